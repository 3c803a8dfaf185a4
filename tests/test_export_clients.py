"""The serving clients' own code loads ``eagle3fn export`` and computes eagle3fn's draft.

* SGLang 0.5.23's ``LlamaForCausalLMEagle3`` (config through ``AutoConfig``, weights
  through its ``load_weights``, the target's embedding through ``set_embed``; only its
  paged attention replaced by the training-time-test pattern) gives the per-step draft
  logits of eagle3fn's draft loaded back with ``load_export``, fp32, within 1e-5.
* speculators 0.9.0's ``Eagle3DraftModel.from_pretrained`` loads ``--format
  speculators`` and its own TTT forward gives the same logits.
* vLLM 0.34.0's EAGLE-3 weight loading takes every tensor of the export, and its
  forward code (``combine_hidden_states``, ``LlamaModel`` / decoder layer / attention
  forwards, its RMSNorm, RoPE and MLP ops; the module tree and paged attention stood
  in for) gives the same logits.

Each variant's negative control is a broken export (weight, config field or vocab map)
that the same check catches. The clients run in one worker process
(``client_oracles.worker``): importing them patches transformers process-wide.
"""

import dataclasses
import importlib.util
import json
import sys

import client_oracles
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_export import (
    AUX,
    TARGET,
    B,
    K,
    S,
    eagle3fn_logits,
    make_draft,
    make_features,
    max_error,
)

from eagle3fn.io.export import (
    CONFIG,
    WEIGHTS,
    export_draft,
    export_speculators,
    load_export,
)

TOL = 1e-5
# variant -> make_draft arguments
VARIANTS = {
    "default": {},
    "llama3": {"rope_name": "llama3"},
    "yarn": {"rope_name": "yarn"},
    "fc_norm": {"fc_norm": True},
    "vocab_full": {"draft_vocab": 96},           # Vd == V: no d2t / t2d written
    "vocab_subset": {"draft_vocab": 40},         # Vd < V: d2t / t2d written
    "width": {"target_hidden": 24},              # H != Ht: the draft ships its embedding
}


def _export(tmp_path, variant):
    args = VARIANTS[variant]
    cfg, params, d2t, t2d, target_embed = make_draft(**args)
    target_hidden = args.get("target_hidden", 32)
    export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX,
                 target_config={**TARGET, "hidden_size": target_hidden}, dtype=torch.float32)
    return cfg, t2d, target_embed, make_features(target_hidden)


def _ours(export_dir, target_embed, features):
    """eagle3fn's draft as ``load_export`` reads the directory back."""
    loaded, cfg, d2t, t2d, _ = load_export(export_dir)
    params = {"embed_tokens.weight": target_embed, **loaded} if "embed_tokens.weight" not in loaded \
        else loaded
    return eagle3fn_logits(cfg, params, features), d2t, t2d


@pytest.fixture(scope="module")
def call():
    """``call(name, *args)``: ``client_oracles.<name>`` in the clients' worker process."""
    with client_oracles.worker() as run:
        yield run
    # The clients never ran in this process (their imports patch transformers).
    assert not {n.split(".")[0] for n in sys.modules} & set(client_oracles.CLIENTS)


def _sglang(call, export_dir, target_embed, features):
    """(per-step logits, hot_token_id) of SGLang's draft loaded from ``export_dir``."""
    client_oracles.require("sglang")
    return call("run_sglang", str(export_dir), target_embed, features.input_ids, features.aux,
                features.attention_mask, K)


def _edit(export_dir, *, config=None, tensors=None):
    """Rewrite the export: ``config`` keys set (None deletes), ``tensors`` edited."""
    if config:
        path = export_dir / CONFIG
        data = json.loads(path.read_text())
        for key, value in config.items():
            data.pop(key, None) if value is None else data.__setitem__(key, value)
        path.write_text(json.dumps(data))
    if tensors:
        with safe_open(str(export_dir / WEIGHTS), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        tensors(state)
        save_file(state, str(export_dir / WEIGHTS))


def _shift(name):
    def edit(state):
        state[name] = state[name].roll(1, dims=0)
    return edit


# The broken export each variant's comparison must catch.
CONTROLS = {
    "default": {"tensors": _shift("midlayer.mlp.down_proj.weight")},
    "llama3": {"config": {"rope_scaling": None}},
    "yarn": {"config": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                         "original_max_position_embeddings": 16}}},
    "fc_norm": {"config": {"fc_norm": None}},   # SGLang then skips the fc_norm weights
    "vocab_full": {"tensors": _shift("norm.weight")},
    "vocab_subset": {"tensors": _shift("lm_head.weight")},
    "width": {"tensors": lambda state: state.__setitem__(
        "embed_tokens.weight", torch.randn_like(state["embed_tokens.weight"]))},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sglang_computes_our_draft(call, tmp_path, variant):
    cfg, t2d, target_embed, features = _export(tmp_path, variant)
    with safe_open(str(tmp_path / WEIGHTS), framework="pt") as f:
        assert ("d2t" in f.keys()) == ("t2d" in f.keys()) == (cfg.draft_vocab_size < 96)
    ours, _, t2d_back = _ours(tmp_path, target_embed, features)
    theirs, hot = _sglang(call, tmp_path, target_embed, features)
    assert [t.shape for t in theirs] == [(B, S, cfg.draft_vocab_size)] * K
    assert max_error(ours, theirs) <= TOL
    # SGLang's draft-to-target ids are the target ids t2d selects, in order (or none).
    if cfg.draft_vocab_size < 96:
        assert torch.equal(hot, t2d.nonzero().flatten())
    else:
        assert hot is None and torch.equal(t2d_back, torch.ones(96, dtype=torch.bool))
    # Negative control: the same comparison catches this variant's broken export.
    _edit(tmp_path, **CONTROLS[variant])
    broken, _ = _sglang(call, tmp_path, target_embed, features)
    assert max_error(ours, broken) > 1e-3


def test_sglang_vocab_map_control(call, tmp_path):
    """A d2t shifted by one draft id gives SGLang other target ids (caught)."""
    _, t2d, target_embed, _ = _export(tmp_path, "vocab_subset")
    _edit(tmp_path, tensors=lambda s: s.__setitem__("d2t", s["d2t"].roll(1)))
    _, hot = _sglang(call, tmp_path, target_embed, make_features())
    assert not torch.equal(hot, t2d.nonzero().flatten())


def test_norm_output_false_is_refused_because_the_engines_compute_otherwise(call, tmp_path):
    """A norm_output=False draft (logits of the un-normed output) is refused in one line;
    SGLang's and vLLM's own norm_output key (written as the old export did) runs another
    draft whichever its value."""
    cfg, params, d2t, t2d, target_embed = make_draft(norm_output=False)
    with pytest.raises(ValueError, match="norm_output=False .* SGLang and vLLM cannot run"):
        export_draft(tmp_path, params, cfg, d2t=d2t, t2d=t2d, aux_layer_ids=AUX)
    assert not any(tmp_path.iterdir())
    features = make_features()
    ours = eagle3fn_logits(cfg, params, features)
    export_draft(tmp_path, params, dataclasses.replace(cfg, norm_output=True), d2t=d2t,
                 t2d=t2d, aux_layer_ids=AUX, dtype=torch.float32)
    for value in (False, True):
        _edit(tmp_path, config={"norm_output": value})
        if importlib.util.find_spec("vllm"):
            assert max_error(ours, _vllm(call, tmp_path, target_embed, features)[2]) > 1e-2
        theirs, _ = _sglang(call, tmp_path, target_embed, features)
        assert max_error(ours, theirs) > 1e-2
    # The normed-state variant SGLang's key selects is refused on load, not misread.
    with pytest.raises(ValueError, match="norm_output is true"):
        load_export(tmp_path)


# --- speculators: --format speculators, loaded by its own from_pretrained ---------------

def _export_speculators(tmp_path, variant):
    args = VARIANTS[variant]
    cfg, params, d2t, t2d, target_embed = make_draft(**args)
    target = client_oracles.tiny_target(tmp_path / "target", target_embed,
                                 num_layers=TARGET["num_hidden_layers"])
    out = export_speculators(tmp_path / "draft", params, cfg, d2t=d2t, t2d=t2d,
                             aux_layer_ids=AUX, target_config=TARGET, target_path=str(target),
                             dtype=torch.float32)
    return cfg, params, d2t, t2d, target_embed, out


def _speculators(call, export_dir, features):
    """(per-step logits, facts) of speculators' model loaded from ``export_dir``."""
    client_oracles.require("speculators")
    return call("run_speculators", str(export_dir), features.input_ids, features.aux,
                features.attention_mask, K)


def _real_rows(logits, features):
    """Rows of real tokens (speculators runs each sample over its real tokens only)."""
    valid = features.attention_mask.bool()
    return [x[valid] for x in logits]


SPECULATORS_CONTROLS = {
    "default": {"tensors": _shift("layers.0.mlp.down_proj.weight")},
    "llama3": {"config": {"transformer_layer_config": "drop rope_scaling"}},
    "yarn": {"config": {"transformer_layer_config": "drop rope_scaling"}},
    "fc_norm": {"config": {"fc_norm": False}},
    "vocab_full": {"tensors": _shift("norm.weight")},
    "vocab_subset": {"tensors": _shift("lm_head.weight")},
}


def _break_speculators(export_dir, control):
    config = dict(control.get("config") or {})
    if config.get("transformer_layer_config") == "drop rope_scaling":
        layer = json.loads((export_dir / CONFIG).read_text())["transformer_layer_config"]
        layer.pop("rope_scaling")
        config["transformer_layer_config"] = layer
    _edit(export_dir, config=config, tensors=control.get("tensors"))


@pytest.mark.parametrize("variant", list(SPECULATORS_CONTROLS))
def test_speculators_loads_our_layout(call, tmp_path, variant):
    client_oracles.require("speculators")
    cfg, params, d2t, t2d, target_embed, out = _export_speculators(tmp_path, variant)
    features = make_features()
    ours = _real_rows(eagle3fn_logits(cfg, params, features), features)
    theirs, facts = _speculators(call, out, features)
    assert max_error(ours, _real_rows(theirs, features)) <= TOL
    # Output-of-layer ids i are speculators' (and vLLM's) capture-before ids i + 1,
    # checked by its from_pretrained against the verifier's layer count.
    assert facts["aux_ids"] == [i + 1 for i in AUX]
    assert facts["fc_norm"] == cfg.fc_norm
    assert torch.equal(facts["embed"], target_embed)
    if cfg.draft_vocab_size < cfg.vocab_size:
        assert torch.equal(facts["d2t"], d2t) and torch.equal(facts["t2d"], t2d)
    else:
        assert facts["d2t"] is None and facts["t2d"] is None
    _break_speculators(out, SPECULATORS_CONTROLS[variant])
    broken, _ = _speculators(call, out, features)
    assert max_error(ours, _real_rows(broken, features)) > 1e-3


def test_speculators_refuses_what_it_cannot_represent(tmp_path):
    cfg, params, d2t, t2d, _ = make_draft(target_hidden=24)
    kw = {"d2t": d2t, "t2d": t2d, "aux_layer_ids": AUX, "target_path": "target"}
    with pytest.raises(ValueError, match="hidden_size=32 differs from the target's 24.*--format eagle3"):
        export_speculators(tmp_path, params, cfg, **kw)
    cfg, params, d2t, t2d, _ = make_draft(norm_output=False)
    with pytest.raises(ValueError, match="norm_output=False"):
        export_speculators(tmp_path, params, cfg, **kw)
    cfg, params, d2t, t2d, _ = make_draft()
    with pytest.raises(ValueError, match="lack embed_tokens.weight"):
        export_speculators(tmp_path, {k: v for k, v in params.items() if "embed" not in k}, cfg, **kw)
    with pytest.raises(ValueError, match="target_path is empty"):
        export_speculators(tmp_path, params, cfg, **{**kw, "target_path": ""})
    assert not any(tmp_path.iterdir())


def test_cli_exports_a_run_speculators_loads(call, tmp_path):
    """``eagle3fn export --format speculators`` of a trained run: speculators' model
    computes the run's draft (target embedding read from the target) on its rows."""
    from eagle3fn.cli.main import main
    from recorders import save_tiny_target, write_tiny_chat

    from eagle3fn.io.target import load_target
    from eagle3fn.shapes import Features
    from eagle3fn.train import CHECKPOINT, train
    from eagle3fn.train.checkpoint import load_run
    from eagle3fn.train.config import TrainConfig

    client_oracles.require("speculators")
    save_tiny_target(tmp_path / "model")
    write_tiny_chat(tmp_path / "chat.jsonl", 4)
    run_dir = tmp_path / "run"
    train(TrainConfig(model=str(tmp_path / "model"), data=str(tmp_path / "chat.jsonl"),
                      out_dir=str(run_dir), draft_vocab_size=64, batch_size=2, max_steps=1,
                      ttt_length=3), log=lambda s: None)
    assert (run_dir / CHECKPOINT).is_file()
    main(["export", "--run", str(run_dir), "--out", str(tmp_path / "draft"), "--format",
          "speculators", "--dtype", "float32"])
    run = load_run(str(run_dir))
    target = load_target(str(tmp_path / "model"), aux_layer_ids=run["aux_layer_ids"])
    params = {**run["params"], "embed_tokens.weight": target.embed_tokens.float()}
    cfg = run["draft"]
    g = torch.Generator().manual_seed(0)
    features = Features(input_ids=torch.randint(0, cfg.vocab_size, (B, S), generator=g),
                        aux=torch.randn(B, S, 3 * cfg.ht, generator=g),
                        attention_mask=torch.ones(B, S, dtype=torch.long))
    ours = eagle3fn_logits(cfg, params, features)
    theirs, facts = _speculators(call, tmp_path / "draft", features)
    assert max_error(ours, theirs) <= TOL
    assert facts["aux_ids"] == [i + 1 for i in run["aux_layer_ids"]]
    assert facts["verifier"] == str(tmp_path / "model")


# --- vLLM: its EAGLE-3 weight loading takes the export as written ------------------------

def _vllm(call, export_dir, target_embed=None, features=None):
    """(parameters by name, has_own_embed_tokens, per-step logits or None) of vLLM's
    loader and forward code on the export."""
    client_oracles.require("vllm")
    if features is None:
        return call("run_vllm", str(export_dir), 96)
    return call("run_vllm", str(export_dir), 96, target_embed, features.input_ids, features.aux,
                features.attention_mask, K)


def _expected_vllm_params(export_dir):
    """vLLM parameter name -> the export's tensor(s) it must hold after loading: q/k/v
    and gate/up stacked in that order (one tensor-parallel rank), ``midlayer.`` read as
    ``layers.0.``, d2t as ``draft_id_to_target_id``."""
    with safe_open(str(export_dir / WEIGHTS), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    expected = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([state.pop(attn + f"{x}_proj.weight")
                                                               for x in "qkv"]),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([state.pop(mlp + f"{x}_proj.weight")
                                                             for x in ("gate", "up")]),
    }
    state.pop("t2d", None)
    if "d2t" in state:
        expected["draft_id_to_target_id"] = state.pop("d2t")
    expected["lm_head.weight"] = state.pop("lm_head.weight")
    expected.update({"model." + k.replace("midlayer.", "layers.0."): v for k, v in state.items()})
    return expected


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vllm_loads_and_computes_our_draft(call, tmp_path, variant):
    cfg, t2d, target_embed, features = _export(tmp_path, variant)
    params, own_embedding, theirs = _vllm(call, tmp_path, target_embed, features)
    expected = _expected_vllm_params(tmp_path)
    # Every parameter vLLM builds is loaded (the embedding comes from the target unless shipped).
    assert set(params) - set(expected) == ({"model.embed_tokens.weight"} if variant != "width" else set())
    for name, tensor in expected.items():
        # VocabParallelEmbedding / ParallelLMHead pad their rows to a multiple of 64.
        assert torch.equal(params[name][:tensor.shape[0]], tensor), name
    assert ("draft_id_to_target_id" not in params) == (cfg.draft_vocab_size == 96)
    # The draft's own embedding is used only when it ships one (H != Ht).
    assert own_embedding == (variant == "width")
    if cfg.draft_vocab_size < 96:  # vLLM scatters draft logits to arange(Vd) + d2t
        targets = torch.arange(cfg.draft_vocab_size) + params["draft_id_to_target_id"]
        assert torch.equal(targets, t2d.nonzero().flatten())
    ours, _, _ = _ours(tmp_path, target_embed, features)
    assert max_error(ours, theirs) <= TOL
    if variant == "fc_norm":  # this control is a load error: test_vllm_refuses_...
        return
    _edit(tmp_path, **CONTROLS[variant])
    assert max_error(ours, _vllm(call, tmp_path, target_embed, features)[2]) > 1e-3


def test_vllm_refuses_a_d2t_for_a_full_vocab_draft(call, tmp_path):
    """Control: the layout before this fix (d2t/t2d also when Vd == V) is what vLLM's
    loader rejects; so is an fc_norm export whose config drops fc_norm."""
    _export(tmp_path / "full", "vocab_full")
    _edit(tmp_path / "full", tensors=lambda s: s.update(
        d2t=torch.zeros(96, dtype=torch.int64), t2d=torch.ones(96, dtype=torch.bool)))
    with pytest.raises(ValueError, match="no module or parameter named .draft_id_to_target_id"):
        _vllm(call, tmp_path / "full")
    _export(tmp_path / "fc", "fc_norm")
    _edit(tmp_path / "fc", config={"fc_norm": None})
    with pytest.raises(ValueError, match="fc_norm"):
        _vllm(call, tmp_path / "fc")


def test_cli_speculators_refuses_a_gguf_or_missing_target(tmp_path):
    """The speculators layout names a safetensors target as its verifier: a run trained
    on a GGUF file, or without a model, is refused in one line before anything loads."""
    from eagle3fn.cli.run import ExportArgs, _export_speculators

    from eagle3fn.errors import UsageError

    args = ExportArgs(run=str(tmp_path), out=str(tmp_path / "out"), format="speculators")
    for config, what in (({"model": str(tmp_path), "gguf_file": "m.gguf"}, "a GGUF target"),
                         ({}, "no target model")):
        with pytest.raises(UsageError, match=f"this run has {what}.*--format eagle3"):
            _export_speculators(args, {"config": config}, {})
    assert not (tmp_path / "out").exists()
