r"""DPPO (divergence proximal policy optimisation): a trust region on the token probabilities.

With :math:`p = e^{\ell}` and :math:`p^{old} = e^{\ell^{old}}` the probabilities of the sampled
token under the current and the behaviour policy, :math:`r` the ratio after the log-ratio bound
and :math:`A` the advantage, DPPO keeps the tokens inside a trust region on a *binary*
divergence between :math:`p` and :math:`p^{old}` (not a band on the ratio), one-sided per sign
of the advantage (:math:`A \le 0` takes the low rule, as verl and prime-rl):

.. math::

    \text{TV:}\quad & \text{kept} \iff p - p^{old} \le \delta_{high}\ (A > 0), \quad
        p - p^{old} \ge -\delta_{low}\ (A \le 0); \\
    \text{KL:}\quad & \text{kept} \iff D \le \delta_{high} \lor p \le p^{old}\ (A > 0), \quad
        D \le \delta_{low} \lor p \ge p^{old}\ (A \le 0), \\
    & D = p^{old} \log\frac{p^{old}}{p} + (1 - p^{old}) \log\frac{1 - p^{old} + \varepsilon}
        {1 - p + \varepsilon}, \quad \varepsilon = 10^{-8},

and the surviving tokens get :math:`s = \mathrm{sg}(\min(r, c))\, A\, \ell` (verl's value form,
:math:`c` = ``ratio_cap``); without a cap, :math:`s = rA` (prime-rl's and SkyRL's value form,
the same gradient :math:`rA`). A masked token has value and gradient 0 and stays in the
reduction's denominator, and so has a token of probability 0 (:math:`\ell = -\infty`, e.g. a
sample outside a recomputed kept set). The decision is :func:`dppo_trust_region`, of the
selected log-probabilities as given.

Numerics: :math:`1 - p` is :math:`-\mathrm{expm1}(\ell)` (verl's ``1 - exp(l)`` loses every digit
in float32 for :math:`\ell > -6 \cdot 10^{-8}`, the near-certain tokens;
:func:`~rlobjectives.kl.estimators.binary_kl`),
:math:`p^{old} \log(p^{old}/p) = p^{old}(\ell^{old} - \ell)` is 0 at
:math:`p^{old} = 0` (its limit; verl computes NaN there and masks the token), and the direction
clause compares :math:`\ell` with :math:`\ell^{old}` (exact).

Decisions (``docs/conventions.md``, "Decisions at a bound"): both divergences are evaluated in
**float64** from the log-probabilities of the computation dtype (:math:`\ell` and
:math:`\ell^{old}` as given, never rebuilt from a rounded difference), then compared with
:math:`\delta` rounded to the computation dtype: the exact real-number decision unless the
exact divergence lies within the float64 evaluation's error of the threshold (TV:
:math:`2^{-50}\max(1, p, p^{old})`; KL: :math:`2^{-46}(1 + p^{old}|\Delta| + |\log q|)`),
where the peers' float32 evaluation (and a GPU's approximate ``exp``) errs by about
:math:`2^{-23}`. The cap count :math:`r > c` is the rule's threshold decision on the
bounded log-ratio. The values keep their formulas in the computation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.decisions import ratio_above
from ..._core.fields import check_fields
from ..._core.reduction import select_or_zero
from ..._core.validation import Scalar, scalar_number, validate_scalar
from ...kl.estimators import binary_kl_gap
from .base import PolicyTokens, Surrogate, SurrogateTerms

__all__ = ["DIVERGENCES", "DPPO", "dppo_trust_region"]

#: The divergences of DPPO, with the default threshold of each (SkyRL's documented values; the
#: TV one is prime-rl's ``dppo_mask_low`` / ``dppo_mask_high``).
DIVERGENCES: dict[str, float] = {"tv": 0.2, "kl": 0.05}


@dataclass(frozen=True)
class DPPO(Surrogate):
    r"""DPPO: :math:`s = \mathrm{sg}(\min(r, c)) A \ell` on the tokens inside a binary trust region.

    The trust region is the binary total-variation (``"tv"``) or binary KL (``"kl"``) divergence
    between :math:`p = e^{\ell}` and :math:`p^{old}`, one-sided per sign of :math:`A` (see the
    module docstring for the conditions; :func:`dppo_trust_region` decides them). A token
    outside it has value and gradient 0 and stays in the reduction's denominator; a token
    inside has :math:`\partial s / \partial \ell = \min(r, c) A` (the capped ratio is a
    constant weight, as CISPO's), or, with ``ratio_cap=None``, :math:`s = rA` with the same
    gradient :math:`rA`. The divergence is decided per token: ``ratio_level`` must be
    ``"token"``.

    Attributes:
        divergence: ``"tv"`` (Binary-TV, arXiv:2602.04879 Eq. 13) or ``"kl"`` (Binary-KL, Eq. 14).
        low: :math:`\delta_{low} \ge 0`, the threshold for :math:`A \le 0` tokens (verl's
            ``clip_ratio_low``); None: the divergence's default, 0.2 for ``"tv"`` (prime-rl's
            ``dppo_mask_low``, SkyRL) and 0.05 for ``"kl"`` (SkyRL's recommendation). For
            ``"tv"`` at most 1 (``|p - p_old| <= 1``).
        high: :math:`\delta_{high} \ge 0`, the threshold for :math:`A > 0` tokens (verl's
            ``clip_ratio_high``); None means ``low``.
        ratio_cap: :math:`c > 0`, the cap of the ratio weight (verl's ``clip_ratio_c``; the
            paper recommends a large value, Sec. 5.4: 20.0). None: no cap, and the value form
            :math:`rA` of prime-rl and SkyRL (same gradient where :math:`r \le c`).

    Raises:
        ValueError: an unknown ``divergence``, a negative threshold, a ``"tv"`` threshold above
            1, ``ratio_cap <= 0`` or a non-finite value (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor (``divergence``: not
            a string).

    References:
        DPPO, arXiv:2602.04879 Eq. 13 (Binary-TV) and Eq. 14 (Binary-KL), Sec. 5.4 (the cap).

    Peer options: verl ``policy_loss.loss_mode="dppo_tv"`` / ``"dppo_kl"`` =
    ``DPPO(divergence, low=clip_ratio_low, high=clip_ratio_high, ratio_cap=clip_ratio_c)``
    (verl's ``ActorConfig.clip_ratio_c`` is 3.0 unless set); prime-rl ``default_loss_fn`` =
    ``DPPO("tv", low=dppo_mask_low, high=dppo_mask_high, ratio_cap=None)`` with
    ``log_ratio_bound=None`` (plus its ``kl_tau`` term); SkyRL ``dppo_policy_loss`` =
    ``DPPO("tv" | "kl", low=delta_low, high=delta_high, ratio_cap=None)``.

    Examples:
        >>> DPPO()
        DPPO(divergence='tv', low=0.2, high=0.2, ratio_cap=20.0)
        >>> DPPO("kl", ratio_cap=3.0)
        DPPO(divergence='kl', low=0.05, high=0.05, ratio_cap=3.0)

    .. versionadded:: 0.3.0
    """

    divergence: str = "tv"
    low: Scalar | None = None
    high: Scalar | None = None
    ratio_cap: Scalar | None = 20.0

    name: ClassVar[str] = "dppo"
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "decides its trust region per token"

    def __post_init__(self) -> None:
        if not isinstance(self.divergence, str):
            raise TypeError(
                f"DPPO.divergence must be a string, one of {sorted(DIVERGENCES)}, got "
                f"{type(self.divergence).__name__} ({self.divergence!r})"
            )
        if self.divergence not in DIVERGENCES:
            raise ValueError(
                f"DPPO.divergence must be one of {sorted(DIVERGENCES)}, got {self.divergence!r}"
            )
        low = DIVERGENCES[self.divergence] if self.low is None else self.low
        low = self._threshold(low, "low")
        high = low if self.high is None else self._threshold(self.high, "high")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)
        check_fields(self, "ratio_cap", strict=True)

    def _threshold(self, value: Scalar, field: str) -> float | torch.Tensor:
        checked = validate_scalar(value, f"DPPO.{field}", minimum=0.0)
        number = scalar_number(checked)  # a 0-d tensor is held to the same range
        if self.divergence == "tv" and number is not None and number > 1.0:
            raise ValueError(
                f"DPPO.{field} must be <= 1 for divergence='tv' (|p - p_old| <= 1), got {number}"
            )
        return checked

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`\mathrm{sg}(\min(r, c)) A \ell` (or :math:`rA`) in the trust region, else 0."""
        advantages, mask, log_probs = tokens.advantages, tokens.mask, tokens.log_probs
        kept = dppo_trust_region(log_probs.detach(), tokens.old_log_probs, advantages, self)
        kept = kept & mask
        active = kept & (log_probs > -torch.inf)  # a token of probability 0 contributes nothing
        ratio = torch.exp(tokens.log_ratio)
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        if self.ratio_cap is None:  # r A: gradient r A
            selected = select_or_zero(ratio, active)
            values, weight, capped = selected * advantages, selected.detach(), None
        else:  # sg(min(r, c)) A l
            weight = torch.where(active, torch.clamp(ratio.detach(), max=self.ratio_cap), zero)
            values = weight * advantages * select_or_zero(log_probs, active)
            capped = kept & ratio_above(tokens.log_ratio.detach(), self.ratio_cap)  # the rule
        outside = mask & ~kept
        return SurrogateTerms(
            values,
            weight,
            out_of_band=outside,
            below=outside & (advantages < 0),
            above=outside & (advantages > 0),
            dual=capped,
        )


def dppo_trust_region(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    dppo: DPPO,
) -> torch.Tensor:
    r"""Where a token stays inside DPPO's trust region (the broadcast shape of the inputs).

    The one decision rule of DPPO (module docstring): ``"tv"``: :math:`p - p^{old} \le
    \delta_{high}` for :math:`A > 0`, :math:`p - p^{old} \ge -\delta_{low}` for :math:`A \le 0`;
    ``"kl"``: :math:`D \le \delta_{high} \lor \ell \le \ell^{old}` for :math:`A > 0`,
    :math:`D \le \delta_{low} \lor \ell \ge \ell^{old}` for :math:`A \le 0`
    (:func:`~rlobjectives.kl.estimators.binary_kl`). The divergences are evaluated in float64
    from the inputs (the
    computation dtype) and compared with the thresholds rounded to the computation dtype
    (``docs/conventions.md``, "Decisions at a bound": the exact decision outside a window of the
    float64 evaluation's error); a NaN divergence is outside.

    It reads the selected log-probabilities as given (zeros elsewhere: inside; detached), in
    the computation dtype, and returns a bool tensor.

    Per sign :math:`\sigma = \pm 1` of :math:`A` (:math:`A \le 0`: :math:`-1`) and its threshold
    :math:`\delta_\sigma`, the TV rule is :math:`\sigma (p - p^{old}) \le \delta_\sigma` (a sign
    flip is exact) and the KL rule :math:`D \le \delta_\sigma` or :math:`\sigma \Delta \le 0`.
    """
    compute, device = log_probs.dtype, log_probs.device
    wide = torch.float64  # the evaluation dtype of the divergences (the rule)
    log_ratio = log_probs - old_log_probs  # only its sign is read (exact: l vs l_old)
    positive = (advantages > 0).to(wide)  # shape of A
    # the thresholds rounded to the computation dtype, then widened (exact)
    low = torch.as_tensor(dppo.low, dtype=wide, device=device).detach().to(compute).to(wide)
    high = torch.as_tensor(dppo.high, dtype=wide, device=device).detach().to(compute).to(wide)
    threshold = torch.lerp(low, high, positive)  # high where A > 0, else low (exact at 0, 1)
    sign = positive.mul(2.0).sub_(1.0)  # +1 where A > 0, else -1
    wide_log_probs, old_log_probs = log_probs.to(wide), old_log_probs.to(wide)
    if dppo.divergence == "tv":
        moved = torch.exp(wide_log_probs).sub_(torch.exp(old_log_probs)).mul_(sign)
        kept = torch.le(moved, threshold, out=moved)  # sign (p - p_old) <= delta, in float64
    else:
        along = torch.le(log_ratio.sign().to(wide) * sign, 0.0)  # sign Delta <= 0: along A's
        gap = old_log_probs - wide_log_probs  # l_old - l in float64
        divergence = binary_kl_gap(wide_log_probs, old_log_probs, gap)
        kept = torch.le(divergence, threshold, out=divergence)
        kept = torch.maximum(kept, along.to(wide), out=kept)
    return kept > 0.5
