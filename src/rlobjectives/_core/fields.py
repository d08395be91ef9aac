"""The validation of an object's hyperparameter fields (the surrogate and objective objects).

The objects are frozen dataclasses whose fields are Python numbers or 0-d tensors. Each check
names the field as ``<Class>.<field>`` and stores the validated value back (a Python number as a
float, a tensor as given), so that a 0-d tensor is held to the same range as its number
(``docs/conventions.md``).
"""

from __future__ import annotations

from typing import Any

from .validation import scalar_number, validate_scalar

__all__ = ["check_band", "check_fields", "check_order"]


def check_fields(
    owner: Any,
    *fields: str,
    at_most: float | None = None,
    reason: str = "",
    minimum: float | None = 0.0,
    strict: bool = False,
    maximum: float | None = None,
    optional: bool = True,
) -> None:
    """Validate and store each of ``fields`` (``validate_scalar``'s range); None passes if optional.

    ``at_most`` adds an inclusive upper bound, ``reason`` its explanation in the message.
    """
    cls = type(owner).__name__
    for field in fields:
        value = getattr(owner, field)
        if value is None and optional:
            continue
        name = f"{cls}.{field}"
        checked = validate_scalar(value, name, minimum=minimum, strict=strict, maximum=maximum)
        number = scalar_number(checked)
        if at_most is not None and number is not None and number > at_most:
            raise ValueError(f"{name} must be <= {at_most:g}{reason}, got {number}")
        object.__setattr__(owner, field, checked)


def check_band(owner: Any, without_low: str = "disables clipping") -> None:
    """A ``low`` in ``[0, 1)`` and a ``high >= 0``; ``high`` needs ``low``.

    ``without_low`` says what ``low=None`` means, in the message of a ``high`` without it.
    """
    cls = type(owner).__name__
    if owner.low is None and owner.high is not None:
        raise ValueError(
            f"{cls}.high requires {cls}.low (low=None {without_low}), got low=None and "
            f"high={owner.high!r}"
        )
    check_fields(owner, "low", maximum=1.0)
    check_fields(owner, "high")


def check_order(owner: Any, lower: str, upper: str) -> None:
    """Two finite real fields (any sign) with ``lower < upper``, 0-d tensors read on the host."""
    check_fields(owner, lower, upper, minimum=None, optional=False)
    cls = type(owner).__name__
    low, high = scalar_number(getattr(owner, lower)), scalar_number(getattr(owner, upper))
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"{cls}.{lower} must be < {cls}.{upper}, got {lower}={low} and {upper}={high}"
        )
