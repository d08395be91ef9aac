r"""The clipped surrogate of PPO / GRPO / DAPO (dual clip, TRL's ``delta``): :class:`Clip`.

With :math:`r` the ratio after the log-ratio bound and :math:`A` the advantage,

.. math::

    s = \min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1 - \epsilon_{low},
    1 + \epsilon_{high}) A\big), \qquad s \leftarrow \max(s, cA) \text{ where } A < 0,

which is, written per sign of the advantage,

.. math::

    s = A \cdot \mathrm{clip}(r, L, H), \qquad
    (L, H) = \begin{cases} (-\infty,\ \min(1 + \epsilon_{high}, \delta)) & A > 0 \\
                           (1 - \epsilon_{low},\ \min(c, \max(1 + \epsilon_{high}, \delta)))
                           & A < 0 \end{cases}

(:math:`c = \delta = \infty` when not given; without clipping :math:`H = \delta` for
:math:`A > 0` and :math:`\min(c, \delta)` for :math:`A < 0`), product for product, with
:math:`\partial s / \partial \ell = rA` where :math:`L \le r \le H` and the log-ratio is within
its bound, else 0 (halved at an exact dual-clip tie :math:`r = c`, :math:`A < 0`). Three
functions hold the rule, shared by the autograd specification (:meth:`Clip.formula`), the fused
stage (:meth:`Clip.stage`) and the Triton kernel's host-side setup (:meth:`Clip.kernel_flags`):
:func:`clip_bounds` (the per-sign bounds, as numbers; :func:`per_sign_bounds` as tensors of the
shape of :math:`A`), :func:`clip_thresholds` / :func:`per_sign_thresholds` (the same bounds as
log-ratio thresholds) and :func:`clip_decisions` (which tokens the clip changes:
:math:`r < L`, :math:`r > H`; the gradient passes where neither holds).

**Decisions at a bound** (``docs/conventions.md``): :math:`r < L`, :math:`r > H`, the band's
:math:`r \notin [1 - \epsilon_{low}, 1 + \epsilon_{high}]` and the tie :math:`r = c` are taken
as a correctly rounded ``exp`` in the computation dtype would take them against the bounds
rounded to that dtype, as comparisons of the log-ratio :math:`x` with the thresholds of
:mod:`rlobjectives._core.decisions`: the same tokens on the autograd and fused paths and in the
kernels, whatever their ``exp`` rounds to (the specification's :math:`r = 1.2` and
:math:`0.8` with :math:`\epsilon = 0.2` are on the band). The values keep their formula
(:math:`\mathrm{clip}(r, L, H)` is continuous: at a bound both branches agree to the rounding of
:math:`r`).

The fused stage is the formula above in tensor operations (``torch.maximum`` / ``minimum``
with the per-sign bounds, comparisons into float indicators that are summed for the
diagnostics and multiplied into the coefficient); it replaced an IEEE-754 bit-pattern version
(0.2) at a measured cost recorded in ``docs/architecture.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..._core.decisions import constant_when_traced, lower_threshold, upper_threshold
from ..._core.validation import Scalar, validate_scalar
from .base import (
    Bound,
    ClipCounts,
    FormulaTerms,
    StageInputs,
    StageOutputs,
    SurrogateInputs,
    SurrogateObjective,
)

__all__ = [
    "Clip",
    "ClipBounds",
    "ClipThresholds",
    "clip_bounds",
    "clip_decisions",
    "clip_thresholds",
    "per_sign_bounds",
    "per_sign_thresholds",
]


@dataclass(frozen=True)
class Clip(SurrogateObjective):
    r"""The clipped ratio surrogate (PPO, GRPO, DAPO clip-higher, dual clip, TRL's ``delta``).

    .. math::

        s = \min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1 - \epsilon_{low},
        1 + \epsilon_{high}) A\big), \quad \text{then } \max(s, cA) \text{ where } A < 0,

    with :math:`\epsilon_{low}` = ``low``, :math:`\epsilon_{high}` = ``high``, :math:`c` =
    ``dual`` and :math:`\delta` = ``delta``; the loss is :math:`-s` per token. Its fused stage
    is :meth:`Clip.stage` (per-sign bounds :func:`clip_bounds`: ``s = A clip(r, L, H)``), its
    Triton kernel the ``"clip"`` surrogate of :mod:`rlobjectives.kernels.jit.token_loss`.
    Which tokens the clip changes is decided on the log-ratio as a correctly rounded ``exp``
    would decide it (``docs/conventions.md``, "Decisions at a bound"): a ratio equal to an edge
    after rounding is on the band, on every backend.

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

    def formula(self, inputs: SurrogateInputs) -> FormulaTerms:
        r""":math:`s = A\,\mathrm{clip}(r, L, H)` per sign of A, clipped where the rule decides.

        Product for product :math:`\max(\min(\min(r, \delta) A, \mathrm{clip}(r) A), cA)`;
        written per sign so that autograd's branch is the decision of :func:`clip_decisions`
        (the rounded products :math:`rA` and :math:`\mathrm{clip}(r) A` are not compared). At
        an exact dual-clip tie :math:`r = c` (:math:`A < 0`) ``torch.maximum`` would split the
        gradient: the value :math:`r`, half the gradient, as :math:`(r + \mathrm{sg}(r))/2`.
        """
        ratio, advantages = inputs.ratio, inputs.advantages
        log_ratio = inputs.log_ratio.detach()
        bounds, thresholds = clip_bounds(self), clip_thresholds(self, log_ratio.dtype)
        lower, upper = per_sign_bounds(bounds, advantages)
        low, beyond = clip_decisions(log_ratio, *per_sign_thresholds(thresholds, advantages))
        clipped = ratio  # (B, T): clip(r, L, H), the branch chosen by the decisions
        if lower is not None:
            clipped = torch.where(low, lower, clipped)
        if upper is not None:
            clipped = torch.where(beyond, upper, clipped)
        if thresholds.dual is not None:  # r == c exactly (A < 0): half the gradient, value r
            tie = _on(log_ratio, thresholds.dual) & (advantages < 0) & ~beyond
            clipped = torch.where(tie, (ratio + ratio.detach()) * 0.5, clipped)
        surrogate = clipped * advantages  # (B, T)
        ratio_d = ratio.detach()
        nonzero = advantages != 0
        safe = torch.where(nonzero, advantages, torch.ones_like(advantages))
        weight = torch.where(nonzero, surrogate.detach() / safe, ratio_d)  # w = s / A
        below_band = _compare(torch.lt, log_ratio, thresholds.band_low, torch.bool)
        out_of_band = below_band | _compare(torch.gt, log_ratio, thresholds.band_high, torch.bool)
        high, dual = beyond & (advantages > 0), beyond & (advantages < 0)
        return FormulaTerms(surrogate, weight, out_of_band, low, high, dual)

    def stage(self, inputs: StageInputs) -> StageOutputs:
        """The fused stage: ``s = A~ clip(r, L, H)`` and its derivative (see the module)."""
        return _clip_stage(self, inputs)

    def kernel_flags(self) -> dict[str, Any]:
        """The kernel's ``"clip"`` setup: the band, the per-sign upper edges, the dual clip.

        Each edge comes with its float32 log-ratio threshold (``*_threshold``: the decisions of
        :func:`clip_decisions`, :mod:`rlobjectives._core.decisions`); the edges themselves give
        the values.
        """
        bounds, thresholds = clip_bounds(self), clip_thresholds(self, torch.float32)
        band = (None, None) if bounds.band is None else bounds.band
        dual = (None, None) if thresholds.dual is None else thresholds.dual
        return {
            "surrogate": "clip",
            "low": _number(band[0]),
            "high": _number(band[1]),
            "upper_positive": _number(bounds.upper_positive),
            "upper_negative": _number(bounds.upper_negative),
            "dual_clip": _number(self.dual),
            "low_threshold": _number(thresholds.band_low),
            "high_threshold": _number(thresholds.band_high),
            "upper_positive_threshold": _number(thresholds.upper_positive),
            "upper_negative_threshold": _number(thresholds.upper_negative),
            "dual_low_threshold": _number(dual[0]),
            "dual_high_threshold": _number(dual[1]),
        }


def _number(value: Bound | None) -> float | None:
    return None if value is None else float(value)


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


def per_sign_bounds(
    bounds: ClipBounds, advantages: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(L, H)`` of ``s = A clip(r, L, H)`` as tensors of the shape of ``A`` (None: no bound).

    ``L`` is ``1 - eps_low`` where ``A < 0``, ``-inf`` elsewhere; ``H`` is ``upper_positive``
    where ``A > 0``, ``upper_negative`` where ``A < 0``, ``+inf`` elsewhere (``A = 0`` or NaN,
    and a side without a bound).
    """
    negative, positive = advantages < 0, advantages > 0
    inf = _as_tensor(math.inf, advantages)
    lower = None
    if bounds.lower_negative is not None:
        lower = torch.where(negative, _as_tensor(bounds.lower_negative, advantages), -inf)
    upper = None
    if bounds.upper_positive is not None or bounds.upper_negative is not None:
        on_positive = inf if bounds.upper_positive is None else bounds.upper_positive
        on_negative = inf if bounds.upper_negative is None else bounds.upper_negative
        upper = torch.where(
            positive,
            _as_tensor(on_positive, advantages),
            torch.where(negative, _as_tensor(on_negative, advantages), inf),
        )
    return lower, upper


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
    fields = (clip.low, clip.high, clip.dual, clip.delta)
    if any(isinstance(field, torch.Tensor) for field in fields):
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


def per_sign_thresholds(
    thresholds: ClipThresholds, advantages: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(t-(L), t+(H))`` of :func:`per_sign_bounds` as tensors of the shape of ``A``.

    ``r < L`` is ``x < t-(L)`` and ``r > H`` is ``x > t+(H)`` for the log-ratio ``x``;
    ``-inf`` / ``+inf`` where a side has no bound (``A = 0`` or NaN included).
    """
    negative, positive = advantages < 0, advantages > 0
    inf = _as_tensor(math.inf, advantages)
    lower = None
    if thresholds.lower_negative is not None:
        edge = _as_tensor(thresholds.lower_negative, advantages)
        lower = torch.where(negative, edge, -inf)
    upper = None
    if thresholds.upper_positive is not None or thresholds.upper_negative is not None:
        on_positive = inf if thresholds.upper_positive is None else thresholds.upper_positive
        on_negative = inf if thresholds.upper_negative is None else thresholds.upper_negative
        upper = torch.where(
            positive,
            _as_tensor(on_positive, advantages),
            torch.where(negative, _as_tensor(on_negative, advantages), inf),
        )
    return lower, upper


def _on(log_ratio: torch.Tensor, edges: tuple[Bound, Bound]) -> torch.Tensor:
    """Bool ``r == c``: ``t-(c) <= x <= t+(c)``."""
    return (log_ratio >= _as_tensor(edges[0], log_ratio)) & (
        log_ratio <= _as_tensor(edges[1], log_ratio)
    )


def clip_decisions(
    log_ratio: torch.Tensor,
    lower: torch.Tensor | None,
    upper: torch.Tensor | None,
    *,
    dtype: torch.dtype = torch.bool,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the clip binds: ``(r < L, r > H)``, as ``(x < t-(L), x > t+(H))`` on the log-ratio.

    The one decision rule of the clip, with the thresholds of :func:`per_sign_thresholds`
    (:func:`clip_thresholds`):
    ``r < L`` is the low edge binding (``A < 0``), ``r > H`` an upper edge (the high edge for
    ``A > 0``, the dual clip or ``delta`` for ``A < 0``), and the gradient passes where neither
    holds, ``L <= r <= H`` (``torch.clamp``'s closed interval), as a correctly rounded ``exp``
    would decide it (``docs/conventions.md``, "Decisions at a bound"; a NaN log-ratio is in
    neither set). The formula (:meth:`Clip.formula`) asks for bool sets, the fused stage for
    float indicators (``dtype``: 1.0 where the clip binds), which it sums and multiplies;
    ``out``: a scratch buffer of that dtype for ``r > H``.
    """
    below = _compare(torch.lt, log_ratio, lower, dtype)
    return below, _compare(torch.gt, log_ratio, upper, dtype, out)


def _compare(
    op: Callable[..., torch.Tensor],
    ratio: torch.Tensor,
    bound: torch.Tensor | Bound | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``op(ratio, bound)`` as ``dtype`` (all 0 / False without a bound), into ``out`` if given."""
    if out is None:
        out = torch.empty(ratio.shape, dtype=dtype, device=ratio.device)
    if bound is None:
        return out.zero_()
    if not isinstance(bound, torch.Tensor):
        bound = _as_tensor(bound, ratio)
    return op(ratio, bound, out=out)


def _as_tensor(value: Bound, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _clip_stage(clip: Clip, inputs: StageInputs) -> StageOutputs:
    r"""The fused stage of :class:`Clip`: :math:`s = \tilde A\,\mathrm{clip}(r, L, H)`, its slope.

    With the per-sign bounds :math:`(L, H)` of :func:`per_sign_bounds` (shape of :math:`A`):
    the values :math:`\tilde A\,\mathrm{clip}(r, L, H)`; the coefficient
    :math:`\partial s / \partial \ell = r \tilde A` where :func:`clip_decisions` lets the
    gradient pass (:math:`L \le r \le H`) and the log-ratio bound held, else 0, halved at an
    exact dual-clip tie :math:`r = c` (``torch.maximum``'s convention); the counts of the clip
    diagnostics. Every decision is taken on the log-ratio by the rule (``docs/conventions.md``,
    "Decisions at a bound"). The ratio is exactly 1 at unselected tokens, never clipped
    (``L <= 1 <= H``): their decisions are 0 and their clipped ratio 1, so the selected sums
    are the full sums minus the unselected count.
    """
    ratio, log_ratio = inputs.ratio, inputs.bounded_log_ratio
    weighted, dtype = inputs.weighted, inputs.dtype
    bounds, thresholds = clip_bounds(clip), clip_thresholds(clip, dtype)
    lower, upper = per_sign_bounds(bounds, inputs.advantages)
    # clip(r, L, H) as max then min: both propagate NaN like torch.clamp (a fresh buffer)
    clipped = ratio.clone() if lower is None else torch.maximum(ratio, lower)
    if upper is not None:
        clipped = torch.minimum(clipped, upper, out=clipped)
    # The decisions, on the log-ratio against the thresholds of the bounds (the rule)
    scratch = _compare(torch.lt, log_ratio, thresholds.band_low, dtype)  # (B, T): below the band
    above_band = (torch.gt, log_ratio, thresholds.band_high, dtype)  # then above it, in scratch
    out_of_band = scratch.sum() + _compare(*above_band, out=scratch).sum()
    edges = per_sign_thresholds(thresholds, inputs.advantages)
    below, above = clip_decisions(log_ratio, *edges, dtype=dtype, out=scratch)  # 1.0: binds
    negative = (inputs.advantages < 0).to(dtype)  # shape of A
    positive = (inputs.advantages > 0).to(dtype)
    above_rows = above.sum(-1, keepdim=True) if positive.shape[-1] == 1 else above
    counts = ClipCounts(out_of_band, below.sum(), (above_rows * positive).sum())
    dual = (above_rows * negative).sum()
    # d s / d l = r A~ (1 - below - above), and 0 where the log-ratio bound fired
    if inputs.passes is None:
        coefficient = ratio * weighted  # (B, T), 0 at unselected tokens (A~ = 0)
    else:  # a NaN log-ratio's NaN ratio becomes 0: no gradient there, as autograd's clamp
        coefficient = torch.nan_to_num(ratio, nan=0.0, posinf=math.inf, neginf=-math.inf)
        coefficient = coefficient.mul_(weighted).mul_(inputs.passes)
    blocked = below.add_(above)  # 1.0 where the clip binds
    if thresholds.dual is not None:  # at r == c exactly torch.maximum(s, cA) ties: half
        tie = torch.ge(log_ratio, _as_tensor(thresholds.dual[0], ratio), out=above)  # t-(c) <= x
        tie = tie.mul_(log_ratio <= _as_tensor(thresholds.dual[1], ratio))  # x <= t+(c)
        blocked = torch.maximum(blocked, tie.mul_(negative).mul_(0.5), out=blocked)
    coefficient = coefficient.addcmul_(coefficient, blocked, value=-1.0)  # c (1 - blocked)
    # Sums over the selected tokens: r - 1 and clip(r, L, H) - 1 are exactly 0 at the others.
    count = inputs.selected_count.to(dtype)
    ratio_sum = torch.sub(ratio, 1.0, out=above).sum() + count
    weight_sum = torch.sub(clipped, 1.0, out=above).sum() + count
    values = clipped.mul_(weighted)  # A~ clip(r, L, H), 0 at unselected tokens
    return StageOutputs(coefficient, values, counts, dual, ratio_sum, weight_sum)
