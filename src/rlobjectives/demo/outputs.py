"""What a demo run leaves behind: ``metrics.jsonl``, ``summary.json``, the figure, a summary line.

The plotting and progress-bar packages (the ``demo`` extra: tqdm, matplotlib) are imported only
when a run starts (:func:`require_extras`), so the library imports without them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from . import rollout
from .config import DemoConfig, DemoResult

__all__ = [
    "MetricsLog",
    "MissingExtraError",
    "metrics_entry",
    "figure_title",
    "require_extras",
    "write_figure",
    "write_outputs",
]

_MISSING_EXTRA = (
    "rlobjectives demo needs the optional packages tqdm and matplotlib, which are not "
    "installed ({error}); install them with: pip install 'rlobjectives[demo]'"
)


class MissingExtraError(ImportError):
    """tqdm or matplotlib (the ``demo`` extra) is not installed."""


def require_extras() -> tuple[Any, Any]:
    """Import tqdm and matplotlib (Agg backend) or raise a clear error.

    Returns:
        ``tqdm.tqdm`` and ``matplotlib.pyplot``.

    Raises:
        MissingExtraError: tqdm or matplotlib is not installed.
    """
    try:
        tqdm = importlib.import_module("tqdm")
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as error:
        raise MissingExtraError(_MISSING_EXTRA.format(error=error)) from None
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    return tqdm.tqdm, pyplot


def metrics_entry(
    step: int, metrics: Mapping[str, float], heldout_accuracy: float | None, elapsed_s: float
) -> dict[str, Any]:
    """One line of ``metrics.jsonl``: the step, its metrics, the held-out accuracy, the time.

    Args:
        step: the step number (from 1).
        metrics: what the step function returned (rounded to 6 decimals here).
        heldout_accuracy: the held-out accuracy if the step was evaluated, else None.
        elapsed_s: seconds since the run started (rounded to milliseconds here).
    """
    return {
        "step": step,
        **{key: round(value, 6) for key, value in metrics.items()},
        "heldout_accuracy": None if heldout_accuracy is None else round(heldout_accuracy, 6),
        "elapsed_s": round(elapsed_s, 3),
    }


class MetricsLog:
    """``metrics.jsonl``, one JSON line per step, flushed at once (kept after Ctrl-C).

    A log without a path (the ranks other than 0) writes nothing.
    """

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("w", encoding="utf-8") if path is not None else None

    def write(self, entry: Mapping[str, Any]) -> None:
        """Append one line and flush it."""
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (nothing without a path)."""
        if self._file is not None:
            self._file.close()


def write_figure(
    pyplot: Any,
    history: Sequence[dict[str, Any]],
    reference_accuracy: float,
    path: Path,
    title: str = "",
) -> None:
    """Save the reward, accuracy, KL, clip-fraction and rollout-correction curves as one PNG.

    ``title``: the figure's title (what was run: :func:`figure_title`). Each panel's legend
    sits below its axes, so it never covers a curve; the step axis has integer ticks.
    """
    from matplotlib.ticker import MaxNLocator  # matplotlib is imported: the run started

    critic = "value_loss" in history[0]  # PPO: a third column for the critic and the KL coef
    corrected = "rollout_effective_sample_size" in history[0]  # GRPO: the rollout correction
    columns = 3 if critic or corrected else 2
    figure, axes = pyplot.subplots(
        2, columns, figsize=(15 if columns == 3 else 10, 9), layout="constrained"
    )
    if critic:
        from .ppo import plot_critic

        plot_critic(axes[0, 2], axes[1, 2], history)
    elif corrected:
        rollout.plot_rollout(axes[0, 2], history)
        axes[1, 2].set_visible(False)
    _plot_training(axes[:, :2].flat, history, reference_accuracy)
    for axis in axes.flat:
        if not axis.get_visible():
            continue
        axis.set_xlabel("PPO step" if critic else "GRPO step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        axis.grid(alpha=0.3)
        axis.legend(
            fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False
        )
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def figure_title(config: DemoConfig, result: DemoResult) -> str:
    """What the figure shows, for a reader who did not run it: algorithm, task, seed, settings."""
    high = config.clip_low if config.clip_high is None else config.clip_high
    status = ", interrupted" if result.interrupted else ""
    return (
        f"rlobjectives demo: {config.algorithm.upper()} on the {config.task!r} digit task "
        f"(length {config.length}), seed {config.seed}: {result.steps_completed}/{config.steps} "
        f"steps on {result.world_size} process(es){status}\n"
        f"{config.prompts_per_step} prompts x {config.group_size} completions per step, "
        f"reduction {config.reduction}, ratio clip [1 - {config.clip_low:g}, 1 + {high:g}], "
        f"KL beta {config.beta:g}, lr {config.lr:g}"
    )


def _plot_training(
    panels: Any, history: Sequence[dict[str, Any]], reference_accuracy: float
) -> None:
    """The four panels every run has: reward, accuracy, KL to the reference, clip fraction."""
    reward, accuracy, kl, clip = panels
    steps = [entry["step"] for entry in history]
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


def write_outputs(
    pyplot: Any, config: DemoConfig, result: DemoResult, out: Path, stream: TextIO | None
) -> None:
    """Write the figure and ``summary.json`` and print a short summary."""
    if result.history:
        title = figure_title(config, result)
        write_figure(pyplot, result.history, result.reference_accuracy, out / "metrics.png", title)
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
        f"({_written(len(result.history))})",
        file=print_stream,
    )


def _written(steps: int) -> str:
    """What the run left in its folder: the figure only when a step was completed."""
    if steps == 0:
        return "summary.json; metrics.jsonl is empty and no metrics.png: no RL step completed"
    lines = "line" if steps == 1 else "lines"
    return f"metrics.jsonl ({steps} {lines}), metrics.png, summary.json"


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 6)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
