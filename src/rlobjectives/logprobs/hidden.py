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

    One ``(chunk_size, V)`` block of logits at a time; values and gradients (accumulated chunk by
    chunk) equal ``log_softmax((hidden @ weight.T + bias).float() / temperature)[tokens]``. A
    kept set restricts the softmax (``-inf``, no gradient, outside); ``vocab_group``: this
    rank's rows of the head, the unsharded results. Details (``grad_hidden`` under
    ``vocab_group``, memory): docs/objectives/logprobs.md, "token_log_probs_from_hidden".

    Args:
        hidden: ``(B, T, H)`` hidden states (float64, float32, bfloat16 or float16).
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` integer token ids in ``[0, V)`` (any id where ``mask`` is False).
        bias: optional ``(V,)`` LM-head bias, same dtype as ``weight``.
        temperature: :math:`\tau > 0`, or a per-token ``(B, T)`` tensor (packed ``(N,)``).
        chunk_size: rows per chunk; None uses :func:`default_chunk_size`.
        mask: optional ``(B, T)`` bool/numeric; where False, ignored (NaN/inf-safe), output 0.
        return_entropy: also return the per-token entropy.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences (``hidden`` ``(N, H)``).
        vocab_group: None, or the process group splitting the LM head's rows (or a
            :class:`~rlobjectives.VocabParallel`: ``hidden_grad="partial"`` / ``"reduced"``).
        kept_ids: ``(B, T, K)`` (packed ``(N, K)``) kept ids padded with ``kept_pad``.
        kept_pad: the padding id of ``kept_ids`` (default -1).
        kept_mask: ``(B, T, V)`` (packed ``(N, V)``) bool, True = kept.
        top_k: as :func:`token_log_probs`.
        top_p: as :func:`token_log_probs`.
        min_p: as :func:`token_log_probs`.
        final_logit_softcapping: as :func:`token_log_probs`.
        logit_scale: as :func:`token_log_probs`.
        fp32_head: form a bf16/fp16 product in float32 (TRL's ``cast_lm_head_to_fp32=True``).
        statistics: as :func:`token_log_probs` (with ``return_entropy`` the entropy among them).

    Returns:
        ``(B, T)`` log-probabilities (packed: the shape of ``tokens``), float32 (float64 for
        float64 inputs); with ``return_entropy=True`` a :class:`TokenLogProbsOutput`.

    Raises:
        ValueError: on wrong ranks or shapes, a weight/bias dtype other than ``hidden``'s,
            other devices, ``temperature <= 0``, ``chunk_size < 1``; as :func:`token_log_probs`.
        TypeError: non-floating ``hidden``/``weight``/``bias``, non-integer ``tokens``; as above.

    References:
        Cut Cross-Entropy, arXiv:2411.09009 Sec. 4; Liger-Kernel, arXiv:2410.10989 Sec. 3.3;
        DeepSeek-V3.2, arXiv:2512.02556 Sec. 3.1; the peers: the docs page above.

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
