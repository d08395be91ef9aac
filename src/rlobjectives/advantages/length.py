r"""Terms that depend on the response length: VAPO's GAE lambda and DAPO's overlong penalty.

- :func:`length_adaptive_lambda`: VAPO's :math:`\lambda = 1 - 1/(\alpha\,l)` per sequence, to
  pass to :func:`rlobjectives.gae` as a per-sequence ``lam``;
- :func:`overlong_penalty`: DAPO's soft punishment of responses that approach or pass the
  maximum length, to add to the task reward.
"""

from __future__ import annotations

import torch

from .._core.validation import (
    ArrayLike,
    as_tensor,
    checks_environment,
    compute_dtype,
    describe,
    validate_scalar,
)

__all__ = ["length_adaptive_lambda", "overlong_penalty"]


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
