"""Sequence packing (SPEC section 9): several conversations per row, up to ``max_length``.

Legend: L tokens of one conversation, B packed rows of a batch, S = ``max_length``
(every packed batch has that one length), Ht target hidden size.

A packed row holds documents (conversations) one after another, then right padding.
``position_ids`` restart at 0 in every document and padding continues the last one,
so the document holding t starts at ``t - position_ids[t]`` (``align.document_starts``)
and every later stage (target, alignment, row maps, attention, RoPE) keeps documents
apart from that one tensor (``Features.positions``)::

    first_fit(lengths, capacity)              row of each item: first-fit in order
    pack_examples(examples, max_length)       conversations -> rows (lists of Examples)
    collate_packed(rows, pad_token_id, S)     input_ids / attention_mask / loss_mask /
                                              position_ids [B, S]
    pack_features(features, loss_mask, S)     a cached batch (one conversation per row),
                                              packed at read time

Packing is deterministic and never splits a conversation; one longer than
``max_length`` is cut to its first ``max_length`` tokens, as without packing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle3fn.io.data import Example
from eagle3fn.shapes import Features


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: each item in turn goes to the first bin (in the order bins
    were opened) with at least its length left, a new bin when none has room. Items
    keep their order inside a bin. ``O(n log n)``: a max-tree over the bins' free room
    finds the first fit. Every length must be in ``[1, capacity]``."""
    n = len(lengths)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    bad = [L for L in lengths if not 1 <= L <= capacity]
    if bad:
        raise ValueError(f"item lengths must be in [1, {capacity}], got {bad[:5]}")
    size = 1
    while size < max(n, 1):
        size *= 2
    room = [0] * size + [capacity] * n + [0] * (size - n)  # leaves: unopened bins are empty
    for i in range(size - 1, 0, -1):
        room[i] = max(room[2 * i], room[2 * i + 1])
    bins: list[list[int]] = []
    for item, L in enumerate(lengths):
        i = 1
        while i < size:  # the leftmost leaf with room >= L
            i = 2 * i if room[2 * i] >= L else 2 * i + 1
        b = i - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        room[i] -= L
        i //= 2
        while i:
            room[i] = max(room[2 * i], room[2 * i + 1])
            i //= 2
    return bins


def _cut(example: Example, max_length: int) -> Example:
    if len(example) <= max_length:
        return example
    return Example(example.input_ids[:max_length], example.loss_mask[:max_length], example.source)


def pack_examples(examples: Sequence[Example], max_length: int) -> list[list[Example]]:
    """Rows of conversations, each row at most ``max_length`` tokens: first-fit in the
    given (file) order (``first_fit``), a conversation longer than ``max_length`` cut to
    it, none split across rows. Deterministic; rows come in the order they were opened."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    cut = [_cut(e, max_length) for e in examples]
    return [[cut[i] for i in row] for row in first_fit([len(e) for e in cut], max_length)]


def _positions(lengths: Sequence[int], width: int) -> torch.Tensor:
    """int64 ``[width]``: ``0..L-1`` per document in turn, padding continuing the last."""
    pos = torch.empty(width, dtype=torch.long)
    start = 0
    for L in lengths:
        pos[start:] = torch.arange(width - start)
        start += L
    return pos


def collate_packed(rows: Sequence[Sequence[Example]], pad_token_id: int,
                   length: int | None = None) -> dict[str, torch.Tensor]:
    """Packed rows (``pack_examples``) as one batch of ``length`` positions (default the
    longest row; pass ``max_length`` so every batch has one shape).

    Returns ``input_ids`` int64 ``[B, S]`` (``pad_token_id`` past the documents),
    ``attention_mask`` int64 ``[B, S]`` (1 on every document's tokens: a right-padded
    prefix), ``loss_mask`` bool ``[B, S]`` (each conversation's ``m_t``, unshifted) and
    ``position_ids`` int64 ``[B, S]`` (restarting at 0 in each document, padding
    continuing the last one).
    """
    if not rows or not all(rows):
        raise ValueError("collate_packed needs non-empty rows of conversations")
    widths = [sum(len(e) for e in row) for row in rows]
    S = max(widths) if length is None else length
    if max(widths) > S:
        raise ValueError(f"a packed row holds {max(widths)} tokens > length={S}")
    B = len(rows)
    out = {"input_ids": torch.full((B, S), pad_token_id, dtype=torch.long),
           "attention_mask": torch.zeros(B, S, dtype=torch.long),
           "loss_mask": torch.zeros(B, S, dtype=torch.bool),
           "position_ids": torch.stack([_positions([len(e) for e in row], S) for row in rows])}
    for b, row in enumerate(rows):
        out["input_ids"][b, :widths[b]] = torch.cat([e.input_ids for e in row])
        out["loss_mask"][b, :widths[b]] = torch.cat([e.loss_mask for e in row])
        out["attention_mask"][b, :widths[b]] = 1
    return out


def pack_features(features: Features, loss_mask_BS: torch.Tensor,
                  max_length: int) -> tuple[Features, torch.Tensor]:
    """A batch of one conversation per row (``[B, S, ...]``, right-padded, e.g. a cache
    shard) packed into rows of ``max_length`` positions: the rows' real tokens, cut
    to ``max_length``, placed first-fit in row order (``first_fit``), their target
    features moved along (a packed target forward gives the same features, SPEC 9).

    Returns ``(Features [B', max_length, ...] with positions, loss_mask bool [B',
    max_length])``; padding is zeros (ids, features, masks). ``target_head`` is shared.
    """
    if features.positions is not None:
        raise ValueError("pack_features packs one conversation per row; this batch is packed already")
    B, S = features.input_ids.shape
    lengths = [min(int(L), max_length) for L in features.attention_mask.sum(1).tolist()]
    rows = first_fit(lengths, max_length)
    source = torch.full((len(rows), max_length), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for b in row:
            source[r, start:start + lengths[b]] = b * S + torch.arange(lengths[b])
            start += lengths[b]
    positions = torch.stack([_positions([lengths[b] for b in row], max_length) for row in rows])
    device = features.input_ids.device
    valid, source = (source >= 0).to(device), source.clamp_min(0).to(device)

    def take(x):
        if x is None:
            return None
        picked = x.flatten(0, 1)[source]
        return torch.where(valid.view(*valid.shape, *([1] * (picked.dim() - 2))), picked,
                           torch.zeros((), dtype=picked.dtype, device=device))
    packed = Features(input_ids=take(features.input_ids), aux=take(features.aux),
                      attention_mask=valid.long(), target_logits=take(features.target_logits),
                      final_hidden=take(features.final_hidden), target_head=features.target_head,
                      positions=positions.to(device))
    return packed, take(loss_mask_BS.bool())
