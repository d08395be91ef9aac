"""The shape of a nested list of numbers, checked before ``torch.tensor`` converts it.

:func:`~rlobjectives._core.validation.as_tensor` walks a list or tuple argument here first, so
that ragged, non-numeric or hostile data (nesting deeper than 64 levels, integers outside the
int64 range) raises a message naming the argument and the offending element instead of an
error from deep inside the conversion.
"""

from __future__ import annotations

import numbers

__all__ = ["nested_shape"]


def nested_shape(value: object, name: str, path: str = "", depth: int = 0) -> tuple[int, ...]:
    """Shape of a nested list/tuple of numbers; raises for ragged, non-numeric or hostile data.

    Nesting deeper than 64 levels and integers outside the int64 range raise ``ValueError``
    naming the argument, instead of a ``RecursionError`` or ``OverflowError`` from deep inside
    the conversion. The walk recurses at most 64 levels, whatever the input.
    """
    max_depth = 64  # more dimensions than any tensor argument of this library can have
    if isinstance(value, (list, tuple)):
        if depth >= max_depth:
            raise ValueError(
                f"{name} is a nested list more than {max_depth} levels deep; expected an array "
                f"of at most {max_depth} dimensions"
            )
        if len(value) == 0:
            return (0,)
        shapes = [
            nested_shape(item, name, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)
        ]
        first = shapes[0]
        for i, shape in enumerate(shapes):
            if shape != first:
                raise ValueError(
                    f"{name} is a ragged nested list: {name}{path}[0] has shape {first} but "
                    f"{name}{path}[{i}] has shape {shape}; expected a rectangular array"
                )
        return (len(value), *first)
    if isinstance(value, numbers.Integral) and not -(2**63) <= int(value) < 2**63:
        # Never format the integer itself: str() of a huge int is slow or raises ValueError.
        raise ValueError(
            f"{name}{path} is an integer of {int(value).bit_length()} bits, outside the range "
            "a tensor can hold ([-2**63, 2**63)); pass a float or a smaller value"
        )
    if isinstance(value, (bool, numbers.Real)) and not isinstance(value, (str, bytes)):
        return ()
    import reprlib  # bounded repr: the offending item may itself be huge or deeply nested

    raise TypeError(
        f"{name} must contain only numbers or bools, got {type(value).__name__} "
        f"({reprlib.repr(value)}) at {name}{path}"
    )
