r"""KL as a reward penalty: on the sequence rewards, or per token with the score at the end.

:func:`kl_penalized_rewards`: :math:`\tilde r_i = r_i - \beta \sum_t M_{it}(\ell_{it} -
\ell^{ref}_{it})` (Ziegler et al.); :func:`kl_penalized_token_rewards`: the reward placement of
the sampled KL estimators of :mod:`rlobjectives.kl.estimators` (OpenRLHF / torchtune /
InstructGPT convention): :math:`R_{it} = -\beta k_{it}` on selected tokens, plus the sequence
score at the last selected token.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from .._core.layout import per_sequence, sequence_layout, token_matrix, token_output
from .._core.reduction import masked_fill_zero, safe_divide
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
from .estimators import Estimator, KLInputs, kl_terms, validate_kl_options, warn_biased

__all__ = ["kl_penalized_rewards", "kl_penalized_token_rewards"]


@checks_environment
def kl_penalized_token_rewards(
    log_probs: ArrayLike,
    ref_log_probs: ArrayLike,
    scores: ArrayLike,
    mask: ArrayLike,
    *,
    kl_coef: Scalar,
    estimator: Estimator = "k1",
    log_ratio_bound: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> torch.Tensor:
    r"""Per-token rewards: a KL penalty on every selected token, the score on the last one.

    .. math::

        R_{it} = -\beta\, k_{it} + \mathbb{1}[t = t^{last}_i]\, s_i \quad (M_{it} = 1), \qquad
        R_{it} = 0 \quad (M_{it} = 0),

    with :math:`k_{it}` the :func:`kl_estimate` of ``estimator`` and :math:`t^{last}_i` the last
    selected token of sequence :math:`i` (OpenRLHF / torchtune / InstructGPT convention); a
    sequence with no selected token gets no reward. At :math:`\gamma = 1` the return is
    :math:`s_i - \beta \sum_t M_{it} k_{it}` (``"k1"`` unbounded: :func:`kl_penalized_rewards`'s
    :math:`r_i - \beta D_i`). Packed and context-parallel calls equal the unsplit call
    (``docs/objectives/kl.md``).

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
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the context-parallel group of the sequences' other tokens, or None.

    Returns:
        ``(B, T)`` rewards (packed: the shape of ``log_probs``), zeros at unselected tokens, on
        the device of ``log_probs``; float32 (float64 if an input is float64), also for bf16/fp16
        inputs.

    Raises:
        ValueError: on mismatched shapes/devices, ``scores`` not of length B (packed: S), an
            unknown ``estimator``, a negative/non-finite ``kl_coef``, a non-positive
            ``log_ratio_bound``, a malformed ``cu_seqlens``, or a ``context_group`` without
            this rank or a process group.
        TypeError: on non-numeric inputs, or a non-ProcessGroup ``context_group``.

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
    inputs = KLInputs(log_probs, ref_log_probs, mask, cu_seqlens, context_group)
    scores_t = as_float_tensor(scores, "scores", inputs.log_probs.device)
    check_same_device({"log_probs": inputs.log_probs, "scores": scores_t})
    scores_t = per_sequence(scores_t, "scores", inputs.layout, "log_probs")
    coefficient = validate_scalar(kl_coef, "kl_coef", minimum=0.0)
    bound = validate_kl_options(estimator, False, log_ratio_bound)
    if estimator != "k1":
        warn_biased(
            f'kl_penalized_token_rewards(estimator="{estimator}"): as a (detached) reward the '
            f"{estimator} penalty gives a biased policy gradient of KL(pi || ref); k1 is the "
            "unbiased reward penalty (use k2 or k3 with straight_through=True in kl_loss instead)"
        )
    elif bound is not None:
        warn_biased(
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
    last = inputs.layout.last_selected(inputs.mask)  # (B, T)
    score_at_last = masked_fill_zero(
        inputs.layout.expand(scores_t.to(dtype)).expand_as(penalty), last
    )
    return token_output(penalty + score_at_last, inputs.flat)  # (B, T)


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
    """The outputs from the rewards and the sampled divergences :math:`D_i`."""
    penalized = rewards - coefficient * divergences  # (B,)
    objective = safe_divide(penalized.sum(), batch)  # ()
    return {
        "objective": objective.to(torch.float32),
        "penalized_rewards": penalized.to(torch.float32),
        "sampled_divergences": divergences.to(torch.float32),
    }
