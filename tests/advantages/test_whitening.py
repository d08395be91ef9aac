"""Tests of masked_whiten (verl's masked_whiten) and its 2-rank global variant."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import reference
from _dist_workers import launch
from _whiten_workers import OPTIONS, SCALES, shard, whiten_worker
from rlobjectives import global_masked_whiten, masked_whiten
from tolerances import assert_close

NAN = float("nan")


def test_golden_verl_formula() -> None:
    # [1, 2, 3] selected, 9 masked: mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1;
    # w = (x - 2) / sqrt(1 + 1e-8) = [-0.999999995, 0, 0.999999995] (verl: rsqrt(var + 1e-8)).
    values = torch.tensor([[1.0, 2.0], [3.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    scale = 1 / math.sqrt(1 + 1e-8)
    assert_close(masked_whiten(values, mask), [[-scale, 0.0], [scale, 0.0]])
    # shift_mean=False adds the mean 2 back: [2 - s, 2, 2 + s], 0 at the masked entry.
    assert_close(
        masked_whiten(values, mask, shift_mean=False), [[2 - scale, 2.0], [2 + scale, 0.0]]
    )
    # Population variance (OpenRLHF): (1 + 0 + 1) / 3 = 2/3, eps 0: w = (x - 2) * sqrt(3/2)
    root = math.sqrt(1.5)
    assert_close(masked_whiten(values, mask, unbiased=False, eps=0.0), [[-root, 0.0], [root, 0.0]])


def test_golden_second_case() -> None:
    # x = [0, 4, 5, 7] (N = 4): mean 4; deviations [-4, 0, 1, 3]; unbiased var 26/3 = 8.6667,
    # with eps = 0.1: rsqrt(8.76667) = 0.337740; w = [-1.350960, 0, 0.337740, 1.013220].
    out = masked_whiten(torch.tensor([0.0, 4.0, 5.0, 7.0]), torch.ones(4), eps=0.1)
    factor = 1 / math.sqrt(26 / 3 + 0.1)
    assert out.dtype == torch.float32
    assert_close(out, [-4 * factor, 0.0, factor, 3 * factor])


shapes = st.sampled_from([(7,), (3, 5), (2, 3, 4), (1, 1), (5, 1), (4, 9)])


@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    density=st.sampled_from([0.0, 0.2, 0.7, 1.0]),
    shift_mean=st.booleans(),
    unbiased=st.booleans(),
    eps=st.sampled_from([1e-8, 0.5, 0.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
@example(  # one selected value: the centered value's gradient must be exactly 0 (no cancellation)
    shape=(7,),
    seed=2,
    density=0.2,
    shift_mean=False,
    unbiased=False,
    eps=1e-8,
    dtype=torch.float32,
)
def test_matches_reference(
    shape: tuple[int, ...],
    seed: int,
    density: float,
    shift_mean: bool,
    unbiased: bool,
    eps: float,
    dtype: torch.dtype,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 3 + 1
    mask = torch.rand(shape, generator=generator) < density
    weights = torch.randn(shape, generator=generator, dtype=torch.float64)
    dirty = torch.where(mask, values, NAN).to(dtype).requires_grad_(True)
    out = masked_whiten(dirty, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps)
    assert out.dtype == dtype and out.shape == shape
    (grad,) = torch.autograd.grad((out * weights.to(dtype)).sum(), dirty)
    clean = dirty.detach().nan_to_num(0.0).double().requires_grad_(True)
    expected = reference.masked_whiten(
        clean, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps
    )
    expected_grad = torch.zeros_like(clean)
    if expected.requires_grad:
        (expected_grad,) = torch.autograd.grad((expected * weights).sum(), clean)
    selected_count = int(mask.sum())
    if eps == 0.0 and selected_count >= 2 and float(values[mask].std()) < 1e-3:
        return  # near-constant values with eps = 0: ill-conditioned by construction
    assert_close(out, expected)
    assert torch.isfinite(grad).all() and bool((grad[~mask] == 0).all())
    assert_close(grad, expected_grad)


def test_nan_and_inf_at_unselected_reach_nothing() -> None:
    values = torch.tensor([[1.0, NAN, 3.0], [math.inf, 5.0, -math.inf]], requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, True, False]])
    out = masked_whiten(values, mask)
    clean = masked_whiten(torch.where(mask, values.detach(), 0.0), mask)
    assert torch.equal(out, clean)
    (grad,) = torch.autograd.grad(out.sum() + (out * out).sum(), values)
    assert torch.isfinite(grad).all() and bool((grad[~mask] == 0).all())


def test_bf16_is_computed_in_float32() -> None:
    values = torch.tensor([0.1, 0.7, 1.3, 2.9, 5.1], dtype=torch.bfloat16)
    mask = torch.tensor([1, 1, 0, 1, 1])
    out = masked_whiten(values, mask)
    assert out.dtype == torch.float32
    expected = reference.masked_whiten(values.double(), mask.bool())
    assert_close(out, expected)  # float32 tolerance: computed in float32 from the bf16 values


def test_degenerate_selections_give_zeros() -> None:
    assert masked_whiten(torch.zeros(0), torch.zeros(0)).shape == (0,)
    assert torch.equal(masked_whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
    # One selected entry: centered value 0 (verl raises for N = 1).
    assert torch.equal(
        masked_whiten(torch.tensor([5.0, 1.0]), torch.tensor([1, 0])), torch.zeros(2)
    )
    # Constant values with eps = 0: 0/0 is 0, never NaN, in value and gradient.
    constant = torch.full((4,), 0.3, requires_grad=True)
    out = masked_whiten(constant, torch.ones(4), eps=0.0)
    assert torch.equal(out, torch.zeros(4))
    (grad,) = torch.autograd.grad(out.sum(), constant)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize(
    "values",
    [
        [1e20, -3e20, 2e20, 5e19],  # (1e20)^2 overflows float32
        [1e-20, -3e-20, 2e-20, 5e-21],  # (1e-20)^2 is below float32's smallest subnormal
        [1e20, 1.0, -2e20, 3e-20],  # mixed
        [3e38, -3e38, 1e38, 0.0],  # near the float32 limit
    ],
)
def test_extreme_magnitudes_match_float64(values: list[float]) -> None:
    x = torch.tensor(values)
    mask = torch.tensor([True, True, True, values[0] >= 1e38])
    for unbiased in (True, False):
        for shift_mean in (True, False):
            out = masked_whiten(x, mask, unbiased=unbiased, shift_mean=shift_mean)
            expected = reference.masked_whiten(
                x.double(), mask, unbiased=unbiased, shift_mean=shift_mean
            )
            assert torch.isfinite(out).all()
            # Relative to the largest output: 1e-16-sized outputs are compared digit by digit.
            unit = expected.abs().max()
            assert_close(out / unit.float(), expected / unit, dtype=torch.float32)


def test_does_not_mutate_inputs() -> None:
    values = torch.tensor([1.0, NAN, 3.0])
    mask = torch.tensor([1, 0, 1])
    before = values.clone(), mask.clone()
    masked_whiten(values, mask)
    assert torch.equal(values.isnan(), before[0].isnan()) and torch.equal(mask, before[1])


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"mask must have the same shape as values \(2, 3\)"):
        masked_whiten(torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"eps must be >= 0.0, got -1.0"):
        masked_whiten(torch.zeros(3), torch.ones(3), eps=-1.0)
    with pytest.raises(TypeError, match=r"shift_mean must be a bool, got int"):
        masked_whiten(torch.zeros(3), torch.ones(3), shift_mean=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unbiased must be a bool, got str"):
        masked_whiten(torch.zeros(3), torch.ones(3), unbiased="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"values must contain only numbers"):
        masked_whiten([["a"]], [[1]])
    with pytest.raises(ValueError, match=r"mask must have the same shape as values"):
        global_masked_whiten(torch.zeros(2), torch.ones(3))
    with pytest.raises(ValueError, match=r"group was given but no torch.distributed process"):
        global_masked_whiten(torch.zeros(2), torch.ones(2), group=object())  # type: ignore[arg-type]


def test_global_variant_without_process_group_equals_masked_whiten() -> None:
    values, mask = shard(1, 1.0)
    for options in OPTIONS:
        assert_close(
            global_masked_whiten(values, mask, **options), masked_whiten(values, mask, **options)
        )  # type: ignore[arg-type]
    out = global_masked_whiten(values.double().requires_grad_(True), mask)
    assert out.dtype == torch.float64 and not out.requires_grad


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(whiten_worker, str(tmp_path_factory.mktemp("whiten")))


@pytest.mark.distributed
def test_two_gloo_ranks_equal_whitening_of_the_concatenation(
    two_ranks: list[dict[str, Any]],
) -> None:
    for scale in SCALES:
        shards = [shard(rank, scale) for rank in range(2)]
        values = torch.cat([v.reshape(-1) for v, _ in shards])
        mask = torch.cat([m.reshape(-1) for _, m in shards])
        for k, options in enumerate(OPTIONS):
            full = masked_whiten(values, mask, **options)  # type: ignore[arg-type]
            expected = reference.masked_whiten(
                torch.where(mask, values, 0.0).double(),
                mask,
                **options,  # type: ignore[arg-type]
            )
            unit = expected.abs().max()  # compare digits, also for 1e-16-sized outputs
            assert_close(full / unit.float(), expected / unit, dtype=torch.float32)
            sizes = [v.numel() for v, _ in shards]
            for rank, piece in enumerate(expected.split(sizes)):
                got = two_ranks[rank][f"{scale}/{k}"]
                assert got.shape == shards[rank][0].shape and got.dtype == torch.float32
                assert torch.isfinite(got).all()
                assert_close(got.reshape(-1) / unit.float(), piece / unit, dtype=torch.float32)
    # Rank 0 selected nothing: its output is 0; rank 1 whitens [1, 2, 4] alone:
    # mean 7/3, unbiased var ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3.
    assert torch.equal(two_ranks[0]["empty_rank"], torch.zeros(4))
    root = math.sqrt(7 / 3 + 1e-8)
    assert_close(two_ranks[1]["empty_rank"], [(-4 / 3) / root, (-1 / 3) / root, (5 / 3) / root])
    for rank in range(2):
        assert_close(two_ranks[rank]["explicit_group"], two_ranks[rank]["1.0/0"])


def test_stacked_moments_equal_each_tensor_alone() -> None:
    # masked_moments of (K, *mask.shape): K statistics (each its own power-of-two scale) in
    # one pass, as value_loss's explained variance takes Var(R - V) and Var(R) together.
    from rlobjectives.advantages.whitening import masked_moments

    mask = torch.tensor([[True, True, False], [True, False, False]])
    first = torch.tensor([[1.0, 2.0, float("nan")], [6.0, float("inf"), 0.0]])
    second = torch.tensor([[3e20, -1e20, 0.0], [1e20, 0.0, float("-inf")]])
    stacked = masked_moments(torch.stack([first, second]), mask, unbiased=True)
    # first: selected 1, 2, 6 -> scale 4 (2^floor(log2 6)), mean 9/3/4 = 0.75,
    # variance of (0.25, 0.5, 1.5): ((0.5)^2 + (0.25)^2 + (0.75)^2) / 2 = 0.4375
    assert stacked.scale[0] == 4.0
    assert stacked.mean[0] == 0.75
    assert stacked.variance[0] == pytest.approx(0.4375, rel=1e-6)
    assert stacked.selected == 3
    for k, values in enumerate((first, second)):
        alone = masked_moments(values, mask, unbiased=True)
        assert torch.equal(stacked.scale[k], alone.scale)
        assert torch.equal(stacked.mean[k], alone.mean)
        assert torch.equal(stacked.variance[k], alone.variance)
        assert torch.equal(stacked.centered[k], alone.centered)
    empty = masked_moments(torch.zeros(2, 0), torch.zeros(0, dtype=torch.bool), unbiased=True)
    assert empty.scale.tolist() == [1.0, 1.0] and empty.variance.tolist() == [0.0, 0.0]
