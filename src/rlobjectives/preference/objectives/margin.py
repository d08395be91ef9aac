r"""The reference-margin objectives: DPO (cDPO, f-DPO), IPO, hinge, robust DPO, EXO, DiscoPOP.

Each is a function of the margin of the f-DPO scores :math:`s = f'(e^{x})` of the log-ratios
:math:`x_c = S_c - R_c`, :math:`x_r = S_r - R_r` (policy minus reference, summed over the
response; :func:`~rlobjectives.preference.objectives.base.f_divergence_score`; the reverse KL,
DPO's own, gives :math:`s = x`):

.. math::

    u = \frac{s_c}{\nu_c} - \frac{s_r}{\nu_r}, \qquad z = \beta u,

with :math:`\nu = \max(n, 1)` (the response length) where the object is length-normalised and
:math:`\nu = 1` otherwise. The rewards they report are :math:`\beta x_c, \beta x_r` (TRL's
``rewards/chosen``, ``rewards/rejected``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..._core.validation import Scalar, validate_bool, validate_scalar
from .base import (
    PairQuantities,
    PreferenceObjective,
    check_beta,
    check_f_divergence,
    check_fraction,
    f_divergence_score,
    smoothed_sigmoid_loss,
)

__all__ = ["DPO", "EXO", "IPO", "DiscoPOP", "Hinge", "RobustDPO"]


class _MarginObjective(PreferenceObjective):
    r"""The shared margin :math:`u` and rewards :math:`\beta x` of the margin family."""

    beta: Scalar
    f_divergence: str
    alpha: Scalar
    length_normalized: bool = False

    def margin(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`u = s_c/\nu_c - s_r/\nu_r` (see the module docstring)."""
        x_c, x_r = q.logratios()
        s_c = f_divergence_score(x_c, self.f_divergence, self.alpha)
        s_r = f_divergence_score(x_r, self.f_divergence, self.alpha)
        if self.length_normalized:
            return s_c / q.chosen_length.clamp(min=1) - s_r / q.rejected_length.clamp(min=1)
        return s_c - s_r

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`(\beta x_c, \beta x_r)`."""
        x_c, x_r = q.logratios()
        return self.beta * x_c, self.beta * x_r

    def _check(self, owner: str) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, owner))
        object.__setattr__(self, "alpha", check_f_divergence(self.f_divergence, self.alpha, owner))
        validate_bool(self.length_normalized, f"{owner}.length_normalized")


@dataclass(frozen=True)
class DPO(_MarginObjective):
    r"""DPO: :math:`L = -(1-\epsilon)\log\sigma(\beta u) - \epsilon\log\sigma(-\beta u)`.

    :math:`u = s_c/\nu_c - s_r/\nu_r` is the margin of the f-DPO scores of the log-ratios
    (module docstring): with the defaults :math:`u = (S_c - R_c) - (S_r - R_r)` and
    :math:`L = -\log\sigma(\beta u)`, DPO's Eq. 7. ``label_smoothing`` :math:`\epsilon` is
    conservative DPO's label noise (the DPO authors' cDPO note; OpenRLHF's and Liger's
    ``label_smoothing``); ``length_normalized`` divides each score by its response length
    (TRL's ``sigmoid_norm``).

    Attributes:
        beta: :math:`\beta > 0`.
        label_smoothing: :math:`\epsilon \in [0, 0.5)`, conservative DPO (0: DPO). TRL's
            ``sigmoid`` ignores its ``label_smoothing`` (the preset passes 0).
        f_divergence: ``"reverse_kl"`` (DPO), ``"forward_kl"``, ``"js_divergence"`` or
            ``"alpha_divergence"`` (f-DPO; TRL's ``f_divergence_type``).
        alpha: the :math:`\alpha` of ``"alpha_divergence"`` (TRL's
            ``f_alpha_divergence_coef``); :math:`|\alpha - 1| < 10^{-6}` is the reverse KL.
        length_normalized: divide the scores by :math:`\max(n, 1)` (TRL ``sigmoid_norm``).

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Rafailov et al. 2023, arXiv:2305.18290 Eq. 7; Mitchell 2023, "A note on DPO with noisy
        preferences" (cDPO); Wang et al. 2023, f-DPO, arXiv:2309.16240 Eq. 9 and Table 1.

    Peer options: TRL ``loss_type="sigmoid"`` (``f_divergence_type``,
    ``f_alpha_divergence_coef``), ``"sigmoid_norm"``; OpenRLHF ``DPOLoss(beta,
    label_smoothing)``; Liger ``LigerFusedLinearDPOLoss(loss_type="sigmoid")``.

    Examples:
        >>> DPO(beta=0.1)  # doctest: +NORMALIZE_WHITESPACE
        DPO(beta=0.1, label_smoothing=0.0, f_divergence='reverse_kl', alpha=0.5,
            length_normalized=False)

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    label_smoothing: Scalar = 0.0
    f_divergence: str = "reverse_kl"
    alpha: Scalar = 0.5
    length_normalized: bool = False

    name: ClassVar[str] = "dpo"

    def __post_init__(self) -> None:
        self._check("DPO")
        smoothing = check_fraction(self.label_smoothing, "DPO", "label_smoothing", maximum=0.5)
        object.__setattr__(self, "label_smoothing", smoothing)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`-(1-\epsilon)\log\sigma(\beta u) - \epsilon\log\sigma(-\beta u)`."""
        return smoothed_sigmoid_loss(self.beta * self.margin(q), self.label_smoothing)


@dataclass(frozen=True)
class IPO(_MarginObjective):
    r"""IPO: :math:`L = \big(u - \frac{1}{2\beta}\big)^2`.

    :math:`u` is the margin of the log-ratios (module docstring), each divided by its response
    length by default: TRL's definition, which the IPO authors confirmed to TRL (the paper's
    results use it); ``length_normalized=False`` takes the raw sums, OpenRLHF's ``ipo=True``.

    Attributes:
        beta: :math:`\beta > 0`, IPO's regulariser :math:`\tau`.
        length_normalized: divide the scores by :math:`\max(n, 1)` (default True: TRL).
        f_divergence: the f-DPO score (TRL's ``f_divergence_type``).
        alpha: the :math:`\alpha` of ``"alpha_divergence"``.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
        Preferences", arXiv:2310.12036 Eq. 17.

    Peer options: TRL ``loss_type="ipo"`` (length-normalised); OpenRLHF ``DPOLoss(ipo=True)``
    = ``IPO(beta, length_normalized=False)`` (OpenRLHF ignores ``label_smoothing`` there).

    Examples:
        >>> IPO(beta=0.1).length_normalized
        True

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    length_normalized: bool = True
    f_divergence: str = "reverse_kl"
    alpha: Scalar = 0.5

    name: ClassVar[str] = "ipo"

    def __post_init__(self) -> None:
        self._check("IPO")

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`(u - 1/(2\beta))^2`."""
        return (self.margin(q) - 1.0 / (2.0 * self.beta)) ** 2


@dataclass(frozen=True)
class Hinge(_MarginObjective):
    r"""Hinge (SLiC): :math:`L = \max(0, 1 - \beta u)`.

    Attributes:
        beta: :math:`\beta > 0` (:math:`1/\beta` is SLiC's margin :math:`\delta`).
        f_divergence: the f-DPO score (TRL's ``f_divergence_type``).
        alpha: the :math:`\alpha` of ``"alpha_divergence"``.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Zhao et al. 2023, SLiC-HF, arXiv:2305.10425 Eq. 1; Liu et al. 2023, RSO,
        arXiv:2309.06657 Eq. 6 (the hinge on normalised likelihoods).

    Peer options: TRL ``loss_type="hinge"``; Liger ``loss_type="hinge"``.

    Examples:
        >>> Hinge(beta=0.1).beta
        0.1

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    f_divergence: str = "reverse_kl"
    alpha: Scalar = 0.5

    name: ClassVar[str] = "hinge"

    def __post_init__(self) -> None:
        self._check("Hinge")

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`\max(0, 1 - \beta u)`."""
        return torch.relu(1.0 - self.beta * self.margin(q))


@dataclass(frozen=True)
class RobustDPO(_MarginObjective):
    r"""Robust DPO: the unbiased DPO loss under flipped labels.

    .. math::

        L = \frac{-(1-\epsilon)\log\sigma(\beta u) + \epsilon\log\sigma(-\beta u)}{1 - 2\epsilon},

    the unbiased loss under labels flipped with probability :math:`\epsilon` (rDPO).

    Attributes:
        beta: :math:`\beta > 0`.
        label_smoothing: :math:`\epsilon`, the flip rate, in :math:`[0, 0.5)` (the paper's
            range, which Liger enforces; TRL only warns outside it).
        f_divergence: the f-DPO score (TRL's ``f_divergence_type``).
        alpha: the :math:`\alpha` of ``"alpha_divergence"``.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Chowdhury et al. 2024, "Provably Robust DPO", arXiv:2403.00409 Eq. 9.

    Peer options: TRL ``loss_type="robust"`` (``label_smoothing``); Liger ``"robust"``.

    Examples:
        >>> RobustDPO(beta=0.1, label_smoothing=0.1).label_smoothing
        0.1

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    label_smoothing: Scalar = 0.0
    f_divergence: str = "reverse_kl"
    alpha: Scalar = 0.5

    name: ClassVar[str] = "robust"

    def __post_init__(self) -> None:
        self._check("RobustDPO")
        smoothing = check_fraction(
            self.label_smoothing, "RobustDPO", "label_smoothing", maximum=0.5
        )
        object.__setattr__(self, "label_smoothing", smoothing)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`(-(1-\epsilon)\log\sigma(z) + \epsilon\log\sigma(-z)) / (1 - 2\epsilon)`."""
        z = self.beta * self.margin(q)
        eps = self.label_smoothing
        return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)


@dataclass(frozen=True)
class EXO(_MarginObjective):
    r"""EXO (pairwise): the KL from the policy's pair distribution to the smoothed labels.

    With :math:`z = \beta u`,

    .. math::

        L = \sigma(z)\big(\log\sigma(z) - \log(1-\epsilon)\big)
            + \sigma(-z)\big(\log\sigma(-z) - \log\epsilon\big).

    Attributes:
        beta: :math:`\beta > 0` (EXO's :math:`\beta_\pi`).
        epsilon: the label smoothing :math:`\epsilon \in (0, 1)` (TRL's ``label_smoothing``
            of ``exo_pair``; the paper recommends :math:`10^{-3}`; 0 is refused, as by TRL:
            :math:`\log 0`).
        f_divergence: the f-DPO score (TRL's ``f_divergence_type``).
        alpha: the :math:`\alpha` of ``"alpha_divergence"``.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment",
        arXiv:2402.00856 Eq. 16 (:math:`K = 2`).

    Peer options: TRL ``loss_type="exo_pair"`` (TRL evaluates :math:`\log(1-\epsilon)`,
    :math:`\log\epsilon` in float32); Liger ``"exo_pair"``.

    Examples:
        >>> EXO(beta=0.1).epsilon
        0.001

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    epsilon: Scalar = 1e-3
    f_divergence: str = "reverse_kl"
    alpha: Scalar = 0.5

    name: ClassVar[str] = "exo"

    def __post_init__(self) -> None:
        self._check("EXO")
        epsilon = check_fraction(self.epsilon, "EXO", "epsilon", maximum=1.0, strict=True)
        object.__setattr__(self, "epsilon", epsilon)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        """The per-pair loss :math:`L` of the class docstring, ``(B,)``."""
        z = self.beta * self.margin(q)
        eps = self.epsilon
        log_keep = torch.log1p(-eps) if isinstance(eps, torch.Tensor) else math.log1p(-eps)
        log_flip = torch.log(eps) if isinstance(eps, torch.Tensor) else math.log(eps)
        chosen = torch.sigmoid(z) * (F.logsigmoid(z) - log_keep)
        rejected = torch.sigmoid(-z) * (F.logsigmoid(-z) - log_flip)
        return chosen + rejected


@dataclass(frozen=True)
class DiscoPOP(_MarginObjective):
    r"""DiscoPOP (log-ratio modulated loss): a blend of the logistic and exponential losses.

    With :math:`z = \beta u` and :math:`m = \sigma(z/\tau)`,

    .. math::

        L = (1 - m)\,\big(-\log\sigma(z)\big) + m\, e^{-z},

    evaluated as :math:`\sigma(-z/\tau)(-\log\sigma(z)) + e^{\log\sigma(z/\tau) - z}` (the same
    numbers, finite where :math:`e^{-z}` alone overflows).

    Attributes:
        beta: :math:`\beta > 0`.
        tau: the temperature :math:`\tau > 0` (TRL's ``discopop_tau``, default 0.05).
        f_divergence: the f-DPO score (TRL's ``f_divergence_type``).
        alpha: the :math:`\alpha` of ``"alpha_divergence"``.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Chris Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for
        Large Language Models", arXiv:2406.08414 Eq. 5.

    Peer options: TRL ``loss_type="discopop"`` (``discopop_tau``); Liger ``"discopop"``.

    Examples:
        >>> DiscoPOP(beta=0.1).tau
        0.05

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    tau: Scalar = 0.05
    f_divergence: str = "reverse_kl"
    alpha: Scalar = 0.5

    name: ClassVar[str] = "discopop"

    def __post_init__(self) -> None:
        self._check("DiscoPOP")
        tau = validate_scalar(self.tau, "DiscoPOP.tau", minimum=0.0, strict=True)
        object.__setattr__(self, "tau", tau)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`(1 - \sigma(z/\tau))(-\log\sigma(z)) + \sigma(z/\tau)e^{-z}`."""
        z = self.beta * self.margin(q)
        logistic = -F.logsigmoid(z)
        return torch.sigmoid(-z / self.tau) * logistic + torch.exp(F.logsigmoid(z / self.tau) - z)
