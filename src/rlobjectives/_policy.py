"""The general policy loss :func:`policy_loss`: validate once, then dispatch to a path.

Two paths compute the same values and gradients: the fused autograd Function of
:mod:`rlobjectives._fused` (the default) and the readable autograd specification of
:mod:`rlobjectives._surrogate` (used when a hyperparameter tensor requires grad, and by the tests
as the fused path's reference). Both reduce through :mod:`rlobjectives._reduction`.
"""

from __future__ import annotations

import torch

from ._fused import ClippedSurrogateFunction, FusedSpec
from ._packing import token_ndim, token_output
from ._policy_args import (
    PolicyCall,
    PolicyLossDiagnostics,
    PolicyLossOutput,
    RatioLevel,
    prepare_layout_inputs,
    validate_diagnostics_normalizer,
    validate_surrogate_options,
)
from ._reduction import Reduction, reduce, validate_layout_reduction
from ._surrogate import policy_terms
from ._validation import ArrayLike, Scalar, validate_bool

__all__ = [
    "fused_applicable",
    "packed_output_shape",
    "policy_loss",
    "run_autograd",
    "run_fused",
    "validate_policy_call",
]


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
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    diagnostics_normalizer: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
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

    Packed sequences (``cu_seqlens`` given, the padding-free layout of flash-attention): the
    per-token tensors are ``(N,)`` or ``(1, N)``, sequence :math:`i` is the run of tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``, advantages are ``(S,)`` per sequence (broadcast to
    their tokens by the library) or per token; every reduction and the GSPO sequence ratio work
    per sequence, and the result equals the call on the padded layout of the same sequences
    (:func:`rlobjectives.unpack`). See ``docs/conventions.md``.

    ``old_log_probs`` and ``advantages`` are constants: no gradient flows into them (so an
    undetached critic or behaviour policy never receives policy gradient). The loss runs
    through a fused ``torch.autograd.Function`` (``rlobjectives._fused``): one forward pass
    computes the loss, the diagnostics and the gradient coefficient, and backward keeps one float
    ``(B, T)`` tensor plus the mask. It supports first-order gradients only; a hyperparameter
    given as a tensor that requires grad selects the plain-autograd specification
    (``rlobjectives._surrogate``) instead.

    Args:
        log_probs: current-policy log-probabilities of the sampled tokens, ``(B, T)``.
        old_log_probs: behaviour-policy log-probabilities, ``(B, T)``.
        advantages: ``(B,)``, ``(B, 1)`` (per sequence) or ``(B, T)`` (per token).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        clip_low: :math:`0 \le \epsilon_{low} < 1`, or None for no clipping.
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
        max_response_length: Dr. GRPO constant for ``sequence_sum_normalized``, a positive
            integer (default ``T``).
        diagnostics_normalizer: global selected-token count used as the denominator of the
            token diagnostics (default: the local count); used exactly as given.
        cu_seqlens: ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last), or None for the padded layout. With it, ``log_probs``,
            ``old_log_probs`` and ``mask`` are ``(N,)`` or ``(1, N)``, ``advantages`` ``(S,)``,
            ``(S, 1)``, ``(N,)`` or ``(1, N)`` (a 1-D tensor of length ``S`` is per sequence),
            and the default ``max_response_length`` is the longest sequence. Its values are
            checked with one host read (skipped under ``torch.compile``).
        return_per_token: also return the ``(B, T)`` per-token loss (packed: the shape of
            ``log_probs``).

    Returns:
        :class:`PolicyLossOutput` ``(loss, per_token_loss, diagnostics)``. ``loss`` and
        ``per_token_loss`` have the dtype and device of ``log_probs`` (integer input becomes the
        default float dtype); the math runs in float32 (float64 for float64 inputs).

    Raises:
        ValueError: on mismatched shapes, wrong ranks, different devices, negative or non-finite
            clip parameters, ``clip_low >= 1``, ``dual_clip <= 1``, ``clip_high`` without
            ``clip_low``, a non-positive normaliser, a fractional ``max_response_length``, an
            unknown ``reduction`` or ``ratio_level``, or a malformed ``cu_seqlens`` (not an
            integer 1-D tensor, not starting at 0, not ending at ``N``, decreasing).
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
    call = validate_policy_call(
        (log_probs, old_log_probs, advantages, mask),
        ("log_probs", "old_log_probs", "advantages", "mask"),
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
        cu_seqlens=cu_seqlens,
    )
    validate_bool(return_per_token, "return_per_token")
    run = run_fused if fused_applicable(call) else run_autograd
    output = run(call, return_per_token=return_per_token)
    return packed_output_shape(output, flat=cu_seqlens is not None and token_ndim(log_probs) == 1)


def packed_output_shape(output: PolicyLossOutput, *, flat: bool) -> PolicyLossOutput:
    """Per-token results of packed ``(N,)`` inputs in the same ``(N,)`` shape."""
    if not flat:
        return output
    per_token = output.per_token_loss
    return output._replace(
        loss=token_output(output.loss, output.loss.ndim == 2),
        per_token_loss=None if per_token is None else token_output(per_token, True),
    )


def validate_policy_call(
    tensors: tuple[ArrayLike, ArrayLike, ArrayLike, ArrayLike],
    names: tuple[str, str, str, str],
    *,
    clip_low: Scalar | None,
    clip_high: Scalar | None,
    dual_clip: Scalar | None,
    ratio_level: str,
    log_ratio_bound: Scalar | None,
    reduction: object,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    diagnostics_normalizer: Scalar | None,
    cu_seqlens: ArrayLike | None = None,
) -> PolicyCall:
    """Validate every argument of a policy-loss call once (tensors named as in ``names``).

    ``cu_seqlens`` selects the packed layout (see :func:`prepare_layout_inputs`).
    """
    inputs, layout = prepare_layout_inputs(*tensors, names, cu_seqlens=cu_seqlens)
    options = validate_surrogate_options(
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
    )
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=layout,
        tokens=inputs.log_probs.shape[-1],
    )
    diagnostics = validate_diagnostics_normalizer(diagnostics_normalizer)
    return PolicyCall(inputs, options, spec, diagnostics, layout)


def fused_applicable(call: PolicyCall) -> bool:
    """Whether the fused Function applies: no hyperparameter tensor requires grad.

    ``old_log_probs`` and ``advantages`` are constants on every path; a tensor hyperparameter
    that requires grad (a learnable clip range, say) is differentiated by the autograd path.
    """
    scalars = [*call.options, call.reduction.normalizer, call.reduction.constant]
    return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in scalars)


def run_fused(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """:func:`policy_loss` through :class:`~rlobjectives._fused.ClippedSurrogateFunction`."""
    inputs = call.inputs
    reduction = call.reduction
    if return_per_token:  # the per-token loss is the "none" reduction; reduce it afterwards
        reduction = reduction._replace(reduction="none")
    spec = FusedSpec(
        call.options, reduction, call.diagnostics_normalizer, inputs.dtype, call.layout, False
    )
    loss, _, diagnostics = ClippedSurrogateFunction.apply(  # type: ignore[no-untyped-call]
        inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask, spec
    )
    per_token = None
    if return_per_token:
        per_token = loss  # (B, T), zeros at unselected tokens
        loss = reduce(per_token, inputs.mask, call.reduction, call.layout)
        per_token = per_token.to(inputs.output_dtype)
    return PolicyLossOutput(
        loss=loss.to(inputs.output_dtype),
        per_token_loss=per_token,
        diagnostics=PolicyLossDiagnostics(*diagnostics.unbind()),
    )


def run_autograd(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """:func:`policy_loss` through the autograd specification (:mod:`rlobjectives._surrogate`)."""
    inputs = call.inputs
    terms = policy_terms(inputs, call.options, call.diagnostics_normalizer, call.layout)
    loss = reduce(terms.per_token_loss, inputs.mask, call.reduction, call.layout)
    per_token = terms.per_token_loss.to(inputs.output_dtype) if return_per_token else None
    return PolicyLossOutput(
        loss=loss.to(inputs.output_dtype), per_token_loss=per_token, diagnostics=terms.diagnostics
    )


def _policy_loss_autograd(*args: ArrayLike, **kwargs: object) -> PolicyLossOutput:
    """:func:`policy_loss` through the autograd path (the fused path's test reference)."""
    return_per_token = bool(kwargs.pop("return_per_token", False))
    names = ("log_probs", "old_log_probs", "advantages", "mask")
    defaults: dict[str, object] = {
        "clip_low": 0.2,
        "clip_high": None,
        "dual_clip": None,
        "ratio_level": "token",
        "log_ratio_bound": 20.0,
        "reduction": "token_mean",
        "normalizer": None,
        "max_response_length": None,
        "diagnostics_normalizer": None,
        "cu_seqlens": None,
    }
    call = validate_policy_call(args, names, **{**defaults, **kwargs})  # type: ignore[arg-type]
    output = run_autograd(call, return_per_token=return_per_token)
    flat = kwargs.get("cu_seqlens") is not None and token_ndim(args[0]) == 1
    return packed_output_shape(output, flat=flat)
