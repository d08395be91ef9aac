"""The global selections of issue 24 and the RL + NLL recipe on 2 real gloo ranks.

One spawn of 2 processes for the module (``tests/_selection_workers.py``, a file-store
rendezvous): :func:`rlobjectives.distributed.global_m2po_mask` and
:func:`rlobjectives.distributed.global_cov_selection` (KL-Cov's top-k with a tie across rows,
Clip-Cov's draw with rank 0's seed) equal the single-process selection of the concatenated
batch, ties included; M2PO's kept-token loss with the global kept count and the "RL + NLL on
the correct responses" recipe (each term with its own global normaliser, 2 ranks x unequal
micro-batches) equal one call on the full batch, value and gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from _dist_workers import launch
from _selection_workers import (
    CLIP_COV_SEED,
    NLL_WEIGHT,
    OBJECTS,
    ROWS,
    THRESHOLDS,
    WIDTH,
    problem,
    worker,
)
from rlobjectives import DPPO, Clip, ClipCov, cov_selection, m2po_mask, nll_loss, policy_loss
from tolerances import assert_close

pytestmark = pytest.mark.distributed  # every test reads the spawned gloo ranks below


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(worker, str(tmp_path_factory.mktemp("selections")))


def _local(full: torch.Tensor, rank: int) -> torch.Tensor:
    return full[ROWS[rank], : WIDTH[rank]]


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_global_m2po_mask_is_the_mask_of_the_whole_batch(
    ranks: list[dict[str, Any]], threshold: float
) -> None:
    full = problem()
    expected = m2po_mask(full.log_probs - full.old_log_probs, full.mask, threshold=threshold)
    for rank, results in enumerate(ranks):
        assert results[f"m2po-{threshold}"].equal(_local(expected, rank))
    # and not the per-rank masks (the split changes AReaL's micro-batch-local selection)
    local = [
        m2po_mask(_local(full.log_probs - full.old_log_probs, r), _local(full.mask, r),
                  threshold=threshold)
        for r in range(2)
    ]  # fmt: skip
    if threshold == 0.1:
        assert not all(local[r].equal(_local(expected, r)) for r in range(2))


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_global_cov_selection_is_the_selection_of_the_whole_batch(
    ranks: list[dict[str, Any]], name: str
) -> None:
    full = problem()
    surrogate = OBJECTS[name]
    if isinstance(surrogate, ClipCov):  # the single call with rank 0's seed
        surrogate = dataclasses.replace(
            surrogate, generator=torch.Generator().manual_seed(CLIP_COV_SEED)
        )
    expected = cov_selection(
        full.log_probs, full.old_log_probs, full.advantages, full.mask, surrogate=surrogate
    )
    assert int(expected.selected.sum()) >= 2  # a real selection
    for rank, results in enumerate(ranks):
        got = results[name]
        assert got["selected"].equal(_local(expected.selected, rank)), (name, rank)
        assert got["candidates"].equal(_local(expected.candidates, rank))
        assert int(got["k"]) == int(expected.k)


def test_rl_plus_nll_recipe_over_ranks_and_micro_batches(ranks: list[dict[str, Any]]) -> None:
    full = problem()
    correct = full.mask & (full.rewards > 0)[:, None]
    leaf = full.log_probs.clone().requires_grad_(True)
    loss = policy_loss(leaf, full.old_log_probs, full.advantages, full.mask, surrogate=DPPO())
    loss = loss.loss + NLL_WEIGHT * nll_loss(leaf, correct)
    (grad,) = torch.autograd.grad(loss, [leaf])
    for rank, results in enumerate(ranks):
        assert_close(results["recipe"]["loss"], loss.detach())
        assert_close(results["recipe"]["grad"], _local(grad, rank))


def test_m2po_over_ranks_with_the_global_kept_count(ranks: list[dict[str, Any]]) -> None:
    full = problem()
    kept = m2po_mask(full.log_probs - full.old_log_probs, full.mask, threshold=0.1)
    leaf = full.log_probs.clone().requires_grad_(True)
    loss = policy_loss(leaf, full.old_log_probs, full.advantages, kept, surrogate=Clip(low=None))
    (grad,) = torch.autograd.grad(loss.loss, [leaf])
    for rank, results in enumerate(ranks):
        assert_close(results["m2po-loss"]["loss"], loss.loss.detach())
        assert_close(results["m2po-loss"]["grad"], _local(grad, rank))
