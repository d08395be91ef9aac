"""Reverse recursions over the sequences of a packed row, restarted at every boundary.

The packed forms of the reverse scans of GAE, REINFORCE++ and ReMax
(:mod:`rlobjectives.advantages.scans`, :mod:`rlobjectives.advantages.outcome`): a discounted sum
(:func:`segment_discounted_sum`) and the value at the next selected token
(:func:`segment_next_selected`) over the contiguous segments of a
:class:`~rlobjectives._core.layout.Layout`, by recursive doubling and cumulative minima: no
Python loop over sequences, no host synchronisation.
"""

from __future__ import annotations

import torch

from .layout import Layout, _sequence_end, _sequence_ids

__all__ = ["segment_discounted_sum", "segment_next_selected"]


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
