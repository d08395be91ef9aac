r"""REAL (Rewards as Labels, ms-swift's ``real``): in-group classification, :class:`REAL`.

Each response :math:`i` has the score :math:`S_i = \frac{1}{n_i}\sum_t x_{it}` (its mean
bounded log-ratio over its :math:`n_i` selected tokens) and the label of the sign of its mean
advantage :math:`\bar A_i` (positive: :math:`\bar A_i > 0`; negative otherwise, zero
included). Per prompt group :math:`g` (``group_size=`` / ``group_ids=`` of the call),

.. math::

    L_g = \log\Big(1 + \sum_{i \in g^-} e^{S_i/\tau}\Big)
        + \log\Big(1 + \sum_{i \in g^+} e^{-S_i/\tau}\Big),

and :math:`L_g = 0` for a group lacking one of the labels; the surrogate of every selected
token of group :math:`g` is :math:`s = -L_g`, so that ``reduction="prompt_mean"`` gives the
mean over the groups, :math:`\frac{1}{P}\sum_g L_g`. A response without a selected token
takes no part. Each :math:`L_g` is a ``logsumexp`` with the 1 as a zero logit (no overflow);
autograd gives :math:`\partial L_g / \partial S_i`, spread as :math:`1/n_i` over the
response's tokens. Under context parallelism the scores' partial sums are combined with the
adjoint backward (the gradient of a token reaches it from every rank's copy of :math:`L_g`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.context import context_sum
from ..._core.fields import check_fields
from ..._core.groups import segment_log1p_sum_exp
from ..._core.validation import Scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms

__all__ = ["REAL"]


@dataclass(frozen=True)
class REAL(Surrogate):
    r"""REAL: :math:`s = -L_g`, the in-group classification loss of the responses' scores.

    .. math::

        L_g = \log\Big(1 + \sum_{i \in g^-} e^{S_i/\tau}\Big)
            + \log\Big(1 + \sum_{i \in g^+} e^{-S_i/\tau}\Big),
        \qquad S_i = \tfrac{1}{n_i}\textstyle\sum_t x_{it},

    at every selected token of group :math:`g` (0 where the group lacks a label); see the
    module docstring. The gradient of a response's score is bounded by :math:`1/\tau`. Needs
    the call's prompt groups (``policy_loss(..., group_size=)`` or ``group_ids=``); with
    ``reduction="prompt_mean"`` the loss is the mean over the groups. A group-level objective:
    not token-local (the hidden-state path composes), ``ratio_level="token"`` only.

    Attributes:
        tau: :math:`\tau > 0`, the temperature of the scores (ms-swift ``real_tau``).

    Raises:
        ValueError: ``tau <= 0`` or non-finite (the message names the field); at the call, no
            ``group_size`` / ``group_ids``.
        TypeError: ``tau`` not a real number or a 0-d real tensor.

    References:
        Rewards as Labels (REAL), arXiv:2602.05630 (the loss :math:`\mathcal{L}_{REAL}`).

    Peer options: ms-swift ``--loss_type real --real_tau τ`` = ``REAL(tau=τ)`` with
    ``group_size=num_generations``, ``reduction="prompt_mean"`` and ``log_ratio_bound=None``
    (its loss divides by every group of the batch: ``normalizer=`` their number counts groups
    without a selected token too).

    Examples:
        >>> REAL()
        REAL(tau=0.5)

    .. versionadded:: 0.4.0
    """

    tau: Scalar = 0.5

    name: ClassVar[str] = "real"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "scores each response by its mean token log-ratio"

    def __post_init__(self) -> None:
        check_fields(self, "tau", strict=True)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`-L_g` at every selected token of group :math:`g`."""
        groups, layout, mask = tokens.groups, tokens.layout, tokens.mask
        if groups is None:
            raise ValueError(
                "REAL needs the prompt groups of the call: pass group_size= (contiguous groups "
                "of equal size) or group_ids= (one label per sequence) to the policy loss"
            )
        log_ratio, advantages = tokens.log_ratio, tokens.advantages
        # whole sequences: one all-reduce; the scores' gradient reaches every rank's tokens
        sums, counts, advantage_sums = context_sum(
            layout.context,
            layout.local_row_sums(log_ratio),
            layout.local_row_counts(mask),
            layout.local_row_sums(advantages),
            adjoint=True,
        )  # (S,) each
        present = counts > 0
        scores = sums / counts.clamp(min=1).to(sums.dtype)  # S_i
        positive = advantage_sums > 0  # the sign of the mean advantage (0: negative)
        logits = torch.where(positive, -scores, scores) / self.tau  # (S,)
        slot = groups * 2 + positive.to(groups.dtype)  # (S,): the group's negative / positive set
        per_slot = segment_log1p_sum_exp(logits, present, slot, 2 * groups.shape[0])
        members = torch.zeros_like(per_slot).index_add(0, slot, present.to(per_slot.dtype))
        both = members.reshape(-1, 2).gt(0).all(-1)  # (S,) per group id: both signs present
        per_group = per_slot.reshape(-1, 2).sum(-1)  # (S,) per group id
        loss = torch.where(both, per_group, 0.0)[groups]  # (S,) each response's group's L_g
        ratio = torch.exp(scores.detach())  # the sequence ratio e^{S_i}
        return SurrogateTerms(
            -layout.expand(loss),
            layout.expand(ratio),
            selected=layout.expand(both[groups]) & mask,
        )
