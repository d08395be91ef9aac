"""The validated policy-loss call and the named results.

:func:`validate_policy_call` builds a :class:`PolicyCall` once per public call
(:func:`rlobjectives.policy_loss`, :func:`rlobjectives.grpo_clipped_surrogate`,
:func:`rlobjectives.fused_policy_loss_from_hidden`); everything after it reads the record
without checking again.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch

from .._core.context import ContextGroup
from .._core.layout import Layout, sequence_layout, token_matrix, tokens_from_sequences
from .._core.reduction import ReductionSpec, validate_layout_reduction, validate_normalizer
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    expand_per_sequence,
    validate_choice,
    validate_context_group,
    validate_scalar,
)
from .surrogates import SURROGATES, Surrogate

__all__ = [
    "PolicyCall",
    "PolicyInputs",
    "PolicyLossDiagnostics",
    "PolicyLossOutput",
    "RatioLevel",
    "SurrogateChoice",
    "SurrogateOptions",
    "as_surrogate",
    "prepare_layout_inputs",
    "validate_entropy_coef",
    "validate_policy_call",
    "validate_surrogate_options",
]


RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
#: The names ``policy_loss(surrogate=...)`` accepts: the registry's, in its order (a surrogate
#: added to the registry is named here without another change).
SURROGATE_NAMES: tuple[str, ...] = tuple(SURROGATES)
#: ``policy_loss(surrogate=...)``: a surrogate object, or its name (the object's defaults).
SurrogateChoice = Surrogate | str


_ZERO = torch.zeros(())  # the default of the last two fields (never modified)


class PolicyLossDiagnostics(NamedTuple):
    """Detached, masked, NaN-proof diagnostics of a policy-loss call.

    Each is a sum over the selected tokens divided by their count, or by
    ``diagnostics_normalizer`` (used as given, so that micro-batch values add up to the
    full-batch value); float32 (float64 for float64 inputs). They describe the ratio and the
    surrogate: ``importance_weights`` do not enter them (VESPO's ``weight_mean`` excepted). The
    clip fields mean the same for every surrogate (per-surrogate bands and edges:
    ``docs/objectives/policy.md``, "Diagnostics"); every comparison of ``r`` with an edge is
    decided by the rule of ``docs/conventions.md`` ("Decisions at a bound").

    Attributes:
        clipped_fraction: ``r`` strictly outside the surrogate's band, any sign of the
            advantage (a superset of the binding clips). 0 without a band.
        clip_fraction_low: the low edge binds: ``r`` below it and ``A < 0``.
        clip_fraction_high: the high edge binds: ``r`` above it and ``A > 0``.
            ``clip_fraction_low + clip_fraction_high`` is verl/OpenRLHF's ``pg_clipfrac`` and
            TRL's ``clip_ratio`` (up to ties at ``A = 0``).
        dual_clip_fraction: an upper edge changes an ``A < 0`` token (``dual`` or the
            two-sided ``delta`` of :class:`~rlobjectives.Clip`: verl's ``pg_clipfrac_lower``;
            CISPO's cap; SAPO's gate).
        log_ratio_bound_fraction: ``|log_ratio| > log_ratio_bound`` (the bound fired).
        ratio_mean: mean importance ratio ``r`` (after the bound; the sequence ratio at each
            token for ``ratio_level="sequence"``).
        approx_kl_k1: k1 estimate of KL(old || new): mean of ``-log_ratio``.
        approx_kl_k3: k3 estimate of KL(old || new): mean of ``r - 1 - log r`` (``log r``
            bounded), computed without cancellation (``expm1``).
        weight_mean: mean of the factor ``w`` of ``s = w A`` (or ``s = sg(w) A log_probs``):
            the clipped ratio, SAPO's gate, GMPO's ratio, CISPO's capped ratio, VESPO's
            ``phi``, DPPO's ``1[kept] min(r, cap)``; 1 for DRO (``SurrogateTerms.weight``; by
            default ``s / A``).
        selected_fraction: the tokens a batch-level objective acts on: M2PO's masked tokens,
            Clip-Cov's detached ones (verl's ``pg_clipfrac`` for ``clip_cov``), KL-Cov's
            penalised ones; 0 for the other surrogates.
    """

    clipped_fraction: torch.Tensor
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    dual_clip_fraction: torch.Tensor
    log_ratio_bound_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    approx_kl_k1: torch.Tensor
    approx_kl_k3: torch.Tensor
    weight_mean: torch.Tensor = _ZERO  # a default keeps 8-field constructions working
    selected_fraction: torch.Tensor = _ZERO  # a default keeps 9-field constructions working


class PolicyLossOutput(NamedTuple):
    """Result of :func:`rlobjectives.policy_loss`.

    Attributes:
        loss: the reduced loss (scalar; ``(B, T)`` for ``reduction="none"``), dtype of
            ``log_probs``.
        per_token_loss: ``(B, T)`` per-token loss (zeros at unselected tokens) when
            ``return_per_token=True``, else None: ``-w s`` (``w`` the importance weights, 1
            without them) minus ``entropy_coef * entropy``; ``loss`` is its reduction.
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
    importance_weights: torch.Tensor | None = None  # (B, 1) or (B, T), detached: a constant
    entropy: torch.Tensor | None = None  # (B, T), floating (grad flows)
    # Whether the importance weights were given one per sequence ((B,) / (B, 1); packed (S,) /
    # (S, 1), broadcast to the (1, N) row): VESPO takes such a weight once per sequence.
    sequence_weights: bool = False
    groups: torch.Tensor | None = None  # (S,) int64 prompt group of each sequence, or None


class SurrogateOptions(NamedTuple):
    """The validated surrogate and the ratio options of one call."""

    surrogate: Surrogate  # a validated surrogate object (Clip(), CISPO(cap=5.0), ...)
    ratio_level: str  # "token" or "sequence" (GSPO)
    log_ratio_bound: float | torch.Tensor | None


class PolicyCall(NamedTuple):
    """Everything a policy-loss path needs, validated once."""

    inputs: PolicyInputs
    options: SurrogateOptions
    reduction: ReductionSpec
    diagnostics_normalizer: float | torch.Tensor | None
    layout: Layout  # which tokens form which sequence
    entropy_coef: float | torch.Tensor = 0.0  # the entropy bonus -c reduce(H) (with inputs.entropy)


def prepare_layout_inputs(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    names: tuple[str, str, str, str],
    *,
    cu_seqlens: ArrayLike | None = None,
    context: ContextGroup | None = None,
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
    layout = sequence_layout(cu_seqlens, log_probs_t, context)
    if packed:
        advantages_t = tokens_from_sequences(advantages_t, advantages_name, layout, log_probs_name)
    else:
        advantages_t = expand_per_sequence(advantages_t, advantages_name, shape, log_probs_name)
    inputs = PolicyInputs(  # contiguous: the sums run in one order whatever the strides
        log_probs=log_probs_t.contiguous(),
        old_log_probs=old_t.detach().contiguous(),
        advantages=advantages_t.detach().contiguous(),
        mask=mask_t.contiguous(),
        output_dtype=log_probs_t.dtype,
        dtype=compute_dtype(log_probs_t, old_t, advantages_t),
    )
    return inputs, layout


def prepare_importance_weights(
    inputs: PolicyInputs,
    importance_weights: ArrayLike | None,
    reference: str,
    layout: Layout | None = None,
) -> PolicyInputs:
    """Add validated ``importance_weights``: ``(B,)``, ``(B, 1)`` or ``(B, T)``, detached.

    Packed ``layout``: ``(S,)`` / ``(S, 1)`` per sequence, ``(N,)`` / ``(1, N)`` per token.

    Their values are not inspected (no host sync): they are expected to be finite and
    non-negative at selected tokens; unselected entries are ignored (NaN/inf there reaches
    nothing). A float64 tensor makes the computation float64, as for the other inputs.
    """
    if importance_weights is None:
        return inputs
    name = "importance_weights"
    weights = as_float_tensor(importance_weights, name, inputs.mask.device)
    check_same_device({reference: inputs.mask, name: weights})
    shape = (inputs.mask.shape[0], inputs.mask.shape[1])
    if layout is not None and layout.sequence_ids is not None:
        sequences = layout.num_sequences  # (S,) and (S, 1) are per sequence, as they broadcast
        per_sequence = tuple(weights.shape) in ((sequences,), (sequences, 1))
        weights = tokens_from_sequences(weights, name, layout, reference).detach()  # (1, N)
    else:
        weights = expand_per_sequence(weights, name, shape, reference).detach()
        per_sequence = weights.shape[-1] == 1  # (B,) or (B, 1), now (B, 1)
    dtype = compute_dtype(torch.empty(0, dtype=inputs.dtype), weights)
    return inputs._replace(importance_weights=weights, dtype=dtype, sequence_weights=per_sequence)


def prepare_entropy(
    inputs: PolicyInputs, entropy: ArrayLike | None, reference: str, packed: bool = False
) -> PolicyInputs:
    """Add a validated ``(B, T)`` (packed: ``(N,)`` or ``(1, N)``) ``entropy`` (differentiable)."""
    if entropy is None:
        return inputs
    entropy_t = as_float_tensor(entropy, "entropy", inputs.mask.device)
    entropy_t = token_matrix(entropy_t, "entropy", packed)
    check_same_device({reference: inputs.mask, "entropy": entropy_t})
    check_shape(entropy_t, "entropy", tuple(inputs.mask.shape), reference)
    # A float64 entropy makes the computation float64, as any other floating input does.
    dtype = compute_dtype(torch.empty(0, dtype=inputs.dtype), entropy_t)
    return inputs._replace(entropy=entropy_t, dtype=dtype)


def validate_entropy_coef(
    entropy_coef: Scalar, *, has_entropy: bool, allow_tensor: bool = True
) -> float | torch.Tensor:
    """A finite ``entropy_coef``; a nonzero one needs the ``entropy`` tensor (``has_entropy``)."""
    coef = validate_scalar(entropy_coef, "entropy_coef", minimum=None, allow_tensor=allow_tensor)
    nonzero = isinstance(coef, torch.Tensor) or coef != 0.0
    if nonzero and not has_entropy:
        raise ValueError(
            f"entropy_coef != 0 requires entropy (the (B, T) per-token entropies), got "
            f"entropy=None and entropy_coef={entropy_coef!r}"
        )
    return coef


def _name_default(cls: type[Surrogate]) -> Surrogate | str:
    """``cls()``, or where a field has no default, the fields the object needs."""
    missing = dataclasses.MISSING
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    required = [f"{f.name}=..." for f in fields if f.default is f.default_factory is missing]
    return f"{cls.__name__}({', '.join(required)})" if required else cls()


#: Each name's object with its defaults (immutable), or, where a field has none (DRO's beta,
#: TOPR's rewards), the object to pass instead. Built at import: a first call under
#: ``torch.compile(fullgraph=True)`` cannot trace ``dataclasses.fields``.
_DEFAULTS: dict[str, Surrogate | str] = {
    name: _name_default(cls) for name, cls in SURROGATES.items()
}


def as_surrogate(surrogate: object) -> Surrogate:
    """The surrogate object of ``policy_loss(surrogate=...)``: an object, or a name's defaults.

    Raises:
        ValueError: an unknown name, or a name whose object has a field without a default.
        TypeError: neither a name nor a surrogate object.
    """
    if isinstance(surrogate, Surrogate):
        return surrogate
    if isinstance(surrogate, str):
        validate_choice(surrogate, "surrogate", SURROGATE_NAMES)
        default = _DEFAULTS[surrogate]
        if isinstance(default, str):  # the name cannot mean defaults
            raise ValueError(f"surrogate={surrogate!r} has no defaults: pass the object, {default}")
        return default
    classes = ", ".join(cls.__name__ for cls in SURROGATES.values())
    raise TypeError(
        f"surrogate must be one of {list(SURROGATE_NAMES)} or a surrogate object ({classes}, or "
        f"a Surrogate subclass of your own), got {type(surrogate).__name__} ({surrogate!r})"
    )


def validate_surrogate_options(
    *,
    surrogate: object = "clip",
    ratio_level: object = "token",
    log_ratio_bound: Scalar | None = 20.0,
) -> SurrogateOptions:
    """The surrogate object, the ratio level it can take and the log-ratio bound, validated.

    The object validated its own fields when it was built; a surrogate that forms its own
    sequence ratio (GMPO, VESPO) takes ``ratio_level="token"`` only.
    """
    objective = as_surrogate(surrogate)
    validate_choice(ratio_level, "ratio_level", RATIO_LEVELS)
    if ratio_level != "token" and not objective.takes_sequence_ratio:
        raise ValueError(
            f"surrogate={objective!r} {objective.token_ratio_reason}: ratio_level must be "
            f"'token', got ratio_level={ratio_level!r}"
        )
    bound = None
    if log_ratio_bound is not None:
        bound = validate_scalar(log_ratio_bound, "log_ratio_bound", minimum=0.0, strict=True)
    return SurrogateOptions(objective, str(ratio_level), bound)


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
    context_group: object = None,
    group_size: object = None,
    group_ids: object = None,
) -> PolicyCall:
    """Validate every tensor argument of a policy-loss call once (named as in ``names``).

    ``cu_seqlens`` selects the packed layout (see :func:`prepare_layout_inputs`);
    ``context_group`` puts its group into the layout (context parallelism).
    """
    context = validate_context_group(context_group)
    surrogate = options.surrogate
    if context is not None and surrogate.selects_from_call():
        raise ValueError(
            f"context_group cannot be used with {type(surrogate).__name__} selecting its tokens "
            f"from this rank's part of the sequences (the selection needs the whole batch): "
            f"compute it over the group first (rlobjectives.distributed.global_cov_selection "
            f"as the object's selection=, global_m2po_mask as the mask of a Clip call; "
            f"docs/distributed/context-parallel.md), got surrogate={surrogate!r}"
        )
    inputs, layout = prepare_layout_inputs(*tensors, names, cu_seqlens=cu_seqlens, context=context)
    if importance_weights is not None:
        inputs = prepare_importance_weights(inputs, importance_weights, names[0], layout)
    if entropy is not None:
        inputs = prepare_entropy(inputs, entropy, names[0], cu_seqlens is not None)
    coef = validate_entropy_coef(entropy_coef, has_entropy=inputs.entropy is not None)
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=layout,
        tokens=inputs.log_probs.shape[-1],
        group_size=group_size,
        group_ids=group_ids,
        device=inputs.mask.device,
    )
    if spec.groups is not None:
        inputs = inputs._replace(groups=spec.groups.ids)
    diagnostics = validate_normalizer(diagnostics_normalizer, "diagnostics_normalizer")
    return PolicyCall(inputs, options, spec, diagnostics, layout, coef)
