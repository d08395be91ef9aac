"""Context parallelism (issue 23): every ``context_group=`` function against the unsplit call.

One module-scoped launch of 4 gloo ranks (``tests/_context_workers.py``) runs every case: each
rank of a case's context group (2 or 3 ranks; new_group subsets of the 4) holds its tokens of
the same sequences (uneven contiguous chunks, a rank without any token of a sequence, or random
subsets; padded and packed; NaN/inf at every unselected and padding position) and calls the
function with ``context_group``. Here, in one process, the same function runs on the whole
problem; each rank's replicated outputs (loss, per-sequence values, diagnostics) must equal the
unsplit ones, its per-token outputs and its inputs' gradients the unsplit ones at its tokens
(zeros at its padding), within 1e-12 in float64 (the Triton interpreter cases: float32, the
float32 tolerance). Data x context parallelism: 2 x 2 ranks, normalisers over both groups.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _context_workers import CASES, GROUPS, Case, launch, make_problem, owners, reference
from tolerances import CONTEXT_TOLERANCE, tolerance

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results (one launch for the module)."""
    return launch(str(tmp_path_factory.mktemp("context")))


def _tolerance(case: Case) -> dict[str, float]:
    return tolerance(torch.float32) if case.kernels else CONTEXT_TOLERANCE


def _at(whole: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The whole problem's per-token ``whole`` at a rank's tokens (0 at its padding)."""
    flat = torch.cat([whole.reshape(-1).double(), torch.zeros(1, dtype=torch.float64)])
    return flat[index % flat.numel()].reshape(index.shape)


def _compare(actual: torch.Tensor, expected: torch.Tensor, case: Case, what: str) -> None:
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        **_tolerance(case),
        msg=lambda m: f"{case.name} {what}: {m}",
    )


def _check(case: Case, results: list[dict[str, Any]]) -> None:
    expected = reference(case)
    members = GROUPS[case.group]
    pieces = [results[rank][case.name] for rank in members]
    head_grads: dict[str, torch.Tensor] = {}
    for position, piece in zip(range(len(members)), pieces, strict=True):
        index = piece["index"]
        for key, value in expected["replicated"].items():
            _compare(piece["replicated"][key], value, case, f"rank {position} {key}")
        for key, value in expected["sharded"].items():
            local = piece["sharded"][key]
            assert torch.isfinite(local).all(), (case.name, key)
            _compare(local, _at(value, index), case, f"rank {position} {key}")
        for key, value in expected["grads"].items():
            local = piece["grads"][key]
            assert torch.isfinite(local).all(), (case.name, key)  # NaN/inf reach no gradient
            if key in ("weight", "bias"):  # replicated parameters: the ranks' parts add up
                head_grads[key] = head_grads.get(key, 0) + local.double()
            elif key == "hidden":
                for h in range(value.shape[-1]):
                    _compare(
                        local[..., h],
                        _at(value[..., h], index),
                        case,
                        f"rank {position} grad hidden",
                    )
            else:
                _compare(local, _at(value, index), case, f"rank {position} grad {key}")
    for key, value in head_grads.items():
        _compare(value, expected["grads"][key], case, f"summed grad {key}")
    # every token of the whole problem is on exactly one rank
    whole = make_problem(case)
    owner = owners(case, whole, len(members))
    assert owner.min() >= 0 and owner.max() < len(members)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_context_parallel_equals_unsplit(ranks: list[dict[str, Any]], case: Case) -> None:
    _check(case, ranks)
