"""Issue 37, deliverable 6: hostile inputs generated, not hand-listed, through the real
CLI entry (``eagle3fn.cli.main.main`` in process, a few as real subprocesses). For every
case: a clean non-zero exit with one ``eagle3fn: error:`` line naming the input, or the
documented behaviour with a result that checks out (every line of a data file accounted
for: used, dropped for having no supervised token, or skipped, as printed); never a
traceback, never exit 0 with a wrong result.

Generated: JSONL lines for the data files of ``vocab`` (and a few fixed ones through
``prepare``, ``train`` and ``eval --prompts``), flag values of ``train``. Cache manifests
are mutated in tests/test_hostile_cache.py, broken weight and checkpoint files are in
tests/test_hostile_files.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recorders import WORDS, save_tiny_target, write_tiny_chat
from test_hostile_cache import cli  # the real CLI entry in process: (exit code, stdout, stderr)

from eagle3fn.cli.main import main

pytestmark = pytest.mark.usefixtures("no_gpu", "one_thread")
FAST = settings(max_examples=40, suppress_health_check=list(HealthCheck), deadline=None)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, no_gpu):
    d = tmp_path_factory.mktemp("hostile-inputs")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 4)
    return d


def clean_refusal(code, out, err, *needles):
    """Non-zero, one error line holding every needle, no traceback."""
    assert code not in (0, None), (code, out, err)
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.startswith("eagle3fn: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- JSONL lines ---------------------------------------------------------------------

TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
ROLE = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "observation"])
VALID = st.one_of(
    st.builds(lambda u, a: {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]},
              TEXT, TEXT),
    st.builds(lambda u, a: {"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": a}]},
              TEXT, TEXT),
)
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                        lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=8), x, max_size=3),
                        max_leaves=8)
TURN = st.dictionaries(st.sampled_from(["role", "content", "from", "value", "tool_calls", "name"]),
                       ANY_JSON | ROLE | TEXT, max_size=3)
HOSTILE_OBJECTS = st.one_of(
    ANY_JSON,
    st.fixed_dictionaries({"messages": st.lists(TURN, max_size=4)}),
    st.fixed_dictionaries({"conversations": st.lists(TURN, max_size=4)}),
    st.fixed_dictionaries({"messages": ANY_JSON}),
    st.builds(lambda v, k: {**v, k: None}, VALID, st.sampled_from(["messages", "conversations", "tools",
                                                                   "system"])),
    st.builds(lambda v, t: {**v, "tools": t}, VALID, ANY_JSON),
    st.builds(lambda v, s: {**v, "system": s}, VALID, ANY_JSON),
)
RAW = st.one_of(
    st.binary(max_size=30).filter(lambda b: b"\n" not in b and b"\r" not in b),
    st.sampled_from([b"{", b"[]", b"null", b"NaN", b'{"messages": [}', b"\xef\xbb\xbf{}", b"\xff\xfe",
                     b'{"messages": [{"role": "user", "content": "\xff"}]}', b"1e999999", b"[" * 5000]),
)


def as_line(x) -> bytes:
    return x if isinstance(x, bytes) else json.dumps(x).encode()


LINES = st.lists(st.one_of(VALID.map(as_line), HOSTILE_OBJECTS.map(as_line), RAW), min_size=1, max_size=4)


def counted(err: str, pattern: str) -> int:
    m = re.search(pattern, err)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_generated_jsonl_through_vocab(workdir, tmp_path_factory, capsys, on_error):
    """Each file either fails on one named line (``raise``; ``skip`` only when nothing
    usable remains) or every non-blank line is accounted for: used, dropped (no
    supervised token) or skipped, as printed. Files of valid lines only always pass."""
    root = tmp_path_factory.mktemp(f"jsonl-{on_error}")
    data, out = root / "chat.jsonl", root / "vocab.safetensors"

    @FAST
    @given(LINES, st.booleans())
    def check(lines, all_valid):
        if all_valid:
            lines = [as_line(v) for v in [{"messages": [{"role": "user", "content": "hello"},
                                                        {"role": "assistant", "content": "hello friend"}]}]]
        data.write_bytes(b"".join(line + b"\n" for line in lines))
        out.unlink(missing_ok=True)
        code, stdout, err = cli(capsys, ["vocab", "--model.path", str(workdir / "model"), "--data.path", str(data),
                                         "--draft-vocab-size", "8", "--out", str(out), "--data.on-error", on_error])
        assert "Traceback" not in stdout + err, err
        nonblank = sum(1 for line in lines if line.strip())
        if code == 0:
            used = counted(stdout, r"from (\d+) conversations")
            dropped = counted(err, r"dropped (\d+) conversations")
            skipped = counted(err, r"skipped (\d+) of")
            assert used >= 1 and out.is_file(), (lines, stdout, err)
            assert used + dropped + skipped == nonblank, (lines, stdout, err)
            assert on_error == "skip" or skipped == 0
            return
        assert not all_valid, err
        line = clean_refusal(code, stdout, err, str(data))
        assert on_error == "raise" or "no usable" in line or "nothing" in line or "no conversation" in line \
            or "empty" in line or ":" in line, line
    check()


FIXED_BAD = {
    "not JSON": (b"{", ":1: "),
    "unknown role": (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), ":1: "),
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', ":1: not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(FIXED_BAD))
def test_bad_lines_through_prepare_train_and_eval(workdir, tmp_path, capsys, case, eval_run):
    raw, needle = FIXED_BAD[case]
    data = tmp_path / "bad.jsonl"
    data.write_bytes(raw + b"\n")
    model = str(workdir / "model")
    for argv in (["prepare", "--model.path", model, "--data.path", str(data), "--out", str(tmp_path / "c")],
                 ["train", "--model", model, "--data", str(data), "--out-dir", str(tmp_path / "r"),
                  "--max-length", "256"],
                 ["eval", "--run", str(eval_run), "--prompts", str(data), "--max-new-tokens", "2"]):
        line = clean_refusal(*cli(capsys, argv), f"{data}{needle}")
        assert "on_error=" not in line, line  # hints name the flag a user types
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def eval_run(workdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    main(["train", "--model", str(workdir / "model"), "--data", str(workdir / "chat.jsonl"), "--out-dir", str(out),
          "--max-steps", "1", "--draft-vocab-size", "32", "--ttt-length", "2", "--no-pack", "--max-length", "256"])
    return out


# ---- flag values ---------------------------------------------------------------------

NUMERIC_FLAGS = ["--lr", "--max-length", "--batch-size", "--epochs", "--warmup-ratio", "--grad-clip", "--ttt-length",
                 "--draft-vocab-size", "--max-steps", "--seed", "--pack-length", "--weight-decay", "--grad-accum"]
VALUES = st.one_of(st.integers(-2**65, 2**65).map(str), st.floats().map(str),
                   st.sampled_from(["", "nan", "inf", "-inf", "1e309", "0x10", "1_000", "None", "abc", "--x", " 3"]))


def test_generated_train_flag_values(workdir, tmp_path_factory, capsys):
    """Any value of a numeric flag, with a model path that does not exist: the flag is
    refused at parse (tyro's box) or the path is named (one line); exit 2 either way,
    no traceback, nothing written."""
    root = tmp_path_factory.mktemp("flags")

    @FAST
    @given(st.lists(st.tuples(st.sampled_from(NUMERIC_FLAGS), VALUES), min_size=1, max_size=3))
    def check(flags):
        argv = ["train", "--model", str(root / "no-model"), "--data", str(workdir / "chat.jsonl"),
                "--out-dir", str(root / "out")]
        for flag, value in flags:
            argv += [flag, value]
        code, out, err = cli(capsys, argv)
        assert code == 2, (flags, out, err)
        assert "Traceback" not in out + err, err
        if "eagle3fn: error:" in err:
            clean_refusal(code, out, err)
        assert not (root / "out").exists()
    check()


# ---- a few through real processes ----------------------------------------------------

def test_real_processes(workdir, tmp_path):
    """The console path end to end: a bad data line, a missing cache, a broken weight
    file; each one line on stderr with its exit code."""
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"{\n")
    model = tmp_path / "model"
    import shutil

    shutil.copytree(workdir / "model", model)
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:1000])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = [
        (["vocab", "--model.path", str(workdir / "model"), "--data.path", str(data), "--out",
          str(tmp_path / "v.safetensors")], 2, f"{data}:1: "),
        (["cache", "verify", str(tmp_path / "nothing")], 2, f"no manifest.json in {tmp_path / 'nothing'}"),
        (["prepare", "--model.path", str(model), "--data.path", str(workdir / "chat.jsonl"), "--out",
          str(tmp_path / "c")], 2, f"weight file '{model / 'model.safetensors'}' is truncated (1000 bytes"),
    ]
    for argv, code, needle in cases:
        p = subprocess.run([sys.executable, "-m", "eagle3fn.cli", *argv], capture_output=True, text=True, env=env)
        assert p.returncode == code, p.stderr
        assert "Traceback" not in p.stderr
        lines = [line for line in p.stderr.splitlines() if line.startswith("eagle3fn: error:")]
        assert len(lines) == 1 and needle in lines[0], p.stderr
