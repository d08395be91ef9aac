r"""The policy loss :func:`policy_loss`: validate once, then one formula, one path.

.. math::

    \Delta = \ell - \ell^{old}\ (\text{selected}), \quad x = \mathrm{clip}(\Delta, -b, b), \quad
    L_{it} = -w_{it}\, s(x, A)_{it} - \beta H_{it}, \quad \mathcal{L} = \mathrm{reduce}(L),

with :math:`s` the surrogate object's formula (:mod:`rlobjectives.policy.surrogates`) and
autograd for every gradient. :func:`policy_terms` is the elementwise part (selection, the log
ratio, the formula, the diagnostics' sums); with ``RLOBJECTIVES_COMPILE=1`` it runs under
``torch.compile`` (dynamic shapes, compiled once per surrogate; eager where no compiler works).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from .._core.compiled import compiled
from .._core.layout import Layout, token_ndim, token_output
from .._core.reduction import Reduction, clamp, masked_fill_zero, reduce_pieces
from .._core.validation import (
    ArrayLike,
    Scalar,
    checks_environment,
    environment,
    validate_bool,
)
from .call import (
    PolicyCall,
    PolicyInputs,
    PolicyLossDiagnostics,
    PolicyLossOutput,
    RatioLevel,
    SurrogateChoice,
    SurrogateOptions,
    validate_policy_call,
    validate_surrogate_options,
)
from .surrogates import PolicyTokens, Surrogate, SurrogateTerms

__all__ = [
    "policy_loss",
    "policy_terms",
    "policy_tokens",
    "run_policy",
    "surrogate_terms",
]

_NAMES = ("log_probs", "old_log_probs", "advantages", "mask")
# The bound of the diagnostic k3 estimate when the call disables the log-ratio bound.
DIAGNOSTIC_LOG_RATIO_BOUND = 20.0


@checks_environment
def policy_loss(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: SurrogateChoice = "clip",
    ratio_level: RatioLevel = "token",
    log_ratio_bound: Scalar | None = 20.0,
    importance_weights: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    entropy_coef: Scalar = 0.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    diagnostics_normalizer: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    return_per_token: bool = False,
    context_group: ProcessGroup | None = None,
    group_size: int | None = None,
    group_ids: ArrayLike | None = None,
) -> PolicyLossOutput:
    r"""Policy-gradient loss: PPO/GRPO/DAPO/GSPO clip, CISPO, SAPO, DPPO, ... or your own.

    .. math::

        L_{it} = -w_{it}\, s_{it}\big(\mathrm{clip}(\ell_{it} - \ell^{old}_{it}, -b, b),
        A_{it}\big) - \beta H_{it}, \qquad \mathcal{L} = \mathrm{reduce}_M(L),

    :math:`s` the ``surrogate`` object's formula (a :class:`~rlobjectives.Surrogate` of your own
    works the same), :math:`w` the importance weights, :math:`\beta` = ``entropy_coef``;
    autograd gives the gradient (``old_log_probs``, ``advantages``, the weights: constants).
    ``ratio_level="sequence"`` is GSPO: the sequence's mean log-ratio at every token,
    :math:`\ell - \mathrm{sg}(\ell) + \mathrm{sg}(\bar\Delta_i)`. Packed equals padded; under
    ``context_group`` every rank returns the unsplit call's loss (``docs/objectives/policy.md``).

    Args:
        log_probs: ``(B, T)`` current-policy log-probabilities (packed: ``(N,)`` or ``(1, N)``).
        old_log_probs: ``(B, T)`` behaviour-policy log-probabilities.
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (packed: ``(S,)`` or per token).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        surrogate: a surrogate object or its name (``"clip"``, ``"cispo"``, ...: its defaults).
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO; token-local surrogates).
        log_ratio_bound: :math:`b > 0` on the log-ratio before ``exp``, or None.
        importance_weights: ``(B,)``, ``(B, 1)`` or ``(B, T)`` constants multiplying the
            per-token surrogate loss (e.g. :func:`rlobjectives.rollout_correction`'s).
        entropy: ``(B, T)`` per-token entropies for the bonus (differentiable), or None.
        entropy_coef: :math:`\beta`; nonzero needs ``entropy``.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``,
            ``"length_weighted"``, ``"prompt_mean"`` or ``"none"`` (:func:`rlobjectives.aggregate`).
        normalizer: the denominator of micro-batch / rank-additive losses (global counts).
        max_response_length: Dr. GRPO's constant (default ``T``).
        diagnostics_normalizer: the denominator of the token diagnostics, used as given.
        cu_seqlens: ``(S + 1,)`` boundaries of packed sequences, or None (padded).
        return_per_token: also return the per-token loss.
        context_group: the process group holding the other tokens of the same sequences.
        group_size: the prompt groups (contiguous, of this size) of ``"prompt_mean"`` and of
            the group-level surrogates (:class:`~rlobjectives.REAL`), or ``group_ids``: one
            label per sequence ``(S,)``.
        group_ids: see ``group_size``.

    Returns:
        :class:`PolicyLossOutput` ``(loss, per_token_loss, diagnostics)`` in the dtype of
        ``log_probs``; the math runs in float32 (float64 when any floating input is).

    Raises:
        ValueError: mismatched shapes or devices, an unknown name, a ``ratio_level`` the
            surrogate does not take, a non-positive bound or normaliser, ``entropy_coef`` without
            ``entropy``, a malformed ``cu_seqlens`` (each message names the argument).
        TypeError: non-numeric inputs, or a ``surrogate`` that is neither a name nor an object.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 7, 9; Shao et al. 2024, GRPO,
        arXiv:2402.03300 Eq. 3; Zheng et al. 2025, GSPO, arXiv:2507.18071.

    Examples:
        >>> from rlobjectives import Clip
        >>> policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
        ...             torch.ones(1, 2, dtype=torch.bool), surrogate=Clip(low=0.2)).loss
        tensor(-1.)
    """
    call = validate_policy_call(
        (log_probs, old_log_probs, advantages, mask),
        _NAMES,
        options=validate_surrogate_options(
            surrogate=surrogate, ratio_level=ratio_level, log_ratio_bound=log_ratio_bound
        ),
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
        importance_weights=importance_weights,
        entropy=entropy,
        entropy_coef=entropy_coef,
        cu_seqlens=cu_seqlens,
        context_group=context_group,
        group_size=group_size,
        group_ids=group_ids,
    )
    validate_bool(return_per_token, "return_per_token")
    output = run_policy(call, return_per_token=return_per_token)
    if cu_seqlens is None or token_ndim(log_probs) != 1:
        return output
    per_token = output.per_token_loss  # packed (N,) inputs: per-token results as (N,)
    return output._replace(
        loss=token_output(output.loss, output.loss.ndim == 2),
        per_token_loss=None if per_token is None else token_output(per_token, True),
    )


def run_policy(call: PolicyCall, *, return_per_token: bool) -> PolicyLossOutput:
    """The loss of a validated call: the terms, the reduction, the bonus, the diagnostics."""
    inputs, layout = call.inputs, call.layout
    terms_of = policy_terms  # compiled on request, not under a context group or a user's compile
    if layout.context is None and not torch.compiler.is_compiling() and environment()[1]:
        terms_of = compiled(policy_terms, "the policy loss")
    terms = terms_of(inputs, call.options, layout)
    per_token, mask, reduction = terms.per_token_loss, inputs.mask, call.reduction
    entropy, coef = inputs.entropy, call.entropy_coef
    bonus = None
    if entropy is not None and (isinstance(coef, torch.Tensor) or coef != 0.0):
        bonus = -coef * masked_fill_zero(entropy.to(inputs.dtype), mask)  # (B, T)
        per_token = per_token + bonus
    pieces = [(per_token, mask)]  # the per-token loss over the call's tokens
    if terms.loss_mask is not None:  # M2PO: the surrogate over its kept tokens, the bonus not
        pieces = [(terms.per_token_loss, terms.loss_mask)]
        pieces += [] if bonus is None else [(bonus, mask)]
    extra = (terms.diagnostic_sums, torch.count_nonzero(mask))
    loss, (sums, count) = reduce_pieces(pieces, reduction, layout, inputs.dtype, extra)
    if call.diagnostics_normalizer is None:
        denominator = count.to(sums.dtype).clamp(min=1)
    else:  # an explicit normaliser is honoured exactly
        denominator = torch.as_tensor(call.diagnostics_normalizer, dtype=sums.dtype)
    diagnostics = PolicyLossDiagnostics(*(sums / denominator.to(sums.device)).unbind())
    output_dtype = inputs.output_dtype
    kept = per_token.to(output_dtype) if return_per_token else None
    return PolicyLossOutput(loss.to(output_dtype), kept, diagnostics)


class TokenTerms(NamedTuple):
    r"""The per-token loss ``-w s`` (0 at unselected tokens), the diagnostics' sums, the mask.

    ``diagnostic_sums`` is ``(10,)``: the counts of the five token sets (out of band, low, high,
    dual, bound fired), the sums of :math:`r`, :math:`-\Delta`, the k3 estimate and the weight
    :math:`w`, and the count of ``selected`` (:class:`PolicyLossDiagnostics` order), this
    rank's; ``loss_mask`` the tokens the surrogate is reduced over (M2PO), else None.
    """

    per_token_loss: torch.Tensor
    diagnostic_sums: torch.Tensor
    loss_mask: torch.Tensor | None


def policy_tokens(
    inputs: PolicyInputs, options: SurrogateOptions, layout: Layout
) -> tuple[PolicyTokens, torch.Tensor, torch.Tensor]:
    r"""What the surrogate sees, the raw log-ratio :math:`\Delta` and the unbounded one.

    Unselected tokens become exact zeros before any arithmetic (log-ratio 0, advantage 0), so
    NaN/inf there reaches neither the values nor the gradients.
    """
    dtype, mask = inputs.dtype, inputs.mask
    log_probs = masked_fill_zero(inputs.log_probs.to(dtype), mask)  # (B, T)
    old_log_probs = masked_fill_zero(inputs.old_log_probs.to(dtype), mask)
    advantages = masked_fill_zero(inputs.advantages.to(dtype), mask)
    log_ratio = log_probs - old_log_probs  # (B, T), raw Delta
    x = log_ratio
    if options.ratio_level == "sequence":  # GSPO: l - sg(l) + sg(mean_t Delta) per sequence
        sums, counts = layout.combine(
            layout.local_row_sums(log_ratio.detach()), layout.local_row_counts(mask)
        )  # (S,) each: whole sequences
        mean = layout.expand(sums / counts.clamp(min=1).to(dtype))  # (B, 1) or (1, N)
        x = masked_fill_zero(log_probs - log_probs.detach() + mean, mask)
    bound = options.log_ratio_bound
    bounded = x if bound is None else clamp(x, -bound, bound)  # (B, T)
    weights = inputs.importance_weights
    tokens = PolicyTokens(
        bounded, advantages, log_probs, old_log_probs, mask, layout,
        None if weights is None else weights.to(dtype), inputs.sequence_weights, inputs.groups,
    )  # fmt: skip
    return tokens, log_ratio, log_ratio if x is log_ratio else x.detach()


def policy_terms(inputs: PolicyInputs, options: SurrogateOptions, layout: Layout) -> TokenTerms:
    """The surrogate's formula on the call's tokens, the per-token loss, the diagnostics' sums."""
    tokens, log_ratio, unbounded = policy_tokens(inputs, options, layout)
    surrogate, weights, mask = options.surrogate, tokens.importance_weights, tokens.mask
    terms = surrogate_terms(surrogate, tokens)
    per_token = -terms.values
    if weights is not None and not surrogate.folds_importance_weights:
        per_token = per_token * masked_fill_zero(weights, mask)  # NaN-proof weights
    per_token = masked_fill_zero(per_token, mask)  # (B, T)
    with torch.no_grad():
        sums = _diagnostic_sums(terms, tokens, log_ratio, unbounded, options.log_ratio_bound)
    return TokenTerms(per_token, sums, terms.loss_mask)


def surrogate_terms(surrogate: Surrogate, tokens: PolicyTokens) -> SurrogateTerms:
    """``surrogate.terms(tokens)``; a class that writes only the token formula is called on it."""
    if type(surrogate).terms is not Surrogate.terms:
        return surrogate.terms(tokens)
    out = surrogate.surrogate(tokens.log_ratio, tokens.advantages)
    return out if isinstance(out, SurrogateTerms) else SurrogateTerms(out)


def _diagnostic_sums(
    terms: SurrogateTerms,
    tokens: PolicyTokens,
    log_ratio: torch.Tensor,
    unbounded: torch.Tensor,
    bound: float | torch.Tensor | None,
) -> torch.Tensor:
    r"""The ``(10,)`` sums of :class:`TokenTerms` (the computation dtype).

    ``log_ratio``: the raw token :math:`\Delta`; ``unbounded``: the log-ratio before the
    bound (GSPO's sequence form); :math:`r = e^x` of the bounded one, the k3 estimate of the raw
    one bounded (at 20 without a bound).
    """
    mask, x = tokens.mask, tokens.log_ratio.detach()
    none = torch.zeros_like(mask)
    fired = none if bound is None else unbounded.abs() > bound  # NaN: not fired
    excess = torch.expm1(x)  # r - 1, exactly 0 at unselected tokens
    if bound is not None and unbounded is log_ratio:  # the token log-ratio, bounded: x itself
        kl_log_ratio, kl_excess = x, excess
    else:
        limit = DIAGNOSTIC_LOG_RATIO_BOUND if bound is None else bound
        kl_log_ratio = clamp(log_ratio, -limit, limit)
        kl_excess = torch.expm1(kl_log_ratio)
    weight = terms.weight
    if weight is None:  # s = w A: w = s / A, or r where A = 0
        nonzero = tokens.advantages != 0
        quotient = terms.values.detach() / torch.where(nonzero, tokens.advantages, 1.0)
        weight = torch.where(nonzero, quotient, excess + 1.0)
    sets = [terms.out_of_band, terms.below, terms.above, terms.dual, fired, terms.selected]
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    counts = []  # count_nonzero: a bool sum is several times slower, eager and compiled
    for flags in sets:
        count = zero if flags is None else torch.count_nonzero(flags & mask)
        counts.append(count.to(x.dtype))
    totals = [
        excess.sum() + torch.count_nonzero(mask),  # the sum of r over the selected tokens
        -log_ratio.sum(),  # k1
        (kl_excess - kl_log_ratio).sum(),  # k3 = r - 1 - log r, without cancellation
        masked_fill_zero(weight.to(x.dtype), mask).sum(),
    ]
    return torch.stack([*counts[:5], *totals, counts[5]])
