r"""The anchored objectives: each response's own log-ratio against the reference.

With :math:`x_c = S_c - R_c`, :math:`x_r = S_r - R_r` (policy minus reference, summed over the
response) and the rewards :math:`r = \beta x`, NCA, BCO, SPPO (hard labels), APO-zero and
APO-down score each response on its own instead of through the margin :math:`x_c - x_r` alone;
AOT (:mod:`~rlobjectives.preference.objectives.aot`) orders the batch. The rewards they report
are :math:`\beta x_c, \beta x_r`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..._core.validation import Scalar, validate_scalar
from .base import PairQuantities, PreferenceObjective, check_beta

__all__ = ["BCO", "NCA", "APODown", "APOZero", "SPPOHard"]


class _Anchored(PreferenceObjective):
    beta: Scalar

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`(\beta x_c, \beta x_r)`."""
        x_c, x_r = q.logratios()
        return self.beta * x_c, self.beta * x_r


@dataclass(frozen=True)
class NCA(_Anchored):
    r"""NCA (pairwise): noise-contrastive alignment of the pair.

    :math:`L = -\log\sigma(r_c) - \tfrac12\log\sigma(-r_c) - \tfrac12\log\sigma(-r_r)`.
    Noise-contrastive alignment with :math:`K = 2`: raises the chosen response's likelihood
    itself, not only the margin.

    Attributes:
        beta: :math:`\beta > 0` (:math:`r = \beta x`).

    Raises:
        ValueError / TypeError: ``beta`` out of range or not a number, named.

    References:
        Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit
        Rewards", arXiv:2402.05369 Eq. 12 (:math:`K = 2`).

    Peer options: TRL ``loss_type="nca_pair"``; Liger ``"nca_pair"``.

    Examples:
        >>> NCA(beta=0.1).beta
        0.1

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1

    name: ClassVar[str] = "nca"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "NCA"))

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`-\log\sigma(r_c) - \frac12\log\sigma(-r_c) - \frac12\log\sigma(-r_r)`."""
        x_c, x_r = q.logratios()
        r_c, r_r = self.beta * x_c, self.beta * x_r
        return -F.logsigmoid(r_c) - 0.5 * F.logsigmoid(-r_c) - 0.5 * F.logsigmoid(-r_r)


@dataclass(frozen=True)
class BCO(_Anchored):
    r"""BCO (pairwise): :math:`L = -\log\sigma(r_c - \delta) - \log\sigma(-(r_r - \delta))`.

    Binary classifier optimisation: chosen responses classified as good, rejected as bad, with
    the reward shift :math:`\delta` (a constant: the paper's running mean of the rewards,
    TRL's ``BCOTrainer``; 0 in TRL's DPO ``bco_pair``).

    Attributes:
        beta: :math:`\beta > 0` (:math:`r = \beta x`).
        delta: the reward shift :math:`\delta` (a constant, default 0).

    Raises:
        ValueError / TypeError: a field out of range or not a number, named.

    References:
        Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment",
        arXiv:2404.04656 Eq. 7.

    Peer options: TRL ``DPOConfig(loss_type="bco_pair")`` = ``BCO(beta)``; Liger
    ``"bco_pair"``.

    Examples:
        >>> BCO(beta=0.1)
        BCO(beta=0.1, delta=0.0)

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    delta: Scalar = 0.0

    name: ClassVar[str] = "bco"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "BCO"))
        object.__setattr__(self, "delta", validate_scalar(self.delta, "BCO.delta", minimum=None))

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`-\log\sigma(r_c - \delta) - \log\sigma(-(r_r - \delta))`."""
        x_c, x_r = q.logratios()
        r_c, r_r = self.beta * x_c, self.beta * x_r
        return -F.logsigmoid(r_c - self.delta) - F.logsigmoid(-(r_r - self.delta))


@dataclass(frozen=True)
class SPPOHard(_Anchored):
    r"""SPPO with hard labels: squared distances of the log-ratios to :math:`\pm\frac{1}{2\beta}`.

    :math:`L = \big(x_c - \frac{1}{2\beta}\big)^2 + \big(x_r + \frac{1}{2\beta}\big)^2`.
    Self-play preference optimisation with the winner's probability set to 1 and the loser's to
    0 (Eq. 4.7 of the paper with :math:`\eta = \beta^{-1}`).

    Attributes:
        beta: :math:`\beta > 0`.

    Raises:
        ValueError / TypeError: ``beta`` out of range or not a number, named.

    References:
        Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment",
        arXiv:2405.00675 Eq. 4.7.

    Peer options: TRL ``loss_type="sppo_hard"``; Liger ``"sppo_hard"``.

    Examples:
        >>> SPPOHard(beta=0.1).beta
        0.1

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1

    name: ClassVar[str] = "sppo_hard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "SPPOHard"))

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`(x_c - 1/(2\beta))^2 + (x_r + 1/(2\beta))^2`."""
        x_c, x_r = q.logratios()
        half = 0.5 / self.beta
        return (x_c - half) ** 2 + (x_r + half) ** 2


@dataclass(frozen=True)
class APOZero(_Anchored):
    r"""APO-zero: :math:`L = 1 - \sigma(r_c) + \sigma(r_r)`.

    Anchored preference optimisation when the chosen responses are better than the model's own
    outputs: raise the chosen likelihood, lower the rejected one.

    Attributes:
        beta: :math:`\beta > 0` (:math:`r = \beta x`).

    Raises:
        ValueError / TypeError: ``beta`` out of range or not a number, named.

    References:
        D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive
        Revisions", arXiv:2408.06266 Eq. 7.

    Peer options: TRL ``loss_type="apo_zero"``; Liger ``"apo_zero"``.

    Examples:
        >>> APOZero(beta=0.1).beta
        0.1

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1

    name: ClassVar[str] = "apo_zero"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "APOZero"))

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`1 - \sigma(r_c) + \sigma(r_r)`."""
        x_c, x_r = q.logratios()
        return (1.0 - torch.sigmoid(self.beta * x_c)) + torch.sigmoid(self.beta * x_r)


@dataclass(frozen=True)
class APODown(_Anchored):
    r"""APO-down: :math:`L = \sigma(r_c) + 1 - \sigma(r_c - r_r)`.

    Anchored preference optimisation when the chosen responses are worse than the model's own
    outputs: lower both likelihoods, the rejected one more.

    Attributes:
        beta: :math:`\beta > 0` (:math:`r = \beta x`).

    Raises:
        ValueError / TypeError: ``beta`` out of range or not a number, named.

    References:
        D'Oosterlinck et al. 2024, arXiv:2408.06266 Eq. 8.

    Peer options: TRL ``loss_type="apo_down"``; Liger ``"apo_down"``.

    Examples:
        >>> APODown(beta=0.1).beta
        0.1

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1

    name: ClassVar[str] = "apo_down"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "APODown"))

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`\sigma(r_c) + 1 - \sigma(r_c - r_r)`."""
        x_c, x_r = q.logratios()
        r_c, r_r = self.beta * x_c, self.beta * x_r
        return torch.sigmoid(r_c) + (1.0 - torch.sigmoid(r_c - r_r))
