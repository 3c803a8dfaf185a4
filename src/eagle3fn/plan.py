"""Memory and FLOP planner: what one TTT step needs on one GPU, from the shapes alone.

Legend: S sequence length, B batch, sp sequence-parallel degree, C = ceil(S/sp) own
rows per sample on one rank, T = C + tail local buffer (tail = k when sp > 1, else 0),
R = B*C rows of a rank, Lp = R rounded up to the flex block (128), the packed
FlexAttention length, k TTT length, H draft hidden, Ht target hidden, I MLP width,
h heads, g kv heads, d head dim, V target vocab, Vd draft vocab, b bytes per
compute-dtype element, n_j loss rows of step j, m_j layer rows of step j (R, or the
computed rows under ``trim="backbone"``), U teacher positions.

The memory model is the list of tensors ``ttt.ttt`` keeps for backward, op by op
(each linear its input; each RMSNorm, fused, its input and rsqrt, or, eager, its fp32
input, rsqrt and pre-weight output; SwiGLU three ``[m_j, I]`` fused, four eager; the
packed FlexAttention its query and output ``[1, h, Qp, d]`` (Qp = the step's query
rows rounded up to a bucket, ``ttt.packed_query_len``), log-sum-exp and block
mask, and once per batch the step-0 keys and values ``[1, g, Lp, d]``; the diagonal
merge its query and the stacked own keys and values ``[j, m_j, g, d]``, fused, or fp32
copies, eager; the fused head only its input rows; the unfused head its logits),
plus what lives beside them at each moment a step can peak: while the teacher table
is built, in the last layer step and the last head of the forward, in the heads'
backward (recorded last, they run first) and in the layer's backward of each step
(``Memory.phases``).

"Fused" is the CUDA path: ``draft.fused_on_cuda`` compiles RMSNorm, RoPE and SwiGLU
with inductor, whose partitioner keeps only the inputs the backward needs (the fp32
intermediates are recomputed in registers), and ``ttt.merge_diagonal`` runs its
Triton kernel (``kernels.merge``). The plan assumes it when
``draft.COMPILE_ELEMENTWISE`` is on (the default; ``EAGLE3FN_COMPILE=0`` turns both
off). The tests (tests/test_plan.py) run the real ``ttt`` on CPU under
``saved_tensors_hooks``, eager and with those three functions compiled by CPU
inductor and the merge kernel in the Triton interpreter, and compare with
``Memory.saved_total``; that the CUDA partitioner (torch 2.11 on the H200) keeps the
same tensors as the CPU one, and the peak, rest on the GPU constants below and on
measurements.

FLOPs are counted as the code executes them: every GEMM (forward, and backward as
two GEMMs per weight, one where the input needs no gradient), FlexAttention per
computed 128x128 block of the packed mask (``ttt.packed_block_mask``: per active
query block, the key blocks from its first row's sample start to its last row; the
diagonal keys are merged elementwise and not counted), the fused head's
recomputation, and the streamed teacher (forward only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from eagle3fn.rowmap import build_rowmap
from eagle3fn.teacher import DEFAULT_CHUNK_SIZE
from eagle3fn.ttt import FLEX_BLOCK, TTTConfig, fused_head_chunk

GiB = 2**30

# ---- GPU constants: calibrated on one H200 (torch 2.11 + cu130) at the BENCH.md 8B
# shapes against measured ``max_memory_allocated`` of the code before the packed
# FlexAttention path and the fused elementwise chains (docs/tutorials/plan.md has the
# validation table). Recalibrate them when torch, the kernels or the GPU change. ------

ALLOCATOR_OVERHEAD_BYTES = 64 * 2**20
"""Bytes the CUDA caching allocator holds beyond the tensors modelled here: cuBLAS /
cuBLASLt workspaces (allocated through the caching allocator and kept after the
first GEMM) and the 512-byte rounding of blocks. Measured on the H200: 63 MiB above
parameters + features before a step, at 8192 and at 16384 tokens."""

FLEX_BACKWARD_WORKSPACE = 1.0
"""FlexAttention backward working memory, as a multiple of ``dq``, the output
gradient's copy (``[1, h, Qp, d]`` each) and ``dk + dv`` (two ``[1, g, Lp, d]``). Not
yet calibrated: on the H200 at 8192-16384 tokens the step peaked in the forward or
in the heads' backward, never inside an attention backward."""

FLEX_SAVES_MAX_SCORES = True
"""FlexAttention keeps an fp32 ``[1, h, Qp]`` row maximum beside its log-sum-exp
(torch's eager autograd op does, as the CPU tests measure; whether the compiled
graph keeps it is not measured: 1 MiB per step at 8B shapes and 8192 tokens)."""

ROWMAP_MAX_POSITIONS = 1 << 16
"""Up to this many buffer positions per rank (B*T) the rows come from a real
``build_rowmap`` on a synthetic mask; beyond it from closed-form counts."""

Pattern = Literal["tail", "scattered"]
Trim = Literal["none", "loss", "backbone", "auto"]
Attention = Literal["auto", "flex", "eager"]
LossImpl = Literal["triton", "torch"]

_TTT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TTTConfig)}


@dataclass(kw_only=True)
class PlanArgs:
    """One TTT step to plan (defaults: BENCH.md's 8B shapes at 8192 tokens, 30% tail)."""

    seq_len: int = 8192
    """S, tokens per sample (the whole sequence, before any sequence-parallel split)."""
    density: float = 0.3
    """Fraction of the positions that are supervised (loss-mask tokens)."""
    pattern: Pattern = "tail"
    """``tail``: the supervised positions are the last ``density*S`` (a prompt-heavy
    chat: the answer at the end; exact row counts). ``scattered``: each position is
    supervised independently with probability ``density`` (expected counts)."""
    hidden: int = 4096
    """H, the draft's hidden size."""
    intermediate: int = 14336
    """I, the SwiGLU MLP width."""
    heads: int = 32
    """Query heads h."""
    kv_heads: int = 8
    """Key/value heads g (GQA); divides ``heads``."""
    head_dim: int | None = None
    """d, per-head width (default ``hidden / heads``)."""
    target_hidden: int | None = None
    """Ht, the target's hidden size (default ``hidden``): aux ``[B, S, 3*Ht]``, final
    hidden ``[B, S, Ht]``, target head ``[V, Ht]``."""
    vocab: int = 128256
    """V, the target vocab (embedding rows, target head rows)."""
    draft_vocab: int = 32000
    """Vd, the draft head's vocab."""
    ttt_length: int = 7
    """k, the number of unrolled TTT steps."""
    batch: int = 1
    """B, samples per micro-batch (each ``seq_len`` long, no padding)."""
    sp: int = 1
    """Sequence-parallel degree: each rank holds ``C = ceil(S/sp)`` own rows plus a k
    tail; the plan is for the rank with the highest peak. With sp > 1 the attention is
    ``eagle3fn.parallel``'s ring attention (explicit scores, last rank sees every
    earlier block)."""
    trim: Trim = "loss"
    """``none``, ``loss``, ``backbone`` or ``auto`` (as ``TTTConfig.trim``; ``auto`` is
    resolved per rank by ``ttt.choose_trim``)."""
    auto_backbone_fraction: float = _TTT_DEFAULTS["auto_backbone_fraction"]
    """``trim="auto"``: backbone when its cost score is at most this
    (``TTTConfig.auto_backbone_fraction``)."""
    auto_loss_share: float = _TTT_DEFAULTS["auto_loss_share"]
    """``trim="auto"``: the score's weight on the supervised rows against the computed
    layer rows (``TTTConfig.auto_loss_share``)."""
    auto_min_rows: int = _TTT_DEFAULTS["auto_min_rows"]
    """``trim="auto"``: fewer own rows ``B*C`` than this take the full path
    (``TTTConfig.auto_min_rows``)."""
    dtype_bytes: int = 2
    """Bytes per element of the compute dtype of parameters and activations (2 =
    bf16, the GPU path; 4 = fp32, the CPU path)."""
    optimizer: bool = False
    """Add training state: fp32 master weights, AdamW m and v and fp32 gradients of the
    trainable parameters, sharded over ``world`` ranks, and the frozen embedding's fp32
    copy. Off: a benchmark step (bf16 leaves, bf16 gradients, no optimizer)."""
    world: int = 1
    """Ranks the optimizer state and fp32 gradients are sharded over."""
    gpu_memory_gib: float = 139.0
    """Memory of one GPU in GiB (default 139: one NVIDIA H200, about 139 GiB usable)."""
    head_chunk_rows: int = _TTT_DEFAULTS["head_chunk_rows"]
    """Most rows per chunk of the fused head (``TTTConfig.head_chunk_rows``, 4096; fewer
    for large Vd, ``ttt.fused_head_chunk``)."""
    teacher_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Vocab entries per block of the streamed teacher (``TTTConfig.teacher_chunk_size``)."""
    attention: Attention = "auto"
    """``flex`` (the GPU path), ``eager`` (explicit scores, the CPU path), ``auto``
    (flex). Ignored when sp > 1 (ring attention)."""
    loss_impl: LossImpl = "triton"
    """Soft cross-entropy of the unfused head (``trim="none"``): ``triton`` keeps the
    bf16 logits (GPU), ``torch`` fp32 log-probabilities and gathered teacher rows."""

    def __post_init__(self) -> None:
        positive = ("seq_len", "hidden", "intermediate", "heads", "kv_heads", "vocab",
                    "draft_vocab", "ttt_length", "batch", "sp", "world", "head_chunk_rows",
                    "teacher_chunk_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.density <= 1.0:
            raise ValueError(f"density must be a fraction in [0, 1], got {self.density}")
        if self.pattern not in ("tail", "scattered"):
            raise ValueError(f"pattern must be 'tail' or 'scattered', got {self.pattern!r}")
        if self.trim not in ("none", "loss", "backbone", "auto"):
            raise ValueError(f"trim must be 'none', 'loss', 'backbone' or 'auto', got {self.trim!r}")
        if self.attention not in ("auto", "flex", "eager"):
            raise ValueError(f"attention must be 'auto', 'flex' or 'eager', got {self.attention!r}")
        if self.loss_impl not in ("triton", "torch"):
            raise ValueError(f"loss_impl must be 'triton' or 'torch', got {self.loss_impl!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; set head_dim")
        if self.draft_vocab > self.vocab:
            raise ValueError(f"draft_vocab={self.draft_vocab} exceeds vocab={self.vocab}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {self.dtype_bytes}")
        if self.sp > self.seq_len:
            raise ValueError(f"sp={self.sp} exceeds seq_len={self.seq_len}; use fewer ranks")
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if not 0.0 <= self.auto_loss_share <= 1.0:
            raise ValueError(f"auto_loss_share must be in [0, 1], got {self.auto_loss_share}")

    @property
    def d(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def ht(self) -> int:
        """Target hidden size."""
        return self.target_hidden or self.hidden

    @property
    def own_rows(self) -> int:
        """C, own rows per sample on one rank."""
        return -(-self.seq_len // self.sp)

    @property
    def buffer_len(self) -> int:
        """T, positions per sample in a rank's buffer."""
        return self.own_rows + (self.ttt_length if self.sp > 1 else 0)


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
            partial + full blocks of ``ttt.packed_block_mask`` for the ``m_j`` packed
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
class Flops:
    """Forward + backward FLOPs of one step on the planned rank, by component.

    Fields:
        backbone_gemm: fc, q/k/v/o and the SwiGLU GEMMs.
        attention: attention matmuls as executed (flex: computed blocks; eager: dense).
        head: draft norm + lm_head GEMMs (the fused head recomputes its forward).
        teacher: the streamed target head ``[U, Ht] x [Ht, V]`` (forward only).
        total: the sum.
    """

    backbone_gemm: float
    attention: float
    head: float
    teacher: float
    total: float


@dataclass(frozen=True)
class Plan:
    """What one TTT step needs (``estimate``).

    Fields:
        args: the planned configuration.
        rows: the rows each step computes on the planned rank.
        memory: bytes by component and the peak.
        flops: FLOPs by component.
        fits: the peak is at most ``args.gpu_memory_gib``.
        headroom: ``gpu_memory_gib`` minus the peak, bytes (negative: short by that).
    """

    args: PlanArgs
    rows: Rows
    memory: Memory
    flops: Flops
    fits: bool
    headroom: int


# ---- rows ---------------------------------------------------------------------------

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
    rows ``rows_N`` (``ttt.packed_flex_attention``), by ``ttt.packed_block_mask``'s
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
    """``_packed_blocks`` read off the real ``ttt.packed_block_mask`` (partial + full
    blocks), with the query windows ``packed_flex_attention`` gives it."""
    from eagle3fn.ttt import packed_block_mask

    N = rows_N.numel()
    if N == 0:
        return 0.0
    from eagle3fn.ttt import packed_query_len

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
    from eagle3fn.ttt import computed_rows

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


def _auto_choice(args: PlanArgs, loss: tuple[float, ...], computed: tuple[float, ...],
                 rowmap=None) -> str:
    """``trim="auto"`` as ``ttt.choose_trim`` decides it: on the real row map when there
    is one, else its rule on counts (backbone iff ``B*C >= auto_min_rows`` and
    ``ttt.auto_score`` of the computed and supervised fractions of ``k*B*C`` is at most
    ``auto_backbone_fraction``, else none)."""
    from eagle3fn.draft import DraftConfig
    from eagle3fn.ttt import auto_score, choose_trim

    draft = DraftConfig(hidden_size=8, intermediate_size=8, num_heads=1, num_kv_heads=1,
                        vocab_size=2, draft_vocab_size=2)
    config = TTTConfig(draft=draft, ttt_length=args.ttt_length, trim="auto",
                       auto_backbone_fraction=args.auto_backbone_fraction,
                       auto_loss_share=args.auto_loss_share, auto_min_rows=args.auto_min_rows)
    if rowmap is not None:
        return choose_trim(rowmap, config)
    rows = args.batch * args.own_rows
    total = args.ttt_length * rows
    if rows >= args.auto_min_rows and auto_score(
            sum(computed) / total, sum(loss) / total, args.auto_loss_share) <= args.auto_backbone_fraction:
        return "backbone"
    return "none"


def plan_rows(args: PlanArgs, rank: int = 0) -> Rows:
    """The rows ``rank`` computes at each step under ``args.trim`` (``auto`` resolved as
    ``ttt.choose_trim`` resolves it for this rank's row map)."""
    B, C, T, k = args.batch, args.own_rows, args.buffer_len, args.ttt_length
    if not 0 <= rank < args.sp:
        raise ValueError(f"rank must be in [0, sp={args.sp}), got {rank}")
    rowmap = None
    if B * T <= ROWMAP_MAX_POSITIONS:
        rowmap = build_rowmap(synthetic_mask(args, rank), k, num_rows=C)
        loss, computed, blocks, U = _rows_from_rowmap(args, rank, rowmap)
        exact = True
    else:
        loss, computed, blocks, U = _rows_from_counts(args, rank)
        exact = args.pattern == "tail"
    trim = args.trim if args.trim != "auto" else _auto_choice(args, loss, computed, rowmap)
    if trim != "backbone":  # every row's query, at every step
        computed = (float(B * C),) * k
        blocks = (_packed_blocks(torch.arange(B * C), C, _real_rows(args, rank)),) * k
    if trim == "none":
        U = float(B * T)
    return Rows(rank=rank, trim=trim, loss_rows=loss, layer_rows=computed, kv_rows=B * C,
                teacher_positions=U, attention_blocks=blocks, exact=exact)


# ---- memory ------------------------------------------------------------------------

def _attention_kind(args: PlanArgs) -> str:
    """``flex``, ``eager`` or ``ring`` (the sequence-parallel attention, modelled as
    its eager path: explicit scores; on CUDA training takes the flex ring path, whose
    memory is linear in the rows and is not modelled yet: ``SP_FLEX_NOTE``)."""
    if args.sp > 1:
        return "ring"
    return "flex" if args.attention in ("auto", "flex") else "eager"


def _param_counts(args: PlanArgs) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the draft."""
    H, I, d, h, g = args.hidden, args.intermediate, args.d, args.heads, args.kv_heads
    embed = args.vocab * H
    trainable = (3 * args.ht * H + 2 * H * (h + 2 * g) * d + h * d * H + 3 * H * I
                 + 4 * H + args.draft_vocab * H)
    return embed + trainable, trainable


def _fused() -> bool:
    """Whether the draft's elementwise chains (RMSNorm, RoPE, SwiGLU) and the diagonal
    merge run fused by ``torch.compile``, as on CUDA (``draft.COMPILE_ELEMENTWISE``,
    off with ``EAGLE3FN_COMPILE=0``); off: eager, as on CPU."""
    from eagle3fn import draft

    return bool(draft.COMPILE_ELEMENTWISE)


def _packed_len(args: PlanArgs) -> int:
    """Lp, the packed FlexAttention length: ``B*C`` rounded up to the flex block."""
    return max(-(-args.batch * args.own_rows // FLEX_BLOCK), 1) * FLEX_BLOCK


def _query_len(args: PlanArgs, m: float) -> int:
    """Qp, the packed query length of ``m`` query rows (``ttt.packed_query_len``)."""
    from eagle3fn.ttt import packed_query_len

    return packed_query_len(math.ceil(m), _packed_len(args))


def _flex_mask_bytes(Qp: int, Lp: int) -> int:
    """One step's ``packed_block_mask``: int32 kv tables (``[Mq]`` counts and
    ``[Mq, M]`` indices, partial and full; Mq = Qp/128, M = Lp/128), their transposed q
    tables (``[M]``, ``[M, Mq]``), and the int64 query windows (start, last ``[Qp]``)
    its ``mask_mod`` captures."""
    Mq, M = Qp // FLEX_BLOCK, Lp // FLEX_BLOCK
    return 4 * (2 * Mq + 2 * M + 4 * Mq * M) + 2 * Qp * 8


def _merge_saved(args: PlanArgs, j: int, m: float, fused: bool) -> float:
    """What ``ttt.merge_diagonal`` keeps at step ``j >= 1`` for ``m`` rows: always the
    natural-log log-sum-exp FlexAttention returns (fp32 ``[1, h, Qp]``, apart from
    the one it keeps itself); ``o`` is a view of the FlexAttention output, counted
    there.

    Fused (the Triton kernel of ``kernels.merge``; the tests run it in the Triton
    interpreter): q ``[m, h, d]``, the diagonal keys and values ``[j, m, g, d]`` and
    the merged fp32 log-sum-exp ``[m, h]``. Eager, all fp32: q and the keys and
    values (copies in bf16, the tensors themselves in fp32), o (a copy in bf16), the
    scores ``[j, m, h]``, their maximum and exponentials, the numerator ``[m, h, d]``
    and the denominator ``[m, h]``."""
    b, h, g, d = args.dtype_bytes, args.heads, args.kv_heads, args.d
    if j == 0:
        return 0.0
    P, G, sh = m * h * d, m * g * d, m * h
    lse = _query_len(args, m) * h * 4
    if fused:
        return lse + P * b + 2 * j * G * b + sh * 4
    return lse + P * 4 * (2 if b == 4 else 3) + 2 * j * G * 4 + (2 * j + 3) * sh * 4


def _attention_saved(args: PlanArgs, j: int, m: float | None = None, kind: str | None = None,
                     hops: int | None = None, fused: bool | None = None,
                     shared_mask: bool = False) -> float:
    """Bytes the attention call of step j keeps for backward, for ``m`` query rows
    (default every row, ``B*C``). ``kind`` and ``hops`` (earlier ring blocks seen)
    default to the planned rank's, ``fused`` to ``_fused()``.

    flex (``ttt.packed_flex_attention``): the packed query and output ``[1, h, Qp, d]``
    (Qp = ``m`` rounded up to a query bucket, ``ttt.packed_query_len``), the fp32
    log-sum-exp and row maximum ``[1, h, Qp]``, the block mask, the merge of
    the diagonal keys (``_merge_saved``) and, at step 0 only, the packed step-0 keys
    and values ``[1, g, Lp, d]`` (shared by every step); ``shared_mask``: the steps
    share one every-row layout (``trim`` none / loss), whose block mask and windows
    are counted at step 0 only. eager / ring: the dense
    ``[B, h, C, d]`` queries (trimmed rows are zeros there) and explicit scores."""
    b, B, C = args.dtype_bytes, args.batch, args.own_rows
    h, g, d = args.heads, args.kv_heads, args.d
    kind = kind or _attention_kind(args)
    m = B * C if m is None else m
    if kind == "flex":
        fused = _fused() if fused is None else fused
        Lp, Qp = _packed_len(args), _query_len(args, m)
        lse = Qp * h * 4 * (2 if FLEX_SAVES_MAX_SCORES else 1)
        keys = 2 * Lp * g * d * b if j == 0 else 0
        mask = _flex_mask_bytes(Qp, Lp) if j == 0 or not shared_mask else 0
        return 2 * Qp * h * d * b + lse + mask + keys + _merge_saved(args, j, m, fused)
    vec = B * C * h * d * b
    # matmul folds [B, h, C, d] queries laid out as [B, C, h, d] without a copy only
    # when B = 1; the diagonal terms keep the queries themselves from step 1 on
    queries = vec if B == 1 else vec * (2 if j else 1)
    diag = 2 * j * vec  # the diagonal keys and values, expanded to h heads
    if kind == "eager":
        scores = B * h * C * (C + j) * (4 + (2 if b == 2 else 0))  # fp32 softmax, bf16 copy
        return B * C * C + scores + queries + 2 * vec + diag
    # ring (eagle3fn.parallel.seqpar._partial_attention); the last rank sees sp - 1
    # earlier blocks, each with its own query copy, keys, values, scores and merge
    per_score = 4 + 4 + (2 if b == 2 else 0)  # logsumexp input, exp output, bf16 probs
    own = B * C * C + B * h * C * (C + j) * per_score + B * h * C * 4 + queries + 2 * vec + diag
    hops = args.sp - 1 if hops is None else hops
    return own + hops * (B * C + B * h * C * C * per_score + 3 * B * h * C * 4 + 5 * vec)


def _o_proj_input(args: PlanArgs, m: float) -> float:
    """What ``o_proj`` keeps: its ``[m, h*d]`` input, a new tensor on every path (flex:
    step 0 copies the output out of the head-major ``[1, h, Lp, d]`` layout, later
    steps keep the merge's output; eager / ring: the ``[B, h, C, d]`` output
    flattened, or gathered at the trimmed rows)."""
    return m * args.heads * args.d * args.dtype_bytes


def _norm_saved(args: PlanArgs, rows: float, fused: bool, input_counted: bool = False,
                input_grad: bool = True) -> float:
    """What one RMSNorm of ``rows`` rows keeps (its output, the next GEMM's input, is
    counted there). Eager (``draft.rms_norm`` unfused): the fp32 input (a copy in bf16,
    the input itself in fp32), the fp32 rsqrt ``[rows, 1]`` and the pre-weight output;
    only the pre-weight output when the input needs no gradient (the frozen
    embedding's rows). Fused (inductor; the tests check this on CPU inductor): the
    input itself and the rsqrt, the fp32 intermediates stay in registers.
    ``input_counted``: the input's storage is already counted elsewhere."""
    H, b = args.hidden, args.dtype_bytes
    if fused:
        return rows * 4 + (0.0 if input_counted else rows * H * b)
    if not input_grad:
        return rows * H * b
    fp32_input = 0.0 if (b == 4 and input_counted) else rows * H * 4
    return fp32_input + rows * 4 + rows * H * b


def _swiglu_saved(args: PlanArgs, rows: float, fused: bool) -> float:
    """The MLP's ``[rows, I]`` tensors: gate and up (and silu(gate) unfused), and
    silu(gate)*up, ``down_proj``'s input."""
    return rows * (3 if fused else 4) * args.intermediate * args.dtype_bytes


def _backbone_saved(args: PlanArgs, rows: Rows, fused: bool) -> tuple[list[float], list[float]]:
    """Per step: (everything the backbone keeps, the attention's share), following
    ``ttt._unroll`` op by op.

    Step 0, every row: the embedding and hidden norms, the q/k/v input ``u``
    ``[R, 2H]``, RoPE cos and sin ``[R, 1, d]``; then for its m rows (all of them
    without backbone trimming; trimmed, ``u``, cos and sin gathered for them) the
    attention, o_proj's input, the post-attention norm, the MLP input and SwiGLU.
    Step ``j >= 1``: the same for its m rows (the hidden norm's input is the previous
    output, or its gathered rows), plus, trimmed, the int64 positions of its rows
    inside the previous step's (they gather the previous output and diagonal keys)."""
    b, k, d, H = args.dtype_bytes, args.ttt_length, args.d, args.hidden
    h, g = args.heads, args.kv_heads
    R = rows.kv_rows
    trimmed = rows.trim == "backbone"
    kind = _attention_kind(args)
    saved, attn = [], []
    for j in range(k):
        m = rows.layer_rows[j]
        a = _attention_saved(args, j, m, fused=fused, shared_mask=not trimmed)
        n = R if j == 0 else m  # rows whose norms and q/k/v input step j computes
        norms = _norm_saved(args, n, fused, input_grad=False) + _norm_saved(args, n, fused)
        s = norms + n * 2 * H * b + 2 * n * d * b
        if trimmed and j == 0:
            s += m * 2 * H * b + 2 * m * d * b  # u, cos, sin of rows[0]
        if trimmed and j > 0:
            s += m * 8  # positions inside the previous step's rows
        if trimmed and kind != "flex":  # index_copy into the dense tensors keeps its sources:
            s += m * h * d * b + 2 * j * m * g * d * b  # the queries and the diagonal keys
        s += (a + _o_proj_input(args, m) + _norm_saved(args, m, fused) + m * H * b
              + _swiglu_saved(args, m, fused))
        saved.append(s)
        attn.append(a)
    return saved, attn


def _head_saved(args: PlanArgs, rows: Rows, fused: bool) -> list[float]:
    """Per step: what the head and loss keep for backward."""
    b, H, Vd, k = args.dtype_bytes, args.hidden, args.draft_vocab, args.ttt_length
    out = []
    for j in range(k):
        if rows.trim == "none":
            R = rows.kv_rows
            # the norm's input is the step's own output, already kept by the next
            # step's hidden norm (all but the last step) when that keeps it itself
            # + lm_head's input and the bool row mask
            s = _norm_saved(args, R, fused, input_counted=j < k - 1) + R * H * b + R
            if args.loss_impl == "triton":  # bf16 logits, the table rows, two fp32 [R]
                s += R * Vd * b + R * 8 + 2 * R * 4
            else:  # fp32 log-probabilities and gathered teacher rows
                s += 2 * R * Vd * 4
            out.append(s)
        else:
            n = rows.loss_rows[j]
            index = n * 8 if rows.trim == "backbone" else 0.0  # searchsorted positions
            out.append(n * H * b + index)  # the checkpoint keeps its input rows
    return out


def _teacher_bytes(args: PlanArgs, U: float) -> tuple[float, float]:
    """(table bytes, extra bytes while building it from the final hidden)."""
    Vd, V = args.draft_vocab, args.vocab
    b = args.dtype_bytes
    cs = min(args.teacher_chunk_size, V)
    table = U * (Vd * b + 4 + 4 + 8 + 1)  # logits, lse_draft, lse_full, token, gate
    # beside the table: the block's fp32 z, z - max and exp(z - max) (the draft-vocab
    # lse after the loop, in row blocks of U * cs entries, needs less); the gathered
    # hidden; int64 cumsum [V] and draft ids [Vd]
    per_row = 12 * cs + args.ht * b
    return table, U * per_row + (V + Vd) * 8


def _inputs_bytes(args: PlanArgs, rows: Rows) -> float:
    """Features (int64 ids and attention mask, bool masks, aux, final hidden, target
    head), vocab maps and the row map's index tensors."""
    b, B, T = args.dtype_bytes, args.batch, args.buffer_len
    features = B * T * (8 + 8 + 1 + 1) + B * T * 4 * args.ht * b + args.vocab * args.ht * b
    vocab = args.draft_vocab * 8 + args.vocab
    # rows, table rows, teacher positions, backbone rows (entry 0: every row), step-0 rows
    rowmap = 8 * (2 * sum(rows.loss_rows) + rows.teacher_positions + rows.kv_rows
                  + sum(rows.layer_rows))
    return features + vocab + rowmap


def _memory(args: PlanArgs, rows: Rows) -> Memory:
    """Bytes by component and at each moment a step can peak (module docstring)."""
    b, B, C, k = args.dtype_bytes, args.batch, args.own_rows, args.ttt_length
    H, I, Vd, h, g, d = (args.hidden, args.intermediate, args.draft_vocab, args.heads,
                         args.kv_heads, args.d)
    total_params, trainable = _param_counts(args)
    parameters = total_params * b + (args.vocab * H * 4 if args.optimizer else 0)
    gradients = trainable * 4 / args.world if args.optimizer else trainable * b
    optimizer_state = trainable * 12 / args.world if args.optimizer else 0
    inputs = _inputs_bytes(args, rows)
    table, teacher_extra = _teacher_bytes(args, rows.teacher_positions)
    fused = _fused()
    saved, attn = _backbone_saved(args, rows, fused)
    head = _head_saved(args, rows, fused)
    saved_total = sum(saved) + sum(head)
    R, m_rows, n_rows = rows.kv_rows, rows.layer_rows, rows.loss_rows
    trimmed_head = rows.trim != "none"

    # fp32 gradients of the masters live across micro-batches; compute-dtype ones
    # appear during the backward (lm_head's first, then the layer's, fc's last)
    resident = parameters + optimizer_state + inputs + ALLOCATOR_OVERHEAD_BYTES
    resident += gradients if args.optimizer else 0
    grad_bytes = 0 if args.optimizer else b
    new_grad = b + (4 if args.optimizer else 0)  # a weight gradient before accumulation
    lm_grad = (Vd * H + H) * grad_bytes
    layer_numel = 2 * H * (h + 2 * g) * d + h * d * H + 3 * H * I + 3 * H
    phases: dict[str, float] = {"teacher": resident + table + teacher_extra}

    # Forward. In the last backbone step the earlier outputs, the step-0 keys, each
    # step's own keys and the RoPE temporaries of the queries are live beside the
    # saved tensors; in the heads, all k outputs and one chunk of logits. (Without
    # backbone trimming, when a norm keeps its input itself (fused, or eager in fp32)
    # the outputs are already saved: by the next step's hidden norm, and the last one
    # by its head's norm under trim="none".)
    outs = [m * H * b for m in m_rows]
    if (fused or b == 4) and rows.trim != "backbone":
        outs = [0.0] * (k - 1) + [0.0 if rows.trim == "none" else outs[-1]]
    kind = _attention_kind(args)
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
    phases["forward_backbone"] = resident + table + sum(saved) + sum(outs[:-1]) + keys + rope
    chunk = fused_head_chunk(args.head_chunk_rows, Vd)
    c = min(chunk, max(n_rows)) if trimmed_head else 0
    norm_tmp = 0 if fused else 2 * H * 4  # the eager norm's fp32 temporaries
    head_fwd = c * (Vd * b + norm_tmp + 2 * H * b)
    phases["forward_head"] = resident + table + saved_total + sum(outs) + head_fwd

    # Head backward, heads in the order k-1 .. 0 (recorded last, run first). The table
    # is held by the fused head's checkpoints (the Triton loss of the unfused head keeps
    # only its logits and lse_draft); each head frees what it saved and leaves its
    # output gradient.
    if trimmed_head:
        table_bwd = table
    elif args.loss_impl == "triton":
        table_bwd = rows.teacher_positions * (Vd * args.dtype_bytes + 4)
    else:
        table_bwd = 0.0
    fwd_end = resident + table_bwd + saved_total
    d_out = [(m if rows.trim == "backbone" else R) * H * b for m in m_rows]
    done, head_transient = 0.0, 0.0
    for q, j in enumerate(range(k - 1, -1, -1)):
        if trimmed_head:
            n = n_rows[j]
            cj = min(chunk, n)
            # the chunk's recomputed logits and their gradient, the recomputed norm
            # (eager: fp32 input, pre-weight and output; fused: output) and its gradient
            norm_bwd = 2 * H * b if fused else H * (4 + 3 * b)
            transient = (Vd * H * new_grad + cj * (2 * Vd * b + norm_bwd)
                         + (2 * n * H * b if n > cj else 0))
        else:  # the logits gradient while the logits are held, then lm_head's
            transient = max(R * Vd * b, Vd * H * new_grad + R * H * b) if q else R * Vd * b
        head_transient = max(head_transient, transient)
        phases[f"head_backward_{j}"] = fwd_end + done + (lm_grad if q else 0) + transient
        done += d_out[j] - head[j]

    # Backbone backward of step j: steps <= j still hold their saved tensors and output
    # gradients; step j runs the SwiGLU backward (two [m, I] gradients beyond the
    # freed one) and later the attention backward (by then the SwiGLU tensors are freed).
    def attention_workspace(m):
        if kind == "flex":
            Qp, Lp = _query_len(args, m), _packed_len(args)
            return FLEX_BACKWARD_WORKSPACE * (2 * Qp * h * d * b + 2 * Lp * g * d * b)
        # score gradients in fp32 beside the saved scores
        return 2 * B * h * C * C * (args.sp if kind == "ring" else 1) * 4

    attention_transient = max(attention_workspace(m) for m in m_rows)
    for j in range(k - 1, -1, -1):
        m = m_rows[j]
        held = resident + lm_grad + sum(saved[: j + 1]) + sum(d_out[: j + 1])
        grads = H * I * grad_bytes if j == k - 1 else layer_numel * grad_bytes + H * I * new_grad
        mlp_bwd = 2 * m * I * b
        attn_bwd = attention_workspace(m) - _swiglu_saved(args, m, fused)
        phases[f"backward_{j}"] = held + grads + max(mlp_bwd, attn_bwd)

    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    kept = {"teacher": resident + table, "forward_backbone": resident + table + sum(saved),
            "forward_head": resident + table + saved_total}
    if peak_phase.startswith("head_backward"):
        base = fwd_end
    elif peak_phase.startswith("backward_"):
        j = int(peak_phase.split("_")[1])
        base = resident + sum(saved[: j + 1])
    else:
        base = kept[peak_phase]
    return Memory(
        parameters=int(parameters), gradients=int(gradients), optimizer_state=int(optimizer_state),
        inputs=int(inputs), teacher_table=int(table), teacher_transient=int(teacher_extra),
        saved_per_step=tuple(int(x) for x in saved), attention_saved=tuple(int(x) for x in attn),
        head_saved_per_step=tuple(int(x) for x in head), saved_total=int(saved_total),
        attention_transient=int(attention_transient), head_transient=int(head_transient),
        largest_transient=int(peak - base), phases={n: int(v) for n, v in phases.items()},
        peak_phase=peak_phase, peak=int(peak),
    )


# ---- FLOPs -------------------------------------------------------------------------

def _flops(args: PlanArgs, rows: Rows) -> Flops:
    B, C, k = args.batch, args.own_rows, args.ttt_length
    H, I, Vd, h, g, d = (args.hidden, args.intermediate, args.draft_vocab, args.heads,
                         args.kv_heads, args.d)
    R = rows.kv_rows
    q_f, kv_f, o_f, mlp_f = 2 * 2 * H * h * d, 2 * 2 * 2 * H * g * d, 2 * h * d * H, 2 * 3 * H * I
    fc = 2 * 3 * args.ht * H * R * 2  # forward + weight gradient (aux has none)
    gemm = fc
    for j in range(k):
        m = rows.layer_rows[j]
        if rows.trim == "backbone" and j == 0:
            gemm += 3 * (R * kv_f + m * (q_f + o_f + mlp_f))
        else:
            gemm += 3 * m * (q_f + kv_f + o_f + mlp_f)
    kind = _attention_kind(args)
    attn = 0.0
    for j in range(k):
        if kind == "flex":
            attn += 3.5 * 4 * h * d * FLEX_BLOCK * FLEX_BLOCK * rows.attention_blocks[j]
        else:
            keys = C * (args.sp if kind == "ring" else 1)
            attn += 3 * 4 * B * h * C * keys * d
    if rows.trim == "none":
        head = 3 * 2 * H * Vd * R * k
    else:
        head = 4 * 2 * H * Vd * sum(rows.loss_rows)  # forward, recompute, two gradients
    teacher = 2 * args.ht * args.vocab * rows.teacher_positions
    return Flops(backbone_gemm=gemm, attention=attn, head=head, teacher=teacher,
                 total=gemm + attn + head + teacher)


# ---- public ------------------------------------------------------------------------

def estimate(args: PlanArgs) -> Plan:
    """Plan one TTT step: rows per step, memory by component and the peak, FLOPs.

    Under sequence parallelism every rank is planned and the one with the highest
    peak is returned (with tail supervision the last ranks hold the supervised rows).
    """
    ranks = range(args.sp) if args.sp <= 64 else sorted({0, args.sp - 2, args.sp - 1})
    best = None
    for r in ranks:
        rows = plan_rows(args, r)
        memory = _memory(args, rows)
        if best is None or memory.peak > best[1].peak:
            best = (rows, memory)
    rows, memory = best
    capacity = int(args.gpu_memory_gib * GiB)
    return Plan(args=args, rows=rows, memory=memory, flops=_flops(args, rows),
                fits=memory.peak <= capacity, headroom=capacity - memory.peak)


def format_plan(plan: Plan) -> str:
    """A short table: component and GiB, the peak, whether it fits, TFLOPs per step."""
    a, m, f, r = plan.args, plan.memory, plan.flops, plan.rows
    g = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
    lines = [
        f"S={a.seq_len} B={a.batch} sp={a.sp} {a.density:.0%} {a.pattern}, trim={r.trim}"
        + (" (auto)" if a.trim == "auto" else "") + (", optimizer" if a.optimizer else "")
        + ("" if _fused() else ", eager elementwise") + f", rank {r.rank}",
        f"rows per step (loss)  {[round(x) for x in r.loss_rows]}",
        f"rows per step (layer) {[round(x) for x in r.layer_rows]}",
        f"{'component':<28}{'GiB':>8}",
        f"{'parameters':<28}{g(m.parameters)}",
        f"{'gradients':<28}{g(m.gradients)}",
        f"{'optimizer state':<28}{g(m.optimizer_state)}",
        f"{'inputs / features':<28}{g(m.inputs)}",
        f"{'teacher table':<28}{g(m.teacher_table)}",
        f"{'saved activations':<28}{g(m.saved_total)}",
        f"{'  of which attention':<28}{g(sum(m.attention_saved))}",
        f"{'  of which head / loss':<28}{g(sum(m.head_saved_per_step))}",
        f"{'largest transient':<28}{g(m.largest_transient)}",
        f"{'peak (' + m.peak_phase + ')':<28}{g(m.peak)}",
        f"fits in {a.gpu_memory_gib:g} GiB: {'yes' if plan.fits else 'no'} "
        f"({'headroom' if plan.fits else 'short by'} {abs(plan.headroom) / GiB:.2f} GiB)",
        f"TFLOPs per step: {f.total / 1e12:.1f} (backbone {f.backbone_gemm / 1e12:.1f}, "
        f"attention {f.attention / 1e12:.1f}, head {f.head / 1e12:.1f}, "
        f"teacher {f.teacher / 1e12:.1f})",
    ]
    if a.sp > 1 and a.attention != "eager":
        lines.append(SP_FLEX_NOTE)
    return "\n".join(lines)


SP_FLEX_NOTE = ("note: sp > 1 is planned with the eager ring attention (explicit scores, "
                "memory ~C*S); on CUDA training runs the flex ring path "
                "(seqpar.ring_block_attention, memory linear in the rows), which this plan does "
                "not model yet: its attention figures are an upper bound there")
"""The line ``format_plan`` adds for a sequence-parallel plan of the GPU path."""


def plan(args: PlanArgs) -> None:
    """Print the plan of one TTT step (the ``eagle3fn plan`` command)."""
    print(format_plan(estimate(args)))


__all__ = ["Flops", "Memory", "Plan", "PlanArgs", "Rows", "estimate", "format_plan", "plan",
           "plan_rows", "synthetic_mask", "ALLOCATOR_OVERHEAD_BYTES", "FLEX_BACKWARD_WORKSPACE",
           "FLEX_SAVES_MAX_SCORES", "ROWMAP_MAX_POSITIONS"]
