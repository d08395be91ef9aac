r"""The fused linear loss: the LM head's gradients formed in the forward chunk loop.

For a loss whose derivative with respect to each token's log-probability, :math:`c_n =
\partial\mathcal{L}/\partial\ell_n`, is known per token once the chunk's log-probabilities are
(:class:`CoefficientFn`), and optionally an entropy term with a known per-token weight
:math:`g_n = \partial\mathcal{L}/\partial H_n`, each chunk of rows forms

.. math::

    \frac{\partial\mathcal{L}}{\partial z_{nv}} = \frac{\partial x_{nv}}{\partial z_{nv}}
        \Big(c_n(\mathbb{1}[v = y_n] - p_{nv}) - g_n\, p_{nv}(\log p_{nv} + H_n)\Big)

(:math:`\partial x / \partial z` the logit transform's, :math:`s(1 - t^2)/\tau` with a softcap,
:math:`s/\tau` without: :mod:`rlobjectives.logprobs.transform`) and its products with the
weight and the hidden rows right away: the fused-linear-cross-entropy technique (Liger-Kernel,
Cut Cross-Entropy), with no recompute in backward.
:class:`FusedLinearLoss` wires it to autograd through a zero-valued anchor. One
``(chunk, V)`` buffer of logits is alive, reused by every chunk (:class:`ChunkBuffers`; the
entropy term adds a few rows of scratch).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Protocol

import torch

from .._core.chunking import Block, block_rows, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import entropy_logit_grads_, entropy_stats_
from .chunks import (
    ChunkBuffers,
    Grads,
    accumulate_grads,
    chain_softcap_,
    chunk_scores,
    new_buffers,
    new_grads,
    select_rows,
    softmax_,
)
from .head import Head
from .truncation import kept_rows, restrict_

__all__ = ["CoefficientFn", "FusedLinearLoss", "FusedTerms", "fused_linear_forward"]


class CoefficientFn(Protocol):
    """``dL/d log_probs`` of the rows of ``block`` from their log-probabilities ``(n,)``."""

    def __call__(self, log_probs: torch.Tensor, block: Block) -> torch.Tensor:
        """The ``(n,)`` derivatives of the chunk ``block``."""
        ...


class FusedTerms(NamedTuple):
    """The loss's per-token derivatives: a function for the log-probs, weights for the entropy."""

    mask: torch.Tensor  # (N,) bool
    coefficient: CoefficientFn  # dL / d log_probs of a chunk
    entropy_weights: torch.Tensor | None  # (N,) dL / dH (zero at unselected rows), or None


class _ChunkGradient(NamedTuple):
    """One chunk's ``dL/dlogits`` (without its ``c 1[v = y]`` term) and per-row values."""

    grad_scores: torch.Tensor  # (n, V), in the chunk's scores buffer
    row_coefficient: torch.Tensor  # (n,) c / tau
    log_probs: torch.Tensor  # (n,), 0 at masked rows
    entropy: torch.Tensor | None  # (n,) with the entropy term


def _row_coefficient(
    terms: FusedTerms,
    log_probs: torch.Tensor,
    block: Block,
    factor: float | torch.Tensor,
    kept: bool,
) -> torch.Tensor:
    """``c s / tau`` of the chunk's rows; 0 for a token outside the kept set (``-inf`` log-prob)."""
    coefficient = terms.coefficient(log_probs, block) * factor  # (n,)
    if kept:  # no gradient through a token the sampler could not have drawn (where, not *)
        coefficient = masked_fill_zero(coefficient, log_probs > -torch.inf)
    return coefficient


def _logit_grads(
    scores: torch.Tensor,
    target: torch.Tensor,
    terms: FusedTerms,
    scratch: torch.Tensor | None,
    options: tuple[float | torch.Tensor, bool],
    block: Block,
) -> _ChunkGradient:
    """``-(c p + g p (log p + H)) s / tau`` in place of ``scores`` ``(n, V)``; ``target`` ``(n,)``.

    ``c = dL/dlog_prob`` and ``g = dL/dH`` (0 at masked tokens); one ``(n, V)`` buffer
    (``scores``), plus a few rows of ``scratch`` for the entropy term. ``options``: ``(s / tau
    of the rows, whether a kept set restricted the scores)``.
    """
    factor, kept = options
    active = terms.mask[block]  # (n,)
    if terms.entropy_weights is None or scratch is None:
        probs, lse = softmax_(scores)  # (n, V), (n,)
        log_probs = masked_fill_zero(target - lse, active)  # (n,)
        row_coefficient = _row_coefficient(terms, log_probs, block, factor, kept)
        grad_scores = probs.mul_((-row_coefficient).unsqueeze(1))  # -c p / tau
        return _ChunkGradient(grad_scores, row_coefficient, log_probs, None)
    lse, entropy, log_total = entropy_stats_(scores, scratch)  # scores becomes s - max
    log_probs = masked_fill_zero(target - lse, active)  # (n,)
    row_coefficient = _row_coefficient(terms, log_probs, block, factor, kept)
    entropy_weight = terms.entropy_weights[block] * factor  # (n,)
    log_p = scores.sub_(log_total)  # (n, V), -inf at banned tokens
    grad_scores = entropy_logit_grads_(
        log_p, entropy, (row_coefficient, entropy_weight), scratch
    )  # -p (c + g (log p + H)) / tau
    return _ChunkGradient(grad_scores, row_coefficient, log_probs, entropy)


def _fused_step(
    head: Head,
    terms: FusedTerms,
    state: tuple[Grads, ChunkBuffers, torch.Tensor | None],
    block: Block,
) -> list[torch.Tensor]:
    grads, buffers, thresholds = state
    active = terms.mask[block]  # (n,)
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active)
    scores = chunk_scores(hidden_chunk, head, buffers, block[0])  # (n, V)
    if head.kept is not None:  # the logits outside the kept set become -inf
        flat = kept_rows(block, ())  # unselected (zeroed) rows keep everything: finite softmax
        restrict_(scores, head.kept, flat, None, thresholds, decide=True, active=active)
    target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,)
    options = (head.transform.row_factor(block[0]), head.kept is not None)
    chunk = _logit_grads(scores, target, terms, buffers.scratch, options, block)
    # + c 1[v = y] s / tau
    chunk.grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), chunk.row_coefficient.unsqueeze(1))
    chain_softcap_(chunk.grad_scores, buffers)
    accumulate_grads(chunk.grad_scores, hidden_chunk, head, grads, buffers, block)
    if chunk.entropy is None:
        return [chunk.log_probs]
    return [chunk.log_probs, masked_fill_zero(chunk.entropy, active)]


def fused_linear_forward(
    head: Head, terms: FusedTerms, needs: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor, Grads]:
    """``(log_probs, entropy, grads)`` of one pass over the chunks.

    ``log_probs`` and ``entropy`` are ``(N,)`` (entropy ``(0,)`` without the term); ``grads``
    are the gradients of the loss (float32/64 accumulators). With a kept set each chunk's
    logits outside it are ``-inf`` before its softmax (the head is on one process: the fused
    loop takes no vocabulary slice).
    """
    rows, device = head.hidden.shape[0], head.hidden.device
    log_probs = torch.zeros(rows, dtype=head.dtype, device=device)
    with_entropy = terms.entropy_weights is not None
    entropy = torch.zeros(rows if with_entropy else 0, dtype=head.dtype, device=device)
    grads = new_grads(head, needs)
    outputs = [log_probs, *([entropy] if with_entropy else [])]
    blocks = block_rows((rows,), head.chunk_size, flat=True)
    thresholds = None
    if head.kept is not None and head.kept.rule:
        thresholds = torch.zeros(rows, dtype=head.dtype, device=device)
    state = (grads, new_buffers(head, with_entropy=with_entropy), thresholds)
    run_blocks(blocks, partial(_fused_step, head, terms, state), outputs)
    return log_probs, entropy, grads


class FusedLinearLoss(torch.autograd.Function):
    """``(anchor, log_probs, entropy)``: the gradients formed in forward, on a zero anchor.

    ``log_probs`` and ``entropy`` are the detached per-token values of the pass. The backward
    scales the buffers formed in forward in place (no second ``(V, H)`` buffer), so a second
    backward through the same result raises.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: Head,
        terms: FusedTerms,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        needs = (
            bool(ctx.needs_input_grad[0]),
            bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]),
        )
        log_probs, entropy, grads = fused_linear_forward(head, terms, needs)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.spent = False
        ctx.mark_non_differentiable(log_probs, entropy)
        return torch.zeros((), dtype=head.dtype, device=hidden.device), log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_anchor: torch.Tensor, *unused: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        if ctx.spent:
            raise RuntimeError(
                "fused_policy_loss_from_hidden supports one backward pass per forward "
                "(its gradients are formed in forward and scaled in place in backward)"
            )
        ctx.spent = True
        results: list[torch.Tensor | None] = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
            if grad is None or dtype is None:
                results.append(None)
            else:
                results.append(grad.mul_(grad_anchor.to(grad.dtype)).to(dtype))
        return (*results, None, None)
