"""Shared parts of the peer presets: one reduction record, the weighted policy term, option access.

A preset maps a peer's options onto calls of the public API (:func:`rlobjectives.policy_loss`,
:func:`rlobjectives.aggregate`, :func:`rlobjectives.kl_estimate`, :func:`rlobjectives.masked_mean`);
nothing here re-implements a loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .._policy import policy_loss
from .._policy_args import PolicyLossDiagnostics
from .._reduction import aggregate
from .._validation import Scalar

__all__ = [
    "ReductionArgs",
    "WeightedPolicyTerm",
    "as_bool_mask",
    "nonempty_rows",
    "not_yet",
    "option",
    "reduce_terms",
    "weighted_policy_loss",
]


class ReductionArgs(NamedTuple):
    """The library reduction that equals a peer's normaliser, and a divisor applied after it.

    ``divisor`` is a Python number (TRL divides some local means by the gradient-accumulation
    steps after reducing; a number keeps that division free of host syncs).
    """

    reduction: str
    normalizer: Scalar | None = None
    max_response_length: Scalar | None = None
    divisor: float = 1.0


class WeightedPolicyTerm(NamedTuple):
    """The reduced policy term and the library's diagnostics of the same call."""

    loss: torch.Tensor
    diagnostics: PolicyLossDiagnostics


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A peer's 0/1 (int, float or bool) mask as a bool tensor on ``like``'s device."""
    return torch.as_tensor(mask, device=like.device) != 0


def nonempty_rows(mask: torch.Tensor) -> torch.Tensor:
    """The number of rows with at least one selected token, at least 1 (a 0-d int64 tensor)."""
    return (mask.sum(-1) > 0).sum().clamp(min=1)


def reduce_terms(per_token: torch.Tensor, mask: torch.Tensor, args: ReductionArgs) -> torch.Tensor:
    """:func:`rlobjectives.aggregate` of ``per_token`` ``(B, T)`` under ``args``."""
    loss = aggregate(
        per_token,
        mask,
        reduction=args.reduction,  # type: ignore[arg-type]
        normalizer=args.normalizer,
        max_response_length=args.max_response_length,
    )
    return loss / args.divisor if args.divisor != 1.0 else loss


def weighted_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    options: Mapping[str, Any],
    args: ReductionArgs,
    weights: torch.Tensor | None = None,
) -> WeightedPolicyTerm:
    """:func:`rlobjectives.policy_loss` reduced as ``args``, each token's loss times ``weights``.

    Without weights this is one ``policy_loss`` call. With constant per-token (or ``(B, 1)``)
    weights it is the per-token loss (``reduction="none"``) times the weights, reduced with the
    same arguments: exactly how verl's ``rollout_is_weights`` and TRL's
    ``importance_sampling_ratio`` enter (after the clip, before the reduction; the denominators
    keep the mask). The weights are selected with ``torch.where`` first, so NaN/inf at unselected
    tokens reaches neither the value nor the gradient.
    """
    if weights is None:
        out = policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            reduction=args.reduction,  # type: ignore[arg-type]
            normalizer=args.normalizer,
            max_response_length=args.max_response_length,
            **options,
        )
        loss = out.loss / args.divisor if args.divisor != 1.0 else out.loss
        return WeightedPolicyTerm(loss, out.diagnostics)
    out = policy_loss(log_probs, old_log_probs, advantages, mask, reduction="none", **options)
    selected = as_bool_mask(mask, log_probs)
    weights_t = torch.as_tensor(weights, device=log_probs.device).detach()
    zero = torch.zeros((), dtype=out.loss.dtype, device=log_probs.device)
    weights_t = torch.where(selected, weights_t.to(out.loss.dtype), zero)  # (B, T)
    return WeightedPolicyTerm(reduce_terms(out.loss * weights_t, mask, args), out.diagnostics)


def option(config: object, name: str, default: Any) -> Any:
    """``config.name`` (attribute or mapping key); ``default`` when absent or None."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(name)
    else:
        value = getattr(config, name, None)
    return default if value is None else value


def not_yet(option_text: str, missing: str) -> NotImplementedError:
    """The error for a peer option that needs a library feature this version does not have."""
    return NotImplementedError(
        f"{option_text} is not supported yet: it needs {missing}, which this version of "
        "rlobjectives does not have. No approximation is substituted; see docs/objectives.md "
        "'Drop-in' for the options that are supported."
    )
