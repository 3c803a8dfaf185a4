"""Alignment (SPEC section 1): shifted arrays and the supervised-position mask.

Legend: B batch, S padded sequence length, V target vocab. Sequences are
right-padded; ``attention_mask[b, t]`` is 1 for ``t < L_b``.

Position ``t`` of every shifted array belongs to draft row ``t``: ``ids'[t] = x_{t+1}``
and ``z'[t] = z_{t+1}``, while the loss mask stays unshifted (``m'[t] = m_t``).

Packed sequences (SPEC section 9) hold several documents (conversations) one after
another; ``positions[b, t]`` (int64 ``[B, S]``) is t's position inside its document,
restarting at 0 at each one, so the document holding t starts at ``t - positions[b, t]``
(``document_starts``). Alignment then applies per document: its last position has no
teacher (``z'`` there would be the next document's).
"""

from __future__ import annotations

from typing import Literal

import torch

MaskAlignment = Literal["eagle", "target"]


def shift_left(x_BS: torch.Tensor, n: int = 1) -> torch.Tensor:
    """``y[:, t] = x[:, t + n]``, zero past the end. Shape kept: ``[B, S, ...]``."""
    if n < 0:
        raise ValueError(f"shift_left needs n >= 0, got n={n}")
    if n == 0:
        return x_BS
    y = torch.zeros_like(x_BS)
    if n < x_BS.shape[1]:
        y[:, : x_BS.shape[1] - n] = x_BS[:, n:]
    return y


def sequence_lengths(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Lengths ``L_b`` (int64 ``[B]``) of a right-padded ``attention_mask`` ``[B, S]``.

    Raises ValueError when the mask is not 2-D or not a prefix of ones per row
    (left padding or holes), since every shifted array assumes right padding.
    """
    if attention_mask_BS.dim() != 2:
        raise ValueError(
            f"attention_mask must be [B, S], got shape {tuple(attention_mask_BS.shape)}"
        )
    valid = attention_mask_BS.bool()
    lengths = valid.sum(dim=1)
    pos = torch.arange(valid.shape[1], device=valid.device)
    prefix = pos[None, :] < lengths[:, None]
    if not torch.equal(prefix, valid):
        bad = (prefix != valid).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {bad} are not right-padded prefixes of ones; "
            "pad sequences on the right (tokenizer.padding_side = 'right')"
        )
    return lengths


def document_starts(positions_BS: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, S]``: the buffer position where t's document starts, ``t -
    positions[b, t]``, clamped at 0 (a sequence-parallel chunk's global positions put
    the start before the buffer). ``positions`` restart at 0 in every packed document."""
    pos_S = torch.arange(positions_BS.shape[1], device=positions_BS.device)
    return (pos_S[None, :] - positions_BS).clamp_min(0)


def supervised_mask(
    loss_mask_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor | None = None,
    *,
    alignment: MaskAlignment = "eagle",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The supervised teacher positions ``mask[b, t] = t in sup_b`` (bool ``[B, S]``).

    ``alignment="eagle"`` (default, EAGLE/SpecForge parity): ``sup = {t : m_t = 1,
    t <= L-2}``, so row ``t`` (which predicts ``x_{t+2}``) is gated by ``m_t``.
    ``alignment="target"``: gate by the mask of the predicted token,
    ``sup = {t : m_{t+2} = 1, t + 2 <= L-1}``. The last position ``L-1`` has no
    teacher and is never supervised. ``attention_mask=None`` means no padding.

    ``positions`` (int64 ``[B, S]``, a packed batch: restarting at 0 in each document;
    None: one document per row) applies the same per document (SPEC 9): ``t + 1``
    (``t + 2`` for ``"target"``) must lie in t's document, so no document's last
    position is supervised.
    """
    if loss_mask_BS.dim() != 2:
        raise ValueError(f"loss_mask must be [B, S], got shape {tuple(loss_mask_BS.shape)}")
    B, S = loss_mask_BS.shape
    if attention_mask_BS is None:
        lengths = torch.full((B,), S, dtype=torch.long, device=loss_mask_BS.device)
    else:
        if attention_mask_BS.shape != loss_mask_BS.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask_BS.shape)} != loss_mask shape "
                f"{tuple(loss_mask_BS.shape)}"
            )
        lengths = sequence_lengths(attention_mask_BS)
    m = loss_mask_BS.bool()
    pos = torch.arange(S, device=m.device)[None, :]
    if alignment == "eagle":
        sup, reach = m & (pos <= lengths[:, None] - 2), 1
    elif alignment == "target":
        sup, reach = shift_left(m, 2) & (pos + 2 <= lengths[:, None] - 1), 2
    else:
        raise ValueError(f"alignment must be 'eagle' or 'target', got {alignment!r}")
    if positions is None:
        return sup
    if positions.shape != loss_mask_BS.shape:
        raise ValueError(f"positions shape {tuple(positions.shape)} != loss_mask shape "
                         f"{tuple(loss_mask_BS.shape)}")
    # t + reach is in t's document iff its position is t's plus reach (documents are
    # contiguous and their positions count up by one).
    return sup & (shift_left(positions, reach) == positions + reach)
