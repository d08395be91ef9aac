"""The boundary of the distillation losses: the student's rows, the teacher, the reduction.

Every public function of :mod:`rlobjectives.distillation` validates its arguments here, once:
the student logits ``(B, T, V)`` (packed: ``(N, V)`` / ``(1, N, V)`` with ``cu_seqlens``) or
the LM head (:func:`rlobjectives.logprobs.head.prepare_head`), the mask, the teacher's
per-token tensors (top-k ``(B, T, K)``, per-token ``(B, T)`` or logits ``(B, T, V)``) and the
reduction (:func:`rlobjectives._core.reduction.validate_layout_reduction`), then reduces the
per-token values with the one reduction of the library.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.layout import Layout, sequence_layout, token_matrix, token_ndim, token_output
from .._core.reduction import (
    ReductionSpec,
    reduce,
    row_weights,
    token_gradient_weights,
    validate_layout_reduction,
)
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    as_token_ids,
    check_same_device,
    check_shape,
)
from ..logprobs.head import Head, HeadOptions, prepare_head, validate_transform
from .chunks import ChunkRule, FusedHiddenDivergence, HiddenDivergence

__all__ = [
    "Rows",
    "hidden_call",
    "hidden_loss",
    "logits_call",
    "per_token",
    "reduced",
    "teacher_logits",
    "token_slots",
    "token_weights",
    "temperature_inverse",
]


class Rows(NamedTuple):
    """The validated token rows of a call.

    Attributes:
        mask: ``(B, T)`` bool (packed: ``(1, N)``), True = the token counts.
        layout: which tokens form which sequence (padded rows or packed runs).
        spec: the validated reduction.
        flat: packed per-token inputs were ``(N,)``: a ``"none"`` result is ``(N,)`` too.
    """

    mask: torch.Tensor
    layout: Layout
    spec: ReductionSpec
    flat: bool

    @property
    def batch_shape(self) -> tuple[int, int]:
        """``(B, T)`` (packed: ``(1, N)``)."""
        return (self.mask.shape[0], self.mask.shape[1])


def temperature_inverse(
    temperature: object, rows: Rows, device: torch.device, dtype: torch.dtype
) -> float | torch.Tensor:
    r""":math:`1/\tau` of the temperature: one number, or one per token.

    ``temperature``: a Python number ``tau > 0`` (finite), or a per-token tensor of the rows'
    shape ``(B, T)`` (packed: ``(N,)`` or ``(1, N)``); the inverse is 1 at unselected tokens.
    """
    transform = validate_transform(
        temperature,
        shape=rows.batch_shape,
        device=device,
        dtype=dtype,
        active=rows.mask,
        packed=rows.layout.sequence_ids is not None,
        reference="mask",
    )
    return transform.inverse


def _rows(
    mask: ArrayLike,
    reference: torch.Tensor,
    reference_name: str,
    *,
    cu_seqlens: ArrayLike | None,
    reduction: object,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
) -> Rows:
    packed = cu_seqlens is not None
    flat = packed and token_ndim(mask) == 1
    mask_t = token_matrix(as_mask(mask, "mask", reference.device), "mask", packed)
    check_same_device({reference_name: reference, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(reference.shape[:2]), f"{reference_name}[..., 0]")
    layout = sequence_layout(cu_seqlens, mask_t)
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=layout,
        tokens=mask_t.shape[-1],
    )
    return Rows(mask_t, layout, spec, flat)


def _logits_tensor(logits: ArrayLike, name: str, packed: bool) -> torch.Tensor:
    tensor = as_float_tensor(logits, name)
    if packed and tensor.ndim == 2:
        tensor = tensor.unsqueeze(0)  # (1, N, V)
    if tensor.ndim != 3 or (packed and tensor.shape[0] != 1):
        expected = (
            "(N, V) or (1, N, V) (packed: cu_seqlens given)"
            if packed
            else "(B, T, V) (3 dimensions), or (N, V) with cu_seqlens (packed sequences)"
        )
        raise ValueError(f"{name} must have shape {expected}, got shape {tuple(tensor.shape)}")
    if tensor.shape[-1] < 1:
        raise ValueError(
            f"{name} must have a vocabulary dimension V >= 1, got shape {tuple(tensor.shape)}"
        )
    return tensor


def logits_call(
    logits: ArrayLike,
    mask: ArrayLike,
    *,
    cu_seqlens: ArrayLike | None,
    reduction: object,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
) -> tuple[torch.Tensor, Rows]:
    """The student logits ``(B, T, V)`` (packed ``(1, N, V)``) and the validated rows."""
    logits_t = _logits_tensor(logits, "logits", cu_seqlens is not None)
    rows = _rows(
        mask,
        logits_t,
        "logits",
        cu_seqlens=cu_seqlens,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )
    return logits_t, rows


def hidden_call(
    hidden: object,
    weight: object,
    tokens: ArrayLike | None,
    bias: object,
    mask: ArrayLike,
    *,
    temperature: object,
    chunk_size: int | None,
    cu_seqlens: ArrayLike | None,
    reduction: object,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    head_options: HeadOptions | None = None,
) -> tuple[Head, Rows]:
    """The validated LM head (flat ``(N, H)`` rows) and the rows.

    ``tokens`` None: a loss that reads no sampled token (zeros stand in for the ids).
    ``temperature``: a number or a per-token tensor; ``head_options``: the logit scale, softcap
    and the product's precision.
    """
    packed = cu_seqlens is not None
    ids: ArrayLike = tokens
    if tokens is None:  # zeros stand in for the ids: they must not vote on the device
        head_tensors = {"hidden": hidden, "weight": weight, "bias": bias}
        present = {k: v for k, v in head_tensors.items() if isinstance(v, torch.Tensor)}
        if len(present) > 1:
            check_same_device(present)
        shape = _hidden_batch_shape(hidden, packed)
        device = hidden.device if isinstance(hidden, torch.Tensor) else None
        ids = torch.zeros(shape, dtype=torch.int64, device=device)
    head, batch_shape = prepare_head(
        hidden, weight, ids, bias, temperature, chunk_size, packed=packed,
        head_options=head_options, mask=mask,
    )  # fmt: skip
    reference = head.hidden.reshape(*batch_shape, head.hidden.shape[-1])
    rows = _rows(
        mask,
        reference,
        "hidden",
        cu_seqlens=cu_seqlens,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )
    return head, rows


def _hidden_batch_shape(hidden: object, packed: bool) -> tuple[int, ...]:
    """The token shape of ``hidden`` (validated by ``prepare_head`` afterwards)."""
    if not isinstance(hidden, torch.Tensor):
        return (0,)
    if packed and hidden.ndim == 2:
        return (1, hidden.shape[0])
    return tuple(hidden.shape[:2]) if hidden.ndim >= 2 else (0,)


def token_slots(
    value: ArrayLike, name: str, rows: Rows, device: torch.device, *, ids: bool = False
) -> torch.Tensor:
    """A teacher top-k tensor ``(B, T, K)`` (packed: ``(N, K)`` / ``(1, N, K)``), ``K >= 1``."""
    tensor = as_token_ids(value, name, device) if ids else as_float_tensor(value, name, device)
    packed = rows.layout.sequence_ids is not None
    if packed and tensor.ndim == 2:
        tensor = tensor.unsqueeze(0)
    batch, tokens = rows.batch_shape
    if tensor.ndim != 3 or tuple(tensor.shape[:2]) != (batch, tokens) or tensor.shape[2] < 1:
        expected = (
            f"(N, K) or (1, N, K) with N = {tokens}"
            if packed
            else f"(B, T, K) = ({batch}, {tokens}, K)"
        )
        raise ValueError(
            f"{name} must have shape {expected} and K >= 1 (the teacher's top-k slots of each "
            f"token), got shape {tuple(tensor.shape)}"
        )
    return tensor


def per_token(
    value: ArrayLike, name: str, rows: Rows, device: torch.device, *, ids: bool = False
) -> torch.Tensor:
    """A per-token tensor ``(B, T)`` (packed: ``(N,)`` / ``(1, N)``), floating or integer."""
    packed = rows.layout.sequence_ids is not None
    tensor = as_token_ids(value, name, device) if ids else as_float_tensor(value, name, device)
    tensor = token_matrix(tensor, name, packed)
    check_shape(tensor, name, rows.batch_shape, "mask")
    return tensor


def teacher_logits(value: ArrayLike, rows: Rows, vocab: int) -> torch.Tensor:
    """The teacher logits, the shape of the student's ``(B, T, V)`` (packed ``(1, N, V)``)."""
    tensor = _logits_tensor(value, "teacher_logits", rows.layout.sequence_ids is not None)
    expected = (*rows.batch_shape, vocab)
    check_shape(tensor, "teacher_logits", expected, "logits")
    return tensor


def token_weights(rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    """``dL/dD_n`` of the reduced loss at every token, ``(N,)`` flat (0 where unselected)."""
    counts = rows.layout.row_counts(rows.mask)  # (S,)
    weights = row_weights(counts, rows.spec, dtype=dtype, batch=rows.layout.num_sequences)
    per_token_weight = token_gradient_weights(weights, rows.layout, dtype).expand(rows.batch_shape)
    zero = torch.zeros((), dtype=dtype, device=rows.mask.device)
    return torch.where(rows.mask, per_token_weight, zero).reshape(-1)


def reduced(values: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The per-token values ``(B, T)`` reduced (``"none"``: masked, packed ``(N,)`` if flat)."""
    loss = reduce(values, rows.mask, rows.spec, rows.layout)
    return token_output(loss, rows.flat and loss.ndim == 2)


def hidden_loss(head: Head, rule: ChunkRule, rows: Rows) -> torch.Tensor:
    """The loss of ``rule`` over ``head``'s rows, reduced as ``rows.spec`` says.

    A reduced loss that needs a gradient takes the fused path (the gradients formed in the
    forward chunk loop, returned through a zero anchor added to the value);
    ``reduction="none"`` and calls without a gradient take the recompute path.
    """
    mask = rows.mask.reshape(-1)
    needs_grad = torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad
        for tensor in (head.hidden, head.weight, head.bias)
    )
    if rows.spec.reduction == "none" or not needs_grad:
        values: torch.Tensor = HiddenDivergence.apply(  # type: ignore[no-untyped-call]
            head.hidden, head.weight, head.bias, head, rule, mask
        )
        return reduced(values.reshape(rows.batch_shape), rows)
    anchor, detached = FusedHiddenDivergence.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head, rule, mask, token_weights(rows, head.dtype)
    )
    loss: torch.Tensor = reduced(detached.reshape(rows.batch_shape), rows) + anchor
    return loss
