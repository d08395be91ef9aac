r"""The rows of :func:`rlobjectives.presets.trl_grpo_loss`: one per TRL ``loss_type``.

Each row names the ``policy_loss`` keywords of the surrogate (built from the preset's options),
the normaliser TRL divides by (a :class:`ReductionArgs` of the call's batch), the metrics TRL
logs, and how TRL's weights and logged ``policy_loss`` enter. See :mod:`._trl` for the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._core.validation import Scalar, validate_scalar
from ..policy.surrogates import CISPO, SAPO, VESPO, Clip
from ._common import ReductionArgs
from ._trl_metrics import MetricInputs, cispo_metrics, clip_metrics, no_metrics, vespo_metrics

if TYPE_CHECKING:
    from ._trl import TRLGRPOLoss

__all__ = ["TRL_LOSS_TYPES", "Batch", "LossType"]


class Batch(NamedTuple):
    """The call-dependent quantities of TRL's normalisers."""

    rows: int
    num_items: Scalar | None
    processes: int
    accumulation: int
    steps_per_generation: int
    max_completion_length: int | None


def _sequence_mean(batch: Batch) -> ReductionArgs:
    return ReductionArgs("sequence_mean", normalizer=max(batch.rows, 1) * batch.accumulation)


def _local_token_mean(batch: Batch) -> ReductionArgs:
    return ReductionArgs("token_mean", divisor=float(batch.accumulation))


def _constant_length(batch: Batch) -> ReductionArgs:
    rows = max(batch.rows, 1) * batch.accumulation
    return ReductionArgs("sequence_sum_normalized", rows, batch.max_completion_length)


def _generation_token_mean(batch: Batch) -> ReductionArgs:
    window = batch.accumulation / batch.steps_per_generation  # TRL >= 1.10: GA / spg
    if batch.num_items is None:  # this call holds the whole generation batch
        return ReductionArgs("token_mean", divisor=batch.processes**-1 * window)
    # TRL's count (a 0-d tensor or a number), checked under its name where it is read
    items = validate_scalar(batch.num_items, "num_items_in_batch", minimum=0.0)
    items = items.clamp(min=1) if isinstance(items, torch.Tensor) else max(items, 1)
    return ReductionArgs("token_mean", normalizer=items / batch.processes * window)


def _length_weighted(batch: Batch) -> ReductionArgs:
    return ReductionArgs("length_weighted", normalizer=max(batch.rows, 1) * batch.accumulation)


def _clip(loss: TRLGRPOLoss) -> dict[str, Any]:
    return {
        # TRL's delta: min(r, delta) in the unclipped branch, any delta > 1
        "surrogate": Clip(low=loss.epsilon, high=loss.epsilon_high, delta=loss.delta),
        "ratio_level": loss.importance_sampling_level,
        "log_ratio_bound": None,  # TRL exponentiates the raw log-ratio
    }


def _cispo(loss: TRLGRPOLoss) -> dict[str, Any]:
    return {
        "surrogate": CISPO(cap=loss.epsilon_high),  # TRL: an absolute cap on r, not 1 + eps
        "ratio_level": loss.importance_sampling_level,
        "log_ratio_bound": None,
    }


def _sapo(loss: TRLGRPOLoss) -> dict[str, Any]:
    return {
        "surrogate": SAPO(
            temperature_pos=loss.sapo_temperature_pos,
            temperature_neg=loss.sapo_temperature_neg,
        ),
        "ratio_level": loss.importance_sampling_level,
        "log_ratio_bound": None,
    }


def _vespo(loss: TRLGRPOLoss) -> dict[str, Any]:
    k_pos, lambda_pos, k_neg, lambda_neg = loss.vespo
    return {
        # its own sequence ratio (a sum), whatever the level
        "surrogate": VESPO(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg),
        "log_ratio_bound": 20.0,  # get_gamma_weights clamps each log-ratio to +-20
    }


class LossType(NamedTuple):
    """One TRL ``loss_type``.

    ``per_sequence_value``: at sequence level the loss is one value per sequence that TRL
    spreads over the tokens (clip, sapo; cispo multiplies each token's log-prob). ``per_call``:
    the logged ``policy_loss`` is the returned one (dapo, cispo, vespo); otherwise TRL logs it
    before dividing by GA. ``folds_weights``: the surrogate takes the importance weights into
    its own formula (vespo), so TRL's 0/1 masks multiply its per-token loss instead.
    """

    options: Callable[[TRLGRPOLoss], dict[str, Any]]
    reduction: Callable[[Batch], ReductionArgs]
    metrics: Callable[[MetricInputs], dict[str, torch.Tensor]]
    per_sequence_value: bool = True
    per_call: bool = False
    folds_weights: bool = False


#: TRL ``loss_type`` -> (surrogate options, normaliser, metrics, how weights and logs enter).
TRL_LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(_clip, _sequence_mean, clip_metrics),
    "bnpo": LossType(_clip, _local_token_mean, clip_metrics),
    "dr_grpo": LossType(_clip, _constant_length, clip_metrics),
    "dapo": LossType(_clip, _generation_token_mean, clip_metrics, per_call=True),
    "luspo": LossType(_clip, _length_weighted, clip_metrics),
    "cispo": LossType(_cispo, _generation_token_mean, cispo_metrics, False, per_call=True),
    "sapo": LossType(_sapo, _sequence_mean, no_metrics),
    "vespo": LossType(_vespo, _generation_token_mean, vespo_metrics, False, True, True),
}
