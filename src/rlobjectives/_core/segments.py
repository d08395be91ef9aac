"""Reverse recursions over the sequences of a packed row, restarted at every boundary.

The packed forms of the reverse scans of GAE, REINFORCE++ and ReMax
(:mod:`rlobjectives.advantages.scans`, :mod:`rlobjectives.advantages.outcome`): a discounted sum
(:func:`segment_discounted_sum`) and the value at the next selected token
(:func:`segment_next_selected`) over the contiguous segments of a
:class:`~rlobjectives._core.layout.Layout`, by recursive doubling and cumulative minima: no
Python loop over sequences, no host synchronisation. :func:`future_discounted_sums` is the
discounted sum over every later position of a token's sequence (padded rows, packed sequences,
context-parallel chunks), FIPO's future log-ratio.
"""

from __future__ import annotations

import math

import torch

from .context import carry_from_later_ranks, context_gather
from .layout import Layout, _sequence_end, _sequence_ids

__all__ = [
    "BLOCK_LOG_RANGE",
    "future_discounted_sums",
    "segment_discounted_sum",
    "segment_next_selected",
]


def segment_discounted_sum(
    values: torch.Tensor,
    chain: torch.Tensor,
    layout: Layout,
    discount: float | torch.Tensor,
) -> torch.Tensor:
    """Reverse discounted sum over the chain tokens of each packed sequence, ``(1, N)``.

    ``values`` and ``chain`` (bool) are ``(1, N)``; the result is 0 off the chain. Equal to
    the padded scan of :mod:`rlobjectives.advantages.scans` applied to each sequence separately.
    ``discount`` is a number, or a ``(1, N)`` tensor of per-token discounts (a per-sequence
    discount broadcast to its tokens, GAE with a per-sequence lambda). A log-depth doubling
    scan: it multiplies factors in ``[0, 1]`` only, so no discount under- or overflows.
    """
    ids = _sequence_ids(layout)  # (N,)
    tokens = ids.shape[0]
    selected = chain.reshape(-1)  # (N,)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    total = torch.where(selected, values.reshape(-1), zero)  # (N,) B
    one = torch.ones((), dtype=values.dtype, device=values.device)
    if isinstance(discount, torch.Tensor):
        factor = torch.where(selected, discount.reshape(-1).to(values.dtype), one)  # (N,) A
    else:
        factor = torch.where(selected, one * discount, one)  # (N,) A
    offset = 1
    while offset < tokens:
        same = ids[offset:] == ids[:-offset]  # (N - d,) t + d in the sequence of t
        shifted = torch.where(same, factor[:-offset] * total[offset:], zero)
        total = torch.cat([total[:-offset] + shifted, total[-offset:]])
        factor = torch.cat(
            [torch.where(same, factor[:-offset] * factor[offset:], zero), zero.expand(offset)]
        )
        offset *= 2
    return torch.where(selected, total, zero).reshape(values.shape)


def segment_next_selected(
    values: torch.Tensor, chain: torch.Tensor, layout: Layout
) -> torch.Tensor:
    """``values`` at the next chain token after ``t`` in its packed sequence (0 if none).

    The packed form of ``rlobjectives.advantages.scans._next_selected``: the first chain
    position after ``t`` over the whole row (a reverse cumulative minimum), kept only when it
    lies before the end of ``t``'s sequence ``cu_seqlens[s + 1]``.
    """
    ids = _sequence_ids(layout)  # (N,)
    tokens = ids.shape[0]
    positions = torch.arange(tokens, device=values.device)  # (N,)
    index = torch.where(chain.reshape(-1), positions, tokens)  # (N,) own index if on the chain
    following = index.flip(0).cummin(0).values.flip(0)  # (N,) first chain index >= t
    next_index = torch.cat([following[1:], following.new_full((1,), tokens)])  # first > t
    last = _sequence_end(layout, positions)  # (N,) one past the last token of t's sequence
    next_index = torch.where(next_index < last, next_index, tokens)  # (N,) N: none
    padded = torch.cat([values.reshape(-1), values.new_zeros(1)])  # (N + 1,)
    return padded.gather(0, next_index).reshape(values.shape)


#: The blocked reverse scans (:func:`future_discounted_sums` here, GAE's and REINFORCE++'s in
#: :mod:`rlobjectives.advantages.scans`) rescale by ``gamma^-o`` inside a block of
#: ``34 / -log(gamma)`` positions, so that every factor lies in ``[e^-34, e^34]`` (float32 holds
#: ``e^+-88``).
BLOCK_LOG_RANGE = 34.0


def future_discounted_sums(
    values: torch.Tensor, layout: Layout, gamma: float | torch.Tensor
) -> torch.Tensor:
    r""":math:`\sum_{s \ge t} \gamma^{s - t} v_s` over the later positions of each sequence.

    ``values`` ``(B, T)`` (a row is a sequence) or packed ``(1, N)``, detached, zero where not
    selected. Padded rows with a number ``gamma``: a blocked reverse cumulative sum
    (:func:`_blocked_future_sums`); packed sequences, a tensor ``gamma`` and code traced by
    ``torch.compile``: a log-depth doubling scan (:func:`_doubling_future_sums`; Inductor's CPU
    code runs the blocked scan's flipped loops element by element, 3.5-6x slower). Under context
    parallelism the local sums take the carry of the later ranks' chunks (each rank a contiguous
    chunk, in rank order).
    """
    blocked = not (isinstance(gamma, torch.Tensor) or torch.compiler.is_compiling())
    if layout.sequence_ids is None and blocked:
        total = _blocked_future_sums(values, float(gamma))
    else:
        ids = None if layout.sequence_ids is None else layout.sequence_ids.reshape(1, -1)
        total = _doubling_future_sums(values, ids, gamma)
    if layout.context is None:
        return total
    return total + _carry(total, layout, gamma)


def _doubling_future_sums(
    values: torch.Tensor, ids: torch.Tensor | None, gamma: float | torch.Tensor
) -> torch.Tensor:
    """The doubling scan: ``F_t += gamma^d F_{t + d}`` for ``d = 1, 2, 4, ...``.

    Only where ``t + d`` lies in ``t``'s sequence: ``ids`` ``(1, N)`` names each packed
    position's sequence; None: each row is one.
    """
    width = values.shape[-1]
    total, factor, reach = values, gamma, 1
    while reach < width:
        later = total[..., reach:] * factor  # gamma^d F_{t + d}
        if ids is not None:
            same = ids[..., reach:] == ids[..., :-reach]  # t + d in the sequence of t
            later = torch.where(same, later, 0.0)
        total = torch.cat([total[..., :-reach] + later, total[..., -reach:]], dim=-1)
        factor = factor * factor
        reach *= 2
    return total


def _blocked_future_sums(values: torch.Tensor, gamma: float) -> torch.Tensor:
    r"""The future sums of padded rows ``(B, T)`` in blocks of ``K`` positions.

    At offset :math:`o` of a block, :math:`F = \gamma^{-o} \sum_{o' \ge o} \gamma^{o'} v_{o'} +
    \gamma^{K - o} H`, :math:`H` the full sum at the next block's first position (the doubling
    scan over the blocks' own sums, with :math:`\gamma^K`). Only positions :math:`s \ge t` enter
    :math:`F_t`, each through a factor in ``[e^-34, e^34]``: a NaN or infinity reaches the earlier
    positions only, as in the doubling scan. ``gamma = 1`` is one reverse cumulative sum.
    """
    rows, width = values.shape
    if width == 0 or gamma == 0.0:  # gamma^0 = 1: F = v
        return values
    block = width
    if gamma < 1.0:
        block = max(1, min(width, int(BLOCK_LOG_RANGE / -math.log(gamma))))
    blocks = -(-width // block)
    padded = torch.nn.functional.pad(values, (0, blocks * block - width))
    padded = padded.reshape(rows, blocks, block)  # (B, C, K)
    exponents = torch.arange(block + 1, dtype=torch.float64, device=values.device)
    powers = torch.pow(gamma, exponents).to(values.dtype)  # (K + 1,) gamma^0 .. gamma^K
    inverse = torch.pow(gamma, -exponents[:block]).to(values.dtype)  # (K,) gamma^-o
    suffix = (padded * powers[:block]).flip(-1).cumsum(-1).flip(-1)  # (B, C, K)
    local = suffix * inverse  # (B, C, K) the sum over the block's positions o' >= o
    if blocks > 1:  # the later blocks, brought back by gamma^(K - o)
        starts = _doubling_future_sums(local[..., 0], None, gamma**block)  # (B, C)
        after = torch.nn.functional.pad(starts[:, 1:], (0, 1)).unsqueeze(-1)  # (B, C, 1)
        local = torch.addcmul(local, after, powers[1:].flip(0))
    return local.reshape(rows, blocks * block)[:, :width]


def _carry(total: torch.Tensor, layout: Layout, gamma: float | torch.Tensor) -> torch.Tensor:
    r""":math:`\gamma^{e - t} C` per position: the later ranks' sum :math:`C`, brought back.

    :math:`e` is the end of this rank's chunk of the token's sequence; one all-gather of each
    rank's ``[F(first position), gamma^length]`` per sequence.
    """
    context = layout.context
    assert context is not None  # internal invariant: called under context parallelism
    dtype, device = total.dtype, total.device
    gamma = torch.as_tensor(gamma, dtype=dtype, device=device)
    width = total.shape[-1]
    if layout.sequence_ids is None:  # padded: each local row a slice of `width` positions
        first = total[:, 0] if width else torch.zeros(total.shape[0], dtype=dtype, device=device)
        lengths = torch.full_like(first, float(width))
        distance = width - torch.arange(width, device=device).to(dtype)  # (T,)
    else:
        ids = layout.sequence_ids
        ones = torch.ones(1, width, dtype=dtype, device=device)
        lengths = layout.local_row_sums(ones)  # (S,) this rank's positions per sequence
        ends = torch.cumsum(lengths, 0)  # one past each sequence's last position here
        starts = (ends - lengths).to(torch.int64).clamp(max=max(width - 1, 0))
        padded = torch.cat([total.reshape(-1), total.new_zeros(1)])
        first = torch.where(lengths > 0, padded[starts], 0.0)
        positions = torch.arange(width, device=device).to(dtype)
        distance = (ends[ids] - positions).reshape(1, -1)  # (1, N)
    states = torch.stack([first, torch.pow(gamma, lengths)], dim=-1)  # (S, 2)
    with torch.no_grad():
        gathered = context_gather(context, states)  # (W, S, 2) in rank order
        start = torch.zeros_like(first).unsqueeze(-1)  # (S, 1): nothing after the last chunk
        carry = carry_from_later_ranks(
            gathered, context.rank, start, lambda state, c: state[:, :1] + state[:, 1:] * c
        )  # (S, 1): the full sum at the first position of the next rank's chunk
    carry = carry.squeeze(-1)
    if layout.sequence_ids is None:
        return torch.pow(gamma, distance) * carry.unsqueeze(-1)  # (B, T)
    return torch.pow(gamma, distance) * carry[layout.sequence_ids].reshape(1, -1)
