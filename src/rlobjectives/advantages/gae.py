r"""Token-level advantage estimators: REINFORCE++ and masked GAE.

They take ``(B, T)`` tensors and a mask; unselected tokens are not part of the trajectory
(their rewards and values are ignored, their advantages are 0) and NaN/inf there never reaches
the outputs. On packed sequences (``cu_seqlens``) the recursions restart at every sequence
boundary (:mod:`rlobjectives._core.layout`). All results are float32 (float64 when an input is
float64). The outcome-reward (one score per sequence) estimators are in ``_outcome_advantages``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch.distributed import ProcessGroup

from .._core.context import (
    carry_from_later_ranks,
    context_gather,
    context_max,
)
from .._core.layout import (
    Layout,
    per_sequence,
    segment_discounted_sum,
    segment_next_selected,
    sequence_layout,
    token_matrix,
    token_output,
)
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    as_tensor,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    describe,
    validate_choice,
    validate_context_group,
    validate_scalar,
)
from .groups import group_centered, grouped_rewards
from .whitening import (
    divide_or_zero,
    masked_moments,
    power_of_two_scale,
    safe_sqrt,
    validate_flag,
    whiten_selected,
)

__all__ = ["HOLES", "GAEOutput", "Holes", "gae", "reinforce_plus_plus_advantages"]

Holes = Literal["skip", "zero"]
HOLES: tuple[str, ...] = ("skip", "zero")


def _validate_discount(value: Scalar, name: str) -> float:
    number = float(validate_scalar(value, name, minimum=0.0, allow_tensor=False))
    if number > 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {number}")
    return number


# The blocked reverse scan rescales by discount**(-c) inside a block; blocks are sized so that
# these factors stay below exp(_SCAN_LOG_RANGE) ~ 6e14, far from float32 over/underflow.
_SCAN_LOG_RANGE = 34.0


def _masked_discounted_sum(
    values: torch.Tensor, mask: torch.Tensor, discount: float
) -> torch.Tensor:
    r"""Reverse discounted sum over the selected tokens of each row (unselected ones skipped).

    :math:`G_t = x_t + w\, G_{n(t)}` with :math:`n(t)` the next selected token (``G = 0`` after
    the last), i.e. :math:`G_t = \sum_{s \ge t,\ M_s} w^{c_s - c_t} x_s` with :math:`c` the
    running count of selected tokens; zeros at unselected tokens.

    Vectorized in blocks of :math:`K` tokens (:math:`w^{-K} \le e^{34}`): inside a block,
    :math:`G_t = w^{-c_t} \sum_{s \ge t} w^{c_s} x_s + w^{n - c_t + 1} H` (a reverse cumulative
    sum; :math:`n` the block's selected count, :math:`H` the return at the first selected token
    after the block), and a Python loop over the ``T / K`` blocks (static) carries :math:`H`.
    ``w = 1`` is one reverse cumulative sum and ``w = 0`` gives :math:`G = x`.
    """
    batch, tokens = values.shape
    values = masked_fill_zero(values, mask)  # (B, T)
    if tokens == 0 or discount == 0.0:
        return values
    if discount == 1.0:
        return masked_fill_zero(values.flip(-1).cumsum(-1).flip(-1), mask)
    block = max(1, min(tokens, int(_SCAN_LOG_RANGE / -math.log(discount))))
    blocks = -(-tokens // block)
    pad = blocks * block - tokens
    values_b = torch.nn.functional.pad(values, (0, pad)).reshape(batch, blocks, block)  # (B,C,K)
    mask_b = torch.nn.functional.pad(mask, (0, pad), value=False).reshape(batch, blocks, block)
    rank = mask_b.long().cumsum(-1)  # (B, C, K) selected tokens up to t within the block
    count = rank[..., -1:]  # (B, C, 1)
    exponents = torch.arange(block + 2, device=values.device, dtype=values.dtype)  # (K + 2,)
    powers = discount**exponents  # (K + 2,) w^k
    inverse_powers = discount ** (-exponents)  # (K + 2,) w^-k <= e^34
    scaled = powers[rank] * values_b  # (B, C, K) w^{c_s} x_s
    suffix = scaled.flip(-1).cumsum(-1).flip(-1)  # (B, C, K) sum over s >= t in the block
    local = inverse_powers[rank] * suffix  # (B, C, K)
    # Return at the first selected token of each block, without the later blocks.
    summary = (powers[(rank - 1).clamp(min=0)] * values_b).sum(-1)  # (B, C)
    decay = powers[count.squeeze(-1)]  # (B, C) w^n
    carry = values.new_zeros(batch)  # (B,) return at the first selected token after the block
    carries: list[torch.Tensor] = []
    for index in reversed(range(blocks)):
        carries.append(carry)
        carry = summary[:, index] + decay[:, index] * carry
    after = torch.stack(carries[::-1], dim=-1).unsqueeze(-1)  # (B, C, 1)
    returns = local + powers[count - rank + 1] * after  # (B, C, K)
    return masked_fill_zero(returns.reshape(batch, blocks * block)[:, :tokens], mask)  # (B, T)


def _row_scan(values: torch.Tensor, chain: torch.Tensor, discount: torch.Tensor) -> torch.Tensor:
    r"""Reverse discounted sum with a discount per row (or per token), ``(B, T)``.

    :math:`G_t = x_t + w_t\, G_{n(t)}` over the chain tokens, as
    :func:`_masked_discounted_sum`, for ``discount`` :math:`w` of shape ``(B, 1)`` or
    ``(B, T)``. A log-depth doubling scan (Hillis-Steele): with :math:`c_t = w_t` on the chain
    and 1 off it (a hole passes the return through), ``x_t += c_t x_{t+d}``, ``c_t *= c_{t+d}``
    for ``d = 1, 2, 4, ...``; it only multiplies factors in ``[0, 1]``, so no discount
    (:math:`w = 0` included, or :math:`10^{-40}`) under- or overflows, traces (static
    ``log2 T`` steps) and has no host sync.
    """
    batch, tokens = values.shape
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    total = masked_fill_zero(values, chain)  # (B, T)
    factor = torch.where(chain, discount.to(values.dtype), torch.ones_like(zero))  # (B, T)
    offset = 1
    while offset < tokens:
        shifted = factor[:, :-offset] * total[:, offset:]  # (B, T - d)
        total = torch.cat([total[:, :-offset] + shifted, total[:, -offset:]], dim=1)
        factor = torch.cat(
            [factor[:, :-offset] * factor[:, offset:], zero.expand(batch, offset)], dim=1
        )
        offset *= 2
    return masked_fill_zero(total, chain)


#: The blocked scan keeps its block's factors below e^34 with blocks of ``34 / -log w`` tokens;
#: below this discount the blocks would be shorter than 8 tokens (and ``w^-1`` of a tiny
#: ``w`` overflows), so the doubling scan runs instead.
_BLOCKED_MIN_DISCOUNT = math.exp(-_SCAN_LOG_RANGE / 8)


def _next_selected(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` at the next selected token after ``t`` in the row (0 after the last), (B, T)."""
    batch, tokens = values.shape
    positions = torch.arange(tokens, device=values.device)  # (T,)
    index = torch.where(mask, positions, tokens)  # (B, T) own index if selected, else T
    following = index.flip(-1).cummin(-1).values.flip(-1)  # (B, T) first selected index >= t
    next_index = torch.cat(
        [following[:, 1:], torch.full((batch, 1), tokens, device=values.device)], dim=-1
    )  # (B, T) first selected index > t, T if none
    padded = torch.cat([values, values.new_zeros(batch, 1)], dim=-1)  # (B, T + 1)
    return padded.gather(-1, next_index)  # (B, T)


def _discounted_sum(
    values: torch.Tensor, chain: torch.Tensor, discount: float | torch.Tensor, layout: Layout
) -> torch.Tensor:
    """:func:`_masked_discounted_sum` per row, or per packed sequence (restarting at each).

    ``discount``: a number, or per-token discounts broadcastable to ``values`` (``(B, 1)``
    padded, ``(1, N)`` packed: a per-sequence discount); tensors and discounts below
    :data:`_BLOCKED_MIN_DISCOUNT` (0 excepted) take the doubling scan.
    """
    if layout.sequence_ids is not None:
        return segment_discounted_sum(values, chain, layout, discount)
    if isinstance(discount, torch.Tensor):
        return _row_scan(values, chain, discount.expand(values.shape))
    if 0.0 < discount < _BLOCKED_MIN_DISCOUNT:
        return _row_scan(values, chain, values.new_full((), discount).expand(values.shape))
    return _masked_discounted_sum(values, chain, discount)


def _next_on_chain(values: torch.Tensor, chain: torch.Tensor, layout: Layout) -> torch.Tensor:
    """:func:`_next_selected` per row, or inside each packed sequence."""
    if layout.sequence_ids is None:
        return _next_selected(values, chain)
    return segment_next_selected(values, chain, layout)


def _context_scan(
    local: torch.Tensor,
    chain: torch.Tensor,
    layout: Layout,
    discount: float | torch.Tensor,
    boundary: Callable[[torch.Tensor], torch.Tensor],
    extra: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    r"""A reverse scan over sequences split into contiguous chunks, one per rank in group order.

    ``local`` is this rank's scan :math:`G^0 = \mathrm{scan}(x)` with a zero bootstrap after its
    last chain token. The recursion :math:`G_t = x_t + a\,G_{n(t)}` is linear, so the exact
    value is :math:`G_t = G^0_t + P_t\,c`, with :math:`P_t = a^{k_t}` the propagation of a unit at
    this rank's last chain token (the scan of that unit: :math:`k_t` later chain tokens here, an
    exact integer count) and :math:`c` the correction the later chunks add at that token. Each
    rank summarises each sequence by ``[holds a chain token, G^0 and P at its first chain token,
    *extra at it]``; one ``all_gather`` of these ``(S, 3 + e)`` states and a fold from the last
    rank down (:func:`~rlobjectives._core.context.carry_from_later_ranks`) give :math:`c`:
    ``boundary(carry)`` is the correction from the carry ``[G, *extra]`` at the first chain
    token of the next chunk that has one (zeros after the last). The gather's backward is the
    adjoint (each rank's outputs are its own tokens).

    Args:
        local: ``(B, T)`` / ``(1, N)`` the local scan, 0 off the chain.
        chain: bool, the recursion's steps.
        layout: the layout with its context group.
        discount: :math:`a`, a number or per-token (``(B, 1)`` / ``(1, N)``, one per sequence).
        boundary: ``(S, 1 + e) -> (S,)`` the correction from the next chunk's carry.
        extra: per-token values whose value at the first chain token enters the carry (GAE:
            :math:`V`, for the next chunk's bootstrap).
    """
    context = layout.context
    assert context is not None  # internal invariant: called under context parallelism
    zero = torch.zeros((), dtype=local.dtype, device=local.device)
    after = layout.local_selected_after(chain).to(local.dtype)  # (B, T) later chain tokens here
    base = torch.as_tensor(discount, dtype=local.dtype, device=local.device)
    propagation = torch.where(chain, torch.pow(base, after), zero)  # (B, T) a^k (0^0 = 1)
    first = layout.first_selected(chain)
    at_first = [
        layout.local_row_sums(torch.where(first, value, zero))
        for value in (local, propagation, *extra)
    ]  # (S,) each
    holds = (layout.local_row_counts(chain) > 0).to(local.dtype)  # (S,)
    states = context_gather(context, torch.stack([holds, *at_first], dim=-1))  # (W, S, 3 + e)

    def step(state: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        start = state[:, 1] + state[:, 2] * boundary(carry)  # (S,) G at the first chain token
        value = torch.cat([start.unsqueeze(-1), state[:, 3:]], dim=-1)  # (S, 1 + e)
        return torch.where(state[:, :1] > 0, value, carry)

    start = local.new_zeros(layout.num_sequences, 1 + len(extra))
    carry = carry_from_later_ranks(states, context.rank, start, step)  # (S, 1 + e)
    correction = layout.expand(boundary(carry))  # (B, 1) / (1, N)
    return masked_fill_zero(local + propagation * correction, chain)


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
    discount = _validate_discount(gamma, "gamma")
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
    returns = _discounted_sum(token_level, chain, discount, layout)  # (B, T) G / unit
    if context is not None:  # G_t += gamma^k gamma G_next: the carry of the later chunks
        returns = _context_scan(returns, chain, layout, discount, lambda c: discount * c[:, 0])
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


class GAEOutput(NamedTuple):
    r"""Result of :func:`gae`.

    Attributes:
        advantages: ``(B, T)`` GAE advantages :math:`\hat A_t` (whitened with ``whiten=True``),
            zeros at unselected tokens.
        returns: ``(B, T)`` value targets :math:`\hat A_t + V_t` (from the advantages before
            whitening), zeros at unselected tokens.
    """

    advantages: torch.Tensor
    returns: torch.Tensor


@checks_environment
def gae(
    rewards: ArrayLike,
    values: ArrayLike,
    mask: ArrayLike,
    *,
    gamma: float,
    lam: float | ArrayLike,
    value_lam: float | ArrayLike | None = None,
    whiten: bool = False,
    holes: Holes = "skip",
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> GAEOutput:
    r"""Masked generalized advantage estimation (GAE) over the selected tokens of each row.

    With :math:`n(t)` the next selected token after :math:`t` in the same row
    (:math:`V_{n(t)} := 0` and :math:`\hat A_{n(t)} := 0` after the last one),

    .. math::

        \delta_t = r_t + \gamma V_{n(t)} - V_t, \qquad
        \hat A_t = \delta_t + \gamma\lambda \hat A_{n(t)}
                 = \sum_{l \ge 0} (\gamma\lambda)^l \delta_{t+l}, \qquad
        \hat R_t = \hat A_t + V_t .

    ``holes`` says what an unselected token *between* two selected ones (a hole: a tool
    observation, a masked turn) is:

    - ``"skip"`` (default): not part of the trajectory. Its reward and value are ignored
      (NaN/inf there is harmless) and the chain jumps over it: :math:`n(t)` is the next
      *selected* token, with no extra discount. verl's ``compute_gae_advantage_return`` does
      the same (it carries ``nextvalues`` and ``lastgaelam`` through masked tokens).
    - ``"zero"``: a step with reward 0 and value 0 that the recursion runs through (so
      :math:`n(t) = t + 1` and every hole costs one factor :math:`\gamma\lambda`, and the token
      before a hole bootstraps from :math:`V = 0`): OpenRLHF's
      ``get_advantages_and_returns``, which multiplies rewards and values by the mask and runs
      the recursion over every position. Equal to ``"skip"`` when the mask has no holes.

    Trailing unselected tokens (padding) never matter: the bootstrap after the last selected
    token is 0 (the response ended). Packed sequences (``cu_seqlens``): the tensors are
    ``(N,)`` or ``(1, N)`` and the recursion restarts at every sequence boundary (a sequence
    never bootstraps from the next one), equal to the padded call on the same sequences. With
    :math:`\gamma = \lambda = 1`, :math:`\hat A_t = \sum_{s \ge t} M_s r_s - V_t`
    (reward-to-go minus value).

    Per-sequence :math:`\lambda` (VAPO's length-adaptive GAE): ``lam`` may be a ``(B,)``
    tensor (packed: ``(S,)``, one per sequence of ``cu_seqlens``); row :math:`i` then runs
    :math:`\hat A_t = \delta_t + \gamma\lambda_i \hat A_{n(t)}` with its own
    :math:`\lambda_i` (:func:`rlobjectives.length_adaptive_lambda` gives VAPO's
    :math:`\lambda_i = 1 - 1/(\alpha\,l_i)`). The values are not range-checked on the device
    (keep them in [0, 1]). ``value_lam`` (a number or the same kind of tensor) decouples the
    critic's :math:`\lambda`: the returns are then :math:`\hat A(\lambda_V) + V` while the
    advantages use ``lam`` (VAPO's decoupled GAE, :math:`\lambda_{critic} = 1`,
    :math:`\lambda_{policy}` length-adaptive; NeMo-RL ``gae_lambda_value`` /
    ``gae_lambda_policy`` / ``length_adaptive_alpha``, which runs its GAE twice). The scan
    multiplies discounts in [0, 1] only (a log-depth doubling scan for per-sequence and tiny
    :math:`\gamma\lambda`), so :math:`\lambda = 0` and :math:`\gamma\lambda = 10^{-40}` are
    exact.

    Context parallelism (``context_group``): each rank holds a contiguous chunk of every
    sequence, chunks in group-rank order (rank 0 the first tokens; a chunk may be empty; with
    ``holes="zero"`` every local position is a step, so the local rows must be contiguous
    slices of the padded rows, as Megatron CP's split gives). The recursion carries
    :math:`V_{n(t)}` and :math:`\hat A_{n(t)}` across the chunk boundaries (one
    ``all_gather`` of each rank's ``(S, 4)`` boundary state, composed locally) and
    ``whiten=True`` takes the statistics of every rank's tokens, so each rank gets its tokens'
    outputs of the unsplit call; the backward of the collectives is their adjoint. A zigzag
    (load-balanced ring attention) split: see ``docs/distributed/context-parallel.md``.

    ``whiten=True`` whitens the advantages over the selected tokens of the batch with
    :func:`rlobjectives.masked_whiten` (unbiased variance, :math:`\epsilon = 10^{-8}`) and keeps
    the returns of the raw advantages: exactly verl's ``compute_gae_advantage_return``
    (``adv_estimator="gae"``), i.e. the composition
    ``out = gae(...); masked_whiten(out.advantages, mask)``. OpenRLHF whitens its GAE
    advantages over the rollout batch with the population variance
    (``masked_whiten(out.advantages, mask, unbiased=False)``); across data-parallel ranks use
    :func:`rlobjectives.distributed.global_masked_whiten`.

    Args:
        rewards: ``(B, T)`` per-token rewards (e.g. from
            :func:`rlobjectives.kl_penalized_token_rewards`).
        values: ``(B, T)`` value estimates :math:`V_t`.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        gamma: discount :math:`\gamma \in [0, 1]`.
        lam: GAE :math:`\lambda \in [0, 1]`: a number, or a ``(B,)`` floating tensor of
            per-sequence values (packed: ``(S,)``).
        value_lam: optional :math:`\lambda_V` of the returns (number or per-sequence tensor);
            None: the returns use ``lam``.
        whiten: whiten the advantages (verl); the returns are not whitened.
        holes: ``"skip"`` (verl) or ``"zero"`` (OpenRLHF), see above.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the process group of the ranks holding the other chunks of the same
            sequences (context parallelism, see above), or None.

    Returns:
        :class:`GAEOutput` ``(advantages, returns)``, each ``(B, T)`` (packed: the shape of
        ``rewards``), on the device of ``rewards``, float32 (float64 if an input is float64),
        zeros at unselected tokens.
        Differentiable in ``rewards`` and ``values`` (detach ``values`` for PPO targets).

    Raises:
        ValueError: on mismatched shapes/devices, inputs that are not ``(B, T)``, ``gamma`` or
            a number ``lam``/``value_lam`` outside [0, 1], a per-sequence ``lam``/``value_lam``
            of another shape or device, an unknown ``holes`` or a malformed ``cu_seqlens``.
        TypeError: on non-numeric inputs, a tensor-valued ``gamma``, a non-floating
            ``lam``/``value_lam`` tensor or a non-bool ``whiten``.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Schulman et al. 2016, GAE, arXiv:1506.02438 Eq. 16; Ouyang et al. 2022,
        arXiv:2203.02155 (PPO for LMs).

    Examples:
        >>> out = gae([[0.0, 1.0]], [[0.5, 0.5]], [[1, 1]], gamma=1.0, lam=1.0)
        >>> out.advantages
        tensor([[0.5000, 0.5000]])

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``whiten`` and ``holes``.
    .. versionchanged:: 0.3.0
       per-sequence ``lam`` and ``value_lam`` (VAPO).
    """
    packed = cu_seqlens is not None
    rewards_in = as_float_tensor(rewards, "rewards")
    flat = packed and rewards_in.ndim == 1
    rewards_t = token_matrix(rewards_in, "rewards", packed)
    device = rewards_t.device
    values_t = token_matrix(as_float_tensor(values, "values", device), "values", packed)
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", packed)
    check_same_device({"rewards": rewards_t, "values": values_t, "mask": mask_t})
    check_shape(values_t, "values", rewards_t.shape, "rewards")
    check_shape(mask_t, "mask", rewards_t.shape, "rewards")
    discount = _validate_discount(gamma, "gamma")
    validate_flag(whiten, "whiten")
    validate_choice(holes, "holes", HOLES)
    context = validate_context_group(context_group)
    layout = sequence_layout(cu_seqlens, rewards_t, context)
    trace = _validate_lambda(lam, "lam", layout, device)
    value_trace = None
    if value_lam is not None:
        value_trace = _validate_lambda(value_lam, "value_lam", layout, device)
    lambdas = [t for t in (trace, value_trace) if isinstance(t, torch.Tensor)]
    dtype = compute_dtype(rewards_t, values_t, *lambdas)  # a float64 lambda tensor counts too

    rewards_m = masked_fill_zero(rewards_t.to(dtype), mask_t)  # (B, T)
    values_m = masked_fill_zero(values_t.to(dtype), mask_t)  # (B, T)
    if holes == "skip":
        chain = mask_t  # the recursion visits the selected tokens only
    else:
        chain = torch.ones_like(mask_t)  # every position is a step; holes have r = V = 0
    next_values = _next_on_chain(values_m, chain, layout)  # (B, T) V_{n(t)}, 0 after the last
    deltas = masked_fill_zero(rewards_m + discount * next_values - values_m, chain)  # (B, T)
    # A_t = delta_t + gamma * lam * A_{n(t)}: the same masked reverse scan as the returns.
    advantages = _advantage_scan(deltas, chain, mask_t, discount, trace, layout, values_m)
    critic = advantages
    if value_trace is not None:  # the returns' own lambda (VAPO's decoupled GAE)
        critic = _advantage_scan(deltas, chain, mask_t, discount, value_trace, layout, values_m)
    returns = masked_fill_zero(critic + values_m, mask_t)  # (B, T)
    if whiten:
        advantages = whiten_selected(
            advantages, mask_t, shift_mean=True, unbiased=True, epsilon=1e-8, context=context
        )
    return GAEOutput(advantages=token_output(advantages, flat), returns=token_output(returns, flat))


def _validate_lambda(
    value: float | ArrayLike, name: str, layout: Layout, device: torch.device
) -> float | torch.Tensor:
    """A number in [0, 1], or a floating per-sequence tensor ``(B,)`` / ``(S,)`` on ``device``."""
    if isinstance(value, numbers.Real) or (
        isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool
    ):
        return _validate_discount(value, name)  # type: ignore[arg-type]
    tensor = as_tensor(value, name, device)
    if not tensor.is_floating_point():
        raise TypeError(
            f"{name} must be a number in [0, 1] or a floating tensor of one value per sequence, "
            f"got {describe(tensor)}"
        )
    check_same_device({"rewards": torch.empty(0, device=device), name: tensor})
    sequences = layout.num_sequences
    what = "B" if layout.sequence_ids is None else "S"
    if tensor.ndim != 1 or tensor.shape[0] != sequences:
        raise ValueError(
            f"{name} must be a number or have shape ({what},) = ({sequences},) (one value per "
            f"sequence), got shape {tuple(tensor.shape)}"
        )
    return tensor


def _advantage_scan(
    deltas: torch.Tensor,
    chain: torch.Tensor,
    mask: torch.Tensor,
    discount: float,
    trace: float | torch.Tensor,
    layout: Layout,
    values: torch.Tensor,
) -> torch.Tensor:
    r"""``A_t = delta_t + gamma lambda A_{n(t)}``, ``(B, T)``; ``lambda`` a number or per row.

    Under context parallelism the later chunks add
    :math:`(\gamma\lambda)^k (\gamma V_{next} + \gamma\lambda A_{next})` (:func:`_context_scan`;
    ``values``: the masked :math:`V`, the next chunk's bootstrap).
    """
    per_sequence: float | torch.Tensor
    if isinstance(trace, torch.Tensor):
        per_sequence = discount * trace.to(deltas.dtype)  # (S,) gamma lambda_i
        factor: float | torch.Tensor = layout.expand(per_sequence)  # (B, 1) / (1, N)
    else:
        per_sequence = factor = discount * trace
    advantages = _discounted_sum(deltas, chain, factor, layout)
    if layout.context is not None:
        advantages = _context_scan(
            advantages,
            chain,
            layout,
            factor,
            lambda carry: discount * carry[:, 1] + per_sequence * carry[:, 0],
            extra=(values,),
        )
    return masked_fill_zero(advantages, mask)
