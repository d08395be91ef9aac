"""Tests of the sampled KL estimators and their placements (rlobjectives.kl.estimators).

``kl_loss``'s goldens and comparisons with the float64 reference, its NaN, micro-batch and
importance-weight tests also run on the Triton kernels (the ``backend`` fixture,
``tests/backends.py``; float32 there, float64 always takes PyTorch).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from backends import FIXTURE_HEALTH, dtype_for, triton_param
from rlobjectives import (
    BiasedGradientWarning,
    kl_estimate,
    kl_loss,
    kl_penalized_rewards,
    kl_penalized_token_rewards,
)
from tolerances import assert_close

REDUCTIONS = ["token_mean", "sequence_mean", "sequence_sum_normalized", "none"]
ESTIMATORS = ["k1", "k2", "k3", "abs"]


def _inputs(
    seed: int, batch: int, tokens: int, dtype: torch.dtype = torch.float64, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(batch, tokens, generator=generator, dtype=torch.float64) * 3 * scale
    ref_log_probs = -torch.rand(batch, tokens, generator=generator, dtype=torch.float64) * 3 * scale
    mask = torch.rand(batch, tokens, generator=generator) < 0.7
    return log_probs.to(dtype), ref_log_probs.to(dtype), mask


def _grads(output: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``output.sum()``; zeros when nothing was selected (no graph)."""
    if not output.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad(output.sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


shapes = st.tuples(st.integers(1, 5), st.integers(1, 7))


# --------------------------------------------------------------------------- golden


def test_kl_estimate_golden() -> None:
    log_probs = torch.tensor([[0.0, 1.0, -1.0, float("nan")]])
    ref_log_probs = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    # d = [0, 1, -1, (masked)]
    # k1 = d = [0, 1, -1, 0]
    assert_close(kl_estimate(log_probs, ref_log_probs, mask, estimator="k1"), [[0, 1, -1, 0]])
    # k2 = d^2 / 2 = [0, 0.5, 0.5, 0]
    assert_close(kl_estimate(log_probs, ref_log_probs, mask, estimator="k2"), [[0, 0.5, 0.5, 0]])
    # k3 = exp(-d) + d - 1: d=1 -> e^-1 = 0.36787944; d=-1 -> e - 2 = 0.71828183
    expected = [[0.0, math.exp(-1.0), math.e - 2.0, 0.0]]
    assert_close(kl_estimate(log_probs, ref_log_probs, mask, estimator="k3"), expected)
    # bound 0.5: d -> [0, 0.5, -0.5]; k3 = e^-0.5 + 0.5 - 1 = 0.10653066, e^0.5 - 1.5 = 0.14872127
    bounded = kl_estimate(log_probs, ref_log_probs, mask, estimator="k3", log_ratio_bound=0.5)
    assert_close(bounded, [[0.0, math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]])


def test_kl_estimate_abs_golden_verl() -> None:
    # verl kl_penalty="abs": |log pi - log ref|. d = [0.5, -1.5, (masked)] -> [0.5, 1.5, 0];
    # gradient sign(d) w.r.t. log pi: [1, -1, 0].
    log_probs = torch.tensor([[-1.0, -2.5, float("nan")]], requires_grad=True)
    ref_log_probs = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = kl_estimate(log_probs, ref_log_probs, mask, estimator="abs")
    assert_close(out, [[0.5, 1.5, 0.0]])
    (grad,) = torch.autograd.grad(out.sum(), log_probs)
    assert_close(grad, [[1.0, -1.0, 0.0]])
    with pytest.warns(BiasedGradientWarning, match="abs penalty"):
        rewards = kl_penalized_token_rewards(
            log_probs.detach(), ref_log_probs, [2.0], mask, kl_coef=0.1, estimator="abs"
        )
    assert_close(rewards, [[-0.05, 2.0 - 0.15, 0.0]])


def test_kl_loss_golden_reductions(backend: str) -> None:
    # d = [[1, 2], [3, (masked)]], k2 = [[0.5, 2], [4.5, -]]
    log_probs = torch.tensor([[1.0, 2.0], [3.0, 7.0]])
    mask = torch.tensor([[True, True], [True, False]])
    zeros = torch.zeros(2, 2)
    # token_mean: (0.5 + 2 + 4.5) / 3 = 7/3
    assert_close(kl_loss(log_probs, zeros, mask, estimator="k2"), 7.0 / 3.0)
    # sequence_mean: ((0.5 + 2)/2 + 4.5/1) / 2 = (1.25 + 4.5)/2 = 2.875
    assert_close(kl_loss(log_probs, zeros, mask, estimator="k2", reduction="sequence_mean"), 2.875)
    # sequence_sum_normalized with C=4: 7 / (2 * 4) = 0.875
    loss = kl_loss(
        log_probs,
        zeros,
        mask,
        estimator="k2",
        reduction="sequence_sum_normalized",
        max_response_length=4,
    )
    assert_close(loss, 0.875)
    # token_mean with normalizer 14: 7 / 14 = 0.5
    assert_close(kl_loss(log_probs, zeros, mask, estimator="k2", normalizer=14), 0.5)
    none = kl_loss(log_probs, zeros, mask, estimator="k2", reduction="none")
    assert_close(none, [[0.5, 2.0], [4.5, 0.0]])


def test_kl_penalized_token_rewards_golden() -> None:
    # The seed example: d = [0.5, 0.5], kl_coef 0.5 -> penalty -0.25 per token; score 3 on the
    # last selected token: [-0.25, 3 - 0.25] = [-0.25, 2.75]; the padding token gets 0.
    # Sum = 2.5 = the seed's penalized reward 3 - 0.5 * 1.
    rewards = kl_penalized_token_rewards(
        [[-1.0, -2.0, float("inf")]],
        [[-1.5, -2.5, float("nan")]],
        [3.0],
        [[1, 1, 0]],
        kl_coef=0.5,
    )
    assert rewards.dtype == torch.float32
    assert_close(rewards, [[-0.25, 2.75, 0.0]])
    # Selected tokens not contiguous: the score goes to the last selected one (index 2), and a
    # row with no selected token gets nothing (its score 5 is dropped, no NaN).
    rewards = kl_penalized_token_rewards(
        torch.zeros(2, 4), torch.zeros(2, 4), [1.0, 5.0], [[1, 0, 1, 0], [0, 0, 0, 0]], kl_coef=1.0
    )
    assert_close(rewards, [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- reference


@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    estimator=st.sampled_from(ESTIMATORS),
    straight_through=st.booleans(),
    bound=st.sampled_from([None, 20.0, 0.7]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_kl_estimate_matches_reference(
    shape: tuple[int, int],
    seed: int,
    estimator: str,
    straight_through: bool,
    bound: float | None,
    dtype: torch.dtype,
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape, dtype=dtype)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    log_probs.requires_grad_(True)
    ref_log_probs.requires_grad_(True)
    out = kl_estimate(
        log_probs,
        ref_log_probs,
        mask,
        estimator=estimator,  # type: ignore[arg-type]
        straight_through=straight_through,
        log_ratio_bound=bound,
    )
    assert out.dtype == dtype and out.shape == shape
    (out * weights).sum().backward()

    lp64 = log_probs.detach().double().requires_grad_(True)
    ref64 = ref_log_probs.detach().double().requires_grad_(True)
    expected = reference.kl_estimate(
        lp64,
        ref64,
        mask,
        estimator=estimator,
        straight_through=straight_through,
        log_ratio_bound=bound,
    )
    lp_grad, ref_grad = _grads(expected * weights.double(), lp64, ref64)
    assert_close(out, expected)
    assert log_probs.grad is not None and ref_log_probs.grad is not None
    assert_close(log_probs.grad, lp_grad)
    assert_close(ref_log_probs.grad, ref_grad)


@FIXTURE_HEALTH
@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    estimator=st.sampled_from(ESTIMATORS),
    straight_through=st.booleans(),
    reduction=st.sampled_from(REDUCTIONS),
    normalizer=st.sampled_from([None, 3.0]),
)
def test_kl_loss_matches_reference(
    backend: str,
    shape: tuple[int, int],
    seed: int,
    estimator: str,
    straight_through: bool,
    reduction: str,
    normalizer: float | None,
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape, dtype=torch.float32)
    log_probs.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        loss = kl_loss(
            log_probs,
            ref_log_probs,
            mask,
            estimator=estimator,  # type: ignore[arg-type]
            straight_through=straight_through,
            reduction=reduction,
            normalizer=normalizer,
            max_response_length=9,
        )
    loss.sum().backward()
    lp64 = log_probs.detach().double().requires_grad_(True)
    expected = reference.kl_loss(
        lp64,
        ref_log_probs.double(),
        mask,
        estimator=estimator,
        straight_through=straight_through,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=9,
    )
    (lp_grad,) = _grads(expected, lp64)
    assert loss.dtype == torch.float32
    assert_close(loss, expected)
    assert log_probs.grad is not None
    assert_close(log_probs.grad, lp_grad)


@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    estimator=st.sampled_from(ESTIMATORS),
    bound=st.sampled_from([None, 0.7]),
    kl_coef=st.sampled_from([0.0, 0.05, 1.5]),
)
def test_kl_penalized_token_rewards_matches_reference(
    shape: tuple[int, int], seed: int, estimator: str, bound: float | None, kl_coef: float
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape)
    scores = torch.randn(
        shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    log_probs.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        rewards = kl_penalized_token_rewards(
            log_probs,
            ref_log_probs,
            scores,
            mask,
            kl_coef=kl_coef,
            estimator=estimator,  # type: ignore[arg-type]
            log_ratio_bound=bound,
        )
    rewards.sum().backward()
    lp64 = log_probs.detach().clone().requires_grad_(True)
    expected = reference.kl_penalized_token_rewards(
        lp64,
        ref_log_probs,
        scores,
        mask,
        kl_coef=kl_coef,
        estimator=estimator,
        log_ratio_bound=bound,
    )
    (lp_grad,) = _grads(expected, lp64)
    assert rewards.dtype == torch.float64
    assert_close(rewards, expected)
    assert log_probs.grad is not None
    assert_close(log_probs.grad, lp_grad)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_estimate_gradcheck(estimator: str) -> None:
    # straight_through is excluded by design: its gradient is k2's, not the derivative of its
    # value (see test_straight_through_value_of_estimator_gradient_of_k2).
    straight_through = False
    log_probs, ref_log_probs, mask = _inputs(3, 3, 5)
    log_probs.requires_grad_(True)
    ref_log_probs.requires_grad_(True)

    def fn(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        return kl_estimate(
            lp,
            ref,
            mask,
            estimator=estimator,  # type: ignore[arg-type]
            straight_through=straight_through,
        )

    assert torch.autograd.gradcheck(fn, (log_probs, ref_log_probs))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kl_loss_gradcheck(reduction: str) -> None:
    log_probs, ref_log_probs, mask = _inputs(4, 3, 4)
    log_probs.requires_grad_(True)

    def fn(lp: torch.Tensor) -> torch.Tensor:
        return kl_loss(lp, ref_log_probs, mask, estimator="k2", reduction=reduction)

    assert torch.autograd.gradcheck(fn, (log_probs,))


# --------------------------------------------------------------------------- properties


@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-4, 1.0, 30.0]),
    bound=st.sampled_from([None, 20.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_k2_k3_nonnegative_and_zero_when_policies_agree(
    shape: tuple[int, int], seed: int, scale: float, bound: float | None, dtype: torch.dtype
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape, dtype=dtype, scale=scale)
    for estimator in ("k2", "k3"):
        value = kl_estimate(
            log_probs,
            ref_log_probs,
            mask,
            estimator=estimator,  # type: ignore[arg-type]
            log_ratio_bound=bound,
        )
        assert bool((value >= 0).all())
        same = kl_estimate(log_probs, log_probs, mask, estimator=estimator)  # type: ignore[arg-type]
        assert torch.equal(same, torch.zeros_like(same))
        # ... and strictly positive where the (selected) log-probs differ (and k is representable)
        differs = mask & ((log_probs - ref_log_probs).abs() > 1e-3)
        assert bool((value[differs] > 0).all())


@given(shape=shapes, seed=st.integers(0, 2**16), estimator=st.sampled_from(ESTIMATORS))
def test_straight_through_value_of_estimator_gradient_of_k2(
    shape: tuple[int, int], seed: int, estimator: str
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape)
    straight = log_probs.clone().requires_grad_(True)
    plain_k2 = log_probs.clone().requires_grad_(True)
    value = kl_estimate(straight, ref_log_probs, mask, estimator=estimator, straight_through=True)  # type: ignore[arg-type]
    k2 = kl_estimate(plain_k2, ref_log_probs, mask, estimator="k2")
    plain = kl_estimate(log_probs, ref_log_probs, mask, estimator=estimator)  # type: ignore[arg-type]
    assert torch.equal(value, plain)  # the value is the estimator's, bit for bit
    value.sum().backward()
    k2.sum().backward()
    assert straight.grad is not None and plain_k2.grad is not None
    assert torch.equal(straight.grad, plain_k2.grad)  # the gradient is k2's: d = lp - ref
    selected_d = (log_probs - ref_log_probs)[mask]
    assert_close(straight.grad[mask], selected_d)


def test_straight_through_gradient_is_unbiased_kl_gradient() -> None:
    # Categorical pi = softmax(theta) over 3 tokens, ref fixed. The exact gradient of
    # KL(pi || ref) w.r.t. theta must equal E_{y ~ pi}[grad of the per-token loss], computed
    # exactly by summing over y weighted by pi(y) (the weights are detached: sampling).
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.1, 0.4, -0.3], dtype=torch.float64), -1)
    log_pi = torch.log_softmax(theta, -1)
    exact = torch.autograd.grad((log_pi.exp() * (log_pi - ref)).sum(), theta)[0]

    def expected_gradient(estimator: str, straight_through: bool) -> torch.Tensor:
        log_pi = torch.log_softmax(theta, -1)
        per_token = kl_estimate(
            log_pi.unsqueeze(0),
            ref.unsqueeze(0),
            torch.ones(1, 3, dtype=torch.bool),
            estimator=estimator,  # type: ignore[arg-type]
            straight_through=straight_through,
        )[0]
        return torch.autograd.grad((log_pi.exp().detach() * per_token).sum(), theta)[0]

    assert_close(expected_gradient("k3", True), exact)
    assert_close(expected_gradient("k1", True), exact)
    assert_close(expected_gradient("k2", False), exact)
    # the biased ones (hence the warnings): k1 has zero expected gradient, k3 does not match
    assert_close(expected_gradient("k1", False), torch.zeros(3, dtype=torch.float64))
    assert not torch.allclose(expected_gradient("k3", False), exact)
    # k3's expected pathwise gradient is that of the reverse KL(ref || pi) = -sum ref grad log pi
    reverse = torch.autograd.grad((ref.exp() * (ref - torch.log_softmax(theta, -1))).sum(), theta)
    assert_close(expected_gradient("k3", False), reverse[0])


@FIXTURE_HEALTH
@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    reduction=st.sampled_from(["token_mean", "sequence_mean", "sequence_sum_normalized"]),
    splits=st.integers(1, 4),
)
def test_kl_loss_micro_batches_sum_to_full_batch(
    backend: str, shape: tuple[int, int], seed: int, reduction: str, splits: int
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape, dtype=torch.float32)
    full = kl_loss(log_probs, ref_log_probs, mask, estimator="k2", reduction=reduction)
    normalizer = {
        "token_mean": max(int(mask.sum()), 1),
        "sequence_mean": max(int((mask.sum(-1) > 0).sum()), 1),
        "sequence_sum_normalized": shape[0],
    }[reduction]
    total = torch.zeros(())
    for chunk in torch.arange(shape[0]).tensor_split(splits):
        if chunk.numel() == 0:
            continue
        total = total + kl_loss(
            log_probs[chunk],
            ref_log_probs[chunk],
            mask[chunk],
            estimator="k2",
            reduction=reduction,
            normalizer=normalizer,
            max_response_length=shape[1],
        )
    assert_close(total, full)


@given(shape=shapes, seed=st.integers(0, 2**16))
def test_token_rewards_return_equals_seed_penalized_reward(
    shape: tuple[int, int], seed: int
) -> None:
    log_probs, ref_log_probs, mask = _inputs(seed, *shape, dtype=torch.float32)
    mask[:, 0] = True  # every sequence has a selected token (empty ones: see the next test)
    scores = torch.randn(shape[0], generator=torch.Generator().manual_seed(seed))
    token_rewards = kl_penalized_token_rewards(log_probs, ref_log_probs, scores, mask, kl_coef=0.3)
    seed_out = kl_penalized_rewards(log_probs, ref_log_probs, scores, mask, 0.3)
    # return at gamma = 1 = sum over tokens = r_i - beta * D_i
    assert_close(token_rewards.sum(-1), seed_out["penalized_rewards"])


def test_token_rewards_empty_sequence_gets_nothing() -> None:
    # The seed's sequence form keeps r_i for an empty sequence; the token form has no token to
    # put it on, so the return is 0 (documented difference).
    out = kl_penalized_token_rewards(
        [[float("nan"), 1.0]], [[0.0, float("-inf")]], [2.0], [[0, 0]], kl_coef=1.0
    )
    assert torch.equal(out, torch.zeros(1, 2))


# --------------------------------------------------------------------------- masking / dtype


def _nonfinite_cases() -> list[object]:
    """PyTorch: every estimator x straight-through x reduction; kernels: every estimator and
    straight-through flag, the reductions in turn."""
    cases: list[object] = [
        pytest.param("torch", estimator, straight_through, reduction)
        for estimator in ESTIMATORS
        for straight_through in (False, True)
        for reduction in REDUCTIONS
    ]
    for index, estimator in enumerate(ESTIMATORS):
        for straight_through in (False, True):
            reduction = REDUCTIONS[(index + straight_through) % len(REDUCTIONS)]
            cases.append(triton_param(estimator, straight_through, reduction))
    return cases


@pytest.mark.parametrize(
    ("backend", "estimator", "straight_through", "reduction"),
    _nonfinite_cases(),
    indirect=["backend"],
)
def test_nan_and_inf_at_masked_positions_reach_nothing(
    backend: str, estimator: str, straight_through: bool, reduction: str
) -> None:
    log_probs, ref_log_probs, mask = _inputs(5, 3, 5, dtype=torch.float32)
    mask[2] = False  # a fully masked sequence too
    poisoned = log_probs.clone()
    poisoned_ref = ref_log_probs.clone()
    poison = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])
    poisoned[~mask] = poison[torch.arange(int((~mask).sum())) % 5]
    poisoned_ref[~mask] = poison.flip(0)[torch.arange(int((~mask).sum())) % 5]
    clean = log_probs.clone().requires_grad_(True)
    dirty = poisoned.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        kwargs = {"estimator": estimator, "straight_through": straight_through}
        expected = kl_loss(clean, ref_log_probs, mask, reduction=reduction, **kwargs)  # type: ignore[arg-type]
        got = kl_loss(dirty, poisoned_ref, mask, reduction=reduction, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(got, expected)
    expected.sum().backward()
    got.sum().backward()
    assert dirty.grad is not None and clean.grad is not None
    assert torch.equal(dirty.grad, clean.grad)
    assert bool((dirty.grad[~mask] == 0).all())

    rewards = kl_penalized_token_rewards(
        dirty.detach(), poisoned_ref, torch.ones(3), mask, kl_coef=0.1
    )
    assert bool(torch.isfinite(rewards).all()) and bool((rewards[~mask] == 0).all())


def test_fully_masked_batch_gives_zeros(backend: str) -> None:
    log_probs = torch.full((2, 3), float("nan"), requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for reduction in REDUCTIONS:
        loss = kl_loss(log_probs, torch.zeros(2, 3), mask, estimator="k2", reduction=reduction)
        assert torch.equal(loss, torch.zeros_like(loss))
        loss.sum().backward()
    assert log_probs.grad is not None and torch.equal(log_probs.grad, torch.zeros(2, 3))
    empty = kl_loss(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0), estimator="k2")
    assert torch.equal(empty, torch.zeros(()))
    assert kl_estimate([], [], []).shape == (0, 0)
    assert kl_penalized_token_rewards([], [], [], [], kl_coef=0.1).shape == (0, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_float32(dtype: torch.dtype) -> None:
    log_probs, ref_log_probs, mask = _inputs(7, 4, 6, dtype=dtype, scale=10.0)
    log_probs[0, 0], ref_log_probs[0, 0], mask[0, 0] = -60.0, 0.0, True  # k3 = exp(20) + ...
    for estimator in ESTIMATORS:
        out = kl_estimate(log_probs, ref_log_probs, mask, estimator=estimator)  # type: ignore[arg-type]
        assert out.dtype == dtype
        expected = reference.kl_estimate(
            log_probs.double(), ref_log_probs.double(), mask, estimator=estimator
        )
        if dtype == torch.float16:  # exp(20) overflows fp16's range on output, documented
            expected = expected.clamp(max=torch.finfo(torch.float16).max)
            out = out.clamp(max=torch.finfo(torch.float16).max)
        assert_close(out, expected.to(dtype).double(), dtype=dtype)
    rewards = kl_penalized_token_rewards(
        log_probs, ref_log_probs, torch.ones(4, dtype=dtype), mask, kl_coef=0.1
    )
    assert rewards.dtype == torch.float32


def test_integer_and_list_inputs() -> None:
    out = kl_estimate([[1, 0]], [[0, 0]], [[1, 1]], estimator="k2")
    assert out.dtype == torch.get_default_dtype()
    assert_close(out, [[0.5, 0.0]])


def test_does_not_mutate_inputs(backend: str) -> None:
    log_probs, ref_log_probs, mask = _inputs(9, 2, 3, dtype=dtype_for(backend))
    log_probs[~mask] = float("nan")
    copies = (log_probs.clone(), ref_log_probs.clone(), mask.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        kl_loss(log_probs, ref_log_probs, mask)
    kl_penalized_token_rewards(log_probs, ref_log_probs, torch.ones(2), mask, kl_coef=0.1)
    for before, after in zip(copies, (log_probs, ref_log_probs, mask), strict=True):
        torch.testing.assert_close(after, before, equal_nan=True, rtol=0, atol=0)


# --------------------------------------------------------------------------- warnings


@pytest.mark.parametrize(
    ("estimator", "match"),
    [("k1", "zero expected gradient"), ("k3", "biased gradient"), ("abs", "biased gradient")],
)
def test_kl_loss_warns_for_biased_combinations(estimator: str, match: str) -> None:
    with pytest.warns(BiasedGradientWarning, match=match) as record:
        kl_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), estimator=estimator)  # type: ignore[arg-type]
    assert record[0].filename == __file__  # attributed to the caller's line


@pytest.mark.parametrize(
    ("estimator", "straight_through"), [("k2", False), ("k1", True), ("k2", True), ("k3", True)]
)
def test_kl_loss_no_warning_for_unbiased_combinations(
    estimator: str, straight_through: bool
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kl_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 2),
            estimator=estimator,  # type: ignore[arg-type]
            straight_through=straight_through,
        )


@pytest.mark.parametrize(
    ("estimator", "bound", "match"),
    [("k2", None, "k2 penalty"), ("k3", None, "k3 penalty"), ("k1", 5.0, "clamping")],
)
def test_token_rewards_warn_for_biased_combinations(
    estimator: str, bound: float | None, match: str
) -> None:
    with pytest.warns(BiasedGradientWarning, match=match):
        kl_penalized_token_rewards(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            [1.0],
            torch.ones(1, 2),
            kl_coef=0.1,
            estimator=estimator,  # type: ignore[arg-type]
            log_ratio_bound=bound,
        )


def test_token_rewards_k1_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kl_penalized_token_rewards(
            torch.zeros(1, 2), torch.zeros(1, 2), [1.0], torch.ones(1, 2), kl_coef=0.1
        )


def test_biased_gradient_warning_is_a_user_warning() -> None:
    assert issubclass(BiasedGradientWarning, UserWarning)


# ------------------------------------------------- importance weights (TRL use_bias_correction_kl)


def test_kl_loss_importance_weights_trl_bias_correction_golden(backend: str) -> None:
    # TRL golden batch: per_token_kl = k3 * coef_1 with coef_1 = exp(logp - old) (not detached).
    # k3 = e^{-d} + d - 1, d = logp - ref: row 1 [0.0187308, 0.0214028, 0], row 2 [0.0187308,
    # 0.0214028]; times r = [[1.3498588, 0.9048374, 1], [0.6703200, 1.1051709]]: [[0.0252838,
    # 0.0193661, 0], [0.0125556, 0.0236537]]; TRL's logged kl (dapo, N = 5) = 0.0161718387.
    # (On the kernels, float32: the differentiable weights take PyTorch, the constant ones not.)
    dtype = dtype_for(backend)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], dtype=dtype)
    old = logp - torch.tensor([[0.3, -0.1, 0.0], [-0.4, 0.1, 0.7]], dtype=dtype)
    ref = torch.tensor([[-1.2, -1.8, -0.5], [-0.9, -1.0, -2.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    logp.requires_grad_(True)
    ratio = torch.exp(logp - old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the differentiable ratio makes k3 unbiased: no warning
        loss = kl_loss(logp, ref, mask, importance_weights=ratio)
    assert_close(loss, 0.0161718387)
    # d(r k3)/dl = r k3 + r (1 - e^{-d}) = r d: row 1 [1.3498588*0.2, 0.9048374*(-0.2), 0]/5
    (grad,) = torch.autograd.grad(loss, logp)
    r = ratio.detach()
    d = (logp - ref).detach()
    assert_close(grad, torch.where(mask, r * d / 5, 0.0))
    assert_close(grad[0, 0], 1.3498588075760032 * 0.2 / 5)
    # constant weights only rescale: the gradient is r (1 - e^{-d}) / 5
    with pytest.warns(BiasedGradientWarning, match="biased gradient"):
        constant = kl_loss(logp, ref, mask, importance_weights=ratio.detach())
    (grad,) = torch.autograd.grad(constant, logp)
    assert_close(constant, 0.0161718387)
    assert_close(grad, torch.where(mask, r * -torch.expm1(-d) / 5, 0.0))


@FIXTURE_HEALTH
@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    estimator=st.sampled_from(ESTIMATORS),
    reduction=st.sampled_from(REDUCTIONS),
    weight_shape=st.sampled_from(["BT", "B1", "B"]),
    differentiable=st.booleans(),
)
def test_kl_loss_importance_weights_match_reference(
    backend: str,
    shape: tuple[int, int],
    seed: int,
    estimator: str,
    reduction: str,
    weight_shape: str,
    differentiable: bool,
) -> None:
    dtype = dtype_for(backend)
    log_probs, ref_log_probs, mask = _inputs(seed, *shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    weights = (torch.rand(shape, generator=generator, dtype=torch.float64) * 2).to(dtype)
    weights = {"BT": weights, "B1": weights[:, :1], "B": weights[:, 0]}[weight_shape]
    log_probs.requires_grad_(True)
    weights = weights.detach().requires_grad_(differentiable)
    poisoned = torch.where(mask, weights, float("nan")) if weight_shape == "BT" else weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        loss = kl_loss(
            log_probs,
            ref_log_probs,
            mask,
            estimator=estimator,  # type: ignore[arg-type]
            reduction=reduction,
            importance_weights=poisoned,
        )
    leaves = [x.detach().double().requires_grad_(x.requires_grad) for x in (log_probs, weights)]
    expected = reference.kl_loss(
        leaves[0],
        ref_log_probs.double(),
        mask,
        estimator=estimator,
        reduction=reduction,
        importance_weights=leaves[1],
    )
    assert_close(loss, expected)
    inputs = [log_probs, weights] if differentiable else [log_probs]
    wanted = _grads(expected, *leaves[: len(inputs)])
    for got, want in zip(_grads(loss, *inputs), wanted, strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, want)


@pytest.mark.parametrize(
    ("estimator", "straight_through", "warns"),
    [("k3", False, False), ("k1", False, False), ("k2", False, True), ("k3", True, True)],
)
def test_kl_loss_differentiable_weights_warnings(
    estimator: str, straight_through: bool, warns: bool
) -> None:
    weights = torch.ones(1, 2, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kl_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 2),
            estimator=estimator,  # type: ignore[arg-type]
            straight_through=straight_through,
            importance_weights=weights,
        )
    found = [w for w in record if issubclass(w.category, BiasedGradientWarning)]
    assert bool(found) == warns
    if warns:
        assert "differentiable importance_weights" in str(found[0].message)
        assert found[0].filename == __file__


def test_kl_loss_importance_weights_errors() -> None:
    zeros = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"importance_weights must have shape \(B,\), \(B, 1\)"):
        kl_loss(zeros, zeros, torch.ones(2, 3), estimator="k2", importance_weights=torch.ones(3))
    with pytest.raises(TypeError, match=r"importance_weights must contain only numbers"):
        kl_loss(zeros, zeros, torch.ones(2, 3), estimator="k2", importance_weights=[["x"]])


# --------------------------------------------------------------------------- errors


def test_errors() -> None:
    zeros = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"estimator must be one of \['k1', 'k2', 'k3', 'abs'\], got 'k4'"
    ):
        kl_estimate(zeros, zeros, mask, estimator="k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ref_log_probs must have the same shape as log_probs"):
        kl_estimate(zeros, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match=r"mask must have the same shape as log_probs \(2, 3\)"):
        kl_loss(zeros, zeros, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"log_probs must have shape \(B, T\)"):
        kl_estimate(torch.zeros(2, 3, 4), zeros, mask)
    with pytest.raises(TypeError, match=r"straight_through must be a bool, got int"):
        kl_estimate(zeros, zeros, mask, straight_through=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"log_ratio_bound must be > 0.0, got 0.0"):
        kl_estimate(zeros, zeros, mask, log_ratio_bound=0.0)
    with pytest.raises(ValueError, match=r"reduction must be one of"):
        kl_loss(zeros, zeros, mask, estimator="k2", reduction="mean")
    with pytest.raises(ValueError, match=r"normalizer must be > 0.0, got -1.0"):
        kl_loss(zeros, zeros, mask, estimator="k2", normalizer=-1.0)
    with pytest.raises(ValueError, match=r"scores must have shape \(B,\) = \(2,\) or \(B, 1\)"):
        kl_penalized_token_rewards(zeros, zeros, [1.0, 2.0, 3.0], mask, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl_coef must be >= 0.0, got -0.1"):
        kl_penalized_token_rewards(zeros, zeros, [1.0, 2.0], mask, kl_coef=-0.1)
    with pytest.raises(ValueError, match=r"kl_coef must be finite, got nan"):
        kl_penalized_token_rewards(zeros, zeros, [1.0, 2.0], mask, kl_coef=float("nan"))
    with pytest.raises(TypeError, match=r"log_probs must contain only numbers or bools"):
        kl_estimate([["a"]], [[0.0]], [[1]])


# --------------------------------------------------------------------------- compile


@pytest.mark.compile
def test_kl_loss_under_torch_compile() -> None:
    log_probs, ref_log_probs, mask = _inputs(11, 3, 5, dtype=torch.float32)
    log_probs[~mask] = float("nan")

    def step(lp: torch.Tensor) -> torch.Tensor:
        # k3 without straight_through: the eager call warns, the compiled one must not break
        # the full graph on warnings.warn.
        biased = kl_loss(lp, ref_log_probs, mask, estimator="k3")
        return biased + kl_loss(lp, ref_log_probs, mask, estimator="k3", straight_through=True)

    compiled = torch.compile(step, fullgraph=True)
    eager_input = log_probs.clone().requires_grad_(True)
    compiled_input = log_probs.clone().requires_grad_(True)
    with pytest.warns(BiasedGradientWarning):
        eager = step(eager_input)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BiasedGradientWarning)
        got = compiled(compiled_input)
    assert_close(got, eager)
    eager.backward()
    got.backward()
    assert compiled_input.grad is not None and eager_input.grad is not None
    assert_close(compiled_input.grad, eager_input.grad)
