r"""FIPO (Future-KL Influenced Policy Optimization, ms-swift's ``fipo``): :class:`FIPO`.

With :math:`x_t` the bounded log-ratio, :math:`r_t = e^{x_t}`, :math:`A_t` the advantage and
:math:`M_t` the selection, the discounted future log-ratio of token :math:`t` runs over the
positions :math:`s \ge t` of its own sequence (selected or not, as the padded row counts them;
a packed sequence stops at its end):

.. math::

    F_t = \sum_{s \ge t} \gamma^{s - t} M_s\, x_s\, \mathbb{1}[r_s \le \delta], \qquad
    f_t = \mathrm{sg}\big(\mathrm{clip}(e^{F_t}, 1, 1 + c)\big), \qquad s_t = f_t\, s^{clip}_t,

:math:`s^{clip}` the clipped surrogate of :class:`~rlobjectives.Clip` (band ``low`` /
``high``, TRL's ``delta``), the influence weight :math:`f` a constant. Optionally
:math:`f \in [1 - c, 1 + c]`, and ms-swift's safety clamp :math:`f \leftarrow \mathrm{clip}(f,
0.8, 1)` where :math:`A_t < 0` and :math:`r_t > \text{threshold}`. The future sum is a
reverse scan by doubling (log-depth, no Python loop over positions); under context parallelism
each rank's chunk takes the carry of the later ranks' chunks (one all-gather of ``(S, 2)``
states: the first position's sum and :math:`\gamma^{\text{length}}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..._core.context import carry_from_later_ranks, context_gather
from ..._core.decisions import ratio_above
from ..._core.layout import Layout
from ..._core.reduction import clamp, masked_fill_zero
from ..._core.validation import Scalar, scalar_number, validate_bool, validate_scalar
from .base import PolicyTokens, Surrogate, SurrogateTerms
from .clip import Clip

__all__ = ["FIPO"]

# ms-swift's safety clamp of the influence weight (fipo_safety_threshold): [0.8, 1.0].
SAFETY_RANGE = (0.8, 1.0)


@dataclass(frozen=True)
class FIPO(Surrogate):
    r"""FIPO: the clipped surrogate times a constant influence weight of the future log-ratio.

    .. math::

        s_t = \mathrm{sg}\big(\mathrm{clip}(e^{F_t}, 1, 1 + c)\big)\, s^{clip}_t,
        \qquad F_t = \textstyle\sum_{s \ge t} \gamma^{s - t} M_s x_s,

    the sum over the later positions of the token's sequence (see the module docstring for
    ``delta`` and the safety clamp). Gradient :math:`f_t\, \partial s^{clip}_t / \partial \ell_t`.
    Not token-local (the future sum reads the sequence; the hidden-state path composes),
    ``ratio_level="token"`` only.

    Attributes:
        gamma: :math:`0 \le \gamma \le 1`, the discount (ms-swift: ``2 ** (-1 / fipo_decay_rate)``,
            0.97857 for its default 32).
        cap: :math:`c \ge 0` of the influence clip (ms-swift ``fipo_clip_range``); None: no clip.
        low: :math:`0 \le \epsilon_{low} < 1` of the surrogate's band; None: no clipping.
        high: :math:`\epsilon_{high} \ge 0`; None means ``low``. Needs ``low``.
        delta: :math:`\delta > 1`, TRL's two-sided clip of the surrogate; tokens with
            :math:`r > \delta` also leave the future sum (ms-swift's ``delta``). None: none.
        cap_high_only: the influence clipped to :math:`[1, 1 + c]` (default, ms-swift's
            ``fipo_clip_high_only``); False: :math:`[1 - c, 1 + c]`.
        safety_threshold: :math:`> 0`: :math:`f \leftarrow \mathrm{clip}(f, 0.8, 1)` where
            :math:`A < 0` and :math:`r >` it (ms-swift ``fipo_safety_threshold``, 4.0 there by
            default). None: no clamp.

    Raises:
        ValueError: ``gamma`` outside ``[0, 1]``, a negative ``cap``, ``low`` outside
            ``[0, 1)``, ``high`` without ``low``, ``delta <= 1``, ``safety_threshold <= 0``
            or a non-finite value (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor (``cap_high_only``:
            not a bool).

    References:
        FIPO, arXiv:2603.19835 (the Future-KL influence weight).

    Peer options: ms-swift ``--loss_type fipo`` = ``FIPO(gamma=2 ** (-1 / fipo_decay_rate),
    cap=fipo_clip_range, low=epsilon, high=epsilon_high, delta=delta,
    cap_high_only=fipo_clip_high_only, safety_threshold=fipo_safety_threshold)`` with
    ``log_ratio_bound=None`` and ``reduction="token_mean", normalizer=N``.

    Examples:
        >>> FIPO(gamma=0.9, cap=0.2)
        FIPO(gamma=0.9, cap=0.2, low=0.2, high=None, delta=None, cap_high_only=True, ...)

    .. versionadded:: 0.4.0
    """

    gamma: Scalar
    cap: Scalar | None
    low: Scalar | None = 0.2
    high: Scalar | None = None
    delta: Scalar | None = None
    cap_high_only: bool = True
    safety_threshold: Scalar | None = None

    name: ClassVar[str] = "fipo"
    token_local: ClassVar[bool] = False
    takes_sequence_ratio: ClassVar[bool] = False
    token_ratio_reason: ClassVar[str] = "sums the future token log-ratios of each position"

    def __post_init__(self) -> None:
        gamma = validate_scalar(self.gamma, "FIPO.gamma", minimum=0.0)
        number = scalar_number(gamma)  # a 0-d tensor is held to the same range
        if number is not None and number > 1.0:
            raise ValueError(f"FIPO.gamma must be <= 1 (a discount), got {number}")
        object.__setattr__(self, "gamma", gamma)
        if self.cap is not None:
            object.__setattr__(self, "cap", validate_scalar(self.cap, "FIPO.cap", minimum=0.0))
        if self.low is None and self.high is not None:
            raise ValueError(
                f"FIPO.high requires FIPO.low (low=None disables clipping), got low=None and "
                f"high={self.high!r}"
            )
        if self.low is not None:
            low = validate_scalar(self.low, "FIPO.low", minimum=0.0, maximum=1.0)
            object.__setattr__(self, "low", low)
        if self.high is not None:
            object.__setattr__(self, "high", validate_scalar(self.high, "FIPO.high", minimum=0.0))
        if self.delta is not None:
            delta = validate_scalar(self.delta, "FIPO.delta", minimum=1.0, strict=True)
            object.__setattr__(self, "delta", delta)
        validate_bool(self.cap_high_only, "FIPO.cap_high_only")
        if self.safety_threshold is not None:
            threshold = validate_scalar(
                self.safety_threshold, "FIPO.safety_threshold", minimum=0.0, strict=True
            )
            object.__setattr__(self, "safety_threshold", threshold)
        clip = Clip.__new__(Clip)  # the fields were validated above, under FIPO's names
        for field, value in (("low", self.low), ("high", self.high), ("dual", None)):
            object.__setattr__(clip, field, value)
        object.__setattr__(clip, "delta", self.delta)
        object.__setattr__(self, "_clip", clip)

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        r""":math:`f_t\, s^{clip}_t` with the influence weight of the future log-ratio."""
        log_ratio, advantages, mask = tokens.log_ratio, tokens.advantages, tokens.mask
        clipped: SurrogateTerms = self._clip.surrogate(log_ratio, advantages)  # type: ignore[attr-defined]
        x = log_ratio.detach()
        future = x if self.delta is None else masked_fill_zero(x, ~ratio_above(x, self.delta))
        total = future_sums(masked_fill_zero(future, mask), tokens.layout, self.gamma)
        influence = torch.exp(total)
        if self.cap is not None:
            low = 1.0 if self.cap_high_only else 1.0 - self.cap
            influence = clamp(influence, low, 1.0 + self.cap)
        safety = None
        if self.safety_threshold is not None:  # A < 0 and r above the threshold
            safety = (advantages < 0) & ratio_above(x, self.safety_threshold)
            influence = torch.where(safety, torch.clamp(influence, *SAFETY_RANGE), influence)
        weight = None if clipped.weight is None else clipped.weight * influence
        return clipped._replace(values=influence * clipped.values, weight=weight, selected=safety)


def future_sums(values: torch.Tensor, layout: Layout, gamma: float | torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_{s \ge t} \gamma^{s - t} v_s` over the later positions of each sequence.

    ``values`` ``(B, T)`` (a row is a sequence) or packed ``(1, N)``, detached, zero where not
    selected; the scan doubles its reach ``d = 1, 2, 4, ...``: ``F_t += gamma^d F_{t + d}``
    where ``t + d`` lies in ``t``'s sequence. Under context parallelism the local sums take the
    carry of the later ranks' chunks (each rank a contiguous chunk, in rank order).
    """
    width = values.shape[-1]
    same = None
    if layout.sequence_ids is not None:
        ids = layout.sequence_ids.reshape(1, -1)  # (1, N)
    total, factor, reach = values, gamma, 1
    while reach < width:
        later = total[..., reach:] * factor  # gamma^d F_{t + d}
        if layout.sequence_ids is not None:
            same = ids[..., reach:] == ids[..., :-reach]  # t + d in the sequence of t
            later = torch.where(same, later, 0.0)
        total = torch.cat([total[..., :-reach] + later, total[..., -reach:]], dim=-1)
        factor = factor * factor
        reach *= 2
    if layout.context is None:
        return total
    return total + _carry(total, layout, gamma)


def _carry(total: torch.Tensor, layout: Layout, gamma: float | torch.Tensor) -> torch.Tensor:
    r""":math:`\gamma^{e - t} C` per position: the later ranks' sum :math:`C`, brought back.

    :math:`e` is the end of this rank's chunk of the token's sequence; one all-gather of each
    rank's ``[F(first position), gamma^length]`` per sequence.
    """
    context = layout.context
    assert context is not None  # internal invariant: called under context parallelism
    dtype, device = total.dtype, total.device
    gamma = torch.as_tensor(gamma, dtype=dtype, device=device)
    width = total.shape[-1]
    if layout.sequence_ids is None:  # padded: each local row a slice of `width` positions
        first = total[:, 0] if width else torch.zeros(total.shape[0], dtype=dtype, device=device)
        lengths = torch.full_like(first, float(width))
        distance = width - torch.arange(width, device=device).to(dtype)  # (T,)
    else:
        ids = layout.sequence_ids
        ones = torch.ones(1, width, dtype=dtype, device=device)
        lengths = layout.local_row_sums(ones)  # (S,) this rank's positions per sequence
        ends = torch.cumsum(lengths, 0)  # one past each sequence's last position here
        starts = (ends - lengths).to(torch.int64).clamp(max=max(width - 1, 0))
        padded = torch.cat([total.reshape(-1), total.new_zeros(1)])
        first = torch.where(lengths > 0, padded[starts], 0.0)
        positions = torch.arange(width, device=device).to(dtype)
        distance = (ends[ids] - positions).reshape(1, -1)  # (1, N)
    states = torch.stack([first, torch.pow(gamma, lengths)], dim=-1)  # (S, 2)
    with torch.no_grad():
        gathered = context_gather(context, states)  # (W, S, 2) in rank order
        start = torch.zeros_like(first).unsqueeze(-1)  # (S, 1): nothing after the last chunk
        carry = carry_from_later_ranks(
            gathered, context.rank, start, lambda state, c: state[:, :1] + state[:, 1:] * c
        )  # (S, 1): the full sum at the first position of the next rank's chunk
    carry = carry.squeeze(-1)
    if layout.sequence_ids is None:
        return torch.pow(gamma, distance) * carry.unsqueeze(-1)  # (B, T)
    return torch.pow(gamma, distance) * carry[layout.sequence_ids].reshape(1, -1)
