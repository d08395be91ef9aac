"""Which rank this process is, its share of a batch, and sums over all ranks.

Single-process runs see rank 0 of 1 and sums over themselves alone; under ``torchrun`` the
demo's Gloo group (:mod:`rlobjectives.demo._process_group`) answers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum", "is_distributed", "rank_and_world_size", "shard"]


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is running."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the number of ranks (``(0, 1)`` without a process group)."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` over all ranks (a copy; ``values`` itself without a group)."""
    if is_distributed():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def shard(count: int, rank: int, world_size: int) -> slice:
    """The rows ``[rank * count / W, (rank + 1) * count / W)`` of this rank."""
    return slice(rank * count // world_size, (rank + 1) * count // world_size)
