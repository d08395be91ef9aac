"""The general policy loss :func:`policy_loss`: validate once, then dispatch to a path.

Two paths compute the same values and gradients: the fused autograd Function of
:mod:`rlobjectives.policy.fused` (the default, for the token-local surrogates ``"clip"``,
``"cispo"`` and ``"sapo"``) and the readable autograd specification of
:mod:`rlobjectives.policy.specification` (used for the sequence-level surrogates ``"gmpo"`` and
``"vespo"``, when a hyperparameter tensor requires grad, and by the tests as the fused path's
reference). Both reduce through :mod:`rlobjectives._core.reduction`; the entropy bonus is added
by autograd on both.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed import ProcessGroup

from .._core.layout import token_ndim, token_output
from .._core.reduction import Reduction, reduce
from .._core.validation import ArrayLike, Scalar, checks_environment, validate_bool
from .fused import _finish, entropy_term, run_fused
from .inputs import (
    PolicyCall,
    PolicyLossOutput,
    RatioLevel,
    Surrogate,
    validate_policy_call,
    validate_surrogate_options,
)
from .specification import policy_terms

__all__ = [
    "fused_applicable",
    "packed_output_shape",
    "policy_loss",
    "run_autograd",
    "run_policy",
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
    context_group: ProcessGroup | None = None,
) -> PolicyLossOutput:
    r"""Policy-gradient loss: PPO/GRPO/DAPO/GSPO clip, CISPO, SAPO, GMPO, VESPO, entropy bonus.

    With :math:`\Delta_{it} = \ell_{it} - \ell^{old}_{it}` (selected tokens only) and the ratio
    :math:`r_{it} = \exp(\mathrm{clip}(\Delta_{it}, -b, b))`, the per-token surrogate
    :math:`s_{it}` is the formula of the ``surrogate`` object (each object's docstring states
    its formula and its peers' options):

    - :class:`~rlobjectives.Clip` (default, ``"clip"``): :math:`s = \min\big(\min(r, \delta) A,\
      \mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high}) A\big)`, then
      :math:`\max(s, cA)` where :math:`A < 0` (``Clip(low, high, dual, delta)``);
    - :class:`~rlobjectives.CISPO`: :math:`s = \mathrm{sg}(w) A \ell` with
      :math:`w = \min(r, \text{cap})` or :math:`w = \mathrm{clip}(r, 1-\epsilon_{low},
      1+\epsilon_{high})`;
    - :class:`~rlobjectives.SAPO`: :math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau`
      by the sign of :math:`A`;
    - :class:`~rlobjectives.GMPO`: :math:`s = \bar A_i \rho_i`, the geometric mean of the
      sequence's ratios clipped in log space (GSPO's token form);
    - :class:`~rlobjectives.VESPO`: :math:`s = \mathrm{sg}(\phi_i) A \ell`, the gamma weight of the
      sequence ratio, which takes in the importance weights (a weight given per sequence,
      ``(B,)`` or packed ``(S,)``, enters once);
    - :class:`~rlobjectives.DPPO`: :math:`s = \mathrm{sg}(\min(r, c)) A \ell` inside a binary-TV
      or binary-KL trust region on :math:`p = e^{\ell}` and :math:`p^{old}`, 0 outside;
    - :class:`~rlobjectives.DRO`: :math:`s = \ell A - \frac{1}{2}\beta(\ell - \ell^{old})^2`;
    - :class:`~rlobjectives.M2PO`: :math:`s = rA` (or the clip) on the tokens its second-moment
      mask keeps, reduced over them;
    - :class:`~rlobjectives.ClipCov`, :class:`~rlobjectives.KLCov`: the clip with a random few
      high-covariance tokens detached; :math:`rA` with the top-k covariance tokens penalised.

    The per-token loss is :math:`L_{it} = -w_{it} s_{it} - \beta H_{it}` with the importance
    weights :math:`w` (``importance_weights``; VESPO takes them inside its sequence ratio
    instead) and the entropy bonus :math:`\beta` = ``entropy_coef``, reduced by ``reduction``
    (see :func:`rlobjectives.aggregate`): the bonus is :math:`-\beta\,\mathrm{reduce}(H)` with
    the surrogate's reduction and normaliser (verl ``entropy_coeff``).

    ``ratio_level="sequence"``: GSPO (arXiv:2507.18071 Eq. 7) for any token-local surrogate
    (``Clip``, ``CISPO``, ``SAPO``; TRL's ``importance_sampling_level="sequence"``): the ratio
    of sequence :math:`i` is :math:`s_i = \exp(\frac{1}{|y_i|}\sum_t \Delta_{it})` over its
    selected tokens, used at every token in the stop-gradient form :math:`\log s_{it} =
    \ell_{it} - sg(\ell_{it}) + sg(\log s_i)`, whose gradient equals the paper's (GSPO-token,
    Eq. 13-14). ``GMPO`` and ``VESPO`` form their own sequence ratio and take ``"token"`` only.

    Packed sequences (``cu_seqlens`` given, the padding-free layout of flash-attention): the
    per-token tensors are ``(N,)`` or ``(1, N)``, sequence :math:`i` is the run of tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``, advantages (and importance weights) are ``(S,)`` per
    sequence (broadcast to their tokens by the library) or per token; every reduction and every
    per-sequence quantity (GSPO/GMPO/VESPO) work per sequence, and the result equals the call
    on the padded layout of the same sequences (:func:`rlobjectives.unpack`). See
    ``docs/conventions.md``.

    Context parallelism (``context_group`` given; ``docs/distributed/context-parallel.md``):
    each rank holds some tokens of every sequence; the per-sequence sums (counts, row sums,
    GSPO/GMPO/VESPO sequence log-ratios) and the totals are summed over the group with one
    all-reduce of ``(S,)`` values per quantity (batched where the path allows: two on the
    fused path with GSPO, one without), so every rank returns the loss and the diagnostics of
    the unsplit call, and ``backward`` gives each rank the gradient of that loss with respect to
    its own tokens (the all-reduces' backward is the identity; sum the parameter gradients over
    the group, as Megatron CP's gradient all-reduce does). Megatron ``context_parallel_size``,
    verl ``ulysses_sequence_parallel_size``, slime ``context_parallel_size``: pass their CP /
    SP group.

    ``old_log_probs``, ``advantages`` and ``importance_weights`` are constants: no gradient
    flows into them. The token-local surrogates (``Clip``, ``CISPO``, ``SAPO``, ``DPPO``,
    ``DRO``) run through a fused ``torch.autograd.Function``
    (:mod:`rlobjectives.policy.fused`, with the object's fused stage): one forward pass computes
    the loss, the diagnostics and the gradient coefficient, and backward keeps one float
    ``(B, T)`` tensor plus the mask. It supports first-order gradients only; a surrogate field
    given as a tensor that requires grad, ``GMPO``/``VESPO`` (sequence-level) and ``M2PO``,
    ``ClipCov``, ``KLCov`` (batch-level selections: per call) use the plain-autograd
    specification (:mod:`rlobjectives.policy.specification`) instead.

    Decisions at a bound (which tokens a clip changes, hence which carry a gradient, and the
    clip diagnostics) are taken as a correctly rounded ``exp`` in the computation dtype would
    take them against the bound rounded to that dtype, on the log-ratio against thresholds
    computed once per call: the same tokens on every path and backend (the Triton kernels
    included), a ratio equal to a bound after rounding on the band (``docs/conventions.md``,
    "Decisions at a bound").

    Args:
        log_probs: current-policy log-probabilities of the sampled tokens, ``(B, T)``.
        old_log_probs: behaviour-policy log-probabilities, ``(B, T)``.
        advantages: ``(B,)``, ``(B, 1)`` (per sequence) or ``(B, T)`` (per token).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        surrogate: a surrogate object (:class:`~rlobjectives.Clip`,
            :class:`~rlobjectives.CISPO`, :class:`~rlobjectives.SAPO`,
            :class:`~rlobjectives.GMPO`, :class:`~rlobjectives.VESPO`,
            :class:`~rlobjectives.DPPO`, :class:`~rlobjectives.DRO`, :class:`~rlobjectives.M2PO`,
            :class:`~rlobjectives.ClipCov`, :class:`~rlobjectives.KLCov`) holding its options, or
            its name (``"clip"``, ``"cispo"``, ``"sapo"``, ``"gmpo"``, ``"vespo"``, ``"dppo"``,
            ``"m2po"``, ``"clip_cov"``, ``"kl_cov"``: the object with its defaults).
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO; ``Clip``, ``CISPO``, ``SAPO`` only).
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
        context_group: the ``torch.distributed`` process group of the ranks that hold the
            other tokens of the same sequences (context parallelism), or None. Every rank of the
            group calls with the same ``S`` sequences in the same order (padded ``(B, T_r)``
            with its local mask, or packed with local ``cu_seqlens`` listing every sequence,
            possibly with zero local tokens) and gets the loss and the diagnostics of the whole
            sequences; the gradient flows into its local tokens only (see above).

    Returns:
        :class:`PolicyLossOutput` ``(loss, per_token_loss, diagnostics)``. ``loss`` and
        ``per_token_loss`` have the dtype and device of ``log_probs`` (integer input becomes the
        default float dtype); the math runs in float32 (float64 when any floating input,
        ``importance_weights`` and ``entropy`` included, is float64).

    Raises:
        ValueError: on mismatched shapes, wrong ranks, different devices,
            ``ratio_level="sequence"`` with a surrogate other than ``Clip``, ``CISPO``,
            ``SAPO``, ``surrogate="dro"`` (DRO has no default ``beta``), a non-positive
            ``log_ratio_bound``, ``entropy_coef != 0`` without ``entropy``, a non-positive
            normaliser, a fractional ``max_response_length``, an unknown ``surrogate`` name,
            ``reduction`` or ``ratio_level``, or a malformed ``cu_seqlens`` (not an integer 1-D
            tensor, not starting at 0, not ending at ``N``, decreasing). A surrogate object
            validates its own fields when it is built.
        TypeError: on non-numeric inputs, or a ``surrogate`` that is neither a name nor a
            surrogate object.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 7 and Eq. 9 (entropy bonus); Shao et
        al. 2024, GRPO, arXiv:2402.03300 Eq. 3; Zheng et al. 2025, GSPO, arXiv:2507.18071; the
        surrogate objects' docstrings for their own papers.

    Examples:
        >>> import torch
        >>> from rlobjectives import Clip
        >>> out = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
        ...                   torch.ones(1, 2, dtype=torch.bool), surrogate=Clip(low=0.2))
        >>> out.loss
        tensor(-1.)

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``surrogate``, ``importance_weights``, ``entropy``/``entropy_coef``,
       ``reduction="length_weighted"`` and the ``weight_mean`` diagnostic.
    .. versionchanged:: 0.3.0
       ``surrogate`` takes the surrogate objects; their options (``clip_low``, ``clip_high``,
       ``dual_clip``, ``delta``, ``cispo_cap``, ``sapo_temperature_*``, ``vespo_*``) left the
       signature: ``clip_low=a, clip_high=b`` is ``surrogate=Clip(low=a, high=b)``.
    """
    options = validate_surrogate_options(
        surrogate=surrogate, ratio_level=ratio_level, log_ratio_bound=log_ratio_bound
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
        context_group=context_group,
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


def run_policy(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """The dispatch step: the Triton kernels, the fused Function or the autograd path.

    The kernels (:mod:`rlobjectives.kernels.calls.policy`) run when
    :func:`~rlobjectives._core.backend.kernel_backend` selects them (CUDA tensors with triton
    installed, or ``RLOBJECTIVES_KERNELS=triton``; never float64 nor under ``torch.compile``)
    for a call the fused path takes whose hyperparameters are numbers (or tensors without
    grad); every other call takes the PyTorch paths, silently (docs/kernels.md).
    """
    if not fused_applicable(call):
        return run_autograd(call, return_per_token=return_per_token)
    return run_fused(call, return_per_token=return_per_token)


def fused_applicable(call: PolicyCall) -> bool:
    """Whether the fused Function applies: a token-local surrogate, no hyperparameter with grad.

    ``old_log_probs`` and ``advantages`` are constants on every path; a tensor hyperparameter
    that requires grad (a learnable clip range, say) is differentiated by the autograd path, and
    so are the sequence-level surrogates (``GMPO``, ``VESPO``).
    """
    options, reduction = call.options, call.reduction
    scalars = [*vars(options.surrogate).values(), options.log_ratio_bound]
    scalars += [reduction.normalizer, reduction.constant]
    learnable = any(isinstance(t, torch.Tensor) and t.requires_grad for t in scalars)
    return options.surrogate.token_local and not learnable


def run_autograd(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """:func:`policy_loss` through the autograd specification (:mod:`.specification`)."""
    inputs = call.inputs
    terms = policy_terms(inputs, call.options, call.diagnostics_normalizer, call.layout)
    per_token = terms.per_token_loss
    if terms.loss_mask is None:
        output = _finish(call, per_token, per_token, terms.diagnostics)
        return output if return_per_token else output._replace(per_token_loss=None)
    # M2PO: the surrogate is reduced over its kept tokens, the entropy bonus over the call's.
    surrogate = reduce(per_token, terms.loss_mask, call.reduction, call.layout)
    output = _finish(call, surrogate, None, terms.diagnostics)
    if not return_per_token:
        return output
    bonus = entropy_term(call)
    per_token = per_token if bonus is None else per_token + bonus
    return output._replace(per_token_loss=per_token.to(inputs.output_dtype))


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
        "context_group",
    )
    call_arguments = {name: arguments.pop(name) for name in call_names}
    options = validate_surrogate_options(**arguments)
    call = validate_policy_call(tensors, _NAMES, options=options, **call_arguments)  # type: ignore[arg-type]
    output = run_autograd(call, return_per_token=return_per_token)
    flat = call_arguments["cu_seqlens"] is not None and token_ndim(tensors[0]) == 1
    return packed_output_shape(output, flat=flat)
