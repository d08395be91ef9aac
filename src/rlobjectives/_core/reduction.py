r"""The named reductions from per-token values to a loss: one implementation for every path.

Every reduction except ``"none"`` is linear in the per-token values :math:`L_{it}`:

.. math::

    \mathcal{L} = \frac{1}{D} \sum_i \frac{1}{d_i} \sum_t M_{it} L_{it},

with a per-row divisor :math:`d_i` and a common denominator :math:`D` that depend on the mask
only (and on an explicit ``normalizer``). :func:`row_weights` computes :math:`(d_i, D)` once;
the autograd path (:func:`reduce`), the fused policy path and the hidden-state path all use it,
the last two also as the gradient :math:`\partial\mathcal{L}/\partial L_{it} = 1/(d_i D)`.

- ``token_mean``: :math:`d_i = 1`, :math:`D = N = \sum M` (at least 1) or ``normalizer``;
- ``sequence_mean``: :math:`d_i = \max(n_i, 1)`, :math:`D` = the non-empty rows (at least 1)
  or ``normalizer``;
- ``sequence_sum_normalized``: :math:`d_i = 1`, :math:`D = \max(B, 1)\,C` or
  ``normalizer`` :math:`\cdot C`;
- ``length_weighted``: :math:`d_i = 1`, :math:`D = \max(B, 1)` or ``normalizer`` (each
  sequence's token mean weighted by its length :math:`n_i`, averaged over the rows: TRL LUSPO).

(:math:`n_i = \sum_t M_{it}`, :math:`C = \max(` ``max_response_length`` or :math:`T`, 1 :math:`)`).
A user-given ``normalizer`` is used exactly as given (fractional values included); only counts
are raised to 1, so that an empty selection gives 0 instead of 0/0.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

from .layout import Layout, longest_sequence, padded, sequence_layout, token_matrix, token_output
from .validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    canonical_reduction,
    check_same_device,
    check_shape,
    checks_environment,
    validate_choice,
    validate_context_group,
    validate_length,
    validate_scalar,
)

__all__ = [
    "REDUCTIONS",
    "Reduction",
    "ReductionSpec",
    "RowWeights",
    "TokenReduction",
    "aggregate",
    "clamp",
    "masked_fill_zero",
    "masked_mean",
    "masked_sum",
    "mean_selected",
    "reduce",
    "reduce_rows",
    "reduction_counts",
    "row_weights",
    "safe_divide",
    "sum_selected",
    "token_gradient_weights",
    "validate_layout_reduction",
    "validate_normalizer",
    "validate_reduction",
    "validate_token_reduction",
]


Reduction = Literal[
    "token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none"
]


REDUCTIONS: tuple[str, ...] = get_args(Reduction)


class ReductionSpec(NamedTuple):
    """A validated reduction: its name, explicit normaliser (or None) and Dr. GRPO constant."""

    reduction: str
    normalizer: float | torch.Tensor | None
    constant: float | torch.Tensor  # C = max(max_response_length or T, 1)


class RowWeights(NamedTuple):
    """Per-row divisors ``(B,)`` (None = all ones) and the common denominator ``()``."""

    divisor: torch.Tensor | None
    denominator: torch.Tensor


def validate_normalizer(value: Scalar | None, name: str) -> float | torch.Tensor | None:
    """A positive finite normaliser (number or 0-d tensor), or None."""
    if value is None:
        return None
    return validate_scalar(value, name, minimum=0.0, strict=True)


def validate_reduction(
    reduction: object,
    *,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    tokens: int,
) -> ReductionSpec:
    """Validate the reduction arguments of a public function (``tokens`` = T)."""
    reduction = canonical_reduction(reduction)  # peers' spellings: alias or "did you mean"
    validate_choice(reduction, "reduction", REDUCTIONS)
    normalizer_value = validate_normalizer(normalizer, "normalizer")
    if max_response_length is None:
        constant: float | torch.Tensor = float(max(tokens, 1))
    else:
        length = validate_length(max_response_length, "max_response_length")
        constant = length if isinstance(length, torch.Tensor) else float(length)
    return ReductionSpec(str(reduction), normalizer_value, constant)


def validate_layout_reduction(
    reduction: object,
    *,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    layout: Layout,
    tokens: int,
) -> ReductionSpec:
    """:func:`validate_reduction` for a layout; ``tokens`` = the width of the per-token rows.

    The default Dr. GRPO constant is the padded width ``T``: for a packed ``(1, N)`` row, the
    longest sequence (the width :func:`rlobjectives.unpack` pads to), not ``N``; under context
    parallelism that of the whole sequences (:func:`~rlobjectives._core.layout.longest_sequence`).
    """
    spec = validate_reduction(
        reduction, normalizer=normalizer, max_response_length=max_response_length, tokens=tokens
    )
    split = layout.sequence_ids is not None or layout.context is not None
    if split and max_response_length is None and spec.reduction == "sequence_sum_normalized":
        spec = spec._replace(constant=longest_sequence(layout, tokens))
    return spec


def _as_tensor(
    value: float | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.as_tensor(value, dtype=dtype, device=device)


def row_weights(
    counts: torch.Tensor, spec: ReductionSpec, *, dtype: torch.dtype, batch: int
) -> RowWeights:
    """The divisors :math:`d_i` and the denominator :math:`D` of ``spec`` (see module doc).

    Args:
        counts: ``(B,)`` selected tokens per row (integer).
        spec: a validated :class:`ReductionSpec` (not ``"none"``).
        dtype: the computation dtype.
        batch: B, the number of rows (static).
    """
    device = counts.device
    normalizer = None if spec.normalizer is None else _as_tensor(spec.normalizer, dtype, device)
    if spec.reduction == "sequence_mean":
        divisor = counts.to(dtype).clamp(min=1)  # (B,)
        if normalizer is None:
            normalizer = (counts > 0).sum().to(dtype).clamp(min=1)
        return RowWeights(divisor, normalizer)
    if spec.reduction in ("sequence_sum_normalized", "length_weighted"):
        rows = _as_tensor(float(max(batch, 1)), dtype, device) if normalizer is None else normalizer
        if spec.reduction == "length_weighted":  # LUSPO: sum_i n_i (sum_t L / n_i) / B
            return RowWeights(None, rows)
        constant = _as_tensor(spec.constant, dtype, device).clamp(min=1)
        return RowWeights(None, rows * constant)
    # token_mean (``counts``: per row, or their total)
    if normalizer is None:
        normalizer = counts.sum().to(dtype).clamp(min=1)
    return RowWeights(None, normalizer)


def reduction_counts(mask: torch.Tensor, spec: ReductionSpec, layout: Layout) -> torch.Tensor:
    """The selected-token counts :func:`row_weights` reads for ``spec``, of whole sequences.

    ``(S,)`` per sequence; under context parallelism only what the reduction reads crosses the
    ranks: the ``(S,)`` counts for ``sequence_mean``, the total count as ``(1,)`` for
    ``token_mean`` without a normaliser, nothing otherwise (zeros, unread).
    """
    if layout.context is None or spec.reduction == "sequence_mean":
        return layout.row_counts(mask)
    if spec.reduction == "token_mean" and spec.normalizer is None:
        return layout.total(mask.to(torch.int64)).reshape(1)
    return torch.zeros(1, dtype=torch.int64, device=mask.device)


def token_gradient_weights(weights: RowWeights, layout: Layout, dtype: torch.dtype) -> torch.Tensor:
    """Derivative of the reduced loss w.r.t. each per-token value, broadcastable to the tokens.

    ``(B, 1)`` for the padded layout, ``(1, N)`` for a packed one; ``(1, 1)`` when every
    sequence has the same weight (no per-row divisor).
    """
    if weights.divisor is None:
        return (1 / weights.denominator.to(dtype)).reshape(1, 1)
    rows = layout.num_sequences
    ones = torch.ones(rows, dtype=dtype, device=weights.denominator.device)
    if weights.divisor is not None:
        ones = ones / weights.divisor
    return layout.expand(ones / weights.denominator)


def reduce_rows(row_sums: torch.Tensor, weights: RowWeights) -> torch.Tensor:
    r"""The loss from per-row sums ``(B,)``: :math:`\sum_i (s_i / d_i) / D`."""
    if weights.divisor is not None:
        row_sums = row_sums / weights.divisor
    return row_sums.sum() / weights.denominator


def reduce(
    values: torch.Tensor, mask: torch.Tensor, spec: ReductionSpec, layout: Layout | None = None
) -> torch.Tensor:
    """Unchecked :func:`aggregate` of per-token values in their own dtype.

    ``layout`` maps tokens to sequences (default: padded ``(B, T)``, one sequence per row).
    """
    layout = padded(values.shape[0]) if layout is None else layout
    selected = masked_fill_zero(values, mask)  # (B, T)
    if spec.reduction == "none":
        return selected
    if layout.context is not None:
        return _reduce_over_context(selected, mask, spec, layout)
    if spec.reduction == "token_mean":  # the total over the count (or the normaliser)
        count = torch.count_nonzero(mask)  # several times faster than a bool sum
        weights = row_weights(count, spec, dtype=values.dtype, batch=layout.num_sequences)
        return selected.sum() / weights.denominator
    counts = layout.row_counts(mask)  # (S,)
    weights = row_weights(counts, spec, dtype=values.dtype, batch=layout.num_sequences)
    if weights.divisor is None:
        return selected.sum() / weights.denominator
    return reduce_rows(layout.row_sums(selected), weights)


def _reduce_over_context(
    selected: torch.Tensor, mask: torch.Tensor, spec: ReductionSpec, layout: Layout
) -> torch.Tensor:
    """:func:`reduce` of this rank's tokens of sequences split over a context group.

    One all-reduce of what the reduction reads (:func:`context_parts`).
    """
    parts = layout.combine(*context_parts(selected, mask, spec, layout))
    return reduce_context_parts(parts, spec, layout, selected.dtype)


def context_parts(
    selected: torch.Tensor, mask: torch.Tensor, spec: ReductionSpec, layout: Layout
) -> tuple[torch.Tensor, ...]:
    """This rank's partial sums a reduction reads, to be summed over the context group.

    The ``(S,)`` row sums and counts for ``sequence_mean``; the total (and the selected-token
    count when no ``normalizer`` is given) for the others, whose per-token weight is the same
    for every token. A caller may all-reduce them together with other sums.
    """
    if spec.reduction == "sequence_mean":
        return layout.local_row_sums(selected), layout.local_row_counts(mask)
    if spec.reduction == "token_mean" and spec.normalizer is None:
        return selected.sum(), torch.count_nonzero(mask)
    return (selected.sum(),)  # the denominator is the normaliser, or B C / B: no count needed


def reduce_context_parts(
    parts: tuple[torch.Tensor, ...], spec: ReductionSpec, layout: Layout, dtype: torch.dtype
) -> torch.Tensor:
    """The reduction from the group's sums of :func:`context_parts`."""
    rows = layout.num_sequences
    if spec.reduction == "sequence_mean":
        sums, counts = parts
        return reduce_rows(sums, row_weights(counts, spec, dtype=dtype, batch=rows))
    counts = parts[1].reshape(1) if len(parts) > 1 else parts[0].new_zeros(1, dtype=torch.int64)
    return parts[0] / row_weights(counts, spec, dtype=dtype, batch=rows).denominator


@checks_environment
def aggregate(
    values: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: object = None,
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
    - ``"length_weighted"``: :math:`\sum_{it} M_{it} L_{it} / S` with :math:`S = B` or the given
      ``normalizer`` (global sequence count): each sequence's token mean weighted by its length,
      averaged over the rows (TRL ``loss_type="luspo"`` since 1.10, whose loss is
      ``(per_token_loss * mask).sum(-1).mean()``; LUSPO, arXiv:2602.05261).
    - ``"none"``: :math:`M \odot L` as a ``(B, T)`` tensor (zeros at unselected tokens).

    Packed layout (``cu_seqlens`` given): ``values`` and ``mask`` are ``(N,)`` or ``(1, N)``,
    sequence :math:`i` is the run ``cu_seqlens[i]:cu_seqlens[i + 1]`` (:math:`S` sequences in
    place of the :math:`B` rows), and the default :math:`C` is the longest sequence; the result
    equals the padded call on :func:`rlobjectives.unpack`'s layout.

    With an explicit ``normalizer`` the result is additive over micro-batches: summing the losses
    of the micro-batches of an optimizer step gives the full-batch loss. The normaliser is used
    exactly as given; counted denominators are raised to 1 (an empty selection gives 0).

    Context parallelism (``context_group`` given, ``docs/distributed/context-parallel.md``):
    each rank of the group holds some tokens of the same sequences (padded ``(B, T_r)`` with
    its mask, or packed with local ``cu_seqlens`` listing every sequence); every rank returns
    the loss of the whole sequences (one all-reduce: ``(S,)`` row sums and counts for
    ``sequence_mean``, two scalars otherwise) and its gradient flows into the local tokens only.

    Args:
        values: per-token values, ``(B, T)``.
        mask: bool ``(B, T)``; True selects the token.
        reduction: one of ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``,
            ``"length_weighted"``, ``"none"``.
        normalizer: optional positive denominator (number or 0-d tensor), see above.
        max_response_length: the Dr. GRPO constant :math:`C`, a positive integer (int or 0-d
            tensor); ``None`` uses ``T`` (packed: the longest sequence).
        cu_seqlens: optional ``(S + 1,)`` integer sequence boundaries of a packed row (0 first,
            non-decreasing, ``N`` last); see ``docs/conventions.md``.
        context_group: the ``torch.distributed`` process group of the ranks holding the other
            tokens of the same sequences (context parallelism), or None.

    Returns:
        A scalar tensor, or ``(B, T)`` for ``"none"`` (packed: the shape of ``values``), with the
        dtype of ``values`` (float16 and bfloat16 values are reduced in float32 and rounded once).

    Raises:
        ValueError: if ``values`` is not ``(B, T)`` (packed: ``(N,)`` or ``(1, N)``), ``mask`` has
            another shape or device, ``reduction`` is unknown, ``normalizer`` is not positive,
            ``max_response_length`` is not a positive integer, ``cu_seqlens`` is malformed, or
            ``context_group`` is given without an initialised process group.
        TypeError: on non-numeric inputs, or a ``context_group`` that is not a process group.
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
    )
    return TokenReduction(values_t, mask_t, spec, layout, flat)


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
