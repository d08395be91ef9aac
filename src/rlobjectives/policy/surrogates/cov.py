r"""Clip-Cov and KL-Cov (entropy-collapse remedies): act on the tokens of largest covariance.

With :math:`\ell` the current log-probability (detached), :math:`A` the advantage and
:math:`\bar\ell`, :math:`\bar A` their exact means over the :math:`N` selected tokens of the
call, each token's centred covariance is

.. math::

    \mathrm{cov}_t = (A_t - \bar A)(\ell_t - \bar\ell),

(:func:`~rlobjectives._core.selection.centered_covariance`) and
:math:`k = \max(\lfloor \rho N \rfloor, 1)` tokens are selected (:math:`\rho` = ``ratio``):

- **Clip-Cov** (:class:`ClipCov`, verl ``clip_cov``): PPO's clip without the dual clip,
  :math:`s = \min(rA, \mathrm{clip}(r, 1 - \epsilon_{low}, 1 + \epsilon_{high})A)`, and
  :math:`\min(k, n)` of the :math:`n` candidates (tokens the band does not clip with
  :math:`\mathrm{cov}_{lb} < \mathrm{cov}_t < \mathrm{cov}_{ub}`) drawn uniformly at random are
  *detached*: their value and gradient are 0 (they stay in the reduction's denominator).
- **KL-Cov** (:class:`KLCov`, verl ``kl_cov``): no clipping, :math:`s = rA`, and the top-k by
  covariance (ties: the earlier token) are *penalised*: :math:`s = rA - \beta|\Delta|` there
  (:math:`\Delta` the log-ratio after its bound).

The selections need the whole call: both objects run the autograd specification (their
``terms``), per call (verl and SkyRL select per micro-batch and rank).
:func:`rlobjectives.cov_selection` gives an object's selection on any batch (for example once
per mini-batch, sliced into its micro-batches),
:func:`rlobjectives.distributed.global_cov_selection` over every rank, and ``selection=``
hands a precomputed one to the object.

Clip-Cov's draw is reproducible and device-side: one int64 seed per call from ``generator``
(or the default generator), then a counter-based hash of each token's ordinal among the
selected tokens (:func:`~rlobjectives._core.selection.random_subset`): the same
draw on every device and in the padded and the packed layout, with no host sync. It is not
verl's draw (verl's ``torch.randperm(n)`` over the row-major candidates needs ``n`` on the
host); the verl preset reproduces verl's own draw through ``selection=``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from ..._core.fields import check_fields, check_order
from ..._core.selection import (
    centered_covariance,
    check_selection,
    draw_seed,
    random_subset,
    selection_count,
    top_k,
    validate_ratio,
    validate_selection,
)
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms
from .clip import Clip

__all__ = ["ClipCov", "CovSelection", "KLCov"]


class CovSelection(NamedTuple):
    r"""The tokens a Clip-Cov / KL-Cov object acts on in one call.

    Attributes:
        selected: bool, the mask's shape: Clip-Cov's detached tokens, KL-Cov's penalised ones.
        candidates: bool, the mask's shape: Clip-Cov's candidates (selected tokens the band
            does not clip, the covariance inside its bounds); KL-Cov: the selected tokens.
        k: 0-d int64, :math:`k = \max(\lfloor \rho N \rfloor, 1)` (at most ``k`` are
            selected; fewer when there are fewer candidates).
    """

    selected: torch.Tensor
    candidates: torch.Tensor
    k: torch.Tensor


@dataclass(frozen=True)
class ClipCov(Surrogate):
    r"""Clip-Cov: PPO's clip, with a random few of the high-covariance tokens detached.

    :math:`s = \min(rA, \mathrm{clip}(r, 1 - \epsilon_{low}, 1 + \epsilon_{high})A)` (no dual
    clip), and :math:`\min(k, n)` tokens drawn uniformly at random among the ``n`` candidates
    (selected tokens the band does not clip, with ``cov_lb < cov < cov_ub``) get value and
    gradient 0 (see the module docstring). The selection needs the whole call: the autograd
    formula :meth:`ClipCov.terms` runs per call (not token-local), ``ratio_level`` must be
    ``"token"``. Diagnostics: the clip fields are the band's (as :class:`~rlobjectives.Clip`),
    ``selected_fraction`` the detached fraction (verl's ``pg_clipfrac`` for this mode).

    Attributes:
        ratio: :math:`0 < \rho \le 1`, the fraction :math:`k = \max(\lfloor\rho N\rfloor, 1)`
            (verl ``policy_loss.clip_cov_ratio``, default 0.0002).
        low: :math:`0 \le \epsilon_{low} < 1` (verl ``clip_ratio_low``, default 0.2).
        high: :math:`\epsilon_{high} \ge 0`; None means ``low`` (verl ``clip_ratio_high``).
        cov_lb: the covariance's lower bound (strict; verl ``clip_cov_lb``, default 1.0).
        cov_ub: the covariance's upper bound (strict; verl ``clip_cov_ub``, default 5.0),
            above ``cov_lb``.
        generator: the ``torch.Generator`` one int64 seed per call is drawn from (eager only:
            a generator cannot enter ``torch.compile``); None: the default generator of the
            tokens' device (``torch.manual_seed`` makes the draw reproducible).
        selection: a precomputed bool selection of the call's tokens (the mask's shape;
            :func:`rlobjectives.cov_selection`, the global variant, or the verl preset's own
            draw) replacing the draw; None: draw per call. Not part of equality.

    Raises:
        ValueError: ``ratio`` outside ``(0, 1]``, ``low`` outside ``[0, 1)``, a negative
            ``high``, ``cov_lb >= cov_ub``, or a non-finite value (the message names the field);
            at the call, a ``selection`` of another shape or device than the mask.
        TypeError: a field of the wrong type (``generator`` not a ``torch.Generator``,
            ``selection`` not a bool tensor).

    References:
        Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models", arXiv:2505.22617 (Clip-Cov: the covariance-based entropy control
        that detaches tokens).

    Peer options: verl ``policy_loss.loss_mode="clip_cov"`` = ``ClipCov(ratio=clip_cov_ratio,
    low=clip_ratio_low, high=clip_ratio_high, cov_lb=clip_cov_lb, cov_ub=clip_cov_ub)`` with
    ``log_ratio_bound=None`` (verl's ratio is unbounded) and verl's draw through ``selection``;
    SkyRL ``clip_cov`` (the same code on its pre-scaled advantages).

    Examples:
        >>> ClipCov()
        ClipCov(ratio=0.0002, low=0.2, high=None, cov_lb=1.0, cov_ub=5.0, generator=None)

    .. versionadded:: 0.3.0
    """

    ratio: Scalar = 0.0002
    low: Scalar = 0.2
    high: Scalar | None = None
    cov_lb: Scalar = 1.0
    cov_ub: Scalar = 5.0
    generator: torch.Generator | None = None
    selection: torch.Tensor | None = field(default=None, repr=False, compare=False)

    name: ClassVar[str] = "clip_cov"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "selects tokens of the whole call"

    def selects_from_call(self) -> bool:
        """Without ``selection`` the object selects from the whole call (see the base class)."""
        return self.selection is None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", validate_ratio(self.ratio, "ClipCov.ratio"))
        check_fields(self, "low", maximum=1.0, optional=False)
        check_fields(self, "high")
        check_order(self, "cov_lb", "cov_ub")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(
                f"ClipCov.generator must be None or a torch.Generator, got "
                f"{type(self.generator).__name__}"
            )
        validate_selection(self.selection, "ClipCov.selection")

    def band(self, inputs: PolicyTokens) -> SurrogateTerms:
        """PPO's clip of the object (``Clip(low, high)``, no dual clip) on the call."""
        return Clip(low=self.low, high=self.high).surrogate(inputs.log_ratio, inputs.advantages)

    def candidates(
        self,
        inputs: PolicyTokens,
        band: SurrogateTerms,
        means: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Selected tokens the band does not clip with ``cov_lb < cov < cov_ub`` (strict).

        ``means``: the covariance's means over every rank (the global selection), else the
        call's.
        """
        mask = inputs.mask
        covariance = centered_covariance(inputs.log_probs.detach(), inputs.advantages, mask, means)
        assert band.below is not None and band.above is not None  # Clip names both sets
        unclipped = mask & ~(band.below | band.above)
        return unclipped & (covariance > self.cov_lb) & (covariance < self.cov_ub)

    def select(self, inputs: PolicyTokens, band: SurrogateTerms) -> CovSelection:
        """The detached tokens: ``selection``, or ``min(k, n)`` candidates drawn at random."""
        mask = inputs.mask
        candidates = self.candidates(inputs, band)
        count = selection_count(self.ratio, mask.sum())
        if self.selection is not None:
            selected = check_selection(self.selection, mask, "ClipCov.selection")
        else:
            seed = draw_seed(self.generator, mask.device)
            selected = random_subset(candidates, mask, count, seed)
        return CovSelection(selected, candidates, count)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r"""PPO's clip, 0 (value and gradient) at the drawn high-covariance tokens."""
        band = self.band(tokens)
        selected = self.select(tokens, band).selected
        zero = torch.zeros((), dtype=band.values.dtype, device=band.values.device)
        assert band.weight is not None
        return band._replace(
            values=torch.where(selected, zero, band.values),
            weight=torch.where(selected, zero, band.weight),
            selected=selected,
        )


@dataclass(frozen=True)
class KLCov(Surrogate):
    r"""KL-Cov: :math:`s = rA`, minus :math:`\beta|\Delta|` at the top-k tokens by covariance.

    No clipping; the :math:`k = \max(\lfloor\rho N\rfloor, 1)` selected tokens of largest
    covariance (a deterministic top-k, ties to the earlier token) get the penalty
    :math:`\beta|\Delta|` (gradient :math:`\beta\,\mathrm{sign}(\Delta)`, 0 at
    :math:`\Delta = 0`: the first PPO step of a batch is unpenalised). The selection needs the
    whole call: its formula :meth:`KLCov.terms` runs per call (not token-local),
    ``ratio_level`` must be ``"token"``. Diagnostics: the clip fields are 0,
    ``selected_fraction`` is the penalised fraction, ``weight_mean`` the mean ratio.

    Attributes:
        ratio: :math:`0 < \rho \le 1` (verl ``policy_loss.kl_cov_ratio``, default 0.0002;
            SkyRL's ``kl_cov_frac`` is 0.2, the paper's 2e-3 for 7B and 2e-4 for 32B models).
        coef: :math:`\beta \ge 0` (verl ``policy_loss.ppo_kl_coef``, default 0.1; the paper and
            SkyRL use 1.0).
        selection: a precomputed bool selection of the call's tokens (the mask's shape;
            :func:`rlobjectives.cov_selection`, the global variant) replacing the top-k; None:
            select per call. Not part of equality.

    Raises:
        ValueError: ``ratio`` outside ``(0, 1]``, a negative ``coef`` or a non-finite value
            (the message names the field); at the call, a ``selection`` of another shape or
            device than the mask.
        TypeError: a field of the wrong type (``selection`` not a bool tensor).

    References:
        Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models", arXiv:2505.22617 (KL-Cov: the covariance-based entropy control
        that penalises tokens).

    Peer options: verl ``policy_loss.loss_mode="kl_cov"`` = ``KLCov(ratio=kl_cov_ratio,
    coef=ppo_kl_coef)`` with ``log_ratio_bound=None`` (verl's ratio and :math:`|\Delta|` are
    unbounded); SkyRL ``kl_cov`` (the same code on its pre-scaled advantages).

    Examples:
        >>> KLCov()
        KLCov(ratio=0.0002, coef=0.1)

    .. versionadded:: 0.3.0
    """

    ratio: Scalar = 0.0002
    coef: Scalar = 0.1
    selection: torch.Tensor | None = field(default=None, repr=False, compare=False)

    name: ClassVar[str] = "kl_cov"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "selects tokens of the whole call"

    def selects_from_call(self) -> bool:
        """Without ``selection`` the object selects from the whole call (see the base class)."""
        return self.selection is None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", validate_ratio(self.ratio, "KLCov.ratio"))
        check_fields(self, "coef")
        validate_selection(self.selection, "KLCov.selection")

    def select(self, inputs: PolicyTokens) -> CovSelection:
        """The penalised tokens: ``selection``, or the top-k by covariance."""
        mask = inputs.mask
        count = selection_count(self.ratio, mask.sum())
        if self.selection is not None:
            selected = check_selection(self.selection, mask, "KLCov.selection")
        else:
            covariance = centered_covariance(inputs.log_probs.detach(), inputs.advantages, mask)
            selected = top_k(covariance, mask, count)
        return CovSelection(selected, mask, count)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`rA`, minus :math:`\beta|\Delta|` at the selected tokens."""
        ratio = torch.exp(tokens.log_ratio)
        selected = self.select(tokens).selected
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        penalty = torch.where(selected, self.coef * torch.abs(tokens.log_ratio), zero)
        values = ratio * tokens.advantages - penalty
        return SurrogateTerms(values, ratio.detach(), selected=selected)
