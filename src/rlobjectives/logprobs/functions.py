r"""Chunked autograd Functions over logits: sampled-token log-probs, entropy, full-vocabulary KL.

Each Function reads the logits one block of rows at a time (:mod:`rlobjectives._core.chunking`),
upcasts that block to float32 (float64 for float64 logits) and keeps only per-row statistics
between the passes; the backward recomputes each block's softmax and writes the exact gradient
into a tensor of the logits' own dtype. The extra memory is O(chunk * V) in both passes.

The per-block math is in :mod:`rlobjectives.logprobs.blocks`; the Functions only wire it to the
chunk driver through per-block step functions.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .._core.chunking import Block, block_rows, flat_rows, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import (
    chunk_entropy,
    chunk_entropy_grad,
    chunk_kl,
    chunk_kl_grads,
    chunk_token_log_probs,
    chunk_token_log_probs_grad,
)

__all__ = [
    "EntropyFunction",
    "FullVocabKLFunction",
    "TokenLogProbsFunction",
    "backward_rows",
    "load_block",
    "row_layout",
]


# ---------------------------------------------------------------------------------------------
# Block loading and the row layout of a chunked call
# ---------------------------------------------------------------------------------------------


def load_block(
    logits: torch.Tensor,
    block: Block,
    active: torch.Tensor | None,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``(C, V)`` rows of ``block``, divided by ``temperature`` (then in ``dtype``).

    With ``active`` (``(C,)`` bool), inactive rows are replaced by zeros with ``torch.where`` on
    the input dtype, before any arithmetic, so NaN/inf there reaches no ``exp``. At temperature
    1 the block keeps the input dtype (the upcast is fused into the softmax of the chunk math).
    The result may alias ``logits``: never modify it in place.
    """
    chunk = logits[block]  # (C, V)
    if active is not None:
        zero = torch.zeros((), dtype=chunk.dtype, device=chunk.device)
        chunk = torch.where(active.unsqueeze(-1), chunk, zero)
    if temperature != 1.0:
        chunk = chunk.to(dtype) / temperature
    return chunk


def backward_rows(active: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Rows whose gradient is computed: selected rows with a nonzero upstream gradient.

    Rows with a zero upstream gradient get an exact zero (instead of ``0 * NaN``), so non-finite
    logits in rows that the caller masks downstream with ``torch.where`` poison nothing.
    """
    return active & (grad != 0)


def row_layout(
    logits: torch.Tensor, chunk_size: int, *per_row: torch.Tensor
) -> tuple[torch.Tensor, list[Block], list[torch.Tensor]]:
    """``(rows, blocks, per_row)``: the logits as ``(N, V)`` when that is a view, else as given.

    ``per_row`` tensors have the leading shape of ``logits``; they are flattened alongside.
    """
    flat = flat_rows(logits)
    if flat is None:  # a strided (B, T, V) view: blocks stay within one row b
        return logits, block_rows(logits.shape[:-1], chunk_size, flat=False), list(per_row)
    blocks = block_rows((flat.shape[0],), chunk_size, flat=True)
    return flat, blocks, [tensor.reshape(-1) for tensor in per_row]


def _empty_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(rows.shape[:-1], dtype=dtype, device=rows.device)


# ---------------------------------------------------------------------------------------------
# Autograd Functions: logits of any layout (N, V) / (B, T, V), per-row active mask
# ---------------------------------------------------------------------------------------------


def _log_probs_step(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    active: torch.Tensor,
    masked: bool,
    temperature: float,
    dtype: torch.dtype,
    block: Block,
) -> list[torch.Tensor]:
    selected = active[block] if masked else None  # (C,)
    chunk = load_block(rows, block, selected, temperature, dtype)  # (C, V)
    log_probs = chunk_token_log_probs(chunk, tokens[block], dtype=dtype)  # (C,)
    return [log_probs if selected is None else masked_fill_zero(log_probs, selected)]


def _log_probs_grad_step(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    active: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    block: Block,
) -> list[torch.Tensor]:
    upstream = grad[block].to(dtype)  # (C,)
    selected = backward_rows(active[block], upstream)  # (C,)
    chunk = load_block(rows, block, selected, temperature, dtype)  # (C, V)
    chunk_grad = chunk_token_log_probs_grad(
        chunk, tokens[block], masked_fill_zero(upstream, selected), dtype=dtype
    )  # (C, V)
    return [chunk_grad.div_(temperature) if temperature != 1.0 else chunk_grad]


class TokenLogProbsFunction(torch.autograd.Function):
    """``log_softmax(logits / tau)[tokens]`` per row, chunked; recompute in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V) or (B, T, V)
        tokens: torch.Tensor,  # leading shape of logits, int64, 0 at inactive rows
        active: torch.Tensor,  # leading shape, bool
        masked: bool,  # False: every row is active (no row selection in the forward pass)
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        rows, blocks, (tokens_r, active_r) = row_layout(logits, chunk_size, tokens, active)
        log_probs = _empty_rows(rows, dtype)  # (N,) or (B, T)
        step = partial(_log_probs_step, rows, tokens_r, active_r, masked, temperature, dtype)
        run_blocks(blocks, step, [log_probs])
        ctx.save_for_backward(logits, tokens, active)
        ctx.options = (temperature, chunk_size, dtype)
        return log_probs.reshape(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, tokens, active = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.options
        rows, blocks, (tokens_r, active_r, grad_r) = row_layout(
            logits, chunk_size, tokens, active, grad
        )
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        step = partial(_log_probs_grad_step, rows, tokens_r, active_r, grad_r, temperature, dtype)
        run_blocks(blocks, step, [grad_rows])
        return grad_rows.reshape(logits.shape), None, None, None, None, None, None


def _entropy_step(
    rows: torch.Tensor,
    active: torch.Tensor,
    masked: bool,
    temperature: float,
    dtype: torch.dtype,
    block: Block,
) -> list[torch.Tensor]:
    selected = active[block] if masked else None  # (C,)
    chunk = load_block(rows, block, selected, temperature, dtype)  # (C, V)
    return [chunk_entropy(chunk, dtype=dtype)]  # (C,), log V at inactive rows


def _entropy_grad_step(
    rows: torch.Tensor,
    active: torch.Tensor,
    entropy: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    block: Block,
) -> list[torch.Tensor]:
    upstream = grad[block].to(dtype)  # (C,)
    selected = backward_rows(active[block], upstream)  # (C,)
    chunk = load_block(rows, block, selected, temperature, dtype)  # (C, V)
    chunk_grad = chunk_entropy_grad(
        chunk,
        masked_fill_zero(entropy[block], selected),
        masked_fill_zero(upstream, selected),
        dtype=dtype,
    )  # (C, V)
    return [chunk_grad.div_(temperature) if temperature != 1.0 else chunk_grad]


class EntropyFunction(torch.autograd.Function):
    """Entropy of ``softmax(logits / tau)`` per row, chunked; recompute in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V) or (B, T, V)
        active: torch.Tensor,  # leading shape, bool
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        rows, blocks, (active_r,) = row_layout(logits, chunk_size, active)
        entropy = _empty_rows(rows, dtype)
        run_blocks(
            blocks, partial(_entropy_step, rows, active_r, masked, temperature, dtype), [entropy]
        )
        entropy = entropy.reshape(active.shape)
        ctx.save_for_backward(logits, active, entropy)
        ctx.options = (temperature, chunk_size, dtype)
        return masked_fill_zero(entropy, active) if masked else entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, active, entropy = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.options
        rows, blocks, (active_r, entropy_r, grad_r) = row_layout(
            logits, chunk_size, active, entropy, grad
        )
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        step = partial(_entropy_grad_step, rows, active_r, entropy_r, grad_r, temperature, dtype)
        run_blocks(blocks, step, [grad_rows])
        return grad_rows.reshape(logits.shape), None, None, None, None, None


def _kl_step(
    rows: torch.Tensor,
    ref_rows: torch.Tensor,
    active: torch.Tensor,
    masked: bool,
    temperature: float,
    dtype: torch.dtype,
    block: Block,
) -> list[torch.Tensor]:
    selected = active[block] if masked else None  # (C,)
    chunk = load_block(rows, block, selected, temperature, dtype)  # (C, V)
    ref_chunk = load_block(ref_rows, block, selected, temperature, dtype)  # (C, V)
    kl = chunk_kl(chunk, ref_chunk, dtype)  # (C,)
    return [kl if selected is None else masked_fill_zero(kl, selected)]


def _kl_grad_step(
    rows: torch.Tensor,
    ref_rows: torch.Tensor,
    active: torch.Tensor,
    kl: torch.Tensor,
    grad: torch.Tensor,
    needs: tuple[bool, bool],
    temperature: float,
    dtype: torch.dtype,
    block: Block,
) -> list[torch.Tensor]:
    upstream = grad[block].to(dtype)  # (C,)
    selected = backward_rows(active[block], upstream)  # (C,)
    chunk = load_block(rows, block, selected, temperature, dtype)  # (C, V)
    ref_chunk = load_block(ref_rows, block, selected, temperature, dtype)  # (C, V)
    grads = chunk_kl_grads(
        chunk,
        ref_chunk,
        masked_fill_zero(kl[block], selected),
        masked_fill_zero(upstream, selected),
        dtype=dtype,
        need_logits=needs[0],
        need_ref=needs[1],
    )
    return [g.div_(temperature) for g in grads] if temperature != 1.0 else grads


class FullVocabKLFunction(torch.autograd.Function):
    """Exact ``KL(softmax(x / tau) || softmax(y / tau))`` per row, chunked."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V) or (B, T, V)
        ref_logits: torch.Tensor,  # same shape
        active: torch.Tensor,  # leading shape, bool
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        rows, blocks, (active_r,) = row_layout(logits, chunk_size, active)
        ref_rows, _, _ = row_layout(ref_logits, chunk_size)
        if ref_rows.ndim != rows.ndim:  # one is a flat view, the other strided: index alike
            rows, ref_rows = logits, ref_logits
            blocks = block_rows(logits.shape[:-1], chunk_size, flat=False)
            active_r = active
        kl = _empty_rows(rows, dtype)
        step = partial(_kl_step, rows, ref_rows, active_r, masked, temperature, dtype)
        run_blocks(blocks, step, [kl])
        kl = kl.reshape(active.shape)
        ctx.save_for_backward(logits, ref_logits, active, kl)
        ctx.options = (temperature, chunk_size, dtype)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, ref_logits, active, kl = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.options
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        rows, blocks, (active_r, kl_r, grad_r) = row_layout(logits, chunk_size, active, kl, grad)
        ref_rows, _, _ = row_layout(ref_logits, chunk_size)
        if ref_rows.ndim != rows.ndim:
            rows, ref_rows, active_r, kl_r, grad_r = logits, ref_logits, active, kl, grad
            blocks = block_rows(logits.shape[:-1], chunk_size, flat=False)
        outputs = [
            torch.empty(rows.shape, dtype=source.dtype, device=source.device)
            for source, need in zip((logits, ref_logits), needs, strict=True)
            if need
        ]
        step = partial(
            _kl_grad_step, rows, ref_rows, active_r, kl_r, grad_r, needs, temperature, dtype
        )
        run_blocks(blocks, step, outputs)
        grads = iter(out.reshape(logits.shape) for out in outputs)
        grad_logits = next(grads) if needs[0] else None
        grad_ref = next(grads) if needs[1] else None
        return grad_logits, grad_ref, None, None, None, None, None
