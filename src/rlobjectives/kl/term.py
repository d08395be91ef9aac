"""The KL term of a loss from hidden states: ``coef * reduce(k(log_probs, ref_log_probs))``.

:func:`validate_kl_term` checks ``ref_log_probs``, ``kl_coef``, ``kl_estimator`` and
``kl_straight_through`` once, at the boundary of :func:`rlobjectives.fused_policy_loss_from_hidden`;
the estimate itself is :func:`rlobjectives.kl.estimators.kl_terms`, the one implementation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.layout import token_tensor
from .._core.validation import (
    ArrayLike,
    check_estimator_spelling,
    validate_bool,
    validate_choice,
    validate_scalar,
)
from .estimators import ESTIMATORS, kl_terms

__all__ = ["KLTerm", "validate_kl_term"]


class KLTerm(NamedTuple):
    """The KL term of the loss: ``coef * reduce(k(log_probs, ref_log_probs))``."""

    ref_log_probs: torch.Tensor  # (B, T) or packed (1, N), detached
    coef: float
    estimator: str
    straight_through: bool

    def estimate(
        self,
        log_probs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio_bound: float | torch.Tensor | None,
        dtype: torch.dtype,
        rows: int | slice | None = None,
    ) -> torch.Tensor:
        """The per-token estimate (0 at unselected tokens); ``rows``: a slice of the flat tokens."""
        ref = self.ref_log_probs if rows is None else self.ref_log_probs.reshape(-1)[rows][None]
        return kl_terms(
            log_probs, ref, mask, estimator=self.estimator,
            straight_through=self.straight_through, log_ratio_bound=log_ratio_bound, dtype=dtype,
        )  # fmt: skip


def validate_kl_term(
    ref_log_probs: ArrayLike | None,
    kl_coef: float,
    kl_estimator: str,
    kl_straight_through: bool,
    hidden: torch.Tensor,
    batch_shape: tuple[int, int],
    packed: bool = False,
) -> KLTerm | None:
    """The KL term's arguments; None when there is no reference (a zero KL loss is reported).

    ``hidden``: the hidden states of the loss (their device); ``batch_shape``: the tokens'.
    """
    beta = float(validate_scalar(kl_coef, "kl_coef", minimum=0.0, allow_tensor=False))
    check_estimator_spelling(kl_estimator, ESTIMATORS, prefix="kl_")
    validate_choice(kl_estimator, "kl_estimator", ESTIMATORS)
    validate_bool(kl_straight_through, "kl_straight_through")
    if ref_log_probs is None:
        if beta > 0:
            raise ValueError(f"kl_coef > 0 requires ref_log_probs, got kl_coef={kl_coef!r}")
        return None
    ref_t = token_tensor(ref_log_probs, "ref_log_probs", ("hidden", hidden), batch_shape, packed)
    return KLTerm(ref_t.detach(), beta, kl_estimator, kl_straight_through)
