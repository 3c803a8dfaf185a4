"""The benchmark scripts' own tools on CPU: plot.py's reading of step.py JSON (the plot
itself is checked by eye) and meta.py's run identity that every JSON carries."""

import dataclasses
import datetime
import importlib.metadata
import json
import subprocess
from pathlib import Path

import pytest
from recorders import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


load = load_benchmark


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def row(mode, density, ms, S=8192, pattern="tail"):
    return dict(S=S, pattern=pattern, mode=mode, density=density, median_ms=ms, peak_gib=1.0)


def test_later_file_wins_and_oom_rows_drop(tmp_path):
    """A point measured in two files is drawn once, from the later file; a NaN (out of
    memory) row is not drawn; distinct points all stay. Negative control: reading the
    files in the other order keeps the other value."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"results": [row("specforge", 0.1, 300.0), row("none", 0.1, 250.0),
                                             row("none", 0.3, float("nan"))]}))
    second.write_text(json.dumps({"results": [row("specforge", 0.1, 310.0), row("loss", 0.1, 200.0),
                                              row("none", 0.1, 260.0, pattern="scattered")]}))
    plot = load("plot")
    got = {(r["mode"], r["density"], r["pattern"]): r["median_ms"]
           for r in plot.load_rows((str(first), str(second)))}
    assert got == {("specforge", 0.1, "tail"): 310.0, ("none", 0.1, "tail"): 250.0,
                   ("loss", 0.1, "tail"): 200.0, ("none", 0.1, "scattered"): 260.0}
    swapped = {(r["mode"], r["density"]): r["median_ms"]
               for r in plot.load_rows((str(second), str(first))) if r["pattern"] == "tail"}
    assert swapped[("specforge", 0.1)] == 300.0


# ---- meta.py: the run identity in every benchmark JSON --------------------------------

def test_git_state_is_head_and_dirty_follows_the_tree(tmp_path, monkeypatch):
    """``commit`` is ``HEAD``'s hash; ``dirty`` turns on for an untracked file and for a
    changed tracked file, and off again once committed."""
    meta = load("meta")
    monkeypatch.delenv("EAGLE3FN_COMMIT", raising=False)
    monkeypatch.delenv("EAGLE3FN_DIRTY", raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-qm", "one")
    assert meta.git_state(tmp_path) == (git(tmp_path, "rev-parse", "HEAD"), False)
    (tmp_path / "new.py").write_text("y = 2\n")
    assert meta.git_state(tmp_path)[1] is True
    (tmp_path / "new.py").unlink()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert meta.git_state(tmp_path)[1] is True
    git(tmp_path, "commit", "-qam", "two")
    assert meta.git_state(tmp_path) == (git(tmp_path, "rev-parse", "HEAD"), False)


def test_outside_git_the_environment_names_the_commit(tmp_path, monkeypatch):
    """A copy of the tree without ``.git`` (the GPU machine's) is refused unless
    ``EAGLE3FN_COMMIT`` and ``EAGLE3FN_DIRTY`` say what it was copied from."""
    meta = load("meta")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repo above
    monkeypatch.delenv("EAGLE3FN_COMMIT", raising=False)
    monkeypatch.setenv("EAGLE3FN_DIRTY", "0")
    with pytest.raises(ValueError, match="EAGLE3FN_COMMIT"):
        meta.git_state(tmp_path)
    monkeypatch.setenv("EAGLE3FN_COMMIT", "abc123")
    monkeypatch.setenv("EAGLE3FN_DIRTY", "yes")
    with pytest.raises(ValueError, match="EAGLE3FN_DIRTY='yes'"):
        meta.git_state(tmp_path)
    monkeypatch.setenv("EAGLE3FN_DIRTY", "1")
    assert meta.git_state(tmp_path) == ("abc123", True)


def test_the_environment_wins_inside_another_checkout(tmp_path, monkeypatch):
    """A tree copied into (or beside a stale ``.git`` of) another checkout records what
    the environment says it was copied from, not that checkout's HEAD (the GPU
    machine's case: two session-10 JSONs recorded the stale HEAD before this)."""
    meta = load("meta")
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-qm", "one")
    monkeypatch.setenv("EAGLE3FN_COMMIT", "f00d")
    monkeypatch.setenv("EAGLE3FN_DIRTY", "0")
    assert meta.git_state(tmp_path) == ("f00d", False)
    monkeypatch.delenv("EAGLE3FN_COMMIT")
    monkeypatch.delenv("EAGLE3FN_DIRTY")
    assert meta.git_state(tmp_path) == (git(tmp_path, "rev-parse", "HEAD"), False)


def test_run_metadata_of_this_checkout():
    """Commit = ``git rev-parse HEAD`` of the repository, versions as installed, a UTC
    date, the arguments as given (tuples as lists)."""
    meta = load("meta")
    got = meta.run_metadata({"seq_lens": (2048, 8192), "head_chunk_rows": 4096})
    assert got["commit"] == git(ROOT, "rev-parse", "HEAD") and len(got["commit"]) == 40
    assert isinstance(got["dirty"], bool)
    assert got["torch"] == importlib.metadata.version("torch")
    assert set(meta.PACKAGES) <= set(got) and got["device"]
    assert datetime.datetime.fromisoformat(got["date"]).utcoffset() == datetime.timedelta(0)
    assert got["args"] == {"seq_lens": [2048, 8192], "head_chunk_rows": 4096}
    assert "null" not in json.dumps(got)


def test_a_null_argument_is_refused():
    """A ``None`` (a default the JSON would not pin down) is refused, naming the field,
    also inside a list; resolved values pass."""
    meta = load("meta")
    with pytest.raises(ValueError, match=r"\['head_chunk_rows', 'flex'\]"):
        meta.run_metadata({"head_chunk_rows": None, "iters": 6, "flex": [{}, None]})
    assert meta.check_resolved({"head_chunk_rows": 4096, "flex": [{}]}) == {
        "head_chunk_rows": 4096, "flex": [{}]}


def test_step_json_records_the_resolved_run(tmp_path):
    """``benchmarks/step.py``'s JSON carries the commit and the arguments the run used:
    ``head_chunk_rows`` as ``TTTConfig``'s default or as given, FlexAttention options
    ``{}`` for none. Negative control: its raw arguments hold nulls and are refused."""
    step, meta = load("step"), load("meta")
    from eagle3fn.unrolled import TTTConfig

    default = TTTConfig.__dataclass_fields__["head_chunk_rows"].default
    out = tmp_path / "step.json"
    step.write_json(step.BenchArgs(json=str(out)), 800.0, [row("none", 0.3, 250.0)])
    written = json.loads(out.read_text())
    assert written["commit"] == git(ROOT, "rev-parse", "HEAD")
    assert written["args"]["head_chunk_rows"] == default
    assert written["args"]["flex_kernel_options"] == {}
    assert "profile" not in written["args"] and written["args"]["json"] == str(out)
    assert written["results"] == [row("none", 0.3, 250.0)] and written["matmul_tflops"] == 800.0
    given = step.resolved_args(step.BenchArgs(head_chunk_rows=2048,
                                              flex_kernel_options='{"USE_TMA": true}'))
    assert given["head_chunk_rows"] == 2048 and given["flex_kernel_options"] == {"USE_TMA": True}
    with pytest.raises(ValueError, match="head_chunk_rows"):
        meta.run_metadata(dataclasses.asdict(step.BenchArgs()))


def test_attention_and_soft_ce_arguments_resolve():
    """The other JSON writers pass ``meta``'s check with their defaults: the attention
    benchmark's ``null`` kernel options become ``{}``, no output path is recorded as null."""
    meta, attention_py = load("meta"), load("attention")
    attention = attention_py.resolved_args(attention_py.AttnArgs(
        kernel_options=("null", '{"USE_TMA": true}')))
    assert attention["kernel_options"] == [{}, {"USE_TMA": True}] and "json" not in attention
    soft_ce = load("soft_ce").resolved_args(load("soft_ce").Args())
    for args in (attention, soft_ce):
        assert None not in meta.check_resolved(args).values()


def test_trace_summary_of_a_hand_made_trace(tmp_path):
    """trace_summary on a trace whose times are known: busy, span, idle (only gaps over
    the threshold), kinds by name, the split, and top-level CPU ops per thread with
    their top names (a nested op is not counted again: control, the nested one sits
    inside its parent, and it does count among the longest single host events). Also
    through main (gzip in, JSON out, the source run's commit recorded)."""
    import gzip

    ts = load("trace_summary")

    def dev(name, t, d, cat="kernel"):
        return {"cat": cat, "name": name, "ts": t, "dur": d}

    events = [dev("nvjet_sm90_tst_128x256", 10000, 1000), dev("void at::native::elementwise_kernel", 11100, 200),
              dev("Memcpy HtoD (Pinned -> Device)", 15000, 100, "gpu_memcpy"),  # a 3700 us gap before it
              dev("triton_tem_fused_flex_attention_0", 15100, 400), dev("triton_poi_fused_mul_0", 15600, 50),
              {"cat": "cpu_op", "ph": "X", "name": "aten::linear", "ts": 0, "dur": 500, "tid": 1},
              {"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 100, "dur": 300, "tid": 1},  # nested
              {"cat": "cpu_op", "ph": "X", "name": "aten::add", "ts": 600, "dur": 50, "tid": 1},
              {"cat": "cpu_op", "ph": "X", "name": "aten::add", "ts": 700, "dur": 30, "tid": 1},
              {"cat": "cpu_op", "ph": "X", "name": "MmBackward0", "ts": 0, "dur": 80, "tid": 2},
              {"cat": "cuda_runtime", "ph": "X", "name": "cudaStreamSynchronize", "ts": 1000, "dur": 2000,
               "tid": 1}]
    s = ts.summarise({"traceEvents": events}, split_ms=3.0, gap_us=500)
    assert (s["events"], s["span_ms"], s["busy_ms"]) == (5, 5.65, 1.75)
    assert (s["idle_ms"], s["idle_gaps"]) == (3.7, 1)  # the two 100 us gaps are under 500 us
    assert {k: v["count"] for k, v in s["by_kind"].items()} == {"gemm": 1, "other": 1, "copy": 1, "flex": 1,
                                                                 "triton": 1}
    assert (s["before"]["events"], s["after"]["events"], s["after"]["busy_ms"]) == (2, 3, 0.55)
    assert s["host"] == [
        {"thread": 1, "top_level_ops": 3, "ms": 0.58,
         "top": [{"name": "aten::linear", "count": 1, "ms": 0.5}, {"name": "aten::add", "count": 2, "ms": 0.08}]},
        {"thread": 2, "top_level_ops": 1, "ms": 0.08, "top": [{"name": "MmBackward0", "count": 1, "ms": 0.08}]}]
    assert [(e["name"], e["thread"], e["start_ms"], e["ms"]) for e in s["longest_host"][:3]] == [
        ("cudaStreamSynchronize", 1, 1.0, 2.0), ("aten::linear", 1, 0.0, 0.5), ("aten::mm", 1, 0.1, 0.3)]
    assert "python" not in s  # no Python stacks in this trace
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    (tmp_path / "bench.json").write_text(json.dumps({"commit": "abc", "dirty": False}))
    report = ts.main(ts.Args(trace=str(path), bench_json=str(tmp_path / "bench.json"),
                             out=str(tmp_path / "s.json")))
    assert json.loads((tmp_path / "s.json").read_text()) == report
    assert report["source_commit"] == "abc" and report["busy_ms"] == 1.75 and report["commit"]


def test_trace_summary_of_python_stacks(tmp_path):
    """The ``python`` block of a ``with_stack`` trace whose calls are known: the
    training thread is the one with the most calls (control: a reader thread's one
    long wait is longer); a recursive function counts its outer call only in
    inclusive time (control: 0.9 ms if the inner call were added again); self times
    and packages add up to the thread's time; addresses in C functions' names are
    dropped so that calls on two objects add up."""
    ts = load("trace_summary")

    def py(name, t, d, tid=1):
        return {"cat": "python_function", "ph": "X", "name": name, "ts": t, "dur": d, "tid": tid}

    run, compile_, forward = ("src/eagle3fn/train/loop.py(10): run", "torch/_dynamo/convert_frame.py(5): _compile",
                              "transformers/models/llama/modeling_llama.py(3): forward")
    events = [py(run, 0, 1000), py(compile_, 100, 600), py(compile_, 200, 300),
              py("<built-in method mm of type object at 0x7f00aa>", 250, 100), py(forward, 800, 150),
              py("<built-in method mm of type object at 0x7f99bb>", 820, 50),
              py("threading.py(300): wait", 0, 5000, tid=9)]
    s = ts.summarise({"traceEvents": events})
    p = s["python"]
    assert (p["thread"], p["calls"], p["ms"]) == (1, 6, 1.0)
    top = {f["name"]: (f["ms"], f["self_ms"], f["calls"]) for f in p["top"]}
    assert top == {run: (1.0, 0.25, 1), compile_: (0.6, 0.5, 2),
                   "<built-in method mm of type object>": (0.15, 0.15, 2), forward: (0.15, 0.1, 1)}
    assert [f["name"] for f in p["top_self"]][:2] == [compile_, run]
    assert p["by_package"] == {"torch/_dynamo": 0.5, "eagle3fn": 0.25, "builtins": 0.15, "transformers": 0.1}
    assert sum(p["by_package"].values()) == pytest.approx(p["ms"])
    assert p["by_package_inclusive"] == {"eagle3fn": 1.0, "torch/_dynamo": 0.6, "builtins": 0.15,
                                         "transformers": 0.15}
    assert s["longest_host"] == [] and s["host"] == []  # Python calls are not host operators
    path = tmp_path / "py.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = ts.main(ts.Args(trace=str(path), out=str(tmp_path / "py.json"), python_top=2))
    assert [f["name"] for f in report["python"]["top"]] == [run, compile_]
