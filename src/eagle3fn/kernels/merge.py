"""The diagonal-key merge of TTT attention (SPEC section 3), forward and backward.

Legend: N query rows, h heads, g kv heads (``rep = h / g`` heads share one), d head
dim, j diagonal steps.

At step ``j >= 1`` a row's query sees the causal step-0 keys and its own keys of
steps ``1..j``. FlexAttention does the first part and returns ``o`` and the natural
log-sum-exp ``lse`` of its scaled scores; this kernel adds the diagonal keys by
log-sum-exp: with ``s_i = scale * q . k_i``,

    out = (exp(lse) o + sum_i exp(s_i) v_i) / (exp(lse) + sum_i exp(s_i))

computed with a running maximum (``M`` = the merged log-sum-exp is kept for
backward). Backward, with ``P0 = exp(lse - M)``, ``P_i = exp(s_i - M)`` and
``D = G . out`` for the output gradient ``G``:

    do = P0 G,  dlse = P0 (G . o - D),  ds_i = P_i (G . v_i - D),
    dq = scale sum_i ds_i k_i,  dk_i = scale sum_rep ds_i q,  dv_i = sum_rep P_i G.

One program per (block of rows, kv head): the ``rep`` query heads of a group share
their keys, so GQA costs no copy, and each row's ``[rep, d]`` tile sits in one warp, so
the reductions over d and over the group's heads stay inside it (one row per program
would reduce across warps at every step).
All maths in fp32 registers; nothing ``[N, h, j]``-sized is written in either
direction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3fn.kernels.soft_ce import to_output

NUM_WARPS = 4
FWD_ROWS = 8
"""Rows per program of the forward kernel."""
BWD_ROWS = 4
"""Rows per program of the backward kernel (it keeps five ``[rows, rep, d]`` fp32 tiles
live)."""


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _group(N, G: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
           REP_P: tl.constexpr, D_P: tl.constexpr):
    """This program's ``ROWS`` rows ``n`` and kv head ``gi``, its ``rep`` query heads
    (int64: they multiply strides of up to ``Qp*d``), the head-dim lanes, and the masks
    of ``[ROWS, REP]`` (scores), ``[ROWS, D]`` (keys) and ``[ROWS, REP, D]`` (queries)."""
    n = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    gi = tl.program_id(1)
    r = tl.arange(0, REP_P)
    cols = tl.arange(0, D_P)
    nmask, rmask, cmask = n < N, r < REP, cols < D
    smask = nmask[:, None] & rmask[None, :]
    return (n, gi, (gi * REP + r).to(tl.int64), cols, smask, nmask[:, None] & cmask[None, :],
            smask[:, :, None] & cmask[None, None, :])


@triton.jit
def _tile(ptr, n, heads, cols, s_n, s_h, mask):
    """fp32 ``[ROWS, REP, D]`` tile of a ``[N, h, d]`` tensor (last stride 1)."""
    return tl.load(ptr + n[:, None, None] * s_n + heads[None, :, None] * s_h + cols[None, None, :],
                   mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _diagonal(k_ptr, v_ptr, i, N, n, gi, cols, kmask, q, scale, G: tl.constexpr, D: tl.constexpr):
    """Step ``i``'s own keys and values of rows ``n``, kv head ``gi`` (fp32 ``[ROWS, D]``
    each, at offsets ``base`` ``[ROWS, D]`` of the ``[j, N, g, d]`` stacks) and the
    group's scaled scores ``s = scale * q . k`` ``[ROWS, REP]``."""
    base = ((i * N + n) * G + gi)[:, None] * D + cols[None, :]
    k = tl.load(k_ptr + base, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + base, mask=kmask, other=0.0).to(tl.float32)
    return base, k, v, tl.sum(q * k[:, None, :], 2) * scale


@triton.jit
def _merge_fwd_kernel(o_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, out_ptr, m_ptr,
                      s_on, s_oh, s_ln, s_lh, s_qn, s_qh,
                      N, J, scale,
                      G: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                      REP_P: tl.constexpr, D_P: tl.constexpr):
    n, gi, heads, cols, smask, kmask, mask = _group(N, G, REP, D, ROWS, REP_P, D_P)
    q = _tile(q_ptr, n, heads, cols, s_qn, s_qh, mask)
    acc = _tile(o_ptr, n, heads, cols, s_on, s_oh, mask)
    top = tl.load(lse_ptr + n[:, None] * s_ln + heads[None, :] * s_lh, mask=smask,
                  other=0.0).to(tl.float32)
    denom = tl.full([ROWS, REP_P], 1.0, tl.float32)
    for i in range(J):
        _, k, v, s = _diagonal(k_ptr, v_ptr, i, N, n, gi, cols, kmask, q, scale, G, D)
        new = tl.maximum(top, s)
        alpha = tl.exp(top - new)
        p = tl.exp(s - new)
        acc = acc * alpha[:, :, None] + p[:, :, None] * v[:, None, :]
        denom = denom * alpha + p
        top = new
    H = G * REP
    flat = n[:, None] * H + heads[None, :]  # [ROWS, REP] in the contiguous [N, h]
    tl.store(out_ptr + flat[:, :, None] * D + cols[None, None, :],
             to_output(acc / denom[:, :, None], out_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + flat, top + tl.log(denom), mask=smask)


@triton.jit
def _merge_bwd_kernel(g_ptr, o_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, m_ptr,
                      do_ptr, dlse_ptr, dq_ptr, dk_ptr, dv_ptr,
                      s_on, s_oh, s_ln, s_lh, s_qn, s_qh,
                      N, J, scale,
                      G: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                      REP_P: tl.constexpr, D_P: tl.constexpr):
    n, gi, heads, cols, smask, kmask, mask = _group(N, G, REP, D, ROWS, REP_P, D_P)
    H = G * REP
    flat = n[:, None] * H + heads[None, :]  # [ROWS, REP] in the contiguous [N, h]
    dense = flat[:, :, None] * D + cols[None, None, :]
    grad = tl.load(g_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    q = _tile(q_ptr, n, heads, cols, s_qn, s_qh, mask)
    o = _tile(o_ptr, n, heads, cols, s_on, s_oh, mask)
    lse = tl.load(lse_ptr + n[:, None] * s_ln + heads[None, :] * s_lh, mask=smask,
                  other=0.0).to(tl.float32)
    merged = tl.load(m_ptr + flat, mask=smask, other=0.0)
    p0 = tl.where(smask, tl.exp(lse - merged), 0.0)
    out = p0[:, :, None] * o  # the fp32 output, recomputed
    for i in range(J):
        _, k, v, s = _diagonal(k_ptr, v_ptr, i, N, n, gi, cols, kmask, q, scale, G, D)
        p = tl.where(smask, tl.exp(s - merged), 0.0)
        out += p[:, :, None] * v[:, None, :]
    dot_out = tl.sum(grad * out, 2)
    tl.store(do_ptr + dense, to_output(p0[:, :, None] * grad, do_ptr.dtype.element_ty), mask=mask)
    tl.store(dlse_ptr + flat, p0 * (tl.sum(grad * o, 2) - dot_out), mask=smask)
    dq = tl.zeros([ROWS, REP_P, D_P], tl.float32)
    for i in range(J):
        base, k, v, s = _diagonal(k_ptr, v_ptr, i, N, n, gi, cols, kmask, q, scale, G, D)
        p = tl.where(smask, tl.exp(s - merged), 0.0)
        ds = p * (tl.sum(grad * v[:, None, :], 2) - dot_out) * scale
        dq += ds[:, :, None] * k[:, None, :]
        tl.store(dk_ptr + base, to_output(tl.sum(ds[:, :, None] * q, 1), dk_ptr.dtype.element_ty),
                 mask=kmask)
        tl.store(dv_ptr + base, to_output(tl.sum(p[:, :, None] * grad, 1), dv_ptr.dtype.element_ty),
                 mask=kmask)
    tl.store(dq_ptr + dense, to_output(dq, dq_ptr.dtype.element_ty), mask=mask)


# ---- launchers ---------------------------------------------------------------------


def _check(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd) -> tuple[int, int, int, int, int]:
    N, h, d = q_NhD.shape
    j, _, g, _ = k_jNgd.shape
    assert o_NhD.shape == q_NhD.shape and lse_Nh.shape == (N, h) and lse_Nh.dtype == torch.float32
    assert k_jNgd.shape == v_jNgd.shape == (j, N, g, d) and h % g == 0
    assert o_NhD.stride(-1) == 1 and q_NhD.stride(-1) == 1
    assert k_jNgd.is_contiguous() and v_jNgd.is_contiguous()
    return N, h, d, j, g


def _meta(h: int, g: int, d: int, rows: int) -> dict:
    return dict(G=g, REP=h // g, D=d, ROWS=rows, REP_P=triton.next_power_of_2(h // g),
                D_P=triton.next_power_of_2(d), num_warps=NUM_WARPS)


def merge_fwd(o_NhD: torch.Tensor, lse_Nh: torch.Tensor, q_NhD: torch.Tensor, k_jNgd: torch.Tensor,
              v_jNgd: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: ``(out [N, h, d] in q's dtype, M [N, h] fp32)``."""
    N, h, d, j, g = _check(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd)
    out = _alloc((N, h, d), q_NhD.dtype, q_NhD.device)
    merged = _alloc((N, h), torch.float32, q_NhD.device)
    if N:
        _merge_fwd_kernel[(triton.cdiv(N, FWD_ROWS), g)](
            o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, out, merged,
            o_NhD.stride(0), o_NhD.stride(1), lse_Nh.stride(0), lse_Nh.stride(1),
            q_NhD.stride(0), q_NhD.stride(1), N, j, scale, **_meta(h, g, d, FWD_ROWS))
    return out, merged


def merge_bwd(grad_NhD, o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, merged_Nh, scale):
    """Launch the backward kernel: ``(do, dlse, dq, dk, dv)``, each like its input."""
    N, h, d, j, g = _check(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd)
    grad_NhD = grad_NhD.contiguous()
    do = _alloc((N, h, d), o_NhD.dtype, o_NhD.device)
    dlse = _alloc((N, h), torch.float32, o_NhD.device)
    dq = _alloc((N, h, d), q_NhD.dtype, q_NhD.device)
    dk, dv = (_alloc(tuple(k_jNgd.shape), k_jNgd.dtype, k_jNgd.device) for _ in range(2))
    if N:
        _merge_bwd_kernel[(triton.cdiv(N, BWD_ROWS), g)](
            grad_NhD, o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, merged_Nh,
            do, dlse, dq, dk, dv,
            o_NhD.stride(0), o_NhD.stride(1), lse_Nh.stride(0), lse_Nh.stride(1),
            q_NhD.stride(0), q_NhD.stride(1), N, j, scale, **_meta(h, g, d, BWD_ROWS))
    return do, dlse, dq, dk, dv


# ---- autograd ----------------------------------------------------------------------


class _MergeFunction(torch.autograd.Function):
    @staticmethod
    def forward(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale):
        return merge_fwd(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, output[1])
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad_out, _):
        o, lse, q, k, v, merged = ctx.saved_tensors
        return (*merge_bwd(grad_out, o, lse, q, k, v, merged, ctx.scale), None)


# ---- public ------------------------------------------------------------------------


def merge_diagonal(o_NhD: torch.Tensor, lse_Nh: torch.Tensor, q_NhD: torch.Tensor,
                   k_jNgd: torch.Tensor, v_jNgd: torch.Tensor, scale: float) -> torch.Tensor:
    """Add each row's own keys of steps ``1..j`` to causal attention outputs, by
    log-sum-exp (Triton; see the module docstring).

    Args:
        o_NhD: ``[N, h, d]`` attention output over the step-0 keys (last stride 1).
        lse_Nh: fp32 ``[N, h]`` natural log-sum-exp of the scaled step-0 scores.
        q_NhD: ``[N, h, d]`` queries (RoPE applied; last stride 1).
        k_jNgd, v_jNgd: ``[j, N, g, d]`` the rows' own keys and values of steps 1..j.
        scale: score scale (``1 / sqrt(d)``).

    Returns:
        ``[N, h, d]`` in q's dtype; differentiable in o, lse, q, k and v.
    """
    return _MergeFunction.apply(o_NhD, lse_Nh, q_NhD, k_jNgd.contiguous(), v_jNgd.contiguous(), scale)[0]


def merge_diagonal_naive(o_NhD: torch.Tensor, lse_Nh: torch.Tensor, q_NhD: torch.Tensor,
                         k_jNgd: torch.Tensor, v_jNgd: torch.Tensor, scale: float) -> torch.Tensor:
    """The PyTorch twin of ``merge_diagonal`` (fp32 maths, or fp64 for fp64 inputs; GQA
    by broadcasting, nothing repeated). Any device; autograd gives its backward."""
    N, h, d = q_NhD.shape
    g = k_jNgd.shape[2]
    math_dtype = torch.promote_types(q_NhD.dtype, torch.float32)
    q = q_NhD.to(math_dtype).view(N, g, h // g, d)
    k = k_jNgd.to(math_dtype)[:, :, :, None]  # [j, N, g, 1, d]
    s = (q[None] * k).sum(-1) * scale  # [j, N, g, rep]
    lse = lse_Nh.to(math_dtype).view(N, g, h // g)
    top = torch.maximum(lse, s.amax(0))
    w0, w = torch.exp(lse - top), torch.exp(s - top)
    out = w0[..., None] * o_NhD.to(math_dtype).reshape(N, g, h // g, d)
    out = out + (w[..., None] * v_jNgd.to(math_dtype)[:, :, :, None]).sum(0)
    return (out / (w0 + w.sum(0))[..., None]).view(N, h, d).to(q_NhD.dtype)
