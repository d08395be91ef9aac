r"""The fused stage of the ``"clip"`` surrogate: value and derivative with IEEE-754 bit tricks.

One stage of :data:`rlobjectives.policy.fused.TOKEN_STAGES` (the CPU-tuned default). The surrogate
is written per sign of the advantage:

.. math::

    s = A \cdot \mathrm{clip}(r, L, H), \qquad
    (L, H) = \begin{cases} (-\infty,\ \min(1 + \epsilon_{high}, \delta)) & A > 0 \\
                           (1 - \epsilon_{low},\ \min(c, \max(1 + \epsilon_{high}, \delta)))
                           & A < 0 \end{cases}

(:math:`c = \delta = \infty` when not given; without clipping :math:`H = \delta` for
:math:`A > 0` and :math:`\min(c, \delta)` for :math:`A < 0`; see
:func:`rlobjectives.policy.formulas.clip_bounds`), which is
``max(min(min(r, delta)A, clip(r)A), cA)`` product for product, and
:math:`\partial s / \partial \ell = rA` where :math:`L \le r \le H` and the log-ratio is within
its bound, else 0 (see :mod:`rlobjectives.policy.fused` for the tie conventions and the documented
deviations from autograd).

The signs of :math:`A` are computed once per call, as integer select masks of the shape of
:math:`A` (:func:`rlobjectives._core.bits.sign_bits`: ``(B, 1)`` padded, ``(1, N)`` for a packed row
or per-token advantages); the clip decisions and counts are integer operations on the ratio's
bits, and :math:`\mathrm{clip}(r, L, H)` is one ``maximum`` and one ``minimum`` with per-sign
bounds of the shape of :math:`A`, built from the masks with bitwise operations.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.bits import Bits, count_bits, select_, sign_bits
from .formulas import ClipBounds, clip_bounds
from .stages import ClipCounts, StageInputs, StageOutputs

__all__ = ["clip_stage"]


class _Signs:
    """Integer select masks of ``A > 0`` and ``A < 0`` (shape of ``A``; NaN and ±0: neither)."""

    def __init__(self, advantages: torch.Tensor) -> None:
        self.positive, self.negative = sign_bits(advantages)


def clip_stage(inputs: StageInputs) -> StageOutputs:
    """The clipped surrogate with IEEE-754 bit tricks (the CPU-tuned default)."""
    bounds = clip_bounds(inputs.options)
    signs = _Signs(inputs.advantages)
    gates = _clip_gates(inputs, bounds, signs)
    coefficient, scratch = _gradient_coefficient(inputs, signs, gates.blocked)
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


def _clip_gates(inputs: StageInputs, bounds: ClipBounds, signs: _Signs) -> _Gates:
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
    reuse = inputs.options.delta is None  # the high edge for A > 0 is 1 + eps_high itself
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
    inputs: StageInputs, signs: _Signs, blocked: torch.Tensor | None
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
    dual_clip = inputs.options.dual_clip
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
