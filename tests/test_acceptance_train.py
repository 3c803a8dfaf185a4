"""Acceptance length during training: each held-out evaluation decodes the first
``eval_accept_prompts`` held-out prompts by speculative decoding, records the acceptance
length in metrics.jsonl, and keeps the best one's checkpoint as checkpoint-best.pt
(``eagle3fn export --best``); a resume keeps the best record.

The recorded value equals the uncached one-prompt twin (``speculative_generate``) run
on the saved checkpoint; scripted acceptance values check the selection: the best
checkpoint is the step with the highest value (controls: a later, better step replaces
it; a resume that forgot the record would replace it with a worse one).
"""

import json

import pytest
import torch

import eagle3fn.train.loop as loop
from eagle3fn.evaluation import SpecConfig, acceptance_stats, speculative_generate
from eagle3fn.train import CHECKPOINT, METRICS, TrainConfig, load_run, train
from eagle3fn.train.checkpoint import BEST
from test_train import config, workdir  # noqa: F401 - the tiny target + data fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny runs: 2 threads crawl on a busy CPU


def eval_rows(out):
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    return [r for r in rows if r.get("split") == "eval"]


def scripted(monkeypatch, values):
    """``holdout_acceptance`` returning ``values`` in turn (one per evaluation)."""
    it = iter(values)
    monkeypatch.setattr(loop, "holdout_acceptance",
                        lambda *a, **k: {"acceptance_length": next(it), "per_position_acceptance": [0.0] * 3,
                                         "accept_tokens": 0})


def params_by_step(out):
    """An ``on_step`` recording the checkpoint saved at every step (save_every=1)."""
    saved = {}

    def on_step(step):
        saved[step] = torch.load(out / CHECKPOINT, weights_only=True)["params"]
    return saved, on_step


@pytest.mark.parametrize("values, best_step", [([1.5, 2.5, 2.0], 2),
                                               ([1.5, 2.5, 3.0], 3),  # control: a later, better step
                                               ([2.0, 2.0, 1.0], 1)])  # ties keep the first
def test_best_checkpoint_is_the_highest_acceptance(workdir, tmp_path, monkeypatch, values, best_step):  # noqa: F811
    out = tmp_path / "run"
    scripted(monkeypatch, values)
    saved, on_step = params_by_step(out)
    train(config(workdir, out, eval_holdout=2, eval_every=1, max_steps=3, save_every=1),
          log=lambda s: None, on_step=on_step)
    assert [r["acceptance_length"] for r in eval_rows(out)] == values
    best = load_run(out, best=True)
    assert best["step"] == best_step and best["best"] == {"step": best_step, "acceptance_length": max(values)}
    assert all(torch.equal(best["params"][n], saved[best_step][n]) for n in saved[best_step])
    assert load_run(out)["step"] == 3


def test_resume_keeps_the_best_record(workdir, tmp_path, monkeypatch):  # noqa: F811
    """Stopped after step 2 (best: step 1, 2.5), resumed: step 3's 1.8 must not replace
    it. Control: the same resume forgetting the record (``best_record`` -> None) takes
    step 3."""
    import shutil

    out = tmp_path / "run"

    def stop(step):
        if step == 2:
            raise KeyboardInterrupt
    scripted(monkeypatch, [2.5, 2.0])
    with pytest.raises(KeyboardInterrupt):
        train(config(workdir, out, eval_holdout=2, eval_every=1, max_steps=3, save_every=1),
              log=lambda s: None, on_step=stop)
    for forget in (False, True):
        copy = tmp_path / f"forget-{forget}"
        shutil.copytree(out, copy)
        scripted(monkeypatch, [1.8])
        if forget:
            monkeypatch.setattr(loop, "best_record", lambda *a: None)
        train(config(workdir, copy, eval_holdout=2, eval_every=1, max_steps=3, save_every=1), log=lambda s: None)
        assert load_run(copy)["step"] == 3
        assert load_run(copy, best=True)["step"] == (3 if forget else 1)


def test_recorded_acceptance_is_real_decoding(workdir, tmp_path, capsys):  # noqa: F811
    """The metrics row's acceptance length and per-position rates equal the uncached
    twin's on the saved draft (k = ttt_length, the first eval_accept_prompts prompts);
    the run's trajectory is the same with the measurement off; export --best exports
    the best step, and --best without checkpoint-best.pt is a one-line error."""
    from eagle3fn.cli.main import main
    from eagle3fn.io.export import load_export
    from eagle3fn.io.target import load_target

    out = tmp_path / "run"
    train(config(workdir, out, eval_holdout=3, eval_every=2, max_steps=2, eval_accept_prompts=2,
                 eval_accept_tokens=6), log=lambda s: None)
    row = eval_rows(out)[-1]
    run = load_run(out, best=True)
    assert run["step"] == 2 and run["best"]["acceptance_length"] == row["acceptance_length"]
    target = load_target(run["config"]["model"], aux_layer_ids=run["aux_layer_ids"])
    params = {**run["params"], "embed_tokens.weight": target.embed_tokens.float()}
    rounds = [n for p in run["holdout_prompts"][:2]
              for n in speculative_generate(target, None, params, run["draft"], run["d2t"], torch.tensor([p]),
                                            SpecConfig(num_draft_tokens=3, max_new_tokens=6)).accepted_per_round]
    length, per_position = acceptance_stats(rounds, 3)
    assert row["acceptance_length"] == pytest.approx(length, abs=1e-12)
    assert row["per_position_acceptance"] == pytest.approx(per_position, abs=1e-6)
    assert row["accept_tokens"] == 2 * 6

    off = tmp_path / "off"
    train(config(workdir, off, eval_holdout=3, eval_every=2, max_steps=2, eval_accept_prompts=0),
          log=lambda s: None)
    assert "acceptance_length" not in eval_rows(off)[-1] and not (off / BEST).exists()
    a, b = load_run(out)["params"], load_run(off)["params"]
    assert all(torch.equal(a[n], b[n]) for n in a)  # measuring changes nothing trained

    main(["export", "--run", str(out), "--out", str(out / "best"), "--dtype", "float32", "--best"])
    assert "exported step 2" in capsys.readouterr().out
    exported, *_ = load_export(out / "best")
    assert all(torch.equal(exported[n], run["params"][n]) for n in run["params"])
    with pytest.raises(SystemExit) as e:
        main(["export", "--run", str(off), "--out", str(off / "best"), "--best"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"no {BEST} in {off}" in err and "drop --best" in err


@pytest.mark.parametrize("kw, needle", [({"eval_accept_prompts": -1}, "--eval-accept-prompts -1"),
                                        ({"eval_accept_tokens": 0}, "--eval-accept-tokens 0")])
def test_config_errors(workdir, tmp_path, kw, needle):  # noqa: F811
    with pytest.raises(ValueError, match=needle):
        TrainConfig(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), **kw)


def test_demo_report_shows_acceptance_and_speedup(workdir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The demo's closing table: each draft's tokens/s and speedup on its path, the target
    alone on both paths, the acceptance length at every evaluation with the best step, the
    --best export, and a verdict against the target alone's fastest path (control: the
    draft's own path's ratio, 0.75x, is not the verdict's)."""
    import eagle3fn.cli.demo as cli_demo
    import eagle3fn.cli.run as cli_run

    out = tmp_path / "run"
    scripted(monkeypatch, [1.5, 2.5, 2.0])
    train(config(workdir, out, eval_holdout=2, eval_every=1, max_steps=3), log=lambda s: None)
    fake = dict(tokens=8, acceptance_length=1.25, simulated_tau=1.5, n_prompts=2, held_out=True)
    speeds = {"graph": (30.0, 40.0), "dynamic": (28.0, 42.0)}  # (with the draft, target alone)
    asked = []

    def evaluate(args):
        asked.append((args.impl, args.untrained))
        draft, alone = speeds[args.impl]
        return {**fake, "tokens_per_s": draft, "target_tokens_per_s": alone, "speedup": draft / alone,
                "impl": args.impl, "step": 0 if args.untrained else 3}

    monkeypatch.setattr(cli_run, "evaluate", evaluate)
    capsys.readouterr()
    cli_demo.demo_report(str(out), num_prompts=2, max_new_tokens=4, untrained_new_tokens=4)
    assert asked == [("graph", True), ("graph", False), ("dynamic", False)]
    lines = capsys.readouterr().out.splitlines()
    trained = next(line for line in lines if line.strip().startswith("trained (step 3), graph"))
    assert trained.split()[4:9] == ["8", "1.25", "1.50", "30.0", "0.75x"]
    assert "--impl graph" in trained
    other = next(line for line in lines if line.strip().startswith("trained (step 3), dynamic"))
    assert other.split()[4:9] == ["8", "1.25", "1.50", "28.0", "0.67x"]
    for impl, alone in (("graph", "40.0"), ("dynamic", "42.0")):
        assert next(line for line in lines if line.strip().startswith(f"target alone, {impl}")).split()[3:6] == \
            ["1.00", alone, "1.00x"]
    during = next(line for line in lines if line.startswith("acceptance length during training"))
    assert "step 1: 1.50, step 2: 2.50, step 3: 2.00; best: step 2" in during
    assert any(f"eagle3fn export --run {out} --out {out / 'draft-best'} --best" in line for line in lines)
    verdict = next(i for i, line in enumerate(lines) if line.startswith("result: "))
    assert lines[verdict].startswith(
        "result: with the trained draft, decoding on this machine (graph path; the target alone on its fastest, "
        f"dynamic) is SLOWER than the target alone ({30 / 42:.2f}x, acceptance length 1.25)")
    from importlib import resources
    shipped = json.loads((resources.files("eagle3fn.demo") / "gpu_result.json").read_text())
    assert f"on {shipped['device']}, {shipped['target']} trained on {shipped['conversations']}" in lines[verdict + 1]
    assert f"speedup {shipped['speedup']:.2f}x at batch {shipped['batch']}" in lines[verdict + 1]
    assert verdict + 2 == len(lines)


def test_demo_verdict_says_faster_only_above_one():
    """The demo's last line names the measured speedup plainly: 'SLOWER' at or below
    1.0x (control: 1.0x exactly is not a gain), the factor above it."""
    from eagle3fn.cli.demo import demo_verdict

    base = dict(acceptance_length=1.9, n_prompts=4)
    assert "is 1.12x the target alone (acceptance length 1.90)" in demo_verdict({**base, "speedup": 1.12})
    for slow in (1.0, 0.58):
        assert f"is SLOWER than the target alone ({slow:.2f}x" in demo_verdict({**base, "speedup": slow})


def test_the_shipped_gpu_result_is_its_records_best():
    """The GPU figure the demo prints (``eagle3fn/demo/gpu_result.json``) is the best k
    of the record it names, rounded as printed. Control: the record's worst k at batch 1
    is another figure."""
    from importlib import resources
    from pathlib import Path

    shipped = json.loads((resources.files("eagle3fn.demo") / "gpu_result.json").read_text())
    record = json.loads((Path(__file__).resolve().parents[1] / shipped["record"]).read_text())
    best = record["result"]["best"][str(shipped["batch"])]
    summary = lambda r: (round(r["acceptance_length"], 2), r["k"], round(r["speedup"], 2))  # noqa: E731
    assert (shipped["acceptance_length"], shipped["k"], shipped["speedup"]) == summary(best)
    rows = [r for r in record["result"]["rows"] if r["batch_size"] == shipped["batch"]]
    assert summary(min(rows, key=lambda r: r["speedup"])) != summary(best)
