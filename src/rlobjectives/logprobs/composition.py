"""The result of :func:`rlobjectives.fused_policy_loss_from_hidden` and its composition path.

The composition is the unfused definition of the loss: the chunked log-probabilities (and
entropies) of the tokens, then :func:`rlobjectives.policy_loss` (dispatched as a public call:
the Triton kernels, the fused Function or autograd), the KL term and the entropy bonus with the
same reduction. :mod:`rlobjectives.logprobs.fused` uses it for the losses that are not token-local
(GSPO, GMPO, VESPO, ``reduction="none"``), for calls that need no gradient, and for the value of
its fused chunk loop; the Triton path (:mod:`rlobjectives.kernels.calls.head`) for the same
cases, with its own log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .._core.reduction import masked_fill_zero, reduce
from ..kl.estimators import kl_terms
from ..policy.inputs import PolicyCall, PolicyLossDiagnostics
from ..policy.loss import run_policy
from .kl_term import KLTerm
from .passes import Head

__all__ = [
    "FusedPolicyLossOutput",
    "HeadLogProbs",
    "LossValues",
    "composed_loss",
    "entropy_on",
    "fused_output",
    "loss_value",
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
    log_probs: torch.Tensor, entropy: torch.Tensor | None, call: PolicyCall, kl: KLTerm | None
) -> LossValues:
    """The unfused composition on ``(B, T)`` log-probs (and entropies)."""
    inputs = call.inputs._replace(log_probs=log_probs, output_dtype=log_probs.dtype)
    policy_call = call._replace(inputs=inputs, entropy_coef=0.0)
    out = run_policy(policy_call, return_per_token=False)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    loss, kl_loss, entropy_loss = out.loss, zero, zero
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
        loss = loss + kl.coef * kl_loss if kl.coef > 0 else loss
    if entropy is not None:
        selected = masked_fill_zero(entropy.to(log_probs.dtype), inputs.mask)
        entropy_loss = reduce(selected, inputs.mask, call.reduction, call.layout)
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
