"""The policy loss (+ KL term, + entropy bonus) straight from hidden states and the LM head.

For a token-local surrogate the loss's derivative with respect to each token's log-probability
depends on that token and on the reduction's weights (known from the mask before the chunk
loop), so each chunk differentiates the same formula as :func:`rlobjectives.policy_loss` with
``torch.autograd.grad`` and forms ``grad_hidden`` and ``grad_weight`` right away, with no
recompute (Liger-Kernel's chunked losses; :mod:`rlobjectives.logprobs.fused_linear`).
Losses that are not token-local (GSPO, GMPO, VESPO, M2PO, the covariance selections,
``reduction="none"``) and calls that need no gradient compose the chunked log-probabilities
with the policy loss instead (:mod:`.composition`: a second pass in backward). On the Triton
backend (``docs/kernels.md``) the log-probabilities come from the Triton LM head, composed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from .._core.backend import lm_head_backend
from .._core.chunking import Block
from .._core.layout import padded, token_ndim, token_output, token_tensor
from .._core.reduction import (
    Reduction,
    masked_fill_zero,
    reduce,
    reduction_counts,
    row_weights,
    token_gradient_weights,
)
from .._core.validation import (
    ArrayLike,
    Scalar,
    checks_environment,
    compute_dtype,
)
from ..kl.estimators import Estimator, warn_biased_kl_loss
from ..kl.term import KLTerm, validate_kl_term
from ..logprobs.fused_linear import FusedLinearLoss, FusedTerms
from ..logprobs.head import Head, HeadOptions, Temperature, prepare_head
from ..logprobs.passes import LogProbsFromHidden
from ..logprobs.triton_head import triton_log_probs
from ..logprobs.vocab_parallel import VocabGroup, reduce_hidden_gradient
from .call import (
    PolicyCall,
    PolicyInputs,
    PolicyLossDiagnostics,
    RatioLevel,
    SurrogateChoice,
    SurrogateOptions,
    validate_entropy_coef,
    validate_policy_call,
    validate_surrogate_options,
)
from .loss import policy_tokens, run_policy, surrogate_terms

__all__ = ["FusedPolicyLossOutput", "fused_policy_loss_from_hidden"]


#: ``(head, mask (N,), with_entropy) -> (log_probs (N,), entropy (N,) or (0,))``, differentiable
#: with respect to the head's hidden states, weight and bias.
HeadLogProbs = Callable[[Head, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


class FusedPolicyLossOutput(NamedTuple):
    """Result of :func:`fused_policy_loss_from_hidden`.

    Attributes:
        loss: scalar total loss ``policy_loss + kl_coef * kl_loss - entropy_coef *
            entropy_loss`` (differentiable with respect to ``hidden``, ``weight`` and ``bias``);
            float32 (float64 for float64 ``hidden``), computed in float64 if any input is
            float64.
        policy_loss: detached scalar, the surrogate part (as :func:`policy_loss` without the
            entropy bonus; TRL's ``policy_loss`` metric).
        kl_loss: detached scalar, the reduced KL estimate (before ``kl_coef``); 0 without
            ``ref_log_probs``.
        log_probs: detached ``(B, T)`` log-probabilities of the tokens (zeros at unselected
            tokens), the same values :func:`token_log_probs_from_hidden` returns.
        diagnostics: :class:`PolicyLossDiagnostics`, as :func:`policy_loss` reports them.
        entropy_loss: detached scalar, the reduced entropy ``reduce(H)`` (before
            ``entropy_coef``; verl's ``actor/entropy_loss``); 0 when ``entropy_coef`` is 0
            (the entropies are then not computed).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    log_probs: torch.Tensor
    diagnostics: PolicyLossDiagnostics
    entropy_loss: torch.Tensor


def entropy_on(call: PolicyCall) -> bool:
    """Whether the loss has an entropy bonus (the entropies must be computed)."""
    return isinstance(call.entropy_coef, torch.Tensor) or call.entropy_coef != 0.0


def loss_value(
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    call: PolicyCall,
    kl: KLTerm | None,
    head: Head,
) -> FusedPolicyLossOutput:
    """The composition on ``(B, T)`` log-probs (and entropies): the loss and its detached parts."""
    inputs = call.inputs._replace(log_probs=log_probs, output_dtype=log_probs.dtype)
    out = run_policy(call._replace(inputs=inputs, entropy_coef=0.0), return_per_token=False)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    loss, kl_loss, entropy_loss, mask = out.loss, zero, zero, inputs.mask
    if kl is not None:
        terms = kl.estimate(log_probs, mask, call.options.log_ratio_bound, inputs.dtype)
        kl_loss = reduce(terms.to(log_probs.dtype), mask, call.reduction, call.layout)
        loss = loss + kl.coef * kl_loss if kl.coef > 0 else loss
    if entropy is not None:
        selected = masked_fill_zero(entropy.to(log_probs.dtype), mask)
        entropy_loss = reduce(selected, mask, call.reduction, call.layout)
        loss = loss - call.entropy_coef * entropy_loss
    dtype = head.dtype  # the parts detached, in the head's dtype
    return FusedPolicyLossOutput(
        loss.to(dtype), out.loss.detach().to(dtype), kl_loss.detach().to(dtype),
        log_probs.detach().to(dtype), out.diagnostics, entropy_loss.detach().to(dtype),
    )  # fmt: skip


def composed_loss(
    head: Head,
    batch_shape: tuple[int, int],
    call: PolicyCall,
    kl: KLTerm | None,
    head_log_probs: HeadLogProbs,
) -> FusedPolicyLossOutput:
    """Log-probs (and entropies) from ``head_log_probs``, then the loss by composition."""
    mask = call.inputs.mask
    with_entropy = entropy_on(call)
    log_probs, entropy = head_log_probs(head, mask.reshape(-1), with_entropy)
    log_probs = log_probs.reshape(batch_shape).to(call.inputs.dtype)  # (B, T)
    entropies = entropy.reshape(batch_shape).to(call.inputs.dtype) if with_entropy else None
    return loss_value(log_probs, entropies, call, kl, head)


@checks_environment
def fused_policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    surrogate: SurrogateChoice = "clip",
    ratio_level: RatioLevel = "token",
    log_ratio_bound: Scalar | None = 20.0,
    importance_weights: ArrayLike | None = None,
    entropy_coef: float = 0.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    group_size: int | None = None,
    group_ids: ArrayLike | None = None,
    diagnostics_normalizer: Scalar | None = None,
    ref_log_probs: ArrayLike | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Estimator = "k3",
    kl_straight_through: bool = False,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
    vocab_group: VocabGroup = None,
    kept_ids: ArrayLike | None = None,
    kept_pad: int = -1,
    kept_mask: ArrayLike | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    fp32_head: bool = True,
) -> FusedPolicyLossOutput:
    r"""Policy loss (+ KL term, + entropy bonus) from hidden states, never forming ``(N, V)``.

    :math:`\ell = \log\mathrm{softmax}((hW^\top + b)/\tau)[y]`, then :math:`\mathcal{L} =
    \mathrm{policy\_loss}(\ell, \ell^{old}, A, M) + \beta\,\mathrm{reduce}(\mathrm{KL}_k(\ell,
    \ell^{ref})) - \gamma\,\mathrm{reduce}(H)`, one reduction for the three terms: equal in value
    and gradient to that composition. Which calls differentiate in the chunk loop and which
    compose, and the kept set: ``docs/objectives/policy.md``, "The loss from hidden states".

    Args:
        hidden: ``(B, T, H)`` hidden states at the response positions (packed ``(N, H)``).
        weight: ``(V, H)`` LM-head weight, the dtype of ``hidden``.
        tokens: ``(B, T)`` sampled token ids (any id where ``mask`` is False).
        old_log_probs: ``(B, T)`` behaviour log-probabilities (constants).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (constants).
        mask: ``(B, T)``; nonzero selects the token (unselected rows reach nothing).
        bias: optional ``(V,)`` LM-head bias.
        temperature: :math:`\tau > 0`, or per token ``(B, T)`` (packed ``(N,)``).
        chunk_size: rows per chunk; None: the memory budget's.
        surrogate: as :func:`policy_loss`.
        ratio_level: as :func:`policy_loss`.
        log_ratio_bound: as :func:`policy_loss`; it also bounds the KL term's log-ratio.
        importance_weights: as :func:`policy_loss` (not on the KL or entropy terms).
        entropy_coef: :math:`\gamma`, a real number (entropies computed only when nonzero).
        reduction: as :func:`policy_loss`.
        normalizer: as :func:`policy_loss` (all three terms).
        max_response_length: as :func:`policy_loss`.
        group_size: as :func:`policy_loss`.
        group_ids: as :func:`policy_loss`.
        diagnostics_normalizer: as :func:`policy_loss`.
        ref_log_probs: optional ``(B, T)`` reference log-probabilities for the KL term.
        kl_coef: :math:`\beta \ge 0` (needs ``ref_log_probs``).
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"`` (:func:`rlobjectives.kl_estimate`).
        kl_straight_through: the estimator's value with the gradient of ``k2`` (verl ``k3+``).
        cu_seqlens: as :func:`policy_loss` (packed ``(N,)`` tokens).
        context_group: as :func:`policy_loss`.
        vocab_group: as :func:`token_log_probs_from_hidden`.
        kept_ids: as :func:`token_log_probs_from_hidden`.
        kept_pad: as :func:`token_log_probs_from_hidden`.
        kept_mask: as :func:`token_log_probs_from_hidden`.
        top_k: as :func:`token_log_probs_from_hidden`.
        top_p: as :func:`token_log_probs_from_hidden`.
        min_p: as :func:`token_log_probs_from_hidden`.
        final_logit_softcapping: as :func:`token_log_probs_from_hidden`.
        logit_scale: as :func:`token_log_probs_from_hidden`.
        fp32_head: as :func:`token_log_probs_from_hidden`.

    Returns:
        :class:`FusedPolicyLossOutput` ``(loss, policy_loss, kl_loss, log_probs, diagnostics,
        entropy_loss)``: ``loss`` scalar with gradients to ``hidden``, ``weight``, ``bias``
        (float32; float64 inputs: float64); the parts detached, ``log_probs`` ``(B, T)``.

    Raises:
        ValueError: as :func:`token_log_probs_from_hidden` and :func:`policy_loss`; a negative
            ``kl_coef``, an unknown ``kl_estimator``, ``kl_coef > 0`` without ``ref_log_probs``.
        TypeError: non-numeric inputs (a tensor ``entropy_coef`` or ``kl_coef`` included).
        RuntimeError: a second backward through a result of the chunk loop.

    References:
        Liger-Kernel, arXiv:2410.10989 Sec. 3.3; GRPO, arXiv:2402.03300 Eq. 3-4.
    """
    packed = cu_seqlens is not None
    kept_options = (vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p, min_p)
    head_options = HeadOptions(final_logit_softcapping, logit_scale, fp32_head)
    head, batch_shape = prepare_head(
        hidden, weight, tokens, bias, temperature, chunk_size, packed=packed, options=kept_options,
        head_options=head_options, mask=mask,
    )  # fmt: skip
    token_tensor(old_log_probs, "old_log_probs", ("hidden", head.hidden), batch_shape, packed)
    options = validate_surrogate_options(
        surrogate=surrogate, ratio_level=ratio_level, log_ratio_bound=log_ratio_bound
    )
    call = validate_policy_call(
        (old_log_probs, old_log_probs, advantages, mask),
        ("old_log_probs", "old_log_probs", "advantages", "mask"),
        options=options,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        diagnostics_normalizer=diagnostics_normalizer,
        importance_weights=importance_weights,
        cu_seqlens=cu_seqlens,
        context_group=context_group,
        group_size=group_size,
        group_ids=group_ids,
    )
    coef = validate_entropy_coef(entropy_coef, has_entropy=True, allow_tensor=False)
    kl = validate_kl_term(
        ref_log_probs, kl_coef, kl_estimator, kl_straight_through, head.hidden, batch_shape, packed
    )
    if kl is not None:
        warn_biased_kl_loss(kl.estimator, kl.straight_through, "fused_policy_loss_from_hidden")
    call = _with_head_dtype(call, head, kl, coef)
    if head.shard is not None:  # Megatron's copy to the TP region, with hidden_grad="reduced"
        head = head._replace(hidden=reduce_hidden_gradient(head.hidden, head.shard))
    out = _dispatch(head, batch_shape, call, kl)
    if not (packed and token_ndim(tokens) == 1):
        return out
    return out._replace(  # packed (N,) tokens: per-token results as (N,)
        loss=token_output(out.loss, out.loss.ndim == 2), log_probs=token_output(out.log_probs, True)
    )


def _with_head_dtype(
    call: PolicyCall, head: Head, kl: KLTerm | None, entropy_coef: float | torch.Tensor
) -> PolicyCall:
    """The call with every input's computation dtype, the head's dtype and ``entropy_coef``."""
    inputs = call.inputs
    extra = (None if kl is None else kl.ref_log_probs, inputs.importance_weights)
    others = [tensor for tensor in extra if tensor is not None]
    dtype = compute_dtype(head.hidden, inputs.old_log_probs, inputs.advantages, *others)
    inputs = inputs._replace(dtype=dtype, output_dtype=head.dtype)
    return call._replace(inputs=inputs, entropy_coef=entropy_coef)


def _dispatch(
    head: Head, batch_shape: tuple[int, int], call: PolicyCall, kl: KLTerm | None
) -> FusedPolicyLossOutput:
    """The dispatch step: composition or fused chunk loop, on the Triton kernels or PyTorch.

    With the kernels selected (docs/kernels.md) the log-probabilities come from the Triton LM
    head, and a token-local loss runs the one-pass Triton function (None from it: a
    hyperparameter the kernels cannot take, the PyTorch chunk loop). A kept set runs on
    PyTorch (the kernels take none).
    """
    kept = head.kept is not None
    if lm_head_backend(head.hidden.device, dtype=head.dtype, kept_set=kept) == "triton":
        return composed_loss(head, batch_shape, call, kl, triton_log_probs)
    if _needs_composition(head, call):
        return composed_loss(head, batch_shape, call, kl, _chunked_log_probs)
    return _fused_loss(head, batch_shape, call, kl)


def _chunked_log_probs(
    head: Head, mask: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`LogProbsFromHidden` (chunked, recompute in backward) of the composition."""
    outputs: tuple[torch.Tensor, torch.Tensor] = LogProbsFromHidden.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head, mask, with_entropy
    )
    return outputs


def _needs_composition(head: Head, call: PolicyCall) -> bool:
    """Whether the loss is not token-local (GSPO, GMPO, VESPO, ``"none"``) or needs no grad.

    Those cases compose :class:`LogProbsFromHidden` (with recompute) and the policy loss instead
    of forming the gradients in forward.
    """
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (head.hidden, head.weight, head.bias)
    )
    options = call.options
    token_local = options.surrogate.token_local and options.ratio_level == "token"
    return (
        not (wants_grad and token_local and call.reduction.reduction != "none")
        or torch.compiler.is_compiling()  # autograd.grad inside a Function's forward: untraceable
        or head.shard is not None  # the normaliser needs every slice before any gradient
    )


def _token_coefficients(
    flat: PolicyInputs,
    options: SurrogateOptions,
    kl: KLTerm | None,
    token_weights: torch.Tensor,
    log_probs: torch.Tensor,
    block: Block,
) -> torch.Tensor:
    """``dL/d log_probs`` of one chunk ``(n,)``: the formula differentiated by autograd.

    ``flat``: the call's inputs as ``(1, N)`` rows; ``token_weights`` ``(1, N)``: the reduction's.
    """
    rows, dtype, surrogate = block[0], flat.dtype, options.surrogate
    mask, weights = flat.mask[:, rows], flat.importance_weights  # (1, n)
    with torch.enable_grad():
        leaf = log_probs.detach().to(dtype).requires_grad_(True)
        chunk = flat._replace(
            log_probs=leaf[None], old_log_probs=flat.old_log_probs[:, rows],
            advantages=flat.advantages[:, rows], mask=mask,
            importance_weights=None if weights is None else weights[:, rows],
        )  # fmt: skip
        tokens = policy_tokens(chunk, options, padded(1))[0]
        per_token = -surrogate_terms(surrogate, tokens).values  # (1, n)
        if tokens.importance_weights is not None and not surrogate.folds_importance_weights:
            per_token = per_token * masked_fill_zero(tokens.importance_weights, mask)
        if kl is not None and kl.coef > 0:
            estimate = kl.estimate(leaf[None], mask, options.log_ratio_bound, dtype, rows)
            per_token = per_token + kl.coef * estimate
        weighted = masked_fill_zero(per_token * token_weights[:, rows], mask)
        (gradient,) = torch.autograd.grad(weighted.sum(), leaf)
    return masked_fill_zero(gradient, mask[0])


def _fused_loss(
    head: Head, batch_shape: tuple[int, int], call: PolicyCall, kl: KLTerm | None
) -> FusedPolicyLossOutput:
    """Gradients formed in the forward chunk loop; the value from the composition."""
    inputs, dtype, layout = call.inputs, call.inputs.dtype, call.layout
    counts = reduction_counts(inputs.mask, call.reduction, layout)  # (S,), whole sequences
    weights = row_weights(counts, call.reduction, dtype=dtype, batch=layout.num_sequences)
    token_weights = token_gradient_weights(weights, layout, dtype).expand(batch_shape)
    token_weights = token_weights.reshape(1, -1)  # (1, N)
    importance = inputs.importance_weights
    flat = inputs._replace(  # (1, N) rows; per-sequence data is not read by a token-local loss
        old_log_probs=inputs.old_log_probs.to(dtype).reshape(1, -1),
        advantages=inputs.advantages.to(dtype).expand(batch_shape).reshape(1, -1),
        mask=inputs.mask.reshape(1, -1), output_dtype=dtype, sequence_weights=False, groups=None,
        importance_weights=None
        if importance is None
        else importance.expand(batch_shape).reshape(1, -1),
    )  # fmt: skip
    mask = flat.mask[0]  # (N,)
    entropy_weights = None
    if entropy_on(call):  # d loss / d H = -entropy_coef * (the reduction's weight)
        entropy_weights = masked_fill_zero(-call.entropy_coef * token_weights[0], mask)
    coefficients = partial(_token_coefficients, flat, call.options, kl, token_weights)
    terms = FusedTerms(mask, coefficients, entropy_weights)
    anchor, flat_log_probs, flat_entropy = FusedLinearLoss.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head._replace(dtype=dtype), terms
    )
    log_probs = flat_log_probs.reshape(batch_shape)  # (B, T), detached
    entropy = None if entropy_weights is None else flat_entropy.reshape(batch_shape)
    with torch.no_grad():
        values = loss_value(log_probs, entropy, call, kl, head)
    # The value is the unfused composition's; the gradient flows through the anchor (value 0).
    return values._replace(loss=(values.loss + anchor).to(head.dtype))
