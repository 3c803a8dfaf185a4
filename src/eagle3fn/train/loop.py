"""The training loop, explicit: batches -> features -> row map -> TTT -> AdamW step.

Writes ``metrics.jsonl`` (one row per logged step: loss, per-step kl/acc/accept, tau,
lr, grad norm, tokens/s) and ``loss.png`` (``plot.plot_metrics``) in ``out_dir``.

fp32 master weights; on CUDA the step computes with bf16 copies (the gradient flows
back to the masters through the cast). Checkpoints hold the masters, the optimizer,
the step, the data position and the RNG state; ``train`` resumes from the latest one
in ``out_dir`` and continues the same loss curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

from eagle3fn.align import supervised_mask
from eagle3fn.draft import DraftConfig, RopeConfig, init_params
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features, Objective
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.plot import plot_metrics
from eagle3fn.ttt import TTTConfig, ttt

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# Settings a checkpoint must share with the run resuming it (others, e.g. trim or
# save_every, may change: they do not change the math or the data order).
_RESUME_KEYS = ("model", "data", "cache", "draft_vocab_size", "aux_layer_ids", "max_length",
                "ttt_length", "batch_size", "grad_accum", "seed", "lr", "warmup_ratio", "epochs")


def draft_config_for(model_config, draft_vocab_size: int, vocab_size: int) -> DraftConfig:
    """The draft's shape from the target's (text) config: one target-shaped layer."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else getattr(text, "rope_scaling", None)
    return DraftConfig(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=vocab_size,
        draft_vocab_size=min(draft_vocab_size, vocab_size),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope=RopeConfig.from_hf(theta, scaling),
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

    def order(self, epoch: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        return torch.randperm(len(self.items), generator=g).tolist()


def _online_source(cfg: TrainConfig, device):
    from transformers import AutoTokenizer

    from eagle3fn.io.data import collate, tokenize_file
    from eagle3fn.io.target import target_features

    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
    target = _target(cfg, device)
    examples = tokenize_file(cfg.data, tok, max_length=cfg.max_length, on_error=cfg.on_error)
    groups = [examples[i:i + cfg.batch_size] for i in range(0, len(examples), cfg.batch_size)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def load(group):
        b = collate(group, pad)
        f = target_features(target, b["input_ids"].to(device), b["attention_mask"].to(device))
        return f, b["loss_mask"].to(device)
    return target, examples, _Source(groups, load)


def _target(cfg: TrainConfig, device):
    from eagle3fn.io.target import load_target

    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    return load_target(cfg.model, aux_layer_ids=cfg.aux_layer_ids, device=device,
                       dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, **kwargs)


def _offline_source(cfg: TrainConfig, device):
    from eagle3fn.io.cache import FeatureCache
    from eagle3fn.io.data import Example

    cache = FeatureCache(cfg.cache, device=device)

    def load(i):
        item = cache[i]
        return item.features, item.loss_mask
    examples = []  # ids and masks only, for the vocab map
    for i, item in enumerate(cache):
        f = item.features
        for b in range(f.input_ids.shape[0]):
            L = int(f.attention_mask[b].sum())
            examples.append(Example(input_ids=f.input_ids[b, :L].cpu(),
                                    loss_mask=item.loss_mask[b, :L].cpu(), source=f"shard {i}"))
    return examples, _Source(list(range(len(cache))), load)


def _save(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, cfg: TrainConfig, trainable: dict) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{path} is not a readable eagle3fn checkpoint ({e}); delete it to start over") from e
    if not isinstance(state, dict) or "params" not in state:
        raise ValueError(f"{path} is not an eagle3fn checkpoint; delete it to start over")
    old = state.get("config", {})
    diff = {k: (old.get(k), getattr(cfg, k)) for k in _RESUME_KEYS
            if json.dumps(old.get(k)) != json.dumps(getattr(cfg, k))}
    if diff:
        raise ValueError(f"{path} was written with other settings {diff}; use another --out-dir "
                         "or the same settings")
    for name, p in trainable.items():
        if name not in state["params"] or state["params"][name].shape != p.shape:
            raise ValueError(f"{path}: parameter {name} missing or of another shape; the draft "
                             "configuration changed since this checkpoint")
    return state


def _metrics_row(step: int, lr: float, grad_norm: float, obj: Objective, tokens_per_s: float) -> dict:
    as_list = lambda t: [round(float(x), 6) for x in t.detach().float()]  # noqa: E731
    return {"step": step, "lr": lr, "loss": float(obj.objective.detach()), "grad_norm": grad_norm,
            "kl": as_list(obj.kl_loss), "acc": as_list(obj.acc), "accept": as_list(obj.accept),
            "tau": float(obj.tau.detach()), "tokens_per_s": round(tokens_per_s, 1)}


def load_run(out_dir: str | os.PathLike) -> dict:
    """A finished (or interrupted) run: ``params`` (trainable, fp32, by name),
    ``draft`` (DraftConfig), ``d2t``/``t2d``, ``config`` (TrainConfig fields),
    ``aux_layer_ids`` and ``step``."""
    from eagle3fn.io.vocab_io import load_vocab_map

    out = Path(out_dir)
    if not (out / CHECKPOINT).exists():
        raise FileNotFoundError(f"no {CHECKPOINT} in {out}: train first (eagle3fn train --out-dir {out})")
    state = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=False)
    draft = dict(state["draft"])
    draft_cfg = DraftConfig(**{**draft, "rope": RopeConfig(**draft["rope"])})
    d2t, t2d = load_vocab_map(out / "vocab.safetensors", vocab_size=draft_cfg.vocab_size,
                              draft_vocab_size=draft_cfg.draft_vocab_size)
    return {"params": state["params"], "draft": draft_cfg, "d2t": d2t, "t2d": t2d,
            "config": state["config"], "aux_layer_ids": tuple(state["aux_layer_ids"]),
            "step": state["step"]}


def train(cfg: TrainConfig, *, log: Callable[[str], None] = print,
          on_step: Callable[[int], None] | None = None) -> dict:
    """Run (or resume) training as configured; returns the last metrics row.

    ``on_step(step)`` is called after each optimizer step and its checkpoint (tests use
    it to interrupt a run).
    """
    from transformers import AutoConfig

    from eagle3fn.io.vocab_io import resolve_vocab_map, save_vocab_map

    if cfg.embedded_default:
        from eagle3fn.demo import demo_data_path
        from eagle3fn.io.smollm2 import smollm2_path

        # A CPU-sized demo: fields still at their class defaults get demo values.
        demo = {"draft_vocab_size": 8192, "max_length": 512, "lr": 1e-3, "epochs": 3}
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        cfg = dataclasses.replace(cfg, model=str(smollm2_path(log=log)), data=str(demo_data_path()),
                                  **{k: v for k, v in demo.items() if getattr(cfg, k) == defaults[k]})
        log(f"embedded default: target {cfg.model}, data {cfg.data}, Vd={cfg.draft_vocab_size}")
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if cfg.device == "auto" else cfg.device))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    if cfg.cache:  # the target is loaded only for its embedding and head
        target = _target(cfg, device)
        examples, source = _offline_source(cfg, device)
    else:
        target, examples, source = _online_source(cfg, device)
    head, embed = target.lm_head.weight.detach(), target.embed_tokens
    V = head.shape[0]
    draft_cfg = draft_config_for(AutoConfig.from_pretrained(cfg.model, **kwargs), cfg.draft_vocab_size, V)
    d2t, t2d = resolve_vocab_map(cfg.vocab_map, examples, vocab_size=V,
                                 draft_vocab_size=draft_cfg.draft_vocab_size)
    save_vocab_map(out / "vocab.safetensors", d2t, t2d)
    d2t, t2d = d2t.to(device), t2d.to(device)
    params = init_params(draft_cfg, embed_tokens=embed.float(), target_lm_head=head.float(),
                         t2d=t2d, device=device, seed=cfg.seed)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(source.items) / cfg.grad_accum)
    total = cfg.max_steps or cfg.epochs * per_epoch
    ttt_cfg = TTTConfig(draft=draft_cfg, ttt_length=cfg.ttt_length, trim=cfg.trim_mode, loss=cfg.loss)
    step, epoch, pos = 0, 0, 0
    ckpt = out / CHECKPOINT
    if ckpt.exists():
        state = _load_checkpoint(ckpt, cfg, trainable)
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(state["params"][n])
        opt.load_state_dict(state["optimizer"])
        step, epoch, pos = state["step"], state["epoch"], state["pos"]
        torch.set_rng_state(state["rng"])
        rows = (out / METRICS).read_text().splitlines() if (out / METRICS).exists() else []
        (out / METRICS).write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= step))
        log(f"resumed {ckpt} at step {step} (epoch {epoch}, batch {pos})")
    log(f"draft: H={draft_cfg.hidden_size} heads={draft_cfg.num_heads}/{draft_cfg.num_kv_heads} "
        f"Vd={draft_cfg.draft_vocab_size} k={cfg.ttt_length} trim={cfg.trim_mode}; "
        f"{len(source.items)} batches/epoch, {total} optimizer steps on {device}")

    def save():
        _save(ckpt, {"params": {n: p.detach().cpu() for n, p in trainable.items()},
                     "optimizer": opt.state_dict(), "step": step, "epoch": epoch, "pos": pos,
                     "rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg),
                     "draft": dataclasses.asdict(draft_cfg),
                     "aux_layer_ids": list(target.aux_layer_ids)})

    def compute_params():
        if device.type != "cuda":
            return params
        return {n: p.to(torch.bfloat16) for n, p in params.items()}

    last, tokens, t0 = {}, 0, time.perf_counter()
    while step < total and epoch < cfg.epochs:
        order = source.order(epoch, cfg.seed)
        for i in range(pos, len(order)):
            features, loss_mask = source.load(source.items[order[i]])
            rowmap = build_rowmap(supervised_mask(loss_mask, features.attention_mask), cfg.ttt_length)
            obj = ttt(compute_params(), features, rowmap, ttt_cfg, d2t=d2t, t2d=t2d)
            (obj.objective / cfg.grad_accum).backward()
            tokens += int(features.attention_mask.sum())
            pos = i + 1
            # Optimizer steps fall every grad_accum micro-batches of the epoch (and at its
            # end), so a checkpoint's data position is always on a step boundary.
            if pos % cfg.grad_accum and pos < len(order):
                continue
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable.values(), cfg.grad_clip))
            lr = lr_at(step, total, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if pos == len(order):
                epoch, pos = epoch + 1, 0
            if step % cfg.log_every == 0 or step == total:
                last = _metrics_row(step, lr, grad_norm, obj, tokens / (time.perf_counter() - t0))
                with open(out / METRICS, "a") as f:
                    f.write(json.dumps(last) + "\n")
                log(f"step {step}/{total} loss {last['loss']:.4f} acc0 {last['acc'][0]:.3f} "
                    f"tau {last['tau']:.2f} lr {lr:.2e} {last['tokens_per_s']:.0f} tok/s")
            if step % cfg.save_every == 0 or step == total:
                save()
            if on_step is not None:
                on_step(step)
            if step >= total or pos == 0:
                break
    save()
    if (out / METRICS).exists():
        plot_metrics(out / METRICS, out / "loss.png")
    if last:
        log(f"done: {step} steps in {time.perf_counter() - t0:.0f} s; last loss {last['loss']:.4f}, "
            f"acc per step {[round(a, 2) for a in last['acc']]}, simulated tau {last['tau']:.2f}; "
            f"{out / CHECKPOINT}, {out / METRICS}, {out / 'loss.png'}")
    return last
