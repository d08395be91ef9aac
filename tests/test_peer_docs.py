"""The numbers behind the docs' statements about the peers (docs/objectives/: whitening, GSPO)."""

from __future__ import annotations

import math

import torch

import reference as ref
import rlobjectives
from rlobjectives import Clip
from tolerances import assert_close

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def _verl_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten: batch mean, Bessel-corrected variance, rsqrt(var + 1e-8)."""
    selected = values[mask]
    count = selected.numel()
    mean = selected.sum() / count
    variance = ((selected - mean) ** 2).sum() / count * count / (count - 1)
    return torch.where(mask, (values - mean) * torch.rsqrt(variance + 1e-8), 0.0)


def test_verl_gae_whitens_with_bessel() -> None:
    # verl's example (γ = λ = 1): the raw advantages are ours; verl returns them whitened.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.4, 7.0]], dtype=torch.float64)
    out = rlobjectives.gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    # row 2: δ1 = 2 - 0.4 = 1.6, δ0 = 0.4 - 0.2 = 0.2 -> 1.8; row 1: 1 - 0.5 = 0.5 everywhere
    assert_close(out.advantages, [[0.5, 0.5, 0.5], [1.8, 1.6, 0.0]])
    # mean 4.9/5 = 0.98, var (3·0.2304 + 0.6724 + 0.3844)/4 = 0.437 -> σ = 0.6610598
    assert_close(
        _verl_whiten(out.advantages, MASK),
        [[-0.7261144] * 3, [1.2404292, 0.9378855, 0.0]],
        torch.float32,
    )


def test_verl_reinforce_plus_plus_is_bessel_scaled() -> None:
    # returns [[1, 1, 1], [2, 2]]: mean 1.4; population σ = sqrt(0.24) here, Bessel sqrt(0.3)
    # in verl, so verl = ours · sqrt((N - 1)/N) with N = 5 selected tokens
    ours = rlobjectives.reinforce_plus_plus_advantages(
        torch.tensor([1.0, 2.0], dtype=torch.float64), MASK
    )
    assert_close(ours, [[-0.8164966] * 3, [1.2247449] * 2 + [0.0]], torch.float32)
    verl = [[-0.7302967] * 3, [1.0954451] * 2 + [0.0]]
    assert_close(ours * math.sqrt(4 / 5), verl, torch.float32)
    returns = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], dtype=torch.float64)
    assert_close(_verl_whiten(returns, MASK), verl, torch.float32)


def test_gspo_token_advantages_get_the_sequence_mean_in_trl_and_openrlhf() -> None:
    generator = torch.Generator().manual_seed(1)
    log_probs = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    old = log_probs + 0.1 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    wide = {"surrogate": Clip(low=0.99, high=100.0)}  # nothing clips
    for advantages in (
        torch.randn(3, 1, generator=generator, dtype=torch.float64).expand(3, 5),
        torch.randn(3, 5, generator=generator, dtype=torch.float64),
    ):
        ours_in = log_probs.clone().requires_grad_(True)
        theirs_in = log_probs.clone().requires_grad_(True)
        ours = rlobjectives.policy_loss(
            ours_in, old, advantages, mask, ratio_level="sequence", log_ratio_bound=None,
            reduction="sequence_mean", **wide,
        ).loss  # fmt: skip
        theirs = ref.openrlhf_policy_loss(
            theirs_in, old, advantages, mask, policy_loss_type="gspo", clip_eps_low=0.99,
            clip_eps_high=100.0,
        )  # fmt: skip
        assert_close(ours, theirs.detach())  # the values agree
        ours.backward()
        theirs.backward()
        assert ours_in.grad is not None and theirs_in.grad is not None
        # OpenRLHF/TRL: every token gets the sequence's mean of our per-token gradients
        counts = mask.sum(-1, keepdim=True)
        row_mean = torch.where(mask, ours_in.grad, 0.0).sum(-1, keepdim=True) / counts
        assert_close(theirs_in.grad, torch.where(mask, row_mean, 0.0))
    # with per-token advantages the two gradients differ (the first loop used constant rows)
    assert not torch.allclose(ours_in.grad, theirs_in.grad)
