"""Tests of the masked reductions: :func:`rlobjectives.aggregate`, ``masked_sum``, ``masked_mean``.

Every reduction against the float64 loop reference (values and gradients), golden values with the
arithmetic in comments, empty selections, NaN/inf at masked positions, the explicit
``normalizer``'s micro-batch additivity, dtypes and errors.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import aggregate, masked_mean, masked_sum
from tolerances import assert_close

F64 = torch.float64
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "none")
SCALAR_REDUCTIONS = REDUCTIONS[:3]


def random_values(
    batch: int, tokens: int, seed: int, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, tokens, generator=generator, dtype=F64).to(dtype)  # (B, T)
    mask = torch.rand(batch, tokens, generator=generator) < 0.6  # (B, T)
    empty_rows = torch.rand(batch, generator=generator) < 0.25  # (B,)
    return values, mask & ~empty_rows.unsqueeze(-1)


def reference_aggregate(values: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    losses = {
        (i, t): values[i, t]
        for i in range(values.shape[0])
        for t in range(values.shape[1])
        if mask[i, t]
    }
    return reference.reduce_losses(losses, tuple(values.shape), **kwargs)  # type: ignore[arg-type]


def gradient(output: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if not output.requires_grad:
        return torch.zeros_like(values)
    (grad,) = torch.autograd.grad(output.sum(), values, allow_unused=True)
    return torch.zeros_like(values) if grad is None else grad


@given(
    batch=st.integers(0, 7),
    tokens=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
    reduction=st.sampled_from(REDUCTIONS),
    normalizer=st.sampled_from([None, 1, 3.5, 12]),
    max_response_length=st.sampled_from([None, 1, 9]),
)
def test_matches_reference(
    batch: int,
    tokens: int,
    seed: int,
    reduction: str,
    normalizer: float | None,
    max_response_length: int | None,
) -> None:
    values, mask = random_values(batch, tokens, seed)
    kwargs = dict(
        reduction=reduction, normalizer=normalizer, max_response_length=max_response_length
    )
    leaf = values.clone().requires_grad_(True)
    actual = aggregate(leaf, mask, **kwargs)
    reference_leaf = values.clone().requires_grad_(True)
    expected = reference_aggregate(reference_leaf, mask, **kwargs)
    assert actual.shape == expected.shape
    assert_close(actual, expected)
    assert_close(gradient(actual, leaf), gradient(expected, reference_leaf))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(reduction: str) -> None:
    values, mask = random_values(4, 5, 3)
    leaf = values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v: aggregate(v, mask, reduction=reduction, normalizer=None), (leaf,)
    )
    assert torch.autograd.gradgradcheck(lambda v: aggregate(v, mask, reduction=reduction), (leaf,))


def test_golden() -> None:
    # Two sequences: [12] (1 token) and [0, 0] (2 tokens); T = 3, the rest is padding (NaN).
    nan = math.nan
    values = torch.tensor([[12.0, nan, nan], [0.0, 0.0, nan]], dtype=F64)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    # token_mean: (12 + 0 + 0) / 3 tokens = 4
    assert_close(aggregate(values, mask, reduction="token_mean"), 4.0)
    # sequence_mean: (12/1 + 0/2) / 2 sequences = 6  (verl #593: the two differ)
    assert_close(aggregate(values, mask, reduction="sequence_mean"), 6.0)
    # sequence_sum_normalized, C = T = 3: 12 / (2 * 3) = 2
    assert_close(aggregate(values, mask, reduction="sequence_sum_normalized"), 2.0)
    # ... C = 8: 12 / (2 * 8) = 0.75; with normalizer 4 sequences: 12 / (4 * 8) = 0.375
    assert_close(
        aggregate(values, mask, reduction="sequence_sum_normalized", max_response_length=8), 0.75
    )
    assert_close(
        aggregate(
            values, mask, reduction="sequence_sum_normalized", normalizer=4, max_response_length=8
        ),
        0.375,
    )
    # token_mean with normalizer 24 (global tokens): 12 / 24 = 0.5
    assert_close(aggregate(values, mask, reduction="token_mean", normalizer=24), 0.5)
    # sequence_mean with normalizer 3 (global non-empty sequences): 12 / 3 = 4
    assert_close(aggregate(values, mask, reduction="sequence_mean", normalizer=3), 4.0)
    # none: values at selected tokens, exact zeros elsewhere (the NaN never shows)
    assert_close(aggregate(values, mask, reduction="none"), [[12.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_golden_gradients() -> None:
    # token_mean: d/dv = 1/N at selected tokens = 1/3; sequence_mean: 1/(n_i S) = [1/2, 1/4, 1/4];
    # Dr. GRPO: 1/(B C) = 1/6
    values = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    cases = {
        "token_mean": [[1 / 3, 0, 0], [1 / 3, 1 / 3, 0]],
        "sequence_mean": [[1 / 2, 0, 0], [1 / 4, 1 / 4, 0]],
        "sequence_sum_normalized": [[1 / 6, 0, 0], [1 / 6, 1 / 6, 0]],
    }
    for reduction, expected in cases.items():
        assert_close(gradient(aggregate(values, mask, reduction=reduction), values), expected)


def test_sequence_mean_skips_empty_rows() -> None:
    # rows [2, 4] (mean 3) and an empty row: S counts non-empty rows only -> 3 / 1 = 3
    values = torch.tensor([[2.0, 4.0], [100.0, 100.0]], dtype=F64)
    mask = torch.tensor([[True, True], [False, False]])
    assert_close(aggregate(values, mask, reduction="sequence_mean"), 3.0)
    # while Dr. GRPO counts every sequence: 6 / (2 * 2) = 1.5
    assert_close(aggregate(values, mask, reduction="sequence_sum_normalized"), 1.5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(0, 0), (0, 3), (3, 0), (2, 3)])
@pytest.mark.parametrize("normalizer", [None, 5])
def test_empty_selection_gives_zero(
    reduction: str, shape: tuple[int, int], normalizer: int | None
) -> None:
    values = torch.full(shape, math.nan, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    out = aggregate(values, mask, reduction=reduction, normalizer=normalizer)
    assert out.shape == (shape if reduction == "none" else ())
    assert (out == 0).all()
    grad = gradient(out, values)
    assert torch.isfinite(grad).all() and (grad == 0).all()


def test_empty_token_axis_with_normalizer_regression() -> None:
    # T = 0 with the default C = T used to divide 0 by (normalizer * 0): NaN. Now 0.
    out = aggregate(
        torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool),
        reduction="sequence_sum_normalized", normalizer=3,
    )  # fmt: skip
    assert out == 0


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nonfinite_at_masked_positions(poison: float, reduction: str) -> None:
    values, mask = random_values(5, 6, 1)
    assert (~mask).any() and mask.any()
    clean = values.clone().requires_grad_(True)
    poisoned = torch.where(mask, values, torch.tensor(poison, dtype=F64)).requires_grad_(True)
    expected = aggregate(clean, mask, reduction=reduction)
    actual = aggregate(poisoned, mask, reduction=reduction)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    grad = gradient(actual, poisoned)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, gradient(expected, clean), rtol=0, atol=0)


@given(
    batch=st.integers(1, 7),
    tokens=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    reduction=st.sampled_from(SCALAR_REDUCTIONS),
    cuts=st.lists(st.integers(1, 6), max_size=3),
)
def test_micro_batch_additivity(
    batch: int, tokens: int, seed: int, reduction: str, cuts: list[int]
) -> None:
    # Split the rows at random cut points, trim each micro-batch after its last selected column,
    # reduce
    # each with the global normalizer: the sum equals the full-batch value, gradients included.
    values, mask = random_values(batch, tokens, seed)
    lengths = mask.sum(-1)  # (B,)
    normalizer = {
        "token_mean": int(mask.sum()),
        "sequence_mean": int((lengths > 0).sum()),
        "sequence_sum_normalized": batch,
    }[reduction]
    leaf = values.clone().requires_grad_(True)
    kwargs = dict(reduction=reduction, max_response_length=tokens)
    full = aggregate(leaf, mask, **kwargs)
    bounds = sorted({0, batch, *(c for c in cuts if c < batch)})
    total = torch.zeros((), dtype=F64)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        selected_columns = mask[start:stop].any(0).nonzero()
        width = int(selected_columns.max()) + 1 if selected_columns.numel() else 1
        total = total + aggregate(
            leaf[start:stop, :width],
            mask[start:stop, :width],
            normalizer=max(normalizer, 1),
            **kwargs,
        )
    assert_close(total, full)
    assert_close(gradient(total, leaf), gradient(full, leaf))


@pytest.mark.parametrize("reduction", SCALAR_REDUCTIONS)
def test_naive_micro_batch_mean_differs(reduction: str) -> None:
    # Guard for the additivity test: rows of 1 and 6 tokens, local normalization averaged over
    # the two micro-batches is not the full-batch value.
    values = torch.tensor([[6.0, 0, 0, 0, 0, 0], [1.0, 1, 1, 1, 1, 1]], dtype=F64)
    mask = torch.tensor([[True] + [False] * 5, [True] * 6])
    # full: token_mean 12/7, sequence_mean (6 + 1)/2, Dr. GRPO 12/(2*6)
    full = aggregate(values, mask, reduction=reduction)
    # naive: token_mean (6 + 1)/2, sequence_mean (6 + 1)/2 (equal here, see below), Dr. GRPO
    # (6/(1*1) + 6/(1*6)) / 2 = 3.5
    naive = (
        aggregate(values[:1, :1], mask[:1, :1], reduction=reduction)
        + aggregate(values[1:], mask[1:], reduction=reduction)
    ) / 2
    if reduction == "sequence_mean":
        # sequence_mean is only invariant to naive averaging with equal non-empty counts:
        # micro-batches of 1 and 2 non-empty rows break it.
        values3 = torch.tensor([[6.0], [0.0], [3.0]], dtype=F64)
        mask3 = torch.ones(3, 1, dtype=torch.bool)
        full = aggregate(values3, mask3, reduction=reduction)  # (6 + 0 + 3) / 3 = 3
        naive = (
            (
                aggregate(values3[:1], mask3[:1], reduction=reduction)  # 6
                + aggregate(values3[1:], mask3[1:], reduction=reduction)  # 1.5
            )
            / 2
        )  # 3.75
    assert abs(float(naive) - float(full)) > 0.1


def test_masked_sum_and_mean() -> None:
    values = torch.tensor([[1.0, math.nan, 3.0], [math.inf, 5.0, 7.0]], dtype=F64)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert_close(masked_sum(values, mask), 4.0)  # 1 + 3
    assert_close(masked_sum(values, mask, dim=-1), [4.0, 0.0])
    assert_close(masked_mean(values, mask), 2.0)  # 4 / 2
    assert_close(masked_mean(values, mask, dim=-1), [2.0, 0.0])  # empty row: 0, not NaN
    assert_close(masked_mean(values, mask, dim=0), [1.0, 0.0, 3.0])
    empty = torch.zeros(0, 0, dtype=F64)
    assert_close(masked_mean(empty, empty.bool()), 0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dtypes(dtype: torch.dtype, reduction: str) -> None:
    values, mask = random_values(5, 7, 4, dtype=dtype)
    out = aggregate(values, mask, reduction=reduction, normalizer=None)
    assert out.dtype == dtype
    assert_close(out, reference_aggregate(values.to(F64), mask, reduction=reduction))
    if dtype in (torch.bfloat16, torch.float16):
        # reduced in float32, rounded once
        expected = aggregate(values.float(), mask, reduction=reduction).to(dtype)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_half_precision_reduction_is_float32() -> None:
    # 4096 tokens of bfloat16 1.0 + 1/256 ~ 1.0039; a bfloat16 accumulator or a bfloat16 division
    # would round differently; the float32 mean of the bfloat16 inputs rounds once to 1.0039062.
    values = torch.full((4, 1024), 1.0 + 1 / 256, dtype=torch.bfloat16)
    mask = torch.ones(4, 1024, dtype=torch.bool)
    out = aggregate(values, mask, reduction="sequence_sum_normalized", max_response_length=3)
    expected = (values.float().sum() / (4 * 3)).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_mask_polarity_and_numeric_masks() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    # nonzero selects: 0.5 and -1 count, 0 does not
    numeric = torch.tensor([[0.5, 0.0, -1.0]])
    assert_close(aggregate(values, numeric), 2.0)  # (1 + 3) / 2
    assert_close(aggregate(values, [[1, 0, 1]]), 2.0)


def test_noncontiguous() -> None:
    values, mask = random_values(6, 8, 2)
    strided_values, strided_mask = values.t().contiguous().t(), mask.t().contiguous().t()
    assert not strided_values.is_contiguous()
    for reduction in REDUCTIONS:
        torch.testing.assert_close(
            aggregate(strided_values[:, ::2], strided_mask[:, ::2], reduction=reduction),
            aggregate(values[:, ::2].contiguous(), mask[:, ::2].contiguous(), reduction=reduction),
        )


def test_inputs_not_mutated() -> None:
    values, mask = random_values(3, 4, 0)
    values[~mask] = math.nan
    before_values, before_mask = values.clone(), mask.clone()
    for reduction in REDUCTIONS:
        aggregate(values, mask, reduction=reduction)
    torch.testing.assert_close(values, before_values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(mask, before_mask)


ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"reduction": "mean"}, ValueError, r"reduction must be one of \['token_mean'"),
    ({"reduction": "sum"}, ValueError, r"reduction must be one of"),
    ({"normalizer": 0}, ValueError, r"normalizer must be > 0"),
    ({"normalizer": -2}, ValueError, r"normalizer must be > 0"),
    ({"normalizer": math.nan}, ValueError, r"normalizer must be finite"),
    ({"normalizer": torch.tensor([1.0, 2.0])}, TypeError, r"normalizer must be a real number"),
    ({"normalizer": True}, TypeError, r"normalizer must be a real number"),
    (
        {"reduction": "sequence_sum_normalized", "max_response_length": 0},
        ValueError,
        r"max_response_length must be > 0",
    ),
    (
        {"reduction": "sequence_sum_normalized", "max_response_length": -4},
        ValueError,
        r"max_response_length must be > 0",
    ),
    (
        {"reduction": "sequence_sum_normalized", "max_response_length": "10"},
        TypeError,
        r"max_response_length must be a real number",
    ),
    ({"values": torch.zeros(2, 3, 4)}, ValueError, r"values must have shape \(B, T\)"),
    ({"mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError, r"mask must have the same shape"),
    ({"mask": torch.ones(3, dtype=torch.bool)}, ValueError, r"mask must have shape \(B, T\)"),
    ({"values": "x"}, TypeError, r"values must be"),
    ({"mask": torch.ones(2, 3, device="meta")}, ValueError, r"mask must be on the same device"),
]


@pytest.mark.parametrize(("override", "error", "match"), ERRORS)
def test_errors(override: dict[str, Any], error: type[Exception], match: str) -> None:
    arguments: dict[str, Any] = {
        "values": torch.zeros(2, 3),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        "reduction": "token_mean",
    }
    arguments.update(override)
    values, mask = arguments.pop("values"), arguments.pop("mask")
    with pytest.raises(error, match=match):
        aggregate(values, mask, **arguments)
