"""rlobjectives: exact, padding-safe PyTorch objectives for RL post-training of language models.

Shape letters used throughout: B sequences, T response tokens, V vocabulary, G group size,
H hidden size. Masks have the shape of the log-probabilities and True/nonzero selects a token.
"""

from importlib.metadata import PackageNotFoundError, version

from ._advantages import (
    GAEOutput,
    gae,
    group_relative_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from ._alignment import (
    ResponseAlignment,
    ResponseLogProbs,
    response_alignment,
    response_log_probs,
)
from ._kl import BiasedGradientWarning, kl_estimate, kl_loss
from ._kl_rewards import kl_penalized_token_rewards
from ._lm_head import TokenLogProbsOutput, token_log_probs_from_hidden
from ._lm_head_loss import FusedPolicyLossOutput, fused_policy_loss_from_hidden
from ._logits import full_vocab_kl, full_vocab_kl_loss, token_entropy, token_log_probs
from ._masking import masked_mean, masked_sum
from ._off_policy import off_policy_sequence_mask
from ._policy import policy_loss
from ._policy_args import PolicyLossDiagnostics, PolicyLossOutput
from ._reduction import Reduction, aggregate
from ._rollout import RolloutCorrection, rollout_correction
from ._rollout_metrics import RolloutCorrectionMetrics
from ._specified import grpo_clipped_surrogate, kl_penalized_rewards
from .distributed import (
    Normalizers,
    data_parallel_loss_scale,
    global_normalizers,
    normalizer_for_reduction,
    sum_diagnostics,
)

try:
    __version__ = version("rlobjectives")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "BiasedGradientWarning",
    "FusedPolicyLossOutput",
    "GAEOutput",
    "Normalizers",
    "PolicyLossDiagnostics",
    "PolicyLossOutput",
    "Reduction",
    "ResponseAlignment",
    "ResponseLogProbs",
    "RolloutCorrection",
    "RolloutCorrectionMetrics",
    "TokenLogProbsOutput",
    "__version__",
    "aggregate",
    "data_parallel_loss_scale",
    "full_vocab_kl",
    "full_vocab_kl_loss",
    "fused_policy_loss_from_hidden",
    "gae",
    "global_normalizers",
    "group_relative_advantages",
    "grpo_clipped_surrogate",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalized_token_rewards",
    "masked_mean",
    "masked_sum",
    "normalizer_for_reduction",
    "off_policy_sequence_mask",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "response_alignment",
    "response_log_probs",
    "rloo_advantages",
    "rollout_correction",
    "sum_diagnostics",
    "token_entropy",
    "token_log_probs",
    "token_log_probs_from_hidden",
]
