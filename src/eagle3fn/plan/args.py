"""What the planner plans: ``PlanArgs``, one TTT step's shapes and settings (the
``eagle3fn plan`` flags), and the facts derived from them alone.

Legend: S sequence length, B batch, sp sequence-parallel degree, C = ceil(S/sp) own
rows per sample on one rank, T = C + tail local buffer, k TTT length, H draft hidden,
Ht target hidden, I MLP width, h heads, g kv heads, d head dim, V target vocab, Vd
draft vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from eagle3fn.teacher import DEFAULT_CHUNK_SIZE
from eagle3fn.unrolled import TTTConfig

GiB = 2**30

Pattern = Literal["tail", "scattered"]
Trim = Literal["none", "loss", "backbone", "auto"]
Attention = Literal["auto", "flex", "eager"]
LossImpl = Literal["triton", "torch"]

TTT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TTTConfig)}
"""``TTTConfig``'s field defaults by name: the planner's defaults for the settings a
step runs with (one source of truth for the values)."""


@dataclass(kw_only=True)
class PlanArgs:
    """One TTT step to plan (defaults: the draft of an 8B Llama target at 8192 tokens,
    30% tail supervision)."""

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
    resolved per rank by ``unrolled.choose_trim``)."""
    auto_backbone_fraction: float = TTT_DEFAULTS["auto_backbone_fraction"]
    """``trim="auto"``: backbone when its cost score is at most this
    (``TTTConfig.auto_backbone_fraction``)."""
    auto_loss_share: float = TTT_DEFAULTS["auto_loss_share"]
    """``trim="auto"``: the score's weight on the supervised rows against the computed
    layer rows (``TTTConfig.auto_loss_share``)."""
    auto_min_rows: int = TTT_DEFAULTS["auto_min_rows"]
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
    """Memory of one GPU in GiB (default 139: the usable memory of a 141 GB card)."""
    head_chunk_rows: int = TTT_DEFAULTS["head_chunk_rows"]
    """Most rows per chunk of the fused head (``TTTConfig.head_chunk_rows``, 4096; fewer
    for large Vd, ``unrolled.fused_head_chunk``)."""
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


def attention_kind(args: PlanArgs) -> str:
    """``flex``, ``eager`` or ``ring`` (the sequence-parallel attention, modelled as
    its eager path: explicit scores; on CUDA training takes the flex ring path, whose
    memory is linear in the rows and is not modelled yet: ``SP_FLEX_NOTE``)."""
    if args.sp > 1:
        return "ring"
    return "flex" if args.attention in ("auto", "flex") else "eager"
