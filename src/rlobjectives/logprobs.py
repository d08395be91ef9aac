"""Log-probabilities, entropy and exact KL from logits, without a float32 copy of the vocabulary.

Public module: ``from rlobjectives.logprobs import token_log_probs, ...``. Every function is also
exported from :mod:`rlobjectives`. The shared chunking helpers (``row_chunks``,
``resolve_chunk_size``, ``chunk_token_log_probs``, ...) live in the private ``_logprobs`` module.
"""

from ._from_hidden import (
    FusedPolicyLossOutput,
    TokenLogProbsOutput,
    fused_policy_loss_from_hidden,
    token_log_probs_from_hidden,
)
from ._logprobs import (
    ResponseAlignment,
    ResponseLogProbs,
    full_vocab_kl,
    full_vocab_kl_loss,
    response_alignment,
    response_log_probs,
    token_entropy,
    token_log_probs,
)

__all__ = [
    "FusedPolicyLossOutput",
    "ResponseAlignment",
    "ResponseLogProbs",
    "TokenLogProbsOutput",
    "full_vocab_kl",
    "full_vocab_kl_loss",
    "fused_policy_loss_from_hidden",
    "response_alignment",
    "response_log_probs",
    "token_entropy",
    "token_log_probs",
    "token_log_probs_from_hidden",
]
