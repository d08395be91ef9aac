"""Sequence layout: which tokens of a per-token tensor belong to which sequence.

Every per-sequence operation of the library (row sums for the reductions, the GSPO sequence
ratio, per-sequence outputs, broadcasting a per-sequence value back to its tokens) goes through
a :class:`Layout`, so that the math is written once for every layout:

- padded ``(B, T)``: row ``i`` is sequence ``i`` (``S = B``); :func:`padded`;
- packed ``(1, N)``: the tokens of ``S`` sequences concatenated, with per-token sequence ids
  and the boundaries ``cu_seqlens`` (:func:`rlobjectives._core.packing.packed_layout`).

Row sums of the padded layout are ``values.sum(-1)``; those of a packed layout are a
``segment_reduce`` over the contiguous runs ``cu_seqlens[i]:cu_seqlens[i + 1]`` (an
``index_add`` over the sequence ids when only the ids are known), counts a difference of the
integer cumulative count at the boundaries, and broadcasts an ``index_select`` by sequence id:
no host synchronisation (``S`` is static), each a few times cheaper on CPU than ``index_add`` /
advanced indexing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .masking import last_selected

__all__ = ["Layout", "padded"]


class Layout(NamedTuple):
    """The sequences of a ``(rows, tokens)`` per-token tensor.

    Attributes:
        num_sequences: S (a static Python int).
        sequence_ids: None for the padded layout (row ``i`` is sequence ``i``), else ``(N,)``
            int64 sequence index of every token of the packed ``(1, N)`` row.
        cu_seqlens: None, or the packed row's ``(S + 1,)`` int64 boundaries (validated).
    """

    num_sequences: int
    sequence_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None

    def row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``(S,)`` of per-token ``values`` (already masked)."""
        if self.sequence_ids is None:
            return values.sum(dim=-1)
        flat = values.reshape(-1)  # (N,)
        if self.cu_seqlens is not None and flat.is_floating_point():
            return torch.segment_reduce(flat, "sum", offsets=self.cu_seqlens)  # (S,)
        sums = torch.zeros(self.num_sequences, dtype=values.dtype, device=values.device)
        return sums.index_add(0, self.sequence_ids, flat)

    def row_counts(self, mask: torch.Tensor) -> torch.Tensor:
        """Selected tokens per sequence ``(S,)`` (int64) of a bool ``mask``."""
        if self.sequence_ids is None:
            return mask.sum(dim=-1)
        if self.cu_seqlens is None:
            return self.row_sums(mask.to(torch.int64))
        flat = mask.reshape(-1)  # (N,)
        running = torch.empty(flat.shape[0] + 1, dtype=torch.int64, device=flat.device)
        running[0] = 0  # (N + 1,) selected tokens before each position, no padded copy
        torch.cumsum(flat, 0, out=running[1:])
        return running.index_select(0, self.cu_seqlens).diff()  # (S,) exact differences

    def expand(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """``(S,)`` values broadcast to the tokens: ``(B, 1)`` padded, ``(1, N)`` packed."""
        if self.sequence_ids is None:
            return per_sequence.unsqueeze(-1)
        return per_sequence.index_select(0, self.sequence_ids).unsqueeze(0)

    def last_selected(self, mask: torch.Tensor) -> torch.Tensor:
        """Bool, the shape of ``mask``: True at the last selected token of each sequence.

        Packed: the largest selected position of each sequence (``scatter_reduce`` amax over the
        sequence ids, no host sync); a sequence with no selected token has none.
        """
        if self.sequence_ids is None:
            return last_selected(mask)
        flat = mask.reshape(-1)  # (N,)
        positions = torch.arange(flat.shape[0], device=flat.device)  # (N,)
        scored = torch.where(flat, positions, -1)  # (N,)
        last = torch.full((self.num_sequences,), -1, dtype=positions.dtype, device=flat.device)
        last = last.scatter_reduce(0, self.sequence_ids, scored, "amax")  # (S,)
        return ((positions == last[self.sequence_ids]) & flat).reshape(mask.shape)


def padded(batch: int) -> Layout:
    """The padded layout of ``batch`` rows (one sequence per row)."""
    return Layout(batch)
