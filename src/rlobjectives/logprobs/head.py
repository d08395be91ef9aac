"""The LM head of the hidden-state functions: validated arguments, chunk size and chunk buffers.

:func:`prepare_head` validates ``hidden`` ``(B, T, H)`` (packed: ``(N, H)``), ``weight``
``(V, H)``, ``bias``, the token ids, the temperature and the chunk size once, into a
:class:`Head` of flat tensors. The ``(N, V)`` logits ``hidden @ weight.T + bias`` are never formed
whole: every pass (:mod:`rlobjectives.logprobs.passes`, :mod:`rlobjectives.logprobs.fused_linear`)
works chunk by chunk in one :class:`ChunkBuffers` (one ``(chunk, V)`` block in the computation
dtype, plus one in the weight's dtype for bf16/fp16 heads and a few rows of scratch for the
entropy), sized by :data:`HEAD_BUDGET` unless ``chunk_size`` is given, with the per-chunk
helpers they share (:func:`chunk_scores`, :func:`softmax_`, :func:`select_rows`, the gradient
accumulators :class:`Grads`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.chunking import (
    Block,
    ChunkBudget,
    chunk_rows,
    resolve_chunk_size,
)
from .._core.layout import token_matrix
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    as_token_ids,
    check_same_device,
    check_shape,
    compute_dtype,
    describe,
    validate_scalar,
)
from .truncation import KeptOptions, KeptSet, Restriction, restriction_of
from .vocab_parallel import Shard

__all__ = [
    "ChunkBuffers",
    "Grads",
    "HEAD_BUDGET",
    "Head",
    "SCRATCH_ELEMENTS",
    "accumulate_grads",
    "chunk_row_bytes",
    "chunk_scores",
    "default_chunk_size",
    "finish_grads",
    "new_buffers",
    "new_grads",
    "prepare_head",
    "scratch_rows",
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
    """The validated LM head and token ids, flattened to rows.

    Under vocabulary parallelism ``weight`` and ``bias`` are this rank's rows (``shard``) and
    ``tokens`` stay global; ``kept`` is the sampler's kept set
    (:mod:`rlobjectives.logprobs.truncation`).
    """

    hidden: torch.Tensor  # (N, H), original dtype
    weight: torch.Tensor  # (V, H), same dtype as hidden
    bias: torch.Tensor | None  # (V,)
    tokens: torch.Tensor  # (N,) int64
    inv_temperature: float
    chunk_size: int
    dtype: torch.dtype  # computation dtype of the log-softmax (float32 or float64)
    shard: Shard | None = None
    kept: KeptSet | None = None


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


#: Elements of the scratch block of :func:`entropy_stats_` / :func:`entropy_logit_grads_`: a
#: few rows (2**17 float32 values = 512 KiB) whose probabilities stay in cache while used.
SCRATCH_ELEMENTS = 1 << 17


def scratch_rows(width: int) -> int:
    """Rows of the scratch block for rows of ``width`` values: ``max(1, 2**17 // width)``."""
    return max(1, SCRATCH_ELEMENTS // max(width, 1))


def _check_floating(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {describe(value)}")
    return value


def _check_weight(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must have shape (V, H) with H = {hidden.shape[2]} from hidden, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError(
            f"weight must have V >= 1 rows (the vocabulary), got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight must have the dtype of hidden ({hidden.dtype}), got dtype {weight.dtype}"
        )
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must have shape ({weight.shape[0]},) and dtype {weight.dtype} like weight, "
            f"got shape {tuple(bias.shape)} and dtype {bias.dtype}"
        )


def _hidden_matrix(hidden: torch.Tensor, packed: bool) -> torch.Tensor:
    """``(B, T, H)``; packed: ``(N, H)`` or ``(1, N, H)`` as ``(1, N, H)``."""
    if packed and hidden.ndim == 2:
        return hidden.unsqueeze(0)
    if hidden.ndim == 3 and (not packed or hidden.shape[0] == 1):
        return hidden
    expected = (
        "(N, H) or (1, N, H) (packed: cu_seqlens given)"
        if packed
        else ("(B, T, H) (3 dimensions), or (N, H) with cu_seqlens (packed sequences)")
    )
    raise ValueError(f"hidden must have shape {expected}, got shape {tuple(hidden.shape)}")


def _restriction(
    options: KeptOptions | None,
    batch_shape: tuple[int, int],
    weight: torch.Tensor,
    packed: bool,
) -> Restriction | None:
    """The vocabulary slice and kept set; None for a plain call (nothing else runs then)."""
    if options is None:
        return None
    vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p = options
    plain = vocab_group is None and kept_ids is None and kept_mask is None
    if plain and top_k is None and top_p is None and type(kept_pad) is int:
        return None
    return restriction_of(
        options,
        shape=batch_shape,
        vocab=weight.shape[0],
        device=weight.device,
        reference="weight",
        packed=packed,
    )


def prepare_head(
    hidden: object,
    weight: object,
    tokens: ArrayLike,
    bias: object,
    temperature: float,
    chunk_size: int | None,
    *,
    packed: bool = False,
    options: KeptOptions | None = None,
) -> tuple[Head, tuple[int, int]]:
    """Validate the hidden states, LM head and token ids; flatten to ``(N, H)`` / ``(N,)``.

    ``packed``: hidden ``(N, H)`` / ``(1, N, H)`` and tokens ``(N,)`` / ``(1, N)``, whose
    ``batch_shape`` is ``(1, N)``. ``options``: ``(vocab_group, kept_ids, kept_pad, kept_mask,
    top_k, top_p)`` (:class:`~rlobjectives.logprobs.truncation.KeptOptions`).
    """
    hidden_t = _hidden_matrix(_check_floating(hidden, "hidden"), packed)
    if hidden_t.shape[2] < 1:
        raise ValueError(
            f"hidden must have a hidden size H >= 1, got shape {tuple(hidden_t.shape)}"
        )
    weight_t = _check_floating(weight, "weight")
    bias_t = None if bias is None else _check_floating(bias, "bias")
    _check_weight(hidden_t, weight_t, bias_t)
    tokens_t = as_token_ids(tokens, "tokens", hidden_t.device)
    if packed:
        tokens_t = token_matrix(tokens_t, "tokens", packed)
    tensors = {"hidden": hidden_t, "weight": weight_t, "tokens": tokens_t}
    check_same_device(tensors if bias_t is None else {**tensors, "bias": bias_t})
    batch_shape = (hidden_t.shape[0], hidden_t.shape[1])
    check_shape(tokens_t, "tokens", batch_shape, "hidden[..., 0]")
    tau = validate_scalar(temperature, "temperature", minimum=0.0, strict=True, allow_tensor=False)
    restriction = _restriction(options, batch_shape, weight_t, packed)
    shard = None if restriction is None else restriction.shard
    kept = None if restriction is None else restriction.kept
    if chunk_size is None:
        vocab = weight_t.shape[0]
        if shard is not None and kept is not None and kept.rule:  # collectives per chunk:
            vocab = shard.largest()  # the same chunks on every rank
        rows = default_chunk_size(vocab, hidden_t.shape[0] * hidden_t.shape[1], weight_t.dtype)
    else:
        rows = resolve_chunk_size(chunk_size, row_width=weight_t.shape[0])
    head = Head(
        hidden=hidden_t.reshape(-1, hidden_t.shape[2]),
        weight=weight_t,
        bias=bias_t,
        tokens=tokens_t.reshape(-1).long(),
        inv_temperature=1.0 / float(tau),
        chunk_size=rows,
        dtype=compute_dtype(hidden_t),
        shard=shard,
        kept=kept,
    )
    return head, batch_shape
