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

import os
import sys
import warnings
from collections.abc import Callable
from typing import Literal, get_args

import torch

from .._core.layout import sequence_layout, token_matrix, token_ndim
from .._core.reduction import clamp, masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_estimator_spelling,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_bool,
    validate_choice,
    validate_context_group,
    validate_scalar,
)

__all__ = [
    "BINARY_KL_EPSILON",
    "ESTIMATORS",
    "ESTIMATOR_FUNCTIONS",
    "ESTIMATOR_GRADIENTS",
    "KLInputs",
    "binary_kl",
    "binary_kl_gap",
    "BiasedGradientWarning",
    "Estimator",
    "kl_gradient",
    "kl_terms",
    "validate_kl_options",
    "warn_biased",
    "warn_biased_kl_loss",
]

Estimator = Literal["k1", "k2", "k3", "abs"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)


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


# The package's directory (this module is in its kl/ folder): every library frame is below it.
_PACKAGE_DIRECTORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warn_biased` for the first frame outside the library.

    The warning is attributed to the user's line, however many library frames (the public
    function, its environment check, a preset) lie in between.
    """
    level, frame = 1, sys._getframe(2)  # frame 1 (level 1) is warn_biased itself
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRECTORY):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level + 1


def warn_biased(message: str) -> None:
    """Emit :class:`BiasedGradientWarning` at the caller's line (not while compiling).

    ``torch.compile`` cannot trace ``warnings.warn`` (it would break a ``fullgraph`` graph), so the
    warning is raised by eager calls only; the condition depends on Python arguments alone. The
    line is the first one outside the library (:func:`_caller_stacklevel`).
    """
    if not torch.compiler.is_compiling():
        warnings.warn(message, BiasedGradientWarning, stacklevel=_caller_stacklevel())


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    # (d / 2) d, not d^2 / 2: the same single rounding, but d^2 overflows float32 for
    # |d| > 1.8e19 where d^2 / 2 is still finite.
    return (0.5 * log_ratio) * log_ratio


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # exp(-d) + d - 1 with expm1 (no cancellation for small d); the clamp only removes rounding
    # below 0 (k3 >= 0 exactly in real arithmetic).
    return (torch.expm1(-log_ratio) + log_ratio).clamp(min=0.0)


#: One function per estimator: the per-token estimate from the log-ratio d.
ESTIMATOR_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": torch.abs,
}

#: Their derivatives with respect to d (used by the fused hidden-state path): 1, d, 1 - e^{-d}.
ESTIMATOR_GRADIENTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": torch.ones_like,
    "k2": lambda log_ratio: log_ratio,
    "k3": lambda log_ratio: -torch.expm1(-log_ratio),
    "abs": torch.sign,  # torch.abs passes gradient 0 at d = 0, as sign(0) = 0
}


def kl_terms(
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

    The single implementation of the estimator math (used by the public functions here, by the
    seed :func:`rlobjectives.kl_penalized_rewards` and by the hidden-state path). Inputs are
    validated by the caller.
    """
    # Select before any arithmetic: NaN/inf at unselected positions reaches no value or gradient.
    log_ratio = masked_fill_zero(log_probs.to(dtype), mask) - masked_fill_zero(
        ref_log_probs.to(dtype), mask
    )  # (B, T)
    if log_ratio_bound is not None:
        log_ratio = clamp(log_ratio, -log_ratio_bound, log_ratio_bound)  # (B, T)
    estimate = ESTIMATOR_FUNCTIONS[estimator](log_ratio)
    if straight_through and estimator != "k2":
        k2 = _k2(log_ratio)  # (B, T)
        estimate = estimate.detach() + (k2 - k2.detach())
    return masked_fill_zero(estimate, mask)


def kl_gradient(
    log_ratio: torch.Tensor,
    *,
    estimator: str,
    straight_through: bool,
    log_ratio_bound: float | torch.Tensor | None,
) -> torch.Tensor:
    """``d k / d log_probs`` per token, in closed form, for a selected, unbounded log-ratio.

    Zero where the bound fires (``torch.clamp`` passes the gradient on the closed interval), as
    autograd of :func:`kl_terms` gives it (up to the ``k3`` rounding clamp at ``d`` ~ 0, where
    both are ~0).
    """
    bounded = log_ratio
    if log_ratio_bound is not None:
        bounded = clamp(log_ratio, -log_ratio_bound, log_ratio_bound)
    gradient = bounded if straight_through else ESTIMATOR_GRADIENTS[estimator](bounded)
    if log_ratio_bound is not None:
        inside = log_ratio.abs() <= torch.as_tensor(log_ratio_bound, dtype=log_ratio.dtype)
        gradient = torch.where(inside, gradient, torch.zeros_like(gradient))
    return gradient


class KLInputs:
    """Validated ``(log_probs, ref_log_probs, mask)`` (coerced, same device, same shape).

    With ``cu_seqlens`` (packed sequences) the tensors are ``(N,)`` or ``(1, N)``, kept as
    ``(1, N)``; ``layout`` maps tokens to sequences (and holds the validated
    ``context_group``) and ``flat`` records ``(N,)`` inputs.
    """

    def __init__(
        self,
        log_probs: ArrayLike,
        ref_log_probs: ArrayLike,
        mask: ArrayLike,
        cu_seqlens: ArrayLike | None = None,
        context_group: object = None,
    ) -> None:
        context = validate_context_group(context_group)
        packed = cu_seqlens is not None
        self.flat = packed and token_ndim(log_probs) == 1
        self.log_probs = token_matrix(as_float_tensor(log_probs, "log_probs"), "log_probs", packed)
        device = self.log_probs.device
        self.ref_log_probs = token_matrix(
            as_float_tensor(ref_log_probs, "ref_log_probs", device), "ref_log_probs", packed
        )
        self.mask = token_matrix(as_mask(mask, "mask", device), "mask", packed)
        check_same_device(
            {"log_probs": self.log_probs, "ref_log_probs": self.ref_log_probs, "mask": self.mask}
        )
        check_shape(self.ref_log_probs, "ref_log_probs", self.log_probs.shape, "log_probs")
        check_shape(self.mask, "mask", self.log_probs.shape, "log_probs")
        self.layout = sequence_layout(cu_seqlens, self.log_probs, context)

    def terms(
        self,
        *,
        estimator: str,
        straight_through: bool,
        log_ratio_bound: float | torch.Tensor | None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """:func:`kl_terms` of these inputs, in ``dtype`` (default: their computation dtype)."""
        return kl_terms(
            self.log_probs,
            self.ref_log_probs,
            self.mask,
            estimator=estimator,
            straight_through=straight_through,
            log_ratio_bound=log_ratio_bound,
            dtype=compute_dtype(self.log_probs, self.ref_log_probs) if dtype is None else dtype,
        )  # (B, T)


def validate_kl_options(
    estimator: str, straight_through: bool, log_ratio_bound: Scalar | None
) -> float | torch.Tensor | None:
    """Validate the estimator options; return the validated log-ratio bound (or None)."""
    check_estimator_spelling(estimator, ESTIMATORS)  # verl's names: "did you mean"
    validate_choice(estimator, "estimator", ESTIMATORS)
    validate_bool(straight_through, "straight_through")
    if log_ratio_bound is None:
        return None
    return validate_scalar(log_ratio_bound, "log_ratio_bound", minimum=0.0, strict=True)


def warn_biased_kl_loss(estimator: str, straight_through: bool, caller: str) -> None:
    """Warn when the KL estimate used as a loss term has a biased or zero expected gradient."""
    if straight_through or estimator not in _BIASED_AS_LOSS:
        return
    warn_biased(f'{caller}(estimator="{estimator}") ' + _BIASED_AS_LOSS[estimator])


_BIASED_AS_LOSS = {
    "abs": (
        "has a biased gradient (sign(d) grad log pi, not the gradient of a KL); use "
        'estimator="k2" or straight_through=True'
    ),
    "k1": (
        'has zero expected gradient on-policy (E[grad log pi] = 0); use estimator="k2", or '
        "straight_through=True, or k1 as a reward penalty (kl_penalized_token_rewards)"
    ),
    "k3": (
        "has a biased gradient (its expectation is the gradient of KL(ref || pi), not "
        'KL(pi || ref)); use straight_through=True (verl "k3+") or estimator="k2" for the '
        "unbiased gradient"
    ),
}

#: verl's and SkyRL's epsilon in the binary KL's complement term.
BINARY_KL_EPSILON = 1e-8


def binary_kl(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    r"""DPPO's binary KL :math:`D(p^{old} \| p)` with verl's :math:`\varepsilon`, no NaN at 0, 1.

    .. math::

        D = p^{old} (\ell^{old} - \ell) + (1 - p^{old}) \log\frac{1 - p^{old} + \varepsilon}
            {1 - p + \varepsilon}, \qquad 1 - p = -\mathrm{expm1}(\ell),

    which is :math:`p^{old}\log(p^{old}/p) + (1 - p^{old})\log\frac{1 - p^{old} + \varepsilon}
    {1 - p + \varepsilon}` with the complements computed without cancellation (verl's
    ``1 - exp(l)`` is 0 in float32 for :math:`\ell > -6 \cdot 10^{-8}`, which moves
    :math:`\log(1 - p + \varepsilon)` by up to 2 there). The logarithm of the quotient is exact
    to an ulp of itself, an absolute error of :math:`10^{-7}` in :math:`D` (float32): harmless
    against the thresholds. :math:`\ell^{old} - \ell` is raised to the dtype's lowest finite
    value, so that the first term is 0 (its limit) at :math:`p^{old} = 0` (:math:`\ell^{old} =
    -\infty`: verl computes NaN there and masks the token).
    """
    return binary_kl_gap(log_probs, old_log_probs, old_log_probs - log_probs)


def binary_kl_gap(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, gap: torch.Tensor
) -> torch.Tensor:
    r""":func:`binary_kl` given ``gap`` = :math:`\ell^{old} - \ell` (a buffer it spends)."""
    lowest = torch.finfo(log_probs.dtype).min
    first = gap.clamp_(min=lowest).mul_(torch.exp(old_log_probs))  # p_old (l_old - l)
    # p_old - 1 = expm1(l_old) kept negated (a sign flip is exact: eps - expm1(l) is
    # 1 - p + eps bit for bit), two passes fewer than negating each complement
    old_shortfall = torch.expm1(old_log_probs)  # p_old - 1
    complement = torch.rsub(torch.expm1(log_probs), BINARY_KL_EPSILON)  # 1 - p + eps
    quotient = torch.rsub(old_shortfall, BINARY_KL_EPSILON).div_(complement).log_()
    return first.addcmul_(old_shortfall, quotient, value=-1.0)  # + (1 - p_old) log(...)
