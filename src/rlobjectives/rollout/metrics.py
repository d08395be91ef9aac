r"""Diagnostics of the rollout correction, kept as sums and counts so that they add up.

A rollout correction runs once per micro-batch on every rank; the step's diagnostics must be
those of the whole batch. Means, fractions, the effective sample size and the chi-square are
ratios of sums, so the metrics keep the **sums** and the **count** (additive over micro-batches
and ranks: :func:`rlobjectives.distributed.sum_diagnostics` adds them) and derive the values as
properties. The extremes (``ratio_min``, ``ratio_max``) are not sums: ``sum_diagnostics`` takes
their minimum/maximum over the pieces that selected at least one token (see
:meth:`RolloutCorrectionMetrics.extremum_fields`).

With :math:`n` selected tokens, :math:`\rho` the raw ratio of the chosen level (after the
:math:`\pm 20` clamp of its logarithm, before truncation), :math:`w` the applied weight and
:math:`\delta = \mathrm{clip}(\ell - \ell^{rollout}, \pm 20)` the token log-ratio:

.. math::

    \bar\rho = \frac{\sum\rho}{n}, \quad
    \mathrm{ESS} = \frac{(\sum w)^2}{n \sum w^2}, \quad
    \chi^2 = \frac{\sum(\rho^2 - 1)}{n}, \quad
    \widehat{\mathrm{KL}}_{k1} = \frac{\sum -\delta}{n}, \quad
    \widehat{\mathrm{KL}}_{k3} = \frac{\sum (e^{\delta} - 1 - \delta)}{n}.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.context import ContextGroup, context_max, context_sum
from .._core.reduction import masked_fill_zero, safe_divide

__all__ = [
    "RolloutCorrectionMetrics",
    "combine_extremes",
    "extremum_rules",
    "metrics_over_context",
    "place_extremes",
    "rollout_metrics",
]


class RolloutCorrectionMetrics(NamedTuple):
    r"""Sums and counts over the selected tokens of a :func:`rlobjectives.rollout_correction` call.

    Every field is a detached 0-d tensor in the computation dtype (float32, float64 for float64
    inputs). The fields are additive over micro-batches and ranks, except the extremes: combine
    pieces with :func:`rlobjectives.distributed.sum_diagnostics`, which sums the sums and counts
    and takes the min/max of the extremes (over pieces with tokens). Read the derived values from
    the properties (or :meth:`summary`); all are 0, never NaN, when nothing is selected.

    Counts are exact in float32 up to :math:`2^{24}` tokens per combined value.

    Attributes:
        token_count: :math:`n`, the selected tokens of the input ``mask``.
        ratio_sum: :math:`\sum\rho` of the raw ratio (level ratio broadcast to its tokens).
        ratio_min: :math:`\min\rho` over the selected tokens (0 when none).
        ratio_max: :math:`\max\rho` over the selected tokens (0 when none).
        ratio_square_excess_sum: :math:`\sum(\rho^2 - 1)` (formed as ``expm1(2 log rho)``).
        weight_sum: :math:`\sum w` of the applied weights (0 at rejected/vetoed tokens).
        weight_square_sum: :math:`\sum w^2`.
        truncated_count: tokens whose weight was truncated (``mode="truncate"``, :math:`\rho`
            outside ``[lower, upper]``).
        masked_count: tokens whose weight was zeroed (``mode="mask"``) or that left the mask
            (``mode="reject"``, ``veto``).
        kl_k1_sum: :math:`\sum -\delta` (token level): k1 of KL(rollout || trainer).
        kl_k3_sum: :math:`\sum e^{\delta} - 1 - \delta` (token level): k3 of KL(rollout || trainer).
    """

    token_count: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    ratio_square_excess_sum: torch.Tensor
    weight_sum: torch.Tensor
    weight_square_sum: torch.Tensor
    truncated_count: torch.Tensor
    masked_count: torch.Tensor
    kl_k1_sum: torch.Tensor
    kl_k3_sum: torch.Tensor

    @staticmethod
    def extremum_fields() -> dict[str, tuple[str, str]]:
        """Fields that combine by ``"min"``/``"max"``, with the count field that marks empty pieces.

        Read by :func:`rlobjectives.distributed.sum_diagnostics`: a piece whose count is 0 does
        not take part; the combined extreme is 0 when every piece is empty.
        """
        return {"ratio_min": ("min", "token_count"), "ratio_max": ("max", "token_count")}

    @property
    def ratio_mean(self) -> torch.Tensor:
        r"""Mean raw ratio :math:`\sum\rho / n` (0 when nothing is selected)."""
        return safe_divide(self.ratio_sum, self.token_count)

    @property
    def effective_sample_size(self) -> torch.Tensor:
        r"""Normalised ESS :math:`(\sum w)^2 / (n \sum w^2)` in [0, 1] (0 if all w = 0)."""
        denominator = self.token_count * self.weight_square_sum
        safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        return torch.where(denominator > 0, self.weight_sum.square() / safe, 0.0)

    @property
    def truncated_fraction(self) -> torch.Tensor:
        """Fraction of the selected tokens whose weight was truncated."""
        return safe_divide(self.truncated_count, self.token_count)

    @property
    def masked_fraction(self) -> torch.Tensor:
        """Fraction of the selected tokens zeroed (``"mask"``) or removed (``"reject"``, veto)."""
        return safe_divide(self.masked_count, self.token_count)

    @property
    def kl_k1(self) -> torch.Tensor:
        r"""k1 estimate of KL(rollout || trainer): mean of :math:`-\delta`."""
        return safe_divide(self.kl_k1_sum, self.token_count)

    @property
    def kl_k3(self) -> torch.Tensor:
        r"""k3 estimate of KL(rollout || trainer): mean of :math:`e^\delta - 1 - \delta` (>= 0)."""
        return safe_divide(self.kl_k3_sum, self.token_count)

    @property
    def chi_square(self) -> torch.Tensor:
        r"""Chi-square divergence estimate :math:`E[\rho^2] - 1` over the selected tokens."""
        return safe_divide(self.ratio_square_excess_sum, self.token_count)

    def summary(self) -> dict[str, torch.Tensor]:
        """The derived values by name (0-d tensors), e.g. for a metrics logger."""
        return {
            "ratio_mean": self.ratio_mean,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
            "effective_sample_size": self.effective_sample_size,
            "truncated_fraction": self.truncated_fraction,
            "masked_fraction": self.masked_fraction,
            "kl_k1": self.kl_k1,
            "kl_k3": self.kl_k3,
            "chi_square": self.chi_square,
        }


def _smallest(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Min of ``values`` (broadcast to ``mask``) over ``mask``; 0 when nothing is selected."""
    zero = torch.zeros((), dtype=count.dtype, device=count.device)
    if mask.numel() == 0:
        return zero
    smallest = torch.where(mask, values, torch.inf).amin()
    return torch.where(count > 0, smallest, zero)


def rollout_metrics(
    *,
    log_ratio: torch.Tensor,
    level_log_ratio: torch.Tensor | None,
    ratio: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    truncated: torch.Tensor | None,
    removed: torch.Tensor | None,
) -> RolloutCorrectionMetrics:
    r"""The metrics of one call (detached, validated inputs).

    Args:
        log_ratio: ``(B, T)`` token log-ratios :math:`\delta`, clamped to ``[-20, 20]``, exact 0
            at unselected tokens (so sums of functions that vanish at 0 need no mask).
        level_log_ratio: the clamped log of a sequence level's raw ratio, broadcastable to
            ``(B, T)`` (``(B, 1)``), or None for the token level (then it is ``log_ratio``).
        ratio: the raw ratio, ``exp`` of the level's log-ratio, same shape.
        weights: ``(B, T)`` applied weights (0 at unselected, rejected and vetoed tokens).
        mask: ``(B, T)`` the input selection (bool).
        truncated: bool ``(B, T)``, selected tokens whose weight was truncated, or None (none).
        removed: bool ``(B, T)``, selected tokens zeroed or removed from the mask, or None.
    """
    dtype = weights.dtype
    count = mask.sum().to(dtype)
    zero = torch.zeros((), dtype=dtype, device=weights.device)
    excess = torch.expm1(log_ratio)  # (B, T) rho_t - 1, 0 at unselected tokens
    if level_log_ratio is None:  # token level: rho^2 - 1 = (rho - 1)(rho + 1), no cancellation
        square_excess = (excess * (excess + 2.0)).sum()
    else:
        square_excess = masked_fill_zero(torch.expm1(2.0 * level_log_ratio), mask).sum()
    selected_ratio = masked_fill_zero(ratio, mask)  # (B, T), 0 unselected (ratios are > 0)
    return RolloutCorrectionMetrics(
        token_count=count,
        ratio_sum=selected_ratio.sum(),
        ratio_min=_smallest(ratio, mask, count),
        ratio_max=selected_ratio.amax() if selected_ratio.numel() else zero,
        ratio_square_excess_sum=square_excess,
        weight_sum=weights.sum(),
        weight_square_sum=weights.square().sum(),
        truncated_count=zero if truncated is None else truncated.sum().to(dtype),
        masked_count=zero if removed is None else removed.sum().to(dtype),
        kl_k1_sum=-log_ratio.sum(),
        kl_k3_sum=(excess - log_ratio).clamp(min=0.0).sum(),
    )


# ------------------------------------------------ combination by sum_diagnostics (extremes)
def extremum_rules(item: tuple[torch.Tensor, ...]) -> list[tuple[int, bool, int]]:
    """``(field index, is max, count field index)`` of the fields combined by min/max.

    A NamedTuple declares them with a static ``extremum_fields()`` returning
    ``{field: ("min" | "max", count_field)}`` (:class:`RolloutCorrectionMetrics`); other
    diagnostics have none.
    """
    declared = getattr(type(item), "extremum_fields", None)
    if declared is None:
        return []
    fields: tuple[str, ...] = item._fields  # type: ignore[attr-defined]
    return [
        (fields.index(name), op == "max", fields.index(count))
        for name, (op, count) in declared().items()
    ]


def combine_extremes(stacked: torch.Tensor, rules: list[tuple[int, bool, int]]) -> torch.Tensor:
    """Local extremes ``(rules,)`` of the ``(pieces, fields)`` stack, minima negated.

    Negated minima let one ``all_reduce(MAX)`` serve every extreme; a piece whose count is 0
    does not take part (``-inf``).
    """
    columns = []
    for index, largest, count in rules:
        signed = stacked[:, index] if largest else -stacked[:, index]  # (pieces,)
        columns.append(torch.where(stacked[:, count] > 0, signed, -torch.inf).amax())
    return torch.stack(columns)


def place_extremes(
    totals: torch.Tensor, extremes: torch.Tensor, rules: list[tuple[int, bool, int]]
) -> torch.Tensor:
    """``totals`` with the summed extremes replaced by the (reduced) ``extremes``; 0 if empty."""
    totals = totals.clone()
    for k, (index, largest, count) in enumerate(rules):
        value = extremes[k] if largest else -extremes[k]
        totals[index] = torch.where(totals[count] > 0, value, torch.zeros_like(value))
    return totals


def metrics_over_context(
    metrics: RolloutCorrectionMetrics, context: ContextGroup
) -> RolloutCorrectionMetrics:
    """The metrics of every rank of a context group: sums added, extremes by min/max.

    One ``all_reduce(SUM)`` of the fields and one ``all_reduce(MAX)`` of the extremes (minima
    negated), exactly as :func:`rlobjectives.distributed.sum_diagnostics` combines pieces.
    """
    stacked = torch.stack(list(metrics)).unsqueeze(0)  # (1, fields)
    (totals,) = context_sum(context, stacked[0])
    rules = extremum_rules(metrics)
    extremes = context_max(context, combine_extremes(stacked, rules))
    return RolloutCorrectionMetrics(*place_extremes(totals, extremes, rules).unbind())
