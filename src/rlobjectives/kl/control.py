r"""Coefficient controllers: adaptive and fixed KL coefficients, the adaptive entropy coefficient.

The adaptive KL controller of Ziegler et al. (2019), a fixed one, and the adaptive entropy
controller of Skywork-OR1 (TRL's ``use_adaptive_entropy``). Plain Python classes (no tensors,
no trainer state): they hold a few floats, update them once per optimizer step from the
measured KL or entropy, pickle, and checkpoint through ``state_dict()`` /
``load_state_dict()`` like a ``torch.optim`` object. The measurement is read once per step on
the host (``float(...)``), outside any hot path.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["AdaptiveEntropyController", "AdaptiveKLController", "FixedKLController"]

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


class AdaptiveEntropyController:
    r"""Adaptive entropy coefficient with its gate (Skywork-OR1; TRL ``use_adaptive_entropy``).

    After each optimizer step with measured mean token entropy :math:`H`,

    .. math::

        c \leftarrow \begin{cases} \min(c + \delta,\ c_{max}) & H \le H^* \\
        \max(c - \delta,\ c_{min}) & H > H^* \end{cases}, \qquad
        \text{value} = \begin{cases} c & H_{last} \le H^* \\ 0 & \text{otherwise,} \end{cases}

    so the bonus :math:`-\text{value} \cdot H` acts only while the entropy is at or below the
    target, with a coefficient that grows while it stays there and decays otherwise.
    :math:`H_{last}` starts at :math:`+\infty`: the applied coefficient is 0 until a measured
    entropy is at or below the target. Use :attr:`value` as ``entropy_coef`` of the next step's
    loss (every micro-batch of an accumulation window the same), then :meth:`update` with the
    window's global token-mean entropy.

    Equal to TRL 1.16's ``GRPOTrainer`` (``use_adaptive_entropy=True``: ``entropy_coef``,
    ``entropy_target``, ``entropy_coef_delta``, ``entropy_coef_min``, ``entropy_coef_max``;
    its ``entropy_ctrl_state.json`` is :meth:`state_dict`'s ``coef`` and ``last_entropy``).

    Args:
        init_coef: initial :math:`c` (TRL ``entropy_coef``).
        target: :math:`H^*` in nats (TRL ``entropy_target``, 0.2).
        delta: :math:`\delta \ge 0` (``entropy_coef_delta``, 0.005).
        min_coef: :math:`c_{min}` (``entropy_coef_min``, 0).
        max_coef: :math:`c_{max} \ge c_{min}` (``entropy_coef_max``, 1).

    Attributes:
        coef: :math:`c` (a float), the coefficient before the gate.
        last_entropy: :math:`H_{last}` (a float, ``inf`` before the first update).
        value: the applied coefficient (read-only).

    Raises:
        ValueError: a non-finite value, ``delta < 0`` or ``min_coef > max_coef``.
        TypeError: a non-numeric argument.

    References:
        He et al. 2025, "Skywork Open Reasoner 1 Technical Report", arXiv:2505.22312 Sec. 4
        (adaptive entropy control).

    Examples:
        >>> controller = AdaptiveEntropyController(0.01, target=0.5, delta=0.01)
        >>> controller.value  # gated: no entropy measured yet
        0.0
        >>> controller.update(0.4)  # at or below the target: c = 0.02, applied
        0.02
        >>> controller.update(0.9)  # above: c = 0.01, gated
        0.0

    .. versionadded:: 0.4.0
    """

    def __init__(
        self,
        init_coef: float,
        *,
        target: float = 0.2,
        delta: float = 0.005,
        min_coef: float = 0.0,
        max_coef: float = 1.0,
    ) -> None:
        self.coef = _real(init_coef, "init_coef", minimum=-math.inf)
        self.target = _real(target, "target", minimum=-math.inf)
        self.delta = _real(delta, "delta")
        self.min_coef, self.max_coef = _coefficient_range(min_coef, max_coef, "")
        self.last_entropy = math.inf

    @property
    def value(self) -> float:
        """The coefficient to apply: :attr:`coef` while the last entropy is <= the target."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float | torch.Tensor) -> float:
        """Move :attr:`coef` by the entropy of the last step; return the new :attr:`value`.

        Args:
            entropy: the step's mean token entropy (a number or 0-d tensor, read on the host).

        Returns:
            The applied coefficient for the next step.

        Raises:
            ValueError: a non-finite ``entropy``.
            TypeError: a non-numeric ``entropy``.
        """
        measured = _real(entropy, "entropy", minimum=-math.inf)
        if measured <= self.target:
            self.coef = min(self.coef + self.delta, self.max_coef)
        else:
            self.coef = max(self.coef - self.delta, self.min_coef)
        self.last_entropy = measured
        return self.value

    def state_dict(self) -> dict[str, float]:
        """Everything needed to resume: the coefficient, the last entropy and the options."""
        return {
            "coef": self.coef,
            "last_entropy": self.last_entropy,
            "target": self.target,
            "delta": self.delta,
            "min_coef": self.min_coef,
            "max_coef": self.max_coef,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (validated like the constructor's arguments)."""
        keys = ("coef", "last_entropy", "target", "delta", "min_coef", "max_coef")
        state = _check_state(state_dict, keys, "AdaptiveEntropyController")
        coef = _real(state["coef"], "state_dict['coef']", minimum=-math.inf)
        last = state["last_entropy"]
        if not (isinstance(last, float) and last == math.inf):
            last = _real(last, "state_dict['last_entropy']", minimum=-math.inf)
        target = _real(state["target"], "state_dict['target']", minimum=-math.inf)
        delta = _real(state["delta"], "state_dict['delta']")
        low, high = _coefficient_range(state["min_coef"], state["max_coef"], "state_dict")
        self.coef, self.last_entropy, self.target, self.delta = coef, last, target, delta
        self.min_coef, self.max_coef = low, high

    def __repr__(self) -> str:
        return (
            f"AdaptiveEntropyController(coef={self.coef!r}, last_entropy={self.last_entropy!r}, "
            f"target={self.target!r}, delta={self.delta!r}, min_coef={self.min_coef!r}, "
            f"max_coef={self.max_coef!r})"
        )


def _coefficient_range(low: object, high: object, owner: str) -> tuple[float, float]:
    """``(min_coef, max_coef)`` validated, ``min_coef <= max_coef``."""
    names = (f"{owner}['min_coef']", f"{owner}['max_coef']") if owner else ("min_coef", "max_coef")
    low_v = _real(low, names[0], minimum=-math.inf)
    high_v = _real(high, names[1], minimum=-math.inf)
    if low_v > high_v:
        raise ValueError(f"{names[0]} must be <= {names[1]} ({high_v}), got {low_v}")
    return low_v, high_v
