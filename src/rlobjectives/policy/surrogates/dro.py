r"""DRO (verl ``dro``): the log-probability policy gradient with a quadratic log-ratio penalty.

With :math:`\ell` the log-probability, :math:`\ell^{old}` the behaviour one,
:math:`\Delta = \ell - \ell^{old}` and :math:`A` the advantage,

.. math::

    s = \ell A - \tfrac{1}{2} \beta \Delta^2, \qquad
    \frac{\partial s}{\partial \ell} = A - \beta \Delta,

per selected token (the loss is :math:`-s`): no ratio, no clip, and the penalty acts at
:math:`A = 0` tokens too; on-policy (:math:`\Delta = 0`) the gradient is vanilla policy
gradient's :math:`A`. :math:`\Delta` is the raw log-ratio (``log_ratio_bound`` bounds the
ratio of the diagnostics only: DRO has no ratio), as verl computes it. A token with a
log-probability of :math:`-\infty` (probability 0 under either policy, where the exact value is
infinite) contributes value and gradient 0 and stays in the reduction's denominator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.fields import check_fields
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms

__all__ = ["DRO"]


@dataclass(frozen=True)
class DRO(Surrogate):
    r"""DRO: :math:`s = \ell A - \frac{1}{2}\beta (\ell - \ell^{old})^2` per token.

    The gradient is :math:`A - \beta(\ell - \ell^{old})` at every selected token (the penalty
    pulls the policy back toward the behaviour policy, also where :math:`A = 0`); the clip
    diagnostics are 0 (nothing is clipped) and ``weight_mean`` is 1 (the advantage's factor in
    the gradient). It has no ratio: ``ratio_level`` must be ``"token"``, and
    ``log_ratio_bound`` does not enter the loss.

    Attributes:
        beta: :math:`\beta > 0`, the weight of the quadratic penalty (verl's
            ``policy_loss.dro_beta``, which has no default and must be positive).

    Raises:
        ValueError: ``beta <= 0`` or a non-finite value (the message names the field).
        TypeError: ``beta`` missing, or not a real number or a 0-d real tensor.

    References:
        Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language
        Models Alignment" (DRO, direct reward optimisation), arXiv:2405.19107; the per-token
        form :math:`-(\ell A - \frac{1}{2}\beta\Delta^2)` is verl's
        ``compute_policy_loss_dro`` ("Direct Reward Optimization with a quadratic log-ratio
        penalty").

    Peer options: verl ``policy_loss.loss_mode="dro"`` = ``DRO(beta=policy_loss.dro_beta)``.

    Examples:
        >>> DRO(beta=0.1)
        DRO(beta=0.1)

    .. versionadded:: 0.3.0
    """

    beta: Scalar

    name: ClassVar[str] = "dro"
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "has no ratio"

    def __post_init__(self) -> None:
        check_fields(self, "beta", strict=True)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`\ell A - \frac{1}{2}\beta\Delta^2` with the raw log-ratio :math:`\Delta`."""
        log_probs, old = tokens.log_probs, tokens.old_log_probs
        finite = torch.isfinite(log_probs) & torch.isfinite(old)  # p = 0: nothing (no NaN)
        zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
        log_probs, old = torch.where(finite, log_probs, zero), torch.where(finite, old, zero)
        log_ratio = log_probs - old  # (B, T), raw: no bound, 0 at unselected tokens
        values = log_probs * tokens.advantages - 0.5 * self.beta * log_ratio * log_ratio
        return SurrogateTerms(values, torch.ones_like(values).detach())
