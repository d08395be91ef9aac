r"""The peers' advantages: TRL's ``multi_objective_aggregation``, verl's ``gdpo``, ``gpg`` and OTB.

- :func:`trl_grpo_advantages`: the advantages of TRL 1.16's ``GRPOTrainer``
  (``_generate_and_score_completions``) from the per-function rewards, for both values of
  ``GRPOConfig.multi_objective_aggregation`` and every ``scale_rewards``;
- :func:`verl_gdpo_advantages`: verl 0.9.1's ``compute_gdpo_outcome_advantage``
  (``algorithm.adv_estimator="gdpo"``), token-level ``(B, T)``;
- :func:`verl_gpg_advantages`: verl 0.9.1's ``compute_gpg_outcome_advantage``
  (``algorithm.adv_estimator="gpg"``), token-level ``(B, T)``;
- :func:`verl_optimal_token_baseline_advantages`: verl 0.9.1's
  ``adv_estimator="optimal_token_baseline"`` / ``"tir_optimal_token_baseline"``.

They are tables onto :func:`rlobjectives.group_relative_advantages`,
:func:`rlobjectives.gdpo_advantages`, :func:`rlobjectives.gpg_advantages`,
:func:`rlobjectives.masked_whiten` and :func:`rlobjectives.optimal_token_baseline_advantages`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._core.validation import as_float_tensor, as_mask, checks_environment, validate_choice
from ..advantages.gdpo import gdpo_advantages
from ..advantages.gpg import gpg_advantages
from ..advantages.groups import grouped_rewards
from ..advantages.otb import optimal_token_baseline_advantages, reward_to_go
from ..advantages.outcome import group_relative_advantages
from ..advantages.whitening import masked_whiten
from ._common import preset_count, preset_flag, preset_number

__all__ = [
    "TRL_AGGREGATIONS",
    "TRL_SCALE_REWARDS",
    "VerlAdvantageOutput",
    "VERL_OTB_ESTIMATORS",
    "trl_grpo_advantages",
    "verl_gdpo_advantages",
    "verl_gpg_advantages",
    "verl_optimal_token_baseline_advantages",
]

#: TRL ``scale_rewards`` -> :func:`rlobjectives.group_relative_advantages`'s ``scale``.
TRL_SCALE_REWARDS: dict[str, str] = {"group": "std", "batch": "batch", "none": "none"}
#: TRL ``multi_objective_aggregation`` values (1.16).
TRL_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
#: TRL's epsilon of both normalisations (``std + 1e-4``).
TRL_EPS = 1e-4


def _rewards_matrix(rewards: Any, name: str) -> torch.Tensor:
    tensor = as_float_tensor(rewards, name)
    if tensor.ndim == 1:
        tensor = tensor.unsqueeze(-1)
    if tensor.ndim != 2 or tensor.shape[1] < 1:
        raise ValueError(
            f"{name} must have shape (B, R): one column per reward function, got shape "
            f"{tuple(tensor.shape)}"
        )
    return tensor


def _reward_weights(weights: Any, name: str, count: int, device: torch.device) -> torch.Tensor:
    """The ``(R,)`` weights of the reward functions, finite, checked under the peer's name."""
    tensor = as_float_tensor(weights, name, device)
    if tensor.ndim != 1 or tensor.shape[0] != count:
        raise ValueError(
            f"{name} must have shape (R,) = ({count},), got shape {tuple(tensor.shape)}"
        )
    if not bool(torch.isfinite(tensor).all()):  # a config value: one host read of R numbers
        raise ValueError(f"{name} must be finite, got {tensor.tolist()}")
    return tensor


def _check_groups(rows: int, generations: int) -> None:
    if rows % generations:
        raise ValueError(
            f"num_generations must divide the number of completions: rewards_per_func has {rows} "
            f"rows (B), not a multiple of num_generations={generations}"
        )


@checks_environment
def trl_grpo_advantages(
    rewards_per_func: Any,
    num_generations: int,
    *,
    multi_objective_aggregation: str = "sum_then_normalize",
    reward_weights: Any = None,
    scale_rewards: str = "group",
) -> torch.Tensor:
    r"""TRL 1.16 ``GRPOTrainer``'s advantages from the rewards of each reward function.

    With :math:`r^k_i` the reward of function :math:`k` (``rewards_per_func[:, k]``),
    :math:`w_k` = ``reward_weights`` (default ones) and groups of ``num_generations``
    contiguous completions:

    - ``"sum_then_normalize"`` (TRL's default): :math:`r_i = \sum_k w_k r^k_i`, then
      ``group_relative_advantages(r, num_generations, scale=..., eps=1e-4)`` with
      ``scale_rewards`` ``"group"`` -> ``"std"`` (the group's unbiased std), ``"batch"`` ->
      ``"batch"`` (the batch's), ``"none"`` -> ``"none"``;
    - ``"normalize_then_sum"`` (GDPO): ``gdpo_advantages(rewards_per_func, num_generations,
      weights=reward_weights, eps=1e-4)``: each function's rewards z-scored within the group,
      weighted sum, whitened over the batch; ``scale_rewards`` is ignored (as in TRL).

    TRL computes this on the rewards gathered from every process (pass the gathered batch) and
    keeps its own process's slice afterwards. Differences: TRL's ``nanstd`` uses a float32
    Bessel factor (a relative 3e-8); a reward function returning None (NaN) is not supported
    here (TRL drops it from that function's statistics and zeroes unscorable completions).

    Args:
        rewards_per_func: ``(B, R)`` rewards of the R reward functions (``(B,)`` for one).
        num_generations: G, the completions per prompt (contiguous groups).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
        reward_weights: optional ``(R,)`` weights (TRL's ``reward_weights``).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (``sum_then_normalize`` only).

    Returns:
        ``(B,)`` advantages, float32 (float64 for float64 rewards).

    Raises:
        ValueError: an unknown ``multi_objective_aggregation`` or ``scale_rewards``, rewards
            that are not ``(B, R)``, ``B`` not divisible by ``num_generations``, weights not
            ``(R,)``.
        TypeError: a non-int ``num_generations``, non-numeric rewards.

    Examples:
        >>> import torch
        >>> rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
        >>> # z-scores +-1/sqrt2 (eps 1e-4), sums [0, 0, .7071, -.7071], whitened (eps 1e-4)
        >>> trl_grpo_advantages(rewards, 2, multi_objective_aggregation="normalize_then_sum")
        tensor([ 0.0000,  0.0000,  1.2245, -1.2245])
    """
    aggregation = validate_choice(
        multi_objective_aggregation, "multi_objective_aggregation", TRL_AGGREGATIONS
    )
    scale_name = validate_choice(scale_rewards, "scale_rewards", tuple(TRL_SCALE_REWARDS))
    scale = TRL_SCALE_REWARDS[scale_name]
    generations = preset_count(num_generations, "num_generations")
    rewards = _rewards_matrix(rewards_per_func, "rewards_per_func")
    _check_groups(rewards.shape[0], generations)
    weights = None
    if reward_weights is not None:
        weights = _reward_weights(
            reward_weights, "reward_weights", rewards.shape[1], rewards.device
        )
    if aggregation == "normalize_then_sum":
        return gdpo_advantages(rewards, generations, weights=weights, eps=TRL_EPS)
    if weights is None:
        total = rewards.sum(dim=1)
    else:
        total = (rewards * weights.to(rewards.dtype)).sum(dim=1)
    return group_relative_advantages(total, generations, scale=scale, eps=TRL_EPS)  # type: ignore[arg-type]


class VerlAdvantageOutput(NamedTuple):
    """verl's ``(advantages, returns)``, each ``(B, T)`` (equal for outcome estimators)."""

    advantages: torch.Tensor
    returns: torch.Tensor


@checks_environment
def verl_gdpo_advantages(
    scores: Any,
    response_mask: Any,
    index: Any,
    *,
    gdpo_reward_weights: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> VerlAdvantageOutput:
    r"""The ``compute_gdpo_outcome_advantage`` of verl 0.9.1 (``adv_estimator="gdpo"``).

    ``scores[:, k]`` is the component ``gdpo_reward_keys[k]`` of each response (verl places it
    on the last response token and sums, the same number). Per component, verl's GRPO
    (``compute_grpo_outcome_advantage``): :math:`(r - \mu_g)/(\sigma_g + \epsilon)`
    (unbiased :math:`\sigma_g`; ``norm_adv_by_std_in_grpo=False``: :math:`r - \mu_g`), and a
    group of one response gets :math:`r/(1 + \epsilon)` (``False``: :math:`r`), verl's
    :math:`\mu = 0, \sigma = 1` convention; the weighted sum :math:`S_i = \sum_k w_k A^k_i`
    (``gdpo_reward_weights``, float32 in verl, default ones); then ``masked_whiten`` over the
    **tokens** of ``response_mask`` (each response counted once per token, unbiased variance,
    :math:`\mathrm{rsqrt}(\sigma^2 + 10^{-8})`) times the mask. The sequence-level whitening of
    the GDPO paper and TRL is :func:`rlobjectives.gdpo_advantages`.

    Args:
        scores: ``(B, R)`` reward components per response.
        response_mask: ``(B, T)`` response mask (0/1, bool).
        index: ``(B,)`` group labels (verl's ``uid``: strings or ints, any order).
        gdpo_reward_weights: optional ``(R,)`` weights.
        epsilon: verl's :math:`\epsilon` (1e-6).
        norm_adv_by_std_in_grpo: divide each component by its group's std (verl's default).

    Returns:
        :class:`VerlAdvantageOutput` ``(advantages, returns)``, each ``(B, T)``, zeros off the
        mask, float32 (float64 for float64 scores).

    Raises:
        ValueError: ``scores`` not ``(B, R)``, a mask of another batch, labels not one per
            response, weights not ``(R,)``, a negative ``epsilon``.
        TypeError: non-numeric inputs, a non-bool ``norm_adv_by_std_in_grpo``.
    """
    values = _rewards_matrix(scores, "scores")
    mask = as_mask(response_mask, "response_mask", values.device)
    if mask.ndim != 2 or mask.shape[0] != values.shape[0]:
        raise ValueError(
            f"response_mask must have shape (B, T) with B = {values.shape[0]} (one row per "
            f"response of scores), got shape {tuple(mask.shape)}"
        )
    eps = preset_number(epsilon, "epsilon")
    by_std = preset_flag(norm_adv_by_std_in_grpo, "norm_adv_by_std_in_grpo")
    weights = torch.ones(values.shape[1], dtype=torch.float32, device=values.device)
    if gdpo_reward_weights is not None:
        weights = _reward_weights(
            gdpo_reward_weights, "gdpo_reward_weights", values.shape[1], values.device
        ).to(torch.float32)  # verl's float32 weights
    _, groups = grouped_rewards(values[:, 0], None, index, name="scores")
    alone = groups.size == 1  # (B,) verl: mu = 0, sigma = 1 for a group of one
    total = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    for k in range(values.shape[1]):
        column = values[:, k]
        scaled = group_relative_advantages(
            column, group_ids=groups.ids, scale="std" if by_std else "none", eps=eps
        )
        singleton = column / (1.0 + eps) if by_std else column
        total = total + weights[k].to(values.dtype) * torch.where(alone, singleton, scaled)
    advantages = masked_whiten(total.unsqueeze(-1).expand(mask.shape), mask)
    return VerlAdvantageOutput(advantages, advantages)


@checks_environment
def verl_gpg_advantages(
    token_level_rewards: Any,
    response_mask: Any,
    index: Any,
    *,
    f_norm: float = 1.0,
) -> VerlAdvantageOutput:
    r"""The ``compute_gpg_outcome_advantage`` of verl 0.9.1 (``adv_estimator="gpg"``).

    verl sums each row of ``token_level_rewards`` into a score :math:`s_i`, forms
    :math:`\alpha = B / \max(\#\{s \ne 0\}, 1)` in **float32**, and returns
    :math:`\alpha (s_i - \mu_g) / F_{norm}` times the mask, with its group-of-one convention
    :math:`\mu = 0` (the raw :math:`\alpha s_i / F_{norm}`; :func:`rlobjectives.gpg_advantages`
    gives 0 there). verl's ``epsilon`` and ``alpha`` arguments are unused by it (``alpha`` is
    recomputed), so they are not options here.

    Args:
        token_level_rewards: ``(B, T)`` verl's token-level rewards (the score on the last token).
        response_mask: ``(B, T)`` response mask (0/1, bool).
        index: ``(B,)`` group labels (verl's ``uid``: strings or ints, any order).
        f_norm: verl's ``f_norm`` (algorithm config, default 1.0), positive.

    Returns:
        :class:`VerlAdvantageOutput` ``(advantages, returns)``, each ``(B, T)`` (the same
        tensor, as verl), zeros off the mask, float32 (float64 for float64 rewards).

    Raises:
        ValueError: ``token_level_rewards`` not ``(B, T)``, a mask of another shape, labels not
            one per response, a non-positive ``f_norm``.
        TypeError: non-numeric inputs.
    """
    rewards = as_float_tensor(token_level_rewards, "token_level_rewards")
    if rewards.ndim != 2:
        raise ValueError(
            "token_level_rewards must have shape (B, T) (verl's token-level rewards), got shape "
            f"{tuple(rewards.shape)}"
        )
    mask = as_mask(response_mask, "response_mask", rewards.device)
    if tuple(mask.shape) != tuple(rewards.shape):
        raise ValueError(
            f"response_mask must have the shape of token_level_rewards {tuple(rewards.shape)}, "
            f"got shape {tuple(mask.shape)}"
        )
    norm = preset_number(f_norm, "f_norm", strict=True)
    scores, groups = grouped_rewards(rewards.sum(dim=-1), None, index, name="token_level_rewards")
    ours = gpg_advantages(scores, group_ids=groups.ids, f_norm=norm)  # alpha exact, mu_1 = r
    batch = scores.shape[0]
    nonzero = (scores != 0).sum().clamp(min=1)
    alpha = batch / nonzero.to(scores.dtype)  # gpg_advantages' alpha
    alpha32 = (batch / nonzero).to(scores.dtype)  # verl: int / int64 tensor -> float32
    singleton = alpha32 * scores / norm  # verl: mu = 0 for a group of one
    advantages = torch.where(groups.size == 1, singleton, ours * (alpha32 / alpha))
    per_token = torch.where(mask, advantages.unsqueeze(-1), torch.zeros_like(rewards))
    return VerlAdvantageOutput(per_token, per_token)


#: verl's ``adv_estimator`` -> :func:`rlobjectives.optimal_token_baseline_advantages`'s
#: ``alignment``.
VERL_OTB_ESTIMATORS: dict[str, str] = {
    "optimal_token_baseline": "position",
    "tir_optimal_token_baseline": "token",
}


@checks_environment
def verl_optimal_token_baseline_advantages(
    token_level_rewards: Any,
    response_mask: Any,
    index: Any,
    old_log_probs: Any,
    sum_pi_squared: Any,
    rollout_is_weights: Any = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    *,
    adv_estimator: str = "optimal_token_baseline",
) -> VerlAdvantageOutput:
    r"""The Optimal Token Baseline estimators of verl 0.9.1, with verl's signature and defaults.

    ``adv_estimator`` ``"optimal_token_baseline"`` (``compute_optimal_token_baseline_advantage``)
    or ``"tir_optimal_token_baseline"`` (``compute_multi_turn_optimal_token_baseline_advantage``):
    :func:`rlobjectives.optimal_token_baseline_advantages` with ``alignment`` ``"position"`` /
    ``"token"``, ``group_ids=index``, ``log_sum_sq_probs = log(sum_pi_squared)``,
    ``importance_weights=rollout_is_weights``, ``eps=epsilon``. verl's trainer passes the
    actor's ``sum_pi_squared`` (``actor.calculate_sum_pi_squared=True``) and ``old_log_probs``;
    here ``sum_pi_squared`` is also :math:`e^{\lambda}` of ``statistics=("log_sum_sq_probs",)``.
    ``returns`` is verl's reward-to-go at every column (not masked, as verl returns it).

    Args:
        token_level_rewards: ``(B, T)`` token-level rewards.
        response_mask: ``(B, T)`` response mask.
        index: ``(B,)`` group labels (verl's ``uid``).
        old_log_probs: ``(B, T)`` behaviour log-probabilities.
        sum_pi_squared: ``(B, T)`` :math:`\sum_v \pi_v^2`.
        rollout_is_weights: optional ``(B, T)`` rollout IS weights.
        handle_zero_tail: verl's ``handle_zero_tail`` (True).
        epsilon: verl's ``epsilon`` (1e-8).
        adv_estimator: verl's ``algorithm.adv_estimator``.

    Returns:
        :class:`VerlAdvantageOutput` ``(advantages, returns)``, each ``(B, T)``.

    Raises:
        ValueError: an unknown ``adv_estimator``, and as
            :func:`rlobjectives.optimal_token_baseline_advantages`.
        TypeError: as :func:`rlobjectives.optimal_token_baseline_advantages`.
    """
    estimator = validate_choice(adv_estimator, "adv_estimator", tuple(VERL_OTB_ESTIMATORS))
    squares = as_float_tensor(sum_pi_squared, "sum_pi_squared")
    out = optimal_token_baseline_advantages(
        token_level_rewards,
        response_mask,
        old_log_probs,
        squares.log(),
        group_ids=index,
        importance_weights=rollout_is_weights,
        alignment=VERL_OTB_ESTIMATORS[estimator],  # type: ignore[arg-type]
        handle_zero_tail=preset_flag(handle_zero_tail, "handle_zero_tail"),
        eps=preset_number(epsilon, "epsilon"),
    )
    rewards = as_float_tensor(token_level_rewards, "token_level_rewards", out.advantages.device)
    mask = as_mask(response_mask, "response_mask", out.advantages.device)
    returns = reward_to_go(rewards.to(out.advantages.dtype), mask)
    return VerlAdvantageOutput(out.advantages, returns)
