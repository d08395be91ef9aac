"""Eager references written the way trainers write them (verl / TRL / OpenRLHF style).

These are the *baselines* of the benchmark suite (``benchmarks/``) and are checked against the
library by the tests (``tests/test_fused.py``), so the two cannot drift. They are deliberately
plain: multiply by the mask, ``torch.max`` of the two negated surrogates, ``.sum() / mask.sum()``.
They are NOT NaN-safe (a NaN at a masked position reaches the loss through ``0 * NaN``) and they
do not guard empty masks: that is the point of comparison, not a bug to fix here.

Precision: every function upcasts its inputs to float32 (float64 stays float64) before the math,
as the library does, so both compute the same numbers and the benchmark compares like with like
(a bf16-native baseline would be faster and less accurate).

Nothing here imports the library.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _upcast(*tensors: Tensor) -> list[Tensor]:
    dtype = torch.float32
    for tensor in tensors:
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return [tensor.to(dtype) for tensor in tensors]


def _reduce(
    losses: Tensor, mask: Tensor, reduction: str, max_response_length: int | None
) -> Tensor:
    """verl's ``agg_loss`` (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm), TRL luspo."""
    if reduction == "token_mean":
        return (losses * mask).sum() / mask.sum()
    if reduction == "sequence_mean":
        per_sequence = (losses * mask).sum(dim=-1) / mask.sum(dim=-1)  # (B,)
        return per_sequence.mean()
    if reduction == "sequence_sum_normalized":
        constant = losses.shape[-1] if max_response_length is None else max_response_length
        return (losses * mask).sum() / (losses.shape[0] * constant)
    if reduction == "length_weighted":  # TRL luspo (>= 1.10)
        return (losses * mask).sum(dim=-1).mean()
    if reduction == "none":
        return losses * mask
    raise ValueError(f"unknown reduction {reduction!r}")


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    log_ratio_bound: float | None = 20.0,
    reduction: str = "token_mean",
    max_response_length: int | None = None,
) -> Tensor:
    """PPO/GRPO/DAPO/GSPO clipped surrogate loss as trainers write it (verl's policy loss).

    ``advantages`` is ``(B, T)`` or ``(B, 1)``; ``mask`` is ``(B, T)`` (bool or float).
    """
    log_probs, old_log_probs, advantages = _upcast(log_probs, old_log_probs, advantages)
    mask = mask.to(log_probs.dtype)
    negative_approx_kl = log_probs - old_log_probs
    if ratio_level == "sequence":
        # GSPO (verl ``compute_policy_loss_gspo``): sequence log-ratio, token stop-gradient form.
        sequence_log_ratio = (negative_approx_kl * mask).sum(dim=-1) / mask.sum(dim=-1)
        negative_approx_kl = log_probs - log_probs.detach() + sequence_log_ratio.detach()[:, None]
    if log_ratio_bound is not None:
        negative_approx_kl = torch.clamp(negative_approx_kl, -log_ratio_bound, log_ratio_bound)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    if clip_low is None:
        pg_losses = pg_losses1
    else:
        high = clip_low if clip_high is None else clip_high
        pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + high)
        pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if dual_clip is not None:
        pg_losses3 = -advantages * dual_clip
        clip_pg_losses2 = torch.min(pg_losses3, pg_losses)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, pg_losses)
    return _reduce(pg_losses, mask, reduction, max_response_length)


def verl_vanilla_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """verl's eager ``compute_policy_loss_vanilla`` (0.9) with its default config, op for op.

    The steps verl runs, written from its formula: the log-ratio clamped to ±20, the ratio, the
    two surrogates and their maximum, the dual clip ``clip_ratio_c`` (always on in verl), the
    ``token-mean`` aggregation (``masked_sum / mask.sum()``), and its three metrics
    (``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``) read on the host as verl returns
    them; ``masked_mean(x, m)`` is ``where(m, x, 0) * m`` summed over ``m.sum() + 1e-8``. The
    library equivalent is ``policy_loss(..., surrogate=Clip(low=clip_ratio, dual=clip_ratio_c))``.
    """
    log_probs, old_log_probs, advantages = _upcast(log_probs, old_log_probs, advantages)
    mask = mask.to(log_probs.dtype)

    def masked_sum(values: Tensor) -> Tensor:
        return (torch.where(mask.bool(), values, 0.0) * mask).sum()

    def masked_mean(values: Tensor) -> Tensor:
        return masked_sum(values) / (mask.sum() + 1e-8)

    negative_approx_kl = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float())
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = masked_sum(pg_losses) / mask.sum()
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return loss, metrics


def kl_penalized_rewards(
    policy_log_probs: Tensor,
    reference_log_probs: Tensor,
    rewards: Tensor,
    response_mask: Tensor,
    beta: float,
) -> Tensor:
    """Mean KL-penalized reward ``mean_i(r_i - beta * sum_t m (lp - ref))`` (the objective)."""
    policy_log_probs, reference_log_probs, rewards = _upcast(
        policy_log_probs, reference_log_probs, rewards
    )
    mask = response_mask.to(policy_log_probs.dtype)
    kl = (policy_log_probs - reference_log_probs) * mask
    return (rewards - beta * kl.sum(dim=-1)).mean()


def kl_estimate(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    *,
    estimator: str = "k3",
    log_ratio_bound: float = 20.0,
) -> Tensor:
    """Per-token KL(pi || ref) estimate as verl's ``kl_penalty`` writes it (k1, k2, k3)."""
    log_probs, ref_log_probs = _upcast(log_probs, ref_log_probs)
    kl = log_probs - ref_log_probs
    if estimator == "k1":
        return kl
    if estimator == "k2":
        return 0.5 * kl.square()
    if estimator == "k3":
        kl = torch.clamp(-kl, min=-log_ratio_bound, max=log_ratio_bound)
        return torch.exp(kl) - kl - 1
    raise ValueError(f"unknown estimator {estimator!r}")


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    log_ratio_bound: float = 20.0,
) -> Tensor:
    """Token-mean KL loss (verl ``use_kl_loss``): ``(kl * mask).sum() / mask.sum()``."""
    kl = kl_estimate(log_probs, ref_log_probs, estimator=estimator, log_ratio_bound=log_ratio_bound)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum()


def rollout_correction(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float | None = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Rollout correction as verl's ``rollout_corr_helper`` / TRL write it (weights, mask, metrics).

    Multiplies by the mask, ``exp(clamp(log_ratio, -20, 20))``, then truncation, masking or
    rejection; the metrics as masked means of the raw ratio and of the weights (verl's
    ``compute_is_metrics`` / ``compute_offpolicy_metrics`` style, as tensors, no ``.item()``).
    """
    log_probs, rollout_log_probs = _upcast(log_probs, rollout_log_probs)
    m = mask.to(log_probs.dtype)
    log_ratio = (log_probs - rollout_log_probs) * m
    if level == "sequence":
        log_ratio_level = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        mean = log_ratio.sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio_level = mean.expand_as(log_ratio)
    else:
        log_ratio_level = log_ratio
    ratio = torch.exp(torch.clamp(log_ratio_level, -20.0, 20.0))
    low = -float("inf") if lower is None else lower
    high = float("inf") if upper is None else upper
    inside = ((ratio >= low) & (ratio <= high)).to(m.dtype)
    keep = m
    if mode == "truncate":
        weights = ratio.clamp(min=lower, max=upper) * m
    elif mode == "mask":
        weights = ratio * inside * m
    else:  # reject
        keep = m * inside
        weights = keep
    count = m.sum()
    token_log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
    metrics = {
        "ratio_mean": (ratio * m).sum() / count,
        "ratio_min": ratio.masked_fill(m == 0, float("inf")).min(),
        "ratio_max": ratio.masked_fill(m == 0, -float("inf")).max(),
        "effective_sample_size": weights.sum() ** 2 / (count * (weights**2).sum()),
        "truncated_fraction": ((1 - inside) * m).sum() / count if mode == "truncate" else 0 * count,
        "masked_fraction": 0 * count if mode == "truncate" else ((1 - inside) * m).sum() / count,
        "kl_k1": (-token_log_ratio * m).sum() / count,
        "kl_k3": ((torch.exp(token_log_ratio) - 1 - token_log_ratio) * m).sum() / count,
        "chi_square": (ratio.square() * m).sum() / count - 1,
    }
    return weights, keep.bool(), metrics
