r"""``kl_loss`` and ``kl_penalized_rewards`` of the public API on the Triton kernels.

:func:`rlobjectives.kl_loss` and :func:`rlobjectives.kl_penalized_rewards` validate their
arguments, then call :func:`kl_loss_kernels` / :func:`kl_rewards_kernels` when
:func:`~rlobjectives._core.backend.kernel_backend` selects the kernels:

- ``kl_loss``: the token-loss kernel without a surrogate (:class:`~._kl.KLLossFunction`); the
  reduction enters as the per-token weights of :func:`rlobjectives._core.reduction.row_weights` over
  the layout (padded or packed), ``reduction="none"`` as the kernel's per-token estimate;
  constant importance weights multiply the estimate. Differentiable importance weights (TRL's
  ``use_bias_correction_kl``) need autograd through the weights: PyTorch path.
- ``kl_penalized_rewards``: one program per sequence (:class:`~._kl.KLPenalizedRewardsFunction`),
  rows of the padded layout or the runs ``cu_seqlens[i]:cu_seqlens[i + 1]`` of a packed one.

Both return None when a hyperparameter is a tensor that requires grad (PyTorch path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..._core.layout import Layout
from ..._core.reduction import ReductionSpec
from ..kl import KLLossFunction, KLPenalizedRewardsFunction
from .policy import flat_values, host_number, reduction_weights

if TYPE_CHECKING:
    from ...kl.estimators import KLInputs

__all__ = ["kl_loss_kernels", "kl_rewards_kernels"]


def kl_loss_kernels(
    inputs: KLInputs,
    spec: ReductionSpec,
    estimator: str,
    straight_through: bool,
    log_ratio_bound: float | torch.Tensor | None,
    importance_weights: torch.Tensor | None,
) -> torch.Tensor | None:
    """:func:`rlobjectives.kl_loss` of validated inputs, or None (the PyTorch path).

    The tensors are ``(B, T)`` (packed ``(1, N)``); the result is the loss in the dtype of
    ``log_probs`` (``(B, T)`` for ``reduction="none"``).
    """
    log_probs, ref_log_probs, mask = inputs.log_probs, inputs.ref_log_probs, inputs.mask
    bound = host_number(log_ratio_bound)
    if not (bound is None or isinstance(bound, float)):
        return None
    if importance_weights is not None and importance_weights.requires_grad:
        return None
    shape = (mask.shape[0], mask.shape[1])
    none = spec.reduction == "none"
    weights = None if none else reduction_weights(mask, spec, inputs.layout)
    importance = None
    if importance_weights is not None:
        importance = flat_values(importance_weights.to(torch.float32), shape)
    kwargs: dict[str, Any] = {
        "row_length": shape[1],
        "estimator": estimator,
        "straight_through": straight_through,
        "log_ratio_bound": bound,
        "importance_weights": importance,
        "return_per_token": none,
    }
    loss, per_token = KLLossFunction.apply(  # type: ignore[no-untyped-call]
        log_probs.reshape(-1), ref_log_probs.reshape(-1), mask.reshape(-1), weights, kwargs
    )
    if not none and inputs.layout.context is not None:  # this rank's share, summed
        (loss,) = inputs.layout.combine(loss)  # identity backward (a replicated loss)
    result: torch.Tensor = per_token.view(shape) if none else loss
    return result.to(log_probs.dtype)


def kl_rewards_kernels(
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    layout: Layout,
    beta: float | torch.Tensor,
) -> dict[str, torch.Tensor] | None:
    """:func:`rlobjectives.kl_penalized_rewards` of validated tensors, or None.

    ``tensors``: ``(policy_log_probs, reference_log_probs, rewards, mask)``, the per-token ones
    ``(B, T)`` (packed ``(1, N)``), ``rewards`` ``(S,)``.
    """
    coefficient = host_number(beta)
    if not isinstance(coefficient, float):
        return None
    policy, reference, rewards, mask = tensors
    packing = None
    if layout.sequence_ids is not None:
        if layout.cu_seqlens is None:  # pragma: no cover - packed layouts carry their boundaries
            return None
        packing = (layout.cu_seqlens, layout.sequence_ids)
    objective, penalized, divergences = KLPenalizedRewardsFunction.apply(  # type: ignore[no-untyped-call]
        policy, reference, rewards.to(torch.float32), mask, coefficient, packing
    )
    return {
        "objective": objective,
        "penalized_rewards": penalized,
        "sampled_divergences": divergences,
    }
