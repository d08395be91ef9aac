r"""Off-policy sequence masking (DeepSeek-V3.2 OPSM), as TRL's ``off_policy_mask_threshold``.

A sequence with a negative advantage whose sampler has drifted too far from the current policy
(mean per-token KL(sampler || current) above a threshold) is dropped from the policy loss: its
negative update would push down tokens that the current policy no longer samples.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from .._core.layout import token_output, tokens_from_sequences
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    check_same_device,
    checks_environment,
    compute_dtype,
    expand_per_sequence,
    validate_scalar,
)
from .correction import check_pair

__all__ = ["off_policy_sequence_mask"]


@checks_environment
def off_policy_sequence_mask(
    log_probs: ArrayLike,
    sampling_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    threshold: Scalar,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> torch.Tensor:
    r"""Off-policy sequence masking (DeepSeek-V3.2 OPSM; TRL ``off_policy_mask_threshold``).

    Drops a sequence with a negative advantage whose mean per-token KL(sampler || current),
    estimated with k1 on its selected tokens, exceeds the threshold :math:`\tau`:

    .. math::

        \bar k_i = \frac{1}{\max(n_i, 1)} \sum_t M_{it}\,(\ell^{samp}_{it} - \ell_{it}), \qquad
        \text{keep}_{it} = M_{it} \wedge \big(A_{it} \ge 0 \vee \bar k_i \le \tau\big).

    Exactly TRL's ``GRPOTrainer.get_off_policy_mask`` (1.16: a NaN difference counts as 0; the
    mean in float32 or wider). TRL multiplies the per-token loss by the mask and keeps the
    dropped sequences in every denominator; to reproduce it, pass the mask as 0/1 weights and
    keep the original mask for the reduction:
    ``policy_loss(..., mask, importance_weights=keep.to(torch.float32) * weights)``. Passing it
    as the loss's ``mask`` instead removes the dropped tokens from the denominator too.

    Args:
        log_probs: ``(B, T)`` current-policy log-probabilities (detached here).
        sampling_log_probs: ``(B, T)`` log-probabilities under the sampler (TRL:
            ``sampling_per_token_logps``, or ``old_per_token_logps`` without vLLM).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` advantages (TRL broadcasting).
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        threshold: :math:`\tau`, a finite real (number or 0-d tensor), e.g. 0.5.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences: the per-token
            tensors are then ``(N,)`` or ``(1, N)`` and per-sequence advantages ``(S,)``; the
            result has the shape of ``log_probs``.
        context_group: the process group of the ranks holding the other tokens of the same
            sequences (context parallelism), or None: :math:`\bar k_i` is then the mean over
            the whole sequence (one all-reduce of its ``(S,)`` sums and counts) and each rank
            gets the mask of its own tokens.

    Returns:
        ``(B, T)`` bool: the selected tokens of the kept sequences (no gradient).

    Raises:
        ValueError: on inputs that are not ``(B, T)``, mismatched shapes/devices, advantages of
            another shape or a non-finite ``threshold``.
        TypeError: on non-numeric inputs or threshold.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        DeepSeek-AI 2025, DeepSeek-V3.2, arXiv:2512.02556 Eq. 9 (off-policy sequence masking);
        TRL ``GRPOConfig.off_policy_mask_threshold``.

    Examples:
        >>> import torch
        >>> off_policy_sequence_mask(torch.zeros(2, 2), torch.tensor([[0.3, 0.3], [0.3, 0.3]]),
        ...                          torch.tensor([1.0, -1.0]), torch.ones(2, 2), threshold=0.2)
        tensor([[ True,  True],
                [False, False]])

    .. versionadded:: 0.2.0
    """
    pair = check_pair(
        log_probs,
        sampling_log_probs,
        mask,
        ("log_probs", "sampling_log_probs", "mask"),
        cu_seqlens,
        context_group,
    )
    log_probs_t, sampling_t, mask_t, layout = pair.first, pair.other, pair.mask, pair.layout
    advantages_t = as_float_tensor(advantages, "advantages", log_probs_t.device)
    check_same_device({"log_probs": log_probs_t, "advantages": advantages_t})
    if layout.sequence_ids is None:
        shape = (log_probs_t.shape[0], log_probs_t.shape[1])
        advantages_t = expand_per_sequence(advantages_t, "advantages", shape, "log_probs")
    else:
        advantages_t = tokens_from_sequences(advantages_t, "advantages", layout, "log_probs")
    threshold_v = validate_scalar(threshold, "threshold", minimum=None)
    dtype = compute_dtype(log_probs_t, sampling_t)
    kl = masked_fill_zero(sampling_t.detach().to(dtype), mask_t) - masked_fill_zero(
        log_probs_t.detach().to(dtype), mask_t
    )  # (B, T)
    kl = torch.nan_to_num(kl, nan=0.0)
    sums, counts = layout.combine(layout.local_row_sums(kl), layout.local_row_counts(mask_t))
    mean_kl = sums / counts.to(dtype).clamp(min=1)  # (S,) whole sequences
    keep = (advantages_t.detach() >= 0) | (layout.expand(mean_kl) <= threshold_v)
    return token_output(mask_t & keep, pair.flat)
