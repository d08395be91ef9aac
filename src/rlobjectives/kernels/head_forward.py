r"""Log-probabilities (and entropy) of the sampled tokens from hidden states and the LM head.

The Cut Cross-Entropy approach: :math:`z = (h W^\top + b) / \tau` is formed tile by tile in
registers and folded into an online log-sum-exp; no ``(rows, V)`` block of logits is ever
written to memory. The forward keeps only the per-row ``lse`` (and entropy) in float32, which is
all the backward (:mod:`._lm_head_backward`) needs to recompute the probabilities.

.. math::

    \ell_n = z_{n, y_n} - \mathrm{lse}_n, \qquad
    H_n = \mathrm{lse}_n - \sum_v p_{nv} z_{nv} \quad (\text{as } \log s - t / s
    \text{ relative to the running max, no cancellation at large logits}).

The vocabulary is split over ``splits`` programs per row block when the row blocks alone would
not fill the GPU; a second small kernel merges the splits.

Under vocabulary parallelism (:func:`lm_head_slice_stats`) the weight rows are a rank's
slice: the partial kernel runs on them and the splits are merged in PyTorch into the slice's
``(lse_r, h_r, z_y)``; the caller combines those over the ranks (no collective runs here).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import KERNEL_DTYPES, check_mask, grid_blocks, mask_bytes, on_tensor_device
from .loading import interpreted, kernels

__all__ = [
    "HeadBlocks",
    "LogitOptions",
    "SliceStats",
    "LMHeadForward",
    "checked_options",
    "dot_precision",
    "head_blocks",
    "lm_head_forward",
    "lm_head_slice_stats",
]


class HeadBlocks(NamedTuple):
    """Tile sizes (powers of two, at least 16 for ``tl.dot``) and launch options.

    Attributes:
        rows: rows per tile (``BLOCK_N``).
        vocab: vocabulary entries per tile (``BLOCK_V``).
        depth: hidden width per ``tl.dot`` step (``BLOCK_H``).
        warps: ``num_warps``.
        stages: ``num_stages`` (software pipelining depth).
    """

    rows: int
    vocab: int
    depth: int
    warps: int = 4
    stages: int = 2


def head_blocks(device: torch.device, dtype: torch.dtype) -> HeadBlocks:
    """Default tiles: small under the interpreter, GEMM-sized on CUDA (16-bit vs float32)."""
    if interpreted(device):
        return HeadBlocks(16, 16, 16)
    if dtype == torch.float32:
        return HeadBlocks(64, 64, 32, warps=4, stages=3)
    return HeadBlocks(128, 128, 64, warps=8, stages=3)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: float32 follows ``torch.get_float32_matmul_precision``.

    ``"highest"`` (PyTorch's default) gives ``"ieee"`` (true float32 products); ``"high"`` /
    ``"medium"`` allow TF32 as ``torch.matmul`` would. 16-bit inputs are exact either way.
    """
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


class LogitOptions(NamedTuple):
    r"""The logit transform and the product's precision of a launch.

    Attributes:
        scale: :math:`s` (``logit_scale``).
        softcap: :math:`c` (``final_logit_softcapping``), or None.
        inverse: ``(N,)`` float32 per-row :math:`1/\tau`, or None (then ``temperature``).
        round_product: round the float32 product to the input dtype first (``fp32_head=False``).
    """

    scale: float = 1.0
    softcap: float | None = None
    inverse: torch.Tensor | None = None
    round_product: bool = False

    def arguments(self, temperature: float) -> tuple[object, float, float, float]:
        """``(inverse_ptr, inv_temperature, scale, softcap)`` of the kernels."""
        return self.inverse, 1.0 / temperature, self.scale, self.softcap or 1.0

    def flags(self) -> dict[str, bool]:
        """The constexpr flags of the kernels."""
        return {
            "HAS_SOFTCAP": self.softcap is not None,
            "ROW_TEMPERATURE": self.inverse is not None,
            "ROUND": self.round_product,
        }


class LMHeadForward(NamedTuple):
    r"""Result of :func:`lm_head_forward` (all float32, zeros at masked rows).

    Attributes:
        log_probs: ``(N,)`` :math:`\ell_n`.
        entropy: ``(N,)`` :math:`H_n`, or None without ``with_entropy``.
        lse: ``(N,)`` log-normaliser :math:`\mathrm{lse}_n` (saved for the backward).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor


def check_head(
    hidden: object,
    weight: object,
    tokens: object,
    mask: object,
    bias: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate ``hidden (N, H)``, ``weight (V, H)``, ``tokens (N,)``, ``mask``, ``bias (V,)``.

    Returns the tensors with unit stride on their last dimension (copies only if needed).

    Raises:
        TypeError / ValueError: naming the argument, on a dtype, shape or device mismatch.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in KERNEL_DTYPES:
        raise TypeError("hidden must be a float16, bfloat16 or float32 tensor")
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be (N, H), got shape {tuple(hidden.shape)}")
    rows, width = hidden.shape
    device = hidden.device
    if not isinstance(weight, torch.Tensor) or weight.dtype != hidden.dtype:
        raise TypeError(f"weight must be a tensor of hidden's dtype {hidden.dtype}")
    if weight.ndim != 2 or weight.shape[1] != width or weight.device != device:
        raise ValueError(f"weight must be (V, {width}) on {device}, got {tuple(weight.shape)}")
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError("tokens must be an int32 or int64 tensor")
    if tuple(tokens.shape) != (rows,) or tokens.device != device:
        raise ValueError(f"tokens must be ({rows},) on {device}, got {tuple(tokens.shape)}")
    mask_t = check_mask(mask, rows, device)
    if bias is not None and (
        not isinstance(bias, torch.Tensor)
        or bias.dtype != hidden.dtype
        or tuple(bias.shape) != (weight.shape[0],)
        or bias.device != device
    ):
        raise ValueError(f"bias must be ({weight.shape[0]},) of dtype {hidden.dtype} on {device}")

    def unit(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.stride(-1) == 1 else tensor.contiguous()

    return unit(hidden), unit(weight), tokens.contiguous(), mask_t, bias


def checked_options(options: LogitOptions | None, hidden: torch.Tensor) -> LogitOptions:
    """``options`` (default: none), a per-row inverse temperature as contiguous ``(N,)`` float32.

    Raises:
        ValueError: a per-row inverse temperature of another shape or device.
    """
    options = options or LogitOptions()
    inverse = options.inverse
    if inverse is None:
        return options
    if tuple(inverse.shape) != (hidden.shape[0],) or inverse.device != hidden.device:
        raise ValueError(
            f"options.inverse must be ({hidden.shape[0]},) on {hidden.device}, got "
            f"{tuple(inverse.shape)} on {inverse.device}"
        )
    return options._replace(inverse=inverse.to(torch.float32).contiguous())


def _splits(device: torch.device, row_blocks: int, vocab_blocks: int) -> int:
    """Vocabulary splits so that about two programs per multiprocessor exist."""
    if device.type != "cuda" or interpreted(device):
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-2 * processors // max(row_blocks, 1))
    return max(1, min(wanted, vocab_blocks))


@on_tensor_device
def lm_head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    blocks: HeadBlocks | None = None,
    splits: int | None = None,
    options: LogitOptions | None = None,
) -> LMHeadForward:
    r"""Two launches: partial online log-sum-exp per (row block, split), then the merge.

    Args:
        hidden: ``(N, H)`` hidden states (fp16/bf16/fp32); masked rows are never read.
        weight: ``(V, H)`` LM-head weight, hidden's dtype.
        tokens: ``(N,)`` int32/int64 sampled ids (any value at masked rows).
        mask: ``(N,)`` bool; True selects the row.
        bias: optional ``(V,)``; ``-inf`` entries ban tokens.
        temperature: :math:`\tau > 0` (Python number; ``options.inverse`` overrides it).
        with_entropy: also compute :math:`H_n`.
        blocks: tile sizes (default :func:`head_blocks`).
        splits: vocabulary splits per row block (default: fill the GPU; 1 on CPU).
        options: the logit scale, softcap, per-row temperature and the product's rounding.

    Returns:
        :class:`LMHeadForward`. No host synchronisation; inputs are not modified.
    """
    hidden, weight, tokens, mask, bias = check_head(hidden, weight, tokens, mask, bias)
    options = checked_options(options, hidden)
    zeros = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    if hidden.shape[0] == 0 or weight.shape[0] == 0:
        return LMHeadForward(zeros, zeros.clone() if with_entropy else None, zeros.clone())
    partial, flags = _partials(
        (hidden, weight, tokens, mask, bias), temperature, with_entropy, blocks, splits, options
    )
    lse = torch.empty_like(zeros)
    log_probs = torch.empty_like(zeros)
    entropy = torch.empty_like(zeros) if with_entropy else None
    block = 1024
    kernels(hidden.device).lm_head.lse_combine_kernel[(grid_blocks(hidden.shape[0], block),)](
        partial[0], partial[1], partial[2], partial[3], flags, lse, log_probs, entropy,
        hidden.shape[0], partial.shape[1], WITH_ENTROPY=with_entropy, BLOCK=block,
    )  # fmt: skip
    return LMHeadForward(log_probs, entropy, lse)


def _partials(
    head: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    temperature: float,
    with_entropy: bool,
    blocks: HeadBlocks | None,
    splits: int | None,
    options: LogitOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, flags)``: the ``(4, splits, N)`` running ``(m, s, t, z_y)``, the mask bytes."""
    hidden, weight, tokens, mask, bias = head
    device = hidden.device
    rows, width = hidden.shape
    vocab = weight.shape[0]
    tiles = blocks or head_blocks(device, hidden.dtype)
    row_blocks = grid_blocks(rows, tiles.rows)
    vocab_blocks = grid_blocks(vocab, tiles.vocab)
    count = splits or _splits(device, row_blocks, vocab_blocks)
    split_size = grid_blocks(vocab_blocks, count) * tiles.vocab
    count = grid_blocks(vocab, split_size)
    partial = torch.empty((4, count, rows), dtype=torch.float32, device=device)
    module = kernels(device).lm_head
    flags = mask_bytes(mask)
    inverse, inv_temperature, scale, softcap = options.arguments(temperature)
    module.lse_partial_kernel[(row_blocks, count)](
        hidden, weight, bias, tokens, flags, partial[0], partial[1], partial[2], partial[3],
        inverse, rows, vocab, width, split_size, hidden.stride(0), weight.stride(0),
        inv_temperature, scale, softcap,
        HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, **options.flags(),
        PRECISION=dot_precision(hidden.dtype), UPCAST=interpreted(device),
        BLOCK_N=tiles.rows, BLOCK_V=tiles.vocab, BLOCK_H=tiles.depth,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    return partial, flags


def _slice_stats(
    partial: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""The slice's ``(lse_r, h_r, z_y)`` from the splits' running statistics (PyTorch).

    The merge of ``lse_combine_kernel``: :math:`M = \max_j m_j`, :math:`s = \sum_j e^{m_j - M}
    s_j`, :math:`t = \sum_j e^{m_j - M}(t_j + (m_j - M) s_j)`; ``lse_r = M + log s``, ``h_r =
    log s - t / s`` (``-inf`` and 0 for a slice with no finite logit in the row).
    """
    maximum, total, moment, target = partial  # (splits, N) each
    overall = maximum.amax(dim=0)  # (N,)
    shift = torch.where(overall == -torch.inf, 0.0, overall)
    rescale = torch.exp(maximum - shift)  # (splits, N), 0 for an empty split
    summed = (rescale * total).sum(dim=0)  # (N,)
    log_total = torch.log(summed)
    entropy = None
    if with_entropy:
        offset = torch.where(maximum == -torch.inf, 0.0, maximum - shift)
        moments = (rescale * (moment + offset * total)).sum(dim=0)
        entropy = torch.where(summed > 0, log_total - moments / summed, 0.0)
    return shift + log_total, entropy, target.sum(dim=0)


class SliceStats(NamedTuple):
    """One vocabulary slice's per-row statistics, ``(N,)`` float32 each."""

    log_normalizer: torch.Tensor  # lse_r of the slice (-inf for a row with no finite logit)
    entropy: torch.Tensor | None  # h_r, the slice's own entropy (None without with_entropy)
    target: torch.Tensor  # z_y where the slice holds the token, 0 elsewhere


@on_tensor_device
def lm_head_slice_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    blocks: HeadBlocks | None = None,
    splits: int | None = None,
    options: LogitOptions | None = None,
) -> SliceStats:
    """The statistics of ``weight``'s vocabulary slice, to be combined over the slices.

    ``tokens`` are ids local to the slice, -1 where the slice does not hold the token (the
    kernels never match -1). Rows outside ``mask`` are not read.
    """
    hidden, weight, tokens, mask, bias = check_head(hidden, weight, tokens, mask, bias)
    options = checked_options(options, hidden)
    rows = hidden.shape[0]
    if rows == 0:
        zeros = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        return SliceStats(zeros, zeros.clone() if with_entropy else None, zeros.clone())
    partial, _ = _partials(
        (hidden, weight, tokens, mask, bias), temperature, with_entropy, blocks, splits, options
    )
    return SliceStats(*_slice_stats(partial, with_entropy))
