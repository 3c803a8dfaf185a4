"""Where ``generate``'s time goes: ``StageTimes`` (seconds per stage of a batch's
rounds) and ``Stage``, the context manager each path brackets its stages with.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

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

