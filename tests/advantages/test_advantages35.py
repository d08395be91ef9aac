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
from peer_transcriptions import (
    LinearLengthPenalty,
    areal_relative_position_gae_lambda,
    prime_rl_score_group,
)
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


# --- relative_position_lambda ------------------------------------------------------------------


def test_relative_position_lambda_golden_and_gae() -> None:
    # q = 0.25: L = 2 -> 0.25, L = 3 -> 0.5, L = 5 -> 0.25 ** (1/4) = 0.7071; L = 1 -> 1, 0 -> 0
    lam = rlo.relative_position_lambda(torch.tensor([0, 1, 2, 3, 5]), q=0.25)
    expected = torch.tensor([0.0, 1.0, 0.25, 0.5, 0.25**0.25])
    torch.testing.assert_close(lam, expected, rtol=1e-7, atol=0)
    assert lam.dtype == torch.float32
    # with gamma = 1, V = 0 and a terminal reward 1, GAE gives lambda^(L - k) at step k: the first
    # step keeps q = 0.25 whatever the length (rows of length 3 and 5)
    rewards = torch.zeros(2, 5, dtype=D)
    rewards[0, 2], rewards[1, 4] = 1.0, 1.0
    mask = torch.arange(5) < torch.tensor([[3], [5]])
    lam = rlo.relative_position_lambda(mask.sum(-1).to(D), q=0.25)
    out = rlo.gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=lam)
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([0.25, 0.25], dtype=D))
    # row of length 5: lambda = 0.25 ** (1/4); step k keeps 0.25 ** ((5 - k) / 4)
    expected = torch.tensor([0.25, 0.25**0.75, 0.5, 0.25**0.25, 1.0], dtype=D)
    torch.testing.assert_close(out.advantages[1], expected, rtol=1e-14, atol=0)


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=8),
    q=st.sampled_from([1.0, 0.5, 0.1, 1e-3]),
)
def test_relative_position_lambda_matches_the_reference_and_areal(
    lengths: list[int], q: float
) -> None:
    ours = rlo.relative_position_lambda(torch.tensor(lengths, dtype=D), q=q)
    expected = torch.tensor(reference.relative_position_lambda(lengths, q=q), dtype=D)
    torch.testing.assert_close(ours, expected, rtol=1e-15, atol=0)
    # AReaL's function (float32 for integer lengths): bit for bit
    areal = areal_relative_position_gae_lambda(torch.tensor(lengths, dtype=torch.long), q=q)
    assert torch.equal(rlo.relative_position_lambda(torch.tensor(lengths), q=q), areal)


# --- group_length_penalty ----------------------------------------------------------------------


def test_group_length_penalty_golden() -> None:
    # one group of 3, rewards [1, 1, 0] (pass rate 2/3), output tokens [10, 20, 40] (max 40),
    # weight 0.25: penalty = 2/3 * 0.25 * [0.25, 0.5, 1] = [1/24, 1/12, 1/6];
    # shaped = [23/24, 11/12, -1/6], mean = 41/72; A = shaped - 41/72 = [28/72, 25/72, -53/72]
    out = rlo.group_length_penalty(
        torch.tensor([1.0, 1, 0], dtype=D), torch.tensor([10.0, 20, 40], dtype=D),
        weights=[0.25], group_size=3,
    )  # fmt: skip
    expected = torch.tensor([28 / 72, 25 / 72, -53 / 72], dtype=D)
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=1e-16)
    # a failing group pays nothing: plain centring; a group of one: 0
    failing = rlo.group_length_penalty([0.0, 0.0, 1.0], [[5.0], [9.0], [1.0]], weights=[1.0],
                                       group_ids=["a", "a", "b"])  # fmt: skip
    assert torch.equal(failing, torch.zeros(3))


@settings(max_examples=25, deadline=None)
@given(
    labels=st.lists(st.integers(0, 3), min_size=0, max_size=9),
    seed=st.integers(0, 2**16),
    columns=st.integers(0, 3),
)
def test_group_length_penalty_matches_the_reference(
    labels: list[int], seed: int, columns: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(labels),), generator=generator).to(D)
    quantities = torch.randint(0, 50, (len(labels), columns), generator=generator).to(D)
    weights = [0.25, 0.1, 0.3][:columns]
    leaves = [rewards.clone().requires_grad_(True), quantities.clone().requires_grad_(True)]
    refs = [rewards.clone().requires_grad_(True), quantities.clone().requires_grad_(True)]
    ours = rlo.group_length_penalty(leaves[0], leaves[1], weights=weights, group_ids=labels)
    expected = reference.group_length_penalty(refs[0], refs[1], weights, list(labels))
    torch.testing.assert_close(ours, expected, rtol=1e-13, atol=1e-15)
    if labels:
        cotangent = torch.linspace(0.5, 1.5, len(labels), dtype=D)
        grads = torch.autograd.grad((ours * cotangent).sum(), leaves, allow_unused=True)
        ref_grads = torch.autograd.grad((expected * cotangent).sum(), refs, allow_unused=True)
        for got, want, leaf in zip(grads, ref_grads, leaves, strict=True):
            got = torch.zeros_like(leaf) if got is None else got
            want = torch.zeros_like(leaf) if want is None else want
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_length_penalty_equals_prime_rl(dtype: torch.dtype) -> None:
    # prime-rl's score_group on each group (its defaults 0.25 / 0.1 / 0.1), the library on the
    # whole batch of 4 groups of 4 with the columns output, input = total - output, turns
    generator = torch.Generator().manual_seed(35030)
    groups, size = 4, 4
    rewards = torch.randint(0, 2, (groups * size,), generator=generator).to(D)
    rewards[:size] = 1.0  # a group that always succeeds
    output = torch.randint(1, 300, (groups * size,), generator=generator)
    total = output + torch.randint(0, 900, (groups * size,), generator=generator)
    turns = torch.randint(1, 6, (groups * size,), generator=generator)
    config = LinearLengthPenalty()
    theirs = torch.cat([
        prime_rl_score_group(
            rewards[g * size:(g + 1) * size].tolist(), output[g * size:(g + 1) * size].tolist(),
            total[g * size:(g + 1) * size].tolist(), turns[g * size:(g + 1) * size].tolist(),
            config, dtype,
        )
        for g in range(groups)
    ])  # fmt: skip
    quantities = torch.stack([output, total - output, turns], dim=-1).to(dtype)
    ours = rlo.group_length_penalty(
        rewards.to(dtype), quantities, weights=torch.tensor([0.25, 0.1, 0.1], dtype=dtype),
        group_size=size,
    )  # fmt: skip
    tol = {"rtol": 1e-14, "atol": 1e-15} if dtype == D else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(ours, theirs, **tol)


@pytest.mark.compile
def test_under_torch_compile() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 1.0])
    sizes = torch.tensor([[10.0, 3.0], [20.0, 1.0], [5.0, 2.0], [8.0, 2.0], [1.0, 1.0], [9.0, 4.0]])
    ids = torch.tensor([3, 3, 0, 0, 7, 7])

    def step(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gpg = rlo.gpg_advantages(r, group_ids=ids, f_norm=0.5)
        shaped = rlo.group_length_penalty(r, x, weights=torch.tensor([0.25, 0.1]), group_size=2)
        lam = rlo.relative_position_lambda(x[:, 0], q=0.3)
        return gpg + shaped + lam

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(rewards, sizes), step(rewards, sizes))
