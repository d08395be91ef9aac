"""Masked reductions: the one place where per-token values become scalars.

Masking is always ``torch.where`` (never a multiplication), so NaN/inf at unselected positions
reaches neither the result nor the gradient. Empty selections give 0, never 0/0.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from ._validation import (
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "REDUCTIONS",
    "Reduction",
    "aggregate",
    "masked_fill_zero",
    "masked_mean",
    "masked_sum",
    "safe_divide",
]

Reduction = Literal["token_mean", "sequence_mean", "sequence_sum_normalized", "none"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)


def masked_fill_zero(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is True, exact zero elsewhere (NaN-proof in value and grad)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    r"""Sum of ``values`` over the selected entries: :math:`\sum M \odot x` via ``torch.where``.

    Args:
        values: any shape, e.g. ``(B, T)``.
        mask: bool, the shape of ``values``; True selects the entry.
        dim: the dimension to reduce, or None for all.

    Returns:
        A scalar (``dim=None``) or ``values`` reduced over ``dim`` (e.g. ``(B,)``). NaN/inf at
        unselected entries reaches neither the sum nor its gradient.

    Examples:
        >>> import torch
        >>> masked_sum(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, False]]))
        tensor(1.)
    """
    selected = masked_fill_zero(values, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """``numerator / max(denominator, 1)``-style division for counts: 0/0 gives 0.

    ``denominator`` is a count (>= 0); counts below 1 are raised to 1, which turns the empty
    case 0/0 into 0 and leaves every nonzero count unchanged.
    """
    if isinstance(denominator, torch.Tensor):
        return numerator / denominator.to(numerator.dtype).clamp(min=1)
    return numerator / max(float(denominator), 1.0)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None
) -> torch.Tensor:
    r"""Mean of ``values`` over the selected entries; 0 (not NaN) where nothing is selected.

    .. math:: \frac{\sum M \odot x}{\max(1, \sum M)}

    Args:
        values: any shape, e.g. ``(B, T)``.
        mask: bool, the shape of ``values``; True selects the entry.
        dim: the dimension to reduce, or None for all.

    Returns:
        A scalar (``dim=None``) or ``values`` reduced over ``dim`` (e.g. ``(B,)``).

    Examples:
        >>> import torch
        >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]),
        ...             torch.tensor([[True, True], [False, False]]), dim=-1)
        tensor([2., 0.])
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return safe_divide(masked_sum(values, mask, dim=dim), count)


def _explicit_normalizer(
    normalizer: Scalar, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    value = validate_scalar(normalizer, "normalizer", minimum=0.0, strict=True)
    return torch.as_tensor(value, dtype=dtype, device=device)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduction: str = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    r"""Reduce per-token values ``(B, T)`` to the loss under one of the named reductions.

    With :math:`M` the mask, :math:`n_i = \sum_t M_{it}` and :math:`L` the per-token values:

    - ``"token_mean"``: :math:`\sum_{it} M_{it} L_{it} / N`, with :math:`N = \sum_{it} M_{it}`
      or the given ``normalizer`` (global selected-token count). DAPO / BNPO and the seed GRPO loss.
    - ``"sequence_mean"``: :math:`\sum_i \big(\sum_t M_{it} L_{it} / n_i\big) / S`, with :math:`S`
      the number of sequences with at least one selected token, or the given ``normalizer``
      (global count of such sequences). Original GRPO (mean of per-sequence token means).
    - ``"sequence_sum_normalized"``: :math:`\sum_{it} M_{it} L_{it} / (S \cdot C)` with
      :math:`S = B` or the given ``normalizer`` (global sequence count) and the constant
      :math:`C` = ``max_response_length`` (default ``T``). Dr. GRPO.
    - ``"none"``: :math:`M \odot L` as a ``(B, T)`` tensor (zeros at unselected tokens).

    With an explicit ``normalizer`` the result is additive over micro-batches: summing the losses
    of the micro-batches of an optimizer step gives the full-batch loss.

    Args:
        values: per-token values, ``(B, T)``.
        mask: bool ``(B, T)``; True selects the token.
        reduction: one of ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``,
            ``"none"``.
        normalizer: optional positive denominator (number or 0-d tensor), see above.
        max_response_length: the Dr. GRPO constant :math:`C`; ``None`` uses ``T``.

    Returns:
        A scalar tensor, or ``(B, T)`` for ``"none"``, with the dtype of ``values`` (float16 and
        bfloat16 values are reduced in float32 and rounded once).

    Raises:
        ValueError: if ``values`` is not ``(B, T)``, ``mask`` has another shape or device,
            ``reduction`` is unknown, or ``normalizer``/``max_response_length`` is not positive.
        TypeError: on non-numeric inputs.
    """
    validate_choice(reduction, "reduction", REDUCTIONS)
    values = as_batch_matrix(as_float_tensor(values, "values"), "values")
    mask = as_batch_matrix(as_mask(mask, "mask", values.device), "mask")
    check_same_device({"values": values, "mask": mask})
    check_shape(mask, "mask", tuple(values.shape), "values")
    if values.dtype in (torch.float16, torch.bfloat16):
        # Reduce in float32 and round once to the half-precision output dtype.
        return aggregate(
            values.float(),
            mask,
            reduction=reduction,
            normalizer=normalizer,
            max_response_length=max_response_length,
        ).to(values.dtype)
    if reduction == "none":
        return masked_fill_zero(values, mask)
    dtype, device = values.dtype, values.device
    if reduction == "token_mean":
        total = masked_sum(values, mask)
        if normalizer is None:
            return safe_divide(total, mask.sum())
        return total / _explicit_normalizer(normalizer, dtype, device)
    if reduction == "sequence_mean":
        tokens_per_sequence = mask.sum(dim=-1)  # (B,)
        sequence_means = safe_divide(masked_sum(values, mask, dim=-1), tokens_per_sequence)  # (B,)
        total = sequence_means.sum()
        if normalizer is None:
            return safe_divide(total, (tokens_per_sequence > 0).sum())
        return total / _explicit_normalizer(normalizer, dtype, device)
    # sequence_sum_normalized
    if max_response_length is None:
        constant = float(values.shape[-1])
    else:
        constant = float(
            validate_scalar(
                max_response_length,
                "max_response_length",
                minimum=0,
                strict=True,
                allow_tensor=False,
            )
        )
    total = masked_sum(values, mask)
    if normalizer is None:
        return total / (max(values.shape[0], 1) * max(constant, 1.0))
    # max(C, 1): an empty token axis (T = 0, C defaulting to T) gives 0, not 0/0.
    return total / (_explicit_normalizer(normalizer, dtype, device) * max(constant, 1.0))
