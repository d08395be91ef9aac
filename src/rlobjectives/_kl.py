r"""Sampled-token KL estimators and their two placements: reward penalty and loss term.

With :math:`d_t = \log\pi(y_t) - \log\pi_{ref}(y_t)` for a token :math:`y_t \sim \pi` and
:math:`\rho_t = \pi_{ref}(y_t)/\pi(y_t) = e^{-d_t}`, Schulman's estimators of
:math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})` are

.. math::

    k_1 = d, \qquad k_2 = \tfrac12 d^2, \qquad k_3 = e^{-d} + d - 1 = \rho - 1 - \log\rho .

:math:`k_1` and :math:`k_3` are unbiased estimates of the KL value (:math:`k_2` is biased, at
second order in :math:`d`), but what matters for training is the **gradient** of the placement
they are used in. Expectations are over on-policy samples :math:`y \sim \pi_\theta`; "reward"
means the estimate is a detached per-token reward whose gradient arrives through the score
function (REINFORCE/PPO, :func:`kl_penalized_token_rewards`), "loss" means the estimate is
differentiated directly (pathwise, GRPO's KL term, :func:`kl_loss`). The
estimator x placement x gradient matrix:

- ``k1``: reward: unbiased :math:`\nabla\mathrm{KL}`; loss: **zero** expected gradient
  (:math:`E_\pi[\nabla\log\pi] = 0`), warns.
- ``k2``: reward: biased, warns; loss: unbiased (:math:`E_\pi[d\,\nabla\log\pi] =
  \nabla\mathrm{KL}`).
- ``k3``: reward: biased, warns; loss: **biased**, its expectation
  :math:`-E_\pi[\rho\,\nabla\log\pi]` is :math:`\nabla\mathrm{KL}(\pi_{ref}\|\pi)`, the reverse
  direction; warns.
- ``abs`` (:math:`|d|`, verl ``kl_penalty="abs"``; not an unbiased estimate of the KL value):
  reward: biased, warns; loss: biased (gradient :math:`\mathrm{sign}(d)\nabla\log\pi`), warns.
- any estimator with ``straight_through=True`` (value of the estimator, gradient of ``k2``;
  verl ``k3+``): loss: unbiased. (As a reward it is irrelevant: rewards are detached.)

:class:`BiasedGradientWarning` is emitted for every "warns" entry. Clamping the log-ratio (the
bound) changes the estimate wherever it fires; for ``k1`` rewards this biases the summed KL, so
:func:`kl_penalized_token_rewards` warns when a bound is used with it.

References:
    Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html);
    verl PR #2953 (``k3+`` / ``low_var_kl+`` straight-through); Shao et al. 2024, GRPO,
    arXiv:2402.03300 Eq. 4 (k3 as a loss term); Ouyang et al. 2022, arXiv:2203.02155 Eq. 2
    (KL as a reward penalty).
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from ._masking import REDUCTIONS, aggregate, masked_fill_zero
from ._validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "ESTIMATORS",
    "BiasedGradientWarning",
    "Estimator",
    "kl_estimate",
    "kl_loss",
    "kl_penalized_token_rewards",
]

Estimator = Literal["k1", "k2", "k3", "abs"]
ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")


class BiasedGradientWarning(UserWarning):
    """A KL estimator is used where its expected gradient is biased or zero.

    The estimator x placement x gradient matrix (on-policy samples; "reward" = detached penalty
    whose gradient comes through the score function, "loss" = differentiated directly):

    - ``k1``: reward unbiased; loss has **zero** expected gradient (warns).
    - ``k2``: reward biased (warns); loss unbiased.
    - ``k3``: reward biased (warns); loss biased, it follows KL(ref || pi) (warns).
    - ``straight_through=True`` (value of the estimator, gradient of ``k2``): loss unbiased.
    - a clamped ``k1`` reward (``log_ratio_bound``): biased where the bound fires (warns).

    Emitted by :func:`kl_loss` and :func:`kl_penalized_token_rewards` in eager mode (not while
    ``torch.compile`` traces). Silence it when the combination is intended with
    ``warnings.filterwarnings("ignore", category=BiasedGradientWarning)``.
    """


def _warn_biased(message: str) -> None:
    """Emit :class:`BiasedGradientWarning` at the caller's caller (not while compiling).

    ``torch.compile`` cannot trace ``warnings.warn`` (it would break a ``fullgraph`` graph), so the
    warning is raised by eager calls only; the condition depends on Python arguments alone.
    """
    if not torch.compiler.is_compiling():
        warnings.warn(message, BiasedGradientWarning, stacklevel=3)


def _clamp_symmetric(values: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """``values.clamp(-bound, bound)`` for a Python number or a 0-d tensor bound."""
    if isinstance(bound, torch.Tensor):
        bound_t = bound.to(dtype=values.dtype, device=values.device)
        return torch.clamp(values, -bound_t, bound_t)
    return values.clamp(-bound, bound)


def _kl_terms(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str,
    straight_through: bool,
    log_ratio_bound: float | torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)`` in ``dtype``, exact zeros at unselected tokens.

    The single implementation of the estimator math (used by the public functions here and by the
    seed :func:`rlobjectives.kl_penalized_rewards`). Inputs are validated by the caller.
    """
    # Select before any arithmetic: NaN/inf at unselected positions reaches no value or gradient.
    log_ratio = masked_fill_zero(log_probs.to(dtype), mask) - masked_fill_zero(
        ref_log_probs.to(dtype), mask
    )  # (B, T)
    if log_ratio_bound is not None:
        log_ratio = _clamp_symmetric(log_ratio, log_ratio_bound)  # (B, T)
    if estimator == "k1":
        estimate = log_ratio
    elif estimator == "abs":
        estimate = log_ratio.abs()
    elif estimator == "k2":
        estimate = 0.5 * log_ratio.square()
    else:
        # k3 = exp(-d) + d - 1, written with expm1 to avoid cancellation for small d; the clamp
        # only removes rounding below 0 (k3 >= 0 exactly in real arithmetic).
        estimate = (torch.expm1(-log_ratio) + log_ratio).clamp(min=0.0)
    if straight_through and estimator != "k2":
        k2 = 0.5 * log_ratio.square()  # (B, T)
        estimate = estimate.detach() + (k2 - k2.detach())
    return masked_fill_zero(estimate, mask)


class _KLInputs:
    """Validated ``(log_probs, ref_log_probs, mask)`` (coerced, same device, same shape)."""

    def __init__(self, log_probs: ArrayLike, ref_log_probs: ArrayLike, mask: ArrayLike) -> None:
        self.log_probs = as_batch_matrix(as_float_tensor(log_probs, "log_probs"), "log_probs")
        device = self.log_probs.device
        self.ref_log_probs = as_batch_matrix(
            as_float_tensor(ref_log_probs, "ref_log_probs", device), "ref_log_probs"
        )
        self.mask = as_batch_matrix(as_mask(mask, "mask", device), "mask")
        check_same_device(
            {"log_probs": self.log_probs, "ref_log_probs": self.ref_log_probs, "mask": self.mask}
        )
        check_shape(self.ref_log_probs, "ref_log_probs", self.log_probs.shape, "log_probs")
        check_shape(self.mask, "mask", self.log_probs.shape, "log_probs")

    def terms(
        self,
        *,
        estimator: str,
        straight_through: bool,
        log_ratio_bound: float | torch.Tensor | None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """:func:`_kl_terms` of these inputs, in ``dtype`` (default: their computation dtype)."""
        return _kl_terms(
            self.log_probs,
            self.ref_log_probs,
            self.mask,
            estimator=estimator,
            straight_through=straight_through,
            log_ratio_bound=log_ratio_bound,
            dtype=compute_dtype(self.log_probs, self.ref_log_probs) if dtype is None else dtype,
        )  # (B, T)


def _validate_kl_options(
    estimator: str, straight_through: bool, log_ratio_bound: Scalar | None
) -> float | torch.Tensor | None:
    validate_choice(estimator, "estimator", ESTIMATORS)
    if not isinstance(straight_through, bool):
        raise TypeError(
            f"straight_through must be a bool, got {type(straight_through).__name__} "
            f"({straight_through!r})"
        )
    if log_ratio_bound is None:
        return None
    return validate_scalar(log_ratio_bound, "log_ratio_bound", minimum=0.0, strict=True)


def kl_estimate(
    log_probs: ArrayLike,
    ref_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    estimator: Estimator = "k3",
    straight_through: bool = False,
    log_ratio_bound: Scalar | None = 20.0,
) -> torch.Tensor:
    r"""Per-token sampled estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})`.

    With :math:`d_{it} = \mathrm{clip}(\ell_{it} - \ell^{ref}_{it}, -b, b)` on selected tokens,

    .. math::

        k_1 = d, \qquad k_2 = \tfrac12 d^2, \qquad k_3 = e^{-d} + d - 1,
        \qquad k_{abs} = |d| .

    ``"abs"`` is verl's ``kl_penalty="abs"`` (a distance, not an unbiased KL estimate).
    ``straight_through=True`` returns the value of the chosen estimator with the gradient of
    :math:`k_2`, i.e. :math:`\mathrm{sg}(k) + k_2 - \mathrm{sg}(k_2)` (verl's ``k3+`` /
    ``low_var_kl+``), whose expected gradient on on-policy samples,
    :math:`E_\pi[d\,\nabla\log\pi]`, is exactly :math:`\nabla\mathrm{KL}(\pi\|\pi_{ref})`.
    :math:`k_2, k_3 \ge 0`, with equality where the policies agree (:math:`d = 0`). See the module
    docstring for which estimator is unbiased in which placement.

    Args:
        log_probs: ``(B, T)`` log-probabilities of the sampled tokens under :math:`\pi`
            (differentiable).
        ref_log_probs: ``(B, T)`` log-probabilities under the reference policy.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of ``k2``.
        log_ratio_bound: :math:`b > 0`, clamp on :math:`d` before ``exp`` (the gradient is zero
            where it fires), or None for no clamp.

    Returns:
        ``(B, T)`` estimates, exact zeros at unselected tokens (NaN/inf there never reaches the
        value or the gradient), with the dtype and device of ``log_probs``; computed in float32
        (float64 if an input is float64) even for bf16/fp16 inputs.

    Raises:
        ValueError: on mismatched shapes/devices, inputs that are not ``(B, T)``, an unknown
            ``estimator`` or a non-positive/non-finite ``log_ratio_bound``.
        TypeError: on non-numeric inputs or a non-bool ``straight_through``.

    References:
        Schulman 2020, "Approximating KL divergence" (k1, k2, k3); Shao et al. 2024, GRPO,
        arXiv:2402.03300 Eq. 4 (k3); verl PR #2953 (straight-through ``k3+``).

    Examples:
        >>> import torch
        >>> kl_estimate(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1, 1]]))
        tensor([[0.0000, 0.3679]])

    .. versionadded:: 0.1.0
    """
    inputs = _KLInputs(log_probs, ref_log_probs, mask)
    bound = _validate_kl_options(estimator, straight_through, log_ratio_bound)
    terms = inputs.terms(
        estimator=estimator, straight_through=straight_through, log_ratio_bound=bound
    )  # (B, T)
    return terms.to(inputs.log_probs.dtype)


def kl_loss(
    log_probs: ArrayLike,
    ref_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    estimator: Estimator = "k3",
    straight_through: bool = False,
    reduction: str = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: int | None = None,
    log_ratio_bound: Scalar | None = 20.0,
) -> torch.Tensor:
    r"""KL(pi || ref) as a loss term: :func:`kl_estimate` reduced with ``reduction``.

    .. math::

        L_{KL} = \mathrm{reduce}_M\big(k_{it}\big),

    where :math:`k_{it}` is the per-token estimate of :func:`kl_estimate` and the reduction is one
    of :func:`rlobjectives.aggregate`'s (``"token_mean"``: :math:`\sum M k / \sum M`;
    ``"sequence_mean"``: mean over non-empty sequences of per-sequence token means;
    ``"sequence_sum_normalized"``: :math:`\sum M k / (B\,C)`; ``"none"``). Add it to the policy
    loss as ``loss = policy_loss(...).loss + kl_coef * kl_loss(...)``. With an explicit
    ``normalizer`` (the global selected-token count, sequence count...) the losses of
    micro-batches sum to the full-batch loss.

    Gradient (on-policy samples; see the module docstring):

    - ``"k2"``, or any estimator with ``straight_through=True``: unbiased
      :math:`\nabla\mathrm{KL}(\pi\|\pi_{ref})` (verl ``k2`` / ``k3+``, OpenRLHF PR #1101).
    - ``"k1"``: zero expected gradient (:math:`E_\pi[\nabla\log\pi] = 0`); emits
      :class:`BiasedGradientWarning`.
    - ``"k3"`` (GRPO's default, TRL ``beta > 0``, verl ``low_var_kl``): expected gradient is
      :math:`\nabla\mathrm{KL}(\pi_{ref}\|\pi)`, not the KL it estimates; emits
      :class:`BiasedGradientWarning` (verl PR #2953).

    Args:
        log_probs: ``(B, T)`` log-probabilities under the current policy (differentiable).
        ref_log_probs: ``(B, T)`` log-probabilities under the reference policy.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        straight_through: value of ``estimator``, gradient of ``k2``.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"`` or
            ``"none"``.
        normalizer: explicit positive denominator (number or 0-d tensor) for micro-batch/rank
            additive losses.
        max_response_length: Dr. GRPO constant :math:`C` for ``"sequence_sum_normalized"``
            (default ``T``).
        log_ratio_bound: clamp :math:`b > 0` on the log-ratio, or None.

    Returns:
        A scalar (``(B, T)`` for ``reduction="none"``) with the dtype and device of
        ``log_probs``; computed in float32 (float64 for float64 inputs). Fully masked inputs give 0.

    Raises:
        ValueError: on mismatched shapes/devices, an unknown ``estimator`` or ``reduction``, a
            non-positive ``normalizer``/``max_response_length``/``log_ratio_bound``.
        TypeError: on non-numeric inputs or a non-bool ``straight_through``.

    Warns:
        BiasedGradientWarning: for ``"k1"`` or ``"k3"`` without ``straight_through``.

    References:
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3-4; Schulman 2020, "Approximating KL
        divergence"; verl PR #2953.

    Examples:
        >>> import torch
        >>> kl_loss(torch.tensor([[0.0, 2.0]]), torch.zeros(1, 2), torch.tensor([[1, 1]]),
        ...         estimator="k2")
        tensor(1.)

    .. versionadded:: 0.1.0
    """
    inputs = _KLInputs(log_probs, ref_log_probs, mask)
    bound = _validate_kl_options(estimator, straight_through, log_ratio_bound)
    validate_choice(reduction, "reduction", REDUCTIONS)
    if not straight_through and estimator == "k1":
        _warn_biased(
            'kl_loss(estimator="k1") has zero expected gradient on-policy (E[grad log pi] = 0); '
            'use estimator="k2", or straight_through=True, or k1 as a reward penalty '
            "(kl_penalized_token_rewards)"
        )
    elif not straight_through and estimator == "abs":
        _warn_biased(
            'kl_loss(estimator="abs") has a biased gradient (sign(d) grad log pi, not the '
            'gradient of a KL); use estimator="k2" or straight_through=True'
        )
    elif not straight_through and estimator == "k3":
        _warn_biased(
            'kl_loss(estimator="k3") has a biased gradient (its expectation is the gradient of '
            'KL(ref || pi), not KL(pi || ref)); use straight_through=True (verl "k3+") or '
            'estimator="k2" for the unbiased gradient'
        )
    terms = inputs.terms(
        estimator=estimator, straight_through=straight_through, log_ratio_bound=bound
    )  # (B, T)
    loss = aggregate(
        terms,
        inputs.mask,
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )
    return loss.to(inputs.log_probs.dtype)


def last_selected(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, T)``: True at the last selected token of each row (no row: all False).

    No host sync: the index is an ``argmax`` over ``where(mask, t, -1)``.
    """
    tokens = mask.shape[-1]
    if tokens == 0:
        return mask.clone()
    positions = torch.arange(tokens, device=mask.device)  # (T,)
    scored = torch.where(mask, positions, -1)  # (B, T)
    last_index = scored.argmax(dim=-1, keepdim=True)  # (B, 1)
    return (positions == last_index) & mask  # (B, T); all False where a row is empty


def kl_penalized_token_rewards(
    log_probs: ArrayLike,
    ref_log_probs: ArrayLike,
    scores: ArrayLike,
    mask: ArrayLike,
    *,
    kl_coef: Scalar,
    estimator: Estimator = "k1",
    log_ratio_bound: Scalar | None = None,
) -> torch.Tensor:
    r"""Per-token rewards: a KL penalty on every selected token, the score on the last one.

    .. math::

        R_{it} = -\beta\, k_{it} + \mathbb{1}[t = t^{last}_i]\, s_i \quad (M_{it} = 1), \qquad
        R_{it} = 0 \quad (M_{it} = 0),

    with :math:`k_{it}` the :func:`kl_estimate` of ``estimator`` and :math:`t^{last}_i` the last
    selected token of sequence :math:`i` (OpenRLHF / torchtune / InstructGPT convention). A
    sequence with no selected token gets no reward at all (its score is dropped, no NaN). At
    :math:`\gamma = 1` the return of sequence :math:`i` is
    :math:`\sum_t R_{it} = s_i - \beta \sum_t M_{it} k_{it}`, which for ``"k1"`` without a bound
    is the seed :func:`rlobjectives.kl_penalized_rewards`'s penalized reward
    :math:`r_i - \beta D_i`.

    The rewards are meant to be used as constants (pass the behaviour-policy ``old_log_probs``
    or detach): the KL gradient then arrives through the policy-gradient score function, which is
    unbiased only for ``"k1"``; ``"k2"``/``"k3"`` (and a clamped ``"k1"``) emit
    :class:`BiasedGradientWarning`. verl's ``use_kl_in_reward`` corresponds to this placement.

    Args:
        log_probs: ``(B, T)`` log-probabilities of the sampled tokens (usually ``old_log_probs``).
        ref_log_probs: ``(B, T)`` reference log-probabilities.
        scores: ``(B,)`` or ``(B, 1)`` sequence scores (reward-model or verifier output).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        kl_coef: :math:`\beta \ge 0` (number or 0-d tensor).
        estimator: ``"k1"`` (default, unbiased as a reward), ``"k2"`` or ``"k3"``.
        log_ratio_bound: optional clamp :math:`b > 0` on the log-ratio (default None).

    Returns:
        ``(B, T)`` rewards, zeros at unselected tokens, on the device of ``log_probs``; float32
        (float64 if an input is float64), also for bf16/fp16 inputs.

    Raises:
        ValueError: on mismatched shapes/devices, ``scores`` not of length B, an unknown
            ``estimator``, a negative/non-finite ``kl_coef``, a non-positive ``log_ratio_bound``.
        TypeError: on non-numeric inputs.

    Warns:
        BiasedGradientWarning: for ``"k2"``/``"k3"``, or ``"k1"`` with a ``log_ratio_bound``.

    References:
        Ziegler et al. 2019, arXiv:1909.08593 Eq. 2; Ouyang et al. 2022, arXiv:2203.02155 Eq. 2;
        Hu et al. 2025, REINFORCE++, arXiv:2501.03262 (token-level KL penalty).

    Examples:
        >>> import torch
        >>> kl_penalized_token_rewards(torch.tensor([[-1.0, -2.0, 0.0]]),
        ...                            torch.tensor([[-1.5, -2.5, 0.0]]), torch.tensor([3.0]),
        ...                            torch.tensor([[1, 1, 0]]), kl_coef=0.5)
        tensor([[-0.2500,  2.7500,  0.0000]])

    .. versionadded:: 0.1.0
    """
    inputs = _KLInputs(log_probs, ref_log_probs, mask)
    scores_t = as_float_tensor(scores, "scores", inputs.log_probs.device)
    check_same_device({"log_probs": inputs.log_probs, "scores": scores_t})
    batch = inputs.log_probs.shape[0]
    if scores_t.ndim == 2 and scores_t.shape[1] == 1:
        scores_t = scores_t.squeeze(-1)
    if scores_t.ndim != 1 or scores_t.shape[0] != batch:
        raise ValueError(
            f"scores must have shape (B,) or (B, 1) with B = {batch} (one score per sequence of "
            f"log_probs), got shape {tuple(scores_t.shape)}"
        )
    coefficient = validate_scalar(kl_coef, "kl_coef", minimum=0.0)
    bound = _validate_kl_options(estimator, False, log_ratio_bound)
    if estimator != "k1":
        _warn_biased(
            f'kl_penalized_token_rewards(estimator="{estimator}"): as a (detached) reward the '
            f"{estimator} penalty gives a biased policy gradient of KL(pi || ref); k1 is the "
            "unbiased reward penalty (use k2 or k3 with straight_through=True in kl_loss instead)"
        )
    elif bound is not None:
        _warn_biased(
            "kl_penalized_token_rewards: clamping the k1 log-ratio (log_ratio_bound) biases the "
            "summed KL penalty wherever the bound fires"
        )
    dtype = compute_dtype(inputs.log_probs, inputs.ref_log_probs, scores_t)
    kl = inputs.terms(
        estimator=estimator, straight_through=False, log_ratio_bound=bound, dtype=dtype
    )  # (B, T)
    if isinstance(coefficient, torch.Tensor):
        coefficient = coefficient.to(dtype=dtype, device=kl.device)
    penalty = masked_fill_zero(-coefficient * kl, inputs.mask)  # (B, T)
    last = last_selected(inputs.mask)  # (B, T)
    score_at_last = masked_fill_zero(scores_t.to(dtype).unsqueeze(-1).expand_as(penalty), last)
    return penalty + score_at_last  # (B, T)
