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


def has_bf16_units(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices natively and faster than fp32: CUDA, and
    CPUs with AMX tiles (Intel Sapphire Rapids and later; the target's forward there is
    about 5x fp32's, docs/results.md "The CPU demo")."""
    return device.type == "cuda" or (device.type == "cpu" and torch.cpu._is_amx_tile_supported())


def train_dtype(device: torch.device) -> torch.dtype:
    """The training step's ``--precision auto`` on ``device``: bf16 where it has bf16 matrix
    units (``has_bf16_units``; the masters stay fp32), fp32 elsewhere."""
    return torch.bfloat16 if has_bf16_units(device) else torch.float32


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``eagle3fn eval`` decodes in and ``prepare`` runs the target and stores
    its cache in (their ``auto``): bf16 on CUDA, fp32 on the CPU (a bf16 cache is lossy,
    and bf16 decoding on the CPU is no faster at batch 1, where the host bounds it, and
    rounds the target's argmax near-ties differently). Training converts a cache to its
    own compute dtype (``train_dtype``)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
