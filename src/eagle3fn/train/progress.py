"""Training progress on stdout without a dependency.

On a terminal: one line redrawn after every optimizer step, e.g.
``[#########---------------] 25/66 loss 4.8812 acc0 0.181 1450 tok/s ETA 3m07s``;
messages (evaluation, checkpoints) are printed above it. Elsewhere (a pipe, a file,
CI, a ``log`` callable): nothing per step; the loop logs one line every log_every steps.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

BAR = 24


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class Progress:
    """``live``: redraw one line on ``stream``; else ``message`` goes to ``log``.

    ``start`` is the step the run begins at (a resumed run), for the ETA.
    """

    def __init__(self, total: int, *, start: int, live: bool, log: Callable[[str], None],
                 stream: TextIO | None = None) -> None:
        self.total, self.start, self.live, self.log = total, start, live, log
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()
        self.line = ""

    def _draw(self, line: str) -> None:
        # Spaces cover the rest of a longer previous line.
        self.stream.write("\r" + line + " " * max(0, len(self.line) - len(line)))
        self.stream.flush()
        self.line = line

    def message(self, text: str) -> None:
        """A line of text: above the bar when live, else through ``log``."""
        if not self.live:
            self.log(text)
            return
        bar = self.line
        self.stream.write("\r" + text + " " * max(0, len(bar) - len(text)) + "\n")
        self.line = ""
        if bar:
            self._draw(bar)

    def update(self, step: int, *, loss: float, acc0: float, tokens_per_s: float) -> None:
        """Redraw the bar after optimizer step ``step`` (does nothing unless live)."""
        if not self.live:
            return
        done = step / max(self.total, 1)
        bar = "#" * round(BAR * done) + "-" * (BAR - round(BAR * done))
        per_step = (time.perf_counter() - self.t0) / max(step - self.start, 1)
        self._draw(f"[{bar}] {step}/{self.total} loss {loss:.4f} acc0 {acc0:.3f} "
                   f"{tokens_per_s:.0f} tok/s ETA {_duration(per_step * (self.total - step))}")

    def close(self) -> None:
        """End the bar's line (when live)."""
        if self.live and self.line:
            self.stream.write("\n")
            self.stream.flush()
            self.line = ""
