r"""Selection by ``torch.where``, clamps with tensor bounds, and the public masked reductions.

The primitives every reduction and loss is written with: :func:`masked_fill_zero` (the NaN-proof
selection), :func:`safe_divide` (counts raised to 1), :func:`sum_selected` /
:func:`mean_selected` and the public :func:`masked_sum` / :func:`masked_mean`.
"""

from __future__ import annotations

import torch

from .validation import (
    ArrayLike,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
)

__all__ = [
    "clamp",
    "masked_fill_zero",
    "masked_mean",
    "masked_sum",
    "mean_selected",
    "safe_divide",
    "sum_selected",
]


_HALF = (torch.float16, torch.bfloat16)


def masked_fill_zero(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is True, exact zero elsewhere (NaN-proof in value and grad)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def clamp(
    values: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor
) -> torch.Tensor:
    """``values.clamp(low, high)`` for Python-number or 0-d-tensor bounds (inclusive)."""
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):
        low_t = torch.as_tensor(low, dtype=values.dtype, device=values.device)
        high_t = torch.as_tensor(high, dtype=values.dtype, device=values.device)
        return torch.clamp(values, low_t, high_t)
    return values.clamp(low, high)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """``numerator / max(denominator, 1)`` for counts: 0/0 gives 0.

    ``denominator`` is a count (>= 0); counts below 1 are raised to 1, which turns the empty
    case 0/0 into 0 and leaves every nonzero count unchanged. Never use it for a user-given
    normaliser, which is honoured exactly (see :mod:`rlobjectives._core.reduction`).
    """
    if isinstance(denominator, torch.Tensor):
        return numerator / denominator.to(numerator.dtype).clamp(min=1)
    return numerator / max(float(denominator), 1.0)


def sum_selected(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unchecked :func:`masked_sum` in the dtype of ``values`` (``mask`` bool, same shape)."""
    selected = masked_fill_zero(values, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def mean_selected(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unchecked :func:`masked_mean` in the dtype of ``values`` (``mask`` bool, same shape)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return safe_divide(sum_selected(values, mask, dim), count)


def _prepare(
    values: ArrayLike, mask: ArrayLike, dim: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(values, mask, dim)``: same shape and device, ``dim`` an int in range."""
    values_t = as_float_tensor(values, "values")
    mask_t = as_mask(mask, "mask", values_t.device)
    check_same_device({"values": values_t, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(values_t.shape), "values")
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int or None, got {type(dim).__name__} ({dim!r})")
        if not -max(values_t.ndim, 1) <= dim < max(values_t.ndim, 1):
            raise ValueError(
                f"dim must be in [-{values_t.ndim}, {values_t.ndim}) for values of shape "
                f"{tuple(values_t.shape)}, got {dim}"
            )
    return values_t, mask_t


@checks_environment
def masked_sum(values: ArrayLike, mask: ArrayLike, *, dim: int | None = None) -> torch.Tensor:
    r"""Sum of ``values`` over the selected entries: :math:`\sum M \odot x` via ``torch.where``.

    Args:
        values: any shape, e.g. ``(B, T)``; tensors, NumPy arrays or nested lists.
        mask: the shape of ``values`` (no broadcasting), bool or numeric; nonzero selects.
        dim: the dimension to reduce, or None for all.

    Returns:
        A scalar (``dim=None``) or ``values`` reduced over ``dim`` (e.g. ``(B,)``), in the dtype
        of ``values`` (float16/bfloat16 are accumulated in float32 and rounded once). NaN/inf at
        unselected entries reaches neither the sum nor its gradient.

    Raises:
        ValueError: if ``mask`` has another shape or device, or ``dim`` is out of range.
        TypeError: on non-numeric inputs or a non-int ``dim``.

    Examples:
        >>> import torch
        >>> masked_sum(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, False]]))
        tensor(1.)
    """
    values_t, mask_t = _prepare(values, mask, dim)
    if values_t.dtype in _HALF:
        return sum_selected(values_t.float(), mask_t, dim).to(values_t.dtype)
    return sum_selected(values_t, mask_t, dim)


@checks_environment
def masked_mean(values: ArrayLike, mask: ArrayLike, *, dim: int | None = None) -> torch.Tensor:
    r"""Mean of ``values`` over the selected entries; 0 (not NaN) where nothing is selected.

    .. math:: \frac{\sum M \odot x}{\max(1, \sum M)}

    Args:
        values: any shape, e.g. ``(B, T)``; tensors, NumPy arrays or nested lists.
        mask: the shape of ``values`` (no broadcasting), bool or numeric; nonzero selects.
        dim: the dimension to reduce, or None for all.

    Returns:
        A scalar (``dim=None``) or ``values`` reduced over ``dim`` (e.g. ``(B,)``), in the dtype
        of ``values`` (float16/bfloat16 are accumulated in float32 and rounded once).

    Raises:
        ValueError: if ``mask`` has another shape or device, or ``dim`` is out of range.
        TypeError: on non-numeric inputs or a non-int ``dim``.

    Examples:
        >>> import torch
        >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]),
        ...             torch.tensor([[True, True], [False, False]]), dim=-1)
        tensor([2., 0.])
    """
    values_t, mask_t = _prepare(values, mask, dim)
    if values_t.dtype in _HALF:
        return mean_selected(values_t.float(), mask_t, dim).to(values_t.dtype)
    return mean_selected(values_t, mask_t, dim)
