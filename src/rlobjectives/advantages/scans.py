r"""The reverse scans of the token-level advantage estimators (GAE, REINFORCE++).

A reverse discounted sum over the chain of a row's selected tokens (:func:`discounted_sum`:
blocked, or a log-depth doubling scan for per-sequence and tiny discounts), the value at the
next chain token (:func:`next_on_chain`), both restarted at packed boundaries
(:mod:`rlobjectives._core.segments`), and their composition across the chunks of a
context-parallel split (:func:`context_scan`). ``holes`` (:data:`HOLES`) says whether an
unselected token between two selected ones is skipped or a step of the recursion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from .._core.context import carry_from_later_ranks, context_gather
from .._core.layout import Layout
from .._core.reduction import masked_fill_zero
from .._core.segments import BLOCK_LOG_RANGE, segment_discounted_sum, segment_next_selected
from .._core.validation import Scalar, validate_scalar

__all__ = [
    "HOLES",
    "Holes",
    "context_scan",
    "discounted_sum",
    "next_on_chain",
    "validate_discount",
]

Holes = Literal["skip", "zero"]
HOLES: tuple[str, ...] = ("skip", "zero")


def validate_discount(value: Scalar, name: str) -> float:
    """A discount: a Python number in [0, 1] (ValueError outside, TypeError for a tensor)."""
    number = float(validate_scalar(value, name, minimum=0.0, allow_tensor=False))
    if number > 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {number}")
    return number


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
    block = max(1, min(tokens, int(BLOCK_LOG_RANGE / -math.log(discount))))
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
_BLOCKED_MIN_DISCOUNT = math.exp(-BLOCK_LOG_RANGE / 8)


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


def discounted_sum(
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


def next_on_chain(values: torch.Tensor, chain: torch.Tensor, layout: Layout) -> torch.Tensor:
    """:func:`_next_selected` per row, or inside each packed sequence."""
    if layout.sequence_ids is None:
        return _next_selected(values, chain)
    return segment_next_selected(values, chain, layout)


def context_scan(
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
