"""No silent failures in training: the non-finite guard, the run fingerprint on resume,
flag ranges, early path checks, checkpoints that cannot run code, a full disk.

Each case failed silently (or with a raw traceback) before the guard existed; each test
shows the new behaviour and, where it compares numbers, a control the test would catch.
"""

import dataclasses
import math
import os
import pickle

import pytest
import torch
from recorders import prepare_cache
from test_train import config, final_params, workdir  # noqa: F401 - the tiny target + data fixture

import eagle3fn.io.target as target_module
from eagle3fn.cli.main import main
from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.vocab_io import load_vocab_map, save_vocab_map
from eagle3fn.train.checkpoint import CHECKPOINT
from eagle3fn.train import METRICS, load_run, train
from eagle3fn.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny runs: 2 threads crawl on a busy CPU

quiet = dict(log=lambda s: None)


def poison(monkeypatch, *, batch: int, where: str = "real"):
    """Make the target's features of the ``batch``-th call NaN at one position: a real
    (non-padding) token or a padding row."""
    real = target_module.target_features
    calls = {"n": 0}

    def features(target, input_ids, attention_mask, **kwargs):
        f = real(target, input_ids, attention_mask, **kwargs)
        calls["n"] += 1
        if calls["n"] == batch:
            aux = f.aux.clone()
            pad = (attention_mask == 0).nonzero()
            b, s = (pad[0].tolist() if where == "padding" else (0, 1))
            aux[b, s, 0] = float("nan")
            f = dataclasses.replace(f, aux=aux)
        return f
    monkeypatch.setattr(target_module, "target_features", features)


@pytest.mark.parametrize("where", ["real", "padding"])
def test_a_nan_feature_stops_the_run_naming_step_batch_and_last_checkpoint(workdir, tmp_path,  # noqa: F811
                                                                           monkeypatch, where):
    out = tmp_path / "run"
    poison(monkeypatch, batch=3, where=where)  # the third batch: step 3 (save_every=2)
    with pytest.raises(RunError) as e:
        train(config(workdir, out, epochs=1, trim_loss_positions=False, batch_size=2), **quiet)
    msg = str(e.value)
    assert msg.startswith("step 3:") and "chat.jsonl:" in msg and "(step 2)" in msg, msg
    assert "\n" not in msg
    state = torch.load(out / CHECKPOINT, weights_only=True)  # the last good one, untouched
    assert state["step"] == 2 and all(torch.isfinite(p).all() for p in state["params"].values())
    assert [r["step"] for r in read_metrics(out / METRICS)] == [1, 2]


def test_skip_drops_the_batch_counts_it_and_finishes(workdir, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "skip"
    poison(monkeypatch, batch=2)
    updates = []
    real_step = torch.optim.AdamW.step

    def counted(self, *a, **k):
        updates.append(1)
        return real_step(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    train(config(workdir, out, epochs=1, on_nonfinite="skip"), **quiet)
    rows = read_metrics(out / METRICS)
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 1, 1]
    assert len(updates) == 3  # four steps, one without an optimizer update
    state = torch.load(out / CHECKPOINT, weights_only=True)
    assert state["nonfinite_skipped"] == 1 and all(torch.isfinite(p).all() for p in state["params"].values())


def test_a_huge_learning_rate_stops_before_a_nonfinite_checkpoint(workdir, tmp_path):  # noqa: F811
    out = tmp_path / "lr"
    with pytest.raises(RunError, match="is not finite"):
        train(config(workdir, out, epochs=2, lr=1e30, save_every=1), **quiet)
    state = torch.load(out / CHECKPOINT, weights_only=True)
    assert all(torch.isfinite(p).all() for p in state["params"].values())
    # The same run with a sane lr is not stopped (the guard is not a false alarm).
    train(config(workdir, tmp_path / "ok", epochs=1), **quiet)


@pytest.mark.parametrize("flag,value", [
    ("lr", 0.0), ("lr", -1e-4), ("lr", math.nan), ("lr", math.inf), ("grad_clip", 0.0), ("grad_clip", -1.0),
    ("warmup_ratio", -1.0), ("warmup_ratio", 5.0), ("warmup_ratio", 1.0), ("max_steps", 0), ("max_steps", -3),
    ("epochs", 0), ("save_every", 0), ("log_every", 0), ("weight_decay", -0.1), ("ttt_length", 0),
    ("max_length", 1), ("draft_vocab_size", 0), ("seed", -1)])
def test_numeric_flags_out_of_range_are_refused_when_the_config_is_built(workdir, tmp_path, flag, value):  # noqa: F811
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} {value}: must be"):
        config(workdir, tmp_path, **{flag: value})


def test_grad_clip_none_turns_clipping_off_explicitly(workdir, tmp_path, monkeypatch):  # noqa: F811
    """The optimizer sees the gradients unscaled with --grad-clip None, and scaled with a
    tiny clip (the control the same comparison catches)."""
    def run(out, clip):
        before, seen = {}, {}
        real = torch.optim.AdamW.step

        def spy(self, *a, **k):
            seen.update({i: p.grad.clone() for i, p in enumerate(self.param_groups[0]["params"])})
            return real(self, *a, **k)
        monkeypatch.setattr(torch.optim.AdamW, "step", spy)
        train(config(workdir, tmp_path / out, epochs=1, max_steps=1, grad_clip=clip), **quiet,
              on_grads=lambda step, g: before.update({i: t.clone() for i, t in enumerate(g.values())}))
        return max(float((seen[i] - before[i]).abs().max() / before[i].abs().max()) for i in before)
    assert run("off", None) == 0
    assert run("tiny", 1e-6) > 0.5


def test_a_resume_may_change_max_steps_and_says_so(workdir, one_step, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "longer"
    shutil.copytree(one_step, out)
    lines = []
    train(config(workdir, out, epochs=1, max_steps=2), log=lines.append)
    assert any(line.startswith("note: --max-steps 2 differs from the checkpoint's 1") for line in lines), lines
    assert torch.load(out / CHECKPOINT, weights_only=True)["step"] == 2


def test_cli_errors_are_one_line_with_exit_codes(workdir, tmp_path, capsys):  # noqa: F811
    base = ["train", "--model", str(workdir / "model"), "--data", str(workdir / "chat.jsonl"),
            "--draft-vocab-size", "64", "--ttt-length", "3"]
    cases = [  # (extra flags, exit code, text in the one line)
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "bogus"], 2, "--device"),
        (["--out-dir", str(workdir / "chat.jsonl" / "run")], 2, "not a writable directory"),
        (["--vocab-map", str(tmp_path / "missing.safetensors")], 2, "missing.safetensors"),
    ]
    for extra, code, text in cases:
        with pytest.raises(SystemExit) as e:
            main([*base, "--out-dir", str(tmp_path / "never"), *extra])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert e.value.code == code and len(lines) == 1 and lines[0].startswith("eagle3fn: error:"), err
        assert text in lines[0] and "Traceback" not in err
        assert not (tmp_path / "never").exists()  # nothing left behind
    with pytest.raises(SystemExit) as e:  # parse-time range check: tyro's box, exit 2
        main([*base, "--save-every", "0"])
    assert e.value.code == 2 and "--save-every 0: must be >= 1" in capsys.readouterr().err


def test_bad_paths_fail_before_the_target_loads(workdir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(UsageError, match="not a writable directory"):
        train(config(workdir, workdir / "chat.jsonl" / "run"), **quiet)
    with pytest.raises(FileNotFoundError, match="no such file"):
        train(config(workdir, tmp_path / "x", data=str(tmp_path / "none.jsonl")), **quiet)
    assert not (tmp_path / "x").exists()


def test_a_failed_run_leaves_no_out_dir_it_created(workdir, tmp_path):  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    out = tmp_path / "created"
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        train(config(workdir, out, data=str(bad)), **quiet)
    assert not out.exists()
    mine = tmp_path / "mine"  # a directory the user made is kept, with what they put there
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError):
        train(config(workdir, mine, data=str(bad)), **quiet)
    assert (mine / "notes.txt").read_text() == "keep"


@pytest.fixture(scope="module")
def one_step(workdir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("one") / "run"
    train(config(workdir, out, epochs=1, max_steps=1), **quiet)
    return out


@pytest.mark.parametrize("change", [
    dict(loss=__import__("eagle3fn.loss", fromlist=["LossConfig"]).LossConfig(objective="lambda")),
    dict(loss=__import__("eagle3fn.loss", fromlist=["LossConfig"]).LossConfig(normalization="token_mean")),
    dict(loss=__import__("eagle3fn.loss", fromlist=["LossConfig"]).LossConfig(step_weight_decay=0.5)),
    dict(grad_clip=1.0), dict(weight_decay=0.1), dict(lr=5e-4), dict(trim_loss_positions=False)])
def test_a_resume_with_other_settings_lists_each_difference(workdir, one_step, tmp_path, change):  # noqa: F811
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(one_step, out)
    with pytest.raises(RunError, match="was written by another run") as e:
        train(config(workdir, out, epochs=1, max_steps=1, **change), **quiet)
    key = next(iter(change))
    listed = str(e.value).split("differs in: ")[1].split(". Resume")[0].split("; ")
    assert all(line.startswith(f"settings.{'trim' if key == 'trim_loss_positions' else key}")
               for line in listed), listed


def test_a_resume_with_another_vocab_map_is_refused_and_keeps_the_run_file(workdir, one_step, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(one_step, out)
    d2t, t2d = load_vocab_map(out / "vocab.safetensors")
    before = (out / "vocab.safetensors").read_bytes()
    other_t2d = torch.zeros_like(t2d)
    other_t2d[-len(d2t):] = True  # another valid map: the last Vd target ids
    other = tmp_path / "other.safetensors"
    used = torch.nonzero(other_t2d).flatten()
    save_vocab_map(other, used - torch.arange(len(used)), other_t2d)  # d2t holds offsets
    with pytest.raises(RunError, match="vocab_map"):
        train(config(workdir, out, epochs=1, max_steps=1, vocab_map=str(other)), **quiet)
    assert (out / "vocab.safetensors").read_bytes() == before
    # The run's own map, given explicitly, resumes (content, not spelling, is compared).
    train(config(workdir, out, epochs=1, max_steps=1, vocab_map=str(out / "vocab.safetensors")), **quiet)


def test_a_resume_after_new_weights_at_the_same_path_is_refused(workdir, tmp_path):  # noqa: F811
    import shutil

    model = tmp_path / "model"
    shutil.copytree(workdir / "model", model)
    out = tmp_path / "run"
    train(config(workdir, out, model=str(model), epochs=1, max_steps=1), **quiet)
    torch.manual_seed(5)
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    m.save_pretrained(model)
    with pytest.raises(RunError, match="target"):
        train(config(workdir, out, model=str(model), epochs=1, max_steps=1), **quiet)


def test_paths_are_compared_by_content_not_spelling(workdir, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    train(config(workdir, out, epochs=1, max_steps=1), **quiet)
    monkeypatch.chdir(workdir)
    rel = config(workdir, out, epochs=1, max_steps=1, model="model", data="./chat.jsonl")
    train(rel, **quiet)  # resumes (nothing left to do) instead of refusing "other settings"
    assert torch.load(out / CHECKPOINT, weights_only=True)["step"] == 1


def test_a_checkpoint_with_a_pickled_payload_never_runs(workdir, one_step, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "evil"
    shutil.copytree(one_step, out)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    state = torch.load(out / CHECKPOINT, weights_only=True)
    state["step"] = Payload()
    with open(out / CHECKPOINT, "wb") as f:
        pickle.dump(state, f)  # a file whose unpickling runs a shell command
    with pytest.raises(RunError, match="not a readable eagle3fn checkpoint"):
        load_run(out)
    with pytest.raises(RunError, match="not a readable eagle3fn checkpoint"):
        train(config(workdir, out, epochs=1, max_steps=1), **quiet)
    assert not marker.exists()
    # Control: a loader that runs code would have run it.
    with open(out / CHECKPOINT, "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_checkpoint_fields_missing_or_truncated_are_clear(workdir, one_step, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "noopt"
    shutil.copytree(one_step, out)
    state = torch.load(out / CHECKPOINT, weights_only=True)
    del state["optimizer"]
    torch.save(state, out / CHECKPOINT)
    with pytest.raises(RunError, match=r"lacks \['optimizer'\]"):
        train(config(workdir, out, epochs=1, max_steps=1), **quiet)
    cut = tmp_path / "cut"
    shutil.copytree(one_step, cut)
    data = (cut / CHECKPOINT).read_bytes()
    (cut / CHECKPOINT).write_bytes(data[: len(data) // 2])
    with pytest.raises(RunError, match="truncated"):
        load_run(cut)
    nan = tmp_path / "nan"
    shutil.copytree(one_step, nan)
    state = torch.load(nan / CHECKPOINT, weights_only=True)
    name = next(iter(state["params"]))
    state["params"][name][0] = float("nan")
    torch.save(state, nan / CHECKPOINT)
    with pytest.raises(RunError, match=f"non-finite weights in \\['{name}'\\]"):
        load_run(nan)


def test_checkpoints_hold_no_target_embedding(one_step):
    names = set(torch.load(one_step / CHECKPOINT, weights_only=True)["params"])
    assert "embed_tokens.weight" not in names and "fc.weight" in names, names


def test_a_full_disk_keeps_the_old_checkpoint_and_no_temp_file(workdir, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "full"
    real, kept = torch.save, {}

    def full_disk(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 3:  # the third save hits a full disk
            real(obj, f, *a, **k)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1024 vs 512")
        real(obj, f, *a, **k)
        if isinstance(obj, dict) and obj.get("step") == 2:
            kept["bytes"] = open(f, "rb").read()
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RunError, match=r"could not write .*unexpected pos.*\(step 2\) is intact; free disk"):
        train(config(workdir, out, epochs=1, max_steps=4, save_every=1), **quiet)
    assert not list(out.glob("*.tmp"))
    assert (out / CHECKPOINT).read_bytes() == kept["bytes"]


@pytest.fixture(scope="module")
def bf16_cache(workdir, tmp_path_factory):  # noqa: F811
    return prepare_cache(workdir, tmp_path_factory.mktemp("cache") / "bf16", "--aux-layer-ids", "0", "2", "5",
                         storage="bfloat16")


def test_a_bf16_cache_trains_on_the_cpu_upcast(workdir, bf16_cache, tmp_path):  # noqa: F811
    """The default offline path on the CPU: prepare's bf16 features train in fp32 (they
    crashed with a dtype mismatch); the run takes the cache's aux ids (none given)."""
    grads = {}
    out = tmp_path / "bf16"
    train(config(workdir, out, cache=str(bf16_cache), data="", epochs=1, max_steps=1), **quiet,
          on_grads=lambda step, g: grads.update({n: (t.dtype, bool(torch.isfinite(t).all())) for n, t in g.items()}))
    assert grads and all(dtype == torch.float32 and ok for dtype, ok in grads.values()), grads
    assert load_run(out)["aux_layer_ids"] == (0, 2, 5)


def test_train_refuses_a_cache_of_other_aux_ids_before_training(workdir, bf16_cache, tmp_path):  # noqa: F811
    with pytest.raises(UsageError, match=r"aux_layer_ids: \[0, 2, 5\] -> \[1, 3, 4\]"):
        train(config(workdir, tmp_path / "aux", cache=str(bf16_cache), data="", aux_layer_ids=(1, 3, 4)),
              **quiet)
    assert not (tmp_path / "aux").exists()


def test_export_and_eval_refuse_a_nonfinite_checkpoint_in_one_line(workdir, one_step, tmp_path, capsys):  # noqa: F811
    import shutil

    nan = tmp_path / "nan"
    shutil.copytree(one_step, nan)
    state = torch.load(nan / CHECKPOINT, weights_only=True)
    state["params"]["fc.weight"][0, 0] = float("inf")
    torch.save(state, nan / CHECKPOINT)
    for command in (["export", "--run", str(nan), "--out", str(tmp_path / "draft")],
                    ["eval", "--run", str(nan), "--num-prompts", "1"]):
        with pytest.raises(SystemExit) as e:
            main(command)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err.startswith("eagle3fn: error:") and "non-finite weights in ['fc.weight']" \
            in err and "\n" not in err, err
    assert not (tmp_path / "draft").exists()


def test_a_draft_cannot_train_past_a_longrope_switch(tmp_path):
    """Phi-3's longrope switches to its long factors past 4096 tokens; a draft trained
    with fixed frequencies cannot, so --max-length beyond it is refused (Phi-3.5 shapes)."""
    from transformers import Phi3Config

    from eagle3fn.train.build import draft_config_for

    d = 48 // 2
    cfg = Phi3Config(hidden_size=96, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                     num_hidden_layers=4, vocab_size=50, max_position_embeddings=131072,
                     original_max_position_embeddings=4096,
                     rope_scaling={"type": "longrope", "short_factor": [1.0] * d,
                                   "long_factor": [1.0 + i / d for i in range(d)]})
    assert draft_config_for(cfg, 32, 50, max_length=4096).rope.rope_type == "longrope"
    with pytest.raises(UsageError, match="--max-length 4097: the target's longrope RoPE"):
        draft_config_for(cfg, 32, 50, max_length=4097)
