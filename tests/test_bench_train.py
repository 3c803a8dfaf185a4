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
    args = bench.BenchArgs(shape="tiny", device="cpu", loops=("online", "offline"), modes=("loss",), steps=3,
                           warmup_steps=1, batch_size=2, max_length=64, length_scale=1 / 32,
                           work_dir=str(work), out=str(out), packs=(False, True), profile_step=2,
                           trace_dir=str(tmp_path / "traces"))
    try:
        result = bench.main(args)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["results"] == result["results"]
    assert saved["args"]["max_length"] == 64 and saved["args"]["device"] == "cpu" and saved["commit"]
    rows = {(r["loop"], r["mode"]): r for r in result["results"]}
    assert set(rows) == {(loop, mode) for loop in ("online", "offline") for mode in ("loss", "loss+pack", "specforge")}
    packed = {loop: rows.pop((loop, "loss+pack")) for loop in ("online", "offline")}

    # The padding every run measured is the hand count over the tokenized data.
    examples = tokenize_file(work / "data.jsonl", AutoTokenizer.from_pretrained(work / "target"), max_length=64)
    lengths = [len(e) for e in examples]
    assert len(lengths) == 6
    slots = sum(2 * max(lengths[i:i + 2]) for i in range(0, 6, 2))
    hand = 1 - sum(lengths) / slots
    assert result["data"]["padding_frac"] == pytest.approx(hand, abs=1e-4)

    for key, r in rows.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["steps"] == 3 and r["warmup_steps"] == 1 and r["batches_match"]
        assert r["padding_frac"] == pytest.approx(hand, abs=1e-4), key
        assert 0 < r["tokens_per_s"] < r["padded_tokens_per_s"]
        assert r["ms_per_step_median"] > 0 and r["startup_s"] >= 0 and r["to_steady_s"] > r["startup_s"]
        assert len(r["step_ms"]) == 2 and min(r["step_ms"]) <= r["ms_per_step_median"] <= max(r["step_ms"])
        assert isinstance(r["recompiles_after_warmup"], int) and r["recompiles_after_warmup"] >= 0
        assert r["recompile_limit_hits"] == 0  # nothing compiles on the CPU
        assert 0 < r["floor_trim_frac"] < r["floor_dense_frac"]
        assert r["peak_gib"] is None and r.get("gpu_busy_pct") is None  # CUDA and nvidia-smi only
        if key[1] != "specforge":  # the eagle3fn process's warm-up profile, step 2 under the profiler
            assert isinstance(r["compile_profile"], dict) and len(r["warmup_step_s"]) == 1, key
            assert r["sync_sites"] == [], key  # step 1 under CUDA's sync debug mode: none on a CPU
            p = r["profile"]
            assert (tmp_path / "traces" / f"{key[0]}-{key[1]}.trace.json.gz").stat().st_size > 1000
            assert p["step"] == 2 and p["wall_ms"] > 0 and p["aten_ops"] > 100, (key, p)
            assert p["device_ms"] == 0 and p["launches"] == 0 and p["top_self_cpu"], (key, p)  # a CPU
    assert rows[("offline", "loss")]["input_wait_frac"] >= 0
    # the probe's input wait is the loop's own (metrics.jsonl input_wait_s), step by step
    from eagle3fn.train.metrics import read_metrics

    waits = [s["load_s"] for s in json.loads((work / "logs" / "offline-loss.json").read_text())["steps"]]
    logged = [r["input_wait_s"] for r in read_metrics(work / "logs" / "offline-loss.metrics.jsonl")
              if r.get("split") != "eval"]
    assert waits == pytest.approx(logged, abs=1e-6) and len(waits) == 3
    for loop in ("online", "offline"):
        mine, theirs = rows[(loop, "loss")], rows[(loop, "specforge")]
        assert mine["vs_specforge"] == pytest.approx(mine["tokens_per_s"] / theirs["tokens_per_s"], rel=1e-2)
        assert mine["command"].startswith("python -m eagle3fn.cli train ")
    assert result["prepare"]["seconds"] > 0
    assert 0 < result["data"]["assistant_share"] < 1

    # Packed (--pack): every conversation once, in rows of max_length (the last batch
    # may hold fewer rows); the floors from the data's mean FLOPs per token.
    for loop, r in packed.items():
        assert "error" not in r and "--pack" in r["command"].split(), (loop, r)
        record = json.loads((work / "logs" / f"{loop}-loss+pack.json").read_text())["steps"]
        assert sum(s["tokens"] for s in record) == sum(lengths)
        assert all(s["padded"] == 2 * 64 for s in record[:-1]) and record[-1]["padded"] in (64, 128)
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
