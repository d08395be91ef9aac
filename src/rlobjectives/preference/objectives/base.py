r"""What every preference objective shares: the per-pair quantities, the base class, sums.

A preference objective is one formula: :meth:`PreferenceObjective.loss` maps the per-pair
quantities of :class:`PairQuantities` (the chosen and rejected responses' summed log-probabilities
under the policy and the reference, their lengths, the pair's share of the NLL term) to the
``(B,)`` per-pair losses with ordinary torch operations, exactly as its docstring writes them;
autograd gives every gradient, on the log-probabilities and on the hidden states
(:mod:`rlobjectives.preference.hidden`). :func:`rlobjectives.preference_loss` reduces them:
:math:`\mathcal{L} = \frac{1}{D}\sum_i w_i L_i` over the pairs whose two responses are not empty.

Objects combine linearly: ``0.8 * DPO(beta=0.1) + 0.2 * BCO(beta=0.1)`` is a
:class:`Combination`, whose per-pair loss is the weighted sum of its terms' (TRL's
``loss_type=[...]`` with ``loss_weights``, e.g. MPO).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from ..._core.validation import Scalar, describe, validate_choice, validate_scalar

__all__ = [
    "F_DIVERGENCES",
    "Combination",
    "PairQuantities",
    "PreferenceObjective",
    "check_beta",
    "check_fraction",
    "f_divergence_score",
    "log1mexp",
    "smoothed_sigmoid_loss",
]


class PairQuantities(NamedTuple):
    r"""The per-pair inputs of a preference formula, each ``(B,)`` in the computation dtype.

    Attributes:
        chosen: :math:`S_c = \sum_t a_t \ell_t`, the chosen response's summed log-probability
            (:math:`a_t` = 1 at its selected tokens; LD-DPO's weights with ``ld_alpha``).
        rejected: :math:`S_r`, the same for the rejected response.
        chosen_length: :math:`n_c`, the selected tokens of the chosen response (a float).
        rejected_length: :math:`n_r`.
        ref_chosen: :math:`R_c`, the reference model's :math:`S_c`, or None.
        ref_rejected: :math:`R_r`, or None.
        nll: the pair's share of the NLL term, :math:`-U_c D / N_{nll}` (:math:`U_c` the
            chosen response's summed log-probability over the NLL tokens, :math:`D` the pair
            normaliser, :math:`N_{nll}` the NLL token normaliser): :math:`\frac{1}{D}\sum_i
            \mathrm{nll}_i = -\sum_i U_{c,i} / N_{nll}`, the token mean of the NLL.
        valid: bool, the pairs whose two responses have a selected token (the others' entries
            are placeholders, -1 for the sums, and their loss is 0).
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_length: torch.Tensor
    rejected_length: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    nll: torch.Tensor
    valid: torch.Tensor

    @property
    def chosen_mean(self) -> torch.Tensor:
        r""":math:`S_c / \max(n_c, 1)`, the chosen response's mean log-probability."""
        return self.chosen / self.chosen_length.clamp(min=1)

    @property
    def rejected_mean(self) -> torch.Tensor:
        r""":math:`S_r / \max(n_r, 1)`."""
        return self.rejected / self.rejected_length.clamp(min=1)

    def logratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(x_c, x_r)`` with :math:`x = S - R` (policy minus reference)."""
        assert self.ref_chosen is not None and self.ref_rejected is not None  # boundary-checked
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected


F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

#: TRL clamps :math:`(\alpha - 1)x` at 80 before its exponential (finite in float32).
_ALPHA_CLAMP = 80.0


def f_divergence_score(
    logratio: torch.Tensor, kind: str, alpha: float | torch.Tensor
) -> torch.Tensor:
    r"""The f-DPO score :math:`f'(e^{x})` of a log-ratio :math:`x` (Wang et al. 2023).

    ``reverse_kl``: :math:`x`; ``forward_kl``: :math:`1 - e^{-x}`; ``js_divergence``:
    :math:`\log 2 + \log\sigma(x)`; ``alpha_divergence``: :math:`(e^{\min((\alpha-1)x, 80)} -
    1)/(\alpha - 1)` (:math:`x` itself when :math:`|\alpha - 1| < 10^{-6}`, the limit).
    """
    if kind == "reverse_kl":
        return logratio
    if kind == "forward_kl":
        return -torch.expm1(-logratio)
    if kind == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratio)
    if not isinstance(alpha, torch.Tensor):
        if abs(alpha - 1.0) < 1e-6:
            return logratio
        return torch.expm1(((alpha - 1.0) * logratio).clamp(max=_ALPHA_CLAMP)) / (alpha - 1.0)
    limit = (alpha - 1.0).abs() < 1e-6  # a 0-d tensor alpha: the limit chosen on the device
    step = torch.where(limit, torch.ones_like(alpha), alpha - 1.0)
    scores = torch.expm1((step * logratio).clamp(max=_ALPHA_CLAMP)) / step
    return torch.where(limit, logratio, scores)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\log(1 - e^{x})` for :math:`x < 0`, without cancellation (Maechler 2012)."""
    small = x < -math.log(2.0)
    return torch.where(small, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def smoothed_sigmoid_loss(z: torch.Tensor, smoothing: float | torch.Tensor) -> torch.Tensor:
    r""":math:`-(1-\epsilon)\log\sigma(z) - \epsilon\log\sigma(-z)` (conservative DPO)."""
    return -(1.0 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)


def check_beta(value: Scalar, owner: str, name: str = "beta") -> float | torch.Tensor:
    """A positive finite coefficient (number or 0-d tensor), the message naming the field."""
    return validate_scalar(value, f"{owner}.{name}", minimum=0.0, strict=True)


def check_fraction(
    value: Scalar, owner: str, name: str, *, maximum: float, strict: bool = False
) -> float | torch.Tensor:
    """A number in ``[0, maximum)`` (``(0, maximum)`` when ``strict``)."""
    return validate_scalar(value, f"{owner}.{name}", minimum=0.0, strict=strict, maximum=maximum)


def check_f_divergence(kind: object, alpha: Scalar, owner: str) -> float | torch.Tensor:
    """Validate the f-divergence fields; returns ``alpha`` (any finite real)."""
    validate_choice(kind, f"{owner}.f_divergence", F_DIVERGENCES)
    return validate_scalar(alpha, f"{owner}.alpha", minimum=None)


class PreferenceObjective:
    """Base class of the preference objects (frozen dataclasses).

    Subclasses define :meth:`loss` (the per-pair formula) and :meth:`rewards` (the implicit
    rewards they report), and the class flags: ``needs_reference`` (the formula reads
    :math:`R_c, R_r`), ``pair_local`` (a pair's loss depends on that pair's quantities only:
    every objective but AOT, which sorts the batch), ``uses_nll`` (reads ``nll``).
    """

    name: ClassVar[str] = "objective"
    needs_reference: ClassVar[bool] = True
    pair_local: ClassVar[bool] = True
    uses_nll: ClassVar[bool] = False

    def loss(self, q: PairQuantities) -> torch.Tensor:
        """The per-pair losses ``(B,)``."""
        raise NotImplementedError

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        """The implicit rewards ``(chosen, rejected)``, each ``(B,)`` (before detaching)."""
        raise NotImplementedError

    def terms(self) -> tuple[tuple[float | torch.Tensor, PreferenceObjective], ...]:
        """``((weight, objective), ...)``: one term of weight 1 for a single objective."""
        return ((1.0, self),)

    def __add__(self, other: object) -> Combination:
        if not isinstance(other, PreferenceObjective):
            return NotImplemented
        return Combination(self.terms() + other.terms())

    def __mul__(self, weight: object) -> Combination:
        if isinstance(weight, bool) or not isinstance(weight, (numbers.Real, torch.Tensor)):
            return NotImplemented
        checked = validate_scalar(weight, "weight", minimum=None)  # type: ignore[arg-type]
        return Combination(tuple((w * checked, o) for w, o in self.terms()))

    __rmul__ = __mul__


@dataclass(frozen=True)
class Combination(PreferenceObjective):
    r"""A weighted sum of objectives: :math:`L_i = \sum_k w_k L^{(k)}_i`.

    Written ``0.8 * DPO(beta=0.1) + 0.2 * BCO(beta=0.1) + 1.0 * SFT()`` (TRL's ``loss_type``
    list with ``loss_weights``: MPO). It needs the reference when a term does, is pair-local
    when every term is, and reports the rewards of its first term.

    Attributes:
        parts: ``((weight, objective), ...)``, at least one; weights finite real numbers (or
            0-d tensors), objectives single (non-combined) preference objects.

    Raises:
        TypeError: ``parts`` not a tuple of ``(number, objective)`` pairs.
        ValueError: no term, or a non-finite weight.

    Examples:
        >>> from rlobjectives import BCO, DPO
        >>> (0.8 * DPO(beta=0.1) + 0.2 * BCO(beta=0.1)).parts[1]
        (0.2, BCO(beta=0.1, delta=0.0))

    .. versionadded:: 0.3.0
    """

    parts: tuple[tuple[float | torch.Tensor, PreferenceObjective], ...]

    name: ClassVar[str] = "combination"

    def __post_init__(self) -> None:
        if not isinstance(self.parts, tuple) or not self.parts:
            raise ValueError(
                f"Combination.parts must be a non-empty tuple of (weight, objective), got "
                f"{describe(self.parts)}"
            )
        for part in self.parts:
            if not (isinstance(part, tuple) and len(part) == 2):
                raise TypeError(
                    f"Combination.parts must hold (weight, objective) pairs, got {describe(part)}"
                )
            weight, objective = part
            validate_scalar(weight, "Combination weight", minimum=None)
            if not isinstance(objective, PreferenceObjective) or isinstance(objective, Combination):
                raise TypeError(
                    "Combination.parts must hold single preference objectives (DPO, BCO, ...), "
                    f"got {describe(objective)}"
                )

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        """Whether a term reads the reference log-probabilities."""
        return any(objective.needs_reference for _, objective in self.parts)

    @property
    def pair_local(self) -> bool:  # type: ignore[override]
        """Whether every term is pair-local."""
        return all(objective.pair_local for _, objective in self.parts)

    @property
    def uses_nll(self) -> bool:  # type: ignore[override]
        """Whether a term reads the NLL share."""
        return any(objective.uses_nll for _, objective in self.parts)

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`\sum_k w_k L^{(k)}_i`."""
        total = torch.zeros_like(q.chosen)
        for weight, objective in self.parts:
            total = total + weight * objective.loss(q)
        return total

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards of the first term."""
        return self.parts[0][1].rewards(q)

    def terms(self) -> tuple[tuple[float | torch.Tensor, PreferenceObjective], ...]:
        """The weighted terms."""
        return self.parts
