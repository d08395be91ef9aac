r"""Fused forward/backward of the token-local policy surrogates, as named stages.

:class:`ClippedSurrogateFunction` computes, in one forward pass over the ``(B, T)`` inputs and
without an autograd graph, the surrogate :math:`s`, its reduction, the ten diagnostics and the
gradient coefficient :math:`c_{it} = \partial (w s_{it}) / \partial \ell_{it}`; the backward is
one multiplication, :math:`\partial \mathcal{L} / \partial \ell_{it} = c_{it} \cdot
\partial \mathcal{L} / \partial s_{it}` (the reduction's per-token weight). It saves one float
``(B, T)`` tensor (the coefficient) plus the mask and a ``(B, 1)`` weight, where autograd keeps
about six ``(B, T)`` tensors.

The stages of :func:`fused_forward`, each the formula it names:

1. :func:`_log_ratio_stage`: :math:`\Delta = \ell - \ell^{old}` where the mask selects a token,
   exactly 0 elsewhere (``torch.where``, before any arithmetic: NaN/inf at unselected positions
   reach no value, diagnostic or gradient); GSPO's sequence form; the k1 and k3 sums
   (:math:`e^{\Delta} - 1 - \Delta` as ``expm1``: no cancellation near on-policy);
2. :func:`_ratio_stage`: :math:`r = \exp(\mathrm{clip}(\Delta, -b, b))` (1 at unselected
   tokens) and where the bound held, :math:`|\Delta| \le b`: ``torch.clamp`` passes the
   gradient there only (closed interval);
3. the surrogate object's fused stage (:meth:`rlobjectives.Clip.stage`, ``CISPO.stage``,
   ``SAPO.stage`` in :mod:`rlobjectives.policy.surrogates`): the values :math:`\tilde A\,
   s(r)` with :math:`\tilde A = wA` (importance weights times the advantage, selected), the
   coefficient and the counts of the clip diagnostics;
4. :func:`_reduce_stage`: the loss through :mod:`rlobjectives._core.reduction` (``row_weights``,
   the same per-row weights every path uses); a packed row computes per-sequence counts and
   segment sums only where the loss needs them (GSPO and ``sequence_mean``);
5. :func:`_diagnostics`: the ten sums over the selected-token count (or the caller's
   ``diagnostics_normalizer``).

The math is that of the objects' formulas (the readable autograd specification of
:mod:`rlobjectives.policy.specification`, which it is tested against), with autograd's
conventions: ``torch.clamp`` passes the gradient on the closed interval (ratio band and
log-ratio bound); in the band ``torch.minimum`` sees a tie of two equal products whose halves
add up to the full gradient; at an exact dual-clip tie :math:`r = c` ``torch.maximum`` passes
half, and so does the fused path. NaN at a selected position propagates to the loss.

Differences from the autograd path (at measure-zero or non-finite inputs only): clipping is
decided on the ratio (:math:`r < L` or :math:`r > H`, the rule of
:func:`rlobjectives.policy.surrogates.clip.clip_decisions`), where autograd compares the rounded
products :math:`rA` and :math:`\mathrm{clip}(r)A` (they can tie when :math:`r` is within an ulp
of an edge or :math:`|A|` is tiny: autograd then passes half the gradient, the fused path none);
a NaN log-ratio counts as out of its bound in the diagnostics; the final sums are ordered
differently (rounding); double backward raises (first-order gradients only).

Implementation notes (CPU speed; the same code traces under ``torch.compile(fullgraph=True)``):
temporaries are reused through ``out=`` and in-place operations, because on CPU a fresh
``(B, T)`` buffer costs page faults that often exceed the arithmetic, and the decisions are
float indicators (``torch.lt(r, L, out=buffer)``: 1.0 where the clip binds), which sum and
multiply in vectorised float loops where bool tensors take scalar loops.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

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


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


class _LogRatios(NamedTuple):
    log_ratio: torch.Tensor  # (B, T) Delta (GSPO: the sequence's) at selected tokens, 0 elsewhere
    clamped: torch.Tensor | None  # clamp(Delta, -b, b) at token level with a bound (k3's too)
    approx_kl_k1: torch.Tensor  # () sum of -Delta
    approx_kl_k3: torch.Tensor  # () sum of expm1(Delta) - Delta (Delta within the bound)


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
    mask: torch.Tensor,
    counts: torch.Tensor,
    spec: FusedSpec,
) -> tuple[_LogRatios, torch.Tensor]:
    r""":math:`\Delta = \ell - \ell^{old}` at selected tokens (0 elsewhere), GSPO, k1 and k3.

    ``counts`` are this rank's ``(S,)`` selected tokens per sequence; returned are the
    log-ratios and the counts of the whole sequences where GSPO needed them (under context
    parallelism summed over the group in the same all-reduce as the log-ratio sums), else
    ``counts`` unchanged.
    """
    dtype, options = spec.dtype, spec.options
    delta = _difference(log_probs, old_log_probs, dtype)  # (B, T), a fresh buffer
    zero = _zero(delta)
    log_ratio = torch.where(mask, delta, zero, out=delta)  # (B, T)
    approx_kl_k1 = -log_ratio.sum()
    bound = options.log_ratio_bound
    kl_bound = DIAGNOSTIC_LOG_RATIO_BOUND if bound is None else bound
    kl_log_ratio = clamp(log_ratio, -kl_bound, kl_bound)  # (B, T)
    # k3 = r - 1 - log r as expm1(Delta) - Delta: no cancellation near on-policy.
    approx_kl_k3 = torch.expm1(kl_log_ratio).sub_(kl_log_ratio).sum()
    if options.ratio_level == "token":
        # With a log-ratio bound, the ratio's clamp is this one: computed once.
        clamped = None if bound is None else kl_log_ratio
        return _LogRatios(log_ratio, clamped, approx_kl_k1, approx_kl_k3), counts
    # GSPO: value log s_i (the mean selected log-ratio of the sequence) at every selected token,
    # gradient 1 w.r.t. log_probs (the stop-gradient form); (l - l) keeps NaN/inf of l.
    layout = spec.layout
    sums, counts = layout.combine(layout.local_row_sums(log_ratio), counts)  # whole sequences
    sequence_log_ratio = layout.expand(sums / counts.clamp(min=1).to(dtype))  # (B, 1)
    value = torch.sub(log_probs, log_probs, out=kl_log_ratio).add_(sequence_log_ratio)
    token_log_ratio = torch.where(mask, value, zero, out=value)  # (B, T)
    return _LogRatios(token_log_ratio, None, approx_kl_k1, approx_kl_k3), counts


class _Ratios(NamedTuple):
    ratio: torch.Tensor  # (B, T) exp(clamp(Delta, -b, b)), 1 at unselected tokens
    passes: torch.Tensor | None  # (B, T) 1.0 where |Delta| <= b (the gradient passes), else 0.0
    bound_fired: torch.Tensor  # () tokens where the bound fired


def _ratio_stage(log_ratios: _LogRatios, spec: FusedSpec) -> _Ratios:
    r""":math:`r = \exp(\mathrm{clip}(\Delta, -b, b))`, and where :math:`|\Delta| \le b` held.

    ``torch.clamp`` passes no gradient where the bound fired: the surrogate stage multiplies its
    coefficient by ``passes`` (a float indicator; a NaN log-ratio is out of its bound and its
    NaN ratio is replaced by 0 in the coefficient, so that the gradient there is exactly 0, as
    autograd's). Consumes the stage's buffers: the clamped log-ratio becomes the ratio, the
    log-ratio the indicator ``passes``.
    """
    log_ratio, bound = log_ratios.log_ratio, spec.options.log_ratio_bound
    if bound is None:
        none = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        return _Ratios(log_ratio.exp(), None, none)
    clamped = log_ratios.clamped
    if clamped is None:
        clamped = clamp(log_ratio, -bound, bound)
    ratio = clamped.exp_()  # (B, T)
    # 1.0 where |Delta| <= b (a NaN log-ratio: 0.0, out of its bound), in the spent buffer
    passes = torch.le(log_ratio.abs_(), _as_tensor(bound, log_ratio), out=log_ratio)
    fired = passes.numel() - passes.sum()  # unselected tokens have Delta = 0: they pass
    return _Ratios(ratio, passes, fired)


def has_fused_stage(options: SurrogateOptions) -> bool:
    """Whether the fused path computes ``options.surrogate`` (the token-local surrogates)."""
    return options.surrogate.token_local


class _Reduced(NamedTuple):
    loss: torch.Tensor  # () or (B, T) for "none"
    row_weights: torch.Tensor  # (B, 1) or (1, N): d loss / d s_it per token, negated


def _reduce_stage(
    values: torch.Tensor,
    row_sums: torch.Tensor,
    counts: torch.Tensor,
    mask: torch.Tensor,
    spec: FusedSpec,
) -> _Reduced:
    """The loss ``-reduce(s)`` and its per-token weight, from :mod:`rlobjectives._core.reduction`.

    ``row_sums`` is ``(S,)``, or the 0-d total where the reduction has no per-row divisor.
    """
    if spec.reduction.reduction == "none":  # -s, and +0.0 at unselected positions
        ones = torch.ones((1, 1), dtype=spec.dtype, device=values.device)
        return _Reduced(torch.where(mask, values.neg_(), _zero(values), out=values), -ones)
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
    diagnostics: torch.Tensor  # (10,) see PolicyLossDiagnostics (field order)
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
    r"""The whole forward: values, diagnostics and the gradient coefficient, no autograd graph.

    ``importance_weights`` (``(B, 1)`` or ``(B, T)``, constants) multiply the per-token
    surrogate: :math:`\tilde A = wA`, selected once (exact zeros at unselected tokens, whatever
    the advantages or weights hold there); the clip decisions use the signs of :math:`A`.
    """
    dtype, layout = spec.dtype, spec.layout
    per_row = _per_row_sums_needed(spec)
    # (S,) this rank's selected tokens per sequence; their total as (1,) where no per-row count
    # is needed (the stage reads this rank's count; the reduction and the diagnostics the
    # counts of the whole sequences, summed over a context group below)
    if per_row:
        counts = layout.local_row_counts(mask)
        count = counts.sum()
    else:
        count = mask.sum()
        counts = count.reshape(1)
    advantages = advantages.to(dtype)  # (B, 1) or (B, T), the signs of the decisions
    weighted = advantages
    if importance_weights is not None:
        weighted = advantages * importance_weights.to(dtype)
    log_ratios, whole_counts = _log_ratio_stage(log_probs, old_log_probs, mask, counts, spec)
    kl_sums = (log_ratios.approx_kl_k1, log_ratios.approx_kl_k3)
    surrogate = spec.options.surrogate
    # the raw selected log-ratio for the stages that read it (DPPO, DRO): a copy, since the
    # ratio stage spends the buffer
    raw = log_ratios.log_ratio.clone() if surrogate.needs_log_ratio else None
    ratios = _ratio_stage(log_ratios, spec)
    del log_ratios  # the log-ratio buffers are spent
    selected = torch.where(mask, weighted, _zero(weighted))  # (B, T) A~, 0 at unselected tokens
    stage = surrogate.stage(
        StageInputs(
            ratio=ratios.ratio,
            advantages=advantages,
            weighted=selected,
            mask=mask,
            passes=ratios.passes,
            log_probs=log_probs,
            selected_count=count,
            dtype=dtype,
            old_log_probs=old_log_probs,
            importance_weights=importance_weights,
            log_ratio=raw,
        )
    )
    values = stage.values
    counted = [*stage.clip, stage.dual, ratios.bound_fired]
    sums = [stage.ratio_sum, *kl_sums, stage.weight_sum]
    # (10,) the diagnostics' sums: the counts convert to the sums' float dtype (exactly as .to);
    # the last, selected_fraction's, is 0 (the token-local surrogates select no tokens)
    sums.append(_zero(stage.ratio_sum))
    diagnostic_sums = torch.stack([value.to(dtype) for value in counted] + sums)
    rows = per_row or spec.row_sums
    # (S,) row sums, or the 0-d total where the loss needs the total only
    totals = layout.local_row_sums(values) if rows else values.sum()
    if layout.context is not None:  # one all-reduce of everything the rest reads
        if whole_counts is counts and per_row:
            totals, diagnostic_sums, counts, count = layout.combine(
                totals, diagnostic_sums, counts, count
            )
        else:  # only the total count is needed, or GSPO summed the counts already
            totals, diagnostic_sums, count = layout.combine(totals, diagnostic_sums, count)
            counts = count.reshape(1) if whole_counts is counts else whole_counts
    elif whole_counts is not counts:
        counts = whole_counts
    reduced = _reduce_stage(values, totals, counts, mask, spec)
    row_sums = totals if rows else values.new_zeros(layout.num_sequences)
    diagnostics = _diagnostics(diagnostic_sums, count, spec)
    return FusedForward(reduced.loss, row_sums, diagnostics, stage.coefficient, reduced.row_weights)


def _per_row_sums_needed(spec: FusedSpec) -> bool:
    """Whether the math needs per-sequence counts and sums (always cheap when padded).

    A packed layout computes segment sums only for GSPO (the sequence log-ratio) and
    ``sequence_mean`` (the per-sequence divisors); the other reductions need totals. Under
    context parallelism neither does a padded one: the token-local reductions then send only
    scalars (the total and the count) to the other ranks, never ``(S,)`` sums.
    """
    layout = spec.layout
    return (
        (layout.sequence_ids is None and layout.context is None)
        or spec.options.ratio_level == "sequence"
        or spec.reduction.reduction == "sequence_mean"
    )


def _diagnostics(sums: torch.Tensor, selected: torch.Tensor, spec: FusedSpec) -> torch.Tensor:
    """The ten diagnostics as one ``(10,)`` tensor (PolicyLossDiagnostics field order).

    ``sums`` holds the five token counts (out of band, low, high, dual, bound fired), the
    sums of ``r``, ``-Delta``, ``expm1(Delta) - Delta`` and the advantage factor over the
    selected tokens, and 0 for ``selected_fraction`` (the token-local surrogates select no
    tokens of the batch); ``selected`` is the selected-token count (the default denominator).
    """
    if spec.diagnostics_normalizer is None:
        denominator = selected.to(spec.dtype).clamp(min=1)
    else:  # an explicit normaliser is honoured exactly
        denominator = _as_tensor(spec.diagnostics_normalizer, sums)
    return sums / denominator


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
            if ctx.per_token:  # the upstream gradient of unselected positions reaches nothing
                grad = torch.where(mask, grad, _zero(grad), out=grad)
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
