r"""The LM head's logit transform: scale, then softcap, then temperature.

The trainers and the samplers do not take the softmax of the raw product :math:`z = h W^\top +
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

from .._core.validation import ArrayLike, describe, validate_scalar

__all__ = [
    "LogitTransform",
    "PLAIN",
    "Temperature",
    "apply_transform_",
    "softcap_derivative",
    "validate_scale",
    "validate_softcap",
    "validate_transform",
]

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


def apply_transform_(scores: torch.Tensor, transform: LogitTransform, rows: object) -> torch.Tensor:
    r"""``scores`` :math:`z` ``(n, V)`` becomes :math:`x = \mathrm{cap}_c(s z)/\tau`, in place.

    ``rows`` indexes the per-token temperature (the chunk's block); ``scores`` is in the
    computation dtype. Returns ``scores``.
    """
    inverse = transform.row_inverse(rows)
    if transform.softcap is not None:
        cap = transform.softcap
        scores.mul_(transform.scale / cap).tanh_()
        factor: float | torch.Tensor = inverse * cap
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
    ``(n, V)`` buffer of their dtype. Only for a transform with a softcap.
    """
    assert transform.softcap is not None
    inverse = transform.row_inverse(rows)
    rows_out = out[: scores.shape[0]]
    if isinstance(inverse, torch.Tensor):
        torch.mul(scores, (1.0 / (inverse * transform.softcap)).to(scores.dtype), out=rows_out)
    else:
        torch.mul(scores, 1.0 / (inverse * transform.softcap), out=rows_out)
    rows_out.clamp_(-1.0, 1.0)
    one = torch.ones((), dtype=scores.dtype, device=scores.device)
    return torch.addcmul(one, rows_out, rows_out, value=-1.0, out=rows_out)


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
