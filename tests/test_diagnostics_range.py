"""Every diagnostic is finite and correct wherever its inputs are finite (issue 27).

Inputs of every magnitude from 1e-30 to 1e30 (float16: the magnitudes it holds, 1e-4 to 1e4),
per input dtype: the diagnostics (explained variance, whitened values, ratio means, the KL
estimates, the rollout metrics) equal the float64 reference on the same (rounded) inputs at the
tolerance of their computation dtype, and are finite wherever that reference is finite and
representable there. A float32 intermediate square of a value above ~1.8e19 overflows, one
below ~1e-19 underflows: the library rescales instead, so that neither makes a finite quantity
inf, NaN or wrong.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from tolerances import tolerance

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# Decimal exponents of the magnitudes per input dtype (float16 holds 6e-5 to 65504).
EXPONENTS = {torch.float16: (-4, 4)}
B, T = 3, 4


def _computation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exponent(dtype: torch.dtype) -> st.SearchStrategy[int]:
    low, high = EXPONENTS.get(dtype, (-30, 30))
    return st.integers(low, high)


class Draw:
    """Random inputs of one example, rounded to ``dtype`` (their float64 values for references)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def normal(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(shape, generator=self.generator, dtype=torch.float64) * scale
        return values.to(self.dtype)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        values = torch.rand(shape, generator=self.generator, dtype=torch.float64)
        return (low + (high - low) * values).to(self.dtype)

    def mask(self) -> torch.Tensor:
        mask = torch.rand((B, T), generator=self.generator) < 0.75
        mask[0, :2] = True  # at least two selected tokens
        return mask


def _check(
    actual: torch.Tensor, expected: Any, dtype: torch.dtype, what: str, magnitude: float = 0.0
) -> None:
    """``actual`` equals the float64 ``expected`` wherever that is finite and representable in
    the computation dtype, and is finite there.

    ``magnitude``: the size of the terms the value is a sum or difference of; the absolute
    tolerance covers their rounding (a few units in the last place of ``magnitude``), which a
    cancellation leaves in any float32 result.
    """
    computation = _computation(dtype)
    if actual.dtype in (torch.bfloat16, torch.float16):  # a result rounded to its input dtype
        computation = actual.dtype
    expected_t = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    actual_t = actual.detach().to(torch.float64)
    representable = torch.isfinite(expected_t) & (expected_t.abs() < torch.finfo(computation).max)
    assert torch.isfinite(actual_t[representable]).all(), f"{what}: {actual_t} vs {expected_t}"
    rtol, atol = tolerance(computation).values()
    atol = max(atol, 8 * torch.finfo(computation).eps * magnitude)
    torch.testing.assert_close(
        actual_t[representable],
        expected_t[representable],
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what} ({dtype}): {m}",
    )


COMMON = settings(max_examples=25)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@COMMON
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_value_loss_diagnostics(dtype: torch.dtype, data: st.DataObject, seed: int) -> None:
    scale = 10.0 ** data.draw(_exponent(dtype))
    relative = 10.0 ** data.draw(st.integers(-3, 1))  # the critic's error relative to R
    draw = Draw(seed, dtype)
    returns = draw.normal(B, T, scale=scale)
    values = (returns.double() + draw.normal(B, T, scale=scale * relative).double()).to(dtype)
    # The rollout values near the returns too, so that the clip binds at every magnitude.
    old_values = (returns.double() + draw.normal(B, T, scale=scale * relative).double()).to(dtype)
    mask = draw.mask()
    out = rlo.value_loss(values, old_values, returns, mask, clip=0.2)
    expected = reference.value_loss_diagnostics(
        values.double(), old_values.double(), returns.double(), mask, clip=0.2
    )
    for name in ("explained_variance", "clip_fraction"):
        _check(getattr(out.diagnostics, name), expected[name], dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@COMMON
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_whitening(dtype: torch.dtype, data: st.DataObject, seed: int) -> None:
    scale = 10.0 ** data.draw(_exponent(dtype))
    draw = Draw(seed, dtype)
    values, mask = draw.normal(B, T, scale=scale), draw.mask()
    shift = data.draw(st.booleans())
    for unbiased in (True, False):
        out = rlo.masked_whiten(values, mask, shift_mean=shift, unbiased=unbiased)
        expected = reference.masked_whiten(
            values.double(), mask, shift_mean=shift, unbiased=unbiased
        )
        _check(out, expected, dtype, f"masked_whiten(unbiased={unbiased})")
        out = rlo.global_masked_whiten(values, mask, shift_mean=shift, unbiased=unbiased)
        _check(out, expected, dtype, f"global_masked_whiten(unbiased={unbiased})")
    rewards = draw.normal(6, scale=scale)
    out = rlo.group_relative_advantages(rewards, group_size=3)
    expected = reference.group_relative_advantages(rewards.double(), 3)
    _check(out, expected, dtype, "group_relative_advantages")
    returns = rlo.gae(values, values, mask, gamma=0.9, lam=0.8, whiten=True).advantages
    raw = reference.gae(values.double(), values.double(), mask, gamma=0.9, lam=0.8)[0]
    _check(returns, reference.masked_whiten(raw, mask), dtype, "gae(whiten=True)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@COMMON
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_policy_loss_diagnostics(dtype: torch.dtype, data: st.DataObject, seed: int) -> None:
    # Log-probabilities and advantages of any magnitude; ratio means, k1/k3 and the weight mean.
    log_exponent = data.draw(_exponent(dtype))
    log_scale, advantage_scale = 10.0**log_exponent, 10.0 ** data.draw(_exponent(dtype))
    surrogate = data.draw(st.sampled_from(["clip", "cispo", "sapo", "gmpo", "vespo"]))
    # Without the bound, ratios of log-ratios beyond ~88 are not finite in float32 (nor is
    # their mean): unbounded only for log-probabilities up to 10.
    unbounded = surrogate != "vespo" and log_exponent <= 1 and data.draw(st.booleans())
    bound = None if unbounded else 20.0
    draw = Draw(seed, dtype)
    log_probs = -draw.uniform(B, T, low=0.0, high=log_scale)
    old_log_probs = -draw.uniform(B, T, low=0.0, high=log_scale)
    advantages = draw.normal(B, scale=advantage_scale)
    mask = draw.mask()
    options: dict[str, Any] = {"surrogate": surrogate, "log_ratio_bound": bound}
    out = rlo.policy_loss(log_probs, old_log_probs, advantages, mask, **options)
    expected = reference.policy_loss_diagnostics(
        log_probs.double(), old_log_probs.double(), advantages.double(), mask, **options
    )
    for name, value in out.diagnostics._asdict().items():
        _check(value, expected[name], dtype, f"{surrogate} {name}", magnitude=log_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@COMMON
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_rollout_metrics(dtype: torch.dtype, data: st.DataObject, seed: int) -> None:
    scale = 10.0 ** data.draw(_exponent(dtype))
    level = data.draw(st.sampled_from(["token", "sequence", "geometric"]))
    mode = data.draw(st.sampled_from(["truncate", "mask", "reject"]))
    upper = data.draw(st.sampled_from([2.0, None])) if mode == "truncate" else 2.0
    draw = Draw(seed, dtype)
    log_probs = -draw.uniform(B, T, low=0.0, high=scale)
    rollout_log_probs = -draw.uniform(B, T, low=0.0, high=scale)
    mask = draw.mask()
    options: dict[str, Any] = {"level": level, "mode": mode, "upper": upper, "lower": 0.5}
    out = rlo.rollout_correction(log_probs, rollout_log_probs, mask, **options)
    expected = reference.rollout_correction(
        log_probs.double(), rollout_log_probs.double(), mask, **options
    )
    metrics = expected["metrics"]
    assert isinstance(metrics, dict)
    for name, value in out.metrics.summary().items():
        _check(value, metrics[name], dtype, f"{level}/{mode} {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@COMMON
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_kl_diagnostics(dtype: torch.dtype, data: st.DataObject, seed: int) -> None:
    scale = 10.0 ** data.draw(_exponent(dtype))
    draw = Draw(seed, dtype)
    log_probs = -draw.uniform(B, T, low=0.0, high=scale)
    ref_log_probs = -draw.uniform(B, T, low=0.0, high=scale)
    rewards, mask = draw.normal(B, scale=scale), draw.mask()
    out = rlo.kl_penalized_rewards(log_probs, ref_log_probs, rewards, mask, 0.1)
    expected = reference.kl_penalized_rewards(
        log_probs.double(), ref_log_probs.double(), rewards.double(), mask, 0.1
    )
    for name in ("sampled_divergences", "penalized_rewards", "objective"):
        _check(out[name], expected[name], dtype, name, magnitude=T * scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
        for estimator in ("k1", "k2", "k3"):
            actual = rlo.kl_loss(log_probs, ref_log_probs, mask, estimator=estimator)
            expected_loss = reference.kl_loss(
                log_probs.double(), ref_log_probs.double(), mask, estimator=estimator
            )
            _check(actual, expected_loss, dtype, f"kl_loss {estimator}", magnitude=scale)
