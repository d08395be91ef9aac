r"""SAPO (Qwen): the soft gate on the ratio, :class:`SAPO`.

With :math:`r` the ratio after the log-ratio bound and :math:`A` the advantage,
:math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau = \tau_+` for :math:`A > 0` and
:math:`\tau_-` otherwise (:math:`A = 0` takes :math:`\tau_-`), and
:math:`\partial s / \partial \ell = 4\sigma(x)\sigma(-x)\, r A` (:math:`x = \tau(r - 1)`) where
the log-ratio bound did not fire, else 0 (``torch.clamp``'s closed interval); the fused stage
uses :math:`\sigma(x)\sigma(-x)` instead of autograd's :math:`\sigma(1 - \sigma)` (no
cancellation for large :math:`|x|`; equal to rounding otherwise). The clip diagnostics count the
tokens whose gradient weight :math:`4\sigma(1 - \sigma)` is below half its peak:
:math:`|x| >` :data:`SAPO_HALF_PEAK`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..._core.validation import Scalar, validate_scalar
from .base import (
    ClipCounts,
    FormulaTerms,
    StageInputs,
    StageOutputs,
    SurrogateInputs,
    SurrogateObjective,
    by_sign,
)

__all__ = ["SAPO", "SAPO_HALF_PEAK"]

# |tau (r - 1)| beyond which SAPO's gradient weight 4 sigma (1 - sigma) is below 1/2 (its peak
# is 1 at r = 1): 4 sigma (1 - sigma) = 1/2 at sigma = (1 +- 1/sqrt 2)/2, i.e. x = 2 ln(1 + sqrt 2).
SAPO_HALF_PEAK = 2.0 * math.log1p(math.sqrt(2.0))


@dataclass(frozen=True)
class SAPO(SurrogateObjective):
    r"""SAPO: the soft-gated surrogate :math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A`.

    :math:`\tau` = ``temperature_pos`` for :math:`A > 0`, ``temperature_neg`` for
    :math:`A \le 0`; at :math:`r = 1` the gate is :math:`2/\tau` with slope 1, and far from
    :math:`r = 1` its gradient vanishes smoothly (a soft clip). Its fused stage is
    :meth:`SAPO.stage`, its Triton kernel the ``"sapo"`` surrogate of
    :mod:`rlobjectives.kernels.jit.token_loss`.

    Attributes:
        temperature_pos: :math:`\tau_+ > 0` for :math:`A > 0`.
        temperature_neg: :math:`\tau_- > 0` for :math:`A \le 0`.

    Raises:
        ValueError: a non-positive or non-finite temperature (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        SAPO, arXiv:2511.20347 (the gated objective).

    Peer options: verl ``loss_mode="sapo"`` with ``tau_pos`` / ``tau_neg``; TRL
    ``loss_type="sapo"`` with ``sapo_temperature_pos`` / ``sapo_temperature_neg``.

    Examples:
        >>> SAPO()
        SAPO(temperature_pos=1.0, temperature_neg=1.05)

    .. versionadded:: 0.3.0
       (the ``sapo_temperature_pos`` / ``sapo_temperature_neg`` keywords of 0.2).
    """

    temperature_pos: Scalar = 1.0
    temperature_neg: Scalar = 1.05

    name: ClassVar[str] = "sapo"

    def __post_init__(self) -> None:
        for field in ("temperature_pos", "temperature_neg"):
            value = validate_scalar(getattr(self, field), f"SAPO.{field}", minimum=0.0, strict=True)
            object.__setattr__(self, field, value)

    def formula(self, inputs: SurrogateInputs) -> FormulaTerms:
        r""":math:`\frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau_\pm` by the sign of A."""
        advantages = inputs.advantages
        temperature = by_sign(
            advantages > 0, self.temperature_pos, self.temperature_neg, advantages
        )  # (B, T)
        scaled = temperature * (inputs.ratio - 1.0)  # (B, T)
        gate = torch.sigmoid(scaled) * 4.0 / temperature  # (B, T)
        x = scaled.detach()
        soft_clipped = x.abs() > SAPO_HALF_PEAK
        below = soft_clipped & (x < 0) & (advantages < 0)
        above = soft_clipped & (x > 0) & (advantages > 0)
        dual = soft_clipped & (x > 0) & (advantages < 0)
        return FormulaTerms(gate * advantages, gate.detach(), soft_clipped, below, above, dual)

    def stage(self, inputs: StageInputs) -> StageOutputs:
        r"""The gate :math:`\frac{4}{\tau}\sigma(\tau(r - 1))` times :math:`\tilde A`, its slope."""
        ratio, mask, dtype = inputs.ratio, inputs.mask, inputs.dtype
        advantages = inputs.advantages.to(dtype)
        positive = _as_tensor(self.temperature_pos, advantages)
        negative = _as_tensor(self.temperature_neg, advantages)
        temperature = torch.where(advantages > 0, positive, negative)  # shape of A
        x = (ratio - 1.0).mul_(temperature)  # (B, T)
        sigma = torch.sigmoid(x)  # (B, T)
        # d gate / d l = 4 sigma(x) sigma(-x) r; zero where the log-ratio bound fired.
        slope = torch.sigmoid(-x).mul_(sigma).mul_(ratio).mul_(4.0)  # (B, T)
        if inputs.passes is not None:  # 0 where the bound fired (a NaN log-ratio's NaN slope too)
            slope = torch.nan_to_num_(slope, nan=0.0, posinf=math.inf, neginf=-math.inf)
            slope = slope.mul_(inputs.passes)
        coefficient = slope.mul_(inputs.weighted)  # (B, T), 0 at unselected tokens
        gate = sigma.mul_(4.0).div_(temperature)  # (B, T), the advantage factor
        values = gate * inputs.weighted  # (B, T), 0 at unselected tokens
        soft_clipped = x.abs() > SAPO_HALF_PEAK  # (B, T)
        clip = ClipCounts(
            _count(soft_clipped, mask),
            _count(soft_clipped & (x < 0) & (advantages < 0), mask),
            _count(soft_clipped & (x > 0) & (advantages > 0), mask),
        )
        unselected = ratio.numel() - inputs.selected_count
        ratio_sum = ratio.sum() - unselected  # r = 1 at unselected tokens
        dual = _count(soft_clipped & (x > 0) & (advantages < 0), mask)
        zero = torch.zeros((), dtype=dtype, device=ratio.device)
        weight_sum = torch.where(mask, gate, zero).sum()
        return StageOutputs(coefficient, values, clip, dual, ratio_sum, weight_sum)

    def kernel_flags(self) -> dict[str, Any]:
        """The kernel's ``"sapo"`` setup: the two temperatures and the half-peak width."""
        return {
            "surrogate": "sapo",
            "tau_positive": float(self.temperature_pos),
            "tau_negative": float(self.temperature_neg),
            "half_peak": SAPO_HALF_PEAK,
        }


def _count(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (condition & mask).sum()


def _as_tensor(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)
