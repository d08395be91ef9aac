"""Tests of value_loss: the clipped PPO critic loss (verl compute_value_loss, OpenRLHF)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import ValueLossDiagnostics, ValueLossOutput, aggregate, value_loss
from tolerances import assert_close

NAN = float("nan")
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "none")


def test_golden_verl_formula() -> None:
    # clip 0.2; V, V_old, R and 1/2 max((V-R)^2, (clip(V, V_old +- 0.2) - R)^2):
    # (0,0): V 1.0, old 0.0, R 2.0: clip(V) = 0.2; (1-2)^2 = 1, (0.2-2)^2 = 3.24 -> 1.62 (binds)
    # (0,1): V 0.5, old 0.4, R 0.0: clip(V) = 0.5 (inside); 0.25 -> 0.125
    # (0,2): masked (NaN everywhere)
    # (1,0): V -1.0, old 0.0, R 0.5: clip(V) = -0.2; (-1.5)^2 = 2.25, (-0.7)^2 = 0.49 -> 1.125
    # (1,1): V 3.0, old 2.0, R 3.0: clip(V) = 2.2; 0, 0.64 -> 0.32 (binds)
    values = torch.tensor([[1.0, 0.5, NAN], [-1.0, 3.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.4, NAN], [0.0, 2.0, math.inf]])
    returns = torch.tensor([[2.0, 0.0, math.inf], [0.5, 3.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = value_loss(values, old, returns, mask, clip=0.2)
    assert isinstance(out, ValueLossOutput) and isinstance(out.diagnostics, ValueLossDiagnostics)
    per_token = [[1.62, 0.125, 0.0], [1.125, 0.32, 0.0]]
    assert_close(out.per_token_loss, per_token)
    # token mean: (1.62 + 0.125 + 1.125 + 0.32) / 4 = 0.7975
    assert_close(out.loss, 0.7975)
    # 2 of 4 tokens bind (the clipped term is strictly larger)
    assert_close(out.diagnostics.clip_fraction, 0.5)
    # gradient: binding tokens 0; others (V - R) / N: (0,1) 0.5/4, (1,0) -1.5/4
    (grad,) = torch.autograd.grad(out.loss, values)
    assert_close(grad, [[0.0, 0.125, 0.0], [-0.375, 0.0, 0.0]])
    # sequence mean: row 0 (1.62 + 0.125)/2 = 0.8725, row 1 (1.125 + 0.32)/2 = 0.7225 -> 0.7975
    assert_close(value_loss(values, old, returns, mask, reduction="sequence_mean").loss, 0.7975)
    # clip=None: 1/2 (V-R)^2 = [0.5, 0.125, 1.125, 0] -> 1.75 / 4 = 0.4375, no clip fraction
    unclipped = value_loss(values, old, returns, mask, clip=None)
    assert_close(unclipped.loss, 0.4375)
    assert float(unclipped.diagnostics.clip_fraction) == 0.0


def test_golden_explained_variance() -> None:
    # R = [1, 2, 3, 4], V = [1, 2, 2, 5]: R - V = [0, 0, 1, -1], Var = 2/3 (unbiased);
    # Var(R) = 5/3; EV = 1 - (2/3) / (5/3 + 1e-5) = 0.6000024 (verl critic/vf_explained_var)
    returns = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    values = torch.tensor([[1.0, 2.0], [2.0, 5.0]], dtype=torch.float64)
    out = value_loss(values, values, returns, torch.ones(2, 2))
    assert_close(out.diagnostics.explained_variance, 1 - (2 / 3) / (5 / 3 + 1e-5))
    # A perfect critic explains everything (up to the 1e-5)
    perfect = value_loss(returns, returns, returns, torch.ones(2, 2)).diagnostics
    assert_close(perfect.explained_variance, 1.0)


value_shapes = st.tuples(st.integers(1, 5), st.integers(1, 7))


@given(
    shape=value_shapes,
    seed=st.integers(0, 2**16),
    clip=st.sampled_from([0.2, 0.05, 0.0, None]),
    reduction=st.sampled_from(REDUCTIONS),
    explicit=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_matches_reference(
    shape: tuple[int, int],
    seed: int,
    clip: float | None,
    reduction: str,
    explicit: bool,
    dtype: torch.dtype,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    old = values + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    returns = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    normalizer = 7.0 if explicit and reduction != "none" else None
    constant = shape[1] + 2 if explicit else None
    dirty = torch.where(mask, values, NAN).to(dtype).requires_grad_(True)
    out = value_loss(
        dirty,
        torch.where(mask, old, math.inf).to(dtype),
        torch.where(mask, returns, NAN).to(dtype),
        mask,
        clip=clip,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=constant,
    )
    assert out.loss.dtype == dtype
    weights = torch.randn(shape, generator=generator, dtype=torch.float64)
    loss = (out.loss * weights.to(dtype)).sum() if reduction == "none" else out.loss
    (grad,) = torch.autograd.grad(loss, dirty) if loss.requires_grad else (torch.zeros_like(dirty),)
    clean = values.to(dtype).double().requires_grad_(True)
    old_r, returns_r = old.to(dtype).double(), returns.to(dtype).double()
    expected = reference.value_loss(
        clean,
        old_r,
        returns_r,
        mask,
        clip=clip,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=constant,
    )
    expected_loss = (expected * weights).sum() if reduction == "none" else expected
    expected_grad = torch.zeros_like(clean)
    if expected_loss.requires_grad:
        (expected_grad,) = torch.autograd.grad(expected_loss, clean)
    assert_close(out.loss, expected)
    assert torch.isfinite(grad).all() and bool((grad[~mask] == 0).all())
    assert_close(grad, expected_grad)
    diagnostics = reference.value_loss_diagnostics(
        values.to(dtype).double(), old_r, returns_r, mask, clip=clip
    )
    assert_close(out.diagnostics.clip_fraction, diagnostics["clip_fraction"])
    assert_close(out.diagnostics.explained_variance, diagnostics["explained_variance"])


def test_half_factor_and_aggregate_mapping() -> None:
    # verl: 0.5 * agg_loss(max(...)); here the same number through aggregate of the per-token
    # loss (the 1/2 is linear), for every reduction and an explicit normalizer.
    generator = torch.Generator().manual_seed(3)
    values, old, returns = (torch.randn(3, 5, generator=generator) for _ in range(3))
    mask = torch.rand(3, 5, generator=generator) < 0.6
    squared = torch.maximum(
        (values - returns) ** 2, (torch.clamp(values, old - 0.2, old + 0.2) - returns) ** 2
    )
    for reduction in REDUCTIONS[:3]:
        for normalizer in (None, 11):
            got = value_loss(values, old, returns, mask, reduction=reduction, normalizer=normalizer)
            want = 0.5 * aggregate(squared, mask, reduction=reduction, normalizer=normalizer)
            assert_close(got.loss, want)


def test_micro_batches_add_up_with_a_global_normalizer() -> None:
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    old, returns = (torch.randn(6, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(6, 4, generator=generator) < 0.7
    full = value_loss(values, old, returns, mask).loss
    tokens = int(mask.sum())
    pieces = [
        value_loss(values[rows], old[rows], returns[rows], mask[rows], normalizer=tokens).loss
        for rows in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    assert_close(sum(pieces), full)


def test_masking_empty_and_dtypes() -> None:
    empty = value_loss(
        torch.zeros(2, 3, requires_grad=True),
        torch.zeros(2, 3),
        torch.ones(2, 3),
        torch.zeros(2, 3),
    )
    assert float(empty.loss.detach()) == 0.0
    assert float(empty.diagnostics.clip_fraction) == 0.0
    assert float(empty.diagnostics.explained_variance) == 0.0
    assert (
        value_loss(
            torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0)
        ).loss.shape
        == ()
    )
    bf16 = torch.tensor([[0.3, 1.7, -2.1]], dtype=torch.bfloat16, requires_grad=True)
    out = value_loss(bf16, bf16.detach() - 0.5, torch.tensor([[1.0, 0.0, -1.0]]), torch.ones(1, 3))
    assert out.loss.dtype == torch.bfloat16 and out.per_token_loss.dtype == torch.float32
    expected = reference.value_loss(
        bf16.detach().double(),
        bf16.detach().double() - 0.5,
        torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64),
        torch.ones(1, 3),
    )
    assert_close(out.loss, expected)
    assert_close(out.per_token_loss.sum() / 3, expected, dtype=torch.float32)
    # gradients only into values: old values and returns are constants
    old = torch.zeros(1, 2, requires_grad=True)
    returns = torch.ones(1, 2, requires_grad=True)
    current = torch.tensor([[0.1, -0.1]], requires_grad=True)
    value_loss(current, old, returns, torch.ones(1, 2)).loss.backward()
    assert old.grad is None and returns.grad is None and current.grad is not None


def test_inputs_are_not_mutated() -> None:
    values = torch.tensor([[1.0, NAN]])
    old = torch.tensor([[0.0, math.inf]])
    before = values.clone(), old.clone()
    value_loss(values, old, torch.zeros(1, 2), torch.tensor([[1, 0]]))
    assert torch.equal(values.isnan(), before[0].isnan()) and torch.equal(old, before[1])


def test_errors() -> None:
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"old_values must have the same shape as values \(2, 3\)"):
        value_loss(zeros, torch.zeros(2, 4), zeros, mask)
    with pytest.raises(ValueError, match=r"returns must have the same shape as values"):
        value_loss(zeros, zeros, torch.zeros(3, 3), mask)
    with pytest.raises(ValueError, match=r"mask must have the same shape as values"):
        value_loss(zeros, zeros, zeros, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"values must have shape \(B, T\)"):
        value_loss(torch.zeros(3), zeros, zeros, mask)
    with pytest.raises(ValueError, match=r"clip must be >= 0.0, got -0.1"):
        value_loss(zeros, zeros, zeros, mask, clip=-0.1)
    with pytest.raises(ValueError, match=r"clip must be finite, got inf"):
        value_loss(zeros, zeros, zeros, mask, clip=math.inf)
    with pytest.raises(ValueError, match=r"reduction must be one of .*got 'mean'"):
        value_loss(zeros, zeros, zeros, mask, reduction="mean")
    with pytest.raises(ValueError, match=r"normalizer must be > 0"):
        value_loss(zeros, zeros, zeros, mask, normalizer=0)
    with pytest.raises(TypeError, match=r"returns must contain only numbers"):
        value_loss(zeros, zeros, [["a", "b", "c"]] * 2, mask)
