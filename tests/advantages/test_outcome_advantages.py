"""Tests of the outcome-reward estimators' new options: group_ids (verl's ``index``),
``scale="batch"`` (TRL), pass@k, OPO and ReMax (verl), and float32 overflow at extreme rewards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import (
    group_relative_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
)
from tolerances import assert_close


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- golden values


def test_group_ids_golden_unequal_groups() -> None:
    # labels a b a c b a: group a = rows 0, 2, 5 = [1, 4, 7]: mean 4, unbiased std 3;
    # group b = rows 1, 4 = [2, 6]: mean 4, std sqrt(8) = 2.8284271; group c = row 3 alone -> 0.
    rewards = [1.0, 2.0, 4.0, 9.0, 6.0, 7.0]
    labels = ["a", "b", "a", "c", "b", "a"]
    out = group_relative_advantages(rewards, group_ids=labels, eps=0.0)
    root8 = math.sqrt(8)
    assert_close(out, [-1.0, -2 / root8, 0.0, 0.0, 2 / root8, 1.0])
    # Dr. GRPO: r - mean: [-3, -2, 0, 0, 2, 3]
    assert_close(
        group_relative_advantages(rewards, group_ids=labels, scale="none"), [-3, -2, 0, 0, 2, 3]
    )
    # RLOO: r - mean(others): a: [1 - 5.5, 4 - 4, 7 - 2.5], b: [2 - 6, 6 - 2], c alone -> 0
    assert_close(rloo_advantages(rewards, group_ids=labels), [-4.5, -4.0, 0.0, 0.0, 4.0, 4.5])
    # The same labels as a tensor, a NumPy array of strings or of ints give the same result.
    for ids in (torch.tensor([0, 1, 0, 7, 1, 0]), np.array(labels), np.array([5, 3, 5, 1, 3, 5])):
        assert torch.equal(group_relative_advantages(rewards, group_ids=ids, eps=0.0), out)


def test_scale_batch_golden_trl() -> None:
    # TRL scale_rewards="batch": (r - group mean) / (std of all rewards + eps).
    # rewards [1, 3 | 2, 6], G = 2: centered [-1, 1, -2, 2]; batch mean 3, deviations
    # [-2, 0, -1, 3], unbiased var 14/3, std 2.1602469; A = centered / (2.1602469 + 1e-4).
    out = group_relative_advantages([1.0, 3.0, 2.0, 6.0], 2, scale="batch", eps=1e-4)
    std = math.sqrt(14 / 3) + 1e-4
    assert_close(out, [-1 / std, 1 / std, -2 / std, 2 / std])


def test_passk_golden_verl() -> None:
    # G = 3: [0.2, 0.9, 0.5] -> best 0.9 (row 1), second 0.5: margin 0.4; unbiased std of the
    # group: mean 0.5333333, deviations [-1/3, 11/30, -1/30] -> var (1/9 + 121/900 + 1/900) / 2
    # = 0.1233333, std 0.3511885; A_1 = 0.4 / (0.3511885 + 1e-6) = 1.1389806.
    # Group 2: [1, 1, 0]: tied best -> margin 0 everywhere.
    out = passk_advantages([0.2, 0.9, 0.5, 1.0, 1.0, 0.0], 3)
    std = math.sqrt((1 / 9 + 121 / 900 + 1 / 900) / 2)
    assert_close(out, [0.0, 0.4 / (std + 1e-6), 0.0, 0.0, 0.0, 0.0])
    assert_close(
        passk_advantages([0.2, 0.9, 0.5], group_ids=[7, 7, 7], scale="none"), [0.0, 0.4, 0.0]
    )
    # A group of one gets 0 (verl raises); group [1, 2]: margin 1 / (std sqrt(0.5) + 1e-6).
    out = passk_advantages([3.0, 1.0, 2.0], group_ids=[0, 1, 1])
    assert_close(out, [0.0, 0.0, 1 / (math.sqrt(0.5) + 1e-6)])


def test_opo_golden_verl() -> None:
    # lengths [3, 1 | 2, 2]; group 1 rewards [1, 0]: b = (3*1 + 1*0) / 4 = 0.75 -> [0.25, -0.75]
    # group 2 rewards [2, 4], equal lengths: b = 3 -> [-1, 1]
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]])
    assert_close(opo_advantages([1.0, 0.0, 2.0, 4.0], mask, 2), [0.25, -0.75, -1.0, 1.0])
    # All responses empty: plain mean. A group of one: 0 (verl: the raw reward).
    empty = torch.zeros(3, 2)
    assert_close(opo_advantages([1.0, 3.0, 5.0], empty, group_ids=[0, 0, 1]), [-1.0, 1.0, 0.0])


def test_remax_golden_verl() -> None:
    # sequence form: r - r_greedy
    assert_close(remax_advantages([1.0, 0.0, 0.5], [0.5, 0.5, 0.5]), [0.5, -0.5, 0.0])
    # token form: reward-to-go over selected tokens minus the baseline: row 0 rewards
    # [0.1, (masked NaN), 0.2, 1.0] -> [1.3, 0, 1.2, 1.0] - 0.5 = [0.8, 0, 0.7, 0.5]
    rewards = torch.tensor([[0.1, math.nan, 0.2, 1.0], [0.0, 2.0, math.inf, math.inf]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    out = remax_advantages(rewards, torch.tensor([[0.5], [1.0]]), mask=mask)
    assert_close(out, [[0.8, 0.0, 0.7, 0.5], [1.0, 1.0, 0.0, 0.0]])


def test_reinforce_plus_plus_unbiased_golden() -> None:
    # Scores [1, 0], mask [[1, 1], [1, 0]]: returns [1, 1, 0], mean 2/3,
    # Bessel var (1/9 + 1/9 + 4/9) / 2 = 1/3, std 0.5773503 (verl masked_whiten);
    # A = [0.5773503, 0.5773503, -1.1547005] (eps 0).
    out = reinforce_plus_plus_advantages([1.0, 0.0], [[1, 1], [1, 0]], unbiased=True, eps=0.0)
    root = math.sqrt(3)
    assert_close(out, [[1 / root, 1 / root], [-2 / root, 0.0]])
    # group_ids = contiguous group_size
    mask = torch.ones(4, 2)
    by_size = reinforce_plus_plus_advantages([1.0, 3.0, 5.0, 6.0], mask, group_size=2)
    by_ids = reinforce_plus_plus_advantages([1.0, 3.0, 5.0, 6.0], mask, group_ids=["x", "x", 2, 2])
    assert torch.equal(by_size, by_ids)


# --------------------------------------------------------------------------- properties


label_lists = st.lists(st.integers(0, 3), min_size=1, max_size=9)


@given(
    labels=label_lists,
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_group_ids_match_reference(labels: list[int], seed: int, dtype: torch.dtype) -> None:
    length = len(labels)
    rewards = torch.randn(length, generator=_generator(seed), dtype=torch.float64).to(dtype)
    weights = torch.randn(length, generator=_generator(seed + 1), dtype=torch.float64)
    mask = torch.rand(length, 4, generator=_generator(seed + 2)) < 0.6
    ids = torch.tensor(labels)
    cases = [
        (
            lambda r: group_relative_advantages(r, group_ids=ids, scale="std"),
            lambda r: reference.group_relative_advantages_grouped(r, labels, scale="std"),
        ),
        (
            lambda r: group_relative_advantages(r, group_ids=ids, scale="batch", eps=1e-4),
            lambda r: reference.group_relative_advantages_grouped(
                r, labels, scale="batch", eps=1e-4
            ),
        ),
        (
            lambda r: group_relative_advantages(r, group_ids=labels, scale="none"),
            lambda r: reference.group_relative_advantages_grouped(r, labels, scale="none"),
        ),
        (
            lambda r: rloo_advantages(r, group_ids=ids),
            lambda r: reference.rloo_advantages_grouped(r, labels),
        ),
        (
            lambda r: passk_advantages(r, group_ids=ids),
            lambda r: reference.passk_advantages(r, labels),
        ),
        (
            lambda r: passk_advantages(r, group_ids=ids, scale="none"),
            lambda r: reference.passk_advantages(r, labels, scale="none"),
        ),
        (
            lambda r: opo_advantages(r, mask, group_ids=ids),
            lambda r: reference.opo_advantages(r, mask, labels),
        ),
    ]
    for function, expected_function in cases:
        got_input = rewards.clone().requires_grad_(True)
        out = function(got_input)
        assert out.dtype == dtype and out.shape == (length,)
        (grad,) = torch.autograd.grad((out * weights.to(dtype)).sum(), got_input)
        ref_input = rewards.double().requires_grad_(True)
        expected = expected_function(ref_input)
        expected_grad = torch.zeros_like(ref_input)
        if expected.requires_grad:
            (expected_grad,) = torch.autograd.grad((expected * weights).sum(), ref_input)
        assert_close(out, expected)
        assert_close(grad, expected_grad)


@given(sizes=st.tuples(st.integers(1, 4), st.integers(1, 5)), seed=st.integers(0, 2**16))
def test_group_ids_equal_group_size_and_follow_permutations(
    sizes: tuple[int, int], seed: int
) -> None:
    prompts, group_size = sizes
    length = prompts * group_size
    rewards = torch.randn(length, generator=_generator(seed), dtype=torch.float64)
    ids = torch.arange(length) // group_size
    permutation = torch.randperm(length, generator=_generator(seed + 1))
    for function in (group_relative_advantages, passk_advantages):
        for scale in ("std", "none"):
            fixed = function(rewards, group_size, scale=scale)  # type: ignore[operator]
            assert_close(function(rewards, group_ids=ids, scale=scale), fixed)  # type: ignore[operator]
            shuffled = function(rewards[permutation], group_ids=ids[permutation], scale=scale)  # type: ignore[operator]
            assert_close(shuffled, fixed[permutation])
    if group_size >= 2:
        assert_close(rloo_advantages(rewards, group_ids=ids), rloo_advantages(rewards, group_size))


@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 7)), seed=st.integers(0, 2**16))
def test_remax_token_form_matches_reference(shape: tuple[int, int], seed: int) -> None:
    generator = _generator(seed)
    rewards = torch.randn(shape, generator=generator, dtype=torch.float64)
    baseline = torch.randn(shape[0], generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    dirty = torch.where(mask, rewards, math.nan).requires_grad_(True)
    out = remax_advantages(dirty, baseline, mask=mask)
    (grad,) = (
        torch.autograd.grad(out.sum(), dirty) if out.requires_grad else (torch.zeros_like(dirty),)
    )
    clean = rewards.clone().requires_grad_(True)
    expected = reference.remax_advantages(clean, baseline, mask)
    expected_grad = torch.zeros_like(clean)
    if expected.requires_grad:
        (expected_grad,) = torch.autograd.grad(expected.sum(), clean)
    assert_close(out, expected)
    assert_close(grad, expected_grad)


@given(
    shape=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
    labels_seed=st.integers(0, 3),
    unbiased=st.booleans(),
    gamma=st.sampled_from([1.0, 0.9]),
)
def test_reinforce_plus_plus_options_match_reference(
    shape: tuple[int, int], seed: int, labels_seed: int, unbiased: bool, gamma: float
) -> None:
    generator = _generator(seed)
    scores = torch.randn(shape[0], generator=generator, dtype=torch.float64, requires_grad=True)
    token_rewards = 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    labels = [(k * (labels_seed + 1)) % 3 for k in range(shape[0])]
    out = reinforce_plus_plus_advantages(
        scores, mask, token_rewards=token_rewards, gamma=gamma, group_ids=labels, unbiased=unbiased
    )
    expected = reference.reinforce_plus_plus_grouped(
        scores, mask, labels=labels, token_rewards=token_rewards, gamma=gamma, unbiased=unbiased
    )
    assert_close(out, expected)
    if expected.requires_grad:
        weights = torch.randn(shape, generator=generator, dtype=torch.float64)
        (grad,) = torch.autograd.grad((out * weights).sum(), scores)
        (expected_grad,) = torch.autograd.grad((expected * weights).sum(), scores)
        assert_close(grad, expected_grad)


# --------------------------------------------------------------------------- extreme magnitudes


EXTREMES = {
    "large": [1e20, -2e20, 3e20, 5e19, 1e20, 1e20, -4e20, 2.5e20],
    "tiny": [1e-20, -2e-20, 3e-20, 5e-21, 1e-20, 1e-20, -4e-20, 2.5e-20],
    "mixed": [1e20, -2e20, 3e20, 5e19, 1e-20, 3e-20, -4e-20, 2.5e-20],
    "limit": [2e38, -2e38, 1e38, 0.0, 1.0, 2.0, 3.0, 4.0],  # outputs stay below 3.4e38
}


def _relative(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 result vs float64 reference, compared digit by digit per group of 4."""
    assert torch.isfinite(out).all()
    for piece_out, piece_expected in zip(out.split(4), expected.split(4), strict=True):
        unit = piece_expected.abs().max().clamp(min=1e-300)
        assert_close(piece_out / unit.float(), piece_expected / unit, dtype=torch.float32)


@pytest.mark.parametrize("case", list(EXTREMES))
def test_extreme_rewards_match_float64(case: str) -> None:
    values = EXTREMES[case]
    rewards = torch.tensor(values)  # float32
    exact = rewards.double()  # the float32 values, exactly
    labels = [0, 0, 0, 0, 1, 1, 1, 1]
    mask = torch.ones(8, 3)
    mask[1, 2] = 0
    for scale in ("std", "none"):
        out = group_relative_advantages(rewards, 4, scale=scale)  # type: ignore[arg-type]
        assert out.abs().max() > 0  # issue 10: zeros for 1e20 rewards in float32
        _relative(out, reference.group_relative_advantages_grouped(exact, labels, scale=scale))
        _relative(
            passk_advantages(rewards, 4, scale=scale),
            reference.passk_advantages(exact, labels, scale=scale),
        )  # type: ignore[arg-type]
    if case != "limit":  # the batch std of +-3e38 is above the float32 range by definition
        batch = group_relative_advantages(rewards, 4, scale="batch")
        expected = reference.group_relative_advantages_grouped(exact, labels, scale="batch")
        unit = expected.abs().max()
        assert_close(batch / unit.float(), expected / unit, dtype=torch.float32)
    _relative(rloo_advantages(rewards, 4), reference.rloo_advantages_grouped(exact, labels))
    _relative(opo_advantages(rewards, mask, 4), reference.opo_advantages(exact, mask, labels))
    # REINFORCE++: one whitening over the batch (the tiny group is ~0 next to the large one).
    token_mask = torch.ones(8, 2, dtype=torch.bool)
    token_mask[3, 1] = False
    for unbiased in (False, True):
        got = reinforce_plus_plus_advantages(rewards, token_mask, unbiased=unbiased)
        want = reference.reinforce_plus_plus_grouped(exact, token_mask, unbiased=unbiased)
        assert got.abs().max() > 0 and torch.isfinite(got).all()
        assert_close(got, want, dtype=torch.float32)
        grouped = reinforce_plus_plus_advantages(
            rewards, token_mask, group_size=4, unbiased=unbiased
        )
        assert_close(
            grouped,
            reference.reinforce_plus_plus_grouped(
                exact, token_mask, labels=labels, unbiased=unbiased
            ),
            dtype=torch.float32,
        )


def test_extreme_rewards_keep_exact_zeros_and_finite_gradients() -> None:
    for value in (1e20, 1e-20, -3e38):
        rewards = torch.full((6,), value, requires_grad=True)
        for scale in ("std", "batch", "none"):
            out = group_relative_advantages(rewards, 3, scale=scale)  # type: ignore[arg-type]
            assert torch.equal(out, torch.zeros(6))
            (grad,) = torch.autograd.grad(out.sum(), rewards)
            assert torch.isfinite(grad).all()


# --------------------------------------------------------------------------- errors


def test_grouping_errors() -> None:
    rewards = torch.zeros(4)
    with pytest.raises(
        ValueError, match=r"group_ids must have one label per reward: expected length 4"
    ):
        group_relative_advantages(rewards, group_ids=[0, 0, 1])
    with pytest.raises(ValueError, match=r"group_ids must have shape \(N,\) with N = 4"):
        group_relative_advantages(rewards, group_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"group_ids must have shape \(N,\) with N = 4"):
        passk_advantages(rewards, group_ids=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"group_ids must be 1-D"):
        rloo_advantages(rewards, group_ids=np.zeros((2, 2), dtype=int))
    with pytest.raises(ValueError, match=r"pass exactly one of group_size .* and group_ids"):
        group_relative_advantages(rewards, 2, group_ids=[0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"pass exactly one of group_size .* and group_ids"):
        opo_advantages(rewards, torch.ones(4, 2))
    with pytest.raises(
        TypeError, match=r"group_ids must hold integer labels .* dtype torch.float32"
    ):
        group_relative_advantages(rewards, group_ids=torch.zeros(4))
    with pytest.raises(TypeError, match=r"got the float 0.5 at group_ids\[1\]"):
        group_relative_advantages(rewards, group_ids=[0, 0.5, 1, 1])
    with pytest.raises(TypeError, match=r"group_ids\[0\] is not hashable"):
        group_relative_advantages(rewards, group_ids=[[0], [0], [1], [1]])
    with pytest.raises(TypeError, match=r"group_ids must be a 1-D tensor, NumPy array or sequence"):
        group_relative_advantages(rewards, group_ids="abcd")
    with pytest.raises(
        ValueError, match=r"group_ids must have one label per reward: expected length 2"
    ):
        reinforce_plus_plus_advantages([1.0, 2.0], torch.ones(2, 2), group_ids=[0])
    with pytest.raises(ValueError, match=r"scale must be one of \['std', 'none'\], got 'batch'"):
        passk_advantages(rewards, 2, scale="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mask must have shape \(N, T\) with N = 4"):
        opo_advantages(rewards, torch.ones(3, 2), 2)
    with pytest.raises(
        ValueError, match=r"baseline_rewards must have shape \(B,\) or \(B, 1\) with B = 4"
    ):
        remax_advantages(rewards, torch.zeros(3))
    with pytest.raises(ValueError, match=r"mask applies to \(B, T\) token-level rewards only"):
        remax_advantages(rewards, rewards, mask=torch.ones(4, 2))
    with pytest.raises(
        ValueError, match=r"rewards must have shape \(B,\) .* got shape \(4, 2\) and no mask"
    ):
        remax_advantages(torch.zeros(4, 2), rewards)
    with pytest.raises(ValueError, match=r"mask must have the same shape as rewards \(4, 2\)"):
        remax_advantages(torch.zeros(4, 2), rewards, mask=torch.ones(4, 3))
    with pytest.raises(TypeError, match=r"unbiased must be a bool"):
        reinforce_plus_plus_advantages([1.0], [[1]], unbiased=1)  # type: ignore[arg-type]
