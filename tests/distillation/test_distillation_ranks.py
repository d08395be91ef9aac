"""The distillation losses across 2 real gloo ranks x 2 micro-batches (global normalisers).

One spawn for the module (``_distill_workers.py``): each rank's losses and ``weight``
gradients, summed over its micro-batches with the normaliser of ``global_normalizers`` and
all-reduced, equal the single-process full batch's, for every loss from hidden states and for
``token_mean`` and ``sequence_mean``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_workers import launch
from _distill_workers import LOSSES, REDUCTIONS, distill_loss, distill_problem, distill_worker
from tolerances import assert_close


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(distill_worker, str(tmp_path_factory.mktemp("distill")))


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_ranks_and_micro_batches_add_up_to_the_full_batch(
    rank_results: list[dict[str, Any]], name: str, reduction: str
) -> None:
    problem = distill_problem()
    weight = problem["weight"].clone().requires_grad_(True)
    full = distill_loss(name, problem, weight, reduction=reduction)
    full.backward()
    assert weight.grad is not None
    assert float(full.detach()) > 0.0  # a nonzero loss: the comparison can fail
    for result in rank_results:  # every rank holds the all-reduced sums
        got = result[f"{name}/{reduction}"]
        assert_close(got["loss"], full.detach())
        assert_close(got["grad_weight"], weight.grad)
    assert torch.equal(rank_results[0][f"{name}/{reduction}"]["loss"],
                       rank_results[1][f"{name}/{reduction}"]["loss"])  # fmt: skip
