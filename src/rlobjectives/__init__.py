"""rlobjectives: exact, padding-safe PyTorch objectives for RL post-training of language models.

Shape letters used throughout: B sequences, T response tokens, V vocabulary, G group size,
H hidden size; packed (padding-free) batches: N tokens of S sequences with ``cu_seqlens``.
Masks have the shape of the log-probabilities and True/nonzero selects a token.
"""

from importlib.metadata import PackageNotFoundError, version

from ._core.backend import use_backend
from ._core.packing import PackedTokens, UnpackedTokens, pack, unpack
from ._core.reduction import Reduction, aggregate, masked_mean, masked_sum
from .advantages.gae import GAEOutput, gae, reinforce_plus_plus_advantages
from .advantages.gdpo import gdpo_advantages
from .advantages.length import length_adaptive_lambda, overlong_penalty
from .advantages.maxrl import maxrl_advantages
from .advantages.otb import OptimalTokenBaselineOutput, optimal_token_baseline_advantages
from .advantages.outcome import (
    group_relative_advantages,
    opo_advantages,
    passk_advantages,
    remax_advantages,
    rloo_advantages,
)
from .advantages.whitening import masked_whiten
from .distillation import (
    generalized_jsd_loss,
    generalized_jsd_loss_from_hidden,
    reverse_kl_loss,
    reverse_kl_loss_from_hidden,
    reverse_kl_rewards,
    topk_forward_kl,
    topk_forward_kl_from_hidden,
)
from .distributed import (
    Normalizers,
    data_parallel_loss_scale,
    global_cov_selection,
    global_m2po_mask,
    global_masked_whiten,
    global_normalizers,
    global_top_entropy_mask,
    normalizer_for_reduction,
    sum_diagnostics,
)
from .kl.control import AdaptiveKLController, FixedKLController
from .kl.estimators import BiasedGradientWarning
from .kl.loss import kl_estimate, kl_loss
from .kl.rewards import kl_penalized_token_rewards
from .logprobs.alignment import (
    ResponseAlignment,
    ResponseLogProbs,
    ResponseStatistics,
    response_alignment,
    response_log_probs,
)
from .logprobs.hidden import TokenLogProbsOutput, token_log_probs_from_hidden
from .logprobs.logits import full_vocab_kl, full_vocab_kl_loss, token_entropy, token_log_probs
from .logprobs.statistics import LogProbStatistics
from .logprobs.vocab_parallel import VocabParallel
from .policy.entropy import top_entropy_mask
from .policy.from_hidden import FusedPolicyLossOutput, fused_policy_loss_from_hidden
from .policy.inputs import PolicyLossDiagnostics, PolicyLossOutput
from .policy.loss import policy_loss
from .policy.nll import nll_loss
from .policy.seeds import grpo_clipped_surrogate, kl_penalized_rewards
from .policy.selection import CovSelection, cov_selection, m2po_mask
from .policy.surrogates import (
    CISPO,
    DPPO,
    DRO,
    GMPO,
    M2PO,
    SAPO,
    VESPO,
    Clip,
    ClipCov,
    KLCov,
    SurrogateObjective,
)
from .rollout.correction import RolloutCorrection, rollout_correction
from .rollout.metrics import RolloutCorrectionMetrics
from .rollout.off_policy import off_policy_sequence_mask
from .value.loss import ValueLossDiagnostics, ValueLossOutput, value_loss

try:
    __version__ = version("rlobjectives")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "CISPO",
    "DPPO",
    "DRO",
    "GMPO",
    "M2PO",
    "SAPO",
    "VESPO",
    "AdaptiveKLController",
    "Clip",
    "ClipCov",
    "CovSelection",
    "KLCov",
    "LogProbStatistics",
    "OptimalTokenBaselineOutput",
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
    "ResponseStatistics",
    "RolloutCorrection",
    "RolloutCorrectionMetrics",
    "SurrogateObjective",
    "TokenLogProbsOutput",
    "UnpackedTokens",
    "ValueLossDiagnostics",
    "ValueLossOutput",
    "VocabParallel",
    "__version__",
    "aggregate",
    "cov_selection",
    "data_parallel_loss_scale",
    "full_vocab_kl",
    "full_vocab_kl_loss",
    "fused_policy_loss_from_hidden",
    "gae",
    "gdpo_advantages",
    "generalized_jsd_loss",
    "generalized_jsd_loss_from_hidden",
    "global_cov_selection",
    "global_m2po_mask",
    "global_masked_whiten",
    "global_normalizers",
    "global_top_entropy_mask",
    "group_relative_advantages",
    "grpo_clipped_surrogate",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalized_token_rewards",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_sum",
    "m2po_mask",
    "masked_whiten",
    "maxrl_advantages",
    "nll_loss",
    "normalizer_for_reduction",
    "off_policy_sequence_mask",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "overlong_penalty",
    "passk_advantages",
    "pack",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "remax_advantages",
    "response_alignment",
    "response_log_probs",
    "reverse_kl_loss",
    "reverse_kl_loss_from_hidden",
    "reverse_kl_rewards",
    "rloo_advantages",
    "rollout_correction",
    "sum_diagnostics",
    "token_entropy",
    "token_log_probs",
    "token_log_probs_from_hidden",
    "top_entropy_mask",
    "topk_forward_kl",
    "topk_forward_kl_from_hidden",
    "unpack",
    "use_backend",
    "value_loss",
]
