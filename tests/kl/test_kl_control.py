"""Tests of the KL-coefficient controllers (Ziegler et al. 2019; verl / OpenRLHF)."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import AdaptiveKLController, FixedKLController


def test_adaptive_golden() -> None:
    # init 0.1, target 6, horizon 10000, n = 256 per step:
    # KL 9: e = clip(9/6 - 1 = 0.5) = 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    # KL 6.6: e = 0.1; beta = 0.100512 * 1.00256 = 0.1007693107...
    # KL 0: e = clip(-1) = -0.2; beta *= 1 - 0.00512 -> 0.1002533...
    # KL 6: e = 0 -> unchanged
    controller = AdaptiveKLController(0.1, 6.0, 10000)
    assert controller.update(9.0, 256) == 0.1 * (1 + 0.2 * 256 / 10000)
    assert math.isclose(controller.value, 0.100512, rel_tol=1e-15)
    controller.update(6.6, 256)
    assert math.isclose(controller.value, 0.100512 * 1.00256, rel_tol=1e-14)
    controller.update(0.0, 256)
    assert math.isclose(controller.value, 0.100512 * 1.00256 * (1 - 0.00512), rel_tol=1e-14)
    before = controller.value
    controller.update(6.0, 256)
    assert controller.value == before
    controller.update(100.0, 0)  # no samples, no change
    assert controller.value == before


@given(
    init=st.floats(0.0, 1.0),
    target=st.floats(0.01, 20.0),
    horizon=st.integers(1, 100_000),
    updates=st.lists(
        st.tuples(st.floats(-1.0, 50.0), st.integers(0, 1000)), min_size=1, max_size=20
    ),
)
def test_adaptive_matches_the_peer_formula_bit_for_bit(
    init: float, target: float, horizon: int, updates: list[tuple[float, int]]
) -> None:
    controller = AdaptiveKLController(init, target, horizon)
    got = [controller.update(kl, n) for kl, n in updates]
    assert got == reference.adaptive_kl_values(init, target, horizon, updates)


def test_accepts_tensors_and_keywords() -> None:
    controller = AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=100)
    value = controller.update(torch.tensor(2.0), n_steps=10)  # e = 0.2 -> 0.2 * 1.02
    assert value == 0.2 * (1 + 0.2 * 10 / 100)
    assert isinstance(controller.value, float)


def test_fixed() -> None:
    controller = FixedKLController(0.05)
    assert controller.update(100.0, 64) == 0.05 and controller.value == 0.05
    assert controller.state_dict() == {"value": 0.05}
    other = FixedKLController(0.0)
    other.load_state_dict(controller.state_dict())
    assert other.value == 0.05


def test_pickle_and_state_dict_round_trip() -> None:
    controller = AdaptiveKLController(0.1, 6.0, 10000)
    controller.update(9.0, 256)
    for clone in (pickle.loads(pickle.dumps(controller)), copy.deepcopy(controller)):
        assert clone.state_dict() == controller.state_dict()
    resumed = AdaptiveKLController(1.0, 1.0, 1)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.state_dict() == {"value": 0.100512, "target": 6.0, "horizon": 10000.0}
    # Resuming from a checkpoint continues exactly where the original goes.
    assert resumed.update(7.0, 128) == controller.update(7.0, 128)
    restored = pickle.loads(pickle.dumps(FixedKLController(0.3)))
    assert restored.value == 0.3
    assert "value=0.3" in repr(restored) and "target=6.0" in repr(controller)


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"horizon must be > 0.0, got -5.0"):
        AdaptiveKLController(0.1, 6.0, -5)
    with pytest.raises(ValueError, match=r"horizon must be > 0.0, got 0.0"):
        AdaptiveKLController(0.1, 6.0, 0)
    with pytest.raises(ValueError, match=r"target must be > 0.0, got 0.0"):
        AdaptiveKLController(0.1, 0.0, 10000)
    with pytest.raises(ValueError, match=r"target must be > 0.0, got -1.0"):
        AdaptiveKLController(0.1, -1.0, 10000)
    with pytest.raises(ValueError, match=r"init_kl_coef must be >= 0.0, got -0.1"):
        AdaptiveKLController(-0.1, 6.0, 10000)
    with pytest.raises(ValueError, match=r"init_kl_coef must be finite, got nan"):
        AdaptiveKLController(math.nan, 6.0, 10000)
    with pytest.raises(TypeError, match=r"target must be a real number, got str"):
        AdaptiveKLController(0.1, "6", 10000)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"horizon must be a real number, got bool"):
        AdaptiveKLController(0.1, 6.0, True)
    with pytest.raises(ValueError, match=r"kl_coef must be >= 0.0, got -1.0"):
        FixedKLController(-1.0)
    with pytest.raises(TypeError, match=r"kl_coef must be a real number or a 0-d real tensor"):
        FixedKLController(torch.ones(2))  # type: ignore[arg-type]


def test_update_and_state_errors() -> None:
    for controller in (AdaptiveKLController(0.1, 6.0, 10000), FixedKLController(0.1)):
        with pytest.raises(ValueError, match=r"current_kl must be finite, got nan"):
            controller.update(math.nan, 10)
        with pytest.raises(ValueError, match=r"n_steps must be >= 0, got -1"):
            controller.update(1.0, -1)
        with pytest.raises(TypeError, match=r"n_steps must be an int, got float"):
            controller.update(1.0, 2.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"current_kl must be a real number"):
            controller.update("1", 2)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"state_dict must be a dict"):
            controller.load_state_dict([0.1])  # type: ignore[arg-type]
    controller = AdaptiveKLController(0.1, 6.0, 10000)
    with pytest.raises(ValueError, match=r"state_dict must have the keys \['horizon', 'target'"):
        controller.load_state_dict({"value": 0.1})
    with pytest.raises(ValueError, match=r"state_dict\['horizon'\] must be > 0.0, got -1.0"):
        controller.load_state_dict({"value": 0.1, "target": 1.0, "horizon": -1.0})
    assert controller.state_dict() == {"value": 0.1, "target": 6.0, "horizon": 10000.0}
