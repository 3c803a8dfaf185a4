"""What the unrolled objective is configured by: ``TTTConfig``, the types it names, and
``Collectives``, what a distributed run plugs in.

The bottom of the ``unrolled`` package: it imports no other module of it, so the
attention, layout and policy modules can name the config without importing the unroll.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch

from eagle3fn.draft import DraftConfig
from eagle3fn.loss import LossConfig
from eagle3fn.shapes import StepTerms
from eagle3fn.teacher import DEFAULT_CHUNK_SIZE

Trim = Literal["none", "loss", "backbone", "auto"]
LossImpl = Literal["auto", "torch", "triton"]
AttentionImpl = Literal["auto", "eager", "flex"]

COMPILE_ELEMENTWISE_DEFAULT = True
"""The default of ``TTTConfig.compile_elementwise``, also for code that runs the draft
without a ``TTTConfig`` (decoding). Code holding a ``TTTConfig`` passes its
field down; nothing here reads the environment (the CLI maps ``EAGLE3FN_COMPILE=0`` to
the field, docs/reference/config.md)."""

DEFAULT_QUERY_BUCKETS = 8
"""The default of ``TTTConfig.query_buckets``."""


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
    score is about the density. The default is the density at which the trimmed
    backbone stops beating the full path on the GPU at 8B shapes, fitted from
    ``benchmarks/step.py`` runs of both paths."""
    auto_loss_share: float = 0.45
    """``trim="auto"``: ``w``, the share of the trimmed path's variable cost that goes
    with the supervised rows (head, loss, the queries' attention) rather than with
    every computed layer row: scattered supervision computes many more layer rows than
    it supervises, and the trimmed path can still win there. The default is
    ``b / (a + b)`` of a least-squares fit of ``time(backbone) / time(none) = c + a*f +
    b*d`` over ``benchmarks/step.py`` runs at several (f, d); 0 decides on the computed
    rows alone."""
    auto_min_rows: int = 4096
    """``trim="auto"``: a batch with fewer own rows (``B*C`` on this rank) takes the
    full path whatever its density. Short steps are bound by kernel launches on the
    host, and the trimmed path launches more kernels, so below some size it loses at
    any density."""
    attention: AttentionImpl = "auto"
    """``eager``: explicit scores, exact on any device (the CPU path). ``flex``:
    compiled FlexAttention of the packed query rows over the step-0 keys with a
    block-sparse causal mask, the diagonal keys merged by log-sum-exp
    (``packed_flex_attention``; the GPU path, no backward on CPU). ``auto``: flex on
    CUDA for heads of at least 16 (inductor's FlexAttention kernels need that), else
    eager."""
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
    262144). Each chunk costs a few dozen kernel launches forward and backward, so
    larger chunks launch fewer kernels; the logits cap keeps the peak."""
    teacher_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Vocab entries per block when the teacher is streamed from the final hidden."""
    compile_elementwise: bool = COMPILE_ELEMENTWISE_DEFAULT
    """On CUDA tensors: fuse the draft's elementwise chains (RMSNorm, RoPE, SwiGLU, the
    streamed teacher's chunk update) with ``torch.compile`` (one fused kernel each way
    instead of 5-15; ``draft.fused_on_cuda``) and merge the diagonal keys with the
    Triton kernel (``kernels.merge``). Off: all of them eager (same maths; rounding
    may differ in the last bit). CPU tensors and ``torch.func`` transforms always run
    eagerly. Default: on (``COMPILE_ELEMENTWISE_DEFAULT``)."""
    flex_kernel_options: tuple[tuple[str, object], ...] | None = None
    """``kernel_options`` of the FlexAttention calls on CUDA, as ``(name, value)``
    pairs (block sizes, warps, stages; see
    ``torch.nn.attention.flex_attention.FlexKernelOptions``); pairs, not a dict, so
    the config stays hashable. ``None``: inductor's defaults for the device.
    ``benchmarks/attention.py --kernel-options`` sweeps them."""
    query_buckets: int = DEFAULT_QUERY_BUCKETS
    """The flex path rounds a step's packed query rows up to a multiple of
    ``Lp / query_buckets`` (in 128-row blocks; Lp = ``B*C`` rounded up to a block):
    at most this many compiled FlexAttention kernels per key length, and query/output
    tensors at most ``Lp / query_buckets`` rows longer than needed
    (``packed_query_len``). 1: always the full key length."""

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
        if self.query_buckets < 1:
            raise ValueError(f"query_buckets must be >= 1, got {self.query_buckets}")


@dataclass(frozen=True)
class Collectives:
    """What a distributed run plugs into ``ttt`` (built by ``eagle3fn.parallel``; this
    package never imports ``torch.distributed``).

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
