r"""DRO (verl ``dro``): the log-probability policy gradient with a quadratic log-ratio penalty.

With :math:`\ell` the log-probability, :math:`\ell^{old}` the behaviour one,
:math:`\Delta = \ell - \ell^{old}` and :math:`A` the advantage,

.. math::

    s = \ell A - \tfrac{1}{2} \beta \Delta^2, \qquad
    \frac{\partial s}{\partial \ell} = A - \beta \Delta,

per selected token (the loss is :math:`-s`): no ratio, no clip, and the penalty acts at
:math:`A = 0` tokens too; on-policy (:math:`\Delta = 0`) the gradient is vanilla policy
gradient's :math:`A`. :math:`\Delta` is the raw log-ratio (``log_ratio_bound`` bounds the
ratio of the diagnostics only: DRO has no ratio), as verl computes it.
"""

from __future__ import annotations

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
)

__all__ = ["DRO"]


@dataclass(frozen=True)
class DRO(SurrogateObjective):
    r"""DRO: :math:`s = \ell A - \frac{1}{2}\beta (\ell - \ell^{old})^2` per token.

    The gradient is :math:`A - \beta(\ell - \ell^{old})` at every selected token (the penalty
    pulls the policy back toward the behaviour policy, also where :math:`A = 0`); the clip
    diagnostics are 0 (nothing is clipped) and ``weight_mean`` is 1 (the advantage's factor in
    the gradient). Its fused stage is :meth:`DRO.stage`, its Triton kernel the ``"dro"``
    surrogate of :mod:`rlobjectives.kernels.jit.token_loss`. It has no ratio:
    ``ratio_level`` must be ``"token"``, and ``log_ratio_bound`` does not enter the loss.

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
    needs_log_ratio: ClassVar[bool] = True
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "has no ratio"

    def __post_init__(self) -> None:
        beta = validate_scalar(self.beta, "DRO.beta", minimum=0.0, strict=True)
        object.__setattr__(self, "beta", beta)

    def formula(self, inputs: SurrogateInputs) -> FormulaTerms:
        r""":math:`\ell A - \frac{1}{2}\beta\Delta^2` with the raw log-ratio :math:`\Delta`."""
        old = inputs.old_log_probs
        assert old is not None  # the specification passes the (selected) old log-probs
        log_probs = inputs.log_probs
        log_ratio = log_probs - old  # (B, T), raw: no bound, 0 at unselected tokens
        values = log_probs * inputs.advantages - 0.5 * self.beta * log_ratio * log_ratio
        none = torch.zeros_like(inputs.mask)
        weight = torch.ones_like(values).detach()
        return FormulaTerms(values, weight, none, none, none, none)

    def stage(self, inputs: StageInputs) -> StageOutputs:
        r"""Values :math:`\rho(\ell A - \beta\Delta^2/2)`, slope :math:`\rho(A - \beta\Delta)`.

        :math:`\rho` the importance weight (:math:`\tilde A = \rho A`): the penalty is a term of
        the per-token loss, which the weights multiply.
        """
        ratio, mask, dtype = inputs.ratio, inputs.mask, inputs.dtype
        log_ratio = inputs.log_ratio  # raw Delta, 0 at unselected tokens (a fresh buffer)
        assert log_ratio is not None  # needs_log_ratio: the fused path passes it
        zero = torch.zeros((), dtype=dtype, device=ratio.device)
        log_probs = torch.where(mask, inputs.log_probs.to(dtype), zero)  # (B, T)
        penalty = log_ratio * self.beta  # beta Delta, 0 at unselected tokens
        weights = inputs.importance_weights
        if weights is not None:  # rho beta Delta (rho selected: NaN there reaches nothing)
            penalty = penalty.mul_(torch.where(mask, weights.to(dtype), zero))
        coefficient = inputs.weighted - penalty  # rho (A - beta Delta)
        # rho (l A - beta Delta^2 / 2) = l A~ - (rho beta Delta) Delta / 2
        values = torch.addcmul(log_probs.mul_(inputs.weighted), penalty, log_ratio, value=-0.5)
        none = torch.zeros((), dtype=torch.int64, device=ratio.device)
        count = inputs.selected_count
        unselected = ratio.numel() - count  # r = 1 at unselected tokens
        return StageOutputs(
            coefficient,
            values,
            ClipCounts(none, none, none),
            none,
            ratio.sum() - unselected,
            count.to(dtype),
        )

    def kernel_flags(self) -> dict[str, Any]:
        """The kernel's ``"dro"`` setup: the penalty weight."""
        return {"surrogate": "dro", "beta": float(self.beta)}
