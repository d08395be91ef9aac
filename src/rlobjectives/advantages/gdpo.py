r"""GDPO: group reward-decoupled normalisation of several reward components, then batch whitening.

With :math:`R` reward components per sequence (format, accuracy, length, ...), GRPO sums them
first and normalises the sum within each group, so a component with a large spread drowns the
others. GDPO (arXiv:2601.05242) normalises each component within its group first, sums them
with weights, then whitens the sum over the batch. Groups are given as in
:mod:`rlobjectives.advantages.outcome` (``group_size`` or ``group_ids``); every statistic is a
segment reduction on values scaled by a power of two (no loop over groups, no host sync).
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    check_same_device,
    checks_environment,
    compute_dtype,
    validate_scalar,
)
from .groups import Groups, group_centered, group_scale, grouped_rewards, segment_sum
from .whitening import divide_or_zero, masked_moments, safe_sqrt, validate_flag

__all__ = ["gdpo_advantages"]


def _group_z_scores(
    values: torch.Tensor, groups: Groups, eps: float | torch.Tensor
) -> torch.Tensor:
    r""":math:`(r - \mu_g)/(\sigma_g + \epsilon)` per sequence ``(B,)``, :math:`\sigma_g` unbiased.

    A group of one sequence, or of identical rewards, gives exactly 0.
    """
    unit = group_scale(values, groups)  # (B,) power of two per group
    centered = group_centered(values / unit, groups)  # (B,) exact 0 for identical rewards
    divisor = (groups.size - 1).clamp(min=1).to(values.dtype)
    spread = safe_sqrt(segment_sum(centered.square(), groups) / divisor)  # (B,) sigma_g / unit
    return divide_or_zero(centered, spread + eps / unit)


def _batch_whitened(total: torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    r""":math:`(S - \bar S)/(\mathrm{std}(S) + \epsilon)` over the batch, unbiased; identical: 0."""
    if total.numel() == 0:
        return total
    shifted = total - total[:1]  # exact zeros when every sum is the same
    moments = masked_moments(shifted, torch.ones_like(shifted, dtype=torch.bool), unbiased=True)
    return divide_or_zero(moments.centered, safe_sqrt(moments.variance) + eps / moments.scale)


@checks_environment
def gdpo_advantages(
    rewards: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: Any = None,
    weights: ArrayLike | None = None,
    eps: Scalar = 1e-6,
    whiten: bool = True,
) -> torch.Tensor:
    r"""GDPO advantages: each reward component normalised within its group, summed, whitened.

    For sequence :math:`i` of group :math:`g` and component :math:`k` (of :math:`R`), with
    the group mean :math:`\mu^k_g` and the unbiased (Bessel-corrected) group standard
    deviation :math:`\sigma^k_g`,

    .. math::

        A^k_i = \frac{r^k_i - \mu^k_g}{\sigma^k_g + \epsilon}, \qquad
        S_i = \sum_k w_k A^k_i, \qquad
        A_i = \frac{S_i - \bar S}{\mathrm{std}(S) + \epsilon},

    where :math:`\bar S` and :math:`\mathrm{std}(S)` (unbiased) run over the :math:`B`
    sequences of the batch (for several data-parallel ranks, call it on the gathered batch, as
    TRL does). A group of one sequence and a group of identical rewards give :math:`A^k = 0`
    (verl's ``grpo`` convention gives :math:`r/(1+\epsilon)` to a group of one: see
    :func:`rlobjectives.presets.verl_gdpo_advantages`); a batch of one or of identical sums
    gives 0. ``whiten=False`` returns :math:`S` (for verl's token-level whitening, below).
    :math:`R = 1` is GRPO (:func:`rlobjectives.group_relative_advantages`) followed by batch
    whitening.

    Peers: TRL ``multi_objective_aggregation="normalize_then_sum"`` (``eps=1e-4``), verl
    ``adv_estimator="gdpo"`` (over tokens: :func:`rlobjectives.presets.verl_gdpo_advantages`),
    NeMo-RL ``GDPOAdvantageEstimator``; in detail: ``docs/objectives/advantages.md``.

    Args:
        rewards: ``(B, R)`` reward components per sequence (``(B,)`` is one component).
        group_size: :math:`G \ge 1`, the groups being contiguous; or None with ``group_ids``.
        group_ids: ``(B,)`` group label per sequence (see
            :func:`rlobjectives.group_relative_advantages`).
        weights: optional ``(R,)`` component weights :math:`w_k` (default ones).
        eps: :math:`\epsilon \ge 0` of both stages (number or 0-d tensor).
        whiten: whiten the weighted sum over the batch (default); False returns :math:`S`.

    Returns:
        ``(B,)`` advantages, float32 (float64 when ``rewards`` or ``weights`` is float64), on
        the device of ``rewards``.

    Raises:
        ValueError: if ``rewards`` is not ``(B, R)`` with ``R >= 1``, ``weights`` is not
            ``(R,)`` or on another device, the grouping is invalid (see
            :func:`rlobjectives.group_relative_advantages`) or ``eps`` is negative/non-finite.
        TypeError: on non-numeric inputs, a non-int ``group_size``, float/unhashable labels or
            a non-bool ``whiten``.

    References:
        GDPO: Group reward-Decoupled Normalization Policy Optimization, arXiv:2601.05242
        (Sec. 3: per-reward group normalisation, weighted aggregation, batch-wise
        normalisation); verl ``compute_gdpo_outcome_advantage``; TRL ``GRPOConfig
        .multi_objective_aggregation``.

    Examples:
        >>> import torch
        >>> rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
        >>> gdpo_advantages(rewards, 2, eps=0.0)  # S = [0, 0, 1/sqrt 2, -1/sqrt 2]
        tensor([ 0.0000,  0.0000,  1.2247, -1.2247])

    .. versionadded:: 0.3.0
    """
    rewards_t = as_float_tensor(rewards, "rewards")
    if rewards_t.ndim == 1:
        rewards_t = rewards_t.unsqueeze(-1)
    if rewards_t.ndim != 2 or rewards_t.shape[1] < 1:
        raise ValueError(
            "rewards must have shape (B, R) with R >= 1 reward components per sequence (or "
            f"(B,) for one), got shape {tuple(rewards_t.shape)}"
        )
    components = rewards_t.shape[1]
    _, groups = grouped_rewards(rewards_t[:, 0], group_size, group_ids, minimum=1)
    weights_t = _weights(weights, components, rewards_t)
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    validate_flag(whiten, "whiten")
    dtype = compute_dtype(rewards_t, weights_t)
    values = rewards_t.to(dtype)
    scores = torch.stack(
        [_group_z_scores(values[:, k], groups, epsilon) for k in range(components)], dim=1
    )  # (B, R)
    total = (scores * weights_t.to(dtype)).sum(dim=1)  # (B,)
    return _batch_whitened(total, epsilon) if whiten else total


def _weights(weights: ArrayLike | None, components: int, rewards: torch.Tensor) -> torch.Tensor:
    if weights is None:
        return torch.ones(components, dtype=torch.float32, device=rewards.device)
    weights_t = as_float_tensor(weights, "weights", rewards.device)
    check_same_device({"rewards": rewards, "weights": weights_t})
    if weights_t.ndim != 1 or weights_t.shape[0] != components:
        raise ValueError(
            f"weights must have shape (R,) = ({components},) (one weight per reward component "
            f"of rewards), got shape {tuple(weights_t.shape)}"
        )
    return weights_t
