"""benchmarks/eval.py on the CPU: the tiny shape end to end (build, warm-up, the plain
and the instrumented runs, the JSON and the table, both ``generate`` implementations,
``--dtype``), the split of its time into target forwards and overhead checked against
the forward count, and ``evaluation.StageTimes``: its stages add up to no more than
the wall time and count every round."""

import json

import pytest
from recorders import load_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/eval.py`` as a module."""
    return load_benchmark("eval")


@pytest.mark.parametrize("impl, dtype", [(None, "auto"), ("static", "float64")])
def test_tiny_cpu_run(bench, tmp_path, capsys, impl, dtype):
    out = tmp_path / "eval.json"
    args = bench.EvalBenchArgs(shape="tiny", prompts=5, prompt_length=12, max_new_tokens=10, batch_size=3,
                               num_draft_tokens=3, device="cpu", work_dir=str(tmp_path / "work"), out=str(out),
                               impl=impl, dtype=dtype)
    report = bench.main(args)
    r = report["result"]
    assert json.loads(out.read_text())["result"]["rounds"] == r["rounds"]
    assert report["args"]["prompts"] == 5 and report["commit"] and report["device"].startswith("cpu")
    assert report["args"]["impl"] == (impl or "dynamic")
    assert report["args"]["dtype"] == ("float32" if dtype == "auto" else dtype)
    assert r["n_prompts"] == 5 and r["tokens"] == 5 * 10  # no EOS: every prompt runs to the end
    # Per prompt: one prefill token, then rounds of accepted + 1 <= k + 1 = 4 tokens.
    assert r["rounds"] >= 5 * 3 and r["target_forwards"] == r["rounds"] + 5
    assert r["verify_ms"] > 0 and r["decode_ms"] > 0 and r["overhead_ms_per_round"] > 0
    assert r["overhead_frac"] == pytest.approx(r["overhead_ms_per_round"] / r["verify_ms"])
    assert r["draft_chain_ms"] > 0 and r["draft_context_ms"] > 0 and r["bookkeeping_ms"] > 0
    assert r["draft_chain_ms"] + r["draft_context_ms"] + r["bookkeeping_ms"] == pytest.approx(
        r["overhead_ms_per_round"])
    assert r["record_s"] == r["cold_record_s"] == 0.0  # no CUDA graphs on the CPU
    assert r["same_as_target"] == 5  # fp32 CPU greedy: the speculative output is the target's
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("speedup ") and "of a verifying forward" in printed[-1]
    assert printed[-2].startswith("per round: verify ") and "draft chain" in printed[-2]


def test_forward_timer_counts_every_target_forward(bench):
    """The instrumented split sees every target forward of ``generate`` (prefill + one
    per round), and restores the real function (control: the count without it is 0)."""
    import torch

    import eagle3fn.evaluation as spec
    from eagle3fn.evaluation import kv
    from spec_setup import make_draft, make_target

    target = make_target()
    params, cfg, d2t = make_draft(target)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9])]
    real = kv.target_forward
    with bench.ForwardTimer(kv, torch.device("cpu")) as timer:
        out = spec.generate(target, None, params, cfg, d2t, prompts, spec.SpecConfig(num_draft_tokens=2,
                                                                                     max_new_tokens=6))
    assert kv.target_forward is real
    rounds = max(len(r.accepted_per_round) for r in out)  # the batch runs until its last row ends
    assert [n for n, _ in timer.calls] == [3] + [3] * rounds  # prefill of 3 tokens, then k + 1 = 3
    assert len(timer.calls) == 1 + rounds and all(ms > 0 for _, ms in timer.calls)


@pytest.mark.parametrize("impl", ["static", "dynamic"])
def test_stage_times_split_a_run(impl):
    """Every round is counted once per batch (one verifying forward each), each stage
    took time, no graph was recorded on the CPU, and the stages add up to no more than
    the wall time."""
    import torch

    import eagle3fn.evaluation as spec
    from eagle3fn.evaluation import kv
    from spec_setup import make_draft, make_target

    target = make_target()
    params, cfg, d2t = make_draft(target)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9])]
    config = spec.SpecConfig(num_draft_tokens=2, max_new_tokens=6)
    stages = spec.StageTimes()
    with bench_timer(kv) as calls:
        out = spec.generate(target, None, params, cfg, d2t, prompts, config, impl=impl, stages=stages)
    assert stages.rounds == max(len(r.accepted_per_round) for r in out) == len(calls) - 1
    parts = (stages.prefill_s, stages.verify_s, stages.draft_context_s, stages.draft_chain_s)
    assert all(t > 0 for t in parts) and stages.record_s == 0.0
    assert sum(parts) <= stages.total_s


def bench_timer(kv):
    """Records the target forwards of a ``generate`` (their token counts): ``kv.target_forward``
    wrapped while the context is open."""
    import contextlib

    @contextlib.contextmanager
    def recording():
        calls, real = [], kv.target_forward

        def counted(target, ids_BN, *a, **k):
            calls.append(ids_BN.shape[1])
            return real(target, ids_BN, *a, **k)
        kv.target_forward = counted
        try:
            yield calls
        finally:
            kv.target_forward = real
    return recording()
