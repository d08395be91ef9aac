r"""Sparse top-k forward KL from the teacher's top-k log-probabilities (with the tail bucket).

A teacher served by an inference engine returns, per token, its top-k log-probabilities
:math:`\ell^T_k` over its full vocabulary and their ids (vLLM ``logprobs``/``prompt_logprobs``,
SGLang ``top_logprobs``); the student's logits are here. With :math:`x = z / \tau` the student's
scaled logits, :math:`\ell^S_k = x_{id_k} - \log\sum_v e^{x_v}`, the teacher's mass
:math:`P_T = \sum_k e^{\ell^T_k}` and the student's :math:`P_S = \sum_k e^{\ell^S_k}`:

.. math::

    \mathrm{head} = \sum_k p^T_k (\ell^T_k - \ell^S_k), \qquad
    \mathrm{tail} = (1 - P_T)\log\frac{1 - P_T}{1 - P_S}.

:class:`TopKRule` evaluates them on one chunk of rows for the drivers of
:mod:`rlobjectives.distillation.chunks`, on the teacher's slots of
:mod:`rlobjectives.distillation.slots`; the public functions are :func:`topk_forward_kl`
(logits) and :func:`topk_forward_kl_from_hidden` (hidden states and the LM head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .._core.chunking import Block, resolve_chunk_size
from .._core.reduction import Reduction
from .._core.validation import ArrayLike, Scalar, checks_environment, compute_dtype, validate_bool
from ..logprobs.head import HeadOptions, Temperature
from .chunks import ChunkOutput, LogitsDivergence, logits_rows, softmax_rows_
from .inputs import hidden_call, hidden_loss, logits_call, reduced, temperature_inverse
from .slots import flatten_slots, teacher_slots, teacher_tensors, zero_where

__all__ = ["TopKMode", "TopKRule", "log1mexp", "topk_forward_kl", "topk_forward_kl_from_hidden"]

TopKMode = Literal["tail", "head", "renormalize"]
_NEG_INF = float("-inf")
_LOG_HALF = -math.log(2.0)


def log1mexp(log_mass: torch.Tensor) -> torch.Tensor:
    r""":math:`\log(1 - e^{a})` without cancellation; ``-inf`` for :math:`a \ge 0`.

    ``log(-expm1(a))`` for :math:`a > -\log 2`, ``log1p(-exp(a))`` below (Maechler 2012).
    """
    below = log_mass.clamp(max=0.0)
    near = torch.log(-torch.expm1(below.clamp(min=_LOG_HALF)))
    far = torch.log1p(-torch.exp(below.clamp(max=_LOG_HALF)))
    return torch.where(below > _LOG_HALF, near, far)


@dataclass(frozen=True, eq=False)
class TopKRule:
    r"""The top-k forward KL of one chunk (values and closed-form gradients).

    ``mode``: ``"tail"`` (head + tail, the default of :func:`topk_forward_kl`), ``"head"``
    (``tail=False``, verl's ``forward_kl_topk``) or ``"renormalize"`` (both distributions
    renormalised over the teacher's valid slots). Gradients with respect to the scaled student
    logits :math:`x` (:math:`q = \mathrm{softmax}(x)`, :math:`q^{rest}_v = e^{x_v -
    \mathrm{lse}(V\setminus K)}` off the set, :math:`T_S = 1 - P_S`, :math:`t` the teacher's
    tail mass in ``"tail"`` mode where it is positive, else 0, and :math:`a = P_T + t`):

    .. math::

        \frac{\partial D}{\partial x_v} = a\,q_v - p^T_v \;(v \in K), \qquad
        q^{rest}_v\,(a\,T_S - t) \;(v \notin K);

    ``"renormalize"``: :math:`\tilde q_v - \tilde p^T_v` on the set, 0 off it.
    """

    log_probs: torch.Tensor  # (rows, K) teacher log-probs over its full vocabulary
    ids: torch.Tensor  # (rows, K) int64
    mode: TopKMode
    dtype: torch.dtype
    value_shape: tuple[int, ...] = ()

    def __call__(
        self,
        scores: torch.Tensor,
        block: Block,
        active: torch.Tensor,
        upstream: torch.Tensor | None,
    ) -> ChunkOutput:
        """The chunk's KL ``(n,)`` and, with ``upstream``, ``dD/dx`` in ``scores``."""
        teacher, ids, valid = teacher_slots(
            self.log_probs[block], self.ids[block], active, self.dtype
        )
        student = torch.where(valid, scores.gather(1, ids), _NEG_INF)  # (n, K) x at the slots
        if self.mode == "renormalize":
            return _renormalized(scores, ids, valid, teacher, student, upstream)
        return self._with_rest(scores, ids, valid, teacher, student, upstream)

    def _with_rest(
        self,
        scores: torch.Tensor,
        ids: torch.Tensor,
        valid: torch.Tensor,
        teacher: torch.Tensor,
        student: torch.Tensor,
        upstream: torch.Tensor | None,
    ) -> ChunkOutput:
        # The complement V \ K: -inf at the valid ids (an idempotent scatter-add; padding adds 0).
        scores.scatter_add_(1, ids, torch.where(valid, _NEG_INF, 0.0).to(scores.dtype))
        rest, log_rest, empty = softmax_rows_(scores)  # q^rest (0 on K), lse(V \ K), (n,)
        log_normalizer = torch.logaddexp(log_rest, torch.logsumexp(student, dim=1))  # lse(V)
        student_log_probs = student - log_normalizer.unsqueeze(1)  # (n, K) l^S, -inf invalid
        log_tail_student = log_rest - log_normalizer  # (n,) log T_S, from the complement
        teacher_probs = teacher.exp()  # (n, K), 0 at invalid slots
        head = zero_where(~valid, teacher_probs * (teacher - student_log_probs)).sum(1)
        tail = torch.zeros_like(head)
        if self.mode == "tail":
            log_tail_teacher = log1mexp(torch.logsumexp(teacher, dim=1))  # (n,) log(1 - P_T)
            tail = zero_where(_covered(ids, valid, scores.shape[1]), log_tail_teacher.exp())  # t
            term = tail * (log_tail_teacher - log_tail_student)  # +inf where T_S = 0 < t
            head = head + zero_where(tail == 0, term)
        if upstream is None:
            return ChunkOutput(head, None)
        total = teacher_probs.sum(1) + tail  # a = P_T + t, (n,)
        factor = zero_where(empty, (total * log_tail_student.exp() - tail) * upstream)  # (n,)
        grad = rest.mul_(factor.unsqueeze(1))  # off K (an empty complement weighs 0)
        slots = (total.unsqueeze(1) * student_log_probs.exp() - teacher_probs) * upstream[:, None]
        grad.scatter_add_(1, ids, zero_where(~valid, slots))  # on K (0 there before)
        return ChunkOutput(head, grad)


def _covered(ids: torch.Tensor, valid: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(n,)`` rows whose valid ids cover the whole vocabulary: no tail bucket exists.

    Only possible with ``K >= V`` slots (decided from the static shapes; all False otherwise).
    A complement whose student logits are all ``-inf`` is not covered: the student's tail is 0
    there and the KL is ``+inf`` wherever the teacher's tail is positive.
    """
    if ids.shape[1] < vocab:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(1, ids, valid.to(torch.int32)).gt(0).all(1)


def _renormalized(
    scores: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    teacher: torch.Tensor,
    student: torch.Tensor,
    upstream: torch.Tensor | None,
) -> ChunkOutput:
    """KL of the teacher and student renormalised over the valid slots (0 for no slot)."""
    any_slot = valid.any(1, keepdim=True)  # (n, 1)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    student_log = student - torch.where(any_slot, torch.logsumexp(student, 1, keepdim=True), zero)
    teacher_log = teacher - torch.where(any_slot, torch.logsumexp(teacher, 1, keepdim=True), zero)
    teacher_probs = teacher_log.exp()  # (n, K)
    value = zero_where(~valid, teacher_probs * (teacher_log - student_log)).sum(1)
    if upstream is None:
        return ChunkOutput(value, None)
    slots = (student_log.exp() - teacher_probs) * upstream.unsqueeze(1)  # (n, K)
    grad = scores.zero_().scatter_add_(1, ids, zero_where(~valid, slots))
    return ChunkOutput(value, grad)


def _mode(tail: bool, renormalize: bool) -> TopKMode:
    validate_bool(tail, "tail")
    validate_bool(renormalize, "renormalize")
    if renormalize:
        return "renormalize"
    return "tail" if tail else "head"


@checks_environment
def topk_forward_kl(
    logits: ArrayLike,
    teacher_log_probs: ArrayLike,
    teacher_ids: ArrayLike,
    mask: ArrayLike,
    *,
    tail: bool = True,
    renormalize: bool = False,
    temperature: Temperature = 1.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""Sparse forward KL(teacher || student) on the teacher's top-k tokens, with the tail bucket.

    With :math:`x = \text{logits}/\tau`, :math:`\ell^S_v = x_v - \log\sum_u e^{x_u}`, the
    teacher's top-k log-probabilities :math:`\ell^T_k` (over its whole vocabulary, so
    :math:`P_T = \sum_k e^{\ell^T_k} \le 1`) at the ids :math:`K = \{id_k\}`, per token

    .. math::

        D = \underbrace{\sum_{k} p^T_k\,(\ell^T_k - \ell^S_{id_k})}_{\text{head}}
          + \underbrace{(1 - P_T)\,\log\frac{1 - P_T}{1 - P_S}}_{\text{tail}}, \qquad
        P_S = \sum_k e^{\ell^S_{id_k}},

    the KL of the :math:`(K+1)`-bucket coarsenings (:math:`0 \le D \le \mathrm{KL}(p_T\|p_S)`);
    ``tail=False``: the head alone; ``renormalize=True``: both renormalised over the teacher's
    slots, :math:`\sum_k \tilde p^T_k(\tilde\ell^T_k - \tilde\ell^S_k)` (``tail`` ignored).
    Derivation, numerics (:math:`\log(1 - P_S)` from the complement's log-sum-exp), the chunked
    closed-form gradient, slot rules: ``docs/objectives/distillation.md``, "``topk_forward_kl``".

    Peers: verl ``loss_mode="forward_kl_topk"``: ``tail=False`` (+ the clamps of
    :func:`rlobjectives.presets.verl_distillation_loss`); TRL server distillation ``beta=0``,
    ``loss_add_tail=True``/``False``: ``tail=True``/``renormalize=True``; NeMo-RL
    ``DistillationLossFn(kl_type="forward", zero_outside_topk=False)``: ``renormalize=True``.

    Args:
        logits: ``(B, T, V)`` student logits (packed ``(N, V)`` / ``(1, N, V)``), any float dtype.
        teacher_log_probs: ``(B, T, K)`` (packed ``(N, K)``) the teacher's top-k
            log-probabilities over its full vocabulary (``-inf`` = padding slot).
        teacher_ids: ``(B, T, K)`` integer token ids of the teacher's slots.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        tail: add the tail bucket (default); False gives verl's head-only loss.
        renormalize: renormalise both distributions over the teacher's slots.
        temperature: :math:`\tau > 0` dividing the student logits (not the teacher's top-k).
        reduction: as :func:`rlobjectives.aggregate` (default ``"token_mean"``).
        normalizer: explicit positive denominator for micro-batches and ranks.
        max_response_length: the Dr. GRPO constant of ``"sequence_sum_normalized"``.
        chunk_size: rows per chunk, or None for about 32 MiB of float32 per chunk.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.

    Returns:
        A 0-d loss (``"none"``: the ``(B, T)`` per-token KL, zeros at unselected tokens;
        packed: the shape of ``mask``), float32 (float64 for float64 ``logits``/teacher).

    Raises:
        ValueError: on wrong shapes or devices, ``temperature <= 0``, an unknown ``reduction``, a
            non-positive ``normalizer``/``max_response_length``/``chunk_size``, bad ``cu_seqlens``.
        TypeError: on non-numeric inputs, non-integer ``teacher_ids``, non-bool ``tail`` /
            ``renormalize``.

    References:
        Agarwal et al. 2024, GKD, arXiv:2306.13649 Sec. 3; Thinking Machines 2025, "On-Policy
        Distillation"; TRL ``_add_tail_bucket``; verl ``compute_forward_kl_topk``.

    Examples:
        >>> logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))
        >>> teacher, ids = torch.log(torch.tensor([[[0.5, 0.3]]])), torch.tensor([[[0, 1]]])
        >>> topk_forward_kl(logits, teacher, ids, torch.tensor([[True]]))  # see the docs' golden
        tensor(0.0305)

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
    log_probs, ids = teacher_tensors(teacher_log_probs, teacher_ids, rows, logits_t.device)
    mode = _mode(tail, renormalize)
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    dtype = compute_dtype(logits_t, log_probs)
    inverse = temperature_inverse(temperature, rows, logits_t.device, dtype)
    flat = logits_rows(logits_t, chunk).flat
    rule = TopKRule(flatten_slots(log_probs, flat), flatten_slots(ids, flat), mode, dtype)
    values = LogitsDivergence.apply(logits_t, rule, rows.mask, inverse, chunk, dtype)  # type: ignore[no-untyped-call]
    return reduced(values, rows)


@checks_environment
def topk_forward_kl_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_log_probs: ArrayLike,
    teacher_ids: ArrayLike,
    mask: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    tail: bool = True,
    renormalize: bool = False,
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
    r""":func:`topk_forward_kl` from hidden states and the LM head, without the ``(N, V)`` logits.

    The student logits :math:`z = h W^\top + b` are formed ``chunk_size`` rows at a time in one
    reused ``(chunk, V)`` buffer (the LM-head machinery of
    :func:`rlobjectives.token_log_probs_from_hidden`); per chunk the closed-form gradient of
    :func:`topk_forward_kl` with respect to the chunk's logits, :math:`G`, gives ``grad_hidden
    = G W`` and ``grad_weight += G^T h`` (``grad_bias += sum G``). For a reduced loss the
    per-token weights of the reduction are known from the mask, so the gradients are formed in
    the forward chunk loop (no recompute, one backward per forward); ``reduction="none"`` and
    calls under ``torch.no_grad`` keep per-row statistics only and recompute each chunk in
    backward. Values and gradients equal :func:`topk_forward_kl` on ``hidden @ weight.T +
    bias`` (the product in the weight's dtype, the softmax in float32).

    Args:
        hidden: ``(B, T, H)`` hidden states (packed: ``(N, H)`` / ``(1, N, H)``), float64,
            float32, bfloat16 or float16.
        weight: ``(V, H)`` LM-head weight, the dtype of ``hidden``.
        teacher_log_probs: ``(B, T, K)`` the teacher's top-k log-probabilities (``-inf`` =
            padding), as in :func:`topk_forward_kl`.
        teacher_ids: ``(B, T, K)`` their integer token ids.
        mask: ``(B, T)``; where False the hidden row is never read.
        bias: optional ``(V,)`` LM-head bias, the dtype of ``weight``.
        tail: add the tail bucket (default).
        renormalize: renormalise both over the teacher's slots.
        temperature: :math:`\tau > 0` dividing the student logits,
            or a per-token tensor ``(B, T)`` (packed ``(N,)``).
        reduction: as :func:`topk_forward_kl`.
        normalizer: explicit positive denominator for micro-batches and ranks.
        max_response_length: the Dr. GRPO constant.
        chunk_size: rows per chunk; None: at most N/16 rows and 64 MiB of buffers, at least 256
            rows (:func:`rlobjectives.logprobs.hidden.default_chunk_size`).
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.
        final_logit_softcapping: :math:`c > 0` capping the student logits
            :math:`c \tanh(s z / c)` before the temperature (Gemma 2/3), or None; as
            :func:`rlobjectives.token_log_probs_from_hidden`.
        logit_scale: :math:`s` multiplying the student logits first (Cohere, Granite).
        fp32_head: the bf16/fp16 product with a float32 result (default), as
            :func:`rlobjectives.token_log_probs_from_hidden`.

    Returns:
        As :func:`topk_forward_kl`: a 0-d loss, or the ``(B, T)`` per-token KL for ``"none"``.

    Raises:
        ValueError: as :func:`topk_forward_kl`, and on a weight/bias of another shape or dtype.
        TypeError: on non-floating ``hidden``/``weight``/``bias``, as :func:`topk_forward_kl`.

    References:
        As :func:`topk_forward_kl`; Wijmans et al. 2024, Cut Cross-Entropy, arXiv:2411.09009;
        Hsu et al. 2024, Liger-Kernel, arXiv:2410.10989 Sec. 3.3 (fused linear losses).

    Examples:
        >>> import torch
        >>> hidden, weight = torch.zeros(1, 1, 2), torch.zeros(4, 2)  # uniform student
        >>> teacher = torch.log(torch.tensor([[[0.5, 0.25]]]))
        >>> mask = torch.tensor([[True]])
        >>> topk_forward_kl_from_hidden(hidden, weight, teacher, torch.tensor([[[0, 1]]]), mask)
        tensor(0.1733)

    .. versionadded:: 0.3.0
    """
    head, rows = hidden_call(
        hidden,
        weight,
        None,
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
    log_probs, ids = teacher_tensors(teacher_log_probs, teacher_ids, rows, head.hidden.device)
    mode = _mode(tail, renormalize)
    head = head._replace(dtype=compute_dtype(head.hidden, log_probs))
    slots = log_probs.shape[-1]
    rule = TopKRule(log_probs.reshape(-1, slots), ids.reshape(-1, slots), mode, head.dtype)
    return hidden_loss(head, rule, rows)
