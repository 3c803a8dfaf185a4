"""BENCH.md's timing protocol, shared by the benchmark scripts: warm-ups, then the
median of CUDA-event-timed calls, with the peak memory of the timed calls."""

from __future__ import annotations

import statistics

import torch


def cuda_timed(fn, warmup: int, iters: int) -> tuple[float, int, int]:
    """``(median ms, peak bytes, base bytes)`` of ``iters`` calls of ``fn`` after
    ``warmup`` untimed ones. Peak = ``max_memory_allocated`` since the warm-ups ended;
    base = ``memory_allocated`` at that moment (what the inputs and caches hold)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated(), base
