"""Plot ``benchmarks/step.py`` JSON: step time (ms) against supervision density, one
line per mode, one panel per (S, pattern). No plotting dependency (PNG by hand).

    python benchmarks/plot.py bench.json [more.json ...] --out docs/img/trim-modes.png
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tyro

from eagle3fn.train.plot import _line, _png, _square

WIDTH, PANEL, MARGIN = 640, 200, 28
COLORS = {"specforge": (0, 0, 0), "none": (220, 40, 40), "loss": (240, 150, 0),
          "backbone": (30, 110, 230), "auto": (20, 160, 60), "loss-mesh": (150, 80, 200)}


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
    rows = load_rows(args.inputs)
    panels = sorted({(r["S"], r["pattern"]) for r in rows})
    height = len(panels) * (PANEL + MARGIN) + MARGIN
    px = [bytearray(b"\xff" * 3 * WIDTH) for _ in range(height)]
    for i, (S, pattern) in enumerate(panels):
        top = MARGIN + i * (PANEL + MARGIN)
        part = [r for r in rows if (r["S"], r["pattern"]) == (S, pattern)]
        hi = max(r["median_ms"] for r in part) * 1.05
        _line(px, MARGIN, top + PANEL, WIDTH - MARGIN, top + PANEL, (0, 0, 0))
        _line(px, MARGIN, top, MARGIN, top + PANEL, (0, 0, 0))
        for mode, color in COLORS.items():
            pts = sorted((r["density"], r["median_ms"]) for r in part if r["mode"] == mode)
            xy = [(MARGIN + round(d * (WIDTH - 2 * MARGIN)), top + PANEL - round(ms / hi * PANEL))
                  for d, ms in pts]
            for (x0, y0), (x1, y1) in zip(xy, xy[1:] or xy):
                _line(px, x0, y0, x1, y1, color)
            for x, y in xy:
                _square(px, x, y, color)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    _png(px, Path(args.out))
    print(f"wrote {args.out}: panels {panels} (x: density 0..1, y: ms 0..max)")


if __name__ == "__main__":
    main(tyro.cli(PlotArgs))
