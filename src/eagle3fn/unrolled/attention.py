"""The EAGLE-3 TTT attention of one step (SPEC section 3): eager, and FlexAttention
over packed query rows with block-sparse masks, partial results merged by
log-sum-exp.

Legend: B batch, C own rows per sample, N query rows of a step (sorted flat rows
``b*C + p``), h heads, g kv heads, d head dim, j the step, Lp = ``B*C`` flat keys
rounded up to FLEX_BLOCK, Qp packed query rows (``packed_query_len``), R rows of a
block table, W its width.

Step j's queries see the causal step-0 keys of their sample (``[B*C]`` flat, built
once per batch) plus each row's own keys of steps ``1..j`` (the diagonal). The flex
path runs FlexAttention over the step-0 keys only and merges the diagonal keys
afterwards (``merge_diagonal``), so no key is ever copied per step.

Packed sequences (SPEC 9): a query sees the step-0 keys of its own document only,
from the document's start (``starts_BC``, ``align.document_starts``) up to itself. A
document is a contiguous range, so "same document id and causal" is the key window
``[start, p]``: the eager path masks keys below the start, the flex path starts each
query's window there (its ``mask_mod`` and block tables are those windows). The
diagonal keys are the row's own, never another document's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import repeat

from eagle3fn.align import document_starts
from eagle3fn.kernels import merge as merge_kernel
from eagle3fn.shapes import Features
from eagle3fn.unrolled.config import (DEFAULT_QUERY_BUCKETS,
                                      AttentionImpl, TTTConfig)
from eagle3fn.compiled import compile_backend, compiled_flex

FLEX_BLOCK = 128
"""FlexAttention's block size, in rows, for queries and keys alike."""

MIN_FLEX_BLOCKS = 2
"""The fewest FLEX_BLOCKs of a packed query or key length: dynamo specialises sizes 0
and 1, so one block would compile a graph of its own (``eagle3fn.compiled``)."""


def eager_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                    valid_BC: torch.Tensor, starts_BC: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-3 TTT attention at step ``j = len(keys) - 1``, exact.

    Args:
        q: ``[B, h, C, d]`` queries of step j (RoPE applied).
        keys: j + 1 pairs ``(k, v)`` of ``[B, g, C, d]``; pair 0 is step 0 (causal
            context), pair ``i >= 1`` the row's own keys of step i (diagonal).
        valid_BC: bool ``[B, C]``, real (non-padded) key positions.
        starts_BC: int64 ``[B, C]`` or None: a packed batch's document start of each
            query row (``align.document_starts``); its step-0 keys begin there.

    Returns:
        ``[B, h, C, d]``. Scores in the input dtype, softmax in fp32 (fp64 for fp64).
    """
    B, h, C, d = q.shape
    rep = h // keys[0][0].shape[1]
    expand = lambda x: repeat(x, "b g s d -> b (g r) s d", r=rep)  # noqa: E731 - GQA
    scale = 1.0 / math.sqrt(d)
    k0, v0 = expand(keys[0][0]), expand(keys[0][1])
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & valid_BC[:, None, None, :]
    if starts_BC is not None:
        key = torch.arange(C, device=q.device)
        allowed = allowed & (key[None, None, None, :] >= starts_BC[:, None, :, None])
    scores = (q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    diag = [((q * expand(k)).sum(-1) * scale)[..., None] for k, _ in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1),
                          dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    out = probs[..., :C] @ v0
    for i, (_, v) in enumerate(keys[1:]):
        out = out + probs[..., C + i, None] * expand(v)
    return out


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


def packed_query_len(num_queries: int, key_len: int,
                     query_buckets: int = DEFAULT_QUERY_BUCKETS) -> int:
    """The packed query length for ``num_queries`` rows over ``key_len`` keys: rounded
    up to a multiple of ``key_len / query_buckets`` in FLEX_BLOCK units, so at most
    ``query_buckets`` lengths (compiled kernels) per key length (a multiple of
    FLEX_BLOCK, at least MIN_FLEX_BLOCKS blocks, at most ``key_len``;
    ``TTTConfig.query_buckets``)."""
    unit = -(-key_len // (query_buckets * FLEX_BLOCK)) * FLEX_BLOCK
    return min(key_len, max(max(-(-num_queries // unit), 1) * unit, MIN_FLEX_BLOCKS * FLEX_BLOCK))


def _range_tables(lo: torch.Tensor, hi: torch.Tensor, full_lo: torch.Tensor, full_hi: torch.Tensor,
                  active: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """BlockMask tables of rows listing ranges of columns: row ``r`` lists the full
    columns ``full_lo[r]..full_hi[r]`` (when not empty) and, as partial, the rest of
    ``lo[r]..hi[r]`` (which contains them), in increasing order; rows with ``active``
    0 list nothing. Returns int32 ``(num_partial [1, 1, R], partial [1, 1, R, width],
    num_full, full)`` (entries past a row's count are clamped columns, never read)."""
    num_full = (full_hi - full_lo + 1).clamp(min=0) * active
    has_full = num_full > 0
    below = torch.where(has_full, full_lo - lo, 0)  # partial columns before the full run
    above_start = torch.where(has_full, full_hi + 1, lo)
    num_partial = torch.where(has_full, below + hi - full_hi, hi - lo + 1).clamp(min=0) * active
    i = torch.arange(width, device=lo.device)[None]
    partial = torch.where(i < below[:, None], lo[:, None] + i, above_start[:, None] + i - below[:, None])
    as_i32 = lambda x: x.clamp(0, width - 1).to(torch.int32)[None, None].contiguous()  # noqa: E731
    return (num_partial.to(torch.int32)[None, None], as_i32(partial),
            num_full.to(torch.int32)[None, None], as_i32(full_lo[:, None] + i))


def _range_lists(lo: torch.Tensor, hi: torch.Tensor, full_lo: torch.Tensor, full_hi: torch.Tensor,
                 active: torch.Tensor, width: int,
                 limit: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``_range_tables``' lists for the batched tables (``_segment_block_tables``),
    without the two leading unit dims: int32 ``(num_partial [R], partial [R, width],
    num_full [R], full [R, width])``, the ``[R, width]`` ones computed in int32 (the
    values are block indices). ``limit`` (int32 ``[R, 1]`` or None: ``width``) is each
    row's own table width: its entries are clamped to ``[0, limit - 1]``, so the first
    ``limit[r]`` columns of row ``r`` are ``_range_tables``' of width ``limit[r]``
    (tables of several widths computed at once)."""
    num_full = (full_hi - full_lo + 1).clamp(min=0) * active
    has_full = num_full > 0
    below = torch.where(has_full, full_lo - lo, 0)  # partial columns before the full run
    above_start = torch.where(has_full, full_hi + 1, lo)
    num_partial = torch.where(has_full, below + hi - full_hi, hi - lo + 1).clamp(min=0) * active
    i = torch.arange(width, dtype=torch.int32, device=lo.device)[None]
    column = lambda x: x.to(torch.int32)[:, None]  # noqa: E731
    partial = torch.where(i < column(below), column(lo), column(above_start - below)) + i
    full = column(full_lo) + i
    for x in (partial, full):
        if limit is None:
            x.clamp_(0, width - 1)
        else:
            torch.minimum(x.clamp_(min=0), limit - 1, out=x)
    return num_partial.to(torch.int32), partial, num_full.to(torch.int32), full


def _transposed_tables(lo: torch.Tensor, hi: torch.Tensor, full_lo: torch.Tensor, full_hi: torch.Tensor,
                       num_active: int, num_columns: int) -> tuple[torch.Tensor, ...]:
    """The column-major tables of ``_range_tables``' lists, for the backward pass: for
    each column ``c < num_columns``, the rows ``r < num_active`` listing it (full and
    partial). ``lo, hi, full_lo, full_hi`` must be non-decreasing in ``r`` (windows of
    packed queries are), so each such row set is a range found by binary search:
    ``lo[r] <= c <= hi[r]`` for ``r`` in ``[b, a)``, full for ``r`` in ``[bf, af)``,
    inside it. No dense mask, no sort."""
    c = torch.arange(num_columns, device=lo.device)
    a = torch.searchsorted(lo, c, right=True).clamp(max=num_active)
    b = torch.searchsorted(hi, c)
    af = torch.searchsorted(full_lo, c, right=True).clamp(max=num_active)
    bf = torch.searchsorted(full_hi, c)
    return _range_tables(b, a - 1, bf, af - 1, (a > b).long(), lo.shape[0])


def block_tables(start_Q: torch.Tensor, last_Q: torch.Tensor, num_queries: int,
                 key_len: int) -> tuple[torch.Tensor, ...]:
    """The int32 tables of ``packed_block_mask`` (any device, no host sync): query-major
    ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` and, where this
    torch's ``BlockMask`` takes them, the key-major ``(q_num_blocks, q_indices,
    full_q_num_blocks, full_q_indices)`` of the backward. Shapes ``[1, 1, R]`` and
    ``[1, 1, R, W]``."""
    M, NB = start_Q.shape[0] // FLEX_BLOCK, key_len // FLEX_BLOCK
    m = torch.arange(M, device=start_Q.device)
    first = (m * FLEX_BLOCK).clamp(max=max(num_queries - 1, 0))
    final = (m * FLEX_BLOCK + FLEX_BLOCK - 1).clamp(max=max(num_queries - 1, 0))
    lo = start_Q[first] // FLEX_BLOCK
    hi = torch.maximum(last_Q[final] // FLEX_BLOCK, lo)
    full_lo = (start_Q[final] + FLEX_BLOCK - 1) // FLEX_BLOCK
    full_hi = (last_Q[first] + 1) // FLEX_BLOCK - 1
    num_active = -(-num_queries // FLEX_BLOCK)
    kv = _range_tables(lo, hi, full_lo, full_hi, (m < num_active).long(), NB)
    if not _block_mask_takes_q_tables():  # a torch without that constructor: it transposes
        return kv
    return kv + _transposed_tables(lo, hi, full_lo, full_hi, num_active, NB)


def packed_block_mask(start_Q: torch.Tensor, last_Q: torch.Tensor, num_queries: int, key_len: int,
                      mask_mod, tables: tuple[torch.Tensor, ...] | None = None):
    """FlexAttention BlockMask for ``Qp = len(start_Q)`` packed queries over ``key_len``
    flat keys (both multiples of FLEX_BLOCK): query ``i`` may see keys
    ``start[i]..last[i]`` (both non-decreasing in ``i``). Per query block: full blocks
    = key blocks inside every query's window, partial blocks (the ``mask_mod``
    applies) = the rest of the union of the windows; blocks holding only padding
    queries (``i >= num_queries``) list nothing and are skipped. The key-major tables
    of the backward come from the same ranges (``_transposed_tables``), not from a
    dense mask and a sort. ``tables``: ``block_tables`` of these windows, already
    computed (``plan_steps`` builds them on the host)."""
    from torch.nn.attention.flex_attention import BlockMask

    if tables is None:
        tables = block_tables(start_Q, last_Q, num_queries, key_len)
    lengths = (start_Q.shape[0], key_len)
    if len(tables) == 4:
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                        seq_lengths=lengths)
    kv, q = tables[:4], tables[4:]
    return BlockMask(seq_lengths=lengths, kv_num_blocks=kv[0], kv_indices=kv[1],
                     full_kv_num_blocks=kv[2], full_kv_indices=kv[3], q_num_blocks=q[0],
                     q_indices=q[1], full_q_num_blocks=q[2], full_q_indices=q[3],
                     BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mask_mod)


@dataclass(frozen=True)
class PackedLayout:
    """One step's packed FlexAttention queries (``packed_flex_attention``): query ``i``
    (row ``qflat[i]``; padding queries repeat the last row) sees the flat step-0 keys
    ``start[i]..last[i]``; ``tables`` are ``block_tables`` of those windows.

    Fields:
        num_queries: N, the step's real query rows.
        start, last: int64 ``[Qp]`` (``Qp = packed_query_len(N, Lp)``).
        tables: the int32 block tables (``block_tables``).
    """

    num_queries: int
    start: torch.Tensor
    last: torch.Tensor
    tables: tuple[torch.Tensor, ...]


def padded_key_len(num_flat_rows: int) -> int:
    """Lp: ``B*C`` flat keys rounded up to FLEX_BLOCK (at least MIN_FLEX_BLOCKS blocks)."""
    return max(-(-num_flat_rows // FLEX_BLOCK), MIN_FLEX_BLOCKS) * FLEX_BLOCK


def packed_layout(rows_N: torch.Tensor, lengths_B: torch.Tensor, num_rows: int,
                  key_len: int, query_buckets: int = DEFAULT_QUERY_BUCKETS,
                  starts_BC: torch.Tensor | None = None) -> PackedLayout:
    """``PackedLayout`` of the sorted flat query rows ``rows_N`` (N >= 1) on their
    device: each query sees its sample's keys up to itself, capped at the sample's
    last real row (``lengths_B``, right padding). ``starts_BC`` (int64 ``[B, C]``, a
    packed batch's ``align.document_starts``): the window starts at the query's
    document start instead of the sample's (never past the window's end, so a
    padding row keeps one key; starts and ends stay non-decreasing in ``i``)."""
    N = rows_N.numel()
    Qp = packed_query_len(N, key_len, query_buckets)
    qflat = torch.cat([rows_N, rows_N[-1:].expand(Qp - N)])  # padding queries copy the last
    sample = qflat // num_rows
    start = sample * num_rows
    last = torch.minimum(qflat, start + lengths_B.to(qflat.device)[sample] - 1)
    if starts_BC is not None:
        start = torch.minimum(start + starts_BC.to(qflat.device).flatten()[qflat], last)
    return PackedLayout(N, start, last, block_tables(start, last, N, key_len))


def packed_layouts(rows: list[torch.Tensor], lengths_B: torch.Tensor, num_rows: int, key_len: int,
                   query_buckets: int = DEFAULT_QUERY_BUCKETS,
                   starts_BC: torch.Tensor | None = None) -> list[PackedLayout]:
    """``[packed_layout(r, lengths_B, num_rows, key_len, query_buckets, starts_BC) for
    r in rows]`` (each ``r`` sorted flat rows ``[N_s]``, ``N_s >= 1``) in one batched
    pass: the lists' packed queries concatenated (``[sum_s Qp_s]``), their windows and
    block tables computed once with per-list offsets, then split. Every tensor equals
    ``packed_layout``'s in values, dtype, shape and strides (``start``/``last`` and the
    tables are views of shared buffers). The ops do not grow with the number of lists
    but for one view per output tensor (the host plans a batch's k steps with it,
    ``layout.plan_steps``); one list takes ``block_tables`` itself."""
    if not rows:
        return []
    device = rows[0].device
    sizes = [r.numel() for r in rows]
    packed = [packed_query_len(n, key_len, query_buckets) for n in sizes]
    # Padding queries copy their list's last row.
    qflat = torch.cat([x for r, n, q in zip(rows, sizes, packed) for x in (r, r[-1:].expand(q - n))])
    start_R, last_R = _flat_windows(lengths_B.to(device), num_rows, starts_BC)
    start, last = start_R.index_select(0, qflat), last_R.index_select(0, qflat)
    # One list: block_tables itself (the batched tables' bookkeeping costs more than
    # it saves for a single sequence).
    tables = ([block_tables(start, last, sizes[0], key_len)] if len(rows) == 1
              else _segment_block_tables(start, last, sizes, packed, key_len))
    return [PackedLayout(n, s, e, t) for n, s, e, t in zip(sizes, start.split(packed), last.split(packed), tables)]


def _flat_windows(lengths_B: torch.Tensor, num_rows: int,
                  starts_BC: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(start [B*C], last [B*C])``: the key window ``packed_layout`` gives a
    query of each flat row ``r = b*C + p``, ``last = min(r, b*C + lengths[b] - 1)``,
    ``start = b*C`` or, with ``starts_BC``, ``min(b*C + starts[b, p], last)``. Computed
    once per batch over its ``B*C`` rows; a step's queries gather theirs."""
    B = lengths_B.numel()
    base = (torch.arange(B, device=lengths_B.device) * num_rows)[:, None]
    row = base + torch.arange(num_rows, device=lengths_B.device)
    last = torch.minimum(row, base + lengths_B[:, None] - 1)
    if starts_BC is None:
        start = base.expand(B, num_rows)
    else:
        start = torch.minimum(base + starts_BC.to(lengths_B.device), last)
    return start.flatten(), last.flatten()


def _offsets(sizes: list[int]) -> list[int]:
    """Exclusive prefix sums of ``sizes``: where each segment of a concatenation starts."""
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def _per_segment(values: list[list[int]], counts: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``[V, sum(counts)]``: row ``v`` holds ``values[v][s]`` repeated ``counts[s]``
    times (a per-segment constant for each element of a concatenation)."""
    per = torch.tensor(values, dtype=torch.int64, device=device)
    if len(counts) == 1:
        return per.expand(-1, counts[0])
    return per.repeat_interleave(torch.tensor(counts, device=device), dim=1, output_size=sum(counts))


def _split_rows(table: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """``table`` ``[sum(rows)]`` or ``[sum(rows), W]`` cut into consecutive pieces of
    ``rows[s]`` rows, each viewed as ``[1, 1, rows[s]]`` / ``[1, 1, rows[s], W]`` with a
    contiguous tensor's strides."""
    return [x.view(1, 1, *x.shape) for x in table.split(rows)]


def _segment_block_tables(start: torch.Tensor, last: torch.Tensor, sizes: list[int], packed: list[int],
                          key_len: int) -> list[tuple[torch.Tensor, ...]]:
    """``block_tables`` of several packed query sequences at once: ``start, last``
    int64 ``[sum_s Qp_s]`` their windows concatenated (each non-decreasing within its
    sequence), ``sizes[s]`` = N_s real queries of ``packed[s]`` = Qp_s. Returns each
    sequence's tables as ``block_tables`` does (views of shared buffers, same values,
    dtypes, shapes and strides).

    Query blocks never straddle two sequences (each Qp_s is a multiple of FLEX_BLOCK),
    so the query-major tables are one ``_range_lists`` over all blocks. The key-major
    ones need, per sequence and key block c, the counts of its block bounds at or
    below c (what ``_transposed_tables``' binary searches of sorted bounds find): one
    ``bincount`` of every bound, offset per sequence and bound kind, and a prefix sum
    give them for all sequences."""
    device = start.device
    S, NB = len(sizes), key_len // FLEX_BLOCK
    blocks = [q // FLEX_BLOCK for q in packed]
    active = [-(-n // FLEX_BLOCK) for n in sizes]
    W = NB + 2  # count bins per sequence and bound kind: bounds lie in [-1, NB]
    # Per block: its sequence's last real query (a global index), its sequence's end of
    # active blocks, and the bin offset of each bound kind (lo, full_lo: value + 1;
    # hi, full_hi: value + 2, counting "below c" as "at or below c - 1").
    cap, act_end, *bins = _per_segment(
        [[q + n - 1 for q, n in zip(_offsets(packed), sizes)], [m + a for m, a in zip(_offsets(blocks), active)]]
        + [[(kind * S + s) * W + shift for s in range(S)] for kind, shift in enumerate((1, 1, 2, 2))],
        blocks, device)
    g = torch.arange(sum(blocks), device=device)
    first = torch.minimum(g * FLEX_BLOCK, cap)
    final = torch.minimum(g * FLEX_BLOCK + FLEX_BLOCK - 1, cap)
    lo = start.index_select(0, first) // FLEX_BLOCK
    hi = torch.maximum(last.index_select(0, final) // FLEX_BLOCK, lo)
    full_lo = (start.index_select(0, final) + FLEX_BLOCK - 1) // FLEX_BLOCK
    full_hi = (last.index_select(0, first) + 1) // FLEX_BLOCK - 1
    if not _block_mask_takes_q_tables():
        kv = _range_lists(lo, hi, full_lo, full_hi, (g < act_end).long(), NB)
        return list(zip(*(_split_rows(t, blocks) for t in kv)))
    hits = torch.bincount((torch.stack([lo, full_lo, hi, full_hi]) + torch.stack(bins)).flatten(),
                          minlength=4 * S * W)
    at_most = hits.view(4, S, W).cumsum(2)[:, :, 1:NB + 1]
    # a, af clamped at the sequence's active blocks (as _transposed_tables); b, bf not.
    cut = torch.tensor([[[n] for n in active]] * 2 + [[[sum(blocks)]] * S] * 2, device=device)
    a, af, b, bf = torch.minimum(at_most, cut).view(4, S * NB)
    kv = (lo, hi, full_lo, full_hi, (g < act_end).long())
    q = (b, a - 1, bf, af - 1, (a > b).long())
    if all(m == NB for m in blocks):  # every table NB wide: one _range_lists for both
        both = _range_lists(*(torch.cat(x) for x in zip(kv, q)), NB)
        kv_t, q_t = zip(*(t.split([len(g), S * NB]) for t in both))
    else:
        widest = max(blocks)
        width = None if all(m == widest for m in blocks) else _per_segment(
            [blocks], [NB] * S, device).view(-1, 1).to(torch.int32)
        kv_t, q_t = _range_lists(*kv, NB), _range_lists(*q, widest, width)
        if width is not None:  # each sequence's first M_s columns, packed back to back
            keep = torch.arange(widest, device=device)[None] < width
            q_t = [q_t[0], q_t[1].masked_select(keep), q_t[2], q_t[3].masked_select(keep)]
    kv_tables = [_split_rows(t, blocks) for t in kv_t]
    q_nums = [_split_rows(t, [NB] * S) for t in (q_t[0], q_t[2])]
    q_lists = [[x.view(1, 1, NB, m) for x, m in zip(t.reshape(-1).split([NB * m for m in blocks]), blocks)]
               for t in (q_t[1], q_t[3])]
    return [(kv_tables[0][s], kv_tables[1][s], kv_tables[2][s], kv_tables[3][s],
             q_nums[0][s], q_lists[0][s], q_nums[1][s], q_lists[1][s]) for s in range(S)]


@functools.lru_cache(maxsize=1)
def _block_mask_takes_q_tables() -> bool:
    """Whether this torch's ``BlockMask`` constructor takes the key-major tables by name
    (2.5 and later do)."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    names = inspect.signature(BlockMask.__init__).parameters
    return all(n in names for n in ("seq_lengths", "q_num_blocks", "q_indices", "full_q_num_blocks",
                                    "full_q_indices", "BLOCK_SIZE", "mask_mod"))


def use_merge_kernel(q_NhD: torch.Tensor) -> bool:
    """Whether ``merge_diagonal`` runs the Triton kernel for these queries."""
    return (q_NhD.is_cuda
            and q_NhD.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not torch._C._functorch.is_functorch_wrapped_tensor(q_NhD))


def merge_diagonal(o_NhD: torch.Tensor, lse_Nh: torch.Tensor, q_NhD: torch.Tensor,
                   k_jNgd: torch.Tensor, v_jNgd: torch.Tensor, scale: float) -> torch.Tensor:
    """Add the diagonal keys of steps ``1..j`` to causal attention outputs: ``o`` and
    ``lse`` (natural log-sum-exp of the scaled scores) over the step-0 keys, merged
    with each row's own keys ``k_jNgd, v_jNgd`` by log-sum-exp (fp32 math, output in
    ``q``'s dtype; GQA by broadcasting, nothing is repeated). ``[N, h, d]``.

    On CUDA (bf16/fp16/fp32) one Triton kernel each way (``kernels.merge``: nothing
    ``[N, h, j]``-sized is stored); elsewhere its PyTorch twin
    ``kernels.merge.merge_diagonal_naive``, which callers with
    ``compile_elementwise`` off call directly (``merge_diagonal_as``)."""
    if use_merge_kernel(q_NhD):
        return merge_kernel.merge_diagonal(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)
    return merge_kernel.merge_diagonal_naive(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)


def merge_diagonal_as(fused: bool):
    """The diagonal merge a caller's ``compile_elementwise`` asks for: ``merge_diagonal``
    (the Triton kernel on CUDA) when ``fused``, else always the PyTorch twin. Both take
    ``(o, lse, q, k, v, scale)``."""
    return merge_diagonal if fused else merge_kernel.merge_diagonal_naive


def merge_blocks(o: torch.Tensor, lse: torch.Tensor, o_t: torch.Tensor,
                 lse_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions by log-sum-exp (the flex path's): ``o [N, h, d]``
    (any dtype) with natural log-sum-exp ``lse [N, h]`` (fp32; ``-inf``: the row saw no
    key there). The weights are fp32 ``[N, h]``, the weighted sum is in ``o``'s dtype
    (as the eager merge), so nothing ``[N, h, d]``-sized is kept in fp32. NaN-free when both are
    ``-inf`` (the result is 0 with ``-inf``); the shift by the larger ``lse`` is a
    constant of the maths, so it carries no gradient. Returns the merged ``(o, lse)``."""
    top = torch.maximum(lse, lse_t).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w, w_t = torch.exp(lse - top), torch.exp(lse_t - top)
    denom = w + w_t
    seen = denom > 0
    safe = torch.where(seen, denom, torch.ones_like(denom))
    out = (w / safe).to(o.dtype)[..., None] * o + (w_t / safe).to(o.dtype)[..., None] * o_t
    return out, torch.where(seen, top + torch.log(safe), torch.full_like(top, -math.inf))


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
    from torch.nn.attention.flex_attention import flex_attention

    if return_lse and diagonal is not None:
        raise ValueError("return_lse is for the step-0 keys alone: merge the diagonal keys "
                         "after the blocks (merge_diagonal)")

    N, h, d = q_NhD.shape
    K, V = keys
    Lp = K.shape[2]
    if N == 0:
        empty = q_NhD.new_zeros(N, h, d)
        return (empty, q_NhD.new_zeros(N, h, dtype=torch.float32)) if return_lse else empty
    if layout is None:
        layout = packed_layout(rows_N, lengths_B, num_rows, Lp, query_buckets, starts_BC)
    elif layout.num_queries != N:
        raise ValueError(f"the layout is for {layout.num_queries} query rows but q has {N}: "
                         "pass the layout of this step's rows (plan_steps)")
    start, last = layout.start, layout.last
    Qp = start.shape[0]
    backend = compile_backend(q_NhD.device)
    if backend is not None and start.storage_offset() + last.storage_offset():
        # Slices of the layout's one buffer: dynamo guards a captured tensor's storage
        # offset against other sizes, which a later batch breaks (one recompilation);
        # own copies (Qp int64 each) start at offset 0.
        start, last = start.clone(), last.clone()

    def mask_mod(b, head, q_idx, kv_idx):
        return (kv_idx >= start[q_idx]) & (kv_idx <= last[q_idx])

    block_mask = packed_block_mask(start, last, N, Lp, mask_mod, tables=layout.tables)
    Q = pack_queries(q_NhD, Qp) if q_packed is None else q_packed
    attend = flex_attention if backend is None else compiled_flex(backend)
    if backend is not None:
        _dynamic_lengths(Q, K, V, block_mask)
    scale = 1.0 / math.sqrt(d)
    out, aux = attend(Q, K, V, block_mask=block_mask, scale=scale, enable_gqa=h != K.shape[1],
                      kernel_options=flex_kernel_options(q_NhD.device, kernel_options), **_LSE)
    lse = getattr(aux, "lse", aux)
    o = out[0, :, :N].transpose(0, 1)
    if return_lse:
        return o, lse[0, :, :N].transpose(0, 1)
    if diagonal is None:
        return o
    return merge_diagonal_as(fused)(o, lse[0, :, :N].transpose(0, 1), q_NhD, *diagonal, scale)


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
    return F.pad(q_NhD, (0, 0, 0, 0, 0, num_packed - q_NhD.shape[0])).transpose(0, 1)[None].contiguous()


def is_flex_path(attention: AttentionImpl, attend, features: Features) -> bool:
    """Whether the steps' attention is the one-rank packed FlexAttention."""
    return attend is None and (attention == "flex" or (attention == "auto" and features.aux.is_cuda))


def row_attention(config: TTTConfig, attend, features: Features, valid_BC: torch.Tensor,
                  k0: torch.Tensor, v0: torch.Tensor, layouts=None):
    """``run(q [N, h, d], rows_N | None, diagonal, j) -> [N, h, d]``: step j's attention
    for the queries of some flat rows (``None``: every row, in order) over the step-0
    keys ``k0, v0`` ``[B*C, g, d]`` and each row's own keys of steps ``1..j``
    (``diagonal = (k, v)``, each ``[j, N, g, d]`` aligned with the rows; None at j = 0).

    The one-rank FlexAttention path (``config.attention="flex"``, or ``auto`` on CUDA)
    packs the queries (``packed_flex_attention`` with the config's kernel options,
    query buckets and merge; ``layouts[j]`` from ``layout.plan_steps`` when given,
    else built per step). Otherwise the queries are placed in zero
    ``[B, h, C, d]`` tensors for ``attend`` (``Collectives.attend`` under sequence
    parallelism, else ``eager_attention``), whose other rows' outputs are dropped.
    A packed batch (``features.positions``) keeps each query in its document on the
    one-rank paths (``align.document_starts``)."""
    B, C = valid_BC.shape
    packed = attend is None and features.positions is not None  # one rank: documents bound the keys
    starts = document_starts(features.positions[:, :C]) if packed else None
    if is_flex_path(config.attention, attend, features):
        keys, lengths = packed_keys(k0, v0), valid_BC.sum(1)
        every = torch.arange(B * C, device=k0.device)
        options = dict(kernel_options=config.flex_kernel_options, query_buckets=config.query_buckets,
                       fused=config.compile_elementwise, starts_BC=starts)
        return lambda q, rows, diagonal, j: packed_flex_attention(  # noqa: E731
            q, every if rows is None else rows, keys, diagonal, lengths, C,
            None if layouts is None else layouts[j], **options)
    if attend is None:
        attend = eager_attention if starts is None else functools.partial(eager_attention, starts_BC=starts)
    as_B = lambda x: x.view(B, C, *x.shape[1:]).transpose(1, 2)  # noqa: E731 - [B, n, C, d]

    def dense(x, rows):
        return as_B(x if rows is None else x.new_zeros(B * C, *x.shape[1:]).index_copy(0, rows, x))

    def run(q, rows, diagonal, j):
        own = [] if diagonal is None else zip(*diagonal)
        keys = [(as_B(k0), as_B(v0))] + [(dense(k, rows), dense(v, rows)) for k, v in own]
        out = attend(dense(q, rows), keys, valid_BC).transpose(1, 2).flatten(0, 1)
        return out if rows is None else out[rows]
    return run
