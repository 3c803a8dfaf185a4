"""The device mesh: data parallel x sequence parallel (ring x Ulysses), from torchrun.

Rank layout (row-major over ``(dp, ring, ulysses)``): global rank
``dp_rank * sp + ring_rank * ulysses + ulysses_rank``; the sequence-parallel rank is
``sp_rank = ring_rank * ulysses + ulysses_rank`` and owns sequence chunk ``sp_rank``,
so a Ulysses group holds one contiguous super-chunk and the ring runs over those.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(kw_only=True)
class ParallelConfig:
    """How the ranks of a ``torchrun`` launch split the work (data parallel = the rest)."""

    ulysses: int = 1
    """Sequence-parallel degree by Ulysses: all-to-all between heads and sequence
    (the draft's query and kv heads must divide by it, or kv heads are repeated)."""
    ring: int = 1
    """Sequence-parallel degree by ring attention: step-0 keys/values pass rank to rank
    (P2P) and partial attentions merge by log-sum-exp."""
    timeout_s: int = 600
    """Collective timeout: a rank that waits longer fails instead of hanging."""

    def __post_init__(self) -> None:
        if self.ulysses < 1 or self.ring < 1:
            raise ValueError(f"--parallel.ulysses and --parallel.ring must be >= 1, got "
                             f"{self.ulysses} and {self.ring}")

    @property
    def sp(self) -> int:
        """Sequence-parallel degree, ``ulysses * ring``."""
        return self.ulysses * self.ring


@dataclass(frozen=True)
class Layout:
    """This rank's place in the mesh.

    Fields:
        mesh: 3-D mesh ``(dp, ring, ulysses)`` (groups for data and sequence parallelism).
        world_mesh: 1-D mesh over every rank (the draft parameters are sharded on it).
        dp, ring, ulysses: the degrees; ``sp = ring * ulysses``, ``world = dp * sp``.
        dp_rank, ring_rank, ulysses_rank: this rank's coordinates.
    """

    mesh: DeviceMesh
    world_mesh: DeviceMesh
    dp: int
    ring: int
    ulysses: int
    dp_rank: int
    ring_rank: int
    ulysses_rank: int

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    @property
    def sp_rank(self) -> int:
        """Which sequence chunk this rank owns."""
        return self.ring_rank * self.ulysses + self.ulysses_rank

    @property
    def world(self) -> int:
        return self.dp * self.sp

    def group(self, name: str):
        """The process group of mesh dimension ``dp``, ``ring`` or ``ulysses``."""
        return self.mesh.get_group(name)


def init_distributed(device: torch.device, timeout_s: int = 600) -> None:
    """Join the process group ``torchrun`` describes (``RANK``/``WORLD_SIZE`` in the
    environment), or make a one-process group when launched without it."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = tempfile.NamedTemporaryFile(prefix="eagle3fn-pg-", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timeout)


def leave_distributed() -> None:
    """Destroy the process group ``init_distributed`` joined, if any. Called when a
    command ends: a gloo group left to interpreter shutdown can abort the process after
    its work is done ("terminate called without an active exception", exit -6, seen
    under torchrun on a loaded machine), which torchrun reports as the run failing."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def build_layout(config: ParallelConfig, device: torch.device) -> Layout:
    """The mesh for ``config`` over the initialised process group.

    Raises:
        ValueError: the world size is not a multiple of ``ulysses * ring``.
    """
    world = dist.get_world_size()
    if world % config.sp:
        raise ValueError(
            f"world size {world} is not divisible by the sequence-parallel degree "
            f"--parallel.ulysses {config.ulysses} x --parallel.ring {config.ring} = {config.sp}; "
            f"launch a multiple of {config.sp} processes (torchrun --nproc-per-node) or change them"
        )
    dp = world // config.sp
    kind = device.type
    mesh = init_device_mesh(kind, (dp, config.ring, config.ulysses),
                            mesh_dim_names=("dp", "ring", "ulysses"))
    world_mesh = init_device_mesh(kind, (world,), mesh_dim_names=("world",))
    return Layout(mesh=mesh, world_mesh=world_mesh, dp=dp, ring=config.ring,
                  ulysses=config.ulysses, dp_rank=mesh.get_local_rank("dp"),
                  ring_rank=mesh.get_local_rank("ring"),
                  ulysses_rank=mesh.get_local_rank("ulysses"))


def is_main() -> bool:
    """Rank 0 of the process group, or a process without one (it owns files and logs)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced in place over every rank (``sum`` or ``max``) and returned; the
    tensor itself in a process without a group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor
