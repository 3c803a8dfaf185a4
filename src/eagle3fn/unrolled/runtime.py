"""The process-wide settings the unrolled objective touches (besides dynamo's recompile
budget, which ``eagle3fn.compiled.compiled_flex`` raises).

- ``one_thread`` sets PyTorch's intra-op thread count (``torch.set_num_threads``,
  process-wide) to 1 for the duration of one call and restores it after, also when
  the call raises.
"""

from __future__ import annotations

import functools

import torch


def one_thread(fn):
    """Run ``fn`` with one intra-op CPU thread (``torch.set_num_threads``, the count
    restored after). The host index maths works on tensors of a few thousand
    rows, where an op that wakes a pool of OpenMP threads costs more than its work
    (on a many-threaded host, a large share of a step's host time)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        if before == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper
