r"""M2PO (second-moment trust policy optimisation): mask the tokens of the largest :math:`\Delta^2`.

For stale (asynchronous) rollouts: with :math:`\Delta = \ell - \ell^{old}` the token log-ratios
of the call's selected tokens, M2PO masks the fewest tokens of the largest :math:`\Delta^2`
such that the second moment of the kept ones, :math:`\frac{1}{|K|}\sum_{t \in K}\Delta_t^2`,
is below the threshold :math:`\tau` (AReaL ``_get_m2po_loss_mask``; at least one token is
kept; :func:`rlobjectives._core.selection.m2po_kept`), then optimises the
unclipped surrogate :math:`s = rA` (the paper's) or PPO's clip on the kept tokens :math:`K`:

.. math::

    \mathcal{L} = \mathrm{reduce}_K\big(-s\big), \qquad s = rA \ \text{or}\
    \min\big(rA, \mathrm{clip}(r, 1 - \epsilon_{low}, 1 + \epsilon_{high})A\big).

The kept tokens form the surrogate's selection: ``token_mean`` divides by :math:`|K|` (AReaL's
``ppo_actor_loss_fn``, which divides by the M2PO-masked loss mask), ``sequence_mean`` by each
row's kept count (a row with nothing kept leaves the mean). The other terms keep the call's
mask and reduction (the entropy bonus, the KL term of
:func:`rlobjectives.fused_policy_loss_from_hidden`: M2PO selects the tokens of its surrogate),
and so do the diagnostics (``selected_fraction`` is the masked fraction); ``per_token_loss``
is :math:`-s` at the kept tokens, 0 at the masked ones, plus the bonus. The
paper's denominator, the original token count :math:`\sum_i |o_i|` (arXiv:2510.01161, the
objective with the M2PO mask), is ``normalizer=`` that count with ``reduction="token_mean"``.

The mask needs the whole call: it is computed per call (the peers' micro-batch, locally on each
rank, as AReaL); :func:`rlobjectives.m2po_mask` computes it on any batch (for example once per
mini-batch, or on AReaL's decoupled log-ratio ``old_log_probs - rollout_log_probs``) and
:func:`rlobjectives.distributed.global_m2po_mask` over every rank, to pass as the mask of a
plain :class:`~rlobjectives.Clip` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.fields import check_band, check_fields
from ..._core.selection import m2po_kept
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms
from .clip import Clip

__all__ = ["M2PO"]


@dataclass(frozen=True)
class M2PO(Surrogate):
    r"""M2PO: the second-moment mask, then :math:`s = rA` (or PPO's clip) on the kept tokens.

    The kept tokens :math:`K` are those left after masking the fewest of the largest
    :math:`\Delta^2` whose removal brings the second moment of the rest below ``threshold``
    (see the module docstring); :math:`\Delta` is the call's raw log-ratio (detached). A
    masked token has value and gradient 0 and leaves the surrogate's selection (AReaL's
    denominator, the kept count; the entropy bonus keeps the call's tokens); the diagnostics
    are over the call's selected tokens, with ``selected_fraction`` the masked fraction. The
    mask needs the whole call (not token-local); ``ratio_level`` must be ``"token"``.

    Attributes:
        threshold: :math:`\tau > 0`, the bound of the kept tokens' second moment (AReaL's
            ``m2_threshold``; 0.04, the value of the paper and of AReaL's example).
        low: :math:`0 \le \epsilon_{low} < 1`: PPO's clip band ``[1 - low, 1 + high]`` on
            the kept tokens (AReaL's ``eps_clip``, the clip of ``ppo_actor_loss_fn``); None
            (default): the unclipped :math:`rA` of the paper.
        high: :math:`\epsilon_{high} \ge 0`; None means ``low``. Needs ``low``.

    Raises:
        ValueError: ``threshold <= 0``, ``low`` outside ``[0, 1)``, a negative ``high``,
            ``high`` without ``low`` or a non-finite value (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
        Stale Data on LLMs?" (M2PO), arXiv:2510.01161 (the second-moment trust region and its
        greedy token mask); AReaL ``areal/trainer/ppo/actor.py`` ``_get_m2po_loss_mask``.

    Peer options: AReaL ``actor.m2_threshold`` = ``M2PO(threshold=m2_threshold)`` with
    ``eps_clip`` as ``low`` when the loss is taken at the proximal point; AReaL's decoupled
    setup (:math:`\Delta` = behaviour minus proximal log-probs) is
    :func:`rlobjectives.m2po_mask` on that log-ratio, then ``policy_loss(...,
    surrogate=Clip(low=eps_clip))`` on the kept mask.

    Examples:
        >>> M2PO()
        M2PO(threshold=0.04, low=None, high=None)

    .. versionadded:: 0.3.0
    """

    threshold: Scalar = 0.04
    low: Scalar | None = None
    high: Scalar | None = None

    name: ClassVar[str] = "m2po"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "selects tokens of the whole call"

    def __post_init__(self) -> None:
        check_fields(self, "threshold", strict=True)
        check_band(self, "is the unclipped r A")

    def selects_from_call(self) -> bool:
        """M2PO's mask is a selection of the whole call (see the base class)."""
        return True

    def kept(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The kept tokens ``K`` (bool, the shape of ``mask``) of the call's raw log-ratio."""
        return m2po_kept(log_ratio.detach(), mask, self.threshold)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`rA` (or PPO's clip) at the kept tokens, 0 at the masked ones."""
        mask, advantages = tokens.mask, tokens.advantages
        kept = self.kept(tokens.log_probs.detach() - tokens.old_log_probs, mask)  # (B, T)
        if self.low is None:
            ratio = torch.exp(tokens.log_ratio)
            band = SurrogateTerms(ratio * advantages, ratio.detach())
        else:
            band = Clip(low=self.low, high=self.high).surrogate(tokens.log_ratio, advantages)
        assert band.weight is not None
        zero = torch.zeros((), dtype=band.values.dtype, device=band.values.device)
        sets = (band.out_of_band, band.below, band.above, band.dual)
        out_of_band, below, above, dual = (None if f is None else kept & f for f in sets)
        return SurrogateTerms(
            torch.where(kept, band.values, zero),
            torch.where(kept, band.weight, zero),
            out_of_band,
            below,
            above,
            dual,
            selected=mask & ~kept,
            loss_mask=kept,
        )
