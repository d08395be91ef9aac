r"""One GRPO step of ``rlobjectives demo``, as in real RL post-training of language models.

1. draw ``P`` prompts and sample ``G`` completions of each with a stand-in inference engine
   (the current policy at another sampling temperature, :mod:`rlobjectives.demo.rollout`;
   groups are contiguous: rows ``g*G .. g*G + G-1`` answer prompt ``g``);
2. score them with the task's verifiable reward :math:`r_i`;
3. log-probabilities of the sampled tokens under the engine (``rollout_log_probs``), the
   trainer's sampling policy (``old_log_probs``) and the frozen reference policy
   (``ref_log_probs``); :func:`rlobjectives.rollout_correction` turns the engine/trainer ratio
   into truncated importance weights;
4. :func:`rlobjectives.kl_penalized_rewards`:
   :math:`\tilde r_i = r_i - \beta \sum_t (\ell^{old}_{it} - \ell^{ref}_{it})`;
5. :func:`rlobjectives.group_relative_advantages`:
   :math:`A_i = (\tilde r_i - \mathrm{mean}_g) / (\mathrm{std}_g + \epsilon)`;
6. several epochs of minibatch updates with :func:`rlobjectives.policy_loss` (clipped ratio
   :math:`\pi_\theta / \pi_{old}`, per-token loss times the importance weights), each divided
   by the *global* count of the minibatch
   (:func:`rlobjectives.distributed.global_normalizers`), so the gradient does not depend on how
   the batch is split over ranks.

:func:`grpo_step` runs them as three stages: the rollout (steps 1-3, no gradient), the
advantages (4-5) and the update (6), then gathers the step's metrics over all ranks. Everything
that is RL math comes from the library. Under ``torchrun`` every rank draws the same prompts and
keeps its share of the groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .. import (
    Clip,
    PolicyLossDiagnostics,
    PolicyLossOutput,
    RolloutCorrection,
    group_relative_advantages,
    kl_penalized_rewards,
    policy_loss,
)
from ..distributed import (
    data_parallel_loss_scale,
    global_normalizers,
    normalizer_for_reduction,
    sum_diagnostics,
)
from . import rollout
from .config import DemoConfig, Forward
from .ranks import all_reduce_sum, rank_and_world_size, shard
from .sampling import default_forward, response_log_probs, sample_responses
from .task import DigitTask, Rewards

__all__ = ["grpo_step", "unwrap"]


class _Samples(NamedTuple):
    """This rank's share of the step's groups, sampled and scored (no gradient)."""

    prompts: torch.Tensor  # (B, P)
    responses: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) bool
    scores: Rewards  # (B,) each
    rollout_log_probs: torch.Tensor  # (B, R) under the stand-in inference engine
    old_log_probs: torch.Tensor  # (B, R) under the trainer's sampling policy
    ref_log_probs: torch.Tensor  # (B, R) under the frozen reference


class _Batch(NamedTuple):
    """What the update trains on: the samples, their importance weights and advantages."""

    samples: _Samples
    correction: RolloutCorrection  # weights (B, R): engine -> trainer (TIS)
    sampled_divergences: torch.Tensor  # (B,) summed k1 KL to the reference
    advantages: torch.Tensor  # (B,)


class _Updates(NamedTuple):
    """The diagnostics and (detached) losses of every minibatch update of one step."""

    diagnostics: list[PolicyLossDiagnostics]
    losses: list[torch.Tensor]  # () each


def unwrap(model: nn.Module) -> nn.Module:
    """The policy inside a ``DistributedDataParallel`` wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def grpo_step(
    model: nn.Module,
    reference: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    prompt_generator: torch.Generator,
    *,
    forward: Forward = default_forward,
) -> dict[str, float]:
    """One GRPO step on this rank's share of the groups; returns global (all-rank) metrics."""
    samples = _rollout_stage(
        unwrap(model), reference, task, config, generator, prompt_generator, forward=forward
    )
    batch = _advantage_stage(samples, config)
    updates = _update_stage(model, optimizer, task, config, batch, generator, forward=forward)
    return _step_metrics(batch, updates)


def _rollout_stage(
    policy: nn.Module,
    reference: nn.Module,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    prompt_generator: torch.Generator,
    *,
    forward: Forward,
) -> _Samples:
    """Steps 1-3: this rank's groups sampled by the engine, scored, and their log-probs."""
    rank, world_size = rank_and_world_size()
    # Every rank draws the same prompts (same generator state) and keeps its share of them.
    digits = task.sample_digits(config.prompts_per_step, prompt_generator, held_out=False)
    digits = digits[shard(config.prompts_per_step, rank, world_size)]  # (P_rank, n)
    digits = digits.repeat_interleave(config.group_size, dim=0)  # (B, n), B = P_rank * G
    prompts = task.prompts(digits)  # (B, P)

    policy.eval()
    engine = rollout.engine_forward(forward, config.sampler_temperature)  # the "inference engine"
    responses, mask = sample_responses(
        policy,
        prompts,
        max_new_tokens=task.max_response_length,
        end=task.end,
        pad=task.pad,
        generator=generator,
        forward=engine,
        # --fsdp: the random numbers of the whole step's rows, one stream on every rank
        rows=_step_rows(prompts.shape[0]) if config.fsdp else None,
    )  # (B, R), (B, R)
    scores = task.rewards(digits, responses)
    with torch.no_grad():
        rollout_log_probs = response_log_probs(policy, prompts, responses, mask, forward=engine)
        old_log_probs = response_log_probs(policy, prompts, responses, mask, forward=forward)
        ref_log_probs = response_log_probs(reference, prompts, responses, mask, forward=forward)
    return _Samples(
        prompts, responses, mask, scores, rollout_log_probs, old_log_probs, ref_log_probs
    )


def _advantage_stage(samples: _Samples, config: DemoConfig) -> _Batch:
    """Steps 3-5: importance weights, KL-penalised rewards, group-relative advantages."""
    correction = rollout.correct(
        samples.old_log_probs, samples.rollout_log_probs, samples.mask, upper=config.rollout_upper
    )
    penalized = kl_penalized_rewards(
        samples.old_log_probs,
        samples.ref_log_probs,
        samples.scores.reward,
        samples.mask,
        config.beta,
    )
    advantages = group_relative_advantages(
        penalized["penalized_rewards"], config.group_size, scale="std"
    )  # (B,)
    return _Batch(samples, correction, penalized["sampled_divergences"], advantages)


def _update_stage(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: DigitTask,
    config: DemoConfig,
    batch: _Batch,
    generator: torch.Generator,
    *,
    forward: Forward,
) -> _Updates:
    """Step 6: epochs x minibatches of clipped-surrogate updates of the policy."""
    unwrap(model).train()
    scale = data_parallel_loss_scale()  # W: DDP averages the gradients over the ranks
    diagnostics, losses = [], []
    for _ in range(config.epochs):
        for rows in _minibatches(batch.samples.prompts.shape[0], config, generator):
            output = _minibatch_loss(model, task, config, batch, rows, forward=forward)
            optimizer.zero_grad(set_to_none=True)
            (output.loss * scale).backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            diagnostics.append(output.diagnostics)
            losses.append(output.loss.detach())
    return _Updates(diagnostics, losses)


def _step_rows(local_rows: int) -> tuple[int, int]:
    """``(offset, total)``: where this rank's rows sit in the whole step's batch."""
    rank, world_size = rank_and_world_size()
    return rank * local_rows, local_rows * world_size


def _minibatches(rows: int, config: DemoConfig, generator: torch.Generator) -> list[torch.Tensor]:
    """This rank's rows of each minibatch of one epoch.

    A random order of this rank's rows (its own stream), cut into ``minibatches``; with
    ``--fsdp`` the order of the whole step's rows (one stream on every rank, as one process
    draws it), each rank keeping its rows of every minibatch.
    """
    if not config.fsdp:
        return list(torch.randperm(rows, generator=generator).chunk(config.minibatches))
    offset, total = _step_rows(rows)
    minibatches = torch.randperm(total, generator=generator).chunk(config.minibatches)
    return [chunk[(chunk >= offset) & (chunk < offset + rows)] - offset for chunk in minibatches]


def _minibatch_loss(
    model: nn.Module,
    task: DigitTask,
    config: DemoConfig,
    batch: _Batch,
    rows: torch.Tensor,
    *,
    forward: Forward,
) -> PolicyLossOutput:
    """The policy loss of the minibatch ``rows``, divided by its count over all ranks."""
    samples = batch.samples
    mask = samples.mask[rows]
    counts = global_normalizers(mask)  # exact counts over all ranks
    log_probs = response_log_probs(
        model, samples.prompts[rows], samples.responses[rows], mask, forward=forward
    )
    return policy_loss(
        log_probs,
        samples.old_log_probs[rows],
        batch.advantages[rows],
        mask,
        surrogate=Clip(low=config.clip_low, high=config.clip_high),
        diagnostics_normalizer=counts.tokens,
        importance_weights=batch.correction.weights[rows],  # TIS: engine -> trainer
        reduction=config.reduction,
        normalizer=normalizer_for_reduction(counts, reduction=config.reduction),
        max_response_length=task.max_response_length,
    )


def _step_metrics(batch: _Batch, updates: _Updates) -> dict[str, float]:
    """The step's metrics, over all ranks: rollout means, mean update diagnostics, correction."""
    samples = batch.samples
    count = len(updates.diagnostics)
    summed = sum_diagnostics(updates.diagnostics)  # summed over updates and ranks
    totals = all_reduce_sum(
        torch.stack(
            [
                samples.scores.reward.sum(),
                samples.scores.exact_match.sum(),
                batch.sampled_divergences.sum(),
                samples.mask.sum().float(),
                torch.tensor(float(samples.prompts.shape[0])),
                torch.stack(updates.losses).sum(),
            ]
        )
    )
    sequences = float(totals[4])
    return {
        "reward": float(totals[0]) / sequences,
        "accuracy": float(totals[1]) / sequences,
        "kl": float(totals[2]) / sequences,
        "response_length": float(totals[3]) / sequences,
        "loss": float(totals[5]) / count,
        "clip_fraction": float(summed.clip_fraction_low + summed.clip_fraction_high) / count,
        "clip_fraction_low": float(summed.clip_fraction_low) / count,
        "clip_fraction_high": float(summed.clip_fraction_high) / count,
        "ratio_mean": float(summed.ratio_mean) / count,
        "approx_kl": float(summed.approx_kl_k3) / count,
        **rollout.step_metrics([batch.correction.metrics]),
    }
