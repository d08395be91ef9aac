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
its bound, else 0. The per-sign bounds are one function, :func:`clip_bounds`, shared by the
autograd specification (:meth:`Clip.formula`), the fused stage (:meth:`Clip.stage`) and the
Triton kernel's host-side setup (:meth:`Clip.kernel_flags`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..._core.bits import Bits, count_bits, select_, sign_bits
from ..._core.reduction import clamp
from ..._core.validation import Scalar, validate_scalar
from .base import (
    Bound,
    ClipCounts,
    FormulaTerms,
    StageInputs,
    StageOutputs,
    SurrogateInputs,
    SurrogateObjective,
    above,
    band_sets,
    below,
)

__all__ = ["Clip", "ClipBounds", "clip_bounds"]


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
        r""":math:`\min(\min(r, \delta) A, \mathrm{clip}(r) A)`, then :math:`\max(s, cA)`, A < 0."""
        ratio, advantages = inputs.ratio, inputs.advantages
        capped = ratio if self.delta is None else clamp(ratio, -math.inf, self.delta)
        surrogate = capped * advantages  # (B, T)
        bounds = clip_bounds(self)
        if bounds.band is not None:
            clipped = clamp(ratio, *bounds.band) * advantages  # (B, T)
            surrogate = torch.minimum(surrogate, clipped)  # (B, T)
        if self.dual is not None:
            # Dual clip (Ye et al. 2020): for A < 0 the surrogate is bounded below by c * A.
            surrogate = torch.where(
                advantages < 0, torch.maximum(surrogate, self.dual * advantages), surrogate
            )
        ratio_d = ratio.detach()
        nonzero = advantages != 0
        safe = torch.where(nonzero, advantages, torch.ones_like(advantages))
        weight = torch.where(nonzero, surrogate.detach() / safe, ratio_d)  # w = s / A
        band = (None, None) if bounds.band is None else bounds.band
        out_of_band = band_sets(ratio_d, advantages, *band)[0]
        low = below(ratio_d, bounds.lower_negative) & (advantages < 0)
        high = above(ratio_d, bounds.upper_positive) & (advantages > 0)
        dual = above(ratio_d, bounds.upper_negative) & (advantages < 0)
        return FormulaTerms(surrogate, weight, out_of_band, low, high, dual)

    def stage(self, inputs: StageInputs) -> StageOutputs:
        """The fused stage: ``s = A~ clip(r, L, H)`` and its derivative (see the module)."""
        return _clip_stage(self, inputs)

    def kernel_flags(self) -> dict[str, Any]:
        """The kernel's ``"clip"`` setup: the band and the per-sign upper edges, the dual clip."""
        bounds = clip_bounds(self)
        band = (None, None) if bounds.band is None else bounds.band
        return {
            "surrogate": "clip",
            "low": _number(band[0]),
            "high": _number(band[1]),
            "upper_positive": _number(bounds.upper_positive),
            "upper_negative": _number(bounds.upper_negative),
            "dual_clip": _number(self.dual),
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


# --- the fused stage (CPU-tuned: IEEE-754 bit operations) ------------------------------------


class _Signs:
    """Integer select masks of ``A > 0`` and ``A < 0`` (shape of ``A``; NaN and ±0: neither)."""

    def __init__(self, advantages: torch.Tensor) -> None:
        self.positive, self.negative = sign_bits(advantages)


def _clip_stage(clip: Clip, inputs: StageInputs) -> StageOutputs:
    """The clipped surrogate with IEEE-754 bit tricks (the CPU-tuned default)."""
    bounds = clip_bounds(clip)
    signs = _Signs(inputs.advantages)
    gates = _clip_gates(clip, inputs, bounds, signs)
    coefficient, scratch = _gradient_coefficient(clip, inputs, signs, gates.blocked)
    # Sum of r over the selected tokens (r - 1 = 0 exactly elsewhere), in a spent buffer.
    dtype = inputs.dtype
    ratio_sum = torch.sub(inputs.ratio, 1.0, out=scratch).sum() + inputs.selected_count.to(dtype)
    values, weight_sum = _surrogate_values(inputs, bounds, signs)
    return StageOutputs(
        coefficient, values, inputs.selected, gates.clip, gates.dual, ratio_sum, weight_sum
    )


class _Gates(NamedTuple):
    clip: ClipCounts
    dual: torch.Tensor  # () dual-clip count
    blocked: torch.Tensor | None  # (B, T) select mask: no gradient (a clip binds, bound fired)


def _clip_gates(clip: Clip, inputs: StageInputs, bounds: ClipBounds, signs: _Signs) -> _Gates:
    """The tokens where a clip binds (added to the fired ones) and the clip counts.

    The ratio is >= +0 or NaN, so its bits order like its values (a NaN with the sign bit set,
    which exp does not produce, would count as below the band). At unselected positions the
    ratio is exactly 1, never clipped (every bound is >= 1 but the low edge, <= 1), so the
    advantage signs need no mask. Each binding set is OR-ed into one ``blocked`` mask (the
    fired mask's buffer), cleared from the gradient once.
    """
    bits, blocked, zero = inputs.bits, inputs.fired, inputs.selected_count.new_zeros(())
    ratio_bits = bits.view(inputs.ratio)  # (B, T), no copy
    out_of_band = binding_low = binding_high = dual = zero
    flags = high_flags = None
    reuse = clip.delta is None  # the high edge for A > 0 is 1 + eps_high itself
    if bounds.band is not None:
        flags = bits.less(ratio_bits, bits.of(bounds.band[0]))  # (B, T) r < 1 - eps_low
        below = count_bits(flags)
        low = flags.bitwise_and_(signs.negative)  # the low clip binds (A < 0)
        binding_low = count_bits(low)
        blocked, flags = _block(blocked, low)
        high_flags = bits.less(bits.of(bounds.band[1]), ratio_bits, out=flags)  # r > 1 + eps_h
        out_of_band = below + count_bits(high_flags)
        flags, high_flags = (high_flags, high_flags) if reuse else (high_flags, None)
    if bounds.upper_positive is not None:
        if high_flags is None:  # NaN too
            high_flags = bits.less(bits.of(bounds.upper_positive), ratio_bits, out=flags)
        high = high_flags.bitwise_and_(signs.positive)  # the high edge binds (A > 0)
        binding_high = count_bits(high)
        blocked, flags = _block(blocked, high)
    if bounds.upper_negative is not None:
        upper = bits.less(bits.of(bounds.upper_negative), ratio_bits, out=flags)
        dual = count_bits(upper.bitwise_and_(signs.negative))
        blocked, flags = _block(blocked, upper)
    return _Gates(ClipCounts(out_of_band, binding_low, binding_high), dual, blocked)


def _block(
    blocked: torch.Tensor | None, binding: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``blocked | binding`` and the buffer free for the next flags (None: allocate one)."""
    if blocked is None:
        return binding, None
    return blocked.bitwise_or_(binding), binding


def _gradient_coefficient(
    clip: Clip, inputs: StageInputs, signs: _Signs, blocked: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``d s / d log_probs = r A~`` at selected tokens not ``blocked``, else 0; a spent buffer.

    The spent buffer (``blocked``'s, or a new one) is float and of the ratio's shape.
    """
    ratio = inputs.ratio
    coefficient = select_(ratio * inputs.weighted, inputs.selected)  # (B, T)
    if blocked is None:
        scratch = torch.empty_like(ratio)
    else:
        coefficient = select_(coefficient, blocked.bitwise_not_())
        scratch = blocked.view(ratio.dtype)
    dual_clip = clip.dual
    if dual_clip is not None:
        # At r == c exactly torch.maximum(s, cA) ties and passes half of the gradient.
        tie = (ratio == torch.as_tensor(dual_clip, dtype=ratio.dtype, device=ratio.device)) & (
            signs.negative != 0
        )
        coefficient = torch.where(tie, 0.5 * coefficient, coefficient)
    return coefficient, scratch


def _surrogate_values(
    inputs: StageInputs, bounds: ClipBounds, signs: _Signs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = A~ clip(r, L, H)`` (+0 at unselected positions) and ``sum clip(r, L, H)``.

    L and H have the shape of A; the sum is over the selected tokens. Overwrites the ratio and
    the sign masks.
    ``clip(r, L, H)`` is exactly 1 at unselected positions (r = 1 there, L <= 1 <= H), so its
    selected sum is the full sum minus the unselected count.
    """
    ratio = inputs.ratio
    lower, upper = _sign_bounds(bounds, signs, inputs.bits)
    # max then min in place: a ternary clamp with broadcast (B, 1) bounds is several times
    # slower on CPU; both propagate NaN like torch.clamp.
    weight = ratio if lower is None else torch.maximum(ratio, lower, out=ratio)  # (B, T)
    weight = weight if upper is None else torch.minimum(weight, upper, out=weight)
    unselected = weight.numel() - inputs.selected_count
    weight_sum = (weight.sum(dtype=torch.float64) - unselected).to(inputs.dtype)
    return select_(weight.mul_(inputs.weighted), inputs.selected), weight_sum


def _sign_bounds(
    bounds: ClipBounds, signs: _Signs, bits: Bits
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The per-sign ``(L, H)`` of ``clip(r, L, H)`` as float tensors of the shape of ``A``.

    ``L = 1 - eps_low`` where ``A < 0``, else ``+0`` (the ratio is ``>= +0`` or NaN, so a lower
    bound of ``+0`` is no bound); ``H`` is the bound of the sign, ``+inf`` where ``A`` is 0 or
    NaN. Built from the sign masks with bitwise operations (exact bit patterns), in their
    buffers (the masks are spent); None where a side has no bound at all.
    """
    infinity = bits.pattern(float("inf"))
    upper = None
    if bounds.upper_negative is not None:  # the bits of H- where A < 0, relative to +inf
        upper = torch.bitwise_and(
            signs.negative, _xor(bits.pattern(bounds.upper_negative), infinity)
        )
    if bounds.upper_positive is not None:
        term = signs.positive.bitwise_and_(_xor(bits.pattern(bounds.upper_positive), infinity))
        upper = term if upper is None else term.bitwise_xor_(upper)
    if upper is not None:
        upper = upper.bitwise_xor_(infinity).view(bits.float_dtype)
    lower = None
    if bounds.lower_negative is not None:
        lower = signs.negative.bitwise_and_(bits.pattern(bounds.lower_negative))
        lower = lower.view(bits.float_dtype)
    return lower, upper


def _xor(left: int | torch.Tensor, right: int | torch.Tensor) -> int | torch.Tensor:
    """``left ^ right`` for bit patterns (a 0-d tensor stays a tensor of its dtype)."""
    if isinstance(left, torch.Tensor):
        return torch.bitwise_xor(left, right)
    if isinstance(right, torch.Tensor):
        return torch.bitwise_xor(right, left)
    return left ^ right
