r"""Batch-level token selections of M2PO, Clip-Cov and KL-Cov, on the device (no host sync).

Every function takes the tokens of one call as a flat, row-major sequence (a padded ``(B, T)``
tensor and its packed ``(1, N)`` form list the selected tokens in the same order), so each
selection is the same in both layouts, and ties are broken by that order (the earlier token
first: stable sorts). The sizes are static (one sort of the call's tokens, counts as 0-d
tensors), so the selections trace under ``torch.compile(fullgraph=True)``.

- :func:`m2po_kept`: M2PO's second-moment mask (AReaL ``_get_m2po_loss_mask``): sort
  :math:`\Delta^2` descending, mask the fewest largest values whose removal brings the mean of
  the rest below the threshold (at least one token kept).
- :func:`centered_covariance`: :math:`(A_t - \bar A)(\ell_t - \bar\ell)` over the selected
  tokens (exact means).
- :func:`selection_count`: :math:`\max(\lfloor \rho N \rfloor, 1)` (verl's ``int(ratio * N)``).
- :func:`top_k`: the :math:`k` largest scores (KL-Cov's deterministic top-k).
- :func:`random_subset`: :math:`\min(k, n)` candidates uniformly at random from one int64 seed
  per call and a counter-based hash (SplitMix64) of each token's ordinal among the selected
  tokens: reproducible, the same on every device and in both layouts (Clip-Cov).
"""

from __future__ import annotations

import torch

from .validation import Scalar, scalar_number, validate_scalar

__all__ = [
    "INT64_MAX",
    "check_selection",
    "validate_ratio",
    "validate_selection",
    "centered_covariance",
    "draw_seed",
    "hash_keys",
    "m2po_kept",
    "random_subset",
    "selection_count",
    "splitmix64",
    "stable_ranks",
    "top_k",
]

INT64_MAX = torch.iinfo(torch.int64).max
_MODULUS = 1 << 64


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - _MODULUS if value >= 1 << 63 else value


# SplitMix64 (Steele, Lea and Flood 2014; the finaliser of java.util.SplittableRandom).
_GOLDEN_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def stable_ranks(keys: torch.Tensor, *, descending: bool) -> torch.Tensor:
    """The rank of each entry of the 1-D ``keys`` in a stable sort (ties: the earlier first)."""
    order = torch.sort(keys, descending=descending, stable=True).indices
    positions = torch.arange(order.numel(), device=keys.device)
    return torch.empty_like(order).scatter_(0, order, positions)


def m2po_kept(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: Scalar) -> torch.Tensor:
    r"""M2PO's kept tokens: the fewest largest :math:`\Delta^2` removed so the rest's mean < τ.

    With :math:`m_{(1)} \ge \dots \ge m_{(n)}` the squared log-ratios of the ``n`` selected
    tokens sorted descending (stable: ties by position, the earlier one masked first), the
    suffix means :math:`S_i = \frac{1}{n - i}\sum_{j > i} m_{(j)}` (0-based, the sum by
    flip-cumsum-flip as AReaL), the first :math:`i` with :math:`S_i < \tau` masks the
    :math:`i` largest; when none is below, the :math:`n - 1` largest are masked (AReaL keeps at
    least one token). ``log_ratio``: ``(B, T)`` detached, any values at unselected tokens.
    """
    flat_mask = mask.reshape(-1)
    squares = torch.where(flat_mask, torch.square(log_ratio.reshape(-1)), -torch.inf)
    size = squares.numel()
    count = flat_mask.sum()
    ordered, order = torch.sort(squares, descending=True, stable=True)
    position = torch.arange(size, device=squares.device)
    valid = position < count
    values = torch.where(
        valid, ordered, torch.zeros((), dtype=ordered.dtype, device=ordered.device)
    )
    suffix = values.flip(0).cumsum(0).flip(0)  # the sums of the kept values, AReaL's order
    remaining = (count - position).clamp(min=1).to(squares.dtype)
    below = valid & (suffix / remaining < threshold)
    fallback = count - 1  # none below: all but the smallest are masked
    first = torch.cat([torch.where(below, position, fallback), fallback.reshape(1)]).min()
    kept_sorted = position >= first
    kept = torch.zeros_like(flat_mask).scatter(0, order, kept_sorted)
    return kept.reshape(mask.shape) & mask


def centered_covariance(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    means: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    r""":math:`(A_t - \bar A)(\ell_t - \bar\ell)` at selected tokens, ``-inf`` elsewhere.

    :math:`\bar A` and :math:`\bar\ell` are the exact means over the call's selected tokens
    (``log_probs`` and ``advantages`` selected: zeros elsewhere, detached, computation dtype),
    or ``means`` = ``(mean log-prob, mean advantage)`` given (over every rank).
    """
    if means is None:
        count = mask.sum().to(log_probs.dtype).clamp(min=1)
        means = (log_probs.sum() / count, advantages.sum() / count)
    covariance = (advantages - means[1]) * (log_probs - means[0])
    return torch.where(mask, covariance, -torch.inf)


def selection_count(ratio: Scalar, count: torch.Tensor) -> torch.Tensor:
    r""":math:`\max(\lfloor \rho N \rfloor, 1)`, 0-d int64 (the product in float64, as Python)."""
    product = count.to(torch.float64) * torch.as_tensor(
        ratio, dtype=torch.float64, device=count.device
    )
    return torch.floor(product).clamp(min=1).to(torch.int64)


def top_k(scores: torch.Tensor, mask: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k`` largest ``scores`` among ``mask`` (ties: the earlier token), bool of its shape."""
    ranks = stable_ranks(scores.reshape(-1), descending=True).reshape(mask.shape)
    return mask & (ranks < k)


def splitmix64(values: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``values + golden gamma`` on int64 (wrap-around arithmetic).

    Logical right shifts of the signed int64 are ``(x >> s) & (2^(64 - s) - 1)``.
    """

    def shifted(x: torch.Tensor, bits: int) -> torch.Tensor:
        return (x >> bits) & ((1 << (64 - bits)) - 1)

    z = values + _GOLDEN_GAMMA
    z = (z ^ shifted(z, 30)) * _MIX_1
    z = (z ^ shifted(z, 27)) * _MIX_2
    return z ^ shifted(z, 31)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One int64 seed (0-d, on ``device``) from ``generator`` or the device's default one."""
    low, high = -(1 << 63), (1 << 63) - 1
    if generator is None:  # the default generator: traceable under torch.compile
        return torch.randint(low, high, (), dtype=torch.int64, device=device)
    seed = torch.randint(
        low, high, (), dtype=torch.int64, generator=generator, device=generator.device
    )
    return seed.to(device)


def hash_keys(mask: torch.Tensor, seed: torch.Tensor, offset: int = 0) -> torch.Tensor:
    r"""The flat int64 keys :math:`\mathrm{splitmix64}(\text{seed} + o_t)` of the tokens.

    :math:`o_t` is the token's ordinal among the selected tokens of ``mask`` (row-major), plus
    ``offset`` (the selected tokens of the ranks before this one, for the global draw).
    """
    ordinal = torch.cumsum(mask.reshape(-1).to(torch.int64), 0) - 1 + offset
    return splitmix64(seed + ordinal)


def random_subset(
    candidates: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, seed: torch.Tensor
) -> torch.Tensor:
    r""":math:`\min(k, n)` of the ``n`` candidates, uniformly at random given ``seed``.

    Each selected token :math:`t` gets the key :math:`\mathrm{splitmix64}(\text{seed} + o_t)`
    with :math:`o_t` its ordinal among the selected tokens of ``mask`` (the same in the padded
    and the packed layout); the ``k`` smallest keys among the candidates are selected (a stable
    sort: ties by ordinal). ``candidates`` is a subset of ``mask``.
    """
    keys = torch.where(candidates.reshape(-1), hash_keys(mask, seed), INT64_MAX)
    ranks = stable_ranks(keys, descending=False).reshape(mask.shape)
    return candidates & (ranks < k)


def validate_ratio(value: Scalar, name: str) -> float | torch.Tensor:
    r"""A selection ratio :math:`0 < \rho \le 1` (a real number or a 0-d tensor)."""
    ratio = validate_scalar(value, name, minimum=0.0, strict=True)
    number = scalar_number(ratio)  # a 0-d tensor is held to the same range
    if number is not None and number > 1.0:
        raise ValueError(f"{name} must be <= 1 (a fraction of the selected tokens), got {number}")
    return ratio


def validate_selection(selection: object, name: str) -> None:
    """``None`` or a bool tensor (a precomputed selection), else ``TypeError`` naming it."""
    if selection is not None and not (
        isinstance(selection, torch.Tensor) and selection.dtype == torch.bool
    ):
        kind = selection.dtype if isinstance(selection, torch.Tensor) else type(selection).__name__
        raise TypeError(f"{name} must be None or a bool tensor of the mask's shape, got {kind}")


def check_selection(selection: torch.Tensor, mask: torch.Tensor, name: str) -> torch.Tensor:
    """A precomputed selection on the call's tokens: the mask's shape (packed: ``(N,)`` too)."""
    if selection.device != mask.device:
        raise ValueError(
            f"{name} must be on the device of the mask ({mask.device}), got {selection.device}"
        )
    if tuple(selection.shape) != tuple(mask.shape):
        packed = selection.ndim == 1 and mask.shape[0] == 1 and selection.numel() == mask.numel()
        if not packed:
            raise ValueError(
                f"{name} must have the shape of the mask {tuple(mask.shape)}, got "
                f"{tuple(selection.shape)}"
            )
        selection = selection.reshape(mask.shape)
    return selection & mask
