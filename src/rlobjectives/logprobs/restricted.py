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
sampled token is outside the kept set has log-probability ``-inf`` and zero gradient. The
full-vocabulary KL over vocabulary slices is
:class:`~rlobjectives.logprobs.divergence.RestrictedKLFunction`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from .._core.chunking import Block, block_rows, resolve_chunk_size, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import slice_entropy_grad, slice_grads_, slice_log_probs_grad, slice_stats
from .functions import backward_rows, load_block, row_layout
from .statistics import Wanted
from .transform import LogitTransform, apply_transform_, softcap_derivative
from .truncation import Restriction, kept_rows, restrict_
from .vocab_parallel import Shard, combine_rows, combine_statistics

__all__ = [
    "LogitsCall",
    "RestrictedEntropyFunction",
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


class LogitsCall(NamedTuple):
    """The per-call options of a chunk loop over logits (the loop's row layout)."""

    transform: LogitTransform  # a per-token temperature laid out like the loop's rows
    dtype: torch.dtype
    restriction: Restriction
    leading: tuple[int, ...]  # the leading shape of the call (the kept set's rows)
    wanted: Wanted = Wanted()


def _laid_out(transform: LogitTransform, per_row: list[torch.Tensor]) -> LogitTransform:
    """The transform with its per-token temperature taken from the last laid-out tensor."""
    return transform._replace(inverse=per_row[-1]) if transform.per_row else transform


def _transformed_block(
    rows: torch.Tensor,
    block: Block,
    selected: torch.Tensor | None,
    call: LogitsCall,
    with_derivative: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, 1 - t^2)``: the chunk's transformed logits and the softcap's derivative.

    ``x`` a fresh ``(C, V)`` tensor of the computation dtype (unselected rows zeroed first); the
    derivative None without a softcap or ``with_derivative`` (a forward pass needs none).
    """
    chunk = load_block(rows, block, selected, 1.0, call.dtype)  # may alias the logits
    scores = chunk.to(call.dtype, copy=True)
    apply_transform_(scores, call.transform, block)
    if call.transform.softcap is None or not with_derivative:
        return scores, None
    return scores, softcap_derivative(scores, call.transform, block, torch.empty_like(scores))


def _restrict(
    chunk: torch.Tensor,
    block: Block,
    call: LogitsCall,
    thresholds: torch.Tensor | None,
    decide: bool,
) -> torch.Tensor:
    """The logits outside the kept set set to ``-inf`` (in place)."""
    restriction = call.restriction
    if restriction.kept is not None:
        flat = kept_rows(block, call.leading)
        restrict_(chunk, restriction.kept, flat, restriction.shard, thresholds, decide=decide)
    return chunk


def _restricted_block(
    rows: torch.Tensor,
    block: Block,
    selected: torch.Tensor | None,
    call: LogitsCall,
    thresholds: torch.Tensor | None,
    decide: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, 1 - t^2)``, the logits outside the kept set ``-inf``.

    ``decide``: a forward pass, which decides the kept set's rule and needs no derivative.
    """
    chunk, derivative = _transformed_block(rows, block, selected, call, not decide)
    return _restrict(chunk, block, call, thresholds, decide), derivative


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


def _scaled_upstream(
    grad: torch.Tensor, call: LogitsCall, block: Block, selected: torch.Tensor
) -> torch.Tensor:
    r"""The upstream gradient of the chunk times :math:`s/\tau`, 0 at unselected rows."""
    upstream = masked_fill_zero(grad[block].to(call.dtype), selected)
    factor = call.transform.row_factor(block)
    if isinstance(factor, torch.Tensor):
        return upstream * factor.to(call.dtype)
    return upstream * factor if factor != 1.0 else upstream


# ---------------------------------------------------------------------------------------------
# Log-probabilities of the sampled tokens, and their statistics
# ---------------------------------------------------------------------------------------------


def _log_probs_step(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    owned: torch.Tensor | None,
    active: torch.Tensor,
    masked: bool,
    state: tuple[LogitsCall, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    """``[target, lse, (entropy), (log_sum_sq), (logit sum), (max, argmax)]`` of the chunk."""
    call, thresholds = state
    wanted = call.wanted
    selected = active[block] if masked else None
    chunk, _ = _transformed_block(rows, block, selected, call, False)  # (C, V)
    logit_sum = chunk.sum(dim=1) if wanted.mean_logits else None  # before the kept set
    chunk = _restrict(chunk, block, call, thresholds, True)
    target = chunk.gather(1, tokens[block].unsqueeze(1)).squeeze(1)  # (C,), -inf off the set
    if owned is not None:
        target = masked_fill_zero(target, owned[block])
    log_normalizer, entropy, log_sum_sq = slice_stats(
        chunk, with_entropy=wanted.entropy, with_squares=wanted.log_sum_sq_probs
    )
    out = [target, log_normalizer]
    out += [value for value in (entropy, log_sum_sq, logit_sum) if value is not None]
    if wanted.is_top1:
        top = chunk.max(dim=1)  # the first maximal logit
        out += [top.values, top.indices]
    return out


def _log_probs_grad_step(
    rows: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, torch.Tensor | None],
    state: tuple[LogitsCall, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    tokens, owned, active, log_normalizer, entropy = saved
    call, thresholds = state
    grad_lp, grad_h = grads
    nonzero = grad_lp[block] != 0
    if grad_h is not None:
        nonzero = nonzero | (grad_h[block] != 0)
    selected = active[block] & nonzero  # (C,) rows with a gradient
    chunk, derivative = _restricted_block(rows, block, selected, call, thresholds, False)
    upstream = _scaled_upstream(grad_lp, call, block, selected)
    target_grad = upstream if owned.numel() == 0 else masked_fill_zero(upstream, owned[block])
    lse = masked_fill_zero(log_normalizer[block], selected)  # finite p on zeroed rows
    if grad_h is None:
        chunk_grad = slice_log_probs_grad(chunk, tokens[block], upstream, target_grad, lse)
    else:
        weights = (upstream, _scaled_upstream(grad_h, call, block, selected))
        values = masked_fill_zero(entropy[block], selected)
        chunk_grad = slice_grads_(chunk, tokens[block], weights, target_grad, (lse, values))
    return [chunk_grad if derivative is None else chunk_grad.mul_(derivative)]


class RestrictedLogProbsFunction(torch.autograd.Function):
    """``x_y - lse`` over the (kept) vocabulary, the logits one slice of it; chunked, recompute.

    :math:`x` the transformed logits (scale, softcap, temperature). Returns ``(log_probs,
    entropy, *others)``: the entropy ``(0,)`` unless asked for, then the other statistics of
    the call's ``wanted`` in :data:`~rlobjectives.logprobs.statistics.STATISTICS` order (not
    differentiable).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,  # (N, V_r) or (B, T, V_r)
        tokens: torch.Tensor,  # leading shape, int64 global ids, 0 at inactive rows
        active: torch.Tensor,  # leading shape, bool
        masked: bool,
        call: LogitsCall,
        chunk_size: int,
    ) -> tuple[torch.Tensor, ...]:
        """The forward pass (see the class docstring)."""
        restriction, dtype, wanted = call.restriction, call.dtype, call.wanted
        local, owned = _local_tokens(tokens, restriction.shard)
        per_row = [local, active] if owned is None else [local, active, owned]
        per_row += [call.transform.inverse] if call.transform.per_row else []  # type: ignore[list-item]
        rows, blocks, flat = _layout(logits, chunk_size, restriction, *per_row)
        tokens_r, active_r = flat[0], flat[1]
        owned_r = None if owned is None else flat[2]
        leading = tuple(active.shape)
        thresholds = _thresholds(restriction, active.numel(), dtype, logits.device)
        laid = call._replace(transform=_laid_out(call.transform, flat), leading=leading)
        count = 2 + wanted.entropy + wanted.log_sum_sq_probs + wanted.mean_logits
        outputs = [torch.zeros(rows.shape[:-1], dtype=dtype, device=logits.device)
                   for _ in range(count)]  # fmt: skip
        if wanted.is_top1:  # the maximum and its first index
            outputs += [torch.zeros(rows.shape[:-1], dtype=kind, device=logits.device)
                        for kind in (dtype, torch.int64)]  # fmt: skip
        step = partial(
            _log_probs_step, rows, tokens_r, owned_r, active_r, masked, (laid, thresholds)
        )
        run_blocks(blocks, step, outputs)
        log_normalizer, target, statistics = combine_statistics(
            (output.reshape(-1) for output in outputs), wanted, restriction.shard,
            logits.shape[-1], tokens.reshape(-1),
        )  # fmt: skip
        log_normalizer, target = log_normalizer.reshape(leading), target.reshape(leading)
        log_probs = target - log_normalizer  # -inf where the token is outside the kept set
        in_set = target > -torch.inf  # no log-prob gradient for a token outside the kept set
        others = [
            statistics[name].reshape(leading)
            for name in ("log_sum_sq_probs", "mean_logits", "is_top1")
            if name in statistics
        ]
        entropy = statistics.get("entropy")
        entropy_out = log_probs.new_zeros(0) if entropy is None else entropy.reshape(leading)
        ctx.save_for_backward(
            logits, local, owned if owned is not None else local.new_zeros(0, dtype=torch.bool),
            active, in_set, log_normalizer, entropy_out,
            thresholds, *([call.transform.inverse] if call.transform.per_row else []),  # type: ignore[list-item]
        )  # fmt: skip
        ctx.options = (call._replace(leading=leading), chunk_size)
        if masked:
            log_probs = masked_fill_zero(log_probs, active)
            if wanted.entropy:
                entropy_out = masked_fill_zero(entropy_out, active)
            others = [masked_fill_zero(value, active) for value in others]
        ctx.mark_non_differentiable(*others)
        return (log_probs, entropy_out, *others)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: Any
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, local, owned, active, in_set, log_normalizer, entropy, thresholds, *inverse = (
            ctx.saved_tensors
        )
        call, chunk_size = ctx.options
        if grad is None:
            grad = torch.zeros_like(log_normalizer)
        grad = masked_fill_zero(grad, in_set)  # the entropy's gradient stays
        if not call.wanted.entropy or grad_entropy is None or grad_entropy.numel() == 0:
            grad_entropy = None
        per_row = [local, active, log_normalizer, grad]
        per_row += [grad_entropy, entropy] if grad_entropy is not None else []
        per_row += [owned] if owned.numel() else []
        per_row += inverse
        rows, blocks, flat = _layout(logits, chunk_size, call.restriction, *per_row)
        laid = call._replace(transform=_laid_out(call.transform, flat))
        values = iter(flat)
        local_r, active_r, lse_r, grad_r = next(values), next(values), next(values), next(values)
        grad_h_r, entropy_r = (next(values), next(values)) if grad_entropy is not None else (
            None, lse_r)  # fmt: skip
        owned_r = next(values) if owned.numel() else owned
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        saved = (local_r, owned_r, active_r, lse_r, entropy_r)
        step = partial(_log_probs_grad_step, rows, saved, (grad_r, grad_h_r), (laid, thresholds))
        run_blocks(blocks, step, [grad_rows])
        return grad_rows.reshape(logits.shape), None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------


def _entropy_step(
    rows: torch.Tensor,
    active: torch.Tensor,
    masked: bool,
    state: tuple[LogitsCall, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    call, thresholds = state
    selected = active[block] if masked else None
    chunk, _ = _restricted_block(rows, block, selected, call, thresholds, True)  # (C, V)
    log_normalizer, entropy, _ = slice_stats(chunk, with_entropy=True)
    assert entropy is not None
    return [log_normalizer, entropy]


def _entropy_grad_step(
    rows: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    state: tuple[LogitsCall, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    active, log_normalizer, entropy, grad = saved
    call, thresholds = state
    upstream = grad[block].to(call.dtype)  # (C,)
    selected = backward_rows(active[block], upstream)  # (C,)
    chunk, derivative = _restricted_block(rows, block, selected, call, thresholds, False)
    chunk_grad = slice_entropy_grad(
        chunk,
        masked_fill_zero(entropy[block], selected),
        _scaled_upstream(grad, call, block, selected),
        masked_fill_zero(log_normalizer[block], selected),
    )
    return [chunk_grad if derivative is None else chunk_grad.mul_(derivative)]


class RestrictedEntropyFunction(torch.autograd.Function):
    """Entropy of the softmax over the (kept) vocabulary of the transformed logits.

    The logits may be one slice of the vocabulary.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        active: torch.Tensor,
        masked: bool,
        call: LogitsCall,
        chunk_size: int,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        restriction, dtype = call.restriction, call.dtype
        inverse = [call.transform.inverse] if call.transform.per_row else []
        rows, blocks, flat = _layout(logits, chunk_size, restriction, active, *inverse)  # type: ignore[arg-type]
        active_r = flat[0]
        leading = tuple(active.shape)
        thresholds = _thresholds(restriction, active.numel(), dtype, logits.device)
        laid = call._replace(transform=_laid_out(call.transform, flat), leading=leading)
        outputs = [torch.zeros(rows.shape[:-1], dtype=dtype, device=logits.device) for _ in "ab"]
        run_blocks(
            blocks, partial(_entropy_step, rows, active_r, masked, (laid, thresholds)), outputs
        )
        totals = combine_rows(outputs[0].reshape(-1), outputs[1].reshape(-1), [], restriction.shard)
        assert totals.entropy is not None
        log_normalizer = totals.log_normalizer.reshape(leading)
        entropy = totals.entropy.reshape(leading)
        ctx.save_for_backward(logits, active, log_normalizer, entropy, thresholds, *inverse)  # type: ignore[arg-type]
        ctx.options = (call._replace(leading=leading), chunk_size)
        return masked_fill_zero(entropy, active) if masked else entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, active, log_normalizer, entropy, thresholds, *inverse = ctx.saved_tensors
        call, chunk_size = ctx.options
        rows, blocks, flat = _layout(
            logits, chunk_size, call.restriction, active, log_normalizer, entropy, grad, *inverse
        )
        laid = call._replace(transform=_laid_out(call.transform, flat))
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        saved = (flat[0], flat[1], flat[2], flat[3])
        step = partial(_entropy_grad_step, rows, saved, (laid, thresholds))
        run_blocks(blocks, step, [grad_rows])
        return grad_rows.reshape(logits.shape), None, None, None, None
