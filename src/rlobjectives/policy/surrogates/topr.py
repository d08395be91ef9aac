r"""TOPR (Tapered Off-Policy REINFORCE, ROLL's ``topr``): :class:`TOPR`.

With :math:`\ell` the log-probability, :math:`A` the advantage, :math:`r = e^x` the token's
ratio after the log-ratio bound and :math:`R_i` the reward of the token's response,

.. math::

    s = w\,A\,\ell, \qquad w = \begin{cases} w_+ & R_i > 0 \\
    w_-\,\mathrm{sg}\big(\mathrm{clip}(r, 0, 1)\big) & R_i \le 0, \end{cases}

per selected token (the loss is :math:`-s`): the supervised update on the responses with a
positive reward, truncated importance sampling on the others. The reward's sign chooses the
branch, so the object holds the rewards of the call's responses (one per sequence); each
token's value reads its own token and its response's reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..._core.decisions import ratio_above
from ..._core.fields import check_fields
from ..._core.layout import per_sequence
from ..._core.validation import ArrayLike, Scalar, as_float_tensor
from .base import PolicyTokens, Surrogate, SurrogateTerms, sampled_log_probs

__all__ = ["TOPR"]


@dataclass(frozen=True)
class TOPR(Surrogate):
    r"""TOPR: :math:`s = w A \ell`, :math:`w = w_+` or :math:`w_- \mathrm{sg}(\min(r, 1))`.

    Responses with :math:`R_i > 0` take :math:`w = w_+` (``positive_weight``: the SFT-like
    update, no ratio); the others (:math:`R_i \le 0`, zero included) take the ratio truncated
    to :math:`[0, 1]` as a constant, times :math:`w_-` (``negative_weight``). The gradient is
    :math:`wA` at every selected token. The ratio is the token's (ROLL's); TOPR's paper writes
    the sequence's :math:`\pi(\tau)/\mu(\tau)` (``ratio_level="sequence"`` gives the
    length-normalised sequence ratio of GSPO instead; ``docs/objectives/policy.md``). The
    truncation count :math:`r > 1` follows ``docs/conventions.md`` ("Decisions at a bound").
    Not token-local (a token reads its response's reward): the hidden-state path composes.

    Attributes:
        rewards: ``(S,)`` (or ``(S, 1)``) the reward of each sequence of the call (only its
            sign is read: :math:`R > 0` is positive, NaN is not); a tensor, array or list.
        positive_weight: :math:`w_+ \ge 0` (ROLL ``topr_positive_weight``).
        negative_weight: :math:`w_- \ge 0` (ROLL ``topr_negative_weight``).

    Raises:
        ValueError: ``rewards`` not one value per sequence (here: not 1-D; at the call: not the
            call's ``S`` sequences, or on another device), a negative weight or a non-finite
            one (the message names the field).
        TypeError: non-numeric ``rewards``, or a weight that is not a real number or a 0-d
            real tensor.

    References:
        Le Roux et al. 2025, TOPR, arXiv:2503.14286 Eq. 8.

    Peer options: ROLL ``pg_variant: topr`` = ``TOPR(rewards=scores,
    positive_weight=topr_positive_weight, negative_weight=topr_negative_weight)`` with
    ``log_ratio_bound=None`` and ROLL's ``loss_agg_mode`` as the reduction.

    Examples:
        >>> TOPR([1.0, 0.0], negative_weight=0.5)
        TOPR(rewards=tensor([1., 0.]), positive_weight=1.0, negative_weight=0.5)

    .. versionadded:: 0.4.0
    """

    rewards: ArrayLike = field(compare=False)
    positive_weight: Scalar = 1.0
    negative_weight: Scalar = 1.0

    name: ClassVar[str] = "topr"
    token_local: ClassVar[bool] = False

    def __post_init__(self) -> None:
        rewards = as_float_tensor(self.rewards, "TOPR.rewards").detach()
        if rewards.ndim == 2 and rewards.shape[1] == 1:
            rewards = rewards.squeeze(-1)
        if rewards.ndim != 1:
            raise ValueError(
                f"TOPR.rewards must have shape (S,) or (S, 1) (one reward per sequence), got "
                f"shape {tuple(rewards.shape)}"
            )
        object.__setattr__(self, "rewards", rewards)
        check_fields(self, "positive_weight", "negative_weight")

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`w A \ell` with :math:`w` chosen by the sign of the response's reward."""
        advantages, layout = tokens.advantages, tokens.layout
        rewards = per_sequence(self.rewards, "TOPR.rewards", layout, "the call")  # type: ignore[arg-type]
        if rewards.device != advantages.device:
            raise ValueError(
                f"TOPR.rewards must be on the device of the call's tensors ({advantages.device}), "
                f"got {rewards.device}"
            )
        positive = layout.expand(rewards > 0)  # (B, 1) or (1, N)
        x = tokens.log_ratio.detach()
        truncated = torch.clamp(torch.exp(x), max=1.0)  # clip(r, 0, 1): r > 0
        weight = torch.where(positive, self.positive_weight, self.negative_weight * truncated)
        values = weight * advantages * sampled_log_probs(tokens.log_probs)
        clipped = ratio_above(x, 1.0) & ~positive  # the truncation changes the weight
        return SurrogateTerms(
            values,
            weight,
            out_of_band=clipped,
            above=clipped & (advantages > 0),
            dual=clipped & (advantages < 0),
        )
