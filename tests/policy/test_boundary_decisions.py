"""Decisions at the clip boundary: the same tokens on every path, by the rule (issue 26).

A sweep of log-ratios at and one ulp around every bound of every deciding surrogate (clip band,
clip-higher, dual clip and its tie, delta, CISPO cap and band, SAPO's soft-clip count), for
float32, bfloat16 and float64 inputs, on the autograd specification, the fused PyTorch path and
the Triton kernels (through the interpreter, one launch per case). The sweep and the expected
decisions are ``tests/boundary_cases.py``'s (the rule's definition, an independent mpmath
oracle); ``benchmarks/gpu_triton_checks.py`` runs the same sweep on a GPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from backends import requires_triton
from boundary_cases import (
    CASES,
    COUNTS,
    boundary_batch,
    dppo_exact_kept,
    dppo_sweep,
    expected_totals,
    sweep_points,
)
from reference import rule_compare
from rlobjectives import DPPO, Clip, grpo_clipped_surrogate, policy_loss
from rlobjectives._core.backend import use_backend
from rlobjectives.policy.surrogates import Surrogate

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _step(value: float, dtype: torch.dtype, direction: float) -> float:
    here = torch.tensor(value, dtype=dtype)
    return float(torch.nextafter(here, torch.tensor(direction, dtype=dtype)))


def _run(path: str, surrogate: Surrogate, batch: tuple[torch.Tensor, ...]) -> Any:
    leaf = batch[0].clone().requires_grad_(True)
    function = policy_loss if path == "autograd" else policy_loss
    with use_backend("triton" if path == "triton" else "torch"):
        out = function(leaf, *batch[1:], surrogate=surrogate)
        (gradient,) = torch.autograd.grad(out.loss, leaf)
    return out, gradient


PATHS = ["autograd", "fused", pytest.param("triton", marks=[requires_triton, pytest.mark.kernels])]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_sweep_gives_the_rules_decisions(case: str, input_dtype: torch.dtype, path: str) -> None:
    if path == "triton" and input_dtype == torch.float64:
        pytest.skip("float64 always takes the PyTorch path")
    surrogate = CASES[case]
    points = sweep_points(surrogate, input_dtype)
    batch = boundary_batch(points, input_dtype)
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    out, gradient = _run(path, surrogate, batch)
    counts, factors = expected_totals(surrogate, points, dtype)
    selected = 2 * len(points)
    for name, count in zip(COUNTS, counts, strict=True):
        assert round(float(getattr(out.diagnostics, name)) * selected) == count, name
    if factors[0] is None:
        return
    # d loss / d l = -A r factor / n (token mean): the factor, from the path's own ratio
    x = batch[0].to(dtype)
    ratio = torch.exp(x)
    signs = torch.tensor([[1.0], [-1.0]], dtype=dtype)
    observed = (-gradient.to(dtype) * selected / (signs * ratio)).reshape(-1)
    want = torch.tensor(factors, dtype=dtype)
    assert torch.equal(observed == 0, want == 0)
    tolerance = 1e-2 if input_dtype == torch.bfloat16 else 1e-6  # the gradient's own dtype
    torch.testing.assert_close(observed, want, rtol=tolerance, atol=0.0)


def _tensor_fields(clip: Clip, requires_grad: bool) -> Clip:
    """The same ``Clip`` with 0-d float64 tensor fields (a schedule, or learnable)."""
    fields = {
        name: None
        if getattr(clip, name) is None
        else torch.tensor(
            float(getattr(clip, name)), dtype=torch.float64, requires_grad=requires_grad
        )
        for name in ("low", "high", "dual", "delta")
    }
    return Clip(**fields)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["schedule", "learnable"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["clip_higher", "dual", "delta"])
def test_tensor_bounds_decide_as_numbers(
    case: str, input_dtype: torch.dtype, requires_grad: bool
) -> None:
    # 0-d tensor fields take the device method (a schedule: the fused path; a learnable one:
    # the autograd path); at these bounds it gives the host's exact thresholds.
    number = CASES[case]
    assert isinstance(number, Clip)
    batch = boundary_batch(sweep_points(number, input_dtype), input_dtype)
    reference_out, reference_gradient = _run("fused", number, batch)
    out, gradient = _run("fused", _tensor_fields(number, requires_grad), batch)
    for name in COUNTS:
        assert torch.equal(getattr(out.diagnostics, name), getattr(reference_out.diagnostics, name))
    assert torch.equal(gradient == 0, reference_gradient == 0)
    torch.testing.assert_close(gradient, reference_gradient)


def test_tensor_bounds_in_float64_use_the_documented_fallback() -> None:
    # float64 with a tensor bound: x > ln B and x < ln B with torch.log's float64 ln B.
    edge = torch.tensor(1.2, dtype=torch.float64)
    threshold = float(torch.log(edge))
    points = [
        _step(threshold, torch.float64, -math.inf),
        threshold,
        _step(threshold, torch.float64, math.inf),
    ]
    batch = boundary_batch(points, torch.float64)
    out, _ = _run("fused", Clip(low=torch.tensor(0.2, dtype=torch.float64), high=edge - 1.0), batch)
    # above 1.2 for A = +1: the point beyond ln B only
    assert round(float(out.diagnostics.clip_fraction_high) * 6) == 1


@pytest.mark.parametrize(
    "backend_name", ["torch", pytest.param("triton", marks=[requires_triton, pytest.mark.kernels])]
)
def test_seed_surrogate_sweep(backend_name: str) -> None:
    # grpo_clipped_surrogate's clipped_fraction: strictly outside [1 - eps, 1 + eps] by the rule
    surrogate = CASES["band"]
    points = sweep_points(surrogate, torch.float32)
    log_probs, old, _, mask = boundary_batch(points, torch.float32)
    with use_backend(backend_name):
        out = grpo_clipped_surrogate(log_probs, old, torch.tensor([1.0, -1.0]), mask, 0.2)
    outside = sum(
        rule_compare(x, 0.8, torch.float32) < 0 or rule_compare(x, 1.2, torch.float32) > 0
        for x in points
    )
    assert round(float(out["clipped_fraction"]) * 2 * len(points)) == 2 * outside


def test_compiled_tensor_bounds_decide_as_eager() -> None:
    # torch.compile(fullgraph=True) traces the device thresholds of 0-d tensor bounds
    clip = _tensor_fields(CASES["dual"], requires_grad=False)  # type: ignore[arg-type]
    log_probs, old, advantages, mask = boundary_batch(
        sweep_points(CASES["dual"], torch.float32), torch.float32
    )

    def loss(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = policy_loss(x, old, advantages, mask, surrogate=clip)
        return out.loss, out.diagnostics.dual_clip_fraction

    compiled = torch.compile(loss, fullgraph=True, dynamic=False)
    leaves = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    (value, fraction), (eager_value, eager_fraction) = compiled(leaves[0]), loss(leaves[1])
    (value + 0 * fraction).backward()
    eager_value.backward()
    assert torch.equal(fraction, eager_fraction)
    assert leaves[0].grad is not None and leaves[1].grad is not None
    assert torch.equal(leaves[0].grad == 0, leaves[1].grad == 0)
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad)


# Cross-backend and hidden-state checks: kept to the cases whose gradient takes a decision
# (Clip) plus one CISPO and one SAPO case for the diagnostics, one launch each.
CROSS_CASES = ["band", "dual", "delta", "vanilla_delta_dual", "cispo_band", "sapo"]


@requires_triton
@pytest.mark.kernels
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CROSS_CASES)
def test_torch_and_triton_agree_on_the_sweep(case: str, input_dtype: torch.dtype) -> None:
    # The same diagnostics, bit for bit, and the same gradient support (values within the
    # rounding of exp, which differs between torch and the interpreter's NumPy): no decision
    # depends on the backend.
    surrogate = CASES[case]
    batch = boundary_batch(sweep_points(surrogate, input_dtype), input_dtype)
    torch_out, torch_gradient = _run("fused", surrogate, batch)
    triton_out, triton_gradient = _run("triton", surrogate, batch)
    for name in COUNTS:
        assert torch.equal(
            getattr(torch_out.diagnostics, name), getattr(triton_out.diagnostics, name)
        )
    assert torch.equal(torch_gradient == 0, triton_gradient == 0)
    tolerance = 1e-2 if input_dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(triton_gradient, torch_gradient, rtol=tolerance, atol=0.0)


# The hidden-state path: logits (80, 0) make the sampled token's log-probability exactly 0 on
# every backend (log-sum-exp = 80 + log(1 + e^-80) = 80 in float32), so the log-ratio is
# exactly -old = the sweep point; p_1 = e^-80 ~ 1.8e-35 (a normal float32) carries the
# per-token coefficient c into the hidden gradient: d loss / d h_1 = -c p_1.
_LOGIT = 80.0


def _hidden_batch(
    points: list[float], input_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    count = len(points)
    hidden = torch.zeros(2, count, 2, dtype=input_dtype)
    hidden[..., 0] = 1.0
    weight = torch.tensor([[_LOGIT, 0.0], [0.0, 1.0]], dtype=input_dtype)
    tokens = torch.zeros(2, count, dtype=torch.long)
    old = -torch.tensor([points, points], dtype=torch.float64).to(input_dtype)
    return hidden, weight, tokens, old, torch.tensor([1.0, -1.0], dtype=input_dtype)


HIDDEN_BACKENDS = ["torch", pytest.param("triton", marks=[requires_triton, pytest.mark.kernels])]


@pytest.mark.parametrize("backend_name", HIDDEN_BACKENDS)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["dual", "delta", "cispo_cap", "sapo"])
def test_hidden_state_path_gives_the_rules_decisions(
    case: str, input_dtype: torch.dtype, backend_name: str
) -> None:
    from rlobjectives.policy.from_hidden import fused_policy_loss_from_hidden

    surrogate = CASES[case]
    points = sweep_points(surrogate, input_dtype)
    hidden, weight, tokens, old, advantages = _hidden_batch(points, input_dtype)
    leaf = hidden.clone().requires_grad_(True)
    mask = torch.ones(tokens.shape, dtype=torch.bool)
    with use_backend(backend_name):
        out = fused_policy_loss_from_hidden(
            leaf, weight, tokens, old, advantages, mask, surrogate=surrogate
        )
        (gradient,) = torch.autograd.grad(out.loss, leaf)
    counts, factors = expected_totals(surrogate, points, torch.float32)
    selected = 2 * len(points)
    for name, count in zip(COUNTS, counts, strict=True):
        assert round(float(getattr(out.diagnostics, name)) * selected) == count, name
    if factors[0] is None:
        return
    # c = -A r factor / n, and d loss / d h_1 = -c p_1 = A r factor p_1 / n
    x = -old.float()
    scale = torch.tensor([[1.0], [-1.0]]) * torch.exp(x) * math.exp(-_LOGIT) / selected
    observed = (gradient[..., 1].float() / scale).reshape(-1)
    want = torch.tensor(factors, dtype=torch.float32)
    assert torch.equal(observed == 0, want == 0)
    tolerance = 2e-2 if input_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(observed, want, rtol=tolerance, atol=0.0)


# DPPO: the trust region evaluated in float64, then decided (docs/conventions.md, "Decisions
# at a bound"); the expected decision is the exact one (tests/boundary_cases.py's mpmath).
DPPO_CASES = {"tv": DPPO("tv"), "kl": DPPO("kl", ratio_cap=None)}


@functools.cache  # each case and dtype: one mpmath sweep
def _dppo_batch(case: str, input_dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], list[bool]]:
    surrogate = DPPO_CASES[case]
    positive_logs, positive_olds, negative_logs, negative_olds = dppo_sweep(surrogate, input_dtype)
    log_probs = torch.tensor([positive_logs, negative_logs], dtype=torch.float64).to(input_dtype)
    old = torch.tensor([positive_olds, negative_olds], dtype=torch.float64).to(input_dtype)
    pairs = zip(positive_logs, positive_olds, strict=True)
    kept = [dppo_exact_kept(surrogate, lp, lo, 1) for lp, lo in pairs]
    pairs = zip(negative_logs, negative_olds, strict=True)
    kept += [dppo_exact_kept(surrogate, lp, lo, -1) for lp, lo in pairs]
    advantages = torch.tensor([1.0, -1.0], dtype=input_dtype)
    return (log_probs, old, advantages, torch.ones(log_probs.shape, dtype=torch.bool)), kept


def test_dppo_sweep_brackets_the_region_where_float32_errs() -> None:
    # The sweep is not vacuous: both decisions on each row, and float32 evaluation of the
    # divergence (every peer's, the library's before the rule) is wrong at some of its pairs.
    from rlobjectives.kl.estimators import binary_kl

    for case, surrogate in DPPO_CASES.items():
        (log_probs, old, _, _), kept = _dppo_batch(case, torch.float32)
        want = torch.tensor(kept).reshape(2, -1)
        assert want.any(dim=1).all() and (~want).any(dim=1).all()
        delta = torch.tensor([[surrogate.high], [-surrogate.low]], dtype=torch.float32)  # type: ignore[list-item]
        if case == "tv":
            moved = torch.exp(log_probs) - torch.exp(old)
            single = torch.where(delta > 0, moved <= delta, moved >= delta)
        else:
            divergence = binary_kl(log_probs, old)
            along = torch.where(delta > 0, log_probs <= old, log_probs >= old)
            single = (divergence <= delta.abs()) | along
        assert not torch.equal(single, want), case


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DPPO_CASES))
def test_dppo_trust_region_is_the_exact_decision(
    case: str, input_dtype: torch.dtype, path: str
) -> None:
    batch, kept = _dppo_batch(case, input_dtype)
    out, gradient = _run(path, DPPO_CASES[case], batch)
    want = torch.tensor(kept)
    assert torch.equal(gradient.reshape(-1) != 0, want), (case, path)
    selected = want.numel()
    outside = (~want).reshape(2, -1)
    assert round(float(out.diagnostics.clipped_fraction) * selected) == int(outside.sum())
    assert round(float(out.diagnostics.clip_fraction_high) * selected) == int(outside[0].sum())
    assert round(float(out.diagnostics.clip_fraction_low) * selected) == int(outside[1].sum())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_dppo_cap_count_follows_the_rule(input_dtype: torch.dtype, path: str) -> None:
    # l = 0, l_old = -x: the log-ratio is exactly x. Row A = -1 keeps every token (p - p_old
    # >= 0 > -0.2), so the cap count r > 3 is the rule's, at and one ulp around t+-(3).
    if path == "triton" and input_dtype == torch.float64:
        pytest.skip("float64 always takes the PyTorch path")
    surrogate = DPPO("tv", ratio_cap=3.0)
    points = sweep_points(Clip(low=None, delta=3.0), input_dtype)
    log_probs = torch.zeros(2, len(points), dtype=input_dtype)
    old = -torch.tensor([points, points], dtype=torch.float64).to(input_dtype)
    advantages = torch.tensor([1.0, -1.0], dtype=input_dtype)
    mask = torch.ones(log_probs.shape, dtype=torch.bool)
    out, _ = _run(path, surrogate, (log_probs, old, advantages, mask))
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    above = sum(rule_compare(x, 3.0, dtype) > 0 for x in points)
    assert 0 < above < len(points)
    assert round(float(out.diagnostics.dual_clip_fraction) * 2 * len(points)) == above


@pytest.mark.parametrize("path", ["autograd", "fused"])
def test_dppo_float64_compares_with_the_float64_threshold(path: str) -> None:
    # float64 inputs: delta = 0.2 rounded to float64, not to float32 (0.20000000298...). p_old
    # = 0.3, p = 0.5 + 1.5e-9: p - p_old = 0.2000000015 is above float64's 0.2 (A > 0: outside)
    # and below float32's (kept if delta were rounded to float32).
    log_probs = torch.tensor([[math.log(0.5 + 1.5e-9)]], dtype=torch.float64)
    old = torch.tensor([[math.log(0.3)]], dtype=torch.float64)
    batch = (log_probs, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    out, gradient = _run(path, DPPO("tv"), batch)
    assert float(gradient) == 0.0 and float(out.diagnostics.clip_fraction_high) == 1.0
