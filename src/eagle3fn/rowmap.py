"""Row maps (SPEC section 6): which rows each TTT step computes, index maths only.

Legend: B batch, T local buffer length, C own rows per sample (``C <= T``; ``C = T``
on one rank, ``T = C + k`` under sequence parallelism), k TTT length, U teacher
positions. Flat draft rows ``b*C + p``; flat teacher positions ``b*T + s``.

Row ``p`` at step ``j`` is taught by position ``s = p + j``, so a supervised
position ``s`` emits row ``s - j`` at step ``j``: the rows shift down by one per step
while the teacher positions stay put. Tail positions ``s >= C`` teach own rows at
deeper steps but never emit rows (``s - j < C``).

Packed sequences (SPEC 9): with ``positions`` (t's position inside its document,
restarting at 0 at each one) a row never leaves its teacher's document:
``s - j >= start(doc(s)) = s - positions[s]``, i.e. ``j <= positions[s]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3fn.shapes import RowMap


def _step_windows(mask_BT: torch.Tensor, ttt_length: int, num_rows: int,
                  positions_BT: torch.Tensor | None) -> torch.Tensor:
    """``win[j, b, p] = mask[b, p + j]`` and ``positions[b, p + j] >= j`` (False past
    T): bool ``[k, B, C]`` (a transposed view), every step from one sliding window
    (``unfold``)."""
    win = F.pad(mask_BT, (0, ttt_length)).unfold(1, num_rows, 1)[:, :ttt_length]  # [B, k, C]
    if positions_BT is not None:
        pos = F.pad(positions_BT, (0, ttt_length), value=-1).unfold(1, num_rows, 1)[:, :ttt_length]
        win = win & (pos >= torch.arange(ttt_length, device=mask_BT.device)[:, None])
    return win.transpose(0, 1)


def _checked_num_rows(mask: torch.Tensor, ttt_length: int, num_rows: int | None,
                      positions: torch.Tensor | None) -> int:
    """C, the own rows per sample (``num_rows``, default T), after checking
    ``build_rowmap``'s arguments: ``mask`` a bool ``[B, T]`` tensor, ``ttt_length`` an int
    >= 1, C an int in ``[0, T]``, ``positions`` None or of ``mask``'s shape (ValueError
    naming the argument otherwise)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        dtype = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"mask must be a bool tensor [B, T], got {dtype}; pass mask.bool() "
            "(e.g. from align.supervised_mask)"
        )
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    if not isinstance(ttt_length, int) or ttt_length < 1:
        raise ValueError(f"ttt_length must be an int >= 1, got {ttt_length!r}")
    T = mask.shape[1]
    C = T if num_rows is None else num_rows
    if not isinstance(C, int) or C < 0 or C > T:
        raise ValueError(
            f"num_rows must be an int in [0, T={T}] (own rows cannot exceed the buffer "
            f"length), got {num_rows!r}"
        )
    if positions is not None and positions.shape != mask.shape:
        raise ValueError(f"positions shape {tuple(positions.shape)} != mask shape {tuple(mask.shape)}")
    return C

def build_rowmap(mask: torch.Tensor, ttt_length: int, num_rows: int | None = None, *,
                 positions: torch.Tensor | None = None) -> RowMap:
    """Build the row map of a batch from its supervised-position mask.

    Args:
        mask: bool ``[B, T]``, ``mask[b, s] = s in sup_b`` (see ``align.supervised_mask``).
        ttt_length: k >= 1, the number of TTT steps.
        num_rows: C, own rows per sample (default T). Positions ``s >= C`` are a
            sequence-parallel overlap tail: they teach, they never emit rows.
        positions: int64 ``[B, T]`` or None, a packed batch's positions inside each
            document (restarting at 0; ``Features.positions``): rows stay in their
            teacher's document, ``j <= positions[b, s]`` (SPEC 9). None: one document.

    Returns:
        RowMap with ``rows[j] = sorted{b*C + s - j : mask[b,s], j <= s, s - j < C}``
        (and ``j <= positions[b, s]``),
        ``teacher_positions`` = sorted flat ``b*T + s`` reached by some step,
        ``table_rows[j]`` aligned with ``rows[j]``, ``backbone_rows``, ``step0_rows``,
        ``denominator = B*C`` and ``dead_steps``. All tensors live on ``mask.device``.
    """
    C = _checked_num_rows(mask, ttt_length, num_rows, positions)
    B, T = mask.shape
    k = ttt_length
    device = mask.device

    # flags[:k]: the step windows; flags[k:]: the rows any step >= j still needs (a
    # suffix OR over the windows: j below 1 + the deepest step whose window holds the row).
    flags = torch.empty(2 * k, B, C, dtype=torch.bool, device=device)
    flags[:k] = _step_windows(mask, k, C, positions)
    steps = torch.arange(1, k + 1, dtype=torch.int32, device=device)[:, None, None]
    torch.lt(steps - 1, (flags[:k] * steps).amax(0), out=flags[k:])
    # Every row list from one nonzero (two host syncs in all, not one per list).
    flags = flags.view(2 * k, B * C)
    counts = flags.sum(dim=1).tolist()
    flat_rows = flags.nonzero()[:, 1].contiguous()
    lists = flat_rows.split(counts)
    rows = lists[:k]

    # A supervised s is reached iff some j < k has j <= s (j <= positions[s]) and
    # s - j < C: iff s minus the deepest such j is below C.
    pos_T = torch.arange(T, device=device)
    deepest = pos_T.clamp_max(k - 1)[None, :]
    if positions is not None:
        deepest = torch.minimum(deepest, positions)
    reached_BT = mask & (pos_T - deepest < C)
    teacher_positions = reached_BT.flatten().nonzero().flatten()
    table_index_BT = torch.cumsum(reached_BT.flatten(), dim=0) - 1

    # Row b*C + p at step j is taught by flat position b*T + p + j: every step's rows
    # at once (they lead flat_rows), split after.
    step_rows = flat_rows[:sum(counts[:k])]
    taught = step_rows + torch.repeat_interleave(
        torch.arange(k, device=device), torch.tensor(counts[:k], device=device), output_size=step_rows.numel())
    if T != C:  # (max(C, 1): with C = 0 there are no rows to divide)
        taught = taught + (step_rows // max(C, 1)) * (T - C)
    table_rows = tuple(table_index_BT.index_select(0, taught).split(counts[:k]))
    backbone_rows = (torch.arange(B * C, device=device),) + lists[k + 1:]
    return RowMap(
        rows=rows,
        teacher_positions=teacher_positions,
        table_rows=table_rows,
        backbone_rows=backbone_rows,
        step0_rows=lists[k],
        denominator=B * C,
        dead_steps=tuple(r.numel() == 0 for r in rows),
        batch_size=B,
        num_rows=C,
        buffer_len=T,
    )
