"""The draft-vocab map from chat data (SPEC section 2), saved and loaded as safetensors.

Legend: V target vocab, Vd draft vocab. ``d2t: int64 [Vd]``, ``t2d: bool [V]``; draft id
``i`` is target id ``i + d2t[i]``. The file holds tensors ``d2t`` and ``t2d`` and the
metadata ``vocab_size`` and ``draft_vocab_size`` (strings, as safetensors requires).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3fn.io.data import Example
from eagle3fn.vocab import build_vocab_map, count_tokens, validate_vocab_map

_BUILD_HINT = (
    "build it with `eagle3fn vocab` (or eagle3fn.io.vocab_io.vocab_map_from_examples + "
    "save_vocab_map) from the training data and the target's tokenizer"
)


def vocab_map_from_examples(
    examples: Sequence[Example], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [Vd], t2d bool [V])`` from the target ids at loss-masked positions.

    Counts with ``eagle3fn.vocab.count_tokens`` over every example's ``loss_mask``
    (ValueError when an id is ``>= vocab_size``: data tokenized for another target) and
    picks the ``Vd`` most frequent with ``eagle3fn.vocab.build_vocab_map``.
    """
    if not examples:
        raise ValueError("no examples to count tokens from; tokenize the training data first")
    ids = torch.cat([e.input_ids for e in examples])
    mask = torch.cat([e.loss_mask for e in examples])
    return build_vocab_map(count_tokens(ids, mask, vocab_size), draft_vocab_size)


def save_vocab_map(path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Validate ``(d2t, t2d)`` and write them to ``path`` (safetensors; parents created;
    written to a temporary name and renamed into place)."""
    from eagle3fn.io.paths import atomic_write

    validate_vocab_map(d2t, t2d)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        save_file(
            {"d2t": d2t.detach().long().cpu().contiguous(), "t2d": t2d.detach().cpu().contiguous()},
            str(tmp),
            metadata={"vocab_size": str(t2d.shape[0]), "draft_vocab_size": str(d2t.shape[0])},
        )


def load_vocab_map(
    path: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t int64 [Vd], t2d bool [V])`` from ``path`` and validate them.

    ``vocab_size`` (the target's, i.e. its lm_head rows) and ``draft_vocab_size`` are
    checked when given. Raises FileNotFoundError for a missing file and ValueError
    naming the file for a malformed or mismatched map, each with the fix.
    """
    from eagle3fn.io.paths import path_kind

    path = Path(path)
    if not path.is_file():
        kind = path_kind(path)
        if kind == "nothing":
            raise FileNotFoundError(f"vocab map {str(path)!r} not found; {_BUILD_HINT}")
        raise ValueError(f"vocab map {str(path)!r} is {kind}, not a file; {_BUILD_HINT}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if not {"d2t", "t2d"} <= keys:
                raise ValueError(f"has tensors {sorted(keys)}, expected 'd2t' and 't2d'")
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
            meta = f.metadata() or {}
        for key, n in (("vocab_size", t2d.shape[0]), ("draft_vocab_size", d2t.shape[0])):
            if key in meta and meta[key] != str(n):
                raise ValueError(f"metadata {key}={meta[key]} but the tensor has {n} entries")
        validate_vocab_map(d2t, t2d, vocab_size=vocab_size, draft_vocab_size=draft_vocab_size)
    except ValueError as e:
        raise ValueError(f"vocab map {str(path)!r}: {e}") from None
    except SafetensorError as e:
        raise ValueError(
            f"vocab map {str(path)!r} is not a safetensors file ({e}); {_BUILD_HINT}"
        ) from None
    return d2t.long(), t2d


def resolve_vocab_map(
    path: str | os.PathLike | None,
    examples: Sequence[Example],
    *,
    vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What training uses: the map at ``path`` (loaded and checked against the target's
    ``vocab_size`` and ``draft_vocab_size``), or with ``path=None`` one built from
    ``examples``. A given but missing path raises FileNotFoundError rather than
    silently building a different map."""
    if path is not None:
        return load_vocab_map(path, vocab_size=vocab_size, draft_vocab_size=draft_vocab_size)
    return vocab_map_from_examples(examples, vocab_size, draft_vocab_size)
