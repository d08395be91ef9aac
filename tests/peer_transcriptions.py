# ruff: noqa: E501  (verbatim peer code keeps its line lengths)
"""Verbatim test-only transcriptions of the peers that do not install from the index (issue 35).

Each function below is the peer's code at the path and commit named in its docstring, copied
as written (only what the tested branch needs; renamed where a name would clash, imports and
configuration objects replaced by plain arguments, both marked). They run in the parity tests
against the library on the same float64 tensors; verl and TRL run from their installed
packages instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# ------------------------------------------------------------------------------------------------
# SkyRL, NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265,
# skyrl/backends/skyrl_train/utils/ppo_utils.py, apply_loss_reduction_to_advantages_minibatch
# (the "token_mean" and "prompt_mean" branches, PR #1719) and reduce_loss.
# ------------------------------------------------------------------------------------------------


def skyrl_reduce_loss(loss: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    return (loss * loss_mask).sum() if loss_mask is not None else loss.sum()


def skyrl_apply_loss_reduction_to_advantages_minibatch(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_reduction: str,
    prompt_boundaries: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    normalized_advantages = torch.zeros_like(advantages)

    # Option 1: token mean
    if loss_reduction == "token_mean":
        normalized_advantages = advantages / loss_mask.sum().clamp(min=1)

    # Option 4: Prompt level mean - token mean within each prompt, then average over all prompts.
    elif loss_reduction == "prompt_mean":
        if prompt_boundaries is None:
            raise ValueError("`prompt_mean` loss reduction requires `prompt_boundaries`")
        num_prompts = len(prompt_boundaries)
        for p_start, p_end in prompt_boundaries:
            prompt_tokens = loss_mask[p_start:p_end].sum().clamp(min=1)
            normalized_advantages[p_start:p_end] = advantages[p_start:p_end] / (
                num_prompts * prompt_tokens
            )

    else:
        raise ValueError(f"Invalid loss reduction type: {loss_reduction}")

    return normalized_advantages


# ------------------------------------------------------------------------------------------------
# AReaL PR #1546 (open), EazyReal/AReaL @ 4e716aa25c2e75dee7f314687e65eaf05099eb85,
# areal/utils/functional/loss_aggregation.py: PromptMean and the helpers it calls.
# ------------------------------------------------------------------------------------------------

GroupSizes = Sequence[int]


def _resolve_masks(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    denominator_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if loss.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} must match loss shape {tuple(loss.shape)}."
        )
    if denominator_mask is not None and loss.shape != denominator_mask.shape:
        raise ValueError(
            f"denom_mask shape {tuple(denominator_mask.shape)} must match "
            f"loss shape {tuple(loss.shape)}."
        )
    numerator_mask = loss_mask.bool()
    return numerator_mask, (numerator_mask if denominator_mask is None else denominator_mask.bool())


def _sequence_sums(values: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Sum token values per sequence for padded or packed inputs."""
    if cu_seqlens is None:
        if values.ndim == 1:
            raise ValueError(
                "Sequence-based loss aggregation requires cu_seqlens for packed "
                "inputs; tree-packed training currently supports only token_mean."
            )
        if values.ndim != 2:
            raise ValueError(
                f"padded policy-gradient inputs must be 2D, got shape {tuple(values.shape)}."
            )
        return values.sum(dim=-1)

    if values.ndim != 1:
        raise ValueError(
            f"packed policy-gradient inputs must be 1D, got shape {tuple(values.shape)}."
        )
    if cu_seqlens.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1D, got shape {tuple(cu_seqlens.shape)}.")

    n_sequences = cu_seqlens.numel() - 1
    sequence_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=values.device, dtype=torch.long)
    sequence_ids = torch.arange(n_sequences, device=values.device).repeat_interleave(
        sequence_lengths, output_size=values.numel()
    )
    result = torch.zeros(n_sequences, dtype=values.dtype, device=values.device)
    return result.scatter_add_(0, sequence_ids, values)


def _sequence_loss_sums(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    denominator_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    numerator_mask, denominator_mask = _resolve_masks(loss, loss_mask, denominator_mask)
    # transcription: .to(torch.float32) dropped so that the float64 comparison stays float64
    masked_loss = torch.where(numerator_mask, loss, 0)
    return (
        _sequence_sums(masked_loss, cu_seqlens),
        _sequence_sums(denominator_mask.to(loss.dtype), cu_seqlens),
    )


def _prompt_ids(
    n_sequences: int, group_sizes: GroupSizes | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    if group_sizes is None:
        raise ValueError("group_sizes are required for loss_aggregation='prompt_mean'.")
    sizes = [int(size) for size in group_sizes]
    if any(size <= 0 for size in sizes):
        raise ValueError(f"group_sizes must be positive, got {sizes}.")
    if sum(sizes) != n_sequences:
        raise ValueError(f"group_sizes sum to {sum(sizes)} but sequence count is {n_sequences}.")
    return (
        torch.arange(len(sizes), device=device).repeat_interleave(
            torch.tensor(sizes, device=device), output_size=n_sequences
        ),
        len(sizes),
    )


def _prompt_sums(values: torch.Tensor, ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    result = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    return result.scatter_add_(0, ids, values)


def _reduce_unit_means(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    active = denominator > 0
    unit_means = torch.where(
        active,
        numerator / denominator.clamp_min(1),
        torch.zeros_like(numerator),
    )
    return unit_means.sum() / active.count_nonzero().clamp_min(1)


class AReaLPromptMean:
    """Average per-prompt token means; weight by active prompt group count."""

    def normalizer(
        self,
        loss_mask: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        group_sizes: GroupSizes | None = None,
    ) -> torch.Tensor:
        denominators = _sequence_sums(loss_mask.bool().to(torch.float32), cu_seqlens)
        ids, n_groups = _prompt_ids(denominators.numel(), group_sizes, loss_mask.device)
        return _prompt_sums(denominators, ids, n_groups).count_nonzero().to(torch.float32)

    def aggregate(
        self,
        loss: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        denominator_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        group_sizes: GroupSizes | None = None,
    ) -> torch.Tensor:
        numerators, denominators = _sequence_loss_sums(
            loss, loss_mask, denominator_mask, cu_seqlens
        )
        ids, n_groups = _prompt_ids(numerators.numel(), group_sizes, loss.device)
        return _reduce_unit_means(
            _prompt_sums(numerators, ids, n_groups),
            _prompt_sums(denominators, ids, n_groups),
        )


# ------------------------------------------------------------------------------------------------
# AReaL, areal-project/AReaL @ cbff54d645d2cd8ee1f1c358a82f3f473588433d,
# areal/trainer/ppo/lambda_fn.py, relative_position_gae_lambda (the context's
# "timestep_lengths" passed as ``lengths``).
# ------------------------------------------------------------------------------------------------


def areal_relative_position_gae_lambda(lengths: torch.Tensor, *, q: float) -> torch.Tensor:
    if (
        isinstance(q, bool)
        or not isinstance(q, int | float)
        or not math.isfinite(q)
        or not 0 < q <= 1
    ):
        raise ValueError(f"q must be a finite number in (0, 1], got {q!r}")

    decay_steps = (lengths - 1).clamp_min(1).to(dtype=torch.float32)
    step_lambdas = torch.exp(math.log(float(q)) / decay_steps)
    return torch.where(
        lengths > 1,
        step_lambdas,
        torch.where(
            lengths == 1,
            torch.ones_like(step_lambdas),
            torch.zeros_like(step_lambdas),
        ),
    )


# ------------------------------------------------------------------------------------------------
# prime-rl, PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64,
# src/prime_rl/orchestrator/algo/grpo.py, GRPOAlgorithm.score_group (one group; the traces'
# fields passed as tensors, the config's weights as numbers, the dtype an argument).
# ------------------------------------------------------------------------------------------------


@dataclass
class LinearLengthPenalty:
    num_output_tokens_weight: float = 0.25
    num_input_tokens_weight: float = 0.1
    num_turns_weight: float = 0.1


def prime_rl_score_group(
    reward: list[float],
    num_output_tokens: list[int],
    num_total_tokens: list[int],
    num_turns: list[int],
    length_penalty: LinearLengthPenalty | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    rewards = torch.tensor(reward, dtype=dtype)
    if length_penalty is None:
        advantages = rewards - rewards.mean()
    else:
        output = torch.tensor(num_output_tokens, dtype=rewards.dtype)
        total = torch.tensor(num_total_tokens, dtype=rewards.dtype)
        turns = torch.tensor(num_turns, dtype=rewards.dtype)
        input = total - output
        penalty_frac = (
            length_penalty.num_output_tokens_weight * (output / output.max().clamp(min=1))
            + length_penalty.num_input_tokens_weight * (input / input.max().clamp(min=1))
            + length_penalty.num_turns_weight * (turns / turns.max().clamp(min=1))
        )
        penalty = rewards.mean() * penalty_frac
        shaped_rewards = rewards - penalty
        advantages = shaped_rewards - shaped_rewards.mean()
    return advantages


# ------------------------------------------------------------------------------------------------
# AReaL, areal-project/AReaL @ cbff54d645d2cd8ee1f1c358a82f3f473588433d:
# areal/trainer/ppo/actor.py compute_prox_logp_approximations (the PROX_APPROX_METHOD_* constants
# of areal/utils/constants.py written as their string values); areal/utils/data.py KLEstimator;
# areal/utils/functional/functional.py _compute_sequence_level_ratio_and_advantages,
# RejectionSamplingResult, _check_bounds, apply_rejection_sampling,
# compute_binary_kl_divergence, ppo_actor_loss_fn. areal/api/cli_args.py RejectionSamplingConfig
# is replaced by a plain dataclass of its fields (its __post_init__ would reject binary_kl).
# ------------------------------------------------------------------------------------------------


@dataclass
class RejectionSamplingConfig:
    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None


def compute_prox_logp_approximations(
    old_logp: torch.Tensor,
    logprobs: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    method: str | None = None,
) -> dict[str, torch.Tensor]:
    """
    Compute approximation(s) for proximal policy log-probabilities.

    This function approximates the log-probabilities of the proximal policy (one training step
    behind the current policy) using version-aware interpolation between the behavior policy
    (old_logp) and current policy (logprobs). This avoids the need for an expensive forward pass
    to compute the proximal policy's log-probabilities explicitly.

    Args:
        old_logp: log_p_behave from the rollout (behavior policy)
        logprobs: log_p_theta from current training forward pass
        versions: per-token policy versions from rollout (v_behave for each token)
        current_version: current training step version (v_theta)
        method: If specified, only compute this method. If None, compute all methods.

    Returns:
        Dictionary with approximation results. Single key if method specified, all methods otherwise.
    """
    # Assume proximal version is current_version - 1 (last broadcast)
    # In AReaL, proximal policy is the last updated/broadcast policy version
    v_proximal = current_version - 1

    # Extract version information
    v_behave = versions.float()
    v_theta = float(current_version)

    # CRITICAL: Only approximate generated tokens (version >= 0)
    # Prompt tokens (version < 0) must NOT be approximated - they have no generation version
    generated_tokens_mask = versions >= 0

    # Compute interpolation factor alpha
    # When v_behave == v_proximal: alpha=0 (use old_logp)
    # When v_behave == v_theta: alpha=1 (use logprobs)
    # For prompt tokens (version < 0): alpha=0 (no interpolation)
    version_diff = v_theta - v_behave
    version_gap = v_proximal - v_behave
    # Avoid division by zero AND exclude prompt tokens
    alpha = torch.where(
        (version_diff > 0) & generated_tokens_mask,
        version_gap / version_diff,
        torch.zeros_like(v_behave),
    )
    alpha = torch.clamp(alpha, 0.0, 1.0)

    approximations = {}

    # If method is specified, only compute that one
    # Otherwise compute all methods (for metrics comparison)
    methods_to_compute = [method] if method else ["loglinear", "linear", "rollout"]

    for m in methods_to_compute:
        if m == "loglinear":
            # Method 1: Log-linear interpolation in log-space (geometric mean in probability space)
            # log(p_prox) = (1-α)·log(p_behave) + α·log(p_theta)
            approximations["loglinear"] = old_logp + alpha * (logprobs - old_logp)

        elif m == "linear":
            # Method 2: Linear interpolation in probability space (arithmetic mean)
            # p_prox = (1-α)·p_behave + α·p_theta
            # Then convert back to log space: log(p_prox)
            p_behave = torch.exp(old_logp)
            p_theta = torch.exp(logprobs)
            p_arithmetic = (1 - alpha) * p_behave + alpha * p_theta
            approximations["linear"] = torch.log(p_arithmetic + 1e-10)

        elif m == "rollout":
            # Method 3: Use behavior policy from rollout as-is (no approximation)
            # p_prox = p_behave
            # Used for metrics comparison
            approximations["rollout"] = old_logp.clone()

    return approximations


class KLEstimator:
    """
    KL divergence estimator, supports k1, k2 and k3.
    """

    def __init__(self, kl_estimator: str = "k1", apply_clamp: bool = True):
        self.kl_estimator = kl_estimator
        if kl_estimator not in ["k1", "k2", "k3"]:
            raise ValueError(f"Invalid KL estimator: {kl_estimator}. Valid choices: k1, k2, k3")
        self.apply_clamp = apply_clamp

    def __call__(self, log_probs: torch.Tensor, log_probs_base: torch.Tensor) -> torch.Tensor:
        return self._compute_approx_kl(
            log_probs, log_probs_base, self.kl_estimator, self.apply_clamp
        )

    # adapted from https://github.com/OpenRLHF/OpenRLHF/blob/main/openrlhf/models/utils.py#L7
    @staticmethod
    def _compute_approx_kl(
        log_probs: torch.Tensor,
        log_probs_base: torch.Tensor,
        kl_estimator: str = "k1",
        apply_clamp: bool = True,
    ) -> torch.Tensor:
        """
        Compute the approximate KL divergence between two distributions.
        Schulman blog: http://joschu.net/blog/kl-approx.html

        Args:
            log_probs: Log probabilities of the new distribution.
            log_probs_base: Log probabilities of the base distribution.
        """

        if kl_estimator == "k1":
            log_ratio = log_probs.float() - log_probs_base.float()

        # The k2 estimator is the non negative kl approximation in
        # http://joschu.net/blog/kl-approx.html
        # The k2_loss is approximately equivalent to the
        # one-step KL divergence penalty with the k1 estimator
        # used in https://arxiv.org/pdf/2310.10505.
        if kl_estimator == "k2":
            log_ratio = log_probs.float() - log_probs_base.float()
            log_ratio = log_ratio**2 / 2.0

        # The k3 estimator is the non negative kl approximation in
        # http://joschu.net/blog/kl-approx.html
        if kl_estimator == "k3":
            log_ratio = log_probs.float() - log_probs_base.float()
            log_ratio = -log_ratio
            log_ratio = log_ratio.exp() - 1 - log_ratio

        if apply_clamp:
            log_ratio = log_ratio.clamp(min=-10, max=10)
        return log_ratio


def _compute_sequence_level_ratio_and_advantages(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute sequence-level geometric mean ratios and average advantages per sequence (GSPO).

    Args:
        log_ratio: Log of probability ratios (logprobs - proximal_logprobs)
        advantages: Per-token advantages
        loss_mask: Boolean mask indicating valid tokens
        cu_seqlens: Cumulative sequence lengths. Required for 1D tensors (packed format).
            Shape: [batch_size + 1], where cu_seqlens[i] marks the start of sequence i.
            For a single sequence, use cu_seqlens=torch.tensor([0, seq_len]).

    Returns:
        ratio: Sequence-level importance sampling ratios (broadcast to all tokens)
        advantages: Sequence-averaged advantages (broadcast to all tokens)
            Note: We use mean instead of sum to keep gradient magnitude independent
            of sequence length. When multiplied by ratio and summed over tokens,
            this gives the correct total gradient contribution per sequence.
    """
    # Handle both 1D (packed) and 2D (padded) tensor shapes
    if log_ratio.ndim == 1:
        # For 1D tensors (packed format), cu_seqlens is required
        if cu_seqlens is None:
            raise ValueError(
                "cu_seqlens is required for 1D tensors (packed format). "
                "In AReaL, 1D tensors are produced by pack_tensor_dict() and always have cu_seqlens. "
                "For a single sequence, use cu_seqlens=torch.tensor([0, seq_len], dtype=torch.int32)."
            )

        # Packed sequences: use cu_seqlens boundaries
        batch_size = cu_seqlens.shape[0] - 1
        seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        # Create sequence index for each token: [0,0,0,1,1,2,2,2,2,...]
        sequence_idx = torch.arange(batch_size, device=log_ratio.device).repeat_interleave(
            seq_lengths
        )

        # Use scatter_add for vectorized summation per sequence (faster than Python loop)
        masked_log_ratio = torch.where(loss_mask, log_ratio, 0.0)
        log_ratio_sum_per_seq = torch.zeros(
            batch_size, device=log_ratio.device, dtype=log_ratio.dtype
        ).scatter_add_(0, sequence_idx, masked_log_ratio)

        masked_advantages = torch.where(loss_mask, advantages, 0.0)
        advantages_sum_per_seq = torch.zeros(
            batch_size, device=advantages.device, dtype=advantages.dtype
        ).scatter_add_(0, sequence_idx, masked_advantages)

        valid_count_per_seq = (
            torch.zeros(batch_size, device=loss_mask.device, dtype=torch.int32)
            .scatter_add_(0, sequence_idx, loss_mask.int())
            .clamp(min=1)
        )

        # Compute sequence-level means
        log_ratio_mean_per_seq = log_ratio_sum_per_seq / valid_count_per_seq.to(log_ratio.dtype)
        adv_mean_per_seq = advantages_sum_per_seq / valid_count_per_seq.to(advantages.dtype)

        # Broadcast sequence-level values back to token-level
        ratio = torch.exp(log_ratio_mean_per_seq)[sequence_idx]
        ratio = torch.where(loss_mask, ratio, 0.0)

        advantages = adv_mean_per_seq[sequence_idx]
        advantages = torch.where(loss_mask, advantages, 0.0)
    else:
        # For 2D tensors (padded sequences)
        # Input shape: [batch_size, seq_len]
        # Compute mean log ratio over sequence length for each sample
        seq_log_ratio_mean = torch.where(loss_mask, log_ratio, 0.0).sum(dim=1) / (
            loss_mask.sum(dim=1).clamp(min=1)
        )
        # Broadcast back to original shape: each sequence gets its own geometric mean ratio
        ratio = torch.exp(seq_log_ratio_mean.unsqueeze(1).expand_as(log_ratio))
        # Apply mask
        ratio = torch.where(loss_mask, ratio, 0.0)

        # Average token advantages per sequence
        # This ensures gradient magnitude is independent of sequence length
        seq_lengths = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        masked_advantages = torch.where(loss_mask, advantages, 0.0)
        advantages = (masked_advantages.sum(dim=-1, keepdim=True) / seq_lengths).expand_as(
            log_ratio
        )
        advantages = torch.where(loss_mask, advantages, 0.0)

    return ratio, advantages


@dataclass
class RejectionSamplingResult:
    """Result of rejection sampling, used by ppo_actor_loss_fn.

    Attributes:
        loss_mask: Updated loss mask (mask mode) or original loss mask (clamp mode).
        behave_imp_weight: Importance weight (clamped in clamp mode, raw in mask mode).
        filtered_fraction: Fraction of valid tokens that were filtered/clamped (for logging).
    """

    loss_mask: torch.Tensor
    behave_imp_weight: torch.Tensor
    filtered_fraction: float


def _check_bounds(metric: torch.Tensor, config: RejectionSamplingConfig) -> torch.Tensor:
    """Check if metric values are within configured bounds.

    Args:
        metric: Per-token or per-sequence metric values.
        config: Rejection sampling configuration with upper and optional lower bounds.

    Returns:
        Boolean tensor, True where metric is within bounds.
    """
    if config.lower is not None:
        return (metric >= config.lower) & (metric <= config.upper)
    else:
        return metric <= config.upper


def apply_rejection_sampling(
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    config: RejectionSamplingConfig,
) -> RejectionSamplingResult:
    """Apply rejection sampling based on divergence between proximal and behavior policy.

    Supports two action modes:
    - 'mask': zero out loss_mask for tokens/sequences exceeding threshold (rejection)
    - 'clamp': clamp importance weight to bounds for tokens/sequences exceeding
      threshold (truncation, tokens still participate in gradient)

    Args:
        proximal_logprobs: Proximal policy log-probabilities,
            shape [batch, seq_len] (2D padded) or [total_tokens] (1D packed).
        old_logprobs: Behavior policy log-probabilities from inference engine,
            same shape as proximal_logprobs.
        loss_mask: Original loss mask (1 for valid tokens), same shape as proximal_logprobs.
        cu_seqlens: Cumulative sequence lengths for 1D packed format. Shape: [batch_size + 1].
            Required when inputs are 1D. None for 2D padded inputs.
        config: Configuration for rejection sampling.

    Returns:
        RejectionSamplingResult with updated loss_mask, behave_imp_weight, and filtered_fraction.
    """
    # Step 0: Validate input shapes.
    if proximal_logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"proximal_logprobs shape {proximal_logprobs.shape} != "
            f"old_logprobs shape {old_logprobs.shape}"
        )
    if proximal_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"proximal_logprobs shape {proximal_logprobs.shape} != "
            f"loss_mask shape {loss_mask.shape}"
        )
    if proximal_logprobs.ndim not in (1, 2):
        raise ValueError(
            f"Expected 1D (packed) or 2D (padded) tensors, got ndim={proximal_logprobs.ndim}"
        )

    # Step 1: Compute log ratio = log(π_proximal / π_behave)
    # Upcast operands to fp32 before subtraction to avoid precision loss in bf16/fp16.
    log_ratio = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    # Sanitize non-finite values (e.g. -inf - (-inf) = NaN) to prevent NaN propagation.
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)

    # Step 2: Compute metric value (reuse existing KLEstimator sign conventions)
    if config.metric == "ratio":
        # Direct ratio π_proximal / π_behave
        metric = torch.exp(log_ratio)
    elif config.metric in ("kl_k1", "kl_k2", "kl_k3"):
        # Use existing KLEstimator (note: _compute_approx_kl takes log_probs, log_probs_base)
        estimator_name = config.metric.replace("kl_", "")  # "k1", "k2", "k3"
        metric = KLEstimator._compute_approx_kl(
            log_probs=proximal_logprobs.detach(),
            log_probs_base=old_logprobs.detach(),
            kl_estimator=estimator_name,
            apply_clamp=False,  # Don't clamp; threshold check handles bounds
        )
    elif config.metric == "binary_kl":
        # Bidirectional binary KL divergence (KPop): mask tokens where
        # KL(proximal || behave) > upper OR KL(behave || proximal) > upper.
        kl_fwd = compute_binary_kl_divergence(proximal_logprobs.detach(), old_logprobs.detach())
        kl_rev = compute_binary_kl_divergence(old_logprobs.detach(), proximal_logprobs.detach())
        # Use max of forward and reverse as the metric; upper bound applies to both.
        metric = torch.maximum(kl_fwd, kl_rev)
    else:
        raise ValueError(f"Unknown metric: {config.metric}")

    # Step 3: Compute behave_imp_weight (needed for both modes)
    behave_imp_weight = torch.exp(log_ratio)
    # Save original weight before any clamping, to compute clamped fraction later.
    original_weight = behave_imp_weight

    # Step 4: Aggregate and filter
    #
    # For ratio metric, aggregate in log space (geometric mean) to match GSPO
    # semantics and avoid the "length trap" where arithmetic mean inflates
    # sequence-level ratios. For KL metrics, aggregate in metric space
    # (arithmetic) since KL divergence is additive.
    _use_log_agg = config.metric == "ratio"

    if config.level == "sequence":
        # Pre-compute sequence indexing (shared by filtering and weight broadcast).
        if loss_mask.ndim == 1:
            # 1D packed format: use cu_seqlens
            if cu_seqlens is None:
                raise ValueError(
                    "cu_seqlens is required for 1D packed tensors in sequence-level filtering."
                )
            batch_size = cu_seqlens.shape[0] - 1
            seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            sequence_idx = torch.arange(batch_size, device=metric.device).repeat_interleave(
                seq_lengths
            )

            # For ratio metric: aggregate log_ratio (geometric); else: aggregate metric (arithmetic).
            agg_values = log_ratio if _use_log_agg else metric
            masked_agg = torch.where(loss_mask.bool(), agg_values, 0.0)
            valid_count_per_seq = (
                torch.zeros(batch_size, device=loss_mask.device, dtype=torch.int32)
                .scatter_add_(0, sequence_idx, loss_mask.int())
                .clamp(min=1)
            )

            # Ratio metric + sequence level: use geometric mean as uniform weight
            # for all tokens (matches old sequence_mask/sequence_truncate semantics).
            if _use_log_agg:
                # masked_agg is already log_ratio masked by loss_mask (computed above).
                seq_log_sum = torch.zeros(
                    batch_size, device=log_ratio.device, dtype=log_ratio.dtype
                ).scatter_add_(0, sequence_idx, masked_agg)
                seq_log_mean = seq_log_sum / valid_count_per_seq.to(log_ratio.dtype)
                behave_imp_weight = torch.exp(seq_log_mean)[sequence_idx]
                original_weight = behave_imp_weight

            if config.agg == "sum":
                seq_agg = torch.zeros(
                    batch_size, device=metric.device, dtype=agg_values.dtype
                ).scatter_add_(0, sequence_idx, masked_agg)
            elif config.agg == "mean":
                seq_agg_sum = torch.zeros(
                    batch_size, device=metric.device, dtype=agg_values.dtype
                ).scatter_add_(0, sequence_idx, masked_agg)
                seq_agg = seq_agg_sum / valid_count_per_seq.to(agg_values.dtype)
            elif config.agg == "max":
                agg_for_max = agg_values.masked_fill(~loss_mask.bool(), float("-inf"))
                seq_agg = torch.full(
                    (batch_size,),
                    float("-inf"),
                    device=metric.device,
                    dtype=agg_values.dtype,
                ).scatter_reduce_(0, sequence_idx, agg_for_max, reduce="amax")
                # All-masked sequences stay -inf; treat them as in-bounds (no valid
                # tokens to filter, and their loss_mask is already all-zero).
                # Recompute from raw counts to detect true zero.
                raw_valid = torch.zeros(
                    batch_size, device=loss_mask.device, dtype=torch.int32
                ).scatter_add_(0, sequence_idx, loss_mask.int())
                all_masked = raw_valid == 0
                seq_agg = torch.where(all_masked, torch.zeros_like(seq_agg), seq_agg)
            else:
                raise ValueError(f"Unknown agg method: {config.agg}")

            # Convert back to metric space for threshold comparison.
            seq_metric = torch.exp(seq_agg) if _use_log_agg else seq_agg

            # Check each sequence against bounds
            in_bounds_per_seq = _check_bounds(seq_metric, config)

            if config.action == "mask":
                # Broadcast back to token level, filter entire sequence
                in_bounds = in_bounds_per_seq[sequence_idx]
            else:
                # clamp mode: clamp tokens in out-of-bounds sequences
                out_of_bounds = (~in_bounds_per_seq)[sequence_idx]
                behave_imp_weight = torch.where(
                    out_of_bounds,
                    behave_imp_weight.clamp(
                        min=config.lower if config.lower is not None else 0.0,
                        max=config.upper,
                    ),
                    behave_imp_weight,
                )
        else:
            # 2D padded format
            agg_values = log_ratio if _use_log_agg else metric
            masked_agg = torch.where(loss_mask.bool(), agg_values, 0.0)
            valid_count = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)

            # Ratio metric + sequence level: geometric mean as uniform weight.
            if _use_log_agg:
                seq_log_mean = masked_agg.sum(dim=-1, keepdim=True) / valid_count
                behave_imp_weight = torch.exp(seq_log_mean).expand_as(log_ratio)
                original_weight = behave_imp_weight

            if config.agg == "sum":
                seq_agg = masked_agg.sum(dim=-1, keepdim=True)
            elif config.agg == "mean":
                seq_agg = masked_agg.sum(dim=-1, keepdim=True) / valid_count
            elif config.agg == "max":
                agg_for_max = agg_values.masked_fill(~loss_mask.bool(), float("-inf"))
                seq_agg = agg_for_max.max(dim=-1, keepdim=True)[0]
                # All-masked sequences stay -inf; treat them as in-bounds (no valid
                # tokens to filter, and their loss_mask is already all-zero).
                all_masked = loss_mask.sum(dim=-1, keepdim=True) == 0
                seq_agg = torch.where(all_masked, torch.zeros_like(seq_agg), seq_agg)
            else:
                raise ValueError(f"Unknown agg method: {config.agg}")

            # Convert back to metric space for threshold comparison.
            seq_metric = torch.exp(seq_agg) if _use_log_agg else seq_agg

            if config.action == "mask":
                in_bounds = _check_bounds(seq_metric, config).expand_as(loss_mask)
            else:
                # clamp mode: clamp tokens in out-of-bounds sequences
                out_of_bounds = (~_check_bounds(seq_metric, config)).expand_as(loss_mask)
                behave_imp_weight = torch.where(
                    out_of_bounds,
                    behave_imp_weight.clamp(
                        min=config.lower if config.lower is not None else 0.0,
                        max=config.upper,
                    ),
                    behave_imp_weight,
                )
    else:
        # Token level
        if config.action == "mask":
            in_bounds = _check_bounds(metric, config)
        else:
            # clamp mode: directly clamp importance weight
            behave_imp_weight = behave_imp_weight.clamp(
                min=config.lower if config.lower is not None else 0.0,
                max=config.upper,
            )

    # Step 5: Update loss_mask or keep it based on action mode
    if config.action == "mask":
        candidates = loss_mask.bool()
        updated_mask = (candidates & in_bounds).to(loss_mask.dtype)
        filtered_count = (candidates & ~in_bounds).sum().item()
        total_count = candidates.sum().item()
        filtered_fraction = filtered_count / max(total_count, 1)
    else:
        # clamp mode: loss_mask unchanged
        updated_mask = loss_mask
        # Report fraction of clamped tokens (for logging)
        clamped_count = (loss_mask.bool() & (original_weight != behave_imp_weight)).sum().item()
        total_count = loss_mask.bool().sum().item()
        filtered_fraction = clamped_count / max(total_count, 1)

    # Apply loss_mask to behave_imp_weight
    behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)

    return RejectionSamplingResult(
        loss_mask=updated_mask,
        behave_imp_weight=behave_imp_weight,
        filtered_fraction=filtered_fraction,
    )


def compute_binary_kl_divergence(
    log_p: torch.Tensor, log_q: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """KL(P||Q) for Bernoulli distributions parameterized by log-probabilities.
    Treats each element as a Bernoulli: P = [p, 1-p], Q = [q, 1-q].
    KL(P||Q) = p*log(p/q) + (1-p)*log((1-p)/(1-q))
    """
    p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO actor loss function with optional rejection sampling.

    The ``rejection_sampling`` parameter replaces the removed
    ``behave_imp_weight_cap`` / ``behave_imp_weight_mode``.

    - ``action='mask'``: modifies loss_mask before loss computation (rejection)
    - ``action='clamp'``: clamps importance weight to bounds (truncation)

    When decoupled loss is disabled:
    1. if recompute logp, both old_logprobs and proximal_logprobs are recomputed logp;
    2. if no recomputation, both old_logp and proximal_logprobs are produced by the inference backend.

    When decoupled loss is enabled, proximal_logprobs is the recomputed logp,
    old_logprobs is produced by the inference engine.

    Note: ``importance_sampling_level`` controls PPO ratio (π_θ/π_proximal)
    aggregation (GSPO), which is orthogonal to ``rejection_sampling.level``
    that controls staleness filtering (π_proximal/π_behave) granularity.

    Args:
        logprobs: Current policy log-probabilities (π_θ).
        proximal_logprobs: Proximal policy log-probabilities (π_proximal).
        old_logprobs: Behavior policy log-probabilities from inference (π_behave).
        advantages: Per-token advantage estimates.
        eps_clip: PPO clipping factor for policy ratio.
        loss_mask: Mask for valid tokens (1 = valid).
        eps_clip_higher: Upper clipping factor (decoupled clipping). None = use eps_clip.
        c_clip: Dual clipping factor, must be > 1.0. None disables dual clipping.
        rejection_sampling: Rejection sampling configuration. None disables filtering.
        importance_sampling_level: Level at which to compute importance sampling ratios.
            - 'token': Per-token ratios (standard PPO)
            - 'sequence': Sequence-level geometric mean of per-token ratios (GSPO)
        cu_seqlens: Cumulative sequence lengths for packed sequences (1D tensors).
            Required when inputs are 1D and importance_sampling_level='sequence'.
            Shape: [batch_size + 1], where cu_seqlens[i] marks the start of sequence i.
            Not needed for 2D padded inputs (sequences identified by batch dimension).
    """
    # Save original count BEFORE rejection sampling may modify loss_mask.
    # This keeps the denominator consistent with loss_weight_fn in actor.py,
    # which always uses the original loss_mask from input_data. Without this,
    # mask mode would inflate per-token gradients by N_original / N_kept.
    loss_mask_count = loss_mask.count_nonzero() or 1
    # Pre-filter mask kept for ratio/clip statistics: rejection sampling below
    # narrows loss_mask for the loss, but stats stay on the original mask so
    # importance_weight/avg reads 1.0 under proximal reuse instead of
    # 1 - filtered_fraction. Gradients are unaffected: the final loss still
    # zeroes filtered tokens through the narrowed mask.
    stat_loss_mask = loss_mask

    # === Apply rejection sampling (replaces old compute_behave_imp_weight) ===
    if rejection_sampling is not None:
        rs_result = apply_rejection_sampling(
            proximal_logprobs=proximal_logprobs,
            old_logprobs=old_logprobs,
            loss_mask=loss_mask,
            cu_seqlens=cu_seqlens,
            config=rejection_sampling,
        )
        # mask mode updates loss_mask; clamp mode keeps it unchanged
        loss_mask = rs_result.loss_mask
        behave_imp_weight = rs_result.behave_imp_weight
        filtered_fraction = rs_result.filtered_fraction
    else:
        filtered_fraction = 0.0

    if importance_sampling_level == "sequence":
        # GSPO: Compute sequence-level geometric mean of probability ratios
        log_ratio = logprobs - proximal_logprobs
        ratio, advantages = _compute_sequence_level_ratio_and_advantages(
            log_ratio, advantages, loss_mask, cu_seqlens
        )
    elif importance_sampling_level == "token":
        # Standard PPO: per-token ratio
        ratio = torch.where(stat_loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    else:
        raise ValueError(
            f"Invalid importance_sampling_level: {importance_sampling_level}. "
            "Must be 'token' or 'sequence'."
        )

    clipped_ratio = torch.clamp(
        ratio,
        1.0 - eps_clip,
        1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher),
    )

    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    clip_mask = pg_loss1.detach() < pg_loss2.detach()
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        assert c_clip > 1.0, c_clip
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        dual_clip_mask = pg_loss3.detach() < pg_loss.detach()
        pg_loss = torch.min(pg_loss, pg_loss3)
    else:
        dual_clip_mask = torch.zeros_like(clip_mask)

    # Apply behavioural importance weight from rejection sampling
    if rejection_sampling is not None:
        behave_approx_kl = proximal_logprobs.detach() - old_logprobs.detach()
        behave_mask = (behave_imp_weight > 0).logical_and(loss_mask.bool())
        behave_approx_kl = torch.where(behave_mask, behave_approx_kl, 0.0)
        pg_loss = pg_loss * behave_imp_weight

    logging_loss = pg_loss.detach()
    pg_loss = torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count
    clip_mask.logical_and_(stat_loss_mask)
    dual_clip_mask.logical_and_(stat_loss_mask)
    # One host sync per microbatch: the count feeds three derived stats.
    n_stat_total = stat_loss_mask.numel()
    n_stat_valid = stat_loss_mask.count_nonzero().item()
    stat = dict(
        loss=logging_loss,
        importance_weight=ratio.detach(),
        approx_kl=(logprobs - proximal_logprobs).detach(),
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
        n_total_tokens=float(n_stat_total),
        n_valid_tokens=float(n_stat_valid),
        n_masked_tokens=float(n_stat_total - n_stat_valid),
        masked_token_ratio=1.0 - n_stat_valid / max(n_stat_total, 1),
    )

    if rejection_sampling is not None:
        stat.update(
            behave_approx_kl=behave_approx_kl.detach(),
            behave_imp_weight=behave_imp_weight.detach(),
            behave_mask=behave_mask,
            filtered_fraction=filtered_fraction,
        )
    return pg_loss, stat


# ------------------------------------------------------------------------------------------------
# prime-rl, PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64,
# src/prime_rl/trainer/rl/loss.py: LossInputs, LossOutputs, _safe_mean,
# compute_importance_ratio_and_mismatch_kl, ipo_loss_fn (the jaxtyping annotations written as
# plain Tensor); packages/prime-rl-configs/src/prime_rl/configs/trainer.py IPOLossConfig is
# replaced by a plain dataclass of its fields and defaults.
# ------------------------------------------------------------------------------------------------


@dataclass
class IPOLossConfig:  # replaced: pydantic BaseConfig with Field(..., ge=0) validators
    ipo_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass
class LossInputs:
    """Inputs for computing loss on a single sample."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor | None = None


@dataclass
class LossOutputs:
    """Outputs from computing loss on a single sample."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _safe_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over a boolean mask; returns 0 when mask is empty."""
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def compute_importance_ratio_and_mismatch_kl(
    trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


# fmt: off
def ipo_loss_fn(inputs: LossInputs, loss_config: IPOLossConfig) -> LossOutputs:
    """IPO loss type: a symmetric trust region (mask tokens whose probability
    moved more than ``ipo_threshold`` in absolute terms), policy gradient via
    the importance ratio, and a squared-log-ratio KL regularizer."""
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))

    is_masked = abs_probs_diff > loss_config.ipo_threshold
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),  # all trainable, masked tokens
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),  # all trainable, unmasked tokens
        "is_masked": _safe_mean(is_masked, loss_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)
# fmt: on


# ------------------------------------------------------------------------------------------------
# ROLL, alibaba/ROLL @ 8eb27cc2dc34c4d1310b169d9b86d339004d811a,
# roll/pipeline/rlvr/actor_pg_worker.py, ActorPGWorker._compute_topr_loss (a function: the
# worker's config cache read as the arguments positive_weight / negative_weight, data.batch['scores']
# as scores; the first-call logging and the metrics cache left out, the metrics returned), and
# the ratio of ActorPGWorker.loss_func.
# ------------------------------------------------------------------------------------------------


def roll_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    ratio = (log_probs - old_log_probs).exp()  # ActorPGWorker.loss_func
    return ratio


# fmt: off
def roll_compute_topr_loss(ratio: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                           advantages: torch.Tensor, scores: torch.Tensor,
                           positive_weight: float = 1.0, negative_weight: float = 1.0):  # replaced: data, self._get_or_cache_config
    positive_mask = (scores > 0).float()
    negative_mask = (scores <= 0).float()

    # 计算损失组件
    positive_token_mask = positive_mask.unsqueeze(-1)
    negative_token_mask = negative_mask.unsqueeze(-1)

    positive_loss = - advantages * log_probs * positive_token_mask

    # 负样本: TIS更新，使用clipped importance sampling ratio
    # 梯度是: -[π(τ)/μ(τ)]_0^1 * R(τ) * ∇log π(τ)
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    negative_loss = - clipped_ratio * advantages * log_probs * negative_token_mask

    weighted_positive_loss = positive_weight * positive_loss
    weighted_negative_loss = negative_weight * negative_loss

    topr_loss = weighted_positive_loss + weighted_negative_loss

    # 缓存TOPR相关指标
    negative_lower_clipped = ((ratio < 0.0) & (negative_token_mask > 0)).float()
    negative_upper_clipped = ((ratio > 1.0) & (negative_token_mask > 0)).float()
    negative_total_clipped = negative_lower_clipped + negative_upper_clipped
    metrics = {  # replaced: self._cached_metrics.update({...}) (the clip fractions)
        "topr_negative_lower_clipped": negative_lower_clipped,
        "topr_negative_upper_clipped": negative_upper_clipped,
        "topr_negative_total_clipped": negative_total_clipped,
    }

    return topr_loss, metrics
# fmt: on


# ------------------------------------------------------------------------------------------------
# ms-swift, modelscope/ms-swift @ 3602360a562313afbf2ef6065fdf61f271a2c5b9 (4.6.0.dev0),
# swift/rlhf_trainers/grpo_trainer.py, GRPOTrainer._compute_loss_and_metrics: the log-ratio and
# the loss_type == 'real' branch of the loss (self.num_generations / self.real_tau as
# arguments; the beta KL term left out).
# ------------------------------------------------------------------------------------------------


# fmt: off
def swift_real_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor,
                    advantages: torch.Tensor, completion_mask: torch.Tensor,
                    num_generations: int, real_tau: float) -> torch.Tensor:  # replaced: self
    log_ratio = per_token_logps - old_per_token_logps
    global_scores = (log_ratio * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)

    group_scores = global_scores.view(-1, num_generations)
    # advantages is per-token [B, T] (constant across tokens without a teacher); reduce
    # to a per-sequence scalar for the group pos/neg split.
    seq_advantages = (advantages * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
    group_rewards = seq_advantages.view(-1, num_generations)

    pos_mask = (group_rewards > 0)
    neg_mask = (group_rewards <= 0)
    valid_mask = (pos_mask.sum(dim=1) != 0) & (neg_mask.sum(dim=1) != 0)

    if not valid_mask.any():
        loss = torch.tensor(0., device=global_scores.device) * global_scores.mean()
    else:
        batch_scores = group_scores[valid_mask]
        batch_pos_mask = pos_mask[valid_mask]
        batch_neg_mask = neg_mask[valid_mask]

        scaled_scores = batch_scores / real_tau
        zeros = torch.zeros(batch_scores.size(0), 1, device=batch_scores.device, dtype=batch_scores.dtype)

        # Negative Loss: log(1 + sum(e^{S_neg}))
        neg_input = scaled_scores.masked_fill(~batch_neg_mask, float('-inf'))
        neg_loss = torch.logsumexp(torch.cat([neg_input, zeros], dim=1), dim=1)

        # Positive Loss: log(1 + sum(e^{-S_pos}))
        pos_input = (-scaled_scores).masked_fill(~batch_pos_mask, float('-inf'))
        pos_loss = torch.logsumexp(torch.cat([pos_input, zeros], dim=1), dim=1)

        loss = (neg_loss + pos_loss).sum() / group_rewards.size(0)
    return loss
# fmt: on


# ------------------------------------------------------------------------------------------------
# ms-swift, modelscope/ms-swift @ 3602360a562313afbf2ef6065fdf61f271a2c5b9 (4.6.0.dev0),
# swift/rlhf_trainers/grpo_trainer.py: GRPOTrainer._compute_fipo_influence (self.args.delta,
# self.fipo_gamma, self.fipo_clip_range, self.fipo_clip_high_only, self.fipo_safety_threshold
# as arguments) and the loss_type == 'fipo' lines of _compute_loss_and_metrics (token-level
# importance sampling, no entropy mask, KL or rollout weights; num_items_in_batch /
# num_processes as the normaliser argument).
# ------------------------------------------------------------------------------------------------


# fmt: off
def swift_compute_fipo_influence(log_ratio: torch.Tensor, coef_1: torch.Tensor, advantages: torch.Tensor,
                                 completion_mask: torch.Tensor, delta: float | None, fipo_gamma: float,
                                 fipo_clip_range: float | None, fipo_clip_high_only: bool,
                                 fipo_safety_threshold: float | None):  # replaced: self
    """Compute FIPO token-level influence weight from Future-KL divergence."""
    future_kl_delta = log_ratio.masked_fill(~completion_mask, 0.0)

    # Dual-Clip participation mask: high-ratio tokens do not contribute to Future-KL.
    if delta is not None:
        delta = torch.as_tensor(delta, dtype=log_ratio.dtype, device=log_ratio.device)
        high_ratio_mask = coef_1 > delta
        future_kl_delta = torch.where(high_ratio_mask, torch.zeros_like(future_kl_delta), future_kl_delta)

    seq_len = future_kl_delta.shape[1]
    future_kl = torch.zeros_like(future_kl_delta)
    positions = torch.arange(seq_len, device=log_ratio.device).unsqueeze(1)
    gamma = torch.as_tensor(fipo_gamma, dtype=log_ratio.dtype, device=log_ratio.device)
    chunk_size = 128
    for chunk_start in range(0, seq_len, chunk_size):
        chunk_end = min(seq_len, chunk_start + chunk_size)
        chunk_positions = torch.arange(chunk_start, chunk_end, device=log_ratio.device).unsqueeze(0)
        distance = chunk_positions - positions
        future_mask = distance >= 0
        decay_block = torch.pow(gamma, distance.clamp(min=0)) * future_mask.to(log_ratio.dtype)
        future_kl += torch.matmul(future_kl_delta[:, chunk_start:chunk_end], decay_block.t())
    future_kl = future_kl.masked_fill(~completion_mask, 0.0)

    influence_weight = torch.exp(future_kl)

    if fipo_clip_range:
        high = 1 + fipo_clip_range
        low = 1.0 if fipo_clip_high_only else 1 - fipo_clip_range
        influence_weight = torch.clamp(influence_weight, min=low, max=high)
    influence_weight = influence_weight.detach()

    # avoid amplifying negative-advantage tokens with very high IS ratios.
    safety_mask = torch.ones_like(completion_mask, dtype=torch.bool)
    if fipo_safety_threshold is not None:
        negative_advantage = advantages < 0
        high_is_ratio = coef_1 > fipo_safety_threshold
        safety_mask = ~(negative_advantage & high_is_ratio)
        influence_weight = torch.where(safety_mask, influence_weight,
                                       torch.clamp(influence_weight, min=0.8, max=1.0))

    metrics = {
        'future_kl': future_kl,
        'influence_weight': influence_weight,
        'safety_mask': safety_mask,
    }
    return influence_weight, metrics


def swift_fipo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor,
                    advantages: torch.Tensor, completion_mask: torch.Tensor, epsilon_low: float,
                    epsilon_high: float, delta: float | None, fipo_decay_rate: float,
                    fipo_clip_range: float | None, fipo_clip_high_only: bool,
                    fipo_safety_threshold: float | None, normalizer: float):  # replaced: self, grpo_batch
    fipo_gamma = 2**(-1 / fipo_decay_rate)  # GRPOTrainer.__init__
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = log_ratio
    coef_1 = torch.exp(log_importance_weights)
    fipo_weight, fipo_metrics = swift_compute_fipo_influence(
        log_ratio, coef_1, advantages, completion_mask, delta, fipo_gamma, fipo_clip_range,
        fipo_clip_high_only, fipo_safety_threshold)

    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)

    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    per_token_loss = per_token_loss * fipo_weight
    loss = (per_token_loss * completion_mask).sum() / normalizer
    return loss, fipo_metrics
# fmt: on


__all__ = [
    "AReaLPromptMean",
    "IPOLossConfig",
    "LossInputs",
    "KLEstimator",
    "RejectionSamplingConfig",
    "apply_rejection_sampling",
    "compute_prox_logp_approximations",
    "ppo_actor_loss_fn",
    "LinearLengthPenalty",
    "areal_relative_position_gae_lambda",
    "ipo_loss_fn",
    "prime_rl_score_group",
    "roll_compute_topr_loss",
    "roll_ratio",
    "skyrl_apply_loss_reduction_to_advantages_minibatch",
    "skyrl_reduce_loss",
    "swift_compute_fipo_influence",
    "swift_fipo_loss",
    "swift_real_loss",
]
