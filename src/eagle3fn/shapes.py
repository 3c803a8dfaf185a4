"""Frozen records passed between the stages of the data flow.

Legend: B batch, T local buffer length (C own rows + tail), C own rows per sample,
k TTT length, U teacher positions kept in the table, N rows of one step, V target
vocab, Vd draft vocab. Flat draft rows are ``b*C + p``; flat teacher positions are
``b*T + s`` (SPEC section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Features:
    """One batch of target features in SPEC section 1's unshifted convention.

    Give the teacher either as ``target_logits`` or as ``final_hidden`` +
    ``target_head`` (streamed in vocab chunks, never ``[*, V]``).

    Fields:
        input_ids: int64 ``[B, T]``, tokens ``x_t``.
        aux: ``[B, T, 3*Ht]``, ``a_t``: outputs of the three aux target layers.
        attention_mask: ``[B, T]``, 1 on real tokens (right padding).
        target_logits: ``[B, T, V]`` or None, ``z_t`` (predicts ``x_{t+1}``).
        final_hidden: ``[B, T, Ht]`` or None, the target's hidden after its final norm.
        target_head: ``[V, Ht]`` or None, the target's lm_head weight.
        positions: int64 ``[B, T]`` or None (``arange``): t's RoPE position inside its
            document. A packed batch (SPEC 9) holds several documents (conversations)
            per row and restarts positions at 0 in each, so the document holding t
            starts at ``t - positions[b, t]`` (``align.document_starts``); padding
            continues the last document. Under sequence parallelism a chunk's global
            positions (its document began before the buffer). None: one document per
            row, every current path unchanged.
    """

    input_ids: torch.Tensor
    aux: torch.Tensor
    attention_mask: torch.Tensor
    target_logits: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None
    target_head: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass(frozen=True)
class RowMap:
    """Which rows each TTT step computes and where their teachers live (SPEC 6).

    Fields:
        rows: k int64 tensors ``[n_j]``, sorted flat draft rows ``b*C + (s - j)`` for
            every supervised ``s`` with ``j <= s`` and ``s - j < C``.
        teacher_positions: int64 ``[U]``, sorted flat ``b*T + s`` of every supervised
            position some step reaches; row ``u`` of the teacher table is built there.
        table_rows: k int64 tensors ``[n_j]``, index into the teacher table of the
            teacher of each entry of ``rows[j]`` (aligned with it).
        backbone_rows: k int64 tensors; entry 0 is every row ``arange(B*C)``, entry
            ``j >= 1`` is ``union_{j' >= j} rows[j']`` (sorted).
        step0_rows: int64, sorted ``union_j rows[j] = rows[0] | backbone_rows[1]``: the
            rows whose step-0 layer output the trimmed backbone computes.
        denominator: ``B*C``, the ``local_mean`` divisor (padded rows included; a packed
            batch: every position of its packed rows, SPEC 9).
        dead_steps: k bools, ``rows[j]`` is empty.
        batch_size: B.
        num_rows: C, own rows per sample.
        buffer_len: T, positions per sample in the local buffer.
        host: ``HostRows`` or None: the same row map on the host, with the batch's
            host masks, when it was built there and sent to the device
            (``unrolled.rowmap_to_device``); ``ttt`` then plans its steps and checks
            the teachers from it, without waiting for the device.
    """

    rows: tuple[torch.Tensor, ...]
    teacher_positions: torch.Tensor
    table_rows: tuple[torch.Tensor, ...]
    backbone_rows: tuple[torch.Tensor, ...]
    step0_rows: torch.Tensor
    denominator: int
    dead_steps: tuple[bool, ...]
    batch_size: int
    num_rows: int
    buffer_len: int
    host: HostRows | None = None

    @property
    def ttt_length(self) -> int:
        """k, the number of TTT steps."""
        return len(self.rows)


@dataclass(frozen=True)
class HostRows:
    """A device ``RowMap``'s host (CPU) twin and the host masks it was built from:
    what the step's planning reads, so the host never waits for the device to learn
    sizes and indices it already had (SPEC 6; ``unrolled.rowmap_to_device``).

    Fields:
        rowmap: the same ``RowMap`` with host tensors (its own ``host`` None).
        lengths: int64 ``[B]``, real tokens among each sample's ``C`` own positions
            (``attention_mask[:, :C].sum(1)``).
        positions: int64 ``[B, T]`` or None, ``Features.positions`` on the host.
    """

    rowmap: RowMap
    lengths: torch.Tensor
    positions: torch.Tensor | None = None


@dataclass(frozen=True)
class TeacherTable:
    """The target's distribution at the U supervised teacher positions (SPEC 4).

    Built once per batch with no grad; every TTT step reads it by index
    (``RowMap.table_rows``). Compact: it keeps the teacher's draft-vocab logits in the
    dtype the target produced them in (bf16 for a bf16 target: ``2*U*Vd`` bytes) and two
    log-sum-exps per row; the probabilities are computed where they are read, on the
    ``[N, Vd]`` rows of a step (``probs_at``, ``probs_on_draft_at``) or in the kernels'
    registers, never as ``[U, Vd]`` fp32 in the training path.

    Fields:
        logits: ``[U, Vd]``, ``z'[s][t2d]``, the teacher's logits on the draft vocab in
            the target's dtype (bf16/fp16/fp32/fp64), exactly as produced.
        lse_draft: ``[U]``, ``logsumexp_Vd z'[s][t2d]`` in the math dtype (fp32, fp64 for
            fp64 inputs): ``probs = exp(logits - lse_draft)``, renormalised over the draft
            vocab (the soft cross-entropy's target).
        lse_full: ``[U]``, ``logsumexp_V z'[s]`` over the full target vocab, math dtype:
            ``probs_on_draft = exp(logits - lse_full)``, not renormalised (the
            acceptance metric and the LK objectives).
        target_token: int64 ``[U]``, ``argmax_V z'[s]``, ties to the lowest id.
        gate: bool ``[U]``, ``t2d[target_token]``: the row trains only if the target's
            token is in the draft vocab.
    """

    logits: torch.Tensor
    lse_draft: torch.Tensor
    lse_full: torch.Tensor
    target_token: torch.Tensor
    gate: torch.Tensor

    @property
    def num_positions(self) -> int:
        """U, the number of teacher positions."""
        return self.target_token.shape[0]

    @property
    def draft_vocab_size(self) -> int:
        """Vd, the number of draft-vocab columns."""
        return self.logits.shape[1]

    def probs_at(self, rows_N: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` ``softmax(z'[s][t2d])`` of table rows ``rows_N`` (int64 ``[N]``), in
        the math dtype of ``lse_draft``."""
        z = self.logits[rows_N].to(self.lse_draft.dtype)
        return torch.exp(z - self.lse_draft[rows_N, None])

    def probs_on_draft_at(self, rows_N: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` ``exp(z'[s][t2d] - logsumexp_V z'[s])`` of table rows ``rows_N``
        (int64 ``[N]``), in the math dtype of ``lse_full``."""
        z = self.logits[rows_N].to(self.lse_full.dtype)
        return torch.exp(z - self.lse_full[rows_N, None])

    @property
    def probs(self) -> torch.Tensor:
        """``[U, Vd]`` ``probs_at`` of every row: a new dense tensor (tests, diagnostics;
        not for the training path)."""
        return torch.exp(self.logits.to(self.lse_draft.dtype) - self.lse_draft[:, None])

    @property
    def probs_on_draft(self) -> torch.Tensor:
        """``[U, Vd]`` ``probs_on_draft_at`` of every row: a new dense tensor (tests,
        diagnostics; not for the training path)."""
        return torch.exp(self.logits.to(self.lse_full.dtype) - self.lse_full[:, None])

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's tensors (``U*Vd*logits.element_size() + O(U)``)."""
        fields = (self.logits, self.lse_draft, self.lse_full, self.target_token, self.gate)
        return sum(t.numel() * t.element_size() for t in fields)


@dataclass(frozen=True)
class StepTerms:
    """Sums over the rows of one TTT step on one rank (divide once, globally, later).

    All fields are 0-d tensors. Counts are int64; sums have the loss dtype.

    Fields:
        loss_sum: ``sum_rows gate * l(p, j)``, the gated soft cross-entropy (grad).
        correct: rows whose argmax draft token maps to ``target_token``.
        rows: rows of the step (loss-mask rows, gated or not): acc's denominator.
        gated: rows with ``gate`` set: the ``token_mean`` and accept denominators.
        accept_sum: ``sum_{gated rows} sum_v min(probs_on_draft, softmax(logits))``.
        log_accept_sum: ``sum_{gated rows} log a(p, j)`` with ``log 0 := 0``.
    """

    loss_sum: torch.Tensor
    correct: torch.Tensor
    rows: torch.Tensor
    gated: torch.Tensor
    accept_sum: torch.Tensor
    log_accept_sum: torch.Tensor


@dataclass(frozen=True)
class Objective:
    """The TTT objective and per-step metrics (SPEC 5). ``[k]`` tensors per step.

    Fields:
        objective: 0-d, ``sum_j w_j * step_loss[j]`` (the value to backpropagate).
        step_loss: ``[k]``, the per-step term of the objective (KL, or LK alpha/lambda).
        kl_loss: ``[k]``, the soft cross-entropy ``loss_j = loss_sum_j / D_j``.
        acc: ``[k]``, top-1 agreement over loss-mask rows (0 for a dead step).
        accept: ``[k]``, mean expected acceptance over gated rows (0 when none).
        tau: 0-d, simulated acceptance length ``1 + sum_j prod_{i<=j} acc_i``.
    """

    objective: torch.Tensor
    step_loss: torch.Tensor
    kl_loss: torch.Tensor
    acc: torch.Tensor
    accept: torch.Tensor
    tau: torch.Tensor
