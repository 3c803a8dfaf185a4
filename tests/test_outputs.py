"""Outputs never overwrite what is not ours (``io.paths``): ``export``, ``vocab`` and
``prepare`` refuse a target holding someone else's files, before any work, with one
line naming what is there and the fix, unless ``--overwrite``; what the same command
wrote is rewritten freely; files are renamed into place whole. ``prepare`` stopped by
SIGTERM finishes its shard and the rerun completes the same cache."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_errors import fails_in_one_line
from test_train import config, workdir  # noqa: F401 - the tiny target + data fixture

from eagle3fn.cli.main import main
from eagle3fn.io.cache import MANIFEST
from eagle3fn.io.paths import MARKER, atomic_write, path_kind
from eagle3fn.train import train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(workdir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("outputs") / "run"
    train(config(workdir, out, epochs=1, max_steps=1), log=lambda s: None)
    return out


def test_export_refuses_another_models_directory(run, tmp_path, capsys):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    before = (other / "config.json").read_bytes()
    fails_in_one_line(capsys, ["export", "--run", str(run), "--out", str(other)], 2,
                      f"--out {other} is not empty (config.json) and was not written by eagle3fn export",
                      "--overwrite")
    assert (other / "config.json").read_bytes() == before and sorted(os.listdir(other)) == ["config.json"]
    main(["export", "--run", str(run), "--out", str(other), "--overwrite"])
    assert json.loads((other / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_export_rewrites_its_own_export_and_fills_an_empty_directory(run, tmp_path, capsys):
    out = tmp_path / "draft"
    out.mkdir()  # empty: ours
    main(["export", "--run", str(run), "--out", str(out)])
    assert json.loads((out / MARKER).read_text())["written_by"] == "eagle3fn export"
    main(["export", "--run", str(run), "--out", str(out), "--format", "speculators"])  # the same command
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert sorted(os.listdir(out)) == sorted([MARKER, "config.json", "model.safetensors"])  # no temp file left
    fails_in_one_line(capsys, ["export", "--run", str(run), "--out", str(out / "config.json")], 2,
                      "is a file, not a directory")


def _vocab(workdir, out, *extra):  # noqa: F811
    return ["vocab", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
            "--draft-vocab-size", "40", "--out", str(out), *extra]


def test_vocab_out_a_directory_fails_before_the_work(workdir, tmp_path, capsys, monkeypatch):  # noqa: F811
    import eagle3fn.io.data

    def no_work(*a, **k):
        raise AssertionError("tokenized before the output was checked")

    monkeypatch.setattr(eagle3fn.io.data, "tokenize_file", no_work)
    fails_in_one_line(capsys, _vocab(workdir, tmp_path), 2, f"--out {tmp_path} is a directory",
                      f"--out {tmp_path / 'vocab.safetensors'}")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("mine\n")
    fails_in_one_line(capsys, _vocab(workdir, foreign), 2, "exists and was not written by eagle3fn vocab",
                      "--overwrite")
    assert foreign.read_text() == "mine\n"


def test_vocab_replaces_its_own_map_and_a_foreign_file_with_overwrite(workdir, tmp_path):  # noqa: F811
    out = tmp_path / "vocab.safetensors"
    main(_vocab(workdir, out))
    main(_vocab(workdir, out))  # ours: replaced without --overwrite
    foreign = tmp_path / "notes.txt"
    foreign.write_text("mine\n")
    main(_vocab(workdir, foreign, "--overwrite"))
    assert path_kind(foreign) == "a file" and foreign.read_bytes()[:8] != b"mine\n"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "vocab.safetensors"]  # no temp file left


def _prepare(workdir, out, *extra):  # noqa: F811
    return ["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
            "--out", str(out), "--batch-size", "2", "--storage", "float32", *extra]


def test_prepare_refuses_a_directory_that_holds_no_cache(workdir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "cache"
    out.mkdir()
    (out / "weights.bin").write_bytes(b"x")
    fails_in_one_line(capsys, _prepare(workdir, out), 2, "is not empty (weights.bin)",
                      "was not written by eagle3fn prepare")
    main(_prepare(workdir, out, "--overwrite"))
    assert (out / MANIFEST).is_file() and (out / "weights.bin").read_bytes() == b"x"
    main(_prepare(workdir, out))  # a cache: its own manifest makes it ours (and resumable)


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]


def test_prepare_stopped_by_sigterm_finishes_its_shard_and_the_rerun_completes(workdir, tmp_path):  # noqa: F811
    from recorders import write_tiny_chat

    write_tiny_chat(tmp_path / "chat.jsonl", 10)
    (tmp_path / "model").symlink_to(workdir / "model")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eagle3fn.cli", *_prepare(tmp_path, tmp_path / "stopped")[:-4], "--batch-size",
           "1", "--storage", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:  # signal once the second shard is written
        if line.startswith("wrote shard-000001"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    stop = [x for x in err.splitlines() if x.startswith("stopped by SIGTERM at shard-")]
    assert len(stop) == 1 and stop[0].endswith("; rerun the same command to resume"), err[-2000:]
    manifest = json.loads((tmp_path / "stopped" / MANIFEST).read_text())
    assert not manifest["complete"] and 2 <= len(manifest["shards"]) < 10
    assert not [n for n in os.listdir(tmp_path / "stopped") if n.endswith(".tmp")]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    whole = tmp_path / "whole"
    main(_prepare(tmp_path, whole, "--batch-size", "1"))
    a, b = (json.loads((d / MANIFEST).read_text()) for d in (whole, tmp_path / "stopped"))
    assert a["complete"] and b["complete"] and a["shards"] == b["shards"]  # same names, sizes and sha256
