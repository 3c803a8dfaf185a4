"""Teacher table (SPEC section 4): the target's distribution at the U teacher positions.

Legend: U teacher positions (``RowMap.teacher_positions``), V target vocab, Vd draft
vocab, H target hidden size. ``t2d: bool[V]`` selects the draft vocab (``vocab.py``).

The table is built once per batch with no grad and shared by every TTT step, which
reads it by index. Math runs in fp32 (fp64 when the inputs are fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3fn.shapes import TeacherTable

DEFAULT_CHUNK_SIZE = 32768


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_t2d(t2d: torch.Tensor, vocab_size: int, what: str) -> None:
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be bool [V], got {t2d.dtype} {tuple(t2d.shape)}")
    if t2d.shape[0] != vocab_size:
        raise ValueError(
            f"t2d has {t2d.shape[0]} entries but the {what} cover a vocab of {vocab_size}; "
            "rebuild the vocab map for this target (eagle3fn.vocab.build_vocab_map)"
        )


def _table(draft_logits_UVd: torch.Tensor, lse_U: torch.Tensor, token_U: torch.Tensor,
           t2d: torch.Tensor) -> TeacherTable:
    return TeacherTable(
        probs=torch.softmax(draft_logits_UVd, dim=-1),
        probs_on_draft=torch.exp(draft_logits_UVd - lse_U[:, None]),
        target_token=token_U,
        gate=t2d[token_U],
    )


@torch.no_grad()
def teacher_table_from_logits(logits_UV: torch.Tensor, t2d: torch.Tensor) -> TeacherTable:
    """Teacher table from target logits ``z'`` at the teacher positions.

    Args:
        logits_UV: ``[U, V]`` shifted target logits (any float dtype).
        t2d: bool ``[V]``, the draft vocab.

    Returns:
        TeacherTable with ``probs, probs_on_draft: [U, Vd]``, ``target_token, gate: [U]``.
    """
    if logits_UV.dim() != 2:
        raise ValueError(f"logits must be [U, V], got shape {tuple(logits_UV.shape)}")
    _check_t2d(t2d, logits_UV.shape[1], "logits")
    z = logits_UV.to(_math_dtype(logits_UV.dtype))
    return _table(z[:, t2d], torch.logsumexp(z, dim=-1), z.argmax(dim=-1), t2d)


@torch.no_grad()
def teacher_table_from_hidden(
    hidden_UH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    t2d: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TeacherTable:
    """Teacher table streamed from ``(final hidden, lm_head)`` over vocab chunks.

    Equals ``teacher_table_from_logits(hidden_UH @ lm_head_VH.T, t2d)`` without ever
    holding ``[U, V]``: each ``[U, chunk]`` block updates a running log-sum-exp and
    argmax (strictly greater wins, so ties keep the lowest id) and scatters its
    draft-vocab columns into the ``[U, Vd]`` draft logits.

    Args:
        hidden_UH: ``[U, H]`` final hidden (after the target's final norm) at ``s + 1``.
        lm_head_VH: ``[V, H]`` target head weight.
        t2d: bool ``[V]``.
        chunk_size: vocab entries per block (peak extra memory ``U * chunk_size``).
    """
    if hidden_UH.dim() != 2 or lm_head_VH.dim() != 2:
        raise ValueError(
            f"hidden must be [U, H] and lm_head [V, H], got {tuple(hidden_UH.shape)} "
            f"and {tuple(lm_head_VH.shape)}"
        )
    if hidden_UH.shape[1] != lm_head_VH.shape[1]:
        raise ValueError(
            f"hidden size {hidden_UH.shape[1]} != lm_head input size {lm_head_VH.shape[1]}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    V = lm_head_VH.shape[0]
    _check_t2d(t2d, V, "lm_head rows")
    U = hidden_UH.shape[0]
    dtype = _math_dtype(torch.promote_types(hidden_UH.dtype, lm_head_VH.dtype))
    device = hidden_UH.device
    Vd = int(t2d.sum())
    # Draft id of each selected target id; the others write a scratch column Vd (an
    # index write, not a boolean-mask one, which would sync the GPU per chunk).
    draft_col = torch.where(t2d, torch.cumsum(t2d, dim=0) - 1, Vd)
    draft_logits = torch.empty(U, Vd + 1, dtype=dtype, device=device)
    run_max = torch.full((U,), float("-inf"), dtype=dtype, device=device)
    run_sum = torch.zeros(U, dtype=dtype, device=device)
    best_id = torch.zeros(U, dtype=torch.long, device=device)
    for start in range(0, V, chunk_size):
        end = min(start + chunk_size, V)
        z = F.linear(hidden_UH, lm_head_VH[start:end]).to(dtype)  # [U, chunk]
        draft_logits.index_copy_(1, draft_col[start:end], z)
        chunk_arg = z.argmax(dim=-1)
        chunk_val = z.gather(1, chunk_arg[:, None]).squeeze(1)
        take = chunk_val > run_max
        best_id = torch.where(take, chunk_arg + start, best_id)
        new_max = torch.maximum(run_max, chunk_val)
        run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
        run_max = new_max
    return _table(draft_logits[:, :Vd], run_max + torch.log(run_sum), best_id, t2d)
