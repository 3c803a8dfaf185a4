"""Batches of tokenized conversations: ``collate`` right-pads a group to ``[B, S]``
tensors, ``batches`` groups examples by length for few padded tokens (``io.packing``
packs several conversations per row instead).

Legend: B batch, S padded length.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from eagle3fn.io.data import Example

def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into one batch.

    Returns ``input_ids`` int64 ``[B, S]`` (``pad_token_id`` past each end),
    ``attention_mask`` int64 ``[B, S]`` (1 on real tokens) and ``loss_mask`` bool
    ``[B, S]`` (0 on padding), ``S = max L``. Padding is masked out, so any id below
    the vocab size works as ``pad_token_id`` (e.g. the eos id when there is no pad).
    """
    if not examples:
        raise ValueError("collate got no examples; an empty batch is never trained")
    if not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(
            f"pad_token_id must be an int >= 0, got {pad_token_id!r}; use "
            "tokenizer.pad_token_id, or tokenizer.eos_token_id when it has none"
        )
    B, S = len(examples), max(len(e) for e in examples)
    input_ids = torch.full((B, S), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    for b, e in enumerate(examples):
        input_ids[b, : len(e)] = e.input_ids
        attention_mask[b, : len(e)] = 1
        loss_mask[b, : len(e)] = e.loss_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def batches(
    examples: Sequence[Example],
    *,
    batch_size: int,
    max_tokens: int | None = None,
    seed: int,
    shuffle: bool = True,
) -> Iterator[list[Example]]:
    """One epoch of batches (lists of examples), deterministic for a given ``seed``.

    The order is ``torch.randperm(len(examples))`` under a CPU generator seeded with
    ``seed`` (the identity with ``shuffle=False``); batches are cut greedily in that
    order, each holding at most ``batch_size`` examples and, with ``max_tokens``, at most
    ``max_tokens`` padded tokens (``len(batch) * longest``). Every example appears in
    exactly one batch; the last batch may be smaller. Use ``seed + epoch`` per epoch.
    Arguments are checked when called, before the first batch is drawn.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not examples:
        raise ValueError("batches got no examples; an empty data set is never trained")
    if max_tokens is not None:
        longest = max(examples, key=len)
        if len(longest) > max_tokens:
            raise ValueError(
                f"example {longest.source} has {len(longest)} tokens > max_tokens={max_tokens}; "
                "raise max_tokens to at least max_length"
            )
    if shuffle:
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(examples), generator=generator).tolist()
    else:
        order = list(range(len(examples)))
    return _cut(examples, order, batch_size, max_tokens)


def _cut(examples, order, batch_size, max_tokens) -> Iterator[list[Example]]:
    batch: list[Example] = []
    longest_len = 0
    for i in order:
        e = examples[i]
        grown = max(longest_len, len(e))
        if batch and (
            len(batch) == batch_size
            or (max_tokens is not None and (len(batch) + 1) * grown > max_tokens)
        ):
            yield batch
            batch, grown = [], len(e)
        batch.append(e)
        longest_len = grown
    yield batch
