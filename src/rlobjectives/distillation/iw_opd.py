r"""Importance-weighted on-policy distillation (IW-OPD): the position-debiased token advantage.

On-policy distillation's sampled-token signal :math:`\ell^T - \ell^{roll}` concentrates its
discrepancy in the early tokens of a response; IW-OPD reweights each token by how much of the
sequence's total discrepancy still lies ahead of it (TRL 1.16 ``trl/experimental/iw_opd``).
"""

from __future__ import annotations

import torch

from .._core.layout import Layout, sequence_layout, token_matrix, token_ndim, token_output
from .._core.reduction import masked_fill_zero
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

__all__ = ["iw_opd_advantages"]


@checks_environment
def iw_opd_advantages(
    teacher_log_probs: ArrayLike,
    rollout_log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    gamma: Scalar,
    eps: Scalar = 1e-8,
    cu_seqlens: ArrayLike | None = None,
) -> torch.Tensor:
    r"""IW-OPD per-token advantages :math:`w_t A_t` (detached).

    .. math::

        A_t = \mathrm{sg}(\ell^T_t - \ell^{roll}_t), \qquad
        w_t = 1 + \gamma\Big(1 - \frac{\sum_{s<t} M_s |A_s|}{\max(\sum_s M_s |A_s|, \epsilon)}\Big),

    at the selected tokens of each sequence (0 elsewhere): the first token gets weight
    :math:`1 + \gamma`, the weight falls as the sequence's discrepancy accumulates, and the
    last token keeps :math:`1 + \gamma |A_{last}| / \sum |A|`. The distillation loss is the
    policy gradient with these advantages: TRL's ``-ℓ·A`` reduced by a token mean,
    ``aggregate(-log_probs * iw_opd_advantages(...), mask, normalizer=N)``; or as
    ``advantages`` of :func:`rlobjectives.policy_loss` (per token). Packed sequences restart the
    prefix at their boundaries. Context parallelism is not supported here: the advantages are
    constants of the rollout, compute them on the whole sequences before the context split.

    Peer: TRL 1.16 ``IWOPDTrainer`` (``distillation_objective="iw_opd"``, ``iw_opd_gamma`` =
    :math:`\gamma` (0.5), ``iw_opd_epsilon`` = :math:`\epsilon` (1e-8); ``rollout_logprobs``
    the sampler's, or the student's own log-probabilities without them).

    Args:
        teacher_log_probs: ``(B, T)`` the teacher's log-probabilities of the sampled tokens.
        rollout_log_probs: ``(B, T)`` the rollout (student sampler) log-probabilities.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        gamma: :math:`\gamma \ge 0`, the weight amplification (number or 0-d tensor).
        eps: :math:`\epsilon > 0`, the floor of the total (number or 0-d tensor).
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.

    Returns:
        ``(B, T)`` advantages (packed: the shape of ``teacher_log_probs``), zeros at unselected
        tokens, detached, float32 (float64 when an input is float64).

    Raises:
        ValueError: mismatched shapes or devices, a negative ``gamma``, a non-positive
            ``eps``, non-finite values, malformed ``cu_seqlens``.
        TypeError: non-numeric inputs.

    References:
        "On the Position Bias of On-Policy Distillation" (IW-OPD), arXiv:2606.22600; TRL
        ``trl/experimental/iw_opd/iw_opd_trainer.py`` ``_compute_iw_opd_loss``.

    Examples:
        >>> # A = [1, .5, -1], prefix [0, 1, 1.5] of 2.5: w = 1 + .5 (1 - [0, .4, .6])
        >>> iw_opd_advantages([[-1.0, -1.0, -2.0]], [[-2.0, -1.5, -1.0]], [[1, 1, 1]], gamma=0.5)
        tensor([[ 1.5000,  0.6500, -1.2000]])

    .. versionadded:: 0.4.0
    """
    packed = cu_seqlens is not None
    flat = packed and token_ndim(teacher_log_probs) == 1
    teacher = token_matrix(
        as_float_tensor(teacher_log_probs, "teacher_log_probs"), "teacher_log_probs", packed
    )
    device = teacher.device
    rollout = token_matrix(
        as_float_tensor(rollout_log_probs, "rollout_log_probs", device), "rollout_log_probs", packed
    )
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", packed)
    check_same_device({"teacher_log_probs": teacher, "rollout_log_probs": rollout, "mask": mask_t})
    check_shape(rollout, "rollout_log_probs", tuple(teacher.shape), "teacher_log_probs")
    check_shape(mask_t, "mask", tuple(teacher.shape), "teacher_log_probs")
    layout = sequence_layout(cu_seqlens, teacher)
    amplification = validate_scalar(gamma, "gamma", minimum=0.0)
    floor = validate_scalar(eps, "eps", minimum=0.0, strict=True)
    dtype = compute_dtype(teacher, rollout)
    with torch.no_grad():
        advantages = masked_fill_zero(teacher.to(dtype), mask_t) - masked_fill_zero(
            rollout.to(dtype), mask_t
        )  # (B, T) A_t, 0 at unselected tokens
        size = advantages.abs()
        before = _prefix(size, layout)  # (B, T) sum_{s < t} |A_s| within the sequence
        total = layout.expand(layout.row_sums(size)).clamp(min=floor)  # (B, 1) / (1, N)
        weights = 1 + amplification * (1 - before / total)
        return token_output(masked_fill_zero(weights * advantages, mask_t), flat)


def _prefix(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The exclusive running sum of ``values`` within each sequence (padded rows or packed)."""
    running = values.cumsum(dim=-1)  # (B, T) / (1, N) inclusive, over the row
    if layout.sequence_ids is None:
        return running - values
    assert layout.cu_seqlens is not None  # sequence_layout keeps the packed boundaries
    flat = running.reshape(-1)
    start = torch.cat([flat.new_zeros(1), flat])  # (N + 1,) the running sum before each token
    offset = start.index_select(0, layout.cu_seqlens[:-1]).index_select(0, layout.sequence_ids)
    return (flat - values.reshape(-1) - offset).reshape(values.shape)
