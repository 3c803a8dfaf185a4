"""``eagle3fn.evaluation``: the greedy output check, the (k, batch size) sweep, and the
acceptance length implied by training-time accuracy.

Oracles: transformers' own greedy forward (identity), ``evaluation.evaluate`` for one
configuration (sweep), brute-force enumeration of acceptance patterns (implied length).
Controls: a corrupted speculative output where the target is not in doubt is raised; a
difference at an exact tie is not; a sweep whose greedy rounds depended on the batch
size would be caught by comparing batch sizes.
"""

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from eagle3fn.evaluation import (
    OutputMismatch, SpecConfig, check_identity, evaluate, implied_acceptance_length, sweep, target_generate,
)
from spec_setup import make_draft, make_target
from test_train import workdir  # noqa: F401 - the tiny target + data fixture

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ([5], [17, 3, 99, 42], [7, 7, 1, 64, 120, 33, 2, 9], [44, 12], [3, 8, 8])


@pytest.fixture(scope="module")
def target():
    return make_target()


def prompts():
    return [torch.tensor(p) for p in PROMPTS]


def test_identity_passes_identical_and_raises_a_real_difference(target):
    alone = target_generate(target, None, prompts(), SpecConfig(max_new_tokens=6))
    report = check_identity(target.model, prompts(), alone, alone)
    assert report.identical == len(PROMPTS) and not report.near_ties
    assert report.line() == f"{len(PROMPTS)}/{len(PROMPTS)} outputs identical to the target's own"
    wrong = [list(a) for a in alone]
    logits = target.model(input_ids=torch.tensor([PROMPTS[1] + wrong[1][:2]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])  # the runner-up: a clear gap in fp64
    wrong[1][2] = second
    with pytest.raises(OutputMismatch, match=r"prompt 1: .* at new token 2 .*not a near-tie"):
        check_identity(target.model, prompts(), alone, wrong)
    early = [list(a) for a in alone]
    early[0] = early[0][:3]
    with pytest.raises(OutputMismatch, match="stops early at token 3"):
        check_identity(target.model, prompts(), alone, early)


class _Tied(torch.nn.Module):
    """Logits equal for tokens 1 and 2 (an exact tie) and lower elsewhere."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))

    def forward(self, input_ids, logits_to_keep=1):
        z = torch.full((1, 1, 8), -5.0)
        z[..., 1] = z[..., 2] = 3.0
        return type("Out", (), {"logits": z})()


def test_identity_reports_a_near_tie_and_its_tolerance():
    report = check_identity(_Tied(), [torch.tensor([4])], [[0, 1, 5]], [[0, 2, 6]])
    assert report.identical == 0 and len(report.near_ties) == 1
    d = report.near_ties[0]
    assert (d.prompt, d.position, d.target_token, d.spec_token, d.gap) == (0, 1, 1, 2, 0.0)
    assert "1 diverging at an argmax near-tie" in report.line()
    with pytest.raises(OutputMismatch):  # control: 1 vs 5 is a gap of 8
        check_identity(_Tied(), [torch.tensor([4])], [[0, 1, 5]], [[0, 5, 6]])


@pytest.mark.parametrize("acc", [[0.9, 0.5, 0.25], [1.0, 0.0, 1.0], [0.3, 0.8, 0.6, 0.1]])
def test_implied_length_is_the_expected_length_of_independent_accepts(acc):
    for k in range(len(acc) + 1):
        expected = 0.0  # brute force over which draft tokens would be accepted
        for pattern in itertools.product([0, 1], repeat=k):
            p = 1.0
            for a, x in zip(acc, pattern):
                p *= a if x else 1 - a
            run = next((i for i, x in enumerate(pattern) if not x), k)
            expected += p * (run + 1)
        assert implied_acceptance_length(acc, k) == pytest.approx(expected, abs=1e-12)


def test_sweep_matches_evaluate_per_configuration(target):
    params, cfg, d2t = make_draft(target, dtype=torch.float64)
    seen = []
    out = sweep(target, params, cfg, d2t, prompts(), ks=(1, 3), batch_sizes=(1, 2, 5),
                max_new_tokens=8, log=lambda s: None, on_row=lambda rows: seen.append(list(rows)))
    rows = out["rows"]
    assert seen == [rows[:n] for n in range(1, 7)]  # after every configuration, the rows so far
    assert [(r["batch_size"], r["k"]) for r in rows] == [(b, k) for b in (1, 2, 5) for k in (1, 3)]
    for k in (1, 3):
        one = evaluate(target, params, cfg, d2t, prompts(), SpecConfig(num_draft_tokens=k, max_new_tokens=8),
                       batch_size=2)
        same_k = [r for r in rows if r["k"] == k]
        for r in same_k:  # greedy rounds do not depend on the batch: the same counts at every size
            assert r["acceptance_length"] == one["acceptance_length"]
            assert r["per_position_acceptance"] == one["per_position_acceptance"]
            assert r["rounds"] == one["rounds"] and r["tokens"] == one["tokens"]
            assert r["identical"] == len(PROMPTS) and r["near_ties"] == 0
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["target_tokens_per_s"])
    for b in (1, 2, 5):
        assert out["best"][b] is max((r for r in rows if r["batch_size"] == b), key=lambda r: r["speedup"])


def test_eval_cli_sweep_prints_a_table_and_writes_json(workdir, tmp_path, capsys):  # noqa: F811
    from eagle3fn.cli.main import main
    from eagle3fn.train import train
    from test_train import config

    out = tmp_path / "run"
    train(config(workdir, out, max_steps=1), log=lambda s: None)
    capsys.readouterr()
    path = tmp_path / "eval.json"
    main(["eval", "--run", str(out), "--prompts", str(workdir / "chat.jsonl"), "--num-prompts", "2",
          "--max-new-tokens", "4", "--num-draft-tokens", "1", "2", "--batch-size", "1", "2",
          "--json", str(path)])
    printed = capsys.readouterr().out
    assert printed.count("<- best k") == 2 and "implied" in printed
    assert "every configuration: 2/2 outputs identical to the target's own" in printed
    record = json.loads(path.read_text())
    rows = record["result"]["rows"]
    assert "partial" not in record["result"]  # the last write is the whole result
    assert len(rows) == 4 and record["args"]["num_draft_tokens"] == [1, 2]
    assert set(record["result"]["best"]) == {"1", "2"}
    assert all(1.0 <= r["implied_acceptance_length"] <= 1 + r["k"] for r in rows)
    # provenance: this checkout's commit (git's, or the environment's for a copied tree)
    import subprocess

    import eagle3fn

    head = subprocess.run(["git", "-C", str(Path(eagle3fn.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or None
    assert record["commit"] == (os.environ.get("EAGLE3FN_COMMIT") or head)
    assert record["eagle3fn"] == eagle3fn.__version__ and record["torch"] == torch.__version__


def test_eval_json_refuses_a_misspelt_dirty_flag_before_loading(tmp_path, monkeypatch, capsys):
    """``EAGLE3FN_DIRTY`` other than 0 or 1 (``false`` once recorded a clean GPU tree as
    dirty) stops ``eagle3fn eval --json`` with a one-line error naming the fix, before
    the run is even read (the run directory here does not exist). Control: 0 passes that
    check and fails later, on the missing run."""
    from eagle3fn.cli.main import main

    args = ["eval", "--run", str(tmp_path / "missing"), "--json", str(tmp_path / "e.json")]
    monkeypatch.setenv("EAGLE3FN_COMMIT", "abc123")
    monkeypatch.setenv("EAGLE3FN_DIRTY", "false")
    with pytest.raises(SystemExit):
        main(args)
    assert "EAGLE3FN_DIRTY='false': set it to 0" in capsys.readouterr().err
    monkeypatch.setenv("EAGLE3FN_DIRTY", "0")
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err
    assert "EAGLE3FN_DIRTY" not in err and "missing" in err


def test_the_two_sides_are_timed_batch_by_batch_in_alternating_order(monkeypatch):
    """``interleaved`` runs both sides on each batch before the next, the side that goes
    first alternating, and sums each side's own seconds: on a machine that slows down
    during the measurement (a fake clock: every call costs one unit more than the one
    before) two equal sides get equal times. Control: timing one side's batches and then
    the other's, on the same machine, does not."""
    from eagle3fn.evaluation import timing

    now, calls, cost = [0.0], [], [0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def side(name):
        def run(batch):
            calls.append((name, batch[0]))
            cost[0] += 1
            now[0] += cost[0]  # the machine slows down call by call
            return [name + str(b) for b in batch]
        return run

    batches = [[0], [1], [2], [3]]
    outputs, seconds = timing.interleaved([side("s"), side("a")], batches, torch.device("cpu"))
    assert calls == [("s", 0), ("a", 0), ("a", 1), ("s", 1), ("s", 2), ("a", 2), ("a", 3), ("s", 3)]
    assert outputs == [["s0", "s1", "s2", "s3"], ["a0", "a1", "a2", "a3"]]
    assert seconds == [1 + 4 + 5 + 8, 2 + 3 + 6 + 7]
    cost[0] = 0  # the control: one side after the other
    _, first = timing.interleaved([side("s")], batches, torch.device("cpu"))
    _, second = timing.interleaved([side("a")], batches, torch.device("cpu"))
    assert (first[0], second[0]) == (1 + 2 + 3 + 4, 5 + 6 + 7 + 8)


def test_identity_summary_names_the_configurations_of_each_identity():
    """A sweep whose configurations agree prints one identity; otherwise each identity
    with the batches and ks that gave it (the control: one k that differs is named)."""
    from eagle3fn.cli.run import identity_summary

    same, other = "16/16 outputs identical to the target's own", "10/16 outputs identical to the target's own"
    rows = [{"batch_size": 1, "k": k, "identity": same} for k in range(1, 8)]
    assert identity_summary(rows) == f"every configuration: {same}"
    rows[-1]["identity"] = other
    rows.append({"batch_size": 4, "k": 2, "identity": other})
    assert identity_summary(rows) == f"{same} at batch 1, k = 1-6; {other} at batch 1, k = 7, batch 4, k = 2"
