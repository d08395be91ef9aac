"""The settings of a demo run, what it returns, and the signatures it plugs in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import Reduction

__all__ = [
    "ALGORITHMS",
    "REDUCTIONS",
    "DemoConfig",
    "DemoResult",
    "Forward",
    "Step",
]

# A forward function: (model, tokens (B, S), attention_mask (B, S) bool) -> logits (B, S, V).
# The demo's model ignores the mask; examples/ passes it to a Hugging Face model.
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# One GRPO step with the signature of grpo_step (examples/ passes a packed-sequence step).
Step = Callable[..., dict[str, float]]
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted")
ALGORITHMS = ("grpo", "ppo")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Every setting of a demo run (the command-line options, see :func:`build_parser`)."""

    out: str = "rlobjectives-demo"
    algorithm: str = "grpo"
    seed: int = 0
    task: str = "sort-unique"
    length: int = 6
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    warmup_steps: int = 40
    warmup_batch_size: int = 64
    warmup_lr: float = 1e-3
    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    epochs: int = 2
    minibatches: int = 2
    lr: float = 1e-3
    beta: float = 0.02
    clip_low: float = 0.2
    clip_high: float | None = None
    reduction: Reduction = "token_mean"
    max_grad_norm: float = 1.0
    sampler_temperature: float = 1.1  # the stand-in inference engine (see demo/rollout.py)
    rollout_upper: float = 2.0  # truncation of the rollout-correction weights (TIS)
    eval_every: int = 10
    eval_size: int = 500
    progress: bool = True
    threads: int = 1
    # FSDP2 (fully_shard) instead of DistributedDataParallel; the samples and the minibatches
    # are then drawn for the whole step from one stream, so any number of ranks trains on the
    # same data as one process (and parameters.pt holds the final parameters)
    fsdp: bool = False


@dataclasses.dataclass
class DemoResult:
    """What a run measured (also written to ``summary.json`` by rank 0)."""

    reference_accuracy: float
    final_accuracy: float | None
    steps_completed: int
    interrupted: bool
    wall_time_s: float
    world_size: int
    history: list[dict[str, Any]]
