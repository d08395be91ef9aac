"""KL kernels (Triton interpreter on CPU): kl_loss per token + reduction, kl_penalized_rewards."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends import requires_triton
from rlobjectives._core.backend import use_kernels
from rlobjectives.kernels.kl import (
    KLLossFunction,
    KLPenalizedRewardsFunction,
    kl_loss_forward,
    kl_penalized_rewards_forward,
)
from rlobjectives.kernels.token_loss import TokenLossOptions
from tolerances import assert_close
from triton_reference import token_loss as reference_loss

pytestmark = requires_triton

N = 67


@pytest.fixture(autouse=True)
def _triton_backend() -> Any:
    with use_kernels("triton"):
        yield


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(N, generator=g) * 3
    log_probs = ref + 0.5 * torch.randn(N, generator=g)
    log_probs[::11] -= 4.0  # beyond the bound 2.0 used below
    mask = torch.rand(N, generator=g) < 0.8
    importance = 0.5 + torch.rand(N, generator=g)
    return log_probs, ref, mask, importance


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("straight_through", [False, True])
@pytest.mark.parametrize("bound", [None, 2.0])
def test_kl_loss_matches_reference(
    estimator: str, straight_through: bool, bound: float | None
) -> None:
    log_probs, ref, mask, _ = _inputs()
    weight = torch.tensor(1.0) / mask.sum()
    out = kl_loss_forward(
        log_probs, ref, mask, weights=weight, estimator=estimator,
        straight_through=straight_through, log_ratio_bound=bound, return_per_token=True,
        block_size=16,
    )  # fmt: skip
    options = TokenLossOptions(
        surrogate="none", log_ratio_bound=bound, kl_coef=1.0, kl_estimator=estimator,
        kl_straight_through=straight_through,
    )  # fmt: skip
    leaf = log_probs.double().requires_grad_(True)
    expected = reference_loss(leaf, None, None, mask, options, weights=weight, ref_log_probs=ref)
    (gradient,) = torch.autograd.grad(expected.loss, leaf)
    assert out.per_token is not None
    torch.testing.assert_close(out.per_token.double(), expected.per_token.detach(),
                               rtol=2e-6, atol=1e-7)  # fmt: skip
    torch.testing.assert_close(out.coefficient.double(), gradient, rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(out.loss.double(), expected.loss.detach(), rtol=2e-6, atol=1e-7)
    assert float(out.selected) == float(mask.sum())


def test_kl_loss_k3_has_no_cancellation_at_tiny_log_ratios() -> None:
    log_probs = torch.tensor([1e-4, -3e-5, 2e-3])
    ref = torch.zeros(3)
    out = kl_loss_forward(log_probs, ref, torch.ones(3, dtype=torch.bool), return_per_token=True)
    d = log_probs.double()
    expected = torch.expm1(-d) + d
    assert out.per_token is not None
    torch.testing.assert_close(out.per_token.double(), expected, rtol=2e-6, atol=0.0)


def test_kl_loss_importance_weights_and_nan_at_unselected() -> None:
    log_probs, ref, mask, importance = _inputs(1)
    weights = torch.rand(N)
    kwargs: dict[str, Any] = {"estimator": "k3", "log_ratio_bound": 2.0}
    clean = KLLossFunction.apply(
        log_probs.clone().requires_grad_(True), ref, mask, weights,
        dict(kwargs, importance_weights=importance, block_size=16),
    )  # fmt: skip
    poisoned_lp = torch.where(mask, log_probs, math.nan).requires_grad_(True)
    dirty = KLLossFunction.apply(
        poisoned_lp, torch.where(mask, ref, -math.inf), mask, weights,
        dict(kwargs, importance_weights=torch.where(mask, importance, math.inf), block_size=16),
    )  # fmt: skip
    dirty[0].backward()
    options = TokenLossOptions(surrogate="none", log_ratio_bound=2.0, kl_coef=1.0,
                               kl_importance_weighted=True)  # fmt: skip
    leaf = log_probs.double().requires_grad_(True)
    expected = reference_loss(leaf, None, None, mask, options, weights=weights,
                              ref_log_probs=ref, importance_weights=importance)  # fmt: skip
    expected.loss.backward()
    assert torch.equal(clean[0], dirty[0])
    assert poisoned_lp.grad is not None and leaf.grad is not None
    torch.testing.assert_close(dirty[0].double(), expected.loss.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(poisoned_lp.grad.double(), leaf.grad, rtol=2e-6, atol=1e-9)


# Seed specification examples (verbatim inputs and outputs).
SEED_EXAMPLES = [
    (
        [[-1.0, -2.0]], [[-1.5, -2.5]], [3.0], [[True, True]], 0.5,
        {"objective": 2.5, "penalized_rewards": [2.5], "sampled_divergences": [1.0]},
    ),
    (
        [[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], [[-1.2, -2.1, -3.4], [-0.7, -0.4, -0.2]],
        [1.0, -1.0], [[True, True, False], [True, True, True]], 0.2,
        {"objective": -0.01, "penalized_rewards": [0.94, -0.96],
         "sampled_divergences": [0.3, -0.2]},
    ),
    (
        [[-1.0, -2.0]], [[-3.0, -4.0]], [-2.0], [[False, False]], 3.0,
        {"objective": -2.0, "penalized_rewards": [-2.0], "sampled_divergences": [0.0]},
    ),
]  # fmt: skip


@pytest.mark.parametrize("example", SEED_EXAMPLES)
def test_kl_penalized_rewards_seed_examples(example: tuple[Any, ...]) -> None:
    policy, reference, rewards, mask, beta, expected = example
    out = kl_penalized_rewards_forward(
        torch.tensor(policy), torch.tensor(reference), torch.tensor(rewards), torch.tensor(mask),
        beta=beta,
    )  # fmt: skip
    for name, value in expected.items():
        got = getattr(out, name)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.tensor(value), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_penalized_rewards_values_and_gradients(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    batch, tokens = 3, 45  # several loop steps with block_size 16
    policy = (-torch.rand(batch, tokens, generator=g) * 2).to(dtype)
    reference = (-torch.rand(batch, tokens, generator=g) * 2).to(dtype)
    rewards = torch.randn(batch, generator=g).to(dtype)
    mask = torch.rand(batch, tokens, generator=g) < 0.7
    mask[1] = False
    dirty = torch.where(mask, policy, torch.tensor(math.nan, dtype=dtype))
    leaves = [t.clone().requires_grad_(True) for t in (dirty, reference, rewards)]
    outputs = KLPenalizedRewardsFunction.apply(*leaves, mask, 0.3)
    upstream = [torch.tensor(1.5), torch.randn(batch, generator=g), torch.randn(batch, generator=g)]
    sum((o * u).sum() for o, u in zip(outputs, upstream, strict=True)).backward()
    ref_leaves = [t.double().requires_grad_(True) for t in (policy, reference, rewards)]
    divergence = torch.where(mask, ref_leaves[0] - ref_leaves[1], 0.0).sum(-1)
    penalized = ref_leaves[2] - 0.3 * divergence
    expected = (penalized.sum() / batch, penalized, divergence)
    sum((e * u.double()).sum() for e, u in zip(expected, upstream, strict=True)).backward()
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert leaf.grad is not None and ref_leaf.grad is not None and leaf.grad.dtype == dtype
        assert_close(leaf.grad, ref_leaf.grad)


def test_kl_penalized_rewards_empty_batch_and_empty_rows() -> None:
    empty = kl_penalized_rewards_forward(
        torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, 4, dtype=torch.bool),
        beta=1.0,
    )  # fmt: skip
    assert float(empty.objective) == 0.0 and empty.penalized_rewards.shape == (0,)
    no_tokens = kl_penalized_rewards_forward(
        torch.zeros(2, 0), torch.zeros(2, 0), torch.tensor([1.0, 3.0]),
        torch.zeros(2, 0, dtype=torch.bool), beta=1.0,
    )  # fmt: skip
    assert float(no_tokens.objective) == 2.0
