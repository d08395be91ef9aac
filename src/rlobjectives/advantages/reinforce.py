r"""REINFORCE++ token advantages: discounted token returns, whitened over the whole batch.

``(B, T)`` tensors and a mask; unselected tokens are not part of the trajectory (their rewards
are ignored, their advantages are 0) and NaN/inf there never reaches the outputs. On packed
sequences (``cu_seqlens``) the recursion restarts at every sequence boundary
(:mod:`rlobjectives.advantages.scans`). Float32 results (float64 when an input is float64).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from .._core.context import context_max
from .._core.layout import Layout, per_sequence, sequence_layout, token_matrix, token_output
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_choice,
    validate_context_group,
    validate_scalar,
)
from .groups import group_centered, grouped_rewards
from .scans import HOLES, Holes, context_scan, discounted_sum, validate_discount
from .whitening import divide_or_zero, masked_moments, power_of_two_scale, safe_sqrt, validate_flag

__all__ = ["reinforce_plus_plus_advantages"]


def _max_abs(values: torch.Tensor) -> torch.Tensor:
    """0-d largest magnitude of ``values`` (0 for an empty tensor)."""
    return values.abs().amax() if values.numel() else values.new_zeros(())


def _check_batch(
    scores: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None
) -> None:
    """One B for ``rewards`` (B,), ``mask`` and ``token_rewards`` (B, T): the odd one is blamed.

    The batch size of the majority is the reference (ties: the mask's).
    """
    sizes = {"mask": mask.shape[0]}
    if token_rewards is not None:
        sizes["token_rewards"] = token_rewards.shape[0]
    if scores.ndim == 1:
        sizes["rewards"] = scores.shape[0]
    values = list(sizes.values())
    batch = max(values, key=lambda size: (values.count(size), -values.index(size)))
    if scores.ndim != 1 or scores.shape[0] != batch:
        raise ValueError(
            f"rewards must have shape (B,) or (B, 1) with B = {batch} (one score per row of "
            f"mask), got shape {tuple(scores.shape)}"
        )
    for name, size in sizes.items():
        if size != batch:
            raise ValueError(f"{name} must have B = {batch} rows like rewards, got {size} rows")


@checks_environment
def reinforce_plus_plus_advantages(
    rewards: ArrayLike,
    mask: ArrayLike,
    *,
    token_rewards: ArrayLike | None = None,
    gamma: float = 1.0,
    group_size: int | None = None,
    group_ids: Any = None,
    unbiased: bool = False,
    eps: Scalar = 1e-8,
    holes: Holes = "skip",
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> torch.Tensor:
    r"""REINFORCE++ token advantages: discounted token returns, whitened over the whole batch.

    The token reward puts the score on the last selected token and adds the optional per-token
    rewards :math:`c_{it}` (typically the KL penalty, see :func:`rlobjectives.kl_estimate`):

    .. math::

        R_{it} = c_{it} + \mathbb{1}[t = t^{last}_i]\,(r_i - b_i), \qquad
        G_{it} = \sum_{s \ge t,\ M_{is}=1} \gamma^{\,n_{ts}} R_{is}, \qquad
        A_{it} = \frac{G_{it} - \mu}{\sigma + \epsilon},

    :math:`n_{ts}`: the selected tokens in :math:`(t, s]` (``holes="zero"``: every position);
    :math:`b_i`: 0, or the group-mean score with ``group_size`` / ``group_ids``; :math:`\mu`,
    :math:`\sigma` over **all selected tokens of the batch**. Unselected tokens are ignored
    and get 0. Peers: OpenRLHF ``reinforce`` / ``reinforce_baseline``, verl
    ``reinforce_plus_plus`` / ``_baseline`` (``unbiased=True``), to a relative
    :math:`\epsilon/\sigma`; packing, context parallelism: ``docs/objectives/advantages.md``.

    Args:
        rewards: ``(B,)`` or ``(B, 1)`` sequence scores.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        token_rewards: optional ``(B, T)`` per-token rewards :math:`c_{it}`.
        gamma: discount :math:`\gamma \in [0, 1]` (REINFORCE++ uses 1).
        group_size: optional :math:`G \ge 1`: subtract the group-mean score first (groups
            contiguous, ``B`` divisible by ``G``), the paper's "REINFORCE++ w/ baseline".
        group_ids: optional ``(B,)`` group label per sequence instead of ``group_size`` (verl's
            ``index``; see :func:`rlobjectives.group_relative_advantages`).
        unbiased: whiten with the Bessel-corrected variance (verl); False: the population one.
        eps: :math:`\epsilon \ge 0` added to :math:`\sigma`.
        holes: ``"skip"`` (verl, the default) jumps over an unselected token between selected
            ones, ``"zero"`` (OpenRLHF) steps through it with reward 0.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the context-parallel group of the sequences' other chunks, or None.

    Returns:
        ``(B, T)`` advantages (packed: the shape of ``mask``) on the device of ``mask``,
        float32 (float64 if an input is float64), zeros at unselected tokens.

    Raises:
        ValueError: on mismatched shapes/devices, an invalid grouping (``B`` not divisible by
            ``group_size``, both ``group_size`` and ``group_ids``, labels not one per row),
            ``gamma`` outside [0, 1], a negative ``eps``, an unknown ``holes``, a malformed
            ``cu_seqlens``, or a ``context_group`` without this rank or a process group.
        TypeError: on non-numeric inputs, a non-bool ``unbiased`` or a ``context_group`` that is
            not a ``torch.distributed`` process group.

    References:
        Hu et al. 2025, REINFORCE++, arXiv:2501.03262 Eq. 8-9 (token advantage), Eq. 10
            (global batch normalization).

    Examples:
        >>> reinforce_plus_plus_advantages([1.0, 0.0], [[1, 1], [1, 0]])
        tensor([[ 0.7071,  0.7071],
                [-1.4142,  0.0000]])

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``unbiased``, ``group_ids``, ``holes``; magnitudes up to the float limits.
    """
    packed = cu_seqlens is not None
    context = validate_context_group(context_group)
    mask_in = as_mask(mask, "mask")
    flat = packed and mask_in.ndim == 1
    mask_t = token_matrix(mask_in, "mask", packed)
    device = mask_t.device
    layout = sequence_layout(cu_seqlens, mask_t, context)
    scores = as_float_tensor(rewards, "rewards", device)
    tensors = {"mask": mask_t, "rewards": scores}
    if packed:
        scores = per_sequence(scores, "rewards", layout, "cu_seqlens")
    if scores.ndim == 2 and scores.shape[1] == 1:
        scores = scores.squeeze(-1)
    extra = None
    if token_rewards is not None:
        extra = token_matrix(
            as_float_tensor(token_rewards, "token_rewards", device), "token_rewards", packed
        )
        tensors["token_rewards"] = extra
    if not packed:  # packed: rewards are (S,) (checked above), the tokens one (1, N) row
        _check_batch(scores, mask_t, extra)
    if extra is not None:
        check_shape(extra, "token_rewards", mask_t.shape, "mask")
    check_same_device(tensors)
    discount = validate_discount(gamma, "gamma")
    validate_flag(unbiased, "unbiased")
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    validate_choice(holes, "holes", HOLES)
    dtype = compute_dtype(*tensors.values())

    scores = scores.to(dtype)  # (B,)
    extra_selected = None if extra is None else masked_fill_zero(extra.to(dtype), mask_t)
    magnitude = _max_abs(scores)
    if extra_selected is not None:
        magnitude = torch.maximum(magnitude, _max_abs(extra_selected))
    magnitude, last = _magnitude_and_last(magnitude, mask_t, layout)  # whole sequences
    unit = power_of_two_scale(magnitude)  # () returns are computed in units of `unit`
    scores = scores / unit  # (B,)
    if group_size is not None or group_ids is not None:
        scores, groups = grouped_rewards(scores, group_size, group_ids, minimum=1)
        scores = group_centered(scores, groups)  # (B,) (r_i - b_i) / unit
    token_level = masked_fill_zero(layout.expand(scores).expand(mask_t.shape), last)
    if extra_selected is not None:
        token_level = token_level + extra_selected / unit  # (B, T)
    chain = mask_t if holes == "skip" else torch.ones_like(mask_t)  # the recursion's steps
    returns = discounted_sum(token_level, chain, discount, layout)  # (B, T) G / unit
    if context is not None:  # G_t += gamma^k gamma G_next: the carry of the later chunks
        returns = context_scan(returns, chain, layout, discount, lambda c: discount * c[:, 0])
    # in units of unit * scale; under CP the statistics of every rank's tokens
    moments = masked_moments(returns, mask_t, unbiased=unbiased, context=context)
    denominator = safe_sqrt(moments.variance) + epsilon / (unit * moments.scale)  # ()
    return token_output(divide_or_zero(moments.centered, denominator), flat)  # (B, T)


def _magnitude_and_last(
    magnitude: torch.Tensor, mask: torch.Tensor, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest magnitude and the last selected token of each sequence, whole sequences.

    Under context parallelism both come from one ``all_reduce(MAX)``: the magnitude and the
    ``(S,)`` index of the last rank holding a selected token of each sequence.
    """
    local = layout.local_last_selected(mask)  # (B, T)
    context = layout.context
    if context is None:
        return magnitude, local
    holds = layout.local_row_counts(mask) > 0  # (S,)
    owners = torch.where(holds, context.rank, -1).to(magnitude.dtype)  # exact small integers
    reduced = context_max(context, torch.cat([magnitude.reshape(1), owners]))
    return reduced[0], local & layout.expand(reduced[1:] == context.rank)
