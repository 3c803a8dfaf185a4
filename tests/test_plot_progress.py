"""Training pictures and progress: the matplotlib figure shows the metrics (checked on
its Axes and Line2D objects, Agg, not pixels), degrades to a one-line note without
matplotlib; the tqdm bar shows steps, loss, tokens/s and the ETA."""

import io
import json
import math
import sys

import pytest

from eagle3fn.train.plot import metrics_figure, plot_metrics
from eagle3fn.train.progress import Progress

TRAIN = [{"step": s, "kl": [3.0 / s, 4.0 / s], "acc": [0.1 * s, 0.05 * s], "tau": 1 + 0.1 * s}
         for s in range(1, 6)]
EVAL = [{"split": "eval", "step": s, "kl": [3.5 / s, 4.5 / s], "acc": [0.08 * s, 0.04 * s],
         "tau": 1 + 0.08 * s, "acceptance_length": 1 + 0.2 * s,
         "per_position_acceptance": [0.1 * s, 0.05 * s]} for s in (2, 4)]
SKIPPED = {"step": 6, "kl": [None, None], "acc": [None, None], "tau": None}


def _lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def check_figure(fig, train, evals):
    """Every panel of ``fig`` shows exactly these rows, labelled (the test oracle)."""
    loss, acc, tau, per_position = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == ["optimizer step"] * 3 + ["draft position"]
    assert loss.get_ylabel() == "KL to the target (nats / token)"
    assert tau.get_ylabel() == "tokens per round (target + accepted drafts)"
    steps, eval_steps = [r["step"] for r in train], [r["step"] for r in evals]
    for ax, key in ((loss, "kl"), (acc, "acc")):
        expected = {}
        for j in range(2):
            expected[f"position {j + 1} (train)"] = (steps, [r[key][j] for r in train])
            expected[f"position {j + 1} (held-out)"] = (eval_steps, [r[key][j] for r in evals])
        assert _lines(ax) == expected
        assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == sorted(expected)
    assert _lines(tau) == {
        "simulated tau (train)": (steps, [r["tau"] for r in train]),
        "simulated tau (held-out)": (eval_steps, [r["tau"] for r in evals]),
        "acceptance length, speculative decoding (held-out)":
            (eval_steps, [r["acceptance_length"] for r in evals])}
    assert _lines(per_position) == {f"step {r['step']}": ([1, 2], r["per_position_acceptance"])
                                    for r in evals}
    # Step numbers on the x axes (ticks span the steps), and titles name each panel.
    assert all(min(ax.get_xlim()) <= 1 and max(ax.get_xlim()) >= 5 for ax in (loss, acc, tau))
    assert all(float(t).is_integer() for ax in fig.axes for t in ax.get_xticks())
    assert [ax.get_title() for ax in fig.axes] == [
        "loss per TTT position", "accuracy per TTT position", "acceptance length over training",
        "acceptance per draft position"]


def test_figure_shows_every_metric():
    pytest.importorskip("matplotlib")
    check_figure(metrics_figure(TRAIN + EVAL + [SKIPPED]), TRAIN, EVAL)  # skipped step left out


def test_figure_check_catches_a_wrong_picture():
    """Negative controls: a figure of one changed value, or of the held-out rows drawn as
    training rows, fails the same check."""
    pytest.importorskip("matplotlib")
    changed = [dict(r) for r in TRAIN]
    changed[2] = {**changed[2], "acc": [0.9, 0.05 * 3]}
    with pytest.raises(AssertionError):
        check_figure(metrics_figure(changed + EVAL), TRAIN, EVAL)
    as_train = [{k: v for k, v in r.items() if k != "split"} for r in EVAL]
    with pytest.raises(AssertionError):
        check_figure(metrics_figure(sorted(TRAIN + as_train, key=lambda r: r["step"])), TRAIN, EVAL)


def test_figure_without_held_out_rows_says_so():
    pytest.importorskip("matplotlib")
    fig = metrics_figure(TRAIN)
    assert set(_lines(fig.axes[0])) == {"position 1 (train)", "position 2 (train)"}
    assert "no acceptance measured" in fig.axes[3].texts[0].get_text()
    with pytest.raises(ValueError, match="no finite training rows"):
        metrics_figure([SKIPPED] + EVAL)


def test_plot_writes_a_png_or_one_line_without_matplotlib(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRAIN + EVAL))
    notes = []
    out = plot_metrics(path, tmp_path / "loss.png", log=notes.append)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not notes
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert plot_metrics(path, tmp_path / "again.png", log=notes.append) is None
    assert notes == [("matplotlib is not installed: no again.png written (pip install "
                      "'eagle3fn[plot]' draws loss, accuracy and acceptance; metrics.jsonl has the "
                      "numbers)")]
    assert not (tmp_path / "again.png").exists()


def _shown(text):
    """Each terminal line as its last carriage return left it."""
    return [line.split("\r")[-1].rstrip() for line in text.split("\n")]


def test_progress_bar_shows_steps_loss_tokens_and_eta(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tqdm.std.time", lambda: clock[0])  # tqdm's clock: 2 s per step
    stream, logged = io.StringIO(), []
    bar = Progress(4, start=0, live=True, log=logged.append, stream=stream)
    for step in (1, 2):
        clock[0] += 2.0
        bar.update(step, loss=4.5 / step, acc0=0.1 * step, tokens_per_s=1450.4)
    bar.message("eval step 2: held-out loss 2.2")
    bar.close()
    shown = _shown(stream.getvalue())
    assert shown[-3] == "eval step 2: held-out loss 2.2"  # messages stand above the bar
    assert shown[-2] == ("[############------------] 2/4, loss 2.2500 acc0 0.200 1450 tok/s, "
                         "elapsed 00:04, ETA 00:04")
    assert shown[-1] == "" and not logged


def test_progress_resumed_run_and_log_mode(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("tqdm.std.time", lambda: clock[0])
    stream = io.StringIO()
    bar = Progress(10, start=6, live=True, log=print, stream=stream)
    clock[0] += 3.0
    bar.update(7, loss=1.0, acc0=0.5, tokens_per_s=10.0)
    bar.close()
    # The ETA counts this process's steps only: 3 s for 1 step, 3 steps left.
    assert _shown(stream.getvalue())[-2].endswith("7/10, loss 1.0000 acc0 0.500 10 tok/s, "
                                                  "elapsed 00:03, ETA 00:09")
    stream, logged = io.StringIO(), []
    quiet = Progress(10, start=0, live=False, log=logged.append, stream=stream)
    quiet.update(1, loss=math.nan, acc0=0.0, tokens_per_s=1.0)
    quiet.message("step 1/10 loss 1.0")
    quiet.close()
    assert stream.getvalue() == "" and logged == ["step 1/10 loss 1.0"]
