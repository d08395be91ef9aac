r"""Forward and backward passes of the LM-head functions, one chunk of rows at a time.

The ``(N, V)`` logits ``hidden @ weight.T + bias`` are never formed whole: each pass runs the
chunk driver of :mod:`rlobjectives._chunking` with a per-chunk step, so at most one ``(chunk, V)``
block of logits (two with entropy) is alive. The module-level passes are:

- :func:`log_probs_forward` / :func:`log_probs_backward`: log-probabilities (and entropy) of the
  given tokens; the forward keeps only the per-row log-normaliser (and entropy), the backward
  recomputes each chunk's logits (the Cut Cross-Entropy / Liger ``_ChunkedSelectiveLogProbs``
  pattern), wired to autograd by :class:`LogProbsFromHidden`;
- the fused linear loss (gradients formed in the forward pass, no recompute) lives in
  :mod:`rlobjectives._lm_head_fused` and uses the chunk math of this module.

All tensors are flat: hidden ``(N, H)``, tokens and masks ``(N,)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from ._chunking import Block, block_rows, chunk_rows, run_blocks
from ._logits_chunks import finite_log_probs_
from ._masking import masked_fill_zero

__all__ = [
    "Grads",
    "Head",
    "LogProbsFromHidden",
    "accumulate_grads",
    "chunk_scores",
    "default_chunk_size",
    "finish_grads",
    "log_probs_backward",
    "log_probs_forward",
    "new_grads",
    "select_rows",
    "softmax_",
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
    return chunk_rows(vocab_size, elements=_CHUNK_ELEMENTS, minimum=_MIN_CHUNK_ROWS)


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


def chunk_scores(hidden_chunk: torch.Tensor, head: Head) -> torch.Tensor:
    """Temperature-scaled logits ``(h W^T + b) / tau`` of one chunk, ``(n, V)`` in ``head.dtype``.

    The product runs in the weight's dtype (as ``hidden @ weight.T`` would); low-precision logits
    are then widened for the softmax. The result is a fresh tensor the caller may overwrite.
    """
    if head.bias is None:
        logits = hidden_chunk @ head.weight.T  # (n, V)
    else:
        logits = torch.addmm(head.bias, hidden_chunk, head.weight.T)  # (n, V)
    scores = logits.to(head.dtype)  # a fresh tensor either way
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
    grad_scores: torch.Tensor, hidden_chunk: torch.Tensor, head: Head, grads: Grads
) -> torch.Tensor:
    """Add one chunk's ``grad_weight``/``grad_bias``; return the chunk's ``grad_hidden``.

    ``grad_scores`` is the gradient with respect to the chunk's logits, ``(n, V)`` in the
    computation dtype; low-precision weights get the product in their dtype (as autograd casts)
    and a float32 accumulation over chunks (casting a low-precision product afterwards would not
    help: Liger-Kernel #1432).
    """
    weight = head.weight
    if weight.dtype in _LOW_PRECISION:
        grad_hidden_chunk = grad_scores.to(weight.dtype) @ weight  # (n, H)
    else:
        grad_hidden_chunk = grad_scores @ weight.to(grad_scores.dtype)  # (n, H)
    if grads.weight is not None:  # grad_scores has the accumulator's dtype
        grads.weight.addmm_(grad_scores.T, hidden_chunk.to(grads.weight.dtype))  # (V, H)
    if grads.bias is not None:
        grads.bias.add_(grad_scores.sum(dim=0))  # (V,)
    return grad_hidden_chunk


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
    head: Head, mask: torch.Tensor | None, with_entropy: bool, block: Block
) -> list[torch.Tensor]:
    """One chunk: ``[log_probs, lse, entropy]`` (entropy: an empty placeholder without it)."""
    active = None if mask is None else mask[block]
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active)
    scores = chunk_scores(hidden_chunk, head)  # (n, V)
    target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,)
    if not with_entropy:
        lse = softmax_(scores)[1]  # (n,)
        return [target - lse, lse]
    maximum = scores.amax(dim=1, keepdim=True)  # (n, 1)
    # Shifted scores s - max; -inf logits (banned tokens) become the most negative finite value,
    # whose exp is 0 and whose product with a zero probability is 0 (not 0 * -inf = NaN).
    shifted = finite_log_probs_(scores.sub_(maximum))  # (n, V)
    probs = shifted.exp()  # (n, V) unnormalised
    total = probs.sum(dim=1, keepdim=True)  # (n, 1)
    # H = log Z - E_p[s - max] with Z = sum exp(s - max); the row dot products as a batched
    # product so that no third (n, V) buffer is formed.
    dots = torch.bmm(probs.unsqueeze(1), shifted.unsqueeze(2)).reshape(-1, 1)  # (n, 1)
    lse = (maximum + total.log()).squeeze(1)  # (n,)
    return [target - lse, lse, (total.log() - dots / total).squeeze(1)]


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
    run_blocks(blocks, partial(_log_probs_step, head, mask, with_entropy), outputs)
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
    head: Head, active: torch.Tensor, upstream: _Upstream, grads: Grads, block: Block
) -> list[torch.Tensor]:
    hidden_chunk, tokens_chunk = select_rows(head.hidden[block], head.tokens[block], active[block])
    scores = chunk_scores(hidden_chunk, head)  # (n, V)
    g_lp = upstream.log_probs[block].unsqueeze(1)  # (n, 1)
    if upstream.entropy is None or upstream.entropy_values is None:
        grad_scores = softmax_(scores)[0].mul_(-g_lp)  # -g p, (n, V)
    else:
        # log p, with -inf (banned tokens) made finite so that p * log p = 0 * finite = 0
        log_p = finite_log_probs_(scores.sub_(upstream.log_normalizer[block].unsqueeze(1)))
        probs = log_p.exp()  # (n, V)
        # dH/ds_v = -p_v (log p_v + H); dlp/ds_v = 1[v = y] - p_v
        grad_scores = log_p.add_(upstream.entropy_values[block].unsqueeze(1))
        grad_scores.mul_(upstream.entropy[block].unsqueeze(1)).add_(g_lp).mul_(probs).neg_()
    grad_scores.scatter_add_(1, tokens_chunk.unsqueeze(1), g_lp)  # + g 1[v = y]
    grad_hidden_chunk = accumulate_grads(grad_scores, hidden_chunk, head, grads)
    return [] if grads.hidden is None else [grad_hidden_chunk]


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
    grads = new_grads(head, needs)
    blocks = block_rows((head.hidden.shape[0],), head.chunk_size, flat=True)
    outputs = [] if grads.hidden is None else [grads.hidden]
    run_blocks(blocks, partial(_log_probs_grad_step, head, active, upstream, grads), outputs)
    return finish_grads(head, grads)


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
        log_probs, log_normalizer, entropy = log_probs_forward(head, mask, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, head.tokens, mask, log_normalizer, entropy)
        ctx.options = (head.inv_temperature, head.chunk_size, head.dtype, with_entropy)
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
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
