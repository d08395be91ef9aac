r"""GMPO (verl ``geo_mean``): the clipped geometric mean of the sequence's ratios, :class:`GMPO`.

With :math:`\Delta` the token's bounded log-ratio and :math:`A` its advantage,

.. math::

    s = \bar A_i \rho_i, \qquad
    \rho_i = \exp\Big(\frac{1}{n_i}\sum_t \mathrm{sgn}(A)\min\big(\mathrm{sgn}(A)\Delta,\
    \mathrm{sgn}(A)\,\mathrm{clip}(\Delta, -\epsilon_{low}, \epsilon_{high})\big)\Big),

:math:`\bar A_i` the mean advantage of the sequence, in the token form of GSPO (value
:math:`\rho_i` at every token, derivative through the token's own clipped log-ratio). The
derivative needs the whole sequence (not token-local), ``ratio_level="token"`` only.
The band is decided in log space (the log-ratio against :math:`-\epsilon_{low}` and
:math:`\epsilon_{high}` rounded to the computation dtype): no ``exp`` is rounded before the
decision, so it is the same on every backend (``docs/conventions.md``, "Decisions at a bound").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.fields import check_band
from ..._core.reduction import clamp, masked_fill_zero
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms

__all__ = ["GMPO"]


@dataclass(frozen=True)
class GMPO(Surrogate):
    r"""GMPO: the geometric-mean policy objective :math:`s = \bar A_i \rho_i`, clipped in log space.

    :math:`\rho_i` is the geometric mean of the sequence's token ratios, each clipped in log
    space to :math:`[-\epsilon_{low}, \epsilon_{high}]` on the side the sign of its advantage
    makes binding (ratio band :math:`[e^{-\epsilon_{low}}, e^{\epsilon_{high}}]`); see the module
    docstring. A sequence-level surrogate (:meth:`GMPO.terms`, not token-local): it forms its
    own sequence ratio (``ratio_level`` must be
    ``"token"``).

    Attributes:
        low: :math:`0 \le \epsilon_{low} < 1`, the log-space lower edge; None: no clipping.
        high: :math:`\epsilon_{high} \ge 0`; None means ``low``. Needs ``low``.

    Raises:
        ValueError: ``low`` outside ``[0, 1)``, a negative ``high``, ``high`` without ``low``,
            or a non-finite value (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        GMPO, arXiv:2507.20673 (the geometric-mean objective).

    Peer options: verl ``loss_mode="geo_mean"`` with ``clip_ratio_low`` / ``clip_ratio_high``.

    Examples:
        >>> GMPO(low=0.4)
        GMPO(low=0.4, high=None)

    .. versionadded:: 0.3.0
       (``clip_low`` / ``clip_high`` with ``surrogate="gmpo"`` in 0.2).
    """

    low: Scalar | None = 0.2
    high: Scalar | None = None

    name: ClassVar[str] = "gmpo"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_band(self)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`\bar A_i \rho_i`, clipped in log space per token (verl ``geo_mean``)."""
        advantages, mask, layout = tokens.advantages, tokens.mask, tokens.layout
        log_ratio = tokens.log_ratio  # (B, T)
        sign = torch.sign(advantages)  # (B, T); A = 0 contributes log-ratio 0 (verl)
        lower = upper = None
        if self.low is None:
            clipped = sign * sign * log_ratio
        else:
            lower = -self.low
            upper = self.low if self.high is None else self.high
            bounded = clamp(log_ratio, lower, upper)  # (B, T)
            clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)  # (B, T)
        clipped = masked_fill_zero(clipped, mask)
        # whole sequences (one all-reduce of the three under context parallelism)
        counts, clipped_sums, advantage_sums = layout.combine(
            layout.local_row_counts(mask),
            layout.local_row_sums(clipped.detach()),
            layout.local_row_sums(advantages),
        )  # (S,) each
        counts = counts.clamp(min=1).to(log_ratio.dtype)
        mean_log_ratio = layout.expand(clipped_sums / counts)  # (B, 1) / (1, N)
        mean_advantage = layout.expand(advantage_sums / counts)  # (B, 1) / (1, N)
        # Token form (as GSPO): value log rho_i at every token, derivative d clipped_t / d l_t.
        ratio = torch.exp(clipped - clipped.detach() + mean_log_ratio)  # (B, T)
        x, none = log_ratio.detach(), torch.zeros_like(mask)
        low = none if lower is None else x < lower  # the band is in log space
        high = none if upper is None else x > upper
        below, above = low & (advantages < 0), high & (advantages > 0)
        return SurrogateTerms(mean_advantage * ratio, ratio.detach(), low | high, below, above)
