"""Bring your SpecForge / EAGLE-3 checkpoint (io.import_draft): a draft built, randomised
and saved by SpecForge 0.2.0's own code imports into eagle3fn names whose per-step logits
(eagle3fn's TTT backbone and head) equal SpecForge's own draft forward (fp32, 1e-5), with
swapped-tensor and ignored-RoPE controls; the EAGLE-3 release layout reads the same;
``eagle3fn export`` output round-trips; ``as_run`` gives ``load_run``'s dict; foreign
directories fail in one line naming the file."""

import dataclasses
import json
import shutil

import pytest
import torch

pytest.importorskip("specforge")
specforge_oracle = pytest.importorskip("specforge_oracle")  # sets TRITON_INTERPRET first

from test_export import eagle3fn_logits, make_draft, make_features, max_error, specforge_logits  # noqa: E402

from eagle3fn.io.export import export_draft, load_export  # noqa: E402
from eagle3fn.io.import_draft import as_run, load_draft  # noqa: E402
from eagle3fn.io.paths import MARKER  # noqa: E402
from eagle3fn.rope import RopeConfig  # noqa: E402
from eagle3fn.vocab import build_vocab_map  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 12  # the target's depth: default aux ids (1, 5, 8)
CASES = {
    # name: (target_hidden, fc_norm, rope_parameters)
    "llama3": (32, False, {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
    "narrow-fc-norm": (24, True, {"rope_type": "default", "rope_theta": 5000.0}),
}


def specforge_save(out, case, seed=0):
    """SpecForge's LlamaForCausalLMEagle3 of a tiny config, weights randomised, its vocab
    buffers set, saved with its own ``save_pretrained``; returns the draft (eval, fp32)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    ht, fc_norm, rope = CASES[case]
    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96,
                         draft_vocab_size=40, target_hidden_size=ht, num_hidden_layers=1,
                         max_position_embeddings=64, tie_word_embeddings=False, rope_parameters=rope,
                         **({"fc_norm": True} if fc_norm else {}))
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").float()
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (96,), generator=g), 40)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    draft.save_pretrained(out)
    return draft.eval()


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "specforge-run-step40"
    return request.param, out, specforge_save(out, request.param)


def test_logits_equal_specforge(saved):
    case, out, draft = saved
    notes = []
    params, cfg, d2t, t2d, ids = load_draft(out, num_target_layers=LAYERS, log=notes.append)
    assert ids == (1, 5, 8) and len(notes) == 1 and "records no aux layer ids" in notes[0]
    assert torch.equal(d2t, draft.d2t) and torch.equal(t2d, draft.t2d)
    assert cfg.rope.theta == 5000.0 and cfg.ht == CASES[case][0] and cfg.fc_norm == CASES[case][1]
    features = make_features(target_hidden=cfg.ht)
    ours = eagle3fn_logits(cfg, params, features)
    theirs = specforge_logits(draft, features)
    err = max_error(ours, theirs)
    assert err <= 1e-5, err
    # (SpecForge's own AutoDraftModel.from_pretrained of the directory is no oracle here:
    # under transformers 5 it leaves the non-persistent RoPE buffers uninitialised.)

    # controls: two same-shape tensors swapped, and the RoPE base left at its default
    swapped = dict(params)
    swapped["midlayer.mlp.gate_proj.weight"], swapped["midlayer.mlp.up_proj.weight"] = (
        params["midlayer.mlp.up_proj.weight"], params["midlayer.mlp.gate_proj.weight"])
    assert max_error(eagle3fn_logits(cfg, swapped, features), theirs) > 1e-3
    default_base = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, theta=10000.0))
    assert max_error(eagle3fn_logits(default_base, params, features), theirs) > 1e-3


def test_eagle3_release_layout_reads_the_same(saved, tmp_path):
    """SafeAILab's layout: pytorch_model.bin without the embedding, architectures
    LlamaForCausalLM, rope_theta / rope_scaling at the top level."""
    _, out, _ = saved
    params, cfg, d2t, t2d, _ = load_draft(out, num_target_layers=LAYERS, log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(architectures=["LlamaForCausalLM"], rope_theta=rope.pop("rope_theta"),
                  rope_scaling=rope if rope["rope_type"] != "default" else None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v for k, v in params.items() if k != "embed_tokens.weight" or cfg.hidden_size != cfg.ht}
    torch.save({**state, "d2t": d2t, "t2d": t2d}, tmp_path / "pytorch_model.bin")
    params2, cfg2, d2t2, t2d2, ids = load_draft(tmp_path, aux_layer_ids=(0, 2, 4), log=lambda _: None)
    assert cfg2 == cfg and ids == (0, 2, 4)
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)
    assert set(params2) == set(state) and all(torch.equal(params2[k], state[k]) for k in state)


def test_export_round_trips(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft("llama3", fc_norm=True)
    export_draft(tmp_path / "x", params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=(1, 5, 8),
                 target_config={"hidden_size": 32, "vocab_size": 96, "num_hidden_layers": LAYERS},
                 dtype=torch.float32)
    want = load_export(tmp_path / "x")
    got = load_draft(tmp_path / "x")
    (tmp_path / "x" / MARKER).unlink()  # a copy without the marker: the generic reader
    bare = load_draft(tmp_path / "x")
    for other in (got, bare):
        assert other[1] == want[1] and other[4] == want[4] == (1, 5, 8)
        assert torch.equal(other[2], d2t) and torch.equal(other[3], t2d)
        assert set(other[0]) == set(params) - {"embed_tokens.weight"}
        assert all(torch.equal(other[0][k], params[k]) for k in other[0])


def test_as_run_is_load_runs_dict(saved, tmp_path):
    from transformers import LlamaConfig

    case, out, draft = saved
    ht = CASES[case][0]
    LlamaConfig(hidden_size=ht, intermediate_size=64, num_attention_heads=4, num_hidden_layers=LAYERS,
                vocab_size=96).save_pretrained(tmp_path / "target")
    run = as_run(out, tmp_path / "target", log=lambda _: None)
    assert set(run) == {"params", "draft", "d2t", "t2d", "config", "aux_layer_ids", "step",
                        "holdout_prompts", "best"}
    assert run["step"] == 40 and run["aux_layer_ids"] == (1, 5, 8) and run["holdout_prompts"] == []
    assert run["config"] == {"model": str(tmp_path / "target"), "gguf_file": None, "seed": 0, "data": "",
                             "on_error": "raise"}
    assert "embed_tokens.weight" not in run["params"]
    for name, p in draft.named_parameters():
        if name != "embed_tokens.weight":
            assert run["params"][name].dtype == torch.float32 and torch.equal(run["params"][name], p), name
    LlamaConfig(hidden_size=ht + 8, intermediate_size=64, num_attention_heads=4, num_hidden_layers=LAYERS,
                vocab_size=96).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=f"hidden size {ht} .* has {ht + 8}; pass the target"):
        as_run(out, tmp_path / "other", log=lambda _: None)


def test_foreign_directories_fail_in_one_line(saved, tmp_path):
    from transformers import LlamaConfig

    _, out, _ = saved
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_draft(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json' not found: .* is not an EAGLE-3 draft"):
        load_draft(tmp_path / "empty")
    LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                vocab_size=96).save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="12 layers, not an EAGLE-3 draft .* the target's directory"):
        load_draft(tmp_path / "target")
    with pytest.raises(ValueError, match="records no aux layer ids .* pass aux_layer_ids"):
        load_draft(out)
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[1, 5, 11\] must be"):
        load_draft(out, aux_layer_ids=(1, 5, 11), num_target_layers=LAYERS)
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[3, 2, 1\] must be three strictly increasing"):
        load_draft(out, aux_layer_ids=(3, 2, 1))
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match="model.safetensors': tensor 'midlayer.mlp.down_proj.weight' has "
                                         r"shape \(32, 64\), config.json implies \(32, 48\)"):
        load_draft(bad, num_target_layers=LAYERS, log=lambda _: None)
    (bad / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 41}))
    with pytest.raises(ValueError, match="model.safetensors': d2t has 40 entries"):
        load_draft(bad, num_target_layers=LAYERS, log=lambda _: None)
    (bad / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="model.safetensors' is truncated"):
        load_draft(bad, num_target_layers=LAYERS, log=lambda _: None)


def test_rope_parameters_beside_rope_scaling():
    """A config with the older keys only keeps them (no rope_parameters)."""
    from eagle3fn.io.import_draft import _draft_config

    base = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=32, intermediate_size=64,
                num_attention_heads=4, vocab_size=96, draft_vocab_size=40, rms_norm_eps=1e-6)
    assert _draft_config({**base, "rope_theta": 123.0}).rope == RopeConfig(theta=123.0)
    assert _draft_config({**base, "norm_output": False}).norm_output is False
