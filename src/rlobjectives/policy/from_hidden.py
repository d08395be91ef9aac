"""The policy loss (+ KL term, + entropy bonus) straight from hidden states and the LM head.

The loss's derivative with respect to each token's log-probability (and entropy) is known per
token once the reduction's weights are known (from the mask, before the chunk loop), so
``grad_hidden`` and ``grad_weight`` are formed chunk by chunk in the forward pass, with no
recompute (Liger-Kernel / Cut Cross-Entropy's fused linear losses;
:class:`rlobjectives.logprobs.fused_linear.FusedLinearLoss`). Losses that are not token-local (GSPO,
GMPO, VESPO, ``reduction="none"``) and calls that need no gradient compose the chunked
log-probabilities (and entropies) with the policy loss instead
(:mod:`rlobjectives.logprobs.composition`). With the Triton kernels selected
(``RLOBJECTIVES_KERNELS``, docs/kernels.md) both run on them (:mod:`rlobjectives.kernels`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from .._core.backend import lm_head_backend
from .._core.chunking import Block
from .._core.layout import padded, token_ndim, token_output
from .._core.reduction import (
    Reduction,
    ReductionSpec,
    masked_fill_zero,
    reduction_counts,
    row_weights,
    token_gradient_weights,
)
from .._core.validation import ArrayLike, Scalar, checks_environment, compute_dtype
from ..kl.estimators import Estimator, kl_gradient, warn_biased_kl_loss
from ..logprobs.fused_linear import FusedLinearLoss, FusedTerms
from ..logprobs.head import Head, HeadOptions, Temperature, prepare_head
from ..logprobs.passes import LogProbsFromHidden
from ..logprobs.triton_head import triton_log_probs
from ..logprobs.vocab_parallel import VocabGroup, reduce_hidden_gradient
from .composition import (
    FusedPolicyLossOutput,
    KLTerm,
    check_old_log_probs,
    composed_loss,
    entropy_on,
    fused_output,
    loss_value,
    validate_kl_term,
)
from .fused import FusedSpec, fused_forward, has_fused_stage, run_fused
from .inputs import (
    PolicyCall,
    RatioLevel,
    Surrogate,
    SurrogateOptions,
    validate_entropy_coef,
    validate_policy_call,
    validate_surrogate_options,
)

__all__ = ["FusedPolicyLossOutput", "fused_policy_loss_from_hidden"]


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
    surrogate: Surrogate = "clip",
    ratio_level: RatioLevel = "token",
    log_ratio_bound: Scalar | None = 20.0,
    importance_weights: ArrayLike | None = None,
    entropy_coef: float = 0.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
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
    r"""Policy loss (+ optional KL penalty and entropy bonus) from hidden states, chunk by chunk.

    Equal in value and gradient to composing the unfused functions,

    .. math::

        \ell = \mathrm{log\_softmax}\big((h W^\top + b) / \tau\big)[y], \qquad
        \mathcal{L} = \mathrm{policy\_loss}(\ell, \ell^{old}, A, M)
            + \beta\, \mathrm{aggregate}\big(\mathrm{KL}_k(\ell, \ell^{ref}), M\big)
            - \gamma\, \mathrm{aggregate}(H, M),

    with the same ``reduction``/``normalizer`` for the three terms, :math:`\beta` = ``kl_coef``,
    :math:`\gamma` = ``entropy_coef`` and :math:`H = -\sum_v p_v \log p_v` the entropy of the
    same softmax. For a token-local surrogate (Clip, CISPO, SAPO, DPPO, DRO) the
    per-token derivatives :math:`c_{it} = \partial\mathcal{L}/\partial\ell_{it}` and
    :math:`g_{it} = \partial\mathcal{L}/\partial H_{it} = -\gamma/(d_i D)` depend only on
    token :math:`(i, t)` and on the batch normaliser, which is computed from the mask before the
    chunk loop, so each chunk forms :math:`\partial\mathcal{L}/\partial z = (c\,(\mathbb{1}_y
    - p) - g\, p \odot (\log p + H))/\tau` and its products with ``weight`` and ``hidden``
    right away; the full logits are never formed and nothing is recomputed in backward. The
    per-token derivative is the fused policy stage's, so its decisions at a bound (which tokens
    a clip changes) follow the rule of :func:`policy_loss` (``docs/conventions.md``,
    "Decisions at a bound"), on PyTorch and on the Triton kernels alike.

    ``reduction="none"``, ``ratio_level="sequence"`` (GSPO), the sequence-level surrogates
    ``"gmpo"`` and ``"vespo"`` (whose per-token derivative needs the whole sequence) and the
    batch-level ``M2PO``, ``ClipCov``, ``KLCov`` (their selections need the whole call) are
    supported by composition instead: :func:`token_log_probs_from_hidden` (chunked, with
    recompute, entropies included) followed by :func:`policy_loss` (for ``"none"`` the returned
    ``loss`` is ``(B, T)``).

    Packed sequences (``cu_seqlens`` given): ``hidden`` is ``(N, H)`` or ``(1, N, H)``, the
    per-token tensors ``(N,)`` or ``(1, N)`` and ``advantages`` ``(S,)`` (or per token); the
    reductions and the sequence-level surrogates run per sequence, exactly as
    :func:`policy_loss` with ``cu_seqlens``.

    Context parallelism (``context_group``): ``hidden`` and the per-token tensors are this
    rank's tokens of the same ``S`` sequences, as :func:`policy_loss` takes them; the
    reduction's weights (the whole sequences' counts, one all-reduce before the chunk loop),
    the sequence-level parts (GSPO, GMPO, VESPO, ``"sequence_mean"``) and the diagnostics are
    those of the unsplit call, every rank returns the whole loss, and the gradients of
    ``hidden``, ``weight`` and ``bias`` are this rank's tokens' part of the unsplit gradient
    (sum ``weight``'s over the group, as the trainer's gradient all-reduce does).

    **Kept set** (``kept_ids``, ``kept_mask``, ``top_k``/``top_p``, as
    :func:`token_log_probs_from_hidden`): :math:`\ell` and :math:`H` are over the sampler's kept
    set (the fused chunk loop restricts each chunk's logits). A sampled token outside the set
    (only a recomputed ``top_k``/``top_p`` that disagrees with the engine can produce one) has
    :math:`\ell = -\infty`: its gradient is exactly 0 (the log-ratio is clamped at
    ``-log_ratio_bound``, so its ratio is :math:`e^{-20}`; the clipped surrogate then
    contributes :math:`\approx 0` for :math:`A > 0` and the constant :math:`(1 - \epsilon)|A|`
    for :math:`A < 0`), it still counts in the denominators, and its KL estimate is the
    bound's value (k3: :math:`e^{20}`): pass the engine's ``kept_ids`` to avoid such tokens.
    The kernels take no kept set (such a call runs the PyTorch path).

    **Vocabulary-parallel** (``vocab_group``, as :func:`token_log_probs_from_hidden`):
    ``weight``/``bias`` are this rank's rows; the loss, its parts and the diagnostics are the
    unsharded call's on every rank, ``grad_weight``/``grad_bias`` this rank's rows of the
    unsharded gradient and ``grad_hidden`` its part (``hidden_grad="partial"``) or the sum
    (``"reduced"``). The log-probabilities need the whole vocabulary's normaliser before any
    gradient can be formed, so the call composes the chunked log-probabilities (recompute in
    backward: the same three products as the fused loop plus one) with the policy loss, on
    PyTorch or the kernels.

    Args:
        hidden: ``(B, T, H)`` hidden states at the response positions.
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` sampled token ids (any id where ``mask`` is False).
        old_log_probs: ``(B, T)`` behaviour log-probabilities (treated as constants).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (treated as constants).
        mask: ``(B, T)`` bool/numeric; nonzero selects the token. Unselected rows of ``hidden``
            and ids of ``tokens`` never reach an output or a gradient (NaN-safe).
        bias: optional ``(V,)`` LM-head bias.
        temperature: :math:`\tau > 0`, or a per-token tensor ``(B, T)`` (packed ``(N,)``).
        chunk_size: rows per chunk; None uses :func:`default_chunk_size`.
        surrogate: as :func:`policy_loss`: a surrogate object (:class:`~rlobjectives.Clip`,
            :class:`~rlobjectives.CISPO`, :class:`~rlobjectives.SAPO`,
            :class:`~rlobjectives.GMPO`, :class:`~rlobjectives.VESPO`,
            :class:`~rlobjectives.DPPO`, :class:`~rlobjectives.DRO`: fused;
            :class:`~rlobjectives.M2PO`, :class:`~rlobjectives.ClipCov`,
            :class:`~rlobjectives.KLCov`: by composition) or its name.
        ratio_level: as :func:`policy_loss` (``"sequence"`` runs unfused, see above).
        log_ratio_bound: as :func:`policy_loss`; also bounds the KL estimator's log-ratio.
        importance_weights: as :func:`policy_loss`: ``(B,)``, ``(B, 1)`` or ``(B, T)``
            constants multiplying the per-token surrogate loss (not the KL or entropy terms).
        entropy_coef: :math:`\gamma`, a real number; the entropies are computed chunk by chunk
            (with their exact gradient) only when it is nonzero.
        reduction: as :func:`policy_loss`.
        normalizer: as :func:`policy_loss` (applies to the KL and entropy terms too).
        max_response_length: as :func:`policy_loss`.
        diagnostics_normalizer: as :func:`policy_loss`.
        ref_log_probs: optional ``(B, T)`` reference-policy log-probabilities for the KL term.
        kl_coef: :math:`\beta \ge 0`; the KL term is added only with ``ref_log_probs``.
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``, as
            :func:`rlobjectives.kl_estimate`.
        kl_straight_through: value of ``kl_estimator`` with the gradient of ``k2`` (verl
            ``k3+``), as :func:`rlobjectives.kl_estimate`.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`policy_loss`.
        context_group: the process group of the ranks holding the other tokens of the same
            sequences (context parallelism), or None; see above.
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
        entropy_loss)``; gradients flow to ``hidden``, ``weight`` and ``bias`` only. ``loss`` is
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: as :func:`token_log_probs_from_hidden` and :func:`policy_loss`, plus a
            negative ``kl_coef``, an unknown ``kl_estimator``, or ``kl_coef > 0`` without
            ``ref_log_probs``.
        TypeError: on non-numeric inputs (a tensor ``entropy_coef`` or ``kl_coef`` included),
            and as :func:`token_log_probs_from_hidden`.
        RuntimeError: on a second backward through the same result.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    Warns:
        BiasedGradientWarning: with the KL term on, for ``"k1"`` or ``"k3"`` without
            ``kl_straight_through``, as :func:`rlobjectives.kl_loss`.

    References:
        Hsu et al. 2024, Liger-Kernel, arXiv:2410.10989 Sec. 3.3 (gradients in the forward pass);
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3-4 (k3 KL term); Schulman et al. 2017,
        arXiv:1707.06347 Eq. 7 and Eq. 9 (entropy bonus).

    Examples:
        >>> import torch
        >>> out = fused_policy_loss_from_hidden(
        ...     torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.tensor([[0, 1]]),
        ...     torch.full((1, 2), -1.3862944), torch.tensor([1.0]), torch.ones(1, 2))
        >>> round(float(out.loss), 4)
        -1.0

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       The surrogates and options of :func:`policy_loss`, ``importance_weights``,
       ``entropy_coef`` and the ``entropy_loss`` output.
    .. versionchanged:: 0.3.0
       ``surrogate`` takes the surrogate objects; their options left the signature, as in
       :func:`policy_loss` (``clip_low=a`` is ``surrogate=Clip(low=a)``).
    """
    packed = cu_seqlens is not None
    kept_options = (vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p, min_p)
    head_options = HeadOptions(final_logit_softcapping, logit_scale, fp32_head)
    head, batch_shape = prepare_head(
        hidden, weight, tokens, bias, temperature, chunk_size, packed=packed, options=kept_options,
        head_options=head_options, mask=mask,
    )  # fmt: skip
    check_old_log_probs(old_log_probs, head, batch_shape, packed)
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
    )
    coef = validate_entropy_coef(entropy_coef, has_entropy=True, allow_tensor=False)
    kl = validate_kl_term(
        ref_log_probs, kl_coef, kl_estimator, kl_straight_through, head, batch_shape, packed
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
    extra = [t for t in (None if kl is None else kl.ref_log_probs, inputs.importance_weights)]
    dtype = compute_dtype(
        head.hidden, inputs.old_log_probs, inputs.advantages, *(t for t in extra if t is not None)
    )
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
    return (
        not wants_grad
        or head.shard is not None  # the normaliser needs every slice before any gradient
        or call.reduction.reduction == "none"
        or call.options.ratio_level == "sequence"
        or not has_fused_stage(call.options)
    )


class _Coefficients(NamedTuple):
    """Flat ``(N,)`` per-token constants of the loss's derivative w.r.t. each log-prob."""

    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    importance_weights: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    token_weights: torch.Tensor  # d loss / d (per-token loss): the reduction's weight
    mask: torch.Tensor  # bool
    options: SurrogateOptions
    kl: KLTerm | None
    dtype: torch.dtype


def _token_coefficients(spec: _Coefficients, log_probs: torch.Tensor, block: Block) -> torch.Tensor:
    """``dL/d log_probs`` of one chunk ``(n,)``, in closed form (no autograd inside forward)."""
    rows = block[0]
    mask = spec.mask[rows]  # (n,)
    none = ReductionSpec("none", None, 1.0)
    weights = spec.importance_weights
    forward = fused_forward(
        log_probs.unsqueeze(0),
        spec.old_log_probs[rows].unsqueeze(0),
        spec.advantages[rows].unsqueeze(0),
        mask.unsqueeze(0),
        FusedSpec(spec.options, none, None, spec.dtype, padded(1)),
        None if weights is None else weights[rows].unsqueeze(0),
    )
    coefficient = -forward.coefficient.squeeze(0)  # d(-w s)/d log_probs, (n,)
    if spec.kl is not None and spec.ref_log_probs is not None and spec.kl.coef > 0:
        log_ratio = masked_fill_zero(log_probs - spec.ref_log_probs[rows], mask)  # (n,)
        kl_slope = kl_gradient(
            log_ratio,
            estimator=spec.kl.estimator,
            straight_through=spec.kl.straight_through,
            log_ratio_bound=spec.options.log_ratio_bound,
        )
        coefficient = coefficient + spec.kl.coef * kl_slope
    return masked_fill_zero(coefficient * spec.token_weights[rows], mask)


def _fused_loss(
    head: Head, batch_shape: tuple[int, int], call: PolicyCall, kl: KLTerm | None
) -> FusedPolicyLossOutput:
    """Gradients formed in the forward chunk loop; the value from the composition."""
    inputs, dtype, layout = call.inputs, call.inputs.dtype, call.layout
    counts = reduction_counts(inputs.mask, call.reduction, layout)  # (S,), whole sequences
    weights = row_weights(counts, call.reduction, dtype=dtype, batch=layout.num_sequences)
    token_weights = token_gradient_weights(weights, layout, dtype).expand(batch_shape)
    mask = inputs.mask.reshape(-1)
    importance = inputs.importance_weights
    coefficients = _Coefficients(
        old_log_probs=inputs.old_log_probs.to(dtype).reshape(-1),
        advantages=inputs.advantages.to(dtype).expand(batch_shape).reshape(-1),
        importance_weights=None
        if importance is None
        else importance.expand(batch_shape).reshape(-1),
        ref_log_probs=None if kl is None else kl.ref_log_probs.to(dtype).reshape(-1),
        token_weights=token_weights.reshape(-1),
        mask=mask,
        options=call.options,
        kl=kl,
        dtype=dtype,
    )
    entropy_weights = None
    if entropy_on(call):  # d loss / d H = -entropy_coef * (the reduction's weight)
        entropy_weights = masked_fill_zero(-call.entropy_coef * coefficients.token_weights, mask)
    terms = FusedTerms(mask, partial(_token_coefficients, coefficients), entropy_weights)
    anchor, flat_log_probs, flat_entropy = FusedLinearLoss.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head._replace(dtype=dtype), terms
    )
    log_probs = flat_log_probs.reshape(batch_shape)  # (B, T), detached
    entropy = None if entropy_weights is None else flat_entropy.reshape(batch_shape)
    with torch.no_grad():
        values = loss_value(log_probs, entropy, call, kl, run_fused)
    # The value is the unfused composition's; the gradient flows through the anchor (value 0).
    return fused_output(values, values.loss.detach() + anchor, log_probs, head)
