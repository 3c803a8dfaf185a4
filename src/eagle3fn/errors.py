"""The errors a user can meet, as two project exception types.

Every message names the offending value, why it is wrong, and the fix, in one line.
The CLI (``cli/main.py``) prints ``eagle3fn: error: <message>`` without a traceback
(``--debug`` or ``EAGLE3FN_DEBUG=1`` shows it) and exits with ``exit_code``:

- ``UsageError`` (also a ``ValueError``): a bad flag, path or input found before any
  heavy work starts; exit 2.
- ``RunError``: a fault found while running (non-finite numbers, a broken cache or
  checkpoint, a resume with other settings, a full disk); exit 1.

The standard ``ValueError`` / ``FileNotFoundError`` raised by our own validation are
shown the same way (exit 2 and 1). ``docs/reference/errors.md`` lists them by command.
"""

from __future__ import annotations


class Eagle3fnError(Exception):
    """Base of the project's user-facing errors."""

    exit_code = 1


class UsageError(Eagle3fnError, ValueError):
    """Bad flags, paths or inputs, found before any heavy work (exit 2)."""

    exit_code = 2


class RunError(Eagle3fnError):
    """A fault found while running: the run stopped and says how to recover (exit 1)."""

    exit_code = 1
