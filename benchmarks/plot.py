"""Plot ``benchmarks/step.py`` JSON: step time (ms) against supervision density, one
line per mode, one panel per (S, pattern), with matplotlib (the ``plot`` extra).

    python benchmarks/plot.py bench.json [more.json ...] --out docs/img/trim-modes.png
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tyro

COLORS = {"specforge": "black", "none": "tab:red", "loss": "tab:orange", "backbone": "tab:blue",
          "auto": "tab:green", "loss-mesh": "tab:purple"}


@dataclass(kw_only=True)
class PlotArgs:
    """Inputs and output of the plot."""

    inputs: tuple[str, ...]
    """JSON files written by benchmarks/step.py --json; where two give the same (S,
    pattern, mode, density), the later one is drawn."""
    out: str = "docs/img/trim-modes.png"
    """PNG to write."""


def load_rows(paths: tuple[str, ...]) -> list[dict]:
    """The result rows of ``paths``, one per (S, pattern, mode, density): where two
    files give the same point the later file's is kept; out-of-memory rows (NaN ms)
    are dropped (a later out-of-memory row hides an earlier file's point: the later
    code did not fit)."""
    latest = {(r["S"], r["pattern"], r["mode"], r["density"]): r
              for path in paths for r in json.loads(Path(path).read_text())["results"]}
    return [r for r in latest.values() if r["median_ms"] == r["median_ms"]]


def main(args: PlotArgs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_rows(args.inputs)
    panels = sorted({(r["S"], r["pattern"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), squeeze=False)
    for ax, (S, pattern) in zip(axes[:, 0], panels):
        part = [r for r in rows if (r["S"], r["pattern"]) == (S, pattern)]
        for mode, color in COLORS.items():
            pts = sorted((r["density"], r["median_ms"]) for r in part if r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), marker="s", color=color, label=mode)
        ax.set_title(f"S = {S}, {pattern} supervision")
        ax.set_xlabel("supervised fraction of positions")
        ax.set_ylabel("step time (ms, median)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}: panels {panels}")


if __name__ == "__main__":
    main(tyro.cli(PlotArgs))
