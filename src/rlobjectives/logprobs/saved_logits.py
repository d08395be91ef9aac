r"""The transformed logits the LM head's forward pass keeps for its backward pass.

The backward needs each chunk's transformed logits :math:`x` again. Recomputing them costs a
fourth GEMM (the forward's :math:`h W^\top`, again) on top of the gradient's two and the
forward's one: 1.33x the three-GEMM floor before any element-wise pass. When the inputs need a
gradient the forward (:func:`~rlobjectives.logprobs.passes.log_probs_forward`) therefore keeps
the first chunks' :math:`x` (after the transform and the kept set), at most :data:`SAVED_LOGITS`
values (2**27: 512 MiB of float32, the size of the ``4096 x 32768`` tile TRL's
``ChunkedLogProbFunction`` holds); the remaining chunks are recomputed. Unless the product needs
a rounding buffer (``fp32_head=False`` with a bf16/fp16 head, a float32 head in a float64
computation) the saved rows' product is formed at once into that buffer (one GEMM instead of one
per chunk, which on CPU re-reads and re-packs the whole weight each time), the chunks then
transform it and take their statistics in place, and the backward forms the gradient in place of
the logits and its two products once over the saved rows. A second backward through the same
graph (``retain_graph=True``) forms the saved logits again by the same operations
(:func:`refill`), so it gives the same gradients to the bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.chunking import Block, block_rows
from .._core.reduction import masked_fill_zero
from .chunks import (
    ChunkBuffers,
    casts_product,
    chunk_product,
    chunk_scores,
    new_buffers,
    select_rows,
    transform_scores_,
)
from .head import Head
from .truncation import kept_rows, restrict_

__all__ = [
    "SAVED_LOGITS",
    "SavedLogits",
    "covers",
    "is_saved",
    "refill",
    "saved_logits",
    "saved_rows",
    "transformed",
    "whole_product",
]

#: The most transformed logits :func:`log_probs_forward` keeps for the backward pass (2**27
#: values: 512 MiB of float32, the ``4096 x 32768`` tile of TRL's ChunkedLogProbFunction).
SAVED_LOGITS = 1 << 27


class SavedLogits(NamedTuple):
    """The transformed logits of the first ``rows`` rows, kept from forward to backward.

    ``values`` is ``(rows, V)``; the backward pass forms the gradient in place there (so a
    second backward through the same graph recomputes them). ``whole``: the product of all the
    rows was formed at once, and their gradient products are too (one GEMM each instead of one
    per chunk).
    """

    values: torch.Tensor
    rows: int
    whole: bool


def saved_logits(head: Head) -> SavedLogits | None:
    """The buffer of the saved chunks (whole chunks within :data:`SAVED_LOGITS`), or None."""
    count, vocab = head.hidden.shape[0], head.weight.shape[0]
    rows = min(count, SAVED_LOGITS // max(vocab, 1))
    if rows < count:
        rows = rows // head.chunk_size * head.chunk_size
    if rows == 0:
        return None
    values = torch.empty(rows, vocab, dtype=head.dtype, device=head.weight.device)
    # at once where no rounding buffer is needed (the product formed in the computation dtype)
    return SavedLogits(values, rows, whole=not casts_product(head))


def covers(saved: SavedLogits | None, head: Head) -> bool:
    """Whether every row is saved with its product formed at once: no ``(chunk, V)`` block."""
    return saved is not None and saved.whole and saved.rows == head.hidden.shape[0]


def transformed(
    hidden_chunk: torch.Tensor,
    head: Head,
    buffers: ChunkBuffers,
    saved: SavedLogits | None,
    block: Block,
) -> torch.Tensor:
    """A forward chunk's transformed logits in ``buffers.scores``: product unless formed."""
    if is_saved(saved, block) and saved is not None and saved.whole:  # product formed already
        return transform_scores_(buffers.scores, head, buffers, block[0])
    return chunk_scores(hidden_chunk, head, buffers, block[0])


def refill(head: Head, mask: torch.Tensor | None, thresholds: torch.Tensor | None) -> SavedLogits:
    """The forward pass's saved logits formed again by the same operations (a second backward).

    The first backward consumed them; the same products, transform and kept set (its
    thresholds replayed) give the same values to the bit, so backward is reentrant.
    """
    saved = saved_logits(head)
    assert saved is not None
    buffers = new_buffers(
        head, with_entropy=False, scores=not covers(saved, head), derivative=False
    )
    whole_product(head, mask, buffers, saved)
    for block in block_rows((saved.rows,), head.chunk_size, flat=True):
        active = None if mask is None else mask[block]
        hidden_chunk, _ = select_rows(head.hidden[block], head.tokens[block], active)
        rows = buffers._replace(scores=saved.values[block])
        scores = transformed(hidden_chunk, head, rows, saved, block)
        if head.kept is not None:
            flat = kept_rows(block, ())
            restrict_(scores, head.kept, flat, head.shard, thresholds, decide=False, active=active)
    return saved


def whole_product(
    head: Head, mask: torch.Tensor | None, buffers: ChunkBuffers, saved: SavedLogits
) -> None:
    """The product of all the saved rows at once, into ``saved.values`` (where ``whole``)."""
    if saved.whole:
        region = buffers._replace(scores=saved.values)
        chunk_product(saved_rows(head, mask, saved.rows), head, region)


def saved_rows(head: Head, mask: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The hidden states of the first ``rows`` rows, those outside ``mask`` zero, ``(rows, H)``."""
    hidden = head.hidden[:rows]
    return hidden if mask is None else masked_fill_zero(hidden, mask[:rows].unsqueeze(1))


def is_saved(saved: SavedLogits | None, block: Block) -> bool:
    """Whether the chunk ``block`` lies within the saved rows."""
    rows = block[0]
    assert isinstance(rows, slice)
    return saved is not None and rows.stop <= saved.rows
