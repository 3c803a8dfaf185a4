"""The training step as one compiled graph (``--compile-step``): the teacher, the k
unrolled steps, the loss, the gradients, the clip and the AdamW update of one
micro-batch traced by dynamo into a single graph per batch shape, so the steady step
runs a handful of host operations instead of every op of the forward, the backward and
the optimizer.

Legend: B batch rows, T buffer length, k TTT length, U teacher positions, n_j rows of
step j, N the one row count every step's rows are padded to (the trimmed loss path),
c_j the rows step j's layer computes (the backbone trim).

What stays on the host: the row map and the steps' index maths (``prepare_batch``),
and the padding of every step's rows to one row count ``N`` (``bucketed``). What is traced: the
teacher table (``batch_teacher``, its vocab chunk bounds passed in), the objective
(``planned_objective``), ``torch.autograd.grad`` of it (dynamo's
``trace_autograd_ops``), the global-norm clip and AdamW on the run's optimizer state,
applied only when the loss and the gradient norm are finite (``torch.where``, no host
read). The state stays in ``run.opt`` under AdamW's own names, so a checkpoint resumes
with either path.

Why one graph with ``autograd.grad`` inside, and not ``torch.func.grad_and_value``:
the fused head wraps its chunks in ``torch.utils.checkpoint``, which functorch's
transforms refuse (saved-tensor hooks), and FlexAttention has no functorch rule;
``autograd.grad`` traced by dynamo takes both (the checkpoint's recomputation is then
AOTAutograd's to do or not: ``REMAT``). The Triton soft cross-entropy enters the graph
as two ``torch.library`` custom ops (``kernels.soft_ce``), opaque to dynamo. The
learning rate is a 0-d tensor input, so the schedule recompiles nothing.

Bounded shapes: packed rows give fixed ``[B, T]`` inputs; under ``trim="loss"`` the
teacher positions and every step's rows are padded to one count ``N``, padding rows
masked out of every sum (exact). With ``DYNAMIC_ROWS`` (the default) ``N`` is a symbolic
size of one graph per batch shape, so a cold run compiles once, and it is the teacher
count itself (``N = max(U, 2)``: no rows computed for nothing); without it, ``N =
bucket_size(U, B*T)``, one of ``ROW_BUCKETS`` sizes, one static graph each (the full
path, ``trim="none"``, has one graph either way). Under ``trim="backbone"`` (needs
``DYNAMIC_ROWS``) nothing is padded: every row list of the plan (the computed rows
``c_j``, ``within``, ``at``, the loss rows) and the packed attention layouts' query
windows and block tables are symbolic (``_symbolic_backbone``); ``trim="auto"`` compiles
one graph for each path it takes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from eagle3fn.compiled import compile_backend, compiler, configure_dynamo
from eagle3fn.shapes import Objective, RowMap
from eagle3fn.teacher import vocab_chunk_bounds
from eagle3fn.unrolled import batch_teacher, planned_objective, prepare_batch
from eagle3fn.unrolled.blocks import PackedLayout
from eagle3fn.unrolled.layout import StepPlan

ROW_BUCKETS = 8
"""Without ``DYNAMIC_ROWS``, the row counts a compiled step pads to: multiples of
``ceil(B*T / ROW_BUCKETS)``, each padding at most ``B*T / ROW_BUCKETS`` rows (at most
this many graphs per batch shape)."""

MIN_ROWS = 2
"""The smallest row count of a symbolic row dimension: dynamo specializes sizes 0 and 1,
so a batch with fewer teacher positions gets padding rows up to this."""

STEP_INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}
"""Inductor options of the compiled step, over ``compiled.INDUCTOR_OPTIONS``: no
mix-order reductions (the fused row and column reductions of an RMSNorm's backward). In
the backbone-trimmed step the TTT steps' RMSNorm backwards reduce over different row
counts (``c_j``), and inductor's check of a fusion candidate there fails on CUDA (torch
2.11: an ``AssertionError`` in ``MixOrderReduction.get_numel_rnumel`` that two fused
reductions have one size). Off, the one graph also stays clear of that fusion's known
silent-gradient bug in torch 2.10-2.13 (pytorch/pytorch#193061: a fused reduction's
output that is a view of a shared gradient buffer is never written). The eager path's
separately compiled chains keep them; the GPU exactness tests (tests/test_gpu.py) check
their gradients against fp32 references."""

DYNAMIC_ROWS = True
"""Whether the compiled step's row count is a symbolic size (one graph for every row
count of a batch shape, rows padded only up to ``MIN_ROWS``: a cold run compiles once; on
CUDA at 8B shapes one graph served a whole run) or fixed per bucket (rows padded up to
one of ``ROW_BUCKETS`` sizes, one graph each). The teacher's and the head's row loops run
in one piece inside the graph for this (``teacher._draft_lse``, ``loss.head_step_terms``)."""

REMAT = False
"""Whether AOTAutograd recomputes the fused head's checkpointed logits in the traced
backward (``remat_using_tags_for_fwd_loss_bwd_graph``). Off: its pass takes one
recomputed region per graph and the k steps' heads are k regions (with the Triton soft
cross-entropy), so the compiled step keeps each chunk's logits for the backward instead
(more memory than the eager step's recomputation)."""


def bucket_size(n: int, limit: int, buckets: int = ROW_BUCKETS) -> int:
    """``n`` rows rounded up to a multiple of ``ceil(limit / buckets)`` (at least one
    unit, at most ``max(n, limit)``): one of ``buckets`` sizes for ``n <= limit``."""
    unit = max(1, -(-limit // buckets))
    return max(n, min(max(1, -(-n // unit)) * unit, limit))


def bucketed(rowmap: RowMap, buckets: int | None = ROW_BUCKETS) -> tuple[RowMap, torch.Tensor]:
    """``rowmap`` (on the host) with the teacher positions and every step's rows and
    table rows padded to ``N = bucket_size(U, B*T, buckets)`` (``buckets=None``: to ``N =
    max(U, MIN_ROWS)``, for a symbolic row count): padding rows read row 0
    and table row 0 (any valid index), padding teachers repeat the first teacher
    position (0 without one). Returns ``(padded row map, counts bool [k, N])``, where
    ``counts[j, i]`` says row i of step j is real; masked out, the padding adds exact
    zeros to every sum (``loss.step_terms``'s ``row_mask_N``)."""
    B, T = rowmap.batch_size, rowmap.buffer_len
    U = rowmap.teacher_positions.numel()
    N = max(U, MIN_ROWS) if buckets is None else bucket_size(U, B * T, buckets)

    def pad(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([x, x.new_full((N - x.numel(),), fill)])

    first = int(rowmap.teacher_positions[0]) if U else 0
    masks = torch.arange(N)[None] < torch.tensor([r.numel() for r in rowmap.rows])[:, None]
    padded = dataclasses.replace(rowmap, teacher_positions=pad(rowmap.teacher_positions, first),
                                 rows=tuple(pad(r, 0) for r in rowmap.rows),
                                 table_rows=tuple(pad(r, 0) for r in rowmap.table_rows), host=None)
    return padded, masks


_OBJECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(Objective))
"""``Objective``'s field names, read once (dynamo cannot read a dataclass's fields)."""


def _adamw_(p, g, m, v, step, lr, *, betas, eps, weight_decay, finite) -> None:
    """AdamW (``torch.optim.AdamW``'s single-tensor maths, bias corrections in the
    parameter's dtype) on ``p`` with gradient ``g``, state ``m, v, step``, where
    ``finite`` (0-d bool) holds; elsewhere everything stays as it was."""
    beta1, beta2 = betas
    t = step + 1
    tp = t.to(p.dtype)
    new_p = p * (1 - lr * weight_decay) if weight_decay else p
    new_m = m.lerp(g, 1 - beta1)
    new_v = v * beta2 + g * g * (1 - beta2)
    step_size = lr / (1 - beta1 ** tp)
    denom = new_v.sqrt() / (1 - beta2 ** tp).sqrt() + eps
    new_p = new_p - step_size * (new_m / denom)
    for x, new in ((p, new_p), (m, new_m), (v, new_v), (step, t)):
        x.copy_(torch.where(finite, new, x))


def _one_step(trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], state: list,
              lr: torch.Tensor, features, rowmap: RowMap, plan, supervised_flat, masks, *, config, precision,
              d2t, t2d, bounds, clip: float, betas, eps: float, weight_decay: float):
    """The traced step: objective, gradients, clip, AdamW (in place on ``trainable`` and
    ``state``, ``(exp_avg, exp_avg_sq, step)`` per parameter, when finite). Returns
    ``(objective fields detached, grad norm 0-d, non-finite flag 0-d float)``."""
    params = {n: p.to(precision) for n, p in {**frozen, **trainable}.items()}
    table = batch_teacher(features, rowmap, config, supervised_flat, t2d=t2d, bounds=bounds)
    row_masks = None if masks is None else list(masks.unbind(0))
    obj = planned_objective(params, features, rowmap, config, plan, supervised_flat, table, d2t=d2t,
                            row_masks=row_masks)
    # Detached before autograd.grad consumes the graph (dynamo refuses to return a
    # tensor whose grad_fn the traced backward used).
    fields = tuple(getattr(obj, name).detach() for name in _OBJECTIVE_FIELDS)
    masters = list(trainable.values())
    grads = torch.autograd.grad(obj.objective, masters)
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        finite = torch.isfinite(obj.objective) & torch.isfinite(norm)
        for p, g, (m, v, step) in zip(masters, grads, state):
            _adamw_(p, g * coef, m, v, step, lr, betas=betas, eps=eps, weight_decay=weight_decay, finite=finite)
    return fields, norm, (~finite).to(norm.dtype)


def _to_device(rowmap: RowMap, masks: torch.Tensor, device: torch.device) -> tuple[RowMap, torch.Tensor]:
    """A padded host row map's teacher positions, rows and table rows, and its row
    masks, on ``device`` (one copy each way, then one tensor per field: views of one
    buffer would sit at offsets that change with the row count), their row dimension marked
    dynamic when ``DYNAMIC_ROWS``; on the CPU as they are, marked likewise."""
    if device.type != "cpu":
        k = rowmap.ttt_length
        flat = torch.stack([rowmap.teacher_positions, *rowmap.rows, *rowmap.table_rows])
        flat = [t.clone() for t in flat.pin_memory().to(device, non_blocking=True).unbind(0)]
        masks = masks.pin_memory().to(device, non_blocking=True)
        rowmap = dataclasses.replace(rowmap, teacher_positions=flat[0], rows=tuple(flat[1:1 + k]),
                                     table_rows=tuple(flat[1 + k:]))
    if DYNAMIC_ROWS:
        for t in (rowmap.teacher_positions, *rowmap.rows, *rowmap.table_rows):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(masks, 1)
    return rowmap, masks


def _symbolic_backbone(rowmap: RowMap, plan: StepPlan) -> tuple[RowMap, StepPlan]:
    """A ``trim="backbone"`` batch's row map and ``StepPlan`` as the one graph takes them:
    every row list (``n_j``, the computed rows ``c_j``, their positions ``within`` and
    ``at``) and the flex layouts' query windows and block tables with their row and block
    counts symbolic (``maybe_mark_dynamic``), each tensor in a storage of its own (views of
    one buffer sit at offsets that change with the batch), the host twin dropped (the
    plan is made)."""
    own = lambda t: t.clone()  # noqa: E731 -- a few dozen small index tensors a step
    rowmap = dataclasses.replace(rowmap, host=None, teacher_positions=own(rowmap.teacher_positions),
                                 rows=tuple(map(own, rowmap.rows)), table_rows=tuple(map(own, rowmap.table_rows)))
    layouts = None if plan.layouts is None else [
        PackedLayout(lay.num_queries, own(lay.start), own(lay.last), tuple(map(own, lay.tables)))
        for lay in plan.layouts]
    plan = dataclasses.replace(plan, computed=tuple(map(own, plan.computed)),
                               within=[None] + [own(w) for w in plan.within[1:]], at=[own(a) for a in plan.at],
                               layouts=layouts)
    dims = [(t, 0) for t in (rowmap.teacher_positions, *rowmap.rows, *rowmap.table_rows, *plan.computed,
                             *plan.within[1:], *plan.at)]
    for lay in layouts or []:
        dims += [(lay.start, 0), (lay.last, 0)] + [(t, d) for t in lay.tables for d in range(2, t.dim())]
    for t, d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)
    return rowmap, plan


class StepGraph:
    """The compiled step of a run (``build`` makes one with ``--compile-step``):
    ``step(run, features, rowmap, lr, clip)`` takes one micro-batch through the
    objective, its gradients, the clip and AdamW in one compiled call, and returns
    ``(objective, grad norm, non-finite flag)`` on the device (the update applied only
    when finite). ``backend``: the dynamo backend (None: the device's, inductor on the
    CPU too)."""

    def __init__(self, run, backend: str | None = None) -> None:
        self.backend = backend or compile_backend(run.device) or "inductor"
        # dynamic=None: the row dimensions ``_to_device`` marks are symbolic, every other size static.
        self.fn = compiler(_one_step, self.backend, dynamic=None if DYNAMIC_ROWS else False,
                           options=STEP_INDUCTOR_OPTIONS)
        self.bounds = vocab_chunk_bounds(run.t2d, run.ttt_cfg.teacher_chunk_size)
        self.shapes: set[tuple] = set()
        """The ``(B, T, trim, N)`` shapes compiled so far (``N``: the bucket's rows; 0
        untrimmed or with ``DYNAMIC_ROWS``, whose row counts are symbolic)."""

    def state(self, run) -> list:
        """``(exp_avg, exp_avg_sq, step)`` of each trainable parameter in ``run.opt``,
        made as AdamW makes them on its first step when missing."""
        out = []
        for p in run.trainable.values():
            s = run.opt.state[p]
            if not s:
                fused = bool(run.opt.param_groups[0].get("fused"))
                s["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append((s["exp_avg"], s["exp_avg_sq"], s["step"]))
        return out

    def step(self, run, features, rowmap: RowMap, lr: float, clip: float,
             log: Callable[[str], None] = lambda s: None):
        """One micro-batch (``Features [B, T, ...]`` and its row map) through the
        compiled step at learning rate ``lr``, gradient norm clipped to ``clip``:
        ``(Objective, grad norm 0-d, non-finite flag 0-d float)`` on the device, the
        parameters and ``run.opt``'s state updated where finite. The first step of each
        new shape compiles it (over a minute at 8B shapes on a cold cache): ``log`` gets a line
        before and one with the seconds after, so a run that stalls there says why."""
        config, plan, supervised_flat = prepare_batch(features, rowmap, run.ttt_cfg)
        masks = None
        if config.trim == "backbone":
            if not DYNAMIC_ROWS:
                raise ValueError("--compile-step with --trim backbone (or auto's choice of it) needs "
                                 "onegraph.DYNAMIC_ROWS; pass --trim loss to use the static graphs")
            rowmap, plan = _symbolic_backbone(rowmap, plan)
        elif config.trim != "none":
            padded, masks = bucketed(rowmap.host.rowmap if rowmap.host is not None else rowmap,
                                     None if DYNAMIC_ROWS else ROW_BUCKETS)
            rowmap, masks = _to_device(padded, masks, features.aux.device)
            plan = dataclasses.replace(plan, at=list(rowmap.rows))
        B, T = rowmap.batch_size, rowmap.buffer_len
        shape = (B, T, config.trim, 0 if masks is None or DYNAMIC_ROWS else masks.shape[1])
        new = shape not in self.shapes
        if new:
            self.shapes.add(shape)
            what = ("untrimmed" if config.trim == "none" else
                    "with its backbone trimmed, for any row counts" if config.trim == "backbone" else
                    "for any trimmed row count" if DYNAMIC_ROWS else
                    f"with {shape[3]} trimmed rows (row bucket {len(self.shapes)}, at most {ROW_BUCKETS} a batch shape)")
            log(f"compile-step: compiling the step for a [{B}, {T}] batch {what}; each compiles once, and a "
                "resume reuses compile-cache.bin")
            t0 = time.perf_counter()
        group = run.opt.param_groups[0]
        frozen = {n: p for n, p in run.params.items() if n not in run.trainable}
        lr_t = torch.tensor(lr, dtype=torch.float64).to(run.device, non_blocking=True)
        configure_dynamo()
        with torch._dynamo.config.patch(trace_autograd_ops=True), torch._functorch.config.patch(
                remat_using_tags_for_fwd_loss_bwd_graph=REMAT):
            fields, norm, bad = self.fn(run.trainable, frozen, self.state(run), lr_t, features, rowmap, plan,
                                        supervised_flat, masks, config=config, precision=run.precision,
                                        d2t=run.d2t, t2d=run.t2d, bounds=self.bounds, clip=clip,
                                        betas=tuple(group["betas"]), eps=group["eps"],
                                        weight_decay=group["weight_decay"])
        if new:
            log(f"compile-step: compiled and ran it in {time.perf_counter() - t0:.1f} s")
        return Objective(*fields), norm, bad
