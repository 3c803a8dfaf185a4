"""Memory and FLOP planner: what one TTT step needs on one GPU, from the shapes alone.

Legend: S sequence length, B batch, sp sequence-parallel degree, C = ceil(S/sp) own
rows per sample on one rank, T = C + tail local buffer (tail = k when sp > 1, else 0),
Cp = C rounded up to the flex block (128), k TTT length, H draft hidden, Ht target
hidden, I MLP width, h heads, g kv heads, d head dim, V target vocab, Vd draft vocab,
b bytes per compute-dtype element, n_j loss rows of step j, m_j layer rows of step j,
U teacher positions.

The memory model is the list of tensors ``ttt.ttt`` keeps for backward, op by op
(RMSNorm keeps its fp32 input, its rsqrt and its pre-weight output; each linear its
input; SwiGLU four ``[rows, I]``; FlexAttention its query, the k-segment key and value
concatenations, its output and log-sum-exp; the fused head only its input rows; the
unfused head its logits), plus what lives beside them at each moment a step can
peak: while the teacher table is built, in the last layer step and the last head of
the forward, in the heads' backward (recorded last, they run first) and in the
layer's backward of each step (``Memory.phases``). The tests (tests/test_plan.py) run
the real ``ttt`` on CPU under ``saved_tensors_hooks`` and compare with
``Memory.saved_total``; the peak also depends on the GPU constants below.

FLOPs are counted as the code executes them: every GEMM (forward, and backward as
two GEMMs per weight, one where the input needs no gradient), FlexAttention per
computed 128x128 block (causal blocks, the diagonal blocks of steps 1..j, inactive
query blocks skipped under ``trim="backbone"``), the fused head's recomputation, and
the streamed teacher (forward only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from eagle3fn.rowmap import build_rowmap
from eagle3fn.teacher import DEFAULT_CHUNK_SIZE
from eagle3fn.ttt import FLEX_BLOCK, TTTConfig

GiB = 2**30

# ---- GPU constants: calibrated on one H200 (torch 2.11 + cu130) at the BENCH.md 8B
# shapes against measured ``max_memory_allocated`` (docs/tutorials/plan.md has the
# validation table). Recalibrate them when torch, the kernels or the GPU change. ------

ALLOCATOR_OVERHEAD_BYTES = 64 * 2**20
"""Bytes the CUDA caching allocator holds beyond the tensors modelled here: cuBLAS /
cuBLASLt workspaces (allocated through the caching allocator and kept after the
first GEMM) and the 512-byte rounding of blocks. Measured on the H200: 63 MiB above
parameters + features before a step, at 8192 and at 16384 tokens."""

FLEX_BACKWARD_WORKSPACE = 1.0
"""FlexAttention backward working memory, as a multiple of ``dq + dk + dv``
(``[B, h, Cp, d]`` and two ``[B, g, k*Cp, d]``). Not yet calibrated: on the H200 at
8192-16384 tokens the step peaks in the forward or in the heads' backward, never
inside an attention backward."""

FLEX_OUTPUT_FOLLOWS_QUERY = True
"""FlexAttention lays its output out like its query. When C is a multiple of 128 the
padded query is a clone of the ``[B, C, h, d]``-ordered projection, so ``o_proj``'s
input is a view of the output; otherwise padding makes it ``[B, h, Cp, d]`` and
``o_proj`` keeps a copy. Seen on the CPU reference and the compiled H200 kernel."""

FLEX_SAVES_MAX_SCORES = True
"""FlexAttention keeps an fp32 ``[B, h, Cp]`` row maximum beside the log-sum-exp
(torch's autograd op does; 1 MiB per step at 8B shapes, within the H200 match)."""

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
    """``trim="auto"``: backbone when its layer rows are at most this fraction of
    ``k*B*C`` (``TTTConfig.auto_backbone_fraction``)."""
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
    """Rows per chunk of the fused head (``TTTConfig.head_chunk_rows``, 2048)."""
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
        attention_blocks: ``[k]``, 128x128 blocks FlexAttention computes at step j (query
            blocks without a needed row are skipped under backbone trimming).
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
        teacher_table: ``probs`` and ``probs_on_draft`` ``[U, Vd]`` fp32, tokens, gates.
        teacher_transient: extra bytes while the table is streamed from the final
            hidden (gathered hidden, fp32 vocab blocks, draft logits).
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


def _block_costs(nb: int, real: int, j: int) -> torch.Tensor:
    """int64 ``[nb]``: 128x128 key blocks FlexAttention computes for each query block
    at step j of a sample with ``real`` valid rows (``ttt.eagle_block_mask``): the full
    causal blocks below it, the edge block, and j diagonal blocks."""
    m = torch.arange(nb)
    full = m.clamp(max=real // FLEX_BLOCK)
    last_real = -(-real // FLEX_BLOCK) - 1
    return full + (full <= m.clamp(max=last_real)).long() + j


def _real_rows(args: PlanArgs, rank: int) -> int:
    """Own rows of ``rank`` that are real positions (the last rank may be padded)."""
    return max(0, min(args.own_rows, args.seq_len - rank * args.own_rows))


def _rows_from_rowmap(args: PlanArgs, rank: int, rm) -> tuple:
    """(loss rows, computed rows, flex blocks of the computed rows, U) from the real
    row map ``rm`` of ``synthetic_mask``."""
    from eagle3fn.ttt import computed_rows

    C, k = args.own_rows, args.ttt_length
    nb = -(-C // FLEX_BLOCK)
    comp = computed_rows(rm)
    real = _real_rows(args, rank)
    blocks = []
    for j, c in enumerate(comp):
        active = torch.zeros(args.batch, nb, dtype=torch.bool)
        active.view(-1)[(c // C) * nb + (c % C) // FLEX_BLOCK] = True
        blocks.append(float((_block_costs(nb, real, j) * active).sum()))
    return (tuple(float(r.numel()) for r in rm.rows), tuple(float(c.numel()) for c in comp),
            tuple(blocks), float(rm.teacher_positions.numel()))


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
    ``1 - (1-q)^v``, v the steps ``>= j`` whose teacher of p can be supervised)."""
    B, C, k, o = args.batch, args.own_rows, args.ttt_length, rank * args.own_rows
    nb = -(-C // FLEX_BLOCK)
    L = _limits(args, rank)
    real = _real_rows(args, rank)
    s_hi = min(args.buffer_len - 1, args.seq_len - 2 - o, C + k - 2)
    if args.pattern == "tail":
        a = _tail_start(args)
        span = [(max(0, a - o - j), L[j]) for j in range(k)]
        comp = [_merge(span)] + [_merge(span[j:]) for j in range(1, k)]
        size = lambda iv: float(B * sum(hi - lo + 1 for lo, hi in iv))  # noqa: E731
        blocks = []
        for j, iv in enumerate(comp):
            active = torch.zeros(nb, dtype=torch.bool)
            for lo, hi in iv:
                active[lo // FLEX_BLOCK: hi // FLEX_BLOCK + 1] = True
            blocks.append(float(B * _block_costs(nb, real, j)[active].sum()))
        U = float(B * max(0, s_hi - max(a - o, 0) + 1))
        return tuple(size(_merge([span[j]])) for j in range(k)), tuple(size(iv) for iv in comp), tuple(blocks), U
    q = args.density

    def expected(j0: int) -> tuple[float, float]:
        rows, prev, last = 0.0, -1, -1
        for v in range(k - j0, 0, -1):  # L is non-increasing: p <= L_{j0+v-1} has v steps
            hi = L[j0 + v - 1]
            rows += max(0, hi - prev) * (1 - (1 - q) ** v)
            prev, last = max(prev, hi), max(last, hi)
        p_row = 1 - (1 - q) ** (k - j0)  # interior rows; blocks hold 128 of them
        starts = torch.arange(nb) * FLEX_BLOCK
        n = ((last + 1) - starts).clamp(0, FLEX_BLOCK).double()
        active = 1 - (1 - p_row) ** n
        return B * rows, B * float((active * _block_costs(nb, real, j0)).sum())

    loss = tuple(B * q * max(0, L[j] + 1) for j in range(k))
    comp = [expected(0)] + [expected(j) for j in range(1, k)]
    return loss, tuple(c for c, _ in comp), tuple(b for _, b in comp), float(B * q * max(0, s_hi + 1))


def _auto_choice(args: PlanArgs, computed: tuple[float, ...], rowmap=None) -> str:
    """``trim="auto"`` as ``ttt.choose_trim`` decides it: on the real row map when there
    is one, else its rule on counts (backbone iff the computed layer rows are at most
    ``auto_backbone_fraction`` of ``k*B*C``; the other path is read from ``choose_trim``
    itself, on a row map where backbone cannot win)."""
    from eagle3fn.draft import DraftConfig
    from eagle3fn.ttt import choose_trim

    draft = DraftConfig(hidden_size=8, intermediate_size=8, num_heads=1, num_kv_heads=1,
                        vocab_size=2, draft_vocab_size=2)
    config = TTTConfig(draft=draft, ttt_length=args.ttt_length, trim="auto",
                       auto_backbone_fraction=args.auto_backbone_fraction)
    if rowmap is not None:
        return choose_trim(rowmap, config)
    total = args.ttt_length * args.batch * args.own_rows
    if sum(computed) <= args.auto_backbone_fraction * total:
        return "backbone"
    every = build_rowmap(torch.ones(1, args.ttt_length + 1, dtype=torch.bool), args.ttt_length)
    return choose_trim(every, dataclasses.replace(config, auto_backbone_fraction=0.0))


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
    trim = args.trim if args.trim != "auto" else _auto_choice(args, computed, rowmap)
    real = _real_rows(args, rank)
    if trim != "backbone":
        nb = -(-C // FLEX_BLOCK)
        computed = (float(B * C),) * k
        blocks = tuple(float(B * _block_costs(nb, real, j).sum()) for j in range(k))
    if trim == "none":
        U = float(B * T)
    return Rows(rank=rank, trim=trim, loss_rows=loss, layer_rows=computed, kv_rows=B * C,
                teacher_positions=U, attention_blocks=blocks, exact=exact)


# ---- memory ------------------------------------------------------------------------

def _attention_kind(args: PlanArgs) -> str:
    """``flex``, ``eager`` or ``ring`` (the sequence-parallel attention)."""
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


def _flex_mask_bytes(B: int, nb: int, k: int) -> int:
    """int32 block-mask tables of one step: kv and q tables, partial and full."""
    return 4 * (2 * B * nb + 2 * B * nb * k * nb + 2 * B * k * nb + 2 * B * k * nb * nb)


def _attention_saved(args: PlanArgs, j: int, kind: str | None = None,
                     hops: int | None = None) -> float:
    """Bytes the attention call of step j keeps for backward (every path runs the
    dense ``[B, h, C, d]`` queries; trimmed rows are zeros there). ``kind`` and
    ``hops`` (earlier ring blocks seen) default to the planned rank's."""
    b, B, C, k = args.dtype_bytes, args.batch, args.own_rows, args.ttt_length
    h, g, d = args.heads, args.kv_heads, args.d
    kind = kind or _attention_kind(args)
    if kind == "flex":
        Cp = -(-C // FLEX_BLOCK) * FLEX_BLOCK
        P = B * Cp
        nb = Cp // FLEX_BLOCK
        lse = P * h * 4 * (2 if FLEX_SAVES_MAX_SCORES else 1)
        return 2 * P * h * d * b + 2 * B * k * Cp * g * d * b + lse + P + 8 + _flex_mask_bytes(B, nb, k)
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


def _o_proj_input(args: PlanArgs, rows: float, trimmed: bool) -> float:
    """What ``o_proj`` keeps: its input rows, unless a view of the flex output."""
    b, B, C = args.dtype_bytes, args.batch, args.own_rows
    hd = args.heads * args.d
    if trimmed:
        return rows * hd * b  # gathered rows
    if _attention_kind(args) == "flex" and FLEX_OUTPUT_FOLLOWS_QUERY and C % FLEX_BLOCK == 0:
        return 0.0  # a view of the flex output
    return B * C * hd * b


def _layer_saved(args: PlanArgs, rows: float, b: int) -> float:
    """Norms, q/k/v input, post-attention norm and SwiGLU of ``rows`` rows."""
    H, I = args.hidden, args.intermediate
    input_norm = rows * H * b
    hidden_norm = rows * (H * 4 + 4 + H * b)  # fp32 input, rsqrt, pre-weight output
    qkv_input = rows * 2 * H * b
    post_norm = rows * (H * 4 + 4 + 2 * H * b)  # + its output, the MLP's input
    mlp = rows * 4 * I * b  # gate, silu(gate), up, silu*up
    return input_norm + hidden_norm + qkv_input + post_norm + mlp


def _backbone_saved(args: PlanArgs, rows: Rows) -> tuple[list[float], list[float]]:
    """Per step: (everything the backbone keeps, the attention's share)."""
    b, k, d = args.dtype_bytes, args.ttt_length, args.d
    H, h, g = args.hidden, args.heads, args.kv_heads
    R = rows.kv_rows
    saved, attn = [], []
    for j in range(k):
        m = rows.layer_rows[j]
        a = _attention_saved(args, j)
        dense_q = m * h * d * b  # trimmed: index_copy into the dense queries keeps its source
        if rows.trim != "backbone":
            s = _layer_saved(args, R, b) + 2 * R * d * b + a + _o_proj_input(args, R, False)
        elif j == 0:
            # every row: embedding norm, hidden norm, u for k/v; rows[0]: u[r0], q
            s = (R * H * b + R * (H * 4 + 4 + H * b) + R * 2 * H * b + m * 2 * H * b + m * 8
                 + 2 * R * d * b + 2 * m * d * b + dense_q + a + _o_proj_input(args, m, True)
                 + m * (H * 4 + 4 + 2 * H * b) + m * 4 * args.intermediate * b)
        else:
            s = (_layer_saved(args, m, b) + m * 8 + 4 * m * d * b + 2 * m * g * d * b
                 + dense_q + a + _o_proj_input(args, m, True))
        saved.append(s)
        attn.append(a)
    return saved, attn


def _head_saved(args: PlanArgs, rows: Rows) -> list[float]:
    """Per step: what the head and loss keep for backward."""
    b, H, Vd, k = args.dtype_bytes, args.hidden, args.draft_vocab, args.ttt_length
    out = []
    for j in range(k):
        if rows.trim == "none":
            R = rows.kv_rows
            # fp32 norm input: a copy in bf16; in fp32 the step's own output, already
            # kept by the next step's hidden norm (all but the last step)
            y32 = R * H * 4 if (b != 4 or j == k - 1) else 0.0
            s = y32 + R * 4 + 2 * R * H * b + R * 8 + R
            if args.loss_impl == "triton":
                s += R * Vd * b + 2 * R * 4
            else:
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
    cs = min(args.teacher_chunk_size, V)
    last = V - (math.ceil(V / cs) - 1) * cs
    table = U * (2 * Vd * 4 + 8 + 1)
    # loop: old z fp32, z - max, exp(z - max) beside the draft logits; then the table
    # (draft logits, probs, the exp temporary, probs_on_draft) beside the last block
    per_row = max(4 * Vd + 12 * cs, 16 * Vd + 4 * last) + args.ht * args.dtype_bytes
    return table, U * per_row + V * 8 - table


def _inputs_bytes(args: PlanArgs, rows: Rows) -> float:
    """Features (int64 ids and attention mask, bool masks, aux, final hidden, target
    head), vocab maps and the row map's index tensors."""
    b, B, T = args.dtype_bytes, args.batch, args.buffer_len
    features = B * T * (8 + 8 + 1 + 1) + B * T * 4 * args.ht * b + args.vocab * args.ht * b
    vocab = args.draft_vocab * 8 + args.vocab
    rowmap = 8 * (2 * sum(rows.loss_rows) + rows.teacher_positions + rows.kv_rows
                  + sum(rows.layer_rows[1:]))
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
    saved, attn = _backbone_saved(args, rows)
    head = _head_saved(args, rows)
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

    # Forward. In the last backbone step the earlier outputs, every step's keys and the
    # RoPE temporaries of the queries are live beside the saved tensors; in the heads,
    # all k outputs and one chunk of logits. (In fp32 the full path's outputs are what
    # the next hidden norm keeps.)
    outs = [m * H * b for m in m_rows]
    if b == 4 and rows.trim != "backbone":
        outs = [0.0] * (k - 1) + [outs[-1]]
    keys = k * 2 * B * C * g * d * b
    # the query projection, x*cos, rotate_half(x)*sin and their sum (trimmed: or the
    # dense zero-filled queries handed to the attention)
    if rows.trim == "backbone":
        rope = max(4 * m_rows[-1] * h * d * b, R * h * d * b)
    else:
        rope = 4 * R * h * d * b
    phases["forward_backbone"] = resident + table + sum(saved) + sum(outs[:-1]) + keys + rope
    c = min(args.head_chunk_rows, max(n_rows)) if trimmed_head else 0
    head_fwd = c * (Vd * b + 2 * H * 4 + 2 * H * b)
    phases["forward_head"] = resident + table + saved_total + sum(outs) + head_fwd

    # Head backward, heads in the order k-1 .. 0 (recorded last, run first). The table
    # is held by the fused head's checkpoints (the Triton loss of the unfused head keeps
    # only probs); each head frees what it saved and leaves its output gradient.
    if trimmed_head:
        table_bwd = table
    else:
        table_bwd = rows.teacher_positions * Vd * 4 if args.loss_impl == "triton" else 0.0
    fwd_end = resident + table_bwd + saved_total
    d_out = [(m if rows.trim == "backbone" else R) * H * b for m in m_rows]
    done, head_transient = 0.0, 0.0
    for q, j in enumerate(range(k - 1, -1, -1)):
        if trimmed_head:
            n = n_rows[j]
            cj = min(args.head_chunk_rows, n)
            transient = (Vd * H * new_grad + cj * (2 * Vd * b + H * (4 + 3 * b))
                         + (2 * n * H * b if n > cj else 0))
        else:  # the logits gradient while the logits are held, then lm_head's
            transient = max(R * Vd * b, Vd * H * new_grad + R * H * b) if q else R * Vd * b
        head_transient = max(head_transient, transient)
        phases[f"head_backward_{j}"] = fwd_end + done + (lm_grad if q else 0) + transient
        done += d_out[j] - head[j]

    # Backbone backward of step j: steps <= j still hold their saved tensors and output
    # gradients; step j runs the SwiGLU backward (two [m, I] gradients beyond the
    # freed one) and later the attention backward (by then the SwiGLU tensors are freed).
    Cp = -(-C // FLEX_BLOCK) * FLEX_BLOCK
    kind = _attention_kind(args)
    if kind == "flex":
        attention_transient = FLEX_BACKWARD_WORKSPACE * (2 * B * Cp * h * d * b
                                                         + 2 * B * k * Cp * g * d * b)
    else:  # score gradients in fp32 beside the saved scores
        attention_transient = 2 * B * h * C * C * (args.sp if kind == "ring" else 1) * 4
    for j in range(k - 1, -1, -1):
        m = m_rows[j]
        held = resident + lm_grad + sum(saved[: j + 1]) + sum(d_out[: j + 1])
        grads = H * I * grad_bytes if j == k - 1 else layer_numel * grad_bytes + H * I * new_grad
        mlp_bwd = 2 * m * I * b
        attn_bwd = attention_transient - 4 * m * I * b
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
        + f", rank {r.rank}",
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
    return "\n".join(lines)


def plan(args: PlanArgs) -> None:
    """Print the plan of one TTT step (the ``eagle3fn plan`` command)."""
    print(format_plan(estimate(args)))


__all__ = ["Flops", "Memory", "Plan", "PlanArgs", "Rows", "estimate", "format_plan", "plan",
           "plan_rows", "synthetic_mask", "ALLOCATOR_OVERHEAD_BYTES", "FLEX_BACKWARD_WORKSPACE",
           "FLEX_OUTPUT_FOLLOWS_QUERY", "FLEX_SAVES_MAX_SCORES", "ROWMAP_MAX_POSITIONS"]
