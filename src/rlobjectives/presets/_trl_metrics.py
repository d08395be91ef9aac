r"""TRL's ratio (``coef_1``) and the metrics ``GRPOTrainer._compute_loss`` logs, per loss type.

The metrics are computed on one call's tensors, in float32 (TRL's masks are int64, so its
metrics are float32), without host syncs; TRL all-reduces them over processes before logging
(:class:`rlobjectives.integrations.trl.GRPOTrainer` does that). With :math:`r` TRL's
``coef_1`` (token ratio, or :math:`\exp` of the masked mean log-ratio at sequence level, one
value per sequence):

- clipped loss types: ``clip_ratio/low_mean`` (:math:`\min(r, \delta) < 1-\epsilon`,
  :math:`A < 0`), ``high_mean`` (:math:`\min(r, \delta) > 1+\epsilon_{high}`, :math:`A > 0`),
  ``region_mean`` (either), ``low_min`` / ``high_max`` (extremes of the per-sequence fractions);
- ``cispo``: ``cispo_clip_ratio`` (:math:`r > \epsilon_{high}`, :math:`A > 0`);
- ``vespo``: ``vespo/phi_seq_mean`` (the mean over the rows of the gamma weight :math:`\phi_i`);
- ``sapo``: none.

Means are over the selected tokens (token values) or over all B rows (one value per sequence).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._core.masked import masked_mean
from .._core.reduction import masked_fill_zero
from ..policy.surrogates.vespo import VESPO_LOG_WEIGHT_RANGE

__all__ = [
    "MetricInputs",
    "cispo_metrics",
    "clip_metrics",
    "importance_ratio",
    "no_metrics",
    "vespo_metrics",
]


class MetricInputs(NamedTuple):
    """The tensors and options a loss type's metrics read (detached, float32 where computed)."""

    log_probs: torch.Tensor  # (B, T)
    old_log_probs: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B,), (B, 1) or (B, T)
    selected: torch.Tensor  # (B, T) bool
    level: str  # "token" or "sequence"
    epsilon: float
    epsilon_high: float
    delta: float | None
    vespo: tuple[float, float, float, float]  # k_pos, lambda_pos, k_neg, lambda_neg
    importance_sampling_ratio: torch.Tensor | None  # (B, T) or (B, 1)


def importance_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, selected: torch.Tensor, level: str
) -> torch.Tensor:
    """TRL's ``coef_1`` with its gradient: ``exp(Δ)`` ``(B, T)`` or ``exp(mean_t Δ)`` ``(B, 1)``."""
    log_ratio = masked_fill_zero(log_probs - old_log_probs.detach(), selected)  # (B, T)
    if level == "sequence":
        counts = selected.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        log_ratio = log_ratio.sum(-1, keepdim=True) / counts  # (B, 1)
    return torch.exp(log_ratio)


def _ratio_and_advantages(inputs: MetricInputs) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = importance_ratio(
        inputs.log_probs.detach().float(), inputs.old_log_probs.float(), inputs.selected,
        inputs.level,
    )  # fmt: skip
    advantages = inputs.advantages.detach().float()
    return ratio, advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages


@torch.no_grad()
def clip_metrics(inputs: MetricInputs) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/*`` of the clipped loss types, on the ratio after the ``delta`` cap.

    ``low_min`` / ``high_max`` are the extremes of the per-sequence fractions, empty sequences
    ignored (NaN when every sequence is empty), as TRL's ``nanmin`` / ``nanmax``.
    """
    ratio, advantages = _ratio_and_advantages(inputs)
    if inputs.delta is not None:  # TRL clamps coef_1 at delta before it forms the metrics
        ratio = ratio.clamp(max=inputs.delta)
    low = (ratio < 1 - inputs.epsilon) & (advantages < 0)
    high = (ratio > 1 + inputs.epsilon_high) & (advantages > 0)
    metrics: dict[str, torch.Tensor] = {}
    for name, clipped in (("low", low), ("high", high), ("region", low | high)):
        metrics[f"clip_ratio/{name}_mean"] = _global_mean(clipped.float(), inputs.selected)
    low_rows = _sequence_means(low.float(), inputs.selected)
    high_rows = _sequence_means(high.float(), inputs.selected)
    metrics["clip_ratio/low_min"] = _nan_extreme(low_rows, largest=False)
    metrics["clip_ratio/high_max"] = _nan_extreme(high_rows, largest=True)
    return metrics


@torch.no_grad()
def cispo_metrics(inputs: MetricInputs) -> dict[str, torch.Tensor]:
    """TRL's ``cispo_clip_ratio``: the ratio above the cap ``epsilon_high`` where ``A > 0``."""
    ratio, advantages = _ratio_and_advantages(inputs)
    capped = (ratio > inputs.epsilon_high) & (advantages > 0)
    return {"cispo_clip_ratio": _global_mean(capped.float(), inputs.selected)}


@torch.no_grad()
def vespo_metrics(inputs: MetricInputs) -> dict[str, torch.Tensor]:
    r"""TRL's ``vespo/phi_seq_mean``: the mean of the gamma weight :math:`\phi_i` over the rows.

    :math:`\log W_i = \mathrm{clip}(\sum_t M \mathrm{clip}(\Delta, \pm 20) + \sum_t M
    \log\rho_t, \log 10^{-8}, 20)` (TRL sums :math:`\log\rho` over every position; the loss and
    this metric over the selected ones, where TRL's ratio is 1 at padding),
    :math:`\phi_i = e^{\lambda + k \log W_i - \lambda W_i}` with :math:`(k, \lambda)` by the
    sign of :math:`A` (:math:`A \ge 0`: the positive pair), as :func:`rlobjectives.policy_loss`
    with ``surrogate="vespo"``.
    """
    low, high = VESPO_LOG_WEIGHT_RANGE
    selected = inputs.selected
    log_ratio = (inputs.log_probs.detach() - inputs.old_log_probs).float().clamp(-20.0, 20.0)
    total = masked_fill_zero(log_ratio, selected).sum(-1, keepdim=True)  # (B, 1)
    weights = inputs.importance_sampling_ratio
    if weights is not None:
        log_weights = torch.log(weights.detach().float()).clamp(low, high)
        if log_weights.shape[-1] != 1:
            log_weights = masked_fill_zero(log_weights, selected).sum(-1, keepdim=True)
        total = total + log_weights  # (B, 1)
    log_weight = total.clamp(low, high)
    advantages = inputs.advantages.detach().float()
    advantages = advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages
    k_pos, lambda_pos, k_neg, lambda_neg = inputs.vespo
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, k_pos, k_neg)
    lam = torch.where(nonnegative, lambda_pos, lambda_neg)
    phi = torch.exp(lam + k * log_weight - lam * torch.exp(log_weight))  # (B, 1) or (B, T)
    return {"vespo/phi_seq_mean": _global_mean(phi, selected)}


def no_metrics(inputs: MetricInputs) -> dict[str, torch.Tensor]:
    """``sapo`` logs no ratio metric in TRL."""
    del inputs
    return {}


def _global_mean(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    if values.shape[-1] == 1:  # one value per sequence: mean over all rows
        return values.sum() / max(values.shape[0], 1)
    return masked_mean(values, selected)


def _sequence_means(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    if values.shape[-1] == 1:
        return values.squeeze(-1)  # (B,)
    sums = masked_fill_zero(values, selected).sum(-1)
    return sums / selected.sum(-1).to(sums.dtype)  # (B,), NaN for an empty row (as TRL)


def _nan_extreme(values: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """TRL's ``nanmax`` (``largest``) or ``nanmin`` of ``values``: NaN when every value is NaN."""
    nan = torch.full((), math.nan, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return nan
    missing = torch.isnan(values)
    fill = -math.inf if largest else math.inf
    filled = torch.where(missing, fill, values)
    extreme = filled.max() if largest else filled.min()
    return torch.where(missing.all(), nan, extreme)
