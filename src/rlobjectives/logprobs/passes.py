r"""Forward and backward passes of the LM-head functions, one chunk of rows at a time.

The ``(N, V)`` logits ``hidden @ weight.T + bias`` are never formed whole: each pass runs the
chunk driver of :mod:`rlobjectives._core.chunking` with a per-chunk step, and every chunk works in
the pass's :class:`ChunkBuffers` (one ``(chunk, V)`` block in the computation dtype, plus one
in the weight's dtype for bf16/fp16 heads and a few rows of scratch for the entropy), sized by the
budget :data:`HEAD_BUDGET` unless ``chunk_size`` is given. The module-level passes are:

- :func:`log_probs_forward` / :func:`log_probs_backward`: log-probabilities (and entropy) of the
  given tokens; the forward keeps only the per-row log-normaliser (and entropy), the backward
  recomputes each chunk's logits (the Cut Cross-Entropy / Liger ``_ChunkedSelectiveLogProbs``
  pattern), wired to autograd by :class:`LogProbsFromHidden`;
- the fused linear loss (gradients formed in the forward pass, no recompute) lives in
  :mod:`rlobjectives.logprobs.fused_linear` and uses the chunk math of this module.

All tensors are flat: hidden ``(N, H)``, tokens and masks ``(N,)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from .._core.chunking import Block, ChunkBudget, block_rows, chunk_rows, run_blocks
from .._core.reduction import masked_fill_zero
from .blocks import entropy_logit_grads_, entropy_stats_, finite_log_probs_, scratch_rows

__all__ = [
    "HEAD_BUDGET",
    "ChunkBuffers",
    "Grads",
    "Head",
    "LogProbsFromHidden",
    "accumulate_grads",
    "chunk_row_bytes",
    "chunk_scores",
    "default_chunk_size",
    "finish_grads",
    "log_probs_backward",
    "log_probs_forward",
    "new_buffers",
    "new_grads",
    "select_rows",
    "softmax_",
]

#: The chunk budget of the hidden-state functions when ``chunk_size`` is None: a chunk holds at
#: most 1/16 of the rows (so its buffers hold 1/16 of the bytes of the ``(N, V)`` logits that the
#: unchunked computation forms, which also forms their softmax and gradient) and at most 64 MiB
#: of buffers, but at least 256 rows: the ``grad_weight += grad_logits.T @ hidden`` update has
#: inner dimension ``rows``, and in a sweep on CPU (float32, N = 4096, H = 1024, V = 32000, one
#: thread, process time; ``bench_logprobs.py --chunk-size``, benchmarks/README.md) the fused loss
#: took 1.23x the three-GEMM floor at 64 rows, 1.03x at 128, 1.01x at 256, 1.09x at 512 and
#: 1.01x at 1024.
HEAD_BUDGET = ChunkBudget(fraction=1 / 16, max_bytes=1 << 26, min_rows=256)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def chunk_row_bytes(vocab_size: int, dtype: torch.dtype) -> int:
    """Bytes of one row of a chunk's buffers (:class:`ChunkBuffers`) for a head of ``dtype``.

    ``V`` scores in the computation dtype (float64 for a float64 head, float32 else), plus ``V``
    values in ``dtype`` for a low-precision head (its product and its gradient's cast).
    """
    if dtype == torch.float64:
        return 8 * vocab_size
    return vocab_size * (4 + (dtype.itemsize if dtype in _LOW_PRECISION else 0))


def default_chunk_size(vocab_size: int, rows: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk used when ``chunk_size=None``: the :data:`HEAD_BUDGET` policy.

    Args:
        vocab_size: V, the number of rows of the LM-head weight.
        rows: N, the number of hidden-state rows of the call.
        dtype: the head's dtype.

    Returns:
        ``min(max(min(N // 16, 2**26 // b), 256), max(N, 1))`` with ``b`` the
        :func:`chunk_row_bytes`: e.g. 256 rows (32 MiB) at N = 4096, V = 32000, float32;
        512 rows at N = 8192; 524 rows (64 MiB) from N = 8384 on; 256 rows at V >= 65536.
    """
    return chunk_rows(chunk_row_bytes(vocab_size, dtype), rows=rows, budget=HEAD_BUDGET)


class Head(NamedTuple):
    """The validated LM head and token ids, flattened to rows."""

    hidden: torch.Tensor  # (N, H), original dtype
    weight: torch.Tensor  # (V, H), same dtype as hidden
    bias: torch.Tensor | None  # (V,)
    tokens: torch.Tensor  # (N,) int64
    inv_temperature: float
    chunk_size: int
    dtype: torch.dtype  # computation dtype of the log-softmax (float32 or float64)


# --------------------------------------------------------------------------------------------
# Chunk math (in place on one (n, V) block)
# --------------------------------------------------------------------------------------------


class ChunkBuffers(NamedTuple):
    """The ``(chunk, V)`` buffers of one pass, allocated once and reused by every chunk.

    Chunks write into them (``out=`` and in-place operations), so a pass holds one ``(chunk,
    V)`` block in the computation dtype whatever the chunk math does, and nothing is allocated
    (and page-faulted) per chunk.
    """

    scores: torch.Tensor  # (chunk, V) computation dtype: logits, then their gradient
    # (chunk, V) in the weight's dtype where it is not the computation dtype (bf16/fp16 heads, or
    # a float32 head in a float64 loss): the product, then the gradient's cast
    product: torch.Tensor | None
    scratch: torch.Tensor | None  # (c, V) computation dtype: a few rows of probabilities (entropy)


def new_buffers(head: Head, *, with_entropy: bool, rows: int | None = None) -> ChunkBuffers:
    """The buffers of a pass over ``head`` (:func:`chunk_row_bytes` bytes per chunk row).

    ``rows``: rows per buffer; by default the chunk size (at most N).
    """
    if rows is None:
        rows = min(head.chunk_size, head.hidden.shape[0])
    vocab, weight, dtype = head.weight.shape[0], head.weight, head.dtype
    cast = weight.dtype != dtype
    scratch = min(rows, scratch_rows(vocab))
    return ChunkBuffers(
        scores=torch.empty(rows, vocab, dtype=dtype, device=weight.device),
        product=torch.empty(rows, vocab, dtype=weight.dtype, device=weight.device)
        if cast
        else None,
        scratch=torch.empty(scratch, vocab, dtype=dtype, device=weight.device)
        if with_entropy
        else None,
    )


def chunk_scores(
    hidden_chunk: torch.Tensor, head: Head, buffers: ChunkBuffers | None = None
) -> torch.Tensor:
    """Temperature-scaled logits ``(h W^T + b) / tau`` of one chunk, ``(n, V)`` in ``head.dtype``.

    The product runs in the weight's dtype (as ``hidden @ weight.T`` would); low-precision logits
    are then widened for the softmax. The result is the first ``n`` rows of ``buffers.scores``
    (a fresh tensor without ``buffers``), which the caller may overwrite.
    """
    rows = hidden_chunk.shape[0]
    if buffers is None:
        buffers = new_buffers(head, with_entropy=False, rows=rows)
    scores = buffers.scores[:rows]  # (n, V)
    product = scores if buffers.product is None else buffers.product[:rows]  # (n, V), weight dtype
    if head.bias is None:
        torch.mm(hidden_chunk, head.weight.T, out=product)
    else:
        torch.addmm(head.bias, hidden_chunk, head.weight.T, out=product)
    if buffers.product is not None:
        scores.copy_(product)
    if head.inv_temperature != 1.0:
        scores.mul_(head.inv_temperature)
    return scores


def softmax_(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    return probs, maximum - probs.amax(dim=1).log()


def select_rows(
    hidden_chunk: torch.Tensor, tokens_chunk: torch.Tensor, active: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the hidden rows and token ids of inactive rows (NaN/inf or bad ids cannot leak)."""
    if active is None:
        return hidden_chunk, tokens_chunk
    hidden_chunk = masked_fill_zero(hidden_chunk, active.unsqueeze(-1))  # (n, H)
    tokens_chunk = torch.where(active, tokens_chunk, torch.zeros_like(tokens_chunk))  # (n,)
    return hidden_chunk, tokens_chunk


class Grads(NamedTuple):
    """Gradient buffers: ``grad_hidden`` in the hidden dtype, float32/64 accumulators else."""

    hidden: torch.Tensor | None  # (N, H)
    weight: torch.Tensor | None  # (V, H)
    bias: torch.Tensor | None  # (V,)


def new_grads(head: Head, needs: tuple[bool, bool, bool]) -> Grads:
    """Zeroed accumulators for the inputs that need a gradient."""
    accumulate = torch.float64 if head.dtype == torch.float64 else torch.float32
    weight, device = head.weight, head.weight.device
    return Grads(
        hidden=torch.empty_like(head.hidden) if needs[0] else None,
        weight=torch.zeros(weight.shape, dtype=accumulate, device=device) if needs[1] else None,
        bias=(
            torch.zeros(weight.shape[0], dtype=accumulate, device=device)
            if needs[2] and head.bias is not None
            else None
        ),
    )


def accumulate_grads(
    grad_scores: torch.Tensor,
    hidden_chunk: torch.Tensor,
    head: Head,
    grads: Grads,
    buffers: ChunkBuffers,
    block: Block,
) -> None:
    """Write one chunk's ``grad_hidden`` rows (at ``block``); add its ``grad_weight``/``grad_bias``.

    ``grad_scores`` is the gradient with respect to the chunk's logits, ``(n, V)`` in the
    computation dtype. A weight in another dtype gets the ``grad_hidden`` product in its dtype
    (as autograd casts the gradient of ``(hidden @ weight.T).float()``, through
    ``buffers.product``); ``grad_weight`` accumulates over chunks in float32 (float64) (casting
    a low-precision product afterwards would not help: Liger-Kernel #1432).
    """
    weight = head.weight
    if grads.hidden is not None:
        if buffers.product is not None:
            grad_cast = buffers.product[: grad_scores.shape[0]].copy_(grad_scores)  # (n, V)
            torch.mm(grad_cast, weight, out=grads.hidden[block])  # (n, H)
        else:
            torch.mm(grad_scores, weight, out=grads.hidden[block])  # (n, H)
    if grads.weight is not None:  # grad_scores has the accumulator's dtype
        grads.weight.addmm_(grad_scores.T, hidden_chunk.to(grads.weight.dtype))  # (V, H)
    if grads.bias is not None:
        grads.bias.add_(grad_scores.sum(dim=0))  # (V,)


def finish_grads(head: Head, grads: Grads) -> tuple[torch.Tensor | None, ...]:
    """The gradients in the dtypes of ``(hidden, weight, bias)``."""
    return (
        grads.hidden,
        None if grads.weight is None else grads.weight.to(head.weight.dtype),
        None if grads.bias is None or head.bias is None else grads.bias.to(head.bias.dtype),
    )


# --------------------------------------------------------------------------------------------
# Log-probabilities (and entropy): forward keeps (lse, entropy), backward recomputes
# --------------------------------------------------------------------------------------------


def _log_probs_step(
    head: Head, mask: torch.Tensor | None, buffers: ChunkBuffers, block: Block
) -> list[torch.Tensor]:
    """One chunk: ``[log_probs, lse]``, and ``entropy`` with ``buffers.scratch``."""
    active = None if mask is None else mask[block]
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active)
    scores = chunk_scores(hidden_chunk, head, buffers)  # (n, V)
    target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,)
    if buffers.scratch is None:
        lse = softmax_(scores)[1]  # (n,)
        return [target - lse, lse]
    lse, entropy, _ = entropy_stats_(scores, buffers.scratch)  # (n,) each
    return [target - lse, lse, entropy]


def log_probs_forward(
    head: Head, mask: torch.Tensor | None, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_probs, log_normalizer, entropy)``, each ``(N,)`` (entropy ``(0,)`` without it)."""
    rows, device = head.hidden.shape[0], head.hidden.device
    log_probs = torch.zeros(rows, dtype=head.dtype, device=device)
    log_normalizer = torch.zeros(rows, dtype=head.dtype, device=device)
    entropy = torch.zeros(rows if with_entropy else 0, dtype=head.dtype, device=device)
    outputs = [log_probs, log_normalizer, entropy] if with_entropy else [log_probs, log_normalizer]
    blocks = block_rows((rows,), head.chunk_size, flat=True)
    buffers = new_buffers(head, with_entropy=with_entropy)
    run_blocks(blocks, partial(_log_probs_step, head, mask, buffers), outputs)
    if mask is not None:
        log_probs = masked_fill_zero(log_probs, mask)
        entropy = masked_fill_zero(entropy, mask) if with_entropy else entropy
    return log_probs, log_normalizer, entropy


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
    state: tuple[Grads, ChunkBuffers],
    block: Block,
) -> list[torch.Tensor]:
    grads, buffers = state
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active[block])
    scores = chunk_scores(hidden_chunk, head, buffers)  # (n, V)
    g_lp = upstream.log_probs[block]  # (n,)
    if upstream.entropy is None or upstream.entropy_values is None or buffers.scratch is None:
        grad_scores = softmax_(scores)[0].mul_(-g_lp.unsqueeze(1))  # -g p, (n, V)
    else:
        # log p, with -inf (banned tokens) made finite so that p * log p = 0 * finite = 0
        log_p = finite_log_probs_(scores.sub_(upstream.log_normalizer[block].unsqueeze(1)))
        grad_scores = entropy_logit_grads_(  # -p (g_lp + g_H (log p + H)), (n, V)
            log_p,
            upstream.entropy_values[block],
            (g_lp, upstream.entropy[block]),
            buffers.scratch,
        )
    grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), g_lp.unsqueeze(1))  # + g 1[v = y]
    accumulate_grads(grad_scores, hidden_chunk, head, grads, buffers, block)
    return []


def log_probs_backward(
    head: Head,
    mask: torch.Tensor | None,
    saved: tuple[torch.Tensor, torch.Tensor],
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients ``(hidden, weight, bias)`` of ``sum(g_lp * log_probs + g_H * entropy)``.

    Rows whose outputs receive no gradient (or are masked) are zeroed before the products, so
    NaN/inf hidden states there cannot reach ``grad_weight`` through ``0 * NaN``; they are
    recomputed from a zero hidden row, given that row's normaliser so their probabilities stay
    finite and their gradient is exactly 0.
    """
    log_normalizer, entropy = saved
    grad_lp = grad_log_probs.to(head.dtype)
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
        log_normalizer=torch.where(active, log_normalizer, zero_row_lse),
        entropy_values=None if grad_h is None else masked_fill_zero(entropy, active),
    )
    state = (new_grads(head, needs), new_buffers(head, with_entropy=grad_h is not None))
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
        log_probs, log_normalizer, entropy = log_probs_forward(head, mask, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, head.tokens, mask, log_normalizer, entropy)
        ctx.options = (head.inv_temperature, head.chunk_size, head.dtype, with_entropy)
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        hidden, weight, bias, tokens, mask, log_normalizer, entropy = ctx.saved_tensors
        inv_temperature, chunk_size, dtype, with_entropy = ctx.options
        head = Head(hidden, weight, bias, tokens, inv_temperature, chunk_size, dtype)
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
        grads = log_probs_backward(
            head, mask, (log_normalizer, entropy), grad_log_probs, grad_entropy, needs
        )
        return (*grads, None, None, None)
