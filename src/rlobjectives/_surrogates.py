r"""The per-token surrogate formulas, one function each, as readable autograd specifications.

Every formula maps the ratios of one call to the surrogate :math:`s_{it}` (the loss is
:math:`-s`), the factor :math:`w_{it}` that multiplies the advantage in it (detached; the
``weight_mean`` diagnostic) and the token sets its clip diagnostics count. :data:`FORMULAS`
is the table keyed by the ``surrogate`` option; :mod:`rlobjectives._surrogate` runs the one the
call names, and :mod:`rlobjectives._fused` computes the token-local ones (``"clip"``,
``"cispo"``, ``"sapo"``) again, with closed-form derivatives, and is tested against them.

With :math:`r` the ratio after the log-ratio bound, :math:`A` the advantage and :math:`\ell`
the log-probability:

- ``"clip"`` (PPO/GRPO/DAPO, dual clip, TRL ``delta``):
  :math:`s = \min(\min(r, \delta) A,\ \mathrm{clip}(r, 1-\epsilon_l, 1+\epsilon_h) A)`, then
  :math:`\max(s, cA)` where :math:`A < 0`;
- ``"cispo"`` (MiniMax-M1): :math:`s = \mathrm{sg}(w) A \ell` with
  :math:`w = \min(r, \text{cap})` (TRL) or :math:`\mathrm{clip}(r, 1-\epsilon_l, 1+\epsilon_h)`
  (verl);
- ``"sapo"`` (Qwen soft gate): :math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau`
  by the sign of :math:`A` (:math:`A = 0` takes the negative temperature);
- ``"gmpo"`` (verl ``geo_mean``): :math:`s = \bar A_i \rho_i` with the geometric mean
  :math:`\rho_i = \exp(\frac{1}{n_i}\sum_t \mathrm{sgn}(A)\min(\mathrm{sgn}(A)\Delta,
  \mathrm{sgn}(A)\,\mathrm{clip}(\Delta, -\epsilon_l, \epsilon_h)))` and :math:`\bar A_i` the
  mean advantage of the sequence, in the token form of GSPO (value :math:`\rho_i` at every token,
  derivative through the token's own clipped log-ratio);
- ``"vespo"`` (TRL): :math:`s = \mathrm{sg}(\phi_i) A \ell` with the gamma weight
  :math:`\phi(W) = e^{\lambda + k \log W - \lambda W}` of the sequence ratio
  :math:`W_i = \exp(\mathrm{clip}(\sum_t \Delta_{it} + \sum_t \log \rho^{IS}_{it},
  \log 10^{-8}, 20))` (a per-sequence weight :math:`\rho^{IS}_i` enters once, padded or
  packed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ._layout import Layout
from ._masking import clamp, masked_fill_zero
from ._policy_args import SurrogateOptions

__all__ = [
    "FORMULAS",
    "SAPO_HALF_PEAK",
    "VESPO_LOG_WEIGHT_RANGE",
    "Bound",
    "ClipBounds",
    "Surrogate",
    "SurrogateInputs",
    "cispo_bounds",
    "cispo_surrogate",
    "clip_bounds",
    "clip_surrogate",
    "folds_importance_weights",
    "gmpo_surrogate",
    "sapo_surrogate",
    "vespo_surrogate",
]

Bound = float | torch.Tensor

# |tau (r - 1)| beyond which SAPO's gradient weight 4 sigma (1 - sigma) is below 1/2 (its peak
# is 1 at r = 1): 4 sigma (1 - sigma) = 1/2 at sigma = (1 +- 1/sqrt 2)/2, i.e. x = 2 ln(1 + sqrt 2).
SAPO_HALF_PEAK = 2.0 * math.log1p(math.sqrt(2.0))
# TRL's clamp of VESPO's sequence log-ratio: [log 1e-8, 20] (get_gamma_weights).
VESPO_LOG_WEIGHT_RANGE = (math.log(1e-8), 20.0)


class SurrogateInputs(NamedTuple):
    """What a formula sees; ``(B, T)`` tensors in the computation dtype, zeros at unselected."""

    ratio: torch.Tensor  # r = exp(bounded log-ratio), with gradient; 1 at unselected tokens
    log_ratio: torch.Tensor  # the bounded token log-ratio log r, with gradient
    advantages: torch.Tensor  # A (B, T), constant
    log_probs: torch.Tensor  # l (B, T), with gradient
    mask: torch.Tensor  # (B, T) bool
    importance_weights: torch.Tensor | None  # (B, 1) or (B, T), constant, NOT selected
    layout: Layout
    options: SurrogateOptions
    sequence_weights: bool = False  # the weights are one per sequence (packed: broadcast)


class Surrogate(NamedTuple):
    """A formula's result: the surrogate, its advantage factor and the clip token sets."""

    values: torch.Tensor  # s (B, T), differentiable
    weight: torch.Tensor  # w (B, T), detached: s = w A (or sg(w) A l)
    out_of_band: torch.Tensor  # bool (B, T): clipped_fraction
    below: torch.Tensor  # bool (B, T): clip_fraction_low
    above: torch.Tensor  # bool (B, T): clip_fraction_high
    dual: torch.Tensor  # bool (B, T): dual_clip_fraction


def _minimum(left: Bound, right: Bound) -> Bound:
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return torch.minimum(_as_bound(left), _as_bound(right))
    return min(left, right)


def _maximum(left: Bound, right: Bound) -> Bound:
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return torch.maximum(_as_bound(left), _as_bound(right))
    return max(left, right)


def _as_bound(value: Bound) -> torch.Tensor:
    # float64 for Python numbers, so that a tensor partner does not round them to float32
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)


class ClipBounds(NamedTuple):
    """The ratio bounds of the ``"clip"`` surrogate per sign of the advantage (None: no bound).

    ``s = A clip(r, lower, upper)`` with ``(lower, upper) = (-inf, upper_positive)`` for
    ``A > 0`` and ``(lower_negative, upper_negative)`` for ``A < 0``, which is
    ``max(min(min(r, delta) A, clip(r) A), c A)`` product for product.
    """

    band: tuple[Bound, Bound] | None  # (1 - eps_low, 1 + eps_high)
    upper_positive: Bound | None  # min(1 + eps_high, delta)
    lower_negative: Bound | None  # 1 - eps_low
    upper_negative: Bound | None  # min(c, max(1 + eps_high, delta)); min(c, delta) unclipped


def clip_bounds(options: SurrogateOptions) -> ClipBounds:
    """The per-sign bounds of the clipped surrogate (see :class:`ClipBounds`)."""
    delta, dual = options.delta, options.dual_clip
    band = None
    upper_positive, lower_negative, upper_negative = delta, None, delta
    if options.clip_low is not None:
        high = options.clip_low if options.clip_high is None else options.clip_high
        band = (1.0 - options.clip_low, 1.0 + high)
        lower_negative = band[0]
        upper_positive = band[1] if delta is None else _minimum(band[1], delta)
        upper_negative = None if delta is None else _maximum(band[1], delta)
    if dual is not None:
        upper_negative = dual if upper_negative is None else _minimum(dual, upper_negative)
    return ClipBounds(band, upper_positive, lower_negative, upper_negative)


def _above(ratio: torch.Tensor, bound: Bound | None) -> torch.Tensor:
    """``r > bound`` (all False without a bound)."""
    if bound is None:
        return torch.zeros_like(ratio, dtype=torch.bool)
    return ratio > torch.as_tensor(bound, dtype=ratio.dtype, device=ratio.device)


def _below(ratio: torch.Tensor, bound: Bound | None) -> torch.Tensor:
    """``r < bound`` (all False without a bound)."""
    if bound is None:
        return torch.zeros_like(ratio, dtype=torch.bool)
    return ratio < torch.as_tensor(bound, dtype=ratio.dtype, device=ratio.device)


def _band_sets(
    ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound | None, upper: Bound | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(outside [lower, upper], below and A < 0, above and A > 0)`` of the ratio."""
    below, above = _below(ratio, lower), _above(ratio, upper)
    return below | above, below & (advantages < 0), above & (advantages > 0)


def clip_surrogate(inputs: SurrogateInputs) -> Surrogate:
    r""":math:`\min(\min(r, \delta) A, \mathrm{clip}(r) A)`, then :math:`\max(s, cA)`, A < 0."""
    ratio, advantages, options = inputs.ratio, inputs.advantages, inputs.options
    capped = ratio if options.delta is None else clamp(ratio, -math.inf, options.delta)
    surrogate = capped * advantages  # (B, T)
    bounds = clip_bounds(options)
    if bounds.band is not None:
        clipped = clamp(ratio, *bounds.band) * advantages  # (B, T)
        surrogate = torch.minimum(surrogate, clipped)  # (B, T)
    if options.dual_clip is not None:
        # Dual clip (Ye et al. 2020): for A < 0 the surrogate is bounded below by c * A.
        surrogate = torch.where(
            advantages < 0, torch.maximum(surrogate, options.dual_clip * advantages), surrogate
        )
    ratio_d = ratio.detach()
    nonzero = advantages != 0
    safe = torch.where(nonzero, advantages, torch.ones_like(advantages))
    weight = torch.where(nonzero, surrogate.detach() / safe, ratio_d)  # w = s / A
    band = (None, None) if bounds.band is None else bounds.band
    out_of_band = _band_sets(ratio_d, advantages, *band)[0]
    below = _below(ratio_d, bounds.lower_negative) & (advantages < 0)
    above = _above(ratio_d, bounds.upper_positive) & (advantages > 0)
    dual = _above(ratio_d, bounds.upper_negative) & (advantages < 0)
    return Surrogate(surrogate, weight, out_of_band, below, above, dual)


def cispo_bounds(options: SurrogateOptions) -> tuple[Bound | None, Bound | None]:
    """CISPO's weight bounds: ``(None, cispo_cap)`` (TRL) or the clip band (verl), or none."""
    if options.cispo_cap is not None:
        return None, options.cispo_cap
    if options.clip_low is None:
        return None, None
    high = options.clip_low if options.clip_high is None else options.clip_high
    return 1.0 - options.clip_low, 1.0 + high


def cispo_surrogate(inputs: SurrogateInputs) -> Surrogate:
    r""":math:`\mathrm{sg}(w) A \ell`, :math:`w` the ratio capped (TRL) or clipped (verl)."""
    lower, upper = cispo_bounds(inputs.options)
    ratio = inputs.ratio.detach()
    weight = clamp(
        ratio, -math.inf if lower is None else lower, math.inf if upper is None else upper
    )  # (B, T), a constant: the gradient flows through log_probs only
    values = weight * inputs.advantages * inputs.log_probs  # (B, T)
    advantages = inputs.advantages
    out_of_band, below, above = _band_sets(ratio, advantages, lower, upper)
    dual = _above(ratio, upper) & (advantages < 0)  # the cap changes an A < 0 token's weight
    return Surrogate(values, weight, out_of_band, below, above, dual)


def sapo_surrogate(inputs: SurrogateInputs) -> Surrogate:
    r"""SAPO: :math:`\frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau_\pm` by the sign of A."""
    options, advantages = inputs.options, inputs.advantages
    positive = torch.as_tensor(options.sapo_temperature_pos, dtype=advantages.dtype)
    negative = torch.as_tensor(options.sapo_temperature_neg, dtype=advantages.dtype)
    temperature = torch.where(
        advantages > 0, positive.to(advantages.device), negative.to(advantages.device)
    )  # (B, T)
    scaled = temperature * (inputs.ratio - 1.0)  # (B, T)
    gate = torch.sigmoid(scaled) * 4.0 / temperature  # (B, T)
    x = scaled.detach()
    soft_clipped = x.abs() > SAPO_HALF_PEAK
    below = soft_clipped & (x < 0) & (advantages < 0)
    above = soft_clipped & (x > 0) & (advantages > 0)
    dual = soft_clipped & (x > 0) & (advantages < 0)
    return Surrogate(gate * advantages, gate.detach(), soft_clipped, below, above, dual)


def gmpo_surrogate(inputs: SurrogateInputs) -> Surrogate:
    r"""GMPO (verl ``geo_mean``): :math:`\bar A_i \rho_i`, clipped in log space per token."""
    options, advantages, mask, layout = (
        inputs.options,
        inputs.advantages,
        inputs.mask,
        inputs.layout,
    )
    log_ratio = inputs.log_ratio  # (B, T)
    sign = torch.sign(advantages)  # (B, T); A = 0 contributes log-ratio 0 (verl)
    lower = upper = None
    if options.clip_low is None:
        clipped = sign * sign * log_ratio
    else:
        lower = -options.clip_low
        upper = options.clip_low if options.clip_high is None else options.clip_high
        bounded = clamp(log_ratio, lower, upper)  # (B, T)
        clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)  # (B, T)
    clipped = masked_fill_zero(clipped, mask)
    counts = layout.row_counts(mask).clamp(min=1).to(log_ratio.dtype)  # (S,)
    mean_log_ratio = layout.expand(layout.row_sums(clipped.detach()) / counts)  # (B, 1)/(1, N)
    mean_advantage = layout.expand(layout.row_sums(advantages) / counts)  # (B, 1)/(1, N)
    # Token form (as GSPO): value log rho_i at every token, derivative d clipped_t / d l_t.
    ratio = torch.exp(clipped - clipped.detach() + mean_log_ratio)  # (B, T)
    x = log_ratio.detach()
    out_of_band, below, above = _band_sets(x, advantages, lower, upper)
    dual = torch.zeros_like(out_of_band)
    weight = ratio.detach()
    return Surrogate(mean_advantage * ratio, weight, out_of_band, below, above, dual)


def _vespo_log_weight(inputs: SurrogateInputs) -> torch.Tensor:
    """``log W_i`` per token: the sequence's summed log-ratio and log-importance-weights."""
    layout, mask = inputs.layout, inputs.mask
    total = layout.row_sums(masked_fill_zero(inputs.log_ratio.detach(), mask))  # (S,)
    total = layout.expand(total)  # (B, 1) or (1, N)
    weights = inputs.importance_weights
    low, high = VESPO_LOG_WEIGHT_RANGE
    if weights is not None and inputs.sequence_weights:
        # A sequence weight enters once per sequence, in the padded (B, 1) and the packed
        # layout alike (there it is broadcast to its tokens: (1, N), the same value at each);
        # a NaN one of an empty row reaches only that row's unselected tokens, which the loss
        # masks.
        total = total + clamp(torch.log(weights), low, high)  # (B, 1) or (1, N)
    elif weights is not None:  # token weights: the log of their product over the sequence
        one = torch.ones((), dtype=weights.dtype, device=weights.device)
        log_weights = clamp(torch.log(torch.where(mask, weights, one)), low, high)  # (B, T)
        total = total + layout.expand(layout.row_sums(masked_fill_zero(log_weights, mask)))
    return clamp(total, low, high)


def vespo_surrogate(inputs: SurrogateInputs) -> Surrogate:
    r"""VESPO (TRL): :math:`\mathrm{sg}(\phi(W_i)) A \ell` with the gamma weight of :math:`W_i`."""
    options, advantages = inputs.options, inputs.advantages
    log_weight = _vespo_log_weight(inputs)  # (B, 1) or (1, N)
    nonnegative = advantages >= 0
    dtype, device = advantages.dtype, advantages.device

    def by_sign(positive: Bound, negative: Bound) -> torch.Tensor:
        return torch.where(
            nonnegative,
            torch.as_tensor(positive, dtype=dtype).to(device),
            torch.as_tensor(negative, dtype=dtype).to(device),
        )

    k = by_sign(options.vespo_k_pos, options.vespo_k_neg)  # (B, T)
    lam = by_sign(options.vespo_lambda_pos, options.vespo_lambda_neg)  # (B, T)
    phi = torch.exp(lam + k * log_weight - lam * torch.exp(log_weight))  # (B, T), constant
    values = phi * advantages * inputs.log_probs  # (B, T)
    none = torch.zeros_like(inputs.mask)
    return Surrogate(values, phi, none, none, none, none)


def folds_importance_weights(options: SurrogateOptions) -> bool:
    """Whether the importance weights enter the formula (VESPO) instead of scaling the loss."""
    return options.surrogate == "vespo"


FORMULAS: dict[str, Callable[[SurrogateInputs], Surrogate]] = {
    "clip": clip_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
    "gmpo": gmpo_surrogate,
    "vespo": vespo_surrogate,
}
