"""Reading the next batches while the current one trains: background threads (one per
load in flight) run the host side of a load (disk read, dequantization, packing,
pinning), the training thread only moves the result to the device (``non_blocking``
from pinned memory on CUDA) and records how long it waited (``wait_s``).

``Prefetcher(load_host, to_device)`` serves ``get(item, window)``. It learns which item
comes next from the epoch order it is given (``set_order``) and the stride of the
positions asked so far (1 on one rank; the data-parallel degree when each rank takes
every dp-th batch), and keeps ``depth`` loads in flight with the last window asked (a
sequence-parallel rank asks every item with the same window). A miss (an item or window
it did not guess) is loaded in the training thread, so results never depend on the
guess: the prefetcher changes when the work is done, never what is returned. An error
of a background load is raised by the ``get`` that asks for that item.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Sequence

import torch


def window_key(window) -> Hashable:
    """A comparable form of a window: None, a ``(start, stop)`` tuple, or a
    ``functools.partial`` compared by function and arguments (a new partial per call
    names the same window)."""
    if isinstance(window, functools.partial):
        return (window.func, window.args, tuple(sorted(window.keywords.items())))
    return window if window is None else tuple(window)


def pin(x):
    """``x`` (a tensor, or a dataclass / tuple of them) in pinned host memory (CUDA only)."""
    if isinstance(x, torch.Tensor):
        return x.pin_memory() if torch.cuda.is_available() and x.device.type == "cpu" else x
    if isinstance(x, tuple):
        return tuple(pin(v) for v in x)
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.replace(x, **{f: pin(getattr(x, f)) for f in x.__dataclass_fields__})
    return x


class Prefetcher:
    """Background loads of the items after the one asked (module docstring).

    Args:
        load_host: ``(item, window) -> host result`` (CPU tensors), run in the thread.
        to_device: ``host result -> result`` on the device, run by ``get``.
        order: the items in the order they will be asked (``set_order`` changes it).
        depth: loads kept in flight (0: none, every ``get`` loads in place).
    """

    def __init__(self, load_host: Callable, to_device: Callable, order: Sequence, *, depth: int = 2) -> None:
        self.load_host, self.to_device, self.depth = load_host, to_device, depth
        self._pool = (ThreadPoolExecutor(max_workers=depth, thread_name_prefix="eagle3fn-prefetch")
                      if depth else None)  # one thread per load in flight: they overlap
        self._lock = threading.Lock()
        self._pending: dict[tuple, Future] = {}
        self._last_pos: int | None = None
        self._stride = 1
        self.wait_s = 0.0
        self.hits = self.misses = 0
        self.set_order(order)

    def set_order(self, order: Sequence) -> None:
        """The items' order from now on (an epoch's permutation); drops guesses of the old one."""
        self._order = list(order)
        self._pos = {item: p for p, item in enumerate(self._order)}
        self._last_pos = None
        with self._lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()

    def take_wait(self) -> float:
        """Seconds ``get`` waited since the last call (then reset)."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def get(self, item, window=None):
        """The result of ``to_device(load_host(item, window))``, from a background load
        when one was started for it, and the next loads started."""
        t = time.perf_counter()
        key = (item, window_key(window))
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:
            self.hits += 1
            host = future.result()
        else:
            self.misses += 1
            host = self.load_host(item, window)
        self._schedule(item, window)
        out = self.to_device(host)
        self.wait_s += time.perf_counter() - t
        return out

    def _schedule(self, item, window) -> None:
        pos = self._pos.get(item)
        if self._pool is None or pos is None:
            return
        if self._last_pos is not None and pos > self._last_pos:
            self._stride = pos - self._last_pos
        self._last_pos = pos
        wanted = [self._order[p] for p in range(pos + self._stride, pos + self._stride * (self.depth + 1),
                                                   self._stride) if p < len(self._order)]
        with self._lock:
            keep = {(w, window_key(window)) for w in wanted}
            for key in [k for k in self._pending if k not in keep]:
                self._pending.pop(key).cancel()
            for w in wanted:
                key = (w, window_key(window))
                if key not in self._pending:
                    self._pending[key] = self._pool.submit(lambda w=w: pin(self.load_host(w, window)))

    def close(self) -> None:
        """Cancel what is in flight and stop the thread."""
        if self._pool is not None:
            self.set_order([])
            self._pool.shutdown(wait=True, cancel_futures=True)
