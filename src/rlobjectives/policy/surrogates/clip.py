r"""The clipped surrogate of PPO / GRPO / DAPO (dual clip, TRL's ``delta``): :class:`Clip`.

.. math::

    s = \min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1 - \epsilon_{low},
    1 + \epsilon_{high}) A\big), \qquad s \leftarrow \max(s, cA) \text{ where } A < 0,

which is, product for product, :math:`s = A\,\mathrm{clip}(r, L, H)` with the per-sign bounds
of :func:`clip_edges`:

.. math::

    (L, H) = \begin{cases} (-\infty,\ \min(1 + \epsilon_{high}, \delta)) & A > 0 \\
                           (1 - \epsilon_{low},\ \min(c, \max(1 + \epsilon_{high}, \delta)))
                           & A < 0 \end{cases}

(:math:`c = \delta = \infty` when not given). The clip is decided on the log-ratio against the
thresholds of :func:`clip_edges` (``docs/conventions.md``, "Decisions at a bound"), so
autograd's branch is the rule's decision: the gradient :math:`rA` passes where
:math:`L \le r \le H`, and is halved at an exact dual-clip tie :math:`r = c` (as
``torch.maximum`` would split it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..._core.decisions import lower_threshold, upper_threshold
from ..._core.fields import check_band, check_fields
from ..._core.validation import Scalar
from .base import Bound, Surrogate, SurrogateTerms

__all__ = ["Clip", "ClipEdges", "clip_edges"]


@dataclass(frozen=True)
class Clip(Surrogate):
    r"""The clipped ratio surrogate (PPO, GRPO, DAPO clip-higher, dual clip, TRL's ``delta``).

    .. math::

        s = \min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1 - \epsilon_{low},
        1 + \epsilon_{high}) A\big), \quad \text{then } \max(s, cA) \text{ where } A < 0,

    with :math:`\epsilon_{low}` = ``low``, :math:`\epsilon_{high}` = ``high``, :math:`c` =
    ``dual`` and :math:`\delta` = ``delta``; the loss is :math:`-s` per token. Written per sign
    of :math:`A` it is :math:`s = A\,\mathrm{clip}(r, L, H)` (:func:`clip_edges`), which is
    what :meth:`surrogate` computes; which tokens the clip changes is decided on the log-ratio
    as a correctly rounded ``exp`` would decide it (``docs/conventions.md``, "Decisions at a
    bound"): a ratio equal to an edge after rounding is on the band.

    Attributes:
        low: :math:`0 \le \epsilon_{low} < 1`; None: no clipping, :math:`s = rA` (vanilla
            importance-weighted policy gradient; REINFORCE with ``old_log_probs =
            log_probs.detach()``).
        high: :math:`\epsilon_{high} \ge 0`, the asymmetric "clip-higher" edge; None means
            ``low``. Needs ``low``.
        dual: :math:`c > 1`: for :math:`A < 0`, :math:`s = \max(s, cA)`; tokens with
            :math:`A \ge 0` are unchanged. None: no dual clip.
        delta: :math:`\delta > 1`: TRL's two-sided clip, the ratio of the unclipped branch
            capped at :math:`\delta` for both signs of :math:`A` (for :math:`\delta > 1 +
            \epsilon_{high}` it acts on :math:`A < 0` only, as ``dual=δ``; below, it also
            lowers :math:`A > 0` tokens). None: no cap.

    Raises:
        ValueError: ``low`` outside ``[0, 1)``, a negative ``high``, ``high`` without ``low``,
            ``dual <= 1``, ``delta <= 1``, or a non-finite value (the message names the field).
        TypeError: a field that is not a real number or a 0-d real tensor.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 7; Shao et al. 2024, GRPO,
        arXiv:2402.03300 Eq. 3; Yu et al. 2025, DAPO, arXiv:2503.14476 Eq. 10 (clip-higher);
        Ye et al. 2020, dual clip, arXiv:1912.09729 Eq. 5; INTELLECT-2, arXiv:2505.07291
        (TRL's ``delta``).

    Peer options: verl ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` (verl's
    vanilla loss always dual-clips, ``dual=3.0``); TRL ``epsilon`` / ``epsilon_high`` /
    ``delta``; OpenRLHF ``--actor.eps_clip_low_high`` / ``--actor.dual_clip``.

    Examples:
        >>> Clip(low=0.2, high=0.28)
        Clip(low=0.2, high=0.28, dual=None, delta=None)

    .. versionadded:: 0.3.0
       (the ``clip_low``, ``clip_high``, ``dual_clip`` and ``delta`` keywords of 0.2).
    """

    low: Scalar | None = 0.2
    high: Scalar | None = None
    dual: Scalar | None = None
    delta: Scalar | None = None

    name: ClassVar[str] = "clip"

    def __post_init__(self) -> None:
        check_band(self)  # the lower edge 1 - low must stay positive: low in [0, 1)
        check_fields(self, "dual", "delta", minimum=1.0, strict=True)

    def surrogate(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> SurrogateTerms:
        r""":math:`s = A\,\mathrm{clip}(r, L, H)`, clipped where the rule decides.

        ``below``: :math:`r < L` (:math:`A < 0`); ``above`` / ``dual``: :math:`r > H` for
        :math:`A > 0` / :math:`A < 0`; ``out_of_band``: :math:`r` outside
        :math:`[1 - \epsilon_{low}, 1 + \epsilon_{high}]`, any sign of :math:`A`.
        """
        ratio = torch.exp(log_ratio)  # (B, T)
        x = log_ratio.detach()
        edges = clip_edges(self, x.dtype)
        negative = advantages < 0
        clipped, none = ratio, torch.zeros_like(negative)
        below = above = dual = band_low = band_high = none
        if edges.low is not None:  # r < 1 - eps_low, A < 0
            band_low = x < edges.low[1]
            below = band_low & negative
            clipped = torch.where(below, edges.low[0], clipped)
        if edges.positive is not None:  # r > min(1 + eps_high, delta), A > 0
            beyond = x > edges.positive[1]
            band_high = beyond if self.delta is None and edges.high is not None else band_high
            above = beyond & (advantages > 0)
            clipped = torch.where(above, edges.positive[0], clipped)
        if edges.negative is not None:  # r > min(c, max(1 + eps_high, delta)), A < 0
            dual = (x > edges.negative[1]) & negative
            clipped = torch.where(dual, edges.negative[0], clipped)
        if edges.tie is not None:  # r == c exactly (A < 0): the value r, half the gradient
            tie = (x >= edges.tie[0]) & (x <= edges.tie[1]) & negative & ~dual
            clipped = torch.where(tie, (ratio + ratio.detach()) * 0.5, clipped)
        if edges.high is not None and band_high is none:
            band_high = x > edges.high[1]  # r > 1 + eps_high
        return SurrogateTerms(
            clipped * advantages, clipped.detach(), band_low | band_high, below, above, dual
        )


Edge = tuple[Bound, Bound]  # (a ratio bound B, its log-ratio threshold t(B) in the dtype)


class ClipEdges(NamedTuple):
    """:class:`Clip`'s ratio bounds per sign of :math:`A` with their thresholds (None: none).

    ``s = A clip(r, L, H)`` with ``(L, H) = (-inf, positive)`` for ``A > 0`` and ``(low,
    negative)`` for ``A < 0``, which is ``max(min(min(r, delta) A, clip(r) A), c A)`` product for
    product. Each edge is ``(B, t)``: ``r < B`` is ``x < t-(B)``, ``r > B`` is ``x > t+(B)``
    (:mod:`rlobjectives._core.decisions`); ``tie`` is ``(t-(c), t+(c))``, the dual clip's ``r ==
    c``.
    """

    low: Edge | None  # 1 - eps_low, with t-
    high: Edge | None  # 1 + eps_high (the band's upper edge), with t+
    positive: Edge | None  # min(1 + eps_high, delta), with t+
    negative: Edge | None  # min(c, max(1 + eps_high, delta)); min(c, delta) unclipped; t+
    tie: tuple[Bound, Bound] | None


#: The edges of the clips with number fields, per (fields, dtype) (cleared past 1024 entries).
_EDGES: dict[tuple[Any, ...], ClipEdges] = {}


def clip_edges(clip: Clip, dtype: torch.dtype) -> ClipEdges:
    """The bounds and thresholds of ``clip`` in ``dtype``; computed once for number fields.

    Tensor fields (a schedule, a learnable clip range) are thresholded on their device at every
    call; number fields on the host, exactly, once (a constant of a ``torch.compile`` graph).
    """
    key = (clip.low, clip.high, clip.dual, clip.delta, dtype)
    if any(map(torch.is_tensor, key)):
        return _edges(clip, dtype)
    edges = _EDGES.get(key)
    if edges is None:
        if len(_EDGES) >= 1024:
            _EDGES.clear()
        edges = _EDGES[key] = _edges(clip, dtype)
    return edges


def _edges(clip: Clip, dtype: torch.dtype) -> ClipEdges:
    delta, dual = clip.delta, clip.dual
    low = high = None
    positive, negative = delta, delta
    if clip.low is not None:
        low, high = 1.0 - clip.low, 1.0 + (clip.low if clip.high is None else clip.high)
        positive = high if delta is None else _extreme(torch.minimum, min, high, delta)
        negative = None if delta is None else _extreme(torch.maximum, max, high, delta)
    if dual is not None:
        negative = dual if negative is None else _extreme(torch.minimum, min, dual, negative)
    tie = None if dual is None else (lower_threshold(dual, dtype), upper_threshold(dual, dtype))
    return ClipEdges(
        None if low is None else (low, lower_threshold(low, dtype)),
        None if high is None else (high, upper_threshold(high, dtype)),
        None if positive is None else (positive, upper_threshold(positive, dtype)),
        None if negative is None else (negative, upper_threshold(negative, dtype)),
        tie,
    )


def _extreme(tensors: Any, numbers: Any, left: Bound, right: Bound) -> Bound:
    """``min``/``max`` of two bounds; float64 for a number beside a tensor (no rounding)."""
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        wide = [v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
                for v in (left, right)]  # fmt: skip
        return tensors(*wide)  # type: ignore[no-any-return]
    return numbers(left, right)  # type: ignore[no-any-return]
