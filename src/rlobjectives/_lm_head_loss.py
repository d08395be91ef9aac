"""The clipped policy loss (+ KL term) straight from hidden states and the LM head.

The loss's derivative with respect to each token's log-probability is known per token once the
reduction's weights are known (from the mask, before the chunk loop), so ``grad_hidden`` and
``grad_weight`` are formed chunk by chunk in the forward pass, with no recompute (Liger-Kernel /
Cut Cross-Entropy's fused linear losses; :class:`rlobjectives._lm_head_chunks.FusedLinearLoss`).
Losses that are not token-local (GSPO, ``reduction="none"``) and calls that need no gradient
compose the chunked log-probabilities with the policy loss instead.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from ._chunking import Block
from ._fused import FusedSpec, fused_forward
from ._kl import ESTIMATORS, Estimator, kl_gradient, kl_terms, warn_biased_kl_loss
from ._layout import padded
from ._lm_head import prepare_head
from ._lm_head_chunks import FusedLinearLoss, Head, LogProbsFromHidden
from ._masking import masked_fill_zero
from ._policy import run_autograd, run_fused, validate_policy_call
from ._policy_args import PolicyCall, PolicyLossDiagnostics, RatioLevel, SurrogateOptions
from ._reduction import Reduction, ReductionSpec, reduce, row_weights, token_gradient_weights
from ._spellings import check_estimator_spelling
from ._validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_bool,
    validate_choice,
    validate_scalar,
)

__all__ = ["FusedPolicyLossOutput", "fused_policy_loss_from_hidden"]


class FusedPolicyLossOutput(NamedTuple):
    """Result of :func:`fused_policy_loss_from_hidden`.

    Attributes:
        loss: scalar total loss ``policy_loss + kl_coef * kl_loss`` (differentiable with respect
            to ``hidden``, ``weight`` and ``bias``); float32 (float64 for float64 ``hidden``),
            computed in float64 if any input is float64.
        policy_loss: detached scalar, the clipped-surrogate part (as :func:`policy_loss`).
        kl_loss: detached scalar, the reduced KL estimate (before ``kl_coef``); 0 without
            ``ref_log_probs``.
        log_probs: detached ``(B, T)`` log-probabilities of the tokens (zeros at unselected
            tokens), the same values :func:`token_log_probs_from_hidden` returns.
        diagnostics: :class:`PolicyLossDiagnostics`, as :func:`policy_loss` reports them.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    log_probs: torch.Tensor
    diagnostics: PolicyLossDiagnostics


def fused_policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    clip_low: Scalar | None = 0.2,
    clip_high: Scalar | None = None,
    dual_clip: Scalar | None = None,
    ratio_level: RatioLevel = "token",
    log_ratio_bound: Scalar | None = 20.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    diagnostics_normalizer: Scalar | None = None,
    ref_log_probs: ArrayLike | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Estimator = "k3",
    kl_straight_through: bool = False,
) -> FusedPolicyLossOutput:
    r"""Clipped policy loss (+ optional KL penalty) computed from hidden states chunk by chunk.

    Equal in value and gradient to composing the unfused functions,

    .. math::

        \ell = \mathrm{log\_softmax}\big((h W^\top + b) / \tau\big)[y], \qquad
        \mathcal{L} = \mathrm{policy\_loss}(\ell, \ell^{old}, A, M)
            + \beta\, \mathrm{aggregate}\big(\mathrm{KL}_k(\ell, \ell^{ref}), M\big),

    with the same ``reduction``/``normalizer`` for both terms and :math:`\beta` = ``kl_coef``.
    The per-token derivative :math:`c_{it} = \partial\mathcal{L}/\partial\ell_{it}` depends only
    on token :math:`(i, t)` and on the batch normaliser, which is computed from the mask before
    the chunk loop, so each chunk forms :math:`\partial\mathcal{L}/\partial z =
    c\,(\mathbb{1}_y - p)/\tau` and its products with ``weight`` and ``hidden`` right away; the
    full logits are never formed and nothing is recomputed in backward.

    ``reduction="none"`` and ``ratio_level="sequence"`` (GSPO, whose per-token derivative needs
    the whole sequence) are supported by composition instead: :func:`token_log_probs_from_hidden`
    (chunked, with recompute) followed by :func:`policy_loss` (for ``"none"`` the returned
    ``loss`` is ``(B, T)``).

    Args:
        hidden: ``(B, T, H)`` hidden states at the response positions.
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` sampled token ids (any id where ``mask`` is False).
        old_log_probs: ``(B, T)`` behaviour log-probabilities (treated as constants).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (treated as constants).
        mask: ``(B, T)`` bool/numeric; nonzero selects the token. Unselected rows of ``hidden``
            and ids of ``tokens`` never reach an output or a gradient (NaN-safe).
        bias: optional ``(V,)`` LM-head bias.
        temperature: :math:`\tau > 0`.
        chunk_size: rows per chunk; None uses :func:`default_chunk_size`.
        clip_low: as :func:`policy_loss`.
        clip_high: as :func:`policy_loss`.
        dual_clip: as :func:`policy_loss`.
        ratio_level: as :func:`policy_loss` (``"sequence"`` runs unfused, see above).
        log_ratio_bound: as :func:`policy_loss`; also bounds the KL estimator's log-ratio.
        reduction: as :func:`policy_loss`.
        normalizer: as :func:`policy_loss` (applies to the KL term too).
        max_response_length: as :func:`policy_loss`.
        diagnostics_normalizer: as :func:`policy_loss`.
        ref_log_probs: optional ``(B, T)`` reference-policy log-probabilities for the KL term.
        kl_coef: :math:`\beta \ge 0`; the KL term is added only with ``ref_log_probs``.
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``, as
            :func:`rlobjectives.kl_estimate`.
        kl_straight_through: value of ``kl_estimator`` with the gradient of ``k2`` (verl
            ``k3+``), as :func:`rlobjectives.kl_estimate`.

    Returns:
        :class:`FusedPolicyLossOutput` ``(loss, policy_loss, kl_loss, log_probs,
        diagnostics)``; gradients flow to ``hidden``, ``weight`` and ``bias`` only. ``loss`` is
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: as :func:`token_log_probs_from_hidden` and :func:`policy_loss`, plus a
            negative ``kl_coef``, an unknown ``kl_estimator``, or ``kl_coef > 0`` without
            ``ref_log_probs``.
        TypeError: on non-numeric inputs.
        RuntimeError: on a second backward through the same result.

    Warns:
        BiasedGradientWarning: with the KL term on, for ``"k1"`` or ``"k3"`` without
            ``kl_straight_through``, as :func:`rlobjectives.kl_loss`.

    References:
        Hsu et al. 2024, Liger-Kernel, arXiv:2410.10989 Sec. 3.3 (gradients in the forward pass);
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3-4 (k3 KL term); Schulman et al. 2017,
        arXiv:1707.06347 Eq. 7.

    Examples:
        >>> import torch
        >>> out = fused_policy_loss_from_hidden(
        ...     torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.tensor([[0, 1]]),
        ...     torch.full((1, 2), -1.3862944), torch.tensor([1.0]), torch.ones(1, 2))
        >>> round(float(out.loss), 4)
        -1.0

    .. versionadded:: 0.1.0
    """
    head, batch_shape = prepare_head(hidden, weight, tokens, bias, temperature, chunk_size)
    _check_old_log_probs(old_log_probs, head, batch_shape)
    call = validate_policy_call(
        (old_log_probs, old_log_probs, advantages, mask),
        ("old_log_probs", "old_log_probs", "advantages", "mask"),
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
    )
    kl = _validate_kl_term(
        ref_log_probs, kl_coef, kl_estimator, kl_straight_through, head, batch_shape
    )
    if kl is not None:
        warn_biased_kl_loss(kl.estimator, kl.straight_through, "fused_policy_loss_from_hidden")
    ref_t = None if kl is None else kl.ref_log_probs
    dtype = compute_dtype(
        head.hidden, call.inputs.old_log_probs, call.inputs.advantages,
        *(() if ref_t is None else (ref_t,)),
    )  # fmt: skip
    call = call._replace(inputs=call.inputs._replace(dtype=dtype, output_dtype=head.dtype))
    if _needs_composition(head, call):
        return _composed_loss(head, batch_shape, call, kl)
    return _fused_loss(head, batch_shape, call, kl)


def _check_old_log_probs(
    old_log_probs: ArrayLike, head: Head, batch_shape: tuple[int, int]
) -> None:
    """``old_log_probs`` against the tokens (the reference of the policy tensors' shapes)."""
    old = as_float_tensor(old_log_probs, "old_log_probs", head.hidden.device)
    check_same_device({"hidden": head.hidden, "old_log_probs": old})
    check_shape(old, "old_log_probs", batch_shape, "tokens")


class _KLTerm(NamedTuple):
    ref_log_probs: torch.Tensor  # (B, T), detached
    coef: float
    estimator: str
    straight_through: bool


def _validate_kl_term(
    ref_log_probs: ArrayLike | None,
    kl_coef: float,
    kl_estimator: str,
    kl_straight_through: bool,
    head: Head,
    batch_shape: tuple[int, int],
) -> _KLTerm | None:
    """The KL term's arguments; None when there is no reference (a zero KL loss is reported)."""
    beta = float(validate_scalar(kl_coef, "kl_coef", minimum=0.0, allow_tensor=False))
    check_estimator_spelling(kl_estimator, ESTIMATORS, prefix="kl_")
    validate_choice(kl_estimator, "kl_estimator", ESTIMATORS)
    validate_bool(kl_straight_through, "kl_straight_through")
    if ref_log_probs is None:
        if beta > 0:
            raise ValueError(f"kl_coef > 0 requires ref_log_probs, got kl_coef={kl_coef!r}")
        return None
    device = head.hidden.device
    ref_t = as_batch_matrix(
        as_float_tensor(ref_log_probs, "ref_log_probs", device), "ref_log_probs"
    )
    check_same_device({"hidden": head.hidden, "ref_log_probs": ref_t})
    check_shape(ref_t, "ref_log_probs", batch_shape, "tokens")
    return _KLTerm(ref_t.detach(), beta, kl_estimator, kl_straight_through)


def _needs_composition(head: Head, call: PolicyCall) -> bool:
    """Whether the loss is not token-local (GSPO, ``"none"``) or no gradient is wanted.

    Those cases compose :class:`LogProbsFromHidden` (with recompute) and the policy loss instead
    of forming the gradients in forward.
    """
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (head.hidden, head.weight, head.bias)
    )
    return (
        not wants_grad
        or call.reduction.reduction == "none"
        or call.options.ratio_level == "sequence"
    )


def _loss_value(
    log_probs: torch.Tensor, call: PolicyCall, kl: _KLTerm | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossDiagnostics]:
    """The unfused composition on ``(B, T)`` log-probs: (loss, policy, kl, diagnostics)."""
    inputs = call.inputs._replace(log_probs=log_probs, output_dtype=log_probs.dtype)
    run = run_fused if not isinstance(call.options.clip_low, torch.Tensor) else run_autograd
    out = run(call._replace(inputs=inputs), return_per_token=False)
    kl_loss = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    if kl is not None:
        terms = kl_terms(
            log_probs,
            kl.ref_log_probs,
            inputs.mask,
            estimator=kl.estimator,
            straight_through=kl.straight_through,
            log_ratio_bound=call.options.log_ratio_bound,
            dtype=inputs.dtype,
        )
        kl_loss = reduce(terms.to(log_probs.dtype), inputs.mask, call.reduction, call.layout)
    loss = out.loss + kl.coef * kl_loss if kl is not None and kl.coef > 0 else out.loss
    return loss, out.loss.detach(), kl_loss.detach(), out.diagnostics


def _composed_loss(
    head: Head, batch_shape: tuple[int, int], call: PolicyCall, kl: _KLTerm | None
) -> FusedPolicyLossOutput:
    """Log-probs with recompute in backward, then the loss by composition."""
    mask = call.inputs.mask
    log_probs, _ = LogProbsFromHidden.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head, mask.reshape(-1), False
    )
    log_probs = log_probs.reshape(batch_shape).to(call.inputs.dtype)  # (B, T)
    loss, policy_part, kl_part, diagnostics = _loss_value(log_probs, call, kl)
    output_dtype = head.dtype
    return FusedPolicyLossOutput(
        loss.to(output_dtype),
        policy_part.to(output_dtype),
        kl_part.to(output_dtype),
        log_probs.detach().to(output_dtype),
        diagnostics,
    )


class _Coefficients(NamedTuple):
    """Flat ``(N,)`` per-token constants of the loss's derivative w.r.t. each log-prob."""

    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None
    token_weights: torch.Tensor  # d loss / d (per-token loss): the reduction's weight
    mask: torch.Tensor  # bool
    options: SurrogateOptions
    kl: _KLTerm | None
    dtype: torch.dtype


def _token_coefficients(spec: _Coefficients, log_probs: torch.Tensor, block: Block) -> torch.Tensor:
    """``dL/d log_probs`` of one chunk ``(n,)``, in closed form (no autograd inside forward)."""
    rows = block[0]
    mask = spec.mask[rows]  # (n,)
    none = ReductionSpec("none", None, 1.0)
    forward = fused_forward(
        log_probs.unsqueeze(0),
        spec.old_log_probs[rows].unsqueeze(0),
        spec.advantages[rows].unsqueeze(0),
        mask.unsqueeze(0),
        FusedSpec(spec.options, none, None, spec.dtype, padded(1)),
    )
    coefficient = -forward.coefficient.squeeze(0)  # d(-s)/d log_probs, (n,)
    if spec.kl is not None and spec.ref_log_probs is not None and spec.kl.coef > 0:
        log_ratio = masked_fill_zero(log_probs - spec.ref_log_probs[rows], mask)  # (n,)
        kl_slope = kl_gradient(
            log_ratio,
            estimator=spec.kl.estimator,
            straight_through=spec.kl.straight_through,
            log_ratio_bound=spec.options.log_ratio_bound,
        )
        coefficient = coefficient + spec.kl.coef * kl_slope
    return masked_fill_zero(coefficient * spec.token_weights[rows], mask)


def _fused_loss(
    head: Head, batch_shape: tuple[int, int], call: PolicyCall, kl: _KLTerm | None
) -> FusedPolicyLossOutput:
    """Gradients formed in the forward chunk loop; the value from the composition."""
    inputs, dtype = call.inputs, call.inputs.dtype
    layout = call.layout
    counts = layout.row_counts(inputs.mask)  # (S,)
    weights = row_weights(counts, call.reduction, dtype=dtype, batch=layout.num_sequences)
    token_weights = token_gradient_weights(weights, layout, dtype).expand(batch_shape)
    coefficients = _Coefficients(
        old_log_probs=inputs.old_log_probs.to(dtype).reshape(-1),
        advantages=inputs.advantages.to(dtype).expand(batch_shape).reshape(-1),
        ref_log_probs=None if kl is None else kl.ref_log_probs.to(dtype).reshape(-1),
        token_weights=token_weights.reshape(-1),
        mask=inputs.mask.reshape(-1),
        options=call.options,
        kl=kl,
        dtype=dtype,
    )
    anchor, flat_log_probs = FusedLinearLoss.apply(  # type: ignore[no-untyped-call]
        head.hidden,
        head.weight,
        head.bias,
        head._replace(dtype=dtype),
        coefficients.mask,
        partial(_token_coefficients, coefficients),
    )
    log_probs = flat_log_probs.reshape(batch_shape)  # (B, T), detached
    with torch.no_grad():
        loss, policy_part, kl_part, diagnostics = _loss_value(log_probs, call, kl)
    # The value is the unfused composition's; the gradient flows through the anchor (value 0).
    loss = loss.detach() + anchor
    output_dtype = head.dtype
    return FusedPolicyLossOutput(
        loss.to(output_dtype),
        policy_part.to(output_dtype),
        kl_part.to(output_dtype),
        log_probs.to(output_dtype),
        diagnostics,
    )
