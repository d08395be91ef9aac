r"""One chunk of rows of the LM head: its buffers, product, transform, softmax and gradients.

The ``(N, V)`` logits ``hidden @ weight.T + bias`` of a :class:`~rlobjectives.logprobs.head.Head`
are never formed whole: every pass (:mod:`rlobjectives.logprobs.passes`,
:mod:`rlobjectives.logprobs.fused_linear`) works chunk by chunk in one :class:`ChunkBuffers` (one
``(chunk, V)`` block in the computation dtype, plus one in the weight's dtype for a bf16/fp16
head whose product is rounded to it (``fp32_head=False``), one for the softcap's derivative and a
few rows of scratch for the entropy), with the per-chunk helpers they share
(:func:`chunk_scores`, :func:`softmax_`, :func:`select_rows`, the gradient accumulators
:class:`Grads`).

**The product's precision.** From bf16/fp16 hidden states and weight the product
:math:`h W^\top + b` is formed with float32 accumulation and a float32 result by default
(``fp32_head=True``; TRL's ``cast_lm_head_to_fp32=True``, prime-rl's
``enable_fp32_lm_head``): on CUDA by ``torch.mm(..., out_dtype=torch.float32)``, on other
devices in float32 arithmetic (the weight widened one vocabulary slice at a time, a few MiB).
``fp32_head=False`` rounds the product to the input dtype before the float32 softmax, as
``hidden @ weight.T`` does (TRL's default forward, vLLM's bf16 logits). The gradient products
accumulate in float32 either way; with ``fp32_head=True`` off CUDA they also read the float32
logits' gradient unrounded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.chunking import Block, scratch_rows
from .._core.reduction import masked_fill_zero
from .head import LOW_PRECISION, Head
from .transform import apply_transform_, softcap_derivative

__all__ = [
    "ChunkBuffers",
    "Grads",
    "WIDEN_ELEMENTS",
    "accumulate_grads",
    "casts_product",
    "chain_softcap_",
    "chunk_product",
    "chunk_scores",
    "finish_grads",
    "leads",
    "new_buffers",
    "new_grads",
    "select_rows",
    "softmax_",
    "transform_scores_",
    "wide_product",
]


class ChunkBuffers(NamedTuple):
    """The ``(chunk, V)`` buffers of one pass, allocated once and reused by every chunk.

    Chunks write into them (``out=`` and in-place operations), so a pass holds one ``(chunk,
    V)`` block in the computation dtype whatever the chunk math does, and nothing is allocated
    (and page-faulted) per chunk.
    """

    scores: torch.Tensor  # (chunk, V) computation dtype: logits, then their gradient
    # (chunk, V) in the weight's dtype where the product is formed in it (fp32_head=False with a
    # bf16/fp16 head, or a float32 head in a float64 loss): the product, then the gradient's cast
    product: torch.Tensor | None
    scratch: torch.Tensor | None  # (c, V) computation dtype: a few rows of probabilities (entropy)
    derivative: torch.Tensor | None = None  # (chunk, V) the softcap's 1 - t^2


def casts_product(head: Head) -> bool:
    """Whether the product is formed in the weight's dtype and then widened (a cast buffer)."""
    return head.weight.dtype != head.dtype and (
        head.rounds_product or head.weight.dtype not in LOW_PRECISION
    )


def new_buffers(
    head: Head,
    *,
    with_entropy: bool,
    rows: int | None = None,
    scores: bool = True,
    derivative: bool = True,
) -> ChunkBuffers:
    """The buffers of a pass over ``head``.

    At most :func:`chunk_row_bytes` bytes per row, and one ``(chunk, V)`` block more with a
    softcap. ``rows``: rows per buffer; by default the chunk size (at most N). ``scores=False``:
    no ``scores`` block (every chunk's logits are formed elsewhere, in saved rows);
    ``derivative=False``: no softcap derivative (a pass that needs no gradient).
    """
    if rows is None:
        rows = min(head.chunk_size, head.hidden.shape[0])
    vocab, weight, dtype = head.weight.shape[0], head.weight, head.dtype
    scratch = scratch_rows(vocab, rows)
    softcap = head.transform.softcap is not None and derivative
    return ChunkBuffers(
        scores=torch.empty(rows if scores else 0, vocab, dtype=dtype, device=weight.device),
        product=torch.empty(rows, vocab, dtype=weight.dtype, device=weight.device)
        if casts_product(head)
        else None,
        scratch=torch.empty(scratch, vocab, dtype=dtype, device=weight.device)
        if with_entropy
        else None,
        derivative=torch.empty(rows, vocab, dtype=dtype, device=weight.device) if softcap else None,
    )


#: Elements of the float32 slice of a bf16/fp16 weight widened at a time off CUDA (4 MiB).
WIDEN_ELEMENTS = 1 << 20


def _widened_rows(width: int) -> int:
    return max(1, WIDEN_ELEMENTS // max(width, 1))


def wide_product(
    left: torch.Tensor, right: torch.Tensor, out: torch.Tensor, *, transpose: bool
) -> torch.Tensor:
    """``out = left @ right.T`` (``transpose``) or ``left @ right`` with a float32 ``out``.

    ``right`` is a bf16/fp16 matrix; ``left`` float32 or ``right``'s dtype. On CUDA (16-bit
    ``left``): one ``torch.mm(..., out_dtype=torch.float32)`` (float32 accumulation in the
    tensor cores, no rounding of the result). Elsewhere ``right`` is widened to float32 a slice
    of its rows at a time and the products run in float32 arithmetic.
    """
    if out.device.type == "cuda" and left.dtype == right.dtype and out.dtype == torch.float32:
        operand = right.T if transpose else right
        return torch.mm(left, operand, out_dtype=torch.float32, out=out)
    left_wide = left if left.dtype == out.dtype else left.to(out.dtype)
    step = _widened_rows(right.shape[1])
    if transpose:  # out (n, V): slices of V
        for start in range(0, right.shape[0], step):
            part = right[start : start + step].to(out.dtype)  # (s, H)
            torch.mm(left_wide, part.T, out=out[:, start : start + step])
        return out
    # out (n, H) = left (n, V) @ right (V, H): sum over slices of V
    for index, start in enumerate(range(0, right.shape[0], step)):
        part = right[start : start + step].to(out.dtype)  # (s, H)
        piece = left_wide[:, start : start + step]
        if index == 0:
            torch.mm(piece, part, out=out)
        else:
            out.addmm_(piece, part)
    return out


def chunk_product(hidden_chunk: torch.Tensor, head: Head, buffers: ChunkBuffers) -> torch.Tensor:
    r"""The product :math:`z = h W^\top + b` of ``n`` rows, into ``buffers.scores[:n]``.

    ``(n, V)`` in ``head.dtype``: formed in float32 from a bf16/fp16 head by default (module
    docstring), in the weight's dtype with ``fp32_head=False`` (through ``buffers.product``, then
    widened for the softmax). Where :func:`leads`, the GEMM's ``alpha`` (and ``beta``) also
    multiply it by :attr:`LogitTransform.leading` (one element-wise pass fewer).
    """
    count = hidden_chunk.shape[0]
    scores = buffers.scores[:count]  # (n, V)
    weight = head.weight
    if buffers.product is not None:  # the product in the weight's dtype, then widened
        product = buffers.product[:count]
        if head.bias is None:
            torch.mm(hidden_chunk, weight.T, out=product)
        else:
            torch.addmm(head.bias, hidden_chunk, weight.T, out=product)
        scores.copy_(product)
    elif weight.dtype != scores.dtype:  # a bf16/fp16 head, float32 accumulation and result
        wide_product(hidden_chunk, weight, scores, transpose=True)
        if head.bias is not None:
            scores.add_(head.bias)
    elif leads(head):
        alpha = head.transform.leading
        if head.bias is None:  # beta = 0: the buffer's old values are not read
            torch.addmm(scores, hidden_chunk, weight.T, beta=0.0, alpha=alpha, out=scores)
        else:
            torch.addmm(head.bias, hidden_chunk, weight.T, beta=alpha, alpha=alpha, out=scores)
    elif head.bias is None:
        torch.mm(hidden_chunk, weight.T, out=scores)
    else:
        torch.addmm(head.bias, hidden_chunk, weight.T, out=scores)
    return scores


def leads(head: Head) -> bool:
    """Whether :func:`chunk_product` applies the transform's leading factor in its GEMM.

    For a product formed in the computation dtype itself (not widened, not rounded first) and a
    leading factor other than 1.
    """
    return head.weight.dtype == head.dtype and head.transform.leading != 1.0


def transform_scores_(
    scores: torch.Tensor, head: Head, buffers: ChunkBuffers, rows: slice | int | torch.Tensor
) -> torch.Tensor:
    r"""``scores`` :math:`z` ``(n, V)`` become :math:`x = \mathrm{cap}_c(s z)/\tau`, in place.

    ``rows`` is the chunk's row range (its per-token temperature). With a softcap and a
    ``buffers.derivative`` :math:`1 - t^2` goes there.
    """
    if not head.transform.plain:
        apply_transform_(scores, head.transform, rows, led=leads(head))
    if buffers.derivative is not None:
        softcap_derivative(scores, head.transform, rows, buffers.derivative)
    return scores


def chain_softcap_(grad_scores: torch.Tensor, buffers: ChunkBuffers) -> torch.Tensor:
    r"""``grad_scores`` ``(n, V)`` times the softcap's :math:`1 - t^2`, in place.

    From the gradient with respect to the transformed logits toward the product's: the
    derivative :func:`transform_scores_` wrote; unchanged without a softcap.
    """
    if buffers.derivative is not None:
        grad_scores.mul_(buffers.derivative[: grad_scores.shape[0]])
    return grad_scores


def chunk_scores(
    hidden_chunk: torch.Tensor,
    head: Head,
    buffers: ChunkBuffers | None,
    rows: slice | int | torch.Tensor,
) -> torch.Tensor:
    r"""The transformed logits :math:`x = \mathrm{cap}_c(s(h W^\top + b))/\tau` of one chunk.

    :func:`chunk_product`, then :func:`transform_scores_`: ``(n, V)`` in ``head.dtype``, the
    first ``n`` rows of ``buffers.scores`` (a fresh tensor without ``buffers``), which the
    caller may overwrite; ``rows`` is the chunk's row range (or index tensor).
    """
    if buffers is None:
        buffers = new_buffers(head, with_entropy=False, rows=hidden_chunk.shape[0])
    return transform_scores_(chunk_product(hidden_chunk, head, buffers), head, buffers, rows)


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


def new_grads(head: Head, needs: tuple[bool, bool, bool], *, zeroed: bool = True) -> Grads:
    """Accumulators for the inputs that need a gradient: zeroed unless written once (``first``)."""
    accumulate = torch.float64 if head.dtype == torch.float64 else torch.float32
    weight, device = head.weight, head.weight.device
    new = torch.zeros if zeroed else torch.empty
    return Grads(
        hidden=torch.empty_like(head.hidden) if needs[0] else None,
        weight=new(weight.shape, dtype=accumulate, device=device) if needs[1] else None,
        bias=(
            new(weight.shape[0], dtype=accumulate, device=device)
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
    *,
    first: bool = False,
) -> None:
    """Write one chunk's ``grad_hidden`` rows (at ``block``); add its ``grad_weight``/``grad_bias``.

    ``grad_scores`` is the gradient with respect to the chunk's logits, ``(n, V)`` in the
    computation dtype. With ``fp32_head=False`` a weight in another dtype gets the
    ``grad_hidden`` product in its dtype (as autograd casts the gradient of ``(hidden @
    weight.T).float()``, through ``buffers.product``); with ``fp32_head=True`` (a bf16/fp16
    head) the product accumulates in float32 (:func:`wide_product`) and is rounded once.
    ``grad_weight`` accumulates over chunks in float32 (float64) (casting a low-precision
    product afterwards would not help: Liger-Kernel #1432).
    """
    weight = head.weight
    if grads.hidden is not None:
        if buffers.product is not None:
            grad_cast = buffers.product[: grad_scores.shape[0]].copy_(grad_scores)  # (n, V)
            torch.mm(grad_cast, weight, out=grads.hidden[block])  # (n, H)
        elif weight.dtype != grad_scores.dtype:  # float32 accumulation, one rounding
            if grad_scores.device.type == "cuda" and grad_scores.dtype == torch.float32:
                # the tensor cores read the 16-bit gradient (TRL's _addmm_fp32)
                left = grad_scores.to(weight.dtype)
            else:
                left = grad_scores
            wide = torch.empty(
                grad_scores.shape[0], weight.shape[1], dtype=grad_scores.dtype,
                device=grad_scores.device,
            )  # fmt: skip
            wide_product(left, weight, wide, transpose=False)
            grads.hidden[block] = wide
        else:
            torch.mm(grad_scores, weight, out=grads.hidden[block])  # (n, H)
    if grads.weight is not None:  # grad_scores has the accumulator's dtype
        if first:  # the only contribution (no zeroed accumulator to add to)
            torch.mm(grad_scores.T, hidden_chunk.to(grads.weight.dtype), out=grads.weight)
        else:
            grads.weight.addmm_(grad_scores.T, hidden_chunk.to(grads.weight.dtype))  # (V, H)
    if grads.bias is not None:
        if first:
            torch.sum(grad_scores, dim=0, out=grads.bias)
        else:
            grads.bias.add_(grad_scores.sum(dim=0))  # (V,)


def finish_grads(head: Head, grads: Grads) -> tuple[torch.Tensor | None, ...]:
    """The gradients in the dtypes of ``(hidden, weight, bias)``."""
    return (
        grads.hidden,
        None if grads.weight is None else grads.weight.to(head.weight.dtype),
        None if grads.bias is None or head.bias is None else grads.bias.to(head.bias.dtype),
    )
