r"""Decisions at a bound, the same on every backend: log-space thresholds of an exact ``exp``.

The rule (``docs/conventions.md``, "Decisions at a bound"): every decision taken on a ratio
:math:`r = e^x` against a bound :math:`B` (clip band, clip-higher, dual clip, ``delta``, CISPO's
cap and band, SAPO's soft-clip count, the rollout correction's truncate / mask / reject and its
veto) is the decision a **correctly rounded** ``exp`` in the computation dtype :math:`D` (float32
for float32 / bfloat16 / float16 inputs and Python lists, float64 for float64) would take against
:math:`B` rounded to :math:`D`, with the library's conventions (``r > B`` and ``r < B`` are
strict; a ratio equal to the bound after rounding is on the band):

.. math::

    r > B \;:=\; \mathrm{fl}_D(e^x) > \mathrm{fl}_D(B), \qquad
    r < B \;:=\; \mathrm{fl}_D(e^x) < \mathrm{fl}_D(B), \qquad
    r = B \;:=\; \mathrm{fl}_D(e^x) = \mathrm{fl}_D(B),

:math:`\mathrm{fl}_D` rounding to nearest, ties to even. :math:`\mathrm{fl}_D(e^x)` is
non-decreasing in :math:`x`, so each decision is a comparison of the log-ratio :math:`x` (a
number of :math:`D`) with a threshold of :math:`D`, and no backend's ``exp`` enters:

.. math::

    r > B \iff x > t^{+}(B), \qquad r < B \iff x < t^{-}(B), \qquad
    r = B \iff t^{-}(B) \le x \le t^{+}(B),

with :func:`upper_threshold` :math:`t^{+}(B)` the largest :math:`x` of :math:`D` whose
correctly rounded ``exp`` is at most :math:`\mathrm{fl}_D(B)` and :func:`lower_threshold`
:math:`t^{-}(B)` the smallest whose ``exp`` is at least :math:`\mathrm{fl}_D(B)`.

**Exactness.** With :math:`m^{+}` the midpoint between :math:`b = \mathrm{fl}_D(B)` and the next
number of :math:`D` (the overflow threshold above the largest finite one),
:math:`\mathrm{fl}_D(e^x) \le b \iff e^x < m^{+}` (:math:`e^x` is never a midpoint: it is
transcendental for :math:`x \ne 0` (Lindemann-Weierstrass) and :math:`e^0 = 1` is a float), so
:math:`t^{+}` is the largest :math:`x` of :math:`D` below :math:`\ln m^{+}`; likewise
:math:`t^{-}` is the smallest above :math:`\ln m^{-}`, :math:`m^{-}` the midpoint below
:math:`b`. For a Python number the threshold is computed **on the host, exactly**: a start from
:mod:`decimal`'s correctly rounded ``ln`` at 40 digits, then a ``nextafter`` walk whose every
step compares :math:`e^x` with the midpoint exactly (:mod:`decimal`'s correctly rounded ``exp``
at a working precision raised until the comparison is decided, against the midpoint as an exact
:class:`fractions.Fraction`); float32 and float64 alike. Results are cached per (bound, dtype),
so a call costs a dictionary look-up.

**Tensor bounds** (0-d tensors: schedules, learnable hyperparameters, ``torch.compile``) are not
read on the host: their thresholds are computed on their device, traceable and without a host
synchronisation. For float32 the device method is :math:`t^{+} = \mathrm{RD}_{32}(\ln m^{+})`
(:math:`m^{\pm}` exact in float64, ``torch.log`` in float64, rounded toward the right side): the
rule's answer unless a float32 number lies within an ulp of float64 of :math:`\ln m^{\pm}`
(about one bound in :math:`2^{29}`; tested against the host method). For float64 the fallback is
:math:`t^{\pm} = \ln B` by ``torch.log`` in float64 (the backend's ``log`` rounding enters there,
at the last bit of float64). The Triton kernels compute in float32 and take the same thresholds
(a tensor bound's by the device method, read with the hyperparameter's value).
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TypeVar

import torch

__all__ = [
    "Threshold",
    "deviation_ratios",
    "constant_when_traced",
    "host_threshold",
    "lower_threshold",
    "ratio_above",
    "ratio_below",
    "ratio_equal",
    "upper_threshold",
]

Threshold = float | torch.Tensor
_Function = TypeVar("_Function", bound=Callable[..., Any])


def constant_when_traced(function: _Function) -> _Function:
    """``torch.compile`` calls ``function`` while tracing and keeps its result as a constant.

    For the host computations of thresholds from Python numbers (the hyperparameters of a
    surrogate object are constants of the graph): ``decimal`` cannot be traced, and need not be.
    This is ``torch.compiler.assume_constant_result``, which only sets the attribute below;
    calling it would import ``torch._dynamo`` (and triton) with the library, so the attribute is
    set directly (``tests/core/test_decisions.py`` checks that the two agree).
    """
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


# Precision (decimal digits) of the starting ln and the first exact comparison: float64 midpoints
# need about 17 digits to separate, so 40 digits rarely needs a second round.
_START_DIGITS = 40
_MAX_DIGITS = 4000  # far beyond any float32/float64 case: a guard against an endless loop
_FLOAT_DTYPES = (torch.float32, torch.float64)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"the computation dtype is float32 or float64, got {dtype}")


def _round(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (to nearest, ties to even; overflow to infinity)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def _step(value: float, dtype: torch.dtype, direction: float) -> float:
    """The neighbour of ``value`` (a number of ``dtype``) towards ``direction``."""
    here = torch.tensor(value, dtype=dtype)
    return float(torch.nextafter(here, torch.tensor(direction, dtype=dtype)))


def _exp_compare(x: float, midpoint: Fraction) -> int:
    """The sign of :math:`e^x - m` (``x`` a finite float, ``m`` a positive rational), exactly.

    :mod:`decimal`'s ``exp`` is correctly rounded: at ``p`` digits the result ``E`` is within
    half a unit in its last place of :math:`e^x`, so a distance ``|E - m|`` beyond one unit
    decides the sign; otherwise the precision doubles (:math:`e^x = m` cannot happen for
    ``x != 0``, and ``e^0 = 1`` is compared exactly).
    """
    if x == 0.0:
        return (Fraction(1) > midpoint) - (Fraction(1) < midpoint)
    digits = _START_DIGITS
    while digits <= _MAX_DIGITS:
        context = decimal.Context(prec=digits, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
        estimate = context.exp(decimal.Decimal(x))
        exponent = estimate.adjusted() - digits + 1  # the unit in the last place: 10**exponent
        unit = Fraction(10) ** exponent
        difference = Fraction(estimate) - midpoint
        if abs(difference) > unit:
            return 1 if difference > 0 else -1
        digits *= 2
    raise ArithmeticError(f"exp({x!r}) could not be separated from {midpoint}")  # pragma: no cover


def _natural_log(value: Fraction) -> float:
    r""":math:`\ln v` as the nearest float64 (a starting point; exactness comes from the walk)."""
    context = decimal.Context(prec=_START_DIGITS, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
    numerator = decimal.Decimal(value.numerator)
    quotient = context.divide(numerator, decimal.Decimal(value.denominator))
    return float(context.ln(quotient))


def _midpoints(bound: float, dtype: torch.dtype) -> tuple[Fraction | None, Fraction | None]:
    """The midpoints below and above ``bound`` (a positive finite number of ``dtype``).

    Above the largest finite number: the overflow threshold (rounding to nearest sends anything
    at or beyond it to infinity). Below the smallest positive number: half of it.
    """
    here = Fraction(bound)
    below = Fraction(_step(bound, dtype, -math.inf))
    above_value = _step(bound, dtype, math.inf)
    above = here + (here - below) if math.isinf(above_value) else Fraction(above_value)
    return (below + here) / 2, (here + above) / 2


def _largest_below_log(midpoint: Fraction, dtype: torch.dtype) -> float:
    r"""The largest ``x`` of ``dtype`` with :math:`e^x < m` (the largest below :math:`\ln m`)."""
    x = _round(_natural_log(midpoint), dtype)
    while _exp_compare(x, midpoint) >= 0:  # too far up: step down
        x = _step(x, dtype, -math.inf)
    while True:  # step up while the next one is still below
        following = _step(x, dtype, math.inf)
        if math.isinf(following) or _exp_compare(following, midpoint) >= 0:
            return x
        x = following


def _smallest_above_log(midpoint: Fraction, dtype: torch.dtype) -> float:
    r"""The smallest ``x`` of ``dtype`` with :math:`e^x > m` (the smallest above :math:`\ln m`)."""
    x = _round(_natural_log(midpoint), dtype)
    while _exp_compare(x, midpoint) <= 0:  # too far down: step up
        x = _step(x, dtype, math.inf)
    while True:
        previous = _step(x, dtype, -math.inf)
        if math.isinf(previous) or _exp_compare(previous, midpoint) <= 0:
            return x
        x = previous


#: The host thresholds computed so far, per (side, bound, dtype); cleared when it grows past
#: :data:`_CACHE_SIZE` (a learnable bound read on the host would give a new key at every step).
_CACHE: dict[tuple[bool, float, torch.dtype], float] = {}
_CACHE_SIZE = 4096


@constant_when_traced  # its inputs are Python numbers
def _host(bound: float, dtype: torch.dtype, upper: bool) -> float:
    """The threshold of a Python number, from the cache or computed exactly."""
    key = (upper, bound, dtype)
    threshold = _CACHE.get(key)
    if threshold is None:
        threshold = _host_upper(bound, dtype) if upper else _host_lower(bound, dtype)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = threshold
    return threshold


def _host_upper(bound: float, dtype: torch.dtype) -> float:
    """:math:`t^{+}(B)` for a Python number (exact)."""
    rounded = _round(bound, dtype)
    if math.isnan(rounded):
        raise ValueError(f"a decision bound must not be NaN, got {bound}")
    if rounded < 0.0:  # every ratio is above a negative bound
        return -math.inf
    if math.isinf(rounded):  # no ratio is above infinity
        return math.inf
    if rounded == 0.0:  # fl(e^x) <= 0: e^x below half the smallest positive number
        smallest = _step(0.0, dtype, math.inf)
        return _largest_below_log(Fraction(smallest) / 2, dtype)
    return _largest_below_log(_midpoints(rounded, dtype)[1], dtype)  # type: ignore[arg-type]


def _host_lower(bound: float, dtype: torch.dtype) -> float:
    """:math:`t^{-}(B)` for a Python number (exact)."""
    rounded = _round(bound, dtype)
    if math.isnan(rounded):
        raise ValueError(f"a decision bound must not be NaN, got {bound}")
    if rounded <= 0.0:  # no ratio is below a bound <= 0 (fl(e^x) >= 0)
        return -math.inf
    if math.isinf(rounded):  # fl(e^x) = inf from the overflow threshold on
        largest = float(torch.finfo(dtype).max)
        _, overflow = _midpoints(largest, dtype)
        return _smallest_above_log(overflow, dtype)  # type: ignore[arg-type]
    return _smallest_above_log(_midpoints(rounded, dtype)[0], dtype)  # type: ignore[arg-type]


# Rounding to nearest float32 sends e^x to infinity from this value on: the largest float32 plus
# half its ulp (2^128 - 2^103, exact in float64).
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def _device_threshold(bound: torch.Tensor, dtype: torch.dtype, upper: bool) -> torch.Tensor:
    """The threshold of a 0-d tensor bound, on its device (see the module docstring)."""
    value = bound.detach().to(dtype)
    if dtype == torch.float64:  # the documented fallback: ln B by the backend's float64 log
        return torch.log(value)
    inf = torch.tensor(math.inf, dtype=dtype, device=value.device)
    neighbour = torch.nextafter(value, inf if upper else -inf).double()
    midpoint = (value.double() + neighbour) * 0.5  # exact in float64 (float32 midpoints: 25 bits)
    # the midpoint beyond the largest float32 (above it, or below infinity): the overflow value
    beyond = torch.isinf(neighbour) if upper else torch.isinf(value)
    midpoint = torch.where(beyond, _FLOAT32_OVERFLOW, midpoint)
    log = torch.log(midpoint)  # float64
    candidate = log.to(dtype)
    if upper:  # the largest float32 strictly below ln m
        stepped = torch.nextafter(candidate, -inf)
        threshold = torch.where(candidate.double() >= log, stepped, candidate)
        return torch.where(value < 0, -inf, torch.where(torch.isinf(value), inf, threshold))
    stepped = torch.nextafter(candidate, inf)  # the smallest float32 strictly above ln m
    threshold = torch.where(candidate.double() <= log, stepped, candidate)
    return torch.where(value <= 0, -inf, threshold)


def upper_threshold(bound: float | torch.Tensor, dtype: torch.dtype) -> Threshold:
    r""":math:`t^{+}(B)`: the largest ``x`` of ``dtype`` whose rounded ``exp`` is <= ``fl(B)``.

    ``r > B`` is ``x > t``. A Python number gives a Python float (exact, cached); a 0-d tensor a
    0-d tensor of ``dtype`` on its device (the device method of the module docstring).
    """
    _check_dtype(dtype)
    if isinstance(bound, torch.Tensor):
        return _device_threshold(bound, dtype, upper=True)
    threshold: float = _host(float(bound), dtype, True)
    return threshold


def lower_threshold(bound: float | torch.Tensor, dtype: torch.dtype) -> Threshold:
    r""":math:`t^{-}(B)`: the smallest ``x`` of ``dtype`` whose rounded ``exp`` is >= ``fl(B)``.

    ``r < B`` is ``x < t``; ``r = B`` is ``lower_threshold <= x <= upper_threshold``.
    """
    _check_dtype(dtype)
    if isinstance(bound, torch.Tensor):
        return _device_threshold(bound, dtype, upper=False)
    threshold: float = _host(float(bound), dtype, False)
    return threshold


def host_threshold(bound: float | torch.Tensor, *, upper: bool) -> float:
    """A float32 threshold as a Python float (the Triton kernels' scalars).

    A tensor bound takes the device method and is read once (the kernels read every
    hyperparameter on the host).
    """
    function = upper_threshold if upper else lower_threshold
    return float(function(bound, torch.float32))


def _as_threshold(threshold: Threshold, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(threshold, dtype=like.dtype, device=like.device)


def ratio_above(log_ratio: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """Bool ``fl(e^x) > fl(B)`` of the log-ratio ``x`` (its dtype is the computation dtype)."""
    return log_ratio > _as_threshold(upper_threshold(bound, log_ratio.dtype), log_ratio)


def ratio_below(log_ratio: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """Bool ``fl(e^x) < fl(B)`` of the log-ratio ``x``."""
    return log_ratio < _as_threshold(lower_threshold(bound, log_ratio.dtype), log_ratio)


def ratio_equal(log_ratio: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """Bool ``fl(e^x) == fl(B)`` of the log-ratio ``x`` (both thresholds inclusive)."""
    dtype = log_ratio.dtype
    low = _as_threshold(lower_threshold(bound, dtype), log_ratio)
    high = _as_threshold(upper_threshold(bound, dtype), log_ratio)
    return (log_ratio >= low) & (log_ratio <= high)


def deviation_ratios(
    scale: float | torch.Tensor, width: float, dtype: torch.dtype
) -> tuple[Threshold, Threshold]:
    r"""``(R_lo, R_hi)``: :math:`|s(r - 1)| > w` exactly where :math:`r \notin [R_{lo}, R_{hi}]`.

    :math:`s(r - 1)` and :math:`w` in ``dtype``'s arithmetic, as a formula evaluates them (the
    product is non-decreasing in :math:`r`): :math:`R_{hi}` is the largest :math:`r` of
    ``dtype`` with :math:`s(r - 1) \le w`, :math:`R_{lo}` the smallest with :math:`s(r - 1)
    \ge -w` (0 when no ratio reaches :math:`-w`). A Python number is searched on the host (a
    ``nextafter`` walk from :math:`1 \pm w/s`, cached); a 0-d tensor on its device, among the 9
    neighbours of :math:`1 \pm w/s` (the edge is within 2 of them). SAPO's soft clip.
    """
    if isinstance(scale, torch.Tensor):
        return _device_deviation_ratios(scale, width, dtype)
    ratios: tuple[float, float] = _host_deviation_ratios(float(scale), width, dtype)
    return ratios


_DEVIATION_CACHE: dict[tuple[float, float, torch.dtype], tuple[float, float]] = {}


@constant_when_traced  # its inputs are Python numbers
def _host_deviation_ratios(
    temperature: float, half_peak_value: float, dtype: torch.dtype
) -> tuple[float, float]:
    """:func:`deviation_ratios` of a Python number (cached per (scale, width, dtype))."""
    key = (temperature, half_peak_value, dtype)
    ratios = _DEVIATION_CACHE.get(key)
    if ratios is None:
        if len(_DEVIATION_CACHE) >= 256:
            _DEVIATION_CACHE.clear()
        ratios = _DEVIATION_CACHE[key] = _search_deviation_ratios(
            temperature, half_peak_value, dtype
        )
    return ratios


def _search_deviation_ratios(
    temperature: float, half_peak_value: float, dtype: torch.dtype
) -> tuple[float, float]:
    tau = torch.tensor(temperature, dtype=dtype)
    half_peak = float(torch.tensor(half_peak_value, dtype=dtype))

    def scaled(ratio: float) -> float:  # tau (r - 1) in dtype, as the paths compute it
        return float((torch.tensor(ratio, dtype=dtype) - 1.0) * tau)

    def step(value: float, direction: float) -> float:
        here = torch.tensor(value, dtype=dtype)
        return float(torch.nextafter(here, torch.tensor(direction, dtype=dtype)))

    high = float(torch.tensor(1.0 + half_peak_value / temperature, dtype=dtype))
    while scaled(high) > half_peak:
        high = step(high, -math.inf)
    while not math.isinf(step(high, math.inf)) and scaled(step(high, math.inf)) <= half_peak:
        high = step(high, math.inf)
    if scaled(0.0) >= -half_peak:  # tau (r - 1) >= -tau > -h: no ratio is soft-clipped below
        return 0.0, high
    low = float(torch.tensor(1.0 - half_peak_value / temperature, dtype=dtype))
    while scaled(low) < -half_peak:
        low = step(low, math.inf)
    while scaled(step(low, -math.inf)) >= -half_peak:
        low = step(low, -math.inf)
    return low, high


def _device_deviation_ratios(
    temperature: torch.Tensor, half_peak_value: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    tau = temperature.detach().to(dtype)
    half_peak = torch.tensor(half_peak_value, dtype=dtype, device=tau.device)
    inf = torch.tensor(math.inf, dtype=dtype, device=tau.device)

    def window(start: torch.Tensor) -> torch.Tensor:  # start and its 4 neighbours either side
        up, down, values = start, start, [start]
        for _ in range(4):
            up, down = torch.nextafter(up, inf), torch.nextafter(down, -inf)
            values += [up, down]
        return torch.stack(values)

    above = window(1.0 + half_peak / tau)
    high = torch.where((above - 1.0) * tau <= half_peak, above, -inf).amax()
    below = window(1.0 - half_peak / tau)
    low = torch.where((below - 1.0) * tau >= -half_peak, below, inf).amin()
    never = (0.0 - 1.0) * tau >= -half_peak  # tau <= h: no ratio is soft-clipped below
    return torch.where(never, torch.zeros_like(low), low), high
