r"""The PPO critic loss: clipped value regression onto the returns, with its diagnostics."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from .._core.context import ContextGroup, context_max
from .._core.layout import Layout, sequence_layout, token_matrix, token_ndim, token_output
from .._core.reduction import (
    Reduction,
    masked_fill_zero,
    reduce,
    safe_divide,
    validate_layout_reduction,
)
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_context_group,
    validate_scalar,
)
from ..advantages.whitening import masked_moments, power_of_two_scale

__all__ = ["ValueLossDiagnostics", "ValueLossOutput", "value_loss"]

# verl's critic/vf_explained_var adds 1e-5 to the variance of the returns.
_EXPLAINED_VARIANCE_EPS = 1e-5


class ValueLossDiagnostics(NamedTuple):
    r"""Detached, masked, NaN-proof diagnostics of a :func:`value_loss` call (0-d tensors).

    Attributes:
        clip_fraction: fraction of selected tokens where the clipped term is strictly larger,
            :math:`(\mathrm{clip}(V, V^{old} \pm \epsilon) - R)^2 > (V - R)^2`, i.e. where
            clipping binds and the loss has no gradient (verl's ``vf_clipfrac``). 0 with
            ``clip=None`` or nothing selected.
        explained_variance: :math:`1 - \mathrm{Var}(R - V) / (\mathrm{Var}(R) + 10^{-5})` over
            the selected tokens (unbiased variances), the share of the returns' variance the
            critic explains: 1 is perfect, 0 is no better than a constant, negative is worse.
            verl's ``critic/vf_explained_var`` is this formula on the rollout values
            (``old_values``). 0 with fewer than two selected tokens.
    """

    clip_fraction: torch.Tensor
    explained_variance: torch.Tensor


class ValueLossOutput(NamedTuple):
    r"""Result of :func:`value_loss`.

    Attributes:
        loss: the reduced loss (scalar; ``(B, T)`` for ``reduction="none"``), dtype of
            ``values``.
        per_token_loss: ``(B, T)`` per-token loss
            :math:`\tfrac12\max((V - R)^2, (\mathrm{clip}(V) - R)^2)`, zeros at unselected
            tokens, in the computation dtype (float32, float64 for float64 inputs).
        diagnostics: :class:`ValueLossDiagnostics`.
    """

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    diagnostics: ValueLossDiagnostics


class _ValueInputs(NamedTuple):
    values: torch.Tensor  # (B, T) computation dtype, zeros at unselected tokens (grad flows)
    old_values: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) bool
    output_dtype: torch.dtype
    layout: Layout  # padded rows, or packed sequences (cu_seqlens)


def _prepare(
    values: ArrayLike,
    old_values: ArrayLike,
    returns: ArrayLike,
    mask: ArrayLike,
    cu_seqlens: ArrayLike | None,
    context: ContextGroup | None,
) -> _ValueInputs:
    packed = cu_seqlens is not None
    values_t = token_matrix(as_float_tensor(values, "values"), "values", packed)
    device = values_t.device
    old_t = token_matrix(as_float_tensor(old_values, "old_values", device), "old_values", packed)
    returns_t = token_matrix(as_float_tensor(returns, "returns", device), "returns", packed)
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", packed)
    check_same_device(
        {"values": values_t, "old_values": old_t, "returns": returns_t, "mask": mask_t}
    )
    for tensor, name in ((old_t, "old_values"), (returns_t, "returns"), (mask_t, "mask")):
        check_shape(tensor, name, values_t.shape, "values")
    dtype = compute_dtype(values_t, old_t, returns_t)
    # Select before any arithmetic: NaN/inf at unselected positions reaches nothing.
    return _ValueInputs(
        values=masked_fill_zero(values_t.to(dtype), mask_t),
        old_values=masked_fill_zero(old_t.to(dtype), mask_t).detach(),
        returns=masked_fill_zero(returns_t.to(dtype), mask_t).detach(),
        mask=mask_t,
        output_dtype=values_t.dtype,
        layout=sequence_layout(cu_seqlens, values_t, context),
    )


def _explained_variance(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    context: ContextGroup | None = None,
) -> torch.Tensor:
    """``1 - Var(R - V) / (Var(R) + 1e-5)`` over the selected tokens; 0 below two tokens.

    ``values`` and ``returns`` are zero at unselected tokens. Neither variance is formed in the
    computation dtype: each is the variance of values divided by a power of two
    (:func:`masked_moments`), and the ratio is taken from their logarithms and the scales'
    exponents (exact integers), so a float32 square never overflows or underflows (returns of
    1e19 have a variance of 1e38, whose rescaling by 2^130 did overflow) and the result is the
    float32 rounding of the true value wherever that is finite. ``context``: over the selected
    tokens of every rank of a context group (one maximum for the common scale, then the two
    variances' maxima, sums and squared deviations in three collectives shared by both).
    """
    if mask.numel() == 0 and context is None:
        return values.new_zeros(())
    # R - V of values divided by a common power of two: the difference cannot overflow either.
    largest = torch.maximum(_largest(values), _largest(returns))
    common = power_of_two_scale(context_max(context, largest))
    # Both variances at once (stacked: their collectives are shared under a context group).
    moments = masked_moments(
        torch.stack([returns / common - values / common, returns]),
        mask,
        unbiased=True,
        context=context,
    )
    residual_scale, target_scale = moments.scale.unbind()
    residual_variance, target_variance = moments.variance.unbind()
    # log Var(R - V) - log(Var(R) + eps), each variance = variance' * scale^2.
    exponent = 2.0 * (residual_scale.log2() + common.log2() - target_scale.log2())  # exact
    log_eps = math.log(_EXPLAINED_VARIANCE_EPS) - 2.0 * math.log(2.0) * target_scale.log2()
    log_ratio = (
        residual_variance.log()
        + exponent * math.log(2.0)
        - torch.logaddexp(target_variance.log(), log_eps)
    )
    explained = 1.0 - torch.exp(log_ratio)
    return torch.where(moments.selected >= 2, explained, 0.0)


def _largest(values: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``values``, 0 for an empty tensor."""
    return values.abs().amax() if values.numel() else values.new_zeros(())


@checks_environment
def value_loss(
    values: ArrayLike,
    old_values: ArrayLike,
    returns: ArrayLike,
    mask: ArrayLike,
    *,
    clip: Scalar | None = 0.2,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> ValueLossOutput:
    r"""Clipped PPO value loss: regress the critic onto the returns, never far from its old value.

    With :math:`V` = ``values`` (current critic), :math:`V^{old}` = ``old_values`` (the critic
    at rollout time), :math:`R` = ``returns`` (e.g. :func:`rlobjectives.gae`'s returns) and
    :math:`\epsilon` = ``clip``, on the selected tokens:

    .. math::

        L_{it} = \tfrac12 \max\Big((V_{it} - R_{it})^2,\
                 \big(\mathrm{clip}(V_{it}, V^{old}_{it} - \epsilon, V^{old}_{it} + \epsilon)
                 - R_{it}\big)^2\Big),

    reduced like :func:`rlobjectives.aggregate` (``"token_mean"``, ``"sequence_mean"``,
    ``"sequence_sum_normalized"``, ``"none"``; a global ``normalizer`` makes it micro-batch and
    rank additive). ``clip=None``: :math:`\tfrac12 (V - R)^2`. Gradients flow into ``values``
    only; float32 (float64 for float64 inputs); NaN/inf at unselected positions reaches nothing.
    Peers: verl ``compute_value_loss`` (``cliprange_value=clip``), OpenRLHF ``ValueLoss``
    (``clip_eps=clip``), TRL PPO's ``vf_loss``; the mapping, packing and context parallelism:
    ``docs/objectives/value.md``.

    Args:
        values: ``(B, T)`` current value predictions :math:`V` (differentiable).
        old_values: ``(B, T)`` values at rollout time :math:`V^{old}`.
        returns: ``(B, T)`` value targets :math:`R`.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        clip: :math:`\epsilon \ge 0` (number or 0-d tensor), or None for no clipping.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``, ``"none"``.
        normalizer: explicit positive denominator (global token / sequence count), see
            :func:`rlobjectives.aggregate`.
        max_response_length: the ``"sequence_sum_normalized"`` constant :math:`C`
            (default ``T``).
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the context-parallel group of the sequences' other tokens, or None.

    Returns:
        :class:`ValueLossOutput` ``(loss, per_token_loss, diagnostics)``; ``loss`` has the
        dtype of ``values`` (per-token results: the shape of ``values``).

    Raises:
        ValueError: on mismatched shapes or devices, inputs that are not ``(B, T)``, a negative
            or non-finite ``clip``, an unknown ``reduction``, a non-positive ``normalizer`` or
            ``max_response_length``, a malformed ``cu_seqlens``, or a ``context_group`` without
            this rank or a process group.
        TypeError: on non-numeric inputs, or a non-ProcessGroup ``context_group``.

    References:
        Schulman et al. 2017, PPO, arXiv:1707.06347 Eq. 9 (:math:`L^{VF}`); the clipped value
        loss of the OpenAI baselines ``ppo2`` implementation; Ziegler et al. 2019,
        arXiv:1909.08593.

    Examples:
        >>> out = value_loss([[1.0, 0.5]], [[0.0, 0.5]], [[2.0, 0.0]], [[1, 1]], clip=0.2)
        >>> out.loss  # token 0: max((1-2)^2, (0.2-2)^2) = 3.24; token 1: 0.25; (3.24+0.25)/2/2
        tensor(0.8725)
        >>> out.diagnostics.clip_fraction
        tensor(0.5000)

    .. versionadded:: 0.2.0
    """
    context = validate_context_group(context_group)
    inputs = _prepare(values, old_values, returns, mask, cu_seqlens, context)
    flat = cu_seqlens is not None and token_ndim(values) == 1
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=inputs.layout,
        tokens=inputs.values.shape[-1],
    )
    bound = None if clip is None else validate_scalar(clip, "clip", minimum=0.0)
    error = inputs.values - inputs.returns  # (B, T)
    squared = error.square()  # (B, T)
    clip_fraction = inputs.values.new_zeros(())
    if bound is not None:
        if isinstance(bound, torch.Tensor):
            bound = bound.to(dtype=inputs.values.dtype, device=inputs.values.device)
        clipped_values = torch.clamp(
            inputs.values, inputs.old_values - bound, inputs.old_values + bound
        )  # (B, T)
        clipped_error = clipped_values - inputs.returns  # (B, T)
        squared = torch.maximum(squared, clipped_error.square())
        # (c - R)^2 > (V - R)^2 compared as magnitudes: squares of float32 errors above ~1.8e19
        # overflow to inf, and inf > inf would hide a binding clip.
        binding = (clipped_error.abs() > error.abs()) & inputs.mask  # (B, T)
        bound_count, selected = inputs.layout.combine(binding.sum(), inputs.mask.sum())
        clip_fraction = safe_divide(bound_count.to(squared.dtype), selected)
    per_token = masked_fill_zero(0.5 * squared, inputs.mask)  # (B, T)
    loss = reduce(per_token, inputs.mask, spec, inputs.layout)
    with torch.no_grad():
        diagnostics = ValueLossDiagnostics(
            clip_fraction=clip_fraction.detach(),
            explained_variance=_explained_variance(
                inputs.values, inputs.returns, inputs.mask, context
            ),
        )
    return ValueLossOutput(
        loss=token_output(loss.to(inputs.output_dtype), flat and loss.ndim == 2),
        per_token_loss=token_output(per_token, flat),
        diagnostics=diagnostics,
    )
