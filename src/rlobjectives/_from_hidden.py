"""Log-probabilities and the fused policy loss straight from hidden states and the LM head.

The ``(B, T, V)`` logits tensor is never formed: tokens are processed in chunks of rows and at most
one ``(chunk, V)`` block of logits (two with entropy) is alive at any time.

- :func:`token_log_probs_from_hidden` is a custom :class:`torch.autograd.Function` that keeps only
  the per-token log-normaliser and recomputes each chunk's logits in backward.
- :func:`fused_policy_loss_from_hidden` knows the loss's own derivative with respect to each
  token's log-probability once the whole-batch normaliser is known (it is computed from the mask
  before the chunk loop), so it forms ``grad_hidden`` and ``grad_weight`` chunk by chunk in the
  forward pass, with no recompute (the fused-linear-cross-entropy technique of Liger-Kernel /
  Cut Cross-Entropy), and scales them by the incoming gradient in backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import torch

from ._kl import ESTIMATORS, BiasedGradientWarning, _kl_terms
from ._logprobs import resolve_chunk_size, row_chunks
from ._masking import aggregate, masked_fill_zero
from ._policy import (
    PolicyLossDiagnostics,
    _policy_loss_terms,
    _PolicyInputs,
    _prepare_policy_inputs,
    _validate_policy_options,
    policy_loss,
)
from ._validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    as_tensor,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "FusedPolicyLossOutput",
    "TokenLogProbsOutput",
    "default_chunk_size",
    "fused_policy_loss_from_hidden",
    "token_log_probs_from_hidden",
]

# Rows per chunk when ``chunk_size`` is None: about 2**24 logits (64 MiB of float32) per chunk, but
# at least 256 rows, below which the per-chunk ``grad_weight += grad_logits.T @ hidden`` update
# (a (V, H) read-modify-write per chunk) dominates on CPU; see benchmarks/bench_logprobs.py.
_CHUNK_ELEMENTS = 2**24
_MIN_CHUNK_ROWS = 256
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk used when ``chunk_size=None``.

    Args:
        vocab_size: V, the number of rows of the LM-head weight.

    Returns:
        ``max(256, 2**24 // V)``: 524 rows at V = 32000 (64 MiB of float32 logits per chunk),
        256 rows at V >= 65536 (V KiB per chunk).
    """
    return max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // max(vocab_size, 1))


class TokenLogProbsOutput(NamedTuple):
    """Result of :func:`token_log_probs_from_hidden` with ``return_entropy=True``.

    Attributes:
        log_probs: ``(B, T)`` log-probabilities of the given tokens.
        entropy: ``(B, T)`` entropy of the (temperature-scaled) next-token distribution.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor


class FusedPolicyLossOutput(NamedTuple):
    """Result of :func:`fused_policy_loss_from_hidden`.

    Attributes:
        loss: scalar total loss ``policy_loss + kl_coef * kl_loss`` (differentiable with respect
            to ``hidden``, ``weight`` and ``bias``); float32 (float64 for float64 ``hidden``),
            computed in float64 if any input is float64.
        policy_loss: detached scalar, the clipped-surrogate part (as :func:`policy_loss`).
        kl_loss: detached scalar, the reduced KL estimate (before ``kl_coef``); 0 without
            ``ref_log_probs``.
        log_probs: detached ``(B, T)`` log-probabilities of the tokens (zeros at unselected
            tokens), the same values :func:`token_log_probs_from_hidden` returns.
        diagnostics: :class:`PolicyLossDiagnostics`, as :func:`policy_loss` reports them.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    log_probs: torch.Tensor
    diagnostics: PolicyLossDiagnostics


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


class _Head(NamedTuple):
    hidden: torch.Tensor  # (N, H), original dtype
    weight: torch.Tensor  # (V, H), same dtype as hidden
    bias: torch.Tensor | None  # (V,)
    tokens: torch.Tensor  # (N,) int64
    batch_shape: tuple[int, int]  # (B, T)
    dtype: torch.dtype  # computation dtype of the log-softmax (float32 or float64)
    inv_temperature: float
    chunk_size: int


def _prepare_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
) -> _Head:
    """Validate the hidden states, LM head and token ids; flatten to ``(N, H)`` / ``(N,)``."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point torch.Tensor, got {_describe(hidden)}")
    if hidden.ndim != 3:
        raise ValueError(
            f"hidden must have shape (B, T, H) (3 dimensions), got shape {tuple(hidden.shape)}"
        )
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point torch.Tensor, got {_describe(weight)}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must have shape (V, H) with H = {hidden.shape[2]} from hidden, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight must have the dtype of hidden ({hidden.dtype}), got dtype {weight.dtype}"
        )
    tensors = {"hidden": hidden, "weight": weight}
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point torch.Tensor, got {_describe(bias)}")
        if tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype:
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},) and dtype {weight.dtype} like weight, "
                f"got shape {tuple(bias.shape)} and dtype {bias.dtype}"
            )
        tensors["bias"] = bias
    tokens_t = as_tensor(tokens, "tokens", hidden.device)
    if tokens_t.is_floating_point() or tokens_t.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got dtype {tokens_t.dtype}")
    tensors["tokens"] = tokens_t
    check_same_device(tensors)
    batch_shape = (hidden.shape[0], hidden.shape[1])
    check_shape(tokens_t, "tokens", batch_shape, "hidden[..., 0]")
    inv_temperature = 1.0 / float(
        validate_scalar(temperature, "temperature", minimum=0.0, strict=True, allow_tensor=False)
    )
    if chunk_size is None:
        rows = default_chunk_size(weight.shape[0])
    else:
        rows = resolve_chunk_size(chunk_size, row_width=weight.shape[0])
    return _Head(
        hidden=hidden.reshape(-1, hidden.shape[2]),
        weight=weight,
        bias=bias,
        tokens=tokens_t.reshape(-1).long(),
        batch_shape=batch_shape,
        dtype=compute_dtype(hidden),
        inv_temperature=inv_temperature,
        chunk_size=rows,
    )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return type(value).__name__


# --------------------------------------------------------------------------------------------
# Chunk kernels (all in place on one (n, V) block)
# --------------------------------------------------------------------------------------------


def _chunk_scores(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    inv_temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Temperature-scaled logits ``(h W^T + b) / tau`` of one chunk, ``(n, V)`` in ``dtype``.

    The product runs in the weight's dtype (as ``hidden @ weight.T`` would); low-precision
    logits are then widened to ``dtype`` for the softmax.
    """
    if bias is None:
        logits = hidden_chunk @ weight.T  # (n, V)
    else:
        logits = torch.addmm(bias, hidden_chunk, weight.T)  # (n, V)
    scores = logits.to(dtype)  # (n, V), a fresh tensor we may overwrite
    if inv_temperature != 1.0:
        scores.mul_(inv_temperature)
    return scores


def _softmax_(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax of ``scores`` ``(n, V)``, in place where safe; also the log-normaliser ``(n,)``.

    The fused softmax kernel is several times faster than ``sub_``/``exp_``/``sum`` passes on CPU.
    The log-normaliser is recovered exactly from the largest probability, which never underflows
    (it is at least 1/V): ``lse = max_v s_v - log max_v p_v``.
    """
    maximum = scores.amax(dim=1)  # (n,)
    if scores.device.type == "cpu":
        # The CPU kernel reads each row (max, sum) before writing it: aliasing the output is safe.
        probs = torch.ops.aten._softmax.out(scores, 1, False, out=scores)  # (n, V)
    else:
        probs = torch.softmax(scores, dim=1)  # (n, V)
    log_normalizer = maximum - probs.amax(dim=1).log()  # (n,)
    return probs, log_normalizer


def _select_rows(
    hidden_chunk: torch.Tensor, tokens_chunk: torch.Tensor, active: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the hidden rows and token ids of inactive rows (NaN/inf or bad ids cannot leak)."""
    if active is None:
        return hidden_chunk, tokens_chunk
    hidden_chunk = masked_fill_zero(hidden_chunk, active.unsqueeze(-1))  # (n, H)
    tokens_chunk = torch.where(active, tokens_chunk, torch.zeros_like(tokens_chunk))  # (n,)
    return hidden_chunk, tokens_chunk


def _accumulate_grads(
    grad_scores: torch.Tensor,
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Add one chunk's ``grad_weight``/``grad_bias``; return the chunk's ``grad_hidden``.

    ``grad_scores`` is the gradient with respect to the chunk's logits, ``(n, V)`` in the
    computation dtype. ``grad_weight``/``grad_bias`` are float32 (or float64) accumulators.
    """
    if weight.dtype in _LOW_PRECISION:
        low = grad_scores.to(weight.dtype)  # (n, V), as autograd would cast it
        grad_hidden_chunk = low @ weight  # (n, H)
        if grad_weight is not None:
            # float32 accumulation over chunks (casting a low-precision product afterwards would
            # not help: Liger-Kernel #1432).
            grad_weight.addmm_(grad_scores.T, hidden_chunk.to(grad_weight.dtype))  # (V, H)
    else:
        grad_hidden_chunk = grad_scores @ weight.to(grad_scores.dtype)  # (n, H)
        if grad_weight is not None:
            grad_weight.addmm_(grad_scores.T, hidden_chunk.to(grad_scores.dtype))  # (V, H)
    if grad_bias is not None:
        grad_bias.add_(grad_scores.sum(dim=0))  # (V,)
    return grad_hidden_chunk


# --------------------------------------------------------------------------------------------
# token_log_probs_from_hidden
# --------------------------------------------------------------------------------------------


class _LogProbsFromHidden(torch.autograd.Function):
    """Chunked ``log_softmax(h W^T + b)[y]`` (and entropy) with recompute in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        mask: torch.Tensor | None,
        inv_temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        log_probs = torch.empty(rows, dtype=dtype, device=hidden.device)  # (N,)
        log_normalizer = torch.empty(rows, dtype=dtype, device=hidden.device)  # (N,)
        entropy = torch.zeros(rows if with_entropy else 0, dtype=dtype, device=hidden.device)
        for start, end in row_chunks(rows, chunk_size):
            active = None if mask is None else mask[start:end]
            hidden_chunk, tokens_chunk = _select_rows(hidden[start:end], tokens[start:end], active)
            scores = _chunk_scores(hidden_chunk, weight, bias, inv_temperature, dtype)  # (n, V)
            target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,)
            if not with_entropy:
                _, lse = _softmax_(scores)  # (n,)
                log_normalizer[start:end] = lse
                log_probs[start:end] = target - lse
                del scores
                continue
            maximum = scores.amax(dim=1, keepdim=True)  # (n, 1)
            scores.sub_(maximum)  # shifted scores s - max, (n, V)
            if with_entropy:
                probs = scores.exp()  # (n, V) unnormalised
                total = probs.sum(dim=1, keepdim=True)  # (n, 1)
                # H = log Z - E_p[s - max] with Z = sum exp(s - max); the row dot products as a
                # batched product so that no third (n, V) buffer is formed.
                dots = torch.bmm(probs.unsqueeze(1), scores.unsqueeze(2)).reshape(-1, 1)  # (n, 1)
                entropy[start:end] = (total.log() - dots / total).squeeze(1)
                del probs
            else:
                total = scores.exp_().sum(dim=1, keepdim=True)  # (n, 1)
            lse = (maximum + total.log()).squeeze(1)  # (n,)
            log_normalizer[start:end] = lse
            log_probs[start:end] = target - lse
            del scores
        if mask is not None:
            log_probs = masked_fill_zero(log_probs, mask)
            if with_entropy:
                entropy = masked_fill_zero(entropy, mask)
        ctx.save_for_backward(hidden, weight, bias, tokens, mask, log_normalizer, entropy)
        ctx.options = (inv_temperature, chunk_size, dtype, with_entropy)
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, tokens, mask, log_normalizer, entropy = ctx.saved_tensors
        inv_temperature, chunk_size, dtype, with_entropy = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        rows = hidden.shape[0]
        zeros = torch.zeros(rows, dtype=dtype, device=hidden.device)
        grad_lp = zeros if grad_log_probs is None else grad_log_probs.to(dtype)  # (N,)
        grad_h = zeros if (grad_entropy is None or not with_entropy) else grad_entropy.to(dtype)
        # Rows whose outputs receive no gradient (or are masked) are zeroed before the product,
        # so NaN/inf hidden states there cannot reach grad_weight through 0 * NaN.
        active = (grad_lp != 0) | (grad_h != 0)  # (N,)
        if mask is not None:
            active = active & mask
            grad_lp = masked_fill_zero(grad_lp, mask)
            grad_h = masked_fill_zero(grad_h, mask)
        # d/d(logits) = (1/tau) d/d(scores): fold 1/tau into the per-row coefficients.
        grad_lp = grad_lp * inv_temperature  # (N,)
        grad_h = grad_h * inv_temperature  # (N,)
        # Inactive rows are recomputed from a zero hidden row: give them that row's normaliser
        # (and entropy 0) so that their probabilities are finite and their gradient exactly 0.
        zero_row = torch.zeros(1, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        zero_row_lse = torch.logsumexp(
            _chunk_scores(zero_row, weight, bias, inv_temperature, dtype), dim=1
        )  # (1,)
        log_normalizer = torch.where(active, log_normalizer, zero_row_lse)  # (N,)
        entropy = masked_fill_zero(entropy, active) if with_entropy else entropy
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        grad_weight = (
            torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=accumulate, device=weight.device)
            if need_bias and bias is not None
            else None
        )
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        for start, end in row_chunks(rows, chunk_size):
            hidden_chunk, tokens_chunk = _select_rows(
                hidden[start:end], tokens[start:end], active[start:end]
            )
            scores = _chunk_scores(hidden_chunk, weight, bias, inv_temperature, dtype)  # (n, V)
            g_lp = grad_lp[start:end].unsqueeze(1)  # (n, 1)
            if not with_entropy:
                grad_scores = _softmax_(scores)[0].mul_(-g_lp)  # -g p, (n, V)
            else:
                log_p = scores.sub_(log_normalizer[start:end].unsqueeze(1))  # log p, (n, V)
                # dH/ds_v = -p_v (log p_v + H); dlp/ds_v = 1[v = y] - p_v
                probs = log_p.exp()  # (n, V)
                grad_scores = log_p.add_(entropy[start:end].unsqueeze(1))
                grad_scores.mul_(grad_h[start:end].unsqueeze(1)).add_(g_lp).mul_(probs).neg_()
                del probs, log_p
            grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), g_lp)  # + g 1[v = y]
            grad_hidden_chunk = _accumulate_grads(
                grad_scores, hidden_chunk, weight, grad_weight, grad_bias
            )
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_hidden_chunk
            del grad_scores, scores
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


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
) -> TokenLogProbsOutput: ...


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
) -> torch.Tensor | TokenLogProbsOutput:
    r"""Log-probabilities of the given tokens from hidden states, without the full logits.

    With :math:`z_{it} = h_{it} W^\top + b` (a length-V row) and temperature :math:`\tau`,

    .. math::

        \ell_{it} = \frac{z_{it, y_{it}}}{\tau} - \log \sum_v \exp\frac{z_{itv}}{\tau}, \qquad
        \mathcal{H}_{it} = -\sum_v p_{itv} \log p_{itv}, \quad
        p_{it} = \mathrm{softmax}(z_{it} / \tau).

    Tokens are processed ``chunk_size`` rows at a time; only one ``(chunk_size, V)`` block of
    logits is alive (two with ``return_entropy``), and only the per-token log-normaliser is kept
    for backward, which recomputes each chunk's logits and accumulates ``grad_hidden``,
    ``grad_weight`` and ``grad_bias`` (float32 accumulators for bf16/fp16 weights). Values and
    gradients equal those of ``log_softmax((hidden @ weight.T + bias).float() / temperature)``
    gathered at ``tokens``.

    Args:
        hidden: ``(B, T, H)`` hidden states (float64, float32, bfloat16 or float16).
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` integer token ids in ``[0, V)`` (any id where ``mask`` is False).
        bias: optional ``(V,)`` LM-head bias, same dtype as ``weight``.
        temperature: :math:`\tau > 0` dividing the logits (sampling temperature).
        chunk_size: rows per chunk; None uses :func:`default_chunk_size` (about 2**24 logits).
        mask: optional ``(B, T)`` bool/numeric; where False the hidden row and token id are
            ignored (NaN/inf-safe) and the outputs are 0.
        return_entropy: also return the per-token entropy.

    Returns:
        ``(B, T)`` log-probabilities, float32 (float64 for float64 inputs); with
        ``return_entropy=True`` a :class:`TokenLogProbsOutput` ``(log_probs, entropy)``.

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
    head = _prepare_head(hidden, weight, tokens, bias, temperature, chunk_size)
    mask_t = None
    if mask is not None:
        mask_t = as_batch_matrix(as_mask(mask, "mask", hidden.device), "mask")
        check_same_device({"hidden": hidden, "mask": mask_t})
        check_shape(mask_t, "mask", head.batch_shape, "tokens")
        mask_t = mask_t.reshape(-1)
    outputs: tuple[torch.Tensor, torch.Tensor] = _LogProbsFromHidden.apply(  # type: ignore[no-untyped-call]
        head.hidden,
        head.weight,
        head.bias,
        head.tokens,
        mask_t,
        head.inv_temperature,
        head.chunk_size,
        head.dtype,
        return_entropy,
    )
    log_probs = outputs[0].reshape(head.batch_shape)  # (B, T)
    if not return_entropy:
        return log_probs
    return TokenLogProbsOutput(log_probs=log_probs, entropy=outputs[1].reshape(head.batch_shape))


# --------------------------------------------------------------------------------------------
# fused_policy_loss_from_hidden
# --------------------------------------------------------------------------------------------

# The per-chunk derivative of the summed, weighted per-token loss with respect to the chunk's
# log-probabilities: (log_probs (n,), start, end) -> dL/dlog_probs (n,).
_Coefficient = Callable[[torch.Tensor, int, int], torch.Tensor]


class _FusedLinearLoss(torch.autograd.Function):
    """Chunk loop forming the log-probs and, in the same pass, grad_hidden and grad_weight."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        coefficient: _Coefficient,
        inv_temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        rows = hidden.shape[0]
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        log_probs = torch.zeros(rows, dtype=dtype, device=hidden.device)  # (N,)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # (N, H)
        grad_weight = (
            torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
            if need_weight
            else None
        )  # (V, H)
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=accumulate, device=weight.device)
            if need_bias and bias is not None
            else None
        )  # (V,)
        for start, end in row_chunks(rows, chunk_size):
            active = mask[start:end]  # (n,)
            hidden_chunk, tokens_chunk = _select_rows(hidden[start:end], tokens[start:end], active)
            scores = _chunk_scores(hidden_chunk, weight, bias, inv_temperature, dtype)  # (n, V)
            target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,)
            probs, lse = _softmax_(scores)  # (n, V), (n,)
            chunk_log_probs = target - lse  # (n,)
            chunk_log_probs = masked_fill_zero(chunk_log_probs, active)
            log_probs[start:end] = chunk_log_probs
            # dL/dlogits = c (1[v = y] - p) / tau, with c = dL/dlog_prob (0 at masked tokens).
            row_coefficient = coefficient(chunk_log_probs, start, end) * inv_temperature  # (n,)
            grad_scores = probs.mul_((-row_coefficient).unsqueeze(1))  # (n, V)
            grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), row_coefficient.unsqueeze(1))
            grad_hidden_chunk = _accumulate_grads(
                grad_scores, hidden_chunk, weight, grad_weight, grad_bias
            )
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_hidden_chunk
            del scores, probs, grad_scores
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        anchor = torch.zeros((), dtype=dtype, device=hidden.device)
        ctx.mark_non_differentiable(log_probs)
        return anchor, log_probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_anchor: torch.Tensor, grad_log_probs: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError(
                "fused_policy_loss_from_hidden supports one backward pass per forward "
                "(its gradients are formed in forward and released in backward)"
            )
        grads, ctx.grads = ctx.grads, None
        results: list[torch.Tensor | None] = []
        for grad, dtype in zip(grads, ctx.dtypes, strict=True):
            if grad is None or dtype is None:
                results.append(None)
                continue
            # In place on the buffer formed in forward: no second (V, H) buffer.
            scaled = grad.mul_(grad_anchor.to(grad.dtype))
            results.append(scaled.to(dtype))
        return (*results, None, None, None, None, None, None)


def _kl_per_token(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    options: tuple[str, bool, float | torch.Tensor | None],
) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)`` of :func:`rlobjectives.kl_estimate`, zero when masked."""
    estimator, straight_through, log_ratio_bound = options
    return _kl_terms(
        log_probs,
        ref_log_probs,
        mask,
        estimator=estimator,
        straight_through=straight_through,
        log_ratio_bound=log_ratio_bound,
        dtype=log_probs.dtype,
    )


def fused_policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    clip_low: Scalar | None = 0.2,
    clip_high: Scalar | None = None,
    dual_clip: Scalar | None = None,
    ratio_level: Literal["token", "sequence"] = "token",
    log_ratio_bound: Scalar | None = 20.0,
    reduction: str = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: int | None = None,
    diagnostics_normalizer: Scalar | None = None,
    ref_log_probs: ArrayLike | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_straight_through: bool = False,
) -> FusedPolicyLossOutput:
    r"""Clipped policy loss (+ optional KL penalty) computed from hidden states chunk by chunk.

    Equal in value and gradient to composing the unfused functions,

    .. math::

        \ell = \mathrm{log\_softmax}\big((h W^\top + b) / \tau\big)[y], \qquad
        \mathcal{L} = \mathrm{policy\_loss}(\ell, \ell^{old}, A, M)
            + \beta\, \mathrm{aggregate}\big(\mathrm{KL}_k(\ell, \ell^{ref}), M\big),

    with the same ``reduction``/``normalizer`` for both terms and :math:`\beta` = ``kl_coef``.
    The per-token derivative :math:`c_{it} = \partial\mathcal{L}/\partial\ell_{it}` depends only
    on token :math:`(i, t)` and on the batch normaliser, which is computed from the mask before
    the chunk loop, so each chunk forms :math:`\partial\mathcal{L}/\partial z =
    c\,(\mathbb{1}_y - p)/\tau` and its products with ``weight`` and ``hidden`` right away; the
    full logits are never formed and nothing is recomputed in backward.

    ``reduction="none"`` and ``ratio_level="sequence"`` (GSPO, whose per-token derivative needs
    the whole sequence) are supported by composition instead: :func:`token_log_probs_from_hidden`
    (chunked, with recompute) followed by :func:`policy_loss` (for ``"none"`` the returned
    ``loss`` is ``(B, T)``).

    Args:
        hidden: ``(B, T, H)`` hidden states at the response positions.
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden``.
        tokens: ``(B, T)`` sampled token ids (any id where ``mask`` is False).
        old_log_probs: ``(B, T)`` behaviour log-probabilities (treated as constants).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (treated as constants).
        mask: ``(B, T)`` bool/numeric; nonzero selects the token. Unselected rows of ``hidden``
            and ids of ``tokens`` never reach an output or a gradient (NaN-safe).
        bias: optional ``(V,)`` LM-head bias.
        temperature: :math:`\tau > 0`.
        chunk_size: rows per chunk; None uses :func:`default_chunk_size`.
        clip_low: as :func:`policy_loss`.
        clip_high: as :func:`policy_loss`.
        dual_clip: as :func:`policy_loss`.
        ratio_level: as :func:`policy_loss` (``"sequence"`` runs unfused, see above).
        log_ratio_bound: as :func:`policy_loss`; also bounds the KL estimator's log-ratio.
        reduction: as :func:`policy_loss`.
        normalizer: as :func:`policy_loss` (applies to the KL term too).
        max_response_length: as :func:`policy_loss`.
        diagnostics_normalizer: as :func:`policy_loss`.
        ref_log_probs: optional ``(B, T)`` reference-policy log-probabilities for the KL term.
        kl_coef: :math:`\beta \ge 0`; the KL term is added only with ``ref_log_probs``.
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``, as
            :func:`rlobjectives.kl_estimate`.
        kl_straight_through: value of ``kl_estimator`` with the gradient of ``k2`` (verl
            ``k3+``), as :func:`rlobjectives.kl_estimate`.

    Returns:
        :class:`FusedPolicyLossOutput` ``(loss, policy_loss, kl_loss, log_probs,
        diagnostics)``; gradients flow to ``hidden``, ``weight`` and ``bias`` only. ``loss`` is
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: as :func:`token_log_probs_from_hidden` and :func:`policy_loss`, plus a
            negative ``kl_coef``, an unknown ``kl_estimator``, or ``kl_coef > 0`` without
            ``ref_log_probs``.
        TypeError: on non-numeric inputs.
        RuntimeError: on a second backward through the same result.

    Warns:
        BiasedGradientWarning: with the KL term on, for ``"k1"`` or ``"k3"`` without
            ``kl_straight_through``, as :func:`rlobjectives.kl_loss`.

    References:
        Hsu et al. 2024, Liger-Kernel, arXiv:2410.10989 Sec. 3.3 (gradients in the forward pass);
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3-4 (k3 KL term); Schulman et al. 2017,
        arXiv:1707.06347 Eq. 7.

    Examples:
        >>> import torch
        >>> out = fused_policy_loss_from_hidden(
        ...     torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.tensor([[0, 1]]),
        ...     torch.full((1, 2), -1.3862944), torch.tensor([1.0]), torch.ones(1, 2))
        >>> round(float(out.loss), 4)
        -1.0

    .. versionadded:: 0.1.0
    """
    head = _prepare_head(hidden, weight, tokens, bias, temperature, chunk_size)
    policy = _prepare_policy_inputs(
        old_log_probs,
        old_log_probs,
        advantages,
        mask,
        ("old_log_probs", "old_log_probs", "advantages", "mask"),
    )
    check_same_device({"hidden": hidden, "old_log_probs": policy.old_log_probs})
    check_shape(policy.old_log_probs, "old_log_probs", head.batch_shape, "tokens")
    options = _validate_policy_options(
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        log_ratio_bound=log_ratio_bound,
        reduction=reduction,
    )
    beta = float(validate_scalar(kl_coef, "kl_coef", minimum=0.0, allow_tensor=False))
    validate_choice(kl_estimator, "kl_estimator", ESTIMATORS)
    if not isinstance(kl_straight_through, bool):
        raise TypeError(
            f"kl_straight_through must be a bool, got {type(kl_straight_through).__name__} "
            f"({kl_straight_through!r})"
        )
    ref_t = None
    if ref_log_probs is not None:
        ref_t = as_batch_matrix(
            as_float_tensor(ref_log_probs, "ref_log_probs", hidden.device), "ref_log_probs"
        )
        check_same_device({"hidden": hidden, "ref_log_probs": ref_t})
        check_shape(ref_t, "ref_log_probs", head.batch_shape, "tokens")
    elif beta > 0:
        raise ValueError(f"kl_coef > 0 requires ref_log_probs, got kl_coef={kl_coef!r}")
    if diagnostics_normalizer is not None:
        diagnostics_normalizer = validate_scalar(
            diagnostics_normalizer, "diagnostics_normalizer", minimum=0.0, strict=True
        )
    if normalizer is not None:
        validate_scalar(normalizer, "normalizer", minimum=0.0, strict=True)
    dtype = compute_dtype(
        hidden, policy.old_log_probs, policy.advantages, *(() if ref_t is None else (ref_t,))
    )
    # As policy_loss(log_probs, ...): the math in the widest input dtype, the results in the dtype
    # of the log-probabilities (float32, or float64 for float64 hidden states).
    output_dtype = head.dtype
    mask_t = policy.mask  # (B, T)
    reduce_kwargs: dict[str, Any] = {
        "reduction": reduction,
        "normalizer": normalizer,
        "max_response_length": max_response_length,
    }
    with_kl = ref_t is not None and beta > 0
    kl_options = (kl_estimator, kl_straight_through, options.log_ratio_bound)
    if with_kl and not kl_straight_through and kl_estimator in ("k1", "k3", "abs"):
        warnings.warn(
            f'fused_policy_loss_from_hidden(kl_estimator="{kl_estimator}") has a biased or zero '
            "expected KL gradient as a loss term (see rlobjectives.kl_loss); use "
            'kl_straight_through=True or kl_estimator="k2" for the unbiased gradient',
            BiasedGradientWarning,
            stacklevel=2,
        )

    def total_loss(
        log_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossDiagnostics]:
        """The unfused composition on ``(B, T)`` log-probs: (loss, policy, kl, diagnostics)."""
        out = policy_loss(
            log_probs,
            policy.old_log_probs.detach(),
            policy.advantages.detach(),
            mask_t,
            **options._asdict(),
            diagnostics_normalizer=diagnostics_normalizer,
            **reduce_kwargs,
        )
        kl_loss = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
        if ref_t is not None:
            kl = _kl_per_token(log_probs, ref_t.detach().to(dtype), mask_t, kl_options)
            kl_loss = aggregate(kl.to(log_probs.dtype), mask_t, **reduce_kwargs)
        loss = out.loss + beta * kl_loss if with_kl else out.loss
        return loss, out.loss.detach(), kl_loss.detach(), out.diagnostics

    if reduction == "none" or ratio_level == "sequence":
        log_probs = token_log_probs_from_hidden(
            hidden,
            weight,
            tokens,
            bias=bias,
            temperature=temperature,
            chunk_size=head.chunk_size,
            mask=mask_t,
        ).to(dtype)
        loss, policy_part, kl_part, diagnostics = total_loss(log_probs)
        return FusedPolicyLossOutput(
            loss.to(output_dtype),
            policy_part.to(output_dtype),
            kl_part.to(output_dtype),
            log_probs.detach().to(output_dtype),
            diagnostics,
        )

    # Per-token weights of the (linear) reduction: d aggregate / d values, from the mask only.
    with torch.enable_grad():
        probe = torch.zeros(head.batch_shape, dtype=dtype, device=hidden.device, requires_grad=True)
        (token_weights,) = torch.autograd.grad(aggregate(probe, mask_t, **reduce_kwargs), probe)
    token_weights = token_weights.reshape(-1)  # (N,)
    flat_mask = mask_t.reshape(-1)  # (N,)
    old_flat = policy.old_log_probs.detach().to(dtype).reshape(-1)  # (N,)
    advantages_flat = (
        policy.advantages.detach().to(dtype).expand(head.batch_shape).reshape(-1)
    )  # (N,)
    ref_flat = None if ref_t is None else ref_t.detach().to(dtype).reshape(-1)  # (N,)

    def coefficient(chunk_log_probs: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """dL/dlog_prob for one chunk, by autograd through the unfused per-token math."""
        with torch.enable_grad():
            leaf = chunk_log_probs.detach().requires_grad_(True)  # (n,)
            chunk_mask = flat_mask[start:end].unsqueeze(0)  # (1, n)
            inputs = _PolicyInputs(
                log_probs=leaf.unsqueeze(0),
                old_log_probs=old_flat[start:end].unsqueeze(0),
                advantages=advantages_flat[start:end].unsqueeze(0),
                mask=chunk_mask,
                output_dtype=dtype,
                dtype=dtype,
            )
            per_token = _policy_loss_terms(
                inputs, diagnostics_normalizer=None, **options._asdict()
            ).per_token_loss  # (1, n)
            if with_kl and ref_flat is not None:
                kl = _kl_per_token(
                    leaf.unsqueeze(0),
                    ref_flat[start:end].unsqueeze(0),
                    chunk_mask,
                    kl_options,
                )  # (1, n)
                per_token = per_token + beta * masked_fill_zero(kl.to(dtype), chunk_mask)
            weighted = (per_token.squeeze(0) * token_weights[start:end]).sum()
            (grad,) = torch.autograd.grad(weighted, leaf, allow_unused=True)
        if grad is None:
            return torch.zeros_like(chunk_log_probs)
        return masked_fill_zero(grad, flat_mask[start:end])

    anchor, flat_log_probs = _FusedLinearLoss.apply(  # type: ignore[no-untyped-call]
        head.hidden,
        head.weight,
        head.bias,
        head.tokens,
        flat_mask,
        coefficient,
        head.inv_temperature,
        head.chunk_size,
        dtype,
    )
    log_probs = flat_log_probs.reshape(head.batch_shape)  # (B, T), detached
    loss, policy_part, kl_part, diagnostics = total_loss(log_probs)
    # The value is the unfused composition's; the gradient flows through the anchor (value 0).
    loss = loss.detach() + anchor
    return FusedPolicyLossOutput(
        loss.to(output_dtype),
        policy_part.to(output_dtype),
        kl_part.to(output_dtype),
        log_probs.to(output_dtype),
        diagnostics,
    )
