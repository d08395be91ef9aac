"""Chunking: the one chunk-size policy and the one chunk-loop driver of the library.

Functions that read a large ``(rows, V)`` tensor (logits, or logits recomputed from hidden
states) process it one block of rows at a time, so that at most one ``(chunk, V)`` float32 block
is alive. Every chunked autograd Function runs its forward and its backward through
:func:`run_blocks`, with a per-block step function that computes the block's results.

Blocks index the leading (row) dimensions of the chunked tensor and of its per-row outputs alike:
``(slice(s, e),)`` for flat rows, or ``(b, slice(s, e))`` for a ``(B, T, V)`` tensor that cannot
be viewed as ``(B*T, V)`` without a copy (e.g. the strided slice ``logits[:, :-1]``), so a
strided input is never copied whole.

Loops run over Python lists built from static shapes (no ``.item()``), so they unroll under
``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "LOGITS_BUDGET",
    "SCRATCH_ELEMENTS",
    "Block",
    "ChunkBudget",
    "block_rows",
    "chunk_rows",
    "flat_rows",
    "resolve_chunk_size",
    "row_chunks",
    "run_blocks",
    "scratch_rows",
]

#: Default number of float32 elements per chunk of the logits functions (rows * V): 2**23 = 32 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 23

#: Elements of a scratch block of a chunk (the exponentials of its normaliser and entropy): a few
#: rows (2**17 float32 values = 512 KiB) that stay in cache while used.
SCRATCH_ELEMENTS = 1 << 17


def scratch_rows(width: int, rows: int) -> int:
    """Scratch rows for ``rows`` rows of ``width`` values: ``min(rows, max(1, 2**17 // width))``."""
    return min(rows, max(1, SCRATCH_ELEMENTS // max(width, 1)))


#: A block: an index into the leading dimensions, ``(slice,)`` or ``(int, slice)``.
Block = tuple[int | slice, ...]


class ChunkBudget(NamedTuple):
    """The memory budget of one chunk, for :func:`chunk_rows`.

    Attributes:
        fraction: the share of the rows one chunk may hold, or None for no share term. The
            unchunked computation holds its ``(rows, V)`` buffers for every row at once, so a
            chunk of ``fraction * rows`` rows holds ``fraction`` of their bytes.
        max_bytes: the most bytes the buffers of one chunk may hold, whatever ``rows`` is.
        min_rows: the fewest rows per chunk (it wins over the two bounds above): below it the
            per-chunk costs (e.g. the ``(V, H)`` read-modify-write of ``grad_weight`` in an
            update of inner dimension ``rows``) dominate.
    """

    fraction: float | None
    max_bytes: int
    min_rows: int


#: The logits functions' budget: 32 MiB of float32 per chunk (their ``(rows, V)`` input exists
#: already, so the chunk is a fixed extra, not a share of it).
LOGITS_BUDGET = ChunkBudget(fraction=None, max_bytes=4 * DEFAULT_CHUNK_ELEMENTS, min_rows=1)


def chunk_rows(
    row_bytes: int, *, rows: int | None = None, budget: ChunkBudget = LOGITS_BUDGET
) -> int:
    r"""The chunk-size policy: the most rows per chunk whose buffers fit ``budget``.

    .. math::

        \text{chunk} = \min\Big(\max\big(\min(\lfloor f R \rfloor,
            \lfloor M / b \rfloor),\ m\big),\ \max(R, 1)\Big)

    with ``f`` = ``budget.fraction`` (the term is dropped when it or ``rows`` is None), ``M`` =
    ``budget.max_bytes``, ``m`` = ``budget.min_rows``, ``b`` = ``row_bytes`` and ``R`` = ``rows``.

    Args:
        row_bytes: bytes of one row of the chunk's buffers (e.g. ``4 V`` for one float32 row of
            logits); 0 counts as 1.
        rows: the number of rows to process (N), or None when unknown (no share term, no cap).
        budget: the :class:`ChunkBudget`.

    Returns:
        Rows per chunk, at least 1.

    Examples:
        >>> chunk_rows(4 * 32000)  # the logits functions: 32 MiB of float32
        262
        >>> chunk_rows(4 * 32000, rows=8192, budget=ChunkBudget(1 / 16, 1 << 26, 256))
        512
    """
    allowed = budget.max_bytes // max(row_bytes, 1)
    if budget.fraction is not None and rows is not None:
        allowed = min(allowed, int(budget.fraction * rows))
    allowed = max(allowed, budget.min_rows, 1)
    return allowed if rows is None else min(allowed, max(rows, 1))


def resolve_chunk_size(chunk_size: int | None, *, row_width: int, name: str = "chunk_size") -> int:
    """Validate a ``chunk_size`` (rows per chunk) argument, or pick the default.

    Args:
        chunk_size: a positive Python int, or None for the default :func:`chunk_rows`
            (about 32 MiB of float32 logits per chunk; e.g. 262 rows at V = 32000, 55 rows at
            V = 152064). On a GPU, larger chunks trade memory for fewer kernel launches:
            measured on an H200 (bf16, N = 16384, V = 152064, token_log_probs forward +
            backward), 55 rows took 73 ms with 0.11 GiB of chunk memory, 220 rows 54 ms with
            0.44 GiB.
        row_width: elements per row of the chunked tensor (V for logits).
        name: argument name used in error messages.

    Returns:
        The number of rows per chunk (>= 1).

    Raises:
        TypeError: if ``chunk_size`` is not an int (bools and tensors are rejected).
        ValueError: if ``chunk_size < 1``.
    """
    if chunk_size is None:
        return chunk_rows(4 * max(row_width, 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(
            f"{name} must be a positive int (rows per chunk) or None, "
            f"got {type(chunk_size).__name__} ({chunk_size!r})"
        )
    if chunk_size < 1:
        raise ValueError(f"{name} must be >= 1 (rows per chunk), got {chunk_size}")
    return chunk_size


def row_chunks(num_rows: int, chunk_size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` row ranges of a chunked loop over ``num_rows`` rows.

    Static Python ints only, so a loop over the result unrolls under ``torch.compile``. The
    last chunk is shorter when ``chunk_size`` does not divide ``num_rows``; zero rows give an
    empty list.

    Examples:
        >>> row_chunks(5, 2)
        [(0, 2), (2, 4), (4, 5)]
    """
    return [(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]


def flat_rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` ``(..., V)`` viewed as ``(rows, V)`` without a copy, or None if impossible.

    Decided from the static sizes and strides (no exception handling, traceable).
    """
    if tensor.ndim == 2:
        return tensor
    sizes, strides = tensor.shape[:-1], tensor.stride()[:-1]
    expected = strides[-1]
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return None
        expected = stride * size if size != 1 else expected
    return tensor.view(-1, tensor.shape[-1])


def block_rows(leading_shape: Sequence[int], chunk_size: int, *, flat: bool) -> list[Block]:
    """The blocks of a chunked loop over the leading dimensions ``leading_shape``.

    Args:
        leading_shape: ``(N,)``, or ``(B, T)`` for a 3-D tensor.
        chunk_size: rows per block.
        flat: whether the rows form one flat axis (``(N,)``, or a flattenable 3-D tensor whose
            leading dimensions the caller has flattened); otherwise blocks stay within one of
            the B rows.
    """
    if flat or len(leading_shape) == 1:
        total = 1
        for size in leading_shape:
            total *= size
        return [(slice(start, end),) for start, end in row_chunks(total, chunk_size)]
    batch, tokens = leading_shape
    return [
        (row, slice(start, end))
        for row in range(batch)
        for start, end in row_chunks(tokens, chunk_size)
    ]


def run_blocks(
    blocks: Sequence[Block],
    step: Callable[[Block], Sequence[torch.Tensor]],
    outputs: Sequence[torch.Tensor],
) -> None:
    """The chunk-loop driver: ``outputs[k][block] = step(block)[k]`` for every block.

    Args:
        blocks: from :func:`block_rows`.
        step: the per-block function (a forward or a backward step); it may also accumulate
            into buffers it holds (e.g. ``grad_weight``), in block order.
        outputs: preallocated per-row outputs, indexed by the same blocks as the input.
    """
    for block in blocks:
        results = step(block)
        for output, result in zip(outputs, results, strict=True):
            output[block] = result
