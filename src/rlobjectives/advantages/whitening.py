r"""Masked whitening (verl's ``masked_whiten``) and the scaling that keeps variances finite.

Squaring a float32 value above :math:`\approx 1.8\cdot10^{19}` overflows and squaring one below
:math:`\approx 10^{-19}` loses digits (subnormals) or underflows to 0. Every variance in the
library is therefore taken of values divided by a power of two close to their largest magnitude
(:func:`power_of_two_scale`): the scaled values lie in :math:`[-2, 2]`, a power-of-two division
is exact (no rounding in the normal range), and the result is rescaled once at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.context import ContextGroup, context_max, context_sum
from .._core.reduction import masked_fill_zero, safe_divide
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_scalar,
)

__all__ = [
    "MaskedMoments",
    "combine_moments",
    "divide_or_zero",
    "local_moments",
    "masked_moments",
    "masked_whiten",
    "power_of_two_scale",
    "safe_sqrt",
    "validate_flag",
    "whiten_selected",
]


def power_of_two_scale(magnitude: torch.Tensor) -> torch.Tensor:
    r"""A power of two :math:`2^{\lfloor\log_2 m\rfloor}` within a factor 2 of ``magnitude``.

    1 where ``magnitude`` is 0 or not finite (nothing to rescale; NaN/inf propagate through the
    values themselves). Detached: the functions that use it are homogeneous in the scale, so the
    scale is a constant of the computation and the gradient flows through the values alone.
    """
    magnitude = magnitude.detach()
    usable = torch.isfinite(magnitude) & (magnitude > 0)
    exponent = torch.floor(torch.log2(torch.where(usable, magnitude, 1.0)))
    return torch.where(usable, torch.exp2(exponent), 1.0)


class MaskedMoments(NamedTuple):
    """Mean and variance of the selected values of a tensor, in units of ``scale``.

    Attributes (``(K,)`` instead of 0-d for ``K`` stacked tensors, see :func:`masked_moments`):
        scale: 0-d power of two; the true statistics are ``scale * mean`` and
            ``scale**2 * variance``.
        mean: 0-d mean of ``values / scale`` over the selected entries (0 if none).
        centered: ``(values / scale - mean)`` at selected entries, exact 0 elsewhere.
        variance: 0-d variance of ``values / scale`` (divisor ``N - 1`` or ``N``, at least 1).
        selected: 0-d number of selected entries (int64), shared by the stacked tensors.
    """

    scale: torch.Tensor
    mean: torch.Tensor
    centered: torch.Tensor
    variance: torch.Tensor
    selected: torch.Tensor


def masked_moments(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    unbiased: bool,
    context: ContextGroup | None = None,
) -> MaskedMoments:
    """Two-pass mean and variance over the selected entries, scaled so that nothing overflows.

    ``values`` (any shape, floating) and the bool ``mask`` of the same shape are validated by the
    caller. NaN/inf at unselected entries reaches nothing. With ``N <= 1`` selected entries the
    variance is 0 (the divisor ``N - 1`` is raised to 1 and the centered values are 0).

    ``values`` of shape ``(K, *mask.shape)``: the statistics of ``K`` tensors under the same
    mask at once (``scale``, ``mean``, ``variance`` are then ``(K,)``, each with its own
    scale), so that under a context group their collectives are shared.

    ``context``: the statistics of the selected entries of every rank of a context group (this
    rank's ``values`` are its shard): the largest magnitudes by one ``all_reduce(MAX)``, the
    count and sums by one ``all_reduce``, the squared deviations by one more (three collectives
    for any ``K``); the backward of the sums is the adjoint (every rank's centered values depend
    on every rank's values).
    """
    stacked = values.ndim == mask.ndim + 1
    dims = tuple(range(int(stacked), values.ndim))  # the entries (all but the stack)
    selected = masked_fill_zero(values, mask)
    if selected.numel() == 0 and context is None:
        zero = selected.new_zeros(values.shape[:1] if stacked else ())
        return MaskedMoments(torch.ones_like(zero), zero, selected, zero, mask.sum())
    if selected.numel():
        magnitude = selected.abs().amax(dim=dims)
    else:
        magnitude = selected.new_zeros(values.shape[:1] if stacked else ())
    scale = power_of_two_scale(context_max(context, magnitude))  # () or (K,)
    trailing = scale.reshape(scale.shape + (1,) * mask.ndim)  # broadcasts over the entries
    scaled = selected / trailing
    total, count = context_sum(context, scaled.sum(dim=dims), mask.sum(), adjoint=True)
    mean = safe_divide(total, count)  # () or (K,)
    # With one selected entry the centered value is identically 0: select it (gradient exactly
    # 0) instead of differencing x and mean(x), whose gradients cancel to rounding only.
    centered = masked_fill_zero(scaled - mean.reshape(trailing.shape), mask & (count > 1))
    divisor = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    (squares,) = context_sum(context, centered.square().sum(dim=dims), adjoint=True)
    variance = squares / divisor.to(scaled.dtype)  # () or (K,)
    return MaskedMoments(scale, mean, centered, variance, count)


def local_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(3,)`` float64 ``[count, mean, M2]`` of the selected values (M2: squared deviations).

    float64 keeps ``M2`` finite for any float32 input (``(1e20)^2`` overflows float32).
    """
    selected = masked_fill_zero(values.to(torch.float64), mask)  # float64 copy of the values
    count = mask.sum().to(torch.float64)  # ()
    mean = selected.sum() / count.clamp(min=1)  # ()
    deviations = masked_fill_zero(selected - mean, mask)
    return torch.stack([count, mean, deviations.square().sum()])  # (3,)


def combine_moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Chan et al.'s pairwise combination of per-rank ``(W, 3)`` ``[n, mean, M2]`` rows.

    :math:`\mu = \sum_r n_r \mu_r / N` and :math:`M_2 = \sum_r M_{2,r} + \sum_r n_r
    (\mu_r - \mu)^2`: no cancellation (unlike :math:`\sum x^2 - N\mu^2`).
    """
    counts, means, squares = rows.unbind(-1)  # (W,) each
    total = counts.sum()  # ()
    mean = (counts * means).sum() / total.clamp(min=1)  # ()
    m2 = squares.sum() + (counts * (means - mean).square()).sum()  # ()
    return total, mean, m2


@checks_environment
def masked_whiten(
    values: ArrayLike,
    mask: ArrayLike,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: Scalar = 1e-8,
) -> torch.Tensor:
    r"""Whiten the selected values: subtract their mean, divide by their standard deviation.

    With :math:`\mu` and :math:`\sigma^2` the mean and variance of the :math:`N` selected values
    (Bessel-corrected, divisor :math:`N - 1`, when ``unbiased``; :math:`N` otherwise),

    .. math::

        w_i = (x_i - \mu)\,\big(\sigma^2 + \epsilon\big)^{-1/2}
              \;(+\,\mu \text{ when } \texttt{shift\_mean=False}).

    This is verl's ``verl.utils.torch_functional.masked_whiten(values, mask, shift_mean)``
    (``masked_var(unbiased=True)``, ``rsqrt(var + 1e-8)``), used by verl's ``gae`` (advantages)
    and ``reinforce_plus_plus`` estimators. Differences, all on purpose: unselected entries
    give 0 here (verl whitens them too, with the statistics of the selected ones); ``N = 0``
    gives zeros and ``N = 1`` gives 0 at the one selected entry (verl raises); verl's mean
    divides by :math:`N + 10^{-8}` (a relative difference of :math:`10^{-8}/N`). OpenRLHF whitens
    GAE / REINFORCE advantages with the population variance and
    :math:`\mathrm{rsqrt}(\max(\sigma^2, 10^{-8}))`: ``unbiased=False``, equal whenever
    :math:`\sigma^2 \gg 10^{-8}`. For statistics over every data-parallel rank use
    :func:`rlobjectives.distributed.global_masked_whiten`.

    Computed in float32 (float64 for float64 input), also for bf16/fp16 input, on values scaled
    by a power of two near their largest magnitude, so rewards of :math:`10^{20}` or
    :math:`10^{-20}` neither overflow nor underflow. Differentiable (through :math:`\mu` and
    :math:`\sigma` too); NaN/inf at unselected entries reaches neither the output nor a gradient.

    Args:
        values: the values to whiten, any shape, e.g. ``(B, T)`` token advantages or ``(B,)``.
        mask: bool or numeric, the shape of ``values``; nonzero selects the entry.
        shift_mean: False adds the mean back after scaling (verl ``shift_mean=False``).
        unbiased: Bessel-corrected variance (verl); False for the population variance.
        eps: :math:`\epsilon \ge 0` added to the variance (number or 0-d tensor).

    Returns:
        The whitened values, the shape of ``values``, zeros at unselected entries, float32
        (float64 for float64 input) on the device of ``values``.

    Raises:
        ValueError: if ``mask`` has another shape or device, or ``eps`` is negative/non-finite.
        TypeError: on non-numeric inputs or non-bool ``shift_mean``/``unbiased``.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 (advantage normalisation in the reference
        implementation); verl ``masked_whiten``; Hu et al. 2025, REINFORCE++, arXiv:2501.03262
        Eq. 10 (global batch normalisation).

    Examples:
        >>> masked_whiten([[1.0, 2.0, 3.0, float("nan")]], [[1, 1, 1, 0]])
        tensor([[-1.,  0.,  1.,  0.]])

    .. versionadded:: 0.2.0
    """
    values_t = as_float_tensor(values, "values")
    mask_t = as_mask(mask, "mask", values_t.device)
    check_same_device({"values": values_t, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(values_t.shape), "values")
    validate_flag(shift_mean, "shift_mean")
    validate_flag(unbiased, "unbiased")
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    return whiten_selected(
        values_t.to(compute_dtype(values_t)),
        mask_t,
        shift_mean=shift_mean,
        unbiased=unbiased,
        epsilon=epsilon,
    )


def whiten_selected(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool,
    unbiased: bool,
    epsilon: float | torch.Tensor,
    context: ContextGroup | None = None,
) -> torch.Tensor:
    """The body of :func:`masked_whiten` on validated tensors in the computation dtype.

    ``context``: the statistics of every rank of a context group (:func:`masked_moments`).
    """
    moments = masked_moments(values, mask, unbiased=unbiased, context=context)
    # (x - mu) rsqrt(var + eps) = c' / hypot(sqrt(var'), sqrt(eps) / s), with c' = (x - mu)/s
    # and var' = var/s^2: hypot neither overflows nor underflows (eps / s^2 would, for s ~ 1e-20).
    root = torch.as_tensor(epsilon, dtype=moments.scale.dtype, device=moments.scale.device).sqrt()
    spread = torch.hypot(safe_sqrt(moments.variance), root / moments.scale)  # ()
    whitened = divide_or_zero(moments.centered, spread)
    if not shift_mean:
        whitened = masked_fill_zero(whitened + moments.mean * moments.scale, mask)
    return whitened


def safe_sqrt(values: torch.Tensor) -> torch.Tensor:
    """``sqrt`` with gradient 0 (not inf/NaN) at 0."""
    positive = values > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, values, 1.0)), 0.0)


def divide_or_zero(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where the denominator is positive, exact 0 elsewhere.

    A positive denominator is raised to the smallest normal number of its dtype, so that its
    reciprocal (in the gradient) stays finite. Every caller divides centered values by a spread
    that is subnormal only when the values are identical (numerator exactly 0), e.g. identical
    rewards of 1e38 with ``eps / 1e38`` as the spread: the result is unchanged and the gradient
    is finite instead of ``inf * 0``.
    """
    positive = denominator > 0
    floor = torch.finfo(denominator.dtype).tiny
    safe = torch.where(positive, denominator.clamp(min=floor), 1.0)
    return torch.where(positive, numerator / safe, 0.0)


def validate_flag(value: object, name: str) -> bool:
    """Raise ``TypeError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value
