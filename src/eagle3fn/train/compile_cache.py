"""The run's compiled kernels kept beside its checkpoint (``compile-cache.bin``), so a
resume on a machine whose compile caches are empty (a new node after a preemption, a
container with a fresh ``/tmp``) does not compile from scratch.

Inductor keeps its own cache on the machine (``TORCHINDUCTOR_CACHE_DIR``, by default
under ``/tmp``): a second run there reuses it. What this adds is the portable copy:
``torch.compiler.save_cache_artifacts`` serializes every cache entry this process
compiled or loaded (inductor's FX graphs, AOTAutograd's graphs, Triton kernels), and
``torch.compiler.load_cache_artifacts`` puts them back into the local caches before the
first step compiles, which then hits them. Entries are keyed by the graph, the
options, the device and the torch / Triton versions, so an entry written elsewhere is
never used where it does not apply (those graphs compile as usual).

Every run reads the file when it is there and rank 0 writes it after a checkpoint (or a
stop) that follows new compilations (every rank compiles the same graphs), so a run that
compiles nothing (the CPU without ``--compile-step``) never writes one. A file that
cannot be read, or written, is reported in one line and the run goes on compiling as
usual: it is a cache, never an input. Loading writes every entry of the file into the
local caches, also those of another torch version, which then just never hit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

COMPILE_CACHE = "compile-cache.bin"


def load_compile_cache(out: Path, log: Callable[[str], None]) -> int:
    """Load ``out / COMPILE_CACHE`` into this process's compile caches; returns the number
    of artifacts loaded (0 when the file is absent, empty or unreadable)."""
    path = out / COMPILE_CACHE
    if not path.is_file():
        return 0
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # a cache: report it and compile as usual
        log(f"compile cache: could not load {path} ({type(err).__name__}: {err}); compiling from scratch")
        return 0
    count = _count(info)
    log(f"compile cache: loaded {count} compiled artifacts from {path}" if count else
        f"compile cache: could not load {path} (no artifact this torch reads); compiling from scratch")
    return count


def save_compile_cache(out: Path, log: Callable[[str], None] | None = None) -> int:
    """Write every compile-cache artifact of this process to ``out / COMPILE_CACHE``
    (atomically: a temporary file renamed over the old one); returns how many (0: nothing
    compiled, nothing written, or a write that failed: reported in one line, never
    raised)."""
    path = out / COMPILE_CACHE
    tmp = path.with_name(path.name + ".tmp")
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return 0
        data, info = saved
        count = _count(info)
        if not data or not count:
            return 0
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except Exception as err:  # a cache: the checkpoint is already saved, the run goes on
        tmp.unlink(missing_ok=True)
        if log is not None:
            log(f"compile cache: could not write {path} ({type(err).__name__}: {err}); a resume will compile")
        return 0
    if log is not None:
        log(f"compile cache: saved {count} compiled artifacts ({len(data) / 2**20:.1f} MiB) to {path}")
    return count


class CompileCacheWriter:
    """Writes the run's compile cache after a checkpoint whenever this process compiled
    graphs since the last write (dynamo's ``unique_graphs`` counter grew): the first
    checkpoint after each new row bucket or shape, not every checkpoint."""

    def __init__(self, out: Path, log: Callable[[str], None]) -> None:
        self.out, self.log, self.graphs = out, log, _graphs()

    def update(self) -> int:
        """Save when new graphs were compiled; the number of artifacts written (0: none)."""
        graphs = _graphs()
        if graphs <= self.graphs:
            return 0
        self.graphs = graphs
        return save_compile_cache(self.out, self.log)


def _graphs() -> int:
    """How many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _count(info) -> int:
    """The number of artifacts a ``CacheInfo`` lists (every kind of cache together)."""
    if info is None:
        return 0
    return sum(len(v) for v in getattr(info, "artifacts", {}).values())
