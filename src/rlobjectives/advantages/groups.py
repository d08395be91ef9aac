r"""Grouped rewards and the segment reductions of the group-relative advantages.

The groups themselves (a dense id per sequence from ``group_size`` or ``group_ids``) are
:mod:`rlobjectives._core.groups`, shared with the ``"prompt_mean"`` reduction; here: the
rewards' validation with their groups, the group maximum, scale and centring.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.groups import Groups, fixed_groups, groups_of, segment_sum, validate_group_size
from .._core.validation import ArrayLike, as_float_tensor, compute_dtype
from .whitening import power_of_two_scale

__all__ = [
    "Groups",
    "contiguous_groups",
    "group_centered",
    "group_scale",
    "grouped_rewards",
    "segment_amax",
    "segment_sum",
    "validate_group_size",
]


def grouped_rewards(
    rewards: ArrayLike,
    group_size: object,
    group_ids: Any,
    *,
    minimum: int = 1,
    name: str = "rewards",
) -> tuple[torch.Tensor, Groups]:
    """Validate ``(N,)`` rewards and their grouping; return them in compute dtype with the groups.

    Exactly one of ``group_size`` (groups contiguous, ``N`` divisible by it) and ``group_ids``
    (one label per reward) must be given.
    """
    rewards_t = as_float_tensor(rewards, name)
    if rewards_t.ndim != 1:
        raise ValueError(
            f"{name} must have shape (B*G,) (1 dimension: one reward per sequence), got shape "
            f"{tuple(rewards_t.shape)}"
        )
    groups = groups_of(
        group_size, group_ids, rewards_t.shape[0], rewards_t.device, minimum=minimum, reference=name
    )
    return rewards_t.to(compute_dtype(rewards_t)), groups


def segment_amax(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(N,)``: the maximum of ``values`` ``(N,)`` over each sequence's group (no gradient)."""
    values = values.detach()
    if groups.fixed is not None:
        size = groups.fixed
        if values.numel() == 0:
            return values
        return values.reshape(-1, size).amax(-1, keepdim=True).expand(-1, size).reshape(-1)
    slots = torch.full_like(values, -torch.inf)
    return slots.scatter_reduce(0, groups.ids, values, "amax")[groups.ids]


def group_scale(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(N,)`` power of two near each group's largest magnitude (see ``power_of_two_scale``)."""
    return power_of_two_scale(segment_amax(values.abs(), groups))


def group_centered(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``x - mean_g(x)`` per group, ``(N,)``; exact 0 for a group of identical values.

    The mean is taken of the differences to the group's first value, so identical values give
    exact zeros (``mean([0.1] * 3) != 0.1`` in floating point, while ``0.1 - 0.1 == 0``).
    """
    shifted = values - values[groups.first]  # (N,)
    mean = segment_sum(shifted, groups) / groups.size.to(values.dtype)  # (N,)
    return shifted - mean


def contiguous_groups(length: int, group_size: int, device: torch.device) -> Groups:
    """:class:`Groups` of ``length`` sequences in contiguous groups of ``group_size``."""
    return fixed_groups(length, group_size, device)
