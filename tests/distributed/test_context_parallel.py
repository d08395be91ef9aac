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

import rlobjectives as rlo
from _context_workers import CASES, GROUPS, WIDTH, Case, launch, make_problem, owners, reference
from tolerances import CONTEXT_TOLERANCE, tolerance

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results (one launch for the module)."""
    return launch(str(tmp_path_factory.mktemp("context")))


def _tolerance(case: Case) -> dict[str, float]:
    if case.dtype != torch.float64:  # rounded once to the input dtype
        return tolerance(case.dtype)
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


# --------------------------------------------------------------------------------------------
# Data x context parallelism: 2 x 2 ranks, normalisers over both groups
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_data_times_context_parallel_equals_the_whole_step(
    ranks: list[dict[str, Any]], reduction: str
) -> None:
    # The step's batch: replica 0's sequences (on ranks 0 and 1), then replica 1's (2 and 3).
    problems = [make_problem(Case("dp", "policy_loss", {}, seed=700 + r)) for r in range(2)]
    log_probs = torch.cat([p.tokens["log_probs"] for p in problems]).requires_grad_(True)
    whole = rlo.policy_loss(
        log_probs,
        torch.cat([p.tokens["old_log_probs"] for p in problems]),
        torch.cat([p.sequences["advantages"] for p in problems]),
        torch.cat([p.mask for p in problems]),
        reduction=reduction,
        max_response_length=WIDTH,
    )
    whole.loss.backward()
    mask = torch.cat([p.mask for p in problems])
    expected_counts = [int(mask.sum()), int((mask.sum(-1) > 0).sum()), mask.shape[0]]
    losses, shares = [], []
    for rank in range(4):
        result = ranks[rank]["_dp"][reduction]
        assert result["counts"] == expected_counts  # one rank of each CP group per DP group
        replica = rank // 2
        grad = log_probs.grad.detach()[replica * 5 : (replica + 1) * 5]
        _compare(result["grad"], _at(grad, result["index"]), _DP, f"rank {rank} grad")
        losses.append(result["loss"])
        shares.append(result["diagnostics"])
    # each CP pair returns its replica's share (the same on both ranks); the shares add up
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    torch.testing.assert_close(losses[2], losses[3], rtol=0, atol=0)
    _compare(losses[0] + losses[2], whole.loss.detach(), _DP, "summed loss")
    # the diagnostics over the global token count add up the same way (sum_diagnostics over DP)
    _compare(shares[0] + shares[2], whole.diagnostics.clipped_fraction, _DP, "diagnostics")
    _compare(shares[1], shares[0], _DP, "diagnostics of the CP pair")


_DP = Case("dp", "policy_loss", {})


# --------------------------------------------------------------------------------------------
# What crosses the ranks: one all-reduce of (S,) values per quantity, batched
# --------------------------------------------------------------------------------------------

S = 5  # sequences of the traffic problem; buffers are float64 (8 bytes) except the DP counts
TRAFFIC = {
    # the loss total and its count, the 10 diagnostic sums and their count: scalars only
    "policy_loss token_mean": [("all_reduce", 8 * 13)],
    # the (S,) row sums and counts, the 10 sums and the count, in one all-reduce
    "policy_loss sequence_mean": [("all_reduce", 8 * (S + 10 + S + 1))],
    # GSPO: the (S,) log-ratio sums and counts first, then the rest
    "policy_loss GSPO sequence_mean": [
        ("all_reduce", 8 * 2 * S),
        ("all_reduce", 8 * (S + 10 + S + 1)),
    ],
    "kl_loss sequence_mean": [("all_reduce", 8 * 2 * S)],
    "kl_penalized_rewards": [("all_reduce", 8 * S)],  # D_i
    "gae": [("all_gather", 8 * S * 4)],  # the (S, 4) boundary states
    # the two micro-batches' (S,) counts over the CP group, then the int64 3-vector over DP
    "global_normalizers": [("all_reduce", 8 * 2 * S), ("all_reduce", 8 * 3)],
    # the clip fraction's 2 counts; the (S,) row sums and counts; the explained variance: the
    # common scale's maximum, then both variances' maxima, [2 sums, count], 2 squared deviations
    "value_loss clip sequence_mean": [
        ("all_reduce", 8 * 2),
        ("all_reduce", 8 * 2 * S),
        ("all_reduce", 8),
        ("all_reduce", 8 * 2),
        ("all_reduce", 8 * 3),
        ("all_reduce", 8 * 2),
    ],
}


@pytest.mark.parametrize("call", sorted(TRAFFIC))
def test_collectives_per_call(ranks: list[dict[str, Any]], call: str) -> None:
    for rank in range(4):
        assert ranks[rank]["_traffic"][call] == TRAFFIC[call], (rank, call)


def test_errors_that_need_real_groups(ranks: list[dict[str, Any]]) -> None:
    # rank 3 is not in the pair {0, 1}: new_group gave it NON_GROUP_MEMBER
    assert ranks[3]["_errors"]["outside"].startswith("ValueError: context_group must contain")
    for rank in range(2):  # M2PO's / KL-Cov's selection needs the whole batch
        for name, kind in (("m2po", "M2PO"), ("kl_cov", "KLCov")):
            message = ranks[rank]["_errors"][name]
            assert message.startswith(f"ValueError: context_group cannot be used with {kind}")
            assert "global_m2po_mask" in message and "surrogate=" in message
    for rank in range(4):  # group=None is the world: it overlaps the context group
        message = ranks[rank]["_errors"]["overlap"]
        assert message.startswith("ValueError: group must be the data-parallel group"), message
