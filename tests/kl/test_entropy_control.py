"""``AdaptiveEntropyController``: TRL 1.16's ``use_adaptive_entropy`` (Skywork-OR1), its gate and
its state; TRL's own lines (from ``GRPOTrainer._compute_loss``) run here on the same entropies."""

from __future__ import annotations

import copy
import inspect
import math
import pickle
import textwrap
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from rlobjectives import AdaptiveEntropyController


def test_golden() -> None:
    # target 0.5, delta 0.01, range [0, 0.025], start 0.01:
    # before any update: gated (last entropy inf) -> 0
    # H = 0.4 <= 0.5: c = 0.02, applied 0.02; H = 0.45: c = min(0.03, 0.025) = 0.025, applied
    # H = 0.9 > 0.5: c = 0.015, gated -> 0; H = 2: c = 0.005; H = 3: c = max(-0.005, 0) = 0
    controller = AdaptiveEntropyController(
        0.01, target=0.5, delta=0.01, min_coef=0.0, max_coef=0.025
    )
    assert controller.value == 0.0 and controller.last_entropy == math.inf
    assert controller.update(0.4) == 0.01 + 0.01
    assert controller.update(torch.tensor(0.45)) == 0.025
    assert controller.update(0.9) == 0.0 and controller.coef == 0.025 - 0.01
    controller.update(2.0)
    controller.update(3.0)
    assert controller.coef == 0.0 and controller.value == 0.0
    assert controller.update(0.5) == 0.01  # at the target: applied (inclusive)


@settings(max_examples=30, deadline=None)
@given(
    init=st.floats(0.0, 0.1),
    target=st.floats(0.0, 3.0),
    delta=st.floats(0.0, 0.05),
    bounds=st.tuples(st.floats(0.0, 0.05), st.floats(0.05, 1.0)),
    entropies=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=15),
)
def test_matches_the_reference(
    init: float, target: float, delta: float, bounds: tuple[float, float], entropies: list[float]
) -> None:
    controller = AdaptiveEntropyController(
        init, target=target, delta=delta, min_coef=bounds[0], max_coef=bounds[1]
    )
    got = [controller.update(h) for h in entropies]
    assert got == reference.adaptive_entropy_values(init, target, delta, *bounds, entropies)


def test_state_and_pickle() -> None:
    controller = AdaptiveEntropyController(0.05, target=1.0, delta=0.02)
    assert pickle.loads(pickle.dumps(controller)).state_dict() == controller.state_dict()
    controller.update(0.7)
    state = controller.state_dict()
    resumed = AdaptiveEntropyController(0.0)
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.state_dict() == state and resumed.value == controller.value
    assert [resumed.update(h) for h in (0.2, 3.0)] == [controller.update(h) for h in (0.2, 3.0)]
    fresh = AdaptiveEntropyController(0.05).state_dict()
    assert fresh["last_entropy"] == math.inf  # TRL's json stores Infinity too
    AdaptiveEntropyController(0.0).load_state_dict(fresh)


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^init_coef must be finite"):
        AdaptiveEntropyController(math.nan)
    with pytest.raises(TypeError, match=r"^target must be a real number"):
        AdaptiveEntropyController(0.1, target="0.2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^delta must be >= 0"):
        AdaptiveEntropyController(0.1, delta=-0.1)
    with pytest.raises(ValueError, match=r"^min_coef must be <= max_coef"):
        AdaptiveEntropyController(0.1, min_coef=0.5, max_coef=0.1)
    controller = AdaptiveEntropyController(0.1)
    with pytest.raises(ValueError, match=r"^entropy must be finite"):
        controller.update(math.inf)
    with pytest.raises(TypeError, match=r"^entropy must be a real number"):
        controller.update(torch.ones(2))
    with pytest.raises(ValueError, match=r"^state_dict must have the keys"):
        controller.load_state_dict({"coef": 0.1})
    with pytest.raises(TypeError, match=r"^state_dict must be a dict"):
        controller.load_state_dict([0.1])  # type: ignore[arg-type]


# --- TRL 1.16: the controller's own lines of GRPOTrainer._compute_loss, run on a stub ----------

trl = pytest.importorskip("trl")

_GATE = (
    "apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target "
    "else 0.0"
)
_START = "if world_entropy <= self.args.entropy_target:"
_END = "self._last_world_entropy = world_entropy"


def _trl_controller_lines() -> tuple[str, str]:
    """TRL's gate and update statements, cut from its installed ``_compute_loss`` source."""
    lines = inspect.getsource(trl.GRPOTrainer._compute_loss).splitlines()
    stripped = [line.strip() for line in lines]
    assert _GATE in stripped, "TRL's gate changed"
    first = stripped.index(_START)
    last = stripped.index(_END, first)
    update = textwrap.dedent("\n".join(lines[first : last + 1]))
    return _GATE, update


@pytest.mark.parametrize(
    ("options", "entropies"),
    [
        ((0.05, 10.0, 0.02, 0.0, 1.0), [11.0, 9.5, 9.9, 10.0, 12.0, 3.0, 3.0]),
        ((0.0, 0.2, 0.005, 0.0, 0.012), [0.1, 0.15, 0.19, 0.2, 0.3, 0.05, 5.0, 0.0]),
        ((0.3, 1.0, 0.1, 0.1, 0.35), [2.0, 2.0, 2.0, 0.5, 0.5, 0.5]),
    ],
)
def test_equals_trl(options: tuple[float, ...], entropies: list[float]) -> None:
    init, target, delta, low, high = options
    gate, update = _trl_controller_lines()
    args = SimpleNamespace(
        entropy_target=target, entropy_coef_delta=delta, entropy_coef_min=low,
        entropy_coef_max=high,
    )  # fmt: skip
    trainer = SimpleNamespace(entropy_coef=init, _last_world_entropy=float("inf"), args=args)
    ours = AdaptiveEntropyController(init, target=target, delta=delta, min_coef=low, max_coef=high)
    for entropy in [None, *entropies]:
        if entropy is not None:
            exec(update, {"self": trainer, "world_entropy": entropy, "min": min, "max": max})
            ours.update(entropy)
        scope: dict[str, object] = {"self": trainer}
        exec(gate, scope)
        assert ours.value == scope["apply_coef"]
        assert ours.coef == trainer.entropy_coef
        assert ours.last_entropy == trainer._last_world_entropy
