r"""Masked generalized advantage estimation (GAE), with per-sequence and decoupled lambdas.

``(B, T)`` tensors and a mask; unselected tokens are not part of the trajectory (their rewards
and values are ignored, their advantages are 0) and NaN/inf there never reaches the outputs. On
packed sequences (``cu_seqlens``) the recursion restarts at every sequence boundary (the scans:
:mod:`rlobjectives.advantages.scans`). All results are float32 (float64 when an input is
float64). REINFORCE++ is :mod:`rlobjectives.advantages.reinforce`; the outcome-reward (one score
per sequence) estimators are :mod:`rlobjectives.advantages.outcome`.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from .._core.layout import Layout, sequence_layout, token_matrix, token_output
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    as_float_tensor,
    as_mask,
    as_tensor,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    describe,
    validate_choice,
    validate_context_group,
)
from .scans import HOLES, Holes, context_scan, discounted_sum, next_on_chain, validate_discount
from .whitening import validate_flag, whiten_selected

__all__ = ["GAEOutput", "gae"]


class GAEOutput(NamedTuple):
    r"""Result of :func:`gae`.

    Attributes:
        advantages: ``(B, T)`` GAE advantages :math:`\hat A_t` (whitened with ``whiten=True``),
            zeros at unselected tokens.
        returns: ``(B, T)`` value targets :math:`\hat A_t + V_t` (from the advantages before
            whitening), zeros at unselected tokens.
    """

    advantages: torch.Tensor
    returns: torch.Tensor


@checks_environment
def gae(
    rewards: ArrayLike,
    values: ArrayLike,
    mask: ArrayLike,
    *,
    gamma: float,
    lam: float | ArrayLike,
    value_lam: float | ArrayLike | None = None,
    whiten: bool = False,
    holes: Holes = "skip",
    cu_seqlens: ArrayLike | None = None,
    context_group: ProcessGroup | None = None,
) -> GAEOutput:
    r"""Masked generalized advantage estimation (GAE) over the selected tokens of each row.

    With :math:`n(t)` the next selected token after :math:`t` in the same row
    (:math:`V_{n(t)} := 0` and :math:`\hat A_{n(t)} := 0` after the last one),

    .. math::

        \delta_t = r_t + \gamma V_{n(t)} - V_t, \qquad
        \hat A_t = \delta_t + \gamma\lambda \hat A_{n(t)}
                 = \sum_{l \ge 0} (\gamma\lambda)^l \delta_{t+l}, \qquad
        \hat R_t = \hat A_t + V_t .

    ``holes``: ``"skip"`` (default, verl) jumps over an unselected token between selected ones,
    ``"zero"`` (OpenRLHF) runs through it as a step with reward and value 0. ``lam`` /
    ``value_lam`` may be per sequence (VAPO); ``whiten=True`` is verl's whitening (the returns
    stay raw). Packed and context-parallel calls equal the unsplit call. In detail:
    ``docs/objectives/advantages.md`` ("gae in detail").

    Args:
        rewards: ``(B, T)`` per-token rewards (:func:`rlobjectives.kl_penalized_token_rewards`).
        values: ``(B, T)`` value estimates :math:`V_t`.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        gamma: discount :math:`\gamma \in [0, 1]`.
        lam: GAE :math:`\lambda \in [0, 1]`: a number, or a ``(B,)`` floating tensor of
            per-sequence values (packed: ``(S,)``).
        value_lam: optional :math:`\lambda_V` of the returns (as ``lam``); None: ``lam``.
        whiten: whiten the advantages (verl); the returns are not whitened.
        holes: ``"skip"`` (verl) or ``"zero"`` (OpenRLHF), see above.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        context_group: the context-parallel group of the sequences' other chunks, or None.

    Returns:
        :class:`GAEOutput` ``(advantages, returns)``, each ``(B, T)`` (packed: the shape of
        ``rewards``) on its device, float32 (float64 if an input is float64), zeros at unselected
        tokens; differentiable in ``rewards`` and ``values`` (detach ``values`` for PPO targets).

    Raises:
        ValueError: on mismatched shapes/devices, inputs that are not ``(B, T)``, ``gamma`` or
            a number ``lam``/``value_lam`` outside [0, 1], a per-sequence ``lam``/``value_lam``
            of another shape or device, an unknown ``holes``, a malformed ``cu_seqlens``, or a
            ``context_group`` without this rank or a process group.
        TypeError: on non-numeric inputs, a tensor-valued ``gamma``, a non-floating
            ``lam``/``value_lam`` tensor, a non-bool ``whiten`` or a ``context_group`` that is
            not a ``torch.distributed`` process group.

    References:
        Schulman et al. 2016, GAE, arXiv:1506.02438 Eq. 16; Ouyang et al. 2022, arXiv:2203.02155.

    Examples:
        >>> out = gae([[0.0, 1.0]], [[0.5, 0.5]], [[1, 1]], gamma=1.0, lam=1.0)
        >>> out.advantages
        tensor([[0.5000, 0.5000]])

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``whiten`` and ``holes``.
    .. versionchanged:: 0.3.0
       per-sequence ``lam`` and ``value_lam`` (VAPO).
    """
    packed = cu_seqlens is not None
    rewards_in = as_float_tensor(rewards, "rewards")
    flat = packed and rewards_in.ndim == 1
    rewards_t = token_matrix(rewards_in, "rewards", packed)
    device = rewards_t.device
    values_t = token_matrix(as_float_tensor(values, "values", device), "values", packed)
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", packed)
    check_same_device({"rewards": rewards_t, "values": values_t, "mask": mask_t})
    check_shape(values_t, "values", rewards_t.shape, "rewards")
    check_shape(mask_t, "mask", rewards_t.shape, "rewards")
    discount = validate_discount(gamma, "gamma")
    validate_flag(whiten, "whiten")
    validate_choice(holes, "holes", HOLES)
    context = validate_context_group(context_group)
    layout = sequence_layout(cu_seqlens, rewards_t, context)
    trace = _validate_lambda(lam, "lam", layout, device)
    value_trace = None
    if value_lam is not None:
        value_trace = _validate_lambda(value_lam, "value_lam", layout, device)
    lambdas = [t for t in (trace, value_trace) if isinstance(t, torch.Tensor)]
    dtype = compute_dtype(rewards_t, values_t, *lambdas)  # a float64 lambda tensor counts too

    rewards_m = masked_fill_zero(rewards_t.to(dtype), mask_t)  # (B, T)
    values_m = masked_fill_zero(values_t.to(dtype), mask_t)  # (B, T)
    if holes == "skip":
        chain = mask_t  # the recursion visits the selected tokens only
    else:
        chain = torch.ones_like(mask_t)  # every position is a step; holes have r = V = 0
    next_values = next_on_chain(values_m, chain, layout)  # (B, T) V_{n(t)}, 0 after the last
    deltas = masked_fill_zero(rewards_m + discount * next_values - values_m, chain)  # (B, T)
    # A_t = delta_t + gamma * lam * A_{n(t)}: the same masked reverse scan as the returns.
    advantages = _advantage_scan(deltas, chain, mask_t, discount, trace, layout, values_m)
    critic = advantages
    if value_trace is not None:  # the returns' own lambda (VAPO's decoupled GAE)
        critic = _advantage_scan(deltas, chain, mask_t, discount, value_trace, layout, values_m)
    returns = masked_fill_zero(critic + values_m, mask_t)  # (B, T)
    if whiten:
        advantages = whiten_selected(
            advantages, mask_t, shift_mean=True, unbiased=True, epsilon=1e-8, context=context
        )
    return GAEOutput(advantages=token_output(advantages, flat), returns=token_output(returns, flat))


def _validate_lambda(
    value: float | ArrayLike, name: str, layout: Layout, device: torch.device
) -> float | torch.Tensor:
    """A number in [0, 1], or a floating per-sequence tensor ``(B,)`` / ``(S,)`` on ``device``."""
    if isinstance(value, numbers.Real) or (
        isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool
    ):
        return validate_discount(value, name)  # type: ignore[arg-type]
    tensor = as_tensor(value, name, device)
    if not tensor.is_floating_point():
        raise TypeError(
            f"{name} must be a number in [0, 1] or a floating tensor of one value per sequence, "
            f"got {describe(tensor)}"
        )
    check_same_device({"rewards": torch.empty(0, device=device), name: tensor})
    sequences = layout.num_sequences
    what = "B" if layout.sequence_ids is None else "S"
    if tensor.ndim != 1 or tensor.shape[0] != sequences:
        raise ValueError(
            f"{name} must be a number or have shape ({what},) = ({sequences},) (one value per "
            f"sequence), got shape {tuple(tensor.shape)}"
        )
    return tensor


def _advantage_scan(
    deltas: torch.Tensor,
    chain: torch.Tensor,
    mask: torch.Tensor,
    discount: float,
    trace: float | torch.Tensor,
    layout: Layout,
    values: torch.Tensor,
) -> torch.Tensor:
    r"""``A_t = delta_t + gamma lambda A_{n(t)}``, ``(B, T)``; ``lambda`` a number or per row.

    Under context parallelism the later chunks add
    :math:`(\gamma\lambda)^k (\gamma V_{next} + \gamma\lambda A_{next})` (:func:`context_scan`;
    ``values``: the masked :math:`V`, the next chunk's bootstrap).
    """
    per_sequence: float | torch.Tensor
    if isinstance(trace, torch.Tensor):
        per_sequence = discount * trace.to(deltas.dtype)  # (S,) gamma lambda_i
        factor: float | torch.Tensor = layout.expand(per_sequence)  # (B, 1) / (1, N)
    else:
        per_sequence = factor = discount * trace
    advantages = discounted_sum(deltas, chain, factor, layout)
    if layout.context is not None:
        advantages = context_scan(
            advantages,
            chain,
            layout,
            factor,
            lambda carry: discount * carry[:, 1] + per_sequence * carry[:, 0],
            extra=(values,),
        )
    return masked_fill_zero(advantages, mask)
