r"""The policy surrogate as a readable specification (the autograd path of the policy loss).

Each step is one function, in plain ``torch`` with autograd doing the derivatives:

1. :func:`token_log_ratios`: :math:`\Delta = \ell - \ell^{old}` on selected tokens (exact zeros
   elsewhere, before any arithmetic), the GSPO sequence form, the bound :math:`|\Delta| \le b`
   and the ratio :math:`r = e^{\Delta}`;
2. the surrogate object's formula (``Clip.formula``, ``CISPO.formula``, ... in
   :mod:`rlobjectives.policy.surrogates`); the per-token loss is :math:`-w s` with the
   importance weights :math:`w` (VESPO folds them into its formula instead);
3. :func:`surrogate_diagnostics`: the named, detached diagnostics (over the call's selected
   tokens, also when the surrogate narrows the loss's selection: M2PO).

:mod:`rlobjectives.policy.fused` computes the same values and gradients of the token-local
surrogates in one pass without autograd and is tested against this module; the hidden-state
path uses the fused path's per-token coefficient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.layout import Layout
from .._core.reduction import clamp, masked_fill_zero
from .inputs import PolicyInputs, PolicyLossDiagnostics, SurrogateOptions
from .surrogates.base import FormulaTerms, SurrogateInputs

__all__ = [
    "DIAGNOSTIC_LOG_RATIO_BOUND",
    "LogRatios",
    "PolicyTerms",
    "policy_terms",
    "surrogate_diagnostics",
    "token_log_ratios",
]

# Bound used for the diagnostic k3 estimate when the caller disables the log-ratio bound.
DIAGNOSTIC_LOG_RATIO_BOUND = 20.0


class LogRatios(NamedTuple):
    """Step 1: log-ratios and ratios, ``(B, T)`` in the computation dtype."""

    log_ratio: torch.Tensor  # raw Delta on selected tokens, 0 elsewhere
    ratio: torch.Tensor  # exp of the (sequence-level, bounded) log-ratio, 1 at unselected tokens
    bound_fired: torch.Tensor  # bool, |log-ratio| > b on selected tokens
    advantages: torch.Tensor  # A, 0 at unselected tokens
    bounded_log_ratio: torch.Tensor  # log of ``ratio`` (with gradient), 0 at unselected tokens
    log_probs: torch.Tensor  # l on selected tokens, 0 elsewhere (with gradient)
    old_log_probs: torch.Tensor  # l_old on selected tokens, 0 elsewhere (constant)


def token_log_ratios(inputs: PolicyInputs, options: SurrogateOptions, layout: Layout) -> LogRatios:
    """Step 1: select, form the (GSPO) log-ratio, bound it and exponentiate."""
    dtype, mask = inputs.dtype, inputs.mask
    # Select before any arithmetic: unselected positions become exact zeros (log-ratio 0, ratio 1,
    # advantage 0), so NaN/inf there can reach neither the values nor the gradients.
    log_probs = masked_fill_zero(inputs.log_probs.to(dtype), mask)  # (B, T)
    old_log_probs = masked_fill_zero(inputs.old_log_probs.to(dtype), mask)  # (B, T)
    advantages = masked_fill_zero(inputs.advantages.to(dtype), mask)  # (B, T)
    log_ratio = log_probs - old_log_probs  # (B, T)
    if options.ratio_level == "token":
        token_log_ratio = log_ratio  # (B, T)
    else:
        # GSPO: log s_i = mean_t log_ratio over the selected tokens, in the stop-gradient form
        # log s_it = log pi_it - sg(log pi_it) + sg(log s_i): value log s_i at every token,
        # gradient d log s_it / d log pi_it = 1, which reproduces the GSPO gradient
        # s_i A_i (1/|y_i|) sum_t grad log pi_it under the sequence_mean reduction.
        sums, counts = layout.combine(  # whole sequences: one all-reduce under CP
            layout.local_row_sums(log_ratio.detach()), layout.local_row_counts(mask)
        )  # (S,) each
        sequence_mean = sums / counts.clamp(min=1).to(dtype)  # (S,), a constant
        sequence_log_ratio = layout.expand(sequence_mean)  # (B, 1)
        token_log_ratio = masked_fill_zero(
            log_probs - log_probs.detach() + sequence_log_ratio, mask
        )  # (B, T)
    bound = options.log_ratio_bound
    if bound is None:
        bounded = token_log_ratio
        bound_fired = torch.zeros_like(mask)
    else:
        bounded = clamp(token_log_ratio, -bound, bound)  # (B, T)
        bound_fired = mask & (token_log_ratio.detach().abs() > bound)  # (B, T)
    return LogRatios(
        log_ratio, torch.exp(bounded), bound_fired, advantages, bounded, log_probs, old_log_probs
    )


@torch.no_grad()
def surrogate_diagnostics(
    ratios: LogRatios,
    surrogate: FormulaTerms,
    mask: torch.Tensor,
    options: SurrogateOptions,
    normalizer: float | torch.Tensor | None,
    layout: Layout | None = None,
) -> PolicyLossDiagnostics:
    """Step 3: the diagnostics (see :class:`PolicyLossDiagnostics`), detached.

    Sums over the selected tokens divided by their count (or ``normalizer``); under context
    parallelism (``layout.context``) the sums and the count of every rank of the group (one
    all-reduce).
    """
    dtype = ratios.ratio.dtype

    def count(condition: torch.Tensor) -> torch.Tensor:
        return (condition & mask).sum().to(dtype)

    def total(values: torch.Tensor) -> torch.Tensor:
        return masked_fill_zero(values, mask).sum()

    bound = (
        DIAGNOSTIC_LOG_RATIO_BOUND if options.log_ratio_bound is None else options.log_ratio_bound
    )
    kl_log_ratio = clamp(ratios.log_ratio.detach(), -bound, bound)  # (B, T)
    selected_tokens = (
        torch.zeros((), dtype=dtype, device=mask.device)
        if surrogate.selected is None
        else count(surrogate.selected)
    )
    sums = torch.stack(
        [
            count(surrogate.out_of_band),
            count(surrogate.below),
            count(surrogate.above),
            count(surrogate.dual),
            count(ratios.bound_fired),
            total(ratios.ratio.detach()),
            total(-ratios.log_ratio.detach()),
            total(torch.expm1(kl_log_ratio) - kl_log_ratio),
            total(surrogate.weight.detach()),
            selected_tokens,
        ]
    )  # (10,) in PolicyLossDiagnostics order
    selected = mask.sum()
    if layout is not None:
        sums, selected = layout.combine(sums, selected)
    if normalizer is None:
        denominator = selected.to(dtype).clamp(min=1)
    else:  # an explicit normaliser is honoured exactly
        denominator = torch.as_tensor(normalizer, dtype=dtype, device=mask.device)
    return PolicyLossDiagnostics(*(sums / denominator).unbind())


class PolicyTerms(NamedTuple):
    """Per-token loss ``-w s`` ``(B, T)`` (zeros at unselected tokens) and diagnostics.

    ``loss_mask``: the tokens the surrogate is reduced over when it narrows the call's
    selection (M2PO's kept tokens; the per-token loss is 0 at the others), else None.
    """

    per_token_loss: torch.Tensor
    diagnostics: PolicyLossDiagnostics
    loss_mask: torch.Tensor | None = None


def policy_terms(
    inputs: PolicyInputs,
    options: SurrogateOptions,
    diagnostics_normalizer: float | torch.Tensor | None,
    layout: Layout,
) -> PolicyTerms:
    """Steps 1-3: the per-token surrogate loss and the diagnostics, in autograd.

    The importance weights (constants) multiply the per-token loss after the mask, before the
    reduction (TRL's ``per_token_loss * importance_sampling_ratio``), except for VESPO, whose
    formula takes them in log space.
    """
    mask, dtype = inputs.mask, inputs.dtype
    ratios = token_log_ratios(inputs, options, layout)
    weights = inputs.importance_weights
    weights = None if weights is None else weights.to(dtype)  # (B, 1) or (B, T)
    surrogate = options.surrogate.formula(
        SurrogateInputs(
            ratio=ratios.ratio,
            log_ratio=ratios.bounded_log_ratio,
            advantages=ratios.advantages,
            log_probs=ratios.log_probs,
            mask=mask,
            importance_weights=weights,
            layout=layout,
            sequence_weights=inputs.sequence_weights,
            old_log_probs=ratios.old_log_probs,
        )
    )
    per_token_loss = -surrogate.values  # (B, T)
    if weights is not None and not options.surrogate.folds_importance_weights:
        per_token_loss = per_token_loss * masked_fill_zero(weights, mask)  # NaN-proof weights
    per_token_loss = masked_fill_zero(per_token_loss, mask)  # (B, T)
    diagnostics = surrogate_diagnostics(
        ratios, surrogate, mask, options, diagnostics_normalizer, layout
    )
    return PolicyTerms(per_token_loss, diagnostics, surrogate.loss_mask)
