"""Sequence layout: which tokens of a per-token tensor belong to which sequence.

Every per-sequence operation of the library (row sums for the reductions, the GSPO sequence
ratio, per-sequence outputs, broadcasting a per-sequence value back to its tokens) goes through
a :class:`Layout`, so that the math is written once for every layout:

- padded ``(B, T)``: row ``i`` is sequence ``i`` (``S = B``); :func:`padded`;
- packed ``(1, N)``: the tokens of ``S`` sequences concatenated, with per-token sequence ids
  and the boundaries ``cu_seqlens`` (:func:`packed_layout`).

Row sums of the padded layout are ``values.sum(-1)``; those of a packed layout are a
``segment_reduce`` over the contiguous runs ``cu_seqlens[i]:cu_seqlens[i + 1]`` (an
``index_add`` over the sequence ids when only the ids are known), counts a difference of the
integer cumulative count at the boundaries, and broadcasts an ``index_select`` by sequence id:
no host synchronisation (``S`` is static), each a few times cheaper on CPU than ``index_add`` /
advanced indexing.

Two parts: the :class:`Layout` itself (row sums, counts, broadcast, last selected token); and the
boundary every public function passes through to accept either layout (:func:`sequence_layout`,
:func:`token_matrix`, :func:`validate_cu_seqlens` and :func:`packed_layout`, which read
``cu_seqlens`` once on the host, skipped while ``torch.compile`` traces; :func:`per_sequence`,
:func:`tokens_from_sequences`, :func:`longest_sequence`, :func:`token_output`). The reverse
recursions of GAE / REINFORCE++ / ReMax restarted at packed boundaries are
:mod:`rlobjectives._core.segments`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .context import ContextGroup, context_max, context_sum
from .validation import (
    ArrayLike,
    as_batch_matrix,
    as_float_tensor,
    as_tensor,
    check_same_device,
    check_shape,
)

__all__ = [
    "ContextGroup",
    "Layout",
    "last_selected",
    "layout_from_cu_seqlens",
    "longest_sequence",
    "packed_layout",
    "padded",
    "per_sequence",
    "sequence_layout",
    "token_matrix",
    "token_tensor",
    "token_ndim",
    "token_output",
    "tokens_from_sequences",
    "validate_cu_seqlens",
]


class Layout(NamedTuple):
    """The sequences of a ``(rows, tokens)`` per-token tensor.

    Under context parallelism (``context`` set) the tensors hold this rank's tokens of the
    ``S`` sequences (every rank the same sequences in the same order): :meth:`row_sums`,
    :meth:`row_counts`, :meth:`total` and :meth:`last_selected` are those of the whole
    sequences (one all-reduce each, :mod:`rlobjectives._core.context`); the ``local_*`` methods
    and :meth:`combine` let a caller batch several sums into one all-reduce.

    Attributes:
        num_sequences: S (a static Python int).
        sequence_ids: None for the padded layout (row ``i`` is sequence ``i``), else ``(N,)``
            int64 sequence index of every token of the packed ``(1, N)`` row.
        cu_seqlens: None, or the packed row's ``(S + 1,)`` int64 boundaries (validated).
        context: None, or the context-parallel group whose ranks hold the other tokens.
    """

    num_sequences: int
    sequence_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    context: ContextGroup | None = None

    def combine(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-rank partial sums summed over the context group (one all-reduce); else as given.

        Identity backward: the results are replicated on every rank of the group.
        """
        if self.context is None:
            return tensors
        return context_sum(self.context, *tensors)

    def row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``(S,)`` of per-token ``values`` (already masked), whole sequences."""
        local = self.local_row_sums(values)
        return local if self.context is None else self.combine(local)[0]

    def row_counts(self, mask: torch.Tensor) -> torch.Tensor:
        """Selected tokens per sequence ``(S,)`` (int64) of a bool ``mask``, whole sequences."""
        local = self.local_row_counts(mask)
        return local if self.context is None else self.combine(local)[0]

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The sum ``()`` of every entry of ``values`` (already masked), over the group."""
        local = values.sum()
        return local if self.context is None else self.combine(local)[0]

    def local_row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``(S,)`` of this rank's tokens (no communication)."""
        if self.sequence_ids is None:
            return values.sum(dim=-1)
        flat = values.reshape(-1)  # (N,)
        if self.cu_seqlens is not None and flat.is_floating_point():
            return torch.segment_reduce(flat, "sum", offsets=self.cu_seqlens)  # (S,)
        sums = torch.zeros(self.num_sequences, dtype=values.dtype, device=values.device)
        return sums.index_add(0, self.sequence_ids, flat)

    def local_row_counts(self, mask: torch.Tensor) -> torch.Tensor:
        """Selected tokens per sequence ``(S,)`` (int64) of this rank (no communication)."""
        if self.sequence_ids is None:
            return torch.count_nonzero(mask, dim=-1)
        if self.cu_seqlens is None:
            return self.local_row_sums(mask.to(torch.int64))
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
        sequence ids, no host sync); a sequence with no selected token has none. Under context
        parallelism the last selected token of a sequence lies on the last rank (in group order,
        the order of the chunks) holding a selected token of it: one ``all_reduce(MAX)`` of
        ``(S,)`` rank indices.
        """
        local = self.local_last_selected(mask)
        if self.context is None:
            return local
        holds = self.local_row_counts(mask) > 0  # (S,)
        rank = self.context.rank
        owner = context_max(self.context, torch.where(holds, rank, -1))  # (S,) last holder
        return local & self.expand(owner == rank)

    def first_selected(self, mask: torch.Tensor) -> torch.Tensor:
        """Bool, the shape of ``mask``: True at the first selected token of each sequence here.

        This rank's tokens only (no communication): the first element of its chunk.
        """
        if self.sequence_ids is None:
            return last_selected(mask.flip(-1)).flip(-1)
        flat = mask.reshape(-1)  # (N,)
        tokens = flat.shape[0]
        positions = torch.arange(tokens, device=flat.device)  # (N,)
        scored = torch.where(flat, positions, tokens)  # (N,)
        first = torch.full((self.num_sequences,), tokens, dtype=positions.dtype, device=flat.device)
        first = first.scatter_reduce(0, self.sequence_ids, scored, "amin")  # (S,)
        return ((positions == first[self.sequence_ids]) & flat).reshape(mask.shape)

    def local_selected_after(self, mask: torch.Tensor) -> torch.Tensor:
        """Int64, the shape of ``mask``: this rank's selected tokens after ``t`` in its sequence.

        A difference of integer cumulative sums (exact): the row's (packed: the sequence's)
        total minus the running count up to ``t`` included.
        """
        if self.sequence_ids is None:
            running = mask.to(torch.int64).cumsum(-1)  # (B, T)
            total = running[:, -1:] if mask.shape[-1] else running
            return total - running
        flat = mask.reshape(-1).to(torch.int64)  # (N,)
        running = torch.cat([flat.new_zeros(1), flat.cumsum(0)])  # (N + 1,) before each position
        positions = torch.arange(flat.shape[0], device=flat.device)
        ends = _sequence_end(self, positions)  # (N,) one past the end of t's sequence
        return (running.index_select(0, ends) - running[1:]).reshape(mask.shape)

    def local_last_selected(self, mask: torch.Tensor) -> torch.Tensor:
        """Bool: True at the last selected token of each sequence among this rank's tokens."""
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


def last_selected(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, T)``: True at the last selected token of each row (no row: all False).

    No host sync: the index is an ``argmax`` over ``where(mask, t, -1)``.
    """
    tokens = mask.shape[-1]
    if tokens == 0:
        return mask.clone()
    positions = torch.arange(tokens, device=mask.device)  # (T,)
    scored = torch.where(mask, positions, -1)  # (B, T)
    last_index = scored.argmax(dim=-1, keepdim=True)  # (B, 1)
    return (positions == last_index) & mask  # (B, T); all False where a row is empty


def _sequence_ids(layout: Layout) -> torch.Tensor:
    assert layout.sequence_ids is not None  # internal invariant: a packed layout
    return layout.sequence_ids


def _sequence_end(layout: Layout, positions: torch.Tensor) -> torch.Tensor:
    """One past the last token of each token's sequence, ``(N,)``."""
    ids = _sequence_ids(layout)
    if layout.cu_seqlens is not None:
        return layout.cu_seqlens[1:].index_select(0, ids)
    # Without the boundaries: the last position of each sequence, by a scatter of maxima.
    last = torch.full((layout.num_sequences,), -1, dtype=positions.dtype, device=ids.device)
    last = last.scatter_reduce(0, ids, positions, "amax")  # (S,)
    return last.index_select(0, ids) + 1


def _check_rank(tensor: torch.Tensor, name: str) -> None:
    """A packed per-token tensor must be ``(N,)`` or ``(1, N)``."""
    if tensor.ndim == 1 or (tensor.ndim == 2 and tensor.shape[0] == 1):
        return
    raise ValueError(
        f"{name} must have shape (N,) or (1, N) in the packed layout (cu_seqlens given), got "
        f"shape {tuple(tensor.shape)}"
    )


def token_matrix(tensor: torch.Tensor, name: str, packed: bool) -> torch.Tensor:
    """A per-token argument as a matrix: ``(B, T)`` padded, ``(1, N)`` packed (from ``(N,)``)."""
    if not packed:
        return as_batch_matrix(tensor, name)
    _check_rank(tensor, name)
    return tensor.reshape(1, -1)


def token_tensor(
    value: ArrayLike, name: str, like: tuple[str, torch.Tensor], shape: Sequence[int], packed: bool
) -> torch.Tensor:
    """A floating per-token argument as :func:`token_matrix`, of the tokens' ``shape``.

    On the device of ``like`` (its name and tensor; the messages name both).
    """
    tensor = token_matrix(as_float_tensor(value, name, like[1].device), name, packed)
    check_same_device({like[0]: like[1], name: tensor})
    check_shape(tensor, name, shape, "tokens")
    return tensor


def token_ndim(value: ArrayLike) -> int:
    """The number of dimensions of a tensor, array or nested list (without converting it)."""
    if hasattr(value, "ndim"):
        return int(value.ndim)
    depth = 0
    while isinstance(value, (list, tuple)):
        depth += 1
        if not value:
            break
        value = value[0]
    return depth


def token_output(tensor: torch.Tensor, flat: bool) -> torch.Tensor:
    """A per-token result in the caller's shape: ``(N,)`` when the inputs were ``(N,)``."""
    return tensor.reshape(-1) if flat else tensor


def validate_cu_seqlens(
    cu_seqlens: ArrayLike,
    num_tokens: int,
    device: torch.device,
    *,
    name: str = "cu_seqlens",
    reference: str = "the per-token tensors",
) -> torch.Tensor:
    """Check ``cu_seqlens`` against ``N`` tokens; return it as int64 ``(S + 1,)`` on ``device``.

    Shape, dtype and device are checked always; the values (0 first, ``N`` last,
    non-decreasing) with one host read, except while ``torch.compile`` traces.

    Raises:
        ValueError: naming ``name``, for a floating/bool dtype, a rank other than 1, no entry,
            another device, or values that are not 0 first, ``N`` last and non-decreasing.
    """
    cu = _cu_tensor(cu_seqlens, device, name, reference)
    if not torch.compiler.is_compiling():
        _check_values(cu, num_tokens, name)
    return cu


def _cu_tensor(
    cu_seqlens: ArrayLike, device: torch.device, name: str, reference: str
) -> torch.Tensor:
    """``cu_seqlens`` as int64 ``(S + 1,)`` on ``device``: dtype, rank and device checks."""
    if isinstance(cu_seqlens, torch.Tensor):
        cu: torch.Tensor = cu_seqlens
    else:
        try:
            cu = as_tensor(cu_seqlens, name, device)
        except TypeError as error:
            raise ValueError(f"{name} must hold integers: {error}") from None
    if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise ValueError(
            f"{name} must be an integer tensor (int32 or int64) of sequence boundaries, got "
            f"dtype {cu.dtype}"
        )
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(
            f"{name} must have shape (S + 1,) (1 dimension, at least the leading 0), got shape "
            f"{tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(
            f"{name} must be on the device of {reference} ({device}), got device {cu.device}"
        )
    return cu.to(torch.int64)


_HOST_CHECKED = 1025  # boundaries read whole by _check_values (S <= 1024 sequences)


def _check_values(cu: torch.Tensor, num_tokens: int, name: str) -> None:
    """0 first, ``N`` last, non-decreasing: one host read.

    Up to :data:`_HOST_CHECKED` boundaries are read whole and checked on the host (one small
    operation instead of five, each of which costs microseconds after the large passes of a
    loss); longer ones are reduced on the device to three numbers first.
    """
    if cu.shape[0] <= _HOST_CHECKED:
        values = cu.tolist()
        first, last = values[0], values[-1]
        shortest = min((b - a for a, b in zip(values, values[1:], strict=False)), default=0)
    else:
        steps = cu.diff().amin()  # the shortest sequence
        first, last, shortest = torch.stack([cu[0], cu[-1], steps]).tolist()
    flags = [first != 0, last != num_tokens, shortest < 0]
    if not any(flags):
        return
    values = cu.tolist()
    shown = values if len(values) <= 12 else [*values[:6], "...", *values[-5:]]
    if flags[0]:
        problem = f"must start at 0, got {name}[0] = {values[0]}"
    elif flags[1]:
        problem = f"must end at N = {num_tokens} (the number of tokens), got {values[-1]}"
    else:
        problem = "must be non-decreasing (sequence s is tokens cu[s]:cu[s + 1])"
    raise ValueError(f"{name} {problem}; {name} = {shown}")


def layout_from_cu_seqlens(cu: torch.Tensor, num_tokens: int) -> Layout:
    """The :class:`Layout` of a packed ``(1, N)`` row with validated int64 boundaries ``cu``.

    ``sequence_ids`` repeats ``s`` ``cu[s + 1] - cu[s]`` times: the one-argument
    ``repeat_interleave`` of the lengths, which returns those indices directly (no gather of an
    ``arange``), with a static output size (no host sync; an empty sequence owns no token).
    """
    if torch.compiler.is_compiling():
        sequence_ids = _traced_sequence_ids(cu, num_tokens)
    else:
        sequence_ids = torch.repeat_interleave(cu.diff(), output_size=num_tokens)  # (N,)
    return Layout(cu.shape[0] - 1, sequence_ids, cu)


def _traced_sequence_ids(cu: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``sequence_ids`` while ``torch.compile`` traces: a count of boundaries, then a cumsum.

    Inductor lowers ``repeat_interleave`` with ``output_size`` to a ``searchsorted`` that runs
    as a scalar binary search per token (0.8 ms for N = 140k on one CPU thread, more than the
    whole fused loss); ``ids[t] = #{s >= 1 : cu[s] <= t}`` by a scatter of the ``S`` boundaries and
    an integer cumulative sum is exact and fuses with its neighbours.
    """
    starts = torch.zeros(num_tokens + 1, dtype=torch.int64, device=cu.device)
    starts = starts.index_add(0, cu[1:], torch.ones_like(cu[1:]))  # boundaries at each token
    return starts[:num_tokens].cumsum(0)  # (N,)


def packed_layout(
    cu_seqlens: ArrayLike,
    num_tokens: int,
    *,
    device: torch.device | None = None,
    name: str = "cu_seqlens",
) -> Layout:
    """Validate ``cu_seqlens`` for ``N`` tokens on ``device`` and build the packed :class:`Layout`.

    The boundary helper of every public function that takes ``cu_seqlens`` (see
    :func:`validate_cu_seqlens` for the checks). ``device`` defaults to the device of
    ``cu_seqlens`` (CPU for a list).
    """
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    cu = validate_cu_seqlens(cu_seqlens, num_tokens, device, name=name)
    return layout_from_cu_seqlens(cu, num_tokens)


def sequence_layout(
    cu_seqlens: ArrayLike | None, tokens: torch.Tensor, context: ContextGroup | None = None
) -> Layout:
    """The layout of validated per-token matrix ``tokens``: padded rows, or packed segments.

    ``context``: the validated context-parallel group whose ranks hold the sequences' other
    tokens (None: whole sequences here).
    """
    if cu_seqlens is None:
        layout = Layout(tokens.shape[0])  # padded: one sequence per row
    else:
        layout = packed_layout(cu_seqlens, tokens.shape[-1], device=tokens.device)
    if context is None:
        return layout
    return layout._replace(context=context._replace(device=tokens.device))


def longest_sequence(layout: Layout, tokens: int) -> int | torch.Tensor:
    """The padded width ``T`` of the layout's sequences: the longest packed sequence (0-d int64).

    The default Dr. GRPO constant: on a packed row it is the length :func:`unpack` pads to, so
    the packed loss equals the padded one. Under context parallelism: the width of the whole
    sequences, the sum of the ranks' padded widths ``T_r`` (each rank's rows a contiguous slice
    of the padded rows, Megatron CP's split) or the longest whole packed sequence (the sum of
    its local lengths); one all-reduce.
    """
    if layout.sequence_ids is None:
        if layout.context is None:
            return tokens
        device = layout.context.device
        return layout.combine(torch.tensor(tokens, dtype=torch.int64, device=device))[0]
    if layout.cu_seqlens is not None:
        lengths = layout.cu_seqlens.diff()  # (S,)
    else:
        ones = torch.ones(1, tokens, dtype=torch.int64, device=layout.sequence_ids.device)
        lengths = layout.local_row_sums(ones)  # (S,)
    lengths = layout.combine(lengths)[0]  # whole sequences under context parallelism
    return torch.cat([lengths, lengths.new_zeros(1)]).amax()


def per_sequence(values: torch.Tensor, name: str, layout: Layout, reference: str) -> torch.Tensor:
    """Per-sequence values (rewards, scores) as ``(S,)``: accepts ``(S,)`` or ``(S, 1)``."""
    sequences = layout.num_sequences
    if values.ndim == 2 and values.shape[1] == 1:
        values = values.squeeze(-1)
    if values.ndim != 1 or values.shape[0] != sequences:
        what = "B" if layout.sequence_ids is None else "S"
        raise ValueError(
            f"{name} must have shape ({what},) = ({sequences},) or ({what}, 1) (one value per "
            f"sequence of {reference}), got shape {tuple(values.shape)}"
        )
    return values


def tokens_from_sequences(
    values: torch.Tensor, name: str, layout: Layout, reference: str
) -> torch.Tensor:
    """Packed per-sequence or per-token values as the per-token ``(1, N)`` row.

    ``(S,)`` and ``(S, 1)`` are per sequence (broadcast to their tokens; when ``N == S`` a 1-D
    tensor is read as per sequence); ``(1, N)`` and ``(N,)`` are per token.
    """
    assert layout.sequence_ids is not None  # internal invariant: a packed layout
    sequences, tokens = layout.num_sequences, layout.sequence_ids.shape[0]
    if values.ndim == 1 and values.shape[0] == sequences:
        return layout.expand(values)
    if values.ndim == 2 and values.shape == (sequences, 1):
        return layout.expand(values.squeeze(-1))
    if values.ndim in (1, 2) and values.numel() == tokens and values.shape[0] in (1, tokens):
        return values.reshape(1, tokens)
    raise ValueError(
        f"{name} must have shape (S,) = ({sequences},) or (S, 1) (per sequence), or (N,) / "
        f"(1, N) with N = {tokens} (per token) in the packed layout of {reference}, got shape "
        f"{tuple(values.shape)}"
    )
