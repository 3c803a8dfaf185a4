"""The packed FlexAttention queries of one step and their block tables (SPEC section 3,
the flex path of ``unrolled.attention``): which step-0 keys each packed query sees,
and the BlockMask listing the key blocks of those windows, planned without a dense
mask.

Legend: B batch, C own rows per sample, N query rows of a step (sorted flat rows
``b*C + p``), Lp = ``B*C`` flat keys rounded up to FLEX_BLOCK, Qp packed query rows
(``packed_query_len``), R rows of a block table, W its width, S packed sequences
planned at once (``packed_layouts``).

Query ``i`` of a step sees the flat step-0 keys ``start[i]..last[i]``: its sample's
keys up to itself, capped at the sample's last real row, from its document's start in
a packed batch (SPEC 9). Windows are non-decreasing in ``i``, so each query block's
keys are one range (full blocks inside every query's window, partial ones at the
edges) and each key block's queries too (the backward's key-major tables).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from eagle3fn.unrolled.config import DEFAULT_QUERY_BUCKETS

FLEX_BLOCK = 128
"""FlexAttention's block size, in rows, for queries and keys alike."""

MIN_FLEX_BLOCKS = 2
"""The fewest FLEX_BLOCKs of a packed query or key length: dynamo specialises sizes 0
and 1, so one block would compile a graph of its own (``eagle3fn.compiled``)."""


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

