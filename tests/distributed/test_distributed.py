"""Tests of rlobjectives.distributed: global normalisers for DDP/FSDP + gradient accumulation.

Single-process tests check the counts, the reduction -> normaliser map, the errors and the
additivity property (micro-batch losses with the global normaliser sum to the full-batch loss,
for any split). The ``distributed`` tests spawn 2 real gloo ranks once for the whole module
(see ``_dist_workers.py``) and compare DDP gradients with the single-process full batch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from _dist_workers import (
    CLIP_HIGH,
    CLIP_LOW,
    ENTROPY_QUANTILES,
    KL_COEF,
    MAX_RESPONSE_LENGTH,
    REDUCTIONS,
    SPLITS,
    ddp_worker,
    entropy_problem,
    failing_worker,
    launch,
    make_model,
    make_problem,
    micro_batch,
    rank_rows,
    step_loss,
)
from rlobjectives import (
    Clip,
    PolicyLossDiagnostics,
    RolloutCorrectionMetrics,
    policy_loss,
    rollout_correction,
    top_entropy_mask,
)
from rlobjectives.distributed import (
    Normalizers,
    data_parallel_loss_scale,
    global_normalizers,
    global_top_entropy_mask,
    normalizer_for_reduction,
    sum_diagnostics,
)
from tolerances import assert_close

NAN = float("nan")


# --------------------------------------------------------------------------------------------
# global_normalizers: counts (single process)
# --------------------------------------------------------------------------------------------


def test_golden_counts_two_micro_batches() -> None:
    first = torch.tensor([[1, 1, 0], [0, 0, 0]])  # 2 tokens; 1 non-empty sequence; 2 sequences
    second = torch.tensor([[1, 0], [1, 1], [1, 0]])  # 4 tokens; 3 non-empty; 3 sequences
    counts = global_normalizers([first, second])
    # tokens 2 + 4 = 6, non-empty 1 + 3 = 4, sequences 2 + 3 = 5
    assert isinstance(counts, Normalizers)
    assert [int(c) for c in counts] == [6, 4, 5]
    for count in counts:
        assert count.ndim == 0 and count.dtype == torch.int64


def test_single_tensor_is_one_micro_batch_and_inputs_are_not_mutated() -> None:
    mask = torch.tensor([[0.5, 0.0, -2.0], [0.0, 0.0, 0.0]])  # nonzero selects: 2 tokens
    before = mask.clone()
    counts = global_normalizers(mask)
    assert [int(c) for c in counts] == [2, 1, 2]
    assert torch.equal(mask, before)


def test_accepts_nested_lists_numpy_and_empty() -> None:
    counts = global_normalizers(([[True, False]], np.array([[0, 1, 1]])))
    assert [int(c) for c in counts] == [3, 2, 2]
    empty = global_normalizers([])  # a rank without micro-batches this step
    assert [int(c) for c in empty] == [0, 0, 0]
    assert empty.tokens.device == torch.device("cpu")
    zero_rows = global_normalizers([torch.zeros(0, 5, dtype=torch.bool), []])
    assert [int(c) for c in zero_rows] == [0, 0, 0]


def test_device_argument() -> None:
    counts = global_normalizers([torch.ones(2, 2)], device="cpu")
    assert counts.tokens.device == torch.device("cpu")
    assert int(counts.tokens) == 4


def test_nan_padding_values_do_not_matter() -> None:
    # Only masks are read; the counts of a (bool) mask never see the padded log-probabilities.
    mask = torch.tensor([[True, False, False], [True, True, True]])
    assert [int(c) for c in global_normalizers(mask)] == [4, 2, 2]


@given(
    shapes=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    density=st.floats(0.0, 1.0),
)
def test_counts_match_reference(shapes: list[tuple[int, int]], seed: int, density: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    masks = [torch.rand(shape, generator=generator) < density for shape in shapes]
    counts = global_normalizers(masks)
    assert tuple(int(c) for c in counts) == reference.global_normalizers(masks)


# --------------------------------------------------------------------------------------------
# normalizer_for_reduction, data_parallel_loss_scale, sum_diagnostics
# --------------------------------------------------------------------------------------------


def test_normalizer_for_each_reduction() -> None:
    counts = global_normalizers([torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1]])])
    # tokens 4, non-empty sequences 2, sequences 3
    assert int(normalizer_for_reduction(counts, reduction="token_mean")) == 4
    assert int(normalizer_for_reduction(counts, reduction="sequence_mean")) == 2
    assert int(normalizer_for_reduction(counts, reduction="sequence_sum_normalized")) == 3


def test_zero_counts_become_one_so_an_empty_step_has_zero_loss() -> None:
    mask = torch.zeros(2, 3, dtype=torch.bool)
    counts = global_normalizers([mask, mask])
    assert [int(c) for c in counts] == [0, 0, 4]
    log_probs = torch.full((2, 3), NAN, dtype=torch.float64, requires_grad=True)
    old_log_probs = torch.full((2, 3), math.inf, dtype=torch.float64)
    for reduction in REDUCTIONS:
        normalizer = normalizer_for_reduction(counts, reduction=reduction)
        assert int(normalizer) >= 1
        out = policy_loss(
            log_probs,
            old_log_probs,
            torch.ones(2, dtype=torch.float64),
            mask,
            reduction=reduction,
            normalizer=normalizer,
            diagnostics_normalizer=normalizer_for_reduction(counts, reduction="token_mean"),
        )
        (grad,) = torch.autograd.grad(out.loss, log_probs)
        assert float(out.loss.detach()) == 0.0
        assert torch.equal(grad, torch.zeros_like(grad))
        assert all(float(value) == 0.0 for value in out.diagnostics)


def test_data_parallel_loss_scale_without_process_group() -> None:
    assert data_parallel_loss_scale() == 1


def test_sum_diagnostics_sums_fields_and_keeps_type() -> None:
    fields = len(PolicyLossDiagnostics._fields)  # 10 (selected_fraction, issue 24)

    def diagnostics(value: float) -> PolicyLossDiagnostics:
        return PolicyLossDiagnostics(*(torch.tensor(value * (k + 1)) for k in range(fields)))

    summed = sum_diagnostics([diagnostics(0.25), diagnostics(0.5)])
    assert isinstance(summed, PolicyLossDiagnostics)
    # field k: 0.25 (k + 1) + 0.5 (k + 1) = 0.75 (k + 1)
    assert [float(v) for v in summed] == [0.75 * (k + 1) for k in range(fields)]
    assert all(v.dtype == torch.float32 for v in summed)
    single = sum_diagnostics(diagnostics(1.0))
    assert [float(v) for v in single] == [float(k + 1) for k in range(fields)]
    # the eight fields of version 0.1 still construct it (weight_mean defaults to 0), and the
    # nine of 0.2 (selected_fraction defaults to 0)
    eight = PolicyLossDiagnostics(*(torch.tensor(1.0) for _ in range(8)))
    assert float(sum_diagnostics([eight, eight]).weight_mean) == 0.0
    nine = PolicyLossDiagnostics(*(torch.tensor(1.0) for _ in range(9)))
    assert float(sum_diagnostics([nine, nine]).selected_fraction) == 0.0


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_errors_masks() -> None:
    with pytest.raises(ValueError, match=r"masks\[1\] must have shape \(B, T\).*got shape \(3,\)"):
        global_normalizers([torch.ones(2, 3), torch.ones(3)])
    with pytest.raises(ValueError, match=r"masks\[0\] must have shape \(B, T\).*\(1, 2, 3\)"):
        global_normalizers(torch.ones(1, 2, 3))
    with pytest.raises(TypeError, match=r"masks must be a \(B, T\) torch.Tensor or a list/tuple"):
        global_normalizers({"mask": torch.ones(1, 1)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"masks\[0\] must contain only numbers or bools"):
        global_normalizers([[["a"]]])


def test_errors_group_without_process_group() -> None:
    group: Any = object()
    with pytest.raises(ValueError, match="group was given but no torch.distributed process"):
        global_normalizers(torch.ones(1, 1), group=group)
    with pytest.raises(ValueError, match="group was given but no torch.distributed process"):
        data_parallel_loss_scale(group=group)
    with pytest.raises(ValueError, match="group was given but no torch.distributed process"):
        sum_diagnostics(PolicyLossDiagnostics(*(torch.tensor(0.0) for _ in range(8))), group=group)


def test_errors_normalizer_for_reduction() -> None:
    counts = global_normalizers(torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"reduction must be one of .*got 'mean'"):
        normalizer_for_reduction(counts, reduction="mean")
    with pytest.raises(ValueError, match=r"reduction='none' takes no normalizer"):
        normalizer_for_reduction(counts, reduction="none")
    with pytest.raises(TypeError, match="normalizers must be the Normalizers returned by"):
        normalizer_for_reduction((1, 1, 1), reduction="token_mean")  # type: ignore[arg-type]


def test_errors_sum_diagnostics() -> None:
    class Other(NamedTuple):
        value: torch.Tensor

    diagnostics = PolicyLossDiagnostics(*(torch.tensor(0.0) for _ in range(8)))
    with pytest.raises(ValueError, match=r"diagnostics must hold at least one NamedTuple"):
        sum_diagnostics([])
    with pytest.raises(ValueError, match=r"diagnostics\[1\] must be a PolicyLossDiagnostics"):
        sum_diagnostics([diagnostics, Other(torch.tensor(0.0))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"diagnostics\[0\].value must be a 0-d floating tensor"):
        sum_diagnostics(Other(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"diagnostics\[0\].value must be a 0-d floating tensor"):
        sum_diagnostics(Other(1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"diagnostics must be NamedTuples of 0-d tensors"):
        sum_diagnostics([torch.tensor(1.0)])  # type: ignore[list-item]


# --------------------------------------------------------------------------------------------
# Additivity in one process: any split into micro-batches gives the full-batch loss and grads
# --------------------------------------------------------------------------------------------


def _pad(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """Append ``width`` columns of ``fill`` (keeps the autograd graph of ``values``)."""
    padding = torch.full((values.shape[0], width), fill, dtype=values.dtype)
    return torch.cat([values, padding], dim=1)


@given(
    batch=st.integers(1, 6),
    tokens=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    cuts=st.lists(st.integers(0, 6), max_size=3),
    extra_padding=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    density=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
)
def test_micro_batch_losses_add_up_to_the_full_batch(
    batch: int,
    tokens: int,
    seed: int,
    cuts: list[int],
    extra_padding: list[int],
    density: float,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, tokens)
    mask = torch.rand(shape, generator=generator) < density
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    log_probs = torch.where(mask, values * 0.5 - 1.0, NAN).requires_grad_()
    old_values = log_probs.detach() + 0.3 * torch.randn(shape, generator=generator).double()
    old_log_probs = torch.where(mask, old_values, math.inf)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    constant = tokens + 3  # explicit Dr. GRPO constant C, shared by all micro-batches

    # Contiguous micro-batches (possibly empty), each re-padded to its own length + NaN padding.
    bounds = sorted({0, batch, *(min(c, batch) for c in cuts)})
    pieces = []
    for k, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        rows = slice(start, stop)
        used = int(mask[rows].any(dim=0).nonzero().max()) + 1 if mask[rows].any() else 0
        width = extra_padding[k % 4]
        pieces.append(
            (
                _pad(log_probs[rows, :used], width, NAN),
                _pad(old_log_probs[rows, :used], width, NAN),
                advantages[rows],
                _pad(mask[rows, :used], width, 0.0).bool(),
            )
        )
    counts = global_normalizers([piece[3] for piece in pieces])
    token_normalizer = normalizer_for_reduction(counts, reduction="token_mean")
    for reduction in REDUCTIONS:
        normalizer = normalizer_for_reduction(counts, reduction=reduction)
        outputs = [
            policy_loss(
                *piece,
                surrogate=Clip(low=CLIP_LOW, high=CLIP_HIGH),
                reduction=reduction,
                normalizer=normalizer,
                max_response_length=constant,
                diagnostics_normalizer=token_normalizer,
            )
            for piece in pieces
        ]
        total = torch.stack([out.loss for out in outputs]).sum()
        (grad,) = torch.autograd.grad(total, log_probs)

        expected = reference.policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            reduction=reduction,
            max_response_length=constant,
            surrogate=Clip(low=CLIP_LOW, high=CLIP_HIGH),
        )
        expected_grad = torch.zeros_like(log_probs)
        if expected.requires_grad:  # False when nothing is selected: the loss is a constant 0
            (expected_grad,) = torch.autograd.grad(expected, log_probs)
        assert_close(total, expected)
        assert_close(grad, expected_grad)
        assert torch.isfinite(grad).all()

        full = policy_loss(
            log_probs, old_log_probs, advantages, mask, surrogate=Clip(low=CLIP_LOW, high=CLIP_HIGH)
        ).diagnostics
        summed = sum_diagnostics([out.diagnostics for out in outputs])
        for name, value in summed._asdict().items():
            assert_close(value, getattr(full, name))


# --------------------------------------------------------------------------------------------
# Real processes: 2 gloo ranks x 2 micro-batches, DistributedDataParallel
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One spawn of 2 ranks that runs every reduction (global and naive) and saves results."""
    return launch(ddp_worker, str(tmp_path_factory.mktemp("ddp")))


def _full_batch(reduction: str, kl_used: bool) -> dict[str, Any]:
    """Single-process full-batch loss, gradients and diagnostics; also the float64 reference."""
    problem = make_problem()
    model = make_model()
    loss, diagnostics = step_loss(
        model, problem, reduction=reduction, normalizer=None, diagnostics_normalizer=None
    )
    grads = torch.autograd.grad(loss, list(model.parameters()))

    reference_model = make_model()
    log_probs = reference_model(problem.input_ids, problem.targets)
    expected = reference.policy_loss(
        log_probs,
        problem.old_log_probs,
        problem.advantages,
        problem.mask,
        reduction=reduction,
        max_response_length=MAX_RESPONSE_LENGTH,
        surrogate=Clip(low=CLIP_LOW, high=CLIP_HIGH),
    )
    if kl_used:  # k2 = (log pi - log ref)^2 / 2 at the selected tokens, same reduction
        k2 = {
            (i, t): 0.5 * (log_probs[i, t] - problem.ref_log_probs[i, t]) ** 2
            for i, t in problem.mask.nonzero().tolist()
        }
        expected = expected + KL_COEF * reference.reduce_losses(
            k2,
            tuple(problem.mask.shape),
            reduction=reduction,
            max_response_length=MAX_RESPONSE_LENGTH,
        )
    expected_grads = torch.autograd.grad(expected, list(reference_model.parameters()))
    return {
        "loss": loss.detach(),
        "grads": [g.detach() for g in grads],
        "diagnostics": diagnostics._asdict(),
        "reference_loss": expected.detach(),
        "reference_grads": expected_grads,
    }


def _max_relative_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(
        float((a - e).abs().max() / e.abs().max().clamp(min=1e-12))
        for a, e in zip(actual, expected, strict=True)
    )


@pytest.mark.distributed
def test_ddp_counts_and_scale(ddp_results: list[dict[str, Any]]) -> None:
    problem = make_problem()
    every_mask = [micro_batch(problem, rows).mask for rank in SPLITS for rows in SPLITS[rank]]
    expected = list(reference.global_normalizers(every_mask))
    # LENGTHS (12, 1, 9, 0, 3, 12, 2, 7) minus one hole in row 2: 45 tokens, 7 non-empty, 8 rows
    assert expected == [45, 7, 8]
    for rank_result in ddp_results:
        for reduction in REDUCTIONS:
            result = rank_result[reduction]["global"]
            assert result["counts"] == expected
            assert result["scale"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ddp_gradients_equal_full_batch(ddp_results: list[dict[str, Any]], reduction: str) -> None:
    full = _full_batch(reduction, ddp_results[0]["kl_used"])
    # The single-process library result is the float64 loop reference.
    assert_close(full["loss"], full["reference_loss"])
    for got, want in zip(full["grads"], full["reference_grads"], strict=True):
        assert_close(got, want)
    for rank_result in ddp_results:  # every rank holds the full-batch gradient
        result = rank_result[reduction]["global"]
        assert_close(result["loss"], full["loss"])  # sum over micro-batches and ranks
        for got, want in zip(result["grads"], full["grads"], strict=True):
            assert_close(got, want)


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ddp_naive_normalisation_differs(ddp_results: list[dict[str, Any]], reduction: str) -> None:
    # Per-micro-batch counts, loss / number of micro-batches, DDP average: the common bug. The
    # test above would fail for it: its gradients are off by far more than any tolerance.
    full = _full_batch(reduction, ddp_results[0]["kl_used"])
    for rank_result in ddp_results:
        naive = rank_result[reduction]["naive"]
        assert _max_relative_difference(naive["grads"], full["grads"]) > 0.05
        assert not math.isclose(float(naive["loss"]), float(full["loss"]), rel_tol=1e-3)


@pytest.mark.distributed
def test_ddp_global_diagnostics_equal_full_batch(ddp_results: list[dict[str, Any]]) -> None:
    full = _full_batch("token_mean", ddp_results[0]["kl_used"])["diagnostics"]
    assert float(full["clip_fraction_low"]) > 0 and float(full["clip_fraction_high"]) > 0
    for rank_result in ddp_results:
        for reduction in REDUCTIONS:
            diagnostics = rank_result[reduction]["global"]["diagnostics"]
            for name, value in full.items():
                assert_close(diagnostics[name], value)
        naive = rank_result["token_mean"]["naive"]["diagnostics"]
        assert not math.isclose(
            float(naive["clipped_fraction"]), float(full["clipped_fraction"]), rel_tol=1e-3
        )


@pytest.mark.distributed
def test_ddp_rollout_metrics_equal_full_batch(ddp_results: list[dict[str, Any]]) -> None:
    # Sums and counts add over micro-batches and ranks; ratio_min/ratio_max combine by
    # all_reduce(MAX) (minima negated), skipping empty pieces (rank 0's second micro-batch is
    # the empty row 3).
    if ddp_results[0]["rollout"] is None:
        pytest.skip("rollout_correction is not available")
    problem = make_problem()
    full = rollout_correction(
        problem.old_log_probs, problem.ref_log_probs, problem.mask, mode="mask", lower=0.7
    ).metrics
    assert 0 < float(full.masked_fraction) < 1
    for rank_result in ddp_results:
        combined = RolloutCorrectionMetrics(**rank_result["rollout"])
        for name, value in full.summary().items():
            assert_close(combined.summary()[name], value)
        assert float(combined.token_count) == 45


@pytest.mark.distributed
def test_launcher_reports_failing_ranks(tmp_path: Any) -> None:
    # One rank is enough to exercise the failure path (each spawned rank re-imports torch).
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 \(exit code 1\).*deliberate failure"):
        launch(failing_worker, str(tmp_path), world_size=1, timeout_s=60.0)


@pytest.mark.distributed
def test_ddp_global_top_entropy_mask(ddp_results: list[dict[str, Any]]) -> None:
    # The quantile over the selected tokens of both ranks is the single-process quantile of the
    # full batch: each rank's mask is the full-batch mask on its rows (its own padded width).
    entropy, mask = entropy_problem()
    for rank, rank_result in enumerate(ddp_results):
        rows = rank_rows(rank)
        masks = rank_result["entropy_masks"]
        width = masks["0.5"].shape[1]
        differs = False
        for level in ENTROPY_QUANTILES:
            full = top_entropy_mask(entropy, mask, quantile=level)[rows, :width]
            local = top_entropy_mask(entropy[rows, :width], mask[rows, :width], quantile=level)
            assert torch.equal(masks[f"{level}"], full), (rank, level)
            differs = differs or not torch.equal(local, full)
        assert differs  # a per-rank quantile would give other masks: the test can fail
        # rank 1 selects nothing: its mask is empty, rank 0's threshold is over rank 0's tokens
        expected = (
            torch.zeros_like(mask[rows, :width])
            if rank == 1
            else top_entropy_mask(entropy[rows, :width], mask[rows, :width], quantile=0.5)
        )
        assert torch.equal(masks["empty_rank"], expected)


def test_global_top_entropy_mask_single_process() -> None:
    entropy, mask = entropy_problem()
    for level in ENTROPY_QUANTILES:
        assert torch.equal(
            global_top_entropy_mask(entropy, mask, quantile=level),
            top_entropy_mask(entropy, mask, quantile=level),
        )
    with pytest.raises(ValueError, match="group was given but no torch.distributed"):
        global_top_entropy_mask(entropy, mask, quantile=0.5, group=object())  # type: ignore[arg-type]
