"""A PNG of the per-step loss and accuracy curves, with no plotting dependency.

Two panels (loss on top, acc below), one line per TTT step j (darker = earlier step),
x = optimizer step. Written with zlib + struct; good enough to eyeball a run.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

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


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Draw ``kl`` and ``acc`` per TTT step from a metrics.jsonl into ``out_png``."""
    rows = [json.loads(r) for r in Path(metrics_jsonl).read_text().splitlines() if r.strip()]
    if not rows:
        raise ValueError(f"{metrics_jsonl} has no rows to plot")
    height = 2 * PANEL + 3 * MARGIN
    px = [bytearray(b"\xff" * 3 * WIDTH) for _ in range(height)]
    steps = [r["step"] for r in rows]
    k = len(rows[0]["kl"])
    for panel, key in enumerate(("kl", "acc")):
        top = MARGIN + panel * (PANEL + MARGIN)
        values = [v for r in rows for v in r[key]]
        lo, hi = min(values), max(values)
        hi = hi if hi > lo else lo + 1.0
        _line(px, MARGIN, top + PANEL, WIDTH - MARGIN, top + PANEL, (0, 0, 0))  # x axis
        _line(px, MARGIN, top, MARGIN, top + PANEL, (0, 0, 0))  # y axis
        span = max(steps[-1] - steps[0], 1)
        for j in range(k):
            shade = int(200 * j / max(k - 1, 1))
            color = (shade, shade, 255) if key == "kl" else (255, shade, shade)
            pts = [(MARGIN + round((s - steps[0]) / span * (WIDTH - 2 * MARGIN)),
                    top + PANEL - round((r[key][j] - lo) / (hi - lo) * PANEL)) for s, r in zip(steps, rows)]
            for (x0, y0), (x1, y1) in zip(pts, pts[1:] or pts):
                _line(px, x0, y0, x1, y1, color)
    out = Path(out_png)
    _png(px, out)
    return out
