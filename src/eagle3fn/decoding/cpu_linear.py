"""Linear layers of a few rows on a CPU (``few_rows``): the verifying forward of
speculative decoding runs the target on ``k + 1`` tokens per row, and on some CPUs
``F.linear`` of a few rows costs several times one row's, where ``W @ X^T`` of the same
rows costs about one row's (both read every weight from memory once, which bounds a
small model's decoding step on a CPU; ``F.linear`` of a few rows takes another BLAS
path there). Measured on a 2-core AMD EPYC (AVX2, no AMX) with torch 2.13's CPU
wheel: docs/results.md, "Decoding on a CPU".

``few_rows(model, rows)`` times both forms on the model's largest linear weight (the
head) at 2 and at ``rows`` rows and, only where ``W @ X^T`` wins at both by
``MIN_GAIN``, makes every ``nn.Linear`` of the model compute inputs of ``2..MAX_ROWS``
rows that way until the context exits; one row, more rows and anything that needs
gradients keep ``F.linear``. The same modules serve the target alone (the speedup's
baseline) and the speculative side, so both run one forward. On other devices it does
nothing.

Legend: R rows (the product of the input's leading dims), K in features, N out features.
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64
"""The most rows an input may have to take the ``W @ X^T`` form (verifying forwards:
batch x (k + 1) tokens; a prompt's prefill is longer and keeps ``F.linear``)."""

MIN_GAIN = 0.8
"""``W @ X^T`` is used only where it takes at most this fraction of ``F.linear``'s time at
both measured row counts."""

REPEATS = 5
"""Timed calls of each form at each row count (the median counts), after one untimed."""


@dataclass(frozen=True)
class Choice:
    """What ``few_rows`` measured and chose (``asdict`` goes into eval's JSON)."""

    form: str
    """``"w_xt"`` (``W @ X^T`` for 2..MAX_ROWS rows) or ``"linear"`` (nothing changed)."""
    rows: tuple[int, ...] = ()
    """The row counts timed (2 and the verify's), empty when nothing was timed."""
    linear_s: tuple[float, ...] = ()
    """Median seconds of ``F.linear`` on the head weight at each of ``rows``."""
    w_xt_s: tuple[float, ...] = ()
    """Median seconds of ``W @ X^T`` there."""
    layers: int = 0
    """``nn.Linear`` modules switched (0 with ``"linear"``)."""


def w_xt(weight_NK: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` without bias as ``(W @ X^T)^T``: ``x [..., K]`` ->
    ``[..., N]`` (the same sums, another BLAS call; equal up to fp rounding)."""
    rows = x.numel() // x.shape[-1]
    return (weight_NK @ x.reshape(rows, x.shape[-1]).T).T.reshape(*x.shape[:-1], weight_NK.shape[0])


def _few_rows_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with inputs of 2..MAX_ROWS rows (no autograd) as ``w_xt``."""
    rows = x.numel() // max(x.shape[-1], 1)
    if 2 <= rows <= MAX_ROWS and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        y = w_xt(self.weight, x)
        return y if self.bias is None else y + self.bias
    return F.linear(x, self.weight, self.bias)


def time_forms(weight_NK: torch.Tensor, rows: int, repeats: int = REPEATS,
               clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Median seconds of ``F.linear`` and of ``w_xt`` on ``rows`` random rows ``[rows, K]``."""
    x = torch.randn(rows, weight_NK.shape[1], dtype=weight_NK.dtype, device=weight_NK.device)
    out = []
    with torch.no_grad():
        for form in (lambda: F.linear(x, weight_NK), lambda: w_xt(weight_NK, x)):
            form()
            times = []
            for _ in range(repeats):
                t0 = clock()
                form()
                times.append(clock() - t0)
            out.append(sorted(times)[len(times) // 2])
    return out[0], out[1]


@contextlib.contextmanager
def few_rows(model: nn.Module, rows: int,
             timer: Callable[[torch.Tensor, int], tuple[float, float]] | None = None) -> Iterator[Choice]:
    """Within the context, ``model``'s ``nn.Linear`` layers compute inputs of
    ``2..MAX_ROWS`` rows (no autograd) as ``W @ X^T`` when, on a CPU, ``timer`` (seconds
    of ``F.linear`` and of ``W @ X^T`` on the largest linear weight) finds that form
    faster by ``MIN_GAIN`` at 2 rows and at ``min(rows, MAX_ROWS)``; otherwise nothing
    changes. Yields the ``Choice``; the layers get their own forward back on exit.
    ``timer`` None: ``time_forms``, read from this module at call time.

    Args:
        model: e.g. the target's HF model (``TargetModel.model``).
        rows: the verifying forward's rows, batch x (k + 1).
    """
    linears = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)]
    if not linears or linears[0].weight.device.type != "cpu" or rows < 2:
        yield Choice("linear")
        return
    head = max(linears, key=lambda m: m.weight.numel()).weight
    sizes = tuple(sorted({2, min(rows, MAX_ROWS)}))
    timer = time_forms if timer is None else timer
    timed = [timer(head, r) for r in sizes]
    use = all(wx <= MIN_GAIN * lin for lin, wx in timed)
    choice = Choice("w_xt" if use else "linear", sizes, tuple(t[0] for t in timed), tuple(t[1] for t in timed),
                    len(linears) if use else 0)
    if use:
        for m in linears:
            m.forward = types.MethodType(_few_rows_forward, m)
    try:
        yield choice
    finally:
        if use:
            for m in linears:
                del m.forward


def choice_record(choice: Choice) -> dict:
    """``choice`` as a JSON-ready dict."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(choice).items()}
