"""Clipped policy-gradient surrogates: :func:`policy_loss` and the seed GRPO surrogate.

One implementation of the math (:func:`_policy_loss_terms`); the public functions differ only in
argument names, defaults and what they return.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from ._fused import ClippedSurrogateFunction, SurrogateSpec
from ._masking import REDUCTIONS, aggregate, masked_fill_zero, masked_mean, safe_divide
from ._validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    expand_per_sequence,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "PolicyLossDiagnostics",
    "PolicyLossOutput",
    "grpo_clipped_surrogate",
    "policy_loss",
]

RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS = ("token", "sequence")
# Bound used for the diagnostic k3 estimate when the caller disables the log-ratio bound.
_DIAGNOSTIC_LOG_RATIO_BOUND = 20.0


class PolicyLossDiagnostics(NamedTuple):
    """Detached, masked, NaN-proof diagnostics of a policy-loss call.

    Token fractions and means are over selected tokens: the numerator is summed over the batch
    and divided by the local selected-token count, or by ``diagnostics_normalizer`` when given
    (so that the values of micro-batches add up to the full-batch values). All are float32
    (float64 for float64 inputs).

    Attributes:
        clipped_fraction: ratio strictly outside ``[1 - clip_low, 1 + clip_high]``, any sign of
            the advantage (the seed's definition; a superset of the binding clips). 0 when
            ``clip_low`` is None.
        clip_fraction_low: the low clip binds: ``r < 1 - clip_low`` and ``A < 0``.
        clip_fraction_high: the high clip binds: ``r > 1 + clip_high`` and ``A > 0``.
            ``clip_fraction_low + clip_fraction_high`` is verl/OpenRLHF's ``pg_clipfrac`` and
            TRL's ``clip_ratio`` (up to ties at ``A = 0``).
        dual_clip_fraction: the dual-clip bound binds: ``A < 0`` and
            ``min(r A, clip(r) A) < c A`` (verl's ``pg_clipfrac_lower``). 0 without ``dual_clip``.
        log_ratio_bound_fraction: ``|log_ratio| > log_ratio_bound`` (the bound fired).
        ratio_mean: mean importance ratio ``r`` (after the bound).
        approx_kl_k1: k1 estimate of KL(old || new): mean of ``-log_ratio``.
        approx_kl_k3: k3 estimate of KL(old || new): mean of ``r - 1 - log r`` (``log r`` bounded).
    """

    clipped_fraction: torch.Tensor
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    dual_clip_fraction: torch.Tensor
    log_ratio_bound_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    approx_kl_k1: torch.Tensor
    approx_kl_k3: torch.Tensor


class PolicyLossOutput(NamedTuple):
    """Result of :func:`policy_loss`.

    Attributes:
        loss: the reduced loss (scalar; ``(B, T)`` for ``reduction="none"``), dtype of
            ``log_probs``.
        per_token_loss: ``(B, T)`` per-token loss ``-s`` (zeros at unselected tokens) when
            ``return_per_token=True``, else None.
        diagnostics: :class:`PolicyLossDiagnostics`.
    """

    loss: torch.Tensor
    per_token_loss: torch.Tensor | None
    diagnostics: PolicyLossDiagnostics


class _PolicyInputs(NamedTuple):
    log_probs: torch.Tensor  # (B, T), floating, original dtype (grad flows)
    old_log_probs: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, 1) or (B, T)
    mask: torch.Tensor  # (B, T) bool
    output_dtype: torch.dtype
    dtype: torch.dtype  # computation dtype (float32 or float64)


def _prepare_policy_inputs(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    names: tuple[str, str, str, str],
) -> _PolicyInputs:
    """Coerce and validate the four tensor arguments (named as the public function names them)."""
    log_probs_name, old_name, advantages_name, mask_name = names
    log_probs_t = as_batch_matrix(as_float_tensor(log_probs, log_probs_name), log_probs_name)
    device = log_probs_t.device
    old_t = as_batch_matrix(as_float_tensor(old_log_probs, old_name, device), old_name)
    advantages_t = as_float_tensor(advantages, advantages_name, device)
    mask_t = as_batch_matrix(as_mask(mask, mask_name, device), mask_name)
    check_same_device(
        {
            log_probs_name: log_probs_t,
            old_name: old_t,
            advantages_name: advantages_t,
            mask_name: mask_t,
        }
    )
    shape = (log_probs_t.shape[0], log_probs_t.shape[1])
    check_shape(old_t, old_name, shape, log_probs_name)
    check_shape(mask_t, mask_name, shape, log_probs_name)
    if advantages_t.ndim == 1 and advantages_t.numel() == 0 and shape[0] == 0:
        advantages_t = advantages_t.reshape(0)
    advantages_t = expand_per_sequence(advantages_t, advantages_name, shape, log_probs_name)
    return _PolicyInputs(
        log_probs=log_probs_t,
        old_log_probs=old_t,
        advantages=advantages_t,
        mask=mask_t,
        output_dtype=log_probs_t.dtype,
        dtype=compute_dtype(log_probs_t, old_t, advantages_t),
    )


def _clamp(
    values: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor
) -> torch.Tensor:
    """``values.clamp(low, high)`` for Python-number or 0-d-tensor bounds (inclusive)."""
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):

        def bound(x: float | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(x, dtype=values.dtype, device=values.device)

        return torch.clamp(values, bound(low), bound(high))
    return values.clamp(low, high)


class _PolicyTerms(NamedTuple):
    per_token_loss: torch.Tensor  # (B, T) compute dtype, zero at unselected tokens
    diagnostics: PolicyLossDiagnostics


def _policy_loss_terms(
    inputs: _PolicyInputs,
    *,
    clip_low: float | torch.Tensor | None,
    clip_high: float | torch.Tensor | None,
    dual_clip: float | torch.Tensor | None,
    ratio_level: str,
    log_ratio_bound: float | torch.Tensor | None,
    diagnostics_normalizer: Scalar | None,
) -> _PolicyTerms:
    """Per-token clipped surrogate loss ``-s`` and diagnostics, in the computation dtype."""
    dtype, mask = inputs.dtype, inputs.mask
    # Select before any arithmetic: unselected positions become exact zeros (log-ratio 0, ratio 1,
    # advantage 0), so NaN/inf there can reach neither the values nor the gradients.
    log_probs = masked_fill_zero(inputs.log_probs.to(dtype), mask)  # (B, T)
    old_log_probs = masked_fill_zero(inputs.old_log_probs.to(dtype), mask)  # (B, T)
    advantages = masked_fill_zero(inputs.advantages.to(dtype), mask)  # (B, T)
    log_ratio = log_probs - old_log_probs  # (B, T)

    if ratio_level == "token":
        token_log_ratio = log_ratio  # (B, T)
    else:
        # GSPO: log s_i = mean_t log_ratio over the selected tokens, in the stop-gradient form
        # log s_it = log pi_it - sg(log pi_it) + sg(log s_i): value log s_i at every token,
        # gradient d log s_it / d log pi_it = 1, which reproduces the GSPO gradient
        # s_i A_i (1/|y_i|) sum_t grad log pi_it under the sequence_mean reduction.
        sequence_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).detach()  # (B, 1)
        token_log_ratio = masked_fill_zero(
            log_probs - log_probs.detach() + sequence_log_ratio, mask
        )  # (B, T)

    if log_ratio_bound is None:
        bounded_log_ratio = token_log_ratio
        bound_fired = torch.zeros_like(mask)
    else:
        bounded_log_ratio = _clamp(token_log_ratio, -log_ratio_bound, log_ratio_bound)  # (B, T)
        bound_fired = mask & (token_log_ratio.detach().abs() > log_ratio_bound)  # (B, T)
    ratio = torch.exp(bounded_log_ratio)  # (B, T)
    unclipped = ratio * advantages  # (B, T)

    if clip_low is None:
        surrogate = unclipped
        low_edge = high_edge = None
    else:
        high = clip_low if clip_high is None else clip_high
        low_edge, high_edge = 1.0 - clip_low, 1.0 + high
        clipped = _clamp(ratio, low_edge, high_edge) * advantages  # (B, T)
        surrogate = torch.minimum(unclipped, clipped)  # (B, T)
    pre_dual_surrogate = surrogate
    if dual_clip is not None:
        # Dual clip (Ye et al. 2020): for A < 0 the surrogate is bounded below by c * A.
        surrogate = torch.where(
            advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate
        )
    per_token_loss = masked_fill_zero(-surrogate, mask)  # (B, T)

    with torch.no_grad():
        denominator = mask.sum() if diagnostics_normalizer is None else diagnostics_normalizer

        def fraction(condition: torch.Tensor) -> torch.Tensor:
            return safe_divide((condition & mask).sum().to(dtype), denominator)

        def mean(values: torch.Tensor) -> torch.Tensor:
            return safe_divide(masked_fill_zero(values, mask).sum(), denominator)

        ratio_d = ratio.detach()
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        if low_edge is None or high_edge is None:
            clipped_fraction = clip_low_fraction = clip_high_fraction = zero
        else:
            below, above = ratio_d < low_edge, ratio_d > high_edge
            clipped_fraction = fraction(below | above)
            clip_low_fraction = fraction(below & (advantages < 0))
            clip_high_fraction = fraction(above & (advantages > 0))
        if dual_clip is None:
            dual_fraction = zero
        else:
            dual_fraction = fraction(
                (advantages < 0) & (pre_dual_surrogate < dual_clip * advantages)
            )
        bound = _DIAGNOSTIC_LOG_RATIO_BOUND if log_ratio_bound is None else log_ratio_bound
        kl_log_ratio = _clamp(log_ratio.detach(), -bound, bound)  # (B, T)
        diagnostics = PolicyLossDiagnostics(
            clipped_fraction=clipped_fraction,
            clip_fraction_low=clip_low_fraction,
            clip_fraction_high=clip_high_fraction,
            dual_clip_fraction=dual_fraction,
            log_ratio_bound_fraction=fraction(bound_fired),
            ratio_mean=mean(ratio_d),
            approx_kl_k1=mean(-log_ratio.detach()),
            approx_kl_k3=mean(torch.expm1(kl_log_ratio) - kl_log_ratio),
        )
    return _PolicyTerms(per_token_loss=per_token_loss, diagnostics=diagnostics)


def policy_loss(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    clip_low: Scalar | None = 0.2,
    clip_high: Scalar | None = None,
    dual_clip: Scalar | None = None,
    ratio_level: RatioLevel = "token",
    log_ratio_bound: Scalar | None = 20.0,
    reduction: str = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: int | None = None,
    diagnostics_normalizer: Scalar | None = None,
    return_per_token: bool = False,
) -> PolicyLossOutput:
    r"""Clipped policy-gradient loss (PPO / GRPO / DAPO / GSPO / dual-clip / vanilla PG).

    With :math:`\Delta_{it} = \ell_{it} - \ell^{old}_{it}` (selected tokens only),

    .. math::

        r_{it} = \exp(\mathrm{clip}(\Delta_{it}, -b, b)), \qquad
        s_{it} = \min\big(r_{it} A_{it},\
                 \mathrm{clip}(r_{it}, 1-\epsilon_{low}, 1+\epsilon_{high}) A_{it}\big),

    and the per-token loss is :math:`L_{it} = -s_{it}`, reduced by ``reduction`` (see
    :func:`rlobjectives.aggregate`). Options:

    - ``clip_high`` != ``clip_low``: asymmetric "clip-higher" band (DAPO, arXiv:2503.14476 Eq. 10).
    - ``clip_low=None``: no clipping, :math:`s = r A` (vanilla policy gradient / REINFORCE with
      importance ratio; with ``old_log_probs = log_probs.detach()`` it is REINFORCE).
    - ``dual_clip=c`` (``c > 1``): for :math:`A < 0`, :math:`s = \max(s, c A)` (Ye et al. 2020,
      arXiv:1912.09729 Eq. 5); tokens with :math:`A \ge 0` are unchanged.
    - ``ratio_level="sequence"``: GSPO (arXiv:2507.18071 Eq. 7): the ratio of sequence :math:`i`
      is :math:`s_i = \exp(\frac{1}{|y_i|}\sum_t \Delta_{it})` over its selected tokens, used at
      every token in the stop-gradient form :math:`\log s_{it} = \ell_{it} - sg(\ell_{it}) +
      sg(\log s_i)`, whose gradient equals the paper's (GSPO-token, Eq. 13-14).

    When only ``log_probs`` requires grad (the training call), the loss runs through a fused
    ``torch.autograd.Function`` (``rlobjectives._fused``): one forward pass computes the loss,
    the diagnostics and the gradient coefficient, and backward keeps one float ``(B, T)``
    tensor plus the mask. It supports first-order gradients only; when ``old_log_probs``,
    ``advantages`` or a tensor hyperparameter also requires grad, plain autograd is used.

    Args:
        log_probs: current-policy log-probabilities of the sampled tokens, ``(B, T)``.
        old_log_probs: behaviour-policy log-probabilities, ``(B, T)``.
        advantages: ``(B,)``, ``(B, 1)`` (per sequence) or ``(B, T)`` (per token).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        clip_low: :math:`\epsilon_{low} \ge 0`, or None for no clipping.
        clip_high: :math:`\epsilon_{high} \ge 0`; None means ``clip_low``.
        dual_clip: :math:`c > 1`, or None.
        ratio_level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO).
        log_ratio_bound: :math:`b > 0` bound on the log-ratio before ``exp`` (the gradient is zero
            where it fires), or None.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"`` or
            ``"none"``.
        normalizer: explicit denominator for micro-batch/rank-additive losses (global selected
            token count for ``token_mean``, global count of non-empty sequences for
            ``sequence_mean``, global sequence count for ``sequence_sum_normalized``).
        max_response_length: Dr. GRPO constant for ``sequence_sum_normalized`` (default ``T``).
        diagnostics_normalizer: global selected-token count used as the denominator of the
            token diagnostics (default: the local count).
        return_per_token: also return the ``(B, T)`` per-token loss.

    Returns:
        :class:`PolicyLossOutput` ``(loss, per_token_loss, diagnostics)``. ``loss`` and
        ``per_token_loss`` have the dtype and device of ``log_probs`` (integer input becomes the
        default float dtype); the math runs in float32 (float64 for float64 inputs).

    Raises:
        ValueError: on mismatched shapes, wrong ranks, different devices, negative or non-finite
            clip parameters, ``dual_clip <= 1``, ``clip_high`` without ``clip_low``, an unknown
            ``reduction`` or ``ratio_level``.
        TypeError: on non-numeric inputs.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 7; Shao et al. 2024, GRPO,
        arXiv:2402.03300 Eq. 3; Yu et al. 2025, DAPO, arXiv:2503.14476 Eq. 8-10;
        Zheng et al. 2025, GSPO, arXiv:2507.18071; Ye et al. 2020, dual-clip, arXiv:1912.09729.

    Examples:
        >>> import torch
        >>> out = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
        ...                   torch.ones(1, 2, dtype=torch.bool))
        >>> out.loss
        tensor(-1.)

    .. versionadded:: 0.1.0
    """
    return _policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
        return_per_token=return_per_token,
        fused=True,
    )


def _policy_loss(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    clip_low: Scalar | None = 0.2,
    clip_high: Scalar | None = None,
    dual_clip: Scalar | None = None,
    ratio_level: str = "token",
    log_ratio_bound: Scalar | None = 20.0,
    reduction: str = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: int | None = None,
    diagnostics_normalizer: Scalar | None = None,
    return_per_token: bool = False,
    fused: bool = True,
) -> PolicyLossOutput:
    """:func:`policy_loss` with a choice of path: fused (default) or pure autograd (tests)."""
    inputs = _prepare_policy_inputs(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        ("log_probs", "old_log_probs", "advantages", "mask"),
    )
    options = _validate_policy_options(
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
        reduction=reduction,
    )
    if diagnostics_normalizer is not None:
        diagnostics_normalizer = validate_scalar(
            diagnostics_normalizer, "diagnostics_normalizer", minimum=0.0, strict=True
        )
    if fused and _fused_applicable(inputs, options, normalizer, diagnostics_normalizer):
        return _fused_policy_loss(
            inputs,
            options,
            reduction=reduction,
            normalizer=normalizer,
            max_response_length=max_response_length,
            diagnostics_normalizer=diagnostics_normalizer,
            return_per_token=return_per_token,
        )
    terms = _policy_loss_terms(
        inputs, diagnostics_normalizer=diagnostics_normalizer, **options._asdict()
    )
    loss = aggregate(
        terms.per_token_loss,
        inputs.mask,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )
    per_token = terms.per_token_loss.to(inputs.output_dtype) if return_per_token else None
    return PolicyLossOutput(
        loss=loss.to(inputs.output_dtype), per_token_loss=per_token, diagnostics=terms.diagnostics
    )


class _PolicyOptions(NamedTuple):
    clip_low: float | torch.Tensor | None
    clip_high: float | torch.Tensor | None
    dual_clip: float | torch.Tensor | None
    ratio_level: str
    log_ratio_bound: float | torch.Tensor | None


def _validate_policy_options(
    *,
    clip_low: Scalar | None,
    clip_high: Scalar | None,
    dual_clip: Scalar | None,
    ratio_level: str,
    log_ratio_bound: Scalar | None,
    reduction: str,
) -> _PolicyOptions:
    validate_choice(ratio_level, "ratio_level", RATIO_LEVELS)
    validate_choice(reduction, "reduction", REDUCTIONS)
    if clip_low is None and clip_high is not None:
        raise ValueError(
            f"clip_high requires clip_low (clip_low=None disables clipping), got clip_low=None "
            f"and clip_high={clip_high!r}"
        )
    low = None if clip_low is None else validate_scalar(clip_low, "clip_low", minimum=0.0)
    high = None if clip_high is None else validate_scalar(clip_high, "clip_high", minimum=0.0)
    dual = None
    if dual_clip is not None:
        dual = validate_scalar(dual_clip, "dual_clip", minimum=1.0, strict=True)
    bound = None
    if log_ratio_bound is not None:
        bound = validate_scalar(log_ratio_bound, "log_ratio_bound", minimum=0.0, strict=True)
    return _PolicyOptions(
        clip_low=low, clip_high=high, dual_clip=dual, ratio_level=ratio_level, log_ratio_bound=bound
    )


def _policy_loss_autograd(*args: ArrayLike, **kwargs: object) -> PolicyLossOutput:
    """:func:`policy_loss` through the pure-autograd path (the fused path's test reference)."""
    return _policy_loss(*args, **kwargs, fused=False)  # type: ignore[arg-type]


def _fused_applicable(
    inputs: _PolicyInputs,
    options: _PolicyOptions,
    *scalars: Scalar | None,
) -> bool:
    """Whether the fused function applies: it differentiates ``log_probs`` only.

    Anything else that requires grad (old log-probs, advantages, a tensor hyperparameter) takes
    the autograd path.
    """
    others = [inputs.old_log_probs, inputs.advantages, *options, *scalars]
    return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in others)


def _fused_policy_loss(
    inputs: _PolicyInputs,
    options: _PolicyOptions,
    *,
    reduction: str,
    normalizer: Scalar | None,
    max_response_length: int | None,
    diagnostics_normalizer: Scalar | None,
    return_per_token: bool,
) -> PolicyLossOutput:
    """:func:`policy_loss` through :class:`~rlobjectives._fused.ClippedSurrogateFunction`."""
    spec = _surrogate_spec(
        inputs,
        options,
        reduction="none" if return_per_token else reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
    )
    loss, _, diagnostics = ClippedSurrogateFunction.apply(  # type: ignore[no-untyped-call]
        inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask, spec
    )
    per_token = None
    if return_per_token:
        per_token = loss  # (B, T), zeros at unselected tokens
        loss = aggregate(
            per_token,
            inputs.mask,
            reduction=reduction,
            normalizer=normalizer,
            max_response_length=max_response_length,
        )
        per_token = per_token.to(inputs.output_dtype)
    return PolicyLossOutput(
        loss=loss.to(inputs.output_dtype),
        per_token_loss=per_token,
        diagnostics=PolicyLossDiagnostics(*diagnostics.unbind()),
    )


def _surrogate_spec(
    inputs: _PolicyInputs,
    options: _PolicyOptions,
    *,
    reduction: str,
    normalizer: Scalar | None,
    max_response_length: int | None,
    diagnostics_normalizer: Scalar | None,
) -> SurrogateSpec:
    """Validate the reduction arguments (as :func:`aggregate` does) into a fused-call spec."""
    if normalizer is not None:
        normalizer = validate_scalar(normalizer, "normalizer", minimum=0.0, strict=True)
    constant = float(inputs.log_probs.shape[-1])
    if max_response_length is not None:
        constant = float(
            validate_scalar(
                max_response_length,
                "max_response_length",
                minimum=0,
                strict=True,
                allow_tensor=False,
            )
        )
    bound = options.log_ratio_bound
    return SurrogateSpec(
        clip_low=options.clip_low,
        clip_high=options.clip_high,
        dual_clip=options.dual_clip,
        ratio_level=options.ratio_level,
        log_ratio_bound=bound,
        diagnostic_bound=_DIAGNOSTIC_LOG_RATIO_BOUND if bound is None else bound,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=constant,
        diagnostics_normalizer=diagnostics_normalizer,
        dtype=inputs.dtype,
    )


def grpo_clipped_surrogate(
    new_log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    token_mask: ArrayLike,
    clip_epsilon: Scalar,
) -> dict[str, torch.Tensor]:
    r"""Clipped GRPO surrogate over selected response tokens (the seed specification).

    .. math::

        r_{it} = \exp(\mathrm{clip}(\ell^{new}_{it} - \ell^{old}_{it}, -60, 60)), \qquad
        s_{it} = \min\big(r_{it} A_i,\ \mathrm{clip}(r_{it}, 1-\epsilon, 1+\epsilon) A_i\big)

    ``loss`` is :math:`-\sum_{it} m_{it} s_{it} / \sum_{it} m_{it}` (token mean over the whole
    batch); ``per_sequence_surrogate[i]`` is the mean of :math:`s_{it}` over sequence ``i``'s
    selected tokens (0 if none); ``clipped_fraction`` is the fraction of selected ratios strictly
    outside :math:`[1-\epsilon, 1+\epsilon]`. With no selected token both scalars are 0.

    This is :func:`policy_loss` with ``clip_low=clip_epsilon``, ``log_ratio_bound=60`` and
    ``reduction="token_mean"``.

    Args:
        new_log_probs: ``(B, T)`` current log-probabilities (differentiable).
        old_log_probs: ``(B, T)`` behaviour log-probabilities.
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)``.
        token_mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        clip_epsilon: :math:`\epsilon \ge 0`, finite.

    Returns:
        ``{"loss": (), "per_sequence_surrogate": (B,), "clipped_fraction": ()}``, all with the
        dtype and device of ``new_log_probs``.

    Raises:
        ValueError: on mismatched shapes or devices, or a negative/NaN/infinite ``clip_epsilon``.
        TypeError: on non-numeric inputs.

    References:
        Shao et al. 2024, DeepSeekMath (GRPO), arXiv:2402.03300 Eq. 3 (token-mean aggregation as
        in DAPO, arXiv:2503.14476 Eq. 8).

    Examples:
        >>> out = grpo_clipped_surrogate([[0.1823215567939546, -0.2231435513142097]], [[0, 0]],
        ...                              [1], [[True, True]], 0.2)
        >>> round(float(out["loss"]), 6)
        -1.0
    """
    inputs = _prepare_policy_inputs(
        new_log_probs,
        old_log_probs,
        advantages,
        token_mask,
        ("new_log_probs", "old_log_probs", "advantages", "token_mask"),
    )
    epsilon = validate_scalar(clip_epsilon, "clip_epsilon", minimum=0.0)
    return _grpo_surrogate_terms(inputs, epsilon, fused=True)


def _grpo_clipped_surrogate_autograd(
    new_log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    token_mask: ArrayLike,
    clip_epsilon: Scalar,
) -> dict[str, torch.Tensor]:
    """:func:`grpo_clipped_surrogate` through the autograd path (the fused path's reference)."""
    inputs = _prepare_policy_inputs(
        new_log_probs,
        old_log_probs,
        advantages,
        token_mask,
        ("new_log_probs", "old_log_probs", "advantages", "token_mask"),
    )
    epsilon = validate_scalar(clip_epsilon, "clip_epsilon", minimum=0.0)
    return _grpo_surrogate_terms(inputs, epsilon, fused=False)


def _grpo_surrogate_terms(
    inputs: _PolicyInputs, epsilon: float | torch.Tensor, *, fused: bool
) -> dict[str, torch.Tensor]:
    """The seed GRPO outputs: ``policy_loss`` with ``clip_low=epsilon``, bound 60, token mean."""
    options = _PolicyOptions(
        clip_low=epsilon, clip_high=None, dual_clip=None, ratio_level="token", log_ratio_bound=60.0
    )
    output_dtype = inputs.output_dtype
    if fused and _fused_applicable(inputs, options):
        spec = _surrogate_spec(
            inputs,
            options,
            reduction="token_mean",
            normalizer=None,
            max_response_length=None,
            diagnostics_normalizer=None,
        )
        loss, row_sums, diagnostics = ClippedSurrogateFunction.apply(  # type: ignore[no-untyped-call]
            inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask, spec
        )
        per_sequence = safe_divide(row_sums, torch.count_nonzero(inputs.mask, dim=-1))  # (B,)
        clipped_fraction = diagnostics[0]
    else:
        terms = _policy_loss_terms(inputs, diagnostics_normalizer=None, **options._asdict())
        loss = aggregate(terms.per_token_loss, inputs.mask, reduction="token_mean")
        per_sequence = masked_mean(-terms.per_token_loss, inputs.mask, dim=-1)  # (B,)
        clipped_fraction = terms.diagnostics.clipped_fraction
    return {
        "loss": loss.to(output_dtype),
        "per_sequence_surrogate": per_sequence.to(output_dtype),
        "clipped_fraction": clipped_fraction.to(output_dtype),
    }
