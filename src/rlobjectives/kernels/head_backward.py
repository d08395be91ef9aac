r"""Gradients of the hidden-state log-probabilities / entropy with recomputed logits.

With per-row incoming gradients :math:`g_\ell` (of the log-probabilities) and :math:`g_H` (of the
entropy), the gradient of the logits is

.. math::

    \frac{\partial L}{\partial z_{nv}} = \frac{\partial x_{nv}}{\partial z_{nv}}\Big(
        g_{\ell,n} (\mathbb{1}[v = y_n] - p_{nv}) - g_{H,n}\, p_{nv} (\log p_{nv} + H_n)\Big),

with :math:`\partial x / \partial z = s(1 - t^2)/\tau` the logit transform's derivative
(:math:`s/\tau` without a softcap) and :math:`p = e^{x - \mathrm{lse}}` recomputed from the
saved ``lse`` (zero at ``-inf`` logits, and :math:`p \log p = 0` there). Scheme, per
vocabulary chunk ``[v0, v0 + C)``:

1. ``grad_logits_kernel`` recomputes the chunk's logits tile by tile (``tl.dot``) and writes
   :math:`\partial L / \partial z` for the chunk, ``(N, C)`` in the input dtype (16-bit inputs:
   rounded once, as autograd rounds the logits' gradient), plus float32 partial column sums
   for the bias gradient;
2. ``grad_weight[v0:v0+C] = dZ^T @ hidden`` (``matmul_kernel``, float32 accumulation over all
   rows in registers, written once in the weight's dtype; masked rows of ``hidden`` are never
   read);
3. ``grad_hidden += dZ @ weight[v0:v0+C]`` (float32 accumulation; across chunks in a float32
   ``(N, H)`` buffer unless the input is float32 or there is a single chunk).

Why this scheme and not one program per vocabulary block holding ``grad_weight`` rows in
registers: at ``H = 4096`` a ``(BLOCK_V, H)`` float32 accumulator is 1-2 MiB, far beyond a
multiprocessor's registers (256 KiB), and splitting ``H`` across programs would recompute the
logits ``H / BLOCK_H`` times. Materialising ``dZ`` one bounded chunk at a time keeps the logits
recompute at one pass, makes both gradient products plain GEMMs with one write each (no
atomics, deterministic), and bounds the extra memory by ``chunk_bytes`` plus the float32
``grad_hidden`` accumulator.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import grid_blocks, mask_bytes, on_tensor_device
from .head_forward import (
    HeadBlocks,
    LogitOptions,
    check_head,
    checked_options,
    dot_precision,
    head_blocks,
)
from .loading import interpreted, kernels

__all__ = ["LMHeadGradients", "lm_head_backward", "vocab_chunk"]

_MIN_CHUNK_BYTES = 64 * 2**20
_GROUP = 8  # row tiles per group of the grouped tile order (L2 reuse)


class LMHeadGradients(NamedTuple):
    """Gradients of :func:`lm_head_backward` (None where not requested).

    Attributes:
        hidden: ``(N, H)`` in hidden's dtype (zero rows where masked).
        weight: ``(V, H)`` in weight's dtype.
        bias: ``(V,)`` in the bias's dtype.
    """

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def vocab_chunk(rows: int, width: int, vocab: int, element_bytes: int, tile: int,
                chunk_bytes: int | None) -> int:  # fmt: skip
    """Vocabulary entries per chunk: ``chunk_bytes`` of ``dZ`` (default ``max(64 MiB, N H e)``).

    Rounded down to a multiple of ``tile`` (at least one tile, at most ``V``).
    """
    budget = (
        chunk_bytes
        if chunk_bytes is not None
        else max(_MIN_CHUNK_BYTES, rows * width * element_bytes)
    )
    entries = budget // max(rows * element_bytes, 1)
    entries = max(tile, entries // tile * tile)
    return min(entries, vocab)


def _matmul(
    module: object, a: torch.Tensor, a_strides: tuple[int, int], b: torch.Tensor,
    b_strides: tuple[int, int], out: torch.Tensor, sizes: tuple[int, int, int], *,
    accumulator: torch.Tensor | None = None, k_mask: torch.Tensor | None = None,
    tiles: HeadBlocks, precision: str, upcast: bool,
) -> None:  # fmt: skip
    """Launch ``out = a @ b (+ accumulator)`` (``sizes = (m, n, k)``, out row-major)."""
    m, n, k = sizes
    grid = (grid_blocks(m, tiles.rows) * grid_blocks(n, tiles.vocab),)
    module.matmul_kernel[grid](  # type: ignore[attr-defined]
        a, b, out, accumulator, k_mask, m, n, k, *a_strides, *b_strides, out.stride(0), 1,
        ACCUMULATE=accumulator is not None, HAS_K_MASK=k_mask is not None,
        PRECISION=precision, UPCAST=upcast,
        BLOCK_M=tiles.rows, BLOCK_N=tiles.vocab, BLOCK_K=tiles.depth, GROUP=_GROUP,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip


@on_tensor_device
def lm_head_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    lse: torch.Tensor,
    grad_log_probs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    need_hidden: bool = True,
    need_weight: bool = True,
    need_bias: bool = False,
    chunk_bytes: int | None = None,
    blocks: HeadBlocks | None = None,
    options: LogitOptions | None = None,
) -> LMHeadGradients:
    r"""Recompute logits chunk by chunk and form the requested gradients (module docstring).

    Args:
        hidden: ``(N, H)``, as :func:`~._lm_head_forward.lm_head_forward`.
        weight: ``(V, H)``.
        tokens: ``(N,)`` int ids.
        mask: ``(N,)`` bool.
        lse: ``(N,)`` float32 saved by the forward.
        grad_log_probs: ``(N,)`` :math:`g_\ell` (float32; ignored at masked rows).
        entropy: ``(N,)`` float32 saved entropy (needed with ``grad_entropy``).
        grad_entropy: ``(N,)`` :math:`g_H`, or None.
        bias: optional ``(V,)``.
        temperature: :math:`\tau`.
        need_hidden: form ``grad_hidden``.
        need_weight: form ``grad_weight``.
        need_bias: form ``grad_bias`` (with a bias).
        chunk_bytes: memory of one ``dZ`` chunk (default ``max(64 MiB, N * H * element)``).
        blocks: tile sizes (default :func:`head_blocks`).
        options: the logit scale, softcap, per-row temperature and rounding of the forward.

    Returns:
        :class:`LMHeadGradients`. No host synchronisation; inputs are not modified.
    """
    hidden, weight, tokens, mask, bias = check_head(hidden, weight, tokens, mask, bias)
    options = checked_options(options, hidden)
    inverse, inv_temperature, scale, softcap = options.arguments(temperature)
    device, dtype = hidden.device, hidden.dtype
    (rows, width), vocab = hidden.shape, weight.shape[0]
    need_bias = need_bias and bias is not None
    empty = rows == 0 or vocab == 0
    allocate = torch.zeros_like if empty else torch.empty_like  # every element is written once
    grad_weight = allocate(weight) if need_weight else None
    grad_hidden = allocate(hidden) if need_hidden else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_bias else None
    if empty or not (need_hidden or need_weight or need_bias):
        return _finish(grad_hidden, grad_weight, grad_bias, bias)
    tiles = blocks or head_blocks(device, dtype)
    chunk = vocab_chunk(rows, width, vocab, hidden.element_size(), tiles.vocab, chunk_bytes)
    chunks = grid_blocks(vocab, chunk)
    accumulator = None
    if need_hidden and dtype != torch.float32 and chunks > 1:
        accumulator = torch.empty((rows, width), dtype=torch.float32, device=device)
    module = kernels(device).lm_head
    precision, upcast = dot_precision(dtype), interpreted(device)
    buffer = torch.empty(rows * chunk, dtype=dtype, device=device)
    row_blocks = grid_blocks(rows, tiles.rows)
    bias_partial = torch.empty(row_blocks * chunk, dtype=torch.float32, device=device)
    flags = mask_bytes(mask)
    with_entropy = grad_entropy is not None
    for index, start in enumerate(range(0, vocab, chunk)):
        size = min(chunk, vocab - start)
        grad_logits = buffer[: rows * size].view(rows, size)
        module.grad_logits_kernel[(row_blocks * grid_blocks(size, tiles.vocab),)](
            hidden, weight, bias, tokens, flags, lse, entropy if with_entropy else None,
            grad_log_probs, grad_entropy, grad_logits, bias_partial, inverse,
            rows, vocab, width, start, size, hidden.stride(0), weight.stride(0), inv_temperature,
            scale, softcap,
            HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=with_entropy, NEED_BIAS=need_bias,
            **options.flags(),
            PRECISION=precision, UPCAST=upcast,
            BLOCK_N=tiles.rows, BLOCK_V=tiles.vocab, BLOCK_H=tiles.depth, GROUP=_GROUP,
            num_warps=tiles.warps, num_stages=tiles.stages,
        )  # fmt: skip
        if grad_weight is not None:
            _matmul(
                module, grad_logits, (1, size), hidden, (hidden.stride(0), 1),
                grad_weight[start : start + size], (size, width, rows), k_mask=flags,
                tiles=tiles, precision=precision, upcast=upcast,
            )  # fmt: skip
        if grad_hidden is not None:
            last = index == chunks - 1
            target = grad_hidden if accumulator is None or last else accumulator
            previous = (
                None if index == 0 else (accumulator if accumulator is not None else grad_hidden)
            )
            _matmul(
                module, grad_logits, (size, 1), weight[start:], (weight.stride(0), 1),
                target, (rows, width, size), accumulator=previous,
                tiles=tiles, precision=precision, upcast=upcast,
            )  # fmt: skip
        if grad_bias is not None:
            partial = bias_partial[: row_blocks * size].view(row_blocks, size)
            grad_bias[start : start + size] = partial.sum(dim=0)
    return _finish(grad_hidden, grad_weight, grad_bias, bias)


def _finish(
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> LMHeadGradients:
    cast_bias = None if grad_bias is None or bias is None else grad_bias.to(bias.dtype)
    return LMHeadGradients(grad_hidden, grad_weight, cast_bias)
