"""Causal-LM alignment on a packed row: the one-token shift inside each sequence.

In the packed layout the ``S`` sequences (prompt, then response) are concatenated into one row of
``N`` tokens with boundaries ``cu_seqlens``. The logits at position ``j`` predict the token at
``j + 1``, so response token ``j`` of sequence ``s`` is scored by row ``j - 1``; the first token
of a sequence (``j = cu_seqlens[s]``) is never scored (the row before it belongs to the previous
sequence), which is why every sequence needs a prompt of at least one token. The result stays in
the packed layout: ``(N,)`` tensors aligned with ``input_ids``, whose mask selects the response
tokens, ready for :func:`rlobjectives.policy_loss` with the same ``cu_seqlens``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.layout import Layout, layout_from_cu_seqlens, token_matrix, validate_cu_seqlens
from .._core.reduction import masked_fill_zero
from .._core.validation import ArrayLike, as_mask, as_token_ids, check_same_device, check_shape

__all__ = ["PackedAlignment", "PackedStarts", "packed_alignment", "packed_starts"]


class PackedStarts(NamedTuple):
    """Where each packed sequence's response starts."""

    start: torch.Tensor  # (S,) int64 absolute position of the first response token
    cu: torch.Tensor  # (S + 1,) int64 boundaries
    layout: Layout


def packed_starts(
    ids: torch.Tensor,
    prompt_lengths: ArrayLike | None,
    response_start: ArrayLike | int | None,
    cu_seqlens: ArrayLike,
    check_layout: bool = True,
) -> PackedStarts:
    """Validate the boundaries and the one start argument ``(S,)`` of a ``(1, N)`` row.

    ``check_layout`` checks the starts on the host (skipped under ``torch.compile``).
    """
    device = ids.device
    cu = validate_cu_seqlens(cu_seqlens, ids.shape[1], device)
    sequences = cu.shape[0] - 1
    if (prompt_lengths is None) == (response_start is None):
        raise ValueError(
            "give exactly one of prompt_lengths (prompt length of each packed sequence) and "
            "response_start (absolute position of its first response token), got "
            f"{'both' if prompt_lengths is not None else 'neither'}"
        )
    name = "prompt_lengths" if prompt_lengths is not None else "response_start"
    given = prompt_lengths if response_start is None else response_start
    value = as_token_ids(given, name, device)
    if value.ndim != 1 or value.shape[0] != sequences:
        raise ValueError(
            f"{name} must have shape (S,) = ({sequences},) (one per sequence of cu_seqlens) in "
            f"the packed layout, got shape {tuple(value.shape)}"
        )
    check_same_device({"input_ids": ids, name: value})
    value = value.to(torch.int64)
    start = cu[:-1] + value if name == "prompt_lengths" else value  # (S,)
    if check_layout and not torch.compiler.is_compiling():
        _check_starts(start, cu, name, value)
    return PackedStarts(start, cu, layout_from_cu_seqlens(cu, ids.shape[1]))


def _check_starts(start: torch.Tensor, cu: torch.Tensor, name: str, given: torch.Tensor) -> None:
    """One host read: every response starts after at least one prompt token, inside its run."""
    flags = torch.stack(
        [(start < cu[:-1] + 1).any(), (start > cu[1:]).any()] if start.numel() else [start.any()]
    ).tolist()
    if not any(flags):
        return
    if flags[0]:
        problem = (
            "must leave at least one prompt token in every sequence (the first token of a "
            "packed sequence has no logits row predicting it inside the sequence)"
        )
    else:
        lengths = (cu[1:] - cu[:-1]).tolist()
        problem = f"must leave the response inside its sequence (lengths {lengths})"
    raise ValueError(f"{name} {problem}, got {given.tolist()}")


class PackedAlignment(NamedTuple):
    """``(1, N)`` positions, tokens and mask (see :class:`rlobjectives.ResponseAlignment`)."""

    positions: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor


def packed_alignment(
    input_ids: torch.Tensor,
    prompt_lengths: ArrayLike | None,
    attention_mask: ArrayLike | None,
    response_start: ArrayLike | int | None,
    cu_seqlens: ArrayLike,
    check_layout: bool,
) -> PackedAlignment:
    """The response tokens of a packed ``(1, N)`` row and the rows that predict them.

    Token ``j`` of sequence ``s`` is a response token when ``start_s <= j`` (and it is attended);
    it is never the first token of its sequence, so the predicting row ``j - 1`` is in the same
    sequence even without the host checks.
    """
    ids = token_matrix(input_ids, "input_ids", True)  # (1, N)
    device = ids.device
    tokens = ids.shape[1]
    attention = None
    if attention_mask is not None:
        attention = as_mask(attention_mask, "attention_mask", device)
        attention = token_matrix(attention, "attention_mask", True)
        check_same_device({"input_ids": ids, "attention_mask": attention})
        check_shape(attention, "attention_mask", tuple(ids.shape), "input_ids")
    starts = packed_starts(ids, prompt_lengths, response_start, cu_seqlens, check_layout)
    sequence_ids = starts.layout.sequence_ids
    assert sequence_ids is not None  # a packed layout
    positions = torch.arange(tokens, device=device)  # (N,)
    first = starts.cu[:-1][sequence_ids]  # (N,) first token of each token's sequence
    mask = (positions >= starts.start[sequence_ids]) & (positions > first)  # (N,)
    if attention is not None:
        mask = mask & attention[0]
    mask = mask.unsqueeze(0)  # (1, N)
    token_ids = masked_fill_zero(ids.to(torch.int64), mask)  # (1, N)
    predicting = (positions - 1).clamp(min=0).unsqueeze(0)  # (1, N) rows j - 1
    return PackedAlignment(positions=predicting, tokens=token_ids, mask=mask)
