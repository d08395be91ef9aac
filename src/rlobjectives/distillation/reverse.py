r"""Reverse KL on the student's sampled tokens: as a loss, and as a per-token reward.

On-policy distillation samples :math:`y \sim \pi_S` from the student and asks the teacher for
its log-probability :math:`\ell^T = \log\pi_T(y)` of every sampled token. With
:math:`\ell^S = \log\pi_S(y)` and :math:`d = \ell^S - \ell^T`, the single-sample estimators of
:math:`\mathrm{KL}(\pi_S \| \pi_T)` are the ones of :mod:`rlobjectives.kl.estimators` with the
teacher in the reference slot (:math:`k_1 = d`, :math:`k_2 = d^2/2`, :math:`k_3 = e^{-d} + d -
1`). Two placements:

- :func:`reverse_kl_loss` / :func:`reverse_kl_loss_from_hidden`: the estimate differentiated
  directly (GKD's supervised placement, verl ``use_policy_gradient=False``);
- :func:`reverse_kl_rewards`: :math:`-c\,k` as a detached per-token reward (advantage) for the
  policy loss (the on-policy distillation recipe of Thinking Machines, slime ``--use-opd``,
  NeMo-RL's OPD estimator, verl ``use_policy_gradient=True``), whose gradient arrives through
  the score function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.chunking import Block, resolve_chunk_size
from .._core.layout import sequence_layout, token_matrix, token_ndim, token_output
from .._core.reduction import Reduction, masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_scalar,
)
from ..kl.estimators import (
    Estimator,
    kl_gradient,
    kl_terms,
    validate_kl_options,
    warn_biased,
    warn_biased_kl_loss,
)
from ..logprobs.head import HeadOptions, Temperature
from .chunks import ChunkOutput, LogitsDivergence, logits_rows, softmax_rows_
from .inputs import hidden_call, hidden_loss, logits_call, per_token, reduced, temperature_inverse

__all__ = ["SampledRule", "reverse_kl_loss", "reverse_kl_loss_from_hidden", "reverse_kl_rewards"]


@dataclass(frozen=True, eq=False)
class SampledRule:
    r"""A KL estimator of the sampled token of each row of a chunk (values and gradients).

    :math:`\ell^S = x_y - \log\sum_v e^{x_v}`, :math:`k(\ell^S - \ell^T)` and, with upstream
    :math:`g`, :math:`\partial(g k)/\partial x_v = g\,k'(d)\,(\mathbb{1}[v = y] - q_v)` with
    :math:`k'` of :func:`rlobjectives.kl.estimators.kl_gradient` (0 where the bound fires).
    """

    tokens: torch.Tensor  # (N,) int64
    teacher_log_probs: torch.Tensor  # (N,)
    estimator: str
    straight_through: bool
    log_ratio_bound: float | torch.Tensor | None
    dtype: torch.dtype
    value_shape: tuple[int, ...] = ()

    def __call__(
        self,
        scores: torch.Tensor,
        block: Block,
        active: torch.Tensor,
        upstream: torch.Tensor | None,
    ) -> ChunkOutput:
        """The chunk's estimates ``(n,)`` and, with ``upstream``, ``d(g k)/dx`` in ``scores``."""
        tokens = torch.where(active, self.tokens[block], torch.zeros_like(self.tokens[block]))
        target = scores.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (n,) x_y
        probs, log_normalizer, _ = softmax_rows_(scores)  # q (n, V), lse (n,)
        student = masked_fill_zero(target - log_normalizer, active)  # (n,) l^S
        teacher = masked_fill_zero(self.teacher_log_probs[block].to(self.dtype), active)
        values = kl_terms(
            student, teacher, active, estimator=self.estimator,
            straight_through=self.straight_through, log_ratio_bound=self.log_ratio_bound,
            dtype=self.dtype,
        )  # fmt: skip
        if upstream is None:
            return ChunkOutput(values, None)
        slope = kl_gradient(
            masked_fill_zero(student - teacher, active),
            estimator=self.estimator,
            straight_through=self.straight_through,
            log_ratio_bound=self.log_ratio_bound,
        )
        coefficient = masked_fill_zero(slope * upstream, active).unsqueeze(1)  # (n, 1)
        grad = probs.mul_(-coefficient).scatter_add_(1, tokens.unsqueeze(1), coefficient)
        return ChunkOutput(values, grad)


@checks_environment
def reverse_kl_loss(
    logits: ArrayLike,
    tokens: ArrayLike,
    teacher_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    estimator: Estimator = "k3",
    straight_through: bool = False,
    log_ratio_bound: Scalar | None = 20.0,
    temperature: Temperature = 1.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""Reverse KL(student || teacher) on the sampled tokens, as a differentiable loss term.

    With :math:`\ell^S_{it} = \log\mathrm{softmax}(\text{logits}_{it}/\tau)[y_{it}]` (chunked as
    :func:`rlobjectives.token_log_probs`), the teacher's log-probability
    :math:`\ell^T_{it}` of the same token and :math:`d = \mathrm{clip}(\ell^S - \ell^T, -b, b)`,

    .. math::

        \mathcal{L} = \mathrm{reduce}_M\big(k(d)\big), \qquad k_1 = d,\ k_2 = \tfrac12 d^2,\
        k_3 = e^{-d} + d - 1, \qquad \frac{\partial k}{\partial\,\text{logits}_v} =
        \frac{k'(d)}{\tau}(\mathbb{1}[v = y] - q_v),

    :math:`k' = 1, d, 1 - e^{-d}` (0 where the bound fires); ``straight_through=True``: the
    value of ``estimator`` with the gradient of :math:`k_2` (verl's ``k3+``). It is
    :func:`rlobjectives.kl_loss` with the teacher in the reference slot; its gradient caveats
    (only ``"k2"`` and ``straight_through`` are unbiased here), the reward placement
    (:func:`reverse_kl_rewards`) and the peers (verl ``loss_mode`` ``k1``/``kl``, ``k2``/``mse``,
    ``k3``/``low_var_kl``, ``abs``, the ``+`` forms; NeMo-RL ``calculate_kl``):
    ``docs/objectives/distillation.md``, "``reverse_kl_loss``".

    Args:
        logits: ``(B, T, V)`` student logits (packed ``(N, V)`` / ``(1, N, V)``).
        tokens: ``(B, T)`` the sampled token ids (any id where ``mask`` is False).
        teacher_log_probs: ``(B, T)`` the teacher's log-probabilities of ``tokens``.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of ``k2``.
        log_ratio_bound: :math:`b > 0` clamping :math:`d` (before ``exp``), or None.
        temperature: :math:`\tau > 0` on the student logits, or per token ``(B, T)`` / ``(N,)``.
        reduction: as :func:`rlobjectives.aggregate`.
        normalizer: explicit positive denominator for micro-batches and ranks.
        max_response_length: the Dr. GRPO constant.
        chunk_size: rows per chunk of the log-softmax, or None.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.

    Returns:
        A 0-d loss (``"none"``: ``(B, T)`` per-token estimates, packed: the shape of ``mask``),
        float32 (float64 when an input is float64).

    Raises:
        ValueError: on wrong shapes/devices, an unknown ``estimator``/``reduction``, a non-positive
            ``log_ratio_bound``/``normalizer``/``temperature``/``chunk_size``, bad ``cu_seqlens``.
        TypeError: on non-numeric inputs, non-integer ``tokens``, non-bool ``straight_through``.

    Warns:
        BiasedGradientWarning: for ``"k1"``, ``"k3"`` and ``"abs"`` without ``straight_through``.

    References:
        Agarwal et al. 2024, GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM, arXiv:2306.08543
        (reverse KL for distillation); Schulman 2020, "Approximating KL divergence".

    Examples:
        >>> logits = torch.log(torch.tensor([[[0.5, 0.5]]]))
        >>> teacher = torch.log(torch.tensor([[0.25]]))  # d = ln 2
        >>> reverse_kl_loss(logits, torch.tensor([[0]]), teacher, torch.tensor([[True]]),
        ...                 estimator="k2")  # (ln 2)^2 / 2
        tensor(0.2402)

    .. versionadded:: 0.3.0
    """
    logits_t, rows = logits_call(
        logits,
        mask,
        cu_seqlens=cu_seqlens,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )
    device = logits_t.device
    tokens_t = per_token(tokens, "tokens", rows, device, ids=True)
    teacher = per_token(teacher_log_probs, "teacher_log_probs", rows, device).detach()
    check_same_device({"logits": logits_t, "tokens": tokens_t, "teacher_log_probs": teacher})
    bound = validate_kl_options(estimator, straight_through, log_ratio_bound)
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    warn_biased_kl_loss(estimator, straight_through, "reverse_kl_loss")
    dtype = compute_dtype(logits_t, teacher)  # a float64 teacher makes the log-softmax float64
    inverse = temperature_inverse(temperature, rows, device, dtype)
    flat = logits_rows(logits_t, chunk).flat
    tokens_r = tokens_t.reshape(-1) if flat else tokens_t
    rule = SampledRule(tokens_r.long(), teacher.reshape(-1) if flat else teacher, estimator,
                       straight_through, bound, dtype)  # fmt: skip
    terms = LogitsDivergence.apply(logits_t, rule, rows.mask, inverse, chunk, dtype)  # type: ignore[no-untyped-call]
    return reduced(terms, rows)


@checks_environment
def reverse_kl_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    teacher_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    estimator: Estimator = "k3",
    straight_through: bool = False,
    log_ratio_bound: Scalar | None = 20.0,
    temperature: Temperature = 1.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    fp32_head: bool = True,
) -> torch.Tensor:
    r""":func:`reverse_kl_loss` from hidden states and the LM head, without the ``(N, V)`` logits.

    The student's log-probabilities :math:`\ell^S = \log\mathrm{softmax}((h W^\top + b)/\tau)[y]`
    are formed chunk by chunk (one reused ``(chunk, V)`` buffer); for a reduced loss each
    chunk's gradient :math:`g\,k'(d)\,(\mathbb{1}_y - q)/\tau` goes straight into
    ``grad_hidden`` / ``grad_weight`` in the forward pass (no recompute, one backward per
    forward); ``reduction="none"`` and calls without a gradient recompute in backward. Equal in
    value and gradient to :func:`reverse_kl_loss` on ``hidden @ weight.T + bias``.

    Args:
        hidden: ``(B, T, H)`` hidden states (packed ``(N, H)`` / ``(1, N, H)``).
        weight: ``(V, H)`` LM-head weight, the dtype of ``hidden``.
        tokens: ``(B, T)`` the sampled token ids.
        teacher_log_probs: ``(B, T)`` the teacher's log-probabilities of ``tokens``.
        mask: ``(B, T)``; where False the hidden row and token id are never read.
        bias: optional ``(V,)`` LM-head bias.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of ``k2``.
        log_ratio_bound: :math:`b > 0` clamping :math:`d`, or None.
        temperature: :math:`\tau > 0`,
            or a per-token tensor ``(B, T)`` (packed ``(N,)``).
        reduction: as :func:`rlobjectives.aggregate`.
        normalizer: explicit positive denominator for micro-batches and ranks.
        max_response_length: the Dr. GRPO constant.
        chunk_size: rows per chunk; None: the head's default (at least 256 rows).
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.
        final_logit_softcapping: :math:`c > 0` capping the student logits
            :math:`c \tanh(s z / c)` before the temperature (Gemma 2/3), or None; as
            :func:`rlobjectives.token_log_probs_from_hidden`.
        logit_scale: :math:`s` multiplying the student logits first (Cohere, Granite).
        fp32_head: the bf16/fp16 product with a float32 result (default), as
            :func:`rlobjectives.token_log_probs_from_hidden`.

    Returns:
        As :func:`reverse_kl_loss`.

    Raises:
        ValueError: as :func:`reverse_kl_loss`, and on a weight/bias of another shape or dtype.
        TypeError: as :func:`reverse_kl_loss`, on non-floating ``hidden``/``weight``/``bias``.

    Warns:
        BiasedGradientWarning: as :func:`reverse_kl_loss`.

    References:
        As :func:`reverse_kl_loss`; Wijmans et al. 2024, Cut Cross-Entropy, arXiv:2411.09009.

    Examples:
        >>> import torch
        >>> hidden, weight = torch.zeros(1, 1, 2), torch.zeros(2, 2)  # pi_S(y) = 1/2
        >>> teacher = torch.log(torch.tensor([[0.25]]))
        >>> reverse_kl_loss_from_hidden(hidden, weight, torch.tensor([[0]]), teacher,
        ...                             torch.tensor([[True]]), estimator="k2")
        tensor(0.2402)

    .. versionadded:: 0.3.0
    """
    head, rows = hidden_call(
        hidden,
        weight,
        tokens,
        bias,
        mask,
        temperature=temperature,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        head_options=HeadOptions(final_logit_softcapping, logit_scale, fp32_head),
    )
    teacher = per_token(teacher_log_probs, "teacher_log_probs", rows, head.hidden.device).detach()
    check_same_device({"hidden": head.hidden, "teacher_log_probs": teacher})
    bound = validate_kl_options(estimator, straight_through, log_ratio_bound)
    warn_biased_kl_loss(estimator, straight_through, "reverse_kl_loss_from_hidden")
    head = head._replace(dtype=compute_dtype(head.hidden, teacher))
    rule = SampledRule(
        head.tokens, teacher.reshape(-1), estimator, straight_through, bound, head.dtype
    )
    return hidden_loss(head, rule, rows)


@checks_environment
def reverse_kl_rewards(
    log_probs: ArrayLike,
    teacher_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    coef: Scalar = 1.0,
    estimator: Estimator = "k1",
    log_ratio_bound: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""Per-token on-policy distillation rewards :math:`-c\,k(\ell^S, \ell^T)` (detached).

    .. math::

        r_{it} = -c\,k(\ell^S_{it} - \ell^T_{it}) \overset{k_1}{=} c\,(\ell^T_{it} - \ell^S_{it})
        \quad (M_{it} = 1), \qquad r_{it} = 0 \quad (M_{it} = 0),

    the reverse-KL reward of on-policy distillation: pass it (or ``A + r``) as per-token
    ``advantages`` to :func:`rlobjectives.policy_loss` /
    :func:`rlobjectives.fused_policy_loss_from_hidden`, with ``log_probs`` the behaviour
    (old / rollout) log-probabilities of the student's samples. The policy gradient of
    :math:`E_{\pi_S}[r]` with ``"k1"`` is then the unbiased :math:`-c\nabla\mathrm{KL}(\pi_S
    \|\pi_T)` (per token: the teacher's log-probability acts as a dense per-token reward);
    ``"k2"``/``"k3"`` or a clamped ``"k1"`` bias it (they warn, as
    :func:`rlobjectives.kl_penalized_token_rewards`). The result is detached.

    Peers: slime ``--use-opd --opd-kl-coef c`` adds ``reverse_kl_rewards(old, teacher, M,
    coef=c)`` to the estimator's advantages before ``--normalize-advantages``; NeMo-RL
    ``OPDAdvantageEstimator`` is ``reverse_kl_rewards(prev_logprobs, teacher, M)``; verl
    ``use_policy_gradient=True`` uses ``-clamp(k(current log-probs, teacher), ±loss_max_clamp)``
    as the advantages of its vanilla PPO loss (``loss_mode="k1"`` recommended: see
    :func:`rlobjectives.presets.verl_distillation_loss`).

    Args:
        log_probs: ``(B, T)`` the student's log-probabilities of its sampled tokens (usually
            the behaviour policy's).
        teacher_log_probs: ``(B, T)`` the teacher's log-probabilities of the same tokens.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        coef: :math:`c \ge 0` (number or 0-d tensor).
        estimator: ``"k1"`` (default, unbiased), ``"k2"``, ``"k3"`` or ``"abs"``.
        log_ratio_bound: optional clamp :math:`b > 0` on :math:`\ell^S - \ell^T` (default None).
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences (the tensors are then
            ``(N,)`` or ``(1, N)``; the rewards are per token either way).

    Returns:
        ``(B, T)`` rewards (packed: the shape of ``log_probs``), zeros at unselected tokens,
        detached, float32 (float64 when an input is float64).

    Raises:
        ValueError: on mismatched shapes/devices, an unknown ``estimator``, a negative or
            non-finite ``coef``, a non-positive ``log_ratio_bound``, a malformed ``cu_seqlens``.
        TypeError: on non-numeric inputs.

    Warns:
        BiasedGradientWarning: for ``"k2"``/``"k3"``/``"abs"``, or ``"k1"`` with a bound.

    References:
        Thinking Machines 2025, "On-Policy Distillation" (per-token reverse KL as the reward);
        Agarwal et al. 2024, GKD, arXiv:2306.13649; slime ``apply_opd_kl_to_advantages``.

    Examples:
        >>> import torch
        >>> reverse_kl_rewards(torch.log(torch.tensor([[0.5, 0.5]])),
        ...                    torch.log(torch.tensor([[0.25, 0.5]])), torch.tensor([[1, 1]]))
        tensor([[-0.6931,  0.0000]])

    .. versionadded:: 0.3.0
    """
    packed = cu_seqlens is not None
    flat = packed and token_ndim(log_probs) == 1
    student = token_matrix(as_float_tensor(log_probs, "log_probs"), "log_probs", packed)
    device = student.device
    teacher = token_matrix(
        as_float_tensor(teacher_log_probs, "teacher_log_probs", device), "teacher_log_probs", packed
    )
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", packed)
    check_same_device({"log_probs": student, "teacher_log_probs": teacher, "mask": mask_t})
    check_shape(teacher, "teacher_log_probs", tuple(student.shape), "log_probs")
    check_shape(mask_t, "mask", tuple(student.shape), "log_probs")
    sequence_layout(cu_seqlens, student)  # validation of the boundaries
    coefficient = validate_scalar(coef, "coef", minimum=0.0)
    bound = validate_kl_options(estimator, False, log_ratio_bound)
    if estimator != "k1":
        warn_biased(
            f'reverse_kl_rewards(estimator="{estimator}"): as a (detached) reward the '
            f"{estimator} estimate gives a biased policy gradient of KL(student || teacher); k1 "
            "is the unbiased reward"
        )
    elif bound is not None:
        warn_biased(
            "reverse_kl_rewards: clamping the k1 log-ratio (log_ratio_bound) biases the summed "
            "KL reward wherever the bound fires"
        )
    dtype = compute_dtype(student, teacher)
    with torch.no_grad():
        kl = kl_terms(student, teacher, mask_t, estimator=estimator, straight_through=False,
                      log_ratio_bound=bound, dtype=dtype)  # fmt: skip
        if isinstance(coefficient, torch.Tensor):
            coefficient = coefficient.to(dtype=dtype, device=device)
        rewards = masked_fill_zero(0.0 - coefficient * kl, mask_t)  # +0 (not -0) where k = 0
    return token_output(rewards, flat)
