r"""The demo's stand-in for an inference engine, and the rollout correction of its samples.

Real trainers sample with an inference engine (vLLM, SGLang) whose log-probabilities differ
from the trainer's. Here the "engine" is the policy itself at a slightly different sampling
temperature :math:`\tau_s` (logits divided by :math:`\tau_s`): its log-probs of the sampled
tokens :math:`\ell^{rollout}` are what an engine would return with the samples. The trainer
recomputes them at temperature 1 (``old_log_probs``), :func:`rlobjectives.rollout_correction`
turns the ratio :math:`e^{\ell^{old} - \ell^{rollout}}` into truncated importance weights
(TIS), and the weights multiply the per-token policy loss before its reduction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import RolloutCorrection, RolloutCorrectionMetrics, rollout_correction
from ..distributed import sum_diagnostics
from .config import Forward

__all__ = [
    "METRIC_KEYS",
    "correct",
    "engine_forward",
    "plot_rollout",
    "step_metrics",
]

#: The keys this module adds to every line of ``metrics.jsonl``.
METRIC_KEYS = (
    "rollout_effective_sample_size",
    "rollout_truncated_fraction",
    "rollout_ratio_mean",
    "rollout_ratio_min",
    "rollout_ratio_max",
    "rollout_kl",
)


def engine_forward(forward: Forward, temperature: float) -> Forward:
    """The engine's forward: the policy's logits divided by the sampling temperature."""
    if temperature == 1.0:
        return forward

    def tempered(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return forward(model, tokens, mask) / temperature

    return tempered


def correct(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    upper: float,
) -> RolloutCorrection:
    """Token-level truncated importance weights ``min(exp(old - rollout), upper)`` (TIS)."""
    return rollout_correction(old_log_probs, rollout_log_probs, mask, upper=upper)


def step_metrics(metrics: Sequence[RolloutCorrectionMetrics]) -> dict[str, float]:
    """ESS, truncated fraction, raw ratio mean/min/max and KL(engine || trainer), all ranks."""
    total = sum_diagnostics(list(metrics))  # sums and counts added, extremes min/max
    return {
        "rollout_effective_sample_size": float(total.effective_sample_size),
        "rollout_truncated_fraction": float(total.truncated_fraction),
        "rollout_ratio_mean": float(total.ratio_mean),
        "rollout_ratio_min": float(total.ratio_min),
        "rollout_ratio_max": float(total.ratio_max),
        "rollout_kl": float(total.kl_k3),
    }


def plot_rollout(axis: Any, history: Sequence[dict[str, Any]]) -> None:
    """One panel: effective sample size, truncated fraction and the raw ratio's range per step."""
    steps = [entry["step"] for entry in history]
    for key, label in (
        ("rollout_effective_sample_size", "effective sample size"),
        ("rollout_truncated_fraction", "fraction truncated (ratio > upper)"),
        ("rollout_ratio_max", "max ratio pi_train / pi_engine"),
        ("rollout_ratio_min", "min ratio"),
    ):
        axis.plot(steps, [entry[key] for entry in history], label=label)
    axis.set_title("rollout correction (engine vs trainer, per token)")
    axis.set_ylim(bottom=0)
