"""Causal-LM alignment: which logits row predicts each response token (the one-token shift).

For a causal LM the logits (or the final hidden state) at position ``j`` predict the token at
``j + 1``. :func:`response_alignment` locates the response tokens of a padded batch and the rows
that predict them; :func:`~rlobjectives.logprobs.responses.response_log_probs` gathers the
response-token log-probabilities from full-sequence logits with that shift.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.layout import token_output
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    as_batch_matrix,
    as_mask,
    as_token_ids,
    check_same_device,
    check_shape,
    checks_environment,
    validate_bool,
)
from .packed_shift import packed_alignment

__all__ = ["ResponseAlignment", "response_alignment"]


class ResponseAlignment(NamedTuple):
    """Where each response token of a causal-LM batch sits, and which row predicts it.

    Attributes:
        positions: ``(B, R)`` int64: index ``j - 1`` of the logits/hidden row (in the ``L``
            axis) that predicts response token ``t`` at absolute position ``j``; a valid index
            (not meaningful) where ``mask`` is False. Packed: ``(N,)`` (the shape of
            ``input_ids``), entry ``j`` for the token at ``j``.
        tokens: ``(B, R)`` int64: the response token ``input_ids[b, j]``; 0 where ``mask`` is
            False. Packed: ``(N,)``.
        mask: ``(B, R)`` bool: True for real response tokens. Packed: ``(N,)``, True at the
            response tokens of each sequence.
    """

    positions: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor


def _start_argument(
    prompt_lengths: ArrayLike | None,
    response_start: ArrayLike | int | None,
    batch: int,
    device: torch.device,
) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` of the one given start argument, checked for shape ``(B,)``."""
    if (prompt_lengths is None) == (response_start is None):
        raise ValueError(
            "give exactly one of prompt_lengths (real prompt lengths) and response_start "
            "(absolute column of the first response token), got "
            f"{'both' if prompt_lengths is not None else 'neither'}"
        )
    name = "prompt_lengths" if prompt_lengths is not None else "response_start"
    value = as_token_ids(prompt_lengths if response_start is None else response_start, name, device)
    if name == "response_start" and value.ndim == 0:
        value = value.expand(batch)
    if value.ndim != 1 or value.shape[0] != batch:
        raise ValueError(
            f"{name} must have shape (B,) = ({batch},) from input_ids, got shape "
            f"{tuple(value.shape)}"
        )
    return name, value


def _split_layout_with_unequal_starts(
    attention_mask: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """Whether responses start at different columns in a verl/TRL-layout batch.

    A row padded on both sides marks that layout (left-padded prompts, right-padded
    responses), where every response starts at one column. Rows padded on one side only are
    ambiguous (each row may have its own layout), so they are never flagged.
    """
    nonempty = lengths > 0  # (B,)
    both_sides = nonempty & (attention_mask[:, 0] == 0) & (end < attention_mask.shape[1])
    low = torch.where(nonempty, start, start.max()).min()
    high = torch.where(nonempty, start, start.min()).max()
    return both_sides.any() & (low != high)


def _check_layout(
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor,
    lengths: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    response_length: int,
    name: str,
) -> None:
    """Host-side check of the padding layout (one synchronisation; skipped under compile)."""
    # Each row's attended tokens must be one contiguous run: at most one 0 -> 1 transition.
    padded = torch.nn.functional.pad(attention_mask.to(torch.int8), (1, 0))  # (B, L + 1)
    run_starts = (padded[:, 1:] > padded[:, :-1]).sum(-1)  # (B,)
    checks = torch.stack(
        [
            (run_starts > 1).any(),
            (prompt_lengths < 1).any(),
            (prompt_lengths > lengths).any(),
            ((end - start) > response_length).any(),
            _split_layout_with_unequal_starts(attention_mask, lengths, start, end),
        ]
    ).tolist()
    if checks[0]:
        raise ValueError(
            "attention_mask must mark each sequence as one contiguous run of ones (right "
            "padding, left padding, or left-padded prompt + right-padded response); got a row "
            "with more than one run (packed sequences are not supported)"
        )
    if name == "prompt_lengths":
        too_short = "must be >= 1 for every sequence (the first token has no logits predicting it)"
        too_long = f"must be <= the number of attended tokens of each sequence {lengths.tolist()}"
        given = prompt_lengths.tolist()
    else:
        too_short = (
            "must leave at least one prompt token in every sequence (column f_b + 1 or later)"
        )
        too_long = (
            f"must leave the response inside the attended tokens (lengths {lengths.tolist()})"
        )
        given = start.tolist()
    if checks[1]:
        raise ValueError(f"{name} {too_short}, got {given}")
    if checks[2]:
        raise ValueError(f"{name} {too_long}, got {given}")
    if checks[4] and name == "prompt_lengths":
        raise ValueError(
            "prompt_lengths: this batch has left-padded prompts and right-padded responses (the "
            "verl/TRL layout), where every response starts at the same column, but "
            f"first attended position + prompt_lengths gives starts {start.tolist()}; pass the "
            "real prompt lengths (padding excluded), or response_start=<padded prompt width>"
        )
    if checks[3]:
        raise ValueError(
            f"response_length={response_length} is shorter than the longest response "
            f"{int((end - start).max())}; pass a larger response_length"
        )


@checks_environment
def response_alignment(
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike | None,
    attention_mask: ArrayLike,
    *,
    response_length: int | None = None,
    check_layout: bool = True,
    response_start: ArrayLike | int | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> ResponseAlignment:
    r"""Locate the response tokens of a causal-LM batch and the rows that predict them.

    For a causal LM the logits (or final hidden state) at position :math:`j` predict the token
    at position :math:`j + 1`. With :math:`f_b` the first attended position of row :math:`b`,
    :math:`n_b = \sum_j \text{attention\_mask}_{bj}` and :math:`P_b` the prompt length, the
    response occupies positions :math:`j \in [f_b + P_b,\ f_b + n_b)` and response token
    :math:`t` (:math:`j = f_b + P_b + t`) is predicted by row :math:`j - 1`:

    .. math::

        \log \pi(y_{bt}) = \log\mathrm{softmax}(\text{logits}_{b, j-1})[\text{input\_ids}_{bj}].

    Supported layouts (each row's ones in ``attention_mask`` form one contiguous run): right
    padding, left padding, and the verl/TRL layout ``[pad, prompt, response, pad]``, where the
    responses start at the padded prompt width: pass ``response_start=prompt_width`` there, not
    that width as ``prompt_lengths``. Packed sequences (``cu_seqlens``): the result is ``(N,)``
    aligned with ``input_ids``, never shifted across a sequence boundary. Details, and the use
    with hidden states: docs/objectives/logprobs.md, "response_alignment".

    Args:
        input_ids: ``(B, L)`` integer token ids of the full sequences (packed: ``(N,)``).
        prompt_lengths: ``(B,)`` integer number of prompt tokens of each row (excluding
            padding), each in ``[1, n_b]`` (packed ``(S,)``); None with ``response_start``.
        attention_mask: ``(B, L)`` bool or numeric, nonzero = real token.
        response_length: R, the number of response columns of the result (a static int >= 1);
            None uses ``L - 1`` (always enough); the generation length gives a tight ``(B, R)``.
        check_layout: check the layout rules above on the host (one device synchronisation,
            skipped while ``torch.compile`` traces); disable once the data pipeline is trusted.
        response_start: instead of ``prompt_lengths``: each row's first response column, an
            int (e.g. the verl/TRL padded prompt width) or ``(B,)``, in ``[f_b + 1, f_b + n_b]``.
        cu_seqlens: ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last), or None for the padded layout (see above).

    Returns:
        :class:`ResponseAlignment` ``(positions, tokens, mask)``, each ``(B, R)`` (packed: the
        shape of ``input_ids``).

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``response_length < 1``, and
            (with ``check_layout``) a non-contiguous attention mask, a prompt length outside
            ``[1, n_b]`` (a response start outside ``[f_b + 1, f_b + n_b]``) or a response longer
            than ``response_length``; both or neither of ``prompt_lengths`` and
            ``response_start``; a malformed ``cu_seqlens``, or packed sequences whose prompt is
            empty or whose start lies outside them (with ``check_layout``).
        TypeError: on non-integer ``input_ids`` or ``prompt_lengths``.

    References:
        The next-token factorisation of causal language models, Radford et al. 2018 (GPT)
        Eq. 1; response-only log-probabilities as used by PPO-RLHF, Ouyang et al. 2022,
        arXiv:2203.02155 Eq. 2.

    Examples:
        >>> import torch
        >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
        >>> a = response_alignment(ids, [2, 1], ids != 0, response_length=3)
        >>> a.positions.tolist(), a.tokens.tolist(), a.mask.tolist()
        ([[1, 0, 0], [0, 1, 2]], [[7, 0, 0], [6, 7, 8]], [[True, False, False], [True, True, True]])

    .. versionadded:: 0.1.0
    """
    if cu_seqlens is not None:
        return _packed_response_alignment(
            input_ids,
            prompt_lengths,
            attention_mask,
            response_length=response_length,
            check_layout=check_layout,
            response_start=response_start,
            cu_seqlens=cu_seqlens,
        )
    ids = as_batch_matrix(as_token_ids(input_ids, "input_ids", None), "input_ids")
    device = ids.device
    attention = as_batch_matrix(as_mask(attention_mask, "attention_mask", device), "attention_mask")
    batch, length = ids.shape
    if length < 1:
        raise ValueError(f"input_ids must have at least one position, got shape {(batch, length)}")
    check_shape(attention, "attention_mask", (batch, length), "input_ids")
    name, starts = _start_argument(prompt_lengths, response_start, batch, device)
    check_same_device({"input_ids": ids, "attention_mask": attention, name: starts})
    if response_length is None:
        response_length = max(length - 1, 1)
    elif isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(
            f"response_length must be an int or None, got {type(response_length).__name__}"
        )
    elif response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {response_length}")
    lengths = attention.sum(-1)  # (B,) n_b
    first = attention.to(torch.int8).argmax(-1)  # (B,) f_b (0 for an empty row)
    starts = starts.to(torch.int64)
    # absolute position of the first response token, and the equivalent prompt lengths
    start = first + starts if name == "prompt_lengths" else starts.expand(batch)  # (B,)
    end = first + lengths  # (B,) one past the last attended position
    if validate_bool(check_layout, "check_layout") and not torch.compiler.is_compiling():
        _check_layout(attention, start - first, lengths, start, end, response_length, name)
    offsets = torch.arange(response_length, device=device)  # (R,)
    absolute = start.unsqueeze(-1) + offsets  # (B, R) positions j
    mask = (absolute < end.unsqueeze(-1)) & (absolute >= 1)  # (B, R)
    absolute = torch.where(mask, absolute, 1).clamp(max=length - 1)  # (B, R)
    tokens = masked_fill_zero(ids.gather(1, absolute).to(torch.int64), mask)  # (B, R)
    positions = (absolute - 1).clamp(min=0)  # (B, R) rows predicting the response tokens
    return ResponseAlignment(positions=positions, tokens=tokens, mask=mask)


def _packed_response_alignment(
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike | None,
    attention_mask: ArrayLike | None,
    *,
    response_length: int | None,
    check_layout: bool,
    response_start: ArrayLike | int | None,
    cu_seqlens: ArrayLike,
) -> ResponseAlignment:
    """:func:`response_alignment` on a packed row (:mod:`rlobjectives.logprobs.packed_shift`)."""
    if response_length is not None:
        raise ValueError(
            f"response_length does not apply to the packed layout (the result is aligned with "
            f"the N tokens of input_ids), got response_length={response_length!r}"
        )
    ids = as_token_ids(input_ids, "input_ids", None)
    flat = ids.ndim == 1
    alignment = packed_alignment(
        ids, prompt_lengths, attention_mask, response_start, cu_seqlens, check_layout
    )
    return ResponseAlignment(*(token_output(tensor, flat) for tensor in alignment))
