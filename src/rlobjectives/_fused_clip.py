r"""The fused stage of the ``"clip"`` surrogate: value and derivative with IEEE-754 bit tricks.

One stage of :data:`rlobjectives._fused.TOKEN_STAGES` (the CPU-tuned default). The surrogate
is written per sign of the advantage:

.. math::

    s = A \cdot \mathrm{clip}(r, L, H), \qquad
    (L, H) = \begin{cases} (-\infty,\ \min(1 + \epsilon_{high}, \delta)) & A > 0 \\
                           (1 - \epsilon_{low},\ \min(c, \max(1 + \epsilon_{high}, \delta)))
                           & A < 0 \end{cases}

(:math:`c = \delta = \infty` when not given; without clipping :math:`H = \delta` for
:math:`A > 0` and :math:`\min(c, \delta)` for :math:`A < 0`; see
:func:`rlobjectives._surrogates.clip_bounds`), which is
``max(min(min(r, delta)A, clip(r)A), cA)`` product for product, and
:math:`\partial s / \partial \ell = rA` where :math:`L \le r \le H` and the log-ratio is within
its bound, else 0 (see :mod:`rlobjectives._fused` for the tie conventions and the documented
deviations from autograd).

The signs of :math:`A` are computed once per call, as integer select masks of the shape of
:math:`A` (:func:`rlobjectives._bits.sign_bits`: ``(B, 1)`` padded, ``(1, N)`` for a packed row
or per-token advantages); the clip decisions and counts are integer operations on the ratio's
bits, and :math:`\mathrm{clip}(r, L, H)` is one ``maximum`` and one ``minimum`` with per-sign
bounds of the shape of :math:`A`, built from the masks with bitwise operations.
"""

from __future__ import annotations

import torch

from ._bits import Bits, count_bits, select_, sign_bits
from ._fused_surrogates import ClipCounts, StageInputs, StageOutputs
from ._surrogates import ClipBounds, clip_bounds

__all__ = ["clip_stage"]


class _Signs:
    """Integer select masks of ``A > 0`` and ``A < 0`` (shape of ``A``; NaN and ±0: neither)."""

    def __init__(self, advantages: torch.Tensor) -> None:
        self.positive, self.negative = sign_bits(advantages)


def clip_stage(inputs: StageInputs) -> StageOutputs:
    """The clipped surrogate with IEEE-754 bit tricks (the CPU-tuned default)."""
    bounds = clip_bounds(inputs.options)
    signs = _Signs(inputs.advantages)
    clip, dual = _clip_gates(inputs, bounds, signs)
    coefficient = _gradient_coefficient(inputs, signs)
    # Sum of r over the selected tokens (r - 1 = 0 exactly elsewhere), in the gate's buffer;
    # then the buffer holds the selection again (no new (B, T) allocation).
    keep, dtype = inputs.keep, inputs.dtype
    ratio_sum = torch.sub(inputs.ratio, 1.0, out=keep.view(dtype)).sum() + inputs.selected_count.to(
        dtype
    )
    selection = keep.copy_(inputs.mask).neg_()  # (B, T) all ones where selected
    values, weight_sum = _surrogate_values(inputs, bounds, signs, selection)
    return StageOutputs(coefficient, values, selection, clip, dual, ratio_sum, weight_sum)


def _clip_gates(
    inputs: StageInputs, bounds: ClipBounds, signs: _Signs
) -> tuple[ClipCounts, torch.Tensor]:
    """Clear ``keep`` where a clip binds; return the clip counts and the dual-clip count.

    The ratio is >= +0 or NaN, so its bits order like its values (a NaN with the sign bit set,
    which exp does not produce, would count as below the band). At unselected positions the
    ratio is exactly 1, never clipped (every bound is >= 1 but the low edge, <= 1), so the
    advantage signs need no mask.
    """
    bits, keep, zero = inputs.bits, inputs.keep, inputs.selected_count.new_zeros(())
    ratio_bits = bits.view(inputs.ratio)  # (B, T), no copy
    out_of_band = binding_low = binding_high = dual = zero
    high_flags = None
    reuse = inputs.options.delta is None  # the high edge for A > 0 is 1 + eps_high itself
    if bounds.band is not None:
        flags = bits.less(ratio_bits, bits.of(bounds.band[0]))  # (B, T) r < 1 - eps_low
        below = count_bits(flags)
        binding_low = count_bits(flags.bitwise_and_(signs.negative))  # the low clip binds (A < 0)
        keep &= flags.bitwise_not_()
        high_flags = bits.less(bits.of(bounds.band[1]), ratio_bits, out=flags)  # r > 1 + eps_h
        out_of_band = below + count_bits(high_flags)
        high_flags = high_flags if reuse else None
    if bounds.upper_positive is not None:
        if high_flags is None:
            high_flags = bits.less(bits.of(bounds.upper_positive), ratio_bits)  # NaN too
        binding_high = count_bits(high_flags.bitwise_and_(signs.positive))  # the high edge binds
        keep &= high_flags.bitwise_not_()
    if bounds.upper_negative is not None:
        upper = bits.less(bits.of(bounds.upper_negative), ratio_bits)
        dual = count_bits(upper.bitwise_and_(signs.negative))
        keep &= upper.bitwise_not_()
    return ClipCounts(out_of_band, binding_low, binding_high), dual


def _gradient_coefficient(inputs: StageInputs, signs: _Signs) -> torch.Tensor:
    """``d s / d log_probs = r A~`` where the unclipped branch is active (``keep``), else 0."""
    ratio = inputs.ratio
    coefficient = select_(ratio * inputs.weighted, inputs.keep)  # (B, T)
    dual_clip = inputs.options.dual_clip
    if dual_clip is not None:
        # At r == c exactly torch.maximum(s, cA) ties and passes half of the gradient.
        tie = (ratio == torch.as_tensor(dual_clip, dtype=ratio.dtype, device=ratio.device)) & (
            signs.negative != 0
        )
        coefficient = torch.where(tie, 0.5 * coefficient, coefficient)
    return coefficient


def _surrogate_values(
    inputs: StageInputs, bounds: ClipBounds, signs: _Signs, selection: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = A~ clip(r, L, H)`` (+0 at unselected positions) and ``sum clip(r, L, H)``.

    L and H have the shape of A; the sum is over the selected tokens. Overwrites the ratio.
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
    return select_(weight.mul_(inputs.weighted), selection), weight_sum


def _sign_bounds(
    bounds: ClipBounds, signs: _Signs, bits: Bits
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The per-sign ``(L, H)`` of ``clip(r, L, H)`` as float tensors of the shape of ``A``.

    ``L = 1 - eps_low`` where ``A < 0``, else ``+0`` (the ratio is ``>= +0`` or NaN, so a lower
    bound of ``+0`` is no bound); ``H`` is the bound of the sign, ``+inf`` where ``A`` is 0 or
    NaN. Built from the sign masks with bitwise operations (exact bit patterns); None where a
    side has no bound at all.
    """
    lower = None
    if bounds.lower_negative is not None:
        lower = torch.bitwise_and(signs.negative, bits.pattern(bounds.lower_negative))
        lower = lower.view(bits.float_dtype)
    infinity = bits.pattern(float("inf"))
    upper = None
    for bound, mask in (
        (bounds.upper_positive, signs.positive),
        (bounds.upper_negative, signs.negative),
    ):
        if bound is not None:  # the bits of H where the mask holds, relative to +inf
            term = torch.bitwise_and(mask, _xor(bits.pattern(bound), infinity))
            upper = term if upper is None else upper.bitwise_xor_(term)
    if upper is not None:
        upper = upper.bitwise_xor_(infinity).view(bits.float_dtype)
    return lower, upper


def _xor(left: int | torch.Tensor, right: int) -> int | torch.Tensor:
    """``left ^ right`` for bit patterns (a 0-d tensor stays a tensor of its dtype)."""
    return torch.bitwise_xor(left, right) if isinstance(left, torch.Tensor) else left ^ right
