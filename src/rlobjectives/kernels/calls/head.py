r"""The hidden-state functions of the public API on the Triton LM-head kernels.

:func:`rlobjectives.token_log_probs_from_hidden` and
:func:`rlobjectives.fused_policy_loss_from_hidden` validate their arguments (a
:class:`~rlobjectives.logprobs.head.Head` and, for the loss, a
:class:`~rlobjectives.policy.inputs.PolicyCall`), then call these functions when
:func:`~rlobjectives._core.backend.kernel_backend` selects the kernels:

- :func:`log_probs_kernels`: :class:`~._from_hidden.LogProbsFromHiddenFunction` (online
  log-sum-exp over vocabulary tiles, recomputing backward); also the log-probabilities of the
  loss's composition path (GSPO, GMPO, VESPO, ``reduction="none"``, no gradient needed);
- :func:`fused_loss_kernels`: :class:`~._from_hidden.FusedPolicyLossFromHiddenFunction` for a
  token-local loss: the LM-head forward, the token-loss kernel (policy term, KL term, entropy
  bonus, reduction weights from :func:`rlobjectives._core.reduction.row_weights` and the layout) and
  the recomputing backward.

``chunk_size`` does not apply to the kernels (their tiles and the backward's ``dZ`` chunk are
sized by :mod:`._lm_head_forward` / :mod:`._lm_head_backward`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...logprobs.composition import FusedPolicyLossOutput, KLTerm, entropy_on
from ...logprobs.head import Head
from ...policy.inputs import PolicyCall
from ..from_hidden import FusedPolicyLossFromHiddenFunction, LogProbsFromHiddenFunction
from .policy import (
    diagnostics_of,
    flat_inputs,
    kernel_dtype,
    kernel_options,
    reduction_weights,
)

__all__ = ["fused_loss_kernels", "log_probs_kernels"]


def _head_kwargs(head: Head) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"temperature": 1.0 / head.inv_temperature}
    if head.shard is not None:
        kwargs["shard"] = head.shard
    return kwargs


def log_probs_kernels(
    head: Head, mask: torch.Tensor | None, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)``, ``(N,)`` float32, of the head's tokens.

    ``entropy`` is ``(0,)`` without ``with_entropy``; ``mask`` None selects every row.
    """
    if mask is None:
        mask = torch.ones(head.hidden.shape[0], dtype=torch.bool, device=head.hidden.device)
    kwargs = dict(_head_kwargs(head), with_entropy=with_entropy)
    outputs: tuple[torch.Tensor, torch.Tensor] = LogProbsFromHiddenFunction.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head.tokens, mask, kwargs
    )
    return outputs


def fused_loss_kernels(
    head: Head, batch_shape: tuple[int, int], call: PolicyCall, kl: KLTerm | None
) -> FusedPolicyLossOutput | None:
    """The token-local loss on the one-pass Triton function, or None (the PyTorch path)."""
    extra: dict[str, Any] = {}
    if kl is not None:
        extra = {
            "kl_coef": kl.coef,
            "kl_estimator": kl.estimator,
            "kl_straight_through": kl.straight_through,
        }
    options = kernel_options(call.options, call.entropy_coef, **extra)
    if options is None:
        return None
    flat = flat_inputs(call.inputs)
    weights = reduction_weights(call.inputs.mask, call.reduction, call.layout)
    loss_kwargs: dict[str, Any] = {
        "options": options,
        "row_length": flat.shape[1],
        "importance_weights": flat.importance_weights,
    }
    if kl is not None:
        loss_kwargs["ref_log_probs"] = kernel_dtype(kl.ref_log_probs).reshape(-1)
    loss, log_probs, _, totals = FusedPolicyLossFromHiddenFunction.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head.tokens, flat.mask, flat.old_log_probs,
        flat.advantages, weights, _head_kwargs(head), loss_kwargs,
    )  # fmt: skip
    if call.layout.context is not None:  # the whole sequences' loss and sums (identity backward)
        loss, totals = call.layout.combine(loss, totals)
    zero = totals.new_zeros(())
    dtype = head.dtype
    return FusedPolicyLossOutput(
        loss.to(dtype),
        totals[1].to(dtype),  # the surrogate part, reduced
        (zero if kl is None else totals[2]).to(dtype),  # the reduced KL estimate
        log_probs.view(batch_shape).to(dtype),
        diagnostics_of(totals, call.diagnostics_normalizer),
        (totals[3] if entropy_on(call) else zero).to(dtype),  # the reduced entropy
    )
