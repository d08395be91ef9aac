"""The decision rule's thresholds (rlobjectives._core.decisions) against an independent oracle.

``t+(B)`` must be the largest ``x`` of the dtype whose correctly rounded ``exp`` is at most the
rounded bound, ``t-(B)`` the smallest whose ``exp`` is at least it; the oracle rounds a 300-bit
mpmath ``exp`` to the nearest number of the dtype (``tests/reference.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import correctly_rounded_exp, neighbour, rounded
from rlobjectives._core import decisions
from rlobjectives._core.decisions import (
    lower_threshold,
    ratio_above,
    ratio_below,
    ratio_equal,
    upper_threshold,
)

DTYPES = (torch.float32, torch.float64)
# The library's bounds (clip 1 -+ 0.2, clip-higher 1.28, dual 3, CISPO cap 5, TIS 2, the veto
# 1e-4), an edge at 1 and one ulp above it, a subnormal, the float32 maximum and 0.
BOUNDS = (0.8, 1.2, 1.28, 0.72, 3.0, 5.0, 1.5, 2.0, 1e-4, 1.0, 1.0 + 2.0**-23, 1e-45, 3.4e38)


def _check_upper(bound: float, dtype: torch.dtype) -> None:
    edge, threshold = rounded(bound, dtype), upper_threshold(bound, dtype)
    assert isinstance(threshold, float) and rounded(threshold, dtype) == threshold
    assert correctly_rounded_exp(threshold, dtype) <= edge
    assert correctly_rounded_exp(neighbour(threshold, dtype, math.inf), dtype) > edge


def _check_lower(bound: float, dtype: torch.dtype) -> None:
    edge, threshold = rounded(bound, dtype), lower_threshold(bound, dtype)
    assert isinstance(threshold, float) and rounded(threshold, dtype) == threshold
    assert correctly_rounded_exp(threshold, dtype) >= edge
    assert correctly_rounded_exp(neighbour(threshold, dtype, -math.inf), dtype) < edge


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bound", BOUNDS)
def test_thresholds_are_the_last_numbers_on_the_band(bound: float, dtype: torch.dtype) -> None:
    _check_upper(bound, dtype)
    _check_lower(bound, dtype)


@settings(max_examples=40, deadline=None)
@given(
    log_bound=st.floats(-12.0, 12.0, allow_nan=False),
    dtype=st.sampled_from(DTYPES),
)
def test_thresholds_of_random_bounds(log_bound: float, dtype: torch.dtype) -> None:
    bound = math.exp(log_bound)
    _check_upper(bound, dtype)
    _check_lower(bound, dtype)


def test_golden_thresholds_at_one() -> None:
    # float32, B = 1: fl(e^x) <= 1 iff e^x < 1 + 2^-24 (the midpoint to 1 + 2^-23), i.e.
    # x < ln(1 + 2^-24) = 2^-24 - 2^-49 + ...; the largest float32 below is the float32 just
    # below 2^-24, 2^-24 (1 - 2^-24). fl(e^x) >= 1 iff e^x > 1 - 2^-25 (the midpoint to
    # 1 - 2^-24), x > ln(1 - 2^-25) = -2^-25 - 2^-51 - ...: the smallest float32 above is -2^-25.
    assert upper_threshold(1.0, torch.float32) == 2.0**-24 * (1 - 2.0**-24)
    assert lower_threshold(1.0, torch.float32) == -(2.0**-25)
    # float64: the same with 2^-53 / 2^-54: 2^-53 (1 - 2^-53) and -2^-54
    assert upper_threshold(1.0, torch.float64) == 2.0**-53 * (1 - 2.0**-53)
    assert lower_threshold(1.0, torch.float64) == -(2.0**-54)


def test_degenerate_bounds() -> None:
    inf = math.inf
    for dtype in DTYPES:
        assert lower_threshold(0.0, dtype) == -inf  # no ratio is below 0 (rollout lower=0)
        assert upper_threshold(inf, dtype) == inf  # none is above infinity
        assert upper_threshold(-1.0, dtype) == -inf  # every ratio is above a negative bound
    # 1e39 overflows float32: fl(e^x) >= inf from the overflow threshold on (x >= 88.72...)
    assert upper_threshold(1e39, torch.float32) == inf
    assert 88.7 < lower_threshold(1e39, torch.float32) < 88.8
    assert correctly_rounded_exp(lower_threshold(1e39, torch.float32), torch.float32) == inf


def test_specification_example_is_on_the_band() -> None:
    # log(1.2) and log(0.8) as float32: exp rounds them to the float32 bounds (1.2000000477,
    # 0.8000000119): on the band, whatever a backend's exp returns (NumPy: 1.1999999285).
    x = torch.tensor([0.1823215567939546, -0.2231435513142097])
    assert not ratio_above(x, 1.2).any() and not ratio_below(x, 0.8).any()
    assert ratio_equal(x[:1], 1.2).all() and ratio_equal(x[1:], 0.8).all()
    assert correctly_rounded_exp(float(x[0]), torch.float32) == rounded(1.2, torch.float32)


def test_veto_log_ratio_just_below_log_veto_is_below() -> None:
    # float32(log 1e-4) = -9.2103405 (the nearest float32 to -9.2103404); fl(e^x) there is
    # below float32(1e-4) (e^x = 1e-4 (1 - 1.3e-7), two float32 ulps of 1e-4 below it): the
    # veto fires, where the comparison with log(1e-4) rounded to float32 kept it.
    x = torch.tensor([math.log(1e-4)], dtype=torch.float32)
    assert bool(ratio_below(x, 1e-4))
    assert correctly_rounded_exp(float(x), torch.float32) < rounded(1e-4, torch.float32)
    assert not bool(x < math.log(1e-4))  # the former comparison


@settings(max_examples=60, deadline=None)
@given(log_bound=st.floats(-12.0, 12.0, allow_nan=False))
def test_device_method_of_tensor_bounds_matches_the_host(log_bound: float) -> None:
    bound = math.exp(log_bound)
    for as_dtype in (torch.float64, torch.float32):
        tensor = torch.tensor(bound, dtype=as_dtype)
        number = float(tensor)  # the tensor's value, as the host method sees it
        upper = upper_threshold(tensor, torch.float32)
        lower = lower_threshold(tensor, torch.float32)
        assert isinstance(upper, torch.Tensor) and upper.dtype == torch.float32
        assert isinstance(lower, torch.Tensor) and lower.dtype == torch.float32
        assert float(upper) == upper_threshold(number, torch.float32)
        assert float(lower) == lower_threshold(number, torch.float32)


def test_device_method_edges_and_float64_fallback() -> None:
    for value in (0.0, 1e-45, 3.4028234663852886e38, math.inf):
        tensor = torch.tensor(value, dtype=torch.float32)
        assert float(upper_threshold(tensor, torch.float32)) == upper_threshold(
            value, torch.float32
        )
        assert float(lower_threshold(tensor, torch.float32)) == lower_threshold(
            value, torch.float32
        )
    # float64 computations with a tensor bound: ln B by torch.log (the documented fallback)
    tensor = torch.tensor(1.2, dtype=torch.float64)
    assert torch.equal(upper_threshold(tensor, torch.float64), torch.log(tensor))
    assert torch.equal(lower_threshold(tensor, torch.float64), torch.log(tensor))


def test_host_thresholds_are_cached_and_the_cache_is_bounded() -> None:
    upper_threshold(1.2345, torch.float32)
    assert decisions._CACHE[(True, 1.2345, torch.float32)] == upper_threshold(1.2345, torch.float32)
    assert len(decisions._CACHE) <= decisions._CACHE_SIZE


def test_nan_log_ratio_is_in_no_set() -> None:
    x = torch.tensor([math.nan])
    assert not ratio_above(x, 1.2) and not ratio_below(x, 0.8) and not ratio_equal(x, 1.0)


def test_other_computation_dtypes_raise() -> None:
    with pytest.raises(ValueError, match="float32 or float64"):
        upper_threshold(1.2, torch.bfloat16)


def test_constant_when_traced_marks_as_torch_compiler_does() -> None:
    # constant_when_traced sets the attribute torch.compiler.assume_constant_result sets (without
    # importing torch._dynamo with the library); a torch that changes the mechanism fails here.
    def marked() -> float:
        return 1.0

    def reference() -> float:
        return 1.0

    decisions.constant_when_traced(marked)
    torch.compiler.assume_constant_result(reference)
    assert vars(marked) == vars(reference) == {"_dynamo_marked_constant": True}
