r"""``kl_loss`` and ``kl_penalized_rewards`` on the Triton kernels.

- :func:`kl_loss_forward` / :class:`KLLossFunction`: the per-token estimate
  :math:`k(\mathrm{clip}(\ell - \ell^{ref}, -b, b))` (k1, k2, k3 or abs; straight-through option)
  times optional constant importance weights, reduced with the caller's per-token weights
  :math:`w`; one forward launch (the token-loss kernel with no surrogate), backward
  ``grad * coefficient``.
- :func:`kl_penalized_rewards_forward` / :class:`KLPenalizedRewardsFunction`: the seed
  specification :math:`D_i = \sum_t M_{it}(\ell_{it} - \ell^{ref}_{it})`,
  :math:`\tilde r_i = r_i - \beta D_i`, :math:`J = \frac1B \sum_i \tilde r_i`; one forward launch
  over ``(B, T)`` rows, and a backward that needs only the mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .common import KERNEL_DTYPES, check_mask, first_order_only, mask_bytes, on_tensor_device
from .loading import kernels
from .token_loss import TokenLossOptions, scale_by_mask, token_loss_forward

__all__ = [
    "KLLossForward",
    "KLLossFunction",
    "KLPenalizedRewardsFunction",
    "KLRewardsForward",
    "kl_loss_forward",
    "kl_penalized_rewards_forward",
]

_ROW_BLOCK = 1024


class KLLossForward(NamedTuple):
    r"""Result of :func:`kl_loss_forward`.

    Attributes:
        coefficient: ``(N,)`` float32 :math:`w\rho\,\partial k / \partial \ell` (0 unselected).
        per_token: ``(N,)`` float32 :math:`\rho k` when requested (zeros at unselected tokens).
        loss: 0-d float32 :math:`\sum w \rho k`.
        total: 0-d float32 :math:`\sum \rho k` (unweighted).
        selected: 0-d float32, selected tokens.
    """

    coefficient: torch.Tensor
    per_token: torch.Tensor | None
    loss: torch.Tensor
    total: torch.Tensor
    selected: torch.Tensor


def kl_loss_forward(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    row_length: int | None = None,
    estimator: str = "k3",
    straight_through: bool = False,
    log_ratio_bound: float | None = 20.0,
    importance_weights: torch.Tensor | None = None,
    return_per_token: bool = False,
    block_size: int = 1024,
) -> KLLossForward:
    r"""Per-token KL estimate and its weighted sum in one launch.

    Args:
        log_probs: ``(N,)`` :math:`\ell` (fp16/bf16/fp32).
        ref_log_probs: ``(N,)`` :math:`\ell^{ref}`.
        mask: ``(N,)`` bool.
        weights: reduction weights ((N,), (B,) with ``row_length``, or one value); None: 1.
        row_length: ``T`` for per-row weights.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of k2.
        log_ratio_bound: :math:`b` or None.
        importance_weights: ``(N,)`` constant :math:`\rho` (TRL ``use_bias_correction_kl``
            passes the policy ratio).
        return_per_token: also write :math:`\rho k` per token.
        block_size: tokens per program.

    Returns:
        :class:`KLLossForward`.
    """
    options = TokenLossOptions(
        surrogate=None,
        log_ratio_bound=log_ratio_bound,
        kl_coef=1.0,
        kl_estimator=estimator,
        kl_straight_through=straight_through,
        kl_importance_weighted=importance_weights is not None,
    )
    out = token_loss_forward(
        log_probs, None, None, mask,
        options=options, weights=weights, row_length=row_length,
        importance_weights=importance_weights, ref_log_probs=ref_log_probs,
        return_per_token=return_per_token, block_size=block_size,
    )  # fmt: skip
    sums = out.sums
    return KLLossForward(
        out.coefficient, out.per_token_loss, sums.weighted_kl, sums.kl_sum, sums.selected
    )


class KLLossFunction(torch.autograd.Function):
    """``(loss, per_token)`` of :func:`kl_loss_forward`; backward ``grad * coefficient``.

    ``apply(log_probs, ref_log_probs, mask, weights, kwargs)``; only ``log_probs`` gets a
    gradient. With ``weights`` the per-token output carries no gradient (as
    :class:`~rlobjectives.kernels.token_loss.TokenLossFunction`). First-order only.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        log_probs: torch.Tensor,
        ref_log_probs: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        out = kl_loss_forward(log_probs, ref_log_probs, mask, weights=weights, **kwargs)
        per_token = out.per_token if out.per_token is not None else out.loss.new_empty(0)
        ctx.save_for_backward(out.coefficient, mask)
        ctx.weighted = weights is not None
        ctx.dtype = log_probs.dtype
        if weights is not None:
            ctx.mark_non_differentiable(per_token)
        return out.loss.clone(), per_token

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, grad_per_token: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        coefficient, mask = ctx.saved_tensors
        gradient = grad_loss
        if not ctx.weighted and grad_per_token is not None and grad_per_token.numel():
            gradient = grad_per_token.float() + grad_loss.float()
        grad = scale_by_mask(coefficient, gradient, mask, ctx.dtype)
        return grad, None, None, None, None


class KLRewardsForward(NamedTuple):
    r"""Result of :func:`kl_penalized_rewards_forward` (float32).

    Attributes:
        objective: 0-d, :math:`\frac{1}{\max(B, 1)}\sum_i \tilde r_i`.
        penalized_rewards: ``(B,)`` :math:`r_i - \beta D_i`.
        sampled_divergences: ``(B,)`` :math:`D_i`.
    """

    objective: torch.Tensor
    penalized_rewards: torch.Tensor
    sampled_divergences: torch.Tensor


def _check_rows(tensor: object, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (*KERNEL_DTYPES, torch.bool):
        raise TypeError(f"{name} must be a float16/bfloat16/float32 (or bool mask) tensor")
    if tuple(tensor.shape) != shape or tensor.device != device:
        raise ValueError(f"{name} must have shape {shape} on {device}, got {tuple(tensor.shape)}")


@on_tensor_device
def kl_penalized_rewards_forward(
    policy_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = _ROW_BLOCK,
) -> KLRewardsForward:
    r"""One launch (one program per sequence) for the seed ``kl_penalized_rewards``.

    Args:
        policy_log_probs: ``(B, T)`` (fp16/bf16/fp32; rows may be strided, tokens contiguous),
            or one packed row ``(1, N)`` with ``cu_seqlens``.
        reference_log_probs: the shape of ``policy_log_probs``.
        rewards: ``(B,)`` (packed: ``(S,)``).
        mask: bool, the shape of ``policy_log_probs``.
        beta: :math:`\beta \ge 0` (Python number).
        cu_seqlens: ``(S + 1,)`` int64 boundaries of the packed sequences (validated), or None.
        block_size: tokens per loop step.

    Returns:
        :class:`KLRewardsForward`; no host synchronisation.
    """
    device = policy_log_probs.device
    shape = tuple(policy_log_probs.shape)
    if len(shape) != 2 or (cu_seqlens is not None and shape[0] != 1):
        raise ValueError(f"policy_log_probs must be (B, T) or packed (1, N), got shape {shape}")
    batch = shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_rows(policy_log_probs, "policy_log_probs", shape, device)
    _check_rows(reference_log_probs, "reference_log_probs", shape, device)
    _check_rows(rewards, "rewards", (batch,), device)
    _check_rows(mask, "mask", shape, device)
    packed = cu_seqlens is not None
    policy = _contiguous(policy_log_probs, packed)
    reference = _contiguous(reference_log_probs, packed)
    flags = _contiguous(check_mask(mask.reshape(-1), mask.numel(), device).view(shape), packed)
    divergences = torch.zeros(batch, dtype=torch.float32, device=device)
    penalized = torch.zeros(batch, dtype=torch.float32, device=device)
    if batch > 0:
        kernels(device).kl_rewards.kl_rewards_kernel[(batch,)](
            policy, reference, rewards.contiguous(), mask_bytes(flags), cu_seqlens, divergences,
            penalized, shape[1], policy.stride(0), reference.stride(0), flags.stride(0),
            float(beta), PACKED=packed, BLOCK=block_size, num_warps=4,
        )  # fmt: skip
    objective = penalized.sum() / max(batch, 1)
    return KLRewardsForward(objective, penalized, divergences)


def _contiguous(tensor: torch.Tensor, packed: bool) -> torch.Tensor:
    """Tokens contiguous: the whole packed row, or the last dimension of each padded row."""
    return tensor.contiguous() if packed else _row_contiguous(tensor)


def _row_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if its last dimension is contiguous, else a contiguous copy."""
    return tensor if tensor.shape[-1] <= 1 or tensor.stride(-1) == 1 else tensor.contiguous()


class KLPenalizedRewardsFunction(torch.autograd.Function):
    r"""``(objective, penalized_rewards, sampled_divergences)`` with the seed's gradients.

    ``apply(policy_log_probs, reference_log_probs, rewards, mask, beta, packing)``, ``packing``
    None (padded rows) or ``(cu_seqlens, sequence_ids)`` of one packed row. With
    :math:`g_J, g_{\tilde r}, g_D` the incoming gradients, per selected token
    :math:`\partial/\partial \ell_{it} = g_{D,i} - \beta g_{\tilde r, i} - \beta g_J / B`, the
    reference gets the negation, and the rewards :math:`g_{\tilde r, i} + g_J / B`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        policy_log_probs: torch.Tensor,
        reference_log_probs: torch.Tensor,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        beta: float,
        packing: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        cu_seqlens = None if packing is None else packing[0]
        out = kl_penalized_rewards_forward(
            policy_log_probs, reference_log_probs, rewards, mask, beta=beta, cu_seqlens=cu_seqlens
        )
        ctx.save_for_backward(mask, None if packing is None else packing[1])
        ctx.beta = float(beta)
        ctx.batch = out.penalized_rewards.shape[0]
        ctx.dtypes = (policy_log_probs.dtype, reference_log_probs.dtype, rewards.dtype)
        return out

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any,
        grad_objective: torch.Tensor,
        grad_penalized: torch.Tensor,
        grad_divergences: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        mask, sequence_ids = ctx.saved_tensors
        per_sequence = grad_objective.float() / max(ctx.batch, 1) + grad_penalized.float()  # (S,)
        row_factor = grad_divergences.float() - ctx.beta * per_sequence  # (S,)
        row_length: int | None = mask.shape[1]
        if sequence_ids is not None:  # packed: the factor of each token's sequence
            row_factor, row_length = row_factor.index_select(0, sequence_ids), None
        flat = mask.reshape(-1)
        one = row_factor.new_ones(1)
        grads: list[torch.Tensor | None] = [None, None, None]
        for index, sign in ((0, 1.0), (1, -1.0)):
            if ctx.needs_input_grad[index] and flat.numel() == 0:
                grads[index] = mask.new_zeros(mask.shape, dtype=ctx.dtypes[index])
            elif ctx.needs_input_grad[index]:
                grads[index] = scale_by_mask(
                    row_factor, one * sign, flat, ctx.dtypes[index], row_length=row_length
                ).view(mask.shape)
        if ctx.needs_input_grad[2]:
            grads[2] = per_sequence.to(ctx.dtypes[2])
        return grads[0], grads[1], grads[2], None, None, None
