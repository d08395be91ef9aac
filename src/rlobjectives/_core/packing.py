r"""The packed (padding-free) layout and the public conversions :func:`pack` / :func:`unpack`.

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

The boundary helpers a public function needs to accept the layout (``cu_seqlens`` validation,
``packed_layout``, ``token_matrix``, ``tokens_from_sequences``, ``per_sequence``,
``longest_sequence``) live with :class:`~rlobjectives._core.layout.Layout` in
:mod:`rlobjectives._core.layout`; this module holds the public conversions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import _cu_tensor, layout_from_cu_seqlens, validate_cu_seqlens
from .validation import (
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
    "pack",
    "unpack",
]


PADDING_SIDES: tuple[str, ...] = ("right", "left")


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
