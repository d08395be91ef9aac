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


__all__ = [
    "AReaLPromptMean",
    "LinearLengthPenalty",
    "areal_relative_position_gae_lambda",
    "prime_rl_score_group",
    "skyrl_apply_loss_reduction_to_advantages_minibatch",
    "skyrl_reduce_loss",
]
