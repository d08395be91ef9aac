"""A pytest plugin: verl 0.9.1's own ``tests/trainer`` with the presets swapped in.

Loaded with ``-p _verl_suite_plugin`` (``tests/integrations/test_verl_own_suite.py``). Before
verl's test modules import them, every registered policy loss (``core_algos.
compute_policy_loss_<mode>`` and ``POLICY_LOSS_REGISTRY[<mode>]``) becomes
``rlobjectives.presets.verl_policy_loss(<mode>)`` (metrics read as Python floats, as verl's
functions return them), and ``rollout_corr_helper.compute_rollout_correction_and_rejection_mask``
becomes the bypass-mode correction of the preset (``rollout_options`` + ``bypass_correction``),
so that verl's own assertions (values, metrics, error types and wording) run on the presets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import verl.trainer.ppo.core_algos as core_algos
import verl.trainer.ppo.rollout_corr_helper as helper
from verl import DataProto

from rlobjectives.presets import verl_policy_loss
from rlobjectives.presets._verl import VERL_LOSS_MODES
from rlobjectives.presets._verl_rollout import bypass_correction, rollout_options

SWAPPED: list[str] = []


def _preset(mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    preset = verl_policy_loss(mode)

    def loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out = preset(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                     rollout_is_weights)  # fmt: skip
        return out.loss, {key: float(value) for key, value in out.metrics.items()}

    loss.__name__ = f"compute_policy_loss_{mode}"
    return loss


def _correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    **options: Any,
) -> tuple[Any, torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_correction_and_rejection_mask`` by the preset."""
    parsed = rollout_options({"policy_loss": {"rollout_correction": options}})
    out = bypass_correction(old_log_prob, rollout_log_prob, response_mask.bool(), parsed)
    weights = None
    if out.weights is not None:
        weights = DataProto.from_dict(tensors={"rollout_is_weights": out.weights})
    metrics = {key: float(value) for key, value in out.metrics.items()}
    return weights, out.mask.to(response_mask.dtype), metrics


for _mode in VERL_LOSS_MODES:
    _name = f"compute_policy_loss_{_mode}"
    _loss = _preset(_mode)
    if hasattr(core_algos, _name):
        setattr(core_algos, _name, _loss)
        SWAPPED.append(_name)
    core_algos.POLICY_LOSS_REGISTRY[_mode] = _loss
helper.compute_rollout_correction_and_rejection_mask = _correction  # type: ignore[assignment]
SWAPPED.append("compute_rollout_correction_and_rejection_mask")


def pytest_report_header() -> str:
    """Name what was swapped in the run's header."""
    return f"rlobjectives presets swapped in: {', '.join(SWAPPED)}"
