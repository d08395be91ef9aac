r"""The packed (padding-free) layout: ``cu_seqlens``, :func:`pack` / :func:`unpack`, helpers.

Throughput-minded trainers concatenate the sequences of a micro-batch into one row and pass the
sequence boundaries to flash-attention as ``cu_seqlens`` (verl ``use_remove_padding``, TRL
``padding_free``, OpenRLHF packing). In that layout

- a per-token tensor is ``(N,)`` (or ``(1, N)``, as a model returns it): the ``N`` tokens of the
  ``S`` sequences, one after the other, with no padding;
- ``cu_seqlens`` is an integer ``(S + 1,)`` tensor, ``0`` first, non-decreasing, ``N`` last:
  sequence ``s`` is the run of tokens ``[cu_seqlens[s], cu_seqlens[s + 1])`` (empty when the two
  are equal);
- the mask still selects the tokens that count (the response tokens; prompt tokens inside a
  sequence are unselected); per-sequence values (advantages, rewards, scores) are ``(S,)``.

Every function of the library takes ``cu_seqlens=`` where its result depends on the sequence
boundaries and then equals the same function on the padded ``(S, T)`` layout of the same
sequences (to float rounding): :func:`pack` and :func:`unpack` convert between the two.

The boundary helpers (:func:`packed_layout`, :func:`token_matrix`, :func:`tokens_from_sequences`,
:func:`per_sequence`, :func:`longest_sequence`) are what a public function needs to accept the
layout: they validate once and build the :class:`~rlobjectives._layout.Layout` through which all
per-sequence math runs. Reading ``cu_seqlens``'s values to validate them is the one host
synchronisation (one ``(S + 1,)`` copy); it is skipped while ``torch.compile`` traces, and the
math after it has none (sequence ids by ``repeat_interleave`` with a static size, or while
tracing by a scatter of the boundaries and an integer cumsum; segment sums by
``segment_reduce``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._layout import Layout, padded
from ._validation import (
    ArrayLike,
    as_batch_matrix,
    as_mask,
    as_tensor,
    checks_environment,
    validate_choice,
)

__all__ = [
    "PackedTokens",
    "UnpackedTokens",
    "layout_from_cu_seqlens",
    "longest_sequence",
    "pack",
    "packed_layout",
    "per_sequence",
    "sequence_layout",
    "token_matrix",
    "token_ndim",
    "token_output",
    "tokens_from_sequences",
    "unpack",
    "validate_cu_seqlens",
]

PADDING_SIDES: tuple[str, ...] = ("right", "left")


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


def sequence_layout(cu_seqlens: ArrayLike | None, tokens: torch.Tensor) -> Layout:
    """The layout of validated per-token matrix ``tokens``: padded rows, or packed segments."""
    if cu_seqlens is None:
        return padded(tokens.shape[0])
    return packed_layout(cu_seqlens, tokens.shape[-1], device=tokens.device)


def longest_sequence(layout: Layout, tokens: int) -> int | torch.Tensor:
    """The padded width ``T`` of the layout's sequences: the longest packed sequence (0-d int64).

    The default Dr. GRPO constant: on a packed row it is the length :func:`unpack` pads to, so
    the packed loss equals the padded one.
    """
    if layout.sequence_ids is None:
        return tokens
    if layout.cu_seqlens is not None:
        lengths = layout.cu_seqlens.diff()  # (S,)
    else:
        ones = torch.ones(1, tokens, dtype=torch.int64, device=layout.sequence_ids.device)
        lengths = layout.row_sums(ones)  # (S,)
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


# --------------------------------------------------------------------------------------------
# pack / unpack
# --------------------------------------------------------------------------------------------


class PackedTokens(NamedTuple):
    """Result of :func:`pack`.

    Attributes:
        values: ``(N, ...)`` the selected positions of each row, row after row.
        cu_seqlens: ``(S + 1,)`` int64 sequence boundaries (``S = B``).
    """

    values: torch.Tensor
    cu_seqlens: torch.Tensor


class UnpackedTokens(NamedTuple):
    """Result of :func:`unpack`.

    Attributes:
        values: ``(S, T, ...)`` one sequence per row, ``padding_value`` elsewhere.
        mask: ``(S, T)`` bool, True at the positions that hold a token of the sequence.
    """

    values: torch.Tensor
    mask: torch.Tensor


@checks_environment
def pack(values: ArrayLike, attention_mask: ArrayLike) -> PackedTokens:
    r"""Pack a padded ``(B, T, ...)`` tensor into the padding-free layout.

    Row ``b``'s positions where ``attention_mask`` is True, in order, become sequence ``b``:

    .. math::

        \text{values}^{packed}_{c_b + k} = \text{values}_{b, j_k(b)}, \qquad
        c_b = \sum_{b' < b} n_{b'}, \quad n_b = \sum_j \text{attention\_mask}_{bj},

    with :math:`j_k(b)` the :math:`k`-th attended position of row :math:`b`, and
    ``cu_seqlens`` :math:`= (c_0, \dots, c_B)`. Right padding (``[tokens, pad]``), left padding
    (``[pad, tokens]``) and any mask with one run of ones per row give the usual packed row; a
    row with no attended position becomes an empty sequence. Pack each per-token tensor of a
    batch (log-probs, masks, values...) with the same ``attention_mask``; per-sequence tensors
    ``(B,)`` stay as they are (``S = B``). Exact (a gather) and differentiable; the number of
    tokens ``N`` is read once on the host (the output shape depends on it).

    Args:
        values: ``(B, T)`` or ``(B, T, ...)`` (e.g. hidden states ``(B, T, H)``, logits
            ``(B, T, V)``), any dtype.
        attention_mask: ``(B, T)`` bool or numeric; nonzero marks the positions that belong to
            the row's sequence (for response tensors: the response positions, or the loss mask).

    Returns:
        :class:`PackedTokens` ``(values, cu_seqlens)``: ``(N, ...)`` values in the dtype of
        ``values`` and ``(B + 1,)`` int64 boundaries, on the device of ``values``.

    Raises:
        ValueError: if ``values`` has fewer than 2 dimensions or ``attention_mask`` is not the
            ``(B, T)`` of ``values``, or they are on different devices.
        TypeError: on non-numeric inputs.

    Examples:
        >>> import torch
        >>> values = torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 4.0]])
        >>> packed = pack(values, torch.tensor([[1, 1, 0], [0, 1, 1]]))  # right, left padded
        >>> packed.values, packed.cu_seqlens
        (tensor([1., 2., 3., 4.]), tensor([0, 2, 4]))

    .. versionadded:: 0.2.0
    """
    values_t = as_tensor(values, "values")
    mask_t = as_batch_matrix(
        as_mask(attention_mask, "attention_mask", values_t.device), "attention_mask"
    )
    if values_t.ndim < 2 or tuple(values_t.shape[:2]) != tuple(mask_t.shape):
        raise ValueError(
            f"attention_mask must have the shape (B, T) of values' first two dimensions, got "
            f"values of shape {tuple(values_t.shape)} and attention_mask of shape "
            f"{tuple(mask_t.shape)}"
        )
    if mask_t.device != values_t.device:
        raise ValueError(
            f"attention_mask must be on the device of values ({values_t.device}), got device "
            f"{mask_t.device}"
        )
    lengths = mask_t.sum(-1)  # (B,)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))  # (B + 1,)
    return PackedTokens(values=values_t[mask_t], cu_seqlens=cu_seqlens)


@checks_environment
def unpack(
    values: ArrayLike,
    cu_seqlens: ArrayLike,
    *,
    length: int | None = None,
    padding_side: str = "right",
    padding_value: float | bool = 0.0,
) -> UnpackedTokens:
    r"""Unpack a packed ``(N, ...)`` tensor into the padded ``(S, T, ...)`` layout.

    Token :math:`c_s + k` of sequence :math:`s` goes to row :math:`s`, column :math:`k` (right
    padding) or :math:`T - n_s + k` (left padding), with :math:`n_s = c_{s+1} - c_s`; every other
    position holds ``padding_value``. The inverse of :func:`pack` for a mask with one run per row.
    Exact (a scatter) and differentiable with respect to ``values``.

    Args:
        values: ``(N,)``, ``(1, N)`` or ``(N, ...)`` packed values (e.g. ``(N, H)``).
        cu_seqlens: ``(S + 1,)`` integer boundaries: 0 first, non-decreasing, ``N`` last.
        length: ``T``, the padded width (a static int >= the longest sequence); None uses the
            longest sequence (read once on the host).
        padding_side: ``"right"`` (``[tokens, pad]``) or ``"left"`` (``[pad, tokens]``).
        padding_value: the value at padded positions (a Python number; a bool for bool
            values, e.g. a mask).

    Returns:
        :class:`UnpackedTokens` ``(values, mask)``: ``(S, T, ...)`` values in the dtype of
        ``values`` and the ``(S, T)`` bool mask of the sequences' positions.

    Raises:
        ValueError: on a malformed ``cu_seqlens`` (see :func:`rlobjectives.policy_loss`), an
            unknown ``padding_side``, or a ``length`` shorter than the longest sequence.
        TypeError: on non-numeric values, a non-int ``length`` or a non-number
            ``padding_value``.

    Examples:
        >>> import torch
        >>> out = unpack(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 3]),
        ...              padding_side="left")
        >>> out.values, out.mask
        (tensor([[1., 2.],
                [0., 3.]]), tensor([[ True,  True],
                [False,  True]]))

    .. versionadded:: 0.2.0
    """
    values_t = as_tensor(values, "values")
    validate_choice(padding_side, "padding_side", PADDING_SIDES)
    device = values_t.device
    if not isinstance(padding_value, (int, float)):  # bool is an int
        raise TypeError(
            f"padding_value must be a Python number or bool, got "
            f"{type(padding_value).__name__} ({padding_value!r})"
        )
    raw = _cu_tensor(cu_seqlens, device, "cu_seqlens", "values")
    total = int(raw[-1])  # N (host read: unpack is data preparation)
    if values_t.ndim >= 2 and values_t.shape[0] == 1 and values_t.shape[0] != total:
        values_t = values_t[0]  # (1, N, ...) as a model returns it
    if values_t.ndim < 1:
        raise ValueError(f"values must have shape (N, ...), got shape {tuple(values_t.shape)}")
    cu = validate_cu_seqlens(raw, values_t.shape[0], device, reference="values")
    tokens = values_t.shape[0]
    layout = layout_from_cu_seqlens(cu, tokens)
    ids = layout.sequence_ids
    assert ids is not None  # a packed layout
    lengths = cu[1:] - cu[:-1]  # (S,)
    width = _unpack_width(length, lengths)
    offsets = torch.arange(tokens, device=device) - cu[:-1][ids]  # (N,)
    if padding_side == "left":
        offsets = offsets + (width - lengths)[ids]
    sequences = layout.num_sequences
    out = values_t.new_full((sequences, width, *values_t.shape[1:]), padding_value)
    out = out.index_put((ids, offsets), values_t)  # (S, T, ...)
    mask = torch.zeros((sequences, width), dtype=torch.bool, device=device)
    mask = mask.index_put((ids, offsets), torch.ones((), dtype=torch.bool, device=device))
    return UnpackedTokens(values=out, mask=mask)


def _unpack_width(length: int | None, lengths: torch.Tensor) -> int:
    """``T``: the given static length (checked), or the longest sequence (one host read)."""
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise TypeError(f"length must be an int or None, got {type(length).__name__}")
    if torch.compiler.is_compiling():
        if length is None:
            raise ValueError("unpack needs a static length under torch.compile")
        return length
    longest = int(lengths.max()) if lengths.numel() else 0
    if length is None:
        return longest
    if length < longest:
        raise ValueError(f"length must be >= the longest sequence {longest}, got {length}")
    return length
