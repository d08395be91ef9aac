"""The clipped GRPO surrogate with its fixed signature and outputs: :func:`grpo_clipped_surrogate`.

A thin wrapper over :func:`rlobjectives.policy_loss`'s terms with ``Clip(low=clip_epsilon)``,
the log-ratio bound 60 and the token mean, returning a dictionary.
"""

from __future__ import annotations

import torch

from .._core.reduction import ReductionSpec, reduce, safe_divide
from .._core.validation import ArrayLike, Scalar, checks_environment, validate_scalar
from .call import SurrogateOptions, prepare_layout_inputs
from .loss import policy_terms
from .surrogates import Clip

__all__ = ["grpo_clipped_surrogate"]

# The specified log-ratio bound.
_LOG_RATIO_BOUND = 60.0


@checks_environment
def grpo_clipped_surrogate(
    new_log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    token_mask: ArrayLike,
    clip_epsilon: Scalar,
    *,
    cu_seqlens: ArrayLike | None = None,
) -> dict[str, torch.Tensor]:
    r"""Clipped GRPO surrogate over selected response tokens, as a dictionary.

    .. math::

        r_{it} = \exp(\mathrm{clip}(\ell^{new}_{it} - \ell^{old}_{it}, -60, 60)), \qquad
        s_{it} = \min\big(r_{it} A_i,\ \mathrm{clip}(r_{it}, 1-\epsilon, 1+\epsilon) A_i\big)

    ``loss`` is :math:`-\sum_{it} m_{it} s_{it} / \sum_{it} m_{it}` (token mean over the whole
    batch); ``per_sequence_surrogate[i]`` is the mean of :math:`s_{it}` over sequence ``i``'s
    selected tokens (0 if none); ``clipped_fraction`` is the fraction of selected ratios strictly
    outside :math:`[1-\epsilon, 1+\epsilon]`. With no selected token both scalars are 0. The
    clip is decided as a correctly rounded float32 (float64) ``exp`` would decide it against the
    rounded edges, on every backend (``docs/conventions.md``, "Decisions at a bound"): the ratios
    :math:`e^{\log 1.2}` and :math:`e^{\log 0.8}` of the second example are on the edges, not
    outside.

    This is :func:`rlobjectives.policy_loss` with ``surrogate=Clip(low=clip_epsilon)``,
    ``log_ratio_bound=60`` and ``reduction="token_mean"`` (any :math:`\epsilon \ge 0` is
    accepted, as specified: for :math:`\epsilon \ge 1` the lower edge never binds).

    Packed sequences (``cu_seqlens`` given): the per-token tensors are ``(N,)`` or ``(1, N)``,
    sequence :math:`i` is the run ``cu_seqlens[i]:cu_seqlens[i + 1]``, advantages are ``(S,)``
    (or per token) and ``per_sequence_surrogate`` is ``(S,)``; the values equal the padded call
    on the same sequences.

    Args:
        new_log_probs: ``(B, T)`` current log-probabilities (differentiable).
        old_log_probs: ``(B, T)`` behaviour log-probabilities (a constant: no gradient).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (a constant: no gradient).
        token_mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        clip_epsilon: :math:`\epsilon \ge 0`, finite.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.

    Returns:
        ``{"loss": (), "per_sequence_surrogate": (B,), "clipped_fraction": ()}`` (packed:
        ``(S,)``), all with the dtype and device of ``new_log_probs``.

    Raises:
        ValueError: on mismatched shapes or devices, a negative/NaN/infinite ``clip_epsilon``,
            or a malformed ``cu_seqlens``.
        TypeError: on non-numeric inputs.

    References:
        Shao et al. 2024, DeepSeekMath (GRPO), arXiv:2402.03300 Eq. 3 (token-mean aggregation as
        in DAPO, arXiv:2503.14476 Eq. 8).

    Examples:
        >>> out = grpo_clipped_surrogate([[0.1823215567939546, -0.2231435513142097]], [[0, 0]],
        ...                              [1], [[True, True]], 0.2)
        >>> round(float(out["loss"]), 6)
        -1.0
    """
    inputs, layout = prepare_layout_inputs(
        new_log_probs, old_log_probs, advantages, token_mask,
        ("new_log_probs", "old_log_probs", "advantages", "token_mask"), cu_seqlens=cu_seqlens,
    )  # fmt: skip
    epsilon = validate_scalar(clip_epsilon, "clip_epsilon", minimum=0.0)
    # Clip(low=epsilon), filled without Clip's own check low < 1: the function takes any finite
    # epsilon >= 0 (for epsilon >= 1 the lower edge never binds, the ratio is positive)
    clip = object.__new__(Clip)
    for name, value in (("low", epsilon), ("high", None), ("dual", None), ("delta", None)):
        object.__setattr__(clip, name, value)
    terms = policy_terms(inputs, SurrogateOptions(clip, "token", _LOG_RATIO_BOUND), layout)
    spec = ReductionSpec("token_mean", None, float(max(inputs.log_probs.shape[-1], 1)))
    sums, selected = layout.row_sums(-terms.per_token_loss), layout.row_counts(inputs.mask)
    count = inputs.mask.sum().to(terms.diagnostic_sums.dtype).clamp(min=1)
    return {
        "loss": reduce(terms.per_token_loss, inputs.mask, spec, layout).to(inputs.output_dtype),
        "per_sequence_surrogate": safe_divide(sums, selected).to(inputs.output_dtype),  # (S,)
        "clipped_fraction": (terms.diagnostic_sums[0] / count).to(inputs.output_dtype),
    }
