r"""Chunked Functions over logits on a vocabulary slice and/or a kept set.

The variants of :mod:`rlobjectives.logprobs.functions` for ``vocab_group=`` (the logits are this
rank's slice of the vocabulary, :mod:`rlobjectives.logprobs.vocab_parallel`) and for the kept
sets of :mod:`rlobjectives.logprobs.truncation`. They keep the same contract (float32/64 chunks,
only per-row statistics saved, recompute in backward, exact gradients in the logits' dtype) and
differ in one point: the row normaliser (and entropy) is no longer the chunk's own softmax but a
per-row statistic of the whole (kept) vocabulary, formed in the forward pass
(:func:`~rlobjectives.logprobs.vocab_parallel.combine_rows`) and saved, so the backward's
:math:`p = e^{x - \ell}` is the global probability on every rank.

Per chunk (forward): the logits are loaded (divided by the temperature, unselected rows zeroed),
the kept set sets the others to ``-inf`` (:func:`~rlobjectives.logprobs.truncation.restrict_`),
and the slice's log-normaliser, entropy and target logit are taken
(:func:`~rlobjectives.logprobs.blocks.slice_stats`). Then one combine over the ranks. A row whose
sampled token is outside the kept set has log-probability ``-inf`` and zero gradient.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .._core.chunking import Block, block_rows, resolve_chunk_size, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import slice_entropy_grad, slice_kl, slice_kl_grads, slice_log_probs_grad, slice_stats
from .functions import backward_rows, load_block, row_layout
from .truncation import Restriction, kept_rows, restrict_
from .vocab_parallel import Shard, combine_rows, sum_over_ranks

__all__ = [
    "RestrictedEntropyFunction",
    "RestrictedKLFunction",
    "RestrictedLogProbsFunction",
    "restricted_chunk_size",
]


def restricted_chunk_size(
    chunk_size: int | None, logits: torch.Tensor, restriction: Restriction | None
) -> int:
    """:func:`resolve_chunk_size`, the same on every rank for the rule over vocabulary slices.

    The top-k/top-p rule over slices runs collectives per chunk, so its default chunk is sized
    by the largest slice rather than this rank's.
    """
    width = logits.shape[-1]
    if restriction is not None and restriction.shard is not None and chunk_size is None:
        kept = restriction.kept
        if kept is not None and kept.rule:
            width = restriction.shard.largest()
    return resolve_chunk_size(chunk_size, row_width=width)


def _layout(
    logits: torch.Tensor, chunk_size: int, restriction: Restriction, *per_row: torch.Tensor
) -> tuple[torch.Tensor, list[Block], list[torch.Tensor]]:
    """The rows and blocks of the chunk loop (:func:`row_layout`).

    With per-chunk collectives (the rule over a slice) the blocks must be the same on every
    rank: ``(b, slice)`` blocks for 3-D logits whatever their strides.
    """
    kept = restriction.kept
    if restriction.shard is not None and kept is not None and kept.rule and logits.ndim == 3:
        blocks = block_rows(logits.shape[:-1], chunk_size, flat=False)
        return logits, blocks, list(per_row)
    return row_layout(logits, chunk_size, *per_row)


def _own_block(
    rows: torch.Tensor, block: Block, selected: torch.Tensor | None, tau: float, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`load_block` as a fresh ``(C, V)`` tensor of ``dtype`` that may be written to."""
    chunk = load_block(rows, block, selected, tau, dtype)
    return chunk.to(dtype, copy=tau == 1.0)


def _restricted_block(
    rows: torch.Tensor,
    block: Block,
    selected: torch.Tensor | None,
    options: tuple[float, torch.dtype, Restriction, tuple[int, ...]],
    thresholds: torch.Tensor | None,
    decide: bool,
) -> torch.Tensor:
    """The chunk's logits after the temperature, with the logits outside the kept set -inf."""
    tau, dtype, restriction, leading = options
    chunk = _own_block(rows, block, selected, tau, dtype)  # (C, V)
    if restriction.kept is not None:
        flat = kept_rows(block, leading)
        restrict_(chunk, restriction.kept, flat, restriction.shard, thresholds, decide=decide)
    return chunk


def _local_tokens(
    tokens: torch.Tensor, shard: Shard | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (tokens, None) if shard is None else shard.local_ids(tokens)


def _thresholds(
    restriction: Restriction, rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    kept = restriction.kept
    if kept is None or not kept.rule:
        return None
    return torch.zeros(rows, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# Log-probabilities of the sampled tokens
# ---------------------------------------------------------------------------------------------


def _log_probs_step(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    owned: torch.Tensor | None,
    active: torch.Tensor,
    masked: bool,
    state: tuple[tuple[float, torch.dtype, Restriction, tuple[int, ...]], torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    options, thresholds = state
    selected = active[block] if masked else None
    chunk = _restricted_block(rows, block, selected, options, thresholds, True)  # (C, V)
    target = chunk.gather(1, tokens[block].unsqueeze(1)).squeeze(1)  # (C,), -inf off the set
    if owned is not None:
        target = masked_fill_zero(target, owned[block])
    log_normalizer, _ = slice_stats(chunk, with_entropy=False)  # (C,)
    return [log_normalizer, target]


def _log_probs_grad_step(
    rows: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor],
    state: tuple[tuple[float, torch.dtype, Restriction, tuple[int, ...]], torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    tokens, owned, active, log_normalizer, grad = saved
    options, thresholds = state
    dtype = options[1]
    upstream = grad[block].to(dtype)  # (C,)
    selected = backward_rows(active[block], upstream)  # (C,)
    chunk = _restricted_block(rows, block, selected, options, thresholds, False)  # (C, V)
    upstream = masked_fill_zero(upstream, selected)
    target_grad = upstream if owned is None else masked_fill_zero(upstream, owned[block])
    lse = masked_fill_zero(log_normalizer[block], selected)  # finite p on zeroed rows
    chunk_grad = slice_log_probs_grad(chunk, tokens[block], upstream, target_grad, lse)
    tau = options[0]
    return [chunk_grad.div_(tau) if tau != 1.0 else chunk_grad]


class RestrictedLogProbsFunction(torch.autograd.Function):
    """``x_y - lse`` over the (kept) vocabulary, the logits one slice of it; chunked, recompute."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V_r) or (B, T, V_r)
        tokens: torch.Tensor,  # leading shape, int64 global ids, 0 at inactive rows
        active: torch.Tensor,  # leading shape, bool
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
        restriction: Restriction,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        local, owned = _local_tokens(tokens, restriction.shard)
        per_row = [local, active] if owned is None else [local, active, owned]
        rows, blocks, flat = _layout(logits, chunk_size, restriction, *per_row)
        tokens_r, active_r = flat[0], flat[1]
        owned_r = None if owned is None else flat[2]
        leading = tuple(active.shape)
        thresholds = _thresholds(restriction, active.numel(), dtype, logits.device)
        options = (temperature, dtype, restriction, leading)
        outputs = [torch.zeros(rows.shape[:-1], dtype=dtype, device=logits.device) for _ in "ab"]
        step = partial(
            _log_probs_step, rows, tokens_r, owned_r, active_r, masked, (options, thresholds)
        )
        run_blocks(blocks, step, outputs)
        totals = combine_rows(
            outputs[0].reshape(-1), None, [outputs[1].reshape(-1)], restriction.shard
        )
        log_normalizer = totals.log_normalizer.reshape(leading)
        target = totals.sums[0].reshape(leading)
        log_probs = target - log_normalizer  # -inf where the token is outside the kept set
        differentiated = active
        if restriction.kept is not None:  # no gradient for a token outside the set
            differentiated = active & (target > -torch.inf)
        ctx.save_for_backward(logits, local, owned, differentiated, log_normalizer, thresholds)
        ctx.options = (temperature, chunk_size, dtype, restriction)
        return masked_fill_zero(log_probs, active) if masked else log_probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, local, owned, active, log_normalizer, thresholds = ctx.saved_tensors
        temperature, chunk_size, dtype, restriction = ctx.options
        per_row = [local, active, log_normalizer, grad] + ([] if owned is None else [owned])
        rows, blocks, flat = _layout(logits, chunk_size, restriction, *per_row)
        owned_r = None if owned is None else flat[4]
        saved = (flat[0], owned_r, flat[1], flat[2], flat[3])
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        options = (temperature, dtype, restriction, tuple(active.shape))
        step = partial(_log_probs_grad_step, rows, saved, (options, thresholds))
        run_blocks(blocks, step, [grad_rows])
        return grad_rows.reshape(logits.shape), None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------


def _entropy_step(
    rows: torch.Tensor,
    active: torch.Tensor,
    masked: bool,
    state: tuple[tuple[float, torch.dtype, Restriction, tuple[int, ...]], torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    options, thresholds = state
    selected = active[block] if masked else None
    chunk = _restricted_block(rows, block, selected, options, thresholds, True)  # (C, V)
    log_normalizer, entropy = slice_stats(chunk, with_entropy=True)
    assert entropy is not None
    return [log_normalizer, entropy]


def _entropy_grad_step(
    rows: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    state: tuple[tuple[float, torch.dtype, Restriction, tuple[int, ...]], torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    active, log_normalizer, entropy, grad = saved
    options, thresholds = state
    upstream = grad[block].to(options[1])  # (C,)
    selected = backward_rows(active[block], upstream)  # (C,)
    chunk = _restricted_block(rows, block, selected, options, thresholds, False)  # (C, V)
    chunk_grad = slice_entropy_grad(
        chunk,
        masked_fill_zero(entropy[block], selected),
        masked_fill_zero(upstream, selected),
        masked_fill_zero(log_normalizer[block], selected),
    )
    tau = options[0]
    return [chunk_grad.div_(tau) if tau != 1.0 else chunk_grad]


class RestrictedEntropyFunction(torch.autograd.Function):
    """Entropy of the softmax over the (kept) vocabulary, the logits one slice of it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        active: torch.Tensor,
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
        restriction: Restriction,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        rows, blocks, (active_r,) = _layout(logits, chunk_size, restriction, active)
        leading = tuple(active.shape)
        thresholds = _thresholds(restriction, active.numel(), dtype, logits.device)
        options = (temperature, dtype, restriction, leading)
        outputs = [torch.zeros(rows.shape[:-1], dtype=dtype, device=logits.device) for _ in "ab"]
        run_blocks(
            blocks, partial(_entropy_step, rows, active_r, masked, (options, thresholds)), outputs
        )
        totals = combine_rows(outputs[0].reshape(-1), outputs[1].reshape(-1), [], restriction.shard)
        assert totals.entropy is not None
        log_normalizer = totals.log_normalizer.reshape(leading)
        entropy = totals.entropy.reshape(leading)
        ctx.save_for_backward(logits, active, log_normalizer, entropy, thresholds)
        ctx.options = (temperature, chunk_size, dtype, restriction)
        return masked_fill_zero(entropy, active) if masked else entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, active, log_normalizer, entropy, thresholds = ctx.saved_tensors
        temperature, chunk_size, dtype, restriction = ctx.options
        rows, blocks, flat = _layout(
            logits, chunk_size, restriction, active, log_normalizer, entropy, grad
        )
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        options = (temperature, dtype, restriction, tuple(active.shape))
        saved = (flat[0], flat[1], flat[2], flat[3])
        step = partial(_entropy_grad_step, rows, saved, (options, thresholds))
        run_blocks(blocks, step, [grad_rows])
        return grad_rows.reshape(logits.shape), None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Full-vocabulary KL over vocabulary slices (no kept set)
# ---------------------------------------------------------------------------------------------


def _kl_normalizer_step(
    pair: tuple[torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    masked: bool,
    options: tuple[float, torch.dtype],
    block: Block,
) -> list[torch.Tensor]:
    tau, dtype = options
    selected = active[block] if masked else None
    chunk = load_block(pair[0], block, selected, tau, dtype).to(dtype)
    ref_chunk = load_block(pair[1], block, selected, tau, dtype).to(dtype)
    return [torch.logsumexp(chunk, dim=1), torch.logsumexp(ref_chunk, dim=1)]


def _kl_step(
    pair: tuple[torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    masked: bool,
    normalizers: tuple[torch.Tensor, torch.Tensor],
    options: tuple[float, torch.dtype],
    block: Block,
) -> list[torch.Tensor]:
    tau, dtype = options
    selected = active[block] if masked else None
    chunk = load_block(pair[0], block, selected, tau, dtype).to(dtype)
    ref_chunk = load_block(pair[1], block, selected, tau, dtype).to(dtype)
    return [slice_kl(chunk, ref_chunk, normalizers[0][block], normalizers[1][block])]


def _kl_grad_step(
    pair: tuple[torch.Tensor, torch.Tensor],
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    needs: tuple[bool, bool],
    options: tuple[float, torch.dtype],
    block: Block,
) -> list[torch.Tensor]:
    active, lse_x, lse_y, kl, grad = saved
    tau, dtype = options
    upstream = grad[block].to(dtype)
    selected = backward_rows(active[block], upstream)
    chunk = load_block(pair[0], block, selected, tau, dtype).to(dtype)
    ref_chunk = load_block(pair[1], block, selected, tau, dtype).to(dtype)
    grads = slice_kl_grads(
        chunk,
        ref_chunk,
        (masked_fill_zero(lse_x[block], selected), masked_fill_zero(lse_y[block], selected)),
        masked_fill_zero(kl[block], selected),
        masked_fill_zero(upstream, selected),
        need_logits=needs[0],
        need_ref=needs[1],
    )
    return [g.div_(tau) for g in grads] if tau != 1.0 else grads


class RestrictedKLFunction(torch.autograd.Function):
    r"""Exact ``KL(softmax(x / tau) || softmax(y / tau))`` per row on vocabulary slices.

    Two passes over the logits: the log-normalisers (combined over the ranks), then this slice's
    terms :math:`p_v (\log p_v - \log q_v)` with them, summed over the ranks: every term is the
    unsharded call's.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        ref_logits: torch.Tensor,
        active: torch.Tensor,
        masked: bool,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
        shard: Shard,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        leading = tuple(active.shape)
        blocks = block_rows(leading, chunk_size, flat=False)  # index both tensors alike
        pair = (logits, ref_logits)
        options = (temperature, dtype)
        stats = [torch.zeros(leading, dtype=dtype, device=logits.device) for _ in "ab"]
        run_blocks(blocks, partial(_kl_normalizer_step, pair, active, masked, options), stats)
        lse_x = combine_rows(stats[0].reshape(-1), None, [], shard).log_normalizer.reshape(leading)
        lse_y = combine_rows(stats[1].reshape(-1), None, [], shard).log_normalizer.reshape(leading)
        kl = torch.zeros(leading, dtype=dtype, device=logits.device)
        step = partial(_kl_step, pair, active, masked, (lse_x, lse_y), options)
        run_blocks(blocks, step, [kl])
        kl = sum_over_ranks(kl, shard)
        kl = masked_fill_zero(kl, active) if masked else kl
        ctx.save_for_backward(logits, ref_logits, active, lse_x, lse_y, kl)
        ctx.options = (temperature, chunk_size, dtype)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, ref_logits, active, lse_x, lse_y, kl = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.options
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        blocks = block_rows(tuple(active.shape), chunk_size, flat=False)
        outputs = [
            torch.empty(logits.shape, dtype=source.dtype, device=source.device)
            for source, need in zip((logits, ref_logits), needs, strict=True)
            if need
        ]
        saved = (active, lse_x, lse_y, kl, grad)
        step = partial(_kl_grad_step, (logits, ref_logits), saved, needs, (temperature, dtype))
        run_blocks(blocks, step, outputs)
        grads = iter(outputs)
        grad_logits = next(grads) if needs[0] else None
        grad_ref = next(grads) if needs[1] else None
        return grad_logits, grad_ref, None, None, None, None, None, None
