"""Vocabulary parallelism (issue 23): ``vocab_group=`` on real gloo ranks against one process.

Two launches for the module (``tests/_vocab_workers.py``): 2 ranks (slices 6 + 5 of V = 11, the
Triton interpreter cases too) and 3 ranks (4 + 4 + 3), spawned once each. Every case runs the
same code on one process with the whole vocabulary, here, in float64: the outputs must equal
the unsharded call's on every rank, the gradient of each slice-split leaf (logits, LM-head rows,
bias) the slice of the unsharded gradient, and the replicated hidden states' gradients must sum
over the ranks to the unsharded one (``hidden_grad="partial"``) or equal it on each rank
(``"reduced"``), all within 1e-12. The problem holds NaN in unselected rows (never read), a
banned ``-inf`` logit / bias entry, padded and packed layouts, temperatures and kept sets.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import _vocab_workers as workers
import rlobjectives as rlo
from backends import TRITON
from tolerances import tolerance

pytestmark = pytest.mark.distributed

EXACT = {"rtol": 1e-12, "atol": 1e-12}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return workers.launch(2, str(tmp_path_factory.mktemp("vocab2")), kernels=TRITON)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return workers.launch(3, str(tmp_path_factory.mktemp("vocab3")), kernels=False)


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    name = {2: "two_ranks", 3: "three_ranks"}[request.param]
    return request.param, request.getfixturevalue(name)


def _compare(world: int, results: list[dict[str, Any]], name: str, expected: dict[str, Any],
             tolerances: dict[str, float]) -> None:  # fmt: skip
    hidden_sum = None
    for rank, result in enumerate(results):
        got = result[name]
        assert len(got["outputs"]) == len(expected["outputs"])
        for index, (actual, want) in enumerate(zip(got["outputs"], expected["outputs"],
                                                   strict=True)):  # fmt: skip
            assert torch.equal(torch.isinf(actual), torch.isinf(want)), (name, rank, index)
            torch.testing.assert_close(
                actual.double(), want.double(), equal_nan=True, **tolerances,
                msg=lambda m, i=index, r=rank: f"{name} output {i} on rank {r}: {m}",
            )  # fmt: skip
        assert got["grads"].keys() == expected["grads"].keys(), name
        part = workers.vocab_slice(world, rank)
        for leaf, gradient in got["grads"].items():
            want = expected["grads"][leaf]
            assert torch.isfinite(gradient).all(), (name, leaf, rank)
            if leaf in workers.SPLIT:
                want = want[..., part] if leaf.endswith("logits") else want[part]
            elif name.endswith("partial"):  # this rank's part of the column-parallel sum
                hidden_sum = gradient.double() if hidden_sum is None else hidden_sum + gradient
                continue
            torch.testing.assert_close(
                gradient.double(), want.double(), **tolerances,
                msg=lambda m, g=leaf, r=rank: f"{name} grad {g} on rank {r}: {m}",
            )  # fmt: skip
    if hidden_sum is not None:
        torch.testing.assert_close(hidden_sum, expected["grads"]["hidden"].double(), **tolerances)


@pytest.mark.parametrize("name", list(workers.CASES))
def test_equals_one_process(ranks: tuple[int, list[dict[str, Any]]], name: str) -> None:
    world, results = ranks
    _compare(world, results, name, workers.run_case(name), EXACT)


@pytest.mark.kernels
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(workers.KERNEL_CASES))
def test_kernels_equal_one_process(two_ranks: list[dict[str, Any]], name: str) -> None:
    # The Triton LM head (interpreted, float32) on 2 ranks against the float64 PyTorch call.
    expected = workers.run_case(name.removeprefix("kernels-"))
    _compare(2, two_ranks, name, expected, tolerance(torch.float32))


def test_given_sizes_and_refusals(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = ranks
    data = workers.problem()
    want = rlo.token_log_probs(torch.nan_to_num(data["logits"]), data["tokens"].clamp(min=0))
    for result in results:
        torch.testing.assert_close(result["given-sizes"], want, **EXACT)
        errors = result["errors"]
        assert errors["top_p-alone"].startswith("top_p without top_k is not supported with")
        assert errors["sizes"].startswith("vocab_group: VocabParallel.vocab_sizes must list one")


def test_hostile_ids_as_one_process(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    # Issue 31, items 3 and 8 under vocab_group: kept ids all outside [0, V) are ignored (the
    # row keeps the whole vocabulary: finite, never NaN), and a selected token id outside
    # [0, V) raises on every rank as the unsharded call's gather does (never the finite
    # -logsumexp of the log-normaliser alone).
    _, results = ranks
    alone = workers.hostile(None)
    data = workers.problem()
    whole = rlo.token_log_probs(torch.nan_to_num(data["logits"]), data["tokens"].clamp(min=0))
    torch.testing.assert_close(alone["kept-outside"], whole, **EXACT)
    for key, error in alone.items():
        if key.startswith("token-outside"):
            assert error == "RuntimeError", (key, error)
    for result in results:
        torch.testing.assert_close(result["hostile"]["kept-outside"], whole, **EXACT)
        for key, error in alone.items():
            if key.startswith("token-outside"):
                assert result["hostile"][key] == error, (key, result["hostile"][key])


def test_sum_pi_squared_equals_verl_vocab_parallel(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    # verl 0.9.1's vocab_parallel_sum_pi_squared on each rank's slice equals exp of our
    # log_sum_sq_probs (one process, the whole vocabulary).
    _, results = ranks
    data = workers.problem()
    logits = torch.nan_to_num(data["logits"], nan=0.0)
    ours = rlo.token_log_probs(
        logits, data["tokens"].clamp(min=0), statistics=("log_sum_sq_probs",)
    )
    assert ours.log_sum_sq_probs is not None
    for result in results:
        torch.testing.assert_close(result["verl-sum-pi-squared"], ours.log_sum_sq_probs.exp(),
                                   **EXACT)  # fmt: skip


def test_statistics_bytes(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    # N = 10 rows, float64: the log-probs send one MAX of N and one SUM of 2 N; the entropy one
    # SUM row more; all four statistics: the entropy's and Sum p^2's rows in the same SUM, the
    # logit sum too (4 rows more than the log-probs), a MAX of N values and a MIN of N int64.
    _, results = ranks
    n = workers.BATCH * workers.STEPS
    for result in results:
        sent = result["statistics-bytes"]
        assert sent["log_probs"] == 8 * (n + 2 * n)
        assert sent["entropy"] == 8 * (n + 3 * n)
        assert sent["all"] == 8 * (n + 5 * n) + 8 * n + 8 * n


def test_hidden_grad_conventions_differ_by_the_sum(two_ranks: list[dict[str, Any]]) -> None:
    # "partial": rank r holds dZ_r W_r; "reduced": every rank holds the sum of the parts.
    partial = [r["hidden-none-partial"]["grads"]["hidden"] for r in two_ranks]
    reduced = [r["hidden-none-reduced"]["grads"]["hidden"] for r in two_ranks]
    assert not torch.allclose(partial[0], reduced[0])
    torch.testing.assert_close(partial[0] + partial[1], reduced[0], **EXACT)
    torch.testing.assert_close(reduced[0], reduced[1], **EXACT)


# --- single process: validation --------------------------------------------------------------


def test_vocab_parallel_validates_its_fields() -> None:
    with pytest.raises(TypeError, match=r"^VocabParallel.group must be a torch.distributed"):
        rlo.VocabParallel("tp")
    if not torch.distributed.is_available():  # pragma: no cover
        return
    group = torch.distributed.ProcessGroup.__new__(torch.distributed.ProcessGroup)
    with pytest.raises(ValueError, match=r"^VocabParallel.hidden_grad must be one of"):
        rlo.VocabParallel(group, hidden_grad="sum")
    with pytest.raises(ValueError, match=r"^VocabParallel.vocab_sizes must be >= 1"):
        rlo.VocabParallel(group, vocab_sizes=(3, 0))
    with pytest.raises(TypeError, match=r"^VocabParallel.vocab_sizes must hold ints"):
        rlo.VocabParallel(group, vocab_sizes=(3, 2.5))
    options = rlo.VocabParallel(group, vocab_sizes=[3, 2])
    assert options.vocab_sizes == (3, 2) and options.hidden_grad == "partial"


def test_vocab_group_needs_an_initialised_group() -> None:
    if not torch.distributed.is_available():  # pragma: no cover
        return
    assert not torch.distributed.is_initialized()
    group = torch.distributed.ProcessGroup.__new__(torch.distributed.ProcessGroup)
    with pytest.raises(ValueError, match=r"^vocab_group needs torch.distributed"):
        rlo.token_entropy(torch.zeros(2, 3), vocab_group=group)
    with pytest.raises(TypeError, match=r"^vocab_group must be a torch.distributed ProcessGroup"):
        rlo.token_log_probs_from_hidden(
            torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long),
            vocab_group=object(),
        )  # fmt: skip
    assert math.isfinite(float(rlo.token_entropy(torch.zeros(1, 3))))
