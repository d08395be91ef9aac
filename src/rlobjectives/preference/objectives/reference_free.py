r"""The reference-free objectives: SimPO, ORPO, CPO and the SFT (NLL) term.

They read the policy's log-probabilities only (no reference model): :math:`S` the summed
log-probability of a response, :math:`m = S / \max(n, 1)` its mean per token, and ``nll``
the pair's share of the token-mean negative log-likelihood of the chosen responses
(:class:`~rlobjectives.preference.objectives.base.PairQuantities`: the NLL tokens are
``nll_mask``, by default the chosen response's selected tokens). Passing reference
log-probabilities with one of them alone is an error (they would be ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..._core.validation import Scalar, validate_scalar
from .base import (
    PairQuantities,
    PreferenceObjective,
    check_beta,
    check_fraction,
    log1mexp,
    smoothed_sigmoid_loss,
)

__all__ = ["CPO", "ORPO", "SFT", "SimPO"]


@dataclass(frozen=True)
class SimPO(PreferenceObjective):
    r"""SimPO: the length-normalised margin without a reference, minus a target margin.

    :math:`L = -(1-\epsilon)\log\sigma(z) - \epsilon\log\sigma(-z)`,
    :math:`z = \beta(m_c - m_r) - \gamma`.
    The length-normalised log-likelihood margin, without a reference, minus the target margin
    :math:`\gamma`.

    Attributes:
        beta: :math:`\beta > 0` (the paper uses 2.0-2.5; TRL's and Liger's default 0.1).
        gamma: the target reward margin :math:`\gamma` (TRL's ``simpo_gamma``, default 0.5).
        label_smoothing: :math:`\epsilon \in [0, 0.5)` (TRL's CPO and Liger's smoothing).

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
        Reward", arXiv:2405.14734 Eq. 6.

    Peer options: TRL ``CPOConfig(loss_type="simpo", cpo_alpha=0)`` (``simpo_gamma``); Liger
    ``LigerFusedLinearSimPOLoss(beta, gamma)``. CPO-SimPO (TRL ``cpo_alpha > 0``):
    ``SimPO(...) + cpo_alpha * SFT()``.

    Examples:
        >>> SimPO(beta=2.0, gamma=0.5).gamma
        0.5

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    gamma: Scalar = 0.5
    label_smoothing: Scalar = 0.0

    name: ClassVar[str] = "simpo"
    needs_reference: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "SimPO"))
        object.__setattr__(self, "gamma", validate_scalar(self.gamma, "SimPO.gamma", minimum=None))
        smoothing = check_fraction(self.label_smoothing, "SimPO", "label_smoothing", maximum=0.5)
        object.__setattr__(self, "label_smoothing", smoothing)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        """The per-pair loss :math:`L` of the class docstring, ``(B,)``."""
        z = self.beta * (q.chosen_mean - q.rejected_mean) - self.gamma
        return smoothed_sigmoid_loss(z, self.label_smoothing)

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`(\beta m_c, \beta m_r)`."""
        return self.beta * q.chosen_mean, self.beta * q.rejected_mean


@dataclass(frozen=True)
class ORPO(PreferenceObjective):
    r"""ORPO: the SFT term plus the log odds ratio of the chosen over the rejected response.

    .. math::

        L = \mathrm{nll}
            - \beta\log\sigma\Big(\log\frac{\mathrm{odds}(m_c)}{\mathrm{odds}(m_r)}\Big).

    With :math:`\mathrm{odds}(m) = e^{m}/(1 - e^{m})` of the mean log-probabilities,
    :math:`\log\frac{\mathrm{odds}(m_c)}{\mathrm{odds}(m_r)} = (m_c - m_r) - (\log(1 - e^{m_c})
    - \log(1 - e^{m_r}))` (:math:`\log(1-e^m)` evaluated without cancellation). The SFT term
    ``nll`` is the token mean of the chosen responses' negative log-likelihood over the NLL
    tokens: ``nll_mask``, by default the chosen response's tokens (Liger's definition); TRL's
    ORPO covers the prompt and the response: pass their log-probabilities and
    ``nll_mask`` = the prompt and response tokens for TRL's.

    Attributes:
        beta: :math:`\beta > 0` (the paper's :math:`\lambda`; TRL's and Liger's default 0.1).

    Raises:
        ValueError / TypeError: ``beta`` out of range or not a number, named.

    References:
        Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
        arXiv:2403.07691 Eq. 6-7.

    Peer options: TRL ``ORPOTrainer`` (``beta``); Liger ``LigerFusedLinearORPOLoss(beta)``.

    Examples:
        >>> ORPO(beta=0.1).uses_nll
        True

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1

    name: ClassVar[str] = "orpo"
    needs_reference: ClassVar[bool] = False
    uses_nll: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "ORPO"))

    def loss(self, q: PairQuantities) -> torch.Tensor:
        """The per-pair loss :math:`L` of the class docstring, ``(B,)``."""
        m_c, m_r = q.chosen_mean, q.rejected_mean
        log_odds = (m_c - m_r) - (log1mexp(m_c) - log1mexp(m_r))
        return q.nll - self.beta * F.logsigmoid(log_odds)

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`(\beta m_c, \beta m_r)`."""
        return self.beta * q.chosen_mean, self.beta * q.rejected_mean


@dataclass(frozen=True)
class CPO(PreferenceObjective):
    r"""CPO: the reference-free DPO margin plus the NLL of the chosen responses.

    :math:`L = -(1-\epsilon)\log\sigma(\beta(S_c - S_r)) - \epsilon\log\sigma(-\beta(S_c - S_r))
    + \lambda\,\mathrm{nll}`.
    DPO without the reference (its :math:`\beta \to 0` limit argument) plus the NLL of the
    chosen responses with weight :math:`\lambda` = ``nll_coef``.

    Attributes:
        beta: :math:`\beta > 0`.
        nll_coef: :math:`\lambda \ge 0`, the NLL weight: TRL's ``cpo_alpha`` (TRL's ``alpha``
            is AlphaPO's reward shape, not this), Liger's ``alpha``; default 1.0 as both.
        label_smoothing: :math:`\epsilon \in [0, 0.5)`.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Xu et al. 2024, "Contrastive Preference Optimization", arXiv:2401.08417 Eq. 3 and
        Eq. 5-6.

    Peer options: TRL ``CPOConfig(loss_type="sigmoid", cpo_alpha=nll_coef)``; Liger
    ``LigerFusedLinearCPOLoss(beta, alpha=nll_coef)``.

    Examples:
        >>> CPO(beta=0.1, nll_coef=1.0).nll_coef
        1.0

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    nll_coef: Scalar = 1.0
    label_smoothing: Scalar = 0.0

    name: ClassVar[str] = "cpo"
    needs_reference: ClassVar[bool] = False
    uses_nll: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "CPO"))
        object.__setattr__(self, "nll_coef", validate_scalar(self.nll_coef, "CPO.nll_coef"))
        smoothing = check_fraction(self.label_smoothing, "CPO", "label_smoothing", maximum=0.5)
        object.__setattr__(self, "label_smoothing", smoothing)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        """The per-pair loss :math:`L` of the class docstring, ``(B,)``."""
        z = self.beta * (q.chosen - q.rejected)
        return smoothed_sigmoid_loss(z, self.label_smoothing) + self.nll_coef * q.nll

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`(\beta S_c, \beta S_r)`."""
        return self.beta * q.chosen, self.beta * q.rejected


@dataclass(frozen=True)
class SFT(PreferenceObjective):
    r"""The SFT term alone: :math:`L = \mathrm{nll}`, the chosen responses' token-mean NLL.

    :math:`\frac{1}{D}\sum_i \mathrm{nll}_i = -\frac{1}{N_{nll}}\sum_i\sum_{t} \ell_{c,it}`
    over the NLL tokens (``nll_mask``, by default the chosen responses' tokens). Mostly a term
    of a combination: ``0.8 * DPO() + 0.2 * BCO() + 1.0 * SFT()`` (MPO). Its rewards are the
    summed log-probabilities :math:`(S_c, S_r)`.

    References:
        Ouyang et al. 2022, arXiv:2203.02155 (the pretraining / SFT mix); Wang et al. 2024,
        MPO, arXiv:2411.10442 Eq. 2.

    Peer options: TRL ``loss_type="sft"``.

    Examples:
        >>> SFT()
        SFT()

    .. versionadded:: 0.3.0
    """

    name: ClassVar[str] = "sft"
    needs_reference: ClassVar[bool] = False
    uses_nll: ClassVar[bool] = True

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`\mathrm{nll}_i`."""
        return q.nll

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed log-probabilities ``(S_c, S_r)``."""
        return q.chosen, q.rejected
