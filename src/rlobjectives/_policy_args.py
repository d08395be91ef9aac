"""Arguments and results of the policy loss: validation at the boundary, named results.

:func:`prepare_policy_inputs` and :func:`validate_surrogate_options` run once per public call
(:func:`rlobjectives.policy_loss`, :func:`rlobjectives.grpo_clipped_surrogate`,
:func:`rlobjectives.fused_policy_loss_from_hidden`); everything after them works on the
validated :class:`PolicyInputs` / :class:`SurrogateOptions` without checking again.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from ._layout import Layout
from ._packing import sequence_layout, token_matrix, tokens_from_sequences
from ._reduction import ReductionSpec, validate_normalizer
from ._validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    expand_per_sequence,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "RATIO_LEVELS",
    "PolicyCall",
    "PolicyInputs",
    "PolicyLossDiagnostics",
    "PolicyLossOutput",
    "RatioLevel",
    "SurrogateOptions",
    "prepare_layout_inputs",
    "prepare_policy_inputs",
    "validate_diagnostics_normalizer",
    "validate_surrogate_options",
]

RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")


class PolicyLossDiagnostics(NamedTuple):
    """Detached, masked, NaN-proof diagnostics of a policy-loss call.

    Token fractions and means are over selected tokens: the numerator is summed over the batch
    and divided by the local selected-token count, or by ``diagnostics_normalizer`` when given
    (used exactly as given, so that the values of micro-batches add up to the full-batch
    values). All are float32 (float64 for float64 inputs).

    Attributes:
        clipped_fraction: ratio strictly outside ``[1 - clip_low, 1 + clip_high]``, any sign of
            the advantage (the seed's definition; a superset of the binding clips). 0 when
            ``clip_low`` is None.
        clip_fraction_low: the low clip binds: ``r < 1 - clip_low`` and ``A < 0``.
        clip_fraction_high: the high clip binds: ``r > 1 + clip_high`` and ``A > 0``.
            ``clip_fraction_low + clip_fraction_high`` is verl/OpenRLHF's ``pg_clipfrac`` and
            TRL's ``clip_ratio`` (up to ties at ``A = 0``).
        dual_clip_fraction: the dual-clip bound binds: ``A < 0`` and
            ``min(r A, clip(r) A) < c A`` (verl's ``pg_clipfrac_lower``). 0 without ``dual_clip``.
        log_ratio_bound_fraction: ``|log_ratio| > log_ratio_bound`` (the bound fired).
        ratio_mean: mean importance ratio ``r`` (after the bound).
        approx_kl_k1: k1 estimate of KL(old || new): mean of ``-log_ratio``.
        approx_kl_k3: k3 estimate of KL(old || new): mean of ``r - 1 - log r`` (``log r`` bounded),
            computed without cancellation (``expm1``).
    """

    clipped_fraction: torch.Tensor
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    dual_clip_fraction: torch.Tensor
    log_ratio_bound_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    approx_kl_k1: torch.Tensor
    approx_kl_k3: torch.Tensor


class PolicyLossOutput(NamedTuple):
    """Result of :func:`rlobjectives.policy_loss`.

    Attributes:
        loss: the reduced loss (scalar; ``(B, T)`` for ``reduction="none"``), dtype of
            ``log_probs``.
        per_token_loss: ``(B, T)`` per-token loss ``-s`` (zeros at unselected tokens) when
            ``return_per_token=True``, else None.
        diagnostics: :class:`PolicyLossDiagnostics`.
    """

    loss: torch.Tensor
    per_token_loss: torch.Tensor | None
    diagnostics: PolicyLossDiagnostics


class PolicyInputs(NamedTuple):
    """The validated tensors of a policy-loss call."""

    log_probs: torch.Tensor  # (B, T) or packed (1, N), floating, original dtype (grad flows)
    old_log_probs: torch.Tensor  # (B, T) / (1, N), detached: a constant
    advantages: torch.Tensor  # (B, 1), (B, T) or packed (1, N), detached: a constant
    mask: torch.Tensor  # (B, T) / (1, N) bool
    output_dtype: torch.dtype
    dtype: torch.dtype  # computation dtype (float32 or float64)


class SurrogateOptions(NamedTuple):
    """The validated surrogate options (Python numbers or 0-d tensors)."""

    clip_low: float | torch.Tensor | None
    clip_high: float | torch.Tensor | None
    dual_clip: float | torch.Tensor | None
    ratio_level: str
    log_ratio_bound: float | torch.Tensor | None


class PolicyCall(NamedTuple):
    """Everything a policy-loss path needs, validated once."""

    inputs: PolicyInputs
    options: SurrogateOptions
    reduction: ReductionSpec
    diagnostics_normalizer: float | torch.Tensor | None
    layout: Layout  # which tokens form which sequence


def prepare_policy_inputs(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    names: tuple[str, str, str, str],
) -> PolicyInputs:
    """The padded ``(B, T)`` case of :func:`prepare_layout_inputs` (no ``cu_seqlens``)."""
    return prepare_layout_inputs(log_probs, old_log_probs, advantages, mask, names)[0]


def prepare_layout_inputs(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    names: tuple[str, str, str, str],
    *,
    cu_seqlens: ArrayLike | None = None,
) -> tuple[PolicyInputs, Layout]:
    """Coerce and validate the four tensor arguments (named as the public function names them).

    Padded: ``(B, T)`` tensors, advantages ``(B,)``, ``(B, 1)`` or ``(B, T)``. Packed
    (``cu_seqlens`` given): ``(N,)`` or ``(1, N)`` tensors, kept as ``(1, N)``; advantages
    ``(S,)`` / ``(S, 1)`` per sequence are broadcast to their tokens, ``(N,)`` / ``(1, N)`` per
    token. ``old_log_probs`` and ``advantages`` are detached: the policy loss treats them as
    constants on every path, so an undetached critic or behaviour policy never receives policy
    gradient. Returns the inputs and the :class:`Layout` of their sequences.
    """
    log_probs_name, old_name, advantages_name, mask_name = names
    packed = cu_seqlens is not None
    log_probs_t = token_matrix(as_float_tensor(log_probs, log_probs_name), log_probs_name, packed)
    device = log_probs_t.device
    old_t = token_matrix(as_float_tensor(old_log_probs, old_name, device), old_name, packed)
    advantages_t = as_float_tensor(advantages, advantages_name, device)
    mask_t = token_matrix(as_mask(mask, mask_name, device), mask_name, packed)
    check_same_device(
        {
            log_probs_name: log_probs_t,
            old_name: old_t,
            advantages_name: advantages_t,
            mask_name: mask_t,
        }
    )
    shape = (log_probs_t.shape[0], log_probs_t.shape[1])
    check_shape(old_t, old_name, shape, log_probs_name)
    check_shape(mask_t, mask_name, shape, log_probs_name)
    layout = sequence_layout(cu_seqlens, log_probs_t)
    if packed:
        advantages_t = tokens_from_sequences(advantages_t, advantages_name, layout, log_probs_name)
    else:
        if advantages_t.ndim == 1 and advantages_t.numel() == 0 and shape[0] == 0:
            advantages_t = advantages_t.reshape(0)
        advantages_t = expand_per_sequence(advantages_t, advantages_name, shape, log_probs_name)
    inputs = PolicyInputs(
        log_probs=log_probs_t,
        old_log_probs=old_t.detach(),
        advantages=advantages_t.detach(),
        mask=mask_t,
        output_dtype=log_probs_t.dtype,
        dtype=compute_dtype(log_probs_t, old_t, advantages_t),
    )
    return inputs, layout


def validate_surrogate_options(
    *,
    clip_low: Scalar | None,
    clip_high: Scalar | None,
    dual_clip: Scalar | None,
    ratio_level: str,
    log_ratio_bound: Scalar | None,
) -> SurrogateOptions:
    """Validate the clip band, dual clip, ratio level and log-ratio bound."""
    validate_choice(ratio_level, "ratio_level", RATIO_LEVELS)
    if clip_low is None and clip_high is not None:
        raise ValueError(
            f"clip_high requires clip_low (clip_low=None disables clipping), got clip_low=None "
            f"and clip_high={clip_high!r}"
        )
    low = None
    if clip_low is not None:
        # The lower edge 1 - clip_low must stay positive: clip_low in [0, 1).
        low = validate_scalar(clip_low, "clip_low", minimum=0.0, maximum=1.0)
    high = None if clip_high is None else validate_scalar(clip_high, "clip_high", minimum=0.0)
    dual = None
    if dual_clip is not None:
        dual = validate_scalar(dual_clip, "dual_clip", minimum=1.0, strict=True)
    bound = None
    if log_ratio_bound is not None:
        bound = validate_scalar(log_ratio_bound, "log_ratio_bound", minimum=0.0, strict=True)
    return SurrogateOptions(
        clip_low=low, clip_high=high, dual_clip=dual, ratio_level=ratio_level, log_ratio_bound=bound
    )


def validate_diagnostics_normalizer(value: Scalar | None) -> float | torch.Tensor | None:
    """A positive finite ``diagnostics_normalizer`` (used exactly as given), or None."""
    return validate_normalizer(value, "diagnostics_normalizer")
