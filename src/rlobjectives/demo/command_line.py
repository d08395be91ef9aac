"""``rlobjectives demo`` on the command line: the options, their checks, and :func:`main`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import __version__
from .config import ALGORITHMS, REDUCTIONS, DemoConfig
from .outputs import MissingExtraError
from .task import TASKS
from .training import train

__all__ = ["build_parser", "main"]

_Add = Callable[..., Any]  # ArgumentParser.add_argument
_COUNTS = (  # options that count something: at least 1 (--warmup-steps: at least 0)
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
)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options (``rlobjectives demo --help``)."""
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="rlobjectives demo",
        description=(
            "GRPO (or PPO, --algorithm ppo) post-training of a tiny transformer on a verifiable "
            "digit task, on CPU, using rlobjectives for the math (GRPO: "
            "group_relative_advantages, kl_penalized_rewards, rollout_correction; PPO: "
            "kl_penalized_token_rewards, gae, value_loss, AdaptiveKLController; both: "
            "policy_loss, global_normalizers). A short supervised warm start makes the "
            "reference policy; RL then raises its held-out exact-match accuracy. Writes "
            "metrics.jsonl (one line per step), metrics.png and summary.json to --out. "
            "Data-parallel: torchrun --nproc_per_node=2 -m rlobjectives.demo [options] "
            "(add --fsdp for FSDP2's fully_shard)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # One flat list of options in --help; the helpers only group the code.
    _add_run_options(parser.add_argument, defaults)
    _add_schedule_options(parser.add_argument, defaults)
    _add_objective_options(parser.add_argument, defaults)
    _add_model_and_evaluation_options(parser.add_argument, defaults)
    parser.add_argument("--version", action="version", version=f"rlobjectives {__version__}")
    return parser


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _add_run_options(add: _Add, defaults: DemoConfig) -> None:
    """Where the outputs go, which algorithm, the seed and the task."""
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


def _add_schedule_options(add: _Add, defaults: DemoConfig) -> None:
    """How many steps, samples, epochs and minibatches."""
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


def _add_objective_options(add: _Add, defaults: DemoConfig) -> None:
    """The learning rate, the objective's coefficients and the rollout correction."""
    add("--lr", type=float, default=defaults.lr, help="learning rate of the policy (AdamW)")
    add(
        "--beta",
        type=float,
        default=defaults.beta,
        help="KL coefficient of the reward penalty (PPO: the adaptive controller's start)",
    )
    add(
        "--clip-low",
        type=float,
        default=defaults.clip_low,
        help="eps_low, not the edge: the ratio is clipped below at 1 - eps_low (0.2: at 0.8)",
    )
    add(
        "--clip-high",
        type=_optional_float,
        default=defaults.clip_high,
        help="eps_high: the ratio is clipped above at 1 + eps_high (None: eps_high = "
        "--clip-low; DAPO uses 0.28)",
    )
    add(
        "--reduction",
        choices=REDUCTIONS,
        default=defaults.reduction,
        help="how the per-token losses are reduced (docs/conventions.md, Reductions)",
    )
    add(
        "--sampler-temperature",
        type=float,
        default=defaults.sampler_temperature,
        help="GRPO: sampling temperature of the stand-in inference engine (1: same as the trainer)",
    )
    add(
        "--rollout-upper",
        type=float,
        default=defaults.rollout_upper,
        help="GRPO: truncation of the rollout-correction importance weights (TIS)",
    )


def _add_model_and_evaluation_options(add: _Add, defaults: DemoConfig) -> None:
    """The model's size, the held-out evaluation, threads and progress bars."""
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
    add(
        "--fsdp",
        action="store_true",
        help=(
            "shard the policy with FSDP2 (torch.distributed.fsdp.fully_shard) instead of "
            "DistributedDataParallel; samples and minibatches are drawn for the whole step from "
            "one stream, so any number of ranks trains on the same data as one process; writes "
            "the final parameters to parameters.pt (GRPO only)"
        ),
    )


def _validate(parser: argparse.ArgumentParser, values: argparse.Namespace) -> None:
    """Reject values out of range with a usage error (exit status 2) that names the option."""
    for name in _COUNTS:
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
    if values.fsdp and values.algorithm != "grpo":
        parser.error(f"--fsdp supports --algorithm grpo, got --algorithm {values.algorithm}")


def _config(values: argparse.Namespace) -> DemoConfig:
    """The run's settings from the parsed options (the others keep their defaults)."""
    return DemoConfig(
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
        fsdp=values.fsdp,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rlobjectives demo`` (also ``python -m rlobjectives.demo``); returns the exit status.

    0 after a complete run, 130 after Ctrl-C (outputs kept; a Ctrl-C before the run starts,
    while the plotting and progress-bar packages import, or while the outputs are written,
    prints one line, no traceback), 2 on a usage error, 1 when the ``demo`` extra (tqdm,
    matplotlib) is missing.
    """
    parser = build_parser()
    try:
        values = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        _validate(parser, values)
    except SystemExit as exit_:  # --help (0) or a usage error (2, message already printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        result = train(_config(values))
    except MissingExtraError as error:
        print(f"rlobjectives demo: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the run's own handler (imports, setup, writing)
        print(INTERRUPTED, file=sys.stderr)
        return 130
    return 130 if result.interrupted else 0


#: What ``rlobjectives demo`` prints for a Ctrl-C outside the run (the run reports its own).
INTERRUPTED = "rlobjectives demo: interrupted (Ctrl-C)"
