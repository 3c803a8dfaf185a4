"""Recorded decoding states kept across calls (``GraphPool``).

A CUDA graph replays the kernels it recorded on the very tensors it recorded them on. A
call of ``decoding.generate`` or of ``evaluation.generate(impl="graph")`` builds its
buffers (static KV caches, slot state, the draft's cache) and records its steps on them;
recording costs one eager run of the step, the capture and the graph's instantiation,
tens of milliseconds for a 30-layer step. Called batch after batch (``evaluation.sweep``
decodes every prompt at batch 1), that cost is paid per batch, where a server records
once per shape at start-up and replays for every request.

A ``GraphPool`` passed to those calls keeps each call's buffers and recorded graphs,
keyed by everything the recording depends on (the shapes but the cache's columns, and
the identity of the model, draft and tensors it reads), and hands them to the next call
with the same key whose prompts fit in their columns, which resets their contents and
replays; a call needing more columns replaces the entry (one cache per shape at a time). Where steps are recorded (CUDA) the callers
round cache columns up to ``COLUMN_ALIGN`` so that prompts of nearby lengths share one
entry; eager steps (the CPU) keep their exact columns. The pool holds
their memory until it is dropped (``clear``), and at most ``size`` entries (least
recently used first out).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any, Callable, Hashable

COLUMN_ALIGN = 256
"""Cache columns of a pooled call are rounded up to a multiple of this, so calls whose
longest prompt differs by less than this reuse one recorded state."""


class GraphPool:
    """Buffers and recorded graphs of earlier calls by key (module docstring).

    Args:
        size: entries kept at most (each holds a KV cache of its batch's shape).
    """

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise ValueError(f"GraphPool size={size} must be >= 1")
        self.size = size
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = self.misses = 0

    def take(self, key: Hashable, fits: Callable[[Any], bool] = lambda entry: True) -> Any | None:
        """The entry stored under ``key``, removed from the pool (a call owns it until it
        ``put``s it back), or None: none stored, or one that does not ``fit`` (dropped,
        its memory freed)."""
        entry = self.entries.pop(key, None)
        if entry is not None and not fits(entry):
            entry = None
            gc.collect()  # recorded graphs hold their owners in reference cycles
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, key: Hashable, entry: Any) -> None:
        """Store ``entry`` under ``key`` as the most recently used; the least recently
        used entries beyond ``size`` are dropped."""
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry and free its memory (once nothing else holds it: a recorded
        graph holds its owner in a reference cycle, so this collects them)."""
        if self.entries:
            self.entries.clear()
            gc.collect()


def aligned(columns: int, pool: GraphPool | None, align: int) -> int:
    """``columns`` rounded up to ``align``, or to ``COLUMN_ALIGN`` when pooled (the larger)."""
    unit = max(align, COLUMN_ALIGN) if pool is not None else align
    return -(-columns // unit) * unit
