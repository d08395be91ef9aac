"""The two specified objectives: the clipped GRPO surrogate and KL-penalized sequence rewards.

Their argument names, defaults and outputs are fixed by the seed specifications; each is a thin
wrapper over the general functions (:func:`rlobjectives.policy_loss`' paths and the KL estimator
implementation of :mod:`rlobjectives.kl.estimators`).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from .._core.layout import Layout, per_sequence, sequence_layout, token_matrix
from .._core.reduction import ReductionSpec, masked_fill_zero, reduce, safe_divide
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_context_group,
    validate_scalar,
)
from ..kl.estimators import kl_terms
from .fused import ClippedSurrogateFunction, FusedSpec
from .inputs import PolicyInputs, SurrogateOptions, prepare_layout_inputs
from .specification import policy_terms
from .surrogates import Clip

__all__ = ["grpo_clipped_surrogate", "kl_penalized_rewards"]

# The seed's log-ratio bound.
_SEED_LOG_RATIO_BOUND = 60.0


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
    r"""Clipped GRPO surrogate over selected response tokens (the seed specification).

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
    inputs, options, layout = _seed_call(
        new_log_probs, old_log_probs, advantages, token_mask, clip_epsilon, cu_seqlens
    )
    return _grpo_outputs(inputs, options, layout, fused=True)


def _seed_call(
    new_log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    token_mask: ArrayLike,
    clip_epsilon: Scalar,
    cu_seqlens: ArrayLike | None,
) -> tuple[PolicyInputs, SurrogateOptions, Layout]:
    inputs, layout = prepare_layout_inputs(
        new_log_probs,
        old_log_probs,
        advantages,
        token_mask,
        ("new_log_probs", "old_log_probs", "advantages", "token_mask"),
        cu_seqlens=cu_seqlens,
    )
    epsilon = validate_scalar(clip_epsilon, "clip_epsilon", minimum=0.0)
    options = SurrogateOptions(_seed_clip(epsilon), "token", _SEED_LOG_RATIO_BOUND)
    return inputs, options, layout


def _seed_clip(epsilon: float | torch.Tensor) -> Clip:
    """``Clip(low=epsilon)``: the seed's symmetric band ``[1 - eps, 1 + eps]`` for any eps >= 0.

    The specification takes any finite ``clip_epsilon >= 0`` (validated above); ``Clip`` itself
    keeps ``low < 1`` (a positive lower edge); for ``eps >= 1`` the lower edge never binds (the
    ratio is positive), so the object is filled without that check.
    """
    clip = object.__new__(Clip)
    for name, value in (("low", epsilon), ("high", None), ("dual", None), ("delta", None)):
        object.__setattr__(clip, name, value)
    return clip


def _grpo_clipped_surrogate_autograd(
    new_log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    token_mask: ArrayLike,
    clip_epsilon: Scalar,
    *,
    cu_seqlens: ArrayLike | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`grpo_clipped_surrogate` through the autograd path (the fused path's reference)."""
    inputs, options, layout = _seed_call(
        new_log_probs, old_log_probs, advantages, token_mask, clip_epsilon, cu_seqlens
    )
    return _grpo_outputs(inputs, options, layout, fused=False)


def _grpo_outputs(
    inputs: PolicyInputs, options: SurrogateOptions, layout: Layout, *, fused: bool
) -> dict[str, torch.Tensor]:
    """The seed outputs: token-mean loss, per-sequence means, out-of-band fraction."""
    spec = ReductionSpec("token_mean", None, float(max(inputs.log_probs.shape[-1], 1)))
    epsilon = options.surrogate.low  # type: ignore[attr-defined]
    learnable_epsilon = isinstance(epsilon, torch.Tensor) and epsilon.requires_grad
    if fused and not learnable_epsilon:
        fused_spec = FusedSpec(options, spec, None, inputs.dtype, layout)
        loss, row_sums, diagnostics = ClippedSurrogateFunction.apply(  # type: ignore[no-untyped-call]
            inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask, fused_spec,
            None,
        )  # fmt: skip
        per_sequence = safe_divide(row_sums, layout.row_counts(inputs.mask))  # (S,)
        clipped_fraction = diagnostics[0]
    else:
        terms = policy_terms(inputs, options, None, layout)
        loss = reduce(terms.per_token_loss, inputs.mask, spec, layout)
        per_sequence = safe_divide(
            layout.row_sums(-terms.per_token_loss), layout.row_counts(inputs.mask)
        )  # (S,)
        clipped_fraction = terms.diagnostics.clipped_fraction
    output_dtype = inputs.output_dtype
    return {
        "loss": loss.to(output_dtype),
        "per_sequence_surrogate": per_sequence.to(output_dtype),
        "clipped_fraction": clipped_fraction.to(output_dtype),
    }


@checks_environment
def kl_penalized_rewards(
    policy_log_probs: ArrayLike,
    reference_log_probs: ArrayLike,
    rewards: ArrayLike,
    response_mask: ArrayLike,
    beta: Scalar,
    *,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    r"""Penalize sequence rewards by the sampled KL divergence to a reference policy.

    .. math::

        D_i = \sum_t m_{it} (\ell^{\pi}_{it} - \ell^{ref}_{it}), \qquad
        \tilde r_i = r_i - \beta D_i, \qquad
        J = \frac{1}{B} \sum_i \tilde r_i

    :math:`D_i` is the k1 (log-ratio) estimate of KL(pi || ref) summed over the response: it is not
    clamped, not divided by the response length, and may be negative. Unselected tokens contribute
    exactly zero (NaN/inf there is ignored); an empty batch has :math:`J = 0`.

    Packed sequences (``cu_seqlens`` given): the per-token tensors are ``(N,)`` or ``(1, N)``,
    :math:`D_i` sums over the run ``cu_seqlens[i]:cu_seqlens[i + 1]``, ``rewards`` and the
    per-sequence outputs are ``(S,)`` and :math:`J` divides by :math:`S`; the values equal the
    padded call on the same sequences.

    Context parallelism (``context_group``, keyword-only: the specified signature is
    unchanged): each rank of the group holds some tokens of the same sequences and the same
    ``rewards``; :math:`D_i` is the sum of the ranks' partial sums (one all-reduce of ``(S,)``
    values), so every rank returns the outputs of the unsplit call, and the gradient of its
    ``policy_log_probs`` is that of the (replicated) outputs.

    Args:
        policy_log_probs: ``(B, T)`` log-probabilities under the policy (differentiable).
        reference_log_probs: ``(B, T)`` log-probabilities under the reference policy.
        rewards: ``(B,)`` (or ``(B, 1)``) scalar rewards.
        response_mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        beta: KL coefficient :math:`\beta \ge 0`, finite.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the process group of the ranks holding the other tokens of the same
            sequences (context parallelism), or None.

    Returns:
        ``{"objective": (), "penalized_rewards": (B,), "sampled_divergences": (B,)}`` (packed:
        ``(S,)``), float32 on the device of ``policy_log_probs`` (computed in float64 when any
        input is float64).

    Raises:
        ValueError: on mismatched shapes or devices, rewards of the wrong length, a
            negative/NaN/infinite ``beta``, or a malformed ``cu_seqlens``.
        TypeError: on non-numeric inputs.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Ziegler et al. 2019, arXiv:1909.08593 Eq. 2; Ouyang et al. 2022 (InstructGPT),
        arXiv:2203.02155 Eq. 2.

    Examples:
        >>> out = kl_penalized_rewards([[-1, -2]], [[-1.5, -2.5]], [3], [[True, True]], 0.5)
        >>> float(out["objective"])
        2.5
    """
    packed = cu_seqlens is not None
    policy = token_matrix(
        as_float_tensor(policy_log_probs, "policy_log_probs"), "policy_log_probs", packed
    )
    device = policy.device
    reference = token_matrix(
        as_float_tensor(reference_log_probs, "reference_log_probs", device),
        "reference_log_probs",
        packed,
    )
    rewards_t = as_float_tensor(rewards, "rewards", device)
    mask = token_matrix(as_mask(response_mask, "response_mask", device), "response_mask", packed)
    check_same_device(
        {
            "policy_log_probs": policy,
            "reference_log_probs": reference,
            "rewards": rewards_t,
            "response_mask": mask,
        }
    )
    check_shape(reference, "reference_log_probs", policy.shape, "policy_log_probs")
    check_shape(mask, "response_mask", policy.shape, "policy_log_probs")
    layout = sequence_layout(cu_seqlens, policy, validate_context_group(context_group))
    batch = layout.num_sequences
    rewards_t = per_sequence(rewards_t, "rewards", layout, "policy_log_probs")
    coefficient = validate_scalar(beta, "beta", minimum=0.0)

    dtype = compute_dtype(policy, reference, rewards_t)
    # The k1 estimate per token, unclamped, through the one KL implementation
    # (rlobjectives.kl.estimators).
    log_ratio = kl_terms(
        policy,
        reference,
        mask,
        estimator="k1",
        straight_through=False,
        log_ratio_bound=None,
        dtype=dtype,
    )  # (B, T), zeros at unselected tokens
    divergences = layout.row_sums(masked_fill_zero(log_ratio, mask))  # (B,) whole sequences
    return _penalized_outputs(rewards_t.to(dtype), divergences, coefficient, batch)


def _penalized_outputs(
    rewards: torch.Tensor,
    divergences: torch.Tensor,
    coefficient: float | torch.Tensor,
    batch: int,
) -> dict[str, torch.Tensor]:
    """The seed's outputs from the rewards and the sampled divergences :math:`D_i`."""
    penalized = rewards - coefficient * divergences  # (B,)
    objective = safe_divide(penalized.sum(), batch)  # ()
    return {
        "objective": objective.to(torch.float32),
        "penalized_rewards": penalized.to(torch.float32),
        "sampled_divergences": divergences.to(torch.float32),
    }
