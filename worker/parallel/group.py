"""The ranks of one tensor-parallel worker group and the collectives a step needs, over torch.distributed.

gloo on CPU (where the tests run), NCCL on CUDA. Every collective takes the group's timeout: a rank that
hangs (or died) inside one raises on the others instead of holding them for ever (issue 37, faults).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None  # None: one rank, every collective is the identity

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place), each rank's partial product of a split contraction."""
        if self.process_group is not None:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n], rank 0's columns first."""
        if self.process_group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TensorParallelGroup(0, 1, None)


def backend_for(device: torch.device | str) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones; raises ValueError naming what is missing."""
    kind = torch.device(device).type
    if kind == "cuda":
        if not dist.is_nccl_available():
            raise ValueError("--tensor-parallel-size > 1 on CUDA needs NCCL, which this torch build lacks")
        return "nccl"
    if not dist.is_gloo_available():
        raise ValueError("--tensor-parallel-size > 1 on CPU needs gloo, which this torch build lacks")
    return "gloo"


def join_group(rank: int, world_size: int, init_method: str, device: torch.device | str = "cpu",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """This process as rank `rank` of `world_size` (init_method: tcp://host:port or file://path, as
    torch.distributed takes it); every rank must call it with the same world_size and init_method. timeout_s:
    how long a step's collective waits for the other ranks."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of {world_size} ranks (0..{world_size - 1})")
    if world_size == 1:
        return SINGLE_RANK
    backend = backend_for(device)
    # joining waits for every rank's process to start (minutes on a loaded node); a step's collectives get
    # timeout_s on a group of their own, so a rank that hangs mid-step is caught quickly
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    return TensorParallelGroup(rank, world_size, dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s)))


def leave_group(group: TensorParallelGroup) -> None:
    if group.process_group is not None and dist.is_initialized():
        dist.destroy_process_group()
