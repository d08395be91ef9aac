r"""The generalized Jensen-Shannon divergence of GKD between the student's and the teacher's logits.

GKD (Agarwal et al. 2024, Eq. 1) in TRL's and Liger's convention, both distributions at the same
temperature, :math:`q = \mathrm{softmax}(s/\tau)` (student), :math:`p = \mathrm{softmax}(t/\tau)`
(teacher), :math:`m = \beta p + (1 - \beta) q`:

.. math::

    \mathrm{JSD}_\beta = \beta\,\mathrm{KL}(p \| m) + (1 - \beta)\,\mathrm{KL}(q \| m)
    \quad (0 < \beta < 1), \qquad \mathrm{KL}(p\|q)\ (\beta = 0), \qquad
    \mathrm{KL}(q\|p)\ (\beta = 1).

:class:`JSDRule` evaluates it on one chunk of rows (values and the closed-form gradient); the
teacher's chunk comes from its logits (:func:`generalized_jsd_loss`) or from its hidden states
and LM head (:func:`generalized_jsd_loss_from_hidden`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._core.chunking import Block, resolve_chunk_size
from .._core.reduction import Reduction
from .._core.validation import (
    ArrayLike,
    Scalar,
    check_same_device,
    checks_environment,
    compute_dtype,
    describe,
    validate_scalar,
)
from ..logprobs.blocks import xlogy_terms
from ..logprobs.head import Head, HeadOptions, Temperature, validate_scale, validate_softcap
from .chunks import (
    ChunkOutput,
    Inverse,
    LogitsDivergence,
    TeacherHead,
    TeacherLogits,
    load_scores,
    logits_rows,
)
from .inputs import (
    Rows,
    hidden_call,
    hidden_loss,
    logits_call,
    reduced,
    temperature_inverse,
)
from .inputs import teacher_logits as validate_teacher_logits

__all__ = ["JSDRule", "generalized_jsd_loss", "generalized_jsd_loss_from_hidden"]


def _log_softmax_(scores: torch.Tensor) -> torch.Tensor:
    """``scores - logsumexp(scores)`` per row, in place."""
    return scores.sub_(torch.logsumexp(scores, dim=1, keepdim=True))


@dataclass(frozen=True, eq=False)
class JSDRule:
    r"""The generalized JSD of one chunk and its gradient with respect to the student's logits.

    With :math:`\ell^S, \ell^T` the log-softmaxes of the chunk and :math:`\log m =
    \mathrm{logaddexp}(\ell^S + \log(1-\beta), \ell^T + \log\beta)`:

    .. math::

        \frac{\partial D}{\partial x_v} = q_v - p_v\ (\beta = 0), \quad
        q_v(\ell^S_v - \ell^T_v - \mathrm{KL}(q\|p))\ (\beta = 1), \quad
        (1 - \beta)\,q_v(\ell^S_v - \log m_v - \mathrm{KL}(q\|m))\ (0 < \beta < 1).

    Terms with zero probability contribute 0 (``-inf`` logits of banned tokens).
    """

    teacher: TeacherLogits
    beta: float
    value_shape: tuple[int, ...] = ()

    def __call__(
        self,
        scores: torch.Tensor,
        block: Block,
        active: torch.Tensor,
        upstream: torch.Tensor | None,
    ) -> ChunkOutput:
        """The chunk's divergences ``(n,)`` and, with ``upstream``, ``dD/dx`` (a new buffer)."""
        teacher_log = _log_softmax_(self.teacher(block, active))  # (n, V) l^T
        student_log = _log_softmax_(scores)  # (n, V) l^S
        student_probs = student_log.exp()  # (n, V) q
        if self.beta == 0.0:  # forward KL(p || q)
            teacher_probs = teacher_log.exp()  # (n, V) p
            values = xlogy_terms(teacher_probs, teacher_log - student_log).sum(1)
            if upstream is None:
                return ChunkOutput(values, None)
            return ChunkOutput(values, student_probs.sub_(teacher_probs).mul_(upstream[:, None]))
        if self.beta == 1.0:  # reverse KL(q || p)
            difference = student_log.sub_(teacher_log)  # (n, V) l^S - l^T
            values = xlogy_terms(student_probs, difference).sum(1)
            if upstream is None:
                return ChunkOutput(values, None)
            grad = xlogy_terms(student_probs, difference.sub_(values.unsqueeze(1)))
            return ChunkOutput(values, grad.mul_(upstream[:, None]))
        log_mixture = torch.logaddexp(
            student_log + math.log1p(-self.beta), teacher_log + math.log(self.beta)
        )  # (n, V) log m
        teacher_part = xlogy_terms(teacher_log.exp(), teacher_log.sub_(log_mixture)).sum(1)
        difference = student_log.sub_(log_mixture)  # (n, V) l^S - log m
        student_part = xlogy_terms(student_probs, difference).sum(1)  # KL(q || m)
        values = self.beta * teacher_part + (1.0 - self.beta) * student_part
        if upstream is None:
            return ChunkOutput(values, None)
        grad = xlogy_terms(student_probs, difference.sub_(student_part.unsqueeze(1)))
        return ChunkOutput(values, grad.mul_(((1.0 - self.beta) * upstream).unsqueeze(1)))


class _TeacherLogitsRows:
    """The teacher's logits block by block (the student's row layout), scaled, in a buffer."""

    def __init__(self, logits: torch.Tensor, flat: bool, inv_temperature: Inverse,
                 buffer: torch.Tensor) -> None:  # fmt: skip
        self.rows = logits.reshape(-1, logits.shape[-1]) if flat else logits
        if isinstance(inv_temperature, torch.Tensor) and flat:  # laid out like the rows
            inv_temperature = inv_temperature.reshape(-1)
        self.inv_temperature, self.buffer = inv_temperature, buffer

    def __call__(self, block: Block, active: torch.Tensor) -> torch.Tensor:
        return load_scores(self.rows, block, active, self.inv_temperature, self.buffer)


def _validate_beta(beta: float) -> float:
    value = float(validate_scalar(beta, "beta", minimum=0.0, allow_tensor=False))
    if value > 1.0:
        raise ValueError(f"beta must be in [0, 1], got {value}")
    return value


#: Rows per chunk of the logits path by default: a quarter of the logits functions' 32 MiB of
#: float32 per chunk (the JSD holds about four (chunk, V) blocks at once).
_JSD_BLOCKS = 4


@checks_environment
def generalized_jsd_loss(
    logits: ArrayLike,
    teacher_logits: ArrayLike,
    mask: ArrayLike,
    *,
    beta: float = 0.5,
    temperature: Temperature = 1.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""GKD's generalized Jensen-Shannon divergence (student, teacher), reduced to a loss.

    With :math:`q = \mathrm{softmax}(\text{logits}/\tau)`, :math:`p =
    \mathrm{softmax}(\text{teacher\_logits}/\tau)` per token and :math:`m = \beta p + (1-\beta)
    q` (:math:`\log m` by ``logaddexp``):

    .. math::

        D_\beta = \begin{cases}
            \mathrm{KL}(p \,\|\, q) & \beta = 0 \ \text{(forward KL)} \\
            \beta\,\mathrm{KL}(p \,\|\, m) + (1-\beta)\,\mathrm{KL}(q \,\|\, m) & 0 < \beta < 1 \\
            \mathrm{KL}(q \,\|\, p) & \beta = 1 \ \text{(reverse KL)}
        \end{cases}, \qquad \mathcal{L} = \mathrm{reduce}_M(D_\beta).

    TRL's and Liger's convention; the endpoints are special cases, so the loss is discontinuous
    there, as in TRL. The gradient (student logits only; the teacher is read detached) is
    closed-form, chunk by chunk: its cases, the endpoints and the memory in
    ``docs/objectives/distillation.md``, "``generalized_jsd_loss``".

    Peers: TRL ``GKDTrainer.generalized_jsd_loss`` (GKD, GOLD): ``mask = labels != -100``,
    ``reduction="batchmean"`` = ``"token_mean"``, ``num_items_in_batch`` = ``normalizer`` (the
    other reductions: the page's normaliser table); TRL's ``DistillationTrainer``:
    :func:`generalized_jsd_loss_from_hidden`; Liger ``LigerJSD(beta)`` (input = student).

    Args:
        logits: ``(B, T, V)`` student logits (packed ``(N, V)`` / ``(1, N, V)``).
        teacher_logits: the teacher's logits, the shape of ``logits`` (same vocabulary).
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        beta: :math:`\beta \in [0, 1]`, a Python number.
        temperature: :math:`\tau > 0` dividing both logit tensors,
            or a per-token tensor ``(B, T)`` (packed ``(N,)``).
        reduction: as :func:`rlobjectives.aggregate`.
        normalizer: explicit positive denominator (TRL's ``num_items_in_batch``).
        max_response_length: the Dr. GRPO constant.
        chunk_size: rows per chunk, or None for about 8 MiB of float32 per block.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.

    Returns:
        A 0-d loss (``"none"``: the ``(B, T)`` per-token divergences, packed: the shape of
        ``mask``), float32 (float64 when an input is float64).

    Raises:
        ValueError: on wrong shapes or devices, ``beta`` outside [0, 1], ``temperature <= 0``, an
            unknown ``reduction``, a non-positive ``normalizer``/``chunk_size``, bad ``cu_seqlens``.
        TypeError: on non-numeric inputs or a tensor-valued ``beta``/``temperature``.

    References:
        Agarwal et al. 2024, On-Policy Distillation of Language Models: Learning from
        Self-Generated Mistakes (GKD), arXiv:2306.13649 Eq. 1; Lin 1991 (the skew JSD).

    Examples:
        >>> student = torch.log(torch.tensor([[[0.5, 0.5]]]))
        >>> teacher, mask = torch.log(torch.tensor([[[0.25, 0.75]]])), torch.tensor([[True]])
        >>> generalized_jsd_loss(student, teacher, mask, beta=0.0)  # KL(teacher || student)
        tensor(0.1308)
        >>> generalized_jsd_loss(student, teacher, mask, beta=1.0)  # KL(student || teacher)
        tensor(0.1438)

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
    teacher = validate_teacher_logits(teacher_logits, rows, logits_t.shape[-1]).detach()
    check_same_device({"logits": logits_t, "teacher_logits": teacher})
    beta_value = _validate_beta(beta)
    if chunk_size is None:
        chunk = max(1, resolve_chunk_size(None, row_width=logits_t.shape[-1]) // _JSD_BLOCKS)
    else:
        chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    dtype = compute_dtype(logits_t, teacher)
    inverse = temperature_inverse(temperature, rows, logits_t.device, dtype)
    layout = logits_rows(logits_t, chunk)
    width = layout.rows.shape[0] if layout.flat else layout.rows.shape[1]
    buffer = torch.empty(
        min(chunk, max(width, 1)), logits_t.shape[-1], dtype=dtype, device=logits_t.device
    )
    source = _TeacherLogitsRows(teacher, layout.flat, inverse, buffer)
    rule = JSDRule(source, beta_value)
    values = LogitsDivergence.apply(logits_t, rule, rows.mask, inverse, chunk, dtype)  # type: ignore[no-untyped-call]
    return reduced(values, rows)


def _floating(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {describe(value)}")
    return value


def _teacher_head(
    hidden: object,
    weight: object,
    bias: object,
    student: Head,
    rows: Rows,
    options: tuple[object, object],
) -> Head:
    """The teacher's LM head: ``(B, T, H_T)`` hidden states, ``(V, H_T)`` weight, ``(V,)`` bias.

    The teacher may have another hidden size than the student (TRL's ``DistillationTrainer``),
    never another vocabulary. Read detached, in the call's computation dtype. ``options``: the
    teacher's ``(final_logit_softcapping, logit_scale)``; its temperature is the student's.
    """
    packed = rows.layout.sequence_ids is not None
    hidden_t = _floating(hidden, "teacher_hidden")
    if packed and hidden_t.ndim == 2:
        hidden_t = hidden_t.unsqueeze(0)
    batch_shape = rows.batch_shape
    if hidden_t.ndim != 3 or tuple(hidden_t.shape[:2]) != batch_shape or hidden_t.shape[2] < 1:
        expected = "(N, H_T) or (1, N, H_T)" if packed else "(B, T, H_T)"
        raise ValueError(
            f"teacher_hidden must have shape {expected} with the student's tokens "
            f"{batch_shape} and H_T >= 1, got shape {tuple(hidden_t.shape)}"
        )
    weight_t = _floating(weight, "teacher_weight")
    vocab = student.weight.shape[0]
    if tuple(weight_t.shape) != (vocab, hidden_t.shape[2]) or weight_t.dtype != hidden_t.dtype:
        raise ValueError(
            f"teacher_weight must have shape (V, H_T) = ({vocab}, {hidden_t.shape[2]}) (the "
            f"student's vocabulary, H_T from teacher_hidden) and dtype {hidden_t.dtype}, got "
            f"shape {tuple(weight_t.shape)} and dtype {weight_t.dtype}"
        )
    bias_t = None if bias is None else _floating(bias, "teacher_bias")
    if bias_t is not None and (tuple(bias_t.shape) != (vocab,) or bias_t.dtype != weight_t.dtype):
        raise ValueError(
            f"teacher_bias must have shape ({vocab},) and dtype {weight_t.dtype} like "
            f"teacher_weight, got shape {tuple(bias_t.shape)} and dtype {bias_t.dtype}"
        )
    tensors = {"hidden": student.hidden, "teacher_hidden": hidden_t, "teacher_weight": weight_t}
    check_same_device(tensors if bias_t is None else {**tensors, "teacher_bias": bias_t})
    softcap = validate_softcap(options[0], "teacher_final_logit_softcapping")
    scale = validate_scale(options[1], "teacher_logit_scale")
    transform = student.transform._replace(scale=scale, softcap=softcap)
    return Head(
        hidden=hidden_t.detach().reshape(-1, hidden_t.shape[2]),
        weight=weight_t.detach(),
        bias=None if bias_t is None else bias_t.detach(),
        tokens=student.tokens,
        transform=transform,
        chunk_size=student.chunk_size,
        dtype=student.dtype,
        fp32=student.fp32,
    )


@checks_environment
def generalized_jsd_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: ArrayLike,
    *,
    beta: float = 0.5,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: Temperature = 1.0,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    fp32_head: bool = True,
    teacher_final_logit_softcapping: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> torch.Tensor:
    r""":func:`generalized_jsd_loss` from both models' hidden states and LM heads, chunked.

    Per chunk of rows both models' logits :math:`(h W^\top + b)/\tau`, :math:`(h_T W_T^\top +
    b_T)/\tau` are formed in two reused ``(chunk, V)`` buffers (never the ``(N, V)`` logits); the
    teacher may have another hidden size and gets no gradient. Equal in value and gradient to
    :func:`generalized_jsd_loss` on the two heads' logits: TRL's ``DistillationTrainer``
    (``ChunkedDivergenceFunction``), Liger ``LigerFusedLinearJSD``. The gradient's path and the
    peers' options: ``docs/objectives/distillation.md``, "``generalized_jsd_loss``".

    Args:
        hidden: ``(B, T, H)`` student hidden states (packed ``(N, H)`` / ``(1, N, H)``).
        weight: ``(V, H)`` student LM-head weight, the dtype of ``hidden``.
        teacher_hidden: ``(B, T, H_T)`` teacher hidden states at the same tokens.
        teacher_weight: ``(V, H_T)`` teacher LM-head weight, the dtype of ``teacher_hidden``.
        mask: ``(B, T)``; where False no hidden row of either model is read.
        beta: :math:`\beta \in [0, 1]` (0: forward KL, 1: reverse KL).
        bias: optional ``(V,)`` student LM-head bias.
        teacher_bias: optional ``(V,)`` teacher LM-head bias.
        temperature: :math:`\tau > 0` dividing both models' logits,
            or a per-token tensor ``(B, T)`` (packed ``(N,)``).
        reduction: as :func:`rlobjectives.aggregate`.
        normalizer: explicit positive denominator (TRL's ``num_items_in_batch``).
        max_response_length: the Dr. GRPO constant.
        chunk_size: rows per chunk; None: the head's default (at least 256 rows).
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.
        final_logit_softcapping: :math:`c > 0` capping the student logits
            :math:`c \tanh(s z / c)` before the temperature (Gemma 2/3), or None; as
            :func:`rlobjectives.token_log_probs_from_hidden`.
        logit_scale: :math:`s` multiplying the student logits first (Cohere, Granite).
        fp32_head: the bf16/fp16 product with a float32 result (default), as
            :func:`rlobjectives.token_log_probs_from_hidden`.
        teacher_final_logit_softcapping: the teacher's softcap (TRL's
            ``teacher_final_logit_softcapping``), or None.
        teacher_logit_scale: the teacher's logit scale (TRL's ``teacher_logit_scale``).

    Returns:
        As :func:`generalized_jsd_loss`.

    Raises:
        ValueError: as :func:`generalized_jsd_loss`, on heads of other shapes, dtypes or
            vocabularies.
        TypeError: on non-floating hidden states, weights or biases, as
            :func:`generalized_jsd_loss`.

    References:
        As :func:`generalized_jsd_loss`; Hsu et al. 2024, Liger-Kernel, arXiv:2410.10989
        (fused linear JSD).

    Examples:
        >>> import torch
        >>> hidden, weight = torch.zeros(1, 1, 2), torch.zeros(2, 2)  # student [.5, .5]
        >>> teacher_hidden = torch.ones(1, 1, 1)
        >>> teacher_weight = torch.log(torch.tensor([[0.25], [0.75]]))  # teacher [.25, .75]
        >>> generalized_jsd_loss_from_hidden(hidden, weight, teacher_hidden, teacher_weight,
        ...                                  torch.tensor([[True]]), beta=0.0)
        tensor(0.1308)

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
    beta_value = _validate_beta(beta)
    dtype = compute_dtype(head.hidden, _floating(teacher_hidden, "teacher_hidden"))
    head = head._replace(dtype=dtype)
    teacher_options = (teacher_final_logit_softcapping, teacher_logit_scale)
    teacher = _teacher_head(teacher_hidden, teacher_weight, teacher_bias, head, rows,
                            teacher_options)  # fmt: skip
    rule = JSDRule(TeacherHead(teacher, min(head.chunk_size, head.hidden.shape[0])), beta_value)
    return hidden_loss(head, rule, rows)
