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
  sequence's token mean weighted by its length :math:`n_i`, averaged over the rows: TRL LUSPO);
- ``prompt_mean``: :math:`d_i = \max(N_{p(i)}, 1)`, :math:`N_p` the selected tokens of the
  prompt group of row :math:`i` (``ReductionSpec.groups``), :math:`D` = the groups with
  :math:`N_p > 0` (at least 1) or ``normalizer``.

(:math:`n_i = \sum_t M_{it}`, :math:`C = \max(` ``max_response_length`` or :math:`T`, 1 :math:`)`).
A user-given ``normalizer`` is used exactly as given (fractional values included); only counts
are raised to 1, so that an empty selection gives 0 instead of 0/0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, get_args

import torch

from .groups import groups_of
from .layout import Layout, longest_sequence, padded
from .validation import (
    Scalar,
    canonical_reduction,
    validate_choice,
    validate_length,
    validate_scalar,
)

__all__ = [
    "NOT_ACCEPTED",
    "PER_ROW_REDUCTIONS",
    "REDUCTIONS",
    "PromptGroups",
    "Reduction",
    "ReductionSpec",
    "RowWeights",
    "clamp",
    "masked_fill_zero",
    "mean_selected",
    "prompt_groups",
    "reduce",
    "reduce_pieces",
    "reduce_rows",
    "reduction_counts",
    "row_weights",
    "safe_divide",
    "select_or_zero",
    "sum_selected",
    "token_gradient_weights",
    "validate_layout_reduction",
    "validate_normalizer",
    "validate_reduction",
]


Reduction = Literal[
    "token_mean",
    "sequence_mean",
    "sequence_sum_normalized",
    "length_weighted",
    "prompt_mean",
    "none",
]


REDUCTIONS: tuple[str, ...] = get_args(Reduction)

#: The reductions with a per-row divisor: they read the per-sequence sums and counts (the
#: others only the totals), on every path (fused, hidden-state, kernels, context parallelism).
PER_ROW_REDUCTIONS: tuple[str, ...] = ("sequence_mean", "prompt_mean")


class _NotAccepted:
    """The default of ``group_size`` / ``group_ids`` for a function that does not take them."""

    def __repr__(self) -> str:
        return "NOT_ACCEPTED"


#: Passed (by default) for the groups by the functions without ``group_size``/``group_ids``:
#: ``reduction="prompt_mean"`` then names the functions that take them.
NOT_ACCEPTED: object = _NotAccepted()


class PromptGroups(NamedTuple):
    """The prompt group of each sequence, for ``"prompt_mean"``.

    Attributes:
        ids: ``(S,)`` int64 dense group id in ``[0, S)`` of each sequence (on the tokens'
            device): ``S`` slots, some unused, so the shapes are static.
    """

    ids: torch.Tensor


class ReductionSpec(NamedTuple):
    """A validated reduction: name, normaliser (or None), Dr. GRPO constant, prompt groups."""

    reduction: str
    normalizer: float | torch.Tensor | None
    constant: float | torch.Tensor  # C = max(max_response_length or T, 1)
    groups: PromptGroups | None = None


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


def prompt_groups(
    group_size: object, group_ids: object, sequences: int, device: torch.device
) -> PromptGroups | None:
    """The validated prompt groups of ``sequences`` sequences, or None when neither is given.

    Exactly one of ``group_size`` (contiguous groups, ``sequences`` divisible by it) and
    ``group_ids`` (one label per sequence: an integer tensor, or a sequence of hashable
    labels) may be given (:func:`rlobjectives._core.groups.groups_of`).
    """
    if group_size is None and group_ids is None:
        return None
    groups = groups_of(
        group_size, group_ids, sequences, device, unit="sequence", reference="the sequences"
    )
    return PromptGroups(groups.ids)


def validate_layout_reduction(
    reduction: object,
    *,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    layout: Layout,
    tokens: int,
    group_size: object = NOT_ACCEPTED,
    group_ids: object = NOT_ACCEPTED,
    device: torch.device | None = None,
) -> ReductionSpec:
    """:func:`validate_reduction` for a layout; ``tokens`` = the width of the per-token rows.

    The default Dr. GRPO constant is the padded width ``T``: for a packed ``(1, N)`` row, the
    longest sequence (the width :func:`rlobjectives.unpack` pads to), not ``N``; under context
    parallelism that of the whole sequences (:func:`~rlobjectives._core.layout.longest_sequence`).

    A function that takes the prompt groups forwards its ``group_size`` / ``group_ids`` (None
    when not given) and the tokens' ``device``: they are validated against the layout's ``S``
    sequences into ``spec.groups`` (also under another reduction, which ignores them), and
    ``"prompt_mean"`` requires one of them. Without them (the default) ``"prompt_mean"`` is
    refused with the functions that take it.
    """
    spec = validate_reduction(
        reduction, normalizer=normalizer, max_response_length=max_response_length, tokens=tokens
    )
    split = layout.sequence_ids is not None or layout.context is not None
    if split and max_response_length is None and spec.reduction == "sequence_sum_normalized":
        spec = spec._replace(constant=longest_sequence(layout, tokens))
    if group_size is NOT_ACCEPTED or group_ids is NOT_ACCEPTED:
        if spec.reduction == "prompt_mean":
            raise ValueError(
                "reduction 'prompt_mean' needs the prompt groups (group_size= or group_ids=), "
                "which this function does not take: aggregate, nll_loss and dft_loss take them "
                "(reduce the per-token values with rlobjectives.aggregate)"
            )
        return spec
    groups = None
    if group_size is not None or group_ids is not None:
        where = torch.device("cpu") if device is None else device
        groups = prompt_groups(group_size, group_ids, layout.num_sequences, where)
    if groups is None and spec.reduction == "prompt_mean":
        raise ValueError(
            "reduction 'prompt_mean' needs the prompt groups: pass group_size= (contiguous "
            "groups of equal size) or group_ids= (one label per sequence)"
        )
    return spec if groups is None else spec._replace(groups=groups)


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
    if spec.reduction == "prompt_mean":
        return _prompt_weights(counts, spec, normalizer, dtype)
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


def _prompt_weights(
    counts: torch.Tensor, spec: ReductionSpec, normalizer: torch.Tensor | None, dtype: torch.dtype
) -> RowWeights:
    r"""``"prompt_mean"``: :math:`d_i = \max(N_{p(i)}, 1)`, :math:`D` = the non-empty groups."""
    assert spec.groups is not None  # validate_layout_reduction requires them
    ids = spec.groups.ids  # (S,)
    per_group = torch.zeros_like(counts).index_add(0, ids, counts)  # (S,) slots, N_p
    divisor = per_group.index_select(0, ids).to(dtype).clamp(min=1)  # (S,) N_p(i)
    if normalizer is None:
        normalizer = (per_group > 0).sum().to(dtype).clamp(min=1)
    return RowWeights(divisor, normalizer)


def reduction_counts(mask: torch.Tensor, spec: ReductionSpec, layout: Layout) -> torch.Tensor:
    """The selected-token counts :func:`row_weights` reads for ``spec``, of whole sequences.

    ``(S,)`` per sequence; under context parallelism only what the reduction reads crosses the
    ranks: the ``(S,)`` counts for :data:`PER_ROW_REDUCTIONS`, the total count as ``(1,)`` for
    ``token_mean`` without a normaliser, nothing otherwise (zeros, unread).
    """
    if layout.context is None or spec.reduction in PER_ROW_REDUCTIONS:
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

    The ``(S,)`` row sums and counts for :data:`PER_ROW_REDUCTIONS`; the total (and the
    selected-token count when no ``normalizer`` is given) for the others, whose per-token weight
    is the same for every token. A caller may all-reduce them together with other sums.
    """
    if spec.reduction in PER_ROW_REDUCTIONS:
        return layout.local_row_sums(selected), layout.local_row_counts(mask)
    if spec.reduction == "token_mean" and spec.normalizer is None:
        return selected.sum(), torch.count_nonzero(mask)
    return (selected.sum(),)  # the denominator is the normaliser, or B C / B: no count needed


def reduce_context_parts(
    parts: tuple[torch.Tensor, ...], spec: ReductionSpec, layout: Layout, dtype: torch.dtype
) -> torch.Tensor:
    """The reduction from the group's sums of :func:`context_parts`."""
    rows = layout.num_sequences
    if spec.reduction in PER_ROW_REDUCTIONS:
        sums, counts = parts
        return reduce_rows(sums, row_weights(counts, spec, dtype=dtype, batch=rows))
    counts = parts[1].reshape(1) if len(parts) > 1 else parts[0].new_zeros(1, dtype=torch.int64)
    return parts[0] / row_weights(counts, spec, dtype=dtype, batch=rows).denominator


def reduce_pieces(
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
    spec: ReductionSpec,
    layout: Layout,
    dtype: torch.dtype,
    extra: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The sum of :func:`reduce` of each ``(values, selection)`` and ``extra`` over the group.

    ``extra``: per-rank sums to total over the context group too (the diagnostics' sums). Under
    a context group every reduction's partial sums (:func:`context_parts`) and ``extra`` travel
    in one all-reduce (identity backward: replicated results).
    """
    if layout.context is None or spec.reduction == "none":
        loss = reduce(*pieces[0], spec, layout)
        for values, selection in pieces[1:]:
            loss = loss + reduce(values, selection, spec, layout)
        return loss, extra if layout.context is None else layout.combine(*extra)
    local = [context_parts(masked_fill_zero(v, m), m, spec, layout) for v, m in pieces]
    combined = layout.combine(*(tensor for part in local for tensor in part), *extra)
    loss, start = torch.zeros((), dtype=dtype, device=combined[0].device), 0
    for part in local:
        group_sums = tuple(combined[start : start + len(part)])
        loss, start = (
            loss + reduce_context_parts(group_sums, spec, layout, dtype),
            start + len(part),
        )
    return loss, tuple(combined[start:])


def masked_fill_zero(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is True, exact zero elsewhere (NaN-proof in value and grad)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def select_or_zero(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``torch.where(selected, values, 0)`` (same shapes): value and gradient; keeps an int8."""
    result: torch.Tensor = _SelectOrZero.apply(values, selected)  # type: ignore[no-untyped-call]
    return result


class _SelectOrZero(torch.autograd.Function):
    """The ``where`` of :func:`select_or_zero`, its selection kept for the backward as ``int8``.

    Autograd would keep the ``where``'s bool, which Inductor's CPU code stores slowly: the
    compiled CISPO and TOPR losses took ~1.5x ``Clip()``'s with it, ~1.05x with the ``int8``.
    ``torch.func`` transforms (``grad``, ``vmap``) apply; forward-mode AD is not defined.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        return masked_fill_zero(values, selected)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: Any) -> None:
        selected = inputs[1]
        # compiled, the int8 is formed from a float (Inductor's CPU code converts a bool slowly)
        kept = torch.where(selected, 1.0, 0.0) if torch.compiler.is_compiling() else selected
        ctx.save_for_backward(kept.to(torch.int8))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (selected,) = ctx.saved_tensors
        return grad * selected, None  # grad where selected, 0 elsewhere


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
