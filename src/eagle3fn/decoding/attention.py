"""Grouped-query attention over the static cache without repeating its kv heads.

Legend: B rows, h query heads, g kv heads (r = h / g queries per kv head), q queries per
row, M cache columns, d head dim.

transformers' sdpa path repeats the keys and values of each kv head r times
(``repeat_kv``) whenever an attention mask is given (its grouped sdpa call needs none),
which writes and reads an r-times copy of the whole cache in every layer at every decode
step. ``grouped_attention`` instead folds the r query heads of a kv head into the query
axis (``[B, g, r*q, d]``), so each layer reads its cache once: scores by one batched
matrix product, the additive mask, softmax in fp32 (fp64 for fp64), one product with the
values. The same arithmetic as transformers' eager attention.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

NAME = "eagle3fn_grouped"
"""The name ``grouped_attention`` is registered under in transformers' ``AttentionInterface``."""


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """``softmax(q k^T * scaling + mask) v`` per head, query head i reading kv head
    ``i // r``: query ``[B, h, q, d]``, key / value ``[B, g, M, d]``, the additive mask
    ``[B, 1, q, M]``; returns ``([B, q, h, d], None)`` as transformers' attention
    functions do."""
    if attention_mask is None or dropout or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise ValueError("grouped_attention serves the static cache's masked decoding only (a 4-D mask, "
                         "no dropout, softcap or sinks); use attention='model' for this model")
    B, h, q, d = query.shape
    g, M = key.shape[1], key.shape[2]
    r = h // g
    scale = d ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(B, g, r * q, d), key.transpose(-1, -2))  # [B, g, r*q, M]
    dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(dtype).view(B, g, r, q, M) * scale + attention_mask[:, :, None].to(dtype)
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(B, g, r * q, M)
    out = torch.matmul(probs, value).view(B, h, q, d)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_attention)


@contextlib.contextmanager
def attention(model: nn.Module, impl: str):
    """While open, the model's text layers attend with ``impl``: ``"grouped"``
    (``grouped_attention``) or ``"model"`` (the model's own setting, unchanged)."""
    if impl == "model":
        yield
        return
    if impl != "grouped":
        raise ValueError(f"attention={impl!r} is not 'grouped' or 'model'")
    _register()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
