"""Where ``generate``'s time goes: ``StageTimes`` (seconds per stage of a batch's
rounds) and ``Stage``, the context manager each path brackets its stages with; and
``interleaved``, how ``evaluate`` and ``sweep`` time the draft beside the target alone,
after a warm-up on the ``widest`` batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class StageTimes:
    """Where ``generate``'s time goes, filled when passed to it (``stages=``): every stage
    bracketed by device syncs (which slow the run a little), seconds summed over the
    batch's rounds. What no field names (``total_s`` minus the others) is bookkeeping:
    acceptance, rollback, compaction, finished rows leaving, the host's reading of the
    accepted counts, Python."""

    total_s: float = 0.0
    """Wall time of ``generate``."""
    prefill_s: float = 0.0
    """The target's prefill forward."""
    verify_s: float = 0.0
    """The target's verifying forwards (``k + 1`` tokens per row each)."""
    draft_context_s: float = 0.0
    """The draft's context rows: ``fc`` of the target's aux, step-0 keys and values, into
    the draft's cache (the prompts' included)."""
    draft_chain_s: float = 0.0
    """The draft's k-step chains."""
    record_s: float = 0.0
    """Recording the CUDA graphs (the static path on CUDA; each includes one eager run)."""
    rounds: int = 0
    """Verification rounds of the batch (each judges every live row)."""


class Stage:
    """``with stage("verify_s"):`` adds the block's synchronised wall time to that field
    of ``StageTimes`` (nothing, not even a sync, when there is none)."""

    def __init__(self, times: StageTimes | None, device: torch.device) -> None:
        self.times, self.device, self.cuda = times, device, device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.times is None:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize(self.device)
        setattr(self.times, name, getattr(self.times, name) + time.perf_counter() - t0)


def widest(batches: Sequence[Sequence[torch.Tensor]]) -> list:
    """The batch whose longest prompt (``[L]`` or ``[1, L]`` each) is the longest (the
    first such): the warm-up batch. Every cache a pooled call sizes for it (columns grow
    with the longest prompt) fits every other batch of the same size, so after it no
    timed batch records its graphs again, as a server records every shape at start-up."""
    return max(batches, key=lambda batch: max(p.shape[-1] for p in batch))


def interleaved(sides: Sequence[Callable[[list], list]], batches: list[list], device: torch.device,
                warmup: bool | None = None) -> tuple[list[list], list[float]]:
    """Run every side on every batch, batch by batch, the sides' order alternating
    (A B, B A, A B, ...), each call timed alone (synchronised on CUDA): a machine whose
    speed drifts during the measurement (a shared CPU, clocks) shifts both sides alike,
    which timing one side's batches and then the other's does not. Both sides' state
    (their static caches and recorded graphs, when they pool them) is then alive at
    once: about twice one side's cache memory. With ``warmup``
    (None: on CUDA) each side first runs the ``widest`` batch once untimed (compilation,
    graph recording at the largest cache any batch needs). Returns each side's outputs
    (concatenated in batch order) and its seconds."""
    if device.type == "cuda" if warmup is None else warmup:
        for side in sides:
            side(widest(batches))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    outputs, seconds = [[] for _ in sides], [0.0] * len(sides)
    for i, batch in enumerate(batches):
        order = range(len(sides)) if i % 2 == 0 else reversed(range(len(sides)))
        for j in order:
            t0 = time.perf_counter()
            got = sides[j](batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[j] += time.perf_counter() - t0
            outputs[j].extend(got)
    return outputs, seconds
