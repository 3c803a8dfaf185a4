"""Training progress on stdout: a tqdm bar on a terminal, log lines elsewhere.

On a terminal: one tqdm line redrawn after every optimizer step, e.g.
``[#########---------------] 25/66, loss L acc0 A N tok/s, elapsed MM:SS,
ETA MM:SS`` (tqdm's estimate from the steps of this process); messages (evaluation,
checkpoints) are printed above it. Elsewhere (a pipe, a file, CI, a ``log`` callable):
nothing per step; the loop logs one line every log_every steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

BAR_FORMAT = "[{bar:24}] {n_fmt}/{total_fmt}{postfix}, elapsed {elapsed}, ETA {remaining}"
"""tqdm's fields: the bar in ``#`` and ``-``, steps done / total, the postfix
(``, loss .. acc0 .. N tok/s``; tqdm puts the comma), elapsed time and the ETA."""


class Progress:
    """``live``: a tqdm bar on ``stream``; else ``message`` goes to ``log``.

    ``start`` is the step the run begins at (a resumed run): the bar starts there and
    the ETA counts only the steps this process ran.
    """

    def __init__(self, total: int, *, start: int, live: bool, log: Callable[[str], None],
                 stream: TextIO | None = None) -> None:
        self.total, self.start, self.live, self.log = total, start, live, log
        self.stream = stream or sys.stdout
        self.bar = (tqdm(total=total, initial=start, file=self.stream, bar_format=BAR_FORMAT,
                         ascii="-#", dynamic_ncols=True, mininterval=0, smoothing=0.3)
                    if live else None)

    def message(self, text: str) -> None:
        """A line of text: above the bar when live, else through ``log``."""
        if self.bar is None:
            self.log(text)
        else:
            self.bar.write(text, file=self.stream)

    def update(self, step: int, *, loss: float, acc0: float, tokens_per_s: float) -> None:
        """Redraw the bar after optimizer step ``step`` (does nothing unless live)."""
        if self.bar is None:
            return
        self.bar.set_postfix_str(f"loss {loss:.4f} acc0 {acc0:.3f} {tokens_per_s:.0f} tok/s",
                                 refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """End the bar's line (when live)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
