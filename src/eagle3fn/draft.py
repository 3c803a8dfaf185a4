"""The EAGLE-3 draft (SPEC section 2): one Llama-style layer, as functions of a
parameter dict.

Legend: B batch, S sequence length, N rows, H draft hidden, Ht target hidden, I MLP
width, h heads, g kv heads, d head dim, V target vocab, Vd draft vocab.

Parameters live in a plain ``dict`` (``init_params``) named as SpecForge/SGLang name
them, so exports load unchanged. ``Eagle3Draft`` only fixes structure and names (the
export writes them with ``DraftConfig``); the layer's maths is written once, here, as
functions of that dict (``project``, ``layer_input``, ``queries`` / ``keys_values`` /
``qkv``, ``layer_output``, ``head``), which training (``eagle3fn.unrolled``) and
decoding (``eagle3fn.evaluation``) both call.
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
        # Inside a compiled region (a compiled training step) before anything else: dynamo
        # cannot trace the backend's context variable, and the region fuses fn anyway.
        if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
            return fn(x, *args)
        backend = compile_backend(x.device)
        if backend is None:
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


@fused_on_cuda
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


def head_logits(out_NH: torch.Tensor, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                cfg: DraftConfig, fused: bool = True) -> torch.Tensor:
    """Draft logits ``[N, Vd]`` = ``lm_head(norm(out))`` (no norm when
    ``cfg.norm_output`` is off) of pre-norm outputs ``[N, H]``, weights passed in
    (``fused``: the norm compiled on CUDA, ``elementwise``)."""
    x = (elementwise(rms_norm, fused)(out_NH, norm_weight, cfg.rms_norm_eps) if cfg.norm_output
         else out_NH)
    return F.linear(x, lm_head_weight)


class RMSNorm(nn.Module):
    """An RMSNorm's weight ``[size]`` (ones at init); its maths is ``rms_norm``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


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
    """SwiGLU weights: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    """The draft's single layer's weights; its maths is ``layer_input``, ``queries`` /
    ``keys_values`` / ``qkv``, attention (the caller's) and ``layer_output``."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)


class Eagle3Draft(nn.Module):
    """Module skeleton: parameter names and shapes (SPEC section 2), no maths.

    ``embed_tokens [V, H]`` (frozen, copied from the target), ``fc [H, 3*Ht]``,
    optional ``fc_norm.{0,1,2} [Ht]``, ``midlayer.*``, ``norm [H]``, ``lm_head [Vd, H]``.
    Build it on the ``meta`` device for structure only (``init_params``, the export);
    the layer is computed by this module's functions of the params dict (``project``
    ... ``head``).
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.ht, cfg.hidden_size, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.ht) for _ in range(3)])
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def head(self, out_NH: torch.Tensor) -> torch.Tensor:
        """``head`` of this module's tensors (a materialized draft, for oracles):
        logits ``[N, Vd]`` of pre-norm outputs ``[N, H]``."""
        return head_logits(out_NH, self.norm.weight, self.lm_head.weight, self.cfg)


# The layer, as functions of the parameter dict (``init_params`` names). Every path that
# runs the draft calls these: the TTT unroll (``eagle3fn.unrolled``), the chain of one
# row (``evaluation.chain``) and the cached batched draft, eager and CUDA-graph
# (``evaluation.cached_draft``, ``evaluation.static_draft``). Attention itself (which
# keys a query sees) is the caller's. ``fused``: the elementwise chains compiled on CUDA
# (``elementwise``); eager and compiled give the same maths.
#
# Step j of one row: ``g`` is fc(a) at j = 0 (``project``), else step j-1's pre-norm
# output; ``u = layer_input(token, g)``; q, k (RoPE'd at the step's position) and v of
# ``u``; ``a`` = attention of q over the keys the step sees; ``out = layer_output(a, g)``;
# logits ``head(out)``.


def project(params: dict[str, torch.Tensor], aux_N3: torch.Tensor, cfg: DraftConfig,
            fused: bool = True) -> torch.Tensor:
    """Step-0 input features ``g = fc(a)`` ``[..., H]`` of target aux ``[..., 3*Ht]``
    (``cfg.fc_norm``: each third RMS-normed first, EAGLE-3.1)."""
    if cfg.fc_norm:
        norm = elementwise(rms_norm, fused)
        aux_N3 = torch.cat([norm(c, params[f"fc_norm.{i}.weight"], cfg.rms_norm_eps)
                            for i, c in enumerate(aux_N3.chunk(3, dim=-1))], dim=-1)
    return F.linear(aux_N3, params["fc.weight"])


def layer_input(params: dict[str, torch.Tensor], ids_N: torch.Tensor, g_NH: torch.Tensor,
                cfg: DraftConfig, fused: bool = True) -> torch.Tensor:
    """The layer input ``u = [input_layernorm(embed(ids)) ; hidden_norm(g)]`` ``[..., 2H]``
    of tokens ``ids [...]`` and input features ``g [..., H]`` (``norm_pair``)."""
    return elementwise(norm_pair, fused)(
        F.embedding(ids_N, params["embed_tokens.weight"]), g_NH, params["midlayer.input_layernorm.weight"],
        params["midlayer.hidden_norm.weight"], cfg.rms_norm_eps)


def _heads(x: torch.Tensor, n: int, cfg: DraftConfig) -> torch.Tensor:
    """``[..., n*d]`` as ``[..., n, d]`` (a view)."""
    return x.view(*x.shape[:-1], n, cfg.d)


def queries(params: dict[str, torch.Tensor], u_N2H: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            cfg: DraftConfig, fused: bool = True) -> torch.Tensor:
    """Queries ``[..., N, h, d]`` of layer inputs ``u [..., N, 2H]``, RoPE'd with cos,
    sin ``[..., N, 1, d]`` (``rope_cos_sin`` at the rows' positions)."""
    q = _heads(F.linear(u_N2H, params["midlayer.self_attn.q_proj.weight"]), cfg.num_heads, cfg)
    return elementwise(apply_rope, fused)(q, cos, sin)


def keys_values(params: dict[str, torch.Tensor], u_N2H: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cfg: DraftConfig, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (RoPE'd as ``queries``) and values ``[..., N, g, d]`` of ``u [..., N, 2H]``."""
    k = _heads(F.linear(u_N2H, params["midlayer.self_attn.k_proj.weight"]), cfg.num_kv_heads, cfg)
    k = elementwise(apply_rope, fused)(k, cos, sin)
    return k, _heads(F.linear(u_N2H, params["midlayer.self_attn.v_proj.weight"]), cfg.num_kv_heads, cfg)


def qkv(params: dict[str, torch.Tensor], u_N2H: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cfg: DraftConfig, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``queries`` and ``keys_values`` of the same rows: q ``[..., N, h, d]``, k, v
    ``[..., N, g, d]`` (one RoPE call for q and k, ``apply_rope_pair``)."""
    attn = "midlayer.self_attn."
    q, k = elementwise(apply_rope_pair, fused)(
        _heads(F.linear(u_N2H, params[attn + "q_proj.weight"]), cfg.num_heads, cfg),
        _heads(F.linear(u_N2H, params[attn + "k_proj.weight"]), cfg.num_kv_heads, cfg), cos, sin)
    return q, k, _heads(F.linear(u_N2H, params[attn + "v_proj.weight"]), cfg.num_kv_heads, cfg)


def layer_output(params: dict[str, torch.Tensor], a_NhD: torch.Tensor, g_NH: torch.Tensor,
                 cfg: DraftConfig, fused: bool = True) -> torch.Tensor:
    """o_proj, residual and MLP of the rows' attention output ``a`` (``[N, h, d]`` or
    any shape of ``N * h * d`` led by N) with their input features ``g [N, H]``: the
    pre-norm output ``[N, H]`` (the next step's ``g``)."""
    # The residual adds ride in the GEMMs' epilogues (addmm: r + a @ W^T).
    r = torch.addmm(g_NH, a_NhD.reshape(a_NhD.shape[0], cfg.num_heads * cfg.d),
                    params["midlayer.self_attn.o_proj.weight"].t())
    x = elementwise(rms_norm, fused)(r, params["midlayer.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = "midlayer.mlp."
    return torch.addmm(r, elementwise(swiglu, fused)(F.linear(x, params[mlp + "gate_proj.weight"]),
                                                     F.linear(x, params[mlp + "up_proj.weight"])),
                       params[mlp + "down_proj.weight"].t())


def head_weights(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm.weight, lm_head.weight)``: ``head_logits``' weights (a fused head chunks
    over them, ``loss.head_step_terms``)."""
    return params["norm.weight"], params["lm_head.weight"]


def head(params: dict[str, torch.Tensor], out_NH: torch.Tensor, cfg: DraftConfig,
         fused: bool = True) -> torch.Tensor:
    """Draft logits ``[N, Vd]`` = ``lm_head(norm(out))`` of pre-norm outputs ``[N, H]``
    (``head_logits``)."""
    return head_logits(out_NH, *head_weights(params), cfg, fused)


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
