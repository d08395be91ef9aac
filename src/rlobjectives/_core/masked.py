r"""The public masked reductions: :func:`aggregate`, :func:`masked_sum`, :func:`masked_mean`.

:func:`aggregate` reduces per-token values under one of the named reductions of
:mod:`rlobjectives._core.reduction` (which holds their math, shared by every path);
:func:`validate_token_reduction` is the boundary of every ``aggregate``-like call
(:func:`rlobjectives.nll_loss`, :func:`rlobjectives.dft_loss`). :func:`masked_sum` and
:func:`masked_mean` reduce any shape over the selected entries.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import Layout, sequence_layout, token_matrix, token_output
from .reduction import (
    Reduction,
    ReductionSpec,
    mean_selected,
    reduce,
    sum_selected,
    validate_layout_reduction,
)
from .validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    validate_context_group,
)

__all__ = [
    "TokenReduction",
    "aggregate",
    "masked_mean",
    "masked_sum",
    "validate_token_reduction",
]

_HALF = (torch.float16, torch.bfloat16)


@checks_environment
def aggregate(
    values: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    group_size: int | None = None,
    group_ids: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: object = None,
) -> torch.Tensor:
    r"""Reduce per-token values ``(B, T)`` to the loss under one of the named reductions.

    With :math:`M` the mask, :math:`n_i = \sum_t M_{it}`, :math:`L` the per-token values and
    :math:`D` the given ``normalizer`` or the default count (DAPO arXiv:2503.14476 Eq. 8; GRPO
    arXiv:2402.03300 Eq. 3; Dr. GRPO arXiv:2503.20783 Sec. 3.1; LUSPO arXiv:2602.05261):

    - ``"token_mean"``: :math:`\sum_{it} M L / D`, :math:`D = \sum M` (DAPO, BNPO).
    - ``"sequence_mean"``: :math:`\sum_i (\sum_t M L / n_i) / D`, :math:`D` = the sequences
      with :math:`n_i > 0` (GRPO).
    - ``"sequence_sum_normalized"``: :math:`\sum_{it} M L / (D C)`, :math:`D = B`,
      :math:`C` = ``max_response_length`` (default ``T``) (Dr. GRPO).
    - ``"length_weighted"``: :math:`\sum_{it} M L / D`, :math:`D = B` (TRL ``luspo``).
    - ``"prompt_mean"``: :math:`\sum_p (\sum_{i \in p, t} M L / N_p) / D`, :math:`N_p =
      \sum_{i \in p} n_i`, :math:`D` = the prompts with :math:`N_p > 0` (AReaL PR #1546;
      SkyRL counts every prompt: ``normalizer=P``); the groups are ``group_size`` or
      ``group_ids`` (one per sequence; a micro-batch must hold whole groups).
    - ``"none"``: :math:`M \odot L`, ``(B, T)`` (zeros at unselected tokens).

    Packed (``cu_seqlens``): ``values``/``mask`` ``(N,)`` or ``(1, N)``, the :math:`S` sequences
    in place of the rows, default :math:`C` the longest; equal to the padded call. With the
    global count as ``normalizer`` the micro-batch losses sum to the full-batch loss; it is
    used exactly as given, counts are raised to 1 (nothing selected gives 0). With
    ``context_group`` (``docs/distributed/context-parallel.md``) every rank holds some tokens
    of the same sequences and returns the whole sequences' loss (one all-reduce).

    Args:
        values: per-token values, ``(B, T)``.
        mask: bool ``(B, T)``; True selects the token.
        reduction: one of the names above.
        normalizer: optional positive denominator :math:`D` (number or 0-d tensor).
        max_response_length: the Dr. GRPO constant :math:`C`, a positive integer (int or 0-d
            tensor); ``None`` uses ``T`` (packed: the longest sequence).
        group_size: ``"prompt_mean"``'s prompts: contiguous groups of this many sequences.
        group_ids: or one group label per sequence ``(B,)`` / ``(S,)`` (ints or hashables).
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of a packed row.
        context_group: the process group of the ranks holding the other tokens of the same
            sequences (context parallelism), or None.

    Returns:
        A scalar, or ``(B, T)`` for ``"none"`` (packed: the shape of ``values``), in the dtype of
        ``values`` (half precision reduced in float32, rounded once).

    Raises:
        ValueError: a wrong shape or device, an unknown ``reduction``, a non-positive
            ``normalizer``, a fractional ``max_response_length``, ``"prompt_mean"`` without
            (or with both of) ``group_size`` / ``group_ids``, a ``group_size`` that does not
            divide the sequences, malformed ``cu_seqlens``, or no initialised process group.
        TypeError: non-numeric inputs, float ``group_ids``, or a ``context_group`` that is not a
            process group.
    """
    call = validate_token_reduction(
        values,
        mask,
        "values",
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        cu_seqlens=cu_seqlens,
        context_group=context_group,
        group_size=group_size,
        group_ids=group_ids,
    )
    return call.finish(call.values)


class TokenReduction(NamedTuple):
    """A validated reduction call of per-token values (:func:`validate_token_reduction`)."""

    values: torch.Tensor  # (B, T) / (1, N), the caller's dtype
    mask: torch.Tensor  # bool, the shape of values
    spec: ReductionSpec
    layout: Layout
    flat: bool  # packed (N,) values: a per-token result is returned as (N,)

    def finish(self, values: torch.Tensor) -> torch.Tensor:
        """``reduce`` of ``values`` (the shape of :attr:`values`) in float32 or wider.

        Half-precision values are reduced in float32 and rounded once to their dtype.
        """
        dtype = self.values.dtype
        wide = values.float() if dtype in (torch.float16, torch.bfloat16) else values
        result = reduce(wide, self.mask, self.spec, self.layout).to(dtype)
        return token_output(result, self.flat and result.ndim == 2)


def validate_token_reduction(
    values: ArrayLike,
    mask: ArrayLike,
    name: str,
    *,
    reduction: object,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    cu_seqlens: ArrayLike | None,
    context_group: object,
    group_size: object = None,
    group_ids: object = None,
) -> TokenReduction:
    """The boundary checks of :func:`aggregate`-like calls, ``values`` named ``name``."""
    packed = cu_seqlens is not None
    values_t = as_float_tensor(values, name)
    flat = values_t.ndim == 1
    values_t = token_matrix(values_t, name, packed)
    mask_t = token_matrix(as_mask(mask, "mask", values_t.device), "mask", packed)
    check_same_device({name: values_t, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(values_t.shape), name)
    layout = sequence_layout(cu_seqlens, values_t, validate_context_group(context_group))
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=layout,
        tokens=values_t.shape[-1],
        group_size=group_size,
        group_ids=group_ids,
        device=values_t.device,
    )
    return TokenReduction(values_t, mask_t, spec, layout, flat)


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
