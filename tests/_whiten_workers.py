"""Worker of the 2-rank ``global_masked_whiten`` test (spawned; see ``_dist_workers.launch``).

Each rank holds a shard of different shape, with NaN/inf at unselected entries and values of
very different magnitudes; every rank whitens its shard with the global statistics and saves
the results, which the test compares with ``masked_whiten`` on the concatenation.
"""

from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from rlobjectives.distributed import global_masked_whiten

OPTIONS = (
    {"shift_mean": True, "unbiased": True},
    {"shift_mean": False, "unbiased": True},
    {"shift_mean": True, "unbiased": False, "eps": 0.0},
)
SCALES = (1.0, 1e20, 1e-20)


def shard(rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: (3, 5) float32; rank 1: (2, 7). NaN/inf at unselected entries."""
    generator = torch.Generator().manual_seed(100 + rank)
    shape = (3, 5) if rank == 0 else (2, 7)
    values = (torch.randn(shape, generator=generator) * 2.0 + 3.0 * rank) * scale
    mask = torch.rand(shape, generator=generator) < 0.7
    mask[0, 0] = True
    dirty = torch.where(mask, values, torch.tensor(float("nan") if rank else float("inf")))
    return dirty, mask


def whiten_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry point of a spawned rank: results to ``rank{r}.pt``, traceback to ``rank{r}.err``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        results = {}
        for scale in SCALES:
            values, mask = shard(rank, scale)
            for k, options in enumerate(OPTIONS):
                results[f"{scale}/{k}"] = global_masked_whiten(values, mask, **options)  # type: ignore[arg-type]
        # A rank with nothing selected still takes part (the other rank's statistics apply).
        empty = torch.zeros(4) if rank == 0 else torch.tensor([1.0, 2.0, 4.0])
        empty_mask = (
            torch.zeros(4, dtype=torch.bool) if rank == 0 else torch.ones(3, dtype=torch.bool)
        )
        results["empty_rank"] = global_masked_whiten(empty, empty_mask)
        explicit = dist.new_group(list(range(world_size)))
        values, mask = shard(rank, 1.0)
        results["explicit_group"] = global_masked_whiten(values, mask, group=explicit)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
