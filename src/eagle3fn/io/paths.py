"""Paths the commands read and write: what a path is (for messages), output targets that
are never someone else's, and atomic writes.

An output is *ours* (``claim_dir`` / ``claim_file``) when it does not exist, is an empty
directory, or was written by the same command:

- a directory written by ``eagle3fn export`` holds ``MARKER`` (``.eagle3fn-output.json``,
  ``{"written_by": "eagle3fn export", "version": ...}``), written before its other
  files; a cache directory of ``eagle3fn prepare`` is known by its own
  ``manifest.json`` (the cache then checks it is the same run's);
- a single file (``eagle3fn vocab``'s map) is ours when the command's own reader
  accepts it (a vocab map with its ``d2t`` / ``t2d`` tensors).

Anything else (another model's ``config.json``, a directory of other files, a file of
another format) is refused with a one-line UsageError naming what is there and the
fixes (another ``--out``, or ``--overwrite``), before any work. ``--overwrite`` writes
the command's files into the target anyway, replacing files of the same names and
leaving every other file where it is. Files are written to a temporary name in the
same directory and renamed into place (``atomic_write``), so a kill leaves the old file
or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3fn.errors import UsageError

MARKER = ".eagle3fn-output.json"
_SHOWN = 4  # entries named in a refusal


def path_kind(path: str | os.PathLike) -> str:
    """What is at ``path``, for a message: ``"nothing"``, ``"a directory"``, ``"a
    file"``, ``"a character device"``, ``"a block device"``, ``"a named pipe"``, ``"a
    socket"`` or ``"a broken symbolic link"``."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if p.is_symlink() else "nothing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def need_file(path: str | os.PathLike, flag: str, fix: str) -> Path:
    """``path`` when it is a regular file; else FileNotFoundError (nothing there) or
    UsageError (a directory, a device, ...) naming ``flag``, what is there, and ``fix``."""
    kind = path_kind(path)
    if kind == "nothing":
        raise FileNotFoundError(f"{flag} {path}: no such file; {fix}")
    if kind != "a file":
        raise UsageError(f"{flag} {path} is {kind}, not a file; {fix}")
    return Path(path)


def need_dir(path: str | os.PathLike, flag: str, fix: str) -> Path:
    """``path`` when it is a directory; else FileNotFoundError or UsageError as ``need_file``."""
    kind = path_kind(path)
    if kind == "nothing":
        raise FileNotFoundError(f"{flag} {path}: no such directory; {fix}")
    if kind != "a directory":
        raise UsageError(f"{flag} {path} is {kind}, not a directory; {fix}")
    return Path(path)


def _writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` (and parents) and prove a file can be made in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".eagle3fn-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path} is not a writable directory ({e.strerror}); pass another {flag}") from e


def claim_dir(path: str | os.PathLike, command: str, *, overwrite: bool = False, flag: str = "--out",
              own_files: tuple[str, ...] = (), mark: bool = True, create: bool = True) -> Path:
    """Check that the directory ``path`` may receive ``command``'s files (module
    docstring), then (``create``) create it and (``mark``) write ``MARKER`` naming
    ``command`` (e.g. ``"eagle3fn export"``). ``own_files``: names whose presence shows
    the directory is the command's own (a cache's ``manifest.json``). UsageError for a
    file in the way, a non-empty directory that is not ours (without ``overwrite``), or
    one that cannot be written. ``create=False`` only checks (a command checks before
    its work, and claims when it writes)."""
    out = Path(path)
    kind = path_kind(out)
    if kind not in ("nothing", "a directory"):
        raise UsageError(f"{flag} {out} is {kind}, not a directory; pass a directory path for {command}'s files")
    if kind == "a directory" and not overwrite:
        entries = sorted(e.name for e in out.iterdir())
        ours = any((out / name).exists() for name in own_files) or _marked_by(out, command)
        if entries and not ours:
            shown = ", ".join(entries[:_SHOWN]) + (f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN
                                                   else "")
            raise UsageError(f"{flag} {out} is not empty ({shown}) and was not written by {command}; pass a new "
                             f"or empty directory as {flag}, or --overwrite to write into it anyway (files of "
                             "the same names are replaced, others are left as they are)")
    if not create:
        return out
    _writable_dir(out, flag)
    if mark:
        import eagle3fn

        with atomic_write(out / MARKER) as tmp:
            tmp.write_text(json.dumps({"written_by": command, "version": eagle3fn.__version__}) + "\n")
    return out


def _marked_by(out: Path, command: str) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("written_by") == command
    except (OSError, ValueError, AttributeError):
        return False


def claim_file(path: str | os.PathLike, command: str, *, overwrite: bool = False, flag: str = "--out",
               ours: Callable[[Path], bool] = lambda p: False, example: str = "out.safetensors") -> Path:
    """Check that the file ``path`` may be written by ``command``: not a directory or a
    device; if it exists, ``ours(path)`` (the command's reader accepts it) or
    ``overwrite``; its directory created and writable. UsageError otherwise, before any
    work (``example``: a file name suggested inside a directory given by mistake)."""
    out = Path(path)
    kind = path_kind(out)
    if kind == "a directory":
        raise UsageError(f"{flag} {out} is a directory; pass a file path for {command}'s output, e.g. "
                         f"{flag} {out / example}")
    if kind not in ("nothing", "a file"):
        raise UsageError(f"{flag} {out} is {kind}, not a file; pass a file path, e.g. {flag} {example}")
    if kind == "a file" and not overwrite and not ours(out):
        raise UsageError(f"{flag} {out} exists and was not written by {command} (its reader does not accept "
                         f"it); pass another {flag}, or --overwrite to replace it")
    parent = out.parent
    if path_kind(parent) not in ("nothing", "a directory"):
        raise UsageError(f"{flag} {out}: {parent} is {path_kind(parent)}, not a directory; pass another {flag}")
    _writable_dir(parent, flag)
    return out


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed onto ``path`` when the block
    ends without an error, removed when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # open()'s usual permissions, unlike mkstemp's
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
