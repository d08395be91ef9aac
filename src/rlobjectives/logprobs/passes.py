r"""Forward and backward passes of the LM-head functions, one chunk of rows at a time.

The ``(N, V)`` logits ``hidden @ weight.T + bias`` are never computed at once: each pass runs the
chunk driver of :mod:`rlobjectives._core.chunking` with a per-chunk step, and every chunk works in
the pass's :class:`~rlobjectives.logprobs.chunks.ChunkBuffers` (see
:mod:`rlobjectives.logprobs.chunks` for the buffers and the per-chunk helpers,
:mod:`rlobjectives.logprobs.head` for the chunk size). The passes are:

- :func:`log_probs_forward` / :func:`log_probs_backward`: log-probabilities (and the statistics
  of :mod:`rlobjectives.logprobs.statistics`) of the given tokens; the forward keeps the
  per-row log-normaliser (and entropy), wired to autograd by :class:`LogProbsFromHidden`;
- the fused linear loss (gradients formed in the forward pass, no recompute) lives in
  :mod:`rlobjectives.logprobs.fused_linear` and shares the head's chunk helpers.

All tensors are flat: hidden ``(N, H)``, tokens and masks ``(N,)``. The forward keeps the first
chunks' transformed logits for the backward pass (:mod:`rlobjectives.logprobs.saved_logits`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from .._core.chunking import Block, block_rows, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import entropy_logit_grads_, slice_moments_
from .chunks import (
    ChunkBuffers,
    Grads,
    accumulate_grads,
    chain_softcap_,
    chunk_scores,
    finish_grads,
    new_buffers,
    new_grads,
    select_rows,
)
from .head import Head
from .saved_logits import (
    SavedLogits,
    covers,
    is_saved,
    refill,
    saved_logits,
    saved_rows,
    transformed,
    whole_product,
)
from .statistics import Wanted
from .transform import softcap_derivative
from .truncation import kept_rows, restrict_
from .vocab_parallel import combine_statistics

__all__ = ["Forward", "LogProbsFromHidden", "Saved", "log_probs_backward", "log_probs_forward"]


class _ForwardState(NamedTuple):
    buffers: ChunkBuffers
    shifted: torch.Tensor  # (c, V) the rows' s - m, a few at a time (beside buffers.scratch)
    thresholds: torch.Tensor | None
    saved: SavedLogits | None
    wanted: Wanted


def _forward_step(
    head: Head, mask: torch.Tensor | None, state: _ForwardState, block: Block
) -> list[torch.Tensor]:
    """One chunk: ``[target, lse, (entropy), (log_sum_sq), (logit sum), (max, argmax)]``.

    Each of this slice's rows under a shard; the logit sum is taken before the kept set.
    """
    buffers, shifted, thresholds, saved, wanted = state
    active = None if mask is None else mask[block]
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active)
    if is_saved(saved, block):  # the logits are formed in the saved rows themselves: no copy
        assert saved is not None
        buffers = buffers._replace(scores=saved.values[block])
    scores = transformed(hidden_chunk, head, buffers, saved, block)  # (n, V)
    # the logit sum before the kept set: read with the normaliser's blocks without one
    inside = wanted.mean_logits and head.kept is None
    logit_sum = scores.sum(dim=1) if wanted.mean_logits and not inside else None  # (n,)
    if head.kept is not None:  # the logits outside the kept set become -inf
        flat = kept_rows(block, ())  # unselected (zeroed) rows keep everything: finite softmax
        restrict_(scores, head.kept, flat, head.shard, thresholds, decide=True, active=active)
    owned = None
    if head.shard is not None:
        tokens_chunk, owned = head.shard.local_ids(tokens_chunk)
    target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,), -inf off the set
    if owned is not None:
        target = masked_fill_zero(target, owned)
    assert buffers.scratch is not None
    # -inf for a slice without a finite logit in a row, not NaN; scores kept (saved); the
    # first maximal logit with is_top1
    moments = slice_moments_(
        scores,
        buffers.scratch,
        entropy=wanted.entropy,
        squares=wanted.log_sum_sq_probs,
        top=wanted.is_top1,
        sums=inside,
        shifted=shifted,
    )
    if inside:
        logit_sum = moments.logit_sum
    extra = [
        value for value in (moments.entropy, moments.log_sum_sq, logit_sum) if value is not None
    ]
    if moments.maximum is not None and moments.argmax is not None:
        extra += [moments.maximum, moments.argmax]
    return [target, moments.log_normalizer, *extra]


class Forward(NamedTuple):
    """What :func:`log_probs_forward` returns: the outputs and what the backward needs."""

    log_probs: torch.Tensor  # (N,)
    log_normalizer: torch.Tensor  # (N,)
    statistics: dict[str, torch.Tensor]  # name -> (N,), the statistics asked for
    thresholds: torch.Tensor | None  # the kept set's per-row rule thresholds
    saved: SavedLogits | None


def log_probs_forward(
    head: Head,
    mask: torch.Tensor | None,
    wanted: Wanted,
    *,
    save: bool = False,
) -> Forward:
    """The log-probabilities and the statistics ``wanted`` of every row, ``(N,)`` each.

    ``thresholds`` are the kept set's per-row thresholds (the rule), or None; ``save`` keeps
    the first chunks' logits for the backward pass (module docstring). Under vocabulary
    parallelism the per-row statistics of the slices are combined over the ranks after the
    chunk loop (:func:`~rlobjectives.logprobs.vocab_parallel.combine_rows`). A token outside
    the kept set has log-probability ``-inf``.
    """
    rows, device, dtype = head.hidden.shape[0], head.hidden.device, head.dtype

    def column(kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(rows, dtype=kind, device=device)

    outputs = [column(), column()]  # target, lse
    outputs += [column() for flag in (wanted.entropy, wanted.log_sum_sq_probs) if flag]
    outputs += [column()] if wanted.mean_logits else []
    outputs += [column(), column(torch.int64)] if wanted.is_top1 else []
    blocks = block_rows((rows,), head.chunk_size, flat=True)
    thresholds = None
    if head.kept is not None and head.kept.rule:
        thresholds = torch.zeros(rows, dtype=dtype, device=device)
    # the scratch rows of slice_moments_; no softcap derivative (the backward's)
    saved = saved_logits(head) if save else None
    buffers = new_buffers(head, with_entropy=True, scores=not covers(saved, head), derivative=False)
    assert buffers.scratch is not None
    if saved is not None:
        whole_product(head, mask, buffers, saved)
    shifted = torch.empty_like(buffers.scratch)
    state = _ForwardState(buffers, shifted, thresholds, saved, wanted)
    run_blocks(blocks, partial(_forward_step, head, mask, state), outputs)
    log_normalizer, target, statistics = combine_statistics(
        outputs, wanted, head.shard, head.weight.shape[0], head.tokens
    )
    log_probs = target - log_normalizer
    if mask is not None:
        log_probs = masked_fill_zero(log_probs, mask)
        statistics = {name: masked_fill_zero(value, mask) for name, value in statistics.items()}
    return Forward(log_probs, log_normalizer, statistics, thresholds, saved)


class _Upstream(NamedTuple):
    r"""Per-row upstream gradients (times :math:`s/\tau`) and the saved statistics."""

    log_probs: torch.Tensor  # (N,)
    entropy: torch.Tensor | None  # (N,) or None without entropy
    log_normalizer: torch.Tensor  # (N,)
    entropy_values: torch.Tensor | None  # (N,)


class _BackwardState(NamedTuple):
    grads: Grads
    buffers: ChunkBuffers
    thresholds: torch.Tensor | None
    saved: SavedLogits | None


_SAME_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_rows_(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``scores`` ``(n, V)`` with the rows outside ``rows`` ``(n,)`` set to +0, in place.

    A selection, not a product (a NaN or inf there becomes 0, the other rows keep every bit):
    the values' bits AND all-ones (kept rows) or zero (the others). On one CPU thread
    ``torch.where`` and ``masked_fill_`` with the ``(n, 1)`` condition took 4x and 6x as long.
    """
    bits = _SAME_WIDTH[scores.element_size()]
    keep = torch.where(rows, -1, 0).to(bits).unsqueeze(1)  # (n, 1) all ones or zeros
    scores.view(bits).bitwise_and_(keep)
    return scores


def _chunk_logits(
    head: Head, active: torch.Tensor, state: _BackwardState, block: Block
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_chunk, tokens_chunk, scores)`` of a backward chunk, inactive rows zero.

    A saved chunk is the forward's logits themselves (the gradient is then formed in place
    there); the others are recomputed (product, transform, the forward's kept set replayed).
    Inactive rows are then set to 0 (a NaN they held reaches no gradient). With a softcap
    :math:`1 - t^2` is in ``buffers.derivative``.
    """
    rows = active[block]  # (n,)
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], rows)
    buffers, saved = state.buffers, state.saved
    if is_saved(saved, block):
        assert saved is not None
        scores = _zero_rows_(saved.values[block], rows)  # (n, V)
        if buffers.derivative is not None:
            softcap_derivative(scores, head.transform, block[0], buffers.derivative)
        return hidden_chunk, tokens_chunk, scores
    scores = chunk_scores(hidden_chunk, head, buffers, block[0])  # (n, V)
    if head.kept is not None:  # the forward pass's set (its thresholds replayed)
        flat = kept_rows(block, ())
        restrict_(scores, head.kept, flat, head.shard, state.thresholds, decide=False, active=rows)
    return hidden_chunk, tokens_chunk, _zero_rows_(scores, rows)


def _backward_step(
    head: Head, active: torch.Tensor, upstream: _Upstream, state: _BackwardState, block: Block
) -> list[torch.Tensor]:
    hidden_chunk, tokens_chunk, scores = _chunk_logits(head, active, state, block)
    buffers = state.buffers
    g_lp = upstream.log_probs[block]  # (n,)
    target_grad = g_lp
    if head.shard is not None:
        tokens_chunk, owned = head.shard.local_ids(tokens_chunk)
        target_grad = masked_fill_zero(g_lp, owned)  # the target's slice adds g 1[v = y]
    log_normalizer = upstream.log_normalizer[block].unsqueeze(1)  # (n, 1)
    if upstream.entropy is None or upstream.entropy_values is None or buffers.scratch is None:
        # p from the forward's normaliser (of the whole vocabulary under a shard): -g p, (n, V)
        grad_scores = scores.sub_(log_normalizer).exp_().mul_(-g_lp.unsqueeze(1))
    else:
        # log p, -inf at banned tokens (made finite there, so that p * log p = 0 * finite = 0)
        log_p = scores.sub_(log_normalizer)
        grad_scores = entropy_logit_grads_(  # -p (g_lp + g_H (log p + H)), (n, V)
            log_p,
            upstream.entropy_values[block],
            (g_lp, upstream.entropy[block]),
            buffers.scratch,
        )
    grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), target_grad.unsqueeze(1))  # g 1[v=y]
    chain_softcap_(grad_scores, buffers)
    if not (is_saved(state.saved, block) and state.saved is not None and state.saved.whole):
        accumulate_grads(grad_scores, hidden_chunk, head, state.grads, buffers, block)
    return []  # the saved rows' products at once, after the chunks (log_probs_backward)


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
    grads_in: tuple[torch.Tensor, torch.Tensor | None],
    needs: tuple[bool, bool, bool],
    logits: SavedLogits | None = None,
) -> tuple[torch.Tensor | None, ...]:
    r"""Gradients ``(hidden, weight, bias)`` of ``sum(g_lp * log_probs + g_H * entropy)``.

    ``grads_in`` is ``(g_lp, g_H)`` (``g_H`` None without the entropy's gradient). Rows whose
    outputs receive no gradient (or are masked) are zeroed before the products, so NaN/inf
    hidden states there cannot reach ``grad_weight`` through ``0 * NaN``; their logits are set
    to 0 and their normaliser to :math:`\log V` (finite probabilities, an exact 0 gradient). A
    token outside the kept set gets no log-prob gradient (its entropy's gradient stays). Under
    vocabulary parallelism every gradient is this rank's: ``grad_weight`` / ``grad_bias`` of its
    rows and its part of ``grad_hidden``. ``logits``: the chunks saved by the forward pass
    (consumed: the gradient is formed in their place).
    """
    grad_log_probs, grad_entropy = grads_in
    grad_lp = grad_log_probs.to(head.dtype)
    if saved.in_set is not None:
        grad_lp = masked_fill_zero(grad_lp, saved.in_set)
    grad_h = None if grad_entropy is None else grad_entropy.to(head.dtype)
    active = grad_lp != 0 if grad_h is None else (grad_lp != 0) | (grad_h != 0)  # (N,)
    if mask is not None:
        active = active & mask
        grad_lp = masked_fill_zero(grad_lp, mask)
        grad_h = None if grad_h is None else masked_fill_zero(grad_h, mask)
    factor = head.transform.row_factor(slice(None))  # s / tau, per row or one number
    uniform = torch.full_like(saved.log_normalizer, float(head.weight.shape[0])).log()
    upstream = _Upstream(
        log_probs=grad_lp * factor,
        entropy=None if grad_h is None else grad_h * factor,
        log_normalizer=torch.where(active, saved.log_normalizer, uniform),
        entropy_values=None if grad_h is None else masked_fill_zero(saved.entropy, active),
    )
    buffers = new_buffers(head, with_entropy=grad_h is not None, scores=not covers(logits, head))
    # all the rows saved and their products formed at once: the accumulators are written once
    alone = logits is not None and logits.whole and logits.rows == head.hidden.shape[0]
    grads = new_grads(head, needs, zeroed=not alone)
    state = _BackwardState(grads, buffers, saved.thresholds, logits)
    blocks = block_rows((head.hidden.shape[0],), head.chunk_size, flat=True)
    run_blocks(blocks, partial(_backward_step, head, active, upstream, state), [])
    if logits is not None and logits.whole:  # the saved rows' gradient products, one GEMM each
        region = (slice(0, logits.rows),)
        hidden = saved_rows(head, active, logits.rows)
        accumulate_grads(logits.values, hidden, head, grads, buffers, region, first=alone)
    return finish_grads(head, state.grads)


class LogProbsFromHidden(torch.autograd.Function):
    r"""Chunked ``log_softmax(x)[y]`` and its statistics; saved or recomputed logits in backward.

    :math:`x = \mathrm{cap}_c(s(h W^T + b))/\tau`; the logits are saved within
    :data:`~rlobjectives.logprobs.saved_logits.SAVED_LOGITS`, recomputed beyond.

    ``hidden``, ``weight`` and ``bias`` are passed both on their own (so autograd sees them) and
    inside ``head``. ``wanted``: the statistics (a bool: the entropy alone, or not). Returns
    ``(log_probs, entropy, *others)``: the entropy ``(N,)`` or ``(0,)`` when not asked for, then
    the other statistics of ``wanted`` in :data:`STATISTICS` order (not differentiable).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: Head,
        mask: torch.Tensor | None,
        wanted: Wanted | bool,
    ) -> tuple[torch.Tensor, ...]:
        """The forward pass (see the class docstring)."""
        if not isinstance(wanted, Wanted):
            wanted = Wanted(entropy=wanted)
        save = any(bool(flag) for flag in ctx.needs_input_grad[:3])
        out = log_probs_forward(head, mask, wanted, save=save)
        in_set = None if head.kept is None else out.log_probs > -torch.inf
        entropy = out.statistics.get("entropy", out.log_probs.new_empty(0))
        ctx.save_for_backward(
            hidden, weight, bias, head.tokens, mask, out.log_normalizer, entropy, out.thresholds,
            in_set,
        )  # fmt: skip
        ctx.head = head
        ctx.logits = out.saved
        ctx.saves = out.saved is not None
        ctx.with_entropy = wanted.entropy
        others = [out.statistics[name] for name in ("log_sum_sq_probs", "mean_logits", "is_top1")
                  if name in out.statistics]  # fmt: skip
        ctx.mark_non_differentiable(*others)
        return (out.log_probs, entropy, *others)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: Any
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        hidden, weight, bias, tokens, mask, *stats = ctx.saved_tensors
        head = ctx.head._replace(hidden=hidden, weight=weight, bias=bias, tokens=tokens)
        rows = hidden.shape[0]
        if grad_log_probs is None:
            grad_log_probs = torch.zeros(rows, dtype=head.dtype, device=hidden.device)
        if not ctx.with_entropy:
            grad_entropy = None
        elif grad_entropy is None:
            grad_entropy = torch.zeros(rows, dtype=head.dtype, device=hidden.device)
        needs = (
            bool(ctx.needs_input_grad[0]),
            bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]),
        )
        logits, ctx.logits = ctx.logits, None  # consumed by the gradient formed in place
        if logits is None and ctx.saves:  # a second backward: the same logits again
            logits = refill(head, mask, stats[2])
        grads = log_probs_backward(
            head, mask, Saved(*stats), (grad_log_probs, grad_entropy), needs, logits
        )
        return (*grads, None, None, None)
