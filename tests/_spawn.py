"""One launcher for the multi-process tests: spawned ranks, one deadline, early failure.

``spawn_ranks(target, args, world_size, out_dir, timeout_s)`` starts ``target(*args(rank))``
on ``world_size`` spawned processes and returns what each rank saved to ``rank{r}.pt``. It
waits until every rank is done or one has failed (the others would wait for it in a
collective), raises ``RuntimeError`` with the failed ranks' tracebacks (``rank{r}.err``) or
``TimeoutError`` after ``timeout_s``, and always terminates, then kills, what is still running.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["spawn_ranks"]


def spawn_ranks(
    target: Callable[..., None],
    args: Callable[[int], tuple[Any, ...]],
    world_size: int,
    out_dir: str,
    timeout_s: float,
    *,
    weights_only: bool = True,
) -> list[Any]:
    """Run ``target(*args(rank))`` on each rank; the ranks' ``rank{r}.pt`` (module docstring)."""
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=target, args=args(rank), daemon=True) for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        while True:  # until every rank is done, or one failed (the others would wait for it)
            running = [p for p in processes if p.exitcode is None]
            if not running or any(p.exitcode for p in processes if p.exitcode is not None):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                stragglers = [rank for rank, p in enumerate(processes) if p in running]
                raise TimeoutError(f"ranks {stragglers} still running after {timeout_s} s")
            wait([p.sentinel for p in running], timeout=left)
        failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (0, None)]
        if failed:  # (the ranks still running are ended below)
            reports = []
            for rank in failed:
                path = Path(out_dir) / f"rank{rank}.err"
                text = path.read_text() if path.exists() else "(no traceback)"
                reports.append(f"rank {rank} (exit code {processes[rank].exitcode}):\n{text}")
            raise RuntimeError("worker ranks failed:\n" + "\n".join(reports))
        return [
            torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=weights_only)
            for rank in range(world_size)
        ]
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():  # pragma: no cover - a rank ignoring SIGTERM
                process.kill()
                process.join(5)
