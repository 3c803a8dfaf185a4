"""One model forward over a ``StaticKVCache``: decode steps, prefills, verification.

Legend: B rows, q tokens per row in this forward, V vocab, H hidden size, A aux layers.

``cached_forward`` feeds ``ids [B, q]`` at each row's next positions ``n_b + i`` (or the
positions given), writes their keys and values into the cache at columns ``n_b + i``
and returns the logits of the last ``keep`` tokens, plus, when asked, the residual
stream after the chosen decoder layers (EAGLE-3's aux features, read as training does:
the input of layer ``i + 1``). It never moves the lengths: a decode step then does
``cache.advance(1)``; speculative verification of ``k`` proposals feeds
``[last, d_1..d_k]`` (q = k + 1) and sets ``n_b += accepted_b + 1``, which is the whole
rollback (rejected columns are overwritten by the next forward).
"""

from __future__ import annotations

import functools
import inspect
from typing import Sequence

import torch
from torch import nn

from eagle3fn.decoding.attention import attention
from eagle3fn.decoding.static_cache import StaticKVCache


_PARAMS: dict[type, frozenset[str]] = {}
"""The forward parameters of each model class (a plain dict, not ``functools.lru_cache``:
a compiled decode step reads it without a graph break once the class is in it)."""


def _forward_params(forward_type: type) -> frozenset[str]:
    if forward_type not in _PARAMS:
        _PARAMS[forward_type] = frozenset(inspect.signature(forward_type.forward).parameters)
    return _PARAMS[forward_type]


def cache_kwarg(model: nn.Module) -> str:
    """The forward's cache argument: ``cache`` (transformers >= 5.25, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier)."""
    return "cache" if "cache" in _forward_params(type(model)) else "past_key_values"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM (``model.get_decoder().layers``)."""
    return model.get_decoder().layers


class _AuxCapture:
    """Pre-hooks on ``layers[i + 1]`` for i in ``aux_layers`` copying the residual stream
    into ``aux [B, q, A*H]`` (slot order = ``aux_layers`` order)."""

    def __init__(self, layers: nn.ModuleList, aux_layers: Sequence[int]) -> None:
        if any(not 0 <= i < len(layers) - 1 for i in aux_layers):
            raise ValueError(f"aux_layers={tuple(aux_layers)} must lie in [0, {len(layers) - 2}] "
                             f"(the output of layer i is read as layer i + 1's input)")
        self.layers, self.aux_layers, self.aux = layers, tuple(aux_layers), None

    def _hook(self, slot: int, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        H = hidden.shape[-1]
        if self.aux is None:
            self.aux = hidden.new_empty(*hidden.shape[:-1], len(self.aux_layers) * H)
        self.aux[..., slot * H:(slot + 1) * H].copy_(hidden)

    def __enter__(self) -> _AuxCapture:
        self.handles = [self.layers[i + 1].register_forward_pre_hook(functools.partial(self._hook, slot),
                                                                     with_kwargs=True)
                        for slot, i in enumerate(self.aux_layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def cached_forward(model: nn.Module, cache: StaticKVCache, ids_BQ: torch.Tensor, *, keep: int | None = None,
                   position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   aux_layers: Sequence[int] = (), layers: nn.ModuleList | None = None,
                   attn: str = "grouped") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model`` on ``ids [B, q]`` over ``cache`` (module docstring).

    Args:
        model: a HF causal LM whose attention layers call ``cache.update``.
        cache: its ``StaticKVCache`` (B rows); the new keys land at columns ``n_b + i``.
        ids_BQ: int64 ``[B, q]`` on the cache's device.
        keep: logits of the last ``keep`` tokens (None: all q).
        position_ids: int64 ``[B, q]`` (None: ``cache.position_ids(q)`` = ``n_b + i``).
        attention_mask: additive ``[B, 1, q, M]`` (None: ``cache.attention_mask``).
        aux_layers: decoder layer ids whose output (the residual stream, before any
            norm) is returned, concatenated in this order.
        layers: the decoder layers the ids index (None: ``decoder_layers(model)``).
        attn: ``"grouped"`` (``attention.grouped_attention``: the cache read once per
            layer) or ``"model"`` (the model's own attention implementation).

    Returns:
        logits ``[B, keep, V]`` and aux ``[B, q, A*H]`` (None without ``aux_layers``).
    """
    B, q = ids_BQ.shape
    if B != cache.lengths.shape[0]:
        raise ValueError(f"ids have {B} rows but the cache has {cache.lengths.shape[0]}")
    keep = q if keep is None else keep
    if position_ids is None:
        position_ids = cache.position_ids(q)
    if attention_mask is None:
        attention_mask = cache.attention_mask(q, cache.dtype)
    kwargs = {cache_kwarg(model): cache, "use_cache": True}
    if "logits_to_keep" in _forward_params(type(model)):
        kwargs["logits_to_keep"] = keep
    capture = _AuxCapture(decoder_layers(model) if layers is None else layers, aux_layers)
    with capture, attention(model, attn):
        out = model(input_ids=ids_BQ, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    return out.logits[:, -keep:], capture.aux if aux_layers else None


def prefill_inputs(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts (R of them, widest W): ids ``[R, W]`` (pad 0), positions
    ``[R, W]`` (0 at each prompt's first token, pads at 0), start ``[R]`` (= W - L_r, the
    first real column) and lengths ``[R]``, all int64 on ``device``."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    W = int(lengths.max())
    ids = torch.zeros(len(prompts), W, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, W - len(p):] = torch.as_tensor(p, dtype=torch.long)
    start = W - lengths
    pos = (torch.arange(W)[None] - start[:, None]).clamp_min(0)
    return ids.to(device), pos.to(device), start.to(device), lengths.to(device)


def prefill_mask(start_R: torch.Tensor, W: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[R, 1, W, W]`` for left-padded prompts: query i reads column c iff
    ``start_r <= c <= i``, and a pad query (i < start_r) reads itself only (a row with
    no visible column would give NaN, and NaN values leak through zero weights)."""
    cols = torch.arange(W, device=start_R.device)
    i, c = cols[:, None], cols[None, :]
    visible = ((c >= start_R[:, None, None]) & (c <= i)) | (c == i)  # [R, W, W]
    low = torch.finfo(dtype).min
    return torch.zeros(visible.shape, dtype=dtype, device=start_R.device).masked_fill_(~visible, low)[:, None]


def prefill(model: nn.Module, prompts: Sequence[Sequence[int]], *, dtype: torch.dtype, device,
            aux_layers: Sequence[int] = (), layers: nn.ModuleList | None = None, attn: str = "grouped"):
    """One left-padded forward of R prompts into a fresh ``StaticKVCache`` of R rows and W
    columns: ``(cache, logits [R, V] at each prompt's last token, aux [R, W, A*H] or None,
    start [R], lengths [R])``. Row r holds its prompt in columns ``start_r .. W - 1``
    (``StaticKVCache.load_rows`` moves it to columns ``0..L_r - 1`` of a larger cache)."""
    ids, pos, start, lengths = prefill_inputs(prompts, device)
    R, W = ids.shape
    cache = StaticKVCache(model.config, R, W, dtype=dtype, device=device)
    logits, aux = cached_forward(model, cache, ids, keep=1, position_ids=pos,
                                 attention_mask=prefill_mask(start, W, dtype), aux_layers=aux_layers, layers=layers,
                                 attn=attn)
    return cache, logits[:, -1], aux, start, lengths
