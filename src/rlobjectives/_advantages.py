r"""Advantage estimators: GRPO / Dr. GRPO, RLOO, REINFORCE++ and masked GAE.

Group-based estimators take a flat ``(B*G,)`` reward vector whose groups (the G responses to one
prompt) are contiguous: ``rewards[g*G:(g+1)*G]`` is group ``g``. Token-level estimators take
``(B, T)`` tensors and a mask; unselected tokens are not part of the trajectory (their rewards
and values are ignored, their advantages are 0) and NaN/inf there never reaches the outputs.
All results are float32 (float64 when an input is float64).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from ._masking import last_selected, masked_fill_zero, masked_mean, masked_sum, safe_divide
from ._validation import (
    ArrayLike,
    Scalar,
    as_batch_matrix,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_choice,
    validate_scalar,
)

__all__ = [
    "GAEOutput",
    "gae",
    "group_relative_advantages",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
]

AdvantageScale = Literal["std", "none"]
SCALES: tuple[str, ...] = ("std", "none")


def _validate_group_size(group_size: object, minimum: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"group_size must be an int, got {type(group_size).__name__} ({group_size!r})"
        )
    if group_size < minimum:
        raise ValueError(f"group_size must be >= {minimum}, got {group_size}")
    return group_size


def _grouped_rewards(rewards: ArrayLike, group_size: object, minimum: int) -> torch.Tensor:
    """Validate a flat ``(B*G,)`` reward vector and return it as ``(B, G)`` in compute dtype."""
    rewards_t = as_float_tensor(rewards, "rewards")
    size = _validate_group_size(group_size, minimum)
    if rewards_t.ndim != 1:
        raise ValueError(
            f"rewards must have shape (B*G,) (1 dimension, groups contiguous), got shape "
            f"{tuple(rewards_t.shape)}"
        )
    length = rewards_t.shape[0]
    if length % size != 0:
        raise ValueError(
            f"rewards length {length} is not divisible by group_size {size}; expected B*G "
            f"rewards with the G responses of each prompt contiguous"
        )
    return rewards_t.to(compute_dtype(rewards_t)).reshape(length // size, size)  # (B, G)


def _centered(grouped: torch.Tensor) -> torch.Tensor:
    """``r - mean_g(r)`` per group, ``(B, G)``; exactly 0 for a group of identical rewards.

    The mean is taken of the differences to the group's first reward, so identical rewards give
    exact zeros (``mean([0.1] * 3) != 0.1`` in floating point, while ``0.1 - 0.1 == 0``).
    """
    shifted = grouped - grouped[:, :1]  # (B, G)
    return shifted - shifted.mean(dim=-1, keepdim=True)  # (B, G)


def _safe_sqrt(values: torch.Tensor) -> torch.Tensor:
    """``sqrt`` with gradient 0 (not inf/NaN) at 0."""
    positive = values > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, values, 1.0)), 0.0)


def group_relative_advantages(
    rewards: ArrayLike,
    group_size: int,
    *,
    scale: AdvantageScale = "std",
    eps: Scalar = 1e-6,
) -> torch.Tensor:
    r"""GRPO (and Dr. GRPO) group-relative advantages of a flat ``(B*G,)`` reward vector.

    For response :math:`j` of group :math:`g` (``rewards[g*G + j]``), with
    :math:`\mu_g = \frac1G \sum_j r_{gj}` and the Bessel-corrected (unbiased) standard deviation
    :math:`\sigma_g = \sqrt{\frac{1}{G-1}\sum_j (r_{gj} - \mu_g)^2}`,

    .. math::

        A_{gj} = \frac{r_{gj} - \mu_g}{\sigma_g + \epsilon} \;(\texttt{"std"}, \text{GRPO}),
        \qquad A_{gj} = r_{gj} - \mu_g \;(\texttt{"none"}, \text{Dr. GRPO}).

    A group of identical rewards gives exactly 0 (never NaN, also with ``eps=0``); for
    ``group_size=1`` :math:`\sigma := 0`, so every advantage is 0 (verl instead uses
    :math:`\mu = 0, \sigma = 1` there, i.e. returns the raw reward). Broadcast the result over
    tokens by passing it as ``advantages`` (``(B*G,)``) to :func:`rlobjectives.policy_loss`.
    verl ``grpo`` uses unbiased std and :math:`\epsilon = 10^{-6}`, TRL unbiased std and
    :math:`10^{-4}`, OpenRLHF ``group_norm`` :math:`10^{-9}`.

    Args:
        rewards: ``(B*G,)`` rewards, the G responses of each prompt contiguous.
        group_size: :math:`G \ge 1`.
        scale: ``"std"`` (divide by :math:`\sigma_g + \epsilon`) or ``"none"`` (mean only).
        eps: :math:`\epsilon \ge 0` (number or 0-d tensor), used with ``"std"``.

    Returns:
        ``(B*G,)`` advantages on the device of ``rewards``, float32 (float64 for float64 input).

    Raises:
        ValueError: if ``rewards`` is not 1-D, its length is not divisible by ``group_size``,
            ``group_size < 1``, ``scale`` is unknown or ``eps`` is negative/non-finite.
        TypeError: on non-numeric rewards or a non-int ``group_size``.

    References:
        Shao et al. 2024, DeepSeekMath/GRPO, arXiv:2402.03300 Sec. 4.1.2 (outcome supervision,
        :math:`\tilde r_i = (r_i - \mathrm{mean}(r)) / \mathrm{std}(r)`); Liu et al. 2025,
        Dr. GRPO, arXiv:2503.20783 (Dr. GRPO objective: no std normalization).

    Examples:
        >>> group_relative_advantages([1.0, 0.0, 1.0, 1.0], 2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])

    .. versionadded:: 0.1.0
    """
    grouped = _grouped_rewards(rewards, group_size, minimum=1)  # (B, G)
    validate_choice(scale, "scale", SCALES)
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    centered = _centered(grouped)  # (B, G)
    if scale == "none":
        return centered.reshape(-1)
    size = grouped.shape[1]
    variance = centered.square().sum(dim=-1, keepdim=True) / max(size - 1, 1)  # (B, 1)
    denominator = _safe_sqrt(variance) + epsilon  # (B, 1)
    positive = denominator > 0
    advantages = torch.where(
        positive, centered / torch.where(positive, denominator, 1.0), 0.0
    )  # (B, G)
    return advantages.reshape(-1)


def rloo_advantages(rewards: ArrayLike, group_size: int) -> torch.Tensor:
    r"""REINFORCE leave-one-out (RLOO) advantages of a flat ``(B*G,)`` reward vector.

    .. math::

        A_{gj} = r_{gj} - \frac{1}{G-1} \sum_{k \ne j} r_{gk}
               = \frac{G}{G-1}\,(r_{gj} - \mu_g).

    A group of identical rewards gives exactly 0. TRL's RLOO applies this to the KL-penalized
    sequence reward (:func:`rlobjectives.kl_penalized_rewards`).

    Args:
        rewards: ``(B*G,)`` rewards, the G responses of each prompt contiguous.
        group_size: :math:`G \ge 2` (the leave-one-out baseline needs another sample).

    Returns:
        ``(B*G,)`` advantages on the device of ``rewards``, float32 (float64 for float64 input).

    Raises:
        ValueError: if ``rewards`` is not 1-D, its length is not divisible by ``group_size`` or
            ``group_size < 2``.
        TypeError: on non-numeric rewards or a non-int ``group_size``.

    References:
        Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!" (ICLR 2019
        DeepRLStructPred workshop); Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740
        (the RLOO estimator).

    Examples:
        >>> rloo_advantages([1.0, 0.0, 0.0], 3)
        tensor([ 1.0000, -0.5000, -0.5000])

    .. versionadded:: 0.1.0
    """
    grouped = _grouped_rewards(rewards, group_size, minimum=2)  # (B, G)
    size = grouped.shape[1]
    return (_centered(grouped) * (size / (size - 1))).reshape(-1)


def _validate_discount(value: Scalar, name: str) -> float:
    number = float(validate_scalar(value, name, minimum=0.0, allow_tensor=False))
    if number > 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {number}")
    return number


# The blocked reverse scan rescales by discount**(-c) inside a block; blocks are sized so that
# these factors stay below exp(_SCAN_LOG_RANGE) ~ 6e14, far from float32 over/underflow.
_SCAN_LOG_RANGE = 34.0


def _masked_discounted_sum(
    values: torch.Tensor, mask: torch.Tensor, discount: float
) -> torch.Tensor:
    r"""Reverse discounted sum over the selected tokens of each row (unselected ones skipped).

    :math:`G_t = x_t + w\, G_{n(t)}` with :math:`n(t)` the next selected token (``G = 0`` after
    the last), i.e. :math:`G_t = \sum_{s \ge t,\ M_s} w^{c_s - c_t} x_s` with :math:`c` the
    running count of selected tokens; zeros at unselected tokens.

    Vectorized in blocks of :math:`K` tokens (:math:`w^{-K} \le e^{34}`): inside a block,
    :math:`G_t = w^{-c_t} \sum_{s \ge t} w^{c_s} x_s + w^{n - c_t + 1} H` (a reverse cumulative
    sum; :math:`n` the block's selected count, :math:`H` the return at the first selected token
    after the block), and a Python loop over the ``T / K`` blocks (static) carries :math:`H`.
    ``w = 1`` is one reverse cumulative sum and ``w = 0`` gives :math:`G = x`.
    """
    batch, tokens = values.shape
    values = masked_fill_zero(values, mask)  # (B, T)
    if tokens == 0 or discount == 0.0:
        return values
    if discount == 1.0:
        return masked_fill_zero(values.flip(-1).cumsum(-1).flip(-1), mask)
    block = max(1, min(tokens, int(_SCAN_LOG_RANGE / -math.log(discount))))
    blocks = -(-tokens // block)
    pad = blocks * block - tokens
    values_b = torch.nn.functional.pad(values, (0, pad)).reshape(batch, blocks, block)  # (B,C,K)
    mask_b = torch.nn.functional.pad(mask, (0, pad), value=False).reshape(batch, blocks, block)
    rank = mask_b.long().cumsum(-1)  # (B, C, K) selected tokens up to t within the block
    count = rank[..., -1:]  # (B, C, 1)
    exponents = torch.arange(block + 2, device=values.device, dtype=values.dtype)  # (K + 2,)
    powers = discount**exponents  # (K + 2,) w^k
    inverse_powers = discount ** (-exponents)  # (K + 2,) w^-k <= e^34
    scaled = powers[rank] * values_b  # (B, C, K) w^{c_s} x_s
    suffix = scaled.flip(-1).cumsum(-1).flip(-1)  # (B, C, K) sum over s >= t in the block
    local = inverse_powers[rank] * suffix  # (B, C, K)
    # Return at the first selected token of each block, without the later blocks.
    summary = (powers[(rank - 1).clamp(min=0)] * values_b).sum(-1)  # (B, C)
    decay = powers[count.squeeze(-1)]  # (B, C) w^n
    carry = values.new_zeros(batch)  # (B,) return at the first selected token after the block
    carries: list[torch.Tensor] = []
    for index in reversed(range(blocks)):
        carries.append(carry)
        carry = summary[:, index] + decay[:, index] * carry
    after = torch.stack(carries[::-1], dim=-1).unsqueeze(-1)  # (B, C, 1)
    returns = local + powers[count - rank + 1] * after  # (B, C, K)
    return masked_fill_zero(returns.reshape(batch, blocks * block)[:, :tokens], mask)  # (B, T)


def _next_selected(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` at the next selected token after ``t`` in the row (0 after the last), (B, T)."""
    batch, tokens = values.shape
    positions = torch.arange(tokens, device=values.device)  # (T,)
    index = torch.where(mask, positions, tokens)  # (B, T) own index if selected, else T
    following = index.flip(-1).cummin(-1).values.flip(-1)  # (B, T) first selected index >= t
    next_index = torch.cat(
        [following[:, 1:], torch.full((batch, 1), tokens, device=values.device)], dim=-1
    )  # (B, T) first selected index > t, T if none
    padded = torch.cat([values, values.new_zeros(batch, 1)], dim=-1)  # (B, T + 1)
    return padded.gather(-1, next_index)  # (B, T)


def reinforce_plus_plus_advantages(
    rewards: ArrayLike,
    mask: ArrayLike,
    *,
    token_rewards: ArrayLike | None = None,
    gamma: float = 1.0,
    group_size: int | None = None,
    eps: Scalar = 1e-8,
) -> torch.Tensor:
    r"""REINFORCE++ token advantages: discounted token returns, whitened over the whole batch.

    The token reward puts the sequence score on the last selected token and adds the optional
    per-token rewards :math:`c_{it}` (typically the KL penalty
    :math:`-\beta\,\log(\pi_{old}/\pi_{ref})`, see :func:`rlobjectives.kl_estimate`):

    .. math::

        R_{it} = c_{it} + \mathbb{1}[t = t^{last}_i]\,(r_i - b_i), \qquad
        G_{it} = \sum_{s \ge t,\ M_{is}=1} \gamma^{\,n_{ts}} R_{is}, \qquad
        A_{it} = \frac{G_{it} - \mu}{\sigma + \epsilon},

    where :math:`n_{ts} = |\{u : t < u \le s,\ M_{iu} = 1\}|` counts selected tokens only (the
    discount skips unselected ones), :math:`b_i` is 0, or with ``group_size`` the mean score of
    the sequence's group (REINFORCE++-baseline), and :math:`\mu`, :math:`\sigma` are the mean and
    the population (biased, as in OpenRLHF) standard deviation of :math:`G` over **all selected
    tokens of the batch** (global normalization). With :math:`\gamma = 1`,
    :math:`G_{it} = r_i - \beta\sum_{s \ge t} \mathrm{KL}_s` (the paper's Eq. for
    :math:`A_{q,o_t}`). For global normalization across data-parallel ranks, call it on the
    gathered batch. An empty mask gives all zeros; unselected tokens get 0. OpenRLHF
    (``reinforce`` / ``reinforce_baseline``) whitens with :math:`(G - \mu)
    \cdot \mathrm{rsqrt}(\max(\sigma^2, 10^{-8}))`, which equals this whenever
    :math:`\sigma \gg 10^{-4}`.

    Args:
        rewards: ``(B,)`` or ``(B, 1)`` sequence scores.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        token_rewards: optional ``(B, T)`` per-token rewards :math:`c_{it}` (ignored at
            unselected tokens).
        gamma: discount :math:`\gamma \in [0, 1]` (REINFORCE++ uses 1).
        group_size: optional :math:`G \ge 1`: subtract the group-mean score first (groups
            contiguous, ``B`` divisible by ``G``), the paper's "REINFORCE++ w/ baseline".
        eps: :math:`\epsilon \ge 0` added to :math:`\sigma`.

    Returns:
        ``(B, T)`` advantages on the device of ``mask``, float32 (float64 if an input is
        float64), zeros at unselected tokens.

    Raises:
        ValueError: on mismatched shapes/devices, ``B`` not divisible by ``group_size``,
            ``gamma`` outside [0, 1] or a negative ``eps``.
        TypeError: on non-numeric inputs.

    References:
        Hu et al. 2025, REINFORCE++, arXiv:2501.03262: token advantage
        :math:`r - \beta\sum_{i \ge t}\mathrm{KL}(i)` with :math:`\mathrm{KL}(t) =
        \log(\pi_{old}/\pi_{SFT})` (Eq. 8-9) and global batch normalization (Eq. 10).

    Examples:
        >>> reinforce_plus_plus_advantages([1.0, 0.0], [[1, 1], [1, 0]])
        tensor([[ 0.7071,  0.7071],
                [-1.4142,  0.0000]])

    .. versionadded:: 0.1.0
    """
    mask_t = as_batch_matrix(as_mask(mask, "mask"), "mask")
    device = mask_t.device
    batch = mask_t.shape[0]
    scores = as_float_tensor(rewards, "rewards", device)
    tensors = {"mask": mask_t, "rewards": scores}
    if scores.ndim == 2 and scores.shape[1] == 1:
        scores = scores.squeeze(-1)
    if scores.ndim != 1 or scores.shape[0] != batch:
        raise ValueError(
            f"rewards must have shape (B,) or (B, 1) with B = {batch} (one score per row of "
            f"mask), got shape {tuple(scores.shape)}"
        )
    extra = None
    if token_rewards is not None:
        extra = as_batch_matrix(
            as_float_tensor(token_rewards, "token_rewards", device), "token_rewards"
        )
        check_shape(extra, "token_rewards", mask_t.shape, "mask")
        tensors["token_rewards"] = extra
    check_same_device(tensors)
    discount = _validate_discount(gamma, "gamma")
    epsilon = validate_scalar(eps, "eps", minimum=0.0)
    dtype = compute_dtype(*tensors.values())

    scores = scores.to(dtype)  # (B,)
    if group_size is not None:
        size = _validate_group_size(group_size, 1)
        if batch % size != 0:
            raise ValueError(
                f"rewards length {batch} is not divisible by group_size {size}; expected B*G "
                f"scores with the G responses of each prompt contiguous"
            )
        scores = _centered(scores.reshape(batch // size, size)).reshape(batch)  # (B,)
    last = last_selected(mask_t)  # (B, T)
    token_level = masked_fill_zero(scores.unsqueeze(-1).expand(mask_t.shape), last)  # (B, T)
    if extra is not None:
        token_level = token_level + masked_fill_zero(extra.to(dtype), mask_t)  # (B, T)
    returns = _masked_discounted_sum(token_level, mask_t, discount)  # (B, T)

    mean = masked_mean(returns, mask_t)  # ()
    centered = masked_fill_zero(returns - mean, mask_t)  # (B, T)
    variance = safe_divide(masked_sum(centered.square(), mask_t), mask_t.sum())  # ()
    denominator = _safe_sqrt(variance) + epsilon  # ()
    positive = denominator > 0
    return torch.where(positive, centered / torch.where(positive, denominator, 1.0), 0.0)


class GAEOutput(NamedTuple):
    r"""Result of :func:`gae`.

    Attributes:
        advantages: ``(B, T)`` GAE advantages :math:`\hat A_t`, zeros at unselected tokens.
        returns: ``(B, T)`` value targets :math:`\hat A_t + V_t`, zeros at unselected tokens.
    """

    advantages: torch.Tensor
    returns: torch.Tensor


def gae(
    rewards: ArrayLike,
    values: ArrayLike,
    mask: ArrayLike,
    *,
    gamma: float,
    lam: float,
) -> GAEOutput:
    r"""Masked generalized advantage estimation (GAE) over the selected tokens of each row.

    With :math:`n(t)` the next selected token after :math:`t` in the same row
    (:math:`V_{n(t)} := 0` and :math:`\hat A_{n(t)} := 0` after the last one),

    .. math::

        \delta_t = r_t + \gamma V_{n(t)} - V_t, \qquad
        \hat A_t = \delta_t + \gamma\lambda \hat A_{n(t)}
                 = \sum_{l \ge 0} (\gamma\lambda)^l \delta_{t+l}, \qquad
        \hat R_t = \hat A_t + V_t .

    Unselected tokens are not part of the trajectory: their rewards and values are ignored
    (NaN/inf there is harmless), the chain skips them (a masked token in the middle, e.g. a tool
    observation, does not break it, as in verl's multi-turn GAE), and the bootstrap after the
    last selected token is 0 (the response ended). With :math:`\gamma = \lambda = 1`,
    :math:`\hat A_t = \sum_{s \ge t} M_s r_s - V_t` (reward-to-go minus value).

    Args:
        rewards: ``(B, T)`` per-token rewards (e.g. from
            :func:`rlobjectives.kl_penalized_token_rewards`).
        values: ``(B, T)`` value estimates :math:`V_t`.
        mask: ``(B, T)``, bool or numeric; nonzero selects the token.
        gamma: discount :math:`\gamma \in [0, 1]`.
        lam: GAE :math:`\lambda \in [0, 1]`.

    Returns:
        :class:`GAEOutput` ``(advantages, returns)``, each ``(B, T)``, on the device of
        ``rewards``, float32 (float64 if an input is float64), zeros at unselected tokens.
        Differentiable in ``rewards`` and ``values`` (detach ``values`` for PPO targets).

    Raises:
        ValueError: on mismatched shapes/devices, inputs that are not ``(B, T)``, ``gamma`` or
            ``lam`` outside [0, 1].
        TypeError: on non-numeric inputs or tensor-valued ``gamma``/``lam``.

    References:
        Schulman et al. 2016, GAE, arXiv:1506.02438 Eq. 16; Ouyang et al. 2022,
        arXiv:2203.02155 (PPO for LMs).

    Examples:
        >>> out = gae([[0.0, 1.0]], [[0.5, 0.5]], [[1, 1]], gamma=1.0, lam=1.0)
        >>> out.advantages
        tensor([[0.5000, 0.5000]])

    .. versionadded:: 0.1.0
    """
    rewards_t = as_batch_matrix(as_float_tensor(rewards, "rewards"), "rewards")
    device = rewards_t.device
    values_t = as_batch_matrix(as_float_tensor(values, "values", device), "values")
    mask_t = as_batch_matrix(as_mask(mask, "mask", device), "mask")
    check_same_device({"rewards": rewards_t, "values": values_t, "mask": mask_t})
    check_shape(values_t, "values", rewards_t.shape, "rewards")
    check_shape(mask_t, "mask", rewards_t.shape, "rewards")
    discount = _validate_discount(gamma, "gamma")
    trace = _validate_discount(lam, "lam")
    dtype = compute_dtype(rewards_t, values_t)

    rewards_m = masked_fill_zero(rewards_t.to(dtype), mask_t)  # (B, T)
    values_m = masked_fill_zero(values_t.to(dtype), mask_t)  # (B, T)
    next_values = _next_selected(values_m, mask_t)  # (B, T) V_{n(t)}, 0 after the last token
    deltas = rewards_m + discount * next_values - values_m  # (B, T)
    # A_t = delta_t + gamma * lam * A_{n(t)}: the same masked reverse scan as the returns.
    advantages = _masked_discounted_sum(deltas, mask_t, discount * trace)  # (B, T)
    returns = masked_fill_zero(advantages + values_m, mask_t)  # (B, T)
    return GAEOutput(advantages=advantages, returns=returns)
