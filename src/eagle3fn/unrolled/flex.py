"""EAGLE-3 TTT attention of one step by FlexAttention over packed query rows
(``unrolled.attention``'s one-rank GPU path, and each key block of the
sequence-parallel ring): the step's queries packed at the front of one query
sequence, a block-sparse mask of their windows (``unrolled.blocks``), the diagonal
keys merged afterwards by log-sum-exp (``unrolled.merges``).

Legend: B batch, C own rows per sample, N query rows of a step (sorted flat rows
``b*C + p``), h heads, g kv heads, d head dim, j the step, Lp = ``B*C`` flat keys
rounded up to FLEX_BLOCK, Qp packed query rows (``packed_query_len``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle3fn.compiled import compile_backend, compiled_flex
from eagle3fn.unrolled.blocks import PackedLayout, packed_block_mask, packed_layout, padded_key_len
from eagle3fn.unrolled.config import DEFAULT_QUERY_BUCKETS
from eagle3fn.unrolled.merges import merge_diagonal_as


def flex_kernel_options(device: torch.device,
                        kernel_options: tuple[tuple[str, object], ...] | None) -> dict | None:
    """``kernel_options`` (``TTTConfig.flex_kernel_options``) as the dict a FlexAttention
    call on ``device`` takes (a new one per call): CUDA only; ``None`` elsewhere or
    when unset (inductor's defaults)."""
    return dict(kernel_options) if device.type == "cuda" and kernel_options else None


def packed_keys(k_Ngd: torch.Tensor, v_Ngd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-0 keys/values ``[B*C, g, d]`` (flat rows) as FlexAttention inputs
    ``[1, g, Lp, d]``, ``Lp`` = ``B*C`` rounded up to FLEX_BLOCK (zeros past it, never
    read). Built once per batch and shared by every step."""
    BC = k_Ngd.shape[0]
    Lp = padded_key_len(BC)
    prep = lambda x: F.pad(x, (0, 0, 0, 0, 0, Lp - BC)).transpose(0, 1)[None].contiguous()  # noqa: E731
    return prep(k_Ngd), prep(v_Ngd)


def packed_flex_attention(q_NhD: torch.Tensor, rows_N: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor],
                          diagonal: tuple[torch.Tensor, torch.Tensor] | None, lengths_B: torch.Tensor,
                          num_rows: int, layout: PackedLayout | None = None, return_lse: bool = False,
                          q_packed: torch.Tensor | None = None, *,
                          kernel_options: tuple[tuple[str, object], ...] | None = None,
                          query_buckets: int = DEFAULT_QUERY_BUCKETS,
                          fused: bool,
                          starts_BC: torch.Tensor | None = None):
    """EAGLE-3 TTT attention for the queries of flat rows ``rows_N`` only, by FlexAttention
    (the one-rank GPU path of every trim mode).

    The N queries are packed at the front of one query sequence of
    ``packed_query_len(N, Lp)`` rows, so FlexAttention visits only
    ``ceil(N / FLEX_BLOCK)`` query blocks whether the rows are contiguous or scattered,
    keeps query/output tensors of about N rows, and the shapes (hence the compiled
    kernels) take at most ``query_buckets`` values per ``B*C``. Query ``i`` (row
    ``b*C + p``) sees the flat step-0 keys ``b*C .. b*C + p`` (capped at the sample's
    last real row; from its document's start in a packed batch); the diagonal keys
    are merged afterwards by log-sum-exp (``merge_diagonal``), so no key is ever copied
    per step.

    Args:
        q_NhD: ``[N, h, d]`` queries (RoPE applied) of ``rows_N`` (sorted flat rows).
        keys: ``packed_keys`` of the step-0 keys/values.
        diagonal: ``(k, v)``, each ``[j, N, g, d]``: every row's own keys of steps
            ``1..j``, aligned with ``rows_N`` (None at step 0).
        lengths_B: int ``[B]`` real rows per sample (right padding).
        num_rows: C.
        layout: ``packed_layout(rows_N, lengths_B, num_rows, Lp, query_buckets)``,
            when already built (``layout.plan_steps`` plans every step on the host);
            else built here.
        return_lse: also return the natural log-sum-exp ``[N, h]`` (fp32) of each
            row's scaled scores over its keys (``-inf`` where it sees none); only with
            ``diagonal=None`` (the sequence-parallel ring merges blocks by it).
        q_packed: ``q_NhD`` already laid out as FlexAttention's query ``[1, h, Qp, d]``
            (``pack_queries``): a caller attending the same queries to several key
            blocks pads them once, and autograd keeps one copy.
        kernel_options: ``TTTConfig.flex_kernel_options`` (CUDA calls only).
        query_buckets: ``TTTConfig.query_buckets``, for a layout built here.
        fused: ``TTTConfig.compile_elementwise``: the diagonal merge's Triton kernel on
            CUDA (``merge_diagonal_as``).
        starts_BC: a packed batch's document starts (``packed_layout``), for a layout
            built here.

    Returns:
        ``[N, h, d]`` in ``q``'s dtype (and the log-sum-exp with ``return_lse``).
    """
    if return_lse and diagonal is not None:
        raise ValueError("return_lse is for the step-0 keys alone: merge the diagonal keys "
                         "after the blocks (merge_diagonal)")

    N, h, d = q_NhD.shape
    K, V = keys
    Lp = K.shape[2]
    if N == 0:
        empty = q_NhD.new_zeros(N, h, d)
        return (empty, q_NhD.new_zeros(N, h, dtype=torch.float32)) if return_lse else empty
    layout = _step_layout(layout, N, rows_N, lengths_B, num_rows, Lp, query_buckets, starts_BC)
    backend = compile_backend(q_NhD.device)
    start, last = _mask_windows(layout, backend)

    def mask_mod(b, head, q_idx, kv_idx):
        return (kv_idx >= start[q_idx]) & (kv_idx <= last[q_idx])

    block_mask = packed_block_mask(start, last, N, Lp, mask_mod, tables=layout.tables)
    Q = pack_queries(q_NhD, start.shape[0]) if q_packed is None else q_packed
    scale = 1.0 / math.sqrt(d)
    out, lse = _flex_forward(Q, K, V, block_mask, scale, h != K.shape[1],
                             flex_kernel_options(q_NhD.device, kernel_options), backend)
    o = out[0, :, :N].transpose(0, 1)
    if return_lse:
        return o, lse[0, :, :N].transpose(0, 1)
    if diagonal is None:
        return o
    return merge_diagonal_as(fused)(o, lse[0, :, :N].transpose(0, 1), q_NhD, *diagonal, scale)


def _step_layout(layout: PackedLayout | None, num_queries: int, rows_N: torch.Tensor,
                 lengths_B: torch.Tensor, num_rows: int, key_len: int, query_buckets: int,
                 starts_BC: torch.Tensor | None) -> PackedLayout:
    """The step's ``PackedLayout``: ``layout`` after checking it is for ``num_queries``
    query rows (ValueError otherwise), or, when None, ``packed_layout`` of ``rows_N``
    built here."""
    if layout is None:
        return packed_layout(rows_N, lengths_B, num_rows, key_len, query_buckets, starts_BC)
    if layout.num_queries != num_queries:
        raise ValueError(f"the layout is for {layout.num_queries} query rows but q has {num_queries}: "
                         "pass the layout of this step's rows (plan_steps)")
    return layout


def _mask_windows(layout: PackedLayout, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's query windows ``(start, last)``, int64 ``[Qp]``, as the ``mask_mod``
    captures them: own copies where FlexAttention is compiled (``backend`` not None)
    and they are slices of a larger buffer, else the layout's tensors."""
    start, last = layout.start, layout.last
    if backend is not None and start.storage_offset() + last.storage_offset():
        # Slices of the layout's one buffer: dynamo guards a captured tensor's storage
        # offset against other sizes, which a later batch breaks (one recompilation);
        # own copies (Qp int64 each) start at offset 0.
        start, last = start.clone(), last.clone()
    return start, last


def _flex_forward(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, block_mask, scale: float,
                  enable_gqa: bool, kernel_options: dict | None, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention of the packed queries ``Q [1, h, Qp, d]`` over the keys ``K, V
    [1, g, Lp, d]`` under ``block_mask``: ``(out [1, h, Qp, d], lse [1, h, Qp])``, the
    natural log-sum-exp in fp32. Compiled by ``backend`` (lengths marked dynamic,
    ``_dynamic_lengths``), eager where it is None."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = flex_attention if backend is None else compiled_flex(backend)
    if backend is not None:
        _dynamic_lengths(Q, K, V, block_mask)
    out, aux = attend(Q, K, V, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                      kernel_options=kernel_options, **_LSE)
    return out, getattr(aux, "lse", aux)

def _dynamic_lengths(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, block_mask) -> None:
    """Tell dynamo up front that the query and key lengths (``Qp``, ``Lp``) and the block
    tables' row and column counts vary (``maybe_mark_dynamic``), so that the first
    batch compiles the one shape-dynamic graph every later batch reuses, instead of a
    static graph that the second shape replaces (``eagle3fn.compiled``)."""
    mark = torch._dynamo.maybe_mark_dynamic
    for x in (Q, K, V):
        mark(x, 2)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        t = getattr(block_mask, name, None)
        if t is not None:
            for dim in range(2, t.dim()):
                mark(t, dim)


def _lse_request() -> dict:
    """The FlexAttention argument that asks for the log-sum-exp: ``return_aux`` where this
    torch has it (``return_lse`` is deprecated there, and its one-time warning changes a
    global that dynamo guards on: one recompilation after the first call)."""
    from torch.nn.attention import flex_attention as fa

    return dict(return_aux=fa.AuxRequest(lse=True)) if hasattr(fa, "AuxRequest") else dict(return_lse=True)


_LSE = _lse_request()


def pack_queries(q_NhD: torch.Tensor, num_packed: int) -> torch.Tensor:
    """``[N, h, d]`` queries as FlexAttention's ``[1, h, Qp, d]`` (zeros past N)."""
    # cat, not F.pad: the pad's backward is a constant_pad_nd with negative pads, a view in
    # eager but a new tensor in a symbolic-size trace, so a compiled step's later view
    # of it fails at run time (strides disagree); cat's backward is a slice in both.
    pad = q_NhD.new_zeros((num_packed - q_NhD.shape[0], *q_NhD.shape[1:]))
    return torch.cat([q_NhD, pad]).transpose(0, 1)[None].contiguous()
