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

    The token reward puts the sequence score on the last selected token and adds the optional
    per-token rewards :math:`c_{it}` (typically the KL penalty
    :math:`-\beta\,\log(\pi_{old}/\pi_{ref})`, see :func:`rlobjectives.kl_estimate`):

    .. math::

        R_{it} = c_{it} + \mathbb{1}[t = t^{last}_i]\,(r_i - b_i), \qquad
        G_{it} = \sum_{s \ge t,\ M_{is}=1} \gamma^{\,n_{ts}} R_{is}, \qquad
        A_{it} = \frac{G_{it} - \mu}{\sigma + \epsilon},

    where :math:`n_{ts} = |\{u : t < u \le s,\ M_{iu} = 1\}|` counts selected tokens only (the
    discount skips unselected ones; ``holes="zero"`` counts every position, :math:`n_{ts} = s - t`,
    see below), :math:`b_i` is 0, or with ``group_size`` / ``group_ids``
    the mean score of the sequence's group (REINFORCE++-baseline), and :math:`\mu`,
    :math:`\sigma` are the mean and standard deviation of :math:`G` over **all selected tokens
    of the batch** (global normalization): the population standard deviation (divisor
    :math:`N`, as OpenRLHF) by default, the Bessel-corrected one (divisor :math:`N - 1`, as
    verl's ``masked_whiten``) with ``unbiased=True``. With :math:`\gamma = 1`,
    :math:`G_{it} = r_i - \beta\sum_{s \ge t} \mathrm{KL}_s` (the paper's Eq. for
    :math:`A_{q,o_t}`). For global normalization across data-parallel ranks, call it on the
    gathered batch. An empty mask gives all zeros; unselected tokens get 0. Returns are
    computed on the inputs divided by a power of two near their largest magnitude, so scores of
    :math:`10^{20}` or :math:`10^{-20}` in float32 neither overflow nor underflow. Packed
    sequences (``cu_seqlens``): ``mask`` and ``token_rewards`` are ``(N,)`` or ``(1, N)``,
    ``rewards`` ``(S,)``; each score lands on the last selected token of its sequence and the
    discounted sum restarts at every boundary (the whitening is over the whole batch anyway).

    Context parallelism (``context_group``): each rank holds a contiguous chunk of every
    sequence, chunks in group-rank order (rank 0 the first tokens; a chunk may be empty), and
    every rank the same ``rewards``. The score lands on the last selected token of the whole
    sequence, the returns carry across the chunk boundaries (one ``all_gather`` of each rank's
    ``(S, 3)`` boundary state) and the whitening statistics are those of every rank's tokens, so
    each rank gets its tokens' advantages of the unsplit call; the backward of the collectives
    is their adjoint (each rank's advantages are its own tokens). A zigzag (load-balanced ring
    attention) split is not contiguous: see ``docs/distributed/context-parallel.md``.

    Peers: OpenRLHF ``reinforce`` / ``reinforce_baseline`` whiten with
    :math:`(G - \mu)\,\mathrm{rsqrt}(\max(\sigma^2, 10^{-8}))` (population variance); verl
    ``reinforce_plus_plus`` / ``reinforce_plus_plus_baseline`` with
    :math:`(G - \mu)\,\mathrm{rsqrt}(\sigma^2 + 10^{-8})` (unbiased variance: ``unbiased=True``).
    Both equal this to a relative :math:`\epsilon/\sigma` (:math:`10^{-8}/\sigma`). verl's
    baseline variant broadcasts the baselined score to every selected token, i.e. its token
    rewards are 0 and :math:`\gamma = 1` here.

    Args:
        rewards: ``(B,)`` or ``(B, 1)`` sequence scores.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        token_rewards: optional ``(B, T)`` per-token rewards :math:`c_{it}` (ignored at
            unselected tokens).
        gamma: discount :math:`\gamma \in [0, 1]` (REINFORCE++ uses 1).
        group_size: optional :math:`G \ge 1`: subtract the group-mean score first (groups
            contiguous, ``B`` divisible by ``G``), the paper's "REINFORCE++ w/ baseline".
        group_ids: optional ``(B,)`` group label per sequence instead of ``group_size`` (verl's
            ``index``; see :func:`rlobjectives.group_relative_advantages`).
        unbiased: whiten with the Bessel-corrected variance (verl) instead of the population
            variance (OpenRLHF, the default).
        eps: :math:`\epsilon \ge 0` added to :math:`\sigma`.
        holes: what an unselected token between two selected ones (a hole: a tool output, an
            observation turn) does to the discount: ``"skip"`` (verl; the default) jumps over
            it, ``"zero"`` (OpenRLHF's ``get_cumulative_returns``) runs the recursion through
            it with reward 0, one factor of :math:`\gamma` per position. The same without
            holes or with :math:`\gamma = 1`.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the process group of the ranks holding the other chunks of the same
            sequences (context parallelism, see above), or None.

    Returns:
        ``(B, T)`` advantages (packed: the shape of ``mask``) on the device of ``mask``,
        float32 (float64 if an input is float64), zeros at unselected tokens.

    Raises:
        ValueError: on mismatched shapes/devices, an invalid grouping (``B`` not divisible by
            ``group_size``, both ``group_size`` and ``group_ids``, labels not one per row),
            ``gamma`` outside [0, 1], a negative ``eps``, an unknown ``holes`` or a malformed
            ``cu_seqlens``.
        TypeError: on non-numeric inputs or a non-bool ``unbiased``.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Hu et al. 2025, REINFORCE++, arXiv:2501.03262: token advantage
        :math:`r - \beta\sum_{i \ge t}\mathrm{KL}(i)` with :math:`\mathrm{KL}(t) =
        \log(\pi_{old}/\pi_{SFT})` (Eq. 8-9) and global batch normalization (Eq. 10).

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
