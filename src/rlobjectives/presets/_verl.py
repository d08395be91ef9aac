r"""verl 0.9.1's registered policy losses (``verl/trainer/ppo/core_algos.py``) as library calls.

:func:`verl_policy_loss` returns a function with verl's registered signature
``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
rollout_is_weights=None) -> (loss, metrics)``; register it with
``verl.trainer.ppo.core_algos.register_policy_loss(name)(fn)``. One row per ``loss_mode`` in
:data:`VERL_LOSS_MODES`, one per ``loss_agg_mode`` in :data:`VERL_AGGREGATIONS`.

The ``loss_agg_mode`` table is :mod:`rlobjectives.presets._verl_config`, the formula of each
``loss_mode`` :mod:`rlobjectives.presets._verl_modes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.validation import checks_environment, validate_choice
from ._common import as_bool_mask, float64_if_any, promote
from ._verl_config import FORCED_AGGREGATIONS, VERL_AGGREGATIONS, check_config, global_info
from ._verl_modes import VERL_LOSS_MODES, VerlCall, VerlLossOutput

__all__ = ["VERL_AGGREGATIONS", "VERL_LOSS_MODES", "VerlPolicyLoss"]
__all__ += ["VerlLossOutput", "verl_policy_loss"]


@dataclass(frozen=True)
class VerlPolicyLoss:
    """A verl policy loss (built by :func:`verl_policy_loss`), callable with verl's signature."""

    loss_mode: str

    @checks_environment
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: object = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> VerlLossOutput:
        """The ``(pg_loss, pg_metrics)`` of verl for these tensors (:func:`verl_policy_loss`)."""
        check_config(config, self.loss_mode)
        mode = VERL_LOSS_MODES[self.loss_mode]
        # checked for every mode, also those that force their own aggregation (verl's
        # ActorConfig refuses an unknown loss_agg_mode whatever the loss_mode)
        validate_choice(loss_agg_mode, "loss_agg_mode", tuple(VERL_AGGREGATIONS))
        aggregation = mode.forced_aggregation or loss_agg_mode
        wide = float64_if_any(old_log_prob, log_prob, advantages, rollout_is_weights)
        old_log_prob, log_prob, advantages = (
            promote(t, wide) for t in (old_log_prob, log_prob, advantages)
        )
        rollout_is_weights = promote(rollout_is_weights, wide)
        mask = as_bool_mask(response_mask, log_prob)
        args = FORCED_AGGREGATIONS[aggregation](mask, global_info(config))
        call = VerlCall(
            old_log_prob, log_prob, advantages, mask, config, rollout_is_weights, aggregation
        )
        return mode.loss(call, args)


@checks_environment
def verl_policy_loss(loss_mode: str = "vanilla") -> VerlPolicyLoss:
    r"""The registered verl policy loss ``loss_mode``, built from library calls.

    The returned function has verl's signature ``(old_log_prob, log_prob, advantages,
    response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None) ->
    (loss, metrics)`` and can be registered with ``register_policy_loss``. ``config`` is any
    object (or mapping) with verl's names: ``clip_ratio``, ``clip_ratio_low``,
    ``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``, ``tau_neg``, ``global_batch_info``
    (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) and
    ``policy_loss`` (``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``,
    ``ppo_kl_coef``, ``dro_beta``, ``rollout_correction``); missing values take the defaults
    of verl's code (0.2, 0.2, 0.2, 3.0, 1.0, 1.05, local counts; 0.0002, 1.0, 5.0, 0.0002,
    1.0, none).

    Each ``loss_mode`` is one :func:`rlobjectives.policy_loss` call with a surrogate object
    (vanilla ``Clip(dual=clip_ratio_c)``, gspo ``Clip`` at ``ratio_level="sequence"``, cispo
    ``CISPO``, sapo ``SAPO``, geo_mean ``GMPO``, gpg ``-A·log_prob``, dppo_tv / dppo_kl
    ``DPPO``, clip_cov ``ClipCov`` with verl's draw, kl_cov ``KLCov``, dro ``DRO``, bypass_mode
    :func:`rlobjectives.rollout_correction` then vanilla or REINFORCE) with verl's metric keys;
    ``rollout_is_weights`` multiply the per-token loss (``importance_weights=``). Each mode's
    call, bounds and metrics: ``docs/objectives/drop-in.md`` ("What each loss_mode computes").
    Tested against verl 0.9.1's own functions and inside its real training step.

    Args:
        loss_mode: a verl 0.9.1 ``loss_mode``: ``"vanilla"``, ``"gspo"``, ``"cispo"``,
            ``"sapo"``, ``"geo_mean"``, ``"gpg"``, ``"dppo_tv"``, ``"dppo_kl"``,
            ``"clip_cov"``, ``"kl_cov"``, ``"dro"``, ``"bypass_mode"`` (every mode verl
            registers; :data:`VERL_LOSS_MODES`).

    Returns:
        A :class:`VerlPolicyLoss`.

    Raises:
        ValueError: an unknown ``loss_mode``; at call time (verl passes ``config`` with the
            tensors) an unknown ``loss_agg_mode`` (every mode, also those that force their own),
            ``dp_size > 1`` without the global count the mode needs (as verl), or a ``config``
            value that is non-finite or out of range, named as verl names it, in every mode
            (``clip_ratio_low`` outside ``[0, 1)``, ``clip_ratio_c <= 1``, ``tau_pos <= 0``,
            ``global_batch_info['dp_size']`` not a positive whole number,
            ``policy_loss.dro_beta`` not positive (missing in ``"dro"``),
            ``policy_loss.clip_cov_ratio`` / ``kl_cov_ratio`` outside ``(0, 1]``,
            ``clip_cov_lb >= clip_cov_ub``; for ``"dppo_tv"`` ``clip_ratio_high``, or the
            ``clip_ratio`` it defaults to, above 1...).
        TypeError: at call time, a ``config`` value that is not a number.

    Examples:
        >>> import torch
        >>> loss_fn = verl_policy_loss("vanilla")
        >>> log_prob = torch.zeros(1, 2, requires_grad=True)
        >>> mask = torch.ones(1, 2)
        >>> loss, metrics = loss_fn(torch.zeros(1, 2), log_prob, torch.ones(1, 2), mask)
        >>> loss
        tensor(-1., grad_fn=<...>)
    """
    validate_choice(loss_mode, "loss_mode", tuple(VERL_LOSS_MODES))
    return VerlPolicyLoss(loss_mode)
