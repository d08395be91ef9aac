"""rlobjectives: exact, padding-safe PyTorch objectives for RL post-training of language models.

Shape letters used throughout: B sequences, T response tokens, V vocabulary, G group size,
H hidden size. Masks have the shape of the log-probabilities and True/nonzero selects a token.
"""

from importlib.metadata import PackageNotFoundError, version

from ._masking import Reduction, aggregate, masked_mean, masked_sum
from ._policy import (
    PolicyLossDiagnostics,
    PolicyLossOutput,
    grpo_clipped_surrogate,
    policy_loss,
)
from ._rewards import kl_penalized_rewards

try:
    __version__ = version("rlobjectives")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "PolicyLossDiagnostics",
    "PolicyLossOutput",
    "Reduction",
    "__version__",
    "aggregate",
    "grpo_clipped_surrogate",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "policy_loss",
]
