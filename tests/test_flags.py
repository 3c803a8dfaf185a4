"""Flags checked against each other and against the target before any work: ``--data``
beside ``--cache``, ``--max-length`` beyond the target's positions (``--allow-long``,
RoPE scalings that extend them), the memory preflight (``train.preflight``) and the
wording of path errors and skip hints."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from test_errors import fails_in_one_line
from test_train import config, workdir  # noqa: F401 - the tiny target + data fixture

from eagle3fn.errors import UsageError
from eagle3fn.io.data import read_conversations
from eagle3fn.plan import PlanArgs, estimate
from eagle3fn.train import train
from eagle3fn.train.build import check_draft_shape, target_positions
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.preflight import check_memory, step_memory, target_parameter_count

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(workdir, out, *flags):  # noqa: F811
    return ["train", "--model", str(workdir / "model"), "--data", str(workdir / "chat.jsonl"), "--out-dir",
            str(out), "--draft-vocab-size", "64", *flags]


# ------------------------------------------------------------------ --data with --cache


def test_data_beside_cache_is_refused_naming_both(workdir, tmp_path, capsys):  # noqa: F811
    cache = tmp_path / "cache"
    cache.mkdir()
    fails_in_one_line(capsys, _train(workdir, tmp_path / "run", "--cache", str(cache)), 2,
                      f"--data {workdir / 'chat.jsonl'} and --cache {cache} given together",
                      "drop --data to train offline, or --cache to train online")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ --max-length vs positions


def _short_target(workdir, tmp_path, positions=256, rope=None):  # noqa: F811
    model = tmp_path / "short"
    shutil.copytree(workdir / "model", model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    if rope is not None:
        cfg["rope_scaling"] = cfg["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def test_max_length_beyond_the_targets_positions_is_refused(workdir, tmp_path, capsys):  # noqa: F811
    model = _short_target(workdir, tmp_path)
    argv = ["train", "--model", str(model), "--data", str(workdir / "chat.jsonl"), "--out-dir",
            str(tmp_path / "run"), "--max-length", "1024"]
    fails_in_one_line(capsys, argv, 2, "--max-length 1024 is beyond the 256 positions of the target",
                      "max_position_embeddings 256", "--max-length 256 or less", "--allow-long")
    cfg = dict(model=str(model), data=str(workdir / "chat.jsonl"))
    check_draft_shape(TrainConfig(**cfg, max_length=1024, allow_long=True))  # said on purpose
    check_draft_shape(TrainConfig(**cfg, max_length=256))


def test_a_rope_scaling_that_extends_the_positions_allows_them(workdir, tmp_path):  # noqa: F811
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    model = _short_target(workdir, tmp_path, rope=yarn)
    cfg = dict(model=str(model), data=str(workdir / "chat.jsonl"))
    check_draft_shape(TrainConfig(**cfg, max_length=1024))  # 4 x 256
    with pytest.raises(UsageError, match=r"beyond the 1024 positions .*yarn RoPE scaling: factor 4.0 x 256"):
        check_draft_shape(TrainConfig(**cfg, max_length=1025))


@pytest.mark.parametrize("positions, scaling, expected", [
    (256, {}, 256),
    (256, {"rope_type": "default"}, 256),
    (256, {"rope_type": "linear", "factor": 2.0}, 512),  # original defaults to max_position_embeddings
    (131072, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072),
    (32768, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    (4096, {"rope_type": "dynamic", "factor": 2.0}, 4096),  # frequencies change past it: not extended
    (None, {}, None),
])
def test_target_positions(positions, scaling, expected):
    text = SimpleNamespace(max_position_embeddings=positions, rope_parameters=scaling)
    assert target_positions(text)[0] == expected


# ------------------------------------------------------------------- memory preflight


def test_target_parameter_count_matches_the_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    for tie in (False, True):
        cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                          num_key_value_heads=2, head_dim=12, vocab_size=101, tie_word_embeddings=tie)
        model = LlamaForCausalLM(cfg)
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        assert target_parameter_count(cfg) == model.num_parameters() - norms


def test_the_preflight_adds_the_target_to_the_plans_draft_step(workdir, tmp_path):  # noqa: F811
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(workdir / "model")
    cfg = config(workdir, tmp_path / "run", batch_size=3, max_length=300)
    need = step_memory(cfg, model_config, torch.device("cpu"), torch.float32)
    plan = estimate(PlanArgs(seq_len=300, batch=3, density=0.3, hidden=32, intermediate=64, heads=4, kv_heads=2,
                             vocab=model_config.vocab_size, draft_vocab=64, ttt_length=3, trim="loss",
                             dtype_bytes=4, optimizer=True, attention="eager", loss_impl="torch"),
                    compile_elementwise=False)
    assert (need.rows, need.seq_len, need.draft) == (3, 300, plan.memory.peak)
    weights = target_parameter_count(model_config) * 4
    forward = 9 * 3 * 300 * 32 * 4 + 3 * 300 * 300  # 8 layers + embeddings of hidden states, the mask
    assert (need.target_weights, need.target_forward) == (weights, forward)
    assert need.peak == weights + max(plan.memory.peak, need.draft_resident + forward)


def test_a_step_that_cannot_fit_is_refused_before_anything_loads(workdir, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The issue's case: --max-length 100000 on short conversations packs them into one
    row of 100000 tokens (a 10 GB attention mask): refused in one line with the numbers."""
    import eagle3fn.io.target

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the memory check")

    monkeypatch.setattr(eagle3fn.io.target, "load_target", no_load)
    line = fails_in_one_line(capsys, _train(workdir, tmp_path / "run", "--max-length", "100000",
                                            "--allow-long", "--pack"), 2,
                             "one step needs about", "at 4 rows of 100000 tokens", "lower --max-length (now 100000)",
                             "--no-memory-check")
    assert "cpu has" in line and not (tmp_path / "run").exists()


def test_the_preflight_compares_with_the_free_memory(workdir, tmp_path, monkeypatch):  # noqa: F811
    from transformers import AutoConfig

    import eagle3fn.train.preflight as preflight

    model_config = AutoConfig.from_pretrained(workdir / "model")
    cfg = config(workdir, tmp_path / "run")
    need = step_memory(cfg, model_config, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(preflight, "free_memory", lambda device: (need.peak, "test"))
    check_memory(cfg, model_config, torch.device("cpu"), torch.float32)  # exactly fits
    monkeypatch.setattr(preflight, "free_memory", lambda device: (need.peak - 1, "test"))
    with pytest.raises(UsageError, match="one step needs about"):
        check_memory(cfg, model_config, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(preflight, "free_memory", lambda device: (0, "test"))
    train(config(workdir, tmp_path / "unchecked", max_steps=1, memory_check=False), log=lambda s: None)


def test_free_memory_on_the_cpu_is_positive():
    from eagle3fn.train.preflight import free_memory

    free, where = free_memory(torch.device("cpu"))
    assert free > 0 and where


# ------------------------------------------------------------------------------ wording


def test_paths_that_exist_but_are_not_files_say_what_they_are(workdir, tmp_path, capsys):  # noqa: F811
    fails_in_one_line(capsys, ["train", "--model", str(workdir / "model"), "--data", str(tmp_path),
                               "--out-dir", str(tmp_path / "a")], 2, f"--data {tmp_path} is a directory, not a file")
    fails_in_one_line(capsys, ["train", "--model", str(workdir / "model"), "--data", "/dev/null",
                               "--out-dir", str(tmp_path / "b")], 2, "--data /dev/null is a character device")
    fails_in_one_line(capsys, ["train", "--model", str(workdir / "model"), "--cache", str(workdir / "chat.jsonl"),
                               "--out-dir", str(tmp_path / "c")], 2, "is a file, not a directory")
    fails_in_one_line(capsys, ["vocab", "--model.path", str(workdir / "model"), "--data.path", "/dev/null",
                               "--out", str(tmp_path / "v.safetensors")], 2, "is a character device, not a file")


def test_skip_hints_name_the_flag_users_type(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "wizard", "content": "hi"}]}\n')
    with pytest.raises(ValueError) as e:
        read_conversations(bad)
    assert "--on-error skip" in str(e.value) and "on_error='skip'" not in str(e.value)
