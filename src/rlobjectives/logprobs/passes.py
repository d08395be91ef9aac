r"""Forward and backward passes of the LM-head functions, one chunk of rows at a time.

The ``(N, V)`` logits ``hidden @ weight.T + bias`` are never formed whole: each pass runs the
chunk driver of :mod:`rlobjectives._core.chunking` with a per-chunk step, and every chunk works in
the pass's :class:`~rlobjectives.logprobs.head.ChunkBuffers` (see :mod:`rlobjectives.logprobs.head`
for the buffers, the chunk size and the per-chunk helpers). The passes are:

- :func:`log_probs_forward` / :func:`log_probs_backward`: log-probabilities (and entropy) of the
  given tokens; the forward keeps only the per-row log-normaliser (and entropy), the backward
  recomputes each chunk's logits (the Cut Cross-Entropy / Liger ``_ChunkedSelectiveLogProbs``
  pattern), wired to autograd by :class:`LogProbsFromHidden`;
- the fused linear loss (gradients formed in the forward pass, no recompute) lives in
  :mod:`rlobjectives.logprobs.fused_linear` and shares the head's chunk helpers.

All tensors are flat: hidden ``(N, H)``, tokens and masks ``(N,)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from .._core.chunking import Block, block_rows, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import entropy_logit_grads_, entropy_stats_, finite_log_probs_
from .head import (
    ChunkBuffers,
    Grads,
    Head,
    accumulate_grads,
    chunk_scores,
    finish_grads,
    new_buffers,
    new_grads,
    select_rows,
    softmax_,
)
from .truncation import kept_rows, restrict_
from .vocab_parallel import combine_rows

__all__ = [
    "LogProbsFromHidden",
    "Saved",
    "log_probs_backward",
    "log_probs_forward",
]


def _log_probs_step(
    head: Head,
    mask: torch.Tensor | None,
    state: tuple[ChunkBuffers, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    """One chunk: ``[target, lse, (entropy)]`` of its rows (this slice's under a shard)."""
    buffers, thresholds = state
    active = None if mask is None else mask[block]
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active)
    scores = chunk_scores(hidden_chunk, head, buffers)  # (n, V)
    if head.kept is not None:  # the logits outside the kept set become -inf
        flat = kept_rows(block, ())  # unselected (zeroed) rows keep everything: finite softmax
        restrict_(scores, head.kept, flat, head.shard, thresholds, decide=True, active=active)
    owned = None
    if head.shard is not None:
        tokens_chunk, owned = head.shard.local_ids(tokens_chunk)
    target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,), -inf off the set
    if owned is not None:
        target = masked_fill_zero(target, owned)
    if buffers.scratch is not None:
        lse, entropy, _ = entropy_stats_(scores, buffers.scratch)  # (n,) each
        return [target, lse, entropy]
    if head.shard is not None:  # a slice may hold no finite logit in a row: -inf, not NaN
        return [target, torch.logsumexp(scores, dim=1)]
    return [target, softmax_(scores)[1]]


def log_probs_forward(
    head: Head, mask: torch.Tensor | None, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log_probs, log_normalizer, entropy, thresholds)``, each ``(N,)``.

    ``entropy`` is ``(0,)`` without it; ``thresholds`` the kept set's per-row thresholds (the
    top-k/top-p rule), or None. Under vocabulary parallelism the per-row statistics of the
    slices are combined over the ranks after the chunk loop
    (:func:`~rlobjectives.logprobs.vocab_parallel.combine_rows`). A token outside the kept set
    has log-probability ``-inf``.
    """
    rows, device = head.hidden.shape[0], head.hidden.device
    target = torch.zeros(rows, dtype=head.dtype, device=device)
    log_normalizer = torch.zeros(rows, dtype=head.dtype, device=device)
    entropy = torch.zeros(rows if with_entropy else 0, dtype=head.dtype, device=device)
    outputs = [target, log_normalizer, entropy] if with_entropy else [target, log_normalizer]
    blocks = block_rows((rows,), head.chunk_size, flat=True)
    buffers = new_buffers(head, with_entropy=with_entropy)
    thresholds = None
    if head.kept is not None and head.kept.rule:
        thresholds = torch.zeros(rows, dtype=head.dtype, device=device)
    run_blocks(blocks, partial(_log_probs_step, head, mask, (buffers, thresholds)), outputs)
    if head.shard is not None:
        totals = combine_rows(
            log_normalizer, entropy if with_entropy else None, [target], head.shard
        )
        log_normalizer, target = totals.log_normalizer, totals.sums[0]
        entropy = entropy if totals.entropy is None else totals.entropy
    log_probs = target - log_normalizer
    if mask is not None:
        log_probs = masked_fill_zero(log_probs, mask)
        entropy = masked_fill_zero(entropy, mask) if with_entropy else entropy
    return log_probs, log_normalizer, entropy, thresholds


class _Upstream(NamedTuple):
    """Per-row upstream gradients (already divided by the temperature) and the saved stats."""

    log_probs: torch.Tensor  # (N,)
    entropy: torch.Tensor | None  # (N,) or None without entropy
    log_normalizer: torch.Tensor  # (N,)
    entropy_values: torch.Tensor | None  # (N,)


def _log_probs_grad_step(
    head: Head,
    active: torch.Tensor,
    upstream: _Upstream,
    state: tuple[Grads, ChunkBuffers, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    grads, buffers, thresholds = state
    rows = active[block]  # (n,)
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], rows)
    scores = chunk_scores(hidden_chunk, head, buffers)  # (n, V)
    if head.kept is not None:  # the forward pass's set (its thresholds replayed); zeroed rows
        # keep everything, so that the chunk's own softmax below stays finite on them
        flat = kept_rows(block, ())
        restrict_(scores, head.kept, flat, head.shard, thresholds, decide=False, active=rows)
    g_lp = upstream.log_probs[block]  # (n,)
    target_grad = g_lp
    if head.shard is not None:
        tokens_chunk, owned = head.shard.local_ids(tokens_chunk)
        target_grad = masked_fill_zero(g_lp, owned)  # the target's slice adds g 1[v = y]
    log_normalizer = upstream.log_normalizer[block].unsqueeze(1)  # (n, 1)
    if upstream.entropy is None or upstream.entropy_values is None or buffers.scratch is None:
        if head.shard is not None:  # p from the saved normaliser of the whole vocabulary
            grad_scores = scores.sub_(log_normalizer).exp_().mul_(-g_lp.unsqueeze(1))
        else:
            grad_scores = softmax_(scores)[0].mul_(-g_lp.unsqueeze(1))  # -g p, (n, V)
    else:
        # log p, with -inf (banned tokens) made finite so that p * log p = 0 * finite = 0
        log_p = finite_log_probs_(scores.sub_(log_normalizer))
        grad_scores = entropy_logit_grads_(  # -p (g_lp + g_H (log p + H)), (n, V)
            log_p,
            upstream.entropy_values[block],
            (g_lp, upstream.entropy[block]),
            buffers.scratch,
        )
    grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), target_grad.unsqueeze(1))  # g 1[v=y]
    accumulate_grads(grad_scores, hidden_chunk, head, grads, buffers, block)
    return []


class Saved(NamedTuple):
    """What :func:`log_probs_forward` leaves for the backward pass, ``(N,)`` each."""

    log_normalizer: torch.Tensor
    entropy: torch.Tensor  # (0,) without the entropy
    thresholds: torch.Tensor | None  # the kept set's rule thresholds
    in_set: torch.Tensor | None  # whether the token is in the kept set (no gradient if not)


def log_probs_backward(
    head: Head,
    mask: torch.Tensor | None,
    saved: Saved,
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients ``(hidden, weight, bias)`` of ``sum(g_lp * log_probs + g_H * entropy)``.

    Rows whose outputs receive no gradient (or are masked) are zeroed before the products, so
    NaN/inf hidden states there cannot reach ``grad_weight`` through ``0 * NaN``; they are
    recomputed from a zero hidden row, given that row's normaliser so their probabilities stay
    finite and their gradient is exactly 0. A token outside the kept set gets no log-prob
    gradient (its entropy's gradient stays). Under vocabulary parallelism every gradient is
    this rank's: ``grad_weight`` / ``grad_bias`` of its rows and its part of ``grad_hidden``.
    """
    grad_lp = grad_log_probs.to(head.dtype)
    if saved.in_set is not None:
        grad_lp = masked_fill_zero(grad_lp, saved.in_set)
    grad_h = None if grad_entropy is None else grad_entropy.to(head.dtype)
    active = grad_lp != 0 if grad_h is None else (grad_lp != 0) | (grad_h != 0)  # (N,)
    if mask is not None:
        active = active & mask
        grad_lp = masked_fill_zero(grad_lp, mask)
        grad_h = None if grad_h is None else masked_fill_zero(grad_h, mask)
    zero_row = torch.zeros(1, head.hidden.shape[1], dtype=head.hidden.dtype, device=active.device)
    zero_row_lse = torch.logsumexp(chunk_scores(zero_row, head), dim=1)  # (1,)
    upstream = _Upstream(
        log_probs=grad_lp * head.inv_temperature,
        entropy=None if grad_h is None else grad_h * head.inv_temperature,
        log_normalizer=torch.where(active, saved.log_normalizer, zero_row_lse),
        entropy_values=None if grad_h is None else masked_fill_zero(saved.entropy, active),
    )
    buffers = new_buffers(head, with_entropy=grad_h is not None)
    state = (new_grads(head, needs), buffers, saved.thresholds)
    blocks = block_rows((head.hidden.shape[0],), head.chunk_size, flat=True)
    run_blocks(blocks, partial(_log_probs_grad_step, head, active, upstream, state), [])
    return finish_grads(head, state[0])


class LogProbsFromHidden(torch.autograd.Function):
    """Chunked ``log_softmax(h W^T + b)[y]`` (and entropy) with recompute in backward.

    ``hidden``, ``weight`` and ``bias`` are passed both on their own (so autograd sees them) and
    inside ``head``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: Head,
        mask: torch.Tensor | None,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        log_probs, log_normalizer, entropy, thresholds = log_probs_forward(head, mask, with_entropy)
        in_set = None if head.kept is None else log_probs > -torch.inf
        ctx.save_for_backward(
            hidden, weight, bias, head.tokens, mask, log_normalizer, entropy, thresholds, in_set
        )
        ctx.options = (head.inv_temperature, head.chunk_size, head.dtype, with_entropy)
        ctx.restriction = (head.shard, head.kept)
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        hidden, weight, bias, tokens, mask, *stats = ctx.saved_tensors
        inv_temperature, chunk_size, dtype, with_entropy = ctx.options
        head = Head(
            hidden, weight, bias, tokens, inv_temperature, chunk_size, dtype, *ctx.restriction
        )
        rows = hidden.shape[0]
        if grad_log_probs is None:
            grad_log_probs = torch.zeros(rows, dtype=dtype, device=hidden.device)
        if not with_entropy:
            grad_entropy = None
        elif grad_entropy is None:
            grad_entropy = torch.zeros(rows, dtype=dtype, device=hidden.device)
        needs = (
            bool(ctx.needs_input_grad[0]),
            bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]),
        )
        grads = log_probs_backward(head, mask, Saved(*stats), grad_log_probs, grad_entropy, needs)
        return (*grads, None, None, None)
