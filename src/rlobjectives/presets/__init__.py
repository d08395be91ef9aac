"""Drop-in presets: the peers' losses (TRL, verl, OpenRLHF) as mappings onto library calls.

Each preset takes a peer's options under the peer's names and returns a function whose result
equals the peer's loss, value and gradient, for the same tensors, with the peer's metric names:

- :func:`trl_grpo_loss`: TRL ``GRPOTrainer._compute_loss`` (every ``loss_type``: grpo, bnpo,
  dr_grpo, dapo, luspo, cispo, sapo, vespo; token and sequence level; ``beta`` with
  ``use_bias_correction_kl``; ``delta``; ``top_entropy_quantile``; ``entropy_coef``;
  ``off_policy_mask_threshold``; the vLLM ``importance_sampling_ratio``).
- :func:`verl_policy_loss`: verl 0.9.1's registered policy losses (every ``loss_mode``:
  vanilla, gspo, cispo, sapo, geo_mean, gpg, dppo_tv, dppo_kl, clip_cov, kl_cov, dro,
  bypass_mode; every ``loss_agg_mode`` with ``global_batch_info``), with verl's signature for
  ``register_policy_loss`` (:mod:`rlobjectives.integrations.verl` registers them).
- :func:`openrlhf_policy_loss`: OpenRLHF 0.11.2's ``PolicyLoss`` (ppo, gspo, dual clip, the
  IS correction at every level, mode and gating, the five-value ``forward``;
  :mod:`rlobjectives.integrations.openrlhf` installs it in the actor).
- :func:`trl_dpo_loss`: TRL's ``DPOTrainer`` loss (every ``loss_type`` and combination, the
  f-divergences, ``ld_alpha``, ``use_weighting``), :func:`trl_reward_loss` (``RewardTrainer``);
  :func:`openrlhf_dpo_loss`, :func:`openrlhf_pairwise_loss`, :func:`openrlhf_log_exp_loss`
  (OpenRLHF's ``DPOLoss``, ``PairWiseLoss``, ``LogExpLoss``).
- :func:`trl_grpo_advantages`: TRL's advantages with ``multi_objective_aggregation``
  (``sum_then_normalize``, ``normalize_then_sum``) and ``scale_rewards``;
  :func:`verl_gdpo_advantages`: verl's ``adv_estimator="gdpo"``; :func:`verl_gpg_advantages`:
  verl's ``adv_estimator="gpg"``; :func:`verl_optimal_token_baseline_advantages`: verl's
  ``"optimal_token_baseline"`` and ``"tir_optimal_token_baseline"``.
- :func:`verl_distillation_loss`: verl's distillation losses (``forward_kl_topk``, the
  estimators, ``use_policy_gradient``, the clamps); :func:`trl_generalized_jsd_loss` (TRL GKD /
  GOLD) and :func:`trl_server_forward_kl_loss` (TRL server distillation, ``loss_add_tail``).
- :func:`trl_sft_loss`: TRL's ``SFTTrainer`` loss for ``SFTConfig.loss_type`` ``"nll"`` and
  ``"dft"`` (:func:`rlobjectives.dft_loss`).

The presets import torch only (never the peers). Each is a table of peer options -> calls of
the public API; see ``docs/objectives/drop-in.md`` for what is covered and the peer options
left out.
"""

from ._advantages import (
    VerlAdvantageOutput,
    trl_grpo_advantages,
    verl_gdpo_advantages,
    verl_gpg_advantages,
    verl_optimal_token_baseline_advantages,
)
from ._distillation import (
    VerlDistillationLoss,
    trl_generalized_jsd_loss,
    trl_server_forward_kl_loss,
    verl_distillation_loss,
)
from ._openrlhf import OpenRLHFPolicyLoss, OpenRLHFPolicyLossOutput, openrlhf_policy_loss
from ._openrlhf_preference import (
    OpenRLHFDPOLoss,
    OpenRLHFPairwiseLoss,
    openrlhf_dpo_loss,
    openrlhf_log_exp_loss,
    openrlhf_pairwise_loss,
)
from ._preference import (
    TRLDPOLoss,
    TRLPreferenceOutput,
    TRLRewardLoss,
    trl_dpo_loss,
    trl_reward_loss,
)
from ._sft import TRLSFTLoss, trl_sft_loss
from ._trl import TRLGRPOLoss, TRLLossOutput, trl_grpo_loss
from ._verl import VerlLossOutput, VerlPolicyLoss, verl_policy_loss

__all__ = [
    "OpenRLHFDPOLoss",
    "OpenRLHFPairwiseLoss",
    "OpenRLHFPolicyLoss",
    "OpenRLHFPolicyLossOutput",
    "TRLDPOLoss",
    "TRLGRPOLoss",
    "TRLLossOutput",
    "TRLSFTLoss",
    "TRLPreferenceOutput",
    "TRLRewardLoss",
    "VerlAdvantageOutput",
    "VerlDistillationLoss",
    "VerlLossOutput",
    "VerlPolicyLoss",
    "openrlhf_dpo_loss",
    "openrlhf_log_exp_loss",
    "openrlhf_pairwise_loss",
    "openrlhf_policy_loss",
    "trl_dpo_loss",
    "trl_generalized_jsd_loss",
    "trl_grpo_advantages",
    "trl_grpo_loss",
    "trl_sft_loss",
    "trl_reward_loss",
    "trl_server_forward_kl_loss",
    "verl_distillation_loss",
    "verl_gdpo_advantages",
    "verl_gpg_advantages",
    "verl_optimal_token_baseline_advantages",
    "verl_policy_loss",
]
