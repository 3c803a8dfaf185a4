"""A PNG of the per-step loss and accuracy curves, with no plotting dependency.

Two panels (loss on top, acc below), one line per TTT step j (darker = earlier step),
x = optimizer step: training rows in blue (kl) and red (acc), held-out evaluation rows
(``"split": "eval"``) in green with a square at each evaluation. Written with zlib +
struct; good enough to eyeball a run.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

from eagle3fn.train.metrics import read_metrics

WIDTH, PANEL, MARGIN = 640, 220, 24


def _png(pixels: list[bytearray], path: Path) -> None:
    height, width = len(pixels), len(pixels[0]) // 3
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _line(px, x0, y0, x1, y1, color) -> None:
    n = max(abs(x1 - x0), abs(y1 - y0), 1)
    for t in range(n + 1):
        x, y = round(x0 + (x1 - x0) * t / n), round(y0 + (y1 - y0) * t / n)
        if 0 <= y < len(px) and 0 <= x < WIDTH:
            px[y][3 * x:3 * x + 3] = bytes(color)


def _square(px, x, y, color) -> None:
    for dy in range(-2, 3):
        _line(px, x - 2, y + dy, x + 2, y + dy, color)


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Draw ``kl`` and ``acc`` per TTT step from a metrics.jsonl into ``out_png``
    (training and held-out rows)."""
    finite = lambda r: all(v is not None and math.isfinite(v) for key in ("kl", "acc") for v in r[key])  # noqa: E731
    rows = [r for r in read_metrics(metrics_jsonl) if finite(r)]  # a skipped step has none
    train = [r for r in rows if r.get("split", "train") == "train"]
    evals = [r for r in rows if r.get("split") == "eval"]
    if not train:
        raise ValueError(f"{metrics_jsonl} has no training rows to plot")
    height = 2 * PANEL + 3 * MARGIN
    px = [bytearray(b"\xff" * 3 * WIDTH) for _ in range(height)]
    steps = [r["step"] for r in train + evals]
    first, span = min(steps), max(max(steps) - min(steps), 1)
    k = len(train[0]["kl"])
    for panel, key in enumerate(("kl", "acc")):
        top = MARGIN + panel * (PANEL + MARGIN)
        values = [v for r in train + evals for v in r[key]]
        lo, hi = min(values), max(values)
        hi = hi if hi > lo else lo + 1.0
        _line(px, MARGIN, top + PANEL, WIDTH - MARGIN, top + PANEL, (0, 0, 0))  # x axis
        _line(px, MARGIN, top, MARGIN, top + PANEL, (0, 0, 0))  # y axis
        for j in range(k):
            shade = int(200 * j / max(k - 1, 1))
            color = (shade, shade, 255) if key == "kl" else (255, shade, shade)
            for part, c in ((train, color), (evals, (shade // 2, 160 + shade // 4, shade // 2))):
                pts = [(MARGIN + round((r["step"] - first) / span * (WIDTH - 2 * MARGIN)),
                        top + PANEL - round((r[key][j] - lo) / (hi - lo) * PANEL)) for r in part]
                for (x0, y0), (x1, y1) in zip(pts, pts[1:] or pts):
                    _line(px, x0, y0, x1, y1, c)
                if part is evals:
                    for x, y in pts:
                        _square(px, x, y, c)
    out = Path(out_png)
    _png(px, out)
    return out
