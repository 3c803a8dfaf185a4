"""Dispatch-level recorders the tests use to see which tensors an op sequence creates."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Records the number of dispatched ops (``n``) and every output's shape (``shapes``)."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out
