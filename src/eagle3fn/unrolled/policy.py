"""The trim policy: which rows ``trim="backbone"`` computes, and which path
``trim="auto"`` takes for a batch (SPEC section 6). The planner (``eagle3fn.plan``)
decides with the same functions on its row counts.

Legend: B batch, C own rows per sample, k TTT length, n_j rows of step j.
"""

from __future__ import annotations

import torch

from eagle3fn.shapes import RowMap
from eagle3fn.unrolled.config import TTTConfig


def computed_rows(rowmap: RowMap) -> tuple[torch.Tensor, ...]:
    """Rows whose layer output ``trim="backbone"`` computes at each step (sorted flat
    ``b*C + p``): ``rows_0 | backbone_rows_1`` at step 0, ``backbone_rows_j`` after.
    Each is contained in the previous one, so a row's input feature and diagonal
    keys are always there."""
    return (rowmap.step0_rows,) + tuple(rowmap.backbone_rows[1:])


def choose_trim(rowmap: RowMap, config: TTTConfig) -> str:
    """The path ``trim="auto"`` takes for this batch: ``none`` below
    ``config.auto_min_rows`` own rows (launch-bound), else ``backbone`` when its cost
    score (``auto_score``) is at most ``config.auto_backbone_fraction``, else ``none``
    (near full density the untrimmed path beats both trimmed ones, whose gathers and
    chunked head then cost more than they save). Any other
    ``config.trim`` is returned as is."""
    if config.trim != "auto":
        return config.trim
    rows = rowmap.batch_size * rowmap.num_rows
    if rows < config.auto_min_rows:
        return "none"
    return auto_trim(rows, rowmap.ttt_length, sum(c.numel() for c in computed_rows(rowmap)),
                     sum(r.numel() for r in rowmap.rows), config.auto_min_rows,
                     config.auto_backbone_fraction, config.auto_loss_share)


def auto_trim(rows: int, ttt_length: int, computed: float, supervised: float, min_rows: int,
              backbone_fraction: float, loss_share: float) -> str:
    """``choose_trim``'s rule on counts: ``rows = B*C`` own rows, ``computed`` the
    layer rows ``trim="backbone"`` computes over the k steps (``computed_rows``),
    ``supervised`` the loss rows ``sum_j n_j``. ``backbone`` iff ``rows >= min_rows``
    and ``auto_score`` of the two fractions of ``k*B*C`` is at most
    ``backbone_fraction``, else ``none`` (also without rows at all)."""
    total = ttt_length * rows
    if rows < min_rows or total == 0:  # launch-bound, or nothing to trim
        return "none"
    score = auto_score(computed / total, supervised / total, loss_share)
    return "backbone" if score <= backbone_fraction else "none"


def auto_score(computed: float, supervised: float, loss_share: float) -> float:
    """``trim="auto"``'s cost score ``(1 - w) * computed + w * supervised``, both
    fractions of the ``k*B*C`` layer rows (keys/values of step 0 aside): the
    trimmed backbone's time relative to the full path grows about linearly in each
    (``TTTConfig.auto_loss_share``)."""
    return (1.0 - loss_share) * computed + loss_share * supervised
