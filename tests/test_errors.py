"""Issue 20: every bad input the CLI meets stops with one clear line (or tyro's box for a
bad flag) naming the value and the fix; nothing runs silently on a value that checks
nothing, and no raw traceback reaches the user."""

import json
import os
import shutil

import pytest
import torch
from test_train import config, workdir  # noqa: F401 - the tiny target + data fixture

from eagle3fn.cli.main import main
from eagle3fn.errors import UsageError
from eagle3fn.io.data import read_conversations
from eagle3fn.io.model_dir import check_model_dir
from eagle3fn.io.target import load_target
from eagle3fn.train import CHECKPOINT, train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: 2 threads crawl on a busy CPU


def fails_in_one_line(capsys, argv, code, *needles):
    """Run the CLI on ``argv``; it must exit ``code`` with exactly one
    ``eagle3fn: error:`` line on stderr, holding every needle, and no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    assert e.value.code == code, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("eagle3fn: error:")]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.out + captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def refused_at_parse(capsys, argv, *needles):
    """Run the CLI on ``argv``; tyro must refuse it (exit 2) with every needle in its box."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2
    text = " ".join((captured.out + captured.err).replace("\u2502", " ").split())
    assert "Traceback" not in text
    for needle in needles:
        assert needle in text, text


@pytest.fixture(scope="module")
def run(workdir, tmp_path_factory):  # noqa: F811
    """One trained run (2 steps) holding out 2 conversations, shared by the eval/export cases."""
    out = tmp_path_factory.mktemp("errors") / "run"
    train(config(workdir, out, epochs=1, max_steps=2, eval_holdout=2), log=lambda s: None)
    return out


def run_with(run, dest, **changes):
    """A copy of ``run`` whose recorded TrainConfig has ``changes`` (e.g. a moved model)."""
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("draft", "*.png", "tb"))
    state = torch.load(dest / CHECKPOINT, weights_only=False)
    state["config"] = {**state["config"], **changes}
    torch.save(state, dest / CHECKPOINT)
    return dest


# ---------------------------------------------------------------------------- eval flags


@pytest.mark.parametrize("flags, needle", [
    (["--num-draft-tokens", "5000"], "--num-draft-tokens 5000 is outside 1..64"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens 0 is outside 1..64"),
    (["--num-prompts", "-1"], "--num-prompts -1 must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--temperature", "-0.5"], "--temperature -0.5 must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature inf must be a finite number >= 0"),
])
def test_eval_flags_out_of_range_are_refused(capsys, flags, needle):
    refused_at_parse(capsys, ["eval", "--run", "nowhere", *flags], needle)


def test_eval_never_uses_fewer_prompts_than_asked(run, capsys):
    fails_in_one_line(capsys, ["eval", "--run", str(run), "--num-prompts", "3"], 2,
                      "--num-prompts 3 but the run holds out 2 conversations",
                      "--num-prompts 2 or less", "--eval-holdout 3")


def test_eval_without_holdout_never_uses_fewer_prompts(run, tmp_path, capsys):
    # No held-out prompts recorded: eval reads the run's 8 training conversations.
    no_holdout = run_with(run, tmp_path / "run", eval_holdout=0)
    state = torch.load(no_holdout / CHECKPOINT, weights_only=False)
    torch.save({**state, "holdout_prompts": []}, no_holdout / CHECKPOINT)
    fails_in_one_line(capsys, ["eval", "--run", str(no_holdout), "--num-prompts", "9"], 2,
                      "--num-prompts 9 but the run's data", "has 8 conversations",
                      "--num-prompts 8 or less")


# ---------------------------------------------------------------------------- verify


@pytest.mark.parametrize("flags, needle", [
    (["--seq-len", "1"], "--seq-len 1 must be >= 2"),
    (["--density", "0"], "--density 0.0 must be in (0, 1]"),
    (["--density", "1.5"], "--density 1.5 must be in (0, 1]"),
    (["--batch", "0"], "--batch 0 must be >= 1"),
    (["--seeds", "0"], "--seeds 0 must be >= 1"),
    (["--ttt-length", "0"], "--ttt-length 0 must be >= 1"),
    (["--vocab", "0"], "--vocab 0 must be >= 1"),
    (["--draft-vocab", "0"], "--draft-vocab 0 must be in 1..2048"),
    (["--vocab", "64", "--draft-vocab", "65"], "--draft-vocab 65 must be in 1..64"),
])
def test_verify_flags_that_compare_nothing_are_refused(capsys, flags, needle):
    refused_at_parse(capsys, ["verify", *flags], needle)


def test_verify_comparing_zero_rows_fails(capsys):
    """A 1% tail of 24 positions supervises nothing: never a PASS."""
    fails_in_one_line(capsys, ["verify", "--density", "0.01", "--seq-len", "24", "--vocab", "64",
                               "--draft-vocab", "16", "--batch", "1", "--seeds", "1"], 1,
                      "seed 0 compared 0 rows", "--density 0.01", "raise --density or --seq-len")


# ---------------------------------------------------------------------------- export


def test_export_dtype_is_a_choice(capsys):
    refused_at_parse(capsys, ["export", "--run", "nowhere", "--dtype", "bogus"], "bogus",
                     "bfloat16", "float16", "float32")


# ---------------------------------------------------------------------------- data files


def write_lines(path, raw: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in raw))
    return path


def test_non_utf8_line_names_file_and_line_and_is_skippable(workdir, tmp_path, capsys):  # noqa: F811
    good = json.dumps({"messages": [{"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": "hello friend"}]}).encode()
    bad = good.replace(b"friend", b"fr\xffiend")
    data = write_lines(tmp_path / "latin.jsonl", [good, bad, good])
    argv = ["vocab", "--model.path", str(workdir / "model"), "--data.path", str(data),
            "--draft-vocab-size", "8", "--out", str(tmp_path / "vocab.safetensors")]
    fails_in_one_line(capsys, argv, 2, f"{data}:2: not UTF-8 (byte 0xff at character",
                      "re-encode the file as UTF-8")
    main([*argv, "--data.on-error", "skip"])
    err = capsys.readouterr().err
    assert f"skipped 1 of 3 conversations; first: {data}:2: not UTF-8" in err
    conversations, skipped = read_conversations(data, on_error="skip")
    assert skipped == 1 and [c.source for c in conversations] == [f"{data}:1", f"{data}:3"]


def test_data_file_missing_or_a_directory(workdir, tmp_path, capsys):  # noqa: F811
    argv = ["vocab", "--model.path", str(workdir / "model"), "--out", str(tmp_path / "v.safetensors"),
            "--data.path"]
    fails_in_one_line(capsys, [*argv, str(tmp_path / "missing.jsonl")], 2,
                      f"chat data file '{tmp_path / 'missing.jsonl'}' not found; pass a JSONL file")
    fails_in_one_line(capsys, [*argv, str(tmp_path)], 2,
                      f"chat data file '{tmp_path}' is a directory; pass the JSONL file inside it")
    with pytest.raises(UsageError, match="is a directory"):
        read_conversations(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_data_file(tmp_path):
    path = tmp_path / "locked.jsonl"
    path.write_text("{}\n")
    path.chmod(0)
    with pytest.raises(UsageError, match=r"locked.jsonl' cannot be read \(Permission denied\); fix its"):
        read_conversations(path)


# ---------------------------------------------------------------------------- model dirs


def copy_model(src, dest, *, keep):
    dest.mkdir()
    for f in src.iterdir():
        if any(f.match(k) for k in keep):
            shutil.copy(f, dest / f.name)
    return dest


def test_eval_and_export_name_a_missing_model(run, tmp_path, capsys):
    gone = tmp_path / "moved-model"
    moved = run_with(run, tmp_path / "run", model=str(gone))
    for command in (["eval", "--run", str(moved)], ["export", "--run", str(moved), "--out",
                                                     str(tmp_path / "draft")]):
        fails_in_one_line(capsys, command, 2, f"target model path '{gone}' does not exist",
                          "hub ids are not downloaded")
    assert not (tmp_path / "draft").exists()


def test_eval_names_a_model_without_weights_or_tokenizer(workdir, run, tmp_path, capsys):  # noqa: F811
    no_weights = copy_model(workdir / "model", tmp_path / "no-weights", keep=["*.json"])
    fails_in_one_line(capsys, ["eval", "--run", str(run_with(run, tmp_path / "a", model=str(no_weights)))],
                      2, f"'{no_weights}' holds no weights (*.safetensors or pytorch_model*.bin)",
                      "config.json + *.safetensors")
    no_tok = copy_model(workdir / "model", tmp_path / "no-tok", keep=["config.json", "*.safetensors"])
    fails_in_one_line(capsys, ["eval", "--run", str(run_with(run, tmp_path / "b", model=str(no_tok)))],
                      2, f"'{no_tok}' holds no tokenizer files")
    # export reads only the config: a model without weights still exports
    main(["export", "--run", str(tmp_path / "a"), "--out", str(tmp_path / "draft"), "--dtype", "float32"])
    assert (tmp_path / "draft" / "config.json").is_file()


def test_check_model_dir(workdir, tmp_path):  # noqa: F811
    model = workdir / "model"
    assert check_model_dir(model, tokenizer=True) == model
    with pytest.raises(FileNotFoundError, match=r"'org/model' does not exist; pass a local directory"):
        check_model_dir("org/model")
    with pytest.raises(UsageError, match=r"is a file, not a directory"):
        check_model_dir(model / "config.json")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UsageError, match=rf"pass its directory '{tmp_path}' .*--gguf-file m.gguf"):
        check_model_dir(tmp_path / "m.gguf")
    with pytest.raises(UsageError, match=r"m.gguf' is truncated \(4 bytes end inside its header\)"):
        check_model_dir(tmp_path, "m.gguf", tokenizer=True)  # checked from its header (tests/test_hostile_files.py)
    with pytest.raises(FileNotFoundError, match=r"no GGUF file 'x.gguf' .*\['m.gguf'\]"):
        check_model_dir(tmp_path, "x.gguf")
    with pytest.raises(FileNotFoundError, match=r"holds no config.json and no weights"):
        check_model_dir(tmp_path)
    assert check_model_dir(copy_model(model, tmp_path / "cfg", keep=["config.json"]), weights=False)
    with pytest.raises(FileNotFoundError, match=r"holds no weights"):
        load_target(tmp_path / "cfg")
