r"""Outcome-reward advantage estimators: one score per sequence, a baseline from its group.

GRPO / Dr. GRPO (:func:`group_relative_advantages`), RLOO (:func:`rloo_advantages`), pass@k
(:func:`passk_advantages`), OPO (:func:`opo_advantages`) and ReMax (:func:`remax_advantages`).
Groups (the responses to one prompt) are given either by ``group_size`` (contiguous groups of
equal size: ``rewards[g*G:(g+1)*G]`` is group ``g``) or by ``group_ids``, one label per sequence
(verl's ``index``; groups of any size, in any order). Per-group statistics are segment
reductions (``index_add`` / ``scatter_reduce``), with no Python loop over groups and no host
sync. Every statistic is taken of the rewards divided by a power of two near the group's
largest magnitude, so rewards of :math:`10^{20}` or :math:`10^{-20}` in float32 neither
overflow nor underflow. Results are ``(N,)`` per-sequence advantages, float32 (float64 for
float64 input); pass them as ``advantages`` to :func:`rlobjectives.policy_loss`, which
broadcasts them over the tokens.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .._core.layout import per_sequence, sequence_layout, token_matrix, token_output
from .._core.reduction import masked_fill_zero
from .._core.segments import segment_discounted_sum
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    checks_environment,
    compute_dtype,
    validate_choice,
    validate_scalar,
)
from .groups import (
    Groups,
    group_centered,
    group_scale,
    grouped_rewards,
    segment_amax,
    segment_sum,
)
from .whitening import divide_or_zero, masked_moments, safe_sqrt

__all__ = [
    "SCALES",
    "AdvantageScale",
    "group_relative_advantages",
    "opo_advantages",
    "passk_advantages",
    "remax_advantages",
    "rloo_advantages",
]

AdvantageScale = Literal["std", "batch", "none"]
SCALES: tuple[str, ...] = ("std", "batch", "none")
PASSK_SCALES: tuple[str, ...] = ("std", "none")


def _group_std(centered: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(N,)`` Bessel-corrected std of each group from its centered values (0 for one member)."""
    divisor = (groups.size - 1).clamp(min=1).to(centered.dtype)  # (N,)
    return safe_sqrt(segment_sum(centered.square(), groups) / divisor)


@checks_environment
def group_relative_advantages(
    rewards: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: Any = None,
    scale: AdvantageScale = "std",
    eps: Scalar = 1e-6,
) -> torch.Tensor:
    r"""GRPO (and Dr. GRPO) group-relative advantages of a flat ``(N,)`` reward vector.

    For sequence :math:`i` of group :math:`g` (:math:`n_g` members), with
    :math:`\mu_g = \frac1{n_g} \sum_{j \in g} r_j` and the Bessel-corrected (unbiased) standard
    deviation :math:`\sigma_g = \sqrt{\frac{1}{n_g-1}\sum_{j \in g} (r_j - \mu_g)^2}`,

    .. math::

        A_i = \frac{r_i - \mu_g}{\sigma_g + \epsilon} \;(\texttt{"std"}, \text{GRPO}),
        \quad A_i = \frac{r_i - \mu_g}{\sigma + \epsilon} \;(\texttt{"batch"}),
        \quad A_i = r_i - \mu_g \;(\texttt{"none"}, \text{Dr. GRPO}),

    where :math:`\sigma` is the unbiased standard deviation of all :math:`N` rewards of the
    batch (TRL ``scale_rewards="batch"``). A group of identical rewards gives exactly 0 (never
    NaN, also with ``eps=0``). **A group of one sequence gets advantage 0** (its own mean is its
    baseline; :math:`\sigma_g := 0`); verl's ``grpo`` instead uses :math:`\mu = 0, \sigma = 1`
    there, i.e. returns :math:`r_i / (1 + \epsilon)`. verl ``grpo`` uses the unbiased std and
    :math:`\epsilon = 10^{-6}`, TRL the unbiased std and :math:`10^{-4}`, OpenRLHF
    ``group_norm`` :math:`10^{-9}`.

    Args:
        rewards: ``(N,)`` sequence rewards (``N = B*G`` with ``group_size``).
        group_size: :math:`G \ge 1`, the groups being contiguous; or None with ``group_ids``.
        group_ids: ``(N,)`` group label per sequence (int tensor, or a sequence / NumPy array
            of hashable labels such as verl's uid strings); groups may have any size and
            order. Exactly one of ``group_size`` and ``group_ids``.
        scale: ``"std"`` (per-group std), ``"batch"`` (std of the whole batch) or ``"none"``.
        eps: :math:`\epsilon \ge 0` (number or 0-d tensor), used by ``"std"`` and ``"batch"``.

    Returns:
        ``(N,)`` advantages on the device of ``rewards``, float32 (float64 for float64 input).

    Raises:
        ValueError: if ``rewards`` is not 1-D, both or neither of ``group_size`` and
            ``group_ids`` are given, ``N`` is not divisible by ``group_size``, ``group_ids``
            does not have one label per reward or is on another device, ``group_size < 1``,
            ``scale`` is unknown or ``eps`` is negative/non-finite.
        TypeError: on non-numeric rewards, a non-int ``group_size`` or float/unhashable labels.

    References:
        Shao et al. 2024, DeepSeekMath/GRPO, arXiv:2402.03300 Sec. 4.1.2 (outcome supervision,
        :math:`\tilde r_i = (r_i - \mathrm{mean}(r)) / \mathrm{std}(r)`); Liu et al. 2025,
        Dr. GRPO, arXiv:2503.20783 Sec. 3.2 (no std normalization).

    Examples:
        >>> group_relative_advantages([1.0, 0.0, 1.0, 1.0], 2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
        >>> group_relative_advantages([1.0, 5.0, 0.0, 3.0], group_ids=["a", "b", "a", "a"])
        tensor([-0.2182,  0.0000, -0.8729,  1.0911])

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``group_ids`` and ``scale="batch"``; magnitudes up to the float limits.
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids, minimum=1)  # (N,)
    validate_choice(scale, "scale", SCALES)
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    unit = group_scale(values, groups)  # (N,) power of two per group
    centered = group_centered(values / unit, groups)  # (N,) (r - mu_g) / unit
    if scale == "none":
        return centered * unit
    if scale == "std":
        return divide_or_zero(centered, _group_std(centered, groups) + epsilon / unit)
    batch = masked_moments(values, torch.ones_like(values, dtype=torch.bool), unbiased=True)
    numerator = centered * (unit / batch.scale)  # (N,) (r - mu_g) / batch scale
    return divide_or_zero(numerator, safe_sqrt(batch.variance) + epsilon / batch.scale)


@checks_environment
def rloo_advantages(
    rewards: ArrayLike, group_size: int | None = None, *, group_ids: Any = None
) -> torch.Tensor:
    r"""REINFORCE leave-one-out (RLOO) advantages of a flat ``(N,)`` reward vector.

    .. math::

        A_i = r_i - \frac{1}{n_g-1} \sum_{j \in g,\, j \ne i} r_j
            = \frac{n_g}{n_g-1}\,(r_i - \mu_g).

    A group of identical rewards gives exactly 0. With ``group_ids`` a group of one sequence
    gets 0 (no other sample for a baseline; verl's ``rloo`` returns the raw reward there). TRL's
    RLOO applies this to the KL-penalized sequence reward
    (:func:`rlobjectives.kl_penalized_rewards`).

    Args:
        rewards: ``(N,)`` sequence rewards.
        group_size: :math:`G \ge 2`, groups contiguous; or None with ``group_ids``.
        group_ids: ``(N,)`` group label per sequence (see
            :func:`group_relative_advantages`). Exactly one of ``group_size`` and ``group_ids``.

    Returns:
        ``(N,)`` advantages on the device of ``rewards``, float32 (float64 for float64 input).

    Raises:
        ValueError: if ``rewards`` is not 1-D, the grouping is invalid (see
            :func:`group_relative_advantages`) or ``group_size < 2``.
        TypeError: on non-numeric rewards or a non-int ``group_size``.

    References:
        Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!" (ICLR 2019
        DeepRLStructPred workshop); Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740
        (the RLOO estimator).

    Examples:
        >>> rloo_advantages([1.0, 0.0, 0.0], 3)
        tensor([ 1.0000, -0.5000, -0.5000])

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``group_ids``.
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids, minimum=2)  # (N,)
    unit = group_scale(values, groups)  # (N,)
    count = groups.size.to(values.dtype)  # (N,)
    factor = torch.where(groups.size > 1, count / (count - 1).clamp(min=1), 0.0)  # (N,)
    return group_centered(values / unit, groups) * factor * unit


@checks_environment
def passk_advantages(
    rewards: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: Any = None,
    scale: Literal["std", "none"] = "std",
    eps: Scalar = 1e-6,
) -> torch.Tensor:
    r"""Pass@k advantages: only the best response of each group is credited, by its margin.

    For group :math:`g` with best reward :math:`r^{(1)}_g` and second best :math:`r^{(2)}_g`,

    .. math::

        A_i = \frac{r^{(1)}_g - r^{(2)}_g}{\sigma_g + \epsilon} \ \text{for the best } i
        \ (\texttt{"std"}), \qquad r^{(1)}_g - r^{(2)}_g \ (\texttt{"none"}), \qquad
        A_i = 0 \text{ for every other } i,

    with :math:`\sigma_g` the unbiased std of the group. With tied best rewards the margin is 0,
    so every advantage of the group is 0 (the first of them is "the best"). A group of one
    sequence gets 0 (verl raises there). Equals verl ``adv_estimator="grpo_passk"``
    (``norm_adv_by_std_in_grpo`` True/False = ``"std"``/``"none"``, :math:`\epsilon=10^{-6}`),
    broadcast over the tokens.

    Args:
        rewards: ``(N,)`` sequence rewards.
        group_size: :math:`G \ge 1`, groups contiguous; or None with ``group_ids``.
        group_ids: ``(N,)`` group label per sequence (see :func:`group_relative_advantages`).
        scale: ``"std"`` or ``"none"``.
        eps: :math:`\epsilon \ge 0`, used by ``"std"``.

    Returns:
        ``(N,)`` advantages, nonzero only at each group's best response, float32 (float64 for
        float64 input); differentiable in the best and second-best rewards (and, through
        :math:`\sigma_g`, the whole group).

    Raises:
        ValueError: as :func:`group_relative_advantages`, or ``scale="batch"``.
        TypeError: on non-numeric rewards, a non-int ``group_size`` or invalid labels.

    References:
        Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
        Exploitation", arXiv:2503.19595 (the best-minus-second-best advantage); verl
        ``compute_grpo_passk_outcome_advantage``.

    Examples:
        >>> passk_advantages([1.0, 0.0, 0.5, 0.0, 2.0, 2.0], 3, scale="none")
        tensor([0.5000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000])

    .. versionadded:: 0.2.0
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids, minimum=1)  # (N,)
    validate_choice(scale, "scale", PASSK_SCALES)
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    unit = group_scale(values, groups)  # (N,)
    scaled = values / unit  # (N,)
    length = values.shape[0]
    positions = torch.arange(length, device=values.device)  # (N,)
    best_position = _first_position(scaled == segment_amax(scaled, groups), groups)  # (N,)
    is_best = positions == best_position
    rest = torch.where(is_best, -torch.inf, scaled.detach())  # (N,) the group without its best
    runner_position = _first_position(rest == segment_amax(rest, groups), groups)  # (N,)
    runner_position = torch.where(groups.size > 1, runner_position, best_position)
    margin = scaled[best_position] - scaled[runner_position]  # (N,) r1 - r2, in units
    if scale == "none":
        advantage = margin * unit
    else:
        std = _group_std(group_centered(scaled, groups), groups)  # (N,)
        advantage = divide_or_zero(margin, std + epsilon / unit)
    return torch.where(is_best, advantage, 0.0)


def _first_position(candidates: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(N,)`` smallest index of a True ``candidates`` entry in each sequence's group."""
    length = candidates.shape[0]
    positions = torch.arange(length, device=candidates.device)  # (N,)
    marked = torch.where(candidates, positions, length)  # (N,)
    if groups.fixed is not None and length:
        size = groups.fixed
        first = marked.reshape(-1, size).amin(-1, keepdim=True).expand(-1, size).reshape(-1)
    else:
        slots = torch.full_like(positions, length).scatter_reduce(0, groups.ids, marked, "amin")
        first = slots[groups.ids]  # (N,)
    return first.clamp(max=max(length - 1, 0))  # clamp: groups of NaN rewards


@checks_environment
def opo_advantages(
    rewards: ArrayLike,
    mask: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: Any = None,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""OPO advantages: reward minus the response-length-weighted mean reward of the group.

    With :math:`l_i = \sum_t M_{it}` the length of response :math:`i`,

    .. math::

        A_i = r_i - b_g, \qquad b_g = \frac{\sum_{j \in g} l_j r_j}{\sum_{j \in g} l_j},

    the optimal baseline of on-policy RL with a sequence-level reward and a token-level
    (length-weighted) gradient. A group of one sequence gets 0 (its baseline is its reward;
    verl's ``opo`` uses :math:`b = 0` there, returning the raw reward); a group whose responses
    are all empty uses the plain mean. Equals verl ``adv_estimator="opo"``, broadcast over the
    tokens. Identical rewards give exactly 0.

    Args:
        rewards: ``(N,)`` sequence rewards.
        mask: ``(N, T)`` response mask (bool or numeric; nonzero selects the token): the
            lengths :math:`l_i` are its row sums.
        group_size: :math:`G \ge 1`, groups contiguous; or None with ``group_ids``.
        group_ids: ``(N,)`` group label per sequence (see :func:`group_relative_advantages`).
        cu_seqlens: optional ``(N + 1,)`` boundaries of packed sequences: ``mask`` is then the
            packed ``(M,)`` or ``(1, M)`` response mask of the ``N`` sequences, and
            :math:`l_i` counts its selected tokens in the run ``cu_seqlens[i]:cu_seqlens[i+1]``.

    Returns:
        ``(N,)`` advantages, float32 (float64 for float64 input), on the device of ``rewards``.

    Raises:
        ValueError: as :func:`group_relative_advantages`, if ``mask`` is not ``(N, T)`` or
            on another device, or a malformed ``cu_seqlens``.
        TypeError: on non-numeric inputs, a non-int ``group_size`` or invalid labels.

    References:
        Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585 Eq. 4;
        verl ``compute_opo_outcome_advantage``.

    Examples:
        >>> opo_advantages([1.0, 0.0], [[1, 1, 1], [1, 0, 0]], 2)  # b = (3*1 + 1*0) / 4
        tensor([ 0.2500, -0.7500])

    .. versionadded:: 0.2.0
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids, minimum=1)  # (N,)
    packed = cu_seqlens is not None
    mask_t = token_matrix(as_mask(mask, "mask", values.device), "mask", packed)
    check_same_device({"rewards": values, "mask": mask_t})
    layout = sequence_layout(cu_seqlens, mask_t)
    if layout.num_sequences != values.shape[0]:
        shape = "S + 1 boundaries in cu_seqlens" if packed else f"shape {tuple(mask_t.shape)}"
        raise ValueError(
            f"mask must have shape (N, T) with N = {values.shape[0]} (one row per reward), or "
            f"packed sequences with N + 1 boundaries, got {shape}"
            + (f" ({layout.num_sequences + 1})" if packed else "")
        )
    lengths = layout.row_counts(mask_t).to(values.dtype)  # (N,)
    unit = group_scale(values, groups)  # (N,)
    scaled = values / unit  # (N,)
    shifted = scaled - scaled[groups.first]  # (N,) exact 0 for identical rewards
    total_length = segment_sum(lengths, groups)  # (N,)
    weighted_mean = divide_or_zero(segment_sum(lengths * shifted, groups), total_length)
    plain_mean = segment_sum(shifted, groups) / groups.size.to(values.dtype)
    baseline = torch.where(total_length > 0, weighted_mean, plain_mean)  # (N,)
    return (shifted - baseline) * unit


@checks_environment
def remax_advantages(
    rewards: ArrayLike,
    baseline_rewards: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""ReMax advantages: reward minus the reward of the greedy response to the same prompt.

    .. math::

        A_i = r_i - r^{greedy}_i \quad \text{(sequence rewards } (B,)\text{)}, \qquad
        A_{it} = \sum_{s \ge t,\ M_{is}=1} r_{is} - r^{greedy}_i \quad
        \text{(token rewards } (B, T)\text{, selected } t\text{)}.

    The token form equals verl ``adv_estimator="remax"`` (``returns`` = reward-to-go of the
    token-level rewards, ``advantages = returns - reward_baselines * mask``), with zeros at
    unselected tokens. The baseline is a constant of the policy gradient (pass a detached
    value).

    Args:
        rewards: ``(B,)`` sequence rewards, or ``(B, T)`` token-level rewards with ``mask``.
        baseline_rewards: ``(B,)`` or ``(B, 1)`` rewards of the greedy (argmax) responses.
        mask: ``(B, T)`` response mask for token-level ``rewards`` (required there, rejected
            for ``(B,)`` rewards).
        cu_seqlens: optional ``(B + 1,)`` boundaries of packed sequences for token-level
            rewards: ``rewards`` and ``mask`` are then ``(N,)`` or ``(1, N)`` and the
            reward-to-go restarts at every boundary.

    Returns:
        ``(B,)`` or ``(B, T)`` advantages (the shape of ``rewards``), float32 (float64 if an
        input is float64), on the device of ``rewards``; zeros at unselected tokens.

    Raises:
        ValueError: on mismatched shapes or devices, or ``mask`` missing for ``(B, T)`` rewards
            / given for ``(B,)`` rewards.
        TypeError: on non-numeric inputs.

    References:
        Li et al. 2024, ReMax, arXiv:2310.10505 Algorithm 1 (greedy baseline);
        verl ``compute_remax_outcome_advantage``.

    Examples:
        >>> remax_advantages([1.0, 0.0], [0.5, 0.5])
        tensor([ 0.5000, -0.5000])

    .. versionadded:: 0.2.0
    """
    if cu_seqlens is not None:
        return _packed_remax(rewards, baseline_rewards, mask, cu_seqlens)
    rewards_t = as_float_tensor(rewards, "rewards")
    device = rewards_t.device
    baseline = as_float_tensor(baseline_rewards, "baseline_rewards", device)
    check_same_device({"rewards": rewards_t, "baseline_rewards": baseline})
    batch = rewards_t.shape[0] if rewards_t.ndim >= 1 else -1
    if baseline.ndim == 2 and baseline.shape[1] == 1:
        baseline = baseline.squeeze(-1)
    if baseline.ndim != 1 or baseline.shape[0] != batch:
        raise ValueError(
            f"baseline_rewards must have shape (B,) or (B, 1) with B = {batch} (one greedy "
            f"reward per row of rewards), got shape {tuple(baseline.shape)}"
        )
    dtype = compute_dtype(rewards_t, baseline)
    if rewards_t.ndim == 1:
        if mask is not None:
            raise ValueError(
                "mask applies to (B, T) token-level rewards only; got (B,) sequence rewards "
                "and a mask (drop the mask, or pass the token-level rewards)"
            )
        return rewards_t.to(dtype) - baseline.to(dtype)
    if rewards_t.ndim != 2 or mask is None:
        raise ValueError(
            "rewards must have shape (B,) (sequence rewards), or (B, T) token-level rewards "
            f"together with a (B, T) mask; got shape {tuple(rewards_t.shape)} and "
            f"{'no mask' if mask is None else 'a mask'}"
        )
    mask_t = as_batch_matrix(as_mask(mask, "mask", device), "mask")
    check_same_device({"rewards": rewards_t, "mask": mask_t})
    if tuple(mask_t.shape) != tuple(rewards_t.shape):
        raise ValueError(
            f"mask must have the same shape as rewards {tuple(rewards_t.shape)}, got shape "
            f"{tuple(mask_t.shape)}"
        )
    selected = masked_fill_zero(rewards_t.to(dtype), mask_t)  # (B, T)
    reward_to_go = selected.flip(-1).cumsum(-1).flip(-1)  # (B, T)
    return masked_fill_zero(reward_to_go - baseline.to(dtype).unsqueeze(-1), mask_t)


def _packed_remax(
    rewards: ArrayLike, baseline_rewards: ArrayLike, mask: ArrayLike | None, cu_seqlens: ArrayLike
) -> torch.Tensor:
    """:func:`remax_advantages` of packed token-level rewards ``(N,)`` / ``(1, N)``."""
    if mask is None:
        raise ValueError("mask is required with cu_seqlens (packed token-level rewards), got None")
    rewards_in = as_float_tensor(rewards, "rewards")
    rewards_t = token_matrix(rewards_in, "rewards", True)  # (1, N)
    device = rewards_t.device
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", True)
    baseline = as_float_tensor(baseline_rewards, "baseline_rewards", device)
    check_same_device({"rewards": rewards_t, "mask": mask_t, "baseline_rewards": baseline})
    if tuple(mask_t.shape) != tuple(rewards_t.shape):
        raise ValueError(
            f"mask must have the same shape as rewards {tuple(rewards_t.shape)}, got shape "
            f"{tuple(mask_t.shape)}"
        )
    layout = sequence_layout(cu_seqlens, rewards_t)
    baseline = per_sequence(baseline, "baseline_rewards", layout, "cu_seqlens")
    dtype = compute_dtype(rewards_t, baseline)
    reward_to_go = segment_discounted_sum(rewards_t.to(dtype), mask_t, layout, 1.0)  # (1, N)
    advantages = masked_fill_zero(reward_to_go - layout.expand(baseline.to(dtype)), mask_t)
    return token_output(advantages, rewards_in.ndim == 1)
