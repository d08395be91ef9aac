r"""AOT: alignment via optimal transport, the batch's sorted margins (not pair-local)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.validation import Scalar, validate_bool
from .base import PairQuantities, PreferenceObjective, check_beta, check_fraction
from .base import smoothed_sigmoid_loss as _smoothed

__all__ = ["AOT"]


def _sorted_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values`` sorted ascending with the invalid pairs' entries last (as ``+inf``)."""
    last = torch.full((), torch.inf, dtype=values.dtype, device=values.device)
    return torch.sort(torch.where(valid, values, last), dim=0).values


@dataclass(frozen=True)
class AOT(PreferenceObjective):
    r"""AOT: DPO's loss on the batch's sorted margins (first-order stochastic dominance).

    With :math:`\mathrm{sort}` ascending over the batch's valid pairs,

    .. math::

        d = \mathrm{sort}(S_c - S_r) - \mathrm{sort}(R_c - R_r) \ \text{(paired)}, \qquad
        d = \mathrm{sort}(x_c) - \mathrm{sort}(x_r) \ \text{(unpaired)},

    and :math:`L_k = -(1-\epsilon)\log\sigma(\beta d_k) - \epsilon\log\sigma(-\beta d_k)` for
    the :math:`k`-th smallest, reported at the :math:`k`-th valid pair (a rank, not that pair's
    own loss: only their mean is meaningful). It depends on the whole batch: a micro-batch's
    sorted batch is not the full batch's, so the loss is not additive over micro-batches (no
    normaliser can change that).

    Attributes:
        beta: :math:`\beta > 0`.
        label_smoothing: :math:`\epsilon \in [0, 0.5)` (conservative smoothing, as TRL).
        unpaired: sort the chosen and the rejected log-ratios separately (TRL
            ``aot_unpaired``) instead of the paired margins (``aot``).

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type, named.

    References:
        Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal
        Transport", arXiv:2406.05882 Eq. 9 (paired) and Eq. 8 (unpaired).

    Peer options: TRL ``loss_type="aot"`` / ``"aot_unpaired"`` (``label_smoothing``).

    Examples:
        >>> AOT(beta=0.1, unpaired=True).unpaired
        True

    .. versionadded:: 0.3.0
    """

    beta: Scalar = 0.1
    label_smoothing: Scalar = 0.0
    unpaired: bool = False

    name: ClassVar[str] = "aot"
    pair_local: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta, "AOT"))
        smoothing = check_fraction(self.label_smoothing, "AOT", "label_smoothing", maximum=0.5)
        object.__setattr__(self, "label_smoothing", smoothing)
        validate_bool(self.unpaired, "AOT.unpaired")

    def loss(self, q: PairQuantities) -> torch.Tensor:
        r""":math:`-(1-\epsilon)\log\sigma(\beta d) - \epsilon\log\sigma(-\beta d)` by rank."""
        assert q.ref_chosen is not None and q.ref_rejected is not None  # boundary-checked
        if self.unpaired:
            x_c, x_r = q.logratios()
            first, second = x_c, x_r
        else:
            first, second = q.chosen - q.rejected, q.ref_chosen - q.ref_rejected
        ranks = torch.arange(q.valid.shape[0], device=q.valid.device)
        filled = ranks < q.valid.sum()  # (B,) the first ranks hold the valid pairs
        zero = torch.zeros((), dtype=first.dtype, device=first.device)
        gap = _sorted_valid(first, q.valid) - _sorted_valid(second, q.valid)
        by_rank = _smoothed(self.beta * torch.where(filled, gap, zero), self.label_smoothing)
        # the k-th smallest goes to the k-th valid pair (the reduction selects the valid pairs)
        rank_of_pair = (q.valid.cumsum(0) - 1).clamp(min=0)
        return by_rank.gather(0, rank_of_pair)

    def rewards(self, q: PairQuantities) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`(\beta x_c, \beta x_r)` of each pair (not sorted)."""
        x_c, x_r = q.logratios()
        return self.beta * x_c, self.beta * x_r
