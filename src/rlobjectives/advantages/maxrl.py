r"""MaxRL: the maximum-likelihood advantage :math:`(r - \mu_g)/\mu_g` of binary-reward groups.

For binary rewards the policy gradient of :math:`\log P(\text{success})` is
:math:`\frac{1}{N_{succ}}\sum_{succ}\nabla\log\pi - \frac{1}{N}\sum\nabla\log\pi` per group,
i.e. the advantage :math:`(r_i - \mu_g)/\mu_g` (arXiv:2602.02710): GRPO's centred reward
divided by the success rate instead of the standard deviation. A group without success carries
no signal.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.validation import ArrayLike, Scalar, checks_environment, validate_scalar
from .groups import group_centered, group_scale, grouped_rewards, segment_sum
from .whitening import divide_or_zero

__all__ = ["maxrl_advantages"]


@checks_environment
def maxrl_advantages(
    rewards: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: Any = None,
    eps: Scalar = 0.0,
) -> torch.Tensor:
    r"""MaxRL advantages of a flat ``(N,)`` reward vector (non-negative, canonically binary).

    For sequence :math:`i` of group :math:`g` with :math:`n_g` members and mean reward
    :math:`\mu_g`,

    .. math::

        A_i = \frac{r_i - \mu_g}{\mu_g + \epsilon} \quad (\mu_g > 0,\ n_g \ge 2), \qquad
        A_i = 0 \quad \text{otherwise}.

    For binary rewards :math:`A_i = 1/\hat p_g - 1` on successes and :math:`-1` on failures
    (:math:`\hat p_g = \mu_g` the group's success rate), the unbiased estimate of
    :math:`\nabla\log p(\text{success})` per group; a group with no success (or of one
    sequence) gives 0. Rewards are not checked for sign on the device (no host sync): a group
    of negative mean gives 0. Identical rewards give exactly 0.

    Peers: prime-rl ``MaxRLAlgorithm.score_group`` (:math:`\mu \le 0 \Rightarrow 0`, no
    :math:`\epsilon`): ``eps=0`` (the default); SkyRL ``compute_maxrl_advantage``:
    ``eps=1e-6`` (equal for groups of at least two with :math:`\mu_g > 0`; SkyRL gives a group
    of one its raw reward, prime-rl and this function 0; for a negative mean SkyRL returns
    nonzero values, this function 0).

    Args:
        rewards: ``(N,)`` sequence rewards (``N = B*G`` with ``group_size``).
        group_size: :math:`G \ge 1`, the groups being contiguous; or None with ``group_ids``.
        group_ids: ``(N,)`` group label per sequence (see
            :func:`rlobjectives.group_relative_advantages`).
        eps: :math:`\epsilon \ge 0` added to :math:`\mu_g` (number or 0-d tensor).

    Returns:
        ``(N,)`` advantages on the device of ``rewards``, float32 (float64 for float64 input).

    Raises:
        ValueError: as :func:`rlobjectives.group_relative_advantages` (shape, grouping), or a
            negative/non-finite ``eps``.
        TypeError: on non-numeric rewards, a non-int ``group_size`` or invalid labels.

    References:
        Maximum Likelihood Reinforcement Learning (MaxRL), arXiv:2602.02710 (the advantage
        :math:`(r - \mu)/\mu`); prime-rl ``orchestrator/algo/max_rl.py``; SkyRL
        ``compute_maxrl_advantage``.

    Examples:
        >>> maxrl_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], 4)
        tensor([ 3.0000, -1.0000, -1.0000, -1.0000,  0.3333,  0.3333,  0.3333, -1.0000])

    .. versionadded:: 0.3.0
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids, minimum=1)  # (N,)
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    unit = group_scale(values, groups)  # (N,) power of two per group
    scaled = values / unit  # (N,)
    centered = group_centered(scaled, groups)  # (N,) (r - mu_g) / unit, exact 0 if identical
    mean = segment_sum(scaled, groups) / groups.size.to(values.dtype)  # (N,) mu_g / unit
    signal = (mean > 0) & (groups.size > 1)  # (N,)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    numerator = torch.where(signal, centered, zero)
    denominator = torch.where(signal, mean + epsilon / unit, zero)
    return divide_or_zero(numerator, denominator)
