r"""Rollout correction: importance weights between the inference engine and the trainer.

The sampler (vLLM, SGLang) and the trainer compute different log-probabilities for the same
tokens, even with the same weights, so the samples are slightly off-policy for the trainer.
With :math:`\delta_{it} = \ell_{it} - \ell^{rollout}_{it}` (trainer minus sampler log-prob of
the sampled token) the raw importance ratio of a **level** is

.. math::

    \rho_{it} = e^{\mathrm{clip}(\delta_{it}, \pm 20)} \;(\text{token}), \qquad
    \rho_i = e^{\mathrm{clip}(\sum_t \delta_{it}, \pm 20)} \;(\text{sequence}), \qquad
    \rho_i = e^{\mathrm{clip}(\frac{1}{n_i}\sum_t \delta_{it}, \pm 20)} \;(\text{geometric}),

(sums over the selected tokens; a sequence ratio is broadcast to its tokens), and a **mode**
turns it into a weight :math:`w` and a mask:

- ``"truncate"``: :math:`w = \mathrm{clip}(\rho, L, U)` (truncated IS, TIS);
- ``"mask"``: :math:`w = \rho\,\mathbb 1[L \le \rho \le U]` (the token stays in the mask);
- ``"reject"``: :math:`w = 1` and the token (the whole sequence for the sequence levels) leaves
  the mask when :math:`\rho \notin [L, U]` (rejection sampling);

and ``veto`` :math:`v` removes a whole sequence with any token ratio :math:`e^{\delta_{it}} < v`.

Every decision (:math:`\rho < L`, :math:`\rho > U`, :math:`e^{\delta} < v`) is taken on the
log-ratio by the rule of :mod:`rlobjectives._core.decisions` (``docs/conventions.md``,
"Decisions at a bound"): as a correctly rounded ``exp`` in the computation dtype would take it
against the bound rounded to that dtype, whatever the backend's ``exp`` rounds to. The weights
keep their formulas (the truncation :math:`\mathrm{clip}(\rho, L, U)` is continuous).

Every per-sequence operation goes through :class:`rlobjectives._core.layout.Layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch
from torch.distributed import ProcessGroup

from .._core.decisions import ratio_above, ratio_below
from .._core.layout import Layout, sequence_layout, token_matrix, token_ndim, token_output
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    scalar_number,
    validate_choice,
    validate_context_group,
    validate_scalar,
)
from .metrics import RolloutCorrectionMetrics, metrics_over_context, rollout_metrics

__all__ = [
    "LEVELS",
    "LOG_RATIO_BOUND",
    "MODES",
    "Level",
    "Mode",
    "RolloutCorrection",
    "check_pair",
    "rollout_correction",
]

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["truncate", "mask", "reject"]
LEVELS: tuple[str, ...] = get_args(Level)
MODES: tuple[str, ...] = get_args(Mode)
#: verl's SAFETY_BOUND: log-ratios are clamped to [-20, 20] before ``exp``.
LOG_RATIO_BOUND = 20.0

Bound = float | torch.Tensor | None


class RolloutCorrection(NamedTuple):
    """Result of :func:`rollout_correction`.

    Attributes:
        weights: ``(B, T)`` importance weights, no gradient, computation dtype (float32, float64
            for float64 inputs); exact 0 where ``mask`` (below) is False and where
            ``mode="mask"`` zeroed them.
        mask: ``(B, T)`` bool, the selected tokens that survive: the input mask minus the
            tokens/sequences rejected by ``mode="reject"`` and the sequences removed by ``veto``.
        metrics: :class:`RolloutCorrectionMetrics` (sums and counts; derived values as
            properties).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: RolloutCorrectionMetrics


class _ModeResult(NamedTuple):
    """A mode's output, broadcastable to ``(B, T)`` (``(B, 1)`` for a sequence level)."""

    weights: torch.Tensor  # before the output mask is applied
    keep: torch.Tensor | None  # bool, tokens kept in the mask (None: all)
    truncated: torch.Tensor | None  # bool, weight truncated (None: none)
    zeroed: torch.Tensor | None  # bool, weight zeroed or token rejected (None: none)


# ------------------------------------------------------------------------------------ levels
def _token_level(
    delta: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor, layout: Layout
) -> torch.Tensor:
    return token_log_ratio  # (B, T), already clamped


def _sequence_level(
    delta: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor, layout: Layout
) -> torch.Tensor:
    # log of the product of the (unclamped) ratios, then the clamp (verl's order); NaN from a
    # sum that met +inf and -inf becomes 0
    log_ratio = torch.nan_to_num(layout.row_sums(delta), nan=0.0)  # (S,)
    return layout.expand(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # (B, 1)


def _geometric_level(
    delta: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor, layout: Layout
) -> torch.Tensor:
    # whole sequences: one all-reduce of both under context parallelism
    sums, counts = layout.combine(layout.local_row_sums(delta), layout.local_row_counts(mask))
    log_ratio = torch.nan_to_num(sums, nan=0.0) / counts.to(delta.dtype).clamp(min=1)  # (S,)
    return layout.expand(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # (B, 1)


#: The clamped log of the raw ratio of each level: ``(B, T)`` per token, ``(B, 1)`` per
#: sequence (padded layout; ``(1, N)`` packed), from the unclamped and the clamped token ratios.
_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Layout], torch.Tensor]] = {
    "token": _token_level,
    "sequence": _sequence_level,
    "geometric": _geometric_level,
}


# ------------------------------------------------------------------------------------- modes
def _outside(log_ratio: torch.Tensor, lower: Bound, upper: Bound) -> torch.Tensor | None:
    """Bool ``rho < lower or rho > upper`` by the rule, on ``log rho``; None when both are open."""
    below = None if lower is None else ratio_below(log_ratio, lower)
    above = None if upper is None else ratio_above(log_ratio, upper)
    if below is None or above is None:
        return above if below is None else below
    return below | above


def _as_bound(value: Bound, like: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _truncate(
    ratio: torch.Tensor, log_ratio: torch.Tensor, lower: Bound, upper: Bound
) -> _ModeResult:
    outside = _outside(log_ratio, lower, upper)
    if outside is None:
        return _ModeResult(ratio, None, None, None)
    weights = torch.clamp(ratio, min=_as_bound(lower, ratio), max=_as_bound(upper, ratio))
    return _ModeResult(weights, None, outside, None)


def _mask(ratio: torch.Tensor, log_ratio: torch.Tensor, lower: Bound, upper: Bound) -> _ModeResult:
    outside = _outside(log_ratio, lower, upper)
    if outside is None:
        return _ModeResult(ratio, None, None, None)
    return _ModeResult(torch.where(outside, 0.0, ratio), None, None, outside)


def _reject(
    ratio: torch.Tensor, log_ratio: torch.Tensor, lower: Bound, upper: Bound
) -> _ModeResult:
    outside = _outside(log_ratio, lower, upper)
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)  # broadcast by the output mask
    return _ModeResult(one, None if outside is None else ~outside, None, outside)


#: A mode: ``(ratio, its log, lower, upper)`` to the weight and the mask changes.
_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, Bound, Bound], _ModeResult]] = {
    "truncate": _truncate,
    "mask": _mask,
    "reject": _reject,
}


# ------------------------------------------------------------------------------- boundary
class Pair(NamedTuple):
    """Validated per-token pair: ``(B, T)`` padded or ``(1, N)`` packed, and its layout."""

    first: torch.Tensor
    other: torch.Tensor
    mask: torch.Tensor
    layout: Layout
    flat: bool  # the inputs were (N,): results are returned as (N,)


def check_pair(
    log_probs: ArrayLike,
    other: ArrayLike,
    mask: ArrayLike,
    names: tuple[str, str, str],
    cu_seqlens: ArrayLike | None = None,
    context_group: object = None,
) -> Pair:
    """Validated log-probs, second log-probs and bool mask (same shape and device), and layout.

    ``context_group`` (validated here) goes into the layout: context parallelism.
    """
    context = validate_context_group(context_group)
    first_name, other_name, mask_name = names
    packed = cu_seqlens is not None
    first_t = token_matrix(as_float_tensor(log_probs, first_name), first_name, packed)
    device = first_t.device
    other_t = token_matrix(as_float_tensor(other, other_name, device), other_name, packed)
    mask_t = token_matrix(as_mask(mask, mask_name, device), mask_name, packed)
    check_same_device({first_name: first_t, other_name: other_t, mask_name: mask_t})
    check_shape(other_t, other_name, tuple(first_t.shape), first_name)
    check_shape(mask_t, mask_name, tuple(first_t.shape), first_name)
    layout = sequence_layout(cu_seqlens, first_t, context)
    flat = packed and token_ndim(log_probs) == 1
    return Pair(first_t, other_t, mask_t, layout, flat)


def _validate_bounds(
    upper: Scalar | None, lower: Scalar | None, veto: Scalar | None
) -> tuple[Bound, Bound, Bound]:
    """``upper > 0``, ``lower >= 0``, ``veto > 0`` (finite, or None) and ``lower <= upper``."""
    upper_v = None if upper is None else validate_scalar(upper, "upper", strict=True)
    lower_v = None if lower is None else validate_scalar(lower, "lower")
    veto_v = None if veto is None else validate_scalar(veto, "veto", strict=True)
    if upper_v is not None and lower_v is not None:
        high, low = scalar_number(upper_v), scalar_number(lower_v)
        if high is not None and low is not None and low > high:
            raise ValueError(f"lower must be <= upper, got lower={low} and upper={high}")
    return upper_v, lower_v, veto_v


def _log_ratio(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    r"""Selected :math:`\delta = \ell - \ell^{rollout}` in ``dtype``, 0 elsewhere, detached.

    NaN at a selected token (a sampler that returned no log-prob) becomes 0 (ratio 1, as TRL
    >= 1.16 does); +-inf become the largest finite values, which the +-20 clamp bounds.
    """
    delta = masked_fill_zero(log_probs.detach().to(dtype), mask) - masked_fill_zero(
        rollout_log_probs.detach().to(dtype), mask
    )  # (B, T)
    return torch.nan_to_num(delta, nan=0.0)


def _vetoed(
    delta: torch.Tensor, mask: torch.Tensor, layout: Layout, veto: Bound
) -> torch.Tensor | None:
    """Bool ``(B, T)``: the selected tokens of sequences with a token ratio below ``veto``.

    ``e^delta < veto`` by the rule (on the unclamped log-ratio, verl's form): ``delta`` below
    the smallest log-ratio whose correctly rounded ``exp`` reaches ``veto`` rounded to the
    computation dtype (not ``log(veto)`` rounded: at ``veto=1e-4`` the float32 log-ratio just
    below ``log(1e-4)`` has ``exp`` equal to float32 ``1e-4``, and is kept).
    """
    if veto is None:
        return None
    catastrophic = mask & ratio_below(delta, veto)  # (B, T)
    has_any = layout.row_counts(catastrophic) > 0  # (S,)
    return mask & layout.expand(has_any)


def _correct(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    layout: Layout,
    *,
    level: str,
    mode: str,
    upper: Bound,
    lower: Bound,
    veto: Bound,
) -> RolloutCorrection:
    """Unchecked :func:`rollout_correction` on validated tensors.

    A sequence-level ratio stays ``(B, 1)`` (padded layout) until broadcasting against the mask
    expands it: ``exp`` and the band tests run once per sequence.
    """
    dtype = compute_dtype(log_probs, rollout_log_probs)
    delta = _log_ratio(log_probs, rollout_log_probs, mask, dtype)  # (B, T), 0 unselected
    token_log_ratio = delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    level_log_ratio = _LEVELS[level](delta, token_log_ratio, mask, layout)  # (B, T) or (B, 1)
    ratio = torch.exp(level_log_ratio)
    applied = _MODES[mode](ratio, level_log_ratio, lower, upper)
    survive = mask if applied.keep is None else mask & applied.keep  # (B, T)
    vetoed = _vetoed(delta, mask, layout, veto)
    if vetoed is not None:
        survive = survive & ~vetoed
    weights = masked_fill_zero(applied.weights, survive)  # (B, T)
    removed = None if applied.zeroed is None else mask & applied.zeroed
    if vetoed is not None:
        removed = vetoed if removed is None else removed | vetoed
    metrics = rollout_metrics(
        log_ratio=token_log_ratio,
        level_log_ratio=None if level == "token" else level_log_ratio,
        ratio=ratio,
        weights=weights,
        mask=mask,
        truncated=None if applied.truncated is None else survive & applied.truncated,
        removed=removed,
    )
    if layout.context is not None:  # the metrics of the whole sequences
        metrics = metrics_over_context(metrics, layout.context)
    # A new tensor even when nothing was removed: the result never aliases the caller's mask.
    survive = survive.clone() if survive is mask else survive
    return RolloutCorrection(weights=weights, mask=survive, metrics=metrics)


@checks_environment
def rollout_correction(
    log_probs: ArrayLike,
    rollout_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    level: Level = "token",
    mode: Mode = "truncate",
    upper: Scalar | None = 2.0,
    lower: Scalar | None = None,
    veto: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> RolloutCorrection:
    r"""Importance weights that correct for the sampler/trainer mismatch (TIS, IcePop, MIS).

    With :math:`\delta_{it} = \ell_{it} - \ell^{rollout}_{it}` on the selected tokens (NaN there,
    a token the sampler gave no log-prob, counts as :math:`\delta = 0`, as in TRL >= 1.16):

    .. math::

        \log\rho = \mathrm{clip}\big(\delta_{it}\ \text{(token)},\ \textstyle\sum_t \delta_{it}
        \ \text{(sequence)},\ \frac{1}{n_i}\sum_t \delta_{it}\ \text{(geometric)},\ -20,\ 20\big),

    a sequence ratio broadcast to its tokens. With :math:`L` = ``lower``, :math:`U` = ``upper``
    (None: open), both inclusive (decided on the log-ratio: ``docs/conventions.md``):
    ``"truncate"``: :math:`w = \mathrm{clip}(\rho, L, U)`; ``"mask"``: :math:`w = \rho\,
    \mathbb 1[L \le \rho \le U]` (both keep the mask); ``"reject"``: :math:`w = 1` and tokens
    (whole sequences at the sequence levels) with :math:`\rho \notin [L, U]` leave the returned
    mask; ``veto`` :math:`v`: a sequence with a token :math:`e^{\delta_{it}} < v` leaves it.

    Constant weights for ``policy_loss(..., out.mask, importance_weights=out.weights)``. Peers
    (TRL ``vllm_importance_sampling_mode``, verl ``rollout_is`` / IcePop / ``rollout_rs``,
    OpenRLHF ``vllm_is_correction_type``), whole sequences: ``docs/objectives/rollout.md``.

    Args:
        log_probs: ``(B, T)`` trainer log-probabilities of the sampled tokens (detached).
        rollout_log_probs: ``(B, T)`` the sampler's log-probabilities of the same tokens.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        level: ``"token"``, ``"sequence"`` (product of the ratios) or ``"geometric"`` (mean).
        mode: ``"truncate"``, ``"mask"`` or ``"reject"``.
        upper: :math:`U > 0` (number or 0-d tensor), or None for no upper bound.
        lower: :math:`L \ge 0`, or None for no lower bound; :math:`L \le U`.
        veto: :math:`v > 0`, or None for no veto.
        cu_seqlens: optional ``(S + 1,)`` packed boundaries (tensors, results ``(N,)``/``(1, N)``).
        context_group: the context-parallel group of the sequences' other tokens, or None.

    Returns:
        :class:`RolloutCorrection` ``(weights, mask, metrics)``: ``weights`` ``(B, T)`` in the
        computation dtype, exact 0 at unselected tokens; ``mask`` ``(B, T)`` bool; ``metrics`` a
        :class:`RolloutCorrectionMetrics` of sums and counts over the selected tokens, additive
        over micro-batches and ranks (:func:`rlobjectives.distributed.sum_diagnostics`).

    Raises:
        ValueError: on inputs that are not ``(B, T)``, mismatched shapes/devices, an unknown
            ``level``/``mode``, ``upper``/``veto`` not > 0, ``lower`` < 0, ``lower > upper``,
            a non-finite bound, or a ``context_group`` without this rank or a process group.
        TypeError: on non-numeric inputs or bounds, or a non-ProcessGroup ``context_group``.

    References:
        Yao et al. 2025 (truncated IS); Liu, Li et al. 2025 (sequence/geometric ratios,
        rejection, veto); Ling Team 2025, arXiv:2510.18855 §3 (IcePop); Kong 1992 (ESS).

    Examples:
        >>> import torch
        >>> out = rollout_correction(torch.tensor([[0.0, 0.0, 0.0]]),
        ...                          torch.tensor([[-1.0, 0.0, 0.5]]), torch.tensor([[1, 1, 0]]))
        >>> out.weights  # exp(1) = 2.718 truncated to 2 (upper=2.0), exp(0) = 1, unselected 0
        tensor([[2., 1., 0.]])
        >>> float(out.metrics.truncated_fraction)
        0.5

    .. versionadded:: 0.2.0
    """
    pair = check_pair(
        log_probs,
        rollout_log_probs,
        mask,
        ("log_probs", "rollout_log_probs", "mask"),
        cu_seqlens,
        context_group,
    )
    validate_choice(level, "level", LEVELS)
    validate_choice(mode, "mode", MODES)
    upper_v, lower_v, veto_v = _validate_bounds(upper, lower, veto)
    result = _correct(
        pair.first,
        pair.other,
        pair.mask,
        pair.layout,
        level=level,
        mode=mode,
        upper=upper_v,
        lower=lower_v,
        veto=veto_v,
    )
    return result._replace(
        weights=token_output(result.weights, pair.flat), mask=token_output(result.mask, pair.flat)
    )
