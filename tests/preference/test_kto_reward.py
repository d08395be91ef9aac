"""``kto_loss`` and ``reward_model_loss`` (issue 34): golden values by hand, the float64 loop
references on random odd shapes (values and gradients), empty inputs, micro-batches."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_preference_loss import gradients

import reference
from rlobjectives import kto_loss, reward_model_loss
from tolerances import assert_close

D = torch.float64


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_golden() -> None:
    # x = S - R: desirable (-1 - 0.5) - (-2) = 0.5, undesirable -3 - (-2.5) = -0.5; kl = 0.2.
    # beta = 1: desirable 1 - sigma(0.5 - 0.2) = 1 - sigma(0.3); undesirable (weight 2)
    # 2 (1 - sigma(0.2 - (-0.5))) = 2 (1 - sigma(0.7)); mean over the 2 responses.
    lp = torch.tensor([[-1.0, -0.5], [-3.0, 9.0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    out = kto_loss(lp, mask, torch.tensor([True, False]), ref_log_probs=torch.tensor([-2.0, -2.5]),
                   kl=0.2, beta=1.0, undesirable_weight=2.0)  # fmt: skip
    expected = ((1 - _sigmoid(0.3)) + 2 * (1 - _sigmoid(0.7))) / 2
    assert_close(out.loss, expected)
    assert_close(out.rewards, [0.5, -0.5])
    # a negative KL estimate is clamped to 0 (TRL's clamp(min=0))
    clamped = kto_loss(lp, mask, torch.tensor([True, False]),
                       ref_log_probs=torch.tensor([-2.0, -2.5]), kl=-1.0, beta=1.0)  # fmt: skip
    assert_close(clamped.kl, 0.0)
    assert_close(clamped.loss, ((1 - _sigmoid(0.5)) + (1 - _sigmoid(0.5))) / 2)


def test_reward_model_golden() -> None:
    # r_c - r_r - m = 2 - 0.5 - 0.5 = 1: -log sigma(1) = log(1 + e^-1); centring
    # 0.1 (2 + 0.5)^2 = 0.625; second pair 0 - 1 - 0 = -1: log(1 + e); mean of the two.
    out = reward_model_loss(torch.tensor([2.0, 0.0], dtype=D), torch.tensor([0.5, 1.0], dtype=D),
                            margin=torch.tensor([0.5, 0.0]), center_coefficient=0.1)  # fmt: skip
    first = math.log1p(math.exp(-1)) + 0.625
    second = math.log1p(math.e) + 0.1 * 1.0
    assert_close(out.loss, (first + second) / 2)
    assert_close(out.accuracy, [1.0, 0.0])
    assert_close(out.margins, [1.5, -1.0])


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(0, 5),
    tokens=st.integers(0, 5),
    seed=st.integers(0, 999),
    kind=st.sampled_from(["kto", "apo_zero_unpaired"]),
    kl=st.sampled_from([None, 0.3, -0.2]),
    per_sequence_ref=st.booleans(),
)
def test_kto_equals_the_reference(batch: int, tokens: int, seed: int, kind: str, kl: Any,
                                  per_sequence_ref: bool) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(batch, tokens, generator=g, dtype=D)
    mask = torch.rand(batch, tokens, generator=g) < 0.7
    ref = lp + 0.3 * torch.randn(batch, tokens, generator=g, dtype=D)
    if per_sequence_ref:
        ref = torch.where(mask, ref, 0.0).sum(-1)
    desirable = torch.rand(batch, generator=g) < 0.5
    options = {"beta": 0.7, "kind": kind}
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    out = kto_loss(a, mask, desirable, ref_log_probs=ref, kl=kl, desirable_weight=1.3,
                   undesirable_weight=0.6, **options)  # fmt: skip
    expected = reference.kto_loss(b, mask, desirable.tolist(), ref, kl=kl, weights=(1.3, 0.6),
                                  beta=0.7, kind=kind)  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(gradients(out.loss, a), gradients(expected, b))


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(0, 6),
    seed=st.integers(0, 999),
    kind=st.sampled_from(["bradley_terry", "log_exp"]),
    margin=st.booleans(),
    center=st.sampled_from([0.0, 0.05]),
)
def test_reward_model_loss_equals_the_reference(batch: int, seed: int, kind: str, margin: bool,
                                                center: float) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    scores = 3 * torch.randn(2, batch, generator=g, dtype=D)
    margins = torch.rand(batch, generator=g, dtype=D) if margin else None
    a, b = scores.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    out = reward_model_loss(a[0], a[1], margin=margins, kind=kind,  # type: ignore[arg-type]
                            center_coefficient=center)  # fmt: skip
    expected = reference.reward_model_loss(b[0], b[1], margins, center, kind)
    assert_close(out.loss, expected)
    assert_close(gradients(out.loss, a), gradients(expected, b))


def test_kto_micro_batches_and_empty_responses() -> None:
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(5, 4, generator=g, dtype=D)
    mask = torch.arange(4)[None] < torch.tensor([3, 0, 4, 1, 2])[:, None]
    ref = lp * 0.8
    desirable = torch.tensor([True, False, False, True, True])
    full = kto_loss(lp, mask, desirable, ref_log_probs=ref, kl=0.1)
    assert full.example_losses[1] == 0 and full.rewards[1] == 0  # the empty response
    parts = [
        kto_loss(lp[rows], mask[rows], desirable[rows], ref_log_probs=ref[rows], kl=0.1,
                 normalizer=4).loss  # 4 non-empty responses in the whole batch
        for rows in (slice(0, 2), slice(2, 5))
    ]  # fmt: skip
    assert_close(sum(parts), full.loss)
    empty = kto_loss(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, dtype=torch.bool),
                     ref_log_probs=torch.zeros(0, 3))  # fmt: skip
    assert empty.loss.item() == 0.0


def test_kto_needs_its_reference() -> None:
    with pytest.raises(ValueError, match="^ref_log_probs is required"):
        kto_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([True]),
                 ref_log_probs=None)  # fmt: skip
