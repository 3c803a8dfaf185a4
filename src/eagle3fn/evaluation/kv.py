"""The target's cached forward and the two caches of batched decoding on transformers'
``DynamicCache`` (``impl="dynamic"`` and ``"static"``): left padding, crop after a
round, and compaction.

Legend: B prompts decoded together (rows; finished ones leave the batch), S cache
slots, N tokens in one target forward (the padded prompts, then 1 + k per round), k
draft tokens per round, V target vocab, Ht target hidden, g kv heads, d head dim.

Both caches share one slot layout and one validity mask ``valid [B, S]``: target slot s
holds the keys of the token read there, draft slot s the step-0 keys of the context row
at that token's position (built from its aux and the next token). Prompts are
left-padded (pad slots invalid); every round appends the k + 1 verified slots to both,
marks those after the accepted prefix invalid (``kept``), and crops the slots no row
keeps. The explicit position ids carry each row's true positions, so a row's attention
and RoPE see exactly its own tokens, as if it were decoded alone. The static path
(``static_draft.StaticDraft``) keeps the draft's slots 0..S-1 in a larger buffer whose
slots past S are invalid, and keeps finished rows in the draft's buffers (the target's
batch still shrinks).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from eagle3fn.decoding.forward import cache_kwarg
from eagle3fn.io.target import FeatureCapture, TargetModel


COMPACT_SLACK = 64
"""Caches are compacted (``compact``) once they hold more than twice the most valid
slots of a row plus this many."""


def left_pad(prompts: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, ...]:
    """Prompts ``[L_i]`` left-padded: ids ``[B, L]`` (pad 0), valid ``[B, L]`` bool and
    positions ``[B, L]`` (0 at each row's first token; pads at 0)."""
    L = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), L, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, L - p.numel():] = p.reshape(-1).to(device)
        valid[b, L - p.numel():] = True
    return ids, valid, (valid.long().cumsum(1) - 1).clamp_min(0)


def target_forward(target: TargetModel, ids_BN: torch.Tensor, valid_BS: torch.Tensor,
                   pos_BN: torch.Tensor, cache, keep: int,
                   aux: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One cached target forward on ``ids [B, N]`` at positions ``pos``, attending the
    cache slots and the new ones where ``valid [B, S + N]``: the aux ``[B, N, 3*Ht]`` (the
    training-time hooks; None when ``aux`` is False) and the logits ``[B, keep, V]`` of
    the last ``keep`` tokens."""
    capture = FeatureCapture(len(target.aux_layer_ids))
    handles = [target.backbone.layers[i + 1].register_forward_pre_hook(
        functools.partial(capture.stream, slot), with_kwargs=True)
        for slot, i in enumerate(target.aux_layer_ids)] if aux else []
    try:
        out = target.model(input_ids=ids_BN, attention_mask=valid_BS.long(), position_ids=pos_BN,
                           use_cache=True, logits_to_keep=keep, **{cache_kwarg(target.model): cache})
    finally:
        for handle in handles:
            handle.remove()
    return capture.aux, out.logits[:, -keep:]


def crop(cache, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, drop: int):
    """Remove the last ``drop`` slots (rejected in every row) from both caches."""
    if drop:
        cache.crop(-drop)
        keys, values, valid = keys[:, :, :-drop], values[:, :, :-drop], valid[:, :-drop]
    return keys, values, valid


def compaction_order(valid_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S']``: each row's valid slots first, in order (a stable sort of ``~valid``),
    cut to ``S'`` = the most valid slots of a row."""
    order = torch.sort((~valid_BS).to(torch.int8), dim=1, stable=True).indices
    return order[:, :int(valid_BS.sum(1).max())]


def gather_slots(x_BgSd: torch.Tensor, order_BS: torch.Tensor) -> torch.Tensor:
    """``x [B, g, S_old, d]`` at slots ``order [B, S]`` per row: ``[B, g, S, d]``."""
    index = order_BS[:, None, :, None].expand(-1, x_BgSd.shape[1], -1, x_BgSd.shape[3])
    return x_BgSd.gather(2, index)


def compact_target(cache, order_BS: torch.Tensor) -> None:
    """The target's cache (every layer) at slots ``order [B, S]`` (``compaction_order``)."""
    for layer in cache.layers:
        layer.keys = gather_slots(layer.keys, order_BS.to(layer.keys.device))
        layer.values = gather_slots(layer.values, order_BS.to(layer.values.device))


def compact(cache, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor):
    """Both caches with each row's valid slots first, in order, cut to the most valid
    slots of a row: rejected slots inside the cache (other rows accepted more) stop
    costing attention. Attention only reads valid slots and the explicit positions, so
    the order of the slots changes nothing but the summation order."""
    order = compaction_order(valid)
    compact_target(cache, order)
    order = order.to(keys.device)
    return gather_slots(keys, order), gather_slots(values, order), valid.gather(1, order)


def kept(n_B: torch.Tensor, steps_K: torch.Tensor) -> torch.Tensor:
    """``[B, k+1]``: which verified slots stay (``x_{T-1}``, ``d_1..d_n``); the rest are
    rolled back (invalid in both caches, cropped where no row keeps them)."""
    return steps_K[None] <= n_B[:, None]

