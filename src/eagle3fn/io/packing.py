"""Sequence packing (SPEC section 9): several conversations per row of ``length`` tokens.

Legend: L tokens of one conversation, B packed rows of a batch, N the row length
(``--pack-length``, default ``max_length``; every packed batch has that one length),
W the packing window, Ht target hidden size.

A packed row holds documents (conversations) one after another, then right padding.
``position_ids`` restart at 0 in every document and padding continues the last one,
so the document holding t starts at ``t - position_ids[t]`` (``align.document_starts``)
and every later stage (target, alignment, row maps, attention, RoPE) keeps documents
apart from that one tensor (``Features.positions``)::

    first_fit(lengths, capacity)              row of each item: first-fit in order
    best_fit_decreasing(lengths, capacity, W) rows: windows of W consecutive items,
                                              longest first, best fit; a window's
                                              rows stay open through the next one
    plan_rows(lengths, max_length, N, W)      the rows the loop trains on (cut, then BFD)
    pack_examples(examples, max_length, ...)  conversations -> rows (lists of Examples)
    collate_packed(rows, pad_token_id, N)     input_ids / attention_mask / loss_mask /
                                              position_ids [B, N]
    gather_packed(parts, rows, N)             rows of conversations taken from unpacked
                                              feature batches (cache shards)
    pack_features(features, loss_mask, ...)   one unpacked feature batch, packed

Packing is deterministic and never splits a conversation; one longer than
``max_length`` is cut to its first ``max_length`` tokens, as without packing. The
window keeps the data order at the scale of W conversations (a row never mixes
conversations more than 2W apart in the file) while sorting inside it fills rows
better than first-fit in order (benchmarks/packing.py measures both).
"""

from __future__ import annotations

import bisect
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


PACK_WINDOW = 256
"""Default packing window W (``--pack-window``). ``benchmarks/packing.py --conversations
4000`` (WildChat-like chats, mean ~1620 tokens, cut at 2048), padding at W = 64 / 256 /
1024: 8.4 / 7.9 / 7.7% in rows of 2048 (no packing can go below 7.6% there: 86% of the
conversations exceed 1024 tokens and no two of those share a row) and 1.1 / 0.7 / 0.6% in rows of
8192."""


def best_fit_decreasing(lengths: Sequence[int], capacity: int, window: int = PACK_WINDOW) -> list[list[int]]:
    """Bins of item indices, packed by consecutive windows of ``window`` items (the
    last may be shorter): each window's items longest first (equal lengths in index
    order), each into the open bin with the least room that still fits it (the
    earliest opened among equals), a new bin when none fits. The bins opened in a
    window stay open through the next window, then close: the next window's items
    fill the gaps a window leaves, and a bin's items are less than ``2 * window``
    apart in index. Bins come in the order opened; items in a bin in the order
    placed. ``O(n log n + n * open bins)``. Every length must be in ``[1, capacity]``."""
    if capacity < 1 or window < 1:
        raise ValueError(f"capacity ({capacity}) and window ({window}) must be >= 1")
    bad = [L for L in lengths if not 1 <= L <= capacity]
    if bad:
        raise ValueError(f"item lengths must be in [1, {capacity}], got {bad[:5]}")
    bins: list[list[int]] = []
    opened: list[int] = []  # the window each bin was opened in
    rooms: list[tuple[int, int]] = []  # (room, bin) of open bins, sorted: the best fit is the first room >= L
    for w, lo in enumerate(range(0, len(lengths), window)):
        rooms = [(room, b) for room, b in rooms if opened[b] == w - 1]
        for i in sorted(range(lo, min(lo + window, len(lengths))), key=lambda i: (-lengths[i], i)):
            j = bisect.bisect_left(rooms, (lengths[i], -1))
            if j == len(rooms):
                room, b = capacity, len(bins)
                bins.append([])
                opened.append(w)
            else:
                room, b = rooms.pop(j)
            bins[b].append(i)
            if room > lengths[i]:
                bisect.insort(rooms, (room - lengths[i], b))
    return bins


def plan_rows(lengths: Sequence[int], max_length: int, length: int | None = None,
              window: int = PACK_WINDOW) -> list[list[int]]:
    """The packed rows of conversations of ``lengths`` tokens (indices, in file order):
    each cut to ``max_length``, then ``best_fit_decreasing`` into rows of ``length``
    tokens (default ``max_length``; ``>= max_length``) by windows of ``window``."""
    length = max_length if length is None else length
    if max_length < 2 or length < max_length:
        raise ValueError(f"need 2 <= max_length ({max_length}) <= row length ({length})")
    return best_fit_decreasing([min(L, max_length) for L in lengths], length, window)


def _cut(example: Example, max_length: int) -> Example:
    if len(example) <= max_length:
        return example
    return Example(example.input_ids[:max_length], example.loss_mask[:max_length], example.source)


def pack_examples(examples: Sequence[Example], max_length: int, *, length: int | None = None,
                  window: int = PACK_WINDOW) -> list[list[Example]]:
    """Rows of conversations, each row at most ``length`` tokens (default
    ``max_length``): ``plan_rows`` (windows of ``window`` in the given, file, order,
    longest first, best fit), a conversation longer than ``max_length`` cut to it,
    none split across rows. Deterministic."""
    cut = [_cut(e, max_length) for e in examples]
    return [[cut[i] for i in row] for row in plan_rows([len(e) for e in cut], max_length, length, window)]


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
    longest row; pass the row length, ``--pack-length``, so every batch has one shape).

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


def gather_packed(parts: Sequence[tuple[Features, torch.Tensor]], rows: Sequence[Sequence[tuple[int, int]]],
                  length: int, max_length: int | None = None) -> tuple[Features, torch.Tensor]:
    """Packed rows of conversations taken from unpacked feature batches.

    Args:
        parts: ``(Features [B_i, S_i, ...], loss_mask bool [B_i, S_i])``, one
            conversation per row, right-padded (e.g. cache shards), on one device.
        rows: per packed row, its conversations as ``(part, row of that part)``, in order.
        length: N, positions per packed row.
        max_length: each conversation is cut to its first ``max_length`` tokens (None:
            kept whole).

    Returns ``(Features [len(rows), N, ...] with positions, loss_mask bool [len(rows),
    N])``: each conversation's ids, features and mask copied to its place (a packed
    target forward gives the same features, SPEC 9), zeros on padding (ids, features,
    masks). ``target_head`` is the first part's. ValueError for a packed part or a row
    longer than ``length``.
    """
    if any(f.positions is not None for f, _ in parts):
        raise ValueError("gather_packed packs one conversation per row; a part is packed already")
    first = parts[0][0]
    real = [[min(int(L), max_length or int(L)) for L in f.attention_mask.sum(1).tolist()] for f, _ in parts]
    widths = [sum(real[p][b] for p, b in row) for row in rows]
    if max(widths, default=0) > length:
        raise ValueError(f"a packed row holds {max(widths)} tokens > length={length}")
    device, B = first.input_ids.device, len(rows)

    def empty(name):
        x = getattr(first, name)
        return None if x is None else torch.zeros(B, length, *x.shape[2:], dtype=x.dtype, device=device)
    names = ("input_ids", "aux", "target_logits", "final_hidden")
    out = {n: empty(n) for n in names}
    mask = torch.zeros(B, length, dtype=torch.bool, device=device)
    for r, row in enumerate(rows):
        start = 0
        for p, b in row:
            f, m = parts[p]
            L = real[p][b]
            for n in names:
                if out[n] is not None:
                    out[n][r, start:start + L] = getattr(f, n)[b, :L]
            mask[r, start:start + L] = m[b, :L]
            start += L
    positions = torch.stack([_positions([real[p][b] for p, b in row], length) for row in rows]).to(device)
    valid = torch.arange(length, device=device)[None] < torch.tensor(widths, device=device)[:, None]
    return Features(input_ids=out["input_ids"], aux=out["aux"], attention_mask=valid.long(),
                    target_logits=out["target_logits"], final_hidden=out["final_hidden"],
                    target_head=first.target_head, positions=positions), mask


def pack_features(features: Features, loss_mask_BS: torch.Tensor, max_length: int, *,
                  length: int | None = None, window: int = PACK_WINDOW) -> tuple[Features, torch.Tensor]:
    """A batch of one conversation per row (``[B, S, ...]``, right-padded) packed into
    rows of ``length`` positions (default ``max_length``): the rows' real tokens, cut
    to ``max_length``, placed by ``plan_rows`` in row order, their target features
    moved along (``gather_packed``).

    Returns ``(Features [B', length, ...] with positions, loss_mask bool [B', length])``.
    """
    if features.positions is not None:
        raise ValueError("pack_features packs one conversation per row; this batch is packed already")
    lengths = features.attention_mask.sum(1).tolist()
    rows = plan_rows(lengths, max_length, length, window)
    return gather_packed([(features, loss_mask_BS.bool())], [[(0, b) for b in row] for row in rows],
                         max_length if length is None else length, max_length)
