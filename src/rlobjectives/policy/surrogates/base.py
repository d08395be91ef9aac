r"""The surrogate contract: :class:`Surrogate`, what it sees, what it returns.

A surrogate is a small frozen object whose one method is its paper's formula in ordinary torch
operations, exactly as its docstring writes it; autograd gives the gradient and
``torch.compile`` the speed (``docs/objectives/custom.md``). The policy loss is

.. math::

    L_{it} = -w_{it}\, s_{it}, \qquad s = \text{the surrogate's formula},

reduced by the call's reduction, :math:`w` the importance weights. A subclass implements

- :meth:`Surrogate.surrogate` ``(log_ratio, advantages) -> s``: the per-token surrogate from the
  bounded log-ratio :math:`x = \log r` (zero at unselected tokens, with gradient) and the
  advantages (broadcast to its shape, zero at unselected tokens); it may return the values
  alone or a :class:`SurrogateTerms` that also names the tokens its diagnostics count; or
- :meth:`Surrogate.terms` ``(tokens) -> SurrogateTerms`` when the formula needs more than the
  log-ratio and the advantages: the log-probabilities (CISPO, DPPO, DRO), the sequences (GMPO,
  VESPO) or the whole batch (M2PO, Clip-Cov, KL-Cov); such a class sets ``token_local = False``
  unless each token's value still depends on that token alone.

A token-local surrogate runs on every path: :func:`rlobjectives.policy_loss` (every reduction,
GSPO's ``ratio_level="sequence"``, packed, context-parallel) and the chunk loop of
:func:`rlobjectives.fused_policy_loss_from_hidden`, which differentiates it per chunk with
``torch.autograd.grad``.

Every decision a surrogate takes on :math:`r = e^x` against a bound is taken on the log-ratio
against the thresholds of :mod:`rlobjectives._core.decisions` (``docs/conventions.md``,
"Decisions at a bound"): :func:`~rlobjectives._core.decisions.ratio_above` /
:func:`~rlobjectives._core.decisions.ratio_below`.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from ..._core.layout import Layout
from ..._core.reduction import select_or_zero

__all__ = [
    "Bound",
    "PolicyTokens",
    "Surrogate",
    "SurrogateTerms",
    "by_sign",
    "sampled_log_probs",
]

Bound = float | torch.Tensor


class PolicyTokens(NamedTuple):
    r"""What :meth:`Surrogate.terms` sees: ``(B, T)`` tensors (packed ``(1, N)``).

    Every tensor is in the computation dtype (float32, float64 when an input is float64) and
    exactly zero at unselected tokens, so NaN/inf there reaches nothing.

    Attributes:
        log_ratio: the bounded log-ratio :math:`x = \mathrm{clip}(\Delta, -b, b)` (GSPO: the
            sequence's mean at every token, in the stop-gradient form), with gradient.
        advantages: :math:`A`, constant.
        log_probs: :math:`\ell`, with gradient.
        old_log_probs: :math:`\ell^{old}`, constant (as given, not rebuilt from a difference).
        mask: bool, the selected tokens.
        layout: which tokens form which sequence (:class:`~rlobjectives._core.layout.Layout`).
        importance_weights: ``(B, 1)`` or ``(B, T)`` constants, not selected, or None.
        sequence_weights: the weights were given one per sequence.
        groups: ``(S,)`` int64 prompt group of each sequence (``group_size=`` /
            ``group_ids=`` of the call), or None.
    """

    log_ratio: torch.Tensor
    advantages: torch.Tensor
    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    mask: torch.Tensor
    layout: Layout
    importance_weights: torch.Tensor | None = None
    sequence_weights: bool = False
    groups: torch.Tensor | None = None


class SurrogateTerms(NamedTuple):
    r"""A surrogate's values and the token sets its diagnostics count (None: none).

    Attributes:
        values: :math:`s`, ``(B, T)``, differentiable (the loss is :math:`-s`).
        weight: the factor :math:`w` of :math:`s = wA` (the ``weight_mean`` diagnostic),
            detached; None: :math:`s / A` where :math:`A \ne 0`, else :math:`r`.
        out_of_band: bool, ``clipped_fraction``: the ratio outside the variant's band.
        below: bool, ``clip_fraction_low``: the low edge changes an :math:`A < 0` token.
        above: bool, ``clip_fraction_high``: the high edge changes an :math:`A > 0` token.
        dual: bool, ``dual_clip_fraction``: an upper edge changes an :math:`A < 0` token.
        selected: bool, ``selected_fraction``: the tokens a batch-level objective acts on.
        loss_mask: bool, the tokens the surrogate is reduced over when the objective narrows
            the call's selection (M2PO), else None.
    """

    values: torch.Tensor
    weight: torch.Tensor | None = None
    out_of_band: torch.Tensor | None = None
    below: torch.Tensor | None = None
    above: torch.Tensor | None = None
    dual: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None


class Surrogate:
    """Base of the surrogate objects: implement :meth:`surrogate` (or :meth:`terms`).

    Subclasses are frozen dataclasses whose fields (Python numbers or 0-d tensors) are
    validated in ``__post_init__``. Class attributes:

    - ``name``: the string that means the class with its defaults (``surrogate="clip"``);
    - ``token_local``: each token's value depends on that token alone (the hidden-state chunk
      loop differentiates it chunk by chunk; else that path composes a second pass);
    - ``takes_sequence_ratio``: ``ratio_level="sequence"`` (GSPO) allowed;
      ``token_ratio_reason`` says why not in the error;
    - ``folds_importance_weights``: the importance weights enter the formula (VESPO) instead
      of multiplying the per-token loss.
    """

    name: ClassVar[str] = ""
    token_local: ClassVar[bool] = True
    takes_sequence_ratio: ClassVar[bool] = True
    token_ratio_reason: ClassVar[str] = "forms its own sequence ratio"
    folds_importance_weights: ClassVar[bool] = False

    def surrogate(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor
    ) -> torch.Tensor | SurrogateTerms:
        """The per-token surrogate :math:`s` from the bounded log-ratio and the advantages."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement surrogate(self, log_ratio, advantages) "
            f"(or terms(self, tokens))"
        )

    def terms(self, tokens: PolicyTokens) -> SurrogateTerms:
        """The surrogate of a call; by default :meth:`surrogate` of the log-ratio."""
        out = self.surrogate(tokens.log_ratio, tokens.advantages)
        return out if isinstance(out, SurrogateTerms) else SurrogateTerms(out)

    def selects_from_call(self) -> bool:
        """Whether the object selects tokens from the whole call (refused with a context group)."""
        return False


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


def sampled_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    r""":math:`\ell` where the token has probability above 0, else 0 (value and gradient).

    The value forms :math:`w A \ell` (CISPO, DPPO, VESPO) would be infinite or NaN at a sampled
    token of probability 0 (:math:`\ell = -\infty`: a sample outside a recomputed kept set);
    such a token contributes nothing and stays in the reduction's denominator. The value and the
    gradient are ``torch.where(log_probs > -inf, log_probs, 0)``'s, the selection kept for the
    backward as an ``int8`` (:func:`~rlobjectives._core.reduction.select_or_zero`).
    """
    return select_or_zero(log_probs, log_probs > -torch.inf)
