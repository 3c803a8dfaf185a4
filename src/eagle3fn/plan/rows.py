"""The row model: which rows one rank computes at each step (SPEC section 6), as
counts, from a real row map of a synthetic mask or in closed form.

Legend: S sequence length, B batch, sp sequence-parallel degree, C own rows per
sample on one rank, T local buffer, k TTT length, n_j loss rows of step j, m_j
computed rows of step j, U teacher positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3fn.plan.args import PlanArgs
from eagle3fn.rowmap import build_rowmap
from eagle3fn.unrolled import FLEX_BLOCK, auto_trim, computed_rows, packed_block_mask, packed_query_len

ROWMAP_MAX_POSITIONS = 1 << 16
"""Up to this many buffer positions per rank (B*T) the rows come from a real
``build_rowmap`` on a synthetic mask; beyond it from closed-form counts."""


@dataclass(frozen=True)
class Rows:
    """Which rows one rank computes at each step (SPEC section 6), as counts.

    Fields:
        rank: the sequence-parallel rank planned (the one with the highest peak).
        trim: the trim mode this rank runs (``auto`` resolved).
        loss_rows: ``[k]``, n_j = ``|rows_j|`` summed over the batch.
        layer_rows: ``[k]``, rows whose layer output step j computes (``B*C`` without
            backbone trimming, ``|computed_rows_j|`` with it).
        kv_rows: rows whose step-0 keys/values are computed (always ``B*C``).
        teacher_positions: U, rows of the teacher table (``B*T`` under ``trim="none"``).
        attention_blocks: ``[k]``, 128x128 blocks FlexAttention computes at step j: the
            partial + full blocks of ``unrolled.packed_block_mask`` for the ``m_j`` packed
            queries (only their ``ceil(m_j/128)`` query blocks are active).
        exact: counts from a real row map or exact interval maths (False: expected
            counts of the scattered pattern).
    """

    rank: int
    trim: str
    loss_rows: tuple[float, ...]
    layer_rows: tuple[float, ...]
    kv_rows: int
    teacher_positions: float
    attention_blocks: tuple[float, ...]
    exact: bool


def _tail_start(args: PlanArgs) -> int:
    """First supervised position of the tail pattern (as benchmarks/step.py draws it:
    ``pos >= int(S * (1 - density))``; ``align.supervised_mask`` drops ``S - 1``)."""
    return int(args.seq_len * (1 - args.density))


def synthetic_mask(args: PlanArgs, rank: int = 0) -> torch.Tensor:
    """The supervised mask the plan assumes on ``rank``: bool ``[B, T]`` over global
    positions ``[r*C, r*C + T)``, nothing at or past ``S - 1``. ``tail``: positions
    ``>= int(S*(1 - density))``; ``scattered``: ``rand < density`` from a CPU
    ``torch.Generator`` seeded 0 over the whole ``[B, S]``."""
    S, B, C, T = args.seq_len, args.batch, args.own_rows, args.buffer_len
    if args.pattern == "tail":
        glob = (torch.arange(S) >= _tail_start(args))[None].expand(B, S).clone()
    else:
        glob = torch.rand(B, S, generator=torch.Generator().manual_seed(0)) < args.density
    glob[:, S - 1:] = False
    out = torch.zeros(B, T, dtype=torch.bool)
    lo, hi = rank * C, min(rank * C + T, S)
    if hi > lo:
        out[:, : hi - lo] = glob[:, lo:hi]
    return out


def _packed_blocks(rows_N: torch.Tensor, C: int, real: int) -> float:
    """128x128 blocks FlexAttention computes for the packed queries of the sorted flat
    rows ``rows_N`` (``unrolled.packed_flex_attention``), by ``packed_block_mask``'s
    formula: each active query block (``ceil(N/128)`` of them) lists the key blocks
    from the sample start of its first row to the last visible key of its last row,
    partial and full together (``hi - lo + 1``); a sample holds ``real`` real rows."""
    N = rows_N.numel()
    if N == 0:
        return 0.0  # packed_flex_attention returns before FlexAttention
    first = rows_N[::FLEX_BLOCK]
    final = rows_N[(torch.arange(first.numel()) * FLEX_BLOCK + FLEX_BLOCK - 1).clamp(max=N - 1)]
    lo = (first // C * C) // FLEX_BLOCK
    last = torch.minimum(final, final // C * C + real - 1)
    hi = torch.maximum(last // FLEX_BLOCK, lo)
    return float((hi - lo + 1).sum())


def _mask_blocks(rows_N: torch.Tensor, B: int, C: int, real: int) -> float:
    """``_packed_blocks`` read off the real ``unrolled.packed_block_mask`` (partial +
    full blocks), with the query windows ``packed_flex_attention`` gives it (the
    default query buckets: the blocks of padding queries list nothing, so the count
    does not depend on them)."""
    N = rows_N.numel()
    if N == 0:
        return 0.0
    Lp = max(-(-B * C // FLEX_BLOCK), 1) * FLEX_BLOCK
    qflat = torch.cat([rows_N, rows_N[-1:].expand(packed_query_len(N, Lp) - N)])
    start = qflat // C * C
    mask = packed_block_mask(start, torch.minimum(qflat, start + real - 1), N, Lp, None)
    return float(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())


def _interval_rows(intervals, B: int, C: int) -> torch.Tensor:
    """Sorted flat rows ``b*C + p`` of every sample for own rows p in the closed
    ``intervals``."""
    own = [torch.arange(lo, hi + 1) for lo, hi in intervals if hi >= lo]
    p = torch.cat(own) if own else torch.zeros(0, dtype=torch.long)
    return (torch.arange(B)[:, None] * C + p[None]).flatten()


def _real_rows(args: PlanArgs, rank: int) -> int:
    """Own rows of ``rank`` that are real positions (the last rank may be padded)."""
    return max(0, min(args.own_rows, args.seq_len - rank * args.own_rows))


def _rows_from_rowmap(args: PlanArgs, rank: int, rm) -> tuple:
    """(loss rows, computed rows, flex blocks of the computed rows, U) from the real
    row map ``rm`` of ``synthetic_mask`` (blocks from the real ``packed_block_mask``)."""
    comp = computed_rows(rm)
    real = _real_rows(args, rank)
    blocks = tuple(_mask_blocks(c, args.batch, args.own_rows, real) for c in comp)
    return (tuple(float(r.numel()) for r in rm.rows), tuple(float(c.numel()) for c in comp),
            blocks, float(rm.teacher_positions.numel()))


def _limits(args: PlanArgs, rank: int) -> list[int]:
    """``L_j``: the largest own row p whose step-j teacher ``p + j`` can be supervised
    on ``rank`` (inside the buffer, at most global ``S - 2``); negative when none."""
    C, T, o = args.own_rows, args.buffer_len, rank * args.own_rows
    return [min(C - 1, T - 1 - j, args.seq_len - 2 - o - j) for j in range(args.ttt_length)]


def _merge(intervals) -> list[tuple[int, int]]:
    """Union of closed integer intervals, as disjoint sorted intervals."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(iv for iv in intervals if iv[1] >= iv[0]):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _rows_from_counts(args: PlanArgs, rank: int) -> tuple:
    """``_rows_from_rowmap``'s counts in closed form: exact interval maths for ``tail``,
    expectations for ``scattered`` (row p is needed from step j on with probability
    ``1 - (1-q)^v``, v the steps ``>= j`` whose teacher of p can be supervised; the
    flex blocks of rows placed at the quantiles of that expected density)."""
    B, C, k, o = args.batch, args.own_rows, args.ttt_length, rank * args.own_rows
    L = _limits(args, rank)
    real = _real_rows(args, rank)
    s_hi = min(args.buffer_len - 1, args.seq_len - 2 - o, C + k - 2)
    if args.pattern == "tail":
        a = _tail_start(args)
        span = [(max(0, a - o - j), L[j]) for j in range(k)]
        comp = [_merge(span)] + [_merge(span[j:]) for j in range(1, k)]
        size = lambda iv: float(B * sum(hi - lo + 1 for lo, hi in iv))  # noqa: E731
        blocks = tuple(_packed_blocks(_interval_rows(iv, B, C), C, real) for iv in comp)
        U = float(B * max(0, s_hi - max(a - o, 0) + 1))
        return tuple(size(_merge([span[j]])) for j in range(k)), tuple(size(iv) for iv in comp), blocks, U
    q = args.density
    p = torch.arange(max(C, 0))

    def expected(j0: int) -> tuple[float, float]:
        steps = (p[:, None] <= torch.tensor(L[j0:])[None]).sum(1)  # v of each own row
        density = 1 - (1 - q) ** steps.double()
        cumulative = density.cumsum(0)
        n = round(float(cumulative[-1])) if C else 0
        at = torch.searchsorted(cumulative, torch.arange(n, dtype=torch.float64) + 0.5)
        flat = (torch.arange(B)[:, None] * C + at[None]).flatten()
        return B * float(density.sum()), _packed_blocks(flat, C, real)

    loss = tuple(B * q * max(0, L[j] + 1) for j in range(k))
    comp = [expected(j) for j in range(k)]
    return loss, tuple(c for c, _ in comp), tuple(b for _, b in comp), float(B * q * max(0, s_hi + 1))


def plan_rows(args: PlanArgs, rank: int = 0) -> Rows:
    """The rows ``rank`` computes at each step under ``args.trim`` (``auto`` resolved as
    ``unrolled.choose_trim`` resolves it for this rank's row map: ``unrolled.auto_trim``
    on its counts)."""
    B, C, T, k = args.batch, args.own_rows, args.buffer_len, args.ttt_length
    if not 0 <= rank < args.sp:
        raise ValueError(f"rank must be in [0, sp={args.sp}), got {rank}")
    if B * T <= ROWMAP_MAX_POSITIONS:
        rowmap = build_rowmap(synthetic_mask(args, rank), k, num_rows=C)
        loss, computed, blocks, U = _rows_from_rowmap(args, rank, rowmap)
        exact = True
    else:
        loss, computed, blocks, U = _rows_from_counts(args, rank)
        exact = args.pattern == "tail"
    trim = args.trim if args.trim != "auto" else auto_trim(
        B * C, k, sum(computed), sum(loss), args.auto_min_rows, args.auto_backbone_fraction,
        args.auto_loss_share)
    if trim != "backbone":  # every row's query, at every step
        computed = (float(B * C),) * k
        blocks = (_packed_blocks(torch.arange(B * C), C, _real_rows(args, rank)),) * k
    if trim == "none":
        U = float(B * T)
    return Rows(rank=rank, trim=trim, loss_rows=loss, layer_rows=computed, kv_rows=B * C,
                teacher_positions=U, attention_blocks=blocks, exact=exact)
