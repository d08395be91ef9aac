"""``rlobjectives demo``: a small, real GRPO post-training run on CPU.

A tiny causal transformer (:class:`TinyTransformer`, plain PyTorch, no downloads) is warm-started
with a few supervised steps on a digit task generated on the fly (:class:`DigitTask`), which
gives a mediocre reference policy; GRPO with the library's objectives then raises its held-out
exact-match accuracy. Run ``rlobjectives demo --help`` (or ``python -m rlobjectives.demo``); for
data parallelism ``torchrun --nproc_per_node=2 -m rlobjectives.demo``. Needs the ``demo`` extra
(tqdm, matplotlib), imported only when a run starts.
"""

from .command_line import build_parser, main
from .config import DemoConfig, DemoResult, Forward
from .model import TinyTransformer
from .sampling import response_log_probs, sample_responses
from .task import TASKS, DigitTask, Rewards
from .training import train

__all__ = [
    "TASKS",
    "DemoConfig",
    "DemoResult",
    "DigitTask",
    "Forward",
    "Rewards",
    "TinyTransformer",
    "build_parser",
    "main",
    "response_log_probs",
    "sample_responses",
    "train",
]
