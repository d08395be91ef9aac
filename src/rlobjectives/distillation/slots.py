r"""The teacher's top-k slots: validated, read chunk by chunk, and the student's log-probs at them.

A teacher served by an inference engine returns, per token, its top-k log-probabilities
:math:`\ell^T_k` and their ids ``(B, T, K)``; a slot whose log-probability is ``-inf`` is padding.
:func:`teacher_tensors` validates them once at the public boundary, :func:`teacher_slots` reads
one chunk's slots, and :func:`teacher_slot_log_probs` (with :class:`SlotLogProbsRule`) gives the
student's log-probabilities :math:`\ell^S_k` at the slots, the building block of the presets
that transform them. :mod:`rlobjectives.distillation.topk` builds the top-k forward KL on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.chunking import Block, resolve_chunk_size
from .._core.validation import ArrayLike, checks_environment, compute_dtype
from ..logprobs.head import Temperature
from .chunks import ChunkOutput, LogitsDivergence, logits_rows, softmax_rows_
from .inputs import Rows, logits_call, temperature_inverse, token_slots

__all__ = [
    "SlotLogProbsRule",
    "flatten_slots",
    "teacher_slot_log_probs",
    "teacher_slots",
    "teacher_tensors",
    "zero_where",
]

_NEG_INF = float("-inf")


def teacher_slots(
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


def zero_where(condition: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` with 0 where ``condition`` holds (``torch.where``, never a product)."""
    return torch.where(condition, torch.zeros((), dtype=values.dtype, device=values.device), values)


def teacher_tensors(
    teacher_log_probs: ArrayLike, teacher_ids: ArrayLike, rows: Rows, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The validated ``(log_probs, ids)`` of the teacher's slots: detached, int64 ids."""
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


def flatten_slots(tensor: torch.Tensor, flat: bool) -> torch.Tensor:
    """``(B, T, K)`` as ``(N, K)`` when the logits' rows are flat, else as given."""
    return tensor.reshape(-1, tensor.shape[-1]) if flat else tensor


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
        _, ids, valid = teacher_slots(self.log_probs[block], self.ids[block], active, self.dtype)
        student = scores.gather(1, ids)  # (n, K)
        probs, log_normalizer, _ = softmax_rows_(scores)
        values = torch.where(valid, student - log_normalizer.unsqueeze(1), _NEG_INF)
        if upstream is None:
            return ChunkOutput(values, None)
        upstream = zero_where(~valid, upstream)
        grad = probs.mul_(-upstream.sum(1, keepdim=True)).scatter_add_(1, ids, upstream)
        return ChunkOutput(values, grad)


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
    :func:`rlobjectives.topk_forward_kl` (padded ``(B, T, V)`` logits).
    """
    logits_t, rows = logits_call(logits, mask, cu_seqlens=None, reduction="none",
                                 normalizer=None, max_response_length=None)  # fmt: skip
    log_probs, ids = teacher_tensors(teacher_log_probs, teacher_ids, rows, logits_t.device)
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    dtype = compute_dtype(logits_t, log_probs)
    inverse = temperature_inverse(temperature, rows, logits_t.device, dtype)
    flat = logits_rows(logits_t, chunk).flat
    rule = SlotLogProbsRule(
        flatten_slots(log_probs, flat), flatten_slots(ids, flat), dtype, ids.shape[-1]
    )
    values: torch.Tensor = LogitsDivergence.apply(  # type: ignore[no-untyped-call]
        logits_t, rule, rows.mask, inverse, chunk, dtype
    )
    return values
