"""Multi-process harness and worker for tests/test_distributed.py.

Spawned children import this module by name (``spawn`` passes the parent's ``sys.path``), so it
holds everything both sides need: the tiny policy model, the problem (a batch of 8 responses of
very different lengths), how it is split over 2 ranks x 2 micro-batches, the per-rank training
step (global normaliser or naive per-micro-batch normalisation) and the process launcher.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from _spawn import spawn_ranks
from rlobjectives import Clip, policy_loss
from rlobjectives.distributed import (
    data_parallel_loss_scale,
    global_normalizers,
    global_top_entropy_mask,
    normalizer_for_reduction,
    sum_diagnostics,
)

try:  # the rollout correction (issue 12); the tests run without it if it is not there yet
    from rlobjectives import rollout_correction
except ImportError:  # pragma: no cover - depends on what is merged
    rollout_correction = None

try:  # the KL loss term (family issue); the tests run without it if it is not there yet
    from rlobjectives import kl_loss
except ImportError:  # pragma: no cover - depends on what is merged
    kl_loss = None

WORLD_SIZE = 2
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized")
VOCAB, HIDDEN = 11, 5
# Response lengths of the 8 sequences: very different, one empty (selects no token).
LENGTHS = (12, 1, 9, 0, 3, 12, 2, 7)
PADDED_LENGTH = 12
MAX_RESPONSE_LENGTH = 16  # the Dr. GRPO constant C, the same for every micro-batch
# rank -> micro-batches (row indices of the full batch). Unequal micro-batch sizes and token
# counts on purpose: with equal sizes the naive normalisation of some reductions is exact.
SPLITS: dict[int, tuple[tuple[int, ...], ...]] = {0: ((0, 1, 2), (3,)), 1: ((4,), (5, 6, 7))}
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
KL_COEF = 0.1
# Quantile levels of the global high-entropy mask (TRL top_entropy_quantile = 1 - level).
ENTROPY_QUANTILES = (0.0, 0.3, 0.5, 0.8, 1.0)
INIT_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 120.0


class TinyPolicy(nn.Module):
    """Embedding + linear head; ``forward`` returns the log-probabilities of ``targets``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embedding(input_ids))  # (B, T, V)
        log_probs = torch.log_softmax(logits.double(), dim=-1)  # (B, T, V)
        return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)


def make_model() -> TinyPolicy:
    """The same float64 initial model in every process."""
    torch.manual_seed(1234)
    return TinyPolicy().double()


class Batch(NamedTuple):
    input_ids: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64
    mask: torch.Tensor  # (B, T) bool
    old_log_probs: torch.Tensor  # (B, T) float64, NaN at unselected tokens
    ref_log_probs: torch.Tensor  # (B, T) float64, inf at unselected tokens
    advantages: torch.Tensor  # (B,) float64


def make_problem() -> Batch:
    """The full batch of the optimizer step (identical in every process)."""
    generator = torch.Generator().manual_seed(2024)
    batch = len(LENGTHS)
    shape = (batch, PADDED_LENGTH)
    input_ids = torch.randint(0, VOCAB, shape, generator=generator)
    targets = torch.randint(0, VOCAB, shape, generator=generator)
    positions = torch.arange(PADDED_LENGTH)
    mask = positions.unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)  # (B, T)
    mask[2, 4] = False  # a hole inside a response: masks are not just lengths
    with torch.no_grad():
        log_probs = make_model()(input_ids, targets)  # (B, T)
    # Behaviour and reference policies off the current one, far enough for the clips to bind.
    old = log_probs + 0.4 * torch.randn(shape, generator=generator, dtype=torch.float64)
    ref = log_probs + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    return Batch(
        input_ids=input_ids,
        targets=targets,
        mask=mask,
        old_log_probs=torch.where(mask, old, nan),
        ref_log_probs=torch.where(mask, ref, inf),
        advantages=torch.randn(batch, generator=generator, dtype=torch.float64),
    )


def micro_batch(problem: Batch, rows: Sequence[int]) -> Batch:
    """Rows of the full batch, re-padded to their own longest response (T differs)."""
    index = torch.tensor(list(rows))
    length = max(2, max(LENGTHS[row] for row in rows))
    picked = [field[index] for field in problem]
    return Batch(*(field[:, :length] if field.ndim == 2 else field for field in picked))


def step_loss(
    model: nn.Module,
    batch: Batch,
    *,
    reduction: str,
    normalizer: torch.Tensor | None,
    diagnostics_normalizer: torch.Tensor | None,
) -> tuple[torch.Tensor, Any]:
    """Policy loss (+ KL loss when available) of one (micro-)batch, and its diagnostics."""
    log_probs = model(batch.input_ids, batch.targets)  # (B, T)
    out = policy_loss(
        log_probs,
        batch.old_log_probs,
        batch.advantages,
        batch.mask,
        surrogate=Clip(low=CLIP_LOW, high=CLIP_HIGH),
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=MAX_RESPONSE_LENGTH,
        diagnostics_normalizer=diagnostics_normalizer,
    )
    loss = out.loss
    if kl_loss is not None:
        loss = loss + KL_COEF * kl_loss(
            log_probs,
            batch.ref_log_probs,
            batch.mask,
            estimator="k2",
            reduction=reduction,
            normalizer=normalizer,
            max_response_length=MAX_RESPONSE_LENGTH,
        )
    return loss, out.diagnostics


def train_step(
    micro_batches: Sequence[Batch],
    *,
    reduction: str,
    naive: bool,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """One optimizer step's backward passes on this rank (DDP + gradient accumulation).

    ``naive=False`` is the documented recipe: global normalisers counted once before the loop,
    every micro-batch loss multiplied by the world size. ``naive=True`` is the common bug: each
    micro-batch normalised by its own counts and divided by the number of micro-batches.
    """
    model = DistributedDataParallel(make_model(), process_group=group)
    counts = global_normalizers([mb.mask for mb in micro_batches], group=group)
    normalizer = normalizer_for_reduction(counts, reduction=reduction)
    token_normalizer = normalizer_for_reduction(counts, reduction="token_mean")
    scale = data_parallel_loss_scale(group=group)
    last = len(micro_batches) - 1
    loss_sum = torch.zeros((), dtype=torch.float64)
    diagnostics = []
    for k, batch in enumerate(micro_batches):
        # Gradients are all-reduced (averaged) only on the last micro-batch's backward.
        context = contextlib.nullcontext() if k == last else model.no_sync()
        with context:
            loss, diag = step_loss(
                model,
                batch,
                reduction=reduction,
                normalizer=None if naive else normalizer,
                diagnostics_normalizer=None if naive else token_normalizer,
            )
            ((loss / len(micro_batches)) if naive else (loss * scale)).backward()
        loss_sum = loss_sum + loss.detach()
        diagnostics.append(diag)
    dist.all_reduce(loss_sum, group=group)
    summed = sum_diagnostics(diagnostics, group=group)
    if naive:  # mean over micro-batches and ranks of the per-micro-batch values
        pieces = len(micro_batches) * scale
        loss_sum = loss_sum / pieces
        summed = type(summed)(*(value / pieces for value in summed))
    return {
        "grads": [p.grad.detach().clone() for p in model.parameters()],
        "loss": loss_sum,
        "diagnostics": dict(summed._asdict()),
        "counts": [int(c) for c in counts],
        "scale": scale,
    }


def rollout_metrics(micro_batches: Sequence[Batch], group: dist.ProcessGroup | None) -> Any:
    """Rollout-correction metrics of the step (old vs ref log-probs as trainer vs sampler),
    combined over this rank's micro-batches and all ranks (sums added, extremes min/max)."""
    if rollout_correction is None:
        return None
    pieces = [
        rollout_correction(
            mb.old_log_probs, mb.ref_log_probs, mb.mask, mode="mask", lower=0.7
        ).metrics
        for mb in micro_batches
    ]
    return sum_diagnostics(pieces, group=group)


def entropy_problem() -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token entropies of the full batch (with ties, NaN at unselected tokens) and its mask."""
    problem = make_problem()
    generator = torch.Generator().manual_seed(7)
    entropy = (4.0 * torch.rand(problem.mask.shape, generator=generator)).round(decimals=1)
    return entropy.masked_fill(~problem.mask, float("nan")), problem.mask


def rank_rows(rank: int) -> list[int]:
    """The rows of the full batch that ``rank`` holds (its micro-batches, in order)."""
    return [row for rows in SPLITS[rank] for row in rows]


def entropy_masks(rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    """This rank's global high-entropy masks (its rows re-padded to its own longest response);
    then the same with nothing selected on rank 1 (the empty rank still joins the collective)."""
    entropy, mask = entropy_problem()
    rows = rank_rows(rank)
    width = max(LENGTHS[row] for row in rows)
    local_entropy, local_mask = entropy[rows, :width], mask[rows, :width]
    masks = {
        f"{level}": global_top_entropy_mask(local_entropy, local_mask, quantile=level)
        for level in ENTROPY_QUANTILES
    }
    empty = torch.zeros_like(local_mask) if rank == 1 else local_mask
    masks["empty_rank"] = global_top_entropy_mask(local_entropy, empty, quantile=0.5, group=group)
    return masks


def rank_results(rank: int) -> dict[str, Any]:
    problem = make_problem()
    micro_batches = [micro_batch(problem, rows) for rows in SPLITS[rank]]
    # An explicit group (all ranks) for one reduction, the default group for the others.
    explicit_group = dist.new_group(list(range(WORLD_SIZE)))
    results: dict[str, Any] = {"kl_used": kl_loss is not None}
    for reduction in REDUCTIONS:
        group = explicit_group if reduction == "sequence_mean" else None
        results[reduction] = {
            "global": train_step(micro_batches, reduction=reduction, naive=False, group=group),
            "naive": train_step(micro_batches, reduction=reduction, naive=True, group=group),
        }
    metrics = rollout_metrics(micro_batches, None)
    results["rollout"] = None if metrics is None else dict(metrics._asdict())

    results["entropy_masks"] = entropy_masks(rank, explicit_group)
    return results


def ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry point of a spawned rank: results to ``rank{r}.pt``, traceback to ``rank{r}.err``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
        )
        torch.save(rank_results(rank), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def failing_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """A rank that fails before joining the group (tests the launcher's failure path)."""
    try:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    worker: Callable[[int, int, int, str], None],
    out_dir: str,
    *,
    world_size: int = WORLD_SIZE,
    timeout_s: float = JOIN_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``world_size`` spawned processes; return each rank's saved results.

    Bounded in time, stopped at the first failed rank (:func:`_spawn.spawn_ranks`). Raises
    ``RuntimeError`` with the ranks' tracebacks if any rank failed and ``TimeoutError`` if the
    deadline passed.
    """
    port = free_port()
    return spawn_ranks(
        worker, lambda rank: (rank, world_size, port, out_dir), world_size, out_dir, timeout_s
    )


__all__ = [
    "ENTROPY_QUANTILES",
    "REDUCTIONS",
    "entropy_problem",
    "rank_rows",
    "ddp_worker",
    "failing_worker",
    "launch",
    "make_model",
    "make_problem",
    "micro_batch",
    "step_loss",
]

if __name__ == "__main__":  # pragma: no cover - manual run: python tests/_dist_workers.py
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        start = time.monotonic()
        out = launch(ddp_worker, directory)
        print(f"{len(out)} ranks in {time.monotonic() - start:.1f} s; KL used: {out[0]['kl_used']}")
