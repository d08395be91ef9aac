r"""Fused forward/backward of the token-local policy surrogates, as named stages.

:class:`ClippedSurrogateFunction` computes, in one forward pass over the ``(B, T)`` inputs, the
surrogate :math:`s`, its reduction, the nine diagnostics and the gradient coefficient
:math:`\partial s_{it} / \partial \ell_{it}`; the backward is one multiplication by the
reduction's per-row weight. It saves one float ``(B, T)`` tensor (the coefficient) plus the mask
and a ``(B, 1)`` weight, where autograd keeps about six ``(B, T)`` tensors. The surrogate stage
is the surrogate object's own (:meth:`~rlobjectives.Clip.stage`, ``CISPO.stage``,
``SAPO.stage`` in :mod:`rlobjectives.policy.surrogates`). Importance weights
:math:`w` enter as :math:`\tilde A = wA` in the products (one ``(B, T)`` multiplication); the
clip decisions and the diagnostics use :math:`A`.

The math is that of the objects' formulas (the readable specification, which it is tested
against). The clip surrogate, written per sign of the advantage, and its derivative are stated
in :mod:`rlobjectives.policy.surrogates.clip`:
:math:`\partial s / \partial \ell = rA` where the ratio is inside its per-sign band and the
log-ratio within its bound, else 0. This reproduces autograd's conventions: ``torch.clamp``
passes the gradient on the closed interval (ratio band and log-ratio bound); in the band
``torch.minimum`` sees a tie of two equal products and its two halves add up to the full
gradient; at an exact dual-clip tie :math:`r = c` ``torch.maximum`` passes half, and so does the
fused path. Unselected positions are exact zeros before any arithmetic (log-ratio 0, ratio 1,
advantage 0): NaN/inf there reaches no value, diagnostic or gradient. NaN at a selected
position propagates to the loss.

The stages of :func:`fused_forward`: :func:`_log_ratio_stage` (select, GSPO form, k1/k3 sums;
at token level the clamped log-ratio of k3 is the ratio's), :func:`_ratio_stage` (bound, exp,
the tokens where the bound fired), the surrogate stage (for :class:`~rlobjectives.Clip`,
:meth:`~rlobjectives.Clip.stage`: the advantage signs, which tokens pass the
gradient and the clip counts, the coefficient and the values), :func:`_reduce_stage` (through
:mod:`rlobjectives._core.reduction`; a packed row computes per-sequence counts and segment sums only
where the loss needs them: GSPO and ``sequence_mean``) and :func:`_diagnostics`.

Documented deviations from the autograd path (all at measure-zero or non-finite inputs):

- clipping is decided on the ratio (:math:`r > H` or :math:`r < L`); autograd decides on the
  rounded products :math:`rA` vs :math:`\mathrm{clip}(r)A`, which can tie when :math:`r` is within
  an ulp of an edge or :math:`|A|` is tiny; autograd then passes half the gradient, the fused path
  none;
- a NaN ratio counts as above the band (and as out of the log-ratio bound) in the diagnostics, and
  without a log-ratio bound gets gradient 0 (autograd: NaN) where :math:`A > 0`;
- the final sums are ordered differently (rounding-level differences);
- double backward raises (first-order gradients only).

Implementation notes (CPU speed; the same code compiles under ``torch.compile(fullgraph=True)``):
masking and comparisons are integer operations on the IEEE-754 bits
(:mod:`rlobjectives._core.bits`),
several times faster than ``torch.where`` on CPU; temporaries are updated in place, because on
CPU a fresh ``(B, T)`` buffer costs page faults that often exceed the arithmetic; a packed row
(``(1, N)``, per-token advantages) pays per token only for the advantage signs, and the small
operations are few (each costs microseconds after the large passes have emptied the caches).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._core.bits import Bits, count_bits, less_, magnitude_, mask_bits, select, select_
from .._core.layout import Layout
from .._core.reduction import (
    ReductionSpec,
    clamp,
    masked_fill_zero,
    reduce,
    reduce_rows,
    row_weights,
    token_gradient_weights,
)
from .inputs import (
    PolicyCall,
    PolicyLossDiagnostics,
    PolicyLossOutput,
    SurrogateOptions,
)
from .specification import DIAGNOSTIC_LOG_RATIO_BOUND
from .surrogates.base import StageInputs

__all__ = [
    "ClippedSurrogateFunction",
    "FusedSpec",
    "entropy_term",
    "fused_forward",
    "has_fused_stage",
    "run_fused",
]


class FusedSpec(NamedTuple):
    """Validated options of one fused call (Python numbers or 0-d tensors)."""

    options: SurrogateOptions
    reduction: ReductionSpec
    diagnostics_normalizer: float | torch.Tensor | None
    dtype: torch.dtype  # computation dtype: float32 or float64
    layout: Layout  # which tokens form which sequence
    # The row sums output is wanted (the seed's per-sequence means); policy_loss discards it, so
    # a packed layout skips its segment sums where the loss does not need them.
    row_sums: bool = True


def _as_tensor(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


class _LogRatioStage(NamedTuple):
    token_log_ratio: torch.Tensor  # (B, T) selected (sequence-level for GSPO), a fresh buffer
    approx_kl_k1: torch.Tensor  # () sum of -Delta
    approx_kl_k3: torch.Tensor  # () sum of expm1(Delta) - Delta (Delta within the bound)
    # clamp(token_log_ratio, -b, b) where the ratio's bound b is the diagnostic's (token level)
    clamped: torch.Tensor | None = None


def _difference(left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``left.to(dtype) - right.to(dtype)`` in one pass where the inputs promote to ``dtype``.

    A mixed-dtype subtraction converts each element to the promoted dtype first, exactly as
    ``.to`` does, so only inputs that promote to a narrower dtype (bf16 - bf16) are converted.
    """
    if torch.promote_types(left.dtype, right.dtype) == dtype:
        return torch.sub(left, right)
    return left.to(dtype).sub_(right)


def _log_ratio_stage(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    keep: torch.Tensor,
    counts: torch.Tensor,
    spec: FusedSpec,
) -> _LogRatioStage:
    """Selected log-ratio (exact zeros elsewhere), its GSPO form, and the k1/k3 sums."""
    dtype, options = spec.dtype, spec.options
    log_ratio = select_(_difference(log_probs, old_log_probs, dtype), keep)  # (B, T)
    approx_kl_k1 = -log_ratio.sum()
    bound = (
        DIAGNOSTIC_LOG_RATIO_BOUND if options.log_ratio_bound is None else options.log_ratio_bound
    )
    kl_log_ratio = clamp(log_ratio, -bound, bound)  # (B, T)
    # k3 = r - 1 - log r as expm1(Delta) - Delta: no cancellation near on-policy.
    approx_kl_k3 = torch.expm1(kl_log_ratio).sub_(kl_log_ratio).sum()
    if options.ratio_level == "token":
        # With a log-ratio bound, the ratio's clamp is this one: computed once.
        clamped = None if options.log_ratio_bound is None else kl_log_ratio
        return _LogRatioStage(log_ratio, approx_kl_k1, approx_kl_k3, clamped)
    del kl_log_ratio
    # GSPO: value log s_i (mean selected log-ratio of the row) at every selected token, gradient
    # 1 w.r.t. log_probs (the stop-gradient form); (x - x) keeps NaN/inf of x.
    per_row = counts.clamp(min=1).to(dtype)  # (S,)
    sequence_log_ratio = spec.layout.expand(spec.layout.row_sums(log_ratio) / per_row)  # (B, 1)
    # (B, T) a fresh buffer: the AND of select, or in place on the converted copy
    same = log_probs.dtype == dtype
    selected = select(log_probs, keep) if same else select_(log_probs.to(dtype), keep)
    token_log_ratio = select_(selected.sub_(selected).add_(sequence_log_ratio), keep)
    return _LogRatioStage(token_log_ratio, approx_kl_k1, approx_kl_k3)


class _RatioStage(NamedTuple):
    ratio: torch.Tensor  # (B, T) exp(clamp(Delta, -b, b)), 1 at unselected tokens
    fired: torch.Tensor | None  # (B, T) select mask where the bound fired; None without a bound
    bound_fired: torch.Tensor  # () count of fired tokens


def _ratio_stage(stage: _LogRatioStage, bits: Bits, spec: FusedSpec) -> _RatioStage:
    """The ratio ``exp(clamp(Delta, -b, b))`` and the tokens where the bound fired.

    ``torch.clamp`` passes no gradient where the bound fired: the surrogate stage clears those
    tokens from its gradient. Consumes the stage's buffers: the clamped log-ratio becomes the
    ratio, the log-ratio the fired mask.
    """
    token_log_ratio, bound = stage.token_log_ratio, spec.options.log_ratio_bound
    if bound is None:
        none = torch.zeros((), dtype=torch.int64, device=token_log_ratio.device)
        return _RatioStage(token_log_ratio.exp(), None, none)
    clamped = stage.clamped
    if clamped is None:
        clamped = clamp(token_log_ratio, -bound, bound)
    ratio = clamped.exp_()  # (B, T)
    fired = less_(bits.of(bound), magnitude_(token_log_ratio))  # (B, T), NaN counts as fired
    return _RatioStage(ratio, fired, count_bits(fired))


def has_fused_stage(options: SurrogateOptions) -> bool:
    """Whether the fused path computes ``options.surrogate`` (the token-local surrogates)."""
    return options.surrogate.token_local


class _Reduced(NamedTuple):
    loss: torch.Tensor  # () or (B, T) for "none"
    row_weights: torch.Tensor  # (B, 1) or (1, N): d loss / d s_it per token, negated


def _reduce_stage(
    surrogate: torch.Tensor,
    row_sums: torch.Tensor,
    counts: torch.Tensor,
    selection: torch.Tensor,
    spec: FusedSpec,
) -> _Reduced:
    """The loss ``-reduce(s)`` and its per-token weight, from :mod:`rlobjectives._core.reduction`.

    ``row_sums`` is ``(S,)``, or the 0-d total where the reduction has no per-row divisor.
    """
    if spec.reduction.reduction == "none":  # -s, +0.0 at unselected positions (s is +-0)
        ones = torch.ones((1, 1), dtype=spec.dtype, device=surrogate.device)
        return _Reduced(select_(surrogate.neg_(), selection), -ones)
    rows = spec.layout.num_sequences
    weights = row_weights(counts, spec.reduction, dtype=spec.dtype, batch=rows)
    if row_sums.ndim == 0 and weights.divisor is None:  # reduce_rows of the one total
        loss = -(row_sums / weights.denominator)
    else:
        loss = -reduce_rows(row_sums, weights)
    return _Reduced(loss, -token_gradient_weights(weights, spec.layout, spec.dtype))


class FusedForward(NamedTuple):
    """Result of :func:`fused_forward`."""

    loss: torch.Tensor  # () or (B, T) for reduction "none", computation dtype
    row_sums: torch.Tensor  # (S,) sum_t w_it s_it over each sequence's selected tokens
    diagnostics: torch.Tensor  # (9,) see PolicyLossDiagnostics (field order)
    coefficient: torch.Tensor  # (B, T) d (w s_it) / d log_probs_it, zero at unselected tokens
    row_weights: torch.Tensor  # (B, 1) or (1, N): d loss / d s_it


def fused_forward(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: FusedSpec,
    importance_weights: torch.Tensor | None = None,
) -> FusedForward:
    """The whole forward: values, diagnostics and the gradient coefficient, no autograd graph.

    ``importance_weights`` (``(B, 1)`` or ``(B, T)``, constants) multiply the per-token
    surrogate. Temporaries are updated in place where possible: on CPU a fresh ``(B, T)``
    buffer costs page faults, often more than the arithmetic.
    """
    dtype = spec.dtype
    selected = mask_bits(mask, dtype)  # (B, T) all ones where selected (never modified)
    per_row = _per_row_sums_needed(spec)
    # (S,) selected tokens per sequence; their total as (1,) where no per-row count is needed
    if per_row:
        counts = spec.layout.row_counts(mask)
        count = counts.sum()
    else:
        count = count_bits(selected)
        counts = count.reshape(1)
    # (B, 1) or (B, T); never selected itself: every product with it is selected afterwards.
    advantages = advantages.to(dtype)
    weighted = advantages
    if importance_weights is not None:  # the one extra (B, T) pass of the importance weights
        weighted = advantages * importance_weights.to(dtype)
    stage = _log_ratio_stage(log_probs, old_log_probs, selected, counts, spec)
    kl_sums = (stage.approx_kl_k1, stage.approx_kl_k3)
    bits = Bits(dtype, log_probs.device)
    ratio = _ratio_stage(stage, bits, spec)
    del stage  # the log-ratio buffer is spent
    stage_inputs = StageInputs(
        ratio.ratio,
        advantages,
        weighted,
        selected,
        ratio.fired,
        mask,
        log_probs,
        count,
        bits,
        dtype,
    )
    surrogate = spec.options.surrogate.stage(stage_inputs)
    values, selection = surrogate.values, surrogate.selection
    if per_row or spec.row_sums:
        row_sums = spec.layout.row_sums(values)  # (S,)
        reduced = _reduce_stage(values, row_sums, counts, selection, spec)
    else:  # the loss needs the total only (a 0-d sum); the unused row sums output is zeros
        reduced = _reduce_stage(values, values.sum(), counts, selection, spec)
        row_sums = values.new_zeros(spec.layout.num_sequences)
    counted = [*surrogate.clip, surrogate.dual, ratio.bound_fired]
    sums = [surrogate.ratio_sum, *kl_sums, surrogate.weight_sum]
    diagnostics = _diagnostics(counted, sums, count, spec)
    return FusedForward(
        reduced.loss, row_sums, diagnostics, surrogate.coefficient, reduced.row_weights
    )


def _per_row_sums_needed(spec: FusedSpec) -> bool:
    """Whether the math needs per-sequence counts and sums (always cheap when padded).

    A packed layout computes segment sums only for GSPO (the sequence log-ratio) and
    ``sequence_mean`` (the per-sequence divisors); the other reductions need totals.
    """
    return (
        spec.layout.sequence_ids is None
        or spec.options.ratio_level == "sequence"
        or spec.reduction.reduction == "sequence_mean"
    )


def _diagnostics(
    counts: list[torch.Tensor], sums: list[torch.Tensor], selected: torch.Tensor, spec: FusedSpec
) -> torch.Tensor:
    """The nine diagnostics as one ``(9,)`` tensor (PolicyLossDiagnostics field order).

    ``counts`` are the five token counts (out of band, low, high, dual, bound fired) and
    ``sums`` the sums of ``r``, ``-Delta``, ``expm1(Delta) - Delta`` and the advantage factor
    over the selected tokens.
    """
    dtype = spec.dtype
    if spec.diagnostics_normalizer is None:
        denominator = selected.to(dtype).clamp(min=1)
    else:  # an explicit normaliser is honoured exactly
        denominator = _as_tensor(spec.diagnostics_normalizer, sums[0])
    # One stack: integer counts convert to the sums' float dtype on the way (exactly as .to).
    return torch.stack([*counts, *sums]).to(dtype) / denominator


class ClippedSurrogateFunction(torch.autograd.Function):
    """Fused token-local surrogate: ``(loss, row_sums, diagnostics)``, one-multiply backward.

    ``forward(log_probs, old_log_probs, advantages, mask, spec, importance_weights)``; only
    ``log_probs`` receives a gradient (``old_log_probs``, ``advantages`` and the importance
    weights, None or a tensor, are constants of the policy loss).
    """

    @staticmethod
    def forward(
        ctx: Any,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        spec: FusedSpec,
        importance_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        out = fused_forward(log_probs, old_log_probs, advantages, mask, spec, importance_weights)
        # The sequence ids serve the row sums' gradient only: not kept when the caller discards
        # the row sums (policy_loss), so a packed row saves what a padded one does per token.
        ids = spec.layout.sequence_ids if spec.row_sums else None
        ctx.save_for_backward(out.coefficient, mask, out.row_weights, ids)
        ctx.per_token = spec.reduction.reduction == "none"
        ctx.row_sums = spec.row_sums  # False: the row sums output is discarded (no gradient)
        ctx.input_dtype = log_probs.dtype
        ctx.mark_non_differentiable(out.diagnostics)
        # An unused output gets None, not zeros: a packed layout's (1, N) broadcast of the row
        # sums' gradient is skipped when only the loss is differentiated.
        ctx.set_materialize_grads(False)
        return out.loss, out.row_sums, out.diagnostics

    @staticmethod
    def backward(
        ctx: Any,
        grad_loss: torch.Tensor | None,
        grad_row_sums: torch.Tensor | None,
        grad_diagnostics: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        """The backward pass (see the class docstring)."""
        coefficient, mask, row_weights, sequence_ids = ctx.saved_tensors
        if grad_loss is None and (grad_row_sums is None or not ctx.row_sums):
            return None, None, None, None, None, None
        differentiable = torch.is_grad_enabled()  # backward(create_graph=True)
        with torch.no_grad():
            # (B, T) for reduction "none", else (B, 1), (1, N) or (1, 1)
            if grad_loss is not None:
                scale = grad_loss * row_weights
            else:
                scale = torch.zeros((), dtype=coefficient.dtype, device=coefficient.device)
            # (torch.compile materialises the gradient of an unused output as zeros.)
            if grad_row_sums is not None and ctx.row_sums:
                layout = Layout(grad_row_sums.shape[0], sequence_ids)
                scale = scale + layout.expand(grad_row_sums)
            grad = coefficient * scale  # (B, T)
            if ctx.per_token:
                grad = select(grad, mask_bits(mask, coefficient.dtype))
            grad = grad.to(ctx.input_dtype)
        if differentiable and not torch.compiler.is_compiling():
            # The gradient is not differentiable: differentiating it raises this error (the
            # mechanism of torch.autograd.function.once_differentiable, made unconditional).
            grad = torch._C._functions.DelayedError(_DOUBLE_BACKWARD_ERROR, 1)(
                grad.detach().requires_grad_(True)
            )
        return grad, None, None, None, None, None


_DOUBLE_BACKWARD_ERROR = (
    b"rlobjectives: the fused policy loss (policy_loss / grpo_clipped_surrogate) supports "
    b"first-order gradients only"
)


def entropy_term(call: PolicyCall) -> torch.Tensor | None:
    """The bonus's per-token loss ``-entropy_coef * H`` ``(B, T)`` (0 at unselected), or None."""
    entropy, coef = call.inputs.entropy, call.entropy_coef
    if entropy is None or (not isinstance(coef, torch.Tensor) and coef == 0.0):
        return None
    selected = masked_fill_zero(entropy.to(call.inputs.dtype), call.inputs.mask)  # (B, T)
    return -coef * selected


def _finish(
    call: PolicyCall,
    loss: torch.Tensor,
    per_token: torch.Tensor | None,
    diagnostics: PolicyLossDiagnostics,
) -> PolicyLossOutput:
    """Add the entropy bonus; the per-token loss (if kept) and the loss in the output dtype."""
    bonus = entropy_term(call)
    if per_token is not None:  # the loss is the reduction of the per-token loss
        if bonus is not None:
            per_token = per_token + bonus
        none = call.reduction.reduction == "none"  # per_token is zero at unselected tokens
        loss = (
            per_token if none else reduce(per_token, call.inputs.mask, call.reduction, call.layout)
        )
    elif bonus is not None:
        loss = loss + reduce(bonus, call.inputs.mask, call.reduction, call.layout)
    output_dtype = call.inputs.output_dtype
    per_token = None if per_token is None else per_token.to(output_dtype)
    return PolicyLossOutput(loss.to(output_dtype), per_token, diagnostics)


def run_fused(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """:func:`policy_loss` through :class:`~rlobjectives.policy.fused.ClippedSurrogateFunction`."""
    inputs = call.inputs
    reduction = call.reduction
    per_token_wanted = return_per_token or reduction.reduction == "none"
    if per_token_wanted:  # the per-token loss is the "none" reduction; reduce it afterwards
        reduction = reduction._replace(reduction="none")
    spec = FusedSpec(
        call.options, reduction, call.diagnostics_normalizer, inputs.dtype, call.layout, False
    )
    loss, _, diagnostics = ClippedSurrogateFunction.apply(  # type: ignore[no-untyped-call]
        inputs.log_probs,
        inputs.old_log_probs,
        inputs.advantages,
        inputs.mask,
        spec,
        inputs.importance_weights,
    )
    per_token = loss if per_token_wanted else None  # (B, T), zeros at unselected tokens
    named = PolicyLossDiagnostics(*diagnostics.unbind())
    output = _finish(call, loss, per_token, named)
    return output if return_per_token else output._replace(per_token_loss=None)
