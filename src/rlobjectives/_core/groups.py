r"""Groups of sequences (the responses to one prompt) as dense segment ids.

A batch of :math:`N` sequences is split into groups either by a fixed ``group_size`` (groups
contiguous: rows ``g*G .. g*G + G-1``) or by ``group_ids``, one label per sequence (verl's
``index``: groups of any size, in any order). Both become :class:`Groups`: a dense id in
``[0, N)`` per sequence, so that every per-group statistic is one ``index_add`` /
``scatter_reduce`` over ``N`` slots (static shapes, no Python loop over groups, no host sync,
traceable by ``torch.compile``). Labels given as a tensor are made dense with a stable sort;
labels given as a Python sequence or NumPy array of any hashable values (verl's uid strings)
are numbered on the host at the boundary.

The group-relative advantages (:mod:`rlobjectives.advantages`) and the ``"prompt_mean"``
reduction (:mod:`rlobjectives._core.reduction`) read the same groups.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

__all__ = ["Groups", "groups_of", "segment_log1p_sum_exp", "segment_sum", "validate_group_size"]


class Groups(NamedTuple):
    """Group structure of ``N`` sequences (every tensor ``(N,)``, on the given device).

    Attributes:
        ids: int64 dense group id in ``[0, N)`` of each sequence.
        first: int64 position of the first sequence of the same group (the smallest index).
        size: int64 number of sequences in the same group.
        fixed: the group size ``G`` for contiguous groups of equal size (reductions then use a
            ``(N/G, G)`` view, faster than a scatter), None for ``group_ids``.
    """

    ids: torch.Tensor
    first: torch.Tensor
    size: torch.Tensor
    fixed: int | None = None


def validate_group_size(group_size: object, minimum: int) -> int:
    """``group_size`` as an int >= ``minimum`` (``TypeError``/``ValueError`` otherwise)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"group_size must be an int, got {type(group_size).__name__} ({group_size!r})"
        )
    if group_size < minimum:
        raise ValueError(f"group_size must be >= {minimum}, got {group_size}")
    return group_size


def segment_sum(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(N,)``: the sum of ``values`` ``(N,)`` over each sequence's group."""
    if groups.fixed is not None:
        size = groups.fixed
        return values.reshape(-1, size).sum(-1, keepdim=True).expand(-1, size).reshape(-1)
    totals = values.new_zeros(values.shape[0]).index_add(0, groups.ids, values)  # (N,) slots
    return totals[groups.ids]


def segment_log1p_sum_exp(
    values: torch.Tensor, present: torch.Tensor, segments: torch.Tensor, count: int
) -> torch.Tensor:
    r""":math:`\log(1 + \sum_{i \in k} e^{v_i})` per segment ``k < count``, stable for any values.

    ``values``, ``present`` (bool: the entries that take part) and ``segments`` (int64 ids) are
    ``(S,)``; the shift is :math:`m_k = \max(0, \max_{i \in k} v_i)` (the 1 included), detached.
    """
    zero = torch.zeros(count, dtype=values.dtype, device=values.device)
    members = torch.where(present, values.detach(), torch.full_like(values, -torch.inf))
    top = zero.scatter_reduce(0, segments, members, "amax")  # max(0, values)
    shifted = torch.where(present, torch.exp(values - top[segments]), 0.0)
    return torch.log(torch.exp(-top).index_add(0, segments, shifted)) + top  # e^-m + sum e^(v-m)


def fixed_groups(length: int, group_size: int, device: torch.device) -> Groups:
    """:class:`Groups` of ``length`` sequences in contiguous groups of ``group_size``."""
    positions = torch.arange(length, device=device)  # (N,)
    ids = torch.div(positions, group_size, rounding_mode="floor")  # (N,)
    return Groups(
        ids=ids, first=ids * group_size, size=torch.full_like(ids, group_size), fixed=group_size
    )


def _labels_to_tensor(
    group_ids: Any, length: int, device: torch.device, unit: str, reference: str
) -> torch.Tensor:
    """Integer labels as an int64 tensor; other hashable labels numbered on the host."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise TypeError(
                f"group_ids must hold integer labels (or be a sequence of hashable labels such "
                f"as strings), got a tensor of dtype {group_ids.dtype}"
            )
        return group_ids
    if isinstance(group_ids, (str, bytes)) or not hasattr(group_ids, "__len__"):
        raise TypeError(
            "group_ids must be a 1-D tensor, NumPy array or sequence with one group label per "
            f"sequence, got {type(group_ids).__name__}"
        )
    array_ndim = getattr(group_ids, "ndim", 1)
    if array_ndim != 1:
        raise ValueError(
            f"group_ids must be 1-D (one label per sequence), got shape "
            f"{tuple(getattr(group_ids, 'shape', ()))}"
        )
    labels = list(group_ids)
    if len(labels) != length:
        raise ValueError(
            f"group_ids must have one label per {unit}: expected length {length} ({reference}), "
            f"got {len(labels)}"
        )
    numbering: dict[Any, int] = {}
    for position, label in enumerate(labels):
        if isinstance(label, float) or (
            isinstance(label, numbers.Real) and not isinstance(label, numbers.Integral)
        ):
            raise TypeError(
                f"group_ids must hold integer or other exact labels, got the float {label!r} "
                f"at group_ids[{position}]"
            )
        try:
            numbering.setdefault(label, len(numbering))
        except TypeError:
            raise TypeError(
                f"group_ids[{position}] is not hashable ({type(label).__name__}); group labels "
                "must be integers, strings or other hashable values"
            ) from None
    return torch.tensor([numbering[label] for label in labels], dtype=torch.int64, device=device)


def _groups_from_ids(
    group_ids: Any, length: int, device: torch.device, unit: str, reference: str
) -> Groups:
    labels = _labels_to_tensor(group_ids, length, device, unit, reference)
    if labels.ndim != 1 or labels.shape[0] != length:
        raise ValueError(
            f"group_ids must have shape (N,) with N = {length} (one label per {unit}), got "
            f"shape {tuple(labels.shape)}"
        )
    if labels.device != device:
        raise ValueError(
            f"group_ids must be on the same device as {reference} ({device}), got device "
            f"{labels.device}"
        )
    labels = labels.to(torch.int64)
    order = torch.sort(labels, stable=True).indices  # (N,) equal labels adjacent, in order
    ordered = labels[order]  # (N,)
    starts = torch.ones_like(ordered, dtype=torch.bool)  # (N,) a new group starts here
    starts[1:] = ordered[1:] != ordered[:-1]
    dense_sorted = starts.long().cumsum(0) - 1  # (N,)
    ids = torch.empty_like(dense_sorted).scatter_(0, order, dense_sorted)  # (N,) original order
    positions = torch.arange(length, device=device)  # (N,)
    first_slots = torch.full_like(positions, length).scatter_reduce(0, ids, positions, "amin")
    count_slots = torch.zeros_like(positions).index_add(0, ids, torch.ones_like(positions))
    return Groups(ids=ids, first=first_slots[ids], size=count_slots[ids])


def groups_of(
    group_size: object,
    group_ids: Any,
    length: int,
    device: torch.device,
    *,
    minimum: int = 1,
    unit: str = "reward",
    reference: str = "rewards",
) -> Groups:
    """The groups of ``length`` sequences from exactly one of ``group_size`` and ``group_ids``.

    ``group_size``: contiguous groups of equal size (``length`` divisible by it, at least
    ``minimum``); ``group_ids``: one label per sequence. ``unit`` and ``reference`` name what the
    sequences are in the messages (``"reward"`` / ``"rewards"``, ``"sequence"`` / ...).
    """
    if (group_size is None) == (group_ids is None):
        raise ValueError(
            "pass exactly one of group_size (contiguous groups of equal size) and group_ids "
            f"(one group label per sequence), got group_size={group_size!r} and group_ids="
            f"{'None' if group_ids is None else type(group_ids).__name__}"
        )
    if group_ids is not None:
        return _groups_from_ids(group_ids, length, device, unit, reference)
    size = validate_group_size(group_size, minimum)
    if length % size != 0 and unit == "sequence":
        raise ValueError(
            f"group_size {size} does not divide the {length} sequences; expected B*G "
            "sequences with the G responses of each prompt contiguous (or pass group_ids)"
        )
    if length % size != 0:
        raise ValueError(
            f"{reference} length {length} is not divisible by group_size {size}; expected B*G "
            f"{unit}s with the G responses of each prompt contiguous"
        )
    return fixed_groups(length, size, device)
