r"""Fused stages of the token-local surrogates other than ``"clip"``: value and derivative.

Each stage takes the ratio of one call and returns, without autograd, the surrogate values
(already multiplied by the importance weights), the closed-form derivative
:math:`\partial (w s_{it}) / \partial \ell_{it}`, the clip counts and the sums the diagnostics
need (:class:`StageOutputs`). :mod:`rlobjectives.policy.fused` keys the stages by the ``surrogate``
option (its own bit-trick stage serves ``"clip"``) and is otherwise the same for all of them.
These stages are plain ``torch`` (they are not the CPU-tuned path of the default surrogate).

With :math:`r` the ratio after the log-ratio bound, :math:`\tilde A = w_{IS} A` (the advantage
times the importance weight) and :math:`\ell` the log-probability:

- ``"cispo"``: :math:`s = \mathrm{sg}(c)\tilde A \ell` with :math:`c = \mathrm{clip}(r, L, H)`,
  :math:`\partial s / \partial \ell = c \tilde A` at every selected token (the bound and the
  cap change the weight, never the gradient's support);
- ``"sapo"``: :math:`s = \frac{4}{\tau}\sigma(x)\tilde A`, :math:`x = \tau(r - 1)`,
  :math:`\partial s / \partial \ell = 4\sigma(x)\sigma(-x)\, r \tilde A` where the log-ratio
  bound did not fire, else 0 (``torch.clamp``'s closed interval), with
  :math:`\sigma(x)\sigma(-x)` instead of autograd's :math:`\sigma(1 - \sigma)` (no cancellation
  for large :math:`|x|`; equal to rounding otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._core.bits import Bits, select, select_
from .formulas import SAPO_HALF_PEAK, Bound, cispo_bounds
from .inputs import SurrogateOptions

__all__ = ["PLAIN_STAGES", "ClipCounts", "StageInputs", "StageOutputs"]


class StageInputs(NamedTuple):
    """The ratio of one fused call and what a surrogate stage needs besides it."""

    ratio: torch.Tensor  # (B, T) r after the bound, 1 at unselected tokens; a fresh buffer
    advantages: torch.Tensor  # (B, 1) or (B, T) A, not selected (signs only)
    weighted: torch.Tensor  # A times the importance weights (or A), not selected
    selected: torch.Tensor  # (B, T) integer select mask of the selected tokens (read only)
    fired: torch.Tensor | None  # (B, T) select mask where the log-ratio bound fired (a scratch
    # buffer the stage may consume), or None without a bound: no gradient through those tokens
    mask: torch.Tensor  # (B, T) bool
    log_probs: torch.Tensor  # (B, T) the log-probabilities, not selected, any float dtype
    selected_count: torch.Tensor  # () selected tokens
    bits: Bits
    options: SurrogateOptions
    dtype: torch.dtype


class ClipCounts(NamedTuple):
    """Token counts of the clip diagnostics (0-d tensors)."""

    out_of_band: torch.Tensor
    binding_low: torch.Tensor
    binding_high: torch.Tensor


class StageOutputs(NamedTuple):
    """A surrogate stage's values, derivative and diagnostic sums."""

    coefficient: torch.Tensor  # (B, T) d (w s) / d log_probs, exact zeros at unselected tokens
    values: torch.Tensor  # (B, T) w s, +0 at unselected tokens
    selection: torch.Tensor  # (B, T) integer select mask of the selected tokens (``selected``)
    clip: ClipCounts
    dual: torch.Tensor  # () dual-clip count (0 without a bound on the A < 0 side)
    ratio_sum: torch.Tensor  # () sum of r over the selected tokens
    weight_sum: torch.Tensor  # () sum of the advantage factor over the selected tokens


def _count(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (condition & mask).sum()


def _as_tensor(value: Bound, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _cispo_stage(inputs: StageInputs) -> StageOutputs:
    r"""CISPO: the capped ratio as a constant weight on :math:`\tilde A \ell`."""
    ratio, mask, dtype = inputs.ratio, inputs.mask, inputs.dtype
    lower, upper = cispo_bounds(inputs.options)
    low = -math.inf if lower is None else lower
    high = math.inf if upper is None else upper
    weight = torch.clamp(ratio, _as_tensor(low, ratio), _as_tensor(high, ratio))  # (B, T)
    selection = inputs.selected  # (B, T)
    # The gradient flows through log_probs at every selected token, bound fired or not.
    coefficient = select_(weight * inputs.weighted, selection)  # (B, T)
    log_probs = select(inputs.log_probs.to(dtype), selection)  # (B, T)
    values = select_(log_probs.mul_(coefficient), selection)  # (B, T)
    below, above = ratio < _as_tensor(low, ratio), ratio > _as_tensor(high, ratio)
    clip = ClipCounts(
        _count(below | above, mask),
        _count(below & (inputs.advantages < 0), mask),
        _count(above & (inputs.advantages > 0), mask),
    )
    dual = _count(above & (inputs.advantages < 0), mask)
    ratio_sum = select(ratio, selection).sum()
    weight_sum = select_(weight, selection).sum()
    return StageOutputs(coefficient, values, selection, clip, dual, ratio_sum, weight_sum)


def _sapo_stage(inputs: StageInputs) -> StageOutputs:
    r"""SAPO: the soft gate :math:`\frac{4}{\tau}\sigma(\tau(r - 1))` on :math:`\tilde A`."""
    ratio, mask, dtype, options = inputs.ratio, inputs.mask, inputs.dtype, inputs.options
    advantages = inputs.advantages.to(dtype)
    positive = _as_tensor(options.sapo_temperature_pos, advantages)
    negative = _as_tensor(options.sapo_temperature_neg, advantages)
    temperature = torch.where(advantages > 0, positive, negative)  # shape of A
    x = (ratio - 1.0).mul_(temperature)  # (B, T)
    sigma = torch.sigmoid(x)  # (B, T)
    selection = inputs.selected
    # d gate / d l = 4 sigma(x) sigma(-x) r; zero where the log-ratio bound fired.
    slope = torch.sigmoid(-x).mul_(sigma).mul_(ratio).mul_(4.0)  # (B, T)
    coefficient = select_(slope.mul_(inputs.weighted), selection)  # (B, T)
    if inputs.fired is not None:
        coefficient = select_(coefficient, inputs.fired.bitwise_not_())
    gate = sigma.mul_(4.0).div_(temperature)  # (B, T), the advantage factor
    values = select_(gate * inputs.weighted, selection)  # (B, T)
    soft_clipped = x.abs() > SAPO_HALF_PEAK  # (B, T)
    clip = ClipCounts(
        _count(soft_clipped, mask),
        _count(soft_clipped & (x < 0) & (advantages < 0), mask),
        _count(soft_clipped & (x > 0) & (advantages > 0), mask),
    )
    ratio_sum = select(ratio, selection).sum()
    dual = _count(soft_clipped & (x > 0) & (advantages < 0), mask)
    weight_sum = select_(gate, selection).sum()
    return StageOutputs(coefficient, values, selection, clip, dual, ratio_sum, weight_sum)


PLAIN_STAGES: dict[str, Callable[[StageInputs], StageOutputs]] = {
    "cispo": _cispo_stage,
    "sapo": _sapo_stage,
}
