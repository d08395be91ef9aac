r"""CISPO (MiniMax-M1): the capped (or clipped) ratio as a constant weight, :class:`CISPO`.

With :math:`r` the ratio after the log-ratio bound, :math:`A` the advantage and :math:`\ell`
the log-probability, :math:`s = \mathrm{sg}(w) A \ell` with :math:`w = \min(r, \text{cap})`
(TRL's absolute cap) or :math:`w = \mathrm{clip}(r, 1 - \epsilon_{low}, 1 + \epsilon_{high})`
(verl's band), and :math:`\partial s / \partial \ell = wA` at every selected token (the bound
and the cap change the weight, never the gradient's support); the weight bounds are
:func:`cispo_bounds`. The diagnostics' token sets (:math:`r` below / above the bounds) are
decided on the log-ratio by the rule of :mod:`rlobjectives._core.decisions`
(``docs/conventions.md``, "Decisions at a bound"); the weight keeps its formula
:math:`\mathrm{clamp}(r, lo, hi)` (continuous at the bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..._core.decisions import ratio_above, ratio_below
from ..._core.fields import check_band, check_fields
from ..._core.reduction import clamp
from ..._core.validation import Scalar
from .base import Bound, PolicyTokens, Surrogate, SurrogateTerms, sampled_log_probs

__all__ = ["CISPO", "cispo_bounds"]

# The default band edge of CISPO without a cap; an explicit ``low`` with ``cap`` is an error.
_DEFAULT_LOW = 0.2
_UNSET: Any = object()


@dataclass(frozen=True)
class CISPO(Surrogate):
    r"""CISPO: :math:`s = \mathrm{sg}(w) A \ell`, the ratio capped or clipped as a constant.

    .. math::

        w = \min(r, \text{cap}) \ \text{(TRL)} \quad\text{or}\quad
        w = \mathrm{clip}(r, 1 - \epsilon_{low}, 1 + \epsilon_{high}) \ \text{(verl)},

    with :math:`\epsilon_{low}` = ``low`` and :math:`\epsilon_{high}` = ``high``; the gradient
    flows through :math:`\ell` only, at every selected token (weight bounds
    :func:`cispo_bounds`). Its clip diagnostics decide the cap and the band by the rule of
    ``docs/conventions.md`` ("Decisions at a bound").

    Attributes:
        cap: TRL's absolute cap of the weight (its ``epsilon_high``, e.g. 5.0 in ScaleRL),
            ``> 0``: no low edge, no band. With ``cap``, ``low`` and ``high`` are None and
            giving either raises. None: the band.
        low: :math:`0 \le \epsilon_{low} < 1` of the band ``[1 - low, 1 + high]`` (default
            0.2 without ``cap``); None (without ``cap``): no bound, :math:`w = r`.
        high: :math:`\epsilon_{high} \ge 0`; None means ``low``. Needs ``low``.

    Raises:
        ValueError: ``cap`` together with ``low`` or ``high``, ``cap <= 0``, ``low`` outside
            ``[0, 1)``, a negative ``high``, ``high`` without ``low``, or a non-finite value
            (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        MiniMax-M1, CISPO, arXiv:2506.13585 Sec. 3.1; ScaleRL, arXiv:2510.13786 (the cap).

    Peer options: TRL ``loss_type="cispo"`` = ``CISPO(cap=epsilon_high)``; verl
    ``policy_loss.loss_mode="cispo"`` = ``CISPO(low=clip_ratio_low, high=clip_ratio_high)``.

    Examples:
        >>> CISPO(cap=5.0)
        CISPO(cap=5.0, low=None, high=None)
        >>> CISPO()
        CISPO(cap=None, low=0.2, high=None)

    .. versionadded:: 0.3.0
       (the ``cispo_cap`` keyword of 0.2, and ``clip_low`` / ``clip_high`` with
       ``surrogate="cispo"``).
    """

    cap: Scalar | None = None
    low: Scalar | None = _UNSET
    high: Scalar | None = None

    name: ClassVar[str] = "cispo"

    def __post_init__(self) -> None:
        if self.cap is not None:
            for field in ("low", "high"):
                value = getattr(self, field)
                if value is not _UNSET and value is not None:
                    raise ValueError(
                        f"CISPO.{field} does not apply with CISPO.cap (TRL's absolute cap has no "
                        f"band), got cap={self.cap!r} and {field}={value!r}"
                    )
            check_fields(self, "cap", strict=True)
            object.__setattr__(self, "low", None)
            return
        object.__setattr__(self, "low", _DEFAULT_LOW if self.low is _UNSET else self.low)
        check_band(self, "disables the band")

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`\mathrm{sg}(w) A \ell`, :math:`w` the ratio capped (TRL) or clipped (verl)."""
        lower, upper = cispo_bounds(self)
        x, advantages = tokens.log_ratio.detach(), tokens.advantages
        low = -math.inf if lower is None else lower
        weight = clamp(torch.exp(x), low, math.inf if upper is None else upper)  # constant
        none = torch.zeros_like(tokens.mask)
        below = none if lower is None else ratio_below(x, lower)
        beyond = none if upper is None else ratio_above(x, upper)  # r above the cap or band
        negative = advantages < 0
        return SurrogateTerms(
            weight * advantages * sampled_log_probs(tokens.log_probs),
            weight,
            out_of_band=below | beyond,
            below=below & negative,
            above=beyond & (advantages > 0),
            dual=beyond & negative,  # the cap changes an A < 0 token's weight
        )


def cispo_bounds(cispo: CISPO) -> tuple[Bound | None, Bound | None]:
    """CISPO's weight bounds: ``(None, cap)`` (TRL) or the band (verl), or none."""
    if cispo.cap is not None:
        return None, cispo.cap
    if cispo.low is None:
        return None, None
    high = cispo.low if cispo.high is None else cispo.high
    return 1.0 - cispo.low, 1.0 + high
