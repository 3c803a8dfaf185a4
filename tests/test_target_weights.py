"""Training from an offline cache reads only the target's embedding and head
(``io.target.load_embedding_and_head``), not the whole model: the same tensors as a
loaded model's, for every target family eagle3fn supports (causal LMs, tied heads,
multimodal wrappers, checkpoints named by older transformers), and the same training.
Controls: a checkpoint whose embedding cannot be told apart is refused (the run then
loads the whole target, and says so), and the comparison sees a wrong tensor."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_target import BUILD, build
from test_train import config, workdir  # noqa: F401 - the tiny target and chat

import eagle3fn.io.target as target_module
import eagle3fn.io.target.loading as target_loading
from eagle3fn.io.target import TargetWeights, load_embedding_and_head, load_target
from eagle3fn.train.checkpoint import CHECKPOINT, read_checkpoint
from eagle3fn.train.loop import train


def saved(kind, path):
    build(kind).save_pretrained(path)
    return path


def same_as_model(path, dtype=torch.float32) -> TargetWeights:
    """The partial load of ``path`` equals the whole model's embedding and head."""
    got = load_embedding_and_head(path, aux_layer_ids=(0, 1, 2), dtype=dtype, device="cpu")
    assert isinstance(got, TargetWeights), got
    full = load_target(path, aux_layer_ids=(0, 1, 2), dtype=dtype)
    assert torch.equal(got.embed_tokens, full.embed_tokens)
    assert torch.equal(got.head_weight, full.head_weight)
    assert got.embed_tokens.dtype == dtype and got.head_weight.dtype == dtype
    return got


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_embedding_and_head_equal_the_loaded_model(kind, tmp_path):
    got = same_as_model(saved(kind, tmp_path / kind))
    tied = torch.equal(got.embed_tokens, got.head_weight)
    assert tied == (kind.startswith("gemma3")), kind  # Gemma ties its head; the others here do not


def test_bfloat16_and_both_checkpoint_namings(tmp_path):
    """bf16 as the run casts it. transformers saves a multimodal wrapper under its older
    names (``language_model.model.embed_tokens.weight``), which it maps on load, and
    checkpoints may also carry the module names: both are found."""
    path = saved("llava", tmp_path / "llava")
    same_as_model(path, torch.bfloat16)
    got = same_as_model(path)
    assert "language_model.model.embed_tokens.weight" in got.source
    file = path / "model.safetensors"
    weights = load_file(str(file))
    renamed = {k.replace("language_model.model.", "model.language_model.").replace(
        "language_model.lm_head.", "lm_head."): v for k, v in weights.items()}
    assert renamed.keys() != weights.keys()
    save_file(renamed, str(file), metadata={"format": "pt"})
    again = load_embedding_and_head(path, aux_layer_ids=(0, 1, 2), dtype=torch.float32, device="cpu")
    assert "model.language_model.embed_tokens.weight, lm_head.weight" in again.source
    assert torch.equal(again.embed_tokens, got.embed_tokens) and torch.equal(again.head_weight, got.head_weight)


def test_control_an_ambiguous_embedding_is_refused(tmp_path):
    """Two tensors that could be the embedding: no guess, a reason (the caller loads the
    whole target)."""
    path = saved("llama", tmp_path / "llama")
    file = path / "model.safetensors"
    weights = load_file(str(file))
    weights["other.embed_tokens.weight"] = weights.pop("model.embed_tokens.weight")
    weights["another.embed_tokens.weight"] = weights["other.embed_tokens.weight"].clone()
    save_file(weights, str(file), metadata={"format": "pt"})
    got = load_embedding_and_head(path, aux_layer_ids=(0, 1, 2), dtype=torch.float32, device="cpu")
    assert isinstance(got, str) and "embedding (model.embed_tokens.weight) matches no single tensor" in got


def test_control_the_comparison_sees_another_tensor(tmp_path, monkeypatch):
    """A loader that returned the head as the embedding is caught by the same check."""
    path = saved("qwen3", tmp_path / "qwen3")
    real = load_embedding_and_head

    def swapped(*a, **kw):
        got = real(*a, **kw)
        return dataclasses.replace(got, embed_tokens=got.head_weight)
    monkeypatch.setattr(sys.modules[__name__], "load_embedding_and_head", swapped)
    with pytest.raises(AssertionError):
        same_as_model(path)


def test_offline_training_reads_two_tensors_and_trains_the_same(workdir, tmp_path, monkeypatch):  # noqa: F811
    """An offline run never loads the model, and trains bitwise as one that does."""
    from recorders import prepare_cache

    cache = prepare_cache(workdir, tmp_path / "cache")
    lines = []
    loads = []
    real = target_module.load_target
    monkeypatch.setattr(target_module, "load_target", lambda *a, **kw: loads.append(1) or real(*a, **kw))
    train(config(workdir, tmp_path / "light", epochs=1, cache=str(cache)), log=lines.append)
    assert not loads and any(line.startswith("offline: the target's embedding and head") for line in lines), lines

    monkeypatch.setattr(target_module, "load_embedding_and_head", lambda *a, **kw: "forced for the test")
    heavy_lines = []
    train(config(workdir, tmp_path / "heavy", epochs=1, cache=str(cache)), log=heavy_lines.append)
    assert loads and any("loading the whole target (forced for the test)" in line for line in heavy_lines)
    light, heavy = (read_checkpoint(tmp_path / d / CHECKPOINT) for d in ("light", "heavy"))
    for name, p in light["params"].items():
        assert torch.equal(p, heavy["params"][name]), name
    assert light["aux_layer_ids"] == heavy["aux_layer_ids"]


def test_offline_evaluation_by_decoding_loads_the_whole_target(workdir, tmp_path, monkeypatch):  # noqa: F811
    """Held-out acceptance decodes with the target, so that run loads it."""
    from recorders import prepare_cache

    cache = prepare_cache(workdir, tmp_path / "cache")
    calls = []
    monkeypatch.setattr(target_module, "load_embedding_and_head", lambda *a, **kw: calls.append(1) or "x")
    cfg = config(workdir, tmp_path / "eval", epochs=1, cache=str(cache), eval_holdout=2)
    assert cfg.eval_accept_prompts > 0
    train(cfg, log=lambda s: None)
    assert not calls


def test_a_model_class_that_cannot_be_built_is_a_reason(tmp_path, monkeypatch):
    """Where the class cannot be built on the meta device, a reason (the caller loads
    the whole target)."""
    path = saved("llama", tmp_path / "llama")

    def refuse(config):
        raise ValueError("needs trust_remote_code")
    monkeypatch.setattr(target_loading, "_auto_class", lambda config: type("C", (), {"from_config": refuse}))
    got = load_embedding_and_head(path, aux_layer_ids=(0, 1, 2), dtype=torch.float32, device="cpu")
    assert isinstance(got, str) and "could not be built on the meta device (ValueError: needs" in got


def test_a_softcapped_head_is_refused_as_load_target_refuses_it(tmp_path):
    from test_target import TEXT
    from transformers import Gemma2Config, Gemma2ForCausalLM

    Gemma2ForCausalLM(Gemma2Config(**TEXT, final_logit_softcapping=30.0)).save_pretrained(tmp_path / "g2")
    for load in (lambda: load_target(tmp_path / "g2"),
                 lambda: load_embedding_and_head(tmp_path / "g2", aux_layer_ids=(0, 1, 2), dtype=torch.float32,
                                                 device="cpu")):
        with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
            load()


def test_only_the_files_transformers_reads(tmp_path):
    """A stray safetensors file beside the model holding the same names is not read; a
    sharded checkpoint is read through its index; a quantized embedding is refused."""
    path = saved("llama", tmp_path / "llama")
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v + 1 for k, v in weights.items()}, str(path / "zz-adapter.safetensors"), metadata={"format": "pt"})
    assert torch.equal(same_as_model(path).embed_tokens, weights["model.embed_tokens.weight"])

    sharded = tmp_path / "sharded"
    build("llama").save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    same_as_model(sharded)

    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    got = load_embedding_and_head(path, aux_layer_ids=(0, 1, 2), dtype=torch.float32, device="cpu")
    assert isinstance(got, str) and "stored as torch.float8_e4m3fn" in got


@pytest.mark.parametrize("kind", ["llama", "gemma3-text"])
def test_the_head_where_it_is_asked(kind, tmp_path):
    """The head on its own device (an offline run keeps it on the host), tied or not."""
    path = saved(kind, tmp_path / kind)
    got = load_embedding_and_head(path, aux_layer_ids=(0, 1, 2), dtype=torch.float32, device="cpu",
                                  head_device="meta")
    assert got.embed_tokens.device.type == "cpu" and got.head_weight.device.type == "meta"
    assert got.head_weight.shape == got.embed_tokens.shape
