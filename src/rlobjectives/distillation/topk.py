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
:mod:`rlobjectives.distillation.chunks`; the public functions are :func:`topk_forward_kl`
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
from .inputs import (
    Rows,
    hidden_call,
    hidden_loss,
    logits_call,
    reduced,
    temperature_inverse,
    token_slots,
)

__all__ = [
    "SlotLogProbsRule",
    "TopKMode",
    "TopKRule",
    "log1mexp",
    "teacher_slot_log_probs",
    "topk_forward_kl",
    "topk_forward_kl_from_hidden",
]

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


def _teacher_slots(
    log_probs: torch.Tensor, ids: torch.Tensor, active: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_probs, ids, valid)`` of a chunk's teacher slots ``(n, K)``.

    A slot is valid where its log-probability is not ``-inf`` (padding) and its row is active;
    invalid slots get ``-inf`` and id 0 (never gathered as data), before any arithmetic.
    """
    teacher = log_probs.to(dtype)
    valid = (teacher != _NEG_INF) & active.unsqueeze(1)  # NaN/+inf stay valid: they propagate
    return (
        torch.where(valid, teacher, _NEG_INF),
        torch.where(valid, ids, torch.zeros_like(ids)),
        valid,
    )


def _zero_where(condition: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(condition, torch.zeros((), dtype=values.dtype, device=values.device), values)


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
        teacher, ids, valid = _teacher_slots(
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
        head = _zero_where(~valid, teacher_probs * (teacher - student_log_probs)).sum(1)
        tail = torch.zeros_like(head)
        if self.mode == "tail":
            log_tail_teacher = log1mexp(torch.logsumexp(teacher, dim=1))  # (n,) log(1 - P_T)
            tail = _zero_where(_covered(ids, valid, scores.shape[1]), log_tail_teacher.exp())  # t
            term = tail * (log_tail_teacher - log_tail_student)  # +inf where T_S = 0 < t
            head = head + _zero_where(tail == 0, term)
        if upstream is None:
            return ChunkOutput(head, None)
        total = teacher_probs.sum(1) + tail  # a = P_T + t, (n,)
        factor = _zero_where(empty, (total * log_tail_student.exp() - tail) * upstream)  # (n,)
        grad = rest.mul_(factor.unsqueeze(1))  # off K (an empty complement weighs 0)
        slots = (total.unsqueeze(1) * student_log_probs.exp() - teacher_probs) * upstream[:, None]
        grad.scatter_add_(1, ids, _zero_where(~valid, slots))  # on K (0 there before)
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
    value = _zero_where(~valid, teacher_probs * (teacher_log - student_log)).sum(1)
    if upstream is None:
        return ChunkOutput(value, None)
    slots = (student_log.exp() - teacher_probs) * upstream.unsqueeze(1)  # (n, K)
    grad = scores.zero_().scatter_add_(1, ids, _zero_where(~valid, slots))
    return ChunkOutput(value, grad)


@dataclass(frozen=True, eq=False)
class SlotLogProbsRule:
    r"""The student's log-probabilities at the teacher's slots, ``(n, K)`` (``-inf`` at padding).

    The building block of the presets that transform them (verl's ``log_prob_min_clamp``):
    :math:`\partial\sum_k g_k \ell^S_k / \partial x_v = \sum_k g_k \mathbb{1}[v = id_k] - q_v
    \sum_k g_k`.
    """

    log_probs: torch.Tensor  # (rows, K) teacher log-probs (only their -inf padding is read)
    ids: torch.Tensor  # (rows, K)
    dtype: torch.dtype
    slots: int

    @property
    def value_shape(self) -> tuple[int, ...]:
        """``(K,)``."""
        return (self.slots,)

    def __call__(
        self,
        scores: torch.Tensor,
        block: Block,
        active: torch.Tensor,
        upstream: torch.Tensor | None,
    ) -> ChunkOutput:
        """The chunk's ``(n, K)`` slot log-probabilities (and ``dD/dx`` in ``scores``)."""
        _, ids, valid = _teacher_slots(self.log_probs[block], self.ids[block], active, self.dtype)
        student = scores.gather(1, ids)  # (n, K)
        probs, log_normalizer, _ = softmax_rows_(scores)
        values = torch.where(valid, student - log_normalizer.unsqueeze(1), _NEG_INF)
        if upstream is None:
            return ChunkOutput(values, None)
        upstream = _zero_where(~valid, upstream)
        grad = probs.mul_(-upstream.sum(1, keepdim=True)).scatter_add_(1, ids, upstream)
        return ChunkOutput(values, grad)


def _mode(tail: bool, renormalize: bool) -> TopKMode:
    validate_bool(tail, "tail")
    validate_bool(renormalize, "renormalize")
    if renormalize:
        return "renormalize"
    return "tail" if tail else "head"


def _teacher(
    teacher_log_probs: ArrayLike, teacher_ids: ArrayLike, rows: Rows, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = token_slots(teacher_log_probs, "teacher_log_probs", rows, device)
    ids = token_slots(teacher_ids, "teacher_ids", rows, device, ids=True)
    check_slots = {"teacher_log_probs": log_probs, "teacher_ids": ids}
    if tuple(ids.shape) != tuple(log_probs.shape):
        raise ValueError(
            f"teacher_ids must have the shape of teacher_log_probs {tuple(log_probs.shape)}, got "
            f"shape {tuple(ids.shape)}"
        )
    for name, tensor in check_slots.items():
        if tensor.device != device:
            raise ValueError(
                f"{name} must be on the same device as the student ({device}), got device "
                f"{tensor.device}"
            )
    return log_probs.detach(), ids.to(torch.int64)


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

    the KL between the :math:`(K+1)`-bucket coarsenings of the two distributions (the top-k
    tokens and one bucket for the rest): :math:`0 \le D \le \mathrm{KL}(p_T \| p_S)` when the
    teacher's log-probabilities are exact, with equality when the teacher's tail is
    proportional to the student's. ``tail=False`` keeps the head alone (verl's
    ``forward_kl_topk``; it can be negative, the sets being sub-distributions: verl clamps it,
    see :func:`rlobjectives.presets.verl_distillation_loss`). ``renormalize=True`` renormalises
    both over the teacher's slots, :math:`\tilde\ell = \ell - \log\sum_k e^{\ell_k}`, and
    returns :math:`\sum_k \tilde p^T_k(\tilde\ell^T_k - \tilde\ell^S_k)` (``tail`` then has no
    effect): TRL's ``loss_add_tail=False`` and NeMo-RL's ``zero_outside_topk=False``.

    Numerics: the student's tail mass is never ``1 - sum(top-k probabilities)`` (17% relative
    error in float32 at a tail of 4e-6, NaN below 1e-8): :math:`\log(1 - P_S) =
    \mathrm{lse}(x_{V\setminus K}) - \mathrm{lse}(x)`, the log-sum-exp of the complement
    (exact to float32 rounding at any tail); the teacher's :math:`\log(1 - P_T)` is
    ``log1mexp`` of :math:`\log P_T` (``-inf``, a tail term of 0, when :math:`P_T \ge 1` by
    rounding; no silent renormalisation). A teacher set covering the whole vocabulary has no
    tail bucket (term 0); a student with no mass outside the set (every other logit ``-inf``)
    while the teacher has some gives ``+inf``, never NaN. Gradient with respect to the logits
    (:math:`q = \mathrm{softmax}(x)`):

    .. math::

        \frac{\partial D}{\partial\,\text{logits}_v} = \frac{1}{\tau}\begin{cases}
            q_v - p^T_v & v \in K \\
            q_v - (1 - P_T)\,e^{x_v - \mathrm{lse}(x_{V\setminus K})} & v \notin K
        \end{cases}

    (``tail=False``: :math:`P_T q_v - p^T_v \mathbb{1}[v \in K]`; ``renormalize``:
    :math:`(\tilde q_v - \tilde p^T_v)\mathbb{1}[v \in K]`), computed chunk by chunk in closed
    form: only one ``(chunk, V)`` float32 block exists at a time in either pass.

    Teacher slots: a slot whose log-probability is ``-inf`` is padding (a server returning
    fewer than K, TRL's padding; its id is never read). NaN or ``+inf`` at a selected token
    propagate (they are not silently dropped). The ids of a row should be distinct, as
    engines return them (not checked on the device); ids of valid slots must lie in ``[0, V)``.
    The teacher tensors get no gradient. Where ``mask`` is False nothing is read: any value
    there (NaN/inf logits, garbage ids) reaches neither the loss nor the gradient.

    Peers: verl ``distillation_loss.loss_mode="forward_kl_topk"`` (``tail=False``, plus the
    clamps of the preset), TRL server/async distillation ``beta=0`` with ``loss_add_tail=True``
    (equal, except where TRL's tail floor :math:`10^{-7}` fires) or ``loss_add_tail=False``
    (``renormalize=True``), NeMo-RL ``DistillationLossFn(kl_type="forward")``
    (``zero_outside_topk=False``: ``renormalize=True``; ``zero_outside_topk=True``: the
    teacher's top-k logits log-softmaxed over K as ``teacher_log_probs``, i.e. a teacher mass
    of 1). Reductions: TRL ``batchmean`` with labels = ``"token_mean"``;
    ``num_items_in_batch`` = ``normalizer``; verl ``token-mean`` = ``"token_mean"`` with
    ``normalizer=batch_num_tokens / dp_size``; NeMo-RL ``global_valid_toks`` = ``normalizer``.

    Args:
        logits: ``(B, T, V)`` student logits (packed: ``(N, V)`` or ``(1, N, V)``), any float
            dtype (read block by block in float32, float64 for float64 inputs).
        teacher_log_probs: ``(B, T, K)`` (packed ``(N, K)``) the teacher's top-k
            log-probabilities over its full vocabulary (``-inf`` = padding slot).
        teacher_ids: ``(B, T, K)`` integer token ids of the teacher's slots.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        tail: add the tail bucket (default); False gives verl's head-only loss.
        renormalize: renormalise both distributions over the teacher's slots.
        temperature: :math:`\tau > 0` dividing the student logits (the teacher's top-k come
            from the engine at its own temperature).
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``,
            ``"length_weighted"`` or ``"none"`` (see :func:`rlobjectives.aggregate`).
        normalizer: explicit positive denominator (global token count, ...) so that the
            losses of micro-batches and ranks add up to the full-batch loss.
        max_response_length: the Dr. GRPO constant of ``"sequence_sum_normalized"``.
        chunk_size: rows per chunk, or None for about 32 MiB of float32 per chunk.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences (see
            :func:`rlobjectives.policy_loss`).

    Returns:
        The loss, a 0-d tensor (``"none"``: the ``(B, T)`` per-token KL, zeros at unselected
        tokens; packed: the shape of ``mask``), float32 (float64 when ``logits`` or
        ``teacher_log_probs`` is float64).

    Raises:
        ValueError: on wrong shapes or devices, ``temperature <= 0``, an unknown ``reduction``,
            a non-positive ``normalizer``/``max_response_length``/``chunk_size`` or a malformed
            ``cu_seqlens``.
        TypeError: on non-numeric inputs, non-integer ``teacher_ids``, non-bool ``tail`` /
            ``renormalize``.

    References:
        Agarwal et al. 2024, On-Policy Distillation of Language Models (GKD),
        arXiv:2306.13649 Sec. 3 (forward KL on student samples); Thinking Machines 2025,
        "On-Policy Distillation"; the tail bucket: TRL ``experimental/server_distillation``
        ``_add_tail_bucket``; verl ``trainer/distillation/fsdp/losses.py``
        ``compute_forward_kl_topk``.

    Examples:
        >>> import torch
        >>> logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))
        >>> teacher = torch.log(torch.tensor([[[0.5, 0.3]]]))
        >>> ids, mask = torch.tensor([[[0, 1]]]), torch.tensor([[True]])
        >>> topk_forward_kl(logits, teacher, ids, mask)  # .5 ln(.5/.4) + .2 ln(.2/.3)
        tensor(0.0305)
        >>> topk_forward_kl(logits, teacher, ids, mask, tail=False)  # .5 ln(.5/.4)
        tensor(0.1116)

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
    log_probs, ids = _teacher(teacher_log_probs, teacher_ids, rows, logits_t.device)
    mode = _mode(tail, renormalize)
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    dtype = compute_dtype(logits_t, log_probs)
    inverse = temperature_inverse(temperature, rows, logits_t.device, dtype)
    flat = logits_rows(logits_t, chunk).flat
    rule = TopKRule(_flatten(log_probs, flat), _flatten(ids, flat), mode, dtype)
    values = LogitsDivergence.apply(logits_t, rule, rows.mask, inverse, chunk, dtype)  # type: ignore[no-untyped-call]
    return reduced(values, rows)


def _flatten(tensor: torch.Tensor, flat: bool) -> torch.Tensor:
    """``(B, T, K)`` as ``(N, K)`` when the logits' rows are flat, else as given."""
    return tensor.reshape(-1, tensor.shape[-1]) if flat else tensor


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
    log_probs, ids = _teacher(teacher_log_probs, teacher_ids, rows, head.hidden.device)
    mode = _mode(tail, renormalize)
    head = head._replace(dtype=compute_dtype(head.hidden, log_probs))
    slots = log_probs.shape[-1]
    rule = TopKRule(log_probs.reshape(-1, slots), ids.reshape(-1, slots), mode, head.dtype)
    return hidden_loss(head, rule, rows)


@checks_environment
def teacher_slot_log_probs(
    logits: ArrayLike,
    teacher_log_probs: ArrayLike,
    teacher_ids: ArrayLike,
    mask: ArrayLike,
    *,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""The student's log-probabilities at the teacher's slots, ``(B, T, K)``, chunked.

    :math:`\ell^S_k = x_{id_k} - \log\sum_v e^{x_v}` with :math:`x = \text{logits}/\tau`;
    ``-inf`` at padding slots (teacher ``-inf``) and 0 where ``mask`` is False. Differentiable
    in ``logits`` (the gradient is recomputed block by block). The building block of the
    presets that transform the per-slot values (verl's ``log_prob_min_clamp``); validated as
    :func:`topk_forward_kl` (padded ``(B, T, V)`` logits).
    """
    logits_t, rows = logits_call(logits, mask, cu_seqlens=None, reduction="none",
                                 normalizer=None, max_response_length=None)  # fmt: skip
    log_probs, ids = _teacher(teacher_log_probs, teacher_ids, rows, logits_t.device)
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    dtype = compute_dtype(logits_t, log_probs)
    inverse = temperature_inverse(temperature, rows, logits_t.device, dtype)
    flat = logits_rows(logits_t, chunk).flat
    rule = SlotLogProbsRule(_flatten(log_probs, flat), _flatten(ids, flat), dtype, ids.shape[-1])
    values: torch.Tensor = LogitsDivergence.apply(  # type: ignore[no-untyped-call]
        logits_t, rule, rows.mask, inverse, chunk, dtype
    )
    return values
