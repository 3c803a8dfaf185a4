"""The training loop, explicit: batches -> features -> row map -> TTT -> AdamW step.

Writes ``metrics.jsonl`` (one row per logged step: loss, per-step kl/acc/accept, tau,
lr, grad norm, tokens/s; and a ``"split": "eval"`` row per evaluation on the held-out
conversations, ``metrics.py``), TensorBoard scalars with ``tensorboard``, and
``loss.png`` (``plot.plot_metrics``) in ``out_dir``.

``eval_holdout`` conversations at the end of the data never train; the training
objective runs on them with no grad every ``eval_every`` steps and at the end, and
their prompts (the tokens before the first supervised one) are saved with the
checkpoint for ``eagle3fn eval``.

fp32 master weights; on CUDA the step computes with bf16 copies (the gradient flows
back to the masters through the cast). Checkpoints hold the masters, the optimizer,
the step, the data position and the RNG state; ``train`` resumes from the latest one
in ``out_dir`` and continues the same loss curve.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from eagle3fn.align import supervised_mask
from eagle3fn.draft import DraftConfig, RopeConfig, init_params
from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.device import default_dtype, resolve_device
from eagle3fn.parallel import (build_layout, chunk_window, collectives, distribute_like, full,
                               full_optimizer_state, gather, init_distributed, load_optimizer_state,
                               reduce_grads, shard, shard_sequence)
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features, Objective
from eagle3fn.train.checkpoint import (CHECKPOINT, check_resume, read_checkpoint, run_fingerprint,
                                       save_checkpoint)
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.metrics import MetricsLog, read_metrics
from eagle3fn.train.plot import plot_metrics
from eagle3fn.train.progress import Progress
from eagle3fn.ttt import Collectives, TTTConfig, gated_counts, ttt

METRICS = "metrics.jsonl"
_PRECISIONS = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


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
    kind = (getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    kind = kind.get("full_attention", kind) if isinstance(kind.get("full_attention"), dict) else kind
    kind = kind.get("rope_type", kind.get("type", "default"))
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


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_ratio`` of the steps, then cosine decay to 0."""
    warmup = max(1, round(total * cfg.warmup_ratio))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclasses.dataclass
class _Source:
    """Where micro-batches come from: a list of items and how to turn one into features."""

    items: list
    load: Callable[[object], tuple[Features, torch.Tensor]]
    describe: Callable[[object], str] = str
    """Names an item in messages (its conversations' file:line, or its cache shard)."""

    def order(self, epoch: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        return torch.randperm(len(self.items), generator=g).tolist()


def _online_source(cfg: TrainConfig, device):
    """The target, and (examples, source) for training and for the held-out tail."""
    from transformers import AutoTokenizer

    from eagle3fn.io.data import collate, tokenize_file
    from eagle3fn.io.target import target_features

    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
    target = _target(cfg, device)
    examples = tokenize_file(cfg.data, tok, max_length=cfg.max_length, on_error=cfg.on_error)
    if cfg.eval_holdout >= len(examples):
        raise ValueError(f"--eval-holdout {cfg.eval_holdout} leaves nothing to train on: {cfg.data} "
                         f"has {len(examples)} usable conversations; hold out fewer")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def load(group):
        b = collate(group, pad)
        f = target_features(target, b["input_ids"].to(device), b["attention_mask"].to(device))
        return f, b["loss_mask"].to(device)

    def source(part):
        return _Source([part[i:i + cfg.batch_size] for i in range(0, len(part), cfg.batch_size)], load,
                       describe=lambda group: "conversations at " + ", ".join(e.source for e in group))
    cut = len(examples) - cfg.eval_holdout
    return target, (examples[:cut], source(examples[:cut])), (examples[cut:], source(examples[cut:]))


def _target(cfg: TrainConfig, device):
    from eagle3fn.io.target import load_target

    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    return load_target(cfg.model, aux_layer_ids=cfg.aux_layer_ids, device=device,
                       dtype=compute_dtype(cfg, device), **kwargs)


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype the target and the draft step run in: ``--precision``, where ``auto`` is
    bf16 on CUDA and fp32 on the CPU."""
    return default_dtype(device) if cfg.precision == "auto" else _PRECISIONS[cfg.precision]


def _offline_source(cfg: TrainConfig, device):
    """(examples, source) for training and for the held-out trailing shards."""
    from eagle3fn.io.cache import FeatureCache
    from eagle3fn.io.data import Example

    # Features in the compute dtype: a bf16 cache trains on the CPU in fp32 (upcast).
    cache = FeatureCache(cfg.cache, device=device, dtype=compute_dtype(cfg, device))

    def load(i, window=None):
        item = cache.read(i, window)
        return item.features, item.loss_mask
    shards = []  # ids and masks only (no features read), for the vocab map and held-out prompts
    for i in range(len(cache)):
        item = cache.read(i, (0, 0))
        f = item.features
        lengths = f.attention_mask.sum(1).tolist()
        shards.append([Example(input_ids=f.input_ids[b, :L].cpu(), loss_mask=item.loss_mask[b, :L].cpu(),
                               source=f"shard {i}") for b, L in enumerate(lengths)])
    # held[n]: conversations in the last n shards (shards are never split).
    held = [0, *itertools.accumulate(len(s) for s in reversed(shards))]
    if cfg.eval_holdout not in held[:-1]:
        raise ValueError(f"--eval-holdout {cfg.eval_holdout}: the trailing shards of {cfg.cache} hold "
                         f"{held[1:-1]} conversations; hold out one of those numbers (or 0)")
    cut = len(shards) - held.index(cfg.eval_holdout)
    flat = lambda part: [e for s in part for e in s]  # noqa: E731
    describe = lambda i: f"shard {cache.names[i]} of the cache {cfg.cache}"  # noqa: E731
    return ((flat(shards[:cut]), _Source(list(range(cut)), load, describe)),
            (flat(shards[cut:]), _Source(list(range(cut, len(shards))), load, describe)))


def _prompt(example) -> list[int]:
    """The tokens before the first supervised one (the chat template's prompt)."""
    return example.input_ids[:int(example.loss_mask.nonzero()[0])].tolist()


@torch.no_grad()
def evaluate_holdout(params: dict[str, torch.Tensor], source: _Source, config: TTTConfig, *,
                     d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
    """The training objective and metrics on held-out batches, with no grad.

    Batches are pooled: ``loss`` and ``kl`` weighted by each batch's ``B*C`` (the
    local_mean divisor), ``acc`` and ``accept`` by each step's rows; ``tau`` is
    ``1 + sum_j prod_{i<=j} acc_i`` of the pooled acc. Returns floats and k-lists.
    """
    k = config.ttt_length
    loss, weight = 0.0, 0
    kl, acc, accept, rows = (torch.zeros(k, dtype=torch.float64) for _ in range(4))
    for item in source.items:
        features, loss_mask = source.load(item)
        rowmap = build_rowmap(supervised_mask(loss_mask, features.attention_mask), k)
        obj = ttt(params, features, rowmap, config, d2t=d2t, t2d=t2d)
        n = torch.tensor([r.numel() for r in rowmap.rows], dtype=torch.float64)
        loss += float(obj.objective) * rowmap.denominator
        kl += obj.kl_loss.double().cpu() * rowmap.denominator
        acc += obj.acc.double().cpu() * n
        accept += obj.accept.double().cpu() * n
        weight, rows = weight + rowmap.denominator, rows + n
    acc, accept = acc / rows.clamp(min=1), accept / rows.clamp(min=1)
    as_list = lambda t: [round(float(x), 6) for x in t]  # noqa: E731
    return {"loss": loss / weight, "kl": as_list(kl / weight), "acc": as_list(acc),
            "accept": as_list(accept), "tau": float(1 + torch.cumprod(acc, 0).sum())}


class _Discard:
    """Metrics sink of the ranks other than 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (a checkpoint tensor) placed like ``param`` (a DTensor shard or not)."""
    if hasattr(param, "device_mesh"):
        return distribute_like(param, full)
    return full


def _metrics_row(step: int, lr: float, grad_norm: float, obj: Objective, tokens_per_s: float,
                 skipped: int) -> dict:
    """One metrics.jsonl row; a non-finite number (a skipped step) is written as null."""
    num = lambda x: round(float(x), 6) if math.isfinite(float(x)) else None  # noqa: E731
    as_list = lambda t: [num(x) for x in t.detach().float()]  # noqa: E731
    return {"step": step, "lr": lr, "loss": num(obj.objective.detach()), "grad_norm": num(grad_norm),
            "kl": as_list(obj.kl_loss), "acc": as_list(obj.acc), "accept": as_list(obj.accept),
            "tau": num(obj.tau.detach()), "tokens_per_s": round(tokens_per_s, 1),
            "nonfinite_skipped": skipped}


def load_run(out_dir: str | os.PathLike) -> dict:
    """A finished (or interrupted) run: ``params`` (trainable, fp32, by name),
    ``draft`` (DraftConfig), ``d2t``/``t2d``, ``config`` (TrainConfig fields),
    ``aux_layer_ids``, ``step`` and ``holdout_prompts`` (token id lists, one per
    held-out conversation; empty without --eval-holdout)."""
    from eagle3fn.io.vocab_io import load_vocab_map

    out = Path(out_dir)
    if not (out / CHECKPOINT).exists():
        raise FileNotFoundError(f"no {CHECKPOINT} in {out}: train first (eagle3fn train --out-dir {out})")
    state = read_checkpoint(out / CHECKPOINT)
    draft = dict(state["draft"])
    draft_cfg = DraftConfig(**{**draft, "rope": RopeConfig(**draft["rope"])})
    d2t, t2d = load_vocab_map(out / "vocab.safetensors", vocab_size=draft_cfg.vocab_size,
                              draft_vocab_size=draft_cfg.draft_vocab_size)
    return {"params": state["params"], "draft": draft_cfg, "d2t": d2t, "t2d": t2d,
            "config": state["config"], "aux_layer_ids": tuple(state["aux_layer_ids"]),
            "step": state["step"], "holdout_prompts": state["holdout_prompts"]}


def initial_params(run: dict, target) -> dict[str, torch.Tensor]:
    """The trainable draft weights a run started from (step 0): ``init_params`` with
    the run's seed, ``target``'s head rows and the run's vocab map, as ``train`` builds
    them (on CPU in fp32; a bf16 CUDA target rounds the copied head)."""
    params = init_params(run["draft"], embed_tokens=target.embed_tokens.float(),
                         target_lm_head=target.lm_head.weight.detach().float(), t2d=run["t2d"],
                         seed=run["config"]["seed"])
    return {n: p.detach() for n, p in params.items() if p.requires_grad}


def _step_starts(pos: int, n: int, dp: int, accum: int) -> list[int]:
    """Order positions of one optimizer step's micro-batches from ``pos`` (``dp`` apart,
    one per data-parallel rank each): up to ``accum`` of them, ending early at the end
    of the epoch. Steps fall every ``accum`` micro-batches of the epoch, so a
    checkpoint's data position is always on a step boundary."""
    starts = [pos]
    while (end := min(starts[-1] + dp, n)) < n and (end // dp) % accum:
        starts.append(end)
    return starts


def _step_objective(objs: list[Objective], *, gated: bool, token_mean: bool) -> Objective:
    """The logged objective of a step of micro-batches. With ``gated`` (the divisors
    were the step's gated rows, ``Collectives.gated``) each micro-batch holds a part of
    ``objective``, ``step_loss``, ``accept`` (and of ``kl`` under token_mean): their sums
    are the step's values. The rest are means over the micro-batches (``kl`` under
    local_mean is then the step's own, SPEC 5); ``acc`` is that mean and ``tau`` its
    simulated acceptance length."""
    if len(objs) == 1:
        return objs[0]
    pool = lambda name: torch.stack([getattr(o, name).detach() for o in objs])  # noqa: E731
    merge = lambda name, summed: pool(name).sum(0) if summed else pool(name).mean(0)  # noqa: E731
    acc = pool("acc").mean(0)
    return Objective(objective=merge("objective", gated), step_loss=merge("step_loss", gated),
                     kl_loss=merge("kl_loss", gated and token_mean), acc=acc,
                     accept=merge("accept", gated), tau=1 + torch.cumprod(acc, 0).sum())


def _check_paths(cfg: TrainConfig) -> None:
    """Every input the run reads exists and looks right, before anything heavy loads."""
    from eagle3fn.io.target import check_model_dir

    check_model_dir(cfg.model, cfg.gguf_file, tokenizer=not cfg.cache)
    for flag, path in (("--data", None if cfg.cache else cfg.data), ("--vocab-map", cfg.vocab_map)):
        if path is None:
            continue
        if not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file; pass an existing file")
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise UsageError(f"{flag} {path} cannot be read ({e.strerror}); fix its permissions") from e
    if cfg.cache and not Path(cfg.cache).is_dir():
        raise FileNotFoundError(f"--cache {cfg.cache}: no such directory; write one with eagle3fn prepare")


def _check_draft_shape(cfg: TrainConfig) -> None:
    """The draft the target's config implies can be built for these flags (its RoPE,
    ``--max-length``), read from config.json alone, before the target loads."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model, **({"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    draft_config_for(config, cfg.draft_vocab_size, text.vocab_size, max_length=cfg.max_length)
    if not cfg.cache and getattr(text, "num_hidden_layers", None):  # a cache brings its own ids
        from eagle3fn.io.target import default_aux_layer_ids, validate_aux_layer_ids

        layers = text.num_hidden_layers
        if cfg.aux_layer_ids is None:
            default_aux_layer_ids(layers)
        else:
            validate_aux_layer_ids(cfg.aux_layer_ids, layers)


def _open_out_dir(out: Path) -> bool:
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


def _nonfinite_flag(flags: torch.Tensor, layout) -> torch.Tensor:
    """Whether any rank saw a non-finite value (a max over ranks; same decision everywhere)."""
    if layout is not None:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return flags


def train(cfg: TrainConfig, *, log: Callable[[str], None] | None = None,
          on_step: Callable[[int], None] | None = None,
          on_grads: Callable[[int, dict[str, torch.Tensor]], None] | None = None) -> dict:
    """Run (or resume) training as configured; returns the last training metrics row.

    ``log`` receives every message, one line each, and a line every ``log_every``
    steps. Default: stdout, where a terminal gets a progress bar redrawn every step
    instead of the per-step lines (``progress.Progress``). ``on_step(step)`` is called
    after each optimizer step and its checkpoint (tests use it to interrupt a run);
    ``on_grads(step, grads)`` receives the whole (gathered) gradients of each optimizer
    step before clipping and the optimizer (tests compare them with a one-process
    oracle; under torchrun every rank must pass it).

    Inputs are checked before anything heavy loads; a step whose loss or gradient norm
    is not finite stops the run (RunError) or, with ``on_nonfinite="skip"``, is dropped
    and counted; a resume with another run fingerprint stops, listing the differences.
    A run that fails before its first checkpoint leaves no out_dir it created behind.
    """
    live = log is None and sys.stdout.isatty()
    log = log or print
    if cfg.embedded_default:
        from eagle3fn.demo import demo_data_path
        from eagle3fn.io.smollm2 import smollm2_path

        cfg = dataclasses.replace(cfg, model=str(smollm2_path(log=log)), data=str(demo_data_path()))
        log(f"embedded default: target {cfg.model}, data {cfg.data}, preset {cfg.preset}")
    device = resolve_device(cfg.device)
    _check_paths(cfg)
    _check_draft_shape(cfg)
    out = Path(cfg.out_dir)
    created = _open_out_dir(out)
    try:
        return _train(cfg, device, out, log, live, on_step, on_grads)
    except BaseException:
        if created and not (out / CHECKPOINT).exists() and not _distributed_worker():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _distributed_worker() -> bool:
    """A rank other than 0 of a distributed run (it never owns the out_dir)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_rank() != 0


def _train(cfg: TrainConfig, device: torch.device, out: Path, log, live, on_step, on_grads) -> dict:
    from transformers import AutoConfig

    from eagle3fn.io.vocab_io import resolve_vocab_map, save_vocab_map

    layout = None
    if "WORLD_SIZE" in os.environ or cfg.parallel.sp > 1:
        init_distributed(device, cfg.parallel.timeout_s)
        layout = build_layout(cfg.parallel, device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_rank() != 0:  # messages, metrics and files: rank 0 only
            log, live = (lambda s: None), False
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    if cfg.cache:  # the target is loaded only for its embedding and head
        from eagle3fn.io.cache import check_cache_for_training

        aux = check_cache_for_training(cfg.cache, model_dir=cfg.model, gguf_file=cfg.gguf_file,
                                       aux_layer_ids=cfg.aux_layer_ids)
        cfg = dataclasses.replace(cfg, aux_layer_ids=tuple(aux))
        target = _target(cfg, device)
        (examples, source), (held, holdout) = _offline_source(cfg, device)
    else:
        target, (examples, source), (held, holdout) = _online_source(cfg, device)
    precision = compute_dtype(cfg, device)
    master = torch.float64 if precision == torch.float64 else torch.float32
    head, embed = target.lm_head.weight.detach(), target.embed_tokens
    V = head.shape[0]
    draft_cfg = draft_config_for(AutoConfig.from_pretrained(cfg.model, **kwargs), cfg.draft_vocab_size, V,
                                 max_length=cfg.max_length)
    d2t, t2d = resolve_vocab_map(cfg.vocab_map, examples, vocab_size=V,
                                 draft_vocab_size=draft_cfg.draft_vocab_size)
    dp = layout.dp if layout else 1
    world = {"dp": dp, "ring": cfg.parallel.ring, "ulysses": cfg.parallel.ulysses}
    fingerprint = run_fingerprint(cfg, device=device, precision=precision, world=world, d2t=d2t, t2d=t2d)
    main = layout is None or torch.distributed.get_rank() == 0
    ckpt = out / CHECKPOINT
    state = read_checkpoint(ckpt) if ckpt.exists() else None
    d2t, t2d = d2t.to(device), t2d.to(device)
    params = init_params(draft_cfg, embed_tokens=embed.to(master), target_lm_head=head.to(master),
                         t2d=t2d, device=device, seed=cfg.seed, dtype=master)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    if state is not None:  # before anything in out_dir is rewritten
        check_resume(ckpt, state, fingerprint, trainable, max_steps=cfg.max_steps, log=log)
    if main:
        save_vocab_map(out / "vocab.safetensors", d2t, t2d)
    if layout:
        trainable = shard(trainable, layout)  # DTensor shards over every rank
    opt = torch.optim.AdamW(trainable.values(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    # One micro-batch = dp consecutive batches of the order, one per data-parallel rank.
    per_epoch = math.ceil(len(source.items) / (dp * cfg.grad_accum))
    total = min(cfg.max_steps or cfg.epochs * per_epoch, cfg.epochs * per_epoch)
    ttt_cfg = TTTConfig(draft=draft_cfg, ttt_length=cfg.ttt_length, trim=cfg.trim_mode, loss=cfg.loss)
    step, epoch, pos, skipped = 0, 0, 0, 0
    if state is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(_like(p, state["params"][n]))
        if layout:
            load_optimizer_state(opt, state["optimizer"])
        else:
            opt.load_state_dict(state["optimizer"])
        step, epoch, pos = state["step"], state["epoch"], state["pos"]
        skipped = state.get("nonfinite_skipped", 0)
        torch.set_rng_state(state["rng"])
        log(f"resumed {ckpt} at step {step} (epoch {epoch}, batch {pos})")
    del state
    metrics = MetricsLog(out, resume_step=step, tensorboard=cfg.tensorboard) if main else _Discard()
    progress = Progress(total, start=step, live=live, log=log)
    log = progress.message
    log(f"draft: H={draft_cfg.hidden_size} heads={draft_cfg.num_heads}/{draft_cfg.num_kv_heads} "
        f"Vd={draft_cfg.draft_vocab_size} k={cfg.ttt_length} trim={cfg.trim_mode}; "
        f"{len(examples)} conversations in {len(source.items)} batches/epoch, {len(held)} held out; "
        f"{total} optimizer steps on {device} ({str(precision).removeprefix('torch.')})")
    holdout_prompts = [_prompt(e) for e in held]
    saved_step = step if ckpt.exists() else None

    def save():
        nonlocal saved_step
        if layout:  # every rank joins the gathers; rank 0 writes (layout-free checkpoint)
            weights, opt_state = full(trainable), full_optimizer_state(opt)
            if not main:
                return
        else:
            weights, opt_state = trainable, opt.state_dict()
        save_checkpoint(ckpt, {"params": {n: p.detach().cpu() for n, p in weights.items()},
                               "optimizer": opt_state, "step": step, "epoch": epoch, "pos": pos,
                               "rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg),
                               "draft": dataclasses.asdict(draft_cfg),
                               "aux_layer_ids": list(target.aux_layer_ids),
                               "holdout_prompts": holdout_prompts, "fingerprint": fingerprint,
                               "nonfinite_skipped": skipped})
        saved_step = step

    whole = {}

    def compute_params():
        nonlocal whole
        current = params
        if layout:
            whole = gather(trainable)
            current = {**params, **whole}
        if precision == master:
            return current
        return {n: p.to(precision) for n, p in current.items()}

    def micro_batch(index):
        """This rank's batch of the order's ``index``-th: features, row map, collectives."""
        item = source.items[order[min(index, len(order) - 1)]]
        windowed = ()
        if layout and layout.sp > 1 and cfg.cache:  # read only this rank's chunk + tail
            windowed = ("aux", "final_hidden")
            features, loss_mask = source.load(item, window=functools.partial(
                chunk_window, sp=layout.sp, sp_rank=layout.sp_rank, ttt_length=cfg.ttt_length))
        else:
            features, loss_mask = source.load(item)
        if index >= len(order):  # a data-parallel rank past the end: zero weight, no rows
            loss_mask = torch.zeros_like(loss_mask)
        supervised = supervised_mask(loss_mask, features.attention_mask)
        if layout is None:
            return item, features, build_rowmap(supervised, cfg.ttt_length), None
        features, supervised, C = shard_sequence(features, supervised, layout.sp, layout.sp_rank,
                                                 cfg.ttt_length, windowed=windowed)
        rowmap = build_rowmap(supervised, cfg.ttt_length, num_rows=C)
        denominator = 0 if index >= len(order) else rowmap.denominator
        return item, features, rowmap, collectives(layout, denominator, device, ttt_cfg.attention)

    last, tokens, t0 = {}, 0, time.perf_counter()
    clip = math.inf if cfg.grad_clip is None else cfg.grad_clip
    # token_mean (and the alpha objective) divide by the gated rows of the whole optimizer
    # step, every micro-batch and rank, as one batch would: counted first from the
    # teacher alone (the step's micro-batches are then held in memory together).
    step_gated = cfg.grad_accum > 1 and (cfg.loss.normalization == "token_mean" or cfg.loss.objective == "alpha")
    rank = layout.dp_rank if layout else 0
    while step < total and epoch < cfg.epochs:
        order = source.order(epoch, cfg.seed)
        while True:
            starts = _step_starts(pos, len(order), dp, cfg.grad_accum)
            batches = (micro_batch(i + rank) for i in starts)
            gated = None
            if step_gated:
                batches = list(batches)
                gated = sum(gated_counts(f, rm, ttt_cfg, t2d) for _, f, rm, _ in batches)
                if layout:
                    torch.distributed.all_reduce(gated)
            items, objs, bad = [], [], torch.zeros((), device=device)
            for item, features, rowmap, coll in batches:
                if gated is not None:
                    coll = (dataclasses.replace(coll, gated=gated) if coll is not None else
                            Collectives(attend=None, reduce_terms=list, denominator=rowmap.denominator,
                                        gated=gated))
                obj = ttt(compute_params(), features, rowmap, ttt_cfg, d2t=d2t, t2d=t2d, collectives=coll)
                # The step's objective: the sum of the micro-batches' parts over the step's
                # gated rows, or the mean of their local means (SPEC 5, as ranks).
                (obj.objective if gated is not None else obj.objective / len(starts)).backward()
                items.append(item)
                objs.append(obj)
                bad = torch.maximum(bad, (~torch.isfinite(obj.objective.detach())).to(bad.dtype))
                if layout:
                    reduce_grads(trainable, whole)
                tokens += int(features.attention_mask[:, :rowmap.num_rows].sum())
            pos = min(starts[-1] + dp, len(order))
            obj = _step_objective(objs, gated=gated is not None,
                                  token_mean=cfg.loss.normalization == "token_mean")
            if on_grads is not None:
                on_grads(step + 1, full({n: p.grad for n, p in trainable.items()}))
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable.values(), clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            # One host sync per step (the loop logs the norm anyway) carries the guard.
            flags = _nonfinite_flag(torch.stack([bad, (~torch.isfinite(grad_norm)).to(bad.dtype)]), layout)
            grad_norm, nonfinite = float(grad_norm), bool(flags.max() > 0)
            lr = lr_at(step, total, cfg)
            if nonfinite:
                where = "; ".join(source.describe(it) for it in items)
                if cfg.on_nonfinite == "error":
                    last_good = (f"{ckpt} (step {saved_step})" if saved_step is not None
                                 else "none written yet")
                    raise RunError(f"step {step + 1}: the loss or gradient norm ({grad_norm}) is not finite on "
                                   f"{where}; nothing of this step was saved, last good checkpoint: "
                                   f"{last_good}. Check those inputs (eagle3fn cache verify for a cache), "
                                   "lower --lr, or pass --on-nonfinite skip to drop such batches")
                skipped += 1
                log(f"step {step + 1}: non-finite loss or gradient norm on {where}; batch skipped "
                    f"({skipped} so far)")
            else:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if pos == len(order):
                epoch, pos = epoch + 1, 0
            logged = step % cfg.log_every == 0 or step == total
            if logged or progress.live:
                counted = float(tokens)
                if layout and logged:  # tokens/s of the whole job (same steps on every rank)
                    counted = torch.tensor(counted, device=device)
                    torch.distributed.all_reduce(counted)
                row = _metrics_row(step, lr, grad_norm, obj, float(counted) / (time.perf_counter() - t0),
                                   skipped)
                if not nonfinite:
                    progress.update(step, loss=row["loss"], acc0=row["acc"][0],
                                    tokens_per_s=row["tokens_per_s"])
            if logged:
                metrics.write(row)
                last = row if not nonfinite else last
                if not progress.live and not nonfinite:
                    log(f"step {step}/{total} loss {last['loss']:.4f} acc0 {last['acc'][0]:.3f} "
                        f"tau {last['tau']:.2f} lr {lr:.2e} {last['tokens_per_s']:.0f} tok/s")
            if holdout.items and (step == total or cfg.eval_every and step % cfg.eval_every == 0):
                held_row = {"split": "eval", "step": step,
                            **evaluate_holdout(compute_params(), holdout, ttt_cfg, d2t=d2t, t2d=t2d)}
                metrics.write(held_row)
                log(f"eval step {step}: held-out loss {held_row['loss']:.4f} "
                    f"acc0 {held_row['acc'][0]:.3f} tau {held_row['tau']:.2f} ({len(held)} conversations)")
            if step % cfg.save_every == 0 or step == total:
                save()
            if on_step is not None:
                on_step(step)
            if step >= total or pos == 0:
                break
    progress.close()
    save()
    metrics.close()
    if main and read_metrics(out / METRICS):
        plot_metrics(out / METRICS, out / "loss.png")
    if last:
        skips = f"; {skipped} non-finite batches skipped" if skipped else ""
        log(f"done: {step} steps in {time.perf_counter() - t0:.0f} s; last loss {last['loss']:.4f}, "
            f"acc per step {[round(a, 2) for a in last['acc']]}, simulated tau {last['tau']:.2f}{skips}; "
            f"{out / CHECKPOINT}, {out / METRICS}, {out / 'loss.png'}")
    return last
