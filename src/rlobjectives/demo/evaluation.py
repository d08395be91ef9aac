"""The reference policy and its measure: the supervised warm start, the held-out accuracy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import DemoConfig, Forward
from .ranks import all_reduce_sum, rank_and_world_size, shard
from .sampling import default_forward, response_log_probs, sample_responses
from .task import DigitTask

__all__ = ["evaluate", "warm_start"]


def warm_start(
    model: nn.Module,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    *,
    forward: Forward = default_forward,
    progress: Callable[[int], Any] | None = None,
) -> None:
    """Short supervised fine-tuning (teacher forcing) on correct responses: the reference policy.

    Deliberately short: it leaves a mediocre policy, as a real SFT checkpoint is before RL.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.warmup_lr)
    model.train()
    for _ in range(config.warmup_steps):
        digits = task.sample_digits(config.warmup_batch_size, generator, held_out=False)
        targets, lengths = task.targets(digits)  # (B, R), (B,)
        mask = torch.arange(task.max_response_length) < lengths.unsqueeze(1)  # (B, R)
        log_probs = response_log_probs(model, task.prompts(digits), targets, mask, forward=forward)
        loss = -log_probs[mask].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if progress is not None:
            progress(1)


@torch.no_grad()
def evaluate(
    model: nn.Module, task: DigitTask, digits: torch.Tensor, *, forward: Forward = default_forward
) -> float:
    """Held-out exact-match accuracy of greedy decoding, over all ranks' shares of ``digits``."""
    rank, world_size = rank_and_world_size()
    rows = digits[shard(digits.shape[0], rank, world_size)]
    was_training = model.training
    model.eval()
    responses, _ = sample_responses(
        model,
        task.prompts(rows),
        max_new_tokens=task.max_response_length,
        end=task.end,
        pad=task.pad,
        greedy=True,
        forward=forward,
    )
    model.train(was_training)
    correct = all_reduce_sum(task.rewards(rows, responses).exact_match.sum().reshape(1))
    return float(correct) / digits.shape[0]
