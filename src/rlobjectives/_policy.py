"""The general policy loss :func:`policy_loss`: validate once, then dispatch to a path.

Two paths compute the same values and gradients: the fused autograd Function of
:mod:`rlobjectives._fused` (the default, for the token-local surrogates ``"clip"``, ``"cispo"``
and ``"sapo"``) and the readable autograd specification of :mod:`rlobjectives._surrogate` (used
for the sequence-level surrogates ``"gmpo"`` and ``"vespo"``, when a hyperparameter tensor
requires grad, and by the tests as the fused path's reference). Both reduce through
:mod:`rlobjectives._reduction`; the entropy bonus is added by autograd on both.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ._fused import ClippedSurrogateFunction, FusedSpec, has_fused_stage
from ._masking import masked_fill_zero
from ._packing import token_ndim, token_output
from ._policy_args import (
    PolicyCall,
    PolicyLossDiagnostics,
    PolicyLossOutput,
    RatioLevel,
    Surrogate,
    SurrogateOptions,
    prepare_entropy,
    prepare_importance_weights,
    prepare_layout_inputs,
    validate_diagnostics_normalizer,
    validate_entropy_coef,
    validate_surrogate_options,
)
from ._reduction import Reduction, reduce, validate_layout_reduction
from ._surrogate import policy_terms
from ._triton._dispatch import kernel_backend
from ._validation import ArrayLike, Scalar, checks_environment, validate_bool

__all__ = [
    "entropy_term",
    "fused_applicable",
    "packed_output_shape",
    "policy_loss",
    "run_autograd",
    "run_fused",
    "run_policy",
    "validate_policy_call",
]

_NAMES = ("log_probs", "old_log_probs", "advantages", "mask")


@checks_environment
def policy_loss(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: Surrogate = "clip",
    clip_low: Scalar | None = 0.2,
    clip_high: Scalar | None = None,
    dual_clip: Scalar | None = None,
    delta: Scalar | None = None,
    cispo_cap: Scalar | None = None,
    sapo_temperature_pos: Scalar = 1.0,
    sapo_temperature_neg: Scalar = 1.05,
    vespo_k_pos: Scalar = 2.0,
    vespo_lambda_pos: Scalar = 3.0,
    vespo_k_neg: Scalar = 3.0,
    vespo_lambda_neg: Scalar = 2.0,
    ratio_level: RatioLevel = "token",
    log_ratio_bound: Scalar | None = 20.0,
    importance_weights: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    entropy_coef: Scalar = 0.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    diagnostics_normalizer: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    return_per_token: bool = False,
) -> PolicyLossOutput:
    r"""Policy-gradient loss: PPO/GRPO/DAPO/GSPO clip, CISPO, SAPO, GMPO, VESPO, entropy bonus.

    With :math:`\Delta_{it} = \ell_{it} - \ell^{old}_{it}` (selected tokens only) and the ratio
    :math:`r_{it} = \exp(\mathrm{clip}(\Delta_{it}, -b, b))`, the per-token surrogate
    :math:`s_{it}` of ``surrogate``:

    - ``"clip"`` (default): :math:`s = \min\big(\min(r, \delta) A,\
      \mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high}) A\big)`, then
      :math:`\max(s, cA)` where :math:`A < 0` with ``dual_clip=c``;
    - ``"cispo"``: :math:`s = \mathrm{sg}(w) A \ell` with :math:`w = \min(r,` ``cispo_cap``
      :math:`)` or, without ``cispo_cap``, :math:`w = \mathrm{clip}(r, 1-\epsilon_{low},
      1+\epsilon_{high})`;
    - ``"sapo"``: :math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A` with
      :math:`\tau =` ``sapo_temperature_pos`` for :math:`A > 0`, ``sapo_temperature_neg``
      otherwise;
    - ``"gmpo"``: :math:`s = \bar A_i \rho_i`, :math:`\rho_i = \exp\big(\frac{1}{n_i}\sum_t
      \mathrm{sgn}(A)\min(\mathrm{sgn}(A)\log r, \mathrm{sgn}(A)\,\mathrm{clip}(\log r,
      -\epsilon_{low}, \epsilon_{high}))\big)`, :math:`\bar A_i` the sequence's mean advantage
      (GSPO's token form: value :math:`\rho_i` at each token, derivative through the token);
    - ``"vespo"``: :math:`s = \mathrm{sg}(\phi_i) A \ell`, :math:`\phi(W) = e^{\lambda + k\log W -
      \lambda W}` of the sequence ratio :math:`W_i = \exp(\mathrm{clip}(\sum_t \log r_{it}
      + \sum_t \log w_{it}, \log 10^{-8}, 20))`, :math:`(k, \lambda)` by the sign of :math:`A`
      (:math:`A \ge 0`: ``vespo_k_pos``, ``vespo_lambda_pos``); a weight given per sequence,
      ``(B,)`` or packed ``(S,)``, enters once: :math:`\log w_i` instead of the sum.

    The per-token loss is :math:`L_{it} = -w_{it} s_{it} - \beta H_{it}` with the importance
    weights :math:`w` (``importance_weights``; VESPO takes them inside :math:`W` instead) and
    the entropy bonus :math:`\beta` = ``entropy_coef``, reduced by ``reduction`` (see
    :func:`rlobjectives.aggregate`): the bonus is :math:`-\beta\,\mathrm{reduce}(H)` with the
    surrogate's reduction and normaliser (verl ``entropy_coeff``).

    Packed sequences (``cu_seqlens`` given, the padding-free layout of flash-attention): the
    per-token tensors are ``(N,)`` or ``(1, N)``, sequence :math:`i` is the run of tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``, advantages (and importance weights) are ``(S,)`` per
    sequence (broadcast to their tokens by the library) or per token; every reduction and every
    per-sequence quantity (GSPO/GMPO/VESPO) work per sequence, and the result equals the call
    on the padded layout of the same sequences (:func:`rlobjectives.unpack`). See
    ``docs/conventions.md``.

    Options of ``"clip"``:

    - ``clip_high`` != ``clip_low``: asymmetric "clip-higher" band (DAPO, arXiv:2503.14476 Eq. 10).
    - ``clip_low=None``: no clipping, :math:`s = r A` (vanilla importance-weighted policy
      gradient; with ``old_log_probs = log_probs.detach()`` it is REINFORCE).
    - ``dual_clip=c`` (``c > 1``): for :math:`A < 0`, :math:`s = \max(s, c A)` (Ye et al. 2020,
      arXiv:1912.09729 Eq. 5); tokens with :math:`A \ge 0` are unchanged.
    - ``delta=δ`` (``δ > 1``): TRL's two-sided clip, the ratio of the unclipped branch capped at
      :math:`\delta` for both signs of :math:`A` (for :math:`\delta > 1 + \epsilon_{high}` it acts
      on :math:`A < 0` only, as ``dual_clip=δ``; below, it also lowers :math:`A > 0` tokens).
    - ``ratio_level="sequence"``: GSPO (arXiv:2507.18071 Eq. 7): the ratio of sequence :math:`i`
      is :math:`s_i = \exp(\frac{1}{|y_i|}\sum_t \Delta_{it})` over its selected tokens, used at
      every token in the stop-gradient form :math:`\log s_{it} = \ell_{it} - sg(\ell_{it}) +
      sg(\log s_i)`, whose gradient equals the paper's (GSPO-token, Eq. 13-14). Also for
      ``"cispo"`` and ``"sapo"`` (TRL's ``importance_sampling_level="sequence"``);
      ``"gmpo"`` and ``"vespo"`` form their own sequence ratio and take ``"token"`` only.

    ``"sapo"`` and ``"vespo"`` do not use ``clip_low``/``clip_high``; ``"cispo"`` with
    ``cispo_cap`` neither. ``old_log_probs``, ``advantages`` and ``importance_weights`` are
    constants: no gradient flows into them. The token-local surrogates (``"clip"``, ``"cispo"``,
    ``"sapo"``) run through a fused ``torch.autograd.Function`` (``rlobjectives._fused``): one
    forward pass computes the loss, the diagnostics and the gradient coefficient, and backward
    keeps one float ``(B, T)`` tensor plus the mask. It supports first-order gradients only; a
    hyperparameter given as a tensor that requires grad, and ``"gmpo"``/``"vespo"``, use the
    plain-autograd specification (``rlobjectives._surrogate``) instead.

    Args:
        log_probs: current-policy log-probabilities of the sampled tokens, ``(B, T)``.
        old_log_probs: behaviour-policy log-probabilities, ``(B, T)``.
        advantages: ``(B,)``, ``(B, 1)`` (per sequence) or ``(B, T)`` (per token).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        surrogate: ``"clip"``, ``"cispo"``, ``"sapo"``, ``"gmpo"`` or ``"vespo"`` (see above).
        clip_low: :math:`0 \le \epsilon_{low} < 1`, or None for no clipping.
        clip_high: :math:`\epsilon_{high} \ge 0`; None means ``clip_low``.
        dual_clip: :math:`c > 1`, or None (``"clip"`` only).
        delta: :math:`\delta > 1`, TRL's two-sided clip, or None (``"clip"`` only).
        cispo_cap: TRL's absolute cap of the CISPO weight (its ``epsilon_high``, e.g. 5.0),
            ``> 0``; None uses the band ``[1 - clip_low, 1 + clip_high]`` (verl) (``"cispo"``
            only).
        sapo_temperature_pos: :math:`\tau_+ > 0` for :math:`A > 0` (``"sapo"``).
        sapo_temperature_neg: :math:`\tau_- > 0` for :math:`A \le 0` (``"sapo"``).
        vespo_k_pos: :math:`k \ge 0` for :math:`A \ge 0` (``"vespo"``).
        vespo_lambda_pos: :math:`\lambda > 0` for :math:`A \ge 0` (``"vespo"``).
        vespo_k_neg: :math:`k \ge 0` for :math:`A < 0` (``"vespo"``).
        vespo_lambda_neg: :math:`\lambda > 0` for :math:`A < 0` (``"vespo"``).
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
        log_ratio_bound: :math:`b > 0` bound on the log-ratio before ``exp`` (the gradient through
            the ratio is zero where it fires), or None.
        importance_weights: ``(B,)``, ``(B, 1)`` or ``(B, T)`` constant weights (e.g. from
            :func:`rlobjectives.rollout_correction`), multiplying the per-token surrogate loss
            after the mask and before the reduction (TRL's ``importance_sampling_ratio``);
            NaN/inf at unselected tokens is ignored. None: no weights.
        entropy: ``(B, T)`` per-token entropies for the bonus (differentiable), or None.
        entropy_coef: :math:`\beta`, the bonus :math:`-\beta\,\mathrm{reduce}(H)`; nonzero needs
            ``entropy``.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``,
            ``"length_weighted"`` or ``"none"``.
        normalizer: explicit denominator for micro-batch/rank-additive losses (global selected
            token count for ``token_mean``, global count of non-empty sequences for
            ``sequence_mean``, global sequence count for ``sequence_sum_normalized`` and
            ``length_weighted``).
        max_response_length: Dr. GRPO constant for ``sequence_sum_normalized``, a positive
            integer (default ``T``).
        diagnostics_normalizer: global selected-token count used as the denominator of the
            token diagnostics (default: the local count); used exactly as given.
        cu_seqlens: ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last), or None for the padded layout. With it, ``log_probs``,
            ``old_log_probs``, ``mask`` and ``entropy`` are ``(N,)`` or ``(1, N)``,
            ``advantages`` and ``importance_weights`` ``(S,)``, ``(S, 1)``, ``(N,)`` or
            ``(1, N)`` (a 1-D tensor of length ``S`` is per sequence), and the default
            ``max_response_length`` is the longest sequence. Its values are checked with one
            host read (skipped under ``torch.compile``).
        return_per_token: also return the ``(B, T)`` per-token loss (packed: the shape of
            ``log_probs``).

    Returns:
        :class:`PolicyLossOutput` ``(loss, per_token_loss, diagnostics)``. ``loss`` and
        ``per_token_loss`` have the dtype and device of ``log_probs`` (integer input becomes the
        default float dtype); the math runs in float32 (float64 when any floating input,
        ``importance_weights`` and ``entropy`` included, is float64).

    Raises:
        ValueError: on mismatched shapes, wrong ranks, different devices, negative or non-finite
            clip parameters, ``clip_low >= 1``, ``dual_clip <= 1``, ``delta <= 1``,
            ``clip_high`` without ``clip_low``, an option given to a surrogate that does not use
            it (``dual_clip``/``delta`` without ``"clip"``, ``cispo_cap`` without ``"cispo"``),
            ``ratio_level="sequence"`` with ``"gmpo"``/``"vespo"``, non-positive temperatures,
            cap or gamma rate, a negative gamma shape, ``entropy_coef != 0`` without
            ``entropy``, a non-positive normaliser, a fractional ``max_response_length``, an
            unknown ``surrogate``, ``reduction`` or ``ratio_level``, or a malformed
            ``cu_seqlens`` (not an integer 1-D tensor, not starting at 0, not ending at ``N``,
            decreasing).
        TypeError: on non-numeric inputs.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 7; Shao et al. 2024, GRPO,
        arXiv:2402.03300 Eq. 3; Yu et al. 2025, DAPO, arXiv:2503.14476 Eq. 8-10;
        Zheng et al. 2025, GSPO, arXiv:2507.18071; Ye et al. 2020, dual-clip, arXiv:1912.09729;
        MiniMax-M1, CISPO, arXiv:2506.13585 Sec. 3.1; SAPO, arXiv:2511.20347 (the gated
        objective; verl ``sapo``, TRL ``loss_type="sapo"``); GMPO, arXiv:2507.20673 (the
        geometric-mean objective; verl ``geo_mean``); VESPO, arXiv:2602.10693 (TRL
        ``get_gamma_weights``); PPO arXiv:1707.06347 Eq. 9 (entropy bonus).

    Examples:
        >>> import torch
        >>> out = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
        ...                   torch.ones(1, 2, dtype=torch.bool))
        >>> out.loss
        tensor(-1.)

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``surrogate``, ``delta``, ``cispo_cap``, the SAPO and VESPO options,
       ``importance_weights``, ``entropy``/``entropy_coef``, ``reduction="length_weighted"``
       and the ``weight_mean`` diagnostic.
    """
    options = validate_surrogate_options(
        surrogate=surrogate,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        delta=delta,
        cispo_cap=cispo_cap,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
    )
    call = validate_policy_call(
        (log_probs, old_log_probs, advantages, mask),
        _NAMES,
        options=options,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
        importance_weights=importance_weights,
        entropy=entropy,
        entropy_coef=entropy_coef,
        cu_seqlens=cu_seqlens,
    )
    validate_bool(return_per_token, "return_per_token")
    output = run_policy(call, return_per_token=return_per_token)
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
    options: SurrogateOptions,
    reduction: object,
    normalizer: Scalar | None,
    max_response_length: Scalar | None,
    diagnostics_normalizer: Scalar | None,
    importance_weights: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    entropy_coef: Scalar = 0.0,
    cu_seqlens: ArrayLike | None = None,
) -> PolicyCall:
    """Validate every tensor argument of a policy-loss call once (named as in ``names``).

    ``cu_seqlens`` selects the packed layout (see :func:`prepare_layout_inputs`).
    """
    inputs, layout = prepare_layout_inputs(*tensors, names, cu_seqlens=cu_seqlens)
    inputs = prepare_importance_weights(inputs, importance_weights, names[0], layout)
    inputs = prepare_entropy(inputs, entropy, names[0], cu_seqlens is not None)
    coef = validate_entropy_coef(entropy_coef, has_entropy=inputs.entropy is not None)
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=layout,
        tokens=inputs.log_probs.shape[-1],
    )
    diagnostics = validate_diagnostics_normalizer(diagnostics_normalizer)
    return PolicyCall(inputs, options, spec, diagnostics, layout, coef)


def run_policy(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """The dispatch step: the Triton kernels, the fused Function or the autograd path.

    The kernels (:mod:`rlobjectives._triton._policy_call`) run when
    :func:`~rlobjectives._triton._dispatch.kernel_backend` selects them (CUDA tensors with triton
    installed, or ``RLOBJECTIVES_KERNELS=triton``; never float64 nor under ``torch.compile``)
    for a call the fused path takes whose hyperparameters are numbers (or tensors without
    grad); every other call takes the PyTorch paths, silently (docs/kernels.md).
    """
    if not fused_applicable(call):
        return run_autograd(call, return_per_token=return_per_token)
    inputs = call.inputs
    if kernel_backend(inputs.log_probs.device, dtype=inputs.dtype) == "triton":
        from ._triton._policy_call import kernel_options, run_kernels

        options = kernel_options(call.options, call.entropy_coef)
        if options is not None:
            return run_kernels(call, options, return_per_token=return_per_token)
    return run_fused(call, return_per_token=return_per_token)


def fused_applicable(call: PolicyCall) -> bool:
    """Whether the fused Function applies: a token-local surrogate, no hyperparameter with grad.

    ``old_log_probs`` and ``advantages`` are constants on every path; a tensor hyperparameter
    that requires grad (a learnable clip range, say) is differentiated by the autograd path, and
    so are the sequence-level surrogates (``"gmpo"``, ``"vespo"``).
    """
    scalars = [*call.options, call.reduction.normalizer, call.reduction.constant]
    learnable = any(isinstance(t, torch.Tensor) and t.requires_grad for t in scalars)
    return has_fused_stage(call.options) and not learnable


def entropy_term(call: PolicyCall) -> torch.Tensor | None:
    """The bonus's per-token loss ``-entropy_coef * H`` ``(B, T)`` (0 at unselected), or None."""
    entropy, coef = call.inputs.entropy, call.entropy_coef
    if entropy is None or (not isinstance(coef, torch.Tensor) and coef == 0.0):
        return None
    selected = masked_fill_zero(entropy.to(call.inputs.dtype), call.inputs.mask)  # (B, T)
    return -coef * selected


def _finish(
    call: PolicyCall,
    loss: torch.Tensor,
    per_token: torch.Tensor | None,
    diagnostics: PolicyLossDiagnostics,
) -> PolicyLossOutput:
    """Add the entropy bonus; the per-token loss (if kept) and the loss in the output dtype."""
    bonus = entropy_term(call)
    if per_token is not None:  # the loss is the reduction of the per-token loss
        if bonus is not None:
            per_token = per_token + bonus
        none = call.reduction.reduction == "none"  # per_token is zero at unselected tokens
        loss = (
            per_token if none else reduce(per_token, call.inputs.mask, call.reduction, call.layout)
        )
    elif bonus is not None:
        loss = loss + reduce(bonus, call.inputs.mask, call.reduction, call.layout)
    output_dtype = call.inputs.output_dtype
    per_token = None if per_token is None else per_token.to(output_dtype)
    return PolicyLossOutput(loss.to(output_dtype), per_token, diagnostics)


def run_fused(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """:func:`policy_loss` through :class:`~rlobjectives._fused.ClippedSurrogateFunction`."""
    inputs = call.inputs
    reduction = call.reduction
    per_token_wanted = return_per_token or reduction.reduction == "none"
    if per_token_wanted:  # the per-token loss is the "none" reduction; reduce it afterwards
        reduction = reduction._replace(reduction="none")
    spec = FusedSpec(
        call.options, reduction, call.diagnostics_normalizer, inputs.dtype, call.layout, False
    )
    loss, _, diagnostics = ClippedSurrogateFunction.apply(  # type: ignore[no-untyped-call]
        inputs.log_probs,
        inputs.old_log_probs,
        inputs.advantages,
        inputs.mask,
        spec,
        inputs.importance_weights,
    )
    per_token = loss if per_token_wanted else None  # (B, T), zeros at unselected tokens
    named = PolicyLossDiagnostics(*diagnostics.unbind())
    output = _finish(call, loss, per_token, named)
    return output if return_per_token else output._replace(per_token_loss=None)


def run_autograd(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """:func:`policy_loss` through the autograd specification (:mod:`rlobjectives._surrogate`)."""
    inputs = call.inputs
    terms = policy_terms(inputs, call.options, call.diagnostics_normalizer, call.layout)
    output = _finish(call, terms.per_token_loss, terms.per_token_loss, terms.diagnostics)
    return output if return_per_token else output._replace(per_token_loss=None)


def _policy_loss_autograd(*args: ArrayLike, **kwargs: Any) -> PolicyLossOutput:
    """:func:`policy_loss` through the autograd path (the fused path's test reference)."""
    bound = inspect.signature(policy_loss).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    tensors = tuple(arguments.pop(name) for name in _NAMES)
    return_per_token = arguments.pop("return_per_token")
    call_names = (
        "reduction",
        "normalizer",
        "max_response_length",
        "diagnostics_normalizer",
        "importance_weights",
        "entropy",
        "entropy_coef",
        "cu_seqlens",
    )
    call_arguments = {name: arguments.pop(name) for name in call_names}
    options = validate_surrogate_options(**arguments)
    call = validate_policy_call(tensors, _NAMES, options=options, **call_arguments)  # type: ignore[arg-type]
    output = run_autograd(call, return_per_token=return_per_token)
    flat = call_arguments["cu_seqlens"] is not None and token_ndim(tensors[0]) == 1
    return packed_output_shape(output, flat=flat)
