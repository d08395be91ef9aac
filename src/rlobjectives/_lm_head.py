"""Log-probabilities and the fused policy loss straight from hidden states and the LM head.

The ``(B, T, V)`` logits tensor is never formed: the passes of :mod:`rlobjectives._lm_head_chunks`
process tokens in chunks of rows and one ``(chunk, V)`` buffer of logits, reused by every
chunk, is alive at any time (the entropy adds a few rows of scratch). This module is the public
shell: it validates once, then dispatches.

- :func:`token_log_probs_from_hidden`: chunked log-softmax with recompute in backward.
- :func:`rlobjectives.fused_policy_loss_from_hidden` (in :mod:`rlobjectives._lm_head_loss`)
  uses the validation here.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import torch

from ._chunking import resolve_chunk_size
from ._lm_head_chunks import Head, LogProbsFromHidden, default_chunk_size
from ._packing import packed_layout, token_matrix, token_ndim
from ._triton._dispatch import kernel_backend
from ._validation import (
    ArrayLike,
    as_mask,
    as_token_ids,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    describe,
    validate_bool,
    validate_scalar,
)

__all__ = [
    "TokenLogProbsOutput",
    "default_chunk_size",
    "prepare_head",
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


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_floating(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {describe(value)}")
    return value


def _check_weight(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must have shape (V, H) with H = {hidden.shape[2]} from hidden, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError(
            f"weight must have V >= 1 rows (the vocabulary), got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight must have the dtype of hidden ({hidden.dtype}), got dtype {weight.dtype}"
        )
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must have shape ({weight.shape[0]},) and dtype {weight.dtype} like weight, "
            f"got shape {tuple(bias.shape)} and dtype {bias.dtype}"
        )


def _hidden_matrix(hidden: torch.Tensor, packed: bool) -> torch.Tensor:
    """``(B, T, H)``; packed: ``(N, H)`` or ``(1, N, H)`` as ``(1, N, H)``."""
    if packed and hidden.ndim == 2:
        return hidden.unsqueeze(0)
    if hidden.ndim == 3 and (not packed or hidden.shape[0] == 1):
        return hidden
    expected = (
        "(N, H) or (1, N, H) (packed: cu_seqlens given)"
        if packed
        else ("(B, T, H) (3 dimensions), or (N, H) with cu_seqlens (packed sequences)")
    )
    raise ValueError(f"hidden must have shape {expected}, got shape {tuple(hidden.shape)}")


def prepare_head(
    hidden: object,
    weight: object,
    tokens: ArrayLike,
    bias: object,
    temperature: float,
    chunk_size: int | None,
    *,
    packed: bool = False,
) -> tuple[Head, tuple[int, int]]:
    """Validate the hidden states, LM head and token ids; flatten to ``(N, H)`` / ``(N,)``.

    ``packed``: hidden ``(N, H)`` / ``(1, N, H)`` and tokens ``(N,)`` / ``(1, N)``, whose
    ``batch_shape`` is ``(1, N)``.
    """
    hidden_t = _hidden_matrix(_check_floating(hidden, "hidden"), packed)
    if hidden_t.shape[2] < 1:
        raise ValueError(
            f"hidden must have a hidden size H >= 1, got shape {tuple(hidden_t.shape)}"
        )
    weight_t = _check_floating(weight, "weight")
    bias_t = None if bias is None else _check_floating(bias, "bias")
    _check_weight(hidden_t, weight_t, bias_t)
    tokens_t = as_token_ids(tokens, "tokens", hidden_t.device)
    if packed:
        tokens_t = token_matrix(tokens_t, "tokens", packed)
    tensors = {"hidden": hidden_t, "weight": weight_t, "tokens": tokens_t}
    check_same_device(tensors if bias_t is None else {**tensors, "bias": bias_t})
    batch_shape = (hidden_t.shape[0], hidden_t.shape[1])
    check_shape(tokens_t, "tokens", batch_shape, "hidden[..., 0]")
    tau = validate_scalar(temperature, "temperature", minimum=0.0, strict=True, allow_tensor=False)
    if chunk_size is None:
        rows = default_chunk_size(
            weight_t.shape[0], hidden_t.shape[0] * hidden_t.shape[1], weight_t.dtype
        )
    else:
        rows = resolve_chunk_size(chunk_size, row_width=weight_t.shape[0])
    head = Head(
        hidden=hidden_t.reshape(-1, hidden_t.shape[2]),
        weight=weight_t,
        bias=bias_t,
        tokens=tokens_t.reshape(-1).long(),
        inv_temperature=1.0 / float(tau),
        chunk_size=rows,
        dtype=compute_dtype(hidden_t),
    )
    return head, batch_shape


def _row_mask(
    mask: ArrayLike, head: Head, batch_shape: tuple[int, int], packed: bool = False
) -> torch.Tensor:
    mask_t = token_matrix(as_mask(mask, "mask", head.hidden.device), "mask", packed)
    check_same_device({"hidden": head.hidden, "mask": mask_t})
    check_shape(mask_t, "mask", batch_shape, "tokens")
    return mask_t


# --------------------------------------------------------------------------------------------
# token_log_probs_from_hidden
# --------------------------------------------------------------------------------------------


@overload
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = ...,
    temperature: float = ...,
    chunk_size: int | None = ...,
    mask: ArrayLike | None = ...,
    return_entropy: Literal[False] = ...,
    cu_seqlens: ArrayLike | None = ...,
) -> torch.Tensor: ...


@overload
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = ...,
    temperature: float = ...,
    chunk_size: int | None = ...,
    mask: ArrayLike | None = ...,
    return_entropy: Literal[True],
    cu_seqlens: ArrayLike | None = ...,
) -> TokenLogProbsOutput: ...


@checks_environment
def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    mask: ArrayLike | None = None,
    return_entropy: bool = False,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor | TokenLogProbsOutput:
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

    Args:
        hidden: ``(B, T, H)`` hidden states (float64, float32, bfloat16 or float16).
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` integer token ids in ``[0, V)`` (any id where ``mask`` is False).
        bias: optional ``(V,)`` LM-head bias, same dtype as ``weight``.
        temperature: :math:`\tau > 0` dividing the logits (sampling temperature).
        chunk_size: rows per chunk; None uses :func:`default_chunk_size`: at most N/16 rows
            and 64 MiB of buffers, at least 256 rows (256 rows, 32 MiB, at N = 4096, V = 32000).
        mask: optional ``(B, T)`` bool/numeric; where False the hidden row and token id are
            ignored (NaN/inf-safe) and the outputs are 0.
        return_entropy: also return the per-token entropy.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.

    Returns:
        ``(B, T)`` log-probabilities (packed: the shape of ``tokens``), float32 (float64 for
        float64 inputs); with ``return_entropy=True`` a :class:`TokenLogProbsOutput`
        ``(log_probs, entropy)``.

    Raises:
        ValueError: on wrong ranks or shapes, a weight/bias dtype different from ``hidden``,
            devices that differ, ``temperature <= 0`` or a non-positive ``chunk_size``.
        TypeError: on non-floating ``hidden``/``weight``/``bias`` or non-integer ``tokens``.

    References:
        Wijmans et al. 2024, Cut Your Losses in Large-Vocabulary Language Models (Cut
        Cross-Entropy), arXiv:2411.09009 Sec. 4 (blockwise logits with recompute); Hsu et al.
        2024, Liger-Kernel, arXiv:2410.10989 Sec. 3.3 (fused linear cross entropy).

    Examples:
        >>> import torch
        >>> hidden, weight = torch.zeros(1, 2, 3), torch.zeros(4, 3)
        >>> token_log_probs_from_hidden(hidden, weight, torch.tensor([[0, 3]]))
        tensor([[-1.3863, -1.3863]])

    .. versionadded:: 0.1.0
    """
    packed = cu_seqlens is not None
    head, batch_shape = prepare_head(
        hidden, weight, tokens, bias, temperature, chunk_size, packed=packed
    )
    output_shape: tuple[int, ...] = batch_shape
    if packed:
        packed_layout(cu_seqlens, batch_shape[1], device=head.hidden.device)  # validation only
        output_shape = batch_shape[1:] if token_ndim(tokens) == 1 else batch_shape
    mask_t = None if mask is None else _row_mask(mask, head, batch_shape, packed).reshape(-1)
    validate_bool(return_entropy, "return_entropy")
    if kernel_backend(head.hidden.device, dtype=head.dtype) == "triton":  # docs/kernels.md
        from ._triton._head_call import log_probs_kernels

        outputs = log_probs_kernels(head, mask_t, return_entropy)
    else:
        outputs = LogProbsFromHidden.apply(  # type: ignore[no-untyped-call]
            head.hidden, head.weight, head.bias, head, mask_t, return_entropy
        )
    log_probs = outputs[0].reshape(output_shape)  # (B, T)
    if not return_entropy:
        return log_probs
    return TokenLogProbsOutput(log_probs=log_probs, entropy=outputs[1].reshape(output_shape))
