r"""VESPO (TRL): the gamma weight of the sequence ratio as a constant, :class:`VESPO`.

With :math:`\ell` the log-probability and :math:`A` the advantage,
:math:`s = \mathrm{sg}(\phi_i) A \ell` with the gamma weight
:math:`\phi(W) = e^{\lambda + k \log W - \lambda W}` of the sequence ratio

.. math::

    W_i = \exp\Big(\mathrm{clip}\big(\textstyle\sum_t \Delta_{it} + \sum_t \log \rho^{IS}_{it},
    \log 10^{-8}, 20\big)\Big),

:math:`(k, \lambda)` by the sign of :math:`A` and :math:`\rho^{IS}` the importance weights
(folded into :math:`W`, not multiplied into the loss; a per-sequence weight :math:`\rho^{IS}_i`
enters once, padded or packed). The weight needs the whole sequence: it is not token-local
(the hidden-state path composes a second pass), and ``ratio_level="token"`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.fields import check_fields
from ..._core.reduction import clamp, masked_fill_zero
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms, by_sign, sampled_log_probs

__all__ = ["VESPO", "VESPO_LOG_WEIGHT_RANGE"]

# TRL's clamp of VESPO's sequence log-ratio: [log 1e-8, 20] (get_gamma_weights).
VESPO_LOG_WEIGHT_RANGE = (math.log(1e-8), 20.0)


@dataclass(frozen=True)
class VESPO(Surrogate):
    r"""VESPO: :math:`s = \mathrm{sg}(\phi(W_i)) A \ell` with a gamma weight of the sequence ratio.

    :math:`\phi(W) = e^{\lambda + k\log W - \lambda W}` (:math:`\phi(1) = 1`, peak at
    :math:`W = k/\lambda`) of the clamped sequence ratio :math:`W_i`, which takes in the
    importance weights (see the module docstring); :math:`(k, \lambda)` = ``(k_pos,
    lambda_pos)`` for :math:`A \ge 0`, ``(k_neg, lambda_neg)`` for :math:`A < 0`. A
    sequence-level surrogate (:meth:`VESPO.terms`, not token-local): it forms its own sequence
    ratio (``ratio_level`` must be ``"token"``).

    Attributes:
        k_pos: gamma shape :math:`k \ge 0` for :math:`A \ge 0`.
        lambda_pos: gamma rate :math:`\lambda > 0` for :math:`A \ge 0`.
        k_neg: :math:`k \ge 0` for :math:`A < 0`.
        lambda_neg: :math:`\lambda > 0` for :math:`A < 0`.

    Raises:
        ValueError: a negative shape, a non-positive rate, or a non-finite value (the message
            names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        VESPO, arXiv:2602.10693 (TRL ``get_gamma_weights``).

    Peer options: TRL ``loss_type="vespo"`` with ``vespo_k_pos`` / ``vespo_lambda_pos`` /
    ``vespo_k_neg`` / ``vespo_lambda_neg``.

    Examples:
        >>> VESPO()
        VESPO(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)

    .. versionadded:: 0.3.0
       (the ``vespo_*`` keywords of 0.2).
    """

    k_pos: Scalar = 2.0
    lambda_pos: Scalar = 3.0
    k_neg: Scalar = 3.0
    lambda_neg: Scalar = 2.0

    name: ClassVar[str] = "vespo"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    folds_importance_weights: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_fields(self, "k_pos", "k_neg")
        check_fields(self, "lambda_pos", "lambda_neg", strict=True)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`\mathrm{sg}(\phi(W_i)) A \ell` with the gamma weight of :math:`W_i`."""
        advantages = tokens.advantages
        log_weight = _log_weight(tokens)  # (B, 1) or (1, N)
        nonnegative = advantages >= 0
        k = by_sign(nonnegative, self.k_pos, self.k_neg, advantages)  # (B, T)
        lam = by_sign(nonnegative, self.lambda_pos, self.lambda_neg, advantages)  # (B, T)
        phi = torch.exp(lam + k * log_weight - lam * torch.exp(log_weight))  # (B, T), constant
        return SurrogateTerms(phi * advantages * sampled_log_probs(tokens.log_probs), phi)


def _log_weight(inputs: PolicyTokens) -> torch.Tensor:
    """``log W_i`` per token: the sequence's summed log-ratio and log-importance-weights."""
    layout, mask = inputs.layout, inputs.mask
    total = layout.row_sums(masked_fill_zero(inputs.log_ratio.detach(), mask))  # (S,)
    total = layout.expand(total)  # (B, 1) or (1, N)
    weights = inputs.importance_weights
    low, high = VESPO_LOG_WEIGHT_RANGE
    if weights is not None and inputs.sequence_weights:
        # A sequence weight enters once per sequence, in the padded (B, 1) and the packed
        # layout alike (there it is broadcast to its tokens: (1, N), the same value at each);
        # a NaN one of an empty row reaches only that row's unselected tokens, which the loss
        # masks.
        total = total + clamp(torch.log(weights), low, high)  # (B, 1) or (1, N)
    elif weights is not None:  # token weights: the log of their product over the sequence
        one = torch.ones((), dtype=weights.dtype, device=weights.device)
        log_weights = clamp(torch.log(torch.where(mask, weights, one)), low, high)  # (B, T)
        total = total + layout.expand(layout.row_sums(masked_fill_zero(log_weights, mask)))
    return clamp(total, low, high)
