"""IEEE-754 bit helpers: exact masking and comparisons as integer operations (CPU speed).

On CPU a ``torch.where(mask, values, 0)`` over a ``(B, T)`` tensor costs several times a bitwise
AND of the float bits with an all-ones/all-zeros integer mask, and a float comparison followed by
a conversion to a select mask costs more than an integer subtraction and shift. These helpers
implement both, exactly:

- :func:`select` / :func:`select_`: a selected value keeps every bit; an unselected one becomes
  ``+0.0`` whatever it held (NaN and inf included), so it can reach no value and no gradient.
- :class:`Bits`: for non-negative floats (``+0`` to ``+inf``, or NaN with the sign bit cleared)
  the bit patterns order like the values, so ``x < y`` is ``(bits(x) - bits(y)) >> (w - 1)``,
  which is all ones exactly where the comparison holds: a select mask in two integer operations.

The helpers work on float32 and float64 (the computation dtypes of the library) and trace under
``torch.compile``. Only the fused policy path (:mod:`rlobjectives.policy.fused`) uses them.
"""

from __future__ import annotations

import struct

import torch

__all__ = [
    "Bits",
    "count_bits",
    "less_",
    "magnitude_",
    "mask_bits",
    "select",
    "select_",
    "sign_bits",
]

_BITS_DTYPE = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def mask_bits(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer mask of the width of ``dtype``: all ones where ``mask`` is True, else zero."""
    return mask.to(_BITS_DTYPE[dtype]).neg_()


def select(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``torch.where(mask, values, 0)`` as a bitwise AND of the float bits (exact, NaN-proof).

    ``values`` may broadcast to the shape of ``bits`` (e.g. ``(B, 1)`` advantages).
    """
    selected = values.expand_as(bits).view(bits.dtype) & bits
    return selected.view(values.dtype)


def select_(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """In-place :func:`select` of a temporary ``values`` of the shape of ``bits``."""
    values.view(bits.dtype).bitwise_and_(bits)
    return values


def magnitude_(values: torch.Tensor) -> torch.Tensor:
    """In place: the bits of ``|values|`` (a NaN of either sign becomes a positive NaN)."""
    bits = values.view(_BITS_DTYPE[values.dtype])
    return bits.bitwise_and_(torch.iinfo(bits.dtype).max)


def less_(left: torch.Tensor | int, right: torch.Tensor) -> torch.Tensor:
    """All ones where ``left < right`` (magnitude bits), computed in place into ``right``.

    ``left - right`` in one pass: a number is made a 0-d tensor on the device (a fill, no
    host synchronisation), since a tensor cannot be subtracted from a number in place.
    """
    shift = torch.iinfo(right.dtype).bits - 1
    if not isinstance(left, torch.Tensor):
        left = torch.full((), left, dtype=right.dtype, device=right.device)
    return torch.sub(left, right, out=right).bitwise_right_shift_(shift)


def count_bits(select_mask: torch.Tensor) -> torch.Tensor:
    """Number of all-ones entries of an integer select mask (a 0-d integer tensor)."""
    return -select_mask.sum(dtype=select_mask.dtype)


def sign_bits(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Select masks of ``values > 0`` and ``values < 0`` (±0, NaN: neither), shape of ``values``.

    ``values`` is float32 or float64. ``torch.sign`` gives exactly ``+1``, ``-1`` or ``+0``
    (``+0`` for ``±0`` and NaN on every backend: it is ``(x > 0) - (x < 0)``); the sign bit of
    ``-1`` is the mask of ``values < 0`` and that of ``-(+1)`` the mask of ``values > 0``. Three
    passes, where two comparisons and two conversions to integer masks cost several times more
    on CPU.
    """
    sign = torch.sign(values).view(_BITS_DTYPE[values.dtype])  # +1, -1 or +0 as bits
    shift = torch.iinfo(sign.dtype).bits - 1
    negative = torch.bitwise_right_shift(sign, shift)
    return sign.neg_().bitwise_right_shift_(shift), negative


class Bits:
    """Integer views of non-negative floats, which order like the floats they encode.

    For ``x, y`` in ``[+0, +inf]`` or NaN with the sign bit cleared, ``x < y`` iff
    ``bits(x) < bits(y)``, and ``(bits(x) - bits(y)) >> (width - 1)`` is all ones exactly where
    ``x < y``. A NaN (sign cleared) compares above every number, +inf included.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.float_dtype = dtype
        self.int_dtype = _BITS_DTYPE[dtype]
        self.device = device
        self.shift = torch.finfo(dtype).bits - 1

    def of(self, value: float | torch.Tensor) -> int | torch.Tensor:
        """Bits of ``max(value, 0)``: a Python int for a number, a 0-d int tensor for a tensor."""
        if isinstance(value, torch.Tensor):
            number = value.to(dtype=self.float_dtype, device=self.device)
            return number.clamp(min=0.0).view(self.int_dtype)
        return self.pattern(max(float(value), 0.0))

    def less(
        self,
        left: torch.Tensor | int,
        right: torch.Tensor | int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All ones where ``left < right`` (magnitude bits; one of them a tensor), else zero."""
        if not isinstance(left, torch.Tensor):  # left - right in one pass (see less_)
            left = torch.full((), left, dtype=self.int_dtype, device=self.device)
        return torch.sub(left, right, out=out).bitwise_right_shift_(self.shift)

    def pattern(self, value: float | torch.Tensor) -> int | torch.Tensor:
        """The exact bits of ``value`` in this dtype (any sign): an int, or a 0-d int tensor."""
        if isinstance(value, torch.Tensor):
            return value.to(dtype=self.float_dtype, device=self.device).view(self.int_dtype)
        float_code, int_code = ("<f", "<i") if self.float_dtype == torch.float32 else ("<d", "<q")
        return int(struct.unpack(int_code, struct.pack(float_code, float(value)))[0])

    def view(self, values: torch.Tensor) -> torch.Tensor:
        """The integer view of a float tensor of this dtype (no copy)."""
        return values.view(self.int_dtype)
