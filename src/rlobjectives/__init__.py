"""rlobjectives: exact, padding-safe PyTorch objectives for RL post-training of language models.

Shape letters used throughout: B sequences, T response tokens, V vocabulary, G group size,
H hidden size; packed (padding-free) batches: N tokens of S sequences with ``cu_seqlens``.
Masks have the shape of the log-probabilities and True/nonzero selects a token.
"""

from importlib.metadata import PackageNotFoundError, version

from ._core.backend import use_backend
from ._core.masked import aggregate, masked_mean, masked_sum
from ._core.packing import PackedTokens, UnpackedTokens, pack, unpack
from ._core.reduction import Reduction
from .advantages.gae import GAEOutput, gae
from .advantages.gdpo import gdpo_advantages
from .advantages.gpg import gpg_advantages
from .advantages.length import (
    group_length_penalty,
    length_adaptive_lambda,
    overlong_penalty,
    relative_position_lambda,
)
from .advantages.maxrl import maxrl_advantages
from .advantages.otb import OptimalTokenBaselineOutput, optimal_token_baseline_advantages
from .advantages.outcome import (
    group_relative_advantages,
    opo_advantages,
    passk_advantages,
    remax_advantages,
    rloo_advantages,
)
from .advantages.reinforce import reinforce_plus_plus_advantages
from .advantages.whitening import masked_whiten
from .distillation import (
    generalized_jsd_loss,
    generalized_jsd_loss_from_hidden,
    iw_opd_advantages,
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
from .kl.control import AdaptiveEntropyController, AdaptiveKLController, FixedKLController
from .kl.estimators import BiasedGradientWarning
from .kl.loss import kl_estimate, kl_loss
from .kl.rewards import kl_penalized_rewards, kl_penalized_token_rewards
from .logprobs.alignment import ResponseAlignment, response_alignment
from .logprobs.divergence import full_vocab_kl, full_vocab_kl_loss
from .logprobs.hidden import TokenLogProbsOutput, token_log_probs_from_hidden
from .logprobs.logits import token_entropy, token_log_probs
from .logprobs.responses import ResponseLogProbs, ResponseStatistics, response_log_probs
from .logprobs.statistics import LogProbStatistics
from .logprobs.vocab_parallel import VocabParallel
from .policy.call import PolicyLossDiagnostics, PolicyLossOutput
from .policy.from_hidden import FusedPolicyLossOutput, fused_policy_loss_from_hidden
from .policy.grpo_surrogate import grpo_clipped_surrogate
from .policy.loss import policy_loss
from .policy.surrogates import (
    CISPO,
    DPPO,
    DRO,
    FIPO,
    GMPO,
    M2PO,
    REAL,
    SAPO,
    TOPR,
    VESPO,
    Clip,
    ClipCov,
    KLCov,
    PolicyTokens,
    ProbabilityBand,
    Surrogate,
    SurrogateTerms,
)
from .preference import (
    AOT,
    BCO,
    CPO,
    DPO,
    EXO,
    IPO,
    NCA,
    ORPO,
    SFT,
    APODown,
    APOZero,
    DiscoPOP,
    Hinge,
    PreferenceLossOutput,
    PreferenceObjective,
    RobustDPO,
    SimPO,
    SPPOHard,
    preference_loss,
)
from .preference.hidden import kto_loss_from_hidden, preference_loss_from_hidden
from .preference.kto import KTOLossOutput, kto_loss
from .preference.reward import RewardModelLossOutput, reward_model_loss
from .rollout.correction import RolloutCorrection, rollout_correction
from .rollout.decoupled import proximal_log_probs, rejection_mask
from .rollout.metrics import RolloutCorrectionMetrics
from .rollout.off_policy import off_policy_sequence_mask
from .selection.batch import CovSelection, cov_selection, m2po_mask
from .selection.entropy import top_entropy_mask
from .supervised.losses import dft_loss, nll_loss
from .value.loss import ValueLossDiagnostics, ValueLossOutput, value_loss

try:
    __version__ = version("rlobjectives")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AOT",
    "BCO",
    "CPO",
    "DPO",
    "EXO",
    "IPO",
    "NCA",
    "ORPO",
    "SFT",
    "APODown",
    "APOZero",
    "DiscoPOP",
    "Hinge",
    "KTOLossOutput",
    "PreferenceLossOutput",
    "PreferenceObjective",
    "RewardModelLossOutput",
    "RobustDPO",
    "SPPOHard",
    "SimPO",
    "CISPO",
    "DPPO",
    "DRO",
    "FIPO",
    "GMPO",
    "M2PO",
    "REAL",
    "SAPO",
    "TOPR",
    "VESPO",
    "AdaptiveEntropyController",
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
    "PolicyTokens",
    "ProbabilityBand",
    "Surrogate",
    "SurrogateTerms",
    "TokenLogProbsOutput",
    "UnpackedTokens",
    "ValueLossDiagnostics",
    "ValueLossOutput",
    "VocabParallel",
    "__version__",
    "aggregate",
    "cov_selection",
    "data_parallel_loss_scale",
    "dft_loss",
    "full_vocab_kl",
    "full_vocab_kl_loss",
    "fused_policy_loss_from_hidden",
    "gae",
    "gdpo_advantages",
    "gpg_advantages",
    "generalized_jsd_loss",
    "generalized_jsd_loss_from_hidden",
    "global_cov_selection",
    "global_m2po_mask",
    "global_masked_whiten",
    "global_normalizers",
    "global_top_entropy_mask",
    "group_length_penalty",
    "group_relative_advantages",
    "iw_opd_advantages",
    "grpo_clipped_surrogate",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalized_token_rewards",
    "kto_loss",
    "kto_loss_from_hidden",
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
    "proximal_log_probs",
    "preference_loss",
    "preference_loss_from_hidden",
    "reinforce_plus_plus_advantages",
    "rejection_mask",
    "relative_position_lambda",
    "remax_advantages",
    "response_alignment",
    "response_log_probs",
    "reverse_kl_loss",
    "reverse_kl_loss_from_hidden",
    "reverse_kl_rewards",
    "reward_model_loss",
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
