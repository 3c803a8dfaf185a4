"""SpecForge 0.2.0 as an external oracle for EAGLE-3 TTT training (CPU, fp32, sdpa).

This module *imports* SpecForge (``specforge==0.2.0``) and runs its own training
forward: ``LlamaForCausalLMEagle3`` (specforge/modeling/draft/llama3_eagle.py)
wrapped in ``OnlineEagle3Model`` (specforge/algorithms/eagle3/model.py) with
``attention_backend="sdpa"``. No SpecForge code is copied.

Entry point::

    out = specforge_ttt(weights, cfg, input_ids=..., attention_mask=...,
                        loss_mask=..., aux_hidden=..., target_logits=...,
                        d2t=..., t2d=..., ttt_length=k)

Arguments follow SPEC section 1's *unshifted* conventions:

* ``input_ids``      int64 ``[B, S]``: tokens ``x_0..x_{L-1}``, right padded.
* ``attention_mask`` ``[B, S]`` (1 = real token, 0 = right padding).
* ``loss_mask``      ``[B, S]``: chat mask ``m`` (unshifted).
* ``aux_hidden``     ``[B, S, 3*Ht]``: ``a_t`` (unshifted).
* ``target_logits``  ``[B, S, V]``: ``z`` (unshifted, ``z[t]`` predicts ``x_{t+1}``).
* ``d2t`` int64 ``[Vd]``, ``t2d`` bool ``[V]``.

The function applies exactly what SpecForge's EAGLE-3 data path applies before
``OnlineEagle3Model.forward`` (``training/strategies/base.py:116`` ->
``TargetHead.preprocess``, ``modeling/target/target_head.py:103-108``)::

    target    = padding(z, left=False)          # z'[t] = z[t+1], zero row at S-1
    input_ids = padding(input_ids, left=False)  # ids'[t] = x_{t+1}, 0 at S-1
    loss_mask = loss_mask[..., None]            # NOT shifted, [B, S, 1]

(EAGLE-3 only allows ``target_repr="hidden_state"``, algorithms/eagle3/providers.py:139,156,
so both the offline and the server-streaming paths go through that shift; the
real pipeline then gets ``z`` as ``TargetHead(bf16)`` of the shifted final hidden,
so its shifted-in pad row / padded positions are exactly 0 logits. Pass
``z = 0`` at padded positions if you want that literally; it only matters where
``m' = 1``.) ``attention_mask``, ``aux_hidden`` are passed through unshifted; the
offline normalizer (algorithms/eagle3/data.py:19-20) zeroes ``loss_mask[L-1]``,
the streaming one does not; this function does *not* zero it (SPEC: parity tests
must pass ``loss_mask[L-1] = 0`` themselves).

``cfg`` keys (draft config; ``LlamaConfig`` + SpecForge extras):
``hidden_size`` (H), ``intermediate_size`` (I), ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` (default H // heads), ``vocab_size`` (V,
target vocab), ``draft_vocab_size`` (Vd), ``rms_norm_eps`` (1e-6), ``rope_theta``
(10000), ``rope_scaling`` (None or dict with ``rope_type``/``type`` in
{default, linear, dynamic, llama3, yarn}; llama3 needs ``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``;
yarn needs ``factor``, ``original_max_position_embeddings``, ``beta_fast``,
``beta_slow``, ``mscale``, ``mscale_all_dim`` all explicit, SpecForge has no
defaults for them under transformers 5), ``max_position_embeddings`` (2048),
``target_hidden_size`` (Ht, default H), ``fc_norm`` (False; EAGLE-3.1 per-chunk
RMSNorm before fc), ``norm_output`` (True), ``hidden_act`` ("silu"),
``freeze_embedding`` (True, as SpecForge training does:
algorithms/model_providers.py:111).

SpecForge parameter / buffer names accepted in ``weights`` (shapes; Hq = heads *
head_dim, Hkv = kv_heads * head_dim)::

    SPECFORGE_PARAM_SHAPES (see below), i.e.
    embed_tokens.weight                          [V, H]       (frozen by default)
    fc.weight                                    [H, 3*Ht]
    fc_norm.{0,1,2}.weight                       [Ht]         (only if cfg fc_norm)
    midlayer.hidden_norm.weight                  [H]
    midlayer.input_layernorm.weight              [H]
    midlayer.post_attention_layernorm.weight     [H]
    midlayer.self_attn.q_proj.weight             [Hq, 2*H]
    midlayer.self_attn.k_proj.weight             [Hkv, 2*H]
    midlayer.self_attn.v_proj.weight             [Hkv, 2*H]
    midlayer.self_attn.o_proj.weight             [H, Hq]
    midlayer.mlp.gate_proj.weight                [I, H]
    midlayer.mlp.up_proj.weight                  [I, H]
    midlayer.mlp.down_proj.weight                [H, I]
    norm.weight                                  [H]
    lm_head.weight                               [Vd, H]
    buffers: d2t int64 [Vd], t2d bool [V]  (optional in ``weights``; the d2t/t2d
             keyword arguments are authoritative and must agree if both given)

No biases anywhere. ``q/k/v_proj`` input columns ``[:H]`` act on
``input_layernorm(embed)`` and ``[H:]`` on ``hidden_norm(g)``.

Returns a dict: ``plosses`` (list of k scalar tensors; their graph has been
consumed by the backward unless ``backward=False``), ``acces``,
``acceptance_rates``, ``acc_corrects``, ``acc_denoms`` (lists of k tensors),
``objective`` (sum_j 0.8**j plosses[j]), ``grads`` (SpecForge name -> grad of
every trainable parameter), ``logits`` / ``hidden`` (per-step draft logits
``[B,S,Vd]`` and pre-norm step outputs ``[B,S,H]``, detached clones taken before
the backward), ``shifted`` (the tensors actually passed to forward), ``model``
(the ``OnlineEagle3Model``) and ``draft`` (the ``LlamaForCausalLMEagle3``).

Pitfalls: ``LogSoftmaxLoss.backward`` (specforge/core/loss.py:200-228) writes
the logits gradient *in place* into the saved logits tensor, so the draft's
logits are garbage after backward and a second backward through the same graph
is wrong; Triton must be in interpreter mode (``TRITON_INTERPRET=1``) before
``specforge.core.loss`` is imported; SpecForge's ``torch.compile``'d helpers
are run eagerly under ``torch._dynamo.config.patch(disable=True)``.
"""

from __future__ import annotations

import os
import sys

if "specforge.core.loss" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402
from typing import Any, Dict, Optional  # noqa: E402

import torch  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "flash_attn is not found" on CPU
    from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: E402
    from specforge.core import loss as _sf_loss  # noqa: E402
    from specforge.modeling.draft.llama3_eagle import (  # noqa: E402
        LlamaForCausalLMEagle3,
    )
    from specforge.utils import padding as _sf_padding  # noqa: E402

from transformers import LlamaConfig  # noqa: E402

__all__ = [
    "SPECFORGE_PARAM_SHAPES",
    "param_shapes",
    "build_draft",
    "specforge_ttt",
]

# name -> symbolic shape. Symbols: H, Ht, I, heads, kv_heads, head_dim, V, Vd.
SPECFORGE_PARAM_SHAPES: Dict[str, tuple] = {
    "embed_tokens.weight": ("V", "H"),
    "fc.weight": ("H", "3*Ht"),
    "midlayer.hidden_norm.weight": ("H",),
    "midlayer.input_layernorm.weight": ("H",),
    "midlayer.post_attention_layernorm.weight": ("H",),
    "midlayer.self_attn.q_proj.weight": ("heads*head_dim", "2*H"),
    "midlayer.self_attn.k_proj.weight": ("kv_heads*head_dim", "2*H"),
    "midlayer.self_attn.v_proj.weight": ("kv_heads*head_dim", "2*H"),
    "midlayer.self_attn.o_proj.weight": ("H", "heads*head_dim"),
    "midlayer.mlp.gate_proj.weight": ("I", "H"),
    "midlayer.mlp.up_proj.weight": ("I", "H"),
    "midlayer.mlp.down_proj.weight": ("H", "I"),
    "norm.weight": ("H",),
    "lm_head.weight": ("Vd", "H"),
}
# present only when cfg["fc_norm"] is true (EAGLE-3.1)
SPECFORGE_FC_NORM_SHAPES: Dict[str, tuple] = {
    f"fc_norm.{i}.weight": ("Ht",) for i in range(3)
}
SPECFORGE_BUFFER_SHAPES: Dict[str, tuple] = {"d2t": ("Vd",), "t2d": ("V",)}


def _interpreted() -> bool:
    """True iff SpecForge's loss kernel *and* triton.language ran in interpreter
    mode. Both are decided when the module is first imported, so TRITON_INTERPRET
    must be set before anything imports triton (note: torch itself imports
    triton, e.g. inside torch.use_deterministic_algorithms)."""
    import triton.language as tl

    kern = getattr(_sf_loss, "log_softmax_forward_kernel", None)
    return all(
        type(f).__name__ == "InterpretedFunction" for f in (kern, tl.max, tl.sum)
    )


def _dims(cfg: Dict[str, Any]) -> Dict[str, int]:
    H = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return {
        "H": H,
        "Ht": int(cfg.get("target_hidden_size") or H),
        "I": int(cfg["intermediate_size"]),
        "heads": heads,
        "kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or H // heads),
        "V": int(cfg["vocab_size"]),
        "Vd": int(cfg["draft_vocab_size"]),
    }


def param_shapes(cfg: Dict[str, Any]) -> Dict[str, tuple]:
    """Concrete shapes of every SpecForge parameter for ``cfg``."""
    d = _dims(cfg)
    names = dict(SPECFORGE_PARAM_SHAPES)
    if cfg.get("fc_norm", False):
        names.update(SPECFORGE_FC_NORM_SHAPES)
    return {
        n: tuple(int(eval(s, {}, dict(d))) for s in sym) for n, sym in names.items()
    }


def _llama_config(cfg: Dict[str, Any]) -> LlamaConfig:
    d = _dims(cfg)
    kw = dict(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=d["H"],
        intermediate_size=d["I"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        vocab_size=d["V"],
        draft_vocab_size=d["Vd"],
        target_hidden_size=d["Ht"],
        num_hidden_layers=1,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        hidden_act=cfg.get("hidden_act", "silu"),
        pretraining_tp=1,
        tie_word_embeddings=False,
        pad_token_id=cfg.get("pad_token_id", None),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=(
            dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") is not None else None
        ),
    )
    if cfg.get("fc_norm", False):
        kw["fc_norm"] = True
    if "norm_output" in cfg:
        kw["norm_output"] = bool(cfg["norm_output"])
    return LlamaConfig(**kw)


def build_draft(
    weights: Dict[str, torch.Tensor],
    cfg: Dict[str, Any],
    *,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLMEagle3:
    """Instantiate SpecForge's draft class and load ``weights`` (SpecForge names)."""
    config = _llama_config(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa")
    draft = draft.to(dtype=dtype)
    params = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    if missing or unexpected:
        raise KeyError(f"weights: missing={missing} unexpected={unexpected}")
    for n, t in params.items():
        if tuple(t.shape) != expected[n]:
            raise ValueError(f"{n}: shape {tuple(t.shape)} != {expected[n]}")
    d2t = torch.as_tensor(d2t).to(torch.int64)
    t2d = torch.as_tensor(t2d).to(torch.bool)
    for name, buf in (("d2t", d2t), ("t2d", t2d)):
        if name in weights and not torch.equal(
            torch.as_tensor(weights[name]).to(buf.dtype), buf
        ):
            raise ValueError(f"weights[{name!r}] disagrees with the {name} argument")
    sd = {n: t.detach().to(dtype) for n, t in params.items()}
    sd["d2t"] = d2t
    sd["t2d"] = t2d
    result = draft.load_state_dict(sd, strict=True)
    if result.missing_keys or result.unexpected_keys:  # pragma: no cover
        raise KeyError(str(result))
    if cfg.get("freeze_embedding", True):
        draft.freeze_embedding()
    return draft


def specforge_ttt(
    weights: Dict[str, torch.Tensor],
    cfg: Dict[str, Any],
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden: torch.Tensor,
    target_logits: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    ttt_length: int,
    ploss_decay: float = 0.8,
    backward: bool = True,
) -> Dict[str, Any]:
    """Run SpecForge 0.2.0's EAGLE-3 TTT training forward (+ backward) on CPU.

    See the module docstring for argument conventions (all unshifted) and the
    returned dict. fp32 only: SpecForge's mask helper builds its causal mask
    in the default dtype (specforge/modeling/_mask_utils.py:39), so fp64 fails.
    """
    dtype = torch.float32
    if not _interpreted():
        raise RuntimeError(
            "Triton is not in interpreter mode: set TRITON_INTERPRET=1 before "
            "anything imports triton (torch.use_deterministic_algorithms and "
            "torch._inductor import it), e.g. first thing in conftest.py"
        )
    if ttt_length < 1:
        raise ValueError("ttt_length must be >= 1")
    draft = build_draft(weights, cfg, d2t=d2t, t2d=t2d, dtype=dtype)
    model = OnlineEagle3Model(
        draft_model=draft, length=int(ttt_length), attention_backend="sdpa"
    )
    model.train()

    # What SpecForge's pipeline does before forward (TargetHead.preprocess,
    # modeling/target/target_head.py:103-108, called at
    # training/strategies/base.py:116). Clone: nothing of the caller is aliased.
    ids_s = _sf_padding(input_ids.detach().clone().long(), left=False)
    tgt_s = _sf_padding(target_logits.detach().clone().to(dtype), left=False)
    lm_s = loss_mask.detach().clone()[..., None]
    am = attention_mask.detach().clone()
    hs = aux_hidden.detach().clone().to(dtype)

    # Record per-step logits / pre-norm outputs (instance attributes shadow
    # the bound methods; SpecForge code itself is untouched).
    rec_logits, rec_hidden = [], []
    cls = type(draft)

    def _compute_logits(h):
        out = cls.compute_logits(draft, h)
        rec_logits.append(out.detach().clone())
        return out

    def _backbone(*a, **k):
        out = cls.backbone(draft, *a, **k)
        rec_hidden.append(out.detach().clone())
        return out

    draft.compute_logits = _compute_logits
    draft.backbone = _backbone

    with torch._dynamo.config.patch(disable=True):
        (
            plosses,
            acceptance_rates,
            acces,
            acc_corrects,
            acc_denoms,
            _metric_losses,
            _metric_loss_denoms,
        ) = model(
            input_ids=ids_s,
            attention_mask=am,
            loss_mask=lm_s,
            target=tgt_s,
            hidden_states=hs,
        )
        weights_j = [ploss_decay**j for j in range(len(plosses))]
        objective = sum(w * p for w, p in zip(weights_j, plosses))
        grads: Dict[str, Optional[torch.Tensor]] = {}
        if backward:
            draft.zero_grad(set_to_none=True)
            objective.backward()
            grads = {
                n: (p.grad.detach().clone() if p.grad is not None else None)
                for n, p in draft.named_parameters()
                if p.requires_grad
            }

    del draft.compute_logits
    del draft.backbone
    return {
        "plosses": plosses,
        "acces": acces,
        "acceptance_rates": acceptance_rates,
        "acc_corrects": acc_corrects,
        "acc_denoms": acc_denoms,
        "objective": objective,
        "grads": grads,
        "logits": rec_logits,
        "hidden": rec_hidden,
        "shifted": {
            "input_ids": ids_s,
            "target": tgt_s,
            "loss_mask": lm_s,
            "attention_mask": am,
            "hidden_states": hs,
        },
        "model": model,
        "draft": draft,
    }
