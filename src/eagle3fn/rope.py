"""Rotary position embeddings of the draft, as transformers builds its target's.

``RopeConfig`` holds a HF config's RoPE (``from_hf`` / ``from_hf_config``: default,
linear, dynamic at init, llama3, yarn with ``truncate`` and ``attention_factor``,
longrope); ``rope_frequencies`` gives the inverse frequencies ``[d/2]`` and the cos/sin
scale of transformers' ``ROPE_INIT_FUNCTIONS`` (``tests/test_rope.py`` holds them equal).
The draft applies them in ``draft.rope_cos_sin`` / ``apply_rope``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from eagle3fn.errors import UsageError

RopeType = Literal["default", "linear", "llama3", "yarn", "longrope"]

# transformers' rope_parameters keys per rope type (its _validate_*_rope_parameters);
# dynamic NTK is read as default (see RopeConfig.from_hf).
ROPE_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor",
                 "attention_factor"),
}
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                  "longrope": ("short_factor", "long_factor")}
# Keys of every type that leave the frequencies alone: the type itself, the base (taken
# as theta), the rotary fraction (checked to be 1) and Qwen-VL's multimodal sections
# (text positions are equal on every axis, which makes M-RoPE the 1-D RoPE).
_ROPE_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor",
                     "mrope_section", "mrope_interleaved")


@dataclass(kw_only=True, frozen=True)
class RopeConfig:
    """Rotary embedding of the draft: Llama rotate-half, transformers' rope types with
    their frequencies and cos/sin scale (``rope_frequencies``)."""

    theta: float = 10000.0
    """Base ``rope_theta``."""
    rope_type: RopeType = "default"
    """``default``, ``linear`` (positions / factor), ``llama3`` (Llama-3.1 band-wise
    scaling), ``yarn`` or ``longrope`` (Phi-3)."""
    factor: float = 1.0
    """Scaling factor (linear, llama3, yarn; longrope: only sets the default scale)."""
    low_freq_factor: float = 1.0
    """llama3: low-frequency factor."""
    high_freq_factor: float = 4.0
    """llama3: high-frequency factor."""
    original_max_position_embeddings: int = 8192
    """llama3 / yarn / longrope: the context length the base model was trained at."""
    beta_fast: float = 32.0
    """yarn: fast rotation boundary (0 reads as 32, as in transformers)."""
    beta_slow: float = 1.0
    """yarn: slow rotation boundary (0 reads as 1)."""
    mscale: float = 1.0
    """yarn: numerator of the DeepSeek scale ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)``, used only when both are non-zero."""
    mscale_all_dim: float = 0.0
    """yarn: denominator of the DeepSeek scale; 0 uses ``0.1*ln(factor)+1``."""
    attention_factor: float | None = None
    """yarn / longrope: the cos/sin scale; None derives it from ``factor`` (and the
    mscales) as transformers does."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole dims (gpt-oss: False)."""
    short_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors ``[d/2]`` for sequences up to
    ``original_max_position_embeddings`` (and transformers' init)."""
    long_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors ``[d/2]`` for longer sequences."""

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise ValueError(
                f"rope_type must be default, linear, llama3, yarn or longrope, "
                f"got {self.rope_type!r}"
            )
        # Lists (a JSON round trip) would make the config unhashable: it keys an lru_cache.
        object.__setattr__(self, "short_factor", tuple(float(x) for x in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(x) for x in self.long_factor))

    @classmethod
    def from_hf(cls, theta: float, scaling: dict | None,
                max_position_embeddings: int | None = None) -> RopeConfig:
        """From a HF ``rope_theta`` and ``rope_scaling`` dict (or transformers 5's
        ``rope_parameters``, whose ``rope_theta`` wins over ``theta``), read as
        transformers' ``ROPE_INIT_FUNCTIONS`` read it.

        ``max_position_embeddings`` is the target's: transformers' default for a missing
        ``original_max_position_embeddings``, and divided by that the default for yarn's
        and longrope's missing ``factor``. ``dynamic`` (dynamic NTK) gives the default RoPE: transformers
        computes exactly those frequencies at init and for every batch whose positions
        stay below ``max_position_embeddings``, and re-derives the base from each longer
        batch's length, which a static draft cannot follow. Raises UsageError for an
        unknown type or key, a missing required key, or ``partial_rotary_factor != 1``.
        """
        if not scaling:
            return cls(theta=theta)
        params = {k: v for k, v in scaling.items() if v is not None}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPE_KEYS:
            raise UsageError(
                f"rope_type={kind!r} is not supported: the draft reproduces transformers' "
                f"{', '.join(ROPE_TYPE_KEYS)} RoPE; train against a target with one of "
                "these or add the type to eagle3fn.draft.rope_frequencies"
            )
        unknown = sorted(set(params) - set(_ROPE_COMMON_KEYS) - set(ROPE_TYPE_KEYS[kind]))
        if unknown:
            raise UsageError(
                f"rope key(s) {unknown} of rope_type={kind!r} are not supported: {kind} RoPE "
                f"takes {', '.join(ROPE_TYPE_KEYS[kind]) or 'no keys'} besides "
                f"{', '.join(_ROPE_COMMON_KEYS)}; remove them from the target config or "
                "teach eagle3fn.draft.RopeConfig what they change"
            )
        partial = float(params.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise UsageError(
                f"partial_rotary_factor={partial} is not supported: the Llama-style draft "
                "rotates every head dim (1.0), so its RoPE cannot match this target's; "
                "train against a target with full rotary heads"
            )
        theta = float(params.get("rope_theta", theta))
        missing = [k for k in _ROPE_REQUIRED.get(kind, ()) if k not in params]
        original = "original_max_position_embeddings"
        if kind in ("llama3", "yarn", "longrope") and original not in params:
            if max_position_embeddings is None:
                missing.append(original)
            else:
                params[original] = max_position_embeddings
        if (kind == "yarn" or (kind == "longrope" and "attention_factor" not in params)) \
                and "factor" not in params:
            if max_position_embeddings is None or original not in params:
                missing.append("factor")
            else:
                params["factor"] = max_position_embeddings / params[original]
        if missing:
            raise UsageError(
                f"{kind} RoPE needs {sorted(missing)} in rope_scaling / rope_parameters; "
                "add them (transformers requires them) or pass the target's "
                "max_position_embeddings"
            )
        if kind == "dynamic":
            return cls(theta=theta)
        fields = {k: params[k] for k in ROPE_TYPE_KEYS[kind] if k in params}
        if kind == "yarn":
            # transformers reads a present-but-null truncate as False.
            fields["truncate"] = bool(scaling.get("truncate", True))
            if not (fields.get("mscale") and fields.get("mscale_all_dim")):
                # transformers then uses 0.1*ln(factor)+1; (1, 0) gives it under every
                # reading, also SpecForge's and vLLM's unconditional mscale ratio.
                fields["mscale"], fields["mscale_all_dim"] = 1.0, 0.0
        return cls(theta=theta, rope_type=kind, **fields)

    @classmethod
    def from_hf_config(cls, text_config) -> RopeConfig:
        """From a HF text config (``PretrainedConfig``): transformers 5's
        ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``, with its
        ``partial_rotary_factor``, ``original_max_position_embeddings`` (Phi-3 keeps it
        outside the dict and transformers prefers it) and ``max_position_embeddings``.
        Per-layer-type parameters (Gemma-3) give the ``full_attention`` entry: the draft
        layer attends over the whole context. Raises UsageError as ``from_hf``."""
        params = dict(getattr(text_config, "rope_parameters", None) or {})
        if not params:
            params = {"rope_theta": getattr(text_config, "rope_theta", 10000.0),
                      **(getattr(text_config, "rope_scaling", None) or {})}
        if any(isinstance(v, dict) for v in params.values()):
            if not isinstance(params.get("full_attention"), dict):
                raise UsageError(
                    f"per-layer-type rope_parameters {sorted(params)} have no "
                    "'full_attention' entry to give the draft's full-attention layer; "
                    "pass a target config with one"
                )
            params = dict(params["full_attention"])
        partial = getattr(text_config, "partial_rotary_factor", None)
        if partial is not None:
            params.setdefault("partial_rotary_factor", partial)
        kind = params.get("rope_type", params.get("type", "default"))
        outside = getattr(text_config, "original_max_position_embeddings", None)
        if kind in ("llama3", "yarn", "longrope") and outside is not None:
            params["original_max_position_embeddings"] = outside
        return cls.from_hf(float(params.get("rope_theta", 10000.0)), params,
                           getattr(text_config, "max_position_embeddings", None))


def rope_frequencies(rope: RopeConfig, head_dim: int,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp64 ``[d/2]``) and the cos/sin scale of a RoPE config:
    transformers' ``ROPE_INIT_FUNCTIONS`` (which run in fp32) in fp64.

    ``seq_len`` (the batch's largest position + 1) matters for longrope only:
    transformers takes ``long_factor`` when it exceeds ``original_max_position_embeddings``,
    else (and at init, None) ``short_factor``.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, mid)
        return torch.where(wavelen < high_wavelen, inv_freq, scaled), 1.0
    if rope.rope_type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(rope.original_max_position_embeddings
                                        / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

        low, high = correction_dim(rope.beta_fast or 32.0), correction_dim(rope.beta_slow or 1.0)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        span = high - low if high != low else 1e-3  # as transformers: avoid 0 / 0
        ramp = (torch.arange(head_dim // 2, dtype=torch.float64) - low) / span
        extrapolate = 1 - ramp.clamp(0, 1)
        inv_freq = inv_freq / rope.factor * (1 - extrapolate) + inv_freq * extrapolate
        if rope.attention_factor is not None:
            scale = float(rope.attention_factor)
        elif rope.mscale and rope.mscale_all_dim:
            scale = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        else:
            scale = mscale(rope.factor)
        return inv_freq, scale
    if rope.rope_type == "longrope":
        long = seq_len is not None and seq_len > rope.original_max_position_embeddings
        name = "long_factor" if long else "short_factor"
        ext = getattr(rope, name)
        if len(ext) != head_dim // 2:
            raise UsageError(
                f"longrope {name} has {len(ext)} entries but head_dim={head_dim} needs "
                f"{head_dim // 2}; pass the target's own rope_scaling and head_dim"
            )
        if rope.attention_factor is not None:
            scale = float(rope.attention_factor)
        elif rope.factor <= 1.0:
            scale = 1.0
        else:
            scale = math.sqrt(1 + math.log(rope.factor)
                              / math.log(rope.original_max_position_embeddings))
        return inv_freq / torch.tensor(ext, dtype=torch.float64), scale
    return inv_freq, 1.0
