r"""The Optimal Token Baseline: a per-token group baseline weighted by the path's score energy.

For the responses :math:`i` of one prompt (a group), with reward-to-go :math:`G_{it} =
\sum_{s \ge t} M_{is} r_{is}` and the squared norm of the token's score function, in
expectation over the sampled token, :math:`\lVert s_{it}\rVert^2 \approx 1 - 2\pi_{it} + \sum_v
\pi_{itv}^2` (:math:`\pi_{it}` the behaviour probability of the sampled token,
:math:`\sum_v\pi^2` the distribution's collision probability), accumulated along the path,
:math:`W_{it} = \sum_{s \le t} M_{is}\,\rho_{is}^2 (1 - 2\pi_{is} + \sum_v \pi_{isv}^2)`
(:math:`\rho` the rollout importance weights, 1 without), the variance-minimising baseline of
the policy gradient at step :math:`t` is

.. math::

    b^*_t = \frac{\sum_{i} G_{it} W_{it} M_{it}}{\sum_{i} W_{it} M_{it} + \epsilon},
    \qquad A_{it} = M_{it}(G_{it} - b^*_t)

(:math:`b^* = 0` for a group of one response). verl 0.9.1 aligns the steps two ways:
``alignment="position"`` (``adv_estimator="optimal_token_baseline"``): :math:`t` is the column
of the padded batch; ``alignment="token"`` (``"tir_optimal_token_baseline"``, for multi-turn
masks with holes): :math:`t` is the rank of the token among the row's selected tokens, and
rows without a selected token belong to no group. With ``handle_zero_tail`` the baseline of a
group's unique longest response is 0 from the second-longest response's length on (verl's
default), where no other response carries a baseline.

The collision probability comes from the trainer's log-probability pass:
``token_log_probs_from_hidden(..., statistics=("log_sum_sq_probs",))`` (or
:func:`~rlobjectives.token_log_probs`) gives :math:`\log\sum_v\pi^2` chunk by chunk, also
under vocabulary parallelism.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

from .._core.groups import Groups, groups_of
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_bool,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "OTBAlignment",
    "OptimalTokenBaselineOutput",
    "optimal_token_baseline_advantages",
    "reward_to_go",
]

#: How the steps of a group's responses are aligned: ``"position"`` (the padded column, verl's
#: ``optimal_token_baseline``) or ``"token"`` (the rank among the row's selected tokens, verl's
#: ``tir_optimal_token_baseline``).
OTBAlignment = Literal["position", "token"]
_ALIGNMENTS = ("position", "token")


class OptimalTokenBaselineOutput(NamedTuple):
    """Result of :func:`optimal_token_baseline_advantages`.

    Attributes:
        advantages: ``(B, T)`` :math:`M(G - b^*)`, zeros at unselected tokens.
        returns: ``(B, T)`` the reward-to-go :math:`G`, zeros at unselected tokens.
    """

    advantages: torch.Tensor
    returns: torch.Tensor


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""``(B, T)``: :math:`G_t = \sum_{s \ge t} M_s r_s` along each row (every column)."""
    selected = torch.where(mask, rewards, torch.zeros((), dtype=rewards.dtype))
    return selected.flip(-1).cumsum(-1).flip(-1)


def _group_columns(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(B, T)``: each row's group's column sums of ``values`` ``(B, T)``."""
    totals = torch.zeros_like(values).index_add(0, groups.ids, values)  # (B, T) group slots
    return totals[groups.ids]


def _group_amax(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(B,)``: the maximum of ``values`` ``(B,)`` over each row's group."""
    slots = torch.full_like(values, torch.iinfo(values.dtype).min)
    return slots.scatter_reduce(0, groups.ids, values, "amax")[groups.ids]


def _zero_tail(lengths: torch.Tensor, members: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``(B,)`` int64: the column from which each row's baseline is 0 (``T``: nowhere).

    A group's unique longest member (among ``members``), strictly longer than the others,
    gets the second-longest member's length; every other row gets a column past the end.
    """
    none = torch.full_like(lengths, -1)
    counted = torch.where(members, lengths, none)  # (B,)
    longest = _group_amax(counted, groups)  # (B,)
    at_longest = torch.zeros_like(lengths).index_add(0, groups.ids, (counted == longest).long())
    unique = at_longest[groups.ids] == 1  # (B,)
    second = _group_amax(torch.where(counted == longest, none, counted), groups)  # (B,)
    tail = unique & (counted == longest) & members & (second >= 0)
    return torch.where(tail, second, torch.iinfo(torch.int64).max)


def _baseline(
    returns: torch.Tensor,
    energy: torch.Tensor,
    mask: torch.Tensor,
    groups: Groups,
    options: tuple[torch.Tensor, bool, float | torch.Tensor],
) -> torch.Tensor:
    """``(B, C)`` :math:`b^*` of aligned ``(B, C)`` returns and energies (0 off the mask).

    ``options``: ``(members (B,), handle_zero_tail, epsilon)``; non-members (and groups of one
    member) get a zero baseline.
    """
    members, zero_tail, epsilon = options
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    weighted = torch.where(mask, energy, zero)  # (B, C) W M
    numerator = _group_columns(returns * weighted, groups)  # (B, C)
    denominator = _group_columns(weighted, groups) + epsilon  # (B, C)
    baseline = numerator / denominator
    count = torch.zeros_like(groups.ids).index_add(0, groups.ids, members.long())[groups.ids]
    baseline = torch.where((members & (count > 1)).unsqueeze(1), baseline, zero)
    if zero_tail:
        lengths = mask.sum(dim=1)  # (B,)
        start = _zero_tail(lengths, members, groups)  # (B,)
        columns = torch.arange(mask.shape[1], device=mask.device)  # (C,)
        baseline = torch.where(columns >= start.unsqueeze(1), zero, baseline)
    return baseline


def _token_ranks(mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` int64: each selected token's rank in its row (``T`` where unselected)."""
    ranks = mask.long().cumsum(dim=1) - 1
    return torch.where(mask, ranks, mask.shape[1])


def _compact(values: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """``(B, T)``: each row's selected values moved to the front (zeros after)."""
    out = torch.zeros(values.shape[0], values.shape[1] + 1, dtype=values.dtype,
                      device=values.device)  # fmt: skip
    return out.scatter(1, ranks, values)[:, :-1]


def _per_token(value: ArrayLike, name: str, rewards: torch.Tensor) -> torch.Tensor:
    """A ``(B, T)`` floating argument of the rewards' shape and device."""
    tensor = as_batch_matrix(as_float_tensor(value, name, rewards.device), name)
    check_same_device({"rewards": rewards, name: tensor})
    check_shape(tensor, name, tuple(rewards.shape), "rewards")
    return tensor


@checks_environment
def optimal_token_baseline_advantages(
    rewards: ArrayLike,
    mask: ArrayLike,
    old_log_probs: ArrayLike,
    log_sum_sq_probs: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: Any = None,
    importance_weights: ArrayLike | None = None,
    alignment: OTBAlignment = "position",
    handle_zero_tail: bool = True,
    eps: Scalar = 1e-8,
) -> OptimalTokenBaselineOutput:
    r"""Advantages with the Optimal Token Baseline (verl 0.9.1's ``optimal_token_baseline``).

    .. math::

        A_{it} = M_{it}\Big(G_{it} - \frac{\sum_{j \in g} G_{jt} W_{jt} M_{jt}}
            {\sum_{j \in g} W_{jt} M_{jt} + \epsilon}\Big), \quad
        W_{it} = \sum_{s \le t} M_{is} \rho_{is}^2 \big(1 - 2 e^{\ell_{is}}
            + e^{\lambda_{is}}\big),

    :math:`G` the reward-to-go, :math:`\ell` = ``old_log_probs``, :math:`\lambda` =
    ``log_sum_sq_probs`` (:math:`\log\sum_v \pi_v^2`), :math:`\rho` = ``importance_weights``
    (module docstring for the alignments and ``handle_zero_tail``). Unselected positions are
    never read (NaN there reaches nothing); all arithmetic is in float32 (float64 for float64
    inputs), without a host synchronisation.

    Peers: verl ``compute_optimal_token_baseline_advantage`` (``alignment="position"``) and
    ``compute_multi_turn_optimal_token_baseline_advantage`` (``"token"``), with ``index`` =
    ``group_ids``, ``sum_pi_squared`` = ``exp(log_sum_sq_probs)``, ``rollout_is_weights`` =
    ``importance_weights`` (equal values, tested on verl's own functions); verl's arguments:
    :func:`rlobjectives.presets.verl_optimal_token_baseline_advantages`.

    Args:
        rewards: ``(B, T)`` token-level rewards (an outcome reward on the last token).
        mask: ``(B, T)`` bool/numeric response mask (multi-turn masks may have holes).
        old_log_probs: ``(B, T)`` behaviour log-probabilities of the sampled tokens.
        log_sum_sq_probs: ``(B, T)`` :math:`\log\sum_v\pi_v^2` of the behaviour distribution
            (``statistics=("log_sum_sq_probs",)``).
        group_size: G, the responses of a prompt being contiguous; or None with ``group_ids``.
        group_ids: ``(B,)`` group label per response (verl's ``index``).
        importance_weights: optional ``(B, T)`` rollout importance weights :math:`\rho`.
        alignment: ``"position"`` or ``"token"``.
        handle_zero_tail: zero the baseline of a group's unique longest response past the
            second-longest length (verl's default True).
        eps: :math:`\epsilon \ge 0` (verl's ``epsilon``, 1e-8).

    Returns:
        :class:`OptimalTokenBaselineOutput` ``(advantages, returns)``, ``(B, T)`` each.

    Raises:
        ValueError: on shapes or devices that differ, grouping errors (as
            :func:`rlobjectives.group_relative_advantages`), an unknown ``alignment``, a
            negative ``eps``.
        TypeError: on non-numeric inputs, a non-bool ``handle_zero_tail``.

    References:
        verl 0.9.1 ``trainer/ppo/core_algos.py`` (Optimal Token Baseline); Weaver & Tao 2001,
        The Optimal Reward Baseline for Gradient-Based Reinforcement Learning
        (arXiv:1301.2315) Theorem 3.

    Examples:
        >>> import torch
        >>> rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        >>> out = optimal_token_baseline_advantages(
        ...     rewards, torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), 2)
        >>> out.advantages  # pi = 1 everywhere: no energy, the baseline is 0
        tensor([[1., 1.],
                [0., 0.]])

    .. versionadded:: 0.4.0
    """
    rewards_t = as_batch_matrix(as_float_tensor(rewards, "rewards"), "rewards")
    shape = (rewards_t.shape[0], rewards_t.shape[1])
    device = rewards_t.device
    mask_t = as_batch_matrix(as_mask(mask, "mask", device), "mask")
    check_same_device({"rewards": rewards_t, "mask": mask_t})
    check_shape(mask_t, "mask", shape, "rewards")
    old = _per_token(old_log_probs, "old_log_probs", rewards_t)
    squares = _per_token(log_sum_sq_probs, "log_sum_sq_probs", rewards_t)
    weights = None
    if importance_weights is not None:
        weights = _per_token(importance_weights, "importance_weights", rewards_t)
    align = validate_choice(alignment, "alignment", _ALIGNMENTS)
    zero_tail = validate_bool(handle_zero_tail, "handle_zero_tail")
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    groups = groups_of(group_size, group_ids, shape[0], device)
    tensors = [rewards_t, old, squares] + ([] if weights is None else [weights])
    dtype = compute_dtype(*tensors)
    zero = torch.zeros((), dtype=dtype, device=device)

    def selected(value: torch.Tensor) -> torch.Tensor:
        return torch.where(mask_t, value.to(dtype), zero)

    returns = reward_to_go(rewards_t.to(dtype), mask_t)  # (B, T)
    energy = 1.0 - 2.0 * torch.exp(selected(old)) + torch.exp(selected(squares))  # (B, T)
    if weights is not None:
        energy = energy * selected(weights).square()
    path = torch.where(mask_t, energy, zero).cumsum(dim=1)  # (B, T) W
    if isinstance(epsilon, torch.Tensor):
        epsilon = epsilon.to(dtype)
    if align == "position":
        members = torch.ones(shape[0], dtype=torch.bool, device=device)
        baseline = _baseline(returns, path, mask_t, groups, (members, zero_tail, epsilon))
        advantages = torch.where(mask_t, returns - baseline, zero)
    else:
        ranks = _token_ranks(mask_t)  # (B, T)
        compact_mask = _compact(mask_t, ranks)  # (B, T) the first n_i columns
        compact_returns = _compact(torch.where(mask_t, returns, zero), ranks)
        compact_path = _compact(torch.where(mask_t, path, zero), ranks)
        members = compact_mask.any(dim=1)  # rows with a selected token form the groups
        baseline = _baseline(compact_returns, compact_path, compact_mask, groups,
                             (members, zero_tail, epsilon))  # fmt: skip
        compact_advantages = compact_returns - baseline  # (B, T)
        gathered = compact_advantages.gather(1, ranks.clamp(max=shape[1] - 1))
        advantages = torch.where(mask_t, gathered, zero)
    return OptimalTokenBaselineOutput(advantages, torch.where(mask_t, returns, zero))
