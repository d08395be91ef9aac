"""Tests of the advantage estimators (rlobjectives.advantages: gae, reinforce, scans, outcome)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import (
    GAEOutput,
    gae,
    group_relative_advantages,
    kl_estimate,
    masked_whiten,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    value_loss,
)
from rlobjectives.advantages import scans as _scans
from tolerances import assert_close


def _grads(output: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``output.sum()``; zeros when nothing was selected (no graph)."""
    if not output.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad(output.sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _token_inputs(
    seed: int, batch: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = _generator(seed)
    rewards = torch.randn(batch, tokens, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, tokens, generator=generator, dtype=torch.float64)
    mask = torch.rand(batch, tokens, generator=generator) < 0.7
    return rewards, values, mask


token_shapes = st.tuples(st.integers(1, 5), st.integers(1, 7))
groups = st.tuples(st.integers(1, 4), st.integers(1, 5))  # (number of prompts, group size)


# --------------------------------------------------------------------------- group relative


def test_group_relative_golden() -> None:
    # Group 1 = [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70710678;
    # A = +-0.5 / (0.70710678 + 1e-6) = +-0.70710578. Group 2 = [1, 1]: identical -> exactly 0.
    out = group_relative_advantages([1.0, 0.0, 1.0, 1.0], 2)
    half = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert out.dtype == torch.float32
    assert_close(out, [half, -half, 0.0, 0.0])
    assert torch.equal(out[2:], torch.zeros(2))
    # G = 4, [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], unbiased var (4+1+0+9)/3 = 14/3,
    # std 2.1602469; A = [-0.9258201, -0.4629100, 0, 1.3887301] (eps 0)
    out = group_relative_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), 4, eps=0.0)
    std = math.sqrt(14.0 / 3.0)
    assert_close(out, [-2 / std, -1 / std, 0.0, 3 / std])
    # Dr. GRPO (scale="none"): mean only -> [-2, -1, 0, 3]
    assert_close(group_relative_advantages([1.0, 2.0, 3.0, 6.0], 4, scale="none"), [-2, -1, 0, 3])


def test_group_relative_matches_torch_std() -> None:
    # Independent computation with torch.std (Bessel-corrected by default).
    rewards = torch.randn(6, 5, generator=_generator(1), dtype=torch.float64)
    expected = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    assert_close(group_relative_advantages(rewards.reshape(-1), 5), expected.reshape(-1))


@pytest.mark.parametrize("value", [0.1, 0.3, -7.25, 1e8, 0.0])
@pytest.mark.parametrize("group_size", [1, 2, 3, 7])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_identical_rewards_give_exact_zeros(value: float, group_size: int, eps: float) -> None:
    rewards = torch.full((2 * group_size,), value, requires_grad=True)
    for scale in ("std", "none"):
        out = group_relative_advantages(rewards, group_size, scale=scale, eps=eps)  # type: ignore[arg-type]
        assert torch.equal(out, torch.zeros_like(out))
        (grad,) = torch.autograd.grad(out.sum(), rewards)
        assert bool(torch.isfinite(grad).all())
    if group_size >= 2:
        out = rloo_advantages(rewards, group_size)
        assert torch.equal(out, torch.zeros_like(out))


@given(
    sizes=groups,
    seed=st.integers(0, 2**16),
    scale=st.sampled_from(["std", "none"]),
    eps=st.sampled_from([1e-6, 1e-2]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_group_relative_matches_reference(
    sizes: tuple[int, int], seed: int, scale: str, eps: float, dtype: torch.dtype
) -> None:
    prompts, group_size = sizes
    rewards = torch.randn(prompts * group_size, generator=_generator(seed), dtype=torch.float64)
    weights = torch.randn(prompts * group_size, generator=_generator(seed + 1), dtype=torch.float64)
    got_input = rewards.to(dtype).requires_grad_(True)
    out = group_relative_advantages(got_input, group_size, scale=scale, eps=eps)  # type: ignore[arg-type]
    assert out.dtype == dtype and out.shape == (prompts * group_size,)
    (grad,) = torch.autograd.grad((out * weights.to(dtype)).sum(), got_input)
    ref_input = got_input.detach().double().requires_grad_(True)
    expected = reference.group_relative_advantages(ref_input, group_size, scale=scale, eps=eps)
    (expected_grad,) = _grads(expected * weights, ref_input)
    assert_close(out, expected)
    assert_close(grad, expected_grad)


def test_group_relative_gradcheck() -> None:
    rewards = torch.randn(12, generator=_generator(2), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r: group_relative_advantages(r, 4), (rewards,))
    assert torch.autograd.gradcheck(lambda r: rloo_advantages(r, 3), (rewards,))


def test_group_relative_dtypes() -> None:
    assert group_relative_advantages([1, 0, 1, 1], 2).dtype == torch.float32
    bf16 = torch.tensor([1.0, 0.0, 2.0, 5.0], dtype=torch.bfloat16)
    assert group_relative_advantages(bf16, 2).dtype == torch.float32
    assert rloo_advantages(bf16, 2).dtype == torch.float32
    assert group_relative_advantages(bf16.double(), 2).dtype == torch.float64
    assert group_relative_advantages([], 3).shape == (0,)


def test_group_relative_errors() -> None:
    with pytest.raises(ValueError, match=r"rewards length 7 is not divisible by group_size 3"):
        group_relative_advantages(torch.zeros(7), 3)
    with pytest.raises(ValueError, match=r"rewards length 5 is not divisible by group_size 2"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"group_size must be >= 1, got 0"):
        group_relative_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"group_size must be >= 2, got 1"):
        rloo_advantages(torch.zeros(4), 1)
    with pytest.raises(TypeError, match=r"group_size must be an int, got bool"):
        group_relative_advantages(torch.zeros(4), True)
    with pytest.raises(TypeError, match=r"group_size must be an int, got float"):
        group_relative_advantages(torch.zeros(4), 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rewards must have shape \(B\*G,\).*got shape \(2, 2\)"):
        group_relative_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(
        ValueError, match=r"scale must be one of \['std', 'batch', 'none'\], got 'mad'"
    ):
        group_relative_advantages(torch.zeros(4), 2, scale="mad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"eps must be >= 0.0, got -1e-06"):
        group_relative_advantages(torch.zeros(4), 2, eps=-1e-6)


# --------------------------------------------------------------------------- RLOO


def test_rloo_golden() -> None:
    # [1, 2, 3, 4]: A_1 = 1 - (2+3+4)/3 = -2, A_2 = 2 - 8/3 = -2/3, A_3 = 3 - 7/3 = 2/3,
    # A_4 = 4 - 6/3 = 2; second group [1, 0, 0, 1]: A = [1 - 1/3, 0 - 2/3, -2/3, 2/3]
    out = rloo_advantages([1.0, 2.0, 3.0, 4.0, 1.0, 0.0, 0.0, 1.0], 4)
    assert_close(out, [-2.0, -2 / 3, 2 / 3, 2.0, 2 / 3, -2 / 3, -2 / 3, 2 / 3])


@given(
    sizes=groups, seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float64])
)
def test_rloo_matches_reference(sizes: tuple[int, int], seed: int, dtype: torch.dtype) -> None:
    prompts, group_size = sizes[0], sizes[1] + 1
    rewards = torch.randn(prompts * group_size, generator=_generator(seed), dtype=dtype)
    got_input = rewards.clone().requires_grad_(True)
    out = rloo_advantages(got_input, group_size)
    (grad,) = torch.autograd.grad((out * torch.arange(out.numel())).sum(), got_input)
    ref_input = rewards.double().requires_grad_(True)
    expected = reference.rloo_advantages(ref_input, group_size)
    (expected_grad,) = _grads(expected * torch.arange(out.numel()), ref_input)
    assert out.dtype == dtype
    assert_close(out, expected)
    assert_close(grad, expected_grad)


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_golden() -> None:
    # Scores [1, 0], mask [[1, 1], [1, 0]], gamma 1: returns [[1, 1], [0, -]].
    # Selected returns [1, 1, 0]: mean 2/3, deviations [1/3, 1/3, -2/3],
    # population var (1/9 + 1/9 + 4/9) / 3 = 2/9, std = 0.47140452;
    # A = [0.70710678, 0.70710678, -1.41421356] (eps 1e-8 is below the tolerance).
    out = reinforce_plus_plus_advantages([1.0, 0.0], [[1, 1], [1, 0]])
    std = math.sqrt(2.0 / 9.0)
    assert_close(out, [[(1 / 3) / std, (1 / 3) / std], [-(2 / 3) / std, 0.0]])


def test_reinforce_plus_plus_golden_with_kl_and_gamma() -> None:
    # One sequence, 3 selected tokens and a masked one in the middle (skipped by the discount):
    # token rewards c = [-0.1, (masked), -0.2, -0.3], score 2 on the last token, gamma 0.5:
    # R = [-0.1, -, -0.2, 1.7]; G_3 = 1.7; G_2 = -0.2 + 0.5*1.7 = 0.65; G_0 = -0.1 + 0.5*0.65
    # = 0.225. Mean = 2.575/3 = 0.85833333; deviations [-0.63333333, -0.20833333, 0.84166667];
    # var = (0.40111111 + 0.04340278 + 0.70840278)/3 = 0.38430556, std = 0.61992383;
    # A = [-1.02163088, 0, -0.33606279, 1.35769368].
    token_rewards = torch.tensor([[-0.1, float("nan"), -0.2, -0.3]])
    out = reinforce_plus_plus_advantages(
        [2.0], [[1, 0, 1, 1]], token_rewards=token_rewards, gamma=0.5, eps=0.0
    )
    # Exactly: mean 103/120, deviations [-19/30, -5/24, 101/120].
    std = math.sqrt(((19 / 30) ** 2 + (5 / 24) ** 2 + (101 / 120) ** 2) / 3)
    assert_close(out, [[-19 / 30 / std, 0.0, -5 / 24 / std, 101 / 120 / std]])
    assert_close(torch.tensor(std), 0.61992383, dtype=torch.float32)


@given(shape=token_shapes, seed=st.integers(0, 2**16))
def test_reinforce_plus_plus_gamma_one_is_paper_return(shape: tuple[int, int], seed: int) -> None:
    # Paper: A_t = r - beta * sum_{i >= t} KL(i) with KL(i) = log(pi_old / pi_ref) (k1), then
    # global whitening. Independent computation with a flipped cumsum over the selected tokens.
    old_log_probs, ref_log_probs, mask = _token_inputs(seed, *shape)
    scores = torch.randn(shape[0], generator=_generator(seed + 3), dtype=torch.float64)
    beta = 0.05
    kl = kl_estimate(old_log_probs, ref_log_probs, mask, estimator="k1", log_ratio_bound=None)
    out = reinforce_plus_plus_advantages(scores, mask, token_rewards=-beta * kl, eps=0.0)
    returns = scores.unsqueeze(-1) - beta * kl.flip(-1).cumsum(-1).flip(-1)  # (B, T)
    selected = returns[mask]
    if selected.numel() == 0:
        assert torch.equal(out, torch.zeros_like(out))
        return
    std = (selected - selected.mean()).square().mean().sqrt()
    expected = torch.where(mask, (returns - selected.mean()) / std, 0.0)
    if float(std) > 1e-6:  # a single selected token (or identical returns) has std 0 -> all 0
        assert_close(out, expected)
        # whitened: mean 0 and population std 1 over the selected tokens
        assert_close(out[mask].mean(), 0.0)
        assert_close(out[mask].square().mean(), 1.0)


@given(
    shape=token_shapes,
    seed=st.integers(0, 2**16),
    gamma=st.sampled_from([1.0, 0.9, 0.0]),
    with_tokens=st.booleans(),
    group_size=st.sampled_from([None, 1]),
    holes=st.sampled_from(["skip", "zero"]),
)
def test_reinforce_plus_plus_matches_reference(
    shape: tuple[int, int],
    seed: int,
    gamma: float,
    with_tokens: bool,
    group_size: int | None,
    holes: str,
) -> None:
    token_rewards, _, mask = _token_inputs(seed, *shape)
    token_rewards = token_rewards * 0.1 if with_tokens else None
    scores = torch.randn(shape[0], generator=_generator(seed + 5), dtype=torch.float64)
    options: dict[str, Any] = {"gamma": gamma, "group_size": group_size, "holes": holes}
    out = reinforce_plus_plus_advantages(scores, mask, token_rewards=token_rewards, **options)
    expected = reference.reinforce_plus_plus_advantages(
        scores, mask, token_rewards=token_rewards, **options
    )
    assert out.dtype == torch.float64
    assert_close(out, expected)


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_plus_plus_gradients(gamma: float) -> None:
    token_rewards, _, mask = _token_inputs(15, 3, 5)
    mask[:, 0] = True
    scores = torch.randn(3, generator=_generator(16), dtype=torch.float64, requires_grad=True)
    token_rewards.requires_grad_(True)

    def fn(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return reinforce_plus_plus_advantages(r, mask, token_rewards=c, gamma=gamma, group_size=3)

    assert torch.autograd.gradcheck(fn, (scores, token_rewards))
    weights = torch.randn(3, 5, generator=_generator(17), dtype=torch.float64)
    got = torch.autograd.grad((fn(scores, token_rewards) * weights).sum(), (scores, token_rewards))
    expected = reference.reinforce_plus_plus_advantages(
        scores, mask, token_rewards=token_rewards, gamma=gamma, group_size=3
    )
    wanted = torch.autograd.grad((expected * weights).sum(), (scores, token_rewards))
    for g, w in zip(got, wanted, strict=True):
        assert_close(g, w)


def test_reinforce_plus_plus_holes_zero_golden_openrlhf() -> None:
    # OpenRLHF's get_cumulative_returns discounts through a hole (gamma 0.5, no token rewards):
    # mask [[1, 0, 1], [1, 1, 1]], scores [1, 2]
    # "zero":  returns [[0.25, -, 1], [0.5, 1, 2]]; mean 4.75 / 5 = 0.95, deviations
    #          -0.7, 0.05, -0.45, 0.05, 1.05, variance 1.8 / 5 = 0.36, std 0.6
    # "skip":  returns [[0.5, -, 1], [0.5, 1, 2]]; mean 1, variance 1.5 / 5 = 0.3
    mask = [[1, 0, 1], [1, 1, 1]]
    zero = reinforce_plus_plus_advantages([1.0, 2.0], mask, gamma=0.5, eps=0.0, holes="zero")
    assert_close(zero, [[-0.7 / 0.6, 0.0, 0.05 / 0.6], [-0.45 / 0.6, 0.05 / 0.6, 1.05 / 0.6]])
    skip = reinforce_plus_plus_advantages([1.0, 2.0], mask, gamma=0.5, eps=0.0)
    std = math.sqrt(0.3)
    assert_close(skip, [[-0.5 / std, 0.0, 0.0], [-0.5 / std, 0.0, 1.0 / std]])
    # Without holes (trailing padding only), or with gamma = 1, both are the same.
    padded = ([1.0, 2.0], [[1, 1, 0], [1, 1, 1]])
    for args, gamma in ((padded, 0.5), (([1.0, 2.0], mask), 1.0)):
        assert torch.equal(
            reinforce_plus_plus_advantages(*args, gamma=gamma, holes="zero"),
            reinforce_plus_plus_advantages(*args, gamma=gamma),
        )
    with pytest.raises(ValueError, match=r"holes must be one of \['skip', 'zero'\], got 'x'"):
        reinforce_plus_plus_advantages([1.0], [[1]], holes="x")  # type: ignore[arg-type]


def test_reinforce_plus_plus_group_baseline() -> None:
    # group_size 2: scores [1, 3 | 5, 5] -> baselined [-1, 1 | 0, 0]; one token each:
    # returns [-1, 1, 0, 0], mean 0, population std sqrt(2/4) = 0.70710678
    mask = torch.ones(4, 1, dtype=torch.bool)
    out = reinforce_plus_plus_advantages([1.0, 3.0, 5.0, 5.0], mask, group_size=2, eps=0.0)
    assert_close(out, [[-math.sqrt(2)], [math.sqrt(2)], [0.0], [0.0]])
    expected = reference.reinforce_plus_plus_advantages(
        torch.tensor([1.0, 3.0, 5.0, 5.0], dtype=torch.float64), mask, group_size=2, eps=0.0
    )
    assert_close(out, expected.float())


def test_reinforce_plus_plus_masking() -> None:
    mask = torch.tensor([[True, False, True], [False, False, False]])
    token_rewards = torch.tensor([[0.1, float("nan"), 0.2], [float("inf"), float("nan"), 1.0]])
    out = reinforce_plus_plus_advantages([1.0, float("nan")], mask, token_rewards=token_rewards)
    clean = reinforce_plus_plus_advantages(
        [1.0, 0.0], mask, token_rewards=torch.where(mask, token_rewards, 0.0)
    )
    assert torch.equal(out, clean)
    assert bool(torch.isfinite(out).all()) and bool((out[~mask] == 0).all())
    empty = reinforce_plus_plus_advantages([1.0, 2.0], torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(2, 3))
    assert reinforce_plus_plus_advantages([], torch.zeros(0, 0)).shape == (0, 0)
    # A constant return everywhere (one token per row, equal scores) gives ~0, never NaN.
    same = reinforce_plus_plus_advantages([0.1, 0.1, 0.1], torch.ones(3, 1), eps=0.0)
    assert bool(torch.isfinite(same).all()) and float(same.abs().max()) < 1e-6


def test_reinforce_plus_plus_errors() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"rewards must have shape \(B,\) or \(B, 1\) with B = 2"):
        reinforce_plus_plus_advantages([1.0, 2.0, 3.0], mask)
    with pytest.raises(ValueError, match=r"token_rewards must have the same shape as mask"):
        reinforce_plus_plus_advantages([1.0, 2.0], mask, token_rewards=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        reinforce_plus_plus_advantages([1.0, 2.0], mask, gamma=1.5)
    with pytest.raises(ValueError, match=r"rewards length 2 is not divisible by group_size 3"):
        reinforce_plus_plus_advantages([1.0, 2.0], mask, group_size=3)
    with pytest.raises(ValueError, match=r"mask must have shape \(B, T\)"):
        reinforce_plus_plus_advantages([1.0, 2.0], torch.ones(2))


# --------------------------------------------------------------------------- GAE


def test_gae_golden() -> None:
    # rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 0.9, lam 0.8 (gamma*lam = 0.72):
    # t=2: delta = 1 + 0 - 0.7 = 0.3;            A_2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;     A_1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;     A_0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    out = gae([[0.0, 0.0, 1.0]], [[0.5, 0.6, 0.7]], [[1, 1, 1]], gamma=0.9, lam=0.8)
    assert isinstance(out, GAEOutput)
    assert_close(out.advantages, [[0.21712, 0.246, 0.3]])
    assert_close(out.returns, [[0.71712, 0.846, 1.0]])
    # A masked token in the middle (NaN reward/value) is skipped, the chain is unchanged, and
    # trailing padding changes nothing.
    out = gae(
        [[0.0, float("nan"), 0.0, 1.0, float("inf")]],
        [[0.5, float("nan"), 0.6, 0.7, -float("inf")]],
        [[1, 0, 1, 1, 0]],
        gamma=0.9,
        lam=0.8,
    )
    assert_close(out.advantages, [[0.21712, 0.0, 0.246, 0.3, 0.0]])
    assert_close(out.returns, [[0.71712, 0.0, 0.846, 1.0, 0.0]])


def test_gae_lambda_limits() -> None:
    rewards, values, _ = _token_inputs(8, 3, 6)
    mask = torch.ones(3, 6, dtype=torch.bool)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], dim=-1)
    # lam = 0: one-step TD error delta_t = r_t + gamma V_{t+1} - V_t
    td = gae(rewards, values, mask, gamma=0.9, lam=0.0).advantages
    assert_close(td, rewards + 0.9 * next_values - values)
    # lam = 1: discounted Monte-Carlo return minus V
    discounts = 0.9 ** torch.arange(6, dtype=torch.float64)
    mc = torch.stack(
        [(rewards[:, t:] * discounts[: 6 - t]).sum(-1) for t in range(6)], dim=-1
    )  # (B, T)
    out = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert_close(out.advantages, mc - values)
    assert_close(out.returns, mc)


@given(shape=token_shapes, seed=st.integers(0, 2**16))
def test_gae_gamma_lambda_one_is_reward_to_go_minus_value(
    shape: tuple[int, int], seed: int
) -> None:
    rewards, values, mask = _token_inputs(seed, *shape)
    out = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    selected_rewards = torch.where(mask, rewards, 0.0)
    reward_to_go = selected_rewards.flip(-1).cumsum(-1).flip(-1)  # (B, T)
    assert_close(out.advantages, torch.where(mask, reward_to_go - values, 0.0))
    assert_close(out.returns, torch.where(mask, reward_to_go, 0.0))


@given(
    shape=token_shapes,
    seed=st.integers(0, 2**16),
    gamma=st.sampled_from([1.0, 0.99, 0.5, 0.0]),
    lam=st.sampled_from([1.0, 0.95, 0.3, 0.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_gae_matches_reference(
    shape: tuple[int, int], seed: int, gamma: float, lam: float, dtype: torch.dtype
) -> None:
    rewards, values, mask = _token_inputs(seed, *shape)
    rewards_in = rewards.to(dtype).requires_grad_(True)
    values_in = values.to(dtype).requires_grad_(True)
    out = gae(rewards_in, values_in, mask, gamma=gamma, lam=lam)
    assert out.advantages.dtype == dtype and out.returns.dtype == dtype
    weights = torch.randn(shape, generator=_generator(seed + 9), dtype=torch.float64)
    grads = torch.autograd.grad(
        ((out.advantages + 2 * out.returns) * weights.to(dtype)).sum(), (rewards_in, values_in)
    )
    rewards_ref = rewards_in.detach().double().requires_grad_(True)
    values_ref = values_in.detach().double().requires_grad_(True)
    advantages, returns = reference.gae(rewards_ref, values_ref, mask, gamma=gamma, lam=lam)
    expected_grads = _grads((advantages + 2 * returns) * weights, rewards_ref, values_ref)
    assert_close(out.advantages, advantages)
    assert_close(out.returns, returns)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert_close(got, expected)


@pytest.mark.parametrize(
    ("gamma", "lam"),
    [(0.9, 0.95), (0.0, 0.5), (1.0, 0.9), (1.0, 1.0), (0.3, 0.1), (0.5, 0.5), (0.999, 0.999)],
)
@pytest.mark.parametrize("log_range", [None, 1.0])
def test_long_sequences_cross_scan_blocks(
    gamma: float, lam: float, log_range: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if log_range is not None:  # force small blocks (6 tokens for 0.855, 2 for 0.5) at any gamma
        monkeypatch.setattr(_scans, "BLOCK_LOG_RANGE", log_range)
    # T = 150 spans several scan blocks (block size from gamma * lam: 9 tokens for 0.03, 50 for
    # 0.5, 322 for 0.9), with masked gaps and an empty row.
    rewards, values, mask = _token_inputs(14, 3, 150)
    mask[1, 60:70] = False  # a gap across a block boundary
    mask[2] = False
    mask[0, 64:128] = False  # a whole block unselected: the carry passes through it
    rewards_in = rewards.clone().requires_grad_(True)
    out = gae(rewards_in, values, mask, gamma=gamma, lam=lam)
    rewards_ref = rewards.clone().requires_grad_(True)
    advantages, returns = reference.gae(rewards_ref, values, mask, gamma=gamma, lam=lam)
    assert_close(out.advantages, advantages)
    assert_close(out.returns, returns)
    (grad,) = torch.autograd.grad(out.advantages.sum(), rewards_in)
    (expected_grad,) = _grads(advantages, rewards_ref)
    assert_close(grad, expected_grad)
    scores = rewards[:, 0]
    got = reinforce_plus_plus_advantages(scores, mask, token_rewards=rewards * 0.01, gamma=gamma)
    expected = reference.reinforce_plus_plus_advantages(
        scores, mask, token_rewards=rewards * 0.01, gamma=gamma
    )
    assert_close(got, expected)


def test_gae_gradcheck() -> None:
    rewards, values, mask = _token_inputs(10, 3, 5)
    rewards.requires_grad_(True)
    values.requires_grad_(True)

    def fn(r: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = gae(r, v, mask, gamma=0.9, lam=0.7)
        return out.advantages, out.returns

    assert torch.autograd.gradcheck(fn, (rewards, values))


def test_gae_nan_at_masked_positions_and_empty() -> None:
    rewards, values, mask = _token_inputs(12, 4, 6)
    mask[3] = False
    dirty_rewards = torch.where(mask, rewards, float("nan")).requires_grad_(True)
    dirty_values = torch.where(mask, values, float("inf")).requires_grad_(True)
    clean = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    dirty = gae(dirty_rewards, dirty_values, mask, gamma=0.95, lam=0.9)
    assert torch.equal(dirty.advantages, clean.advantages)
    assert torch.equal(dirty.returns, clean.returns)
    grads = torch.autograd.grad(
        (dirty.advantages + dirty.returns).sum(), (dirty_rewards, dirty_values)
    )
    for grad in grads:
        assert bool(torch.isfinite(grad).all()) and bool((grad[~mask] == 0).all())
    empty = gae(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0), gamma=1.0, lam=1.0)
    assert empty.advantages.shape == (0, 0) and empty.returns.shape == (0, 0)
    no_tokens = gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), gamma=1.0, lam=1.0)
    assert no_tokens.advantages.shape == (2, 0)


def test_gae_dtypes() -> None:
    bf16 = torch.ones(2, 3, dtype=torch.bfloat16)
    out = gae(bf16, bf16, torch.ones(2, 3), gamma=1.0, lam=1.0)
    assert out.advantages.dtype == torch.float32
    assert gae([[1, 2]], [[0, 0]], [[1, 1]], gamma=1.0, lam=1.0).advantages.dtype == torch.float32


def test_gae_errors() -> None:
    zeros = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.1"):
        gae(zeros, zeros, mask, gamma=1.1, lam=0.9)
    with pytest.raises(ValueError, match=r"lam must be >= 0.0, got -0.1"):
        gae(zeros, zeros, mask, gamma=0.9, lam=-0.1)
    with pytest.raises(ValueError, match=r"lam must be finite, got nan"):
        gae(zeros, zeros, mask, gamma=0.9, lam=float("nan"))
    with pytest.raises(
        TypeError, match=r"gamma must be a real number \(a Python number, not a tensor\)"
    ):
        gae(zeros, zeros, mask, gamma=torch.tensor(0.9), lam=0.9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"values must have the same shape as rewards \(2, 3\)"):
        gae(zeros, torch.zeros(2, 4), mask, gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match=r"mask must have the same shape as rewards"):
        gae(zeros, zeros, torch.ones(3, 2), gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match=r"rewards must have shape \(B, T\)"):
        gae(torch.zeros(3), zeros, mask, gamma=0.9, lam=0.9)


# --------------------------------------------------------------------------- GAE options (PPO)


def test_gae_whiten_golden_verl() -> None:
    # rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 0.9, lam 0.8 (test_gae_golden):
    # A = [0.21712, 0.246, 0.3], returns [0.71712, 0.846, 1.0]. verl whitens A over the mask:
    # mean 0.254373, deviations [-0.037253, -0.008373, 0.045627], unbiased var
    # (0.00138779 + 0.0000701 + 0.00208182) / 2 = 0.00176986 -> /sqrt(var + 1e-8).
    out = gae([[0.0, 0.0, 1.0]], [[0.5, 0.6, 0.7]], [[1, 1, 1]], gamma=0.9, lam=0.8, whiten=True)
    raw = [0.21712, 0.246, 0.3]
    mean = sum(raw) / 3
    variance = sum((a - mean) ** 2 for a in raw) / 2
    assert_close(out.advantages, [[(a - mean) / math.sqrt(variance + 1e-8) for a in raw]])
    assert_close(out.returns, [[0.71712, 0.846, 1.0]])  # returns of the raw advantages


def test_gae_holes_zero_golden_openrlhf() -> None:
    # OpenRLHF runs the recursion through a hole with r = V = 0 there (gamma 0.9, lam 0.8):
    # mask [1, 0, 1, 1], rewards [0, -, 0, 1], values [0.5, -, 0.6, 0.7]
    # t=3: delta = 1 - 0.7 = 0.3;               A_3 = 0.3
    # t=2: delta = 0.9*0.7 - 0.6 = 0.03;        A_2 = 0.03 + 0.72*0.3 = 0.246
    # t=1 (hole): delta = 0.9*0.6 - 0 = 0.54;   A_1 = 0.54 + 0.72*0.246 = 0.71712
    # t=0: delta = 0 + 0.9*0 - 0.5 = -0.5;      A_0 = -0.5 + 0.72*0.71712 = 0.0163264
    # "skip" (verl, default) jumps over the hole: A_0 = 0.21712 as without it.
    rewards = [[0.0, float("nan"), 0.0, 1.0]]
    values = [[0.5, float("inf"), 0.6, 0.7]]
    mask = [[1, 0, 1, 1]]
    zero = gae(rewards, values, mask, gamma=0.9, lam=0.8, holes="zero")
    assert_close(zero.advantages, [[0.0163264, 0.0, 0.246, 0.3]])
    assert_close(zero.returns, [[0.5163264, 0.0, 0.846, 1.0]])
    skip = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(skip.advantages, [[0.21712, 0.0, 0.246, 0.3]])
    # Without holes (trailing padding only) both are the same.
    padded = ([[0.0, 0.0, 1.0, 9.0]], [[0.5, 0.6, 0.7, 9.0]], [[1, 1, 1, 0]])
    for name in ("advantages", "returns"):
        assert torch.equal(
            getattr(gae(*padded, gamma=0.9, lam=0.8, holes="zero"), name),
            getattr(gae(*padded, gamma=0.9, lam=0.8), name),
        )


@given(
    shape=token_shapes,
    seed=st.integers(0, 2**16),
    gamma=st.sampled_from([1.0, 0.9, 0.0]),
    lam=st.sampled_from([1.0, 0.95, 0.0]),
    whiten=st.booleans(),
    holes=st.sampled_from(["skip", "zero"]),
)
def test_gae_options_match_reference(
    shape: tuple[int, int], seed: int, gamma: float, lam: float, whiten: bool, holes: str
) -> None:
    rewards, values, mask = _token_inputs(seed, *shape)
    rewards_in = torch.where(mask, rewards, float("nan")).requires_grad_(True)
    values_in = torch.where(mask, values, float("inf")).requires_grad_(True)
    out = gae(rewards_in, values_in, mask, gamma=gamma, lam=lam, whiten=whiten, holes=holes)  # type: ignore[arg-type]
    weights = torch.randn(shape, generator=_generator(seed + 9), dtype=torch.float64)
    grads = _grads((out.advantages + 2 * out.returns) * weights, rewards_in, values_in)
    rewards_ref = rewards.clone().requires_grad_(True)
    values_ref = values.clone().requires_grad_(True)
    advantages, returns = reference.gae_with_options(
        rewards_ref, values_ref, mask, gamma=gamma, lam=lam, whiten=whiten, holes=holes
    )
    expected_grads = _grads((advantages + 2 * returns) * weights, rewards_ref, values_ref)
    assert_close(out.advantages, advantages)
    assert_close(out.returns, returns)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(got).all() and bool((got[~mask] == 0).all())
        assert_close(got, expected)
    if whiten:  # the documented composition
        raw = gae(rewards, values, mask, gamma=gamma, lam=lam, holes=holes)  # type: ignore[arg-type]
        assert torch.equal(out.advantages, masked_whiten(raw.advantages, mask))
        assert torch.equal(out.returns, raw.returns)


def test_gae_option_errors() -> None:
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"holes must be one of \['skip', 'zero'\], got 'carry'"):
        gae(zeros, zeros, mask, gamma=1.0, lam=1.0, holes="carry")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"whiten must be a bool, got str"):
        gae(zeros, zeros, mask, gamma=1.0, lam=1.0, whiten="yes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- compile


@pytest.mark.compile
def test_gae_and_reinforce_plus_plus_under_torch_compile() -> None:
    rewards, values, mask = _token_inputs(13, 3, 6)
    ids = torch.tensor([4, 1, 4])
    rewards = rewards.float()
    values = values.float()

    def step(r: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = gae(r, v, mask, gamma=0.99, lam=0.95, whiten=True, holes="zero")
        advantages = reinforce_plus_plus_advantages(r[:, 0], mask, token_rewards=r, group_size=3)
        critic = value_loss(v, v.detach() + 0.1, out.returns, mask)
        outcome = group_relative_advantages(r[:, 1], group_ids=ids)  # segment ops
        return out.advantages + advantages + critic.loss + outcome.unsqueeze(-1)

    compiled = torch.compile(step, fullgraph=True)
    assert_close(compiled(rewards, values), step(rewards, values))
