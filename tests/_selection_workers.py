"""Worker of tests/distributed/test_global_selections.py: 2 gloo ranks, spawned once.

Spawned children import this module by name (``spawn`` passes the parent's ``sys.path``). The
ranks share one problem (:func:`problem`, the same on every rank): rank 0 holds rows 0-2 of it,
rank 1 rows 3-4 with fewer columns (their tokens beyond column 5 are unselected in the full
batch), so that the concatenation of the ranks' selected tokens in rank order is the full
batch's row-major order. The rendezvous is a file store in the test's temporary directory (no
port to race for); every rank destroys its process group before it exits.
"""

from __future__ import annotations

import dataclasses
import datetime
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlobjectives import DPPO, Clip, ClipCov, KLCov, nll_loss, policy_loss
from rlobjectives.distributed import (
    global_cov_selection,
    global_m2po_mask,
    global_normalizers,
    normalizer_for_reduction,
)

WORLD_SIZE = 2
ROWS = {0: slice(0, 3), 1: slice(3, 5)}
WIDTH = {0: 7, 1: 5}
MICRO_BATCHES = {0: ((0,), (1, 2)), 1: ((0, 1),)}  # local rows per micro-batch
THRESHOLDS = (0.02, 0.1)
OBJECTS = {
    "kl_cov": KLCov(ratio=0.3, coef=1.0),
    "clip_cov": ClipCov(ratio=0.25, cov_lb=-2.0, cov_ub=2.0),
}
CLIP_COV_SEED = 13  # the generator of rank 0 (and of the single-process call)
NLL_WEIGHT = 0.1
TIMEOUT_S = 60.0


class Problem(NamedTuple):
    log_probs: torch.Tensor  # (5, 7) float64
    old_log_probs: torch.Tensor
    advantages: torch.Tensor  # (5, 7)
    mask: torch.Tensor  # (5, 7) bool; rows 3-4 unselected beyond column 5
    rewards: torch.Tensor  # (5,)


def problem() -> Problem:
    generator = torch.Generator().manual_seed(24)
    log_probs = -2 * torch.rand(5, 7, generator=generator, dtype=torch.float64)
    old = log_probs + 0.3 * torch.randn(5, 7, generator=generator, dtype=torch.float64)
    advantages = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=generator) < 0.8
    mask[3:, 5:] = False
    advantages[1] = advantages[0]  # a tie across rows (GRPO's identical responses)
    log_probs[1], old[1], mask[1] = log_probs[0], old[0], mask[0]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    return Problem(log_probs, old, advantages, mask, rewards)


def local(rank: int) -> Problem:
    full = problem()
    rows, width = ROWS[rank], WIDTH[rank]
    return Problem(*(x[rows, :width] for x in full[:4]), full.rewards[rows])


def _clip_cov(rank: int) -> ClipCov:
    surrogate = OBJECTS["clip_cov"]
    assert isinstance(surrogate, ClipCov)
    # rank 1's generator is seeded differently: the draw must take rank 0's seed only
    seed = CLIP_COV_SEED if rank == 0 else 999
    return dataclasses.replace(surrogate, generator=torch.Generator().manual_seed(seed))


def rank_results(rank: int) -> dict[str, Any]:
    data = local(rank)
    results: dict[str, Any] = {}
    group = dist.new_group(list(range(WORLD_SIZE)))  # an explicit group for one of the calls
    log_ratio = data.log_probs - data.old_log_probs
    for threshold in THRESHOLDS:
        results[f"m2po-{threshold}"] = global_m2po_mask(log_ratio, data.mask, threshold=threshold)
    for name in OBJECTS:
        surrogate = _clip_cov(rank) if name == "clip_cov" else OBJECTS[name]
        selection = global_cov_selection(
            data.log_probs, data.old_log_probs, data.advantages, data.mask,
            surrogate=surrogate, group=group if name == "kl_cov" else None,
        )  # fmt: skip
        results[name] = selection._asdict()
    # RL + NLL on the correct responses (docs/objectives/policy.md): 2 ranks x micro-batches,
    # each term with its own global normaliser; the sum of the micro-batch losses over ranks and
    # the per-rank gradients equal one call on the full batch.
    correct = data.mask & (data.rewards > 0)[:, None]
    pieces = [torch.tensor(rows) for rows in MICRO_BATCHES[rank]]
    rl = normalizer_for_reduction(
        global_normalizers([data.mask[p] for p in pieces]), reduction="token_mean"
    )
    ce = normalizer_for_reduction(
        global_normalizers([correct[p] for p in pieces]), reduction="token_mean"
    )
    leaf = data.log_probs.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for p in pieces:
        policy = policy_loss(
            leaf[p], data.old_log_probs[p], data.advantages[p], data.mask[p],
            surrogate=DPPO(), normalizer=rl,
        ).loss  # fmt: skip
        loss = policy + NLL_WEIGHT * nll_loss(leaf[p], correct[p], normalizer=ce)
        loss.backward()  # the micro-batch gradients add up in leaf.grad
        total = total + loss.detach()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    results["recipe"] = {"loss": total, "grad": leaf.grad}
    # M2PO over the ranks, then the kept tokens' plain surrogate with the global kept count
    kept = results["m2po-0.1"]
    kept_count = normalizer_for_reduction(global_normalizers([kept]), reduction="token_mean")
    m2po_leaf = data.log_probs.clone().requires_grad_(True)
    m2po = policy_loss(
        m2po_leaf,
        data.old_log_probs,
        data.advantages,
        kept,
        surrogate=Clip(low=None),
        normalizer=kept_count,
    ).loss
    m2po.backward()
    m2po_total = m2po.detach().clone()
    dist.all_reduce(m2po_total, op=dist.ReduceOp.SUM)
    results["m2po-loss"] = {"loss": m2po_total, "grad": m2po_leaf.grad}
    return results


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry point of a spawned rank: results to ``rank{r}.pt``, traceback to ``rank{r}.err``."""
    del port  # a file store instead of a TCP port
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{Path(out_dir) / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        torch.save(rank_results(rank), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


__all__ = [
    "CLIP_COV_SEED", "MICRO_BATCHES", "NLL_WEIGHT", "OBJECTS", "ROWS", "THRESHOLDS",
    "WIDTH", "local", "problem", "worker",
]  # fmt: skip
