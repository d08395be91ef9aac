r"""The policy surrogate as a readable specification (the autograd path of the policy loss).

Each step is one function, in plain ``torch`` with autograd doing the derivatives:

1. :func:`token_log_ratios`: :math:`\Delta = \ell - \ell^{old}` on selected tokens (exact zeros
   elsewhere, before any arithmetic), the GSPO sequence form, the bound :math:`|\Delta| \le b`
   and the ratio :math:`r = e^{\Delta}`;
2. :func:`clip_surrogate`: :math:`s = \min(rA, \mathrm{clip}(r, 1-\epsilon_l, 1+\epsilon_h) A)`,
   then the dual clip :math:`\max(s, cA)` for :math:`A < 0`;
3. :func:`surrogate_diagnostics`: the named, detached diagnostics.

:mod:`rlobjectives._fused` computes the same values and gradients in one pass without autograd
and is tested against this module; the hidden-state path uses the fused path's per-token
coefficient. A new surrogate is a new function next to :func:`clip_surrogate`, with its
closed-form gradient in the fused path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._layout import Layout
from ._masking import clamp, masked_fill_zero
from ._policy_args import PolicyInputs, PolicyLossDiagnostics, SurrogateOptions

__all__ = [
    "DIAGNOSTIC_LOG_RATIO_BOUND",
    "LogRatios",
    "PolicyTerms",
    "clip_surrogate",
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
        counts = layout.row_counts(mask).clamp(min=1).to(dtype)  # (S,)
        sequence_mean = (layout.row_sums(log_ratio) / counts).detach()  # (S,)
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
    return LogRatios(log_ratio, torch.exp(bounded), bound_fired, advantages)


class ClipSurrogate(NamedTuple):
    """Step 2: the surrogate ``s`` and its value before the dual clip, ``(B, T)``."""

    values: torch.Tensor
    before_dual_clip: torch.Tensor
    band: tuple[float | torch.Tensor, float | torch.Tensor] | None  # (1 - eps_l, 1 + eps_h)


def clip_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, options: SurrogateOptions
) -> ClipSurrogate:
    r"""Step 2: :math:`\min(rA, \mathrm{clip}(r)A)`, then :math:`\max(s, cA)` where :math:`A<0`."""
    unclipped = ratio * advantages  # (B, T)
    band = None
    surrogate = unclipped
    if options.clip_low is not None:
        high = options.clip_low if options.clip_high is None else options.clip_high
        band = (1.0 - options.clip_low, 1.0 + high)
        clipped = clamp(ratio, *band) * advantages  # (B, T)
        surrogate = torch.minimum(unclipped, clipped)  # (B, T)
    before_dual = surrogate
    if options.dual_clip is not None:
        # Dual clip (Ye et al. 2020): for A < 0 the surrogate is bounded below by c * A.
        surrogate = torch.where(
            advantages < 0, torch.maximum(surrogate, options.dual_clip * advantages), surrogate
        )
    return ClipSurrogate(surrogate, before_dual, band)


@torch.no_grad()
def surrogate_diagnostics(
    ratios: LogRatios,
    surrogate: ClipSurrogate,
    mask: torch.Tensor,
    options: SurrogateOptions,
    normalizer: float | torch.Tensor | None,
) -> PolicyLossDiagnostics:
    """Step 3: the diagnostics (see :class:`PolicyLossDiagnostics`), detached."""
    dtype = ratios.ratio.dtype
    advantages, ratio = ratios.advantages, ratios.ratio.detach()
    if normalizer is None:
        denominator = mask.sum().to(dtype).clamp(min=1)
    else:  # an explicit normaliser is honoured exactly
        denominator = torch.as_tensor(normalizer, dtype=dtype, device=mask.device)

    def fraction(condition: torch.Tensor) -> torch.Tensor:
        return (condition & mask).sum().to(dtype) / denominator

    def mean(values: torch.Tensor) -> torch.Tensor:
        return masked_fill_zero(values, mask).sum() / denominator

    zero = torch.zeros((), dtype=dtype, device=mask.device)
    clipped = clip_low = clip_high = dual = zero
    if surrogate.band is not None:
        below, above = ratio < surrogate.band[0], ratio > surrogate.band[1]
        clipped = fraction(below | above)
        clip_low = fraction(below & (advantages < 0))
        clip_high = fraction(above & (advantages > 0))
    if options.dual_clip is not None:
        before = surrogate.before_dual_clip.detach()
        dual = fraction((advantages < 0) & (before < options.dual_clip * advantages))
    bound = (
        DIAGNOSTIC_LOG_RATIO_BOUND if options.log_ratio_bound is None else options.log_ratio_bound
    )
    kl_log_ratio = clamp(ratios.log_ratio.detach(), -bound, bound)  # (B, T)
    return PolicyLossDiagnostics(
        clipped_fraction=clipped,
        clip_fraction_low=clip_low,
        clip_fraction_high=clip_high,
        dual_clip_fraction=dual,
        log_ratio_bound_fraction=fraction(ratios.bound_fired),
        ratio_mean=mean(ratio),
        approx_kl_k1=mean(-ratios.log_ratio.detach()),
        approx_kl_k3=mean(torch.expm1(kl_log_ratio) - kl_log_ratio),
    )


class PolicyTerms(NamedTuple):
    """Per-token loss ``-s`` ``(B, T)`` (zeros at unselected tokens) and diagnostics."""

    per_token_loss: torch.Tensor
    diagnostics: PolicyLossDiagnostics


def policy_terms(
    inputs: PolicyInputs,
    options: SurrogateOptions,
    diagnostics_normalizer: float | torch.Tensor | None,
    layout: Layout,
) -> PolicyTerms:
    """Steps 1-3: the per-token clipped surrogate loss and the diagnostics, in autograd."""
    ratios = token_log_ratios(inputs, options, layout)
    surrogate = clip_surrogate(ratios.ratio, ratios.advantages, options)
    per_token_loss = masked_fill_zero(-surrogate.values, inputs.mask)  # (B, T)
    diagnostics = surrogate_diagnostics(
        ratios, surrogate, inputs.mask, options, diagnostics_normalizer
    )
    return PolicyTerms(per_token_loss, diagnostics)
