"""One optimizer step of a run: its micro-batches -> row maps -> TTT -> gradients,
checked for finiteness, then AdamW; and the metrics row it logs.

A step takes up to ``grad_accum`` micro-batches of the epoch's order, one per
data-parallel rank each (``step_starts``). Under ``local_mean`` its objective is the
mean of the micro-batches' (SPEC 5, as data-parallel ranks); under ``token_mean`` (and
the ``alpha`` objective) every micro-batch divides by the step's gated rows, counted
first from the teacher alone (``gated_counts``), so the step's gradient is that of one
batch holding them all.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch

from eagle3fn.errors import RunError
from eagle3fn.parallel import all_reduce, chunk_window, collectives, full, reduce_grads, shard_sequence
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Objective
from eagle3fn.train.build import Run
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.sources import batch_rowmap, device_supervised
from eagle3fn.unrolled import Collectives, gated_counts, ttt


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step leaves for logging, all on the host: its ``objective``
    (``step_objective``, CPU float64 tensors holding the device's values exactly), the
    gradient norm before clipping, the learning rate, whether it was non-finite (and
    skipped), and the real tokens it read on this rank."""

    objective: Objective
    grad_norm: float
    lr: float
    nonfinite: bool
    tokens: int
    stop: int = 0
    """The signal number of a stop request (``io.stop``) some rank had before this
    step's reduction (the largest over the ranks), 0 for none: every rank sees the same
    value, so all stop after the same step, signalled or not."""


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_ratio`` of the steps, then cosine decay to 0."""
    peak, warmup = cfg.lr, max(1, round(total * cfg.warmup_ratio))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def step_starts(pos: int, n: int, dp: int, accum: int) -> list[int]:
    """Order positions of one optimizer step's micro-batches from ``pos`` (``dp`` apart,
    one per data-parallel rank each): up to ``accum`` of them, ending early at the end
    of the epoch. Steps fall every ``accum`` micro-batches of the epoch, so a
    checkpoint's data position is always on a step boundary."""
    starts = [pos]
    while (end := min(starts[-1] + dp, n)) < n and (end // dp) % accum:
        starts.append(end)
    return starts


def step_objective(objs: list[Objective], *, gated: bool, token_mean: bool) -> Objective:
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


def metrics_row(step: int, lr: float, grad_norm: float, obj: Objective, tokens_per_s: float,
                 skipped: int) -> dict:
    """One metrics.jsonl row; a non-finite number (a skipped step) is written as null."""
    num = lambda x: round(float(x), 6) if math.isfinite(float(x)) else None  # noqa: E731
    as_list = lambda t: [num(x) for x in t.detach().float()]  # noqa: E731
    return {"step": step, "lr": lr, "loss": num(obj.objective.detach()), "grad_norm": num(grad_norm),
            "kl": as_list(obj.kl_loss), "acc": as_list(obj.acc), "accept": as_list(obj.accept),
            "tau": num(obj.tau.detach()), "tokens_per_s": round(tokens_per_s, 1),
            "nonfinite_skipped": skipped}


_LOGGED = tuple(f.name for f in dataclasses.fields(Objective))
"""The ``Objective`` fields a step's metrics row is made from (all of them)."""


def _download(head: torch.Tensor, obj: Objective) -> tuple[list[float], Objective]:
    """The step's one device-to-host copy: ``head`` ``[n]`` as n floats and ``obj``'s
    tensors (0-d and ``[k]``) as CPU float64 tensors of the same shapes (exact for fp32
    and fp64), read in one transfer. Logging then reads host memory: a step's metrics
    row (``metrics_row``, a few dozen numbers) used to wait on the device once per
    number, the first of those waits after the optimizer's update, so the next step's
    host work started on an idle device."""
    parts = [getattr(obj, n).detach().double().reshape(-1) for n in _LOGGED]
    host = torch.cat([head.reshape(-1), *parts]).cpu()
    values, *pieces = host.split([head.numel(), *(p.numel() for p in parts)])
    return values.tolist(), Objective(**{n: piece.reshape(getattr(obj, n).shape)
                                         for n, piece in zip(_LOGGED, pieces)})


def micro_batch(run: Run, order: list[int], index: int):
    """This rank's batch of the order's ``index``-th: ``(item, features, rowmap,
    collectives)``; under sequence parallelism its chunk (from the cache, only its
    window is read), past the end of the order a zero-weight batch."""
    cfg, layout = run.cfg, run.layout
    item = run.source.items[order[min(index, len(order) - 1)]]
    windowed = ()
    if layout and layout.sp > 1 and cfg.cache:
        windowed = ("aux", "final_hidden")
        features, masks = run.source.load(item, window=functools.partial(
            chunk_window, sp=layout.sp, sp_rank=layout.sp_rank, ttt_length=cfg.ttt_length))
    else:
        features, masks = run.source.load(item)
    empty = index >= len(order)  # a data-parallel rank past the end: zero weight, no rows
    if layout is None:
        return item, features, batch_rowmap(features, masks, cfg.ttt_length, empty=empty), None
    supervised = device_supervised(features, masks, empty=empty)
    features, supervised, C = shard_sequence(features, supervised, layout.sp, layout.sp_rank,
                                             cfg.ttt_length, windowed=windowed)
    rowmap = build_rowmap(supervised, cfg.ttt_length, num_rows=C, positions=features.positions)
    denominator = 0 if empty else rowmap.denominator
    return item, features, rowmap, collectives(layout, denominator, run.device, run.ttt_cfg.attention,
                                               kernel_options=run.ttt_cfg.flex_kernel_options,
                                               compile_elementwise=run.ttt_cfg.compile_elementwise)


def _tokens(features, rowmap) -> int:
    """The real tokens of a batch's own rows (from the host twin: no host sync)."""
    return (int(rowmap.host.lengths.sum()) if rowmap.host is not None
            else int(features.attention_mask[:, :rowmap.num_rows].sum()))


def _backward(run: Run, order: list[int], starts: list[int]):
    """Forward and backward of the step's micro-batches: ``(items, objectives,
    non-finite flag on the device, tokens)``; gradients accumulate in ``run.trainable``."""
    cfg = run.cfg
    token_mean = cfg.loss.normalization == "token_mean"
    batches = (micro_batch(run, order, i + (run.layout.dp_rank if run.layout else 0)) for i in starts)
    gated = None
    if cfg.grad_accum > 1 and (token_mean or cfg.loss.objective == "alpha"):
        batches = list(batches)  # the step's micro-batches are held together
        gated = all_reduce(sum(gated_counts(f, rm, run.ttt_cfg, run.t2d) for _, f, rm, _ in batches))
    items, objs, tokens = [], [], 0
    bad = torch.zeros((), device=run.device)
    for item, features, rowmap, coll in batches:
        if gated is not None:
            coll = (dataclasses.replace(coll, gated=gated) if coll is not None else
                    Collectives(attend=None, reduce_terms=list, denominator=rowmap.denominator, gated=gated))
        obj = ttt(run.compute_params(), features, rowmap, run.ttt_cfg, d2t=run.d2t, t2d=run.t2d,
                  collectives=coll)
        (obj.objective if gated is not None else obj.objective / len(starts)).backward()
        items.append(item)
        objs.append(obj)
        bad = torch.maximum(bad, (~torch.isfinite(obj.objective.detach())).to(bad.dtype))
        if run.layout:
            reduce_grads(run.trainable, run.whole)
        tokens += _tokens(features, rowmap)
    objective = step_objective(objs, gated=gated is not None, token_mean=token_mean)
    return items, objective, bad, tokens


def optimizer_step(run: Run, order: list[int], *, log: Callable[[str], None],
                   on_grads: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
                   stop_signal: Callable[[], int] | None = None) -> StepResult:
    """The next optimizer step from ``run.pos`` of ``order``: gradients, the finiteness
    check (riding the step's one device read, which also brings the logged gradient
    norm and metrics, ``_download``; one process with host masks makes no other),
    AdamW; advances ``run.step``, ``run.pos`` / ``run.epoch``. A non-finite step raises RunError naming
    the step, its batches and the last good checkpoint, or with ``on_nonfinite="skip"``
    updates nothing and is counted in ``run.skipped``. ``stop_signal()`` (the signal
    number of this rank's stop request, 0 for none) rides the same all-reduce, so
    ``StepResult.stop`` agrees on every rank."""
    cfg = run.cfg
    starts = step_starts(run.pos, len(order), run.dp, cfg.grad_accum)
    clip = math.inf if cfg.grad_clip is None else cfg.grad_clip
    lr = lr_at(run.step, run.total, cfg)
    if run.step_graph is not None:  # --compile-step: clip and AdamW inside the graph, applied where finite
        if on_grads is not None:
            raise ValueError("on_grads needs the eager step: its gradients never leave the compiled one")
        item, features, rowmap, _ = micro_batch(run, order, starts[0])
        objective, grad_norm, bad = run.step_graph.step(run, features, rowmap, lr, clip, log=log)
        items, tokens = [item], _tokens(features, rowmap)
    else:
        items, objective, bad, tokens = _backward(run, order, starts)
        if on_grads is not None:
            on_grads(run.step + 1, full({n: p.grad for n, p in run.trainable.items()}))
        grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable.values(), clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    run.pos = min(starts[-1] + run.dp, len(order))
    stop = torch.full((), float(stop_signal() if stop_signal is not None else 0), device=bad.device)
    flags = all_reduce(torch.stack([bad, (~torch.isfinite(grad_norm)).to(bad.dtype), stop]), "max")
    (grad_norm, flag, stop), objective = _download(torch.stack([grad_norm.double(), flags[:2].max().double(),
                                                                flags[2].double()]), objective)
    nonfinite = flag > 0
    if nonfinite:
        where = "; ".join(run.source.describe(it) for it in items)
        if cfg.on_nonfinite == "error":
            last_good = (f"{run.checkpoint} (step {run.saved_step})" if run.saved_step is not None
                         else "none written yet")
            raise RunError(f"step {run.step + 1}: the loss or gradient norm ({grad_norm}) is not finite on "
                           f"{where}; nothing of this step was saved, last good checkpoint: {last_good}. "
                           "Check those inputs (eagle3fn cache verify for a cache), lower --lr, or pass "
                           "--on-nonfinite skip to drop such batches")
        run.skipped += 1
        log(f"step {run.step + 1}: non-finite loss or gradient norm on {where}; batch skipped "
            f"({run.skipped} so far)")
    else:
        for group in run.opt.param_groups:
            group["lr"] = lr
        if run.step_graph is None:
            run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    if run.pos == len(order):
        run.epoch, run.pos = run.epoch + 1, 0
    return StepResult(objective, grad_norm, lr, nonfinite, tokens, stop=int(stop))
