"""CUDA-graph recording of a function over fixed tensors (``Graphed``)."""

from __future__ import annotations

from typing import Callable

import torch


class Graphed:
    """``fn()`` (no arguments: it reads and writes fixed tensors) called eagerly, or, with
    ``graph``, recorded once as a CUDA graph and replayed: the kernels of a whole step
    launched by one call instead of hundreds of Python-level launches. The first
    ``prepare`` runs ``fn`` once on a side stream (so lazily built state such as cuBLAS
    handles and the RoPE frequencies exists before recording, as PyTorch's CUDA-graph
    notes ask) and records it; ``fn`` must be idempotent on its inputs, as running it
    twice is what this does (or the caller saves and restores what it changes)."""

    def __init__(self, fn: Callable[[], None], graph: bool, device: torch.device) -> None:
        self.fn, self.graph, self.device, self.recorded = fn, graph, device, None

    @property
    def due(self) -> bool:
        """A recording is due (graph mode, not recorded yet)."""
        return self.graph and self.recorded is None

    def prepare(self) -> None:
        """Record the graph if it is due (no-op when eager or recorded)."""
        if not self.due:
            return
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.recorded = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (a training loop's prefetching
            # reader) during the recording are theirs, not an error of the recording.
            with torch.cuda.graph(self.recorded, capture_error_mode="thread_local"):
                self.fn()

    def __call__(self) -> None:
        if not self.graph:
            self.fn()
            return
        self.prepare()
        self.recorded.replay()
