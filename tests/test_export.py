"""Export: the directory round-trips, carries no embedding, and SpecForge 0.2.0's own
draft class built from the exported config.json loads model.safetensors and
reproduces eagle3fn's per-step draft logits (fp32, 1e-5)."""

import dataclasses
import json
import pathlib
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3fn.draft import DraftConfig, Eagle3Draft, RopeConfig, init_params
from eagle3fn.io.export import (
    CONFIG,
    WEIGHTS,
    draft_config_from_dict,
    export_draft,
    load_export,
    rope_scaling_dict,
)
from eagle3fn.io.paths import MARKER
from eagle3fn.shapes import Features
from eagle3fn.unrolled import backbone
from eagle3fn.vocab import build_vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: 2 threads crawl on a busy CPU

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, S, K = 2, 10, 3
AUX = (1, 5, 8)
TARGET = {"hidden_size": 32, "vocab_size": 96, "num_hidden_layers": 12,
          "max_position_embeddings": 64}
ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=5000.0, rope_type="linear", factor=2.0),
    "llama3": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=4),
    "yarn": RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0,
                       original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                       mscale=1.0, mscale_all_dim=0.0),
}


def make_draft(rope_name="default", fc_norm=False, norm_output=True, seed=0, hidden=32,
               target_hidden=32, kv_heads=2, draft_vocab=40):
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=64, num_heads=4, num_kv_heads=kv_heads,
                      head_dim=8, vocab_size=96, draft_vocab_size=draft_vocab,
                      target_hidden_size=target_hidden,
                      rope=ROPES[rope_name], fc_norm=fc_norm, norm_output=norm_output)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (96,), generator=g), draft_vocab)
    target_embed = torch.randn(96, hidden, generator=g)
    params = init_params(cfg, embed_tokens=target_embed, seed=seed)
    with torch.no_grad():  # move norms off 1 and weights off their init scale
        for name, p in params.items():
            if name != "embed_tokens.weight":
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.15))
    params = {k: v.detach() for k, v in params.items()}
    return cfg, params, d2t, t2d, target_embed


def make_features(target_hidden=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    attention = torch.ones(B, S, dtype=torch.long)
    attention[1, 7:] = 0
    return Features(input_ids=torch.randint(0, 96, (B, S), generator=g) * attention,
                    aux=torch.randn(B, S, 3 * target_hidden, generator=g), attention_mask=attention)


def eagle3fn_logits(cfg, params, features):
    """k per-step draft logits ``[B, S, Vd]`` from eagle3fn's TTT backbone and head."""
    draft = Eagle3Draft(cfg)
    draft.load_state_dict(params, strict=True)
    with torch.no_grad():
        outs = backbone(draft, features, num_rows=S, ttt_length=K, attention="eager")
        return [draft.head(out) for out in outs]


def specforge_draft(export_dir, target_embed):
    """SpecForge 0.2.0's LlamaForCausalLMEagle3 built from the exported config.json
    (LlamaConfig with its extra fields) with model.safetensors loaded strictly; the
    embedding, which the export leaves out when H == Ht, is the target's."""
    pytest.importorskip("specforge")
    specforge_oracle = pytest.importorskip("specforge_oracle")  # sets TRITON_INTERPRET
    from transformers import LlamaConfig

    config = LlamaConfig(**json.loads((export_dir / CONFIG).read_text()))
    draft = specforge_oracle.LlamaForCausalLMEagle3(config, attention_backend="sdpa").float()
    with safe_open(str(export_dir / WEIGHTS), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    if config.hidden_size == config.target_hidden_size:
        assert "embed_tokens.weight" not in state
        state["embed_tokens.weight"] = target_embed
    result = draft.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return draft.eval()


def specforge_logits(draft, features):
    """k per-step logits from SpecForge's draft methods, driven as
    OnlineEagle3Model.forward drives them with attention_backend="sdpa"
    (specforge/algorithms/eagle3/model.py: project, causal+padding mask, sdpa
    cache_hidden, ids shifted left once per step), minus the loss."""
    from specforge.utils import padding

    ids = padding(features.input_ids.clone(), left=False)  # ids'[t] = x_{t+1}
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        hidden = draft.project_hidden_states(features.aux)
        mask = draft.prepare_decoder_attention_mask(
            attention_mask=features.attention_mask, hidden_states=hidden, batch_size=B,
            seq_length=S, past_key_values_length=0)
        positions = torch.arange(S).unsqueeze(0)
        cache_hidden, logits = [[], []], []
        for j in range(K):
            emb = draft.embed_input_ids(ids).to(hidden.dtype)
            hidden = draft.backbone(input_embeds=emb, hidden_states=hidden,
                                    cache_hidden=cache_hidden, attention_mask=mask,
                                    position_ids=positions)
            logits.append(draft.compute_logits(hidden))
            ids = padding(ids, left=False)
    return logits


def max_error(ours, theirs):
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs))


# --- round trip ------------------------------------------------------------------------

@pytest.mark.parametrize("rope_name", list(ROPES))
@pytest.mark.parametrize("fc_norm", [False, True])
def test_round_trip_fp32(tmp_path, rope_name, fc_norm):
    cfg, params, d2t, t2d, _ = make_draft(rope_name, fc_norm)
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX,
                 target_config=TARGET, dtype=torch.float32)
    loaded, cfg2, d2t2, t2d2, aux2 = load_export(tmp_path)
    assert cfg2 == dataclasses.replace(cfg, head_dim=cfg.d, target_hidden_size=cfg.ht)
    assert cfg2.rope == cfg.rope
    assert aux2 == AUX
    assert torch.equal(d2t2, d2t) and d2t2.dtype == torch.int64
    assert torch.equal(t2d2, t2d) and t2d2.dtype == torch.bool
    assert set(loaded) == set(params) - {"embed_tokens.weight"}
    for name, t in loaded.items():
        assert torch.equal(t, params[name]), name


def test_round_trip_bf16_default(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft("llama3")
    out = export_draft(tmp_path / "draft", params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    assert out == tmp_path / "draft"
    loaded, cfg2, _, _, _ = load_export(out)
    assert cfg2.rope == cfg.rope
    for name, t in loaded.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, params[name].to(torch.bfloat16)), name


def test_rope_scaling_dicts_round_trip():
    for rope in ROPES.values():
        assert RopeConfig.from_hf(rope.theta, rope_scaling_dict(rope)) == rope
    assert rope_scaling_dict(ROPES["default"]) is None
    assert rope_scaling_dict(ROPES["llama3"]) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 4}
    assert rope_scaling_dict(ROPES["yarn"]) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    # gpt-oss style yarn (truncate off, explicit attention factor) and Phi-3 longrope keep
    # every field through config.json (they were dropped: the reload differed).
    import json

    for rope in (RopeConfig(theta=150000.0, rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                            truncate=False, attention_factor=1.3),
                 RopeConfig(theta=10000.0, rope_type="longrope", factor=32.0, original_max_position_embeddings=4096,
                            short_factor=(1.0, 1.5), long_factor=(2.0, 3.0))):
        written = json.loads(json.dumps(rope_scaling_dict(rope)))
        assert RopeConfig.from_hf(rope.theta, written) == rope, written
        changed = {**written, "attention_factor": 1.0}  # control: a dropped field is seen
        assert RopeConfig.from_hf(rope.theta, changed) != rope


# --- file layout and config ------------------------------------------------------------

def test_weights_file_has_no_embedding(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft()
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    with safe_open(str(tmp_path / WEIGHTS), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {k: f.get_tensor(k).dtype for k in keys}
        assert f.metadata() == {"format": "pt"}
    assert not any("embed" in k for k in keys)
    assert keys == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"midlayer.{m}.weight" for m in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm",
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
    assert dtypes.pop("d2t") == torch.int64 and dtypes.pop("t2d") == torch.bool
    assert set(dtypes.values()) == {torch.bfloat16}
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, CONFIG, WEIGHTS]  # no temp files


def test_config_fields(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft("yarn")
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX,
                 target_config={"text_config": TARGET, "architectures": ["SomeVLM"]})
    config = json.loads((tmp_path / CONFIG).read_text())
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1,
        "vocab_size": 96, "draft_vocab_size": 40, "target_hidden_size": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": rope_scaling_dict(ROPES["yarn"]),
        "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False,
        "pretraining_tp": 1, "torch_dtype": "bfloat16", "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8],
                         "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [2, 6, 9],
    }
    assert draft_config_from_dict(config).rope == ROPES["yarn"]


def test_config_defaults_without_target_config(tmp_path):
    for rope_name, positions in (("default", 2048), ("llama3", 32), ("yarn", 64)):
        cfg, params, d2t, t2d, _ = make_draft(rope_name)
        out = export_draft(tmp_path / rope_name, params, cfg, d2t=d2t, t2d=t2d,
                           aux_layer_ids=AUX)
        config = json.loads((out / CONFIG).read_text())
        assert config["max_position_embeddings"] == positions
        assert (config["rope_scaling"] is None) == (rope_name == "default")
        assert "fc_norm" not in config and "norm_output" not in config


def test_fc_norm_written_norm_output_refused(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft(fc_norm=True)
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    config = json.loads((tmp_path / CONFIG).read_text())
    assert config["fc_norm"] is True and "norm_output" not in config
    with safe_open(str(tmp_path / WEIGHTS), framework="pt") as f:
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(f.keys())
    _, cfg2, _, _, _ = load_export(tmp_path)
    assert cfg2.fc_norm and cfg2.norm_output
    cfg, params, d2t, t2d, _ = make_draft(norm_output=False)
    with pytest.raises(ValueError, match="norm_output=False"):
        export_draft(tmp_path / "off", params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    assert not (tmp_path / "off").exists()


def test_full_draft_vocab_writes_no_map(tmp_path):
    """Vd == V: no d2t / t2d (vLLM has no parameter for d2t then); load_export returns
    the identity map. Vd < V without them is an error naming the tensor."""
    cfg, params, d2t, t2d, _ = make_draft(draft_vocab=96)
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    with safe_open(str(tmp_path / WEIGHTS), framework="pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())
    _, _, d2t2, t2d2, _ = load_export(tmp_path)
    assert torch.equal(d2t2, torch.zeros(96, dtype=torch.int64)) and bool(t2d2.all())
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)


def test_aux_ids_not_starting_at_one_warn(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft()
    with pytest.warns(UserWarning, match="PR #25454"):
        export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=(0, 4, 9))
    assert load_export(tmp_path)[4] == (0, 4, 9)


def test_draft_of_another_width_exports_its_embedding(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft(target_hidden=24)
    assert cfg.hidden_size != cfg.ht
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX,
                 dtype=torch.float32)
    loaded, *_ = load_export(tmp_path)
    assert torch.equal(loaded["embed_tokens.weight"], params["embed_tokens.weight"])
    params.pop("embed_tokens.weight")
    with pytest.raises(ValueError, match="exports its own embed_tokens"):
        export_draft(tmp_path / "again", params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)


# --- SpecForge loads the export and reproduces our logits ------------------------------

@pytest.mark.parametrize("rope_name,fc_norm,norm_output,target_hidden", [
    ("default", False, True, 32), ("llama3", False, True, 32), ("yarn", False, True, 32),
    ("linear", True, True, 32), ("llama3", False, True, 24),
])
def test_specforge_loads_export_and_matches_logits(tmp_path, rope_name, fc_norm, norm_output,
                                                   target_hidden):
    cfg, params, d2t, t2d, target_embed = make_draft(rope_name, fc_norm, norm_output,
                                                     target_hidden=target_hidden)
    features = make_features(target_hidden)
    target = {**TARGET, "hidden_size": target_hidden}
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX,
                 target_config=target, dtype=torch.float32)
    draft = specforge_draft(tmp_path, target_embed)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    theirs = specforge_logits(draft, features)
    ours = eagle3fn_logits(cfg, params, features)
    assert [t.shape for t in theirs] == [(B, S, 40)] * K
    assert max_error(ours, theirs) < 1e-5
    # The loaded export drives eagle3fn the same way.
    loaded, cfg2, *_ = load_export(tmp_path)
    again = eagle3fn_logits(cfg2, {"embed_tokens.weight": target_embed, **loaded}, features)
    assert max_error(again, ours) == 0.0


@pytest.mark.parametrize("corrupt", ["swap_qk", "shift_lm_head", "drop_rope_scaling"])
def test_negative_control_corrupted_export_fails(tmp_path, corrupt):
    """Swapping the q and k projections (same shape with kv_heads = heads), shifting
    the lm_head rows by one draft id, or dropping rope_scaling from config.json breaks
    the comparison by far more than 1e-5."""
    cfg, params, d2t, t2d, target_embed = make_draft("llama3", kv_heads=4)
    features = make_features()
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX,
                 dtype=torch.float32)
    with safe_open(str(tmp_path / WEIGHTS), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    if corrupt == "swap_qk":
        q, k = "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight"
        state[q], state[k] = state[k], state[q]
    elif corrupt == "shift_lm_head":
        state["lm_head.weight"] = state["lm_head.weight"].roll(1, dims=0)
    else:
        _edit_config(tmp_path, rope_scaling=None)
    save_file(state, str(tmp_path / WEIGHTS))
    theirs = specforge_logits(specforge_draft(tmp_path, target_embed), features)
    assert max_error(eagle3fn_logits(cfg, params, features), theirs) > 1e-3


# --- errors ----------------------------------------------------------------------------

@pytest.fixture
def exported(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft()
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    return tmp_path


def test_load_missing_directory_or_file(tmp_path, exported):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_export(tmp_path / "nowhere")
    (exported / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors.*export_draft"):
        load_export(exported)


def _edit_config(path, **changes):
    config = json.loads((path / CONFIG).read_text())
    config.update(changes)
    (path / CONFIG).write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"vocab_size": 97}, "t2d covers 96 target ids but the target vocab is 97"),
    ({"draft_vocab_size": 41}, "d2t has 40 entries but draft_vocab_size is 41"),
    ({"intermediate_size": 48}, r"'midlayer\.mlp\.\w+\.weight' has shape .* implies"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 5, 8]}, "must differ by exactly 1"),
    ({"eagle_config": {}}, "eagle_aux_hidden_state_layer_ids is missing"),
    ({"num_hidden_layers": 2}, "one layer"),
    ({"fc_norm": True}, r"missing \['fc_norm.0.weight'"),
    ({"hidden_size": None}, "malformed field"),
])
def test_load_mismatched_config(exported, changes, message):
    _edit_config(exported, **changes)
    with pytest.raises(ValueError, match=message):
        load_export(exported)


def test_load_mismatched_weights(exported):
    with safe_open(str(exported / WEIGHTS), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: v for k, v in state.items() if k != "norm.weight"}, str(exported / WEIGHTS))
    with pytest.raises(ValueError, match=r"model.safetensors.*missing \['norm.weight'\]"):
        load_export(exported)
    save_file({**state, "extra.weight": torch.zeros(1)}, str(exported / WEIGHTS))
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        load_export(exported)
    save_file({k: v for k, v in state.items() if k != "d2t"}, str(exported / WEIGHTS))
    with pytest.raises(ValueError, match="'d2t' is missing"):
        load_export(exported)
    (exported / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_export(exported)


def test_export_rejects_bad_inputs(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft()
    kw = dict(d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        export_draft(tmp_path, {k: v for k, v in params.items() if k != "norm.weight"}, cfg, **kw)
    with pytest.raises(ValueError, match=r"unexpected \['bogus'\]"):
        export_draft(tmp_path, {**params, "bogus": torch.zeros(1)}, cfg, **kw)
    with pytest.raises(ValueError, match=r"'lm_head.weight'\] has shape \(39, 32\)"):
        export_draft(tmp_path, {**params, "lm_head.weight": params["lm_head.weight"][:39]},
                     cfg, **kw)
    with pytest.raises(ValueError, match="d2t and t2d disagree|t2d selects"):
        export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d.roll(1), aux_layer_ids=AUX)
    for ids in [(5, 1, 8), (1, 5), (-1, 5, 8)]:
        with pytest.raises(ValueError, match="three strictly increasing"):
            export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=ids)
    with pytest.raises(ValueError, match=r"in \[0, 10\] for a 12-layer target"):
        export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=(1, 5, 11),
                     target_config=TARGET)
    with pytest.raises(ValueError, match="target_config hidden_size=4096"):
        export_draft(tmp_path, params, cfg, target_config={**TARGET, "hidden_size": 4096}, **kw)
    with pytest.raises(ValueError, match="target_config vocab_size=100"):
        export_draft(tmp_path, params, cfg, target_config={**TARGET, "vocab_size": 100}, **kw)
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_draft(tmp_path, params, cfg, dtype=torch.float64, **kw)
    assert not any(tmp_path.iterdir())  # nothing written by a rejected export


def test_docs_example_runs():
    """docs/reference/what-an-export-contains.md's python blocks run (docs/tutorials pages are run by test_docs)."""
    text = (ROOT / "docs" / "reference" / "what-an-export-contains.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"what-an-export-contains.md[block {i}]", "exec"), namespace)
