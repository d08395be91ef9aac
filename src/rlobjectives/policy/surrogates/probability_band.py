r"""The probability-band trust region of prime-rl's ``ipo`` loss: :class:`ProbabilityBand`.

With :math:`p = e^{\ell}` and :math:`p^{old} = e^{\ell^{old}}` the sampled token's
probabilities, :math:`x` the bounded log-ratio, :math:`r = e^x` and :math:`A` the advantage,

.. math::

    s = \mathbb{1}\big[|p - p^{old}| \le \tau\big]\, r A - \kappa x^2,

per selected token (the loss is :math:`-s`): the ratio term where the token's probability
moved by at most :math:`\tau` in absolute terms (either sign of :math:`A`), and a squared
log-ratio penalty at every selected token. The band is decided as DPPO's binary-TV trust region
(:func:`~rlobjectives.policy.surrogates.dppo.dppo_trust_region`): :math:`e^{\ell} -
e^{\ell^{old}}` evaluated in float64 from the log-probabilities as given, compared with
:math:`\tau` rounded to the computation dtype (``docs/conventions.md``, "Decisions at a bound").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.fields import check_fields
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms

__all__ = ["ProbabilityBand"]


@dataclass(frozen=True)
class ProbabilityBand(Surrogate):
    r"""A band on the token probability, prime-rl's ``ipo`` loss.

    .. math::

        s = \mathbb{1}\big[|p - p^{old}| \le \tau\big]\, rA - \kappa x^2,

    :math:`p = e^{\ell}`, :math:`r = e^x`. Token-local; the gradient is
    :math:`\mathbb{1}[|p - p^{old}| \le \tau]\, rA - 2\kappa x`: the ratio term only inside the
    band, the penalty everywhere (it pulls the policy back toward :math:`\pi^{old}`, also at
    :math:`A = 0`). :math:`x` is the log-ratio after ``log_ratio_bound`` (prime-rl's is
    unbounded: ``log_ratio_bound=None``), with gradient 0 where the bound fires.
    ``ratio_level`` must be ``"token"`` (the band is per token).

    Attributes:
        tau: :math:`0 \le \tau \le 1`, the band's half-width on :math:`p - p^{old}`
            (``|p - p_old| <= 1`` always).
        kappa: :math:`\kappa \ge 0`, the coefficient of the squared log-ratio.

    Raises:
        ValueError: ``tau`` outside ``[0, 1]``, a negative ``kappa`` or a non-finite value (the
            message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        prime-rl ``ipo_loss_fn`` (``src/prime_rl/trainer/rl/loss.py``); the band is DPPO's
        binary-TV trust region made symmetric, arXiv:2602.04879 Eq. 13; the penalty is the
        Kimi K2.5 squared log-ratio, arXiv:2602.02276.

    Peer options: prime-rl ``[trainer.loss] type = "ipo"`` = ``ProbabilityBand(tau=ipo_threshold,
    kappa=kl_tau)`` with the advantages times ``adv_tau``, ``log_ratio_bound=None`` and
    ``normalizer=rl_scale`` (its global loss-token count).

    Examples:
        >>> ProbabilityBand()
        ProbabilityBand(tau=0.1, kappa=0.001)

    .. versionadded:: 0.4.0
    """

    tau: Scalar = 0.1
    kappa: Scalar = 1e-3

    name: ClassVar[str] = "probability_band"
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "decides its band per token"

    def __post_init__(self) -> None:
        check_fields(self, "tau", at_most=1.0, reason=" (|p - p_old| <= 1)")
        check_fields(self, "kappa")

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`\mathbb{1}[|p - p^{old}| \le \tau]\, rA - \kappa x^2`."""
        log_ratio, advantages = tokens.log_ratio, tokens.advantages
        compute, wide = log_ratio.dtype, torch.float64
        # p - p_old in float64 from the log-probabilities as given (the rule of DPPO's TV), each
        # exp in place on its own copy
        moved = tokens.log_probs.detach().to(wide, copy=True).exp_()
        moved = moved.sub_(tokens.old_log_probs.to(wide, copy=True).exp_())  # (B, T)
        tau = torch.as_tensor(self.tau, dtype=wide, device=moved.device).detach()
        tau = tau.to(compute).to(wide)  # tau rounded to the computation dtype
        # Outside the band: the sign bit of tau - |p - p_old| (the edge, +0, inside).
        if torch.compiler.is_compiling():
            # Inductor's CPU code. The decision as an int8 (-1 outside, 0 inside) is what the
            # backward keeps: not a mask, which that code stores slowly, nor the float64 work,
            # which it would otherwise redo; taken by an arithmetic shift of the float64's bits,
            # as it converts a float64 (or its mask) to int8 element by element. tau - |.| out of
            # place: in place it costs the compiled loss a fifth of Clip()'s time.
            margin = tau - moved.abs_()
            # A select with equal branches, a no-op that reads the advantages: the decision is
            # then one loop with the values over their broadcast. Read from the log-probabilities
            # alone it is a flat loop of its own (with the log-ratio, which it shares reads with),
            # and Inductor merges no such pair into the loop over (B, 1) advantages.
            margin = torch.where(advantages == advantages, margin, margin)
            outside_code = (margin.view(torch.int64) >> 63).to(torch.int8)
            outside, kept = outside_code < 0, outside_code + 1
        else:  # eager: a bool, tau - |.| in place
            outside = torch.signbit(torch.sub(tau, moved.abs_(), out=moved))
            kept = outside.logical_not()
        gated = torch.exp(log_ratio) * kept  # 1[kept] r
        values = gated * advantages
        if isinstance(self.kappa, torch.Tensor):
            values = values - self.kappa * log_ratio.square()
        else:  # the same sum, one pass fewer
            values = values.addcmul(log_ratio, log_ratio, value=-self.kappa)
        x = log_ratio.detach()
        up, down = outside & (x > 0), outside & (x < 0)  # p above / below the band
        negative = advantages < 0
        return SurrogateTerms(
            values,
            gated.detach(),
            out_of_band=outside,
            below=down & negative,
            above=up & (advantages > 0),
            dual=up & negative,
        )
