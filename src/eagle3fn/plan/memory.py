"""Memory of one step on one rank: the components, and the bytes at each moment a step
can peak (``Memory.phases``): while the teacher table is built, in the last layer
step and the last head of the forward, in the heads' backward (recorded last, they
run first) and in the layer's backward of each step.

Legend: B batch, C own rows per sample, R = B*C rows of a rank, Lp packed key
length, Qp packed query rows, k TTT length, H draft hidden, I MLP width, h heads, g
kv heads, d head dim, V target vocab, Vd draft vocab, b bytes per compute-dtype
element, n_j loss rows of step j, m_j layer rows of step j.

``fused``: ``TTTConfig.compile_elementwise`` (the CUDA path); ``query_buckets``:
``TTTConfig.query_buckets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3fn.plan.args import PlanArgs, attention_kind
from eagle3fn.plan.rows import Rows
from eagle3fn.plan.saved import (backbone_saved, head_saved, inputs_bytes, packed_len,
                                 query_len, swiglu_saved, teacher_bytes)
from eagle3fn.unrolled import fused_head_chunk

# ---- GPU constants: calibrated on one GPU at 8B draft shapes against the measured
# ``max_memory_allocated`` of a step (docs/tutorials/plan.md has the validation table).
# Recalibrate them when torch, the kernels or the GPU change. ------

ALLOCATOR_OVERHEAD_BYTES = 64 * 2**20
"""Bytes the CUDA caching allocator holds beyond the tensors modelled here: cuBLAS /
cuBLASLt workspaces (allocated through the caching allocator and kept after the
first GEMM) and the 512-byte rounding of blocks: what a GPU holds above parameters +
features before a step (docs/tutorials/plan.md), rounded up."""

FLEX_BACKWARD_WORKSPACE = 1.0
"""FlexAttention backward working memory, as a multiple of ``dq``, the output
gradient's copy (``[1, h, Qp, d]`` each) and ``dk + dv`` (two ``[1, g, Lp, d]``). Not
yet calibrated: the measured steps peaked in the forward or in the heads' backward,
never inside an attention backward."""


@dataclass(frozen=True)
class Memory:
    """Bytes of one rank at its peak, by component.

    Fields:
        parameters: every draft parameter in the compute dtype, plus the frozen
            embedding's fp32 copy with ``optimizer``.
        gradients: trainable parameters' gradients (compute dtype; fp32 and sharded over
            ``world`` with ``optimizer``).
        optimizer_state: fp32 masters and AdamW m, v of the trainable parameters over
            ``world`` (0 without ``optimizer``).
        inputs: features (ids, masks, aux, final hidden, target head), vocab maps and
            row-map indices.
        teacher_table: the compact table: draft-vocab logits ``[U, Vd]`` in the compute
            dtype, two fp32 log-sum-exps, tokens, gates.
        teacher_transient: extra bytes while the table is streamed from the final
            hidden (gathered hidden, fp32 vocab blocks and their draft columns).
        saved_per_step: ``[k]``, what the backbone (fc, layer, attention) keeps for
            backward at each step.
        attention_saved: ``[k]``, the attention's share of ``saved_per_step``.
        head_saved_per_step: ``[k]``, what the head and loss keep for backward.
        saved_total: everything kept for backward (the two lists summed).
        attention_transient: attention backward working memory at the largest step.
        head_transient: the head/loss working memory (a chunk's logits and gradient, or
            the unfused head's logits gradient).
        largest_transient: the largest bytes live on top of the saved tensors at the
            phase that peaks (forward values still held, gradients in flight,
            workspaces).
        phases: bytes at each moment a step can peak: ``teacher`` (table being
            built), ``forward_backbone`` (last layer step), ``forward_head`` (last
            head), ``head_backward_j`` (the heads run first in backward, k-1 down to
            0) and ``backward_j`` (the layer's backward of step j).
        peak_phase: the phase that peaks.
        peak: the predicted ``max_memory_allocated`` of the step.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    teacher_table: int
    teacher_transient: int
    saved_per_step: tuple[int, ...]
    attention_saved: tuple[int, ...]
    head_saved_per_step: tuple[int, ...]
    saved_total: int
    attention_transient: int
    head_transient: int
    largest_transient: int
    phases: dict[str, int] = field(hash=False)
    peak_phase: str
    peak: int


@dataclass(frozen=True)
class _Held:
    """What the phases of one step share (bytes, ``_held``).

    Fields:
        parameters, gradients, optimizer_state, inputs, table, teacher_extra: as the
            ``Memory`` fields of those names (``teacher_transient`` for the last).
        saved, attn, head: per step, the backbone's saved tensors, their attention
            share and the head's (``saved.backbone_saved``, ``saved.head_saved``).
        resident: what lives through the whole step: parameters, optimizer state,
            inputs, the allocator's overhead and, with the optimizer, fp32 gradients.
        grad_bytes: bytes per element of a weight gradient held across the backward
            (0 with the optimizer: accumulated into the fp32 ones).
        new_grad: bytes per element of a weight gradient before accumulation.
        lm_grad: lm_head's (and the final norm's) gradient.
        layer_numel: the layer's weights (attention, MLP, norms).
    """

    parameters: float
    gradients: float
    optimizer_state: float
    inputs: float
    table: float
    teacher_extra: float
    saved: list[float]
    attn: list[float]
    head: list[float]
    resident: float
    grad_bytes: int
    new_grad: int
    lm_grad: float
    layer_numel: int


def _param_counts(args: PlanArgs) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the draft."""
    H, I, d, h, g = args.hidden, args.intermediate, args.d, args.heads, args.kv_heads
    embed = args.vocab * H
    trainable = (3 * args.ht * H + 2 * H * (h + 2 * g) * d + h * d * H + 3 * H * I
                 + 4 * H + args.draft_vocab * H)
    return embed + trainable, trainable


def _held(args: PlanArgs, rows: Rows, fused: bool, query_buckets: int) -> _Held:
    """The components of one rank's memory and the saved tensors of each step."""
    b = args.dtype_bytes
    H, I, Vd, h, g, d = (args.hidden, args.intermediate, args.draft_vocab, args.heads,
                         args.kv_heads, args.d)
    total_params, trainable = _param_counts(args)
    parameters = total_params * b + (args.vocab * H * 4 if args.optimizer else 0)
    gradients = trainable * 4 / args.world if args.optimizer else trainable * b
    optimizer_state = trainable * 12 / args.world if args.optimizer else 0
    inputs = inputs_bytes(args, rows)
    table, teacher_extra = teacher_bytes(args, rows.teacher_positions)
    saved, attn = backbone_saved(args, rows, fused, query_buckets)
    head = head_saved(args, rows, fused)
    # fp32 gradients of the masters live across micro-batches; compute-dtype ones
    # appear during the backward (lm_head's first, then the layer's, fc's last)
    resident = parameters + optimizer_state + inputs + ALLOCATOR_OVERHEAD_BYTES
    resident += gradients if args.optimizer else 0
    grad_bytes = 0 if args.optimizer else b
    return _Held(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state,
                 inputs=inputs, table=table, teacher_extra=teacher_extra, saved=saved, attn=attn,
                 head=head, resident=resident, grad_bytes=grad_bytes,
                 new_grad=b + (4 if args.optimizer else 0), lm_grad=(Vd * H + H) * grad_bytes,
                 layer_numel=2 * H * (h + 2 * g) * d + h * d * H + 3 * H * I + 3 * H)


def _forward_phases(args: PlanArgs, rows: Rows, held: _Held, fused: bool) -> dict[str, float]:
    """``forward_backbone`` and ``forward_head``. In the last backbone step the earlier
    outputs, the step-0 keys, each step's own keys and the RoPE temporaries of the
    queries are live beside the saved tensors; in the heads, all k outputs and one
    chunk of logits. (Without backbone trimming, when a norm keeps its input itself
    (fused, or eager in fp32) the outputs are already saved: by the next step's hidden
    norm, and the last one by its head's norm under trim="none".)"""
    b, k, H, Vd = args.dtype_bytes, args.ttt_length, args.hidden, args.draft_vocab
    h, g, d = args.heads, args.kv_heads, args.d
    R, m_rows = rows.kv_rows, rows.layer_rows
    outs = [m * H * b for m in m_rows]
    if (fused or b == 4) and rows.trim != "backbone":
        outs = [0.0] * (k - 1) + [0.0 if rows.trim == "none" else outs[-1]]
    kind = attention_kind(args)
    # k0 is held by the unroll (and v0 by the eager / ring closure), and the last
    # step's stacked own keys and values [k-1, m, g, d] unless a saved tensor holds them
    # (the fused or fp32 merge; index_copy on the trimmed eager / ring path)
    stack_saved = (fused or b == 4) if kind == "flex" else rows.trim == "backbone"
    keys = ((1 if kind == "flex" else 2) * R * g * d * b
            + (0 if stack_saved else 2 * (k - 1) * m_rows[-1] * g * d * b))
    # the query projection and the RoPE result (eager: also x*cos, rotate_half(x)*sin;
    # trimmed eager / ring: or the dense zero-filled queries handed to the attention)
    rope = (2 if fused else 4) * m_rows[-1] * h * d * b
    if rows.trim == "backbone" and kind != "flex":
        rope = max(rope, R * h * d * b)
    base = held.resident + held.table
    phases = {"forward_backbone": base + sum(held.saved) + sum(outs[:-1]) + keys + rope}
    c = min(fused_head_chunk(args.head_chunk_rows, Vd), max(rows.loss_rows)) if rows.trim != "none" else 0
    norm_tmp = 0 if fused else 2 * H * 4  # the eager norm's fp32 temporaries
    head_fwd = c * (Vd * b + norm_tmp + 2 * H * b)
    phases["forward_head"] = base + (sum(held.saved) + sum(held.head)) + sum(outs) + head_fwd
    return phases


def _forward_end(args: PlanArgs, rows: Rows, held: _Held) -> float:
    """Bytes at the end of the forward: the table is held by the fused head's
    checkpoints (the Triton loss of the unfused head keeps only its logits and
    lse_draft)."""
    if rows.trim != "none":
        table_bwd = held.table
    elif args.loss_impl == "triton":
        table_bwd = rows.teacher_positions * (args.draft_vocab * args.dtype_bytes + 4)
    else:
        table_bwd = 0.0
    return held.resident + table_bwd + (sum(held.saved) + sum(held.head))


def _head_backward_phases(args: PlanArgs, rows: Rows, held: _Held, fused: bool,
                          d_out: list[float]) -> tuple[dict[str, float], float]:
    """``head_backward_j``, heads in the order k-1 .. 0 (recorded last, run first),
    and the largest head transient. Each head frees what it saved and leaves its
    output gradient ``d_out[j]``."""
    b, k, H, Vd = args.dtype_bytes, args.ttt_length, args.hidden, args.draft_vocab
    R, n_rows = rows.kv_rows, rows.loss_rows
    chunk = fused_head_chunk(args.head_chunk_rows, Vd)
    fwd_end = _forward_end(args, rows, held)
    phases, done, head_transient = {}, 0.0, 0.0
    for q, j in enumerate(range(k - 1, -1, -1)):
        if rows.trim != "none":
            n = n_rows[j]
            cj = min(chunk, n)
            # the chunk's recomputed logits and their gradient, the recomputed norm
            # (eager: fp32 input, pre-weight and output; fused: output) and its gradient
            norm_bwd = 2 * H * b if fused else H * (4 + 3 * b)
            transient = (Vd * H * held.new_grad + cj * (2 * Vd * b + norm_bwd)
                         + (2 * n * H * b if n > cj else 0))
        else:  # the logits gradient while the logits are held, then lm_head's
            transient = max(R * Vd * b, Vd * H * held.new_grad + R * H * b) if q else R * Vd * b
        head_transient = max(head_transient, transient)
        phases[f"head_backward_{j}"] = fwd_end + done + (held.lm_grad if q else 0) + transient
        done += d_out[j] - held.head[j]
    return phases, head_transient


def _backbone_backward_phases(args: PlanArgs, rows: Rows, held: _Held, fused: bool,
                              query_buckets: int, d_out: list[float]) -> tuple[dict[str, float], float]:
    """``backward_j`` and the largest attention workspace. In the layer's backward of
    step j, steps <= j still hold their saved tensors and output gradients; step j runs
    the SwiGLU backward (two ``[m, I]`` gradients beyond the freed one) and later the
    attention backward (by then the SwiGLU tensors are freed)."""
    b, B, C, k = args.dtype_bytes, args.batch, args.own_rows, args.ttt_length
    H, I, h, g, d = args.hidden, args.intermediate, args.heads, args.kv_heads, args.d
    kind = attention_kind(args)

    def attention_workspace(m):
        if kind == "flex":
            Qp, Lp = query_len(args, m, query_buckets), packed_len(args)
            return FLEX_BACKWARD_WORKSPACE * (2 * Qp * h * d * b + 2 * Lp * g * d * b)
        # score gradients in fp32 beside the saved scores
        return 2 * B * h * C * C * (args.sp if kind == "ring" else 1) * 4

    attention_transient = max(attention_workspace(m) for m in rows.layer_rows)
    phases = {}
    for j in range(k - 1, -1, -1):
        m = rows.layer_rows[j]
        live = held.resident + held.lm_grad + sum(held.saved[: j + 1]) + sum(d_out[: j + 1])
        grads = (H * I * held.grad_bytes if j == k - 1
                 else held.layer_numel * held.grad_bytes + H * I * held.new_grad)
        mlp_bwd = 2 * m * I * b
        attn_bwd = attention_workspace(m) - swiglu_saved(args, m, fused)
        phases[f"backward_{j}"] = live + grads + max(mlp_bwd, attn_bwd)
    return phases, attention_transient


def plan_memory(args: PlanArgs, rows: Rows, fused: bool, query_buckets: int) -> Memory:
    """Bytes by component and at each moment a step can peak (module docstring)."""
    held = _held(args, rows, fused, query_buckets)
    resident, table, saved = held.resident, held.table, held.saved
    saved_total = sum(saved) + sum(held.head)
    phases: dict[str, float] = {"teacher": resident + table + held.teacher_extra}
    phases.update(_forward_phases(args, rows, held, fused))
    d_out = [(m if rows.trim == "backbone" else rows.kv_rows) * args.hidden * args.dtype_bytes
             for m in rows.layer_rows]
    head_phases, head_transient = _head_backward_phases(args, rows, held, fused, d_out)
    phases.update(head_phases)
    back_phases, attention_transient = _backbone_backward_phases(args, rows, held, fused,
                                                                 query_buckets, d_out)
    phases.update(back_phases)

    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    kept = {"teacher": resident + table, "forward_backbone": resident + table + sum(saved),
            "forward_head": resident + table + saved_total}
    if peak_phase.startswith("head_backward"):
        base = _forward_end(args, rows, held)
    elif peak_phase.startswith("backward_"):
        j = int(peak_phase.split("_")[1])
        base = resident + sum(saved[: j + 1])
    else:
        base = kept[peak_phase]
    return Memory(
        parameters=int(held.parameters), gradients=int(held.gradients),
        optimizer_state=int(held.optimizer_state), inputs=int(held.inputs), teacher_table=int(table),
        teacher_transient=int(held.teacher_extra), saved_per_step=tuple(int(x) for x in saved),
        attention_saved=tuple(int(x) for x in held.attn),
        head_saved_per_step=tuple(int(x) for x in held.head), saved_total=int(saved_total),
        attention_transient=int(attention_transient), head_transient=int(head_transient),
        largest_transient=int(peak - base), phases={n: int(v) for n, v in phases.items()},
        peak_phase=peak_phase, peak=int(peak),
    )
