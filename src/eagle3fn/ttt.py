"""Training-time test (SPEC section 3): the draft unrolled k steps, as a function of
stateless parameters.

Legend: B batch, T local buffer length, C own rows per sample, k TTT length, H draft
hidden, h heads, g kv heads, d head dim, V target vocab, Vd draft vocab, U teacher
positions, n_j rows of step j.

Step j, row p: input token ``ids'[p + j]``, input feature ``fc(a_p)`` at j = 0 and the
previous step's pre-norm output after; queries and keys at RoPE position
``pos[p] + j``; keys are the causal step-0 keys plus the row's own keys of steps
``1..j``; the teacher sits at ``s = p + j``.

``trim="none"`` is the full-length path (SpecForge/EAGLE semantics): a teacher at
every position, logits for every row, every row's loss masked. ``trim="loss"``
builds the teacher only at the U supervised positions and computes the draft norm,
lm_head, loss and metrics only at ``rows_j``; the backbone still runs every row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F

from eagle3fn.align import shift_left
import eagle3fn.draft as draft_module
from eagle3fn.draft import (DraftConfig, Eagle3Draft, apply_rope, apply_rope_pair, head_logits,
                            norm_pair, rope_cos_sin, swiglu)
from eagle3fn.kernels import merge as merge_kernel
from eagle3fn.loss import LossConfig, head_step_terms, objective, step_terms
from eagle3fn.shapes import Features, Objective, RowMap, StepTerms, TeacherTable
from eagle3fn.teacher import DEFAULT_CHUNK_SIZE, teacher_table_from_hidden, teacher_table_from_logits

Trim = Literal["none", "loss", "backbone", "auto"]
LossImpl = Literal["auto", "torch", "triton"]
AttentionImpl = Literal["auto", "eager", "flex"]
FLEX_BLOCK = 128


@dataclass(kw_only=True, frozen=True)
class TTTConfig:
    """The unrolled objective: draft shape, TTT length, trimming, loss."""

    draft: DraftConfig
    """The draft's sizes and toggles."""
    ttt_length: int = 7
    """k, the number of unrolled steps."""
    trim: Trim = "loss"
    """``none``: every row at every step (reference semantics). ``loss``: teacher,
    head, loss and metrics only at the supervised rows of each step (exact).
    ``backbone``: also the layer itself only where a loss needs it: step 0 computes
    keys/values for every row and the rest for ``rows_0 | backbone_rows_1``, step
    ``j >= 1`` only ``backbone_rows_j`` (SPEC section 6; exact). ``auto``: per batch,
    ``backbone`` when the batch has at least ``auto_min_rows`` rows and its cost
    score (the rows the trimmed layer computes and the supervised rows, weighted by
    ``auto_loss_share``) is at most ``auto_backbone_fraction``, else ``none``
    (``choose_trim``)."""
    auto_backbone_fraction: float = 0.85
    """``trim="auto"``: the largest cost score at which the trimmed backbone still
    beats the full path. The score is ``(1 - w) * f + w * d`` with ``f`` the fraction of
    the ``k*B*C`` layer rows the trimmed path computes, ``d`` the fraction that is
    supervised (``sum_j n_j / (k*B*C)``) and ``w = auto_loss_share``; for tail
    supervision ``f ~ d`` (``f`` exceeds it by ``k(k-1)/2`` rows per sample) and the
    score is about the density. Calibrated on an H200 at 8B shapes (docs/benchmarks.md,
    sessions 7 and 8): at 8192 tail backbone against none was 0.80x at 0.6, 0.99x at
    0.8 and 1.07x at 0.9, and 1.12-1.15x at 1.0 (100% density, at 2048, 8192 and
    32768)."""
    auto_loss_share: float = 0.45
    """``trim="auto"``: ``w``, the share of the trimmed path's variable cost that goes
    with the supervised rows (head, loss, the queries' attention) rather than with
    every computed layer row. Scattered supervision computes many more layer rows than
    it supervises (at 60%: f = 0.91, d = 0.6), and there the trimmed path still wins
    (backbone/none 0.93-0.94x at 8192 and 32768, sessions 7 and 8). A least-squares
    fit of ``ratio = c + a*f + b*d`` over 19 measured (f, d) points at 8192 and 32768
    gave ``b / (a + b) = 0.46`` and the tail crossing ``(1 - c) / (a + b) = 0.84``. 0
    decides on the computed rows alone (the session-7 rule)."""
    auto_min_rows: int = 4096
    """``trim="auto"``: a batch with fewer own rows (``B*C`` on this rank) takes the
    full path whatever its density. Short steps are bound by kernel launches on the
    host, and the trimmed path launches more kernels (H200, 8B shapes: at S=1024
    ``none`` beat ``backbone`` at 10-60% tail density by 16-52%; at 2048 ``backbone``
    was 0.8-0.99x ``none`` at 10-60% tail but 1.08-1.20x at 45-60% scattered; at 8192
    and above it wins at every fraction up to 0.8)."""
    attention: AttentionImpl = "auto"
    """``eager``: explicit scores, exact on any device (the CPU path). ``flex``:
    compiled FlexAttention of the packed query rows over the step-0 keys with a
    block-sparse causal mask, the diagonal keys merged by log-sum-exp
    (``packed_flex_attention``; the GPU path, no backward on CPU). ``auto``: flex on
    CUDA, else eager."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Step weights, normalisation and objective kind."""
    loss_impl: LossImpl = "auto"
    """Soft cross-entropy and metrics: ``torch`` (reference), ``triton`` (indexed
    kernels, any Vd), ``auto`` (triton on CUDA, torch elsewhere)."""
    fused_head: bool = True
    """Trimmed paths: run norm + lm_head + loss in row chunks and recompute the
    logits in backward instead of keeping ``[n_j, Vd]`` (``loss.head_step_terms``)."""
    head_chunk_rows: int = 4096
    """Most rows per chunk of the fused head; a chunk also holds at most
    ``HEAD_CHUNK_LOGITS`` logits (``fused_head_chunk``: 4096 rows at Vd 32000, 512 at
    262144). Each chunk costs a few dozen launches forward and backward: at 8192 /
    30% on the H200, 4096 rows instead of 2048 took the step from 1553 to 1217
    launches at the same peak (docs/benchmarks.md)."""
    teacher_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Vocab entries per block when the teacher is streamed from the final hidden."""

    def __post_init__(self) -> None:
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if self.trim not in ("none", "loss", "backbone", "auto"):
            raise ValueError(f"trim must be 'none', 'loss', 'backbone' or 'auto', got {self.trim!r}")
        if self.loss_impl not in ("auto", "torch", "triton"):
            raise ValueError(f"loss_impl must be 'auto', 'torch' or 'triton', got {self.loss_impl!r}")
        if self.attention not in ("auto", "eager", "flex"):
            raise ValueError(f"attention must be 'auto', 'eager' or 'flex', got {self.attention!r}")
        if not math.isfinite(self.auto_backbone_fraction):
            raise ValueError(f"auto_backbone_fraction must be a finite number (below 0: never "
                             f"backbone, 1 or more: always), got {self.auto_backbone_fraction}")
        if not 0.0 <= self.auto_loss_share <= 1.0:
            raise ValueError(f"auto_loss_share must be in [0, 1] (0: decide on the computed rows "
                             f"alone), got {self.auto_loss_share}")
        if self.auto_min_rows < 0:
            raise ValueError(f"auto_min_rows must be >= 0, got {self.auto_min_rows}")


HEAD_CHUNK_LOGITS = 2**27
"""Most logits one fused-head chunk holds (256 MiB in bf16; its gradient as much in
backward)."""


def fused_head_chunk(head_chunk_rows: int, draft_vocab: int) -> int:
    """Rows per chunk of the fused head: ``head_chunk_rows``, fewer for large draft
    vocabularies so that a chunk holds at most ``HEAD_CHUNK_LOGITS`` logits (at least
    one row)."""
    return max(1, min(head_chunk_rows, HEAD_CHUNK_LOGITS // draft_vocab))


@dataclass(frozen=True)
class Collectives:
    """What a distributed run plugs into ``ttt`` (built by ``eagle3fn.parallel``; this
    module never imports ``torch.distributed``).

    Fields:
        attend: ``(q [B, h, C, d], keys, valid [B, C]) -> [B, h, C, d]``, the EAGLE-3
            attention of one step with the step-0 keys of every earlier rank of the
            sequence (``eager_attention``'s contract, keys spanning ranks).
        reduce_terms: per-step ``StepTerms`` -> the same with every field summed over all
            ranks in value, while gradients flow only to this rank's sums.
        denominator: the ``local_mean`` divisor ``sum over ranks of B*C``.
        loss_scale: multiplies this rank's loss sums before the reduction under
            ``local_mean`` (``parallel.collectives``: data-parallel groups of unequal
            ``B*C`` average their own means, SPEC 5); 1 for one group.
        gated: ``[k]`` the ``token_mean`` divisors (and those of ``accept`` and the
            ``alpha`` objective) when they span more than this batch: the gated rows of
            every micro-batch of a gradient-accumulation step (``gated_counts``), summed
            over ranks. None: this batch's own, reduced over ranks.
    """

    attend: Callable[[torch.Tensor, list, torch.Tensor], torch.Tensor] | None
    reduce_terms: Callable[[Sequence[StepTerms]], list[StepTerms]]
    denominator: int | torch.Tensor
    loss_scale: float | torch.Tensor = 1.0
    gated: torch.Tensor | None = None


@functools.lru_cache(maxsize=8)
def skeleton(cfg: DraftConfig) -> Eagle3Draft:
    """A parameter-free ``Eagle3Draft`` (on ``meta``) for ``functional_call``."""
    with torch.device("meta"):
        return Eagle3Draft(cfg)


def eager_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                    valid_BC: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 TTT attention at step ``j = len(keys) - 1``, exact.

    Args:
        q: ``[B, h, C, d]`` queries of step j (RoPE applied).
        keys: j + 1 pairs ``(k, v)`` of ``[B, g, C, d]``; pair 0 is step 0 (causal
            context), pair ``i >= 1`` the row's own keys of step i (diagonal).
        valid_BC: bool ``[B, C]``, real (non-padded) key positions.

    Returns:
        ``[B, h, C, d]``. Scores in the input dtype, softmax in fp32 (fp64 for fp64).
    """
    B, h, C, d = q.shape
    rep = h // keys[0][0].shape[1]
    expand = lambda x: x.repeat_interleave(rep, dim=1)  # noqa: E731
    scale = 1.0 / math.sqrt(d)
    k0, v0 = expand(keys[0][0]), expand(keys[0][1])
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & valid_BC[:, None, None, :]
    scores = (q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    diag = [((q * expand(k)).sum(-1) * scale)[..., None] for k, _ in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1),
                          dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    out = probs[..., :C] @ v0
    for i, (_, v) in enumerate(keys[1:]):
        out = out + probs[..., C + i, None] * expand(v)
    return out


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Every torch.compile(flex_attention) in the process (other libraries' too) shares
    # one recompile budget; past it dynamo silently runs the unfused O(S^2)-memory
    # path. Each (length, dtype) needs its own kernel, so allow more than the default.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


FLEX_KERNEL_OPTIONS: dict | None = None
"""``kernel_options`` passed to FlexAttention on CUDA (block sizes, warps, stages; see
``torch.nn.attention.flex_attention.FlexKernelOptions``). ``None``: inductor's defaults
for the device. ``benchmarks/attention.py --kernel-options`` sweeps it (on the H200 at
8B shapes no setting beat the defaults: docs/benchmarks.md, session 7)."""


def flex_kernel_options(device: torch.device) -> dict | None:
    """A copy of ``FLEX_KERNEL_OPTIONS`` for a FlexAttention call on ``device`` (CUDA
    only; ``None`` elsewhere or when unset)."""
    return dict(FLEX_KERNEL_OPTIONS) if device.type == "cuda" and FLEX_KERNEL_OPTIONS else None


def packed_keys(k_Ngd: torch.Tensor, v_Ngd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-0 keys/values ``[B*C, g, d]`` (flat rows) as FlexAttention inputs
    ``[1, g, Lp, d]``, ``Lp`` = ``B*C`` rounded up to FLEX_BLOCK (zeros past it, never
    read). Built once per batch and shared by every step."""
    BC = k_Ngd.shape[0]
    Lp = _key_len(BC)
    prep = lambda x: F.pad(x, (0, 0, 0, 0, 0, Lp - BC)).transpose(0, 1)[None].contiguous()  # noqa: E731
    return prep(k_Ngd), prep(v_Ngd)


QUERY_BUCKETS = 8
"""Packed query lengths are rounded up to a multiple of ``Lp / QUERY_BUCKETS`` (in
FLEX_BLOCK units): at most this many compiled FlexAttention kernels per key length,
and query/output tensors at most ``Lp / QUERY_BUCKETS`` rows longer than needed."""


def packed_query_len(num_queries: int, key_len: int) -> int:
    """The packed query length for ``num_queries`` rows over ``key_len`` keys (a multiple
    of FLEX_BLOCK, at least one block, at most ``key_len``; see QUERY_BUCKETS)."""
    unit = -(-key_len // (QUERY_BUCKETS * FLEX_BLOCK)) * FLEX_BLOCK
    return min(key_len, max(-(-num_queries // unit), 1) * unit)


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
    computed (``_plan_steps`` builds them on the host)."""
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


def _key_len(num_flat_rows: int) -> int:
    """Lp: ``B*C`` flat keys rounded up to FLEX_BLOCK (at least one block)."""
    return max(-(-num_flat_rows // FLEX_BLOCK), 1) * FLEX_BLOCK


def packed_layout(rows_N: torch.Tensor, lengths_B: torch.Tensor, num_rows: int,
                  key_len: int) -> PackedLayout:
    """``PackedLayout`` of the sorted flat query rows ``rows_N`` (N >= 1) on their
    device: each query sees its sample's keys up to itself, capped at the sample's
    last real row (``lengths_B``, right padding)."""
    N = rows_N.numel()
    Qp = packed_query_len(N, key_len)
    qflat = torch.cat([rows_N, rows_N[-1:].expand(Qp - N)])  # padding queries copy the last
    sample = qflat // num_rows
    start = sample * num_rows
    last = torch.minimum(qflat, start + lengths_B.to(qflat.device)[sample] - 1)
    return PackedLayout(N, start, last, block_tables(start, last, N, key_len))


def _one_thread(fn):
    """Run ``fn`` with one intra-op CPU thread (``torch.set_num_threads``, the count
    restored after). The host index maths works on tensors of a few thousand
    rows, where an op that wakes a pool of OpenMP threads costs more than its work:
    on the H200 machine's host (16 threads, a VM) one ``searchsorted`` of 8192 rows took
    1.3 ms, and those of one 8192 / 30% step 55 ms of its ~170 ms host time."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        if before == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper


def _upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host, int32/int64) on ``device`` in one copy per dtype: packed into
    one pinned buffer, each segment starting at a 64-byte boundary (compiled kernels
    take them as inputs), sent with ``non_blocking``."""
    odd = {t.dtype for t in tensors} - {torch.int64, torch.int32}
    if odd:
        raise TypeError(f"_upload sends int32/int64 tensors only, got {sorted(map(str, odd))}")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in (torch.int64, torch.int32):
        mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        if not mine:
            continue
        align = 64 // torch.empty((), dtype=dtype).element_size()
        sizes = [-(-tensors[i].numel() // align) * align for i in mine]
        host = torch.zeros(sum(sizes), dtype=dtype, pin_memory=torch.cuda.is_available())
        offsets = [sum(sizes[:n]) for n in range(len(mine))]
        for i, o in zip(mine, offsets):
            host[o:o + tensors[i].numel()] = tensors[i].flatten()
        dev = host.to(device, non_blocking=True)
        for i, o in zip(mine, offsets):
            out[i] = dev[o:o + tensors[i].numel()].view(tensors[i].shape)
    return out


def _to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """int64 host copies of ``tensors`` in one download (one host sync when they live on
    a GPU; none when they are already on the host)."""
    sizes = [t.numel() for t in tensors]
    if not tensors:
        return []
    flat = torch.cat([t.to(torch.int64).flatten() for t in tensors]).cpu()
    return [x.view(t.shape) for x, t in zip(flat.split(sizes), tensors)]


def _host_layouts(rows: Sequence[torch.Tensor | None], lengths_B: torch.Tensor,
                  num_rows: int) -> list[PackedLayout | None]:
    """``packed_layout`` of each step's rows (host tensors; ``None``: every row), None
    for a step without rows. The every-row layout is built once and shared by the
    steps that use it (``trim`` none / loss: every step)."""
    Lp = _key_len(lengths_B.numel() * num_rows)
    every = None if all(r is not None for r in rows) else packed_layout(
        torch.arange(lengths_B.numel() * num_rows), lengths_B, num_rows, Lp)
    return [every if r is None else None if not r.numel()
            else packed_layout(r, lengths_B, num_rows, Lp) for r in rows]


def _distinct(layouts: Sequence[PackedLayout | None]) -> list[PackedLayout]:
    """The layouts, each shared one once (by identity), in order of first use."""
    return list({id(lay): lay for lay in layouts if lay is not None}.values())


def _layout_tensors(layouts: Sequence[PackedLayout | None]) -> list[torch.Tensor]:
    """The tensors of the distinct layouts, in the order ``_rebuild_layouts`` takes them."""
    return [t for lay in _distinct(layouts) for t in (lay.start, lay.last, *lay.tables)]


def _rebuild_layouts(layouts: Sequence[PackedLayout | None], sent) -> list[PackedLayout | None]:
    """The layouts with their tensors taken in order from the iterator ``sent``
    (``_layout_tensors``' order); a layout shared by steps stays shared."""
    rebuilt = {id(lay): PackedLayout(lay.num_queries, next(sent), next(sent),
                                     tuple(next(sent) for _ in lay.tables))
               for lay in _distinct(layouts)}
    return [None if lay is None else rebuilt[id(lay)] for lay in layouts]


@dataclass(frozen=True)
class _StepPlan:
    """Index maths of one batch's unrolled steps, done on the host (``_plan_steps``).

    Fields:
        layouts: the flex path's ``PackedLayout`` per step (None: another attention).
        within: ``trim="backbone"``: per step ``j >= 1``, the positions of the computed
            rows of step j inside those of step ``j - 1`` (entry 0 None); else None.
        at: per step, the rows whose loss is taken, as positions in the step's output.
    """

    layouts: list | None
    within: list | None
    at: list


def _inside(outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """Positions of the sorted rows ``inner`` inside the sorted ``outer``. Clamped so a
    hand-made row map whose rows are not nested reads wrong rows (which the
    negative-control tests catch) instead of out of range."""
    return torch.searchsorted(outer, inner).clamp_max(max(outer.numel() - 1, 0))


def _sends_plan(device: torch.device) -> bool:
    """Whether ``_plan_steps`` uploads its host tensors (every device but the CPU; tests
    force it on the CPU to check the packing)."""
    return device.type != "cpu"


@_one_thread
def _plan_steps(rowmap: RowMap, trim: str, features: Features, flex: bool) -> _StepPlan:
    """The ``_StepPlan`` of a batch: on a GPU, the row lists it needs come down in one
    copy, and the layouts and positions go up in two, instead of a few dozen tiny
    kernels per step."""
    C = rowmap.num_rows
    device = features.aux.device
    computed = computed_rows(rowmap) if trim == "backbone" else None
    lengths = features.attention_mask[:, :C].sum(1)
    wanted = ([lengths] if flex else []) + (list(computed) + list(rowmap.rows) if computed else [])
    host = iter(_to_host(wanted))
    lengths_h = next(host) if flex else None
    layouts = within = None
    at = list(rowmap.rows)
    if computed is not None:
        comp_h = [next(host) for _ in computed]
        rows_h = [next(host) for _ in rowmap.rows]
        within = [None] + [_inside(a, b) for a, b in zip(comp_h, comp_h[1:])]
        at = [_inside(c, r) for c, r in zip(comp_h, rows_h)]
    if flex:
        layouts = _host_layouts(comp_h if computed is not None else [None] * rowmap.ttt_length,
                                lengths_h, C)
    if not _sends_plan(device):
        return _StepPlan(layouts, within, at)
    moved = (_layout_tensors(layouts) if flex else []) + (
        [w for w in within[1:]] + at if computed is not None else [])
    sent = iter(_upload(moved, device))
    if flex:
        layouts = _rebuild_layouts(layouts, sent)
    if computed is not None:
        within = [None] + [next(sent) for _ in within[1:]]
        at = [next(sent) for _ in at]
    return _StepPlan(layouts, within, at)


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
    return (draft_module.COMPILE_ELEMENTWISE and q_NhD.is_cuda
            and q_NhD.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not torch._C._functorch.is_functorch_wrapped_tensor(q_NhD))


def merge_diagonal(o_NhD: torch.Tensor, lse_Nh: torch.Tensor, q_NhD: torch.Tensor,
                   k_jNgd: torch.Tensor, v_jNgd: torch.Tensor, scale: float) -> torch.Tensor:
    """Add the diagonal keys of steps ``1..j`` to causal attention outputs: ``o`` and
    ``lse`` (natural log-sum-exp of the scaled scores) over the step-0 keys, merged
    with each row's own keys ``k_jNgd, v_jNgd`` by log-sum-exp (fp32 math, output in
    ``q``'s dtype; GQA by broadcasting, nothing is repeated). ``[N, h, d]``.

    On CUDA (bf16/fp16/fp32, unless ``EAGLE3FN_COMPILE=0``) one Triton kernel each way
    (``kernels.merge``: nothing ``[N, h, j]``-sized is stored); elsewhere its PyTorch
    twin ``merge_diagonal_naive``."""
    if use_merge_kernel(q_NhD):
        return merge_kernel.merge_diagonal(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)
    return merge_kernel.merge_diagonal_naive(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)


def packed_flex_attention(q_NhD: torch.Tensor, rows_N: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor],
                          diagonal: tuple[torch.Tensor, torch.Tensor] | None, lengths_B: torch.Tensor,
                          num_rows: int, layout: PackedLayout | None = None, return_lse: bool = False,
                          q_packed: torch.Tensor | None = None):
    """EAGLE-3 TTT attention for the queries of flat rows ``rows_N`` only, by FlexAttention
    (the one-rank GPU path of every trim mode).

    The N queries are packed at the front of one query sequence of
    ``packed_query_len(N, Lp)`` rows, so FlexAttention visits only
    ``ceil(N / FLEX_BLOCK)`` query blocks whether the rows are contiguous or scattered,
    keeps query/output tensors of about N rows, and the shapes (hence the compiled
    kernels) take at most QUERY_BUCKETS values per ``B*C``. Query ``i`` (row ``b*C + p``) sees the flat step-0 keys ``b*C .. b*C + p``
    (capped at the sample's last real row); the diagonal keys are merged afterwards by
    log-sum-exp (``merge_diagonal``), so no key is ever copied per step.

    Args:
        q_NhD: ``[N, h, d]`` queries (RoPE applied) of ``rows_N`` (sorted flat rows).
        keys: ``packed_keys`` of the step-0 keys/values.
        diagonal: ``(k, v)``, each ``[j, N, g, d]``: every row's own keys of steps
            ``1..j``, aligned with ``rows_N`` (None at step 0).
        lengths_B: int ``[B]`` real rows per sample (right padding).
        num_rows: C.
        layout: ``packed_layout(rows_N, lengths_B, num_rows, Lp)``, when already built
            (``_plan_steps`` plans every step on the host); else built here.

        return_lse: also return the natural log-sum-exp ``[N, h]`` (fp32) of each
            row's scaled scores over its keys (``-inf`` where it sees none); only with
            ``diagonal=None`` (the sequence-parallel ring merges blocks by it).
        q_packed: ``q_NhD`` already laid out as FlexAttention's query ``[1, h, Qp, d]``
            (``pack_queries``): a caller attending the same queries to several key
            blocks pads them once, and autograd keeps one copy.

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
        layout = packed_layout(rows_N, lengths_B, num_rows, Lp)
    elif layout.num_queries != N:
        raise ValueError(f"the layout is for {layout.num_queries} query rows but q has {N}: "
                         "pass the layout of this step's rows (_plan_steps)")
    start, last = layout.start, layout.last
    Qp = start.shape[0]

    def mask_mod(b, head, q_idx, kv_idx):
        return (kv_idx >= start[q_idx]) & (kv_idx <= last[q_idx])

    block_mask = packed_block_mask(start, last, N, Lp, mask_mod, tables=layout.tables)
    Q = pack_queries(q_NhD, Qp) if q_packed is None else q_packed
    attend = _compiled_flex() if q_NhD.is_cuda else flex_attention
    scale = 1.0 / math.sqrt(d)
    out, lse = attend(Q, K, V, block_mask=block_mask, scale=scale, enable_gqa=h != K.shape[1],
                      return_lse=True, kernel_options=flex_kernel_options(q_NhD.device))
    o = out[0, :, :N].transpose(0, 1)
    if return_lse:
        return o, lse[0, :, :N].transpose(0, 1)
    if diagonal is None:
        return o
    return merge_diagonal(o, lse[0, :, :N].transpose(0, 1), q_NhD, *diagonal, scale)


def pack_queries(q_NhD: torch.Tensor, num_packed: int) -> torch.Tensor:
    """``[N, h, d]`` queries as FlexAttention's ``[1, h, Qp, d]`` (zeros past N)."""
    return F.pad(q_NhD, (0, 0, 0, 0, 0, num_packed - q_NhD.shape[0])).transpose(0, 1)[None].contiguous()


def _flex_path(attention: AttentionImpl, attend, features: Features) -> bool:
    """Whether the steps' attention is the one-rank packed FlexAttention."""
    return attend is None and (attention == "flex" or (attention == "auto" and features.aux.is_cuda))


def _row_attention(attention: AttentionImpl, attend, features: Features, valid_BC: torch.Tensor,
                   k0: torch.Tensor, v0: torch.Tensor, layouts=None):
    """``run(q [N, h, d], rows_N | None, diagonal, j) -> [N, h, d]``: step j's attention
    for the queries of some flat rows (``None``: every row, in order) over the step-0
    keys ``k0, v0`` ``[B*C, g, d]`` and each row's own keys of steps ``1..j``
    (``diagonal = (k, v)``, each ``[j, N, g, d]`` aligned with the rows; None at j = 0).

    The one-rank FlexAttention path (``attention="flex"``, or ``auto`` on CUDA) packs
    the queries (``packed_flex_attention``; ``layouts[j]`` from ``_plan_steps`` when
    given, else built per step). Otherwise the queries are placed in zero
    ``[B, h, C, d]`` tensors for ``attend`` (``Collectives.attend`` under sequence
    parallelism, else ``eager_attention``), whose other rows' outputs are dropped."""
    B, C = valid_BC.shape
    if _flex_path(attention, attend, features):
        keys, lengths = packed_keys(k0, v0), valid_BC.sum(1)
        every = torch.arange(B * C, device=k0.device)
        return lambda q, rows, diagonal, j: packed_flex_attention(  # noqa: E731
            q, every if rows is None else rows, keys, diagonal, lengths, C,
            None if layouts is None else layouts[j])
    attend = attend or eager_attention
    as_B = lambda x: x.view(B, C, *x.shape[1:]).transpose(1, 2)  # noqa: E731 - [B, n, C, d]

    def dense(x, rows):
        return as_B(x if rows is None else x.new_zeros(B * C, *x.shape[1:]).index_copy(0, rows, x))

    def run(q, rows, diagonal, j):
        own = [] if diagonal is None else zip(*diagonal)
        keys = [(as_B(k0), as_B(v0))] + [(dense(k, rows), dense(v, rows)) for k, v in own]
        out = attend(dense(q, rows), keys, valid_BC).transpose(1, 2).flatten(0, 1)
        return out if rows is None else out[rows]
    return run


def _unroll(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
            rows: Sequence[torch.Tensor] | None, attention: AttentionImpl, attend,
            plan: _StepPlan | None = None) -> list[torch.Tensor]:
    """The k unrolled steps on the rows ``rows[j]`` of each step (``None``: every row).

    Step 0 computes keys and values for every own row (everyone's context) and the
    query, attention, o_proj and MLP for ``rows[0]``; step ``j >= 1`` runs the whole
    layer on ``rows[j]`` only, whose queries attend causally to the full step-0 keys
    and to their own keys of steps ``1..j``. Each ``rows[j]`` must be inside
    ``rows[j-1]`` (``computed_rows``). Returns k tensors ``[n_j, H]`` (``[B*C, H]``)."""
    cfg, layer = draft.cfg, draft.midlayer
    attn = layer.self_attn
    C = num_rows
    B = features.input_ids.shape[0]
    ids_next = shift_left(features.input_ids)  # ids'[t] = x_{t+1}
    positions = features.positions
    if positions is None:
        positions = torch.arange(features.input_ids.shape[1], device=ids_next.device).expand(B, -1)
    pos_flat = positions[:, :C].reshape(-1)
    valid = features.attention_mask[:, :C].bool()
    g_all = draft.project(features.aux[:, :C]).flatten(0, 1)  # [B*C, H]
    heads = lambda x, n: x.view(x.shape[0], n, cfg.d)  # noqa: E731

    def rope_at(positions):  # cos, sin [n, 1, d], shared by the queries and keys of a step
        cos, sin = rope_cos_sin(positions, cfg.rope, cfg.d, g_all.dtype)
        return cos[:, None], sin[:, None]

    def take(x, idx):  # rows idx of x (None: all); index_select's backward is one
        return x if idx is None else x.index_select(0, idx)  # index_add, not a sort

    def within(j, outer, inner):  # positions of the sorted rows inner inside sorted outer
        if inner is None:
            return None
        return plan.within[j] if plan is not None and plan.within else _inside(outer, inner)

    def layer_rest(q, g, rows, diagonal, j):  # attention, o_proj and MLP of rows
        a = attend_rows(q, rows, diagonal, j)
        # The residual adds ride in the GEMMs' epilogues (addmm: r + a @ W^T). o_proj
        # and down_proj are read as weights, so forward hooks on those modules do not
        # fire (neither has a bias).
        r = torch.addmm(g, a.reshape(a.shape[0], cfg.num_heads * cfg.d), attn.o_proj.weight.t())
        x = layer.post_attention_layernorm(r)
        mlp = layer.mlp
        return torch.addmm(r, swiglu(mlp.gate_proj(x), mlp.up_proj(x)), mlp.down_proj.weight.t())

    def layer_input(ids, g):  # [norm(embed(ids)) ; norm(g)], [n, 2H]
        return norm_pair(draft.embed_tokens(ids), g, layer.input_layernorm.weight,
                         layer.hidden_norm.weight, cfg.rms_norm_eps)

    u = layer_input(ids_next[:, :C].flatten(), g_all)
    cos, sin = rope_at(pos_flat)
    k0 = apply_rope(heads(attn.k_proj(u), cfg.num_kv_heads), cos, sin)
    attend_rows = _row_attention(attention, attend, features, valid, k0,
                                 heads(attn.v_proj(u), cfg.num_kv_heads),
                                 None if plan is None else plan.layouts)
    prev = None if rows is None else rows[0]
    q = apply_rope(heads(attn.q_proj(take(u, prev)), cfg.num_heads), take(cos, prev), take(sin, prev))
    out = layer_rest(q, take(g_all, prev), prev, None, 0)
    outs, diagonal = [out], None  # the rows' own keys/values of steps 1..j, [j, N, g, d]
    for j in range(1, ttt_length):
        rj = None if rows is None else rows[j]
        at = within(j, prev, rj)
        g = take(out, at)
        ids_j = take(shift_left(ids_next, j)[:, :C].reshape(-1), rj)
        u = layer_input(ids_j, g)
        cos, sin = rope_at(take(pos_flat, rj) + j)
        q, k = apply_rope_pair(heads(attn.q_proj(u), cfg.num_heads),
                               heads(attn.k_proj(u), cfg.num_kv_heads), cos, sin)
        v = heads(attn.v_proj(u), cfg.num_kv_heads)
        diagonal = (k[None], v[None]) if diagonal is None else tuple(
            torch.cat((x if at is None else x.index_select(1, at), y[None]))
            for x, y in zip(diagonal, (k, v)))
        out = layer_rest(q, g, rj, diagonal, j)
        outs.append(out)
        prev = rj
    return outs


def backbone(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
             attention: AttentionImpl = "eager", attend=None,
             plan: _StepPlan | None = None) -> list[torch.Tensor]:
    """The unrolled layer on every own row: k pre-norm outputs ``[B, C, H]``.

    Runs inside ``functional_call`` (``draft`` holds the parameters). ``attend``
    (``Collectives.attend``) replaces the one-rank attention under sequence parallelism.
    """
    B = features.input_ids.shape[0]
    outs = _unroll(draft, features, num_rows, ttt_length, None, attention, attend, plan)
    return [out.view(B, num_rows, -1) for out in outs]


def computed_rows(rowmap: RowMap) -> tuple[torch.Tensor, ...]:
    """Rows whose layer output ``trim="backbone"`` computes at each step (sorted flat
    ``b*C + p``): ``rows_0 | backbone_rows_1`` at step 0, ``backbone_rows_j`` after.
    Each is contained in the previous one, so a row's input feature and diagonal
    keys are always there."""
    return (rowmap.step0_rows,) + tuple(rowmap.backbone_rows[1:])


def choose_trim(rowmap: RowMap, config: TTTConfig) -> str:
    """The path ``trim="auto"`` takes for this batch: ``none`` below
    ``config.auto_min_rows`` own rows (launch-bound), else ``backbone`` when its cost
    score (``auto_score``) is at most ``config.auto_backbone_fraction``, else ``none``
    (measured on the H200: near full density the untrimmed path beats both trimmed
    ones, whose gathers and chunked head then cost more than they save). Any other
    ``config.trim`` is returned as is."""
    if config.trim != "auto":
        return config.trim
    if rowmap.batch_size * rowmap.num_rows < config.auto_min_rows:
        return "none"
    total = rowmap.ttt_length * rowmap.batch_size * rowmap.num_rows
    if total == 0:  # no rows at all: nothing to trim
        return "none"
    computed = sum(c.numel() for c in computed_rows(rowmap))
    supervised = sum(r.numel() for r in rowmap.rows)
    score = auto_score(computed / total, supervised / total, config.auto_loss_share)
    return "backbone" if score <= config.auto_backbone_fraction else "none"


def auto_score(computed: float, supervised: float, loss_share: float) -> float:
    """``trim="auto"``'s cost score ``(1 - w) * computed + w * supervised``, both
    fractions of the ``k*B*C`` layer rows (keys/values of step 0 aside): the
    trimmed backbone's time relative to the full path grows about linearly in each
    (``TTTConfig.auto_loss_share``)."""
    return (1.0 - loss_share) * computed + loss_share * supervised


def trimmed_backbone(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
                     rows: Sequence[torch.Tensor], attention: AttentionImpl = "eager",
                     attend=None, plan: _StepPlan | None = None) -> list[torch.Tensor]:
    """``backbone`` computing only the rows a later loss needs (``computed_rows``).

    Step 0 computes keys and values for every own row (everyone's context) and the
    query, attention, o_proj and MLP for ``rows[0]``; step ``j >= 1`` runs the whole
    layer on ``rows[j]`` only, whose queries attend causally to the full step-0 keys
    and to their own diagonal keys of steps ``1..j``.

    Returns:
        k tensors ``[n_j, H]``: the pre-norm outputs of ``rows[j]``, in its order.
    """
    return _unroll(draft, features, num_rows, ttt_length, rows, attention, attend, plan)


class _Unrolled(torch.nn.Module):
    """``forward`` = backbone + head + per-step terms, so one ``functional_call`` runs
    the whole differentiable part."""

    def __init__(self, draft: Eagle3Draft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features: Features, rowmap: RowMap, config: TTTConfig,
                table: TeacherTable, d2t: torch.Tensor, supervised_flat: torch.Tensor | None,
                collectives: Collectives | None = None, plan: _StepPlan | None = None):
        attend = collectives.attend if collectives is not None else None
        if plan is None:
            plan = _plan_steps(rowmap, config.trim, features,
                               _flex_path(config.attention, attend, features))
        if config.trim == "backbone":
            outs = trimmed_backbone(self.draft, features, rowmap.num_rows, config.ttt_length,
                                    computed_rows(rowmap), config.attention, attend=attend,
                                    plan=plan)
        else:
            outs = backbone(self.draft, features, rowmap.num_rows, config.ttt_length,
                            config.attention, attend=attend, plan=plan)
        at = plan.at  # rows_j as positions in step j's output
        impl = config.loss_impl
        if impl == "auto":
            impl = "triton" if features.aux.is_cuda else "torch"
        kwargs = dict(impl=impl, accept_grad=config.loss.objective != "kl")
        terms = []
        for j, out in enumerate(outs):
            flat = out.flatten(0, -2)  # [B*C, H], or [n_j, H] computed rows
            if config.trim != "none" and config.fused_head:
                head = functools.partial(head_logits, cfg=self.draft.cfg)
                terms.append(head_step_terms(
                    flat.index_select(0, at[j]), head, self.draft.head_weights(), table,
                    rowmap.table_rows[j], d2t, **kwargs,
                    chunk_rows=fused_head_chunk(config.head_chunk_rows, config.draft.draft_vocab_size)))
                continue
            if config.trim != "none":
                logits = self.draft.head(flat.index_select(0, at[j]))  # [n_j, Vd]
                table_rows, row_mask = rowmap.table_rows[j], None
            else:
                logits = self.draft.head(flat)  # [B*C, Vd]
                table_rows, row_mask = _dense_step(rowmap, j, supervised_flat)
            terms.append(step_terms(logits, table, table_rows, d2t, row_mask_N=row_mask, **kwargs))
        if collectives is not None:
            # One zero-weighted dummy row per step keeps every step's output in the graph
            # on every rank (a rank whose step is dead still joins that step's backward
            # collectives, so no rank waits forever).
            dummy = [0 * out.flatten()[:1].sum() for out in outs]
            terms = [dataclasses.replace(t, loss_sum=t.loss_sum + z, accept_sum=t.accept_sum + z,
                                         log_accept_sum=t.log_accept_sum + z)
                     for t, z in zip(terms, dummy)]
        return terms


def _dense_step(rowmap: RowMap, j: int, supervised_flat: torch.Tensor):
    """Full-length path, step j: every row ``b*C + p`` reads teacher ``b*T + p + j``
    (``[B*C]``, clamped inside its sample) and counts iff ``p + j < T`` and that
    position is supervised."""
    B, C, T = rowmap.batch_size, rowmap.num_rows, rowmap.buffer_len
    s = torch.arange(C, device=supervised_flat.device) + j
    index = (torch.arange(B, device=s.device)[:, None] * T + s.clamp_max(T - 1)).flatten()
    return index, (s < T).repeat(B) & supervised_flat[index]


def _teacher(features: Features, read_U: torch.Tensor, config: TTTConfig,
             t2d: torch.Tensor) -> TeacherTable:
    """Teacher table from the target outputs at flat positions ``read_U`` of z."""
    if features.target_logits is not None:
        return teacher_table_from_logits(features.target_logits.flatten(0, 1)[read_U], t2d)
    if features.final_hidden is None or features.target_head is None:
        raise ValueError("Features need target_logits, or final_hidden and target_head")
    return teacher_table_from_hidden(features.final_hidden.flatten(0, 1)[read_U],
                                     features.target_head, t2d, chunk_size=config.teacher_chunk_size)


def ttt(params: dict[str, torch.Tensor], features: Features, rowmap: RowMap, config: TTTConfig,
        *, d2t: torch.Tensor, t2d: torch.Tensor,
        collectives: Collectives | None = None) -> Objective:
    """The TTT objective and per-step metrics of one batch (differentiable in params).

    Args:
        params: draft parameters (``draft.init_params``), any dtype/device.
        features: the batch (``Features``), ``[B, T, ...]``.
        rowmap: ``rowmap.build_rowmap(supervised_mask, k)`` of this batch.
        config: ``TTTConfig``; ``config.trim`` picks the full or the trimmed path.
        d2t, t2d: the vocab map.
        collectives: under data/sequence parallelism (``eagle3fn.parallel``): the
            cross-rank attention and the reduction of the per-step sums. ``features``
            and ``rowmap`` are then this rank's (``C`` own rows + a ``k`` tail).

    Returns:
        ``Objective`` (``objective`` 0-d, per-step ``[k]`` losses and metrics, tau).
    """
    B, T = features.input_ids.shape
    if (rowmap.batch_size, rowmap.buffer_len) != (B, T) or rowmap.ttt_length != config.ttt_length:
        raise ValueError(
            f"row map is for B={rowmap.batch_size}, T={rowmap.buffer_len}, k={rowmap.ttt_length} "
            f"but the batch has B={B}, T={T} and config.ttt_length={config.ttt_length}"
        )
    positions = rowmap.teacher_positions
    if positions.numel() and bool((positions % T == T - 1).any()):
        raise ValueError(
            "a teacher position is the last of its buffer, where z'[s] = z[s+1] is not held; "
            "build the mask with align.supervised_mask (it never supervises t = L-1)"
        )
    if config.trim == "auto":
        config = dataclasses.replace(config, trim=choose_trim(rowmap, config))
    # The steps' index maths first, on the host: its one download waits for nothing but
    # the row map, not for the teacher.
    plan = _plan_steps(rowmap, config.trim, features, _flex_path(
        config.attention, collectives.attend if collectives is not None else None, features))
    supervised_flat = None
    if config.trim != "none":
        table = _teacher(features, positions + 1, config, t2d)  # z'[s] = z[s+1]
    else:
        supervised_flat = torch.zeros(B * T, dtype=torch.bool, device=positions.device)
        supervised_flat[positions] = True
        s = torch.arange(B * T, device=positions.device)
        # A teacher at every position; the last one of each buffer has no z[s+1] and is
        # never supervised, so any row of z may stand in for it.
        table = _teacher(features, torch.where(s % T == T - 1, s, s + 1), config, t2d)
    module = _Unrolled(skeleton(config.draft))
    named = {f"draft.{k}": v for k, v in params.items()}
    terms = torch.func.functional_call(
        module, named, (features, rowmap, config, table, d2t, supervised_flat, collectives, plan)
    )
    if collectives is None:
        return objective(terms, rowmap.denominator, config.loss)
    if config.loss.normalization == "local_mean" and not _is_one(collectives.loss_scale):
        scale = torch.as_tensor(collectives.loss_scale).to(terms[0].loss_sum)
        terms = [dataclasses.replace(t, loss_sum=t.loss_sum * scale) for t in terms]
    terms = collectives.reduce_terms(terms)
    if collectives.gated is not None:
        terms = [dataclasses.replace(t, gated=g.to(t.gated)) for t, g in zip(terms, collectives.gated)]
    return objective(terms, collectives.denominator, config.loss)


def _is_one(x: float | torch.Tensor) -> bool:
    """``x == 1`` for a number; a tensor scale is applied as it is (no host sync)."""
    return not isinstance(x, torch.Tensor) and x == 1


def gated_counts(features: Features, rowmap: RowMap, config: TTTConfig, t2d: torch.Tensor) -> torch.Tensor:
    """``[k]`` int64: the gated rows of each step of this batch (rows whose teacher's
    argmax is in the draft vocab), as ``ttt``'s step terms count them, without running
    the draft: the teacher at the teacher positions only (no grad). Summed over the
    micro-batches of a step (and ranks), it is ``Collectives.gated``."""
    with torch.no_grad():
        table = _teacher(features, rowmap.teacher_positions + 1, config, t2d)
        return torch.stack([table.gate[r].sum() for r in rowmap.table_rows]).to(torch.int64)
