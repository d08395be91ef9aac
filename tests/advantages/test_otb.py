"""The Optimal Token Baseline (issue 33): verl 0.9.1's two estimators, run from the installed verl.

``optimal_token_baseline_advantages`` against verl's ``compute_optimal_token_baseline_advantage``
(``alignment="position"``) and ``compute_multi_turn_optimal_token_baseline_advantage``
(``"token"``) in float64, with and without rollout IS weights, on right-padded and multi-turn
masks (holes), groups of one to four responses, verl's signature defaults; the loop reference of
``tests/reference.py``; a golden case with its arithmetic; the verl preset through verl's own
``get_adv_estimator_fn``; and the collision probability taken from ``statistics=``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
import rlobjectives.presets as presets
from tolerances import assert_close

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
F64 = torch.float64
VERL = {"position": "optimal_token_baseline", "token": "tir_optimal_token_baseline"}


def _batch(draw: Any) -> dict[str, Any]:
    sizes = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3)))]
    batch, width = sum(sizes), draw(st.integers(1, 7))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(0, width + 1, (batch,), generator=generator)
    mask = torch.arange(width) < lengths.unsqueeze(1)
    if draw(st.booleans()):  # multi-turn: tool outputs masked out inside the response
        mask = mask & (torch.rand(batch, width, generator=generator) < 0.7)
    labels = np.array([f"uid{g}" for g, size in enumerate(sizes) for _ in range(size)])
    labels = labels[torch.randperm(batch, generator=generator).numpy()]
    return {
        "rewards": torch.randn(batch, width, generator=generator, dtype=F64) * mask,
        "mask": mask,
        "old": -3 * torch.rand(batch, width, generator=generator, dtype=F64),
        "squares": 0.02 + 0.9 * torch.rand(batch, width, generator=generator, dtype=F64),
        "weights": 0.3 + torch.rand(batch, width, generator=generator, dtype=F64),
        "index": labels,
    }


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_equals_verl(data: st.DataObject) -> None:
    b = _batch(data.draw)
    alignment = data.draw(st.sampled_from(("position", "token")))
    weighted = data.draw(st.booleans())
    zero_tail = data.draw(st.booleans())
    verl = core_algos.get_adv_estimator_fn(VERL[alignment])
    theirs, returns = verl(
        token_level_rewards=b["rewards"], response_mask=b["mask"].double(), index=b["index"],
        old_log_probs=b["old"], sum_pi_squared=b["squares"],
        rollout_is_weights=b["weights"] if weighted else None, handle_zero_tail=zero_tail,
    )  # fmt: skip
    ours = rlo.optimal_token_baseline_advantages(
        b["rewards"], b["mask"], b["old"], b["squares"].log(), group_ids=b["index"],
        importance_weights=b["weights"] if weighted else None, alignment=alignment,
        handle_zero_tail=zero_tail,
    )  # fmt: skip
    torch.testing.assert_close(ours.advantages, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.returns, torch.where(b["mask"], returns, 0.0))
    want = reference.optimal_token_baseline(
        b["rewards"], b["mask"].tolist(), b["old"], b["squares"], list(b["index"]),
        importance_weights=b["weights"] if weighted else None, alignment=alignment,
        handle_zero_tail=zero_tail,
    )  # fmt: skip
    torch.testing.assert_close(ours.advantages, want, rtol=1e-12, atol=1e-12)
    # the preset: verl's arguments and defaults, verl's unmasked returns
    preset = presets.verl_optimal_token_baseline_advantages(
        b["rewards"], b["mask"].double(), b["index"], b["old"], b["squares"],
        b["weights"] if weighted else None, zero_tail, adv_estimator=VERL[alignment],
    )  # fmt: skip
    torch.testing.assert_close(preset.advantages, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(preset.returns, returns, rtol=0, atol=0)


def test_verl_signature_defaults() -> None:
    # verl's defaults: handle_zero_tail=True, epsilon=1e-8, no IS weights; float32 as verl's
    # trainer passes them.
    generator = torch.Generator().manual_seed(8)
    mask = torch.rand(6, 5, generator=generator) < 0.8
    rewards = torch.randn(6, 5, generator=generator) * mask
    old = -torch.rand(6, 5, generator=generator)
    squares = 0.05 + 0.5 * torch.rand(6, 5, generator=generator)
    index = np.array(["a", "a", "a", "b", "b", "c"])
    for estimator in VERL.values():
        theirs, _ = core_algos.get_adv_estimator_fn(estimator)(
            token_level_rewards=rewards, response_mask=mask.float(), index=index,
            old_log_probs=old, sum_pi_squared=squares,
        )  # fmt: skip
        ours = presets.verl_optimal_token_baseline_advantages(
            rewards, mask, index, old, squares, adv_estimator=estimator
        )
        assert ours.advantages.dtype == torch.float32
        torch.testing.assert_close(ours.advantages, theirs, rtol=1e-5, atol=1e-6)


def test_golden() -> None:
    # One group of two responses, two tokens each. pi = e^0 = 1 at every token of row 1 (w = 1
    # - 2 + 1 = 0: no energy), row 0 has pi = 0.5, sum pi^2 = 0.5: w = 1 - 1 + 0.5 = 0.5, W =
    # [0.5, 1.0]. Rewards: row 0 gets 1 at its last token (G = [1, 1]), row 1 gets 3 (G = [3, 3]).
    # b_t = (G_0 W_0 + G_1 * 0) / (W_0 + 1e-8) = 1 - 2e-8 (t = 0: 1 * .5 / (.5 + 1e-8)),
    # A_0 = [2e-8, 1e-8], A_1 = [3 - b_0, 3 - b_1] ~ [2, 2].
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]], dtype=F64)
    old = torch.tensor([[math.log(0.5)] * 2, [0.0, 0.0]], dtype=F64)
    squares = torch.tensor([[math.log(0.5)] * 2, [0.0, 0.0]], dtype=F64)
    out = rlo.optimal_token_baseline_advantages(rewards, torch.ones(2, 2), old, squares, 2)
    b0, b1 = 0.5 / (0.5 + 1e-8), 1.0 / (1.0 + 1e-8)
    assert_close(out.advantages, [[1 - b0, 1 - b1], [3 - b0, 3 - b1]])
    assert_close(out.returns, [[1.0, 1.0], [3.0, 3.0]])


def test_zero_tail_and_groups_of_one() -> None:
    # Group {0, 1}: lengths 3 and 1 -> row 0's baseline is 0 from column 1 on (A = G = 2
    # there); row 2 alone: no baseline at all (A = G = 5 at its two tokens).
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.0, 0.0], [0.0, 5.0, 0.0]], dtype=F64)
    old = torch.full((3, 3), math.log(0.25), dtype=F64)
    squares = torch.full((3, 3), math.log(0.3), dtype=F64)
    out = rlo.optimal_token_baseline_advantages(rewards, mask, old, squares,
                                                group_ids=[7, 7, 8])  # fmt: skip
    assert_close(out.advantages[0, 1:], [2.0, 2.0])
    assert_close(out.advantages[2, :2], [5.0, 5.0])
    without = rlo.optimal_token_baseline_advantages(
        rewards, mask, old, squares, group_ids=[7, 7, 8], handle_zero_tail=False
    )
    # without the zero tail row 0 is its own baseline past column 0: A = G eps / (W + eps) ~ 0
    assert_close(without.advantages[0, 1:], [0.0, 0.0])
    assert without.advantages[0, 0] == out.advantages[0, 0]  # both rows hold column 0


def test_group_size_equals_group_ids_and_the_statistic_feeds_it() -> None:
    # The collision probability straight from token_log_probs(statistics=...) (the behaviour
    # policy's logits), contiguous groups of 2 given both ways.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 11, generator=generator, dtype=F64)
    tokens = torch.randint(0, 11, (4, 5), generator=generator)
    mask = torch.rand(4, 5, generator=generator) < 0.8
    stats = rlo.token_log_probs(logits, tokens, mask=mask, statistics=("log_sum_sq_probs",))
    assert stats.log_sum_sq_probs is not None
    rewards = torch.randn(4, 5, generator=generator, dtype=F64)
    by_size = rlo.optimal_token_baseline_advantages(rewards, mask, stats.log_probs,
                                                    stats.log_sum_sq_probs, 2)  # fmt: skip
    by_ids = rlo.optimal_token_baseline_advantages(
        rewards, mask, stats.log_probs, stats.log_sum_sq_probs, group_ids=[0, 0, 1, 1]
    )
    torch.testing.assert_close(by_size.advantages, by_ids.advantages, rtol=0, atol=0)
    probs = torch.softmax(logits, -1)
    theirs, _ = core_algos.compute_optimal_token_baseline_advantage(
        rewards * mask, mask.double(), np.array([0, 0, 1, 1]), stats.log_probs,
        (probs**2).sum(-1),
    )  # fmt: skip
    torch.testing.assert_close(by_size.advantages, theirs, rtol=1e-12, atol=1e-12)
