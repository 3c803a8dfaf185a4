"""External parity: SpecForge 0.2.0's own OnlineEagle3Model (sdpa) vs eagle3fn's TTT.

Same weights (the parameter names are SpecForge's), same batch; per-step losses,
accuracies, acceptance and every parameter gradient agree in fp32 (1e-5). See
docs/explanation/what-differs-from-specforge.md for what differs on purpose (nothing exercised here).
"""

import dataclasses

import pytest
import torch

from eagle3fn.align import supervised_mask
from eagle3fn.draft import DraftConfig, RopeConfig, init_params
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, ttt
from eagle3fn.vocab import build_vocab_map

pytest.importorskip("specforge")
specforge_oracle = pytest.importorskip("specforge_oracle")

B, S, K = 2, 12, 3
ROPES = {
    "default": (RopeConfig(theta=10000.0), None),
    "llama3": (RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=4),
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
    "yarn": (RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0,
                        original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                        mscale=1.0, mscale_all_dim=0.0),
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}),
}


def setup(rope_name, fc_norm, seed=0):
    rope, scaling = ROPES[rope_name]
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                      head_dim=8, vocab_size=96, draft_vocab_size=40, target_hidden_size=24,
                      rope=rope, fc_norm=fc_norm)
    sf_cfg = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=96, draft_vocab_size=40,
                  rms_norm_eps=cfg.rms_norm_eps, rope_theta=rope.theta, rope_scaling=scaling,
                  max_position_embeddings=64, target_hidden_size=24, fc_norm=fc_norm)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (96,), generator=g), 40)
    params = init_params(cfg, seed=seed)
    with torch.no_grad():
        for name, p in params.items():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.15))
        # Draft id 0 wins most rows; the target agrees on about half the positions,
        # so the accuracies are neither 0 nor 1.
        params["lm_head.weight"][0] += 2.0 * params["norm.weight"].sign()
    attention = torch.ones(B, S, dtype=torch.long)
    attention[1, 8:] = 0
    loss_mask = (torch.rand(B, S, generator=g) < 0.6) & attention.bool()
    loss_mask[torch.arange(B), attention.sum(1) - 1] = False  # SPEC 1: never t = L-1
    head = torch.randn(96, 24, generator=g)
    head[t2d] *= 1.5
    features = Features(
        input_ids=torch.randint(0, 96, (B, S), generator=g) * attention,
        aux=torch.randn(B, S, 72, generator=g),
        attention_mask=attention,
        target_logits=torch.randn(B, S, 24, generator=g) @ head.T
        + 30.0 * (torch.rand(B, S, 1, generator=g) < 0.5) * torch.nn.functional.one_hot(
            d2t[0], 96),
    )
    return cfg, sf_cfg, params, features, loss_mask, d2t, t2d


def ours(cfg, params, features, loss_mask, d2t, t2d, trim="loss", rowmap=None):
    rm = rowmap or build_rowmap(supervised_mask(loss_mask, features.attention_mask), K)
    ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    out = ttt(ps, features, rm, TTTConfig(draft=cfg, ttt_length=K, trim=trim, attention="eager"),
              d2t=d2t, t2d=t2d)
    out.objective.backward()
    return out, {n: p.grad for n, p in ps.items() if p.requires_grad}


def theirs(sf_cfg, params, features, loss_mask, d2t, t2d):
    return specforge_oracle.specforge_ttt(
        {n: p.detach() for n, p in params.items()}, sf_cfg, input_ids=features.input_ids,
        attention_mask=features.attention_mask, loss_mask=loss_mask.long(), aux_hidden=features.aux,
        target_logits=features.target_logits, d2t=d2t, t2d=t2d, ttt_length=K)


def assert_parity(got, sf):
    out, grads = got
    assert 0 < out.acc.min() and out.acc.max() < 1, out.acc  # the metric is exercised
    torch.testing.assert_close(out.kl_loss.detach(), torch.stack([p.detach() for p in sf["plosses"]]).float(),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.acc, torch.stack([torch.as_tensor(a) for a in sf["acces"]]).float(),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.accept, torch.stack([torch.as_tensor(a) for a in sf["acceptance_rates"]]).float(),
                               rtol=1e-5, atol=1e-7)
    assert set(grads) == set(sf["grads"])
    for name, g in grads.items():
        err = ((g - sf["grads"][name]).abs().max() / sf["grads"][name].abs().max()).item()
        assert err <= 1e-5, f"{name}: {err:.3g}"


@pytest.mark.parametrize("trim", ["loss", "none"])
@pytest.mark.parametrize("rope_name,fc_norm", [("default", False), ("llama3", True), ("yarn", False)])
def test_matches_specforge(rope_name, fc_norm, trim):
    cfg, sf_cfg, params, features, loss_mask, d2t, t2d = setup(rope_name, fc_norm)
    sf = theirs(sf_cfg, params, features, loss_mask, d2t, t2d)
    assert_parity(ours(cfg, params, features, loss_mask, d2t, t2d, trim=trim), sf)


def test_negative_control_unshifted_rows():
    cfg, sf_cfg, params, features, loss_mask, d2t, t2d = setup("default", False)
    sf = theirs(sf_cfg, params, features, loss_mask, d2t, t2d)
    rm = build_rowmap(supervised_mask(loss_mask, features.attention_mask), K)
    bad = dataclasses.replace(rm, rows=(rm.rows[0],) * K, table_rows=(rm.table_rows[0],) * K)
    with pytest.raises(AssertionError):
        assert_parity(ours(cfg, params, features, loss_mask, d2t, t2d, rowmap=bad), sf)
