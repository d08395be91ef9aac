"""The advantages of issue 35: GPG (verl's own function runs here), the relative-position GAE
lambda (AReaL) and the group length penalty (prime-rl)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from rlobjectives import presets

D = torch.float64


# --- gpg_advantages ----------------------------------------------------------------------------


def test_gpg_golden() -> None:
    # rewards [1, 0 | 0, 0 | 2, 1]: 3 non-zero of B = 6 -> alpha = 2; group means .5, 0, 1.5
    # A = 2 (r - mean) / f_norm, f_norm = 0.5: [2, -2, 0, 0, 2, -2]
    out = rlo.gpg_advantages(torch.tensor([1.0, 0, 0, 0, 2, 1], dtype=D), 2, f_norm=0.5)
    assert torch.equal(out, torch.tensor([2.0, -2, 0, 0, 2, -2], dtype=D))
    # a group of one and a group of identical rewards: exactly 0 (alpha = 4 / 3 here)
    ids = ["a", "b", "b", "c"]
    out = rlo.gpg_advantages(torch.tensor([3.0, 0.1, 0.1, 0.0], dtype=D), group_ids=ids)
    assert torch.equal(out, torch.zeros(4, dtype=D))
    # nothing non-zero: alpha = B / 1, the centred rewards are 0 anyway
    assert torch.equal(rlo.gpg_advantages(torch.zeros(4), 2), torch.zeros(4))


@settings(max_examples=30, deadline=None)
@given(
    labels=st.lists(st.integers(0, 3), min_size=0, max_size=9),
    seed=st.integers(0, 2**16),
    f_norm=st.sampled_from([1.0, 0.3, 2.5]),
)
def test_gpg_matches_the_reference(labels: list[int], seed: int, f_norm: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(-1, 3, (len(labels),), generator=generator).to(D) * 0.5
    ours_leaf, ref_leaf = rewards.clone().requires_grad_(True), rewards.clone().requires_grad_(True)
    ours = rlo.gpg_advantages(ours_leaf, group_ids=labels, f_norm=f_norm)
    expected = reference.gpg_advantages(ref_leaf, list(labels), f_norm=f_norm)
    torch.testing.assert_close(ours, expected, rtol=1e-14, atol=1e-15)
    if labels:
        weights = torch.linspace(0.5, 1.5, len(labels), dtype=D)
        (ours * weights).sum().backward()
        (expected * weights).sum().backward()
        torch.testing.assert_close(ours_leaf.grad, ref_leaf.grad, rtol=1e-14, atol=1e-15)


verl_core = pytest.importorskip("verl.trainer.ppo.core_algos")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("f_norm", [1.0, 1.7])
def test_gpg_equals_verl(dtype: torch.dtype, f_norm: float) -> None:
    # verl 0.9.1 compute_gpg_outcome_advantage itself, on a batch with groups of 1 to 4 (a
    # singleton with a non-zero score: verl's mu = 0), zero scores and a ragged mask
    generator = torch.Generator().manual_seed(35020)
    batch, tokens = 11, 6
    scores = torch.randint(0, 3, (batch,), generator=generator).to(D) * 0.7
    scores[[2, 8]] = 0.0
    index = np.array(list("abacbbadcce"), dtype=object)  # d, e: alone
    scores[7] = 1.4
    rewards = torch.zeros(batch, tokens, dtype=D)
    lengths = torch.randint(1, tokens + 1, (batch,), generator=generator)
    mask = torch.arange(tokens) < lengths[:, None]
    rewards[torch.arange(batch), lengths - 1] = scores
    rewards, mask_f = rewards.to(dtype), mask.to(dtype)
    theirs, theirs_returns = verl_core.compute_gpg_outcome_advantage(
        rewards.clone(), mask_f, index, f_norm=f_norm
    )
    ours = presets.verl_gpg_advantages(rewards, mask, list(index), f_norm=f_norm)
    tol = {"rtol": 1e-15, "atol": 1e-15} if dtype == D else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(ours.advantages, theirs, **tol)
    torch.testing.assert_close(ours.returns, theirs_returns, **tol)
    # the library's estimator differs only at the group of one (0 there), and by verl's
    # float32 alpha
    plain = rlo.gpg_advantages(rewards.sum(-1), group_ids=list(index), f_norm=f_norm)
    alone = torch.tensor([list(index).count(label) == 1 for label in index])  # d and e
    assert float(plain[alone].abs().max()) == 0.0
    torch.testing.assert_close(
        torch.where(mask, plain[:, None], 0.0)[~alone], theirs[~alone], rtol=1e-6, atol=1e-6
    )
