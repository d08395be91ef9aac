r"""The PPO (actor-critic) loop of ``rlobjectives demo --algorithm ppo``.

Same task, policy, warm start, sampling and reference as the GRPO run; the difference is where
the advantages come from. One step:

1. sample ``P x G`` responses, score them, and take the log-probabilities under the sampling
   policy and the reference, and the values :math:`V_t` of a **critic** (:class:`ValueModel`: a
   copy of the warm-started transformer with a linear value head);
2. per-token rewards :func:`rlobjectives.kl_penalized_token_rewards`: :math:`-\beta\,k_1` on
   every token, the score on the last one, with :math:`\beta` from an
   :class:`rlobjectives.AdaptiveKLController`;
3. :func:`rlobjectives.gae` with whitening (verl's ``gae`` estimator): advantages and returns;
   under ``torchrun`` the whitening uses every rank's tokens
   (:func:`rlobjectives.distributed.global_masked_whiten`);
4. epochs of minibatch updates of :func:`rlobjectives.policy_loss` (actor) and
   :func:`rlobjectives.value_loss` (critic, clipped around the rollout values), with the global
   normalisers;
5. the controller moves :math:`\beta` towards the target KL.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import (
    AdaptiveKLController,
    Clip,
    gae,
    kl_penalized_token_rewards,
    policy_loss,
    value_loss,
)
from ..distributed import (
    data_parallel_loss_scale,
    global_masked_whiten,
    global_normalizers,
    normalizer_for_reduction,
    sum_diagnostics,
)
from .model import TinyTransformer
from .ranks import all_reduce_sum
from .sampling import response_log_probs, sample_responses
from .task import DigitTask, Rewards

__all__ = [
    "GAMMA",
    "KL_HORIZON",
    "KL_TARGET",
    "LAMBDA",
    "PPOStep",
    "ValueModel",
    "plot_critic",
    "response_values",
]

GAMMA = 1.0  # no discount within a response (verl / OpenRLHF default)
LAMBDA = 0.95  # GAE lambda (OpenRLHF's default)
VALUE_CLIP = 0.2  # value clip range (verl cliprange_value, OpenRLHF value_clip)
CRITIC_LR = 2e-3  # AdamW learning rate of the critic
KL_TARGET = 4.0  # per-sequence summed k1 KL the controller steers to
KL_HORIZON = 2_000  # samples (verl / OpenRLHF: 10 000); shorter, so beta moves in 150 steps


class ValueModel(nn.Module):
    """The critic: a copy of the policy's transformer trunk and a linear value head.

    ``forward(tokens)`` returns ``(B, S)`` values: :math:`V` of the state that ends at each
    position (the value of generating the next token from there).
    """

    def __init__(self, policy: TinyTransformer) -> None:
        super().__init__()
        self.trunk = copy.deepcopy(policy)
        del self.trunk.head  # the language-model head is not part of the critic
        hidden_size = policy.token_embedding.embedding_dim
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Values ``(B, S)`` of ``tokens`` ``(B, S)``."""
        return self.value_head(self.trunk.hidden_states(tokens)).squeeze(-1)  # type: ignore[no-any-return]


def response_values(
    critic: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    r"""``(B, R)`` values of the states before each response token (0 where ``mask`` is False).

    The value of response token ``t`` is read at the position that predicts it (``P + t - 1``),
    like its log-probability: :math:`\delta_t = r_t + \gamma V_{t+1} - V_t`.
    """
    prompt_length = prompts.shape[1]
    values = critic(torch.cat([prompts, responses], dim=1))  # (B, P + R)
    values = values[:, prompt_length - 1 : prompt_length - 1 + responses.shape[1]]  # (B, R)
    return torch.where(mask, values, 0.0)


class Rollout(NamedTuple):
    prompts: torch.Tensor  # (B, P)
    responses: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) bool
    scores: Rewards  # (B,) each
    old_log_probs: torch.Tensor  # (B, R)
    kl: torch.Tensor  # (B,) sampled k1 KL to the reference, summed over the response
    old_values: torch.Tensor  # (B, R)
    advantages: torch.Tensor  # (B, R) whitened GAE advantages
    returns: torch.Tensor  # (B, R) value targets


class PPOStep:
    """One PPO step per call, with the critic, its optimizer and the KL controller as state.

    Called like :func:`rlobjectives.demo.grpo.grpo_step` and returns the same metrics plus
    ``value_loss``, ``value_clip_fraction``, ``explained_variance`` and ``kl_coef``.
    """

    def __init__(self, policy: nn.Module, config: Any, *, world_size: int) -> None:
        if not isinstance(policy, TinyTransformer):
            raise ValueError(
                "--algorithm ppo builds its critic from the demo's TinyTransformer, got a "
                f"{type(policy).__name__}"
            )
        critic = ValueModel(policy)
        self.critic: nn.Module = (
            nn.parallel.DistributedDataParallel(critic) if world_size > 1 else critic
        )
        self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=CRITIC_LR)
        self.controller = AdaptiveKLController(config.beta, KL_TARGET, KL_HORIZON)
        self.world_size = world_size

    def __call__(
        self,
        model: nn.Module,
        reference: nn.Module,
        optimizer: torch.optim.Optimizer,
        task: DigitTask,
        config: Any,
        generator: torch.Generator,
        prompt_generator: torch.Generator,
        *,
        forward: Any = None,
    ) -> dict[str, float]:
        """One step (the signature of ``grpo_step``; ``forward`` must be the default)."""
        rollout = self._rollout(model, reference, task, config, generator, prompt_generator)
        kl_coef = self.controller.value
        updates = self._update(model, optimizer, task, config, rollout, generator)
        totals = all_reduce_sum(
            torch.stack(
                [
                    rollout.kl.sum(),
                    torch.tensor(float(rollout.mask.shape[0])),
                    value_loss(
                        rollout.old_values, rollout.old_values, rollout.returns, rollout.mask
                    ).diagnostics.explained_variance,
                ]
            )
        )
        sequences = int(totals[1])
        self.controller.update(float(totals[0]) / sequences, n_steps=sequences)
        return {
            **_rollout_metrics(rollout),
            **updates,
            "explained_variance": float(totals[2]) / self.world_size,
            "kl_coef": kl_coef,
        }

    def _rollout(
        self,
        model: nn.Module,
        reference: nn.Module,
        task: DigitTask,
        config: Any,
        generator: torch.Generator,
        prompt_generator: torch.Generator,
    ) -> Rollout:
        """Sample, score, and estimate advantages and returns (no gradient)."""
        policy = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        critic = self.critic.module if self.world_size > 1 else self.critic
        assert isinstance(critic, nn.Module)
        rank = torch.distributed.get_rank() if self.world_size > 1 else 0
        digits = task.sample_digits(config.prompts_per_step, prompt_generator, held_out=False)
        share = config.prompts_per_step // self.world_size
        digits = digits[rank * share : (rank + 1) * share].repeat_interleave(config.group_size, 0)
        prompts = task.prompts(digits)  # (B, P)
        policy.eval()
        responses, mask = sample_responses(
            policy,
            prompts,
            max_new_tokens=task.max_response_length,
            end=task.end,
            pad=task.pad,
            generator=generator,
        )  # (B, R), (B, R)
        scores = task.rewards(digits, responses)
        with torch.no_grad():
            old_log_probs = response_log_probs(policy, prompts, responses, mask)  # (B, R)
            ref_log_probs = response_log_probs(reference, prompts, responses, mask)  # (B, R)
            old_values = response_values(critic, prompts, responses, mask)  # (B, R)
        rewards = kl_penalized_token_rewards(
            old_log_probs, ref_log_probs, scores.reward, mask, kl_coef=self.controller.value
        )  # (B, R): -beta * k1 per token, the score on the last one
        single = self.world_size == 1
        estimate = gae(rewards, old_values, mask, gamma=GAMMA, lam=LAMBDA, whiten=single)
        advantages = estimate.advantages
        if not single:  # the same whitening, with the statistics of every rank's tokens
            advantages = global_masked_whiten(advantages, mask)
        kl = torch.where(mask, old_log_probs - ref_log_probs, 0.0).sum(-1)  # (B,)
        return Rollout(
            prompts,
            responses,
            mask,
            scores,
            old_log_probs,
            kl,
            old_values,
            advantages,
            estimate.returns,
        )

    def _update(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        task: DigitTask,
        config: Any,
        rollout: Rollout,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """Epochs x minibatches of actor and critic updates; their mean metrics over all ranks."""
        model.train()
        self.critic.train()
        scale = data_parallel_loss_scale()
        batch = rollout.prompts.shape[0]
        diagnostics, losses = [], []
        for _ in range(config.epochs):
            for rows in torch.randperm(batch, generator=generator).chunk(config.minibatches):
                counts = global_normalizers(rollout.mask[rows])
                normalizer = normalizer_for_reduction(counts, reduction=config.reduction)
                mask = rollout.mask[rows]
                log_probs = response_log_probs(
                    model, rollout.prompts[rows], rollout.responses[rows], mask
                )
                actor = policy_loss(
                    log_probs,
                    rollout.old_log_probs[rows],
                    rollout.advantages[rows],
                    mask,
                    surrogate=Clip(low=config.clip_low, high=config.clip_high),
                    reduction=config.reduction,
                    normalizer=normalizer,
                    max_response_length=task.max_response_length,
                    diagnostics_normalizer=counts.tokens,
                )
                values = response_values(
                    self.critic, rollout.prompts[rows], rollout.responses[rows], mask
                )
                critic = value_loss(
                    values,
                    rollout.old_values[rows],
                    rollout.returns[rows],
                    mask,
                    clip=VALUE_CLIP,
                    reduction=config.reduction,
                    normalizer=normalizer,
                    max_response_length=task.max_response_length,
                )
                self._step(model, optimizer, (actor.loss + critic.loss) * scale, config)
                diagnostics.append(actor.diagnostics)
                losses.append(
                    torch.stack([actor.loss, critic.loss, critic.diagnostics.clip_fraction])
                )
        return _update_metrics(diagnostics, losses, self.world_size)

    def _step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, config: Any
    ) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.critic_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), config.max_grad_norm)
        optimizer.step()
        self.critic_optimizer.step()


def _rollout_metrics(rollout: Rollout) -> dict[str, float]:
    totals = all_reduce_sum(
        torch.stack(
            [
                rollout.scores.reward.sum(),
                rollout.scores.exact_match.sum(),
                rollout.kl.sum(),
                rollout.mask.sum().float(),
                torch.tensor(float(rollout.mask.shape[0])),
            ]
        )
    )
    sequences = float(totals[4])
    return {
        "reward": float(totals[0]) / sequences,
        "accuracy": float(totals[1]) / sequences,
        "kl": float(totals[2]) / sequences,
        "response_length": float(totals[3]) / sequences,
    }


def _update_metrics(
    diagnostics: Sequence[Any], losses: list[torch.Tensor], world_size: int
) -> dict[str, float]:
    updates = len(diagnostics)
    summed = sum_diagnostics(list(diagnostics))  # summed over updates and ranks
    loss_totals = all_reduce_sum(torch.stack(losses).detach().sum(0))  # (3,)
    return {
        "loss": float(loss_totals[0]) / updates,  # sum over ranks of additive losses
        "value_loss": float(loss_totals[1]) / updates,
        "value_clip_fraction": float(loss_totals[2]) / (updates * world_size),
        "clip_fraction": float(summed.clip_fraction_low + summed.clip_fraction_high) / updates,
        "clip_fraction_low": float(summed.clip_fraction_low) / updates,
        "clip_fraction_high": float(summed.clip_fraction_high) / updates,
        "ratio_mean": float(summed.ratio_mean) / updates,
        "approx_kl": float(summed.approx_kl_k3) / updates,
    }


def plot_critic(critic_axis: Any, kl_axis: Any, history: Sequence[dict[str, Any]]) -> None:
    """The PPO panels of the figure: critic loss and explained variance; the KL coefficient."""
    steps = [entry["step"] for entry in history]
    critic_axis.plot(steps, [e["value_loss"] for e in history], label="value loss (clipped)")
    critic_axis.plot(
        steps, [e["explained_variance"] for e in history], label="explained variance (rollout)"
    )
    critic_axis.set_title("critic")
    kl_axis.plot(steps, [e["kl_coef"] for e in history], label="KL coefficient (adaptive)")
    kl_axis.set_title(f"KL coefficient, target KL {KL_TARGET} per sequence")
