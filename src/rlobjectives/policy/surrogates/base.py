r"""What every surrogate object shares: the base class and the contracts of its two paths.

A surrogate object (:class:`~rlobjectives.Clip`, :class:`~rlobjectives.CISPO`,
:class:`~rlobjectives.SAPO`, :class:`~rlobjectives.GMPO`, :class:`~rlobjectives.VESPO`) is a small
frozen value that validates its fields at construction and carries, as methods, what the paths
of :func:`rlobjectives.policy_loss` need from it:

- :meth:`SurrogateObjective.formula`: the readable autograd specification: from the ratios of
  one call (:class:`SurrogateInputs`) to the surrogate :math:`s` (the loss is :math:`-s`), the
  factor :math:`w` of :math:`s = wA` (the ``weight_mean`` diagnostic) and the token sets of the
  clip diagnostics (:class:`FormulaTerms`);
- :meth:`SurrogateObjective.stage` (token-local surrogates): the fused stage, the same values
  and their closed-form derivative :math:`\partial (w s_{it}) / \partial \ell_{it}` without
  autograd (:class:`StageInputs` to :class:`StageOutputs`), run by
  :mod:`rlobjectives.policy.fused` and by the hidden-state path;
- :meth:`SurrogateObjective.kernel_flags` (token-local surrogates): the host-side setup of the
  Triton token-loss kernel (its surrogate id, edges and scalars, :mod:`rlobjectives.kernels`).

Class attributes: ``name`` (the string that means the object with its defaults), ``token_local``
(value and derivative per token: a fused stage, a kernel, the hidden-state chunk loop; the
sequence-level GMPO and VESPO form their own sequence ratio, and the batch-level M2PO, ClipCov
and KLCov select tokens from the whole call), ``takes_sequence_ratio`` (``ratio_level="sequence"``
allowed: GSPO's sequence ratio in place of the token ratio; ``token_ratio_reason`` says why not
in the error), ``folds_importance_weights`` (the importance weights enter the formula instead
of scaling the per-token loss: VESPO) and ``needs_log_ratio`` (the fused stage reads the raw
selected log-ratio, :attr:`StageInputs.log_ratio`: DPPO, DRO).

Fields are Python numbers or 0-d tensors; a tensor that requires grad (a learnable
hyperparameter) routes the call to the autograd path.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch

from ..._core.layout import Layout

__all__ = [
    "Bound",
    "ClipCounts",
    "FormulaTerms",
    "StageInputs",
    "StageOutputs",
    "SurrogateInputs",
    "SurrogateObjective",
    "above",
    "band_sets",
    "below",
    "by_sign",
]

Bound = float | torch.Tensor


class SurrogateInputs(NamedTuple):
    """What a formula sees; ``(B, T)`` tensors in the computation dtype, zeros at unselected."""

    ratio: torch.Tensor  # r = exp(bounded log-ratio), with gradient; 1 at unselected tokens
    log_ratio: torch.Tensor  # the bounded token log-ratio log r, with gradient
    advantages: torch.Tensor  # A (B, T), constant
    log_probs: torch.Tensor  # l (B, T), with gradient
    mask: torch.Tensor  # (B, T) bool
    importance_weights: torch.Tensor | None  # (B, 1) or (B, T), constant, NOT selected
    layout: Layout
    sequence_weights: bool = False  # the weights are one per sequence (packed: broadcast)
    old_log_probs: torch.Tensor | None = None  # l_old (B, T), constant, zeros at unselected


class FormulaTerms(NamedTuple):
    """A formula's result: the surrogate, its advantage factor and the clip token sets."""

    values: torch.Tensor  # s (B, T), differentiable
    weight: torch.Tensor  # w (B, T), detached: s = w A (or sg(w) A l)
    out_of_band: torch.Tensor  # bool (B, T): clipped_fraction
    below: torch.Tensor  # bool (B, T): clip_fraction_low
    above: torch.Tensor  # bool (B, T): clip_fraction_high
    dual: torch.Tensor  # bool (B, T): dual_clip_fraction
    # bool (B, T): selected_fraction (tokens the objective masks, detaches or penalises), or None
    selected: torch.Tensor | None = None
    # bool (B, T): the tokens the surrogate is reduced over when the objective narrows the
    # call's selection (M2PO's kept tokens), or None (the call's mask)
    loss_mask: torch.Tensor | None = None


class StageInputs(NamedTuple):
    """The ratio of one fused call and what a surrogate stage needs besides it."""

    ratio: torch.Tensor  # (B, T) r after the bound, 1 at unselected tokens; a fresh buffer
    advantages: torch.Tensor  # (B, 1) or (B, T) A, not selected: the signs of the decisions
    weighted: torch.Tensor  # (B, T) A~ = w A, exact zeros at unselected tokens
    mask: torch.Tensor  # (B, T) bool
    passes: torch.Tensor | None  # (B, T) 1.0 where the log-ratio bound held (torch.clamp passes
    # the gradient), 0.0 where it fired (a NaN log-ratio too); None without a bound
    log_probs: torch.Tensor  # (B, T) the log-probabilities, not selected, any float dtype
    selected_count: torch.Tensor  # () selected tokens
    dtype: torch.dtype
    old_log_probs: torch.Tensor | None = None  # (B, T) l_old, not selected, any float dtype
    importance_weights: torch.Tensor | None = None  # (B, 1) or (B, T) rho, not selected
    # (B, T) the raw token log-ratio Delta at selected tokens, 0 elsewhere (a fresh buffer),
    # for the surrogates with ``needs_log_ratio`` (None otherwise)
    log_ratio: torch.Tensor | None = None


class ClipCounts(NamedTuple):
    """Token counts of the clip diagnostics (0-d tensors)."""

    out_of_band: torch.Tensor
    binding_low: torch.Tensor
    binding_high: torch.Tensor


class StageOutputs(NamedTuple):
    """A surrogate stage's values, derivative and diagnostic sums."""

    coefficient: torch.Tensor  # (B, T) d (w s) / d log_probs, exact zeros at unselected tokens
    values: torch.Tensor  # (B, T) w s, exact zeros at unselected tokens
    clip: ClipCounts
    dual: torch.Tensor  # () dual-clip count (0 without a bound on the A < 0 side)
    ratio_sum: torch.Tensor  # () sum of r over the selected tokens
    weight_sum: torch.Tensor  # () sum of the advantage factor over the selected tokens


class SurrogateObjective:
    """Base class of the surrogate objects (see the module docstring for the contract).

    Subclasses are frozen dataclasses; the string ``name`` means the subclass with its defaults
    (``policy_loss(..., surrogate="cispo")`` is ``surrogate=CISPO()``).
    """

    name: ClassVar[str]
    token_local: ClassVar[bool] = True
    takes_sequence_ratio: ClassVar[bool] = True
    token_ratio_reason: ClassVar[str] = "forms its own sequence ratio"
    folds_importance_weights: ClassVar[bool] = False
    needs_log_ratio: ClassVar[bool] = False  # the fused stage reads StageInputs.log_ratio

    def selects_from_call(self) -> bool:
        """Whether the object selects tokens from the whole call itself.

        True for M2PO's mask and Clip-Cov's / KL-Cov's selections without ``selection=``: such
        a call needs the whole batch, so it is refused under context parallelism (hand the
        global selection instead).
        """
        return False

    def formula(self, inputs: SurrogateInputs) -> FormulaTerms:
        """The readable autograd specification of the surrogate (see the subclass)."""
        raise NotImplementedError

    def stage(self, inputs: StageInputs) -> StageOutputs:
        """The fused stage: values and closed-form derivative (token-local surrogates only)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused stage")

    def kernel_flags(self) -> dict[str, Any]:
        """The Triton token-loss kernel's setup: surrogate name, edges, scalars, flags."""
        raise NotImplementedError(f"{type(self).__name__} has no Triton kernel")


def above(ratio: torch.Tensor, bound: Bound | None) -> torch.Tensor:
    """``r > bound`` (all False without a bound)."""
    if bound is None:
        return torch.zeros_like(ratio, dtype=torch.bool)
    return ratio > torch.as_tensor(bound, dtype=ratio.dtype, device=ratio.device)


def below(ratio: torch.Tensor, bound: Bound | None) -> torch.Tensor:
    """``r < bound`` (all False without a bound)."""
    if bound is None:
        return torch.zeros_like(ratio, dtype=torch.bool)
    return ratio < torch.as_tensor(bound, dtype=ratio.dtype, device=ratio.device)


def band_sets(
    ratio: torch.Tensor, advantages: torch.Tensor, lower: Bound | None, upper: Bound | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(outside [lower, upper], below and A < 0, above and A > 0)`` of the ratio."""
    low, high = below(ratio, lower), above(ratio, upper)
    return low | high, low & (advantages < 0), high & (advantages > 0)


def by_sign(
    condition: torch.Tensor, when_true: Bound, when_false: Bound, like: torch.Tensor
) -> torch.Tensor:
    """A per-token hyperparameter: ``when_true`` where ``condition``, else ``when_false``."""
    dtype, device = like.dtype, like.device
    return torch.where(
        condition,
        torch.as_tensor(when_true, dtype=dtype).to(device),
        torch.as_tensor(when_false, dtype=dtype).to(device),
    )
