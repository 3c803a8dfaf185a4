"""Training curves from a ``metrics.jsonl``, drawn with matplotlib (the ``plot`` extra).

Four panels, each with axis labels, units, step numbers and a legend:

1. loss: soft cross-entropy to the target (nats per supervised token) per TTT
   position ``j`` against the optimizer step; training rows as lines, held-out rows
   (``"split": "eval"``) as square markers of the same colour.
2. accuracy: top-1 agreement with the target per TTT position, same layout.
3. acceptance length: the simulated tau of training and held-out rows, and the
   acceptance length measured by speculative decoding at held-out evaluations
   (``acceptance_length``, when the run recorded it), in tokens per round.
4. acceptance per draft position: ``per_position_acceptance`` of each held-out
   evaluation (one line per evaluated step).

Legend: k TTT positions (draft tokens), rows = metrics.jsonl rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from eagle3fn.train.metrics import read_metrics

MISSING = ("matplotlib is not installed: no {path} written (pip install 'eagle3fn[plot]' "
           "draws loss, accuracy and acceptance; metrics.jsonl has the numbers)")


def _finite(row: dict) -> bool:
    return all(v is not None and math.isfinite(v) for key in ("kl", "acc") for v in row[key])


def metrics_figure(rows: list[dict]):
    """The four-panel ``matplotlib.figure.Figure`` of metrics rows (module docstring).

    Rows with a non-finite ``kl`` / ``acc`` (skipped steps) are left out; held-out rows
    are those with ``"split": "eval"``. Raises ValueError when no training row is left;
    ImportError when matplotlib is absent (``plot_metrics`` turns it into a note).
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in rows if _finite(r)]
    train = [r for r in rows if r.get("split", "train") == "train"]
    evals = [r for r in rows if r.get("split") == "eval"]
    if not train:
        raise ValueError("no finite training rows to plot (every step was skipped, or the "
                         "run wrote none yet)")
    k = len(train[0]["kl"])
    fig = Figure(figsize=(11, 8))
    # Fixed margins fit the four labelled panels at this size; a constrained layout
    # solves for them at every draw (a third of the time of a run's plot).
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.07, top=0.96, wspace=0.2, hspace=0.28)
    loss_ax, acc_ax, tau_ax, pos_ax = fig.subplots(2, 2).flatten()
    colors = [f"C{j}" for j in range(k)]
    for ax, key, title, ylabel in (
            (loss_ax, "kl", "loss per TTT position", "KL to the target (nats / token)"),
            (acc_ax, "acc", "accuracy per TTT position", "top-1 agreement with the target (fraction)")):
        for j in range(k):
            ax.plot([r["step"] for r in train], [r[key][j] for r in train], color=colors[j],
                    label=f"position {j + 1} (train)")
            if evals:
                ax.plot([r["step"] for r in evals], [r[key][j] for r in evals], "s", color=colors[j],
                        markeredgecolor="black", label=f"position {j + 1} (held-out)")
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        ax.legend(fontsize="small", ncols=2 if evals else 1)
        ax.grid(alpha=0.3)
    acc_ax.set_ylim(0, 1)

    tau_ax.plot([r["step"] for r in train], [r["tau"] for r in train], color="C0",
                label="simulated tau (train)")
    if evals:
        tau_ax.plot([r["step"] for r in evals], [r["tau"] for r in evals], "s", color="C0",
                    markeredgecolor="black", label="simulated tau (held-out)")
    measured = [r for r in evals if r.get("acceptance_length") is not None]
    if measured:
        tau_ax.plot([r["step"] for r in measured], [r["acceptance_length"] for r in measured], "o-",
                    color="C3", label="acceptance length, speculative decoding (held-out)")
    tau_ax.set(title="acceptance length over training", xlabel="optimizer step",
               ylabel="tokens per round (target + accepted drafts)")
    tau_ax.legend(fontsize="small")
    tau_ax.grid(alpha=0.3)

    per_position = [r for r in evals if r.get("per_position_acceptance")]
    for i, r in enumerate(per_position):
        values = r["per_position_acceptance"]
        pos_ax.plot(range(1, len(values) + 1), values, "o-", label=f"step {r['step']}",
                    alpha=0.35 + 0.65 * (i + 1) / len(per_position))
    if per_position:
        pos_ax.legend(fontsize="small", title="held-out evaluation at")
        pos_ax.set_xticks(range(1, len(per_position[-1]["per_position_acceptance"]) + 1))
    else:
        pos_ax.text(0.5, 0.5, "no acceptance measured\n(train with held-out data and --eval-every)",
                    ha="center", va="center", transform=pos_ax.transAxes)
    pos_ax.set(title="acceptance per draft position", xlabel="draft position",
               ylabel="accepted fraction of rounds reaching it", ylim=(0, 1))
    pos_ax.grid(alpha=0.3)
    for ax in (loss_ax, acc_ax, tau_ax, pos_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and positions are whole
    return fig


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path,
                 log: Callable[[str], None] = print) -> Path | None:
    """Draw ``metrics_figure`` of a metrics.jsonl into ``out_png`` (PNG, Agg, no display
    needed) and return its path; without matplotlib, ``log`` one line saying so and
    return None."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        log(MISSING.format(path=Path(out_png).name))
        return None
    fig = metrics_figure(read_metrics(metrics_jsonl))
    FigureCanvasAgg(fig)
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    return out
