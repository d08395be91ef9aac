r"""The batch-level selections of M2PO, Clip-Cov and KL-Cov as functions of their own.

:class:`~rlobjectives.M2PO`, :class:`~rlobjectives.ClipCov` and :class:`~rlobjectives.KLCov`
select their tokens from the whole call, as the peers do per micro-batch. These functions give
the same selections on any batch, so that they can be computed once where the peers' split
would change them:

- :func:`m2po_mask`: M2PO's kept tokens of a log-ratio (for example AReaL's decoupled
  ``old_log_probs - rollout_log_probs``, or the mini-batch's log-ratio before its micro-batches);
- :func:`cov_selection`: the tokens a Clip-Cov / KL-Cov object acts on in a call on these
  tensors (to compute once per mini-batch and hand each micro-batch its rows through the
  object's ``selection=``).

:mod:`rlobjectives.distributed` has the variants over every data-parallel rank.
"""

from __future__ import annotations

import torch

from .._core.layout import sequence_layout, token_matrix, token_output
from .._core.selection import m2po_kept
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_scalar,
)
from ..policy.call import as_surrogate, validate_policy_call, validate_surrogate_options
from ..policy.loss import policy_tokens
from ..policy.surrogates.base import PolicyTokens
from ..policy.surrogates.cov import ClipCov, CovSelection, KLCov

__all__ = ["CovSelection", "cov_selection", "m2po_mask", "selection_inputs"]

_NAMES = ("log_probs", "old_log_probs", "advantages", "mask")


@checks_environment
def m2po_mask(
    log_ratio: ArrayLike,
    mask: ArrayLike,
    *,
    threshold: Scalar = 0.04,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""M2PO's kept tokens: mask the fewest largest :math:`\Delta^2` so the rest's mean is below τ.

    With :math:`m_{(1)} \ge \dots \ge m_{(n)}` the squared log-ratios :math:`\Delta^2` of the
    ``n`` selected tokens, sorted (stable: ties by the row-major position, the earlier one
    masked first), the kept tokens are those left after masking the :math:`i` largest, with
    :math:`i` the first index whose suffix mean :math:`\frac{1}{n - i}\sum_{j > i} m_{(j)}` is
    below ``threshold`` (strict); when none is, the :math:`n - 1` largest (at least one token is
    kept). The whole batch is one set (not per sequence), exactly as AReaL's
    ``_get_m2po_loss_mask`` on one micro-batch; the packed layout gives the same tokens.

    Args:
        log_ratio: ``(B, T)`` log-ratios :math:`\Delta` (packed: ``(N,)`` or ``(1, N)``); AReaL
            squares ``old_log_probs - proximal_log_probs`` (behaviour minus proximal).
        mask: bool/numeric, the shape of ``log_ratio``; nonzero selects the token.
        threshold: :math:`\tau > 0` (AReaL ``m2_threshold``; the paper's 0.04).
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences (only the layout of the
            tensors: the mask is over the whole batch).

    Returns:
        bool mask of the kept tokens, a subset of ``mask``, the shape of ``log_ratio``; the
        decisions in float32 (float64 for float64 input); no gradient.

    Raises:
        ValueError: a shape or device mismatch, ``threshold <= 0`` or non-finite, malformed
            ``cu_seqlens``.
        TypeError: non-numeric inputs.

    References:
        Zheng et al. 2025, M2PO, arXiv:2510.01161; AReaL ``_get_m2po_loss_mask``.

    Examples:
        >>> m2po_mask(torch.tensor([[0.1, -0.5, 0.3, 0.05, 1.0, 0.2]]), torch.ones(1, 6))
        tensor([[ True, False,  True,  True, False,  True]])

    .. versionadded:: 0.3.0
    """
    packed = cu_seqlens is not None
    values = as_float_tensor(log_ratio, "log_ratio")
    flat = values.ndim == 1
    values = token_matrix(values, "log_ratio", packed)
    mask_t = token_matrix(as_mask(mask, "mask", values.device), "mask", packed)
    check_same_device({"log_ratio": values, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(values.shape), "log_ratio")
    sequence_layout(cu_seqlens, values)  # validates the boundaries
    tau = validate_scalar(threshold, "threshold", minimum=0.0, strict=True)
    with torch.no_grad():
        selected = torch.where(mask_t, values.detach().to(compute_dtype(values)), 0.0)
        kept = m2po_kept(selected, mask_t, tau)
    return token_output(kept, flat)


def selection_inputs(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    log_ratio_bound: Scalar | None,
    cu_seqlens: ArrayLike | None,
) -> PolicyTokens:
    """The validated, detached :class:`PolicyTokens` of a call on these tensors."""
    options = validate_surrogate_options(log_ratio_bound=log_ratio_bound)
    call = validate_policy_call(
        (log_probs, old_log_probs, advantages, mask),
        _NAMES,
        options=options,
        reduction="token_mean",
        normalizer=None,
        max_response_length=None,
        diagnostics_normalizer=None,
        cu_seqlens=cu_seqlens,
    )
    inputs = call.inputs._replace(log_probs=call.inputs.log_probs.detach())
    with torch.no_grad():
        return policy_tokens(inputs, options, call.layout)[0]


@checks_environment
def cov_selection(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: ClipCov | KLCov,
    log_ratio_bound: Scalar | None = 20.0,
    cu_seqlens: ArrayLike | None = None,
) -> CovSelection:
    r"""The tokens a :class:`~rlobjectives.ClipCov` / :class:`~rlobjectives.KLCov` acts on here.

    The selection :func:`rlobjectives.policy_loss` with ``surrogate`` makes on these tensors:
    with :math:`\mathrm{cov}_t = (A_t - \bar A)(\ell_t - \bar\ell)` over the :math:`N` selected
    tokens and :math:`k = \max(\lfloor\rho N\rfloor, 1)`, KL-Cov's top-k by covariance (ties to
    the earlier token), Clip-Cov's :math:`\min(k, n)` of its :math:`n` candidates drawn from one
    seed of ``surrogate.generator`` (the default generator when None; one draw per call, as
    ``policy_loss``); a ``surrogate.selection`` given is returned (with the candidates and
    ``k``). Hand the result to the object with
    ``dataclasses.replace(surrogate, selection=result.selected)`` (or its rows to each
    micro-batch's call) to act on the same tokens.

    Args:
        log_probs: ``(B, T)`` current log-probabilities (detached here).
        old_log_probs: ``(B, T)`` behaviour log-probabilities (Clip-Cov's band).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)``.
        mask: ``(B, T)`` bool/numeric; nonzero selects the token.
        surrogate: a :class:`~rlobjectives.ClipCov` or :class:`~rlobjectives.KLCov`.
        log_ratio_bound: as :func:`rlobjectives.policy_loss` (the ratio of Clip-Cov's band).
        cu_seqlens: packed sequences, as :func:`rlobjectives.policy_loss`.

    Returns:
        :class:`CovSelection` ``(selected, candidates, k)``, the masks in the layout of
        ``mask`` (packed: ``(1, N)``); no gradient.

    Raises:
        ValueError / TypeError: as :func:`rlobjectives.policy_loss`; a ``surrogate`` that is not
        a Clip-Cov or KL-Cov object.

    References:
        Cui et al. 2025, arXiv:2505.22617 (Clip-Cov, KL-Cov); verl ``compute_policy_loss_clip_cov``
        / ``compute_policy_loss_kl_cov``.

    .. versionadded:: 0.3.0
    """
    objective = as_surrogate(surrogate)
    if not isinstance(objective, ClipCov | KLCov):
        raise TypeError(
            f"surrogate must be a ClipCov or KLCov object, got {type(surrogate).__name__}"
        )
    inputs = selection_inputs(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        log_ratio_bound=log_ratio_bound,
        cu_seqlens=cu_seqlens,
    )
    with torch.no_grad():
        if isinstance(objective, ClipCov):
            return objective.select(inputs, objective.band(inputs))
        return objective.select(inputs)
