r"""SAPO (Qwen): the soft gate on the ratio, :class:`SAPO`.

With :math:`r` the ratio after the log-ratio bound and :math:`A` the advantage,
:math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau = \tau_+` for :math:`A > 0` and
:math:`\tau_-` otherwise (:math:`A = 0` takes :math:`\tau_-`), and
:math:`\partial s / \partial \ell = 4\sigma(x)(1 - \sigma(x))\, r A` (:math:`x = \tau(r - 1)`)
where the log-ratio bound did not fire, else 0 (``torch.clamp``'s closed interval). The clip
diagnostics count the
tokens whose gradient weight :math:`4\sigma(1 - \sigma)` is below half its peak:
:math:`|x| >` :data:`SAPO_HALF_PEAK`, a decision on :math:`r = e^{\Delta}` taken by the rule
(``docs/conventions.md``, "Decisions at a bound"): :math:`|\tau(r - 1)| > h` in the
computation dtype's arithmetic holds exactly for :math:`r < R_{lo}` or :math:`r > R_{hi}`
(:func:`soft_clip_ratios`, found once per temperature), so it is decided on the log-ratio
against the thresholds of :math:`R_{lo}, R_{hi}` (:mod:`rlobjectives._core.decisions`), as a
correctly rounded ``exp`` would decide it, on every backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.decisions import deviation_ratios, lower_threshold, upper_threshold
from ..._core.fields import check_fields
from ..._core.validation import Scalar
from .base import Bound, Surrogate, SurrogateTerms, by_sign

__all__ = ["SAPO", "SAPO_HALF_PEAK", "soft_clip_ratios", "soft_clip_thresholds"]

# |tau (r - 1)| beyond which SAPO's gradient weight 4 sigma (1 - sigma) is below 1/2 (its peak
# is 1 at r = 1): 4 sigma (1 - sigma) = 1/2 at sigma = (1 +- 1/sqrt 2)/2, i.e. x = 2 ln(1 + sqrt 2).
SAPO_HALF_PEAK = 2.0 * math.log1p(math.sqrt(2.0))


@dataclass(frozen=True)
class SAPO(Surrogate):
    r"""SAPO: the soft-gated surrogate :math:`s = \frac{4}{\tau}\sigma(\tau(r - 1)) A`.

    :math:`\tau` = ``temperature_pos`` for :math:`A > 0`, ``temperature_neg`` for
    :math:`A \le 0`; at :math:`r = 1` the gate is :math:`2/\tau` with slope 1, and far from
    :math:`r = 1` its gradient vanishes smoothly (a soft clip). Its soft-clip count decides
    :math:`|\tau(r - 1)| > h` by the rule of ``docs/conventions.md`` ("Decisions at a bound").

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
        check_fields(self, "temperature_pos", "temperature_neg", strict=True)

    def surrogate(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> SurrogateTerms:
        r""":math:`\frac{4}{\tau}\sigma(\tau(r - 1)) A`, :math:`\tau_\pm` by the sign of A."""
        temperature = by_sign(
            advantages > 0, self.temperature_pos, self.temperature_neg, advantages
        )  # (B, T)
        gate = torch.sigmoid(temperature * (torch.exp(log_ratio) - 1.0)) * 4.0 / temperature
        low, high = self._soft_clipped(log_ratio.detach(), advantages)
        negative = advantages < 0
        below, above, dual = low & negative, high & (advantages > 0), high & negative
        return SurrogateTerms(gate * advantages, gate.detach(), low | high, below, above, dual)

    def _soft_clipped(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tau (r - 1) < -h, tau (r - 1) > h)`` by the rule: on the log-ratio, tau by sign."""
        dtype = log_ratio.dtype
        positive = advantages > 0
        low_positive, high_positive = soft_clip_thresholds(self.temperature_pos, dtype)
        low_negative, high_negative = soft_clip_thresholds(self.temperature_neg, dtype)
        low = torch.where(positive, _as_tensor(low_positive, log_ratio), low_negative)
        high = torch.where(positive, _as_tensor(high_positive, log_ratio), high_negative)
        return log_ratio < low, log_ratio > high


def soft_clip_ratios(temperature: Bound, dtype: torch.dtype) -> tuple[Bound, Bound]:
    r"""``(R_lo, R_hi)``: :math:`|\tau(r - 1)| > h` exactly where :math:`r \notin [R_{lo}, R_{hi}]`.

    :math:`h` = :data:`SAPO_HALF_PEAK`, in ``dtype``'s arithmetic as the formula evaluates it
    (:func:`rlobjectives._core.decisions.deviation_ratios`).
    """
    return deviation_ratios(temperature, SAPO_HALF_PEAK, dtype)


def soft_clip_thresholds(temperature: Bound, dtype: torch.dtype) -> tuple[Bound, Bound]:
    """The log-ratio thresholds ``(t-(R_lo), t+(R_hi))`` of :func:`soft_clip_ratios`."""
    low, high = soft_clip_ratios(temperature, dtype)
    return lower_threshold(low, dtype), upper_threshold(high, dtype)


def _as_tensor(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)
