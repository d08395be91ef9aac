"""The rollout correction's decisions at its bounds follow the rule (issue 26).

``truncate`` / ``mask`` / ``reject`` (``rho < lower``, ``rho > upper``) and ``veto``
(``e^delta < veto``) at log-ratios on and one ulp around every threshold, float32, bfloat16 and
float64 inputs, the three levels (one token per sequence: the sequence and geometric
log-ratios equal the token's). Expected: a correctly rounded ``exp`` in the computation dtype
against the bound rounded to it (the mpmath oracle of ``tests/reference.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import rule_compare
from rlobjectives import rollout_correction
from rlobjectives._core.decisions import lower_threshold, upper_threshold

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
MODES = {  # mode -> (lower, upper): TIS with a lower bound, IcePop's band, rejection
    "truncate": (0.5, 2.0),
    "mask": (0.8, 1.2),
    "reject": (0.5, 2.0),
}


def _step(value: float, dtype: torch.dtype, direction: float) -> float:
    here = torch.tensor(value, dtype=dtype)
    return float(torch.nextafter(here, torch.tensor(direction, dtype=dtype)))


def _points(bounds: tuple[float, ...], input_dtype: torch.dtype) -> list[float]:
    """Each bound's two thresholds, one ulp either side, and the nearest number to log(bound)."""
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    points: set[float] = set()
    for bound in bounds:
        for threshold in (upper_threshold(bound, dtype), lower_threshold(bound, dtype)):
            assert isinstance(threshold, float)
            points |= {threshold, _step(threshold, dtype, math.inf)}
            points.add(_step(threshold, dtype, -math.inf))
        points.add(float(torch.tensor(math.log(bound), dtype=dtype)))
    if input_dtype == torch.bfloat16:  # the bfloat16 neighbours (the points must be inputs)
        narrow = torch.tensor(sorted(points), dtype=torch.float64).to(torch.bfloat16)
        up = torch.nextafter(narrow, torch.tensor(math.inf, dtype=torch.bfloat16))
        down = torch.nextafter(narrow, torch.tensor(-math.inf, dtype=torch.bfloat16))
        points = {float(v) for v in torch.cat([narrow, up, down]).float()}
    return sorted(points)


def _inputs(points: list[float], input_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One token per sequence, ``(P, 1)``: the log-ratio of row ``i`` is ``points[i]``."""
    log_probs = torch.tensor(points, dtype=torch.float64).reshape(-1, 1).to(input_dtype)
    return log_probs, torch.zeros_like(log_probs), torch.ones(log_probs.shape, dtype=torch.bool)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_modes_decide_by_the_rule(mode: str, input_dtype: torch.dtype, level: str) -> None:
    lower, upper = MODES[mode]
    points = _points((lower, upper), input_dtype)
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    log_probs, rollout, mask = _inputs(points, input_dtype)
    out = rollout_correction(
        log_probs,
        rollout,
        mask,
        level=level,
        mode=mode,
        lower=lower,
        upper=upper,  # type: ignore[arg-type]
    )
    outside = torch.tensor(
        [rule_compare(x, lower, dtype) < 0 or rule_compare(x, upper, dtype) > 0 for x in points]
    )
    assert outside.any() and (~outside).any()  # the sweep brackets the band
    metrics = out.metrics
    if mode == "truncate":
        assert int(metrics.truncated_count) == int(outside.sum())
        assert out.mask.all()
    elif mode == "mask":
        assert torch.equal(out.weights.reshape(-1) == 0, outside)
        assert int(metrics.masked_count) == int(outside.sum())
    else:
        assert torch.equal(out.mask.reshape(-1), ~outside)
        assert int(metrics.masked_count) == int(outside.sum())


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_veto_decides_by_the_rule(input_dtype: torch.dtype) -> None:
    veto = 1e-4
    points = _points((veto,), input_dtype)
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    log_probs, rollout, mask = _inputs(points, input_dtype)
    out = rollout_correction(log_probs, rollout, mask, upper=None, veto=veto)
    vetoed = torch.tensor([rule_compare(x, veto, dtype) < 0 for x in points])
    assert vetoed.any() and (~vetoed).any()
    assert torch.equal(out.mask.reshape(-1), ~vetoed)


def test_veto_golden_float32_log_of_the_veto() -> None:
    # float32(log 1e-4) = -9.2103405 rounds e^x to float32(1e-4) minus two ulps: vetoed (the
    # comparison with log(1e-4) rounded to float32 kept it). The next float32 up, -9.2103395,
    # is the smallest whose exp reaches float32(1e-4): kept.
    log_probs = torch.tensor([[math.log(1e-4)], [-9.2103395]], dtype=torch.float32)
    out = rollout_correction(log_probs, torch.zeros(2, 1), torch.ones(2, 1), upper=None, veto=1e-4)
    assert out.mask.reshape(-1).tolist() == [False, True]
