"""Issue 35's surrogates: ProbabilityBand, TOPR, REAL and FIPO, each one object of its own module.

Golden values by hand (the arithmetic in the comments), float64 parity with the peers' released
code (verbatim transcriptions in ``tests/peer_transcriptions.py``: prime-rl ``ipo_loss_fn``,
ROLL ``_compute_topr_loss``, ms-swift's REAL and FIPO branches), values and gradients; the
float64 loop references of ``tests/reference.py`` on every reduction with importance weights and
the entropy bonus; NaN/inf at unselected positions; packed == padded; micro-batches with the
global normaliser; the hidden-state path; ``RLOBJECTIVES_COMPILE=1``. ProbabilityBand is also a
row of the option tables (``family_cases.py``, the micro-batch and packed tables).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import peer_transcriptions as peers
import rlobjectives as rlo
from rlobjectives import ProbabilityBand
from tolerances import assert_close

F64 = torch.float64
LN = math.log


def t(values: Any, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def loss_and_grad(
    log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    **kwargs: Any,
) -> tuple[Any, torch.Tensor]:  # fmt: skip
    """policy_loss's output and its d loss / d log_probs."""
    leaf = log_probs.detach().clone().requires_grad_(True)
    out = rlo.policy_loss(leaf, old, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(out.loss.sum(), [leaf])
    return out, grad


def random_batch(batch: int, tokens: int, seed: int, spread: float = 0.5) -> dict[str, Any]:
    """Float64 log-probabilities with ratios across the bands, ~25% unselected (NaN there)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=g, dtype=F64) * 2 - 0.05
    log_probs = (old + spread * torch.randn(batch, tokens, generator=g, dtype=F64)).clamp(max=0)
    mask = torch.rand(batch, tokens, generator=g) < 0.75
    mask[:, 0] = True  # every sequence has a selected token (the peers count empty ones apart)
    return {
        "log_probs": log_probs,
        "old_log_probs": old,
        "advantages": torch.randn(batch, generator=g, dtype=F64),
        "mask": mask,
        "rewards": torch.randint(0, 2, (batch,), generator=g).to(F64) * 2 - 1,
    }


def poisoned(case: dict[str, Any]) -> dict[str, Any]:
    """The batch with NaN / inf at every unselected position."""
    mask = case["mask"]
    return {
        **case,
        "log_probs": torch.where(mask, case["log_probs"], torch.nan),
        "old_log_probs": torch.where(mask, case["old_log_probs"], torch.inf),
    }


# --------------------------------------------------------------------------------------------
# ProbabilityBand (prime-rl ipo_loss_fn)
# --------------------------------------------------------------------------------------------


def test_probability_band_golden() -> None:
    # p_old = .5, p = [.6, .8, .25, .45], A = [1, -1, 1, -1], tau = .2, kappa = .5:
    # p - p_old = [.1, .3, -.25, -.05]: kept [yes, no, no, yes]; r = 2p = [1.2, 1.6, .5, .9].
    # s = 1[kept] r A - kappa (ln r)^2 = [1.2 - .5 ln(1.2)^2, -.5 ln(1.6)^2, -.5 ln(.5)^2,
    # -.9 - .5 ln(.9)^2] = [1.1833795, -.1104515, -.2402265, -.9055504];
    # loss = -sum / 4 = .0182122; grad = -(1[kept] r A - 2 kappa ln r) / 4
    # = [-(1.2 - ln 1.2), ln 1.6, ln .5, .9 + ln .9] / 4.
    # Diagnostics: t1 above the band with A < 0 (dual), t2 below with A > 0 (no side count).
    log_probs = t([[0.6, 0.8, 0.25, 0.45]]).log()
    old = t([[0.5] * 4]).log()
    mask = torch.ones(1, 4, dtype=torch.bool)
    out, grad = loss_and_grad(
        log_probs, old, t([[1.0, -1.0, 1.0, -1.0]]), mask,
        surrogate=ProbabilityBand(tau=0.2, kappa=0.5), log_ratio_bound=None,
    )  # fmt: skip
    values = [
        1.2 - 0.5 * LN(1.2) ** 2,
        -0.5 * LN(1.6) ** 2,
        -0.5 * LN(0.5) ** 2,
        -0.9 - 0.5 * LN(0.9) ** 2,
    ]
    assert_close(out.loss, -sum(values) / 4)
    assert_close(grad, [[-(1.2 - LN(1.2)) / 4, LN(1.6) / 4, LN(0.5) / 4, (0.9 + LN(0.9)) / 4]])
    d = out.diagnostics
    assert_close(d.clipped_fraction, 0.5)  # prime-rl's is_masked
    assert_close(d.clip_fraction_low, 0.0)
    assert_close(d.clip_fraction_high, 0.0)
    assert_close(d.dual_clip_fraction, 0.25)
    assert_close(d.weight_mean, (1.2 + 0.9) / 4)
    # the band's edge is inside: |p - p_old| = .25 <= tau = .25 keeps t2
    out = rlo.policy_loss(log_probs, old, t([1.0]), mask, surrogate=ProbabilityBand(tau=0.25))
    assert_close(out.diagnostics.clipped_fraction, 0.25)


@pytest.mark.parametrize(
    "config",
    [
        peers.IPOLossConfig(),
        peers.IPOLossConfig(ipo_threshold=0.05, kl_tau=0.3),
        peers.IPOLossConfig(ipo_threshold=0.3, adv_tau=0.5, kl_tau=0.0),
    ],
    ids=["defaults", "narrow", "adv_tau"],
)
def test_probability_band_equals_prime_rl_ipo(config: Any) -> None:
    # prime-rl: per sample, the sum of the per-token losses, then / rl_scale (the global loss
    # tokens); here token_mean with normalizer=rl_scale, the advantages times adv_tau, no bound.
    case = random_batch(5, 9, seed=3)
    mask, scale = case["mask"], int(case["mask"].sum()) + 3  # rl_scale: a global count
    leaf = case["log_probs"].clone().requires_grad_(True)
    results = [
        peers.ipo_loss_fn(
            peers.LossInputs(leaf[i], case["old_log_probs"][i], None,
                             case["advantages"][i].expand(9), mask[i]),
            config,
        )
        for i in range(5)
    ]  # fmt: skip
    expected = sum(result.loss for result in results) / scale
    (want,) = torch.autograd.grad(expected, [leaf])
    out, grad = loss_and_grad(
        poisoned(case)["log_probs"], case["old_log_probs"], config.adv_tau * case["advantages"],
        mask, surrogate=ProbabilityBand(tau=config.ipo_threshold, kappa=config.kl_tau),
        log_ratio_bound=None, normalizer=scale,
    )  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(grad, torch.where(mask, want, 0.0))
    masked = sum(r.metrics["is_masked"] * m.sum() for r, m in zip(results, mask, strict=True))
    assert_close(out.diagnostics.clipped_fraction, masked / mask.sum())  # prime-rl is_masked
    assert 0 < float(out.diagnostics.clipped_fraction) < 1  # the band binds on some tokens


def test_probability_band_tensor_fields_and_a_learnable_kappa() -> None:
    case = random_batch(3, 6, seed=5)
    args = (case["log_probs"], case["old_log_probs"], case["advantages"], case["mask"])
    number = rlo.policy_loss(*args, surrogate=ProbabilityBand(tau=0.1, kappa=0.2))
    kappa = torch.tensor(0.2, dtype=F64, requires_grad=True)
    tensor = rlo.policy_loss(*args, surrogate=ProbabilityBand(tau=torch.tensor(0.1), kappa=kappa))
    assert_close(tensor.loss, number.loss)
    (grad,) = torch.autograd.grad(tensor.loss, [kappa])  # d loss / d kappa = mean x^2
    mask = case["mask"]
    x = (case["log_probs"] - case["old_log_probs"])[mask]
    assert_close(grad, (x * x).mean())
    with pytest.raises(ValueError, match=r"^ProbabilityBand.tau must be <= 1"):
        ProbabilityBand(tau=torch.tensor(1.5))
