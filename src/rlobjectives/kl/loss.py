r"""The public KL functions: the per-token estimate and the KL loss term.

The estimator math (one table of values and derivatives), the validation of the options and
the biased-gradient warnings are in :mod:`rlobjectives.kl.estimators`; this module validates the
public arguments once and computes in PyTorch.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from .._core.layout import token_output, tokens_from_sequences
from .._core.reduction import Reduction, masked_fill_zero, reduce, validate_layout_reduction
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    check_same_device,
    checks_environment,
    compute_dtype,
    expand_per_sequence,
)
from .estimators import (
    Estimator,
    KLInputs,
    validate_kl_options,
    warn_biased,
    warn_biased_kl_loss,
)

__all__ = ["kl_estimate", "kl_loss"]


@checks_environment
def kl_estimate(
    log_probs: ArrayLike,
    ref_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    estimator: Estimator = "k3",
    straight_through: bool = False,
    log_ratio_bound: Scalar | None = 20.0,
) -> torch.Tensor:
    r"""Per-token sampled estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})`.

    With :math:`d_{it} = \mathrm{clip}(\ell_{it} - \ell^{ref}_{it}, -b, b)` on selected tokens,

    .. math::

        k_1 = d, \qquad k_2 = \tfrac12 d^2, \qquad k_3 = e^{-d} + d - 1,
        \qquad k_{abs} = |d| .

    ``"abs"`` is verl's ``kl_penalty="abs"`` (a distance, not an unbiased KL estimate).
    ``straight_through=True`` returns the value of the chosen estimator with the gradient of
    :math:`k_2`, i.e. :math:`\mathrm{sg}(k) + k_2 - \mathrm{sg}(k_2)` (verl's ``k3+`` /
    ``low_var_kl+``), whose expected gradient on on-policy samples,
    :math:`E_\pi[d\,\nabla\log\pi]`, is exactly :math:`\nabla\mathrm{KL}(\pi\|\pi_{ref})`.
    :math:`k_2, k_3 \ge 0`, with equality where the policies agree (:math:`d = 0`). See the module
    docstring for which estimator is unbiased in which placement.

    Args:
        log_probs: ``(B, T)`` log-probabilities of the sampled tokens under :math:`\pi`
            (differentiable).
        ref_log_probs: ``(B, T)`` log-probabilities under the reference policy.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of ``k2``.
        log_ratio_bound: :math:`b > 0`, clamp on :math:`d` before ``exp`` (the gradient is zero
            where it fires), or None for no clamp.

    Returns:
        ``(B, T)`` estimates, exact zeros at unselected tokens (NaN/inf there never reaches the
        value or the gradient), with the dtype and device of ``log_probs``; computed in float32
        (float64 if an input is float64) even for bf16/fp16 inputs.

    Raises:
        ValueError: on mismatched shapes/devices, inputs that are not ``(B, T)``, an unknown
            ``estimator`` or a non-positive/non-finite ``log_ratio_bound``.
        TypeError: on non-numeric inputs or a non-bool ``straight_through``.

    References:
        Schulman 2020, "Approximating KL divergence" (k1, k2, k3); Shao et al. 2024, GRPO,
        arXiv:2402.03300 Eq. 4 (k3); verl PR #2953 (straight-through ``k3+``).

    Examples:
        >>> import torch
        >>> kl_estimate(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1, 1]]))
        tensor([[0.0000, 0.3679]])

    .. versionadded:: 0.1.0
    """
    inputs = KLInputs(log_probs, ref_log_probs, mask)
    bound = validate_kl_options(estimator, straight_through, log_ratio_bound)
    terms = inputs.terms(
        estimator=estimator, straight_through=straight_through, log_ratio_bound=bound
    )  # (B, T)
    return terms.to(inputs.log_probs.dtype)


@checks_environment
def kl_loss(
    log_probs: ArrayLike,
    ref_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    estimator: Estimator = "k3",
    straight_through: bool = False,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    log_ratio_bound: Scalar | None = 20.0,
    importance_weights: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> torch.Tensor:
    r"""KL(pi || ref) as a loss term: :func:`kl_estimate` reduced with ``reduction``.

    .. math::

        L_{KL} = \mathrm{reduce}_M\big(w_{it}\,k_{it}\big),

    where :math:`k_{it}` is :func:`kl_estimate`'s estimate, :math:`w_{it}` the optional
    ``importance_weights`` (used as given, not detached), the reduction one of
    :func:`rlobjectives.aggregate`'s (packed and context-parallel calls too). Add it as
    ``policy_loss(...).loss + kl_coef * kl_loss(...)``. Expected gradient (on-policy): ``"k2"``
    or ``straight_through=True``: :math:`\nabla\mathrm{KL}(\pi\|\pi_{ref})` (verl ``k2`` /
    ``k3+``); ``"k1"``: zero; ``"k3"`` (GRPO, TRL ``beta``, verl ``low_var_kl``):
    :math:`\nabla\mathrm{KL}(\pi_{ref}\|\pi)`. ``importance_weights=exp(log_probs -
    old_log_probs)``: TRL's ``use_bias_correction_kl``. Details: ``docs/objectives/kl.md``.

    Args:
        log_probs: ``(B, T)`` log-probabilities under the current policy (differentiable).
        ref_log_probs: ``(B, T)`` log-probabilities under the reference policy.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of ``k2``.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``, ``"none"``.
        normalizer: explicit positive denominator (number or 0-d tensor), or None.
        max_response_length: Dr. GRPO constant :math:`C` (``"sequence_sum_normalized"``; ``T``).
        log_ratio_bound: clamp :math:`b > 0` on the log-ratio, or None.
        importance_weights: ``(B, T)``, ``(B, 1)`` or ``(B,)`` weights :math:`w` multiplying the
            per-token estimate (see above), or None. NaN/inf at unselected tokens is ignored.
        cu_seqlens: optional ``(S + 1,)`` packed boundaries; see :func:`rlobjectives.policy_loss`.
        context_group: the context-parallel group of the sequences' other tokens, or None.

    Returns:
        A scalar (``(B, T)`` for ``"none"``; packed: the shape of ``log_probs``), dtype and device
        of ``log_probs``; float32 math (float64 if a floating input is). Fully masked: 0.

    Raises:
        ValueError: on mismatched shapes/devices, an unknown ``estimator`` or ``reduction``, a
            non-positive ``normalizer``/``max_response_length``/``log_ratio_bound``, a malformed
            ``cu_seqlens``, or a ``context_group`` without this rank or a process group.
        TypeError: on non-numeric inputs, a non-bool ``straight_through`` or a non-ProcessGroup
            ``context_group``.

    Warns:
        BiasedGradientWarning: for ``"k1"`` or ``"k3"`` without ``straight_through``; with
            differentiable ``importance_weights``, for ``"k2"`` or ``straight_through`` instead.

    References:
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3-4; Schulman 2020, "Approximating KL
        divergence"; verl PR #2953; TRL ``GRPOConfig.use_bias_correction_kl`` (DeepSeek-V3.2,
        arXiv:2512.02556, the unbiased KL estimate).

    Examples:
        >>> import torch
        >>> log_probs, ref, mask = torch.tensor([[0.0, 2.0]]), torch.zeros(1, 2), torch.ones(1, 2)
        >>> kl_loss(log_probs, ref, mask, estimator="k2")
        tensor(1.)
        >>> kl_loss(log_probs, ref, mask, estimator="k2", importance_weights=[[1.0, 0.5]])
        tensor(0.5000)

    .. versionadded:: 0.1.0
    """
    inputs = KLInputs(log_probs, ref_log_probs, mask, cu_seqlens, context_group)
    bound = validate_kl_options(estimator, straight_through, log_ratio_bound)
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=inputs.layout,
        tokens=inputs.log_probs.shape[-1],
    )
    weights = _importance_weights(importance_weights, inputs)
    if weights is not None and weights.requires_grad:
        _warn_biased_ratio_weighted(estimator, straight_through)
    else:
        warn_biased_kl_loss(estimator, straight_through, "kl_loss")
    # Every floating input takes part in the computation dtype, the weights included.
    dtype = compute_dtype(inputs.log_probs, inputs.ref_log_probs, *_present(weights))
    terms = inputs.terms(
        estimator=estimator, straight_through=straight_through, log_ratio_bound=bound, dtype=dtype
    )  # (B, T)
    if weights is not None:
        # Select the weights first: NaN/inf at unselected tokens reaches no value or gradient.
        terms = terms * masked_fill_zero(weights.to(terms.dtype), inputs.mask)  # (B, T)
    loss = reduce(terms, inputs.mask, spec, inputs.layout).to(inputs.log_probs.dtype)
    return token_output(loss, inputs.flat and loss.ndim == 2)


def _present(tensor: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return () if tensor is None else (tensor,)


def _importance_weights(weights: ArrayLike | None, inputs: KLInputs) -> torch.Tensor | None:
    """Validated ``(B, 1)`` or ``(B, T)`` weights of :func:`kl_loss` (None stays None)."""
    if weights is None:
        return None
    device = inputs.log_probs.device
    weights_t = as_float_tensor(weights, "importance_weights", device)
    check_same_device({"log_probs": inputs.log_probs, "importance_weights": weights_t})
    if inputs.layout.sequence_ids is not None:  # packed: (S,) per sequence or per token
        return tokens_from_sequences(weights_t, "importance_weights", inputs.layout, "log_probs")
    shape = (inputs.log_probs.shape[0], inputs.log_probs.shape[1])
    return expand_per_sequence(weights_t, "importance_weights", shape, "log_probs")


def _warn_biased_ratio_weighted(estimator: str, straight_through: bool) -> None:
    """Warn for ratio-weighted KL terms whose expected gradient is not grad KL(pi || ref)."""
    if estimator in ("k1", "k3") and not straight_through:
        return
    warn_biased(
        f'kl_loss(estimator="{estimator}", straight_through={straight_through}) with '
        "differentiable importance_weights (the ratio pi/pi_old, TRL use_bias_correction_kl) has "
        "a biased expected gradient (grad of E[w k] needs an estimator unbiased in value); use "
        'estimator="k3" or "k1" without straight_through, or detach the weights'
    )
