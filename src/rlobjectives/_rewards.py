"""KL-penalized sequence rewards (the seed specification :func:`kl_penalized_rewards`)."""

from __future__ import annotations

import torch

from ._kl import _kl_terms
from ._masking import masked_sum, safe_divide
from ._validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_scalar,
)

__all__ = ["kl_penalized_rewards"]


def kl_penalized_rewards(
    policy_log_probs: ArrayLike,
    reference_log_probs: ArrayLike,
    rewards: ArrayLike,
    response_mask: ArrayLike,
    beta: Scalar,
) -> dict[str, torch.Tensor]:
    r"""Penalize sequence rewards by the sampled KL divergence to a reference policy.

    .. math::

        D_i = \sum_t m_{it} (\ell^{\pi}_{it} - \ell^{ref}_{it}), \qquad
        \tilde r_i = r_i - \beta D_i, \qquad
        J = \frac{1}{B} \sum_i \tilde r_i

    :math:`D_i` is the k1 (log-ratio) estimate of KL(pi || ref) summed over the response: it is not
    clamped, not divided by the response length, and may be negative. Unselected tokens contribute
    exactly zero (NaN/inf there is ignored); an empty batch has :math:`J = 0`.

    Args:
        policy_log_probs: ``(B, T)`` log-probabilities under the policy (differentiable).
        reference_log_probs: ``(B, T)`` log-probabilities under the reference policy.
        rewards: ``(B,)`` (or ``(B, 1)``) scalar rewards.
        response_mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        beta: KL coefficient :math:`\beta \ge 0`, finite.

    Returns:
        ``{"objective": (), "penalized_rewards": (B,), "sampled_divergences": (B,)}``, float32
        on the device of ``policy_log_probs`` (computed in float64 when any input is float64).

    Raises:
        ValueError: on mismatched shapes or devices, rewards of the wrong length, or a
            negative/NaN/infinite ``beta``.
        TypeError: on non-numeric inputs.

    References:
        Ziegler et al. 2019, arXiv:1909.08593 Eq. 2; Ouyang et al. 2022 (InstructGPT),
        arXiv:2203.02155 Eq. 2.

    Examples:
        >>> out = kl_penalized_rewards([[-1, -2]], [[-1.5, -2.5]], [3], [[True, True]], 0.5)
        >>> float(out["objective"])
        2.5
    """
    policy = as_batch_matrix(
        as_float_tensor(policy_log_probs, "policy_log_probs"), "policy_log_probs"
    )
    device = policy.device
    reference = as_batch_matrix(
        as_float_tensor(reference_log_probs, "reference_log_probs", device), "reference_log_probs"
    )
    rewards_t = as_float_tensor(rewards, "rewards", device)
    mask = as_batch_matrix(as_mask(response_mask, "response_mask", device), "response_mask")
    check_same_device(
        {
            "policy_log_probs": policy,
            "reference_log_probs": reference,
            "rewards": rewards_t,
            "response_mask": mask,
        }
    )
    batch = policy.shape[0]
    check_shape(reference, "reference_log_probs", policy.shape, "policy_log_probs")
    check_shape(mask, "response_mask", policy.shape, "policy_log_probs")
    if rewards_t.ndim == 2 and rewards_t.shape[1] == 1:
        rewards_t = rewards_t.squeeze(-1)
    if rewards_t.ndim != 1 or rewards_t.shape[0] != batch:
        raise ValueError(
            f"rewards must have shape (B,) = ({batch},) (one reward per sequence of "
            f"policy_log_probs), got shape {tuple(rewards_t.shape)}"
        )
    coefficient = validate_scalar(beta, "beta", minimum=0.0)

    dtype = compute_dtype(policy, reference, rewards_t)
    # The k1 estimate per token, unclamped, through the one KL implementation (rlobjectives._kl).
    log_ratio = _kl_terms(
        policy,
        reference,
        mask,
        estimator="k1",
        straight_through=False,
        log_ratio_bound=None,
        dtype=dtype,
    )  # (B, T), zeros at unselected tokens
    divergences = masked_sum(log_ratio, mask, dim=-1)  # (B,)
    penalized = rewards_t.to(dtype) - coefficient * divergences  # (B,)
    objective = safe_divide(penalized.sum(), batch)  # ()
    return {
        "objective": objective.to(torch.float32),
        "penalized_rewards": penalized.to(torch.float32),
        "sampled_divergences": divergences.to(torch.float32),
    }
