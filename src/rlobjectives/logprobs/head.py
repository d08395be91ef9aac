r"""The LM head of the hidden-state functions: validated arguments, chunk size and chunk buffers.

:func:`prepare_head` validates ``hidden`` ``(B, T, H)`` (packed: ``(N, H)``), ``weight``
``(V, H)``, ``bias``, the token ids, the temperature and the chunk size once, into a
:class:`Head` of flat tensors. The ``(N, V)`` logits ``hidden @ weight.T + bias`` are never formed
whole: every pass (:mod:`rlobjectives.logprobs.passes`, :mod:`rlobjectives.logprobs.fused_linear`)
works chunk by chunk in one :class:`ChunkBuffers` (one ``(chunk, V)`` block in the computation
dtype, plus one in the weight's dtype for a bf16/fp16 head whose product is rounded to it
(``fp32_head=False``), one for the softcap's derivative and a few rows of scratch for the
entropy), sized by :data:`HEAD_BUDGET` unless ``chunk_size`` is given, with the per-chunk
helpers they share (:func:`chunk_scores`, :func:`softmax_`, :func:`select_rows`, the gradient
accumulators :class:`Grads`).

**The product's precision.** From bf16/fp16 hidden states and weight the product
:math:`h W^\top + b` is formed with float32 accumulation and a float32 result by default
(``fp32_head=True``; TRL's ``cast_lm_head_to_fp32=True``, prime-rl's
``enable_fp32_lm_head``): on CUDA by ``torch.mm(..., out_dtype=torch.float32)``, on other
devices in float32 arithmetic (the weight widened one vocabulary slice at a time, a few MiB).
``fp32_head=False`` rounds the product to the input dtype before the float32 softmax, as
``hidden @ weight.T`` does (TRL's default forward, vLLM's bf16 logits). The gradient products
accumulate in float32 either way; with ``fp32_head=True`` off CUDA they also read the float32
logits' gradient unrounded.

**The logit transform** (:class:`LogitTransform`): scale, then softcap, then temperature. The
trainers and the samplers do not take the softmax of the raw product :math:`z = h W^\top +
b`: Cohere multiplies it by ``logit_scale``, Granite and MiniCPM3 divide it by ``logits_scaling``,
Gemma 2 (and Gemma 3 when configured) caps it with ``final_logit_softcapping``, and the sampler
divides by its temperature. The functions of this package apply them in TRL's order
(``trl.kernels.ChunkedLogProbFunction``, ``_transform``):

.. math::

    x = \frac{\mathrm{cap}_c(s\,z)}{\tau}, \qquad
    \mathrm{cap}_c(u) = c \tanh(u / c) \ (c \text{ given}), \quad u \ (c = \text{None}),

with :math:`s` = ``logit_scale``, :math:`c` = ``final_logit_softcapping`` and :math:`\tau` =
``temperature`` (a number, or one value per token). Its derivative is, with :math:`t = \tanh(s z /
c)`,

.. math::

    \frac{\partial x}{\partial z} = \frac{s\,(1 - t^2)}{\tau} \quad (c \text{ given}), \qquad
    \frac{s}{\tau} \quad (c = \text{None}):

a per-row factor :math:`s/\tau` (:meth:`LogitTransform.row_factor`, folded into the per-row
coefficients of the closed-form gradients) times, with a softcap, the element-wise
:math:`1 - t^2` (:func:`softcap_derivative`), recovered from :math:`x` as
:math:`t = \mathrm{clamp}(x\tau/c, -1, 1)` (every path recovers it the same way, so the
recomputing, the saving and the fused paths give the same numbers; ``-inf`` outside a kept set
gives 0). A ``-inf`` logit (a banned token) becomes :math:`-c/\tau` under a softcap, as in the
peers' forward passes.

:func:`validate_transform` checks the three public arguments; a per-token temperature is
``(B, T)`` (padded) or ``(N,)`` / ``(1, N)`` (packed), any value where the row is not selected
(those rows use 1).
"""

from __future__ import annotations

import math
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
    as_mask,
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
    "PLAIN",
    "ChunkBuffers",
    "Grads",
    "HEAD_BUDGET",
    "Head",
    "HeadOptions",
    "LogitTransform",
    "Temperature",
    "SCRATCH_ELEMENTS",
    "accumulate_grads",
    "apply_transform_",
    "chunk_row_bytes",
    "casts_product",
    "chunk_product",
    "chunk_scores",
    "default_chunk_size",
    "finish_grads",
    "leads",
    "new_buffers",
    "new_grads",
    "prepare_head",
    "scratch_rows",
    "select_rows",
    "softcap_derivative",
    "softmax_",
    "transform_scores_",
    "validate_scale",
    "validate_softcap",
    "validate_transform",
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
    values in ``dtype`` for a low-precision head (its rounded product and its gradient's cast
    with ``fp32_head=False``; the bound the default chunk size is computed with).
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


# ---------------------------------------------------------------------------------------------
# The logit transform: scale, then softcap, then temperature
# ---------------------------------------------------------------------------------------------
#: A temperature argument: a positive number, or a per-token tensor.
Temperature = float | ArrayLike


class LogitTransform(NamedTuple):
    r"""A validated transform :math:`z \mapsto \mathrm{cap}_c(s z) / \tau` (module docstring).

    Attributes:
        scale: :math:`s` (``logit_scale``).
        softcap: :math:`c` (``final_logit_softcapping``), or None.
        inverse: :math:`1/\tau`: a Python float, or a per-row tensor in the computation dtype
            (1 at unselected rows) whose leading shape is that of the rows of the call (flat
            ``(N,)``, or the ``(B, T)`` of strided logits), indexed by the chunk's block.
    """

    scale: float = 1.0
    softcap: float | None = None
    inverse: float | torch.Tensor = 1.0

    @property
    def plain(self) -> bool:
        """Whether the transform is the identity (no scale, no softcap, temperature 1)."""
        return (
            self.scale == 1.0
            and self.softcap is None
            and not isinstance(self.inverse, torch.Tensor)
            and self.inverse == 1.0
        )

    @property
    def per_row(self) -> bool:
        """Whether the temperature is one value per token."""
        return isinstance(self.inverse, torch.Tensor)

    @property
    def leading(self) -> float:
        r"""The transform's first constant factor: :math:`s/c`, else :math:`s/\tau` (or :math:`s`).

        The number the product is multiplied by before anything else (the ``tanh``'s argument
        under a softcap; the whole transform with one temperature), which a GEMM can apply as
        its ``alpha`` (:func:`chunk_product`).
        """
        if self.softcap is not None:
            return self.scale / self.softcap
        if isinstance(self.inverse, torch.Tensor):
            return self.scale
        return self.scale * self.inverse

    def row_inverse(self, rows: object) -> float | torch.Tensor:
        r""":math:`1/\tau` of the rows ``rows`` (a block index): a float or an ``(n, 1)`` tensor."""
        if isinstance(self.inverse, torch.Tensor):
            return self.inverse[rows].reshape(-1, 1)  # type: ignore[index]
        return self.inverse

    def row_factor(self, rows: object) -> float | torch.Tensor:
        r""":math:`\partial x / \partial z` without the softcap's :math:`1 - t^2`: :math:`s/\tau`.

        A float, or an ``(n,)`` tensor for a per-token temperature.
        """
        inverse = self.row_inverse(rows)
        if isinstance(inverse, torch.Tensor):
            return inverse.reshape(-1) * self.scale
        return inverse * self.scale

    def flat(self) -> LogitTransform:
        """The transform with a per-token temperature flattened to ``(N,)`` rows."""
        if isinstance(self.inverse, torch.Tensor):
            return self._replace(inverse=self.inverse.reshape(-1))
        return self


#: The identity transform.
PLAIN = LogitTransform()


def apply_transform_(
    scores: torch.Tensor, transform: LogitTransform, rows: object, *, led: bool = False
) -> torch.Tensor:
    r"""``scores`` :math:`z` ``(n, V)`` becomes :math:`x = \mathrm{cap}_c(s z)/\tau`, in place.

    ``rows`` indexes the per-token temperature (the chunk's block); ``scores`` is in the
    computation dtype. ``led``: ``scores`` holds :math:`z` times
    :attr:`LogitTransform.leading` already. Returns ``scores``.
    """
    inverse = transform.row_inverse(rows)
    factor: float | torch.Tensor
    if transform.softcap is not None:
        if not led:
            scores.mul_(transform.leading)
        scores.tanh_()
        factor = inverse * transform.softcap
    elif led:  # what remains: a per-token 1/tau, or nothing
        factor = inverse if isinstance(inverse, torch.Tensor) else 1.0
    else:
        factor = inverse * transform.scale
    if isinstance(factor, torch.Tensor):
        scores.mul_(factor.to(scores.dtype))
    elif factor != 1.0:
        scores.mul_(factor)
    return scores


def softcap_derivative(
    scores: torch.Tensor, transform: LogitTransform, rows: object, out: torch.Tensor
) -> torch.Tensor:
    r""":math:`1 - t^2` with :math:`t = \mathrm{clamp}(x \tau / c, -1, 1)`, written into ``out``.

    ``scores`` are the transformed logits :math:`x` ``(n, V)`` (not modified); ``out`` an
    ``(n, V)`` buffer of their dtype. Only for a transform with a softcap. Formed as
    :math:`\max(1 - (\tau/c)^2 x^2, 0)` (equal in exact arithmetic: :math:`|t| \le 1` exactly
    where the clamp does nothing), two passes for one temperature (``-inf`` outside a kept set
    gives 0).
    """
    assert transform.softcap is not None
    inverse = transform.row_inverse(rows)
    rows_out = out[: scores.shape[0]]
    one = torch.ones((), dtype=scores.dtype, device=scores.device)
    if isinstance(inverse, torch.Tensor):
        torch.mul(scores, (1.0 / (inverse * transform.softcap)).to(scores.dtype), out=rows_out)
        torch.addcmul(one, rows_out, rows_out, value=-1.0, out=rows_out)
    else:
        factor = 1.0 / (inverse * transform.softcap)  # tau / c
        torch.addcmul(one, scores, scores, value=-(factor * factor), out=rows_out)
    return rows_out.clamp_(min=0.0)


def validate_softcap(
    final_logit_softcapping: object, name: str = "final_logit_softcapping"
) -> float | None:
    """A softcap :math:`c > 0` (a finite Python number), or None."""
    if final_logit_softcapping is None:
        return None
    value = validate_scalar(
        final_logit_softcapping,  # type: ignore[arg-type]
        name,
        minimum=0.0,
        strict=True,
        allow_tensor=False,
    )
    return float(value)


def validate_scale(logit_scale: object, name: str = "logit_scale") -> float:
    """A logit scale: a finite real Python number (0 kept, as TRL keeps it)."""
    value = validate_scalar(logit_scale, name, minimum=None, allow_tensor=False)  # type: ignore[arg-type]
    return float(value)


def _temperature_tensor(
    temperature: torch.Tensor,
    *,
    shape: tuple[int, ...],
    device: torch.device,
    packed: bool,
    reference: str,
) -> torch.Tensor:
    """Check a per-token temperature against the leading ``shape`` (packed: ``(N,)`` too)."""
    if temperature.is_complex() or not (
        temperature.is_floating_point() or temperature.dtype in _INTEGERS
    ):
        raise TypeError(
            "temperature must be a real number or a real per-token tensor, got "
            f"{describe(temperature)}"
        )
    if temperature.ndim == 0:
        raise TypeError(
            "temperature must be a real number (a Python number) or a per-token tensor of "
            f"shape {shape}, got a 0-d tensor {describe(temperature)}"
        )
    given = tuple(temperature.shape)
    if packed and len(shape) == 2 and shape[0] == 1 and given == (shape[1],):
        temperature = temperature.reshape(shape)
    elif given != tuple(shape):
        extra = f" or ({shape[1]},) (packed)" if packed and len(shape) == 2 else ""
        raise ValueError(
            f"temperature must be a number or a per-token tensor of shape {tuple(shape)}{extra} "
            f"(the shape of {reference}), got shape {given}"
        )
    if temperature.device != device:
        raise ValueError(
            f"temperature must be on the same device as {reference} ({device}), got device "
            f"{temperature.device}"
        )
    return temperature


_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def validate_transform(
    temperature: object,
    final_logit_softcapping: object = None,
    logit_scale: object = 1.0,
    *,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    active: torch.Tensor | None = None,
    packed: bool = False,
    reference: str = "tokens",
) -> LogitTransform:
    r"""Validate ``temperature``, ``final_logit_softcapping`` and ``logit_scale``.

    Args:
        temperature: :math:`\tau > 0`, a Python number, or a per-token tensor of the leading
            ``shape`` (packed: ``(N,)`` for a ``(1, N)`` shape); its values at selected tokens
            must be positive and finite (not checked on the device: a zero gives ``inf``/NaN
            that propagates, as any bad value at a selected token).
        final_logit_softcapping: :math:`c > 0`, or None.
        logit_scale: :math:`s`, a finite real number (TRL keeps 0 as given).
        shape: the leading shape of the per-token tensors of the call.
        device: the device of the call.
        dtype: the computation dtype (the per-token :math:`1/\tau` is formed in it).
        active: ``shape`` bool, the selected tokens (elsewhere :math:`1/\tau = 1`), or None.
        packed: accept ``(N,)`` for a ``(1, N)`` shape.
        reference: the argument that fixes ``shape`` (for the messages).

    Returns:
        The :class:`LogitTransform` (a per-token temperature as ``shape``).

    Raises:
        ValueError: a non-positive or non-finite number, a tensor of another shape or device.
        TypeError: a non-number, a bool, a 0-d or non-real tensor.
    """
    cap = validate_softcap(final_logit_softcapping)
    scale = validate_scale(logit_scale)
    if isinstance(temperature, torch.Tensor):
        tau = _temperature_tensor(
            temperature, shape=shape, device=device, packed=packed, reference=reference
        ).to(dtype)
        inverse = 1.0 / tau
        if active is not None:
            inverse = torch.where(active.reshape(shape), inverse, 1.0)
        return LogitTransform(scale, cap, inverse)
    if isinstance(temperature, (list, tuple)):
        raise TypeError(
            "temperature must be a real number or a per-token tensor (a torch.Tensor), got "
            f"{describe(temperature)}"
        )
    value = validate_scalar(
        temperature,  # type: ignore[arg-type]
        "temperature",
        minimum=0.0,
        strict=True,
        allow_tensor=False,
    )
    inverse_value = 1.0 / float(value)
    if not math.isfinite(inverse_value):
        raise ValueError(f"temperature must be > 0 with a finite inverse, got {temperature!r}")
    return LogitTransform(scale, cap, inverse_value)


class Head(NamedTuple):
    """The validated LM head and token ids, flattened to rows.

    Under vocabulary parallelism ``weight`` and ``bias`` are this rank's rows (``shard``) and
    ``tokens`` stay global; ``kept`` is the sampler's kept set
    (:mod:`rlobjectives.logprobs.truncation`); ``transform`` the logit transform (scale,
    softcap, temperature: :mod:`rlobjectives.logprobs.head`, a per-token temperature as
    ``(N,)`` rows); ``fp32`` whether a bf16/fp16 product is formed in float32.
    """

    hidden: torch.Tensor  # (N, H), original dtype
    weight: torch.Tensor  # (V, H), same dtype as hidden
    bias: torch.Tensor | None  # (V,)
    tokens: torch.Tensor  # (N,) int64
    transform: LogitTransform
    chunk_size: int
    dtype: torch.dtype  # computation dtype of the log-softmax (float32 or float64)
    shard: Shard | None = None
    kept: KeptSet | None = None
    fp32: bool = True

    @property
    def rounds_product(self) -> bool:
        """Whether the product is formed in the weight's (low-precision) dtype."""
        return self.weight.dtype in _LOW_PRECISION and not self.fp32


class HeadOptions(NamedTuple):
    """The head's transform arguments as the public functions take them."""

    final_logit_softcapping: object = None
    logit_scale: object = 1.0
    fp32_head: object = True


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
        head.rounds_product or head.weight.dtype not in _LOW_PRECISION
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
    scratch = min(rows, scratch_rows(vocab))
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
    vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p = options[:6]
    min_p = options[6] if len(options) > 6 else None  # type: ignore[misc]
    plain = vocab_group is None and kept_ids is None and kept_mask is None
    if plain and top_k is None and top_p is None and min_p is None and type(kept_pad) is int:
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
    temperature: object,
    chunk_size: int | None,
    *,
    packed: bool = False,
    options: KeptOptions | None = None,
    head_options: HeadOptions | None = None,
    mask: ArrayLike | None = None,
) -> tuple[Head, tuple[int, int]]:
    """Validate the hidden states, LM head and token ids; flatten to ``(N, H)`` / ``(N,)``.

    ``packed``: hidden ``(N, H)`` / ``(1, N, H)`` and tokens ``(N,)`` / ``(1, N)``, whose
    ``batch_shape`` is ``(1, N)``. ``options``: ``(vocab_group, kept_ids, kept_pad, kept_mask,
    top_k, top_p, min_p)`` (:class:`~rlobjectives.logprobs.truncation.KeptOptions`).
    ``head_options``: ``(final_logit_softcapping, logit_scale, fp32_head)``. ``temperature``:
    a number or a per-token tensor (``(B, T)``; packed ``(N,)``); ``mask``: the selected
    tokens (a per-token temperature is 1 elsewhere; the mask itself is validated by the caller,
    so a wrong one is ignored here).
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
    head_options = head_options or HeadOptions()
    fp32 = head_options.fp32_head
    if not isinstance(fp32, bool):
        raise TypeError(f"fp32_head must be a bool, got {describe(fp32)}")
    transform = validate_transform(
        temperature,
        head_options.final_logit_softcapping,
        head_options.logit_scale,
        shape=batch_shape,
        device=hidden_t.device,
        dtype=compute_dtype(hidden_t),
        active=_temperature_rows(mask, batch_shape, hidden_t.device, packed),
        packed=packed,
    )
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
        transform=transform.flat(),
        chunk_size=rows,
        dtype=compute_dtype(hidden_t),
        shard=shard,
        kept=kept,
        fp32=fp32,
    )
    return head, batch_shape


def _temperature_rows(
    mask: ArrayLike | None, batch_shape: tuple[int, int], device: torch.device, packed: bool
) -> torch.Tensor | None:
    """The selected tokens as a ``batch_shape`` bool, or None.

    A mask of another shape or device is left to the caller's validation (None here).
    """
    if mask is None:
        return None
    mask_t = as_mask(mask, "mask", device)
    if mask_t.device != device or mask_t.numel() != batch_shape[0] * batch_shape[1]:
        return None
    if not packed and tuple(mask_t.shape) != batch_shape:
        return None
    return mask_t.reshape(batch_shape)
