"""Loss and metrics (SPEC section 5) over the rows of each step, read from one table.

Legend: N rows of one step, U teacher positions, Vd draft vocab, k TTT length.
Row ``i`` of a step is taught by table row ``table_rows[i]``.

Per step, ``step_terms`` returns *sums* (loss, counts, acceptance); ``objective``
divides once by the global counts, so the same code serves one rank and many
(reduce the sums across ranks first). ``impl`` selects the implementation of the
soft cross-entropy; ``"torch"`` is the readable reference, ``"triton"`` the kernels
of ``kernels/soft_ce.py`` (loss, argmax and acceptance in one pass over the vocab).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3fn.kernels.soft_ce import SoftCE, indexed_soft_ce
from eagle3fn.shapes import Objective, StepTerms, TeacherTable

Impl = Literal["torch", "triton"]
Normalization = Literal["local_mean", "token_mean"]
ObjectiveKind = Literal["kl", "alpha", "lambda"]


@dataclass(kw_only=True, frozen=True)
class LossConfig:
    """How per-step sums become the TTT objective."""

    step_weight_decay: float = 0.8
    """Step j is weighted ``step_weight_decay ** j`` in the objective."""
    normalization: Normalization = "local_mean"
    """``local_mean``: divide step losses by ``B*C`` (every row, padded ones included;
    SpecForge/EAGLE), summed over the ranks of one sequence; data-parallel ranks and the
    micro-batches of a gradient-accumulation step then average their means (SPEC 5). A
    packed batch (SPEC 9) divides by the positions it holds, ``B*C`` of its packed rows,
    so its mean differs from that of the same conversations unpacked (``B*C`` of their
    right-padded rows) by exactly the ratio of those counts; the sums are equal.
    ``token_mean``: divide by the number of gated rows of the step, summed over every
    rank and every micro-batch of the optimizer step (as one batch would): unchanged by
    packing."""
    objective: ObjectiveKind = "kl"
    """``kl``: soft cross-entropy. ``alpha``: LK ``-mean_gated log a``. ``lambda``: LK
    ``w*kl + (1-w)*(1-accept)`` with ``w = kl_scale*exp(-kl_decay*accept)``."""
    kl_scale: float = 1.0
    """LK lambda: scale of the KL weight."""
    kl_decay: float = 1.0
    """LK lambda: decay of the KL weight with the (detached) acceptance."""

    def __post_init__(self) -> None:
        if self.normalization not in ("local_mean", "token_mean"):
            raise ValueError(
                f"normalization must be 'local_mean' or 'token_mean', got {self.normalization!r}"
            )
        if self.objective not in ("kl", "alpha", "lambda"):
            raise ValueError(f"objective must be 'kl', 'alpha' or 'lambda', got {self.objective!r}")
        if self.step_weight_decay <= 0:
            raise ValueError(f"step_weight_decay must be > 0, got {self.step_weight_decay}")


def _math(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_rows(logits_NV: torch.Tensor, table: TeacherTable, table_rows_N: torch.Tensor) -> None:
    if logits_NV.dim() != 2 or table_rows_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"logits must be [N, Vd] with table_rows [N], got {tuple(logits_NV.shape)} "
            f"and {tuple(table_rows_N.shape)}"
        )
    if logits_NV.shape[1] != table.draft_vocab_size:
        raise ValueError(
            f"logits have {logits_NV.shape[1]} draft-vocab columns but the teacher table "
            f"has {table.draft_vocab_size}; the draft's lm_head and t2d disagree"
        )


def _check_impl(impl: str) -> None:
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'torch' or 'triton', got {impl!r}")


def _kernel(logits_NV: torch.Tensor, table: TeacherTable, table_rows_N: torch.Tensor,
            row_mask_N: torch.Tensor | None, d2t: torch.Tensor | None = None) -> SoftCE:
    return indexed_soft_ce(logits_NV, table.logits, table.lse_draft, table.lse_full, table.gate,
                           table_rows_N, row_mask_N=row_mask_N, d2t_V=d2t,
                           target_token_U=None if d2t is None else table.target_token)


def soft_cross_entropy(
    logits_NV: torch.Tensor,
    table: TeacherTable,
    table_rows_N: torch.Tensor,
    *,
    row_mask_N: torch.Tensor | None = None,
    impl: Impl = "torch",
) -> torch.Tensor:
    """Gated soft cross-entropy **summed** over rows (0-d, differentiable in logits).

    ``sum_i gate[t_i] * -sum_v probs[t_i, v] * log_softmax(logits[i])[v]`` with
    ``t_i = table_rows[i]`` and ``probs = exp(table.logits - table.lse_draft)``; fp32
    math (fp64 for fp64 logits or table). N = 0 gives 0.

    Args:
        logits_NV: ``[N, Vd]`` draft logits of the step's rows.
        table: the batch's compact TeacherTable (``logits [U, Vd]``, ``lse_draft``,
            ``gate [U]``); the torch path computes the probabilities of its ``[N, Vd]``
            rows only, the kernels in registers.
        table_rows_N: int64 ``[N]``, indices into the table.
        row_mask_N: bool ``[N]`` or None; rows outside it count as absent (the
            full-length path computes every row and masks, the trimmed one indexes).
        impl: ``"torch"`` (reference) or ``"triton"`` (``kernels.indexed_soft_ce``: streams the
            vocab, reads the table by index; fp64 runs its PyTorch twin).
    """
    _check_rows(logits_NV, table, table_rows_N)
    _check_impl(impl)
    if impl == "triton":
        return _kernel(logits_NV, table, table_rows_N, row_mask_N).loss.sum()
    logp = F.log_softmax(_math(logits_NV), dim=-1)
    per_row = -(table.probs_at(table_rows_N) * logp).sum(dim=-1)
    return torch.where(_gate(table, table_rows_N, row_mask_N), per_row, 0.0).sum()


def _gate(table: TeacherTable, table_rows_N: torch.Tensor,
          row_mask_N: torch.Tensor | None) -> torch.Tensor:
    gate = table.gate[table_rows_N]
    return gate if row_mask_N is None else gate & row_mask_N


def step_terms(
    logits_NV: torch.Tensor,
    table: TeacherTable,
    table_rows_N: torch.Tensor,
    d2t: torch.Tensor,
    *,
    row_mask_N: torch.Tensor | None = None,
    impl: Impl = "torch",
    accept_grad: bool = False,
) -> StepTerms:
    """Loss sum and metric counts of one step's rows (see ``StepTerms``).

    Args:
        logits_NV, table, table_rows_N, row_mask_N, impl: as ``soft_cross_entropy``.
        d2t: int64 ``[Vd]``, draft id ``i`` -> target id ``i + d2t[i]``.
        accept_grad: keep the graph of the acceptance sums (needed by the LK objectives).
            The Triton kernels give no acceptance gradient: with ``impl="triton"`` and
            ``accept_grad`` the acceptance sums fall back to the torch implementation
            (loss and acc still come from the kernel).
    """
    _check_rows(logits_NV, table, table_rows_N)
    _check_impl(impl)
    gate = _gate(table, table_rows_N, row_mask_N)
    if impl == "triton":
        out = _kernel(logits_NV, table, table_rows_N, row_mask_N, d2t)
        loss_sum, correct, accept = out.loss.sum(), out.correct.sum(), out.accept
    else:
        loss_sum = soft_cross_entropy(logits_NV, table, table_rows_N, row_mask_N=row_mask_N,
                                      impl=impl)
        with torch.no_grad():
            pred = logits_NV.argmax(dim=-1)
            match = pred + d2t[pred] == table.target_token[table_rows_N]
            correct = (match if row_mask_N is None else match & row_mask_N).sum()
    rows = logits_NV.shape[0] if row_mask_N is None else row_mask_N.sum()
    if impl == "torch" or accept_grad:  # the kernels' acceptance has no gradient
        with torch.set_grad_enabled(accept_grad and torch.is_grad_enabled()):
            probs = torch.softmax(_math(logits_NV), dim=-1)
            teacher = table.probs_on_draft_at(table_rows_N)  # [N, Vd]
            accept = torch.minimum(teacher, probs).sum(dim=-1)
            accept = torch.where(gate, accept, 0.0)
    # log(1) = 0 stands in for log 0 and for ungated rows (finite gradients).
    log_accept = torch.log(torch.where(gate & (accept > 0), accept, 1.0))
    return StepTerms(
        loss_sum=loss_sum,
        correct=correct,
        # torch.full for an int: as_tensor would copy from the host and sync the GPU.
        rows=rows if isinstance(rows, torch.Tensor) else torch.full((), rows, device=logits_NV.device),
        gated=gate.sum(),
        accept_sum=accept.sum(),
        log_accept_sum=log_accept.sum(),
    )


_TERM_FIELDS = tuple(f.name for f in dataclasses.fields(StepTerms))
"""``StepTerms``' field names, read once (dynamo cannot read a dataclass's fields)."""


def head_step_terms(
    hidden_NH: torch.Tensor,
    head: Callable[..., torch.Tensor],
    head_weights: Sequence[torch.Tensor],
    table: TeacherTable,
    table_rows_N: torch.Tensor,
    d2t: torch.Tensor,
    *,
    row_mask_N: torch.Tensor | None = None,
    impl: Impl = "torch",
    accept_grad: bool = False,
    chunk_rows: int = 1024,
) -> StepTerms:
    """``step_terms(head(hidden, *head_weights), ...)`` without keeping the logits.

    The rows are processed in chunks of ``chunk_rows``; each chunk's logits
    ``[chunk, Vd]`` are dropped after its terms are computed and recomputed in
    backward (``torch.utils.checkpoint``), so no ``[N, Vd]`` tensor outlives a chunk.
    Gradients reach ``hidden`` and every tensor of ``head_weights`` (passed as explicit
    inputs so the recomputation needs no module state). Under ``torch.func`` transforms,
    which do not support checkpointing, the logits are computed whole and kept; so they
    are inside a compiled graph (``--compile-step``, whose backward keeps them anyway),
    where the graph then holds for any ``N``.

    Args:
        hidden_NH: ``[N, H]`` pre-norm outputs of the step's rows.
        head: ``head(hidden_chunk, *head_weights) -> [chunk, Vd]`` logits.
        chunk_rows: rows per chunk (peak logits memory ``chunk_rows * Vd``).
        others: as ``step_terms``.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    # Whole, not chunked: under torch.func (no checkpointing there), and inside a compiled
    # step, whose backward keeps every chunk's logits anyway (``train.onegraph.REMAT``)
    # and whose graph a loop over the rows would fix to one row count. Dynamo cannot ask
    # whether a tensor is functorch-wrapped, so that question comes second.
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(hidden_NH):
        return step_terms(head(hidden_NH, *head_weights), table, table_rows_N, d2t,
                          row_mask_N=row_mask_N, impl=impl, accept_grad=accept_grad)
    names = _TERM_FIELDS
    sums = None
    for start in range(0, max(hidden_NH.shape[0], 1), chunk_rows):
        rows = slice(start, start + chunk_rows)
        mask = None if row_mask_N is None else row_mask_N[rows]

        def chunk_terms(h, *weights, rows=rows, mask=mask):
            t = step_terms(head(h, *weights), table, table_rows_N[rows], d2t, row_mask_N=mask,
                           impl=impl, accept_grad=accept_grad)
            return tuple(getattr(t, n) for n in names)

        part = checkpoint(chunk_terms, hidden_NH[rows], *head_weights, use_reentrant=False)
        sums = part if sums is None else tuple(a + b for a, b in zip(sums, part))
    return StepTerms(**dict(zip(names, sums)))


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with ``0 / 0 = 0`` (a dead step contributes nothing)."""
    return num / den.clamp_min(1).to(num.dtype)


def objective(terms: Sequence[StepTerms], denominator: int | torch.Tensor,
              config: LossConfig = LossConfig()) -> Objective:
    """Combine per-step sums into the objective and metrics (SPEC section 5).

    Args:
        terms: k StepTerms, already summed over ranks when data/sequence parallel.
        denominator: ``B*C`` summed over ranks (``RowMap.denominator`` on one rank);
            used by ``local_mean``.
        config: step weights, normalisation and objective kind.
    """
    stack = lambda name: torch.stack([getattr(t, name) for t in terms])  # noqa: E731
    loss_sum, gated = stack("loss_sum"), stack("gated")
    if config.normalization == "local_mean":
        kl = loss_sum / denominator
    else:
        kl = _ratio(loss_sum, gated)
    acc = _ratio(stack("correct").to(loss_sum.dtype), stack("rows"))
    accept = _ratio(stack("accept_sum"), gated)
    if config.objective == "kl":
        step_loss = kl
    elif config.objective == "alpha":
        step_loss = -_ratio(stack("log_accept_sum"), gated)
    else:
        w = config.kl_scale * torch.exp(-config.kl_decay * accept.detach())
        step_loss = w * kl + (1 - w) * (1 - accept)
    weights = config.step_weight_decay ** torch.arange(
        len(terms), dtype=loss_sum.dtype, device=loss_sum.device
    )
    return Objective(
        objective=(weights * step_loss).sum(),
        step_loss=step_loss,
        kl_loss=kl,
        acc=acc,
        accept=accept,
        tau=1 + torch.cumprod(acc, dim=0).sum(),
    )
