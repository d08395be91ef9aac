"""The bodies of the public :mod:`rlobjectives.distributed` functions (collectives).

Kept apart so that the public module reads as its API and documentation. Every function here
is called once per public call, after nothing else has validated its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from .._core.context import ContextGroup, context_sum
from .._core.layout import sequence_layout, token_matrix
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_context_group,
    validate_scalar,
)
from ..advantages.whitening import combine_moments, local_moments, validate_flag
from ..rollout.metrics import combine_extremes, extremum_rules, place_extremes

__all__ = [
    "check_context_pairing",
    "count_over_ranks",
    "process_group_active",
    "sum_over_ranks",
    "whiten_over_ranks",
]

_DiagnosticsT = TypeVar("_DiagnosticsT", bound=tuple[torch.Tensor, ...])


def process_group_active(group: dist.ProcessGroup | None) -> bool:
    """Whether collectives must run: True when a process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "group was given but no torch.distributed process group is initialised; "
                "call torch.distributed.init_process_group first, or pass group=None for the "
                "single-process case"
            )
        return False
    return True


def _as_mask_list(
    masks: Sequence[ArrayLike] | torch.Tensor, packed: Sequence[bool] | None = None
) -> list[torch.Tensor]:
    """One ``(B, T)`` bool mask per micro-batch (packed: ``(1, N)``); a tensor is one."""
    if isinstance(masks, torch.Tensor):
        items: list[object] = [masks]
    elif isinstance(masks, (list, tuple)):
        items = list(masks)
    else:
        raise TypeError(
            "masks must be a (B, T) torch.Tensor or a list/tuple of (B, T) masks (one per "
            f"micro-batch), got {type(masks).__name__}"
        )
    tensors: list[torch.Tensor] = []
    for index, item in enumerate(items):
        name = f"masks[{index}]"
        device = tensors[0].device if tensors else None
        is_packed = packed is not None and index < len(packed) and packed[index]
        tensors.append(token_matrix(as_mask(item, name, device), name, is_packed))
    for index, tensor in enumerate(tensors[1:], start=1):
        if tensor.device != tensors[0].device:
            raise ValueError(
                f"masks[{index}] must be on the same device as masks[0] ({tensors[0].device}), "
                f"got device {tensor.device}"
            )
    return tensors


def _as_boundaries(
    cu_seqlens: Sequence[ArrayLike | None] | torch.Tensor | None,
    masks: Sequence[ArrayLike] | torch.Tensor,
) -> list[ArrayLike | None]:
    """One ``cu_seqlens`` (or None) per micro-batch, matching ``masks``; [] when none given."""
    if cu_seqlens is None:
        return []
    if isinstance(masks, torch.Tensor):
        return [cu_seqlens]  # one mask: its (S + 1,) boundaries
    count = len(masks) if isinstance(masks, (list, tuple)) else -1
    if isinstance(cu_seqlens, torch.Tensor) or len(cu_seqlens) != count:
        raise ValueError(
            f"cu_seqlens must be a list with one entry (a tensor, or None for a padded mask) "
            f"per mask ({count}), got {type(cu_seqlens).__name__}"
        )
    return list(cu_seqlens)


def check_context_pairing(group: dist.ProcessGroup | None, context: ContextGroup) -> None:
    """``group`` (the data-parallel group) must share exactly this rank with ``context``.

    The data-parallel group holds one rank of each context group (different sequences); a group
    that contains other ranks of this rank's context group would count their (already summed)
    sequences again.
    """
    data_ranks = set(dist.get_process_group_ranks(group or dist.group.WORLD))  # type: ignore[arg-type]
    context_ranks = set(dist.get_process_group_ranks(context.group))
    if data_ranks & context_ranks != {dist.get_rank()}:
        raise ValueError(
            "group must be the data-parallel group when context_group is given: it must share "
            f"only this rank (global rank {dist.get_rank()}) with context_group, got group "
            f"ranks {sorted(data_ranks)} and context_group ranks {sorted(context_ranks)} (with "
            "context parallelism alone, the data-parallel group of each rank is that rank: "
            "torch.distributed.new_group([rank]) or a device mesh's data-parallel dimension)"
        )


def count_over_ranks(
    masks: Sequence[ArrayLike] | torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device | str | None,
    cu_seqlens: Sequence[ArrayLike | None] | torch.Tensor | None,
    context_group: object = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, sequences_nonempty, sequences)`` of every mask, summed over the ranks.

    With a context group, each sequence's counts are first summed over the context group (one
    all-reduce of every micro-batch's ``(S,)`` counts, concatenated), then the three totals over
    the data-parallel ``group``.
    """
    boundaries = _as_boundaries(cu_seqlens, masks)
    tensors = _as_mask_list(masks, [cu is not None for cu in boundaries])
    boundaries = boundaries or [None] * len(tensors)
    active = process_group_active(group)
    context = validate_context_group(context_group)
    if context is not None:
        check_context_pairing(group, context)
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"device must be a torch.device or a device string, got {device!r} ({error})"
            ) from None
    elif tensors:
        target = tensors[0].device
    else:
        target = torch.device("cpu")
    with torch.no_grad():
        per_sequence = [
            sequence_layout(cu, mask).local_row_counts(mask).to(target)  # (B,) or (S,)
            for mask, cu in zip(tensors, boundaries, strict=True)
        ]
        every = torch.cat([torch.zeros(0, dtype=torch.int64, device=target), *per_sequence])
        if context is not None:  # whole sequences: one all-reduce over the context group
            (every,) = context_sum(context, every)
        counts = torch.stack(
            [
                every.sum(),
                (every > 0).sum(),
                torch.tensor(every.numel(), dtype=torch.int64, device=target),
            ]
        )  # (3,)
        if active:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return counts[0], counts[1], counts[2]


def _check_diagnostics(
    diagnostics: Sequence[_DiagnosticsT] | _DiagnosticsT,
) -> list[_DiagnosticsT]:
    """The NamedTuples to combine: one type, every field a 0-d floating tensor."""
    items: list[_DiagnosticsT]
    if isinstance(diagnostics, list) or (
        isinstance(diagnostics, tuple) and not hasattr(diagnostics, "_fields")
    ):
        items = list(cast("Sequence[_DiagnosticsT]", diagnostics))
    else:
        items = [cast("_DiagnosticsT", diagnostics)]
    if not items:
        raise ValueError("diagnostics must hold at least one NamedTuple of 0-d tensors, got []")
    kind = type(items[0])
    if not hasattr(items[0], "_fields"):
        raise ValueError(
            f"diagnostics must be NamedTuples of 0-d tensors, got {kind.__name__} at index 0"
        )
    for index, item in enumerate(items):
        if type(item) is not kind:
            raise ValueError(
                f"diagnostics[{index}] must be a {kind.__name__} like diagnostics[0], got "
                f"{type(item).__name__}"
            )
        for field, value in zip(item._fields, item, strict=True):  # type: ignore[attr-defined]
            if (
                not isinstance(value, torch.Tensor)
                or value.ndim != 0
                or not value.is_floating_point()
            ):
                raise ValueError(
                    f"diagnostics[{index}].{field} must be a 0-d floating tensor, got "
                    f"{type(value).__name__}"
                    + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
                )
    return items


def sum_over_ranks(
    diagnostics: Sequence[_DiagnosticsT] | _DiagnosticsT, *, group: dist.ProcessGroup | None
) -> _DiagnosticsT:
    """The fields summed over the pieces and the ranks; extremum fields by min/max."""
    items = _check_diagnostics(diagnostics)
    kind = type(items[0])
    active = process_group_active(group)
    first = items[0]
    dtype = first[0].dtype
    for value in first:
        dtype = torch.promote_types(dtype, value.dtype)
    with torch.no_grad():
        stacked = torch.stack([torch.stack([v.detach().to(dtype) for v in item]) for item in items])
        totals = stacked.sum(dim=0)  # (fields,)
        if active:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        rules = extremum_rules(first)
        if rules:
            extremes = combine_extremes(stacked, rules)  # (rules,), minima negated
            if active:
                dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            totals = place_extremes(totals, extremes, rules)
    values = [totals[k].to(first[k].dtype) for k in range(len(first))]
    return kind(*values)


def whiten_over_ranks(
    values: ArrayLike,
    mask: ArrayLike,
    *,
    group: dist.ProcessGroup | None,
    shift_mean: bool,
    unbiased: bool,
    eps: Scalar,
) -> torch.Tensor:
    """Whitening with the global count, mean and M2 (one ``all_reduce`` of a ``(W, 3)`` table)."""
    values_t = as_float_tensor(values, "values")
    mask_t = as_mask(mask, "mask", values_t.device)
    check_same_device({"values": values_t, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(values_t.shape), "values")
    validate_flag(shift_mean, "shift_mean")
    validate_flag(unbiased, "unbiased")
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    active = process_group_active(group)
    dtype = compute_dtype(values_t)
    with torch.no_grad():
        local = local_moments(values_t.detach(), mask_t)  # (3,) float64
        if active:
            rows = local.new_zeros(dist.get_world_size(group), 3)  # (W, 3)
            rows[dist.get_rank(group)] = local
            dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
        else:
            rows = local.unsqueeze(0)  # (1, 3)
        total, mean, m2 = combine_moments(rows)
        divisor = (total - 1).clamp(min=1) if unbiased else total.clamp(min=1)
        denominator = m2 / divisor + float(epsilon)  # () float64
        positive = denominator > 0
        inverse = torch.where(positive, torch.rsqrt(torch.where(positive, denominator, 1.0)), 0.0)
        centered = values_t.to(torch.float64) - mean
        whitened = centered * inverse + (0.0 if shift_mean else mean)
        return masked_fill_zero(whitened.to(dtype), mask_t)
