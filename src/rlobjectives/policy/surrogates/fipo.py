r"""FIPO (Future-KL Influenced Policy Optimization, ms-swift's ``fipo``): :class:`FIPO`.

With :math:`x_t` the bounded log-ratio, :math:`r_t = e^{x_t}`, :math:`A_t` the advantage and
:math:`M_t` the selection, the discounted future log-ratio of token :math:`t` runs over the
positions :math:`s \ge t` of its own sequence (selected or not, as the padded row counts them;
a packed sequence stops at its end):

.. math::

    F_t = \sum_{s \ge t} \gamma^{s - t} M_s\, x_s\, \mathbb{1}[r_s \le \delta], \qquad
    f_t = \mathrm{sg}\big(\mathrm{clip}(e^{F_t}, 1, 1 + c)\big), \qquad s_t = f_t\, s^{clip}_t,

:math:`s^{clip}` the clipped surrogate of :class:`~rlobjectives.Clip` (band ``low`` /
``high``, TRL's ``delta``), the influence weight :math:`f` a constant. Optionally
:math:`f \in [1 - c, 1 + c]`, and ms-swift's safety clamp :math:`f \leftarrow \mathrm{clip}(f,
0.8, 1)` where :math:`A_t < 0` and :math:`r_t > \text{threshold}`. The future sum is a
blocked reverse cumulative sum (a doubling scan when packed or compiled); under context parallelism
each rank's chunk takes the carry of the later ranks' chunks (one all-gather of ``(S, 2)``
states: the first position's sum and :math:`\gamma^{\text{length}}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.decisions import ratio_above
from ..._core.fields import check_band, check_fields
from ..._core.reduction import clamp, masked_fill_zero
from ..._core.segments import future_discounted_sums
from ..._core.validation import Scalar, validate_bool
from .base import PolicyTokens, Surrogate, SurrogateTerms
from .clip import Clip

__all__ = ["FIPO"]

# ms-swift's safety clamp of the influence weight (fipo_safety_threshold): [0.8, 1.0].
SAFETY_RANGE = (0.8, 1.0)


@dataclass(frozen=True)
class FIPO(Surrogate):
    r"""FIPO: the clipped surrogate times a constant influence weight of the future log-ratio.

    .. math::

        s_t = \mathrm{sg}\big(\mathrm{clip}(e^{F_t}, 1, 1 + c)\big)\, s^{clip}_t,
        \qquad F_t = \textstyle\sum_{s \ge t} \gamma^{s - t} M_s x_s,

    the sum over the later positions of the token's sequence (see the module docstring for
    ``delta`` and the safety clamp). Gradient :math:`f_t\, \partial s^{clip}_t / \partial \ell_t`.
    Not token-local (the future sum reads the sequence; the hidden-state path composes),
    ``ratio_level="token"`` only.

    Attributes:
        gamma: :math:`0 \le \gamma \le 1`, the discount (ms-swift: ``2 ** (-1 / fipo_decay_rate)``,
            0.97857 for its default 32).
        cap: :math:`c \ge 0` of the influence clip (ms-swift ``fipo_clip_range``); None: no clip.
        low: :math:`0 \le \epsilon_{low} < 1` of the surrogate's band; None: no clipping.
        high: :math:`\epsilon_{high} \ge 0`; None means ``low``. Needs ``low``.
        delta: :math:`\delta > 1`, TRL's two-sided clip of the surrogate; tokens with
            :math:`r > \delta` also leave the future sum (ms-swift's ``delta``). None: none.
        cap_high_only: the influence clipped to :math:`[1, 1 + c]` (default, ms-swift's
            ``fipo_clip_high_only``); False: :math:`[1 - c, 1 + c]`.
        safety_threshold: :math:`> 0`: :math:`f \leftarrow \mathrm{clip}(f, 0.8, 1)` where
            :math:`A < 0` and :math:`r >` it (ms-swift ``fipo_safety_threshold``, 4.0 there by
            default). None: no clamp.

    Raises:
        ValueError: ``gamma`` outside ``[0, 1]``, a negative ``cap``, ``low`` outside
            ``[0, 1)``, ``high`` without ``low``, ``delta <= 1``, ``safety_threshold <= 0``
            or a non-finite value (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor (``cap_high_only``:
            not a bool).

    References:
        FIPO, arXiv:2603.19835 (the Future-KL influence weight).

    Peer options: ms-swift ``--loss_type fipo`` = ``FIPO(gamma=2 ** (-1 / fipo_decay_rate),
    cap=fipo_clip_range, low=epsilon, high=epsilon_high, delta=delta,
    cap_high_only=fipo_clip_high_only, safety_threshold=fipo_safety_threshold)`` with
    ``log_ratio_bound=None`` and ``reduction="token_mean", normalizer=N``.

    Examples:
        >>> FIPO(gamma=0.9, cap=0.2)
        FIPO(gamma=0.9, cap=0.2, low=0.2, high=None, delta=None, cap_high_only=True, ...)

    .. versionadded:: 0.4.0
    """

    gamma: Scalar
    cap: Scalar | None
    low: Scalar | None = 0.2
    high: Scalar | None = None
    delta: Scalar | None = None
    cap_high_only: bool = True
    safety_threshold: Scalar | None = None

    name: ClassVar[str] = "fipo"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "sums the future token log-ratios of each position"

    def __post_init__(self) -> None:
        check_fields(self, "gamma", at_most=1.0, reason=" (a discount)", optional=False)
        check_fields(self, "cap")
        check_band(self)
        check_fields(self, "delta", minimum=1.0, strict=True)
        validate_bool(self.cap_high_only, "FIPO.cap_high_only")
        check_fields(self, "safety_threshold", strict=True)
        # the band's clipped surrogate (its fields were checked above, under FIPO's names)
        object.__setattr__(self, "_clip", Clip(low=self.low, high=self.high, delta=self.delta))

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`f_t\, s^{clip}_t` with the influence weight of the future log-ratio."""
        log_ratio, advantages, mask = tokens.log_ratio, tokens.advantages, tokens.mask
        clipped: SurrogateTerms = self._clip.surrogate(log_ratio, advantages)  # type: ignore[attr-defined]
        x = log_ratio.detach()
        future = x if self.delta is None else masked_fill_zero(x, ~ratio_above(x, self.delta))
        total = future_discounted_sums(masked_fill_zero(future, mask), tokens.layout, self.gamma)
        influence = torch.exp(total)
        if self.cap is not None:
            low = 1.0 if self.cap_high_only else 1.0 - self.cap
            influence = clamp(influence, low, 1.0 + self.cap)
        safety = None
        if self.safety_threshold is not None:  # A < 0 and r above the threshold
            safety = (advantages < 0) & ratio_above(x, self.safety_threshold)
            influence = torch.where(safety, torch.clamp(influence, *SAFETY_RANGE), influence)
        weight = None if clipped.weight is None else clipped.weight * influence
        return clipped._replace(values=influence * clipped.values, weight=weight, selected=safety)
