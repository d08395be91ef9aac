r"""The clipped surrogate of PPO / GRPO / DAPO (dual clip, TRL's ``delta``): :class:`Clip`.

.. math::

    s = \min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1 - \epsilon_{low},
    1 + \epsilon_{high}) A\big), \qquad s \leftarrow \max(s, cA) \text{ where } A < 0,

which is, product for product, :math:`s = A\,\mathrm{clip}(r, L, H)` with the per-sign bounds
of :func:`clip_bounds`:

.. math::

    (L, H) = \begin{cases} (-\infty,\ \min(1 + \epsilon_{high}, \delta)) & A > 0 \\
                           (1 - \epsilon_{low},\ \min(c, \max(1 + \epsilon_{high}, \delta)))
                           & A < 0 \end{cases}

(:math:`c = \delta = \infty` when not given). The clip is decided on the log-ratio against the
thresholds of :func:`clip_thresholds` (``docs/conventions.md``, "Decisions at a bound"), so
autograd's branch is the rule's decision: the gradient :math:`rA` passes where
:math:`L \le r \le H`, and is halved at an exact dual-clip tie :math:`r = c` (as
``torch.maximum`` would split it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..._core.decisions import constant_when_traced, lower_threshold, upper_threshold
from ..._core.validation import Scalar, validate_scalar
from .base import Bound, Surrogate, SurrogateTerms

__all__ = ["Clip", "ClipBounds", "ClipThresholds", "clip_bounds", "clip_thresholds"]


@dataclass(frozen=True)
class Clip(Surrogate):
    r"""The clipped ratio surrogate (PPO, GRPO, DAPO clip-higher, dual clip, TRL's ``delta``).

    .. math::

        s = \min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1 - \epsilon_{low},
        1 + \epsilon_{high}) A\big), \quad \text{then } \max(s, cA) \text{ where } A < 0,

    with :math:`\epsilon_{low}` = ``low``, :math:`\epsilon_{high}` = ``high``, :math:`c` =
    ``dual`` and :math:`\delta` = ``delta``; the loss is :math:`-s` per token. Written per sign
    of :math:`A` it is :math:`s = A\,\mathrm{clip}(r, L, H)` (:func:`clip_bounds`), which is
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
        if self.low is None and self.high is not None:
            raise ValueError(
                f"Clip.high requires Clip.low (low=None disables clipping), got low=None and "
                f"high={self.high!r}"
            )
        if self.low is not None:  # the lower edge 1 - low must stay positive: low in [0, 1)
            object.__setattr__(
                self, "low", validate_scalar(self.low, "Clip.low", minimum=0.0, maximum=1.0)
            )
        if self.high is not None:
            object.__setattr__(self, "high", validate_scalar(self.high, "Clip.high", minimum=0.0))
        for field in ("dual", "delta"):
            value = getattr(self, field)
            if value is not None:
                checked = validate_scalar(value, f"Clip.{field}", minimum=1.0, strict=True)
                object.__setattr__(self, field, checked)

    def surrogate(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> SurrogateTerms:
        r""":math:`s = A\,\mathrm{clip}(r, L, H)`, clipped where the rule decides.

        ``below``: :math:`r < L` (:math:`A < 0`); ``above`` / ``dual``: :math:`r > H` for
        :math:`A > 0` / :math:`A < 0`; ``out_of_band``: :math:`r` outside
        :math:`[1 - \epsilon_{low}, 1 + \epsilon_{high}]`, any sign of :math:`A`.
        """
        ratio = torch.exp(log_ratio)  # (B, T)
        x = log_ratio.detach()
        bounds, edges = clip_bounds(self), clip_thresholds(self, x.dtype)
        negative = advantages < 0
        clipped, none = ratio, torch.zeros_like(negative)
        below = above = dual = band_low = band_high = none
        if (low := bounds.lower_negative) is not None and edges.band_low is not None:
            band_low = x < edges.band_low  # r < 1 - eps_low
            below = band_low & negative
            clipped = torch.where(below, low, clipped)
        if (high := bounds.upper_positive) is not None and edges.upper_positive is not None:
            beyond = x > edges.upper_positive  # r > min(1 + eps_high, delta)
            band_high = beyond if bounds.band is not None and self.delta is None else band_high
            above = beyond & (advantages > 0)
            clipped = torch.where(above, high, clipped)
        if (upper := bounds.upper_negative) is not None and edges.upper_negative is not None:
            dual = (x > edges.upper_negative) & negative  # r > min(c, max(1 + eps_high, delta))
            clipped = torch.where(dual, upper, clipped)
        if edges.dual is not None:  # r == c exactly (A < 0): the value r, half the gradient
            tie = (x >= edges.dual[0]) & (x <= edges.dual[1]) & negative & ~dual
            clipped = torch.where(tie, (ratio + ratio.detach()) * 0.5, clipped)
        if edges.band_high is not None and band_high is none:
            band_high = x > edges.band_high  # r > 1 + eps_high
        return SurrogateTerms(
            clipped * advantages, clipped.detach(), band_low | band_high, below, above, dual
        )


def _minimum(left: Bound, right: Bound) -> Bound:
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return torch.minimum(_as_bound(left), _as_bound(right))
    return min(left, right)


def _maximum(left: Bound, right: Bound) -> Bound:
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return torch.maximum(_as_bound(left), _as_bound(right))
    return max(left, right)


def _as_bound(value: Bound) -> torch.Tensor:
    # float64 for Python numbers, so that a tensor partner does not round them to float32
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)


class ClipBounds(NamedTuple):
    """The ratio bounds of :class:`Clip` per sign of the advantage (None: no bound).

    ``s = A clip(r, lower, upper)`` with ``(lower, upper) = (-inf, upper_positive)`` for
    ``A > 0`` and ``(lower_negative, upper_negative)`` for ``A < 0``, which is
    ``max(min(min(r, delta) A, clip(r) A), c A)`` product for product.
    """

    band: tuple[Bound, Bound] | None  # (1 - eps_low, 1 + eps_high)
    upper_positive: Bound | None  # min(1 + eps_high, delta)
    lower_negative: Bound | None  # 1 - eps_low
    upper_negative: Bound | None  # min(c, max(1 + eps_high, delta)); min(c, delta) unclipped


def clip_bounds(clip: Clip) -> ClipBounds:
    """The per-sign bounds of the clipped surrogate (see :class:`ClipBounds`)."""
    delta, dual = clip.delta, clip.dual
    band = None
    upper_positive, lower_negative, upper_negative = delta, None, delta
    if clip.low is not None:
        high = clip.low if clip.high is None else clip.high
        band = (1.0 - clip.low, 1.0 + high)
        lower_negative = band[0]
        upper_positive = band[1] if delta is None else _minimum(band[1], delta)
        upper_negative = None if delta is None else _maximum(band[1], delta)
    if dual is not None:
        upper_negative = dual if upper_negative is None else _minimum(dual, upper_negative)
    return ClipBounds(band, upper_positive, lower_negative, upper_negative)


class ClipThresholds(NamedTuple):
    """:class:`ClipBounds` as log-ratio thresholds of one computation dtype (None: no bound).

    ``r < B`` is ``x < t-(B)`` and ``r > B`` is ``x > t+(B)`` for the log-ratio ``x``
    (:mod:`rlobjectives._core.decisions`: a correctly rounded ``exp`` in that dtype against the
    bound rounded to it); Python floats for number fields, 0-d tensors for tensor fields.
    """

    band_low: Bound | None  # t-(1 - eps_low): below the band (clipped_fraction)
    band_high: Bound | None  # t+(1 + eps_high): above the band
    lower_negative: Bound | None  # t-(1 - eps_low): the low edge of A < 0
    upper_positive: Bound | None  # t+(min(1 + eps_high, delta))
    upper_negative: Bound | None  # t+(min(c, max(1 + eps_high, delta)))
    dual: tuple[Bound, Bound] | None  # (t-(c), t+(c)): the tie r == c


#: The thresholds of the clips with number fields, per (fields, dtype): a call with the same
#: hyperparameters reads them back (cleared past 1024 entries).
_THRESHOLDS: dict[tuple[Any, ...], ClipThresholds] = {}


def clip_thresholds(clip: Clip, dtype: torch.dtype) -> ClipThresholds:
    """The thresholds of :func:`clip_bounds` in ``dtype``, computed once per hyperparameters.

    Number fields: the host's exact thresholds, kept per (fields, dtype) (a constant of a
    ``torch.compile`` graph); tensor fields: on their device at every call (a schedule or a
    learnable value changes between calls).
    """
    low, high, dual, delta = fields = (clip.low, clip.high, clip.dual, clip.delta)
    if (
        isinstance(low, torch.Tensor)
        or isinstance(high, torch.Tensor)
        or isinstance(dual, torch.Tensor)
        or isinstance(delta, torch.Tensor)
    ):
        return _thresholds(clip, dtype)
    thresholds: ClipThresholds = _number_thresholds(*fields, dtype)
    return thresholds


@constant_when_traced  # its inputs are Python numbers
def _number_thresholds(
    low: Scalar | None,
    high: Scalar | None,
    dual: Scalar | None,
    delta: Scalar | None,
    dtype: torch.dtype,
) -> ClipThresholds:
    key = (low, high, dual, delta, dtype)
    thresholds = _THRESHOLDS.get(key)
    if thresholds is None:
        clip = object.__new__(Clip)  # the fields were validated by the object that has them
        for name, value in zip(("low", "high", "dual", "delta"), key[:4], strict=True):
            object.__setattr__(clip, name, value)
        thresholds = _thresholds(clip, dtype)
        if len(_THRESHOLDS) >= 1024:
            _THRESHOLDS.clear()
        _THRESHOLDS[key] = thresholds
    return thresholds


def _thresholds(clip: Clip, dtype: torch.dtype) -> ClipThresholds:
    bounds = clip_bounds(clip)
    band = (None, None) if bounds.band is None else bounds.band
    dual = None if clip.dual is None else (_lower(clip.dual, dtype), _upper(clip.dual, dtype))
    return ClipThresholds(
        _lower(band[0], dtype),
        _upper(band[1], dtype),
        _lower(bounds.lower_negative, dtype),
        _upper(bounds.upper_positive, dtype),
        _upper(bounds.upper_negative, dtype),
        dual,  # type: ignore[arg-type]
    )


def _lower(bound: Bound | None, dtype: torch.dtype) -> Bound | None:
    return None if bound is None else lower_threshold(bound, dtype)


def _upper(bound: Bound | None, dtype: torch.dtype) -> Bound | None:
    return None if bound is None else upper_threshold(bound, dtype)
