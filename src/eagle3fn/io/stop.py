"""A graceful stop on SIGTERM / SIGINT, for commands that work in resumable units
(an optimizer step of ``train``, a shard of ``prepare``).

Inside ``graceful_stop()`` the first SIGTERM or SIGINT only records the request
(``StopRequest.requested``, ``.signal``) and says on stderr that the unit in flight
finishes first; the command checks the request between units, saves, and raises
``Stopped`` (``StopRequest.stopped(where)``), which the CLI prints as ``stopped by
SIGTERM at step N; rerun the same command to resume`` with exit code 128 + the signal
(143 for SIGTERM, 130 for SIGINT). The first signal also puts back the operating
system's default action for both signals, so a second one stops the process at once
(even inside a long native call), as an unhandled signal would. Leaving the block
restores the handlers that were there before.

Under a launcher (torchrun: ``TORCHELASTIC_RUN_ID`` set) one stop often arrives twice:
a scheduler signals every process of the job, and torchrun forwards its own copy to its
workers a moment later. There a repeat of the *same* signal within
``LAUNCHER_REPEAT_S`` seconds of the first is that copy and is ignored (said on stderr);
a later repeat, or the other signal, stops at once as above (from Python, at the next
bytecode; torchrun's own kill after its grace period covers a long native call).

Usage (``eagle3fn synthesize`` and any other resumable command)::

    from eagle3fn.io.stop import graceful_stop

    with graceful_stop(unit="batch") as stop:
        for i, batch in enumerate(batches):
            write(batch)                      # the unit in flight always finishes
            if stop.requested:
                raise stop.stopped(f"batch {i + 1}")   # the CLI prints it, exits 143/130

Signal handlers can only be installed by the main thread: elsewhere ``graceful_stop``
installs nothing and its request never fires (the caller's own handling stands).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

SIGNALS = (signal.SIGTERM, signal.SIGINT)
LAUNCHER_REPEAT_S = 2.0
"""Under a launcher, a repeat of the first signal this soon after it is the launcher's
forwarded copy (module docstring), not a second request."""


def under_launcher() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class Stopped(Exception):
    """A command stopped between two resumable units on a signal; ``exit_code`` is
    128 + the signal number (the shell's convention for a signal's end)."""

    def __init__(self, signum: int, where: str) -> None:
        self.signal = signum
        self.where = where
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} at {where}; "
                         "rerun the same command to resume")


@dataclass
class StopRequest:
    """What ``graceful_stop`` yields: ``requested`` turns True at the first handled
    signal, ``signal`` is its number (None before), ``installed`` whether handlers were
    installed (False outside the main thread)."""

    unit: str = "step"
    requested: bool = False
    signal: int | None = None
    installed: bool = False
    repeat_window_s: float = 0.0
    """A repeat of the first signal within this many seconds is ignored (0: none is;
    ``graceful_stop`` sets ``LAUNCHER_REPEAT_S`` under a launcher)."""
    first_at: float | None = None

    @property
    def name(self) -> str:
        """The signal's name, e.g. ``SIGTERM`` (empty before any)."""
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def stopped(self, where: str) -> Stopped:
        """The exception to raise once the work is saved (``where``: e.g. ``step 12``)."""
        assert self.signal is not None, "no stop was requested"
        return Stopped(self.signal, where)

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.requested:  # only reached under a launcher (repeat_window_s > 0)
            if signum == self.signal and time.monotonic() - self.first_at < self.repeat_window_s:
                os.write(2, f"{signal.Signals(signum).name} again within {self.repeat_window_s:g} s: the "
                            "launcher's forwarded copy, ignored\n".encode())
                return
            for s in SIGNALS:  # a real second request: the default action, now
                signal.signal(s, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested, self.signal, self.first_at = True, signum, time.monotonic()
        if not self.repeat_window_s:
            for s in SIGNALS:  # a second signal: the default action, at once
                signal.signal(s, signal.SIG_DFL)
        # os.write, not print: a handler that prints can interrupt a print of the main
        # thread and fail on the stream's lock.
        name = signal.Signals(signum).name
        again = f"again after {self.repeat_window_s:g} s" if self.repeat_window_s else "again"
        os.write(2, f"{name} received: finishing the {self.unit} in flight and saving, then stopping; "
                    f"send it {again} to stop at once (losing the {self.unit} in flight)\n".encode())


@contextlib.contextmanager
def graceful_stop(unit: str = "step") -> Iterator[StopRequest]:
    """Handle SIGTERM and SIGINT as a stop request for the block (module docstring);
    ``unit`` names what finishes before the stop in the notice printed at the signal."""
    request = StopRequest(unit=unit, repeat_window_s=LAUNCHER_REPEAT_S if under_launcher() else 0.0)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        for s in SIGNALS:
            signal.signal(s, request._handle)
        request.installed = True
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
