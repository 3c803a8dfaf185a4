"""Building a run: check every input before anything heavy loads, then the sources, the
draft, the vocab map, the parameters and optimizer, and the state a checkpoint resumes.

``build_run`` returns a ``Run``: what one optimizer step (``train.step``), the held-out
evaluation and the checkpoint need. The draft keeps fp32 master weights (fp64 with
``precision="float64"``); the step computes with copies in the compute dtype (bf16 on
CUDA), so gradients flow back to the masters through the cast.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from eagle3fn.draft import DraftConfig, RopeConfig, init_params
from eagle3fn.errors import UsageError
from eagle3fn.parallel import (Layout, build_layout, distribute_like, full, full_optimizer_state, gather,
                               init_distributed, is_main, load_optimizer_state, shard)
from eagle3fn.train.checkpoint import CHECKPOINT, check_resume, read_checkpoint, run_fingerprint, save_checkpoint
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.sources import Source, offline_source, offline_target, online_source, prompt_of
from eagle3fn.unrolled import TTTConfig


def draft_config_for(model_config, draft_vocab_size: int, vocab_size: int,
                     max_length: int | None = None) -> DraftConfig:
    """The draft's shape from the target's (text) config: one target-shaped layer, its
    RoPE as transformers builds the target's (``RopeConfig.from_hf_config``).

    The draft trains with fixed frequencies: a ``longrope`` target whose batches may
    pass ``original_max_position_embeddings``, or a ``dynamic`` one past
    ``max_position_embeddings``, switches frequencies per batch in transformers and the
    serving engines, so ``max_length`` beyond those is a UsageError."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    rope = RopeConfig.from_hf_config(text)
    kind = _rope_scaling(text).get("rope_type", _rope_scaling(text).get("type", "default"))
    limit = {"longrope": rope.original_max_position_embeddings,
             "dynamic": getattr(text, "max_position_embeddings", None)}.get(kind)
    if max_length is not None and limit is not None and max_length > limit:
        raise UsageError(f"--max-length {max_length}: the target's {kind} RoPE changes its frequencies past "
                         f"{limit} tokens, which a draft trained with fixed ones cannot follow; pass "
                         f"--max-length {limit} or less")
    return DraftConfig(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=vocab_size,
        draft_vocab_size=min(draft_vocab_size, vocab_size),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope=rope,
    )




def _rope_scaling(text) -> dict:
    """The text config's RoPE scaling dict (``rope_parameters`` in transformers 5,
    ``rope_scaling`` before; the ``full_attention`` entry of a per-layer-type dict),
    empty without one."""
    scaling = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return scaling.get("full_attention", scaling) if isinstance(scaling.get("full_attention"), dict) else scaling


_EXTENDING = ("linear", "yarn", "llama3")
"""RoPE scalings with fixed frequencies that stretch the trained range to ``factor x
original_max_position_embeddings``."""


def target_positions(text) -> tuple[int | None, str]:
    """The positions a target (text config) is meant for and how that was decided:
    ``max_position_embeddings``, or for a ``_EXTENDING`` RoPE scaling the larger of it
    and ``factor x original_max_position_embeddings`` (the original defaulting to
    ``max_position_embeddings``); ``(None, ...)`` when the config names none."""
    positions = getattr(text, "max_position_embeddings", None)
    scaling = _rope_scaling(text)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if positions is None:
        return None, "the target's config names no max_position_embeddings"
    why = f"max_position_embeddings {positions}"
    if kind in _EXTENDING and scaling.get("factor"):
        original = scaling.get("original_max_position_embeddings") or positions
        stretched = int(float(scaling["factor"]) * original)
        if stretched > positions:
            return stretched, f"its {kind} RoPE scaling: factor {scaling['factor']} x {original}"
        return positions, f"{why}, which its {kind} RoPE scaling does not extend"
    return positions, why + ("" if kind == "default" else f" (its {kind} RoPE scaling does not extend it)")


def check_paths(cfg: TrainConfig) -> None:
    """Every input the run reads exists and looks right, before anything heavy loads."""
    from eagle3fn.io.model_dir import check_model_dir
    from eagle3fn.io.paths import need_dir, need_file

    check_model_dir(cfg.model, cfg.gguf_file, tokenizer=not cfg.cache)
    fixes = {"--data": "pass the chat JSONL file", "--vocab-map": "pass the file eagle3fn vocab wrote"}
    for flag, path in (("--data", None if cfg.cache else cfg.data), ("--vocab-map", cfg.vocab_map)):
        if path is None:
            continue
        need_file(path, flag, fixes[flag])
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise UsageError(f"{flag} {path} cannot be read ({e.strerror}); fix its permissions") from e
    if cfg.cache:
        need_dir(cfg.cache, "--cache", "pass the directory eagle3fn prepare wrote")


def check_draft_shape(cfg: TrainConfig) -> None:
    """The draft the target's config implies can be built for these flags (its RoPE,
    ``--max-length`` within the target's positions unless ``--allow-long``:
    ``target_positions``), read from config.json alone, before the target loads."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model, **({"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    draft_config_for(config, cfg.draft_vocab_size, text.vocab_size, max_length=cfg.max_length)
    positions, why = target_positions(text)
    if positions is not None and cfg.max_length > positions and not cfg.allow_long:
        raise UsageError(f"--max-length {cfg.max_length} is beyond the {positions} positions of the target "
                         f"{cfg.model} ({why}): its features past them come from positions it was never "
                         f"trained at; pass --max-length {positions} or less, or --allow-long to train there anyway")
    if not cfg.cache and getattr(text, "num_hidden_layers", None):  # a cache brings its own ids
        from eagle3fn.io.target import default_aux_layer_ids, validate_aux_layer_ids

        layers = text.num_hidden_layers
        if cfg.aux_layer_ids is None:
            default_aux_layer_ids(layers)
        else:
            validate_aux_layer_ids(cfg.aux_layer_ids, layers)


def check_inputs(cfg: TrainConfig, device: torch.device, log: Callable[[str], None]) -> None:
    """Every input checked before anything heavy loads: the paths (``check_paths``), the
    draft's shape and --max-length against the target's config (``check_draft_shape``),
    and with ``memory_check`` the step's estimated peak memory against the device's free
    memory (``preflight.check_memory``, from the target's config.json). ``--data``
    beside ``--cache`` (the command line refuses it: ``TrainConfig.refuse_ignored_flags``)
    is logged as not read."""
    check_paths(cfg)
    check_draft_shape(cfg)
    if cfg.cache and cfg.data:
        log(f"note: --data {cfg.data} is not read: offline training reads the features from --cache {cfg.cache}")
    if cfg.memory_check:
        from transformers import AutoConfig

        from eagle3fn.train.preflight import check_memory

        kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        check_memory(cfg, AutoConfig.from_pretrained(cfg.model, **kwargs), device, cfg.compute_dtype(device))


def open_out_dir(out: Path) -> bool:
    """Create ``out`` (and parents) and prove it writable; True when this call created it
    (a run that fails before its first checkpoint removes it again)."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".eagle3fn-write-test-")  # one per rank
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"--out-dir {out} is not a writable directory ({e.strerror}); pass another "
                         "--out-dir") from e
    return created




@dataclasses.dataclass(eq=False)
class Run:
    """One training run, built and (when resuming) restored: what the step, the
    evaluation and the checkpoint read and update.

    Fields (``B*C`` etc. as in ``ttt``): ``params`` the draft's whole parameters
    (trainable masters and the frozen embedding), ``trainable`` the trainable ones
    (DTensor shards over every rank under torchrun), ``layout`` the mesh or None,
    ``total`` the optimizer steps, ``step, epoch, pos`` where the data order stands,
    ``skipped`` the non-finite batches dropped so far, ``saved_step`` the step of the
    checkpoint in ``out`` (None: none yet), ``record`` the settings (``cfg`` as a dict)
    every checkpoint records."""

    cfg: TrainConfig
    device: torch.device
    precision: torch.dtype
    layout: Layout | None
    out: Path
    target: object
    examples: list
    source: Source
    held: list
    holdout: Source
    draft_cfg: DraftConfig
    ttt_cfg: TTTConfig
    d2t: torch.Tensor
    t2d: torch.Tensor
    params: dict[str, torch.Tensor]
    trainable: dict[str, torch.Tensor]
    opt: torch.optim.Optimizer
    total: int
    fingerprint: dict
    record: dict
    step: int = 0
    epoch: int = 0
    pos: int = 0
    skipped: int = 0
    saved_step: int | None = None
    whole: dict = dataclasses.field(default_factory=dict)
    step_graph: object = None
    """``onegraph.StepGraph`` with ``--compile-step``, else None (the eager step)."""

    @property
    def dp(self) -> int:
        """Data-parallel degree (1 without torchrun)."""
        return self.layout.dp if self.layout else 1

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT

    def compute_params(self) -> dict[str, torch.Tensor]:
        """The draft's parameters for one forward: gathered from the shards under
        torchrun (kept in ``whole`` for ``reduce_grads``), cast to the compute dtype
        (``Tensor.to`` returns the tensor itself where it already has that dtype)."""
        current = self.params
        if self.layout:
            self.whole = gather(self.trainable)
            current = {**self.params, **self.whole}
        return {n: p.to(self.precision) for n, p in current.items()}

    def save(self, path: Path | None = None, **extra) -> None:
        """Write the checkpoint (every rank joins the gathers; rank 0 writes a
        layout-free file); to ``path`` with ``extra`` fields instead (checkpoint-best.pt)."""
        if self.layout:
            weights, opt_state = full(self.trainable), full_optimizer_state(self.opt)
            if not is_main():
                return
        else:
            weights, opt_state = self.trainable, self.opt.state_dict()
        save_checkpoint(path or self.checkpoint, {
            "params": {n: p.detach().cpu() for n, p in weights.items()}, "optimizer": opt_state,
            "step": self.step, "epoch": self.epoch, "pos": self.pos, "rng": torch.get_rng_state(),
            "config": self.record, "draft": dataclasses.asdict(self.draft_cfg),
            "aux_layer_ids": list(self.target.aux_layer_ids),
            "holdout_prompts": [prompt_of(e) for e in self.held], "fingerprint": self.fingerprint,
            "nonfinite_skipped": self.skipped, **extra})
        if path is None:
            self.saved_step = self.step


def _parallel(cfg: TrainConfig, device: torch.device) -> tuple[Layout | None, torch.device]:
    """The mesh under torchrun (or with sequence parallelism), and this rank's device."""
    if "WORLD_SIZE" not in os.environ and cfg.parallel.sp == 1:
        return None, device
    init_distributed(device, cfg.parallel.timeout_s)
    layout = build_layout(cfg.parallel, device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return layout, device


def ttt_options(cfg: TrainConfig) -> dict:
    """The run's ``TTTConfig`` keyword arguments but the draft's: ``--ttt-length``,
    ``--trim``, ``--loss.*`` and the ``--ttt.*`` options."""
    return dict(ttt_length=cfg.ttt_length, trim=cfg.trim_mode, loss=cfg.loss, **cfg.ttt.config_fields())


def frozen_in_compute_dtype(params: dict[str, torch.Tensor], precision: torch.dtype) -> dict[str, torch.Tensor]:
    """``params`` with the frozen ones (no grad: the embedding ``[V, H]``) cast to the
    compute dtype: they need no master copy, and ``Run.compute_params`` then passes them
    as they are instead of casting them at every step (bf16 on CUDA: the same values,
    half the memory of an fp32 copy, no ``[V, H]`` cast per step)."""
    return {n: p if p.requires_grad else p.to(precision) for n, p in params.items()}


def build_run(cfg: TrainConfig, device: torch.device, out: Path,
              log: Callable[[str], None]) -> Run:
    """Sources, draft, vocab map, parameters, optimizer, and the checkpoint's state when
    ``out`` holds one (its run fingerprint checked before anything in ``out`` is
    rewritten). ``cfg`` has passed ``check_inputs``. The settings the build itself uses
    are read first, in one place; the sources and the fingerprint then read theirs."""
    from transformers import AutoConfig

    from eagle3fn.io.vocab_io import resolve_vocab_map, save_vocab_map

    layout, device = _parallel(cfg, device)
    if cfg.compile_step and layout is not None:
        raise UsageError("--compile-step runs on one process: drop --compile-step under torchrun")
    if not is_main():  # messages: rank 0 only
        log = lambda s: None  # noqa: E731
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    model_config = AutoConfig.from_pretrained(cfg.model, **kwargs)
    precision = cfg.compute_dtype(device)
    master = torch.float64 if precision == torch.float64 else torch.float32
    if cfg.cache:  # the aux layer ids are the cache's
        from eagle3fn.io.cache import check_cache_for_training

        aux = check_cache_for_training(cfg.cache, model_dir=cfg.model, gguf_file=cfg.gguf_file,
                                       aux_layer_ids=cfg.aux_layer_ids)
        cfg = dataclasses.replace(cfg, aux_layer_ids=tuple(aux))
    offline, vocab_map, seed = bool(cfg.cache), cfg.vocab_map, cfg.seed
    draft_vocab_size, max_length = cfg.draft_vocab_size, cfg.max_length
    world = {"dp": layout.dp if layout else 1, "ring": cfg.parallel.ring, "ulysses": cfg.parallel.ulysses}
    adamw = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": cfg.weight_decay}
    accum, epochs, max_steps = cfg.grad_accum, cfg.epochs, cfg.max_steps
    ttt = ttt_options(cfg)
    record = dataclasses.asdict(cfg)  # the settings every checkpoint records
    if offline:  # the target's embedding and head, or the whole target to decode with it
        target = offline_target(cfg, device, log)
        (examples, source), (held, holdout) = offline_source(cfg, device)
    else:
        target, (examples, source), (held, holdout) = online_source(cfg, device)
    head, embed = target.head_weight, target.embed_tokens
    draft_cfg = draft_config_for(model_config, draft_vocab_size, head.shape[0], max_length=max_length)
    d2t, t2d = resolve_vocab_map(vocab_map, examples, vocab_size=head.shape[0],
                                 draft_vocab_size=draft_cfg.draft_vocab_size)
    fingerprint = run_fingerprint(cfg, device=device, precision=precision, world=world, d2t=d2t, t2d=t2d)
    ckpt = out / CHECKPOINT
    state = read_checkpoint(ckpt) if ckpt.exists() else None
    d2t, t2d = d2t.to(device), t2d.to(device)
    params = frozen_in_compute_dtype(init_params(draft_cfg, embed_tokens=embed.to(master),
                                                 target_lm_head=head.to(master), t2d=t2d, device=device,
                                                 seed=seed, dtype=master), precision)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    if state is not None:
        check_resume(ckpt, state, fingerprint, trainable, max_steps=max_steps, log=log)
    if is_main():
        save_vocab_map(out / "vocab.safetensors", d2t, t2d)
    if layout:
        trainable = shard(trainable, layout)
    # One fused kernel per parameter group on one GPU (the foreach path launches a few
    # hundred per step); sharded parameters keep the foreach path.
    fused = device.type == "cuda" and not layout
    opt = torch.optim.AdamW(trainable.values(), **adamw, fused=fused or None)
    # One micro-batch = dp consecutive batches of the order, one per data-parallel rank.
    per_epoch = math.ceil(len(source.items) / (world["dp"] * accum))
    total = min(max_steps or epochs * per_epoch, epochs * per_epoch)
    run = Run(cfg=cfg, device=device, precision=precision, layout=layout, out=out, target=target,
              examples=examples, source=source, held=held, holdout=holdout, draft_cfg=draft_cfg,
              ttt_cfg=TTTConfig(draft=draft_cfg, **ttt), d2t=d2t, t2d=t2d, params=params, trainable=trainable,
              opt=opt, total=total, fingerprint=fingerprint, record=record)
    if cfg.compile_step:
        from eagle3fn.train.onegraph import StepGraph

        run.step_graph = StepGraph(run)
    if state is not None:
        _restore(run, state)
        log(f"resumed {run.checkpoint} at step {run.step} (epoch {run.epoch}, batch {run.pos})")
    return run


def _restore(run: Run, state: dict) -> None:
    """Weights, optimizer, data position, skip count and RNG from a checkpoint's state."""
    with torch.no_grad():
        for n, p in run.trainable.items():
            full_tensor = state["params"][n]
            p.copy_(distribute_like(p, full_tensor) if hasattr(p, "device_mesh") else full_tensor)
    if run.layout:
        load_optimizer_state(run.opt, state["optimizer"])
    else:
        run.opt.load_state_dict(state["optimizer"])
    run.step, run.epoch, run.pos = state["step"], state["epoch"], state["pos"]
    run.skipped, run.saved_step = state.get("nonfinite_skipped", 0), state["step"]
    torch.set_rng_state(state["rng"])
