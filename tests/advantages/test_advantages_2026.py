"""Tests of the 2026 advantage estimators (issue 25, item 3).

GDPO, MaxRL, VAPO's per-sequence GAE lambda (``gae(lam=(B,))``, ``value_lam``,
``length_adaptive_lambda``) and DAPO's overlong penalty: golden values with the arithmetic in
comments (SPEC A1-A5), the float64 loop references of tests/reference.py (hypothesis, values and
gradients), the peers' numbers on their batches (tests/distillation/peer_batches.py) and the
exactness of the GAE scan at tiny and per-sequence discounts.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from peer_batches import PEER_NUMBERS, check, gae_batch, gdpo_batch, maxrl_batch
from tolerances import assert_close

D = torch.float64
SQRT_HALF = math.sqrt(0.5)


# --- GDPO ---------------------------------------------------------------------------------------


def test_gdpo_golden_values() -> None:
    # Groups of 2; rewards [[1, 0], [0, 1] | [1, 1], [0, 1]].
    # Component 0: [1, 0] -> +-1/sqrt2 (std sqrt(1/2)), [1, 0] -> +-1/sqrt2.
    # Component 1: [0, 1] -> -+1/sqrt2, [1, 1] -> 0 (identical).
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]], dtype=D)
    # w = [1, 1]: S = [0, 0, 1/sqrt2, -1/sqrt2], mean 0, unbiased std sqrt((1/2 + 1/2)/3):
    # A = S / sqrt(1/3) = [0, 0, sqrt(3/2), -sqrt(3/2)] = [0, 0, 1.224745, -1.224745]
    assert_close(rlo.gdpo_advantages(rewards, 2, eps=0.0), [0, 0, math.sqrt(1.5), -math.sqrt(1.5)])
    # w = [1, .5]: S = [.35355, -.35355, .70711, -.70711], std sqrt(1.25/3) = .645497
    weighted = [SQRT_HALF / 2, -SQRT_HALF / 2, SQRT_HALF, -SQRT_HALF]
    expected = [s / math.sqrt(1.25 / 3) for s in weighted]  # [.547723, -.547723, 1.095445, ...]
    assert_close(rlo.gdpo_advantages(rewards, 2, weights=[1.0, 0.5], eps=0.0), expected)
    assert_close(
        rlo.gdpo_advantages(rewards, 2, weights=[1.0, 0.5], whiten=False, eps=0.0), weighted
    )
    # verl's token-level whitening with lengths [1, 1, 2, 2]: mean_tok 0,
    # var_tok = (2 * .125 + 4 * .5) / 5 = .45 -> S / .670820 = [.527046, -.527046, 1.054093, ...]
    mask = torch.tensor([[1, 0], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    total = rlo.gdpo_advantages(rewards, 2, weights=[1.0, 0.5], eps=0.0, whiten=False)
    token_level = rlo.masked_whiten(total[:, None].expand(4, 2), mask, eps=0.0)
    assert_close(token_level[:, 0], [s / math.sqrt(0.45) for s in weighted])
    # one sequence, identical sums, a group of one: exact zeros
    assert rlo.gdpo_advantages(rewards[:1], 1).tolist() == [0.0]
    assert rlo.gdpo_advantages(torch.full((4, 2), 0.1, dtype=D), 2).tolist() == [0.0] * 4
    assert rlo.gdpo_advantages(rewards, 1).tolist() == [0.0] * 4


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    groups=st.integers(1, 4),
    size=st.integers(1, 4),
    components=st.integers(1, 3),
    eps=st.sampled_from((0.0, 1e-6, 1e-4)),
    whiten=st.booleans(),
    by_ids=st.booleans(),
)
def test_gdpo_equals_the_reference(
    seed: int, groups: int, size: int, components: int, eps: float, whiten: bool, by_ids: bool
) -> None:
    generator = torch.Generator().manual_seed(seed)
    count = groups * size
    rewards = torch.randint(0, 3, (count, components), generator=generator).to(D) * 0.5
    rewards = rewards + torch.rand(count, components, generator=generator, dtype=D) * (seed % 2)
    weights = (torch.rand(components, generator=generator, dtype=D) * 2 - 0.5).tolist()
    labels = (torch.randperm(count, generator=generator) % groups).tolist()
    grouping: dict[str, Any] = {"group_ids": labels} if by_ids else {"group_size": size}
    expected_labels = labels if by_ids else reference.group_labels(count, size, None)
    leaf = rewards.clone().requires_grad_(True)
    ours = rlo.gdpo_advantages(leaf, **grouping, weights=weights, eps=eps, whiten=whiten)
    ref_leaf = rewards.clone().requires_grad_(True)
    theirs = reference.gdpo_advantages(
        ref_leaf, expected_labels, weights=weights, eps=eps, whiten=whiten
    )
    assert_close(ours, theirs)
    if theirs.requires_grad and ours.requires_grad:
        projection = torch.arange(count, dtype=D) % 3 - 1.0
        (ours * projection).sum().backward()
        (theirs * projection).sum().backward()
        assert_close(leaf.grad, ref_leaf.grad)


def test_gdpo_equals_trl_verl_and_nemo_rl() -> None:
    b = gdpo_batch()
    rewards, size, weights, mask = b["rewards"], b["group_size"], b["weights"], b["mask"]
    # TRL normalize_then_sum: eps 1e-4 in both stages; TRL's nanstd has a float32 Bessel factor
    check(
        "trl_normalize_then_sum",
        rlo.gdpo_advantages(rewards, size, weights=weights, eps=1e-4),
        tol=1e-7,
    )
    # NeMo-RL (leave-one-out off): eps 1e-6 in the group stage, none in the batch stage
    check("nemo_gdpo", rlo.gdpo_advantages(rewards, size, weights=weights), tol=2e-6)
    # verl: masked_whiten over the tokens of the weighted sum (verl in float32)
    total = rlo.gdpo_advantages(rewards, size, weights=weights, whiten=False)
    check("verl_gdpo", rlo.masked_whiten(total[:, None].expand(mask.shape), mask), tol=1e-6)
    # group ids in any order
    permutation = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    labels = (torch.arange(24) // size)[permutation]
    shuffled = rlo.gdpo_advantages(rewards[permutation], group_ids=labels, weights=weights)
    torch.testing.assert_close(
        shuffled, rlo.gdpo_advantages(rewards, size, weights=weights)[permutation]
    )


# --- MaxRL --------------------------------------------------------------------------------------


def test_maxrl_golden_values() -> None:
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    # mu = 1/4: (1 - 1/4) / (1/4) = 3, (0 - 1/4) / (1/4) = -1; no success: 0;
    # mu = 3/4: (1 - 3/4) / (3/4) = 1/3, -1
    expected = [3, -1, -1, -1, 0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3, -1]
    assert_close(rlo.maxrl_advantages(torch.tensor(rewards, dtype=D), 4), expected)
    # SkyRL's eps = 1e-6: 0.75 / 0.250001 = 2.999988
    assert_close(
        rlo.maxrl_advantages(torch.tensor(rewards[:4], dtype=D), 4, eps=1e-6)[0],
        0.75 / (0.25 + 1e-6),
    )
    # a group of one: 0 (SkyRL gives the raw reward, prime-rl 0); a negative mean: 0
    assert rlo.maxrl_advantages([0.7], 1).tolist() == [0.0]
    assert rlo.maxrl_advantages([-1.0, 0.5], 2).tolist() == [0.0, 0.0]


def test_maxrl_equals_the_reference_prime_rl_and_skyrl() -> None:
    b = maxrl_batch()
    check("prime_maxrl", rlo.maxrl_advantages(b["rewards"], b["group_size"]))
    check("skyrl_maxrl", rlo.maxrl_advantages(b["rewards"], b["group_size"], eps=1e-6))
    ours = rlo.maxrl_advantages(b["continuous"], group_ids=b["group_ids"], eps=1e-6)
    skyrl = torch.tensor(list(reference_entries("skyrl_maxrl_group_ids")), dtype=D)
    singleton = 8  # group 3 has one member: SkyRL keeps its raw reward, ours is 0
    keep = torch.arange(13) != singleton
    torch.testing.assert_close(ours[keep], skyrl[keep], rtol=1e-12, atol=1e-12)
    assert ours[singleton] == 0
    leaf = b["continuous"].clone().requires_grad_(True)
    ref_leaf = b["continuous"].clone().requires_grad_(True)
    labels = b["group_ids"].tolist()
    ours = rlo.maxrl_advantages(leaf, group_ids=b["group_ids"], eps=0.1)
    theirs = reference.maxrl_advantages(ref_leaf, labels, eps=0.1)
    assert_close(ours, theirs)
    (ours * torch.arange(13, dtype=D)).sum().backward()
    (theirs * torch.arange(13, dtype=D)).sum().backward()
    assert_close(leaf.grad, ref_leaf.grad)


def reference_entries(name: str) -> list[float]:
    at = PEER_NUMBERS[name]["at"]
    return [at[str(k)] for k in range(len(at))]


# --- VAPO: length-adaptive lambda, per-sequence GAE lambda, value lambda ------------------------


def test_length_adaptive_lambda_golden_and_peers() -> None:
    # alpha = .05: 1 - 1/(.05 l): l = 10, 20 -> <= 0 -> 0; 100 -> .8; 1000 -> .98; l = 0 -> 0
    lengths = [0, 10, 20, 100, 1000]
    assert_close(
        rlo.length_adaptive_lambda(lengths, alpha=0.05), [0, 0, 0, 0.8, 0.98], torch.float32
    )
    mask = gae_batch()["mask"]
    check("nemo_lambda", rlo.length_adaptive_lambda(mask.sum(-1).double(), alpha=0.05))
    # integer lengths: float32 (as NeMo-RL and AReaL compute it)
    assert rlo.length_adaptive_lambda(mask.sum(-1), alpha=0.05).dtype == torch.float32
    doubles = torch.tensor([0.0, 0.5, 3.0, 41.5], dtype=D)
    assert_close(
        rlo.length_adaptive_lambda(doubles, alpha=0.3),
        reference.length_adaptive_lambda(doubles.tolist(), alpha=0.3),
    )


def test_gae_per_sequence_lambda_golden() -> None:
    # r = [0, 0, 1], V = .5, gamma = 1: delta = [0, 0, .5];
    # lambda .5: A = [.125, .25, .5]; lambda 0: A = delta = [0, 0, .5];
    # value_lam = 1: returns = sum of deltas ahead + V = [1, 1, 1]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=D)
    values = torch.full((2, 3), 0.5, dtype=D)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = rlo.gae(
        rewards, values, mask, gamma=1.0, lam=torch.tensor([0.5, 0.0], dtype=D), value_lam=1.0
    )
    assert_close(out.advantages, [[0.125, 0.25, 0.5], [0.0, 0.0, 0.5]])
    assert_close(out.returns, torch.ones(2, 3))


def test_gae_per_sequence_lambda_equals_nemo_rl_and_verl() -> None:
    b = gae_batch()
    rewards, values, mask = b["rewards"], b["values"], b["mask"]
    lam = rlo.length_adaptive_lambda(mask.sum(-1).double(), alpha=0.05)
    out = rlo.gae(rewards, values, mask, gamma=0.99, lam=lam, value_lam=1.0)
    check("nemo_gae_advantages", out.advantages[mask])
    check("nemo_gae_returns", out.returns[mask])
    check("verl_gae_returns", rlo.gae(rewards, values, mask, gamma=0.99, lam=0.95).returns[mask])


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 4),
    tokens=st.integers(1, 9),
    gamma=st.sampled_from((1.0, 0.97, 0.3)),
    lam_kind=st.sampled_from(("tensor", "tiny", "zero")),
    value_lam=st.sampled_from((None, 1.0, "tensor")),
    holes=st.sampled_from(("skip", "zero")),
)
def test_gae_per_sequence_lambda_equals_the_reference(
    seed: int, batch: int, tokens: int, gamma: float, lam_kind: str, value_lam: Any, holes: str
) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, tokens, generator=generator, dtype=D)
    values = torch.randn(batch, tokens, generator=generator, dtype=D)
    mask = torch.rand(batch, tokens, generator=generator) < 0.7
    if holes == "zero":  # the reference of holes="zero" is a per-position recursion
        mask = torch.arange(tokens)[None] < mask.sum(-1, keepdim=True)
    lam_values = {
        "tensor": torch.rand(batch, generator=generator, dtype=D).tolist(),
        "tiny": [1e-30] * batch,
        "zero": [0.0] * batch,
    }[lam_kind]
    critic = (
        None
        if value_lam is None
        else (
            value_lam
            if value_lam == 1.0
            else torch.rand(batch, generator=generator, dtype=D).tolist()
        )
    )
    leaves = [t.clone().requires_grad_(True) for t in (rewards, values)]
    out = rlo.gae(
        *leaves,
        mask,
        gamma=gamma,
        lam=torch.tensor(lam_values, dtype=D),
        value_lam=None
        if critic is None
        else torch.tensor(critic, dtype=D)
        if isinstance(critic, list)
        else critic,
        holes=holes,
    )
    ref_leaves = [t.clone().requires_grad_(True) for t in (rewards, values)]
    advantages, returns = reference.gae(
        *ref_leaves, mask, gamma=gamma, lam=lam_values, value_lam=critic
    )
    assert_close(out.advantages, advantages)
    assert_close(out.returns, returns)
    projection = torch.randn(batch, tokens, generator=generator, dtype=D)
    ((out.advantages + out.returns) * projection).sum().backward()
    if not mask.any():  # nothing selected: constant zeros
        assert all(leaf.grad is None or not leaf.grad.any() for leaf in leaves)
        return
    ((advantages + returns) * projection).sum().backward()
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert_close(leaf.grad, ref_leaf.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("discount", [1e-40, 1e-30, 1e-8, 3e-3, 0.5])
def test_gae_scan_is_exact_for_tiny_discounts(dtype: torch.dtype, discount: float) -> None:
    # gamma lam = 1e-40 underflows in float32 and its inverse overflows: the doubling scan
    # multiplies factors in [0, 1] only. A = delta + w delta' + ...: against the float64 loop.
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(3, 700, generator=generator, dtype=D).to(dtype)
    values = torch.randn(3, 700, generator=generator, dtype=D).to(dtype)
    mask = torch.rand(3, 700, generator=generator) < 0.8
    expected = reference.gae(rewards.double(), values.double(), mask, gamma=1.0, lam=discount)[0]
    for lam in (discount, torch.full((3,), discount, dtype=dtype)):
        out = rlo.gae(rewards, values, mask, gamma=1.0, lam=lam)
        assert torch.isfinite(out.advantages).all()
        assert_close(out.advantages, expected, dtype)


def test_gae_per_sequence_lambda_packed_equals_padded() -> None:
    b = gae_batch()
    rewards, values, mask = b["rewards"], b["values"], b["mask"]
    attention = mask.clone()
    attention[5, 10:14] = True  # the hole is part of sequence 5
    lam = rlo.length_adaptive_lambda(mask.sum(-1).double(), alpha=0.05)
    padded = rlo.gae(rewards, values, mask, gamma=0.99, lam=lam, value_lam=lam.flip(0))
    packed_rewards = rlo.pack(rewards, attention)
    packed = rlo.gae(
        packed_rewards.values,
        rlo.pack(values, attention).values,
        rlo.pack(mask, attention).values,
        gamma=0.99,
        lam=lam,
        value_lam=lam.flip(0),
        cu_seqlens=packed_rewards.cu_seqlens,
    )
    for field in ("advantages", "returns"):
        torch.testing.assert_close(
            getattr(packed, field),
            rlo.pack(getattr(padded, field), attention).values,
            rtol=1e-12,
            atol=1e-12,
        )


# --- DAPO's overlong penalty -------------------------------------------------------------------


def test_overlong_penalty_golden_and_peers() -> None:
    # L_max = 20, L_cache = 4: 0 up to 16, then (16 - l) / 4: 17 -> -.25, 18 -> -.5, 20 -> -1;
    # -1 beyond 20 (OpenRLHF caps; verl/AReaL would give (16 - 22)/4 = -1.5 there)
    lengths = [10, 16, 17, 18, 20, 22]
    assert_close(rlo.overlong_penalty(lengths, 20, 4), [0, 0, -0.25, -0.5, -1, -1], torch.float32)
    assert_close(
        rlo.overlong_penalty(lengths, 20, 4, factor=0.5),
        [0, 0, -0.125, -0.25, -0.5, -0.5],
        torch.float32,
    )
    assert_close(rlo.overlong_penalty(lengths, 20, 0), [0, 0, 0, 0, 0, -1], torch.float32)
    assert str(rlo.overlong_penalty([1], 20, 4).item()) == "0.0"  # +0, not -0
    check(
        "openrlhf_overlong", rlo.overlong_penalty(torch.arange(0, 61, dtype=D), 48, 12, factor=0.7)
    )
    check(
        "verl_overlong_le_max",
        rlo.overlong_penalty(torch.arange(0, 49, dtype=D), 48, 12, factor=0.7),
    )
    lengths_f = [0.0, 35.5, 36.0, 40.25, 48.0, 48.5, 90.0]
    assert_close(
        rlo.overlong_penalty(torch.tensor(lengths_f, dtype=D), 48, 12, factor=0.7),
        reference.overlong_penalty(lengths_f, 48, 12, factor=0.7),
    )
