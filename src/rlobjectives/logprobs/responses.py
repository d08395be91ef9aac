r"""Response-token log-probabilities from full-sequence causal-LM logits, shift included.

:func:`response_log_probs` locates the response tokens with
:func:`~rlobjectives.logprobs.alignment.response_alignment` and gathers their log-probabilities
(and statistics) from the rows that predict them, through the chunked Functions over the whole
``(B, L, V)`` logits: no ``(B, R, V)`` copy is gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, overload

import torch

from .._core.layout import token_matrix, token_ndim, token_output
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    as_token_ids,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
)
from .alignment import ResponseAlignment, response_alignment
from .functions import TokenLogProbsFunction
from .head import Temperature, validate_transform
from .logits import as_logits, scalar_temperature
from .restricted import LogitsCall, RestrictedLogProbsFunction, restricted_chunk_size
from .statistics import Wanted, statistics_result, validate_statistics
from .transform import LogitTransform
from .truncation import Restriction, restriction_of
from .vocab_parallel import VocabGroup

__all__ = ["ResponseLogProbs", "ResponseStatistics", "response_log_probs"]


class ResponseLogProbs(NamedTuple):
    """Result of :func:`response_log_probs`.

    Attributes:
        log_probs: ``(B, R)`` float32 log-probabilities of the response tokens, 0 where
            ``mask`` is False. Packed: ``(N,)`` (the shape of ``input_ids``), aligned with the
            tokens.
        mask: ``(B, R)`` bool response mask, ready for :func:`rlobjectives.policy_loss`
            (packed: ``(N,)``, with the same ``cu_seqlens``).
    """

    log_probs: torch.Tensor
    mask: torch.Tensor


class ResponseStatistics(NamedTuple):
    r"""Result of :func:`response_log_probs` with ``statistics=``: the statistics asked for.

    Attributes:
        log_probs: ``(B, R)`` log-probabilities of the response tokens (as
            :class:`ResponseLogProbs`).
        mask: ``(B, R)`` bool response mask.
        entropy: ``(B, R)`` entropy of the distribution each response token was drawn from, or
            None.
        log_sum_sq_probs: ``(B, R)`` :math:`\log\sum_v p_v^2` (detached), or None.
        mean_logits: ``(B, R)`` mean of the transformed logits (detached), or None.
        is_top1: ``(B, R)`` bool, whether the token is the first maximal logit, or None.
    """

    log_probs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


def _shifted(restriction: Restriction, alignment: ResponseAlignment, length: int) -> Restriction:
    """The kept set's rows (one per response token) for the logits rows that predict them.

    Row ``positions[b, t]`` of the ``(B, L)`` logits reads row ``(b, t)`` of the set; rows that
    predict no response token read row 0 (they are not computed).
    """
    kept = restriction.kept
    if kept is None or kept.rule:
        return restriction
    batch, width = alignment.mask.shape
    device = alignment.mask.device
    response_rows = torch.arange(batch * width, device=device).reshape(batch, width)  # (B, R)
    columns = torch.where(alignment.mask, alignment.positions, length)  # (B, R); L: spare
    index = torch.zeros(batch, length + 1, dtype=torch.int64, device=device)
    index = index.scatter(1, columns, response_rows)[:, :length]  # (B, L)
    return restriction._replace(kept=kept._replace(rows=index.reshape(-1)))


def _shifted_transform(
    transform: LogitTransform, alignment: ResponseAlignment, length: int
) -> LogitTransform:
    """A per-token temperature moved from the response tokens to the rows predicting them.

    ``(B, R)`` to ``(B, L)``, 1 on the other rows.
    """
    inverse = transform.inverse
    if not isinstance(inverse, torch.Tensor):
        return transform
    batch = alignment.mask.shape[0]
    columns = torch.where(alignment.mask, alignment.positions, length)  # (B, R); L: spare
    rows = torch.ones(batch, length + 1, dtype=inverse.dtype, device=inverse.device)
    rows = rows.scatter(1, columns, inverse.reshape(alignment.mask.shape))[:, :length]
    return transform._replace(inverse=rows)


@overload
def response_log_probs(
    logits: ArrayLike,
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike | None,
    attention_mask: ArrayLike,
    *,
    response_start: ArrayLike | int | None = ...,
    response_length: int | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    check_layout: bool = ...,
    cu_seqlens: ArrayLike | None = ...,
    vocab_group: VocabGroup = ...,
    kept_ids: ArrayLike | None = ...,
    kept_pad: int = ...,
    kept_mask: ArrayLike | None = ...,
    top_k: int | None = ...,
    top_p: float | None = ...,
    min_p: float | None = ...,
    final_logit_softcapping: float | None = ...,
    logit_scale: float = ...,
    statistics: None = ...,
) -> ResponseLogProbs: ...


@overload
def response_log_probs(
    logits: ArrayLike,
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike | None,
    attention_mask: ArrayLike,
    *,
    response_start: ArrayLike | int | None = ...,
    response_length: int | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    check_layout: bool = ...,
    cu_seqlens: ArrayLike | None = ...,
    vocab_group: VocabGroup = ...,
    kept_ids: ArrayLike | None = ...,
    kept_pad: int = ...,
    kept_mask: ArrayLike | None = ...,
    top_k: int | None = ...,
    top_p: float | None = ...,
    min_p: float | None = ...,
    final_logit_softcapping: float | None = ...,
    logit_scale: float = ...,
    statistics: Sequence[str],
) -> ResponseStatistics: ...


@checks_environment
def response_log_probs(
    logits: ArrayLike,
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike | None,
    attention_mask: ArrayLike,
    *,
    response_start: ArrayLike | int | None = None,
    response_length: int | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    check_layout: bool = True,
    cu_seqlens: ArrayLike | None = None,
    vocab_group: VocabGroup = None,
    kept_ids: ArrayLike | None = None,
    kept_pad: int = -1,
    kept_mask: ArrayLike | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    statistics: Sequence[str] | None = None,
) -> ResponseLogProbs | ResponseStatistics:
    r"""Response-token log-probabilities from full-sequence causal-LM logits, shift included.

    .. math::

        \text{log\_probs}_{bt} = \log\mathrm{softmax}(\text{logits}_{b, j-1} / \tau)
        [\text{input\_ids}_{bj}], \qquad j = f_b + P_b + t,

    for the response tokens located by :func:`response_alignment` (its padding layouts; packed
    sequences with ``cu_seqlens``, ``(N,)`` results never shifted across a boundary); 0
    elsewhere, through the chunked log-softmax of :func:`token_log_probs` on the full logits (no
    ``(B, R, V)`` copy). The kept set and a per-token temperature belong to the **response
    tokens** (row ``t``: the set token ``t`` was drawn from). Details:
    docs/objectives/logprobs.md, "response_log_probs".

    Args:
        logits: ``(B, L, V)`` logits of the full sequences (packed: ``(N, V)``).
        input_ids: ``(B, L)`` integer token ids (packed: ``(N,)``).
        prompt_lengths: ``(B,)`` integer prompt lengths (without padding), each >= 1, or None.
        response_start: instead of ``prompt_lengths``: each row's first response column (int
            or ``(B,)``); see :func:`response_alignment`.
        attention_mask: ``(B, L)`` bool or numeric, nonzero = real token.
        response_length: R (static int), or None for ``L - 1``; see :func:`response_alignment`.
        temperature: :math:`\tau > 0` (the sampling temperature), or one per response token:
            ``(B, R)`` (packed ``(N,)``, aligned with ``input_ids``), as the kept set.
        chunk_size: rows per chunk, or None for ``max(1, 2**23 // V)``.
        check_layout: validate the layout on the host (see :func:`response_alignment`).
        cu_seqlens: ``(S + 1,)`` integer boundaries of packed sequences, or None (padded).
        vocab_group: as :func:`token_log_probs` (``logits``: this rank's vocabulary slice).
        kept_ids: ``(B, R, K)`` kept ids per response token (packed ``(N, K)``), padded.
        kept_pad: the padding id of ``kept_ids`` (default -1).
        kept_mask: ``(B, R, V)`` (packed ``(N, V)``) bool, True = kept.
        top_k: as :func:`token_log_probs`.
        top_p: as :func:`token_log_probs`.
        min_p: as :func:`token_log_probs`.
        final_logit_softcapping: as :func:`token_log_probs`.
        logit_scale: as :func:`token_log_probs`.
        statistics: as :func:`token_log_probs`: a :class:`ResponseStatistics` with them.

    Returns:
        :class:`ResponseLogProbs` ``(log_probs, mask)``: ``(B, R)`` float32 log-probabilities
        (float64 for float64 logits) and bool response mask (packed: ``input_ids``' shape).

    Raises:
        ValueError: on shapes that do not match ``(B, L, V)`` / ``(B, L)`` (the kept set:
            ``(B, R, K)`` / ``(B, R, V)``), and as :func:`response_alignment` and
            :func:`token_log_probs`.
        TypeError: as :func:`response_alignment` and :func:`token_log_probs`.

    References:
        Radford et al. 2018 (GPT) Eq. 1; Ouyang et al. 2022, arXiv:2203.02155 Eq. 2.

    Examples:
        >>> import torch
        >>> logits = torch.zeros(1, 3, 4)  # uniform next-token distributions
        >>> out = response_log_probs(logits, [[1, 2, 3]], [1], [[1, 1, 1]], response_length=2)
        >>> out.log_probs, out.mask
        (tensor([[-1.3863, -1.3863]]), tensor([[True, True]]))

    .. versionadded:: 0.1.0
    """
    packed = cu_seqlens is not None
    logits_t = as_logits(logits, "logits")
    if packed and logits_t.ndim == 2:
        logits_t = logits_t.unsqueeze(0)  # (1, N, V)
    if logits_t.ndim != 3 or (packed and logits_t.shape[0] != 1):
        expected = "(N, V) or (1, N, V) (packed: cu_seqlens given)" if packed else "(B, L, V)"
        raise ValueError(f"logits must have shape {expected}, got shape {tuple(logits_t.shape)}")
    ids = as_token_ids(input_ids, "input_ids", logits_t.device)
    flat = packed and token_ndim(input_ids) == 1
    ids = token_matrix(ids, "input_ids", packed)
    check_same_device({"logits": logits_t, "input_ids": ids})
    check_shape(ids, "input_ids", tuple(logits_t.shape[:2]), "logits without V")
    alignment = response_alignment(
        ids,
        prompt_lengths,
        attention_mask,
        response_length=response_length,
        check_layout=check_layout,
        response_start=response_start,
        cu_seqlens=cu_seqlens,
    )  # (B, R), packed (1, N)
    batch, length = ids.shape
    # Row k of the logits predicts input_ids[:, k + 1]; only rows that predict a response token
    # are computed. Rows selected: scatter the response mask onto the predicting rows.
    rows = torch.zeros((batch, length), dtype=torch.int64, device=ids.device)  # (B, L)
    rows = rows.scatter_add(1, alignment.positions, alignment.mask.to(torch.int64)) > 0
    targets = torch.nn.functional.pad(ids[:, 1:].to(torch.int64), (0, 1))  # (B, L)
    dtype = compute_dtype(logits_t)
    transform = validate_transform(
        temperature,
        final_logit_softcapping,
        logit_scale,
        shape=tuple(alignment.mask.shape),
        device=logits_t.device,
        dtype=dtype,
        active=alignment.mask,
        packed=packed,
        reference="the response tokens",
    )  # per response token (B, R); packed (N,)
    wanted = validate_statistics(statistics)
    options = (vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p, min_p)
    restriction = restriction_of(
        options,
        shape=tuple(alignment.mask.shape),
        vocab=logits_t.shape[-1],
        device=logits_t.device,
        reference="logits",
        packed=packed,
    )
    chunk = restricted_chunk_size(chunk_size, logits_t, restriction)
    targets = torch.where(rows, targets, 0)  # (B, L)
    tau = scalar_temperature(transform, temperature)
    outputs: tuple[torch.Tensor, ...]
    if restriction is None and tau is not None and wanted is None:
        outputs = (
            TokenLogProbsFunction.apply(  # type: ignore[no-untyped-call]
                logits_t, targets, rows, True, tau, chunk, dtype
            ),
        )  # (B, L)
    else:
        if restriction is not None:
            restriction = _shifted(restriction, alignment, length)
        call = LogitsCall(
            _shifted_transform(transform, alignment, length), dtype,
            restriction or Restriction(None, None), (), wanted or Wanted(),
        )  # fmt: skip
        outputs = RestrictedLogProbsFunction.apply(  # type: ignore[no-untyped-call]
            logits_t, targets, rows, True, call, chunk
        )  # (B, L) each

    def gathered(full: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, R), the caller's shape
        values = masked_fill_zero(full.gather(1, alignment.positions), alignment.mask)
        return token_output(values, flat)

    mask_out = token_output(alignment.mask, flat)
    if wanted is None:
        return ResponseLogProbs(log_probs=gathered(outputs[0]), mask=mask_out)
    result = statistics_result(wanted, [gathered(t) if t.numel() else t for t in outputs])
    return ResponseStatistics(result.log_probs, mask_out, *result[1:])
