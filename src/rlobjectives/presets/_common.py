"""Shared parts of the peer presets: one reduction record, the weighted policy term, option access.

A preset maps a peer's options onto calls of the public API (:func:`rlobjectives.policy_loss`,
:func:`rlobjectives.aggregate`, :func:`rlobjectives.kl_estimate`, :func:`rlobjectives.masked_mean`);
nothing here re-implements a loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

import torch

from .._core.masked import aggregate
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    Scalar,
    compute_dtype,
    validate_bool,
    validate_length,
    validate_scalar,
)
from ..policy.call import PolicyLossDiagnostics, validate_surrogate_options
from ..policy.loss import policy_loss

_MaybeTensor = TypeVar("_MaybeTensor", torch.Tensor, torch.Tensor | None)

__all__ = [
    "ReductionArgs",
    "WeightedPolicyTerm",
    "as_bool_mask",
    "check_options",
    "nonempty_rows",
    "option",
    "preset_count",
    "preset_flag",
    "preset_number",
    "float64_if_any",
    "promote",
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
    token_filter: torch.Tensor | None = None,
) -> WeightedPolicyTerm:
    """:func:`rlobjectives.policy_loss` reduced as ``args``, with importance weights and a filter.

    ``weights`` (constant ``(B, T)`` or ``(B, 1)``) go to ``policy_loss(importance_weights=)``:
    they multiply each token's loss after the clip and before the reduction, the denominators
    keep the mask (verl's ``rollout_is_weights``, TRL's ``importance_sampling_ratio``, 0/1
    masks that TRL multiplies in). One call.

    ``token_filter`` (``(B, T)`` bool, or None) zeroes the per-token loss of the tokens it drops
    after the surrogate is formed, the denominators unchanged: for a surrogate that folds the
    importance weights into its own formula (VESPO), where a 0/1 multiplier cannot travel as a
    weight. Then the loss is ``policy_loss(reduction="none")`` selected by the filter and
    reduced with :func:`rlobjectives.aggregate` under ``args`` (the same numbers as one call).
    """
    if token_filter is None:
        out = policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            reduction=args.reduction,  # type: ignore[arg-type]
            normalizer=args.normalizer,
            max_response_length=args.max_response_length,
            importance_weights=weights,
            **options,
        )
        loss = out.loss / args.divisor if args.divisor != 1.0 else out.loss
        return WeightedPolicyTerm(loss, out.diagnostics)
    out = policy_loss(
        log_probs, old_log_probs, advantages, mask, reduction="none",
        importance_weights=weights, **options,
    )  # fmt: skip
    per_token = masked_fill_zero(out.loss, token_filter)  # (B, T)
    return WeightedPolicyTerm(reduce_terms(per_token, mask, args), out.diagnostics)


def check_options(options: Mapping[str, Any]) -> None:
    """Validate a row's ``policy_loss`` keywords once, when the preset is built.

    The surrogate object validated its own fields when the row built it; this checks the
    ratio level it is given and the log-ratio bound.

    Raises:
        ValueError: an option out of range, or ``ratio_level="sequence"`` with a surrogate that
            forms its own sequence ratio (the message names the keyword).
    """
    validate_surrogate_options(**options)


def option(config: object, name: str, default: Any) -> Any:
    """``config.name`` (attribute or mapping key); ``default`` when absent or None."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(name)
    else:
        value = getattr(config, name, None)
    return default if value is None else value


def preset_number(
    value: object,
    name: str,
    *,
    minimum: float | None = 0.0,
    strict: bool = False,
    maximum: float | None = None,
) -> float:
    """A peer's numeric option checked like the library's hyperparameters, under the peer's name.

    A real Python number (not a bool), finite, ``>= minimum`` (``>`` when ``strict``) and
    ``< maximum``; returned as a float.

    Raises:
        ValueError: naming ``name``, for a non-finite or out-of-range value.
        TypeError: naming ``name``, for a non-number.
    """
    number = validate_scalar(
        value,  # type: ignore[arg-type]
        name,
        minimum=minimum,
        strict=strict,
        maximum=maximum,
        allow_tensor=False,
    )
    return float(number)


def preset_count(value: object, name: str) -> int:
    """A peer's positive whole-number option (a length, a process or step count) as an int.

    Raises:
        ValueError: naming ``name``, for a value that is not a positive whole number.
        TypeError: naming ``name``, for a non-number.
    """
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python int, got a tensor")
    return int(validate_length(value, name))  # type: ignore[arg-type]


def preset_flag(value: object, name: str) -> bool:
    """A peer's on/off option: a Python bool (a truthy string must not switch it on)."""
    return validate_bool(value, name)


def float64_if_any(*tensors: torch.Tensor | None) -> torch.dtype | None:
    """float64 when any floating tensor of a preset call is float64, else None (unchanged).

    A preset composes several library calls, each of which computes in the dtype of its own
    inputs; converting every input to float64 first (:func:`promote`) makes the whole preset
    follow the library's rule (float64 when any floating input is float64), so that a float64
    entropy, reference or sampler log-probability does not meet a term computed in float32.
    Otherwise (float32, bf16, fp16) nothing is converted: each call computes in float32 anyway.
    """
    present = [t for t in tensors if t is not None]
    return torch.float64 if compute_dtype(*present) == torch.float64 else None


def promote(tensor: _MaybeTensor, dtype: torch.dtype | None) -> _MaybeTensor:
    """``tensor`` in ``dtype`` (a floating tensor; None or no dtype: unchanged).

    Differentiable: gradients arrive in the input's own dtype.
    """
    if tensor is None or dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)
