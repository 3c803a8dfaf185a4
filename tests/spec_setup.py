"""Shared test helpers of speculative decoding (``eagle3fn.evaluation``): tiny fp64 Llama
targets built from config, drafts for them, ``model.generate``'s greedy continuation,
a target and draft built to agree often, and the batched tests' prompts and fixtures
(``target``, ``references``: import them into a test module to use them)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3fn.draft import DraftConfig, init_params
from eagle3fn.io.target import load_target
from eagle3fn.vocab import build_vocab_map

V, H, VD = 128, 32, 48
AUX = (1, 3, 4)
PROMPTS = ([5], [17, 3, 99, 42], [7, 7, 1, 64, 120, 33, 2, 9, 88, 15, 61], [44, 12])
"""The batched tests' prompts: lengths 1 to 11 (left padding), decoded together."""
NEW = 14
"""New tokens per prompt in the batched tests."""


def make_target(vocab=V, layers=8, aux=AUX, seed=0, constant=False):
    """Tiny Llama in fp64 (no argmax near-ties between cached and uncached forwards).
    ``constant``: final norm weight 0, so every logit is 0 and the greedy token is 0."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=None, pad_token_id=0))
    if constant:
        torch.nn.init.zeros_(model.model.norm.weight)
    return load_target(model, aux_layer_ids=aux, dtype=torch.float64)


def make_draft(target, vd=VD, seed=0, dtype=torch.float32, counts=None, zero_norm=False):
    """A draft for ``target`` (``Vd = vd``, d2t from random or given token ``counts``), its
    weights perturbed past the init scale; ``zero_norm``: its logits all 0.
    Returns ``(params, cfg, d2t)``."""
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_heads=4, num_kv_heads=2,
                      vocab_size=target.vocab_size, draft_vocab_size=vd, target_hidden_size=H)
    g = torch.Generator().manual_seed(seed)
    if counts is None:
        counts = torch.randint(0, 100, (target.vocab_size,), generator=g)
    d2t, _ = build_vocab_map(counts, vd)
    params = init_params(cfg, embed_tokens=target.embed_tokens.float(), dtype=dtype, seed=seed)
    with torch.no_grad():  # larger than the 0.02 init so every path of the layer matters
        for name, p in params.items():
            if name != "embed_tokens.weight":
                scale = 0.3 if "norm" in name else 0.15
                p.add_(torch.randn(p.shape, generator=g, dtype=dtype) * scale)
        if zero_norm:
            params["norm.weight"].zero_()  # logits all 0: the draft's argmax is draft id 0
    return params, cfg, d2t


def greedy(target, prompt, n):
    """``model.generate``'s greedy ``n`` new tokens after ``prompt`` (a list of ids)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def agreeing_pair(dtype=torch.float64, device="cpu", vocab=V, hidden=32, layers=4, seed=0):
    """A tiny Llama target and a real draft that often proposes what it will say.

    Target: its head is its embedding plus noise (the greedy token tends to repeat the
    current one, now and then moving on), its layers' outputs scaled up (the context
    matters), its last layer a no-op, so the aux of layer ``layers - 2`` is its final
    pre-norm hidden state. Draft (``Vd = V``): ``fc`` picks that aux, attention and MLP
    add nothing, its norm and head are the target's: each step proposes the token the
    target chose last, accepted as long as the target repeats it. Returns
    ``(target, params, cfg, d2t)``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight + 0.5 * torch.randn_like(model.lm_head.weight))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(2.0)
            layer.mlp.down_proj.weight.mul_(2.0)
        model.model.layers[-1].self_attn.o_proj.weight.zero_()
        model.model.layers[-1].mlp.down_proj.weight.zero_()
    target = load_target(model, aux_layer_ids=(0, 1, layers - 2), dtype=dtype, device=device)
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=64, num_heads=4, num_kv_heads=2, vocab_size=vocab,
                      draft_vocab_size=vocab, target_hidden_size=hidden, rms_norm_eps=model.config.rms_norm_eps)
    params = init_params(cfg, embed_tokens=target.embed_tokens, dtype=dtype, device=device, seed=seed)
    with torch.no_grad():
        params["fc.weight"].zero_()
        params["fc.weight"][:, 2 * hidden:] = torch.eye(hidden, dtype=dtype, device=device)
        params["midlayer.self_attn.o_proj.weight"].zero_()
        params["midlayer.mlp.down_proj.weight"].zero_()
        params["norm.weight"].copy_(target.model.model.norm.weight)
        params["lm_head.weight"].copy_(target.lm_head.weight)
    return target, params, cfg, torch.zeros(vocab, dtype=torch.long, device=device)


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def references(target):
    """Each of ``PROMPTS``' greedy continuation (``model.generate``), past NEW for oracles."""
    return [greedy(target, p, NEW + 8) for p in PROMPTS]
