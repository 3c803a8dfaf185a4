"""What every benchmark JSON records about its run, so that a figure in
docs/benchmarks.md can be traced to the code, the arguments and the machine:

    from meta import run_metadata
    json.dump(dict(run_metadata(resolved_args), results=rows), f)

``commit`` and ``dirty`` (uncommitted or untracked changes in the tree) come from git,
unless the environment says them: a copy of the tree (the GPU machine gets one, maybe
inside another checkout) takes them from ``EAGLE3FN_COMMIT=<sha> EAGLE3FN_DIRTY=0|1``, which ``python
benchmarks/meta.py`` prints for the checkout it runs in. ``args`` are the values the
run used: a ``None`` is refused, because a null standing for "the library's default"
changes meaning when the default does (``head_chunk_rows: null`` meant 2048 rows
before commit 7e17b7c and 4096 after it).
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "triton", "transformers")
"""Distributions whose versions every JSON records."""


def git_state(repo: Path = ROOT) -> tuple[str, bool]:
    """``(commit, dirty)`` of the tree at ``repo``. ``EAGLE3FN_COMMIT`` and
    ``EAGLE3FN_DIRTY``, when set, say it and win: a copied tree (the GPU machine gets
    one) may sit inside another checkout, or carry a stale ``.git``, whose state is not
    the tree's. Otherwise from git: ``HEAD``'s full hash, and whether tracked files
    differ from it or untracked, not ignored files exist."""
    commit, dirty = os.environ.get("EAGLE3FN_COMMIT", ""), os.environ.get("EAGLE3FN_DIRTY", "")
    if commit or dirty:
        if not commit or dirty not in ("0", "1"):
            raise ValueError(f"EAGLE3FN_COMMIT={commit!r}, EAGLE3FN_DIRTY={dirty!r}: set both (the sha, "
                             "and 0 or 1), from `python benchmarks/meta.py` in the checkout the tree came from")
        return commit, dirty == "1"
    try:
        git = ["git", "-C", str(repo)]
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True,
                                check=True).stdout
        return commit, bool(status.strip())
    except (FileNotFoundError, subprocess.CalledProcessError):
        raise ValueError(f"{repo} is not a git checkout and EAGLE3FN_COMMIT / EAGLE3FN_DIRTY are unset: "
                         "run `python benchmarks/meta.py` in the checkout the tree was copied from and put "
                         "its output before the command") from None


@functools.cache
def _git_state_at_start(repo: Path) -> tuple[str, bool]:
    """``git_state`` once per process: a run records the tree it started from, also
    when its JSON is rewritten after every row."""
    return git_state(repo)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})"


def check_resolved(args: Mapping[str, object]) -> dict:
    """``args`` as a JSON-ready dict (tuples as lists); ``ValueError`` naming every field
    that is ``None`` or holds one (resolve it to the value the run used)."""
    nulls = [k for k, v in args.items()
             if v is None or (isinstance(v, (list, tuple)) and any(x is None for x in v))]
    if nulls:
        raise ValueError(f"benchmark arguments {nulls} are None: record the value the run used "
                         "(the library's default resolved, {} for no options), or leave an "
                         "output path that was not given out")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}


def run_metadata(args: Mapping[str, object], *, repo: Path = ROOT) -> dict:
    """The identity of a benchmark run, to merge into its JSON's top level: ``commit``
    and ``dirty`` (``git_state`` at the first call in the process), ``date`` (UTC,
    ISO 8601), ``device`` (the CUDA device's name, or ``cpu (<machine>)``), ``python``,
    the ``PACKAGES``' versions (``"not installed"`` when absent) and ``args``, the
    resolved arguments (``check_resolved``: no ``None``)."""
    resolved = check_resolved(args)
    commit, dirty = _git_state_at_start(Path(repo).resolve())
    return dict(commit=commit, dirty=dirty,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=_device(), python=platform.python_version(),
                **{name: _version(name) for name in PACKAGES}, args=resolved)


if __name__ == "__main__":
    commit, dirty = git_state()
    print(f"EAGLE3FN_COMMIT={commit} EAGLE3FN_DIRTY={int(dirty)}")
