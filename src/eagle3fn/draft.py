"""The EAGLE-3 draft (SPEC section 2): one Llama-style layer, as a module skeleton.

Legend: B batch, S sequence length, H draft hidden, Ht target hidden, I MLP width,
h heads, g kv heads, d head dim, V target vocab, Vd draft vocab.

Parameters live in a plain ``dict`` (``init_params``) named as SpecForge/SGLang name
them, so exports load unchanged. ``Eagle3Draft`` only fixes structure and names; the
training code runs it statelessly with ``torch.func.functional_call``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eagle3fn.compiled import compile_backend, compiler
from eagle3fn.rope import ROPE_TYPE_KEYS, RopeConfig, RopeType, rope_frequencies  # noqa: F401 - re-exported


def fused_on_cuda(fn):
    """``fn`` compiled (shape-dynamic) for CUDA inputs, eager otherwise (same maths,
    rounding may differ in the last bit: inductor keeps fp32 intermediates in registers).
    The draft's elementwise chains (RMSNorm, RoPE, SwiGLU) are wrapped so: one fused
    kernel each way instead of 5-15. CPU tensors (unless a test's
    ``runtime.compile_on_cpu`` asks) and ``torch.func`` transforms always run eagerly;
    ``wrapper.eager`` is ``fn`` itself, which a caller whose ``compile_elementwise`` is
    off runs instead (``elementwise``)."""
    compiled: dict[str, object] = {}

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args):
        backend = compile_backend(x.device)
        if (backend is None or torch.compiler.is_compiling()
                or torch._C._functorch.is_functorch_wrapped_tensor(x)):
            return fn(x, *args)
        if backend not in compiled:
            compiled[backend] = compiler(fn, backend)
        return compiled[backend](x, *args)

    wrapper.eager = fn
    return wrapper


def elementwise(fn, fused: bool):
    """``fn``, a ``fused_on_cuda`` function, as its caller's ``compile_elementwise``
    (``fused``) asks: ``fn`` itself (compiled for CUDA inputs) or always eager
    (``fn.eager``)."""
    return fn if fused else fn.eager


@functools.lru_cache(maxsize=32)
def _device_frequencies(rope: RopeConfig, head_dim: int,
                        device: torch.device) -> tuple[torch.Tensor, float]:
    """``rope_frequencies`` already on ``device`` (a host-to-GPU copy per call would
    stall the GPU queue at every step)."""
    inv_freq, scale = rope_frequencies(rope, head_dim)
    return inv_freq.to(device), scale


def rope_cos_sin(positions: torch.Tensor, rope: RopeConfig, head_dim: int,
                 dtype: torch.dtype, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*positions.shape, d]`` (``emb = cat(freqs, freqs)``), in ``dtype``
    (``fused``: one compiled kernel on CUDA, ``elementwise``)."""
    inv_freq, scale = _device_frequencies(rope, head_dim, positions.device)
    return elementwise(_cos_sin, fused)(positions, inv_freq, scale, dtype)


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
                cfg: DraftConfig, fused: bool = True) -> torch.Tensor:
    """Draft logits ``[N, Vd]`` = ``lm_head(norm(out))`` (no norm when
    ``cfg.norm_output`` is off) of pre-norm outputs ``[N, H]``, weights passed in
    (``fused``: the norm compiled on CUDA, ``elementwise``)."""
    x = (elementwise(rms_norm, fused)(out_NH, norm_weight, cfg.rms_norm_eps) if cfg.norm_output
         else out_NH)
    return F.linear(x, lm_head_weight)


class RMSNorm(nn.Module):
    """``rms_norm`` as a module (its weight is a named parameter; ``fused``: compiled
    on CUDA, ``elementwise``)."""

    def __init__(self, size: int, eps: float, fused: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise(rms_norm, self.fused)(x, self.weight, self.eps)


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
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (``fused``: compiled on CUDA)."""

    def __init__(self, cfg: DraftConfig, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(elementwise(swiglu, self.fused)(self.gate_proj(x), self.up_proj(x)))


@fused_on_cuda
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """The draft's single layer; ``eagle3fn.unrolled`` drives its attention step by step."""

    def __init__(self, cfg: DraftConfig, fused: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.mlp = MLP(cfg, fused)


class Eagle3Draft(nn.Module):
    """Module skeleton: parameter names and shapes (SPEC section 2).

    ``embed_tokens [V, H]`` (frozen, copied from the target), ``fc [H, 3*Ht]``,
    optional ``fc_norm.{0,1,2} [Ht]``, ``midlayer.*``, ``norm [H]``, ``lm_head [Vd, H]``.
    Build it on the ``meta`` device for structure only. ``compile_elementwise``: its
    norms and SwiGLU compiled on CUDA (``fused_on_cuda``), else always eager.
    """

    def __init__(self, cfg: DraftConfig, *, compile_elementwise: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        fused = compile_elementwise
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.ht, cfg.hidden_size, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.ht, cfg.rms_norm_eps, fused) for _ in range(3)])
        self.midlayer = DecoderLayer(cfg, fused)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
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
    params = {  # drawn in fp32 whatever the default dtype: a seed gives the same draws at every precision
        name: torch.ones(p.shape, dtype=torch.float32) if name in norms
        else torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02
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
