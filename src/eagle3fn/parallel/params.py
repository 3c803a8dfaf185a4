"""Sharded draft parameters: explicit DTensor ``Shard(0)`` over every rank, gathered
for compute, gradients reduce-scattered.

Why not FSDP2 ``fully_shard``: the TTT is a pure function of a parameter dict
(``ttt(params, ...)``, the draft's layer functions of ``eagle3fn.draft``), while
``fully_shard`` hooks a module's ``forward``. Sharding the dict itself keeps the functional core untouched:
``gather`` is one all-gather per parameter, ``reduce_grads`` after backward the
reduce-scatter FSDP would issue, AdamW runs on the local shards (1/world of the
optimizer state per rank), and a checkpoint is the full tensors, valid for any layout.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from eagle3fn.parallel.mesh import Layout


def shard(params: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Trainable tensors become leaf DTensors ``Shard(0)`` on ``layout.world_mesh``
    (rank 0's values); frozen ones (``requires_grad=False``, the embedding) stay whole."""
    out = {}
    for name, p in params.items():
        if not p.requires_grad:
            out[name] = p
            continue
        out[name] = distribute_tensor(p.detach(), layout.world_mesh, [Shard(0)]).requires_grad_(True)
    return out


def gather(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors for compute: leaves whose ``.grad`` holds this rank's gradient
    after backward (``reduce_grads`` then sums them into the shards). Plain tensors
    pass through.

    The reduction runs after backward, not inside it: autograd may order a rank's
    backward collectives (ring, all-to-all) differently from another rank's, and a
    reduce-scatter interleaved with them could deadlock.
    """
    out = {}
    for name, p in params.items():
        if isinstance(p, DTensor):
            # One rank: the shard is the whole tensor; share its storage, copy nothing.
            whole = p.to_local() if p.device_mesh.size() == 1 else p.full_tensor()
            p = whole.detach().requires_grad_(True)
        out[name] = p
    return out


def reduce_grads(sharded: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor]) -> None:
    """Set each sharded parameter's ``.grad`` to its shard of the sum over ranks of the
    gathered copies' gradients (one reduce-scatter per parameter)."""
    for name, p in sharded.items():
        if not isinstance(p, DTensor):
            continue
        g = gathered[name].grad
        if g is None:
            g = torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device)
        partial = DTensor.from_local(g.to(p.dtype), p.device_mesh, [Partial()], run_check=False,
                                     shape=p.shape, stride=p.stride())
        grad = partial.redistribute(p.device_mesh, [Shard(0)])
        p.grad = grad if p.grad is None else p.grad + grad


def distribute_like(param: DTensor, whole: torch.Tensor) -> DTensor:
    """``whole`` (e.g. from a checkpoint) sharded like ``param``."""
    return distribute_tensor(whole.to(param.to_local().device, param.dtype), param.device_mesh,
                             param.placements)


def full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached whole tensors (e.g. for a checkpoint); plain tensors pass through."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for n, t in tensors.items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every DTensor gathered (layout-free checkpoint)."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in s.items()}
                      for i, s in state["state"].items()}
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a ``full_optimizer_state`` into an optimizer over sharded parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        sharded[i] = {k: (distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                          if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 else v)
                      for k, v in s.items()}
    optimizer.load_state_dict({**state, "state": sharded})
