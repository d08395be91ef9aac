r"""Token-level policy loss on the Triton kernels: launcher and autograd function.

Flat token layout: every per-token tensor is ``(N,)`` (``N = B * T`` flattened, row-major);
per-sequence quantities are given per token, per row with ``row_length=T``, or as one value.
Per selected token (unselected tokens are exact zeros everywhere):

.. math::

    \Delta = \mathrm{clip}(\ell - \ell^{old}, -b, b), \quad r = e^{\Delta}, \qquad
    L = -\rho\, s(r, A, \ell) + \beta\, k(\mathrm{clip}(\ell - \ell^{ref}, -b, b)) - c_H H,

with ``s`` one of (``options.surrogate``), the library's definitions
(:mod:`rlobjectives.policy.surrogates`, the fused path :mod:`rlobjectives.policy.fused`; the same
values, gradients and diagnostics up to float32 rounding):

- ``"clip"``: :math:`s = A\,\mathrm{clip}(r, L, H)` with the per-sign bounds of
  :func:`rlobjectives.policy.surrogates.clip.clip_bounds` (the band, ``delta``, ``dual``); the
  slope :math:`rA` where :math:`L \le r \le H` and the log-ratio bound held, halved at an exact
  dual-clip tie :math:`r = c` (clipping decided on the ratio, as the fused PyTorch path).
- ``"cispo"``: :math:`\mathrm{sg}(w) A \ell`, :math:`w = \mathrm{clamp}(r, lo, hi)` with
  :func:`rlobjectives.policy.surrogates.cispo.cispo_bounds` (TRL's cap or verl's band).
- ``"sapo"``: :math:`(4/\tau) \sigma(\tau (r - 1)) A`, :math:`\tau = \tau_+` if :math:`A > 0`
  else :math:`\tau_-`.
- ``"dppo_tv"``, ``"dppo_kl"``: :math:`\mathrm{sg}(\min(r, c)) A \ell` inside the binary trust
  region of :func:`rlobjectives.policy.surrogates.dppo.dppo_trust_region` (without a cap
  :math:`rA`), 0 outside.
- ``"dro"``: :math:`\ell A - \frac{1}{2}\beta(\ell - \ell^{old})^2` (the raw log-ratio).
- ``"none"``: 0 (only the KL term: ``kl_loss``).

The importance weights :math:`\rho` enter the products as :math:`\tilde A = \rho A`; sign
decisions and diagnostics use :math:`A`. The last nine sums are the numerators of
:class:`rlobjectives.PolicyLossDiagnostics` (its field order).

``GSPO``: ``sequence_log_ratio`` replaces :math:`\ell - \ell^{old}` in :math:`\Delta` (value of
the sequence's mean log-ratio, gradient 1 with respect to :math:`\ell`); the k1/k3 diagnostics
keep the token log-ratio. The reduced loss is :math:`\sum_i w_i L_i` with the per-token
reduction weights :math:`w = \partial\,\mathrm{loss} / \partial L_i` computed by the caller from
the mask (e.g. ``1 / n_tokens`` for token_mean, ``1 / (n_i S)`` for sequence_mean).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..policy.specification import DIAGNOSTIC_LOG_RATIO_BOUND
from ..policy.surrogates import Clip, SurrogateObjective
from ..policy.surrogates.sapo import SAPO_HALF_PEAK
from .common import (
    Indexed,
    check_mask,
    check_tokens,
    first_order_only,
    grid_blocks,
    indexed,
    mask_bytes,
    on_tensor_device,
)
from .loading import kernels

__all__ = [
    "TokenLossForward",
    "TokenLossFunction",
    "TokenLossOptions",
    "TokenLossSums",
    "scale_by_mask",
    "token_loss_forward",
]

_BLOCK = 1024
_WARPS = 4


class TokenLossOptions(NamedTuple):
    r"""Hyperparameters of one call (Python numbers; the kernel compiles per structural option).

    Attributes:
        surrogate: a token-local surrogate object (:class:`~rlobjectives.Clip`,
            :class:`~rlobjectives.CISPO`, :class:`~rlobjectives.SAPO`, :class:`~rlobjectives.DPPO`,
            :class:`~rlobjectives.DRO`; its
            :meth:`~rlobjectives.policy.surrogates.base.SurrogateObjective.kernel_flags` set the
            kernel up), or None for no policy term (only the KL term: ``kl_loss``).
        log_ratio_bound: :math:`b > 0` or None (then no bound; KL log-ratio unbounded too).
        diagnostic_bound: bound of the k3 diagnostic; None: ``log_ratio_bound`` or 20.
        kl_coef: :math:`\beta` (the KL term is on when ``ref_log_probs`` is given).
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        kl_straight_through: value of the estimator, gradient of k2 (verl ``k3+``).
        kl_importance_weighted: multiply the KL term by the importance weights too
            (``kl_loss(importance_weights=...)``); TRL's policy loss does not.
        entropy_coef: :math:`c_H` of the entropy bonus (on when ``entropy`` is given).
    """

    surrogate: SurrogateObjective | None = Clip()
    log_ratio_bound: float | None = 20.0
    diagnostic_bound: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_straight_through: bool = False
    kl_importance_weighted: bool = False
    entropy_coef: float = 0.0


class TokenLossSums(NamedTuple):
    """Sums over the selected tokens (0-d float32 tensors; counts are exact up to 2**24).

    ``L`` is the per-token total loss, ``P = rho (-s)`` its policy part, ``k`` the KL estimate
    (before ``kl_coef``), ``H`` the entropy; ``w`` the reduction weights (1 when none given).
    Diagnostic fractions are these counts divided by the (global) selected-token count.
    """

    weighted_loss: torch.Tensor  # sum w L (the loss)
    weighted_policy: torch.Tensor  # sum w P
    weighted_kl: torch.Tensor  # sum w k
    weighted_entropy: torch.Tensor  # sum w H
    policy_sum: torch.Tensor  # sum P
    kl_sum: torch.Tensor  # sum k
    entropy_sum: torch.Tensor  # sum H
    selected: torch.Tensor  # selected tokens
    out_of_band: torch.Tensor  # clipped_fraction's numerator
    binding_low: torch.Tensor  # clip_fraction_low's
    binding_high: torch.Tensor  # clip_fraction_high's
    dual_binding: torch.Tensor  # dual_clip_fraction's
    bound_fired: torch.Tensor  # log_ratio_bound_fraction's: |policy log-ratio| > b
    ratio_sum: torch.Tensor  # ratio_mean's: sum r
    k1_sum: torch.Tensor  # sum -(l - l_old) (token log-ratio, unbounded)
    k3_sum: torch.Tensor  # sum g(clip(l - l_old, +-b_diag)), g(x) = e^x - 1 - x
    weight_sum: torch.Tensor  # weight_mean's: the factor w of s = w A (or sg(w) A l)


class TokenLossForward(NamedTuple):
    r"""Result of :func:`token_loss_forward`.

    Attributes:
        coefficient: ``(N,)`` float32, :math:`w\,\partial L / \partial \ell` (with no
            weights: :math:`\partial L / \partial \ell`); 0 at unselected tokens.
        per_token_loss: ``(N,)`` float32 :math:`L` (zeros at unselected tokens) when requested.
        totals: ``(17,)`` float32, the sums in :class:`TokenLossSums` field order.
    """

    coefficient: torch.Tensor
    per_token_loss: torch.Tensor | None
    totals: torch.Tensor

    @property
    def sums(self) -> TokenLossSums:
        """:class:`TokenLossSums`: views into ``totals``, built on access.

        Seventeen views cost more host time than the kernel launch at small N, so the autograd
        path never builds them.
        """
        return TokenLossSums(*self.totals.unbind())


_DEFAULT_OPTIONS = TokenLossOptions()


#: The kernel arguments of the surrogate terms, with the placeholders (never read) that a
#: surrogate's :meth:`kernel_flags` leaves in place; an edge given as None is absent.
_SURROGATE_PLACEHOLDERS: dict[str, Any] = {
    "low": None,
    "high": None,
    "upper_positive": None,
    "upper_negative": None,
    "dual_clip": None,
    "tau_positive": 1.0,
    "tau_negative": 1.0,
    "half_peak": SAPO_HALF_PEAK,
    "ratio_cap": None,
    "beta": 1.0,
}


def _surrogate_flags(surrogate: SurrogateObjective | None) -> tuple[str, dict[str, Any]]:
    """The kernel's surrogate name and the surrogate's setup, placeholders where it has none."""
    if surrogate is None:
        return "none", dict(_SURROGATE_PLACEHOLDERS)
    if not isinstance(surrogate, SurrogateObjective) or not surrogate.token_local:
        raise ValueError(
            f"the token-loss kernel computes the token-local surrogates (Clip, CISPO, SAPO, "
            f"DPPO, DRO), "
            f"got surrogate={surrogate!r}"
        )
    setup = surrogate.kernel_flags()
    name = setup.pop("surrogate")
    return name, {**_SURROGATE_PLACEHOLDERS, **setup}


def _flags(options: TokenLossOptions, kernel_module: Any) -> dict[str, Any]:
    """Compile-time flags and runtime scalars of the kernel for ``options``."""
    name, setup = _surrogate_flags(options.surrogate)
    surrogate = kernel_module.SURROGATES.get(name)
    estimator = kernel_module.ESTIMATORS.get(options.kl_estimator)
    if surrogate is None or estimator is None:
        raise ValueError(
            f"surrogate must be one of {sorted(kernel_module.SURROGATES)} and kl_estimator one "
            f"of {sorted(kernel_module.ESTIMATORS)}, got {name!r} and "
            f"{options.kl_estimator!r}"
        )
    bound = options.log_ratio_bound
    diagnostic = options.diagnostic_bound
    if diagnostic is None:
        diagnostic = DIAGNOSTIC_LOG_RATIO_BOUND if bound is None else bound
    flags: dict[str, Any] = {
        key: 1.0 if value is None else float(value) for key, value in setup.items()
    }  # placeholders (never read) where an edge is absent
    flags.update(
        bound=0.0 if bound is None else float(bound),
        diagnostic_bound=float(diagnostic),
        kl_coef=float(options.kl_coef),
        entropy_coef=float(options.entropy_coef),
        SURROGATE=surrogate,
        HAS_LOW=setup["low"] is not None,
        HAS_HIGH=setup["high"] is not None,
        HAS_UPPER_POSITIVE=setup["upper_positive"] is not None,
        HAS_UPPER_NEGATIVE=setup["upper_negative"] is not None,
        HAS_DUAL=setup["dual_clip"] is not None,
        HAS_CAP=setup["ratio_cap"] is not None,
        HAS_BOUND=bound is not None,
        KL_ESTIMATOR=estimator,
        KL_STRAIGHT_THROUGH=bool(options.kl_straight_through),
    )
    return flags


def _tensor(argument: Indexed | None) -> torch.Tensor | None:
    return None if argument is None else argument.tensor


def _layout(argument: Indexed | None) -> tuple[int, int]:
    """``(divisor, stride)`` of an indexed argument (``(1, 0)`` when absent)."""
    return (1, 0) if argument is None else (argument.divisor, argument.stride)


@on_tensor_device
def token_loss_forward(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    options: TokenLossOptions = _DEFAULT_OPTIONS,
    weights: torch.Tensor | None = None,
    row_length: int | None = None,
    sequence_log_ratio: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    return_per_token: bool = False,
    block_size: int = _BLOCK,
) -> TokenLossForward:
    r"""One kernel launch: coefficient, optional per-token loss and the partial sums.

    Args:
        log_probs: ``(N,)`` current log-probabilities :math:`\ell` (fp16/bf16/fp32).
        old_log_probs: ``(N,)`` behaviour log-probabilities (unused for ``"none"``).
        advantages: ``(N,)``, ``(B,)`` with ``row_length`` or one value (unused for ``"none"``).
        mask: ``(N,)`` bool; True selects the token.
        options: :class:`TokenLossOptions`.
        weights: reduction weights :math:`w` ((N,), (B,) or one value); None means 1.
        row_length: ``T``, for ``(B,)``-shaped per-row tensors.
        sequence_log_ratio: GSPO log-ratio per token or per row (replaces the token's).
        importance_weights: constant :math:`\rho` multiplying :math:`-s` (as ``advantages``).
        ref_log_probs: ``(N,)`` reference log-probabilities: adds :math:`\beta k`.
        entropy: ``(N,)`` entropy :math:`H`: adds :math:`-c_H H`.
        return_per_token: also write the ``(N,)`` per-token loss.
        block_size: tokens per program (power of two).

    Returns:
        :class:`TokenLossForward`. No host synchronisation; inputs are not modified.

    Raises:
        TypeError / ValueError: on a dtype, shape, device or option outside this contract.
    """
    device = log_probs.device
    count = log_probs.shape[0] if log_probs.ndim == 1 else -1
    log_probs = check_tokens(log_probs, "log_probs", count, device)
    mask = check_mask(mask, count, device)
    module = kernels(device).token_loss
    flags = _flags(options, module)
    has_policy = options.surrogate is not None
    old = check_tokens(old_log_probs, "old_log_probs", count, device) if has_policy else None
    adv = indexed(advantages, "advantages", count, row_length, device) if has_policy else None
    weight = None if weights is None else indexed(weights, "weights", count, row_length, device)
    sequence = None
    if sequence_log_ratio is not None:
        sequence = indexed(sequence_log_ratio, "sequence_log_ratio", count, row_length, device)
    importance = None
    if importance_weights is not None:
        importance = indexed(importance_weights, "importance_weights", count, row_length, device)
    elif options.kl_importance_weighted:
        raise ValueError("kl_importance_weighted=True needs importance_weights")
    ref = None if ref_log_probs is None else check_tokens(ref_log_probs, "ref", count, device)
    ent = None if entropy is None else check_tokens(entropy, "entropy", count, device)
    programs = grid_blocks(count, block_size)
    columns = len(module.SUM_NAMES)
    coefficient = torch.empty(count, dtype=torch.float32, device=device)
    loss = torch.empty(count, dtype=torch.float32, device=device) if return_per_token else None
    partial = torch.empty((programs, columns), dtype=torch.float32, device=device)
    module.token_loss_kernel[(programs,)](
        log_probs, old, _tensor(adv), mask_bytes(mask), _tensor(weight), _tensor(sequence),
        _tensor(importance), ref, ent, coefficient, loss, partial, count,
        *_layout(adv), *_layout(weight), *_layout(sequence), *_layout(importance),
        HAS_WEIGHTS=weight is not None, HAS_SEQUENCE=sequence is not None,
        HAS_IMPORTANCE=importance is not None, HAS_KL=ref is not None,
        KL_IMPORTANCE=bool(options.kl_importance_weighted), HAS_ENTROPY=ent is not None,
        STORE_LOSS=return_per_token, COLUMNS=columns, BLOCK=block_size, num_warps=_WARPS,
        **flags,
    )  # fmt: skip
    totals = partial.sum(dim=0)  # (17,), one reduction on the device, deterministic
    return TokenLossForward(coefficient, loss, totals)


@on_tensor_device
def scale_by_mask(
    factor: torch.Tensor,
    gradient: torch.Tensor,
    mask: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    row_length: int | None = None,
) -> torch.Tensor:
    """``where(mask, factor * gradient, 0)`` in ``out_dtype``, one kernel launch.

    Args:
        factor: ``(N,)``, ``(B,)`` (with ``row_length``) or one value, float32.
        gradient: the same layouts (typically a 0-d incoming gradient).
        mask: ``(N,)`` bool.
        out_dtype: dtype of the result (the input's dtype).
        row_length: ``T`` for per-row factors.

    Returns:
        ``(N,)`` tensor of ``out_dtype``.
    """
    count = mask.shape[0]
    device = mask.device
    first = indexed(factor.float(), "factor", count, row_length, device)
    second = indexed(gradient.float(), "gradient", count, row_length, device)
    out = torch.empty(count, dtype=out_dtype, device=device)
    block = _BLOCK
    kernels(device).scale.scale_kernel[(grid_blocks(count, block),)](
        first.tensor, second.tensor, mask_bytes(mask.contiguous()), out, count,
        first.divisor, first.stride, second.divisor, second.stride,
        BLOCK=block, num_warps=_WARPS,
    )  # fmt: skip
    return out


class TokenLossFunction(torch.autograd.Function):
    r"""``(loss, per_token_loss, totals)`` with a one-launch backward ``grad * coefficient``.

    ``apply(log_probs, entropy, old_log_probs, advantages, mask, weights, kwargs)`` where
    ``kwargs`` holds the remaining keyword arguments of :func:`token_loss_forward`. Gradients
    flow to ``log_probs`` (:math:`\partial/\partial\ell`) and ``entropy``
    (:math:`-c_H w`); every other tensor is a constant. With ``weights`` the per-token loss is
    returned without gradient (its derivative needs the unweighted coefficient); without weights
    both outputs are differentiable. First-order only.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        old_log_probs: torch.Tensor | None,
        advantages: torch.Tensor | None,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        out = token_loss_forward(
            log_probs, old_log_probs, advantages, mask, weights=weights, entropy=entropy, **kwargs
        )
        per_token = out.per_token_loss
        if per_token is None:
            per_token = out.coefficient.new_empty(0)
        ctx.save_for_backward(out.coefficient, mask, weights)
        ctx.row_length = kwargs.get("row_length")
        ctx.entropy_coef = kwargs.get("options", TokenLossOptions()).entropy_coef
        ctx.dtypes = (log_probs.dtype, None if entropy is None else entropy.dtype)
        # One call: mark_non_differentiable replaces (does not extend) the marked set.
        if weights is not None:
            ctx.mark_non_differentiable(out.totals, per_token)
        else:
            ctx.mark_non_differentiable(out.totals)
        return out.totals[0].clone(), per_token, out.totals

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, grad_per_token: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        coefficient, mask, weights = ctx.saved_tensors
        gradient = grad_loss
        if weights is None and grad_per_token is not None and grad_per_token.numel():
            gradient = grad_per_token.float() + grad_loss.float()  # (N,)
        grad_log_probs = None
        if ctx.needs_input_grad[0]:
            grad_log_probs = scale_by_mask(coefficient, gradient, mask, ctx.dtypes[0])
        grad_entropy = None
        if ctx.needs_input_grad[1]:
            factor = gradient if weights is None else weights
            scale = -ctx.entropy_coef * (
                grad_loss if weights is not None else torch.ones_like(grad_loss)
            )
            grad_entropy = scale_by_mask(
                factor, scale, mask, ctx.dtypes[1], row_length=ctx.row_length
            )
        return grad_log_probs, grad_entropy, None, None, None, None, None
