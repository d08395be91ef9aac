"""Log-probabilities and the fused policy loss straight from hidden states and the LM head.

The ``(B, T, V)`` logits tensor is never formed: the passes of :mod:`rlobjectives.logprobs.passes`
process tokens in chunks of rows and one ``(chunk, V)`` buffer of logits, reused by every
chunk, is alive at any time (the entropy adds a few rows of scratch). This module is the public
shell: it validates once, then dispatches.

- :func:`token_log_probs_from_hidden`: chunked log-softmax with recompute in backward.
- the head's validation (:func:`rlobjectives.logprobs.head.prepare_head`) is shared with
  :func:`rlobjectives.fused_policy_loss_from_hidden` (:mod:`rlobjectives.policy.from_hidden`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, overload

import torch

from .._core.backend import lm_head_backend
from .._core.layout import packed_layout, token_matrix, token_ndim
from .._core.validation import (
    ArrayLike,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    validate_bool,
)
from .head import Head, HeadOptions, Temperature, default_chunk_size, prepare_head
from .passes import LogProbsFromHidden
from .statistics import LogProbStatistics, Wanted, validate_statistics
from .triton_head import triton_log_probs
from .vocab_parallel import VocabGroup, reduce_hidden_gradient

__all__ = [
    "TokenLogProbsOutput",
    "default_chunk_size",
    "token_log_probs_from_hidden",
]


class TokenLogProbsOutput(NamedTuple):
    """Result of :func:`token_log_probs_from_hidden` with ``return_entropy=True``.

    Attributes:
        log_probs: ``(B, T)`` log-probabilities of the given tokens (packed: the shape of
            ``tokens``).
        entropy: ``(B, T)`` entropy of the (temperature-scaled) next-token distribution.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor


def _row_mask(
    mask: ArrayLike, head: Head, batch_shape: tuple[int, int], packed: bool = False
) -> torch.Tensor:
    mask_t = token_matrix(as_mask(mask, "mask", head.hidden.device), "mask", packed)
    check_same_device({"hidden": head.hidden, "mask": mask_t})
    check_shape(mask_t, "mask", batch_shape, "tokens")
    return mask_t


@overload
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    mask: ArrayLike | None = ...,
    return_entropy: Literal[False] = ...,
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
    fp32_head: bool = ...,
    statistics: None = ...,
) -> torch.Tensor: ...


@overload
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    mask: ArrayLike | None = ...,
    return_entropy: Literal[True],
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
    fp32_head: bool = ...,
    statistics: None = ...,
) -> TokenLogProbsOutput: ...


@overload
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    mask: ArrayLike | None = ...,
    return_entropy: bool = ...,
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
    fp32_head: bool = ...,
    statistics: Sequence[str],
) -> LogProbStatistics: ...


@checks_environment
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    mask: ArrayLike | None = None,
    return_entropy: bool = False,
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
    fp32_head: bool = True,
    statistics: Sequence[str] | None = None,
) -> torch.Tensor | TokenLogProbsOutput | LogProbStatistics:
    r"""Log-probabilities of the given tokens from hidden states, without the full logits.

    With :math:`z_{it} = h_{it} W^\top + b` (a length-V row) and temperature :math:`\tau`,

    .. math::

        \ell_{it} = \frac{z_{it, y_{it}}}{\tau} - \log \sum_v \exp\frac{z_{itv}}{\tau}, \qquad
        \mathcal{H}_{it} = -\sum_v p_{itv} \log p_{itv}, \quad
        p_{it} = \mathrm{softmax}(z_{it} / \tau).

    Tokens are processed ``chunk_size`` rows at a time; only one ``(chunk_size, V)`` buffer of
    logits is alive (reused by every chunk; ``return_entropy`` adds a few rows), and only the
    per-token log-normaliser is kept for backward, which recomputes each chunk's logits and
    accumulates ``grad_hidden``, ``grad_weight`` and ``grad_bias`` (float32 accumulators for
    bf16/fp16 weights). Values and
    gradients equal those of ``log_softmax((hidden @ weight.T + bias).float() / temperature)``
    gathered at ``tokens``.

    Packed sequences (``cu_seqlens`` given): ``hidden`` is ``(N, H)`` or ``(1, N, H)`` and
    ``tokens`` (and ``mask``) ``(N,)`` or ``(1, N)``; the log-probabilities are per token, so
    the sequence boundaries change nothing but the accepted shapes (``cu_seqlens`` is validated
    against ``N``).

    **Kept set** (the sampler's truncation, as :func:`token_log_probs`): ``kept_ids``,
    ``kept_mask`` or ``top_k``/``top_p``; each chunk's logits outside the set are set to
    ``-inf`` before its softmax, so :math:`\ell = z_y/\tau - \log\sum_{v \in K}
    e^{z_v/\tau}` (``-inf`` and no gradient for a token outside the set) and the entropy is
    over the set; no ``(N, V)`` tensor is formed (a ``(chunk, V)`` bool per chunk; the rule's
    per-row thresholds are saved, not re-sorted, for backward). The Triton kernels take no
    kept set: such a call runs this chunked PyTorch path on every backend.

    **Vocabulary-parallel** (``vocab_group``): ``weight`` ``(V_r, H)`` and ``bias`` are this
    rank's contiguous rows of the LM head (rank order, uneven allowed), ``hidden`` and
    ``tokens`` are replicated, ``tokens`` global ids. The log-probabilities (and entropies)
    equal the unsharded call on every rank: per row, one all-reduce MAX and one SUM of
    ``2``-``3`` floats after the chunk loop. ``grad_weight`` / ``grad_bias`` are exact for the
    local rows; ``grad_hidden`` follows Megatron's column-parallel convention: this rank's part
    (``VocabParallel(group, hidden_grad="partial")``, the default: the caller's
    ``copy_to_tensor_model_parallel_region`` all-reduces it) or the sum
    (``hidden_grad="reduced"``); the parts sum to the unsharded gradient. On the Triton kernels
    too.

    Args:
        hidden: ``(B, T, H)`` hidden states (float64, float32, bfloat16 or float16).
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` integer token ids in ``[0, V)`` (any id where ``mask`` is False).
        bias: optional ``(V,)`` LM-head bias, same dtype as ``weight``.
        temperature: :math:`\tau > 0` dividing the logits (sampling temperature), or a
            per-token tensor ``(B, T)`` (packed ``(N,)``; any value where ``mask`` is False).
        chunk_size: rows per chunk; None uses :func:`default_chunk_size`: at most N/16 rows
            and 64 MiB of buffers, at least 256 rows (256 rows, 32 MiB, at N = 4096, V = 32000).
        mask: optional ``(B, T)`` bool/numeric; where False the hidden row and token id are
            ignored (NaN/inf-safe) and the outputs are 0.
        return_entropy: also return the per-token entropy.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        vocab_group: None, or the process group over which the LM head's rows are split (or a
            :class:`~rlobjectives.VocabParallel` with its options).
        kept_ids: ``(B, T, K)`` (packed ``(N, K)``) kept ids padded with ``kept_pad``, as
            :func:`token_log_probs`.
        kept_pad: the padding id of ``kept_ids`` (default -1).
        kept_mask: ``(B, T, V)`` (packed ``(N, V)``) bool, True = kept.
        top_k: recompute the sampler's top-k (after the temperature), as
            :func:`token_log_probs`.
        top_p: recompute the sampler's top-p after top-k, as :func:`token_log_probs` (sorts
            each chunk's rows: ``(chunk, V)`` values alone, ``(chunk, k)`` with ``top_k``).
        min_p: as :func:`token_log_probs`.
        final_logit_softcapping: as :func:`token_log_probs`.
        logit_scale: as :func:`token_log_probs`.
        fp32_head: form the product of bf16/fp16 ``hidden`` and ``weight`` with float32
            accumulation and a float32 result (default, TRL's ``cast_lm_head_to_fp32=True``);
            False rounds it to their dtype first, as ``hidden @ weight.T`` (TRL's default
            forward, a bf16 sampler's logits).
        statistics: as :func:`token_log_probs` (with ``return_entropy=True`` the entropy is
            among them).

    Returns:
        ``(B, T)`` log-probabilities (packed: the shape of ``tokens``), float32 (float64 for
        float64 inputs); with ``return_entropy=True`` a :class:`TokenLogProbsOutput`
        ``(log_probs, entropy)``.

    Raises:
        ValueError: on wrong ranks or shapes, a weight/bias dtype different from ``hidden``,
            devices that differ, ``temperature <= 0`` or a non-positive ``chunk_size``; for the
            kept set and ``vocab_group`` as :func:`token_log_probs`.
        TypeError: on non-floating ``hidden``/``weight``/``bias`` or non-integer ``tokens``,
            and as :func:`token_log_probs`.

    References:
        Wijmans et al. 2024, Cut Your Losses in Large-Vocabulary Language Models (Cut
        Cross-Entropy), arXiv:2411.09009 Sec. 4 (blockwise logits with recompute); Hsu et al.
        2024, Liger-Kernel, arXiv:2410.10989 Sec. 3.3 (fused linear cross entropy).
        Vocabulary-parallel: verl ``linear_cross_entropy(dist_process_group=)``, NeMo-RL
        ``ChunkedDistributedHiddenStatesToLogprobs``, CCE ``vocab_parallel_options``.
        Truncation: DeepSeek-V3.2, arXiv:2512.02556 Sec. 3.1.

    Examples:
        >>> import torch
        >>> hidden, weight = torch.zeros(1, 2, 3), torch.zeros(4, 3)
        >>> token_log_probs_from_hidden(hidden, weight, torch.tensor([[0, 3]]))
        tensor([[-1.3863, -1.3863]])

    .. versionadded:: 0.1.0
    """
    packed = cu_seqlens is not None
    options = (vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p, min_p)
    head_options = HeadOptions(final_logit_softcapping, logit_scale, fp32_head)
    head, batch_shape = prepare_head(
        hidden, weight, tokens, bias, temperature, chunk_size, packed=packed, options=options,
        head_options=head_options, mask=mask,
    )  # fmt: skip
    output_shape: tuple[int, ...] = batch_shape
    if packed:
        packed_layout(cu_seqlens, batch_shape[1], device=head.hidden.device)  # validation only
        output_shape = batch_shape[1:] if token_ndim(tokens) == 1 else batch_shape
    mask_t = None if mask is None else _row_mask(mask, head, batch_shape, packed).reshape(-1)
    validate_bool(return_entropy, "return_entropy")
    wanted = validate_statistics(statistics, entropy=return_entropy) or Wanted()
    if head.shard is not None:  # Megatron's copy to the TP region, with hidden_grad="reduced"
        head = head._replace(hidden=reduce_hidden_gradient(head.hidden, head.shard))
    backend = lm_head_backend(
        head.hidden.device, dtype=head.dtype, kept_set=head.kept is not None,
        unsupported="the kernels compute no statistics but the entropy (statistics=)"
        if wanted.beyond_entropy
        else None,
    )  # fmt: skip
    if backend == "triton":  # docs/kernels.md
        outputs = triton_log_probs(head, mask_t, wanted.entropy)
    else:
        outputs = LogProbsFromHidden.apply(  # type: ignore[no-untyped-call]
            head.hidden, head.weight, head.bias, head, mask_t, wanted
        )
    log_probs = outputs[0].reshape(output_shape)  # (B, T)
    if statistics is None:
        if not return_entropy:
            return log_probs
        return TokenLogProbsOutput(log_probs=log_probs, entropy=outputs[1].reshape(output_shape))
    others = iter(outputs[2:])
    values = {"entropy": outputs[1]} if wanted.entropy else {}
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1"):
        if getattr(wanted, name):
            values[name] = next(others)
    return wanted.result(
        log_probs, {name: value.reshape(output_shape) for name, value in values.items()}
    )
