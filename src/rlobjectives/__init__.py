"""rlobjectives: exact, padding-safe PyTorch objectives for RL post-training of language models.

Shape letters used throughout: B sequences, T response tokens, V vocabulary, G group size,
H hidden size; packed (padding-free) batches: N tokens of S sequences with ``cu_seqlens``.
Masks have the shape of the log-probabilities and True/nonzero selects a token.
"""

from importlib.metadata import PackageNotFoundError, version

from ._advantages import GAEOutput, gae, reinforce_plus_plus_advantages
from ._alignment import (
    ResponseAlignment,
    ResponseLogProbs,
    response_alignment,
    response_log_probs,
)
from ._entropy import top_entropy_mask
from ._kl import BiasedGradientWarning
from ._kl_control import AdaptiveKLController, FixedKLController
from ._kl_loss import kl_estimate, kl_loss
from ._kl_rewards import kl_penalized_token_rewards
from ._lm_head import TokenLogProbsOutput, token_log_probs_from_hidden
from ._lm_head_loss import FusedPolicyLossOutput, fused_policy_loss_from_hidden
from ._logits import full_vocab_kl, full_vocab_kl_loss, token_entropy, token_log_probs
from ._masking import masked_mean, masked_sum
from ._off_policy import off_policy_sequence_mask
from ._outcome_advantages import (
    group_relative_advantages,
    opo_advantages,
    passk_advantages,
    remax_advantages,
    rloo_advantages,
)
from ._packing import PackedTokens, UnpackedTokens, pack, unpack
from ._policy import policy_loss
from ._policy_args import PolicyLossDiagnostics, PolicyLossOutput
from ._reduction import Reduction, aggregate
from ._rollout import RolloutCorrection, rollout_correction
from ._rollout_metrics import RolloutCorrectionMetrics
from ._specified import grpo_clipped_surrogate, kl_penalized_rewards
from ._value import ValueLossDiagnostics, ValueLossOutput, value_loss
from ._whitening import masked_whiten
from .distributed import (
    Normalizers,
    data_parallel_loss_scale,
    global_masked_whiten,
    global_normalizers,
    global_top_entropy_mask,
    normalizer_for_reduction,
    sum_diagnostics,
)

try:
    __version__ = version("rlobjectives")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AdaptiveKLController",
    "BiasedGradientWarning",
    "FixedKLController",
    "FusedPolicyLossOutput",
    "GAEOutput",
    "Normalizers",
    "PackedTokens",
    "PolicyLossDiagnostics",
    "PolicyLossOutput",
    "Reduction",
    "ResponseAlignment",
    "ResponseLogProbs",
    "RolloutCorrection",
    "RolloutCorrectionMetrics",
    "TokenLogProbsOutput",
    "UnpackedTokens",
    "ValueLossDiagnostics",
    "ValueLossOutput",
    "__version__",
    "aggregate",
    "data_parallel_loss_scale",
    "full_vocab_kl",
    "full_vocab_kl_loss",
    "fused_policy_loss_from_hidden",
    "gae",
    "global_masked_whiten",
    "global_normalizers",
    "global_top_entropy_mask",
    "group_relative_advantages",
    "grpo_clipped_surrogate",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalized_token_rewards",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "normalizer_for_reduction",
    "off_policy_sequence_mask",
    "opo_advantages",
    "passk_advantages",
    "pack",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "remax_advantages",
    "response_alignment",
    "response_log_probs",
    "rloo_advantages",
    "rollout_correction",
    "sum_diagnostics",
    "token_entropy",
    "token_log_probs",
    "token_log_probs_from_hidden",
    "top_entropy_mask",
    "unpack",
    "value_loss",
]
