r"""The GRPO post-training loop of ``rlobjectives demo``.

One training step, as in real RL post-training of language models:

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

Everything that is RL math comes from the library; this module holds only the model plumbing
(sampling, calling the model) and the bookkeeping (metrics, figure, progress bar).
Under ``torchrun`` every rank draws the same prompts and keeps its share of the groups, the
model is wrapped in ``DistributedDataParallel`` (gloo on CPU) and rank 0 writes the outputs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from .. import Reduction, group_relative_advantages, kl_penalized_rewards, policy_loss
from .. import response_log_probs as library_response_log_probs
from ..distributed import (
    data_parallel_loss_scale,
    global_normalizers,
    normalizer_for_reduction,
    sum_diagnostics,
)
from . import _process_group, rollout
from .model import TinyTransformer
from .task import TASKS, DigitTask

__all__ = [
    "DemoConfig",
    "DemoResult",
    "Forward",
    "MissingExtraError",
    "build_parser",
    "main",
    "response_log_probs",
    "sample_responses",
    "train",
]

# A forward function: (model, tokens (B, S), attention_mask (B, S) bool) -> logits (B, S, V).
# The demo's model ignores the mask; examples/ passes it to a Hugging Face model.
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# One GRPO step with the signature of grpo_step (examples/ passes a packed-sequence step).
Step = Callable[..., dict[str, float]]
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized")
ALGORITHMS = ("grpo", "ppo")
_MISSING_EXTRA = (
    "rlobjectives demo needs the optional packages tqdm and matplotlib, which are not "
    "installed ({error}); install them with: pip install 'rlobjectives[demo]'"
)


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


def _default_forward(
    model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    # Causal attention: no real token ever sees the padding, which only follows the end token.
    return model(tokens)  # type: ignore[no-any-return]


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    end: int,
    pad: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    forward: Forward = _default_forward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (or greedily decode) one response per prompt, stopping at the end token.

    Args:
        model: the policy.
        prompts: ``(B, P)`` prompt token ids.
        max_new_tokens: response length ``R`` (responses without an end token are cut there).
        end: end-of-response token id (kept in the response and in its mask).
        pad: token written after the end token (outside the mask).
        generator: random generator of the sampling.
        greedy: take the most likely token instead of sampling.
        forward: ``(model, tokens, attention_mask) -> logits``.

    Returns:
        ``responses`` ``(B, R)`` token ids and ``mask`` ``(B, R)`` bool: True up to and including
        the end token.
    """
    tokens = prompts  # (B, P)
    attention_mask = torch.ones_like(prompts, dtype=torch.bool)  # (B, P)
    finished = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)  # (B,)
    columns, mask_columns = [], []
    for _ in range(max_new_tokens):
        logits = forward(model, tokens, attention_mask)[:, -1].float()  # (B, V)
        if greedy:
            next_token = logits.argmax(-1)  # (B,)
        else:
            probs = torch.softmax(logits, dim=-1)  # (B, V)
            next_token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
        next_token = torch.where(finished, pad, next_token)
        mask_columns.append(~finished)
        columns.append(next_token)
        finished = finished | (next_token == end)
        tokens = torch.cat([tokens, next_token.unsqueeze(-1)], dim=1)  # (B, P + step)
        attention_mask = torch.cat([attention_mask, ~finished.unsqueeze(-1)], dim=1)
    return torch.stack(columns, dim=1), torch.stack(mask_columns, dim=1)


def response_log_probs(
    model: nn.Module,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    mask: torch.Tensor,
    *,
    prompt_mask: torch.Tensor | None = None,
    forward: Forward = _default_forward,
) -> torch.Tensor:
    """Log-probabilities ``(B, R)`` of the response tokens given their prompts.

    The model reads ``[prompt, response]`` with the attention mask ``[prompt_mask, mask]``, and
    :func:`rlobjectives.response_log_probs` applies the one-token shift (the logits at position
    ``j - 1`` score the token at ``j``) and the float32 log-softmax. The masks come from the
    sampler, never from token ids: a sampled token may equal the padding id.

    Args:
        model: the policy or the reference policy.
        prompts: ``(B, P)`` prompt token ids (left-padded if their lengths differ).
        responses: ``(B, R)`` response token ids.
        mask: ``(B, R)`` bool response mask (True up to and including the end token).
        prompt_mask: ``(B, P)`` bool, False at left padding (default: all True).
        forward: ``(model, tokens, attention_mask) -> logits``.

    Returns:
        ``(B, R)`` log-probabilities, float32 (float64 for a float64 model), 0 where ``mask`` is
        False; differentiable when grad is enabled.
    """
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
    tokens = torch.cat([prompts, responses], dim=1)  # (B, P + R)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)  # (B, P + R)
    logits = forward(model, tokens, attention_mask)  # (B, P + R, V)
    return library_response_log_probs(
        logits, tokens, prompt_mask.sum(-1), attention_mask, response_length=responses.shape[1]
    ).log_probs  # (B, R)


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if _is_distributed():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def _shard(count: int, rank: int, world_size: int) -> slice:
    """The rows ``[rank * count / W, (rank + 1) * count / W)`` of this rank."""
    return slice(rank * count // world_size, (rank + 1) * count // world_size)


def warm_start(
    model: nn.Module,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    *,
    forward: Forward = _default_forward,
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
    model: nn.Module, task: DigitTask, digits: torch.Tensor, *, forward: Forward = _default_forward
) -> float:
    """Held-out exact-match accuracy of greedy decoding, over all ranks' shares of ``digits``."""
    rank, world_size = _rank_and_world_size()
    shard = digits[_shard(digits.shape[0], rank, world_size)]
    was_training = model.training
    model.eval()
    responses, _ = sample_responses(
        model,
        task.prompts(shard),
        max_new_tokens=task.max_response_length,
        end=task.end,
        pad=task.pad,
        greedy=True,
        forward=forward,
    )
    model.train(was_training)
    correct = _all_reduce_sum(task.rewards(shard, responses).exact_match.sum().reshape(1))
    return float(correct) / digits.shape[0]


def _rank_and_world_size() -> tuple[int, int]:
    if _is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def grpo_step(
    model: nn.Module,
    reference: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    prompt_generator: torch.Generator,
    *,
    forward: Forward = _default_forward,
) -> dict[str, float]:
    """One GRPO step on this rank's share of the groups; returns global (all-rank) metrics."""
    rank, world_size = _rank_and_world_size()
    policy = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    # Every rank draws the same prompts (same generator state) and keeps its share of them.
    digits = task.sample_digits(config.prompts_per_step, prompt_generator, held_out=False)
    digits = digits[_shard(config.prompts_per_step, rank, world_size)]  # (P_rank, n)
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
    )  # (B, R), (B, R)
    scores = task.rewards(digits, responses)
    with torch.no_grad():
        rollout_log_probs = response_log_probs(policy, prompts, responses, mask, forward=engine)
        old_log_probs = response_log_probs(policy, prompts, responses, mask, forward=forward)
        ref_log_probs = response_log_probs(reference, prompts, responses, mask, forward=forward)
    correction = rollout.correct(old_log_probs, rollout_log_probs, mask, upper=config.rollout_upper)
    penalized = kl_penalized_rewards(old_log_probs, ref_log_probs, scores.reward, mask, config.beta)
    advantages = group_relative_advantages(
        penalized["penalized_rewards"], config.group_size, scale="std"
    )  # (B,)

    policy.train()
    scale = data_parallel_loss_scale()  # W: DDP averages the gradients over the ranks
    batch = prompts.shape[0]
    diagnostics, losses = [], []
    for _ in range(config.epochs):
        order = torch.randperm(batch, generator=generator)
        for rows in order.chunk(config.minibatches):
            counts = global_normalizers(mask[rows])  # exact counts over all ranks
            log_probs = response_log_probs(
                model, prompts[rows], responses[rows], mask[rows], forward=forward
            )
            reduction = {
                "reduction": config.reduction,
                "normalizer": normalizer_for_reduction(counts, reduction=config.reduction),
                "max_response_length": task.max_response_length,
            }
            output = policy_loss(
                log_probs,
                old_log_probs[rows],
                advantages[rows],
                mask[rows],
                clip_low=config.clip_low,
                clip_high=config.clip_high,
                diagnostics_normalizer=counts.tokens,
                importance_weights=correction.weights[rows],  # TIS: engine -> trainer
                **reduction,  # type: ignore[arg-type]
            )
            loss = output.loss
            optimizer.zero_grad(set_to_none=True)
            (loss * scale).backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            diagnostics.append(output.diagnostics)
            losses.append(loss.detach())

    updates = len(diagnostics)
    mean_diagnostics = sum_diagnostics(diagnostics)  # summed over updates and ranks
    totals = _all_reduce_sum(
        torch.stack(
            [
                scores.reward.sum(),
                scores.exact_match.sum(),
                penalized["sampled_divergences"].sum(),
                mask.sum().float(),
                torch.tensor(float(batch)),
                torch.stack(losses).sum(),
            ]
        )
    )
    sequences = float(totals[4])
    return {
        "reward": float(totals[0]) / sequences,
        "accuracy": float(totals[1]) / sequences,
        "kl": float(totals[2]) / sequences,
        "response_length": float(totals[3]) / sequences,
        "loss": float(totals[5]) / updates,
        "clip_fraction": float(
            mean_diagnostics.clip_fraction_low + mean_diagnostics.clip_fraction_high
        )
        / updates,
        "clip_fraction_low": float(mean_diagnostics.clip_fraction_low) / updates,
        "clip_fraction_high": float(mean_diagnostics.clip_fraction_high) / updates,
        "ratio_mean": float(mean_diagnostics.ratio_mean) / updates,
        "approx_kl": float(mean_diagnostics.approx_kl_k3) / updates,
        **rollout.step_metrics([correction.metrics]),
    }


class MissingExtraError(ImportError):
    """tqdm or matplotlib (the ``demo`` extra) is not installed."""


def _require_extras() -> tuple[Any, Any]:
    """Import tqdm and matplotlib (Agg backend) or raise a clear error."""
    try:
        tqdm = importlib.import_module("tqdm")
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as error:
        raise MissingExtraError(_MISSING_EXTRA.format(error=error)) from None
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    return tqdm.tqdm, pyplot


def write_figure(
    pyplot: Any, history: Sequence[dict[str, Any]], reference_accuracy: float, path: Path
) -> None:
    """Save the reward, accuracy, KL, clip-fraction and rollout-correction curves as one PNG."""
    steps = [entry["step"] for entry in history]
    critic = "value_loss" in history[0]  # PPO: a third column for the critic and the KL coef
    corrected = "rollout_effective_sample_size" in history[0]  # GRPO: the rollout correction
    columns = 3 if critic or corrected else 2
    figure, axes = pyplot.subplots(
        2, columns, figsize=(15 if columns == 3 else 10, 7), constrained_layout=True
    )
    reward, accuracy, kl, clip = axes[:, :2].flat
    if critic:
        from .ppo import plot_critic

        plot_critic(axes[0, 2], axes[1, 2], history)
    elif corrected:
        rollout.plot_rollout(axes[0, 2], history)
        axes[1, 2].set_visible(False)
    reward.plot(steps, [entry["reward"] for entry in history], label="mean reward (sampled)")
    reward.set_title("reward")
    evaluated = [entry for entry in history if entry.get("heldout_accuracy") is not None]
    accuracy.plot(steps, [entry["accuracy"] for entry in history], label="sampled, training")
    accuracy.plot(
        [0] + [entry["step"] for entry in evaluated],
        [reference_accuracy] + [entry["heldout_accuracy"] for entry in evaluated],
        marker="o",
        label="held-out, greedy",
    )
    accuracy.axhline(reference_accuracy, color="grey", linestyle="--", label="reference, held-out")
    accuracy.set_title("exact-match accuracy")
    accuracy.set_ylim(0, 1)
    kl.plot(steps, [entry["kl"] for entry in history], label="KL(policy || reference)")
    kl.set_title("sampled KL to the reference (per sequence)")
    clip.plot(steps, [entry["clip_fraction"] for entry in history], label="binding (low + high)")
    clip.plot(steps, [entry["clip_fraction_low"] for entry in history], label="low (A < 0)")
    clip.plot(steps, [entry["clip_fraction_high"] for entry in history], label="high (A > 0)")
    clip.set_title("clip fraction")
    for axis in axes.flat:
        if not axis.get_visible():
            continue
        axis.set_xlabel("PPO step" if critic else "GRPO step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


class _Interrupt:
    """Turns SIGINT/SIGTERM into KeyboardInterrupt once, then ignores repeats while saving."""

    def __init__(self) -> None:
        self.fired = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.fired:
            return
        self.fired = True
        raise KeyboardInterrupt


def train(
    config: DemoConfig,
    *,
    model: nn.Module | None = None,
    forward: Forward = _default_forward,
    stream: TextIO | None = None,
    custom_step: Step | None = None,
) -> DemoResult:
    """Run the demo: warm start, reference evaluation, GRPO, outputs in ``config.out``.

    Args:
        config: the settings.
        model: the policy to train (default: a fresh :class:`TinyTransformer`); it must map token
            ids of the task's vocabulary to logits through ``forward``.
        forward: ``(model, tokens, attention_mask) -> logits``.
        stream: where the progress bars and the summary go (default: standard error / output).
        custom_step: one training step with the signature and metrics of :func:`grpo_step`,
            in place of the configured algorithm's (``examples/grpo_transformers.py --packed``
            passes a packed-sequence step).

    Returns:
        :class:`DemoResult`. On Ctrl-C the run stops after writing ``metrics.jsonl`` (flushed
        every step), the figure and ``summary.json`` with ``interrupted: true``.
    """
    tqdm, pyplot = _require_extras()
    created_group = _process_group.setup()
    rank, world_size = _rank_and_world_size()
    if config.prompts_per_step % world_size:
        raise ValueError(
            f"prompts_per_step must be divisible by the number of ranks ({world_size}), got "
            f"{config.prompts_per_step}"
        )
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)  # restored at the end
    writer = rank == 0
    out = Path(config.out)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    interrupt = _Interrupt()
    # Signal handlers can only be installed from the main thread (Ctrl-C reaches it there).
    in_main_thread = threading.current_thread() is threading.main_thread()
    signals = _signals() if in_main_thread else []
    previous = {sig: signal.signal(sig, interrupt.handler) for sig in signals}
    start = time.perf_counter()
    history: list[dict[str, Any]] = []
    reference_accuracy = math.nan
    final_accuracy: float | None = None
    steps_completed = 0
    metrics_file = (out / "metrics.jsonl").open("w", encoding="utf-8") if writer else None
    show = config.progress and writer
    try:
        task = DigitTask(config.task, length=config.length)
        torch.manual_seed(config.seed)
        if model is None:
            model = TinyTransformer(
                task.vocab_size,
                task.context_length,
                hidden_size=config.hidden_size,
                num_layers=config.num_layers,
                num_heads=config.num_heads,
            )
        data_generator = torch.Generator().manual_seed(config.seed)
        eval_digits = task.sample_digits(
            config.eval_size, torch.Generator().manual_seed(12345), held_out=True
        )
        with tqdm(
            total=config.warmup_steps, desc="warm start (SFT)", disable=not show, file=stream
        ) as bar:
            warm_start(model, task, config, data_generator, forward=forward, progress=bar.update)
        if world_size > 1:
            model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
        policy = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
        reference_accuracy = evaluate(policy, task, eval_digits, forward=forward)
        heldout_accuracy = reference_accuracy
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        # Prompts: same stream on every rank; sampling: one stream per rank.
        prompt_generator = torch.Generator().manual_seed(config.seed + 1)
        sample_generator = torch.Generator().manual_seed(config.seed * 1000 + 7 + rank)
        step_function: Callable[..., dict[str, float]] = grpo_step
        if custom_step is not None:
            step_function = custom_step
        elif config.algorithm == "ppo":  # actor-critic: the critic and KL controller live there
            from .ppo import PPOStep

            step_function = PPOStep(policy, config, world_size=world_size)
        desc = config.algorithm.upper()
        with tqdm(total=config.steps, desc=desc, disable=not show, file=stream) as bar:
            for step in range(1, config.steps + 1):
                metrics = step_function(
                    model,
                    reference,
                    optimizer,
                    task,
                    config,
                    sample_generator,
                    prompt_generator,
                    forward=forward,
                )
                evaluated = step % config.eval_every == 0 or step == config.steps
                if evaluated:
                    heldout_accuracy = evaluate(policy, task, eval_digits, forward=forward)
                    final_accuracy = heldout_accuracy if step == config.steps else None
                entry = {
                    "step": step,
                    **{key: round(value, 6) for key, value in metrics.items()},
                    "heldout_accuracy": round(heldout_accuracy, 6) if evaluated else None,
                    "elapsed_s": round(time.perf_counter() - start, 3),
                }
                history.append(entry)
                steps_completed = step
                if metrics_file is not None:
                    metrics_file.write(json.dumps(entry) + "\n")
                    metrics_file.flush()
                bar.set_postfix(
                    reward=f"{metrics['reward']:.3f}",
                    acc=f"{metrics['accuracy']:.2f}",
                    heldout=f"{heldout_accuracy:.2f}",
                    kl=f"{metrics['kl']:.3f}",
                    clip=f"{metrics['clip_fraction']:.3f}",
                    refresh=False,
                )
                bar.update(1)
    except KeyboardInterrupt:
        interrupt.fired = True
    except RuntimeError:
        if not interrupt.fired:  # a peer rank stopped on Ctrl-C: its collectives fail here
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        torch.set_num_threads(previous_threads)
        if metrics_file is not None:
            metrics_file.close()
    result = DemoResult(
        reference_accuracy=reference_accuracy,
        final_accuracy=final_accuracy,
        steps_completed=steps_completed,
        interrupted=interrupt.fired,
        wall_time_s=round(time.perf_counter() - start, 3),
        world_size=world_size,
        history=history,
    )
    if writer:
        _write_outputs(pyplot, config, result, out, stream)
    if _is_distributed() and not interrupt.fired:
        # After an interruption a peer may be gone: no more collectives then.
        model = None  # the DistributedDataParallel wrapper references the process group
        _process_group.shutdown(created=created_group)
    return result


def _signals() -> list[int]:
    return [signal.SIGINT, signal.SIGTERM]


def _write_outputs(
    pyplot: Any, config: DemoConfig, result: DemoResult, out: Path, stream: TextIO | None
) -> None:
    """Write the figure and ``summary.json`` and print a short summary."""
    if result.history:
        write_figure(pyplot, result.history, result.reference_accuracy, out / "metrics.png")
    last_heldout = next(
        (
            e["heldout_accuracy"]
            for e in reversed(result.history)
            if e["heldout_accuracy"] is not None
        ),
        None,
    )
    summary = {
        "reference_heldout_accuracy": _finite_or_none(result.reference_accuracy),
        "final_heldout_accuracy": result.final_accuracy,
        "last_heldout_accuracy": last_heldout,
        "steps_completed": result.steps_completed,
        "steps_requested": config.steps,
        "interrupted": result.interrupted,
        "wall_time_s": result.wall_time_s,
        "world_size": result.world_size,
        "config": dataclasses.asdict(config),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print_stream = sys.stdout if stream is None else stream
    status = "interrupted" if result.interrupted else "done"
    reference = _finite_or_none(result.reference_accuracy)
    final = result.final_accuracy if result.final_accuracy is not None else last_heldout
    print(
        f"{status}: {result.steps_completed}/{config.steps} {config.algorithm.upper()} steps in "
        f"{result.wall_time_s:.1f} s on {result.world_size} process(es); held-out exact match "
        f"{_percent(reference)} (reference) -> {_percent(final)} (policy); outputs in {out}/ "
        "(metrics.jsonl, metrics.png, summary.json)",
        file=print_stream,
    )


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 6)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options (``rlobjectives demo --help``)."""
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="rlobjectives demo",
        description=(
            "GRPO post-training of a tiny transformer on a verifiable digit task, on CPU, using "
            "rlobjectives for the math (group_relative_advantages, kl_penalized_rewards, "
            "policy_loss, global_normalizers). A short supervised warm start makes the "
            "reference policy; GRPO then raises its held-out exact-match accuracy. Writes "
            "metrics.jsonl (one line per step), metrics.png and summary.json to --out. "
            "Data-parallel: torchrun --nproc_per_node=2 -m rlobjectives.demo [options]."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--out", default=defaults.out, help="output folder")
    add(
        "--algorithm",
        choices=ALGORITHMS,
        default=defaults.algorithm,
        help="grpo (group-relative advantages) or ppo (critic, GAE, adaptive KL coefficient)",
    )
    add("--seed", type=int, default=defaults.seed, help="random seed (model, data, sampling)")
    add("--task", choices=TASKS, default=defaults.task, help="the digit task")
    add("--length", type=int, default=defaults.length, help="digits per prompt")
    add("--steps", type=int, default=defaults.steps, help="RL steps (GRPO or PPO)")
    add(
        "--warmup-steps",
        type=int,
        default=defaults.warmup_steps,
        help="supervised warm-start steps",
    )
    add("--prompts-per-step", type=int, default=defaults.prompts_per_step, help="prompts per step")
    add("--group-size", type=int, default=defaults.group_size, help="completions per prompt (G)")
    add("--epochs", type=int, default=defaults.epochs, help="optimisation epochs per batch")
    add("--minibatches", type=int, default=defaults.minibatches, help="minibatches per epoch")
    add("--lr", type=float, default=defaults.lr, help="GRPO learning rate (AdamW)")
    add("--beta", type=float, default=defaults.beta, help="KL coefficient of the reward penalty")
    add("--clip-low", type=float, default=defaults.clip_low, help="ratio clip below, 1 - eps_low")
    add(
        "--clip-high",
        type=_optional_float,
        default=defaults.clip_high,
        help="ratio clip above, 1 + eps_high (None: same as --clip-low; DAPO uses 0.28)",
    )
    add("--reduction", choices=REDUCTIONS, default=defaults.reduction, help="loss reduction")
    add(
        "--sampler-temperature",
        type=float,
        default=defaults.sampler_temperature,
        help="sampling temperature of the stand-in inference engine (1: same as the trainer)",
    )
    add(
        "--rollout-upper",
        type=float,
        default=defaults.rollout_upper,
        help="truncation of the rollout-correction importance weights (TIS)",
    )
    add("--hidden-size", type=int, default=defaults.hidden_size, help="model width")
    add("--num-layers", type=int, default=defaults.num_layers, help="transformer blocks")
    add("--eval-every", type=int, default=defaults.eval_every, help="held-out eval interval")
    add("--eval-size", type=int, default=defaults.eval_size, help="held-out prompts")
    add(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch CPU threads per process (the model is too small to gain from more)",
    )
    add("--no-progress", action="store_true", help="no progress bars")
    return parser


def _positive(parser: argparse.ArgumentParser, values: argparse.Namespace) -> None:
    for name in (
        "steps",
        "warmup_steps",
        "prompts_per_step",
        "group_size",
        "epochs",
        "minibatches",
        "eval_every",
        "eval_size",
        "length",
        "threads",
    ):
        if getattr(values, name) < (0 if name == "warmup_steps" else 1):
            parser.error(
                f"--{name.replace('_', '-')} must be positive, got {getattr(values, name)}"
            )
    if values.group_size < 2:
        parser.error(
            f"--group-size must be >= 2 (GRPO compares completions), got {values.group_size}"
        )
    if values.beta < 0 or values.clip_low < 0 or (values.clip_high or 0) < 0:
        parser.error("--beta, --clip-low and --clip-high must be >= 0")
    if not (values.sampler_temperature > 0 and values.rollout_upper > 0):
        parser.error("--sampler-temperature and --rollout-upper must be > 0")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rlobjectives demo`` (also ``python -m rlobjectives.demo``); returns the exit status.

    0 after a complete run, 130 after Ctrl-C (outputs kept), 2 on a usage error.
    """
    parser = build_parser()
    try:
        values = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        _positive(parser, values)
    except SystemExit as exit_:  # --help (0) or a usage error (2, message already printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    config = DemoConfig(
        out=values.out,
        algorithm=values.algorithm,
        seed=values.seed,
        task=values.task,
        length=values.length,
        hidden_size=values.hidden_size,
        num_layers=values.num_layers,
        warmup_steps=values.warmup_steps,
        steps=values.steps,
        prompts_per_step=values.prompts_per_step,
        group_size=values.group_size,
        epochs=values.epochs,
        minibatches=values.minibatches,
        lr=values.lr,
        beta=values.beta,
        clip_low=values.clip_low,
        clip_high=values.clip_high,
        reduction=values.reduction,
        sampler_temperature=values.sampler_temperature,
        rollout_upper=values.rollout_upper,
        eval_every=values.eval_every,
        eval_size=values.eval_size,
        progress=not values.no_progress,
        threads=values.threads,
    )
    try:
        result = train(config)
    except MissingExtraError as error:
        print(f"rlobjectives demo: error: {error}", file=sys.stderr)
        return 1
    return 130 if result.interrupted else 0
