"""Indexed soft cross-entropy over the draft vocab, streamed in vocab blocks (SPEC 5).

Legend: N rows of one step, U teacher positions, Vd draft vocab, BV vocab block.
Row ``i`` is taught by table row ``t = table_rows[i]``; it is *in rows* when
``row_mask[i]`` (always, without a mask) and *active* when also ``gate[t]``.

The teacher is the compact table of ``shapes.TeacherTable``: its draft-vocab logits
``y = teacher_logits[t]`` (bf16 for a bf16 target) and two fp32 log-sum-exps per row.
Its probabilities are computed in registers, in fp32, where they are used:
``p = exp(y - lse_draft[t])`` (renormalised over the draft vocab) and
``q = exp(y - lse_full[t])`` (over the full target vocab).

One program per row, no ceiling on Vd (the row is never held whole):

- pass 1 streams the logits ``z`` and, on active rows, the teacher row ``p``
  with an online softmax: running max ``m`` (which also yields the argmax, ties to the
  lowest id), ``s = sum exp(z - m)``, the teacher mass ``P = sum p`` and
  ``A = sum p (z - m)``, the last two rescaled as ``m`` grows. Then ``lse = m + log s``
  and ``loss = P log s - A``: two non-negative terms, so no cancellation.
- pass 2, active rows only, needs the final lse: ``accept = sum min(q, exp(z - lse))``.
- backward: ``dz = g (exp(z - lse) P - p)``, one pass from the saved lse and P (``p``
  recomputed from the teacher logits).

Rows outside ``row_mask`` skip both passes. In-rows rows with the gate off run pass 1
over the logits only (argmax for the acc metric) and never read the table. The table
is read by index in the kernels: no ``[N, Vd]`` gather of it is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_V = 4096
"""Vocab block on the GPU (8 warps: 16 fp32 per thread for each streamed row)."""
INTERPRETER_BLOCK_V = 65536
"""Vocab block under ``TRITON_INTERPRET=1``, whose cost is per loop iteration."""
NUM_WARPS = 8
LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _in_rows(row_mask_ptr, row, HAS_ROW_MASK: tl.constexpr):
    if HAS_ROW_MASK:
        in_rows = tl.load(row_mask_ptr + row) != 0
    else:
        in_rows = row >= 0
    return in_rows


@triton.jit
def _block_max(z, cols, V):
    """Block max and its lowest column (V when the block is empty)."""
    z_max = tl.max(z, 0)
    return z_max, tl.min(tl.where(z == z_max, cols, V), 0)


@triton.jit
def to_output(x, dtype: tl.constexpr):
    """fp32 ``x`` in ``dtype``, rounded to nearest even."""
    if dtype == tl.bfloat16:
        # Rounded by hand because the interpreter truncates fp32 -> bf16; the GPU's
        # conversion rounds to nearest even too, so the result is the same there.
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x.to(dtype)


@triton.jit
def _soft_ce_fwd_kernel(
    logits_ptr, teacher_ptr, lse_draft_ptr, lse_full_ptr, gate_ptr, table_rows_ptr,
    row_mask_ptr, target_token_ptr, d2t_ptr,
    loss_ptr, lse_ptr, mass_ptr, argmax_ptr, correct_ptr, accept_ptr,
    V,
    HAS_ROW_MASK: tl.constexpr, HAS_TARGET: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # int64 offsets: U * Vd passes 2**31 at long contexts and large draft vocabs.
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(table_rows_ptr + row)
    in_rows = _in_rows(row_mask_ptr, row, HAS_ROW_MASK)
    active = in_rows & (tl.load(gate_ptr + t) != 0)
    z_row = logits_ptr + row * V
    lanes = tl.arange(0, BLOCK_V)

    m = tl.full((), float("-inf"), tl.float32)
    best = tl.full((), 0, tl.int32)
    s = tl.full((), 0.0, tl.float32)
    mass = tl.full((), 0.0, tl.float32)
    pz = tl.full((), 0.0, tl.float32)  # sum p (z - m)
    y_row = teacher_ptr + t * V
    if active:
        lse_draft = tl.load(lse_draft_ptr + t)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            y = tl.load(y_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp(y - lse_draft)  # 0 on the tail lanes
            z_max, z_arg = _block_max(z, cols, V)
            m_new = tl.maximum(m, z_max)
            best = tl.where(z_max > m, z_arg, best)  # strict: earlier blocks win ties
            # The first block has nothing to rescale (m = -inf, mass = 0: -inf * 0).
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            # where before the product: the tail lanes would give 0 * -inf.
            pz = pz + shift * mass + tl.sum(p * tl.where(inside, z - m_new, 0.0), 0)
            mass = mass + tl.sum(p, 0)
            m = m_new
    elif in_rows:
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            z_max, z_arg = _block_max(z, cols, V)
            best = tl.where(z_max > m, z_arg, best)
            m = tl.maximum(m, z_max)

    log_s = tl.log(tl.where(active, s, 1.0))
    lse = tl.where(active, m + log_s, 0.0)
    accept = tl.full((), 0.0, tl.float32)
    if active:
        lse_full = tl.load(lse_full_ptr + t)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            y = tl.load(y_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            q = tl.exp(y - lse_full)
            accept += tl.sum(tl.minimum(q, tl.exp(z - lse)), 0)

    tl.store(loss_ptr + row, tl.where(active, mass * log_s - pz, 0.0))
    tl.store(lse_ptr + row, lse)
    tl.store(mass_ptr + row, mass)
    tl.store(argmax_ptr + row, best.to(tl.int64))
    tl.store(accept_ptr + row, accept)
    if HAS_TARGET:
        match = best + tl.load(d2t_ptr + best) == tl.load(target_token_ptr + t)
        tl.store(correct_ptr + row, (in_rows & match).to(tl.int8))


@triton.jit
def _soft_ce_bwd_kernel(
    grad_ptr, logits_ptr, teacher_ptr, lse_draft_ptr, gate_ptr, table_rows_ptr, row_mask_ptr,
    lse_ptr, mass_ptr, dlogits_ptr,
    V,
    HAS_ROW_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(table_rows_ptr + row)
    active = _in_rows(row_mask_ptr, row, HAS_ROW_MASK) & (tl.load(gate_ptr + t) != 0)
    z_row = logits_ptr + row * V
    dz_row = dlogits_ptr + row * V
    lanes = tl.arange(0, BLOCK_V)
    if active:
        g = tl.load(grad_ptr + row).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        mass = tl.load(mass_ptr + row)
        lse_draft = tl.load(lse_draft_ptr + t)
        y_row = teacher_ptr + t * V
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
            y = tl.load(y_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp(y - lse_draft)
            dz = g * (tl.exp(z - lse) * mass - p)
            tl.store(dz_row + cols, to_output(dz, dlogits_ptr.dtype.element_ty), mask=inside)
    else:
        zero = tl.zeros([BLOCK_V], dtype=dlogits_ptr.dtype.element_ty)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            tl.store(dz_row + cols, zero, mask=cols < V)


# ---- launchers ---------------------------------------------------------------------

_INTERPRETED = isinstance(_soft_ce_fwd_kernel, InterpretedFunction)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output comes from here (tests poison it with NaN / -1)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_v(V: int, block_v: int | None) -> int:
    if block_v is None:
        block_v = INTERPRETER_BLOCK_V if _INTERPRETED else BLOCK_V
    return min(block_v, triton.next_power_of_2(V))


def _check_table(logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N) -> None:
    N, V = logits_NV.shape
    assert logits_NV.dtype in LOGIT_DTYPES and logits_NV.is_contiguous()
    assert teacher_UV.dtype in LOGIT_DTYPES and teacher_UV.is_contiguous()
    assert teacher_UV.dim() == 2 and teacher_UV.shape[1] == V
    assert lse_draft_U.dtype == torch.float32 and lse_draft_U.shape == teacher_UV.shape[:1]
    assert gate_U.dtype == torch.bool and gate_U.shape == teacher_UV.shape[:1]
    assert table_rows_N.dtype == torch.int64 and table_rows_N.shape == (N,)
    assert table_rows_N.is_contiguous() and gate_U.is_contiguous() and lse_draft_U.is_contiguous()
    if row_mask_N is not None:
        assert row_mask_N.dtype == torch.bool and row_mask_N.shape == (N,)
        assert row_mask_N.is_contiguous()


def soft_ce_fwd(
    logits_NV: torch.Tensor,
    teacher_UV: torch.Tensor,
    lse_draft_U: torch.Tensor,
    lse_full_U: torch.Tensor,
    gate_U: torch.Tensor,
    table_rows_N: torch.Tensor,
    row_mask_N: torch.Tensor | None,
    target_token_U: torch.Tensor | None,
    d2t_V: torch.Tensor | None,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the forward kernel: ``(loss, lse, mass, argmax, correct, accept)``, ``[N]``
    each (fp32, fp32, fp32, int64, int8 or None without a target, fp32)."""
    _check_table(logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N)
    assert lse_full_U.shape == lse_draft_U.shape and lse_full_U.dtype == torch.float32
    assert lse_full_U.is_contiguous()
    assert (target_token_U is None) == (d2t_V is None)
    N, V = logits_NV.shape
    has_target = target_token_U is not None
    if has_target:
        assert target_token_U.dtype == torch.int64 and target_token_U.shape == gate_U.shape
        assert d2t_V.dtype == torch.int64 and d2t_V.shape == (V,)
    device = logits_NV.device
    loss, lse, mass, accept = (_alloc((N,), torch.float32, device) for _ in range(4))
    argmax = _alloc((N,), torch.int64, device)
    correct = _alloc((N,), torch.int8, device) if has_target else None
    if N > 0:
        _soft_ce_fwd_kernel[(N,)](
            logits_NV, teacher_UV, lse_draft_U, lse_full_U, gate_U, table_rows_N, row_mask_N,
            target_token_U, d2t_V,
            loss, lse, mass, argmax, correct, accept,
            V,
            HAS_ROW_MASK=row_mask_N is not None, HAS_TARGET=has_target,
            BLOCK_V=_block_v(V, block_v), num_warps=NUM_WARPS,
        )
    return loss, lse, mass, argmax, correct, accept


def soft_ce_bwd(
    grad_N: torch.Tensor,
    logits_NV: torch.Tensor,
    teacher_UV: torch.Tensor,
    lse_draft_U: torch.Tensor,
    gate_U: torch.Tensor,
    table_rows_N: torch.Tensor,
    row_mask_N: torch.Tensor | None,
    lse_N: torch.Tensor,
    mass_N: torch.Tensor,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """Launch the backward kernel: ``dlogits [N, Vd]`` in the logits' dtype."""
    _check_table(logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N)
    N, V = logits_NV.shape
    assert grad_N.shape == (N,) and grad_N.is_contiguous()
    assert lse_N.shape == mass_N.shape == (N,) and lse_N.dtype == mass_N.dtype == torch.float32
    dlogits = _alloc((N, V), logits_NV.dtype, logits_NV.device)
    if N > 0:
        _soft_ce_bwd_kernel[(N,)](
            grad_N, logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N,
            lse_N, mass_N, dlogits,
            V,
            HAS_ROW_MASK=row_mask_N is not None, BLOCK_V=_block_v(V, block_v),
            num_warps=NUM_WARPS,
        )
    return dlogits


# ---- autograd ----------------------------------------------------------------------
# Forward and backward kernels are each a torch.library custom op with a fake (shapes
# only) implementation, which dynamo keeps as an opaque call inside a compiled graph
# (the compiled training step traces autograd.grad through them); each sits in an
# autograd.Function with setup_context: torch.func transforms hand such a Function's
# forward plain tensors, which Triton needs (it cannot read the wrappers of grad/vjp).
# An op returns no None: ``correct`` without a target is an empty tensor, turned back
# into None in ``indexed_soft_ce``.


@torch.library.custom_op("eagle3fn::soft_ce_fwd", mutates_args=())
def _soft_ce_fwd_op(logits_NV: torch.Tensor, teacher_UV: torch.Tensor, lse_draft_U: torch.Tensor,
                    lse_full_U: torch.Tensor, gate_U: torch.Tensor, table_rows_N: torch.Tensor,
                    row_mask_N: torch.Tensor | None, target_token_U: torch.Tensor | None,
                    d2t_V: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
    loss, lse, mass, argmax, correct, accept = soft_ce_fwd(
        logits_NV, teacher_UV, lse_draft_U, lse_full_U, gate_U, table_rows_N, row_mask_N, target_token_U, d2t_V)
    if correct is None:
        correct = torch.empty(0, dtype=torch.int8, device=logits_NV.device)
    return loss, lse, mass, argmax, correct, accept


@_soft_ce_fwd_op.register_fake
def _(logits_NV, teacher_UV, lse_draft_U, lse_full_U, gate_U, table_rows_N, row_mask_N, target_token_U, d2t_V):
    N = logits_NV.shape[0]
    f32 = lambda: logits_NV.new_empty(N, dtype=torch.float32)  # noqa: E731
    correct = logits_NV.new_empty(N if target_token_U is not None else 0, dtype=torch.int8)
    return f32(), f32(), f32(), logits_NV.new_empty(N, dtype=torch.int64), correct, f32()


@torch.library.custom_op("eagle3fn::soft_ce_bwd", mutates_args=())
def _soft_ce_bwd_op(grad_N: torch.Tensor, logits_NV: torch.Tensor, teacher_UV: torch.Tensor,
                    lse_draft_U: torch.Tensor, gate_U: torch.Tensor, table_rows_N: torch.Tensor,
                    row_mask_N: torch.Tensor | None, lse_N: torch.Tensor, mass_N: torch.Tensor) -> torch.Tensor:
    # grad_N is often an expanded scalar (stride 0) from a sum.
    return soft_ce_bwd(grad_N.contiguous(), logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N,
                       lse_N, mass_N)


@_soft_ce_bwd_op.register_fake
def _(grad_N, logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N, lse_N, mass_N):
    return torch.empty_like(logits_NV)


class _SoftCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(logits_NV, teacher_UV, lse_draft_U, lse_full_U, gate_U, table_rows_N,
                row_mask_N, target_token_U, d2t_V):
        return _soft_ce_fwd_op(logits_NV, teacher_UV, lse_draft_U, lse_full_U, gate_U,
                               table_rows_N, row_mask_N, target_token_U, d2t_V)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits_NV, teacher_UV, lse_draft_U, _, gate_U, table_rows_N, row_mask_N, _, _ = inputs
        _, lse, mass, argmax, correct, accept = output
        ctx.mark_non_differentiable(lse, mass, argmax, correct, accept)
        ctx.save_for_backward(logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N,
                              row_mask_N, lse, mass)

    @staticmethod
    def backward(ctx, grad_loss_N, *_):
        dlogits = _SoftCEBackward.apply(grad_loss_N, *ctx.saved_tensors)
        return (dlogits,) + (None,) * 8


class _SoftCEBackward(torch.autograd.Function):
    @staticmethod
    def forward(grad_N, logits_NV, teacher_UV, lse_draft_U, gate_U, table_rows_N, row_mask_N,
                lse_N, mass_N):
        return _soft_ce_bwd_op(grad_N, logits_NV, teacher_UV, lse_draft_U, gate_U,
                               table_rows_N, row_mask_N, lse_N, mass_N)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "second derivatives of the Triton soft cross-entropy are not implemented; "
            "use impl='torch' (--ttt.loss-impl torch)"
        )


# ---- public ------------------------------------------------------------------------


@dataclass(frozen=True)
class SoftCE:
    """Per-row outputs of ``indexed_soft_ce``; every field is ``[N]``.

    With ``p = exp(teacher_logits[t] - lse_draft[t])`` and
    ``q = exp(teacher_logits[t] - lse_full[t])``:

    Fields:
        loss: fp32, ``-sum_v p_v * log_softmax(z)_v`` on active rows, 0 on the
            others; the only differentiable field.
        lse: fp32, ``logsumexp(z)`` on active rows, 0 on the others.
        argmax: int64, ``argmax(z)`` (ties to the lowest id) on in-rows rows, 0 outside
            ``row_mask``.
        correct: int8 (0/1), ``argmax + d2t[argmax] == target_token[t]`` on in-rows rows;
            None when no ``target_token``/``d2t`` were given.
        accept: fp32, ``sum_v min(q_v, softmax(z)_v)`` on active rows, 0 on the others;
            no grad.
    """

    loss: torch.Tensor
    lse: torch.Tensor
    argmax: torch.Tensor
    correct: torch.Tensor | None
    accept: torch.Tensor


def indexed_soft_ce(
    logits_NV: torch.Tensor,
    teacher_logits_UV: torch.Tensor,
    lse_draft_U: torch.Tensor,
    lse_full_U: torch.Tensor,
    gate_U: torch.Tensor,
    table_rows_N: torch.Tensor,
    *,
    target_token_U: torch.Tensor | None = None,
    d2t_V: torch.Tensor | None = None,
    row_mask_N: torch.Tensor | None = None,
) -> SoftCE:
    """Gated soft cross-entropy, argmax and acceptance of each row, table read by index.

    The teacher is a compact ``TeacherTable``'s ``(logits, lse_draft, lse_full)``: its
    probabilities are computed in registers from the teacher logits (fp32 math), never
    stored. fp32 math for bf16/fp16/fp32 logits; gradients (``dlogits``, in the logits'
    dtype) flow through ``loss`` only, none to the table. fp64 logits or an fp64 table
    run the PyTorch twin ``indexed_soft_ce_naive`` instead (the exactness tests' dtype;
    no kernel).

    Args:
        logits_NV: ``[N, Vd]`` draft logits of the step's rows.
        teacher_logits_UV: ``[U, Vd]`` (bf16/fp16/fp32), the teacher's draft-vocab logits.
        lse_draft_U: fp32 ``[U]``, their log-sum-exp: ``p = exp(teacher - lse_draft)``
            is the renormalised teacher (the loss's target).
        lse_full_U: fp32 ``[U]``, the log-sum-exp over the full target vocab:
            ``q = exp(teacher - lse_full)`` is the teacher on the draft vocab, not
            renormalised (acceptance).
        gate_U: bool ``[U]``, rows taught by a table row without gate have loss 0.
        table_rows_N: int64 ``[N]``, the table row of each logits row (in range).
        target_token_U: int64 ``[U]`` or None, the teacher's argmax target id.
        d2t_V: int64 ``[Vd]`` or None, draft id ``i`` -> target id ``i + d2t[i]``.
        row_mask_N: bool ``[N]`` or None; rows outside it are absent (all outputs 0).
    """
    tensors = (logits_NV, teacher_logits_UV, lse_draft_U, lse_full_U)
    if torch.float64 in (x.dtype for x in tensors):
        return indexed_soft_ce_naive(
            logits_NV, teacher_logits_UV, lse_draft_U, lse_full_U, gate_U, table_rows_N,
            target_token_U=target_token_U, d2t_V=d2t_V, row_mask_N=row_mask_N,
        )
    if logits_NV.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits must be bf16, fp16, fp32 or fp64, got {logits_NV.dtype}")
    if logits_NV.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"the Triton soft cross-entropy needs CUDA tensors, got {logits_NV.device}; "
            "use impl='torch' (--ttt.loss-impl torch), or set TRITON_INTERPRET=1 before importing triton (tests)"
        )
    c = lambda x: None if x is None else x.contiguous()  # noqa: E731
    loss, lse, _, argmax, correct, accept = _SoftCEFunction.apply(
        c(logits_NV), c(teacher_logits_UV), c(lse_draft_U), c(lse_full_U), c(gate_U),
        c(table_rows_N), c(row_mask_N), c(target_token_U), c(d2t_V),
    )
    return SoftCE(loss=loss, lse=lse, argmax=argmax, correct=correct if target_token_U is not None else None,
                  accept=accept)


def indexed_soft_ce_naive(
    logits_NV: torch.Tensor,
    teacher_logits_UV: torch.Tensor,
    lse_draft_U: torch.Tensor,
    lse_full_U: torch.Tensor,
    gate_U: torch.Tensor,
    table_rows_N: torch.Tensor,
    *,
    target_token_U: torch.Tensor | None = None,
    d2t_V: torch.Tensor | None = None,
    row_mask_N: torch.Tensor | None = None,
) -> SoftCE:
    """PyTorch twin of ``indexed_soft_ce`` (same arguments and outputs), dense: it
    gathers the ``[N, Vd]`` teacher rows, computes their probabilities in the math dtype
    of the log-sum-exps, and keeps ``[N, Vd]`` log-probabilities."""
    z = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    in_rows = torch.ones_like(gate_U[table_rows_N]) if row_mask_N is None else row_mask_N
    active = gate_U[table_rows_N] & in_rows
    y = teacher_logits_UV[table_rows_N].to(  # [N, Vd]
        torch.promote_types(teacher_logits_UV.dtype, lse_draft_U.dtype))
    logp = F.log_softmax(z, dim=-1)
    p = torch.exp(y - lse_draft_U[table_rows_N, None])
    loss = torch.where(active, -(p * logp).sum(dim=-1), 0.0)
    with torch.no_grad():
        lse = torch.where(active, torch.logsumexp(z, dim=-1), 0.0)
        argmax = torch.where(in_rows, logits_NV.argmax(dim=-1), 0)
        q = torch.exp(y - lse_full_U[table_rows_N, None])
        accept = torch.minimum(q, logp.exp()).sum(dim=-1)
        accept = torch.where(active, accept, 0.0)
        correct = None
        if target_token_U is not None:
            match = argmax + d2t_V[argmax] == target_token_U[table_rows_N]
            correct = (match & in_rows).to(torch.int8)
    return SoftCE(loss=loss, lse=lse, argmax=argmax, correct=correct, accept=accept)
