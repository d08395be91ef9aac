r"""Reverse scans over the sequences of a packed row: the recursions of GAE and REINFORCE++.

On a packed ``(1, N)`` row the recursions of :mod:`rlobjectives.advantages.gae` must restart at
every sequence boundary. Both are reverse linear recurrences over the tokens of the *chain* (the
tokens the recursion visits: the selected ones, or every token of a sequence):

.. math::

    H_t = b_t + a_t H_{t+1}, \qquad b_t = \mathbb{1}[t \in \text{chain}]\, x_t, \qquad
    a_t = \begin{cases} w & t \in \text{chain} \\ 1 & \text{else} \end{cases},

with :math:`H = 0` after the last token of each sequence; :math:`H_t` at a chain token is the
discounted sum :math:`\sum_{s \ge t,\ s \in \text{chain}} w^{c_s - c_t} x_s` of the padded
implementation. :func:`segment_discounted_sum` evaluates it by recursive doubling
(Hillis-Steele): after the step of offset :math:`d` each token holds the composition
:math:`(A, B)` of the next :math:`2d` tokens of its sequence, :math:`(A_t, B_t) \leftarrow
(A_t A_{t+d},\ B_t + A_t B_{t+d})` when :math:`t + d` is in the same sequence, else
:math:`(0, B_t)`: :math:`\lceil \log_2 N \rceil` vectorised steps, no host synchronisation, no
Python loop over sequences, and the sequence test is a ``torch.where`` so that a NaN of one
sequence never reaches another. The products of :math:`w` only shrink (no rescaling, no
overflow). :func:`segment_next_selected` finds the next chain token inside the same sequence.
"""

from __future__ import annotations

import torch

from .layout import Layout

__all__ = ["segment_discounted_sum", "segment_next_selected"]


def _sequence_ids(layout: Layout) -> torch.Tensor:
    assert layout.sequence_ids is not None  # internal invariant: a packed layout
    return layout.sequence_ids


def segment_discounted_sum(
    values: torch.Tensor, chain: torch.Tensor, layout: Layout, discount: float
) -> torch.Tensor:
    """Reverse discounted sum over the chain tokens of each packed sequence, ``(1, N)``.

    ``values`` and ``chain`` (bool) are ``(1, N)``; the result is 0 off the chain. Equal to
    the padded scan of :mod:`rlobjectives.advantages.gae` applied to each sequence separately.
    """
    ids = _sequence_ids(layout)  # (N,)
    tokens = ids.shape[0]
    selected = chain.reshape(-1)  # (N,)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    total = torch.where(selected, values.reshape(-1), zero)  # (N,) B
    one = torch.ones((), dtype=values.dtype, device=values.device)
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

    The packed form of ``_advantages._next_selected``: the first chain position after ``t``
    over the whole row (a reverse cumulative minimum), kept only when it lies before the end of
    ``t``'s sequence ``cu_seqlens[s + 1]``.
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


def _sequence_end(layout: Layout, positions: torch.Tensor) -> torch.Tensor:
    """One past the last token of each token's sequence, ``(N,)``."""
    ids = _sequence_ids(layout)
    if layout.cu_seqlens is not None:
        return layout.cu_seqlens[1:].index_select(0, ids)
    # Without the boundaries: the last position of each sequence, by a scatter of maxima.
    last = torch.full((layout.num_sequences,), -1, dtype=positions.dtype, device=ids.device)
    last = last.scatter_reduce(0, ids, positions, "amax")  # (S,)
    return last.index_select(0, ids) + 1
