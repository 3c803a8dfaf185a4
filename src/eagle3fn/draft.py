"""The EAGLE-3 draft (SPEC section 2): one Llama-style layer, as a module skeleton.

Legend: B batch, S sequence length, H draft hidden, Ht target hidden, I MLP width,
h heads, g kv heads, d head dim, V target vocab, Vd draft vocab.

Parameters live in a plain ``dict`` (``init_params``) named as SpecForge/SGLang name
them, so exports load unchanged. ``Eagle3Draft`` only fixes structure and names; the
training code runs it statelessly with ``torch.func.functional_call``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

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


COMPILE_ELEMENTWISE = os.environ.get("EAGLE3FN_COMPILE", "1") != "0"
"""Fuse the draft's elementwise chains (RMSNorm, RoPE, SwiGLU) with ``torch.compile``
on CUDA tensors (one fused kernel each way instead of 5-15). Set the environment
variable ``EAGLE3FN_COMPILE=0`` (or this flag) to run them eagerly; CPU tensors and
``torch.func`` transforms always run eagerly."""


def fused_on_cuda(fn):
    """``fn`` compiled (shape-dynamic) for CUDA inputs, eager otherwise (same maths,
    rounding may differ in the last bit: inductor keeps fp32 intermediates in registers)."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args):
        nonlocal compiled
        if (not COMPILE_ELEMENTWISE or not x.is_cuda or torch.compiler.is_compiling()
                or torch._C._functorch.is_functorch_wrapped_tensor(x)):
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args)

    wrapper.eager = fn
    return wrapper


@functools.lru_cache(maxsize=32)
def _device_frequencies(rope: RopeConfig, head_dim: int,
                        device: torch.device) -> tuple[torch.Tensor, float]:
    """``rope_frequencies`` already on ``device`` (a host-to-GPU copy per call would
    stall the GPU queue at every step)."""
    inv_freq, scale = rope_frequencies(rope, head_dim)
    return inv_freq.to(device), scale


def rope_cos_sin(positions: torch.Tensor, rope: RopeConfig, head_dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*positions.shape, d]`` (``emb = cat(freqs, freqs)``), in ``dtype``."""
    inv_freq, scale = _device_frequencies(rope, head_dim, positions.device)
    return _cos_sin(positions, inv_freq, scale, dtype)


@fused_on_cuda
def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin``'s maths (fp64 angles; one fused kernel on CUDA)."""
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@fused_on_cuda
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama rotate-half RoPE: ``x*cos + rotate_half(x)*sin`` (non-interleaved)."""
    return _rope(x, cos, sin)


@fused_on_cuda
def apply_rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` of the queries and the keys of one step, in one call (one
    compiled region on CUDA instead of two)."""
    return _rope(q, cos, sin), _rope(k, cos, sin)


@dataclass(kw_only=True, frozen=True)
class DraftConfig:
    """Sizes and toggles of the one-layer EAGLE-3 draft."""

    hidden_size: int
    """H, the draft's hidden size (usually the target's)."""
    intermediate_size: int
    """I, the SwiGLU MLP width."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA); divides ``num_heads``."""
    vocab_size: int
    """V, the target vocab (embedding rows; t2d length)."""
    draft_vocab_size: int
    """Vd, the draft head's vocab."""
    head_dim: int | None = None
    """d, per-head width (default H / num_heads)."""
    target_hidden_size: int | None = None
    """Ht, the target's hidden size (default H); fc maps 3*Ht -> H."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary embedding."""
    fc_norm: bool = False
    """EAGLE-3.1: RMSNorm each of the three aux chunks before fc."""
    norm_output: bool = True
    """Apply the final norm before lm_head (EAGLE-3.1 may turn it off)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "set head_dim"
            )

    @property
    def d(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def ht(self) -> int:
        """Target hidden size."""
        return self.target_hidden_size or self.hidden_size


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` with fp32 (or fp64) math, output in the input dtype."""
    return _rms_norm(x, weight, eps)


@fused_on_cuda
def norm_pair(x: torch.Tensor, g: torch.Tensor, x_weight: torch.Tensor, g_weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    """The layer input ``cat(rms_norm(x), rms_norm(g))`` ``[N, 2H]`` of the token
    embeddings ``x`` (cast to ``g``'s dtype first) and the features ``g`` ``[N, H]``:
    one compiled region on CUDA instead of two norms and a copy."""
    return torch.cat((_rms_norm(x.to(g.dtype), x_weight, eps), _rms_norm(g, g_weight, eps)), dim=-1)


def head_logits(out_NH: torch.Tensor, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                cfg: DraftConfig) -> torch.Tensor:
    """Draft logits ``[N, Vd]`` = ``lm_head(norm(out))`` (no norm when
    ``cfg.norm_output`` is off) of pre-norm outputs ``[N, H]``, weights passed in."""
    x = rms_norm(out_NH, norm_weight, cfg.rms_norm_eps) if cfg.norm_output else out_NH
    return F.linear(x, lm_head_weight)


class RMSNorm(nn.Module):
    """``rms_norm`` as a module (its weight is a named parameter)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """q/k/v from the ``[embedding ; hidden]`` input (width 2H), o back to H."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, d = cfg.hidden_size, cfg.d
        self.q_proj = nn.Linear(2 * H, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * H, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * H, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, H, bias=False)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@fused_on_cuda
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """The draft's single layer; ``ttt.py`` drives its attention step by step."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Eagle3Draft(nn.Module):
    """Module skeleton: parameter names and shapes (SPEC section 2).

    ``embed_tokens [V, H]`` (frozen, copied from the target), ``fc [H, 3*Ht]``,
    optional ``fc_norm.{0,1,2} [Ht]``, ``midlayer.*``, ``norm [H]``, ``lm_head [Vd, H]``.
    Build it on the ``meta`` device for structure only.
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.ht, cfg.hidden_size, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.ht, cfg.rms_norm_eps) for _ in range(3)])
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def project(self, aux_BS3: torch.Tensor) -> torch.Tensor:
        """Step-0 input feature ``g = fc(a)`` ``[B, S, H]`` from aux ``[B, S, 3*Ht]``."""
        if self.cfg.fc_norm:
            chunks = aux_BS3.chunk(3, dim=-1)
            aux_BS3 = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_BS3)

    def head(self, out_NH: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[N, Vd]`` = ``lm_head(norm(out))`` of pre-norm outputs ``[N, H]``."""
        return self.lm_head(self.norm(out_NH) if self.cfg.norm_output else out_NH)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm.weight, lm_head.weight)``, for ``head_logits`` outside the module."""
        return self.norm.weight, self.lm_head.weight


FROZEN = ("embed_tokens.weight",)
"""Parameters that are copied from the target and never trained."""


def init_params(
    cfg: DraftConfig,
    *,
    embed_tokens: torch.Tensor | None = None,
    target_lm_head: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Fresh draft parameters, named as ``Eagle3Draft.named_parameters()``.

    Linear layers use normal(0, 0.02) (Llama's ``initializer_range``), norms are ones.

    Args:
        embed_tokens: ``[V, H]`` target embedding to copy (frozen; random if None).
        target_lm_head: ``[V, H]`` target head; with ``t2d``, lm_head starts as its
            draft-vocab rows ``target_lm_head[t2d]``.
        t2d: bool ``[V]``, needed with ``target_lm_head``.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        skeleton = Eagle3Draft(cfg)
    norms = {f"{n}.weight" for n, m in skeleton.named_modules() if isinstance(m, RMSNorm)}
    params = {
        name: torch.ones(p.shape) if name in norms else torch.randn(p.shape, generator=g) * 0.02
        for name, p in skeleton.named_parameters()
    }
    if embed_tokens is not None:
        if tuple(embed_tokens.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"embed_tokens has shape {tuple(embed_tokens.shape)}, the draft needs "
                f"[vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]"
            )
        params["embed_tokens.weight"] = embed_tokens.detach().clone()
    if target_lm_head is not None:
        if t2d is None or t2d.shape != (cfg.vocab_size,) or int(t2d.sum()) != cfg.draft_vocab_size:
            raise ValueError(
                "initialising lm_head from the target head needs t2d: bool [vocab_size] "
                f"selecting draft_vocab_size={cfg.draft_vocab_size} ids"
            )
        params["lm_head.weight"] = target_lm_head.detach()[t2d.to(target_lm_head.device)].clone()
    return {
        k: v.to(device=device, dtype=dtype).requires_grad_(k not in FROZEN)
        for k, v in params.items()
    }
