"""Log-ratios at and one ulp around every bound, and the decisions the rule gives there.

Shared by ``tests/policy/test_boundary_decisions.py`` (the PyTorch paths and the kernels
through the interpreter) and ``benchmarks/gpu_triton_checks.py`` (the kernels on a GPU, where
``tl.exp`` is an approximation). The expected decisions come from the rule's definition
(``docs/conventions.md``, "Decisions at a bound"): a correctly rounded ``exp`` in the computation
dtype (the 300-bit mpmath oracle of ``tests/reference.py``) against the bound rounded to it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from reference import correctly_rounded_exp, rounded, rule_compare
from rlobjectives import CISPO, SAPO, Clip
from rlobjectives._core.decisions import lower_threshold, upper_threshold
from rlobjectives.policy.surrogates import Surrogate
from rlobjectives.policy.surrogates.sapo import SAPO_HALF_PEAK, soft_clip_ratios

__all__ = [
    "CASES",
    "COUNTS",
    "boundary_batch",
    "dppo_exact_kept",
    "dppo_sweep",
    "expected",
    "expected_totals",
    "sweep_points",
]

CASES: dict[str, Surrogate] = {
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
    surrogate: Surrogate, x: float, sign: int, dtype: torch.dtype
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
def _edges(surrogate: Surrogate) -> list[tuple[float, bool]]:
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


def sweep_points(surrogate: Surrogate, input_dtype: torch.dtype) -> list[float]:
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


def boundary_batch(points: list[float], input_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Row 0: the points with A = +1; row 1: with A = -1 (old log-probs 0: x is the point)."""
    log_probs = torch.tensor([points, points], dtype=torch.float64).to(input_dtype)
    old = torch.zeros_like(log_probs)
    advantages = torch.tensor([1.0, -1.0], dtype=input_dtype)
    mask = torch.ones(log_probs.shape, dtype=torch.bool)
    return log_probs, old, advantages, mask


COUNTS = ("clipped_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction")


def expected_totals(
    surrogate: Surrogate, points: list[float], dtype: torch.dtype
) -> tuple[list[int], list[float | None]]:
    """The four counts over both rows of :func:`boundary_batch` and the per-token factors."""
    counts = [0, 0, 0, 0]
    factors: list[float | None] = []
    for sign in (1, -1):
        for x in points:
            sets, factor = expected(surrogate, x, sign, dtype)
            counts = [c + int(s) for c, s in zip(counts, sets, strict=True)]
            factors.append(factor)
    return counts, factors


# ------------------------------------------------------------------------------ DPPO's rule
# DPPO's trust region is not one exp against a bound: it is evaluated in float64 from the
# log-probabilities of the computation dtype, then decided (docs/conventions.md, "Decisions at
# a bound"). The sweep: pairs (l, l_old) of float32 (bfloat16) numbers with l next to the exact
# boundary l* of the region (p - p_old = +-delta, or D = delta), on both sides; the expected
# decision is the exact one (mpmath at 120 digits), which float64 evaluation reproduces there
# and float32 evaluation does not always.
DPPO_OLD = [-1.1 + 0.2 * k / 15 for k in range(16)]  # l_old in [-1.1, -0.9]: l within 2x


def _mp_divergence(divergence: str, log_probs: Any, old: Any) -> Any:
    """TV ``p - p_old`` or the binary KL ``D(p_old || p)`` with float64's 1e-8, exactly."""
    import mpmath

    p, p_old = mpmath.exp(log_probs), mpmath.exp(old)
    if divergence == "tv":
        return p - p_old
    epsilon = mpmath.mpf(1e-8)  # the float64 nearest to 1e-8, as the float64 evaluation
    return p_old * (old - log_probs) + (1 - p_old) * mpmath.log(
        (1 - p_old + epsilon) / (1 - p + epsilon)
    )


def dppo_exact_kept(surrogate: Any, log_probs: float, old: float, sign: int) -> bool:
    """The exact decision of :func:`dppo_trust_region` for ``(l, l_old)`` (float32 thresholds)."""
    import mpmath

    with mpmath.workdps(120):
        value = _mp_divergence(surrogate.divergence, mpmath.mpf(log_probs), mpmath.mpf(old))
        low, high = (
            rounded(float(surrogate.low), torch.float32),
            rounded(float(surrogate.high), torch.float32),
        )
        if surrogate.divergence == "tv":
            return bool(value <= high) if sign > 0 else bool(value >= -low)
        if sign > 0:
            return bool(value <= high) or log_probs <= old
        return bool(value <= low) or log_probs >= old


def _boundary_log_prob(surrogate: Any, old: float, sign: int) -> float:
    """``l*``: where the exact divergence reaches the sign's threshold on the deciding side."""
    import mpmath

    with mpmath.workdps(120):
        old_mp = mpmath.mpf(old)
        delta = rounded(float(surrogate.high if sign > 0 else surrogate.low), torch.float32)
        if surrogate.divergence == "tv":
            return float(mpmath.log(mpmath.exp(old_mp) + sign * mpmath.mpf(delta)))

        low, high = (old_mp, mpmath.mpf(0)) if sign > 0 else (old_mp - 1.5, old_mp)
        # bisection to 1.5 / 2^90 (far below a float64 ulp): D - delta changes sign once
        for _ in range(90):
            middle = (low + high) / 2
            excess = _mp_divergence("kl", middle, old_mp) - delta
            if (excess > 0) == (sign > 0):
                high = middle
            else:
                low = middle
        return float((low + high) / 2)


@functools.cache  # the sweep of each case is found once
def dppo_sweep(
    surrogate: Any, input_dtype: torch.dtype
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Row ``A = +1`` and row ``A = -1``: ``(l, l_old)`` pairs next to ``l*``, the same count.

    For each ``l_old``: the two numbers of the input dtype either side of ``l*`` and their outer
    neighbours (pairs whose ``l - (l - l_old)`` is not ``l_old`` are left out: the paths decide
    on the reconstructed old log-probability).
    """
    rows: list[tuple[list[float], list[float]]] = []
    for sign in (1, -1):
        logs: list[float] = []
        olds: list[float] = []
        for value in DPPO_OLD:
            old = rounded(value, input_dtype)
            start = float(torch.tensor(_boundary_log_prob(surrogate, old, sign)).to(input_dtype))
            below = (
                start
                if start <= _boundary_log_prob(surrogate, old, sign)
                else _step(start, input_dtype, -math.inf)
            )
            above = _step(below, input_dtype, math.inf)
            for point in (
                _step(below, input_dtype, -math.inf),
                below,
                above,
                _step(above, input_dtype, math.inf),
            ):
                here = torch.tensor([point, old], dtype=input_dtype).float()
                delta = here[0] - here[1]
                if float(here[0] - delta) == float(here[1]):
                    logs.append(point)
                    olds.append(old)
        rows.append((logs, olds))
    width = min(len(rows[0][0]), len(rows[1][0]))
    return rows[0][0][:width], rows[0][1][:width], rows[1][0][:width], rows[1][1][:width]
