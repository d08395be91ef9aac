r"""Terms that depend on the response length: GAE lambdas, the overlong and group length penalties.

- :func:`length_adaptive_lambda`: VAPO's :math:`\lambda = 1 - 1/(\alpha\,l)` per sequence, to
  pass to :func:`rlobjectives.gae` as a per-sequence ``lam``;
- :func:`relative_position_lambda`: AReaL's :math:`\lambda = q^{1/(L-1)}` per sequence (the same
  retention at the same relative position of every length);
- :func:`overlong_penalty`: DAPO's soft punishment of responses that approach or pass the
  maximum length, to add to the task reward;
- :func:`group_length_penalty`: prime-rl's length-shaped group advantage (rewards minus the
  group's pass rate times the lengths relative to the group's longest, then centred).
"""

from __future__ import annotations

import math

import torch

from .._core.validation import (
    ArrayLike,
    as_float_tensor,
    as_tensor,
    check_same_device,
    checks_environment,
    compute_dtype,
    describe,
    validate_scalar,
)
from .groups import group_centered, grouped_rewards, segment_amax, segment_sum

__all__ = [
    "group_length_penalty",
    "length_adaptive_lambda",
    "overlong_penalty",
    "relative_position_lambda",
]


def _lengths(lengths: ArrayLike) -> torch.Tensor:
    """``(B,)`` lengths (integer or floating) as a floating tensor (float32, float64 kept)."""
    tensor = as_tensor(lengths, "lengths")
    if tensor.dtype == torch.bool:
        raise TypeError(f"lengths must be integer or floating token counts, got {describe(tensor)}")
    if tensor.ndim != 1:
        raise ValueError(
            f"lengths must have shape (B,) (one response length per sequence), got shape "
            f"{tuple(tensor.shape)}"
        )
    return tensor.to(compute_dtype(tensor))


def _count(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (a token count), got {describe(value)} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@checks_environment
def length_adaptive_lambda(lengths: ArrayLike, *, alpha: float) -> torch.Tensor:
    r"""VAPO's length-adaptive GAE :math:`\lambda` per sequence: :math:`1 - 1/(\alpha\,l)`.

    .. math::

        \lambda_i = \max\Big(0,\ 1 - \frac{1}{\alpha\, l_i}\Big) \quad (l_i > 0), \qquad
        \lambda_i = 0 \quad (l_i = 0),

    with :math:`l_i` the response length in tokens (the selected tokens of the row,
    ``mask.sum(-1)``, EOS included), so that :math:`\sum_t \lambda^t = 1/(1-\lambda) = \alpha
    l`: the GAE horizon grows with the response. Pass the result as ``lam`` of
    :func:`rlobjectives.gae` (per sequence), with ``value_lam=1.0`` for VAPO's decoupled
    critic. Lengths are not checked on the device: a negative length gives 0.

    Peers (identical for every :math:`l \ge 0`, both in float32): NeMo-RL
    ``length_adaptive_alpha`` (``1 - 1/clamp(alpha l, min=1)`` clamped to [0, 1]; VAPO's
    :math:`\alpha = 0.05`, ``gae_lambda_value: 1.0``); AReaL ``vapo_length_adaptive_gae``
    (``clamp_min(1 - 1/(alpha clamp_min(l, 1)), 0)``, :math:`l = 0 \Rightarrow 0`; a length in
    turns with ``gae_timestep_unit=turn``).

    Args:
        lengths: ``(B,)`` response lengths (integer or floating).
        alpha: :math:`\alpha > 0` (VAPO: 0.05), a Python number.

    Returns:
        ``(B,)`` :math:`\lambda` in [0, 1), float32 (float64 for float64 lengths).

    Raises:
        ValueError: if ``lengths`` is not 1-D, or ``alpha`` is not positive and finite.
        TypeError: on non-numeric or bool ``lengths``, or a non-number ``alpha``.

    References:
        Yue et al. 2025, VAPO, arXiv:2504.05118 Sec. 4.1 (decoupled GAE) and Eq. 7
        (length-adaptive GAE, :math:`\lambda_{policy} = 1 - 1/(\alpha l)`).

    Examples:
        >>> length_adaptive_lambda([0, 10, 20, 100, 1000], alpha=0.05)
        tensor([0.0000, 0.0000, 0.0000, 0.8000, 0.9800])

    .. versionadded:: 0.3.0
    """
    lengths_t = _lengths(lengths)
    rate = float(validate_scalar(alpha, "alpha", minimum=0.0, strict=True, allow_tensor=False))
    horizon = rate * lengths_t.clamp(min=1.0)  # alpha l, >= alpha
    lam = (1.0 - 1.0 / horizon).clamp(min=0.0)
    return torch.where(lengths_t > 0, lam, torch.zeros_like(lam))


@checks_environment
def overlong_penalty(
    lengths: ArrayLike,
    max_length: int,
    cache_length: int,
    *,
    factor: float = 1.0,
) -> torch.Tensor:
    r"""DAPO's soft overlong punishment of each response, to add to its reward.

    With :math:`L_{max}` = ``max_length`` and :math:`L_{cache}` = ``cache_length`` (DAPO Eq. 13),

    .. math::

        R(l) = c \cdot \begin{cases}
            0 & l \le L_{max} - L_{cache} \\
            \dfrac{(L_{max} - L_{cache}) - l}{L_{cache}} & L_{max} - L_{cache} < l \le L_{max} \\
            -1 & l > L_{max}
        \end{cases}

    times ``factor`` :math:`c`; continuous at both bounds (0 and :math:`-c`), so the
    inclusive/exclusive ends do not matter, and in :math:`[-c, 0]`. ``cache_length=0`` (no
    soft buffer) gives 0 up to :math:`L_{max}` and :math:`-c` beyond. DAPO's setting:
    :math:`L_{max} = 20480`, :math:`L_{cache} = 4096`.

    Peers: OpenRLHF ``--reward.overlong_buffer_len`` / ``--reward.overlong_penalty_factor``
    with ``max_new_tokens`` (capped at :math:`-c`: equal); verl ``reward_manager=dapo``
    (``overlong_buffer.len`` / ``penalty_factor``, ``max_resp_len``) and AReaL
    (``overlong_tokens`` / ``overlong_penalty_factor``) do not cap at :math:`-c` (their
    responses never exceed :math:`L_{max}`): equal for :math:`l \le L_{max}`.

    Args:
        lengths: ``(B,)`` response lengths in tokens (integer or floating).
        max_length: :math:`L_{max} \ge 1`, the maximum response length (an int).
        cache_length: :math:`0 \le L_{cache} \le L_{max}`, the soft buffer (an int).
        factor: :math:`c \ge 0`, the penalty at and beyond :math:`L_{max}`.

    Returns:
        ``(B,)`` penalties in :math:`[-c, 0]`, float32 (float64 for float64 lengths).

    Raises:
        ValueError: if ``lengths`` is not 1-D, ``max_length < 1``, ``cache_length`` is not in
            ``[0, max_length]`` or ``factor`` is negative or not finite.
        TypeError: on non-numeric ``lengths``, non-int lengths bounds or a non-number
            ``factor``.

    References:
        Yu et al. 2025, DAPO, arXiv:2503.14476 Eq. 13 (soft overlong punishment) and Sec. 3.4.

    Examples:
        >>> overlong_penalty([10, 16, 17, 18, 20, 22], 20, 4)
        tensor([ 0.0000,  0.0000, -0.2500, -0.5000, -1.0000, -1.0000])

    .. versionadded:: 0.3.0
    """
    lengths_t = _lengths(lengths)
    longest = _count(max_length, "max_length", 1)
    buffer = _count(cache_length, "cache_length", 0)
    if buffer > longest:
        raise ValueError(
            f"cache_length must be <= max_length ({longest}), got {buffer} (the soft buffer is "
            "the last cache_length tokens before max_length)"
        )
    scale = float(validate_scalar(factor, "factor", minimum=0.0, allow_tensor=False))
    if buffer == 0:
        ramp = torch.where(lengths_t > longest, -1.0, 0.0).to(lengths_t.dtype)
    else:
        ramp = ((longest - buffer - lengths_t) / buffer).clamp(min=-1.0, max=0.0)
    return ramp * scale + 0.0  # + 0.0: no -0.0 where there is no penalty


@checks_environment
def relative_position_lambda(lengths: ArrayLike, *, q: float) -> torch.Tensor:
    r"""AReaL's relative-position GAE :math:`\lambda` per sequence: :math:`q^{1/(L-1)}`.

    .. math::

        \lambda_i = q^{1/(L_i - 1)} \ (L_i \ge 2), \qquad \lambda_i = 1 \ (L_i = 1), \qquad
        \lambda_i = 0 \ (L_i = 0),

    so that with :math:`\gamma = 1` a terminal reward keeps the fraction
    :math:`\lambda^{L-k} = q^{(L-k)/(L-1)}` at step :math:`k`: exactly :math:`q` at the first
    step and 1 at the last, the same at every relative position :math:`(k-1)/(L-1)` whatever
    the length (a one-step trajectory has nothing to decay over). Pass it as ``lam`` of
    :func:`rlobjectives.gae` (per sequence). Computed as AReaL does,
    :math:`\exp(\ln q / \max(L - 1, 1))`. Lengths are not checked on the device (counts
    :math:`\ge 0`; a length in ``(1, 2)`` gives :math:`q`, a negative one 0).

    Peer: AReaL ``gae_lambda="areal.trainer.ppo.lambda_fn.relative_position_gae_lambda"``
    (``q`` its keyword; the length is the effective token count, or the turn count with
    ``gae_timestep_unit=turn``): equal, both in float32 for integer lengths.

    Args:
        lengths: ``(B,)`` trajectory lengths :math:`L_i` (integer or floating counts).
        q: the retained fraction at the first step, :math:`0 < q \le 1` (a Python number).

    Returns:
        ``(B,)`` :math:`\lambda` in ``[0, 1]``, float32 (float64 for float64 lengths).

    Raises:
        ValueError: ``lengths`` not 1-D, or ``q`` not in ``(0, 1]``.
        TypeError: non-numeric or bool ``lengths``, a non-number ``q``.

    References:
        AReaL (inclusionAI), ``areal/trainer/ppo/lambda_fn.py``, PR #1600 (flexible GAE lambda
        strategies); GAE: Schulman et al. 2016, arXiv:1506.02438 Eq. 16.

    Examples:
        >>> relative_position_lambda([0, 1, 2, 3, 5], q=0.25)
        tensor([0.0000, 1.0000, 0.2500, 0.5000, 0.7071])

    .. versionadded:: 0.4.0
    """
    lengths_t = _lengths(lengths)
    retained = float(validate_scalar(q, "q", minimum=0.0, strict=True, allow_tensor=False))
    if retained > 1.0:
        raise ValueError(f"q must be <= 1 (the fraction retained at the first step), got {q}")
    steps = (lengths_t - 1).clamp(min=1.0)  # (B,) the transitions to decay over
    lam = torch.exp(math.log(retained) / steps)
    one, zero = torch.ones_like(lam), torch.zeros_like(lam)
    return torch.where(lengths_t > 1, lam, torch.where(lengths_t == 1, one, zero))


@checks_environment
def group_length_penalty(
    rewards: ArrayLike,
    quantities: ArrayLike,
    *,
    weights: ArrayLike,
    group_size: int | None = None,
    group_ids: ArrayLike | None = None,
) -> torch.Tensor:
    r"""prime-rl's length-shaped GRPO advantage: a pass-rate-scaled length penalty, centred.

    With :math:`\bar r_g` the mean reward of the group of sequence :math:`i` (its pass rate
    for 0/1 rewards), :math:`x_{ik}` the quantities (output tokens, input tokens, turns) and
    :math:`w_k` their weights,

    .. math::

        \tilde r_i = r_i - \bar r_g \sum_k w_k \frac{x_{ik}}{\max(\max_{j \in g} x_{jk},\ 1)},
        \qquad A_i = \tilde r_i - \operatorname{mean}_{j \in g} \tilde r_j :

    a group that mostly succeeds pays for the length of each response relative to the group's
    longest, so shorter correct answers win; a group that fails pays nothing. A group of one
    sequence gives 0. The group maximum is a constant (no gradient); rewards and quantities are
    differentiable otherwise.

    Peer: prime-rl ``GRPOAlgorithm.score_group`` with ``length_penalty`` (linear; per group,
    float32): ``num_output_tokens_weight`` (0.25), ``num_input_tokens_weight`` (0.1),
    ``num_turns_weight`` (0.1) on ``num_output_tokens``, ``num_total_tokens -
    num_output_tokens`` and ``num_turns``: ``weights=[0.25, 0.1, 0.1]`` with those columns.

    Args:
        rewards: ``(B,)`` rewards, the groups' responses contiguous with ``group_size``.
        quantities: ``(B, K)`` non-negative quantities per response (``(B,)``: one).
        weights: ``(K,)`` weights :math:`w_k`, one per column of ``quantities``.
        group_size: :math:`G`, the responses per prompt (``B`` divisible by it), or None with
            ``group_ids``.
        group_ids: ``(B,)`` one group label per sequence (ints or strings).

    Returns:
        ``(B,)`` advantages, float32 (float64 when an input is float64).

    Raises:
        ValueError: ``rewards`` not 1-D, ``quantities`` not ``(B, K)``, ``weights`` not
            ``(K,)``, neither or both of ``group_size`` / ``group_ids``, a bad grouping.
        TypeError: non-numeric inputs or labels, a non-int ``group_size``.

    References:
        prime-rl (PrimeIntellect), ``src/prime_rl/orchestrator/algo/grpo.py`` (length-penalty
        shaping of the GRPO baseline).

    Examples:
        >>> group_length_penalty([1.0, 1.0], [[10.0], [20.0]], weights=[0.5], group_size=2)
        tensor([ 0.1250, -0.1250])

    .. versionadded:: 0.4.0
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids)
    sizes = as_float_tensor(quantities, "quantities", values.device)
    sizes = sizes.unsqueeze(-1) if sizes.ndim == 1 else sizes
    if sizes.ndim != 2 or sizes.shape[0] != values.shape[0]:
        raise ValueError(
            f"quantities must have shape (B, K) with B = {values.shape[0]} (one row per reward), "
            f"got shape {tuple(sizes.shape)}"
        )
    weights_t = as_float_tensor(weights, "weights", values.device)
    check_same_device({"rewards": values, "quantities": sizes, "weights": weights_t})
    if weights_t.ndim != 1 or weights_t.shape[0] != sizes.shape[1]:
        raise ValueError(
            f"weights must have shape (K,) = ({sizes.shape[1]},) (one weight per column of "
            f"quantities), got shape {tuple(weights_t.shape)}"
        )
    given = [weights_t] if isinstance(weights, torch.Tensor) else []  # a list: exact numbers
    dtype = compute_dtype(values, sizes, *given)
    if not given:
        weights_t = torch.as_tensor(weights, dtype=torch.float64, device=values.device)
    values, sizes, weights_t = values.to(dtype), sizes.to(dtype), weights_t.to(dtype)
    size = groups.size.to(dtype)  # (B,) sequences in the group
    pass_rate = segment_sum(values, groups) / size  # (B,) the group's mean reward
    longest = [segment_amax(sizes[:, k], groups).clamp(min=1.0) for k in range(sizes.shape[1])]
    relative = sizes / torch.stack(longest, dim=-1) if longest else sizes  # (B, K)
    shaped = values - pass_rate * (relative * weights_t).sum(dim=-1)  # (B,)
    return group_centered(shaped, groups)
