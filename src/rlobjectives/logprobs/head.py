r"""The LM head of the hidden-state functions: validated arguments and chunk size.

:func:`prepare_head` validates ``hidden`` ``(B, T, H)`` (packed: ``(N, H)``), ``weight``
``(V, H)``, ``bias``, the token ids, the temperature and the chunk size once, into a
:class:`Head` of flat tensors, whose ``(N, V)`` logits ``hidden @ weight.T + bias`` are formed
one chunk of :func:`default_chunk_size` rows at a time (the budget :data:`HEAD_BUDGET`, unless
``chunk_size`` is given) in the buffers of :mod:`rlobjectives.logprobs.chunks`.

:func:`validate_transform` checks the arguments of the logit transform (``temperature``,
``final_logit_softcapping``, ``logit_scale``) into a
:class:`~rlobjectives.logprobs.transform.LogitTransform`; a per-token temperature is ``(B, T)``
(padded) or ``(N,)`` / ``(1, N)`` (packed), any value where the row is not selected (those rows
use 1).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._core.chunking import ChunkBudget, chunk_rows, resolve_chunk_size
from .._core.layout import token_matrix
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
from .transform import LogitTransform
from .truncation import KeptOptions, KeptSet, Restriction, restriction_of
from .vocab_parallel import Shard

__all__ = [
    "HEAD_BUDGET",
    "Head",
    "HeadOptions",
    "LOW_PRECISION",
    "Temperature",
    "chunk_row_bytes",
    "default_chunk_size",
    "prepare_head",
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


#: The dtypes of a low-precision head (a product rounded to them with ``fp32_head=False``).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def chunk_row_bytes(vocab_size: int, dtype: torch.dtype) -> int:
    """Bytes of one row of a chunk's buffers for a head of ``dtype``.

    The buffers are :class:`~rlobjectives.logprobs.chunks.ChunkBuffers`: ``V`` scores in the
    computation dtype (float64 for a float64 head, float32 else), plus ``V`` values in ``dtype``
    for a low-precision head (its rounded product and its gradient's cast with
    ``fp32_head=False``; the bound the default chunk size is computed with).
    """
    if dtype == torch.float64:
        return 8 * vocab_size
    return vocab_size * (4 + (dtype.itemsize if dtype in LOW_PRECISION else 0))


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


#: A temperature argument: a positive number, or a per-token tensor.
Temperature = float | ArrayLike


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
    softcap, temperature: :mod:`rlobjectives.logprobs.transform`, a per-token temperature as
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
        return self.weight.dtype in LOW_PRECISION and not self.fp32


class HeadOptions(NamedTuple):
    """The head's transform arguments as the public functions take them."""

    final_logit_softcapping: object = None
    logit_scale: object = 1.0
    fp32_head: object = True


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
