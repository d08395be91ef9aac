"""Chunked log-probabilities, entropy and exact full-vocabulary KL from logits.

Every function here reads the logits ``(N, V)`` one block of rows ("chunk") at a time, upcasts
that block to float32 (float64 for float64 logits), and keeps only per-row statistics (a few
``(N,)`` vectors) between the forward and the backward pass. The backward pass recomputes the
softmax of each chunk from the saved logits and writes the exact gradient into a tensor of the
logits' own dtype, so no float32 copy of the whole ``(N, V)`` tensor ever exists: the extra memory
is O(chunk_size * V), on top of the logits and their gradient.

Chunking helpers for other modules (``_from_hidden.py`` uses them):

- :func:`resolve_chunk_size` validates a ``chunk_size`` argument and picks the default.
- :func:`row_chunks` lists the static ``(start, end)`` row ranges of a chunked loop.
- :func:`chunk_token_log_probs` / :func:`chunk_token_log_probs_grad`,
  :func:`chunk_entropy` / :func:`chunk_entropy_grad`: the per-chunk math on already scaled,
  upcast logits ``x = logits / temperature`` of shape ``(C, V)``.

Loops run over Python ``range`` objects built from static shapes (no ``.item()``), so the
functions trace under ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._masking import aggregate, masked_fill_zero
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
    validate_scalar,
)

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "ResponseAlignment",
    "ResponseLogProbs",
    "chunk_entropy",
    "chunk_entropy_grad",
    "chunk_token_log_probs",
    "chunk_token_log_probs_grad",
    "full_vocab_kl",
    "full_vocab_kl_loss",
    "resolve_chunk_size",
    "response_alignment",
    "response_log_probs",
    "row_chunks",
    "token_entropy",
    "token_log_probs",
]

#: Default number of logits per chunk (rows * V): 2**23 elements = 32 MiB in float32.
DEFAULT_CHUNK_ELEMENTS = 1 << 23


# ---------------------------------------------------------------------------------------------
# Chunking helpers (shared with _from_hidden.py)
# ---------------------------------------------------------------------------------------------


def resolve_chunk_size(chunk_size: int | None, *, row_width: int, name: str = "chunk_size") -> int:
    """Validate a ``chunk_size`` (rows per chunk) argument, or pick the default.

    Args:
        chunk_size: a positive Python int, or None for the default
            ``max(1, DEFAULT_CHUNK_ELEMENTS // row_width)`` rows (about 32 MiB of float32 logits
            per chunk; e.g. 262 rows at V = 32000, 55 rows at V = 152064).
            On a GPU, larger chunks trade memory for fewer kernel launches: measured on an
            H200 (bf16, N = 16384, V = 152064, token_log_probs forward + backward), 55 rows took
            73 ms with 0.11 GiB of chunk memory, 220 rows 54 ms with 0.44 GiB.
        row_width: elements per row of the chunked tensor (V for logits).
        name: argument name used in error messages.

    Returns:
        The number of rows per chunk (>= 1).

    Raises:
        TypeError: if ``chunk_size`` is not an int (bools and tensors are rejected).
        ValueError: if ``chunk_size < 1``.
    """
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(row_width, 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(
            f"{name} must be a positive int (rows per chunk) or None, "
            f"got {type(chunk_size).__name__} ({chunk_size!r})"
        )
    if chunk_size < 1:
        raise ValueError(f"{name} must be >= 1 (rows per chunk), got {chunk_size}")
    return chunk_size


def row_chunks(num_rows: int, chunk_size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` row ranges of a chunked loop over ``num_rows`` rows.

    Static Python ints only (no tensor values are read), so a loop over the result unrolls
    under ``torch.compile``. The last chunk is shorter when ``chunk_size`` does not divide
    ``num_rows``; zero rows give an empty list.

    Args:
        num_rows: N, the number of rows.
        chunk_size: rows per chunk, >= 1 (see :func:`resolve_chunk_size`).

    Returns:
        ``[(0, c), (c, 2c), ..., (k c, N)]``.

    Examples:
        >>> row_chunks(5, 2)
        [(0, 2), (2, 4), (4, 5)]
    """
    return [(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]


def _load_chunk(
    logits: torch.Tensor,
    start: int,
    end: int,
    active: torch.Tensor | None,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``start:end`` of ``logits``, divided by ``temperature`` (then in ``dtype``).

    With ``active`` (``(C,)`` bool), inactive rows are replaced by zeros with ``torch.where``
    (on the input dtype, before any arithmetic), so NaN/inf there can reach neither an ``exp``
    nor a result. At temperature 1 the chunk keeps the input dtype: the upcast is fused into
    the ``(log_)softmax(..., dtype=dtype)`` of the chunk helpers. The result may alias
    ``logits``: never modify it in place.
    """
    chunk = logits[start:end]  # (C, V)
    if active is not None:
        zero = torch.zeros((), dtype=chunk.dtype, device=chunk.device)
        chunk = torch.where(active.unsqueeze(-1), chunk, zero)
    if temperature != 1.0:
        chunk = chunk.to(dtype) / temperature
    return chunk


def _xlogy_terms(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs * values`` with 0 wherever ``probs == 0`` (so 0 * -inf = 0 for -inf logits).

    NaN probabilities (NaN logits in a selected row) still propagate.
    """
    return torch.where(
        probs == 0, torch.zeros((), dtype=probs.dtype, device=probs.device), probs * values
    )


def _finite_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Clamp ``-inf`` log-probabilities to the most negative finite value, in place.

    Then ``p * log p = 0 * finite = 0`` for ``-inf`` logits; NaN still propagates.
    """
    return log_probs.clamp_(min=torch.finfo(log_probs.dtype).min)


def chunk_token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    r"""Log-softmax at the sampled tokens of one chunk: :math:`x_{n,y_n} - \log\sum_v e^{x_{nv}}`.

    One fused ``log_softmax(logits, dtype=dtype)`` (the upcast of a bf16/fp16 chunk happens
    inside it), then a gather. Differentiable; the ``*_grad`` helpers below give the same
    gradient without autograd, for use inside a custom ``backward``.

    Args:
        logits: ``(C, V)`` logits of the chunk, already divided by the temperature (any float
            dtype).
        tokens: ``(C,)`` int64 token ids in ``[0, V)``.
        dtype: computation and result dtype (float32, or float64).

    Returns:
        ``(C,)`` log-probabilities in ``dtype``.
    """
    log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (C, V)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def chunk_token_log_probs_grad(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    grad: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    r"""Gradient of :func:`chunk_token_log_probs` w.r.t. its logits: ``(onehot - p) g``.

    .. math::

        \frac{\partial}{\partial x_{nv}} \sum_n g_n \log p_{n y_n}
        = g_n (\mathbb{1}[v = y_n] - p_{nv}).

    Divide by the temperature for the gradient w.r.t. the raw logits. Not differentiable
    (in-place ops on its own intermediates); call it where autograd is off (a ``backward``).

    Args:
        logits: ``(C, V)`` as passed to :func:`chunk_token_log_probs` (not modified).
        tokens: ``(C,)`` int64.
        grad: ``(C,)`` upstream gradient of the log-probs, in ``dtype``.
        dtype: computation and result dtype.

    Returns:
        ``(C, V)`` gradient in ``dtype`` (a new tensor).
    """
    grad_logits = torch.softmax(logits, dim=-1, dtype=dtype)  # (C, V) p
    grad_logits.mul_((-grad).unsqueeze(-1))  # (C, V) -g p
    return grad_logits.scatter_add_(-1, tokens.unsqueeze(-1), grad.unsqueeze(-1))


def chunk_entropy(logits: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""Entropy of the softmax of one chunk: :math:`-\sum_v p_v \log p_v` (0 log 0 = 0).

    Args:
        logits: ``(C, V)`` logits already divided by the temperature (any float dtype).
        dtype: computation and result dtype.

    Returns:
        ``(C,)`` entropies in ``dtype``. Not differentiable (in-place ops).
    """
    log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_probs)  # (C, V)
    entropy: torch.Tensor = -torch.linalg.vecdot(probs, _finite_log_probs(log_probs))  # (C,)
    return entropy


def chunk_entropy_grad(
    logits: torch.Tensor,
    entropy: torch.Tensor,
    grad: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    r"""Gradient of :func:`chunk_entropy` w.r.t. its logits (not differentiable).

    .. math::

        \frac{\partial H_n}{\partial x_{nv}} = -p_{nv} (\log p_{nv} + H_n).

    Args:
        logits: ``(C, V)`` (not modified).
        entropy: ``(C,)`` from :func:`chunk_entropy`.
        grad: ``(C,)`` upstream gradient of the entropy, in ``dtype``.
        dtype: computation and result dtype.

    Returns:
        ``(C, V)`` gradient in ``dtype`` (a new tensor).
    """
    log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_probs)  # (C, V)
    _finite_log_probs(log_probs).add_(entropy.unsqueeze(-1))  # (C, V) log p + H
    return probs.mul_(log_probs).mul_((-grad).unsqueeze(-1))


# ---------------------------------------------------------------------------------------------
# Autograd functions (flat (N, V) logits, (N,) bool rows to compute)
# ---------------------------------------------------------------------------------------------


def _backward_rows(active: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Rows whose gradient is computed: selected rows with a nonzero upstream gradient.

    Rows with a zero upstream gradient get an exact zero (instead of ``0 * NaN``), so
    non-finite logits in rows that the caller masks downstream with ``torch.where`` do not
    poison the gradient.
    """
    return active & (grad != 0)


class _TokenLogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V)
        tokens: torch.Tensor,  # (N,) int64, 0 at inactive rows
        active: torch.Tensor,  # (N,) bool
        masked: bool,  # False: every row is active (no row selection in the forward pass)
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        log_probs = []
        for start, end in row_chunks(logits.shape[0], chunk_size):
            rows = active[start:end] if masked else None  # (C,)
            chunk = _load_chunk(logits, start, end, rows, temperature, dtype)  # (C, V)
            chunk_log_probs = chunk_token_log_probs(chunk, tokens[start:end], dtype=dtype)
            if rows is not None:
                chunk_log_probs = masked_fill_zero(chunk_log_probs, rows)  # (C,)
            log_probs.append(chunk_log_probs)
        ctx.save_for_backward(logits, tokens, active)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return _cat(log_probs, logits, dtype)  # (N,)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, tokens, active = ctx.saved_tensors
        temperature, dtype = ctx.temperature, ctx.dtype
        grad_logits = torch.empty_like(logits)  # (N, V), dtype of the logits
        for start, end in row_chunks(logits.shape[0], ctx.chunk_size):
            upstream = grad[start:end].to(dtype)  # (C,)
            rows = _backward_rows(active[start:end], upstream)  # (C,)
            chunk = _load_chunk(logits, start, end, rows, temperature, dtype)  # (C, V)
            chunk_grad = chunk_token_log_probs_grad(
                chunk, tokens[start:end], masked_fill_zero(upstream, rows), dtype=dtype
            )  # (C, V)
            if temperature != 1.0:
                chunk_grad.div_(temperature)
            grad_logits[start:end] = chunk_grad
        return grad_logits, None, None, None, None, None, None


class _EntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V)
        active: torch.Tensor,  # (N,) bool
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        entropies = []
        for start, end in row_chunks(logits.shape[0], chunk_size):
            rows = active[start:end] if masked else None  # (C,)
            chunk = _load_chunk(logits, start, end, rows, temperature, dtype)  # (C, V)
            entropies.append(chunk_entropy(chunk, dtype=dtype))  # (C,)
        entropy = _cat(entropies, logits, dtype)  # (N,), log(V) at inactive rows
        ctx.save_for_backward(logits, active, entropy)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return masked_fill_zero(entropy, active) if masked else entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, active, entropy = ctx.saved_tensors
        temperature, dtype = ctx.temperature, ctx.dtype
        grad_logits = torch.empty_like(logits)  # (N, V)
        for start, end in row_chunks(logits.shape[0], ctx.chunk_size):
            upstream = grad[start:end].to(dtype)  # (C,)
            rows = _backward_rows(active[start:end], upstream)  # (C,)
            chunk = _load_chunk(logits, start, end, rows, temperature, dtype)  # (C, V)
            chunk_grad = chunk_entropy_grad(
                chunk,
                masked_fill_zero(entropy[start:end], rows),
                masked_fill_zero(upstream, rows),
                dtype=dtype,
            )  # (C, V)
            if temperature != 1.0:
                chunk_grad.div_(temperature)
            grad_logits[start:end] = chunk_grad
        return grad_logits, None, None, None, None, None


def _chunk_kl(chunk: torch.Tensor, ref_chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """KL(p || q) per row of one chunk, ``(C,)``."""
    log_p = torch.log_softmax(chunk, dim=-1, dtype=dtype)  # (C, V)
    log_q = torch.log_softmax(ref_chunk, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_p)  # (C, V)
    return _xlogy_terms(probs, log_p.sub_(log_q)).sum(-1)  # (C,)


class _FullVocabKLFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V)
        ref_logits: torch.Tensor,  # (N, V)
        active: torch.Tensor,  # (N,) bool
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        kls = []
        for start, end in row_chunks(logits.shape[0], chunk_size):
            rows = active[start:end] if masked else None  # (C,)
            chunk = _load_chunk(logits, start, end, rows, temperature, dtype)  # (C, V)
            ref_chunk = _load_chunk(ref_logits, start, end, rows, temperature, dtype)  # (C, V)
            chunk_kl = _chunk_kl(chunk, ref_chunk, dtype)  # (C,)
            kls.append(chunk_kl if rows is None else masked_fill_zero(chunk_kl, rows))
        kl = _cat(kls, logits, dtype)  # (N,)
        ctx.save_for_backward(logits, ref_logits, active, kl)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, ref_logits, active, kl = ctx.saved_tensors
        temperature, dtype = ctx.temperature, ctx.dtype
        needs_logits, needs_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logits = torch.empty_like(logits) if needs_logits else None  # (N, V)
        grad_ref = torch.empty_like(ref_logits) if needs_ref else None  # (N, V)
        for start, end in row_chunks(logits.shape[0], ctx.chunk_size):
            upstream = grad[start:end].to(dtype)  # (C,)
            rows = _backward_rows(active[start:end], upstream)  # (C,)
            upstream = masked_fill_zero(upstream, rows).unsqueeze(-1)  # (C, 1)
            chunk = _load_chunk(logits, start, end, rows, temperature, dtype)  # (C, V)
            ref_chunk = _load_chunk(ref_logits, start, end, rows, temperature, dtype)  # (C, V)
            log_p = torch.log_softmax(chunk, dim=-1, dtype=dtype)  # (C, V)
            log_q = torch.log_softmax(ref_chunk, dim=-1, dtype=dtype)  # (C, V)
            probs = torch.exp(log_p)  # (C, V)
            if grad_logits is not None:
                # dKL/dx_v = p_v (log p_v - log q_v - KL)
                row_kl = masked_fill_zero(kl[start:end], rows).unsqueeze(-1)  # (C, 1)
                chunk_grad = _xlogy_terms(probs, log_p.sub_(log_q).sub_(row_kl))  # (C, V)
                chunk_grad.mul_(upstream)
                if temperature != 1.0:
                    chunk_grad.div_(temperature)
                grad_logits[start:end] = chunk_grad
            if grad_ref is not None:
                # dKL/dy_v = q_v - p_v
                chunk_grad = log_q.exp_().sub_(probs).mul_(upstream)  # (C, V)
                if temperature != 1.0:
                    chunk_grad.div_(temperature)
                grad_ref[start:end] = chunk_grad
        return grad_logits, grad_ref, None, None, None, None, None


def _cat(parts: list[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate per-chunk ``(C,)`` results; an empty list (N = 0) gives ``(0,)``."""
    if not parts:
        return torch.zeros(0, dtype=dtype, device=like.device)
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------
# Boundary validation
# ---------------------------------------------------------------------------------------------


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if logits.ndim not in (2, 3):
        raise ValueError(
            f"{name} must have shape (B, T, V) or (N, V), got shape {tuple(logits.shape)} "
            f"({logits.ndim} dimensions)"
        )
    if logits.shape[-1] < 1:
        raise ValueError(
            f"{name} must have a vocabulary dimension V >= 1, got shape {tuple(logits.shape)}"
        )


def _as_logits(logits: ArrayLike, name: str) -> torch.Tensor:
    tensor = as_float_tensor(logits, name)
    _check_logits(tensor, name)
    return tensor


def _row_mask(
    mask: ArrayLike | None, name: str, logits: torch.Tensor, logits_name: str
) -> torch.Tensor:
    """The ``(N,)`` bool rows to compute: ``mask`` flattened, or all True."""
    batch_shape = tuple(logits.shape[:-1])
    if mask is None:
        return torch.ones(batch_shape, dtype=torch.bool, device=logits.device).reshape(-1)
    mask_t = as_mask(mask, name, logits.device)
    check_same_device({logits_name: logits, name: mask_t})
    if tuple(mask_t.shape) != batch_shape:
        raise ValueError(
            f"{name} must have shape {batch_shape} (the shape of {logits_name} without its last "
            f"dimension V), got shape {tuple(mask_t.shape)}"
        )
    return mask_t.reshape(-1)


def _validate_temperature(temperature: float) -> float:
    value = validate_scalar(
        temperature, "temperature", minimum=0.0, strict=True, allow_tensor=False
    )
    return float(value)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def token_log_probs(
    logits: ArrayLike,
    tokens: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""Log-probabilities of the sampled tokens, computed in float32 chunk by chunk.

    With :math:`x = \text{logits} / \tau`,

    .. math::

        \log \pi(y_{bt}) = x_{bt, y_{bt}} - \log \sum_{v=1}^{V} \exp(x_{btv}),

    evaluated on blocks of ``chunk_size`` rows, each upcast to float32 on its own, so no float32
    copy of the ``(B, T, V)`` logits is made (TRL's ``selective_log_softmax`` and torchtune's
    ``log_softmax(dtype=float32)`` upcast the whole tensor). The gradient is exact,
    :math:`\partial / \partial \text{logits}_{btv} = g_{bt} (\mathbb{1}[v = y_{bt}] - p_{btv})
    / \tau`; it is recomputed chunk by chunk in the backward pass (only the logits and the
    ``(N,)`` log-normalisers are saved) and written in the logits' dtype. Invariant to adding a
    constant to each row of the logits. Second-order gradients are not supported.

    Args:
        logits: ``(B, T, V)`` or ``(N, V)`` floating logits (any float dtype).
        tokens: ``(B, T)`` or ``(N,)`` integer token ids, in ``[0, V)`` wherever ``mask`` is True
            (not checked on the device: an out-of-range id raises inside ``gather``).
        mask: optional ``(B, T)`` / ``(N,)`` bool or numeric, nonzero = compute this position.
            Unselected positions give 0, and any value there (NaN/inf logits, padding ids such
            as -100) reaches neither the output nor the gradient. Default: every position.
        temperature: :math:`\tau > 0`; the logits are divided by it (the sampling temperature).
        chunk_size: rows per chunk (positive int), or None for
            ``max(1, 2**23 // V)`` rows (about 32 MiB of float32 per chunk).

    Returns:
        ``(B, T)`` or ``(N,)`` log-probabilities, float32 (float64 for float64 logits) whatever
        the logits' dtype, on the logits' device. Rows with a zero upstream gradient get an exact
        zero logits gradient.

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``temperature <= 0`` or
            non-finite, ``chunk_size < 1``.
        TypeError: on non-numeric logits, non-integer tokens, a non-int ``chunk_size`` or a
            non-number ``temperature``.

    References:
        The log-softmax gather of the policy-gradient estimator, Williams 1992 (REINFORCE) and
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 6-7; chunked float32 evaluation as in
        Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989 Sec. 3.3) and Cut Cross-Entropy
        (Wijmans et al. 2024, arXiv:2411.09009).

    Examples:
        >>> import torch
        >>> token_log_probs(torch.log(torch.tensor([[0.25, 0.75]])), torch.tensor([1]))
        tensor([-0.2877])

    .. versionadded:: 0.1.0
    """
    logits_t = _as_logits(logits, "logits")
    tokens_t = _as_tokens(tokens, "tokens", logits_t, "logits")
    active = _row_mask(mask, "mask", logits_t, "logits")
    tau = _validate_temperature(temperature)
    vocab = logits_t.shape[-1]
    chunk = resolve_chunk_size(chunk_size, row_width=vocab)
    flat_tokens = torch.where(active, tokens_t.reshape(-1).to(torch.int64), 0)  # (N,)
    out: torch.Tensor = _TokenLogProbsFunction.apply(  # type: ignore[no-untyped-call]
        logits_t.reshape(-1, vocab),
        flat_tokens,
        active,
        mask is not None,
        tau,
        chunk,
        compute_dtype(logits_t),
    )  # (N,)
    return out.reshape(logits_t.shape[:-1])


def _as_tokens(
    tokens: ArrayLike, name: str, logits: torch.Tensor, logits_name: str
) -> torch.Tensor:
    tokens_t = as_tensor(tokens, name, logits.device)
    if tokens_t.is_floating_point() or tokens_t.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor of token ids, got dtype {tokens_t.dtype}"
        )
    check_same_device({logits_name: logits, name: tokens_t})
    expected = tuple(logits.shape[:-1])
    if tuple(tokens_t.shape) != expected:
        raise ValueError(
            f"{name} must have shape {expected} (the shape of {logits_name} without its last "
            f"dimension V), got shape {tuple(tokens_t.shape)}"
        )
    return tokens_t


def token_entropy(
    logits: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""Entropy of the next-token distribution at every position, in float32, chunk by chunk.

    With :math:`p = \mathrm{softmax}(\text{logits} / \tau)` over the vocabulary,

    .. math::

        H_{bt} = -\sum_{v=1}^{V} p_{btv} \log p_{btv}, \qquad
        \frac{\partial H_{bt}}{\partial \text{logits}_{btv}}
        = -\frac{p_{btv} (\log p_{btv} + H_{bt})}{\tau}.

    Terms with :math:`p_v = 0` (e.g. ``-inf`` logits of banned tokens) contribute 0. Memory and
    dtype behaviour as in :func:`token_log_probs`: float32 chunks, only the logits and two
    ``(N,)`` vectors saved, exact gradient in the logits' dtype, no second-order gradients.

    Args:
        logits: ``(B, T, V)`` or ``(N, V)`` floating logits.
        mask: optional ``(B, T)`` / ``(N,)``; unselected positions give 0 and never reach the
            output or the gradient. Default: every position.
        temperature: :math:`\tau > 0`.
        chunk_size: rows per chunk, or None for ``max(1, 2**23 // V)``.

    Returns:
        ``(B, T)`` or ``(N,)`` entropies in nats, float32 (float64 for float64 logits).

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``temperature <= 0``,
            ``chunk_size < 1``.
        TypeError: on non-numeric logits or a non-int ``chunk_size``.

    References:
        Shannon 1948; the entropy bonus of Mnih et al. 2016, A3C, arXiv:1602.01783 Sec. 4, and
        the entropy diagnostics of DAPO, arXiv:2503.14476 Sec. 3.1.

    Examples:
        >>> import torch
        >>> token_entropy(torch.zeros(1, 4))  # uniform over 4 tokens: log 4
        tensor([1.3863])

    .. versionadded:: 0.1.0
    """
    logits_t = _as_logits(logits, "logits")
    active = _row_mask(mask, "mask", logits_t, "logits")
    tau = _validate_temperature(temperature)
    vocab = logits_t.shape[-1]
    chunk = resolve_chunk_size(chunk_size, row_width=vocab)
    out: torch.Tensor = _EntropyFunction.apply(  # type: ignore[no-untyped-call]
        logits_t.reshape(-1, vocab), active, mask is not None, tau, chunk, compute_dtype(logits_t)
    )  # (N,)
    return out.reshape(logits_t.shape[:-1])


def _prepare_kl(
    logits: ArrayLike,
    ref_logits: ArrayLike,
    mask: ArrayLike | None,
    temperature: float,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int]:
    logits_t = _as_logits(logits, "logits")
    ref_t = _as_logits(ref_logits, "ref_logits")
    check_same_device({"logits": logits_t, "ref_logits": ref_t})
    check_shape(ref_t, "ref_logits", tuple(logits_t.shape), "logits")
    active = _row_mask(mask, "mask", logits_t, "logits")
    tau = _validate_temperature(temperature)
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    return logits_t, ref_t, active, tau, chunk


def full_vocab_kl(
    logits: ArrayLike,
    ref_logits: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""Exact per-token KL(pi || ref) over the whole vocabulary, chunked over tokens.

    With :math:`p = \mathrm{softmax}(\text{logits}/\tau)` and
    :math:`q = \mathrm{softmax}(\text{ref\_logits}/\tau)` at each position,

    .. math::

        \mathrm{KL}_{bt} = \sum_{v=1}^{V} p_{btv} (\log p_{btv} - \log q_{btv}) \ \ge 0,

    .. math::

        \frac{\partial \mathrm{KL}}{\partial \text{logits}_v}
        = \frac{p_v (\log p_v - \log q_v - \mathrm{KL})}{\tau}, \qquad
        \frac{\partial \mathrm{KL}}{\partial \text{ref\_logits}_v} = \frac{q_v - p_v}{\tau}.

    This is the exact value that the sampled estimators k1/k2/k3 (Schulman 2020) estimate from
    one token per position; none of verl (``kl_penalty="full"`` raises NotImplementedError),
    TRL or OpenRLHF computes it. Both forward and backward process ``chunk_size`` positions at a
    time in float32 (only the two logit tensors and three ``(N,)`` vectors are saved), so the
    extra memory is O(chunk_size * V) in both passes; gradients are written in each input's
    dtype, for ``ref_logits`` only when it requires grad. Terms with :math:`p_v = 0` contribute
    0; the KL is ``inf`` where the reference gives zero probability to a token the policy
    supports. Both distributions use the same temperature (the sampling temperature).

    To reduce to a loss use :func:`full_vocab_kl_loss` (or
    ``aggregate(full_vocab_kl(...), mask, reduction=...)``).

    Args:
        logits: ``(B, T, V)`` or ``(N, V)`` policy logits.
        ref_logits: reference-policy logits, same shape (any float dtype).
        mask: optional ``(B, T)`` / ``(N,)``; unselected positions give exactly 0, and NaN/inf
            in their logits reaches neither the output nor a gradient. Default: every position.
        temperature: :math:`\tau > 0`, applied to both logit tensors.
        chunk_size: positions per chunk, or None for ``max(1, 2**23 // V)``.

    Returns:
        ``(B, T)`` or ``(N,)`` KL in nats, float32 (float64 if either input is float64).

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``temperature <= 0``,
            ``chunk_size < 1``.
        TypeError: on non-numeric logits or a non-int ``chunk_size``.

    References:
        Kullback & Leibler 1951; the KL-regularised RL objective of Ouyang et al. 2022,
        arXiv:2203.02155 Eq. 2, and GRPO, arXiv:2402.03300 Eq. 3-4 (whose k3 term estimates this
        quantity from the sampled token).

    Examples:
        >>> import torch
        >>> logits = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> ref_logits = torch.log(torch.tensor([[0.25, 0.75]]))
        >>> full_vocab_kl(logits, ref_logits)  # 0.5 log 2 + 0.5 log(2/3)
        tensor([0.1438])

    .. versionadded:: 0.1.0
    """
    logits_t, ref_t, active, tau, chunk = _prepare_kl(
        logits, ref_logits, mask, temperature, chunk_size
    )
    vocab = logits_t.shape[-1]
    out: torch.Tensor = _FullVocabKLFunction.apply(  # type: ignore[no-untyped-call]
        logits_t.reshape(-1, vocab),
        ref_t.reshape(-1, vocab),
        active,
        mask is not None,
        tau,
        chunk,
        compute_dtype(logits_t, ref_t),
    )  # (N,)
    return out.reshape(logits_t.shape[:-1])


def full_vocab_kl_loss(
    logits: ArrayLike,
    ref_logits: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: str = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""Exact full-vocabulary KL(pi || ref) reduced to a loss term.

    .. math::

        \mathcal{L}_{KL} = \mathrm{reduce}_{M}\big(\mathrm{KL}_{bt}\big),

    with :math:`\mathrm{KL}_{bt}` from :func:`full_vocab_kl` and the reduction of
    :func:`rlobjectives.aggregate` (``"token_mean"``, ``"sequence_mean"``,
    ``"sequence_sum_normalized"``, ``"none"``). Multiply by the KL coefficient and add it to the
    policy loss (GRPO's KL term, arXiv:2402.03300 Eq. 3, with the exact KL in place of k3).
    With an explicit ``normalizer`` the loss of micro-batches adds up to the full-batch loss.

    Args:
        logits: ``(B, T, V)`` policy logits.
        ref_logits: ``(B, T, V)`` reference logits.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        reduction: see :func:`rlobjectives.aggregate`.
        normalizer: optional explicit denominator (see :func:`rlobjectives.aggregate`).
        max_response_length: Dr. GRPO constant for ``"sequence_sum_normalized"``.
        temperature: :math:`\tau > 0`, applied to both logit tensors.
        chunk_size: positions per chunk, or None for ``max(1, 2**23 // V)``.

    Returns:
        Scalar loss (``(B, T)`` for ``reduction="none"``), float32 (float64 for float64 inputs).

    Raises:
        ValueError: as :func:`full_vocab_kl`, for logits that are not ``(B, T, V)``, an unknown
            ``reduction`` or a non-positive ``normalizer``.
        TypeError: on non-numeric logits.

    References:
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3; Ouyang et al. 2022, arXiv:2203.02155
        Eq. 2.

    Examples:
        >>> import torch
        >>> loss = full_vocab_kl_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3),
        ...                           torch.ones(1, 2, dtype=torch.bool))
        >>> loss
        tensor(0.)

    .. versionadded:: 0.1.0
    """
    logits_t = _as_logits(logits, "logits")
    if logits_t.ndim != 3:
        raise ValueError(
            f"logits must have shape (B, T, V) for a reduced loss, got shape "
            f"{tuple(logits_t.shape)}"
        )
    mask_t = as_batch_matrix(as_mask(mask, "mask", logits_t.device), "mask")
    kl = full_vocab_kl(
        logits_t, ref_logits, mask=mask_t, temperature=temperature, chunk_size=chunk_size
    )  # (B, T)
    return aggregate(
        kl,
        mask_t,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )


# ---------------------------------------------------------------------------------------------
# Causal-LM alignment
# ---------------------------------------------------------------------------------------------


class ResponseAlignment(NamedTuple):
    """Where each response token of a causal-LM batch sits, and which row predicts it.

    Attributes:
        positions: ``(B, R)`` int64: index ``j - 1`` of the logits/hidden row (in the ``L``
            axis) that predicts response token ``t`` at absolute position ``j``; a valid index
            (not meaningful) where ``mask`` is False.
        tokens: ``(B, R)`` int64: the response token ``input_ids[b, j]``; 0 where ``mask`` is
            False.
        mask: ``(B, R)`` bool: True for real response tokens.
    """

    positions: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor


class ResponseLogProbs(NamedTuple):
    """Result of :func:`response_log_probs`.

    Attributes:
        log_probs: ``(B, R)`` float32 log-probabilities of the response tokens, 0 where
            ``mask`` is False.
        mask: ``(B, R)`` bool response mask, ready for :func:`rlobjectives.policy_loss`.
    """

    log_probs: torch.Tensor
    mask: torch.Tensor


def _as_index_tensor(value: ArrayLike, name: str, device: torch.device | None) -> torch.Tensor:
    tensor = as_tensor(value, name, device)
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {tensor.dtype}")
    return tensor


def _check_layout(
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor,
    lengths: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    response_length: int,
) -> None:
    """Host-side check of the padding layout (one synchronisation; skipped under compile)."""
    # Each row's attended tokens must be one contiguous run: at most one 0 -> 1 transition.
    padded = torch.nn.functional.pad(attention_mask.to(torch.int8), (1, 0))  # (B, L + 1)
    run_starts = (padded[:, 1:] > padded[:, :-1]).sum(-1)  # (B,)
    checks = torch.stack(
        [
            (run_starts > 1).any(),
            (prompt_lengths < 1).any(),
            (prompt_lengths > lengths).any(),
            ((end - start) > response_length).any(),
        ]
    ).tolist()
    if checks[0]:
        raise ValueError(
            "attention_mask must mark each sequence as one contiguous run of ones (right "
            "padding, left padding, or left-padded prompt + right-padded response); got a row "
            "with more than one run (packed sequences are not supported)"
        )
    if checks[1]:
        raise ValueError(
            "prompt_lengths must be >= 1 for every sequence (the first token has no logits "
            f"predicting it), got {prompt_lengths.tolist()}"
        )
    if checks[2]:
        raise ValueError(
            "prompt_lengths must be <= the number of attended tokens of each sequence "
            f"{lengths.tolist()}, got {prompt_lengths.tolist()}"
        )
    if checks[3]:
        raise ValueError(
            f"response_length={response_length} is shorter than the longest response "
            f"{int((end - start).max())}; pass a larger response_length"
        )


def response_alignment(
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike,
    attention_mask: ArrayLike,
    *,
    response_length: int | None = None,
    check_layout: bool = True,
) -> ResponseAlignment:
    r"""Locate the response tokens of a causal-LM batch and the rows that predict them.

    For a causal LM the logits (or final hidden state) at position :math:`j` predict the token
    at position :math:`j + 1`. With :math:`f_b` the first attended position of row :math:`b`,
    :math:`n_b = \sum_j \text{attention\_mask}_{bj}` and :math:`P_b` the prompt length, the
    response occupies positions :math:`j \in [f_b + P_b,\ f_b + n_b)` and response token
    :math:`t` (:math:`j = f_b + P_b + t`) is predicted by row :math:`j - 1`:

    .. math::

        \log \pi(y_{bt}) = \log\mathrm{softmax}(\text{logits}_{b, j-1})[\text{input\_ids}_{bj}].

    Supported layouts (each row's ones in ``attention_mask`` form one contiguous run):
    right padding (``[prompt, response, pad]``), left padding (``[pad, prompt, response]``),
    and the verl/TRL layout of left-padded prompts concatenated with right-padded responses
    (``[pad, prompt, response, pad]``). Packed rows (several runs) are rejected.

    Use the result with logits via :func:`response_log_probs`, or with hidden states by
    gathering the predicting rows first (cheap: ``(B, R, H)``)::

        rows = hidden.gather(1, alignment.positions.unsqueeze(-1).expand(-1, -1, H))
        log_probs = token_log_probs_from_hidden(rows, weight, alignment.tokens)
        log_probs = torch.where(alignment.mask, log_probs, 0.0)

    Args:
        input_ids: ``(B, L)`` integer token ids of the full sequences.
        prompt_lengths: ``(B,)`` integer number of prompt tokens of each row (excluding
            padding), each in ``[1, n_b]``.
        attention_mask: ``(B, L)`` bool or numeric, nonzero = real token.
        response_length: R, the number of response columns of the result (a static int >= 1);
            None uses ``L - 1`` (always enough; trailing columns may be fully masked). Pass the
            generation length to get a tight ``(B, R)``.
        check_layout: check the layout rules above on the host (one device synchronisation,
            skipped while ``torch.compile`` traces). Disable in a hot loop once the data
            pipeline is trusted.

    Returns:
        :class:`ResponseAlignment` ``(positions, tokens, mask)``, each ``(B, R)``.

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``response_length < 1``, and
            (with ``check_layout``) a non-contiguous attention mask, a prompt length outside
            ``[1, n_b]`` or a response longer than ``response_length``.
        TypeError: on non-integer ``input_ids`` or ``prompt_lengths``.

    References:
        The next-token factorisation of causal language models, Radford et al. 2018 (GPT)
        Eq. 1; response-only log-probabilities as used by PPO-RLHF, Ouyang et al. 2022,
        arXiv:2203.02155 Eq. 2.

    Examples:
        >>> import torch
        >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
        >>> a = response_alignment(ids, [2, 1], ids != 0, response_length=3)
        >>> a.positions.tolist(), a.tokens.tolist(), a.mask.tolist()
        ([[1, 0, 0], [0, 1, 2]], [[7, 0, 0], [6, 7, 8]], [[True, False, False], [True, True, True]])

    .. versionadded:: 0.1.0
    """
    ids = as_batch_matrix(_as_index_tensor(input_ids, "input_ids", None), "input_ids")
    device = ids.device
    attention = as_batch_matrix(as_mask(attention_mask, "attention_mask", device), "attention_mask")
    prompts = _as_index_tensor(prompt_lengths, "prompt_lengths", device)
    check_same_device({"input_ids": ids, "attention_mask": attention, "prompt_lengths": prompts})
    batch, length = ids.shape
    if length < 1:
        raise ValueError(f"input_ids must have at least one position, got shape {(batch, length)}")
    check_shape(attention, "attention_mask", (batch, length), "input_ids")
    if prompts.ndim != 1 or prompts.shape[0] != batch:
        raise ValueError(
            f"prompt_lengths must have shape (B,) = ({batch},) from input_ids, got shape "
            f"{tuple(prompts.shape)}"
        )
    if response_length is None:
        response_length = max(length - 1, 1)
    elif isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(
            f"response_length must be an int or None, got {type(response_length).__name__}"
        )
    elif response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {response_length}")
    prompts = prompts.to(torch.int64)
    lengths = attention.sum(-1)  # (B,) n_b
    first = attention.to(torch.int8).argmax(-1)  # (B,) f_b (0 for an empty row)
    start = first + prompts  # (B,) absolute position of the first response token
    end = first + lengths  # (B,) one past the last attended position
    if check_layout and not torch.compiler.is_compiling():
        _check_layout(attention, prompts, lengths, start, end, response_length)
    offsets = torch.arange(response_length, device=device)  # (R,)
    absolute = start.unsqueeze(-1) + offsets  # (B, R) positions j
    mask = (absolute < end.unsqueeze(-1)) & (absolute >= 1)  # (B, R)
    absolute = torch.where(mask, absolute, 1).clamp(max=length - 1)  # (B, R)
    tokens = masked_fill_zero(ids.gather(1, absolute).to(torch.int64), mask)  # (B, R)
    positions = (absolute - 1).clamp(min=0)  # (B, R) rows predicting the response tokens
    return ResponseAlignment(positions=positions, tokens=tokens, mask=mask)


def response_log_probs(
    logits: ArrayLike,
    input_ids: ArrayLike,
    prompt_lengths: ArrayLike,
    attention_mask: ArrayLike,
    *,
    response_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    check_layout: bool = True,
) -> ResponseLogProbs:
    r"""Response-token log-probabilities from full-sequence causal-LM logits, shift included.

    .. math::

        \text{log\_probs}_{bt} = \log\mathrm{softmax}(\text{logits}_{b, j-1} / \tau)
        [\text{input\_ids}_{bj}], \qquad j = f_b + P_b + t,

    for the response tokens located by :func:`response_alignment` (see it for the supported
    padding layouts); 0 elsewhere. The log-softmax runs through :func:`token_log_probs` on the
    full ``(B, L, V)`` logits with non-predicting rows masked out, so no ``(B, R, V)`` copy is
    gathered and the memory stays O(chunk_size * V) besides the logits and their gradient.

    Args:
        logits: ``(B, L, V)`` logits of the full sequences (position ``j`` predicts ``j + 1``).
        input_ids: ``(B, L)`` integer token ids.
        prompt_lengths: ``(B,)`` integer prompt lengths (without padding), each >= 1.
        attention_mask: ``(B, L)`` bool or numeric, nonzero = real token.
        response_length: R (static int), or None for ``L - 1``; see :func:`response_alignment`.
        temperature: :math:`\tau > 0` (the sampling temperature).
        chunk_size: rows per chunk, or None for ``max(1, 2**23 // V)``.
        check_layout: validate the layout on the host (see :func:`response_alignment`).

    Returns:
        :class:`ResponseLogProbs` ``(log_probs, mask)``: ``(B, R)`` float32 log-probabilities
        (float64 for float64 logits) and the ``(B, R)`` bool response mask.

    Raises:
        ValueError: on shapes that do not match ``(B, L, V)`` / ``(B, L)``, and as
            :func:`response_alignment` and :func:`token_log_probs`.
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
    logits_t = _as_logits(logits, "logits")
    if logits_t.ndim != 3:
        raise ValueError(f"logits must have shape (B, L, V), got shape {tuple(logits_t.shape)}")
    ids = as_batch_matrix(_as_index_tensor(input_ids, "input_ids", logits_t.device), "input_ids")
    check_same_device({"logits": logits_t, "input_ids": ids})
    check_shape(ids, "input_ids", tuple(logits_t.shape[:2]), "logits without V")
    alignment = response_alignment(
        ids,
        prompt_lengths,
        attention_mask,
        response_length=response_length,
        check_layout=check_layout,
    )
    batch, length = ids.shape
    # Row k of the logits predicts input_ids[:, k + 1]; only rows that predict a response token
    # are computed. Rows selected: scatter the response mask onto the predicting rows.
    rows = torch.zeros((batch, length), dtype=torch.int64, device=ids.device)  # (B, L)
    rows = rows.scatter_add(1, alignment.positions, alignment.mask.to(torch.int64)) > 0
    targets = torch.nn.functional.pad(ids[:, 1:].to(torch.int64), (0, 1))  # (B, L)
    full = token_log_probs(
        logits_t, targets, mask=rows, temperature=temperature, chunk_size=chunk_size
    )  # (B, L)
    log_probs = masked_fill_zero(full.gather(1, alignment.positions), alignment.mask)  # (B, R)
    return ResponseLogProbs(log_probs=log_probs, mask=alignment.mask)
