r"""Entropy in the policy loss: the high-entropy token mask ("80/20" forking tokens).

:func:`top_entropy_mask` keeps the selected tokens whose entropy is at or above a quantile of
the selected tokens' entropies (TRL's ``get_high_entropy_mask``, on one process);
:func:`rlobjectives.distributed.global_top_entropy_mask` takes the quantile over the selected
tokens of every rank. Both compute the threshold with :func:`entropy_threshold`: the
linear-interpolation quantile of ``torch.quantile``, from a sort of a fixed-size tensor (no
boolean indexing, no host synchronisation, no ``torch.quantile`` size limit of :math:`2^{24}`).

The entropy bonus itself (``entropy=``, ``entropy_coef=``) is a term of
:func:`rlobjectives.policy_loss` and :func:`rlobjectives.fused_policy_loss_from_hidden`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._core.context import gather_padded
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    validate_context_group,
    validate_scalar,
)

__all__ = [
    "entropy_mask_over_group",
    "entropy_threshold",
    "prepare_entropy_mask_args",
    "top_entropy_mask",
]


def prepare_entropy_mask_args(
    entropy: ArrayLike, mask: ArrayLike, quantile: Scalar
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Validate ``(entropy, mask, quantile)``: ``(B, T)`` tensors and ``0 <= quantile <= 1``."""
    entropy_t = as_batch_matrix(as_float_tensor(entropy, "entropy"), "entropy")
    mask_t = as_batch_matrix(as_mask(mask, "mask", entropy_t.device), "mask")
    check_same_device({"entropy": entropy_t, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(entropy_t.shape), "entropy")
    level = float(validate_scalar(quantile, "quantile", minimum=0.0, allow_tensor=False))
    if level > 1.0:
        raise ValueError(f"quantile must be <= 1 (a quantile level in [0, 1]), got {level}")
    return entropy_t.detach(), mask_t, level


def entropy_threshold(
    values: torch.Tensor, count: torch.Tensor, quantile: float, has_nan: torch.Tensor
) -> torch.Tensor:
    """The ``quantile`` of ``count`` selected values, as ``torch.quantile(..., "linear")``.

    Args:
        values: ``(K,)`` the selected values followed (in any order) by ``+inf`` fillers.
        count: ``()`` the number of selected values (int64); 0 gives an unused threshold.
        quantile: the level ``q`` in ``[0, 1]``.
        has_nan: ``()`` bool, whether a selected value is NaN (the threshold is then NaN, as
            ``torch.quantile`` gives).

    Returns:
        ``()`` the threshold ``v_(lo) + (rank - lo) (v_(hi) - v_(lo))`` with
        ``rank = q (count - 1)`` computed in the dtype of ``values`` (``torch.lerp``).
    """
    if values.numel() == 0:  # nothing to sort (a static shape): an unused threshold
        return torch.full((), float("nan"), dtype=values.dtype, device=values.device)
    ordered = torch.sort(values).values  # (K,), the selected values first
    level = torch.tensor(quantile, dtype=values.dtype, device=values.device)
    rank = level * (count - 1).clamp(min=0)  # () in the values' dtype, as torch.quantile
    below = rank.to(torch.int64)
    above = rank.ceil().to(torch.int64)
    last = values.numel() - 1
    low = ordered.gather(0, below.clamp(max=last).reshape(1))
    high = ordered.gather(0, above.clamp(max=last).reshape(1))
    threshold = torch.lerp(low, high, (rank - below.to(values.dtype)).reshape(1)).squeeze(0)
    return torch.where(has_nan, torch.full_like(threshold, float("nan")), threshold)


def entropy_mask_over_group(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    level: float,
    group: dist.ProcessGroup | None,
    active: bool,
) -> torch.Tensor:
    """The mask with the threshold over the selected entropies of every rank of ``group``.

    ``entropy`` and ``mask`` are validated ``(B, T)`` tensors (detached). ``active``: a process
    group is initialised (else the threshold is this rank's, :func:`top_entropy_mask`). One
    ``all_gather`` of the per-rank counts (read on the host to size the next one), one of the
    entropies padded with ``+inf``, one ``all_reduce`` of the count.
    """
    dtype = torch.promote_types(entropy.dtype, torch.float32)
    values = entropy.to(dtype)
    with torch.no_grad():
        selected = values[mask]  # (n,) this rank's selected entropies (a host sync)
        count = torch.tensor(selected.numel(), dtype=torch.int64, device=values.device)
        if active:
            gathered = gather_padded(selected, group, float("inf"))
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        else:
            gathered = selected
        # NaN only comes from a selected entropy: the padding is +inf
        threshold = entropy_threshold(gathered, count, level, torch.isnan(gathered).any())
    return (values >= threshold) & mask


@checks_environment
def top_entropy_mask(
    entropy: ArrayLike,
    mask: ArrayLike,
    *,
    quantile: float,
    context_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    r"""The selected tokens whose entropy is at or above the ``quantile`` of the selected ones.

    .. math::

        K_{it} = M_{it} \wedge \big(H_{it} \ge Q_q(\{H_{js} : M_{js}\})\big),

    with :math:`Q_q` the linear-interpolation quantile of ``torch.quantile``. ``quantile=1 - ρ``
    keeps the top :math:`\rho` fraction of the tokens (ties at the threshold are kept, so
    possibly more); ``quantile=0`` keeps every selected token, ``quantile=1`` only the
    highest-entropy ones. Multiply the policy loss by it through ``mask`` or, as TRL does
    (denominators over all selected tokens), through ``importance_weights=K.float()``.

    Equal to TRL's ``GRPOTrainer.get_high_entropy_mask(entropies, mask, threshold)`` on one
    process with ``threshold = quantile``; TRL's config ``top_entropy_quantile=ρ`` calls it with
    ``threshold = 1 - ρ``, so ``top_entropy_quantile=ρ`` is ``quantile=1 - ρ`` here. With
    several data-parallel ranks TRL takes the quantile over every rank's tokens: use
    :func:`rlobjectives.distributed.global_top_entropy_mask` for that. Context parallelism
    (``context_group``): the quantile of the selected tokens of the whole sequences, i.e. of
    every rank of the group (one gather of the selected entropies); each rank gets the mask of
    its own tokens. (Data x context parallelism with TRL's all-rank quantile:
    ``global_top_entropy_mask`` over the group of all those ranks, each token counted once.)

    Args:
        entropy: ``(B, T)`` per-token entropies (any float dtype; not differentiated).
        mask: ``(B, T)`` bool/numeric; nonzero selects the token. Unselected entries (NaN/inf
            included) never enter the quantile and are never kept.
        quantile: the quantile level :math:`q`, ``0 <= q <= 1`` (a Python number).
        context_group: the process group of the ranks holding the other tokens of the same
            sequences (context parallelism), or None.

    Returns:
        ``(B, T)`` bool mask, a subset of ``mask``; all False when nothing is selected. The
        quantile is computed in float32 (float64 for float64 entropies; TRL rounds those to
        float32 first), without ``torch.quantile``'s :math:`2^{24}`-element limit. A NaN entropy
        at a selected token makes the threshold NaN: nothing is kept (as in TRL).

    Raises:
        ValueError: on shapes or devices that differ, or ``quantile`` outside ``[0, 1]``.
        TypeError: on non-numeric inputs or a tensor ``quantile``.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
        Reinforcement Learning for LLM Reasoning", arXiv:2506.01939 Sec. 4 (Eq. 5).

    Examples:
        >>> import torch
        >>> entropy = torch.tensor([[0.5, 2.0, 1.0], [1.5, 0.2, 9.0]])
        >>> mask = torch.tensor([[True, True, True], [True, True, False]])
        >>> top_entropy_mask(entropy, mask, quantile=0.5)  # median of 5 values: 1.0
        tensor([[False,  True,  True],
                [ True, False, False]])

    .. versionadded:: 0.2.0
    """
    entropy_t, mask_t, level = prepare_entropy_mask_args(entropy, mask, quantile)
    context = validate_context_group(context_group)
    if context is not None:
        return entropy_mask_over_group(entropy_t, mask_t, level, context.group, True)
    dtype = torch.promote_types(entropy_t.dtype, torch.float32)
    values = entropy_t.to(dtype)
    filler = torch.full((), float("inf"), dtype=dtype, device=values.device)
    selected = torch.where(mask_t, values, filler).reshape(-1)  # (B T,)
    has_nan = (torch.isnan(values) & mask_t).any()
    threshold = entropy_threshold(selected, mask_t.sum(), level, has_nan)
    return (values >= threshold) & mask_t
