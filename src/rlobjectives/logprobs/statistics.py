r"""Per-token statistics of the next-token distribution, besides the log-probabilities.

``statistics=`` on :func:`~rlobjectives.token_log_probs`,
:func:`~rlobjectives.token_log_probs_from_hidden` and :func:`~rlobjectives.response_log_probs`
asks for any of TRL 1.16's optional outputs of ``ChunkedLogProbFunction`` (the names are
TRL's), computed in the same chunk loop as the log-probabilities, over the same transformed
logits :math:`x` (scale, softcap, temperature) and, with a kept set, the truncated
distribution :math:`q_K`:

- ``"entropy"``: :math:`H = -\sum_v p_v \log p_v` (differentiable);
- ``"log_sum_sq_probs"``: :math:`\log\sum_v p_v^2` (verl's :math:`\sum\pi^2` of the Optimal Token
  Baseline is its ``exp``); detached, as TRL marks it;
- ``"mean_logits"``: :math:`\frac1V\sum_v x_v`, the mean over the whole vocabulary of the
  transformed logits, temperature included, before any kept set; detached;
- ``"is_top1"``: whether the token is the first maximal logit (:math:`\arg\max_v x_v`, the
  first index among ties; over the kept set with one): a bool.

Under vocabulary parallelism each rank forms its slice's moments; :math:`\sum p^2` rides in the
same all-reduce SUM as the normaliser (one row more), the mean's sum too, and the first maximal
logit takes one all-reduce MAX of ``N`` values and one all-reduce MIN of ``N`` int64
(:func:`~rlobjectives.logprobs.vocab_parallel.first_argmax`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._core.validation import describe

__all__ = [
    "LogProbStatistics",
    "STATISTICS",
    "Wanted",
    "statistics_result",
    "validate_statistics",
]

#: The statistics ``statistics=`` may name (TRL 1.16's ``OPTIONAL_OUTPUTS``).
STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class LogProbStatistics(NamedTuple):
    r"""Log-probabilities with the statistics asked for (``statistics=``); None for the others.

    Attributes:
        log_probs: the log-probabilities of the tokens (the shape of ``tokens``), float32
            (float64 for float64 inputs), 0 where not selected.
        entropy: the entropy of the (transformed, truncated) next-token distribution, or None.
        log_sum_sq_probs: :math:`\log\sum_v p_v^2` (detached), or None.
        mean_logits: the mean of the transformed logits over the vocabulary (detached), or None.
        is_top1: bool, whether the token is the first maximal logit, or None.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


class Wanted(NamedTuple):
    """Which statistics a call computes."""

    entropy: bool = False
    log_sum_sq_probs: bool = False
    mean_logits: bool = False
    is_top1: bool = False

    @property
    def beyond_entropy(self) -> bool:
        """Whether a statistic other than the entropy is asked for."""
        return self.log_sum_sq_probs or self.mean_logits or self.is_top1

    def result(self, log_probs: torch.Tensor, values: dict[str, torch.Tensor]) -> LogProbStatistics:
        """The :class:`LogProbStatistics` of ``values`` (name -> tensor), None where not asked."""
        return LogProbStatistics(
            log_probs,
            *(values[name] if getattr(self, name) else None for name in STATISTICS),
        )


def validate_statistics(statistics: object, *, entropy: bool = False) -> Wanted | None:
    """``statistics`` as a :class:`Wanted`, or None when not given (and no ``entropy``).

    Args:
        statistics: None, or a tuple / list of names from :data:`STATISTICS` (duplicates count
            once; an empty tuple asks for the result type with the log-probabilities alone).
        entropy: ``return_entropy=True`` (adds ``"entropy"``).

    Raises:
        TypeError: not a tuple or list of strings.
        ValueError: an unknown name.
    """
    if statistics is None:
        return Wanted(entropy=True) if entropy else None
    if isinstance(statistics, str) or not isinstance(statistics, (tuple, list)):
        raise TypeError(
            f"statistics must be a tuple of names from {STATISTICS} (or None), got "
            f"{describe(statistics)} ({statistics!r})"
        )
    for name in statistics:
        if not isinstance(name, str):
            raise TypeError(f"statistics must hold names (str), got {describe(name)} ({name!r})")
        if name not in STATISTICS:
            raise ValueError(
                f"statistics must name statistics from {STATISTICS}, got {name!r} "
                "(the log-probabilities are always returned)"
            )
    return Wanted(*(name in statistics or (name == "entropy" and entropy) for name in STATISTICS))


def statistics_result(wanted: Wanted, outputs: Sequence[torch.Tensor]) -> LogProbStatistics:
    """The :class:`LogProbStatistics` of a Function's ``(log_probs, entropy, *others)``."""
    others = iter(outputs[2:])
    values = {"entropy": outputs[1]} if wanted.entropy else {}
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1"):
        if getattr(wanted, name):
            values[name] = next(others)
    return wanted.result(outputs[0], values)
