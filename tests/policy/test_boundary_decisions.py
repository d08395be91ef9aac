"""Decisions at the clip boundary: the same tokens on every path, by the rule (issue 26).

A sweep of log-ratios at and one ulp around every bound of every deciding surrogate (clip band,
clip-higher, dual clip and its tie, delta, CISPO cap and band, SAPO's soft-clip count), for
float32, bfloat16 and float64 inputs, on the autograd specification, the fused PyTorch path and
the Triton kernels (through the interpreter, one launch per case). The expected decisions come
from the rule's definition (``docs/conventions.md``, "Decisions at a bound"): a correctly
rounded ``exp`` in the computation dtype (an independent 300-bit mpmath oracle,
``tests/reference.py``) compared with the bound rounded to that dtype.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends import requires_triton
from reference import correctly_rounded_exp, rounded, rule_compare
from rlobjectives import CISPO, SAPO, Clip, grpo_clipped_surrogate, policy_loss
from rlobjectives._core.backend import use_kernels
from rlobjectives._core.decisions import lower_threshold, upper_threshold
from rlobjectives.policy.loss import _policy_loss_autograd
from rlobjectives.policy.surrogates import SurrogateObjective
from rlobjectives.policy.surrogates.sapo import SAPO_HALF_PEAK, soft_clip_ratios

CASES: dict[str, SurrogateObjective] = {
    "band": Clip(low=0.2),
    "clip_higher": Clip(low=0.2, high=0.28),
    "dual": Clip(low=0.2, dual=3.0),
    "delta": Clip(low=0.2, high=0.28, delta=1.1),  # delta below 1 + eps_high: both signs
    "vanilla_delta_dual": Clip(low=None, delta=1.5, dual=2.0),
    "cispo_cap": CISPO(cap=5.0),
    "cispo_band": CISPO(low=0.2, high=0.28),
    "sapo": SAPO(temperature_pos=1.0, temperature_neg=4.0),  # 4 > h: a low edge for A < 0
}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


# ------------------------------------------------------------------------ the rule's answer
def _clip_edges(clip: Clip, sign: int) -> tuple[float | None, float | None]:
    """``(L, H)`` of ``s = A clip(r, L, H)`` for the sign of ``A``, from the formula.

    ``s = min(min(r, delta) A, clip(r, 1 - eps_l, 1 + eps_h) A)``, then ``max(s, c A)`` for
    ``A < 0``: for ``A > 0``, ``s / A = min(r, delta, 1 + eps_h)`` (``H = min(delta, 1 +
    eps_h)``); for ``A < 0``, ``s / A = min(max(min(r, delta), clip(r)), c)``, i.e. ``L = 1 -
    eps_l`` and ``H = min(c, max(1 + eps_h, delta))`` (``delta`` alone without the band).
    """
    band = None
    if clip.low is not None:
        high = clip.low if clip.high is None else clip.high
        band = (1.0 - float(clip.low), 1.0 + float(high))
    delta = None if clip.delta is None else float(clip.delta)
    dual = None if clip.dual is None else float(clip.dual)
    if sign > 0:
        uppers = [v for v in (delta, None if band is None else band[1]) if v is not None]
        return None, min(uppers) if uppers else None
    lower = None if band is None else band[0]
    if band is not None and delta is not None:
        upper: float | None = max(band[1], delta)
    else:
        upper = delta  # (no cap of the A < 0 side by the band alone)
    if dual is not None:
        upper = dual if upper is None else min(dual, upper)
    return lower, upper


def _sapo_sets(x: float, sign: int, sapo: SAPO, dtype: torch.dtype) -> tuple[bool, bool]:
    """``(tau (r - 1) < -h, tau (r - 1) > h)`` at ``r = fl(e^x)``, in ``dtype``'s arithmetic."""
    tau = float(sapo.temperature_pos if sign > 0 else sapo.temperature_neg)
    ratio = torch.tensor(correctly_rounded_exp(x, dtype), dtype=dtype)
    scaled = float((ratio - 1.0) * torch.tensor(tau, dtype=dtype))
    half_peak = rounded(SAPO_HALF_PEAK, dtype)
    return scaled < -half_peak, scaled > half_peak


def expected(
    surrogate: SurrogateObjective, x: float, sign: int, dtype: torch.dtype
) -> tuple[tuple[bool, bool, bool, bool], float | None]:
    """The four diagnostic sets ``(out of band, low, high, dual)`` and the gradient factor.

    The factor multiplies ``r A`` in the gradient (1 passes, 0 clipped, 1/2 at the dual tie);
    None where the gradient takes no decision (CISPO, SAPO).
    """
    if isinstance(surrogate, Clip):
        lower, upper = _clip_edges(surrogate, sign)
        below = lower is not None and rule_compare(x, lower, dtype) < 0
        above = upper is not None and rule_compare(x, upper, dtype) > 0
        out = False
        if surrogate.low is not None:
            band_low, band_high = (
                _clip_edges(surrogate, -1)[0],
                1.0 + float(surrogate.low if surrogate.high is None else surrogate.high),
            )
            out = rule_compare(x, band_low, dtype) < 0 or rule_compare(x, band_high, dtype) > 0
        tie = (
            sign < 0
            and surrogate.dual is not None
            and not above
            and rule_compare(x, float(surrogate.dual), dtype) == 0
        )
        factor = 0.0 if below or above else (0.5 if tie else 1.0)
        return (out, below, above and sign > 0, above and sign < 0), factor
    if isinstance(surrogate, CISPO):
        if surrogate.cap is not None:
            low, high = None, float(surrogate.cap)
        else:
            eps_h = surrogate.low if surrogate.high is None else surrogate.high
            low, high = 1.0 - float(surrogate.low), 1.0 + float(eps_h)  # type: ignore[arg-type]
        below = low is not None and rule_compare(x, low, dtype) < 0
        above = rule_compare(x, high, dtype) > 0
        return (below or above, below and sign < 0, above and sign > 0, above and sign < 0), None
    assert isinstance(surrogate, SAPO)
    soft_low, soft_high = _sapo_sets(x, sign, surrogate, dtype)
    sets = (soft_low or soft_high, soft_low and sign < 0, soft_high and sign > 0)
    return (*sets, soft_high and sign < 0), None


# ------------------------------------------------------------------------------- the sweep
def _edges(surrogate: SurrogateObjective) -> list[tuple[float, bool]]:
    """Every bound the surrogate decides at, with its side (True: an upper edge)."""
    if isinstance(surrogate, Clip):
        edges = [(_clip_edges(surrogate, -1)[0], False), (_clip_edges(surrogate, 1)[1], True)]
        edges.append((_clip_edges(surrogate, -1)[1], True))
        if surrogate.low is not None:
            high = surrogate.low if surrogate.high is None else surrogate.high
            edges.append((1.0 + float(high), True))
        if surrogate.dual is not None:
            edges += [(float(surrogate.dual), False), (float(surrogate.dual), True)]
        return [(float(b), up) for b, up in edges if b is not None]
    if isinstance(surrogate, CISPO):
        if surrogate.cap is not None:
            return [(float(surrogate.cap), True)]
        eps_h = surrogate.low if surrogate.high is None else surrogate.high
        return [(1.0 - float(surrogate.low), False), (1.0 + float(eps_h), True)]  # type: ignore[arg-type]
    assert isinstance(surrogate, SAPO)
    edges = []
    for tau in (surrogate.temperature_pos, surrogate.temperature_neg):
        low, high = soft_clip_ratios(tau, torch.float32)
        edges += [(float(high), True)] + ([(float(low), False)] if float(low) > 0 else [])
    return edges


def _step(value: float, dtype: torch.dtype, direction: float) -> float:
    return float(
        torch.nextafter(torch.tensor(value, dtype=dtype), torch.tensor(direction, dtype=dtype))
    )


def sweep_points(surrogate: SurrogateObjective, input_dtype: torch.dtype) -> list[float]:
    """Log-ratios at, and one ulp either side of, each threshold; the nearest to log(bound).

    bfloat16 inputs: the bfloat16 numbers next to each point (below and above), so that the
    sweep still brackets every threshold on the coarser grid.
    """
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    points: set[float] = set()
    for bound, upper in _edges(surrogate):
        if isinstance(surrogate, SAPO) and dtype == torch.float64:
            bound = float(soft_clip_ratios_like(surrogate, bound))
        threshold = upper_threshold(bound, dtype) if upper else lower_threshold(bound, dtype)
        assert isinstance(threshold, float)
        points |= {threshold, _step(threshold, dtype, -math.inf), _step(threshold, dtype, math.inf)}
        points.add(rounded(math.log(bound), dtype))
    if input_dtype == torch.bfloat16:
        wide = torch.tensor(sorted(points), dtype=torch.float64)
        narrow = wide.to(torch.bfloat16)
        up = torch.nextafter(narrow, torch.tensor(math.inf, dtype=torch.bfloat16))
        down = torch.nextafter(narrow, torch.tensor(-math.inf, dtype=torch.bfloat16))
        points = {float(v) for v in torch.cat([narrow, up, down]).float()}
    return sorted(points)


def soft_clip_ratios_like(surrogate: SAPO, bound: float) -> float:
    """SAPO's float64 edge next to its float32 one (the float64 sweep needs its own edges)."""
    for tau in (surrogate.temperature_pos, surrogate.temperature_neg):
        low32, high32 = soft_clip_ratios(tau, torch.float32)
        low64, high64 = soft_clip_ratios(tau, torch.float64)
        if float(high32) == bound:
            return float(high64)
        if float(low32) == bound:
            return float(low64)
    raise AssertionError(bound)


def _batch(points: list[float], input_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Row 0: the points with A = +1; row 1: with A = -1 (old log-probs 0: x is the point)."""
    log_probs = torch.tensor([points, points], dtype=torch.float64).to(input_dtype)
    old = torch.zeros_like(log_probs)
    advantages = torch.tensor([1.0, -1.0], dtype=input_dtype)
    mask = torch.ones(log_probs.shape, dtype=torch.bool)
    return log_probs, old, advantages, mask


def _run(path: str, surrogate: SurrogateObjective, batch: tuple[torch.Tensor, ...]) -> Any:
    leaf = batch[0].clone().requires_grad_(True)
    function = _policy_loss_autograd if path == "autograd" else policy_loss
    with use_kernels("triton" if path == "triton" else "torch"):
        out = function(leaf, *batch[1:], surrogate=surrogate)
        (gradient,) = torch.autograd.grad(out.loss, leaf)
    return out, gradient


PATHS = ["autograd", "fused", pytest.param("triton", marks=[requires_triton, pytest.mark.kernels])]
COUNTS = ("clipped_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_sweep_gives_the_rules_decisions(case: str, input_dtype: torch.dtype, path: str) -> None:
    if path == "triton" and input_dtype == torch.float64:
        pytest.skip("float64 always takes the PyTorch path")
    surrogate = CASES[case]
    points = sweep_points(surrogate, input_dtype)
    batch = _batch(points, input_dtype)
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    out, gradient = _run(path, surrogate, batch)
    counts = [0, 0, 0, 0]
    factors: list[float | None] = []
    for sign in (1, -1):
        for x in points:
            sets, factor = expected(surrogate, x, sign, dtype)
            counts = [c + int(s) for c, s in zip(counts, sets, strict=True)]
            factors.append(factor)
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
    batch = _batch(sweep_points(number, input_dtype), input_dtype)
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
    batch = _batch(points, torch.float64)
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
    log_probs, old, _, mask = _batch(points, torch.float32)
    with use_kernels(backend_name):
        out = grpo_clipped_surrogate(log_probs, old, torch.tensor([1.0, -1.0]), mask, 0.2)
    outside = sum(
        rule_compare(x, 0.8, torch.float32) < 0 or rule_compare(x, 1.2, torch.float32) > 0
        for x in points
    )
    assert round(float(out["clipped_fraction"]) * 2 * len(points)) == 2 * outside


def test_compiled_tensor_bounds_decide_as_eager() -> None:
    # torch.compile(fullgraph=True) traces the device thresholds of 0-d tensor bounds
    clip = _tensor_fields(CASES["dual"], requires_grad=False)  # type: ignore[arg-type]
    log_probs, old, advantages, mask = _batch(
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
