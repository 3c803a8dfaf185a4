"""Where and in which precision to run: one rule for ``train``, ``prepare`` and ``eval``."""

from __future__ import annotations

import torch

from eagle3fn.errors import UsageError


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; any other name as given,
    checked: ``cuda`` on a machine without a GPU is a UsageError naming the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UsageError(f"--device {name!r} is not a torch device ({e}); use auto, cpu or cuda") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name} but torch sees no GPU on this machine; use --device auto "
                         "(picks the CPU here) or --device cpu")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """The target's (and the offline cache's) dtype on ``device``: bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
