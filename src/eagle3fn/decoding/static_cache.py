"""A fixed-shape KV cache with one length per row, usable as a transformers ``Cache``.

Legend: B rows (slots), L decoder layers, g kv heads, d head dim, M cache columns
(positions 0..M-1 of every row), q tokens fed per row in one forward, V vocab.

Row b holds the keys and values of its positions ``0..n_b - 1`` in columns ``0..n_b - 1``
(``lengths = n [B]``, int64 on the device). A forward of q tokens per row writes them at
columns ``n_b .. n_b + q - 1`` (an ``index_put_`` with tensor indices: no host sync, the same
kernels whatever the lengths, so a decode step can be recorded once as a CUDA graph), at
positions ``position_ids [B, q] = n_b + i``, under the explicit additive mask
``[B, 1, q, M]``: query i of row b sees column c iff ``c <= n_b + i``. The forward does not
move ``n``: the caller advances it (``advance``) or sets it (``lengths.copy_``, which is
also how speculative verification rolls rejected tokens back: their columns are simply
overwritten later).

transformers passes a 4-D ``attention_mask`` through unchanged (``masking_utils``:
"an already prepared 4D mask ... is returned as-is") to the sdpa and eager attention
functions, which add it to the scores; the model's own mask construction never runs.
Sliding-window layers would need a second mask and are refused.

Memory: ``2 * L * B * g * M * d * itemsize`` bytes (keys and values), e.g. bf16 (2 bytes).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(config) -> tuple[int, int, int]:
    """``(L, g, d)`` of a HF model config: decoder layers, kv heads, head dim."""
    c = _text_config(config)
    heads = c.num_attention_heads
    g = getattr(c, "num_key_value_heads", None) or heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, g, d


def cache_bytes(config, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a ``StaticKVCache`` for this config: ``2 * L * B * g * M * d * itemsize``."""
    L, g, d = kv_shape(config)
    return 2 * L * batch_size * g * max_len * d * torch.empty((), dtype=dtype).element_size()


def check_full_attention(config) -> None:
    """ValueError when any layer of the model attends in a sliding window (one 4-D mask
    cannot serve both kinds of layer)."""
    c = _text_config(config)
    types = getattr(c, "layer_types", None) or []
    sliding = getattr(c, "sliding_window", None) is not None and getattr(c, "use_sliding_window", True)
    if any(t != "full_attention" for t in types) or (not types and sliding):
        raise ValueError(
            f"{type(c).__name__} has non-full attention layers (layer_types={types}, sliding_window="
            f"{getattr(c, 'sliding_window', None)}); the static decoding cache supports full attention only: "
            "use transformers' generate for this model"
        )


class RowLayer(CacheLayerMixin):
    """One layer's buffers ``keys``, ``values [B, g, M, d]`` (written by ``StaticKVCache``)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.device = keys.device

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("RowLayer is written through StaticKVCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticKVCache(Cache):
    """KV cache of ``B`` rows x ``M`` columns per layer with per-row lengths (module docstring).

    Fields:
        lengths: int64 ``[B]`` on ``device``, n_b = positions held by row b (starts at 0).
        layers: L ``RowLayer`` with ``keys``, ``values [B, g, M, d]`` in ``dtype``.
        max_len: M.
        window: W <= M, the columns forwards attend (``attention_mask`` and ``update``
            return the first W): M by default; an eager caller that knows every row's
            ``n_b + q <= W`` may lower it to skip the columns no row holds yet (a CUDA
            graph keeps M: its shapes are fixed).
    """

    def __init__(self, config, batch_size: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"a static cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        check_full_attention(config)
        L, g, d = kv_shape(config)
        layers = [RowLayer(torch.zeros(batch_size, g, max_len, d, dtype=dtype, device=device),
                           torch.zeros(batch_size, g, max_len, d, dtype=dtype, device=device)) for _ in range(L)]
        super().__init__(layers=layers)
        self.max_len, self.batch_size_, self.dtype = max_len, batch_size, dtype
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._columns_M = torch.arange(max_len, device=device)
        self._rows_B1 = torch.arange(batch_size, device=device)[:, None]
        self.window = max_len
        self._steps = torch.arange(max_len, device=device)

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    # ------------------------------------------------------------------ inputs

    def position_ids(self, q: int) -> torch.Tensor:
        """int64 ``[B, q]``: ``n_b + i``, the positions of the next q tokens of each row."""
        return self.lengths[:, None] + self._steps[:q]

    def attention_mask(self, q: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[B, 1, q, W]`` in ``dtype``: 0 where query i of row b may read column
        c (``c <= n_b + i``), the dtype's lowest finite value elsewhere."""
        visible = self._columns_M[:self.window] <= self.position_ids(q)[:, :, None]  # [B, q, W]
        hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device)
        return torch.where(visible, torch.zeros((), dtype=dtype, device=self.device), hidden)[:, None]

    # ----------------------------------------------------------- transformers API

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``, ``value_states [B, g, q, d]`` at columns ``n_b + i`` of
        layer ``layer_idx``; return its buffers' first W columns ``[B, g, W, d]`` (the mask
        hides the columns a query may not read)."""
        layer = self.layers[layer_idx]
        columns_Bq = self.lengths[:, None] + self._steps[:key_states.shape[2]]
        # An index_put (advanced indices around the kv-head slice: values [B, q, g, d]),
        # not a scatter: inductor writes it into the buffer in place, where a scatter on a
        # graph input became a copy of the whole cache and a copy back, every layer.
        layer.keys[self._rows_B1, :, columns_Bq] = key_states.to(layer.keys.dtype).transpose(1, 2)
        layer.values[self._rows_B1, :, columns_Bq] = value_states.to(layer.values.dtype).transpose(1, 2)
        return layer.keys[:, :, :self.window], layer.values[:, :, :self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: rows have lengths of their own (``lengths``); callers pass ``position_ids``
        and the 4-D mask, so transformers never derives positions from this."""
        return 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_len, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    # ------------------------------------------------------------------ rows

    def advance(self, by: torch.Tensor | int) -> None:
        """``n += by`` (int, or int64 ``[B]``)."""
        self.lengths.add_(by)

    def load_rows(self, rows_R: torch.Tensor, src: StaticKVCache, start_R: torch.Tensor,
                  length_R: torch.Tensor) -> None:
        """Copy ``src`` row r's columns ``start_r .. start_r + length_r - 1`` into this
        cache's row ``rows[r]`` at columns ``0..length_r - 1`` and set its length to
        ``length_r``. ``src`` has R rows and ``M_src <= M`` columns (a left-padded prefill:
        ``start_r = M_src - length_r``); columns past ``length_r`` get padding, which the
        mask hides until they are overwritten."""
        R, M_src = src.lengths.shape[0], src.max_len
        g, d = self.layers[0].keys.shape[1], self.layers[0].keys.shape[3]
        cols = (start_R[:, None] + src._columns_M[:M_src]).clamp_max(M_src - 1)  # [R, M_src]
        index = cols[:, None, :, None].expand(R, g, M_src, d)
        for mine, theirs in zip(self.layers, src.layers):
            mine.keys[:, :, :M_src].index_copy_(0, rows_R, theirs.keys.gather(2, index))
            mine.values[:, :, :M_src].index_copy_(0, rows_R, theirs.values.gather(2, index))
        self.lengths.index_copy_(0, rows_R, length_R)
