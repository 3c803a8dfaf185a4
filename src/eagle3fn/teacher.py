"""Teacher table (SPEC section 4): the target's distribution at the U teacher positions.

Legend: U teacher positions (``RowMap.teacher_positions``), V target vocab, Vd draft
vocab, H target hidden size. ``t2d: bool[V]`` selects the draft vocab (``vocab.py``).

The table is built once per batch with no grad and shared by every TTT step, which
reads it by index. It keeps the teacher's draft-vocab logits as produced (bf16 for a
bf16 target) and two log-sum-exps per row (``shapes.TeacherTable``); math runs in
fp32 (fp64 when the inputs are fp64).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from eagle3fn.draft import elementwise, fused_on_cuda
from eagle3fn.shapes import TeacherTable

DEFAULT_CHUNK_SIZE = 32768


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


_BOUNDS: dict[int, tuple] = {}
"""``_chunk_bounds``'s memo: ``id(t2d) -> (weakref to t2d, its version, chunk, bounds)``."""


def _chunk_bounds(t2d: torch.Tensor, cum: torch.Tensor, chunk_size: int) -> list[int]:
    """The draft ids of vocab chunk c are ``[bounds[c], bounds[c + 1])``: read from
    ``cum = cumsum(t2d)`` on the host once per vocab map (a run's ``t2d`` is fixed), so
    later batches make no host sync for it. The memo holds ``t2d`` weakly and checks its
    identity and version, so a changed or new map is read again."""
    V = t2d.shape[0]
    hit = _BOUNDS.get(id(t2d))
    if hit is not None and hit[0]() is t2d and hit[1:3] == (t2d._version, chunk_size):
        return hit[3]
    last = torch.arange(chunk_size - 1, V + chunk_size - 1, chunk_size, device=cum.device)
    bounds = [0] + cum[last.clamp_max(V - 1)].tolist()
    if len(_BOUNDS) > 64:
        _BOUNDS.clear()
    _BOUNDS[id(t2d)] = (weakref.ref(t2d), t2d._version, chunk_size, bounds)
    return bounds


def vocab_chunk_bounds(t2d: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[int]:
    """``bounds``, ``len = ceil(V / chunk_size) + 1``: the draft ids of vocab chunk c of
    ``teacher_table_from_hidden`` are ``[bounds[c], bounds[c + 1])`` (one host read of
    ``t2d`` bool ``[V]``). A compiled region takes them as an argument, as it cannot
    read the device."""
    return _chunk_bounds(t2d, torch.cumsum(t2d, dim=0), chunk_size)


def _check_t2d(t2d: torch.Tensor, vocab_size: int, what: str) -> None:
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be bool [V], got {t2d.dtype} {tuple(t2d.shape)}")
    if t2d.shape[0] != vocab_size:
        raise ValueError(
            f"t2d has {t2d.shape[0]} entries but the {what} cover a vocab of {vocab_size}; "
            "rebuild the vocab map for this target (eagle3fn.vocab.build_vocab_map)"
        )


def _table(logits_UVd: torch.Tensor, lse_draft_U: torch.Tensor, lse_full_U: torch.Tensor,
           token_U: torch.Tensor, t2d: torch.Tensor) -> TeacherTable:
    return TeacherTable(logits=logits_UVd, lse_draft=lse_draft_U, lse_full=lse_full_U,
                        target_token=token_U, gate=t2d[token_U])


def _draft_lse(logits_UVd: torch.Tensor, dtype: torch.dtype, block_rows: int) -> torch.Tensor:
    """``[U]`` ``logsumexp`` of the rows of ``logits_UVd`` upcast to ``dtype``, ``block_rows``
    rows at a time (the upcast copy and its temporaries are ``[block_rows, Vd]``). Inside a
    compiled graph (``--compile-step``) in one piece: inductor fuses the upcast into the
    reduction, and a loop over the rows would fix the graph to one row count."""
    if torch.compiler.is_compiling():
        return torch.logsumexp(logits_UVd.to(dtype), dim=-1)
    step = max(block_rows, 1)
    blocks = [torch.logsumexp(logits_UVd[r:r + step].to(dtype), dim=-1)
              for r in range(0, logits_UVd.shape[0], step)]
    return torch.cat(blocks) if blocks else logits_UVd.new_empty(0, dtype=dtype)


@torch.no_grad()
def teacher_table_from_logits(logits_UV: torch.Tensor, t2d: torch.Tensor) -> TeacherTable:
    """Teacher table from target logits ``z'`` at the teacher positions.

    Args:
        logits_UV: ``[U, V]`` shifted target logits (any float dtype).
        t2d: bool ``[V]``, the draft vocab.

    Returns:
        TeacherTable with ``logits: [U, Vd]`` in ``logits_UV``'s dtype, ``lse_draft,
        lse_full: [U]`` in fp32 (fp64 for fp64 logits), ``target_token, gate: [U]``.
    """
    if logits_UV.dim() != 2:
        raise ValueError(f"logits must be [U, V], got shape {tuple(logits_UV.shape)}")
    _check_t2d(t2d, logits_UV.shape[1], "logits")
    z = logits_UV.to(_math_dtype(logits_UV.dtype))
    draft = logits_UV[:, t2d]
    return _table(draft, _draft_lse(draft, z.dtype, draft.shape[0]),
                  torch.logsumexp(z, dim=-1), z.argmax(dim=-1), t2d)


@torch.no_grad()
def teacher_table_from_hidden(
    hidden_UH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    t2d: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compile_elementwise: bool = True,
    bounds: list[int] | None = None,
) -> TeacherTable:
    """Teacher table streamed from ``(final hidden, lm_head)`` over vocab chunks.

    Equals ``teacher_table_from_logits(hidden_UH @ lm_head_VH.T, t2d)`` without ever
    holding ``[U, V]``: each ``[U, chunk]`` block updates a running log-sum-exp and
    argmax (strictly greater wins, so ties keep the lowest id) and writes its draft-vocab
    columns (a contiguous range of draft ids, both vocabs being in id order) into the
    table's logits, as produced; the draft-vocab log-sum-exp is then taken over the
    table's rows, in blocks of about ``U * chunk_size`` entries.

    Args:
        hidden_UH: ``[U, H]`` final hidden (after the target's final norm) at ``s + 1``.
        lm_head_VH: ``[V, H]`` target head weight.
        t2d: bool ``[V]``.
        chunk_size: vocab entries per block (peak extra memory ``~12 * U * chunk_size``
            bytes beside the table).
        compile_elementwise: each block's running update fused into one or two
            compiled kernels on CUDA (``draft.fused_on_cuda``); off: eager.
        bounds: ``vocab_chunk_bounds(t2d, chunk_size)`` when the caller has them (a
            compiled region, which cannot read them from the device); None: read here.

    Returns:
        TeacherTable with ``logits: [U, Vd]`` in the dtype of the head's matmul (bf16
        for bf16 inputs), ``lse_draft, lse_full: [U]`` in fp32 (fp64 for fp64 inputs),
        ``target_token, gate: [U]``.
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
    logits_dtype = torch.promote_types(hidden_UH.dtype, lm_head_VH.dtype)
    dtype = _math_dtype(logits_dtype)
    device = hidden_UH.device
    # Draft ids are target ids in order, so the draft ids of chunk c are the range
    # [bounds[c], bounds[c + 1]): one host read per vocab map (Vd sizes the allocation
    # anyway), none in the loop, and no boolean-mask indexing (a GPU sync).
    cum = torch.cumsum(t2d, dim=0)  # [V], draft ids at or before each target id
    bounds = _chunk_bounds(t2d, cum, chunk_size) if bounds is None else bounds
    Vd = bounds[-1]
    draft_ids = torch.searchsorted(cum, torch.arange(1, Vd + 1, device=cum.device))  # [Vd]
    logits = torch.empty(U, Vd, dtype=logits_dtype, device=device)
    run_max = torch.full((U,), float("-inf"), dtype=dtype, device=device)
    run_sum = torch.zeros(U, dtype=dtype, device=device)
    best_id = torch.zeros(U, dtype=torch.long, device=device)
    update = elementwise(_chunk_update, compile_elementwise)
    for c, start in enumerate(range(0, V, chunk_size)):
        end = min(start + chunk_size, V)
        z = F.linear(hidden_UH, lm_head_VH[start:end])  # [U, chunk], as produced
        if bounds[c + 1] > bounds[c]:
            logits[:, bounds[c]:bounds[c + 1]] = z.index_select(
                1, draft_ids[bounds[c]:bounds[c + 1]] - start)
        run_max, run_sum, best_id = update(z, run_max, run_sum, best_id, start)
    lse_draft = _draft_lse(logits, dtype, U * chunk_size // max(Vd, 1))
    return _table(logits, lse_draft, run_max + torch.log(run_sum), best_id, t2d)


@fused_on_cuda
def _chunk_update(z_UC: torch.Tensor, run_max: torch.Tensor, run_sum: torch.Tensor,
                  best_id: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
    """One vocab chunk ``z [U, chunk]`` (target ids ``start..``) into the running max,
    sum of exponentials and argmax ``[U]`` (math in ``run_max``'s dtype; a strictly
    greater maximum wins, so ties keep the lowest id). Fused into one or two kernels on
    CUDA (``draft.fused_on_cuda``)."""
    z = z_UC.to(run_max.dtype)
    chunk_arg = z.argmax(dim=-1)
    chunk_val = z.gather(1, chunk_arg[:, None]).squeeze(1)
    best_id = torch.where(chunk_val > run_max, chunk_arg + start, best_id)
    new_max = torch.maximum(run_max, chunk_val)
    run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
    return new_max, run_sum, best_id
