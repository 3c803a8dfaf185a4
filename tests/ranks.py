"""Gloo ranks for the distributed tests (tests/test_parallel.py, tests/test_loop_grads.py):
one launcher, a hang turned into a failure.

The ranks are forked from one forkserver per test session that has already imported
torch, its distributed tensors and the case modules: a spawned rank would import them
again (about 3 s of CPU per rank on a 2-core machine, 18 ranks a session). The server
starts on the first launch, with ``OMP_NUM_THREADS=1`` (tiny fp64 shapes: threads only
add scheduling noise, and the ranks share 2 cores); it runs no torch op, so no OpenMP
pool is forked. Every rank still sets its own threads and deterministic algorithms.
"""

import datetime
import multiprocessing
import os
import time

import pytest
import torch.multiprocessing as mp

# What each rank imports anyway; the forkserver imports them once (a module that fails
# to import is skipped there and imported by the rank, as spawn would).
PRELOAD = ["torch", "torch._inductor", "torch.distributed.tensor", "eagle3fn.parallel", "eagle3fn.train.loop",
           "parallel_cases", "loop_grad_cases"]


# The ranks' collective timeout: long enough for a rank that compiles its first kernels
# on a loaded 2-core machine while another waits in a collective (60 s was not: CI saw a
# gloo recv time out there), shorter than the launcher's hang timeout below, so a real
# hang still fails as one.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=180)


def launch(fn, args: tuple, nprocs: int, what: str, timeout_s: float = 240) -> None:
    """Run ``fn(rank, *args)`` on ranks ``0..nprocs-1`` (forked from the session's
    forkserver) and wait; a rank's exception re-raises here with its traceback, ranks
    still running after ``timeout_s`` are killed and the test fails naming ``what``."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read when the forkserver starts (the first launch)
    multiprocessing.set_forkserver_preload(PRELOAD)
    try:
        ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    finally:  # left set, it would reach later tests' subprocesses (test_kill_resume compares
        if before is None:  # a subprocess run bitwise with an in-process one)
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = before
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what}: ranks still running after {timeout_s} s (hang)")
