"""Draft-vocab map (SPEC section 2): ``d2t`` / ``t2d`` from token counts, and checks.

Legend: V target vocab, Vd draft vocab. Draft id ``i`` is target id ``i + d2t[i]``;
``t2d[v]`` says whether target id ``v`` is in the draft vocab, and
``nonzero(t2d) == d2t + arange(Vd)``.
"""

from __future__ import annotations

import torch


def count_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id at loss-masked positions: int64 ``[V]``.

    Args:
        ids: int ``[...]`` token ids; mask: same shape, nonzero where supervised.
    """
    if ids.shape != mask.shape:
        raise ValueError(f"ids shape {tuple(ids.shape)} != mask shape {tuple(mask.shape)}")
    selected = ids[mask.bool()].long()
    if selected.numel() and (selected.min() < 0 or selected.max() >= vocab_size):
        bad = selected[(selected < 0) | (selected >= vocab_size)][0].item()
        raise ValueError(
            f"token id {bad} is outside the target vocab [0, {vocab_size}); the data was "
            "tokenized with a different tokenizer than the target's"
        )
    return torch.bincount(selected, minlength=vocab_size)


def build_vocab_map(counts_V: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``Vd`` most frequent target ids and return ``(d2t, t2d)``.

    Ties break to the lower id; when fewer than ``Vd`` ids occur, the lowest unused ids
    fill the rest (they lie in ``0..Vd-1``). (SpecForge breaks ties by first occurrence
    in the data, so the two differ only on tied counts.)

    Args:
        counts_V: int ``[V]`` counts (``count_tokens``).
        draft_vocab_size: Vd, ``1 <= Vd <= V``.

    Returns:
        ``d2t: int64 [Vd]`` and ``t2d: bool [V]``.
    """
    if counts_V.dim() != 1:
        raise ValueError(f"counts must be [V], got shape {tuple(counts_V.shape)}")
    V = counts_V.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(
            f"draft_vocab_size must be in [1, V={V}], got {draft_vocab_size}"
        )
    order = torch.sort(counts_V, descending=True, stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values
    d2t = used - torch.arange(draft_vocab_size, device=used.device)
    t2d = torch.zeros(V, dtype=torch.bool, device=used.device)
    t2d[used] = True
    return d2t, t2d


def validate_vocab_map(
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> None:
    """Raise ValueError unless ``(d2t, t2d)`` is a consistent map of the given sizes."""
    if d2t.dim() != 1 or d2t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"d2t must be int64 [Vd], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise ValueError(f"t2d must be bool [V], got {t2d.dtype} {tuple(t2d.shape)}")
    if vocab_size is not None and t2d.shape[0] != vocab_size:
        raise ValueError(
            f"t2d covers {t2d.shape[0]} target ids but the target vocab is {vocab_size}; "
            "the map was built for another target: rebuild it (eagle3fn vocab)"
        )
    if draft_vocab_size is not None and d2t.shape[0] != draft_vocab_size:
        raise ValueError(
            f"d2t has {d2t.shape[0]} entries but draft_vocab_size is {draft_vocab_size}; "
            "set draft_vocab_size to the map's size or rebuild the map"
        )
    used = t2d.nonzero().flatten()
    if used.numel() != d2t.shape[0]:
        raise ValueError(
            f"t2d selects {used.numel()} target ids but d2t has {d2t.shape[0]} entries; "
            "d2t and t2d come from different maps"
        )
    mapped = d2t.long().to(used.device) + torch.arange(d2t.shape[0], device=used.device)
    if not torch.equal(mapped, used):
        i = (mapped != used).nonzero()[0].item()
        raise ValueError(
            f"d2t and t2d disagree at draft id {i}: d2t maps it to target id "
            f"{mapped[i].item()} but the {i}-th id selected by t2d is {used[i].item()}"
        )
