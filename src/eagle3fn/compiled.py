"""What eagle3fn compiles, and how: the backend per device, shape-dynamic graphs, and a
counter of dynamo's recompilations.

Stable shapes. Everything compiled here is compiled shape-dynamic (``dynamic=True``):
one graph serves every batch length and row count, so a run compiles during its first
steps and not again (``RecompileCounter`` counts dynamo's recompilations; the loop's
test and benchmarks/train.py report them). What would still specialise is kept away
from the boundaries dynamo specialises on: FlexAttention's query and key lengths are at
least two blocks (``unrolled.blocks.MIN_FLEX_BLOCKS``), since dynamo treats sizes 0
and 1 (one block) as constants.

Inductor itself adds guards where it decides by size: its "mix-order reduction" (the
fused row and column reductions of an RMSNorm's backward) is taken only above size
thresholds (rows >= 4096, rows >= 2 * columns, rows * columns >= 5 Mi), and each
threshold is a guard that a batch on its other side breaks (a run whose batches cross
a threshold recompiles after warm-up). ``INDUCTOR_OPTIONS``
turns on its non-strict mode, which skips those checks (the fused kernel at any size),
so the one graph holds for every length.

``compile_on_cpu`` (tests only) makes CPU tensors take the compiled paths too, with a
chosen dynamo backend, for the duration of a ``with`` block (a context variable: the
setting is scoped to the block and to the calling thread's context, never global).

A bottom module: it imports nothing of eagle3fn.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging

import torch

CPU_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("eagle3fn_cpu_backend", default=None)
"""The dynamo backend CPU tensors are compiled with inside ``compile_on_cpu``; None: CPU
tensors run eagerly (the default)."""


INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}
"""The inductor options of every eagle3fn compile (module docstring)."""


def compiler(fn, backend: str, dynamic: bool | None = True, options: dict | None = None):
    """``torch.compile(fn, dynamic=dynamic, backend=backend)``, with ``INDUCTOR_OPTIONS``
    updated by ``options`` when the backend is inductor (other backends take none).
    ``dynamic=None``: only the sizes marked dynamic are symbolic (the compiled training
    step's row counts, ``train.onegraph``); ``False``: one static graph per shape (that
    step without ``onegraph.DYNAMIC_ROWS``)."""
    merged = {**INDUCTOR_OPTIONS, **(options or {})} if backend == "inductor" else None
    return torch.compile(fn, dynamic=dynamic, backend=backend, options=merged)


def compile_backend(device: torch.device) -> str | None:
    """The ``torch.compile`` backend the compiled paths use for tensors on ``device``:
    ``"inductor"`` on CUDA; on the CPU None (eager), or ``compile_on_cpu``'s backend.
    None inside a graph being compiled (the one-graph step, ``train.onegraph``): the
    caller's eager path is traced into that graph instead of compiling again inside it
    (dynamo refuses ``maybe_mark_dynamic`` and ``ContextVar.get`` there)."""
    if torch.compiler.is_compiling():
        return None
    if device.type == "cuda":
        return "inductor"
    return CPU_BACKEND.get() if device.type == "cpu" else None


@contextlib.contextmanager
def compile_on_cpu(backend: str = "aot_eager"):
    """Inside the block, CPU tensors take the compiled paths (the elementwise chains of
    ``draft.fused_on_cuda``, the FlexAttention of the flex path) with dynamo
    ``backend``: what a test without a GPU needs to see dynamo's guards, hence the
    recompilations a CUDA run would have. Not for training: ``aot_eager`` is slower than
    eager, and FlexAttention refuses a backward on the CPU (a test lifts that check)."""
    token = CPU_BACKEND.set(backend)
    try:
        yield
    finally:
        CPU_BACKEND.reset(token)


DYNAMO_CACHE_SIZE_LIMIT = 64
"""The least ``torch._dynamo.config.cache_size_limit`` (dynamo's recompile budget per
function, shared by every ``torch.compile`` of the process, other libraries' too) an
eagle3fn compile runs with (``configure_dynamo``)."""


def configure_dynamo() -> None:
    """Raise dynamo's recompile budget to at least ``DYNAMO_CACHE_SIZE_LIMIT`` in the
    calling thread (never lowered). Past the budget dynamo silently runs a function
    uncompiled (FlexAttention: its O(S^2)-memory path); a run needs one graph per dtype
    and grad mode, this leaves room for others. Dynamo's config is per thread since
    torch 2.12, so every thread that compiles calls this (``compiled_flex`` does)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                DYNAMO_CACHE_SIZE_LIMIT)


def compiled_flex(backend: str = "inductor"):
    """``torch.compile(flex_attention, dynamic=True)`` with ``backend``, built once
    per process and backend; raises the calling thread's recompile budget
    (``configure_dynamo``) at every call."""
    configure_dynamo()
    return _compiled_flex(backend)


@functools.lru_cache(maxsize=4)
def _compiled_flex(backend: str):
    from torch.nn.attention.flex_attention import flex_attention

    return compiler(flex_attention, backend)


class RecompileCounter:
    """Counts dynamo's recompilations in this process while open: its "Recompiling
    function" log events (the ``recompiles`` log artifact is turned on) and the times a
    function hit dynamo's recompile limit (after which it runs uncompiled), keeping the
    first ``keep`` messages (one line each). ``graphs()``: dynamo's unique graphs so far.
    Use as a context manager or call ``close()``; torch's log settings go back to their
    defaults on close."""

    def __init__(self, keep: int = 5) -> None:
        import torch._logging

        self.count, self.limit_hits, self.examples, self.keep = 0, 0, [], keep
        torch._logging.set_logs(recompiles=True)
        counter = self

        class Handler(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if message.startswith("Recompiling function"):
                    counter.count += 1
                elif message.startswith("torch._dynamo hit config."):
                    counter.limit_hits += 1
                else:
                    return
                if len(counter.examples) < counter.keep:
                    counter.examples.append(" ".join(message.split())[:300])
        self.handler = Handler()
        logging.getLogger("torch._dynamo").addHandler(self.handler)

    def __enter__(self) -> "RecompileCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop counting; torch's log settings back to their defaults."""
        import torch._logging

        logging.getLogger("torch._dynamo").removeHandler(self.handler)
        torch._logging.set_logs()

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
