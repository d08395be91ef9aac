"""The result of :func:`rlobjectives.fused_policy_loss_from_hidden` and its composition path.

The composition is the unfused definition of the loss: the chunked log-probabilities (and
entropies) of the tokens, then :func:`rlobjectives.policy_loss`'s path, the KL term and the
entropy bonus with the same reduction. :mod:`.from_hidden` uses it for the losses that are not
token-local (GSPO, GMPO, VESPO, ``reduction="none"``, ...), for calls that need no gradient,
for the Triton LM head, and for the value of its chunk loop.

The KL term's arguments (``ref_log_probs``, ``kl_coef``, ``kl_estimator``,
``kl_straight_through``: :func:`validate_kl_term`, a :class:`KLTerm`) and the check of
``old_log_probs`` against the token ids (:func:`check_old_log_probs`) are validated here too:
the composition is where the KL term enters the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .._core.layout import token_matrix
from .._core.reduction import masked_fill_zero, reduce
from .._core.validation import (
    ArrayLike,
    as_float_tensor,
    check_estimator_spelling,
    check_same_device,
    check_shape,
    validate_bool,
    validate_choice,
    validate_scalar,
)
from ..kl.estimators import ESTIMATORS, kl_terms
from ..logprobs.head import Head
from .call import PolicyCall, PolicyLossDiagnostics
from .loss import run_policy

__all__ = [
    "FusedPolicyLossOutput",
    "HeadLogProbs",
    "KLTerm",
    "LossValues",
    "check_old_log_probs",
    "composed_loss",
    "entropy_on",
    "fused_output",
    "loss_value",
    "validate_kl_term",
]


#: ``(head, mask (N,), with_entropy) -> (log_probs (N,), entropy (N,) or (0,))``, differentiable
#: with respect to the head's hidden states, weight and bias.
HeadLogProbs = Callable[[Head, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


class FusedPolicyLossOutput(NamedTuple):
    """Result of :func:`fused_policy_loss_from_hidden`.

    Attributes:
        loss: scalar total loss ``policy_loss + kl_coef * kl_loss - entropy_coef *
            entropy_loss`` (differentiable with respect to ``hidden``, ``weight`` and ``bias``);
            float32 (float64 for float64 ``hidden``), computed in float64 if any input is
            float64.
        policy_loss: detached scalar, the surrogate part (as :func:`policy_loss` without the
            entropy bonus; TRL's ``policy_loss`` metric).
        kl_loss: detached scalar, the reduced KL estimate (before ``kl_coef``); 0 without
            ``ref_log_probs``.
        log_probs: detached ``(B, T)`` log-probabilities of the tokens (zeros at unselected
            tokens), the same values :func:`token_log_probs_from_hidden` returns.
        diagnostics: :class:`PolicyLossDiagnostics`, as :func:`policy_loss` reports them.
        entropy_loss: detached scalar, the reduced entropy ``reduce(H)`` (before
            ``entropy_coef``; verl's ``actor/entropy_loss``); 0 when ``entropy_coef`` is 0
            (the entropies are then not computed).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    log_probs: torch.Tensor
    diagnostics: PolicyLossDiagnostics
    entropy_loss: torch.Tensor


def entropy_on(call: PolicyCall) -> bool:
    """Whether the loss has an entropy bonus (the entropies must be computed)."""
    return isinstance(call.entropy_coef, torch.Tensor) or call.entropy_coef != 0.0


class LossValues(NamedTuple):
    """The unfused composition's value and its detached parts."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    diagnostics: PolicyLossDiagnostics


def loss_value(
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    call: PolicyCall,
    kl: KLTerm | None,
) -> LossValues:
    """The unfused composition on ``(B, T)`` log-probs (and entropies)."""
    inputs = call.inputs._replace(log_probs=log_probs, output_dtype=log_probs.dtype)
    policy_call = call._replace(inputs=inputs, entropy_coef=0.0)
    out = run_policy(policy_call, return_per_token=False)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    loss, kl_loss, entropy_loss = out.loss, zero, zero
    mask = inputs.mask
    if kl is not None:
        terms = kl_terms(
            log_probs,
            kl.ref_log_probs,
            mask,
            estimator=kl.estimator,
            straight_through=kl.straight_through,
            log_ratio_bound=call.options.log_ratio_bound,
            dtype=inputs.dtype,
        )
        kl_loss = reduce(terms.to(log_probs.dtype), mask, call.reduction, call.layout)
        loss = loss + kl.coef * kl_loss if kl.coef > 0 else loss
    if entropy is not None:
        selected = masked_fill_zero(entropy.to(log_probs.dtype), mask)
        entropy_loss = reduce(selected, mask, call.reduction, call.layout)
        loss = loss - call.entropy_coef * entropy_loss
    return LossValues(
        loss, out.loss.detach(), kl_loss.detach(), entropy_loss.detach(), out.diagnostics
    )


def fused_output(
    values: LossValues, loss: torch.Tensor, log_probs: torch.Tensor, head: Head
) -> FusedPolicyLossOutput:
    """The public result: ``loss`` (with its gradient) and the detached parts, head's dtype."""
    output_dtype = head.dtype
    return FusedPolicyLossOutput(
        loss.to(output_dtype),
        values.policy.to(output_dtype),
        values.kl.to(output_dtype),
        log_probs.detach().to(output_dtype),
        values.diagnostics,
        values.entropy.to(output_dtype),
    )


def composed_loss(
    head: Head,
    batch_shape: tuple[int, int],
    call: PolicyCall,
    kl: KLTerm | None,
    head_log_probs: HeadLogProbs,
) -> FusedPolicyLossOutput:
    """Log-probs (and entropies) from ``head_log_probs``, then the loss by composition."""
    mask = call.inputs.mask
    with_entropy = entropy_on(call)
    log_probs, entropy = head_log_probs(head, mask.reshape(-1), with_entropy)
    log_probs = log_probs.reshape(batch_shape).to(call.inputs.dtype)  # (B, T)
    entropies = entropy.reshape(batch_shape).to(call.inputs.dtype) if with_entropy else None
    values = loss_value(log_probs, entropies, call, kl)
    return fused_output(values, values.loss, log_probs, head)


class KLTerm(NamedTuple):
    """The KL term of the loss: ``coef * reduce(k(log_probs, ref_log_probs))``."""

    ref_log_probs: torch.Tensor  # (B, T) or packed (1, N), detached
    coef: float
    estimator: str
    straight_through: bool


def check_old_log_probs(
    old_log_probs: ArrayLike, head: Head, batch_shape: tuple[int, int], packed: bool = False
) -> None:
    """``old_log_probs`` against the tokens (the reference of the policy tensors' shapes).

    ``packed``: ``(N,)`` or ``(1, N)``, compared as ``(1, N)``.
    """
    old = as_float_tensor(old_log_probs, "old_log_probs", head.hidden.device)
    if packed:
        old = token_matrix(old, "old_log_probs", packed)
    check_same_device({"hidden": head.hidden, "old_log_probs": old})
    check_shape(old, "old_log_probs", batch_shape, "tokens")


def validate_kl_term(
    ref_log_probs: ArrayLike | None,
    kl_coef: float,
    kl_estimator: str,
    kl_straight_through: bool,
    head: Head,
    batch_shape: tuple[int, int],
    packed: bool = False,
) -> KLTerm | None:
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
    ref_t = token_matrix(
        as_float_tensor(ref_log_probs, "ref_log_probs", device), "ref_log_probs", packed
    )
    check_same_device({"hidden": head.hidden, "ref_log_probs": ref_t})
    check_shape(ref_t, "ref_log_probs", batch_shape, "tokens")
    return KLTerm(ref_t.detach(), beta, kl_estimator, kl_straight_through)
