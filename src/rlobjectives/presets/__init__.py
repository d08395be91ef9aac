"""Drop-in presets: the peers' losses (TRL, verl, OpenRLHF) as mappings onto library calls.

Each preset takes a peer's options under the peer's names and returns a function whose result
equals the peer's loss, value and gradient, for the same tensors, with the peer's metric names:

- :func:`trl_grpo_loss`: TRL ``GRPOTrainer._compute_loss`` (``loss_type`` grpo, bnpo, dr_grpo,
  dapo, luspo; token and sequence level; ``beta`` with ``use_bias_correction_kl``; ``delta``).
- :func:`verl_policy_loss`: verl's registered policy losses (``loss_mode`` vanilla, gspo, gpg,
  every ``loss_agg_mode``), with verl's signature for ``register_policy_loss``.
- :func:`openrlhf_policy_loss`: OpenRLHF's ``PolicyLoss`` (ppo, gspo, dual clip).

The presets import torch only (never the peers). Options that need a library feature this
version lacks raise ``NotImplementedError`` naming it; nothing is approximated. See
``docs/objectives.md``, section "Drop-in".
"""

from ._openrlhf import OpenRLHFPolicyLoss, OpenRLHFPolicyLossOutput, openrlhf_policy_loss
from ._trl import TRLGRPOLoss, TRLLossOutput, trl_grpo_loss
from ._verl import VerlLossOutput, VerlPolicyLoss, verl_policy_loss

__all__ = [
    "OpenRLHFPolicyLoss",
    "OpenRLHFPolicyLossOutput",
    "TRLGRPOLoss",
    "TRLLossOutput",
    "VerlLossOutput",
    "VerlPolicyLoss",
    "openrlhf_policy_loss",
    "trl_grpo_loss",
    "verl_policy_loss",
]
