r"""KL-coefficient controllers: the adaptive controller of Ziegler et al. (2019) and a fixed one.

Plain Python classes (no tensors, no trainer state): they hold one float, update it once per
optimizer step from the measured KL, pickle, and checkpoint through ``state_dict()`` /
``load_state_dict()`` like a ``torch.optim`` object. The measured KL is read once per step on
the host (``float(current_kl)``), outside any hot path.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["AdaptiveKLController", "FixedKLController"]

# The proportional error is clipped to +-0.2 (Ziegler et al. 2019, Sec. 2.2; verl, OpenRLHF, TRL).
_ERROR_CLIP = 0.2


def _real(value: object, name: str, *, positive: bool = False, minimum: float = 0.0) -> float:
    """A finite real number (Python number or 0-d real tensor) >= ``minimum`` (> if positive)."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a real number or a 0-d real tensor, got a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        number = float(value.detach().cpu())
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    else:
        number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    if positive and number <= minimum:
        raise ValueError(f"{name} must be > {minimum}, got {number}")
    if not positive and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def _update_arguments(current_kl: object, n_steps: object) -> tuple[float, int]:
    """Validated ``(current_kl, n_steps)`` of an ``update`` call."""
    kl = _real(current_kl, "current_kl", minimum=-math.inf)
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral):
        raise TypeError(f"n_steps must be an int, got {type(n_steps).__name__} ({n_steps!r})")
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps}")
    return kl, int(n_steps)


def _check_state(state: object, expected: tuple[str, ...], owner: str) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise TypeError(
            f"state_dict must be a dict (from {owner}.state_dict()), got {type(state).__name__}"
        )
    if set(state) != set(expected):
        raise ValueError(
            f"state_dict must have the keys {sorted(expected)} (from {owner}.state_dict()), got "
            f"{sorted(map(str, state))}"
        )
    return state


class AdaptiveKLController:
    r"""Adaptive KL coefficient: steer the measured KL towards a target (Ziegler et al. 2019).

    After each step with measured :math:`\mathrm{KL}` over :math:`n` samples,

    .. math::

        e = \mathrm{clip}\Big(\frac{\mathrm{KL}}{\mathrm{KL}_{target}} - 1,\ -0.2,\ 0.2\Big),
        \qquad \beta \leftarrow \beta\,\Big(1 + e\,\frac{n}{H}\Big),

    so :math:`\beta` grows while the KL is above target and shrinks while it is below, by at
    most a factor :math:`1 \pm 0.2\,n/H` per step. Equal (bit for bit, same float64
    arithmetic) to verl's ``AdaptiveKLController(init_kl_coef, target_kl, horizon)`` and
    OpenRLHF's ``AdaptiveKLController(init_kl_coef, target, horizon)``, where :math:`n` is the
    number of sequences of the step (verl ``batch_size``, OpenRLHF ``rollout_batch_size``) and
    :math:`H` = 10 000 by default. Keep :math:`n < 5H` (the multiplier is positive then).

    Args:
        init_kl_coef: initial coefficient :math:`\beta_0 \ge 0`.
        target: target KL :math:`> 0` (verl ``target_kl``, OpenRLHF ``target``), in the same
            units as the ``current_kl`` passed to :meth:`update` (e.g. the mean per-sequence sum
            of token KL estimates).
        horizon: :math:`H > 0`, the number of samples over which the error is corrected.

    Attributes:
        value: the current coefficient :math:`\beta` (a float), to pass as ``kl_coef``.

    Raises:
        ValueError: ``init_kl_coef < 0``, ``target <= 0``, ``horizon <= 0`` or a non-finite
            value.
        TypeError: a non-numeric argument.

    References:
        Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
        arXiv:1909.08593 Sec. 2.2 (Eq. for :math:`e_t` and :math:`\beta_{t+1}`).

    Examples:
        >>> controller = AdaptiveKLController(0.1, target=6.0, horizon=10000)
        >>> controller.update(9.0, n_steps=256)  # e = min(9/6 - 1, 0.2) = 0.2
        0.100512
        >>> controller.value
        0.100512

    .. versionadded:: 0.2.0
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = _real(init_kl_coef, "init_kl_coef")
        self.target = _real(target, "target", positive=True)
        self.horizon = _real(horizon, "horizon", positive=True)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        """Update :attr:`value` from the KL measured on the last ``n_steps`` samples.

        Args:
            current_kl: measured KL (a number or a 0-d tensor, read on the host), finite.
            n_steps: samples (sequences) since the last update, an int >= 0.

        Returns:
            The new coefficient (also in :attr:`value`).

        Raises:
            ValueError: a non-finite ``current_kl`` or a negative ``n_steps``.
            TypeError: a non-numeric ``current_kl`` or a non-int ``n_steps``.
        """
        kl, samples = _update_arguments(current_kl, n_steps)
        error = min(max(kl / self.target - 1.0, -_ERROR_CLIP), _ERROR_CLIP)
        self.value *= 1.0 + error * samples / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"value", "target", "horizon"}``: everything needed to resume."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (validated like the constructor's arguments)."""
        state = _check_state(state_dict, ("value", "target", "horizon"), "AdaptiveKLController")
        value = _real(state["value"], "state_dict['value']")
        target = _real(state["target"], "state_dict['target']", positive=True)
        horizon = _real(state["horizon"], "state_dict['horizon']", positive=True)
        self.value, self.target, self.horizon = value, target, horizon

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value!r}, target={self.target!r}, "
            f"horizon={self.horizon!r})"
        )


class FixedKLController:
    r"""A constant KL coefficient with the controller interface (verl/OpenRLHF's).

    :meth:`update` validates its arguments and leaves :attr:`value` unchanged, so a trainer can
    switch between fixed and adaptive control without other changes.

    Args:
        kl_coef: the coefficient :math:`\beta \ge 0`.

    Attributes:
        value: :math:`\beta` (a float).

    Raises:
        ValueError: a negative or non-finite ``kl_coef``.
        TypeError: a non-numeric ``kl_coef``.

    Examples:
        >>> FixedKLController(0.05).update(3.0, n_steps=64)
        0.05

    .. versionadded:: 0.2.0
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = _real(kl_coef, "kl_coef")

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        """Validate the arguments (as :meth:`AdaptiveKLController.update`); return :attr:`value`."""
        _update_arguments(current_kl, n_steps)
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"value"}``."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        state = _check_state(state_dict, ("value",), "FixedKLController")
        self.value = _real(state["value"], "state_dict['value']")

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value!r})"
