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

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import peer_transcriptions as peers
import reference
import rlobjectives as rlo
from rlobjectives import FIPO, REAL, TOPR, ProbabilityBand
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


def test_probability_band_decides_on_the_float64_probabilities() -> None:
    # float32 inputs whose p - p_old is 0.20000000305 in float64, above tau = fl32(0.2) =
    # 0.20000000298 (outside), while float32's exp(l) - exp(l_old) gives 0.19999999 (inside):
    # the band follows the float64 value, so the token has value and gradient 0 (kappa = 0).
    log_probs = torch.tensor([[-0.019026590511202812]], dtype=torch.float32)
    old = torch.tensor([[-0.24698390066623688]], dtype=torch.float32)
    tau = float(torch.tensor(0.2))  # 0.2 rounded to float32
    assert float(torch.exp(log_probs) - torch.exp(old)) <= tau  # the float32 evaluation
    assert math.exp(float(log_probs)) - math.exp(float(old)) > tau
    leaf = log_probs.requires_grad_(True)
    out = rlo.policy_loss(leaf, old, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                          surrogate=ProbabilityBand(tau=0.2, kappa=0.0))  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    assert out.diagnostics.clipped_fraction == 1.0 and out.diagnostics.clip_fraction_high == 1.0
    assert out.loss == 0.0 and grad == 0.0


@pytest.mark.compile
def test_probability_band_compiled_takes_the_eager_decisions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Compiled, the decision is the sign bit of tau - |p - p_old| by an integer shift of its
    # float64 bits; eager, torch.signbit. Both at the edge (tau = 0 and l = l_old: tau - |0| =
    # +0, inside; a token that moved at all is outside), at the float64 case above (outside,
    # where float32 says inside) and with NaN at an unselected token, with advantages per
    # sequence and per token (the compiled decision reads them). tau a 0-d tensor: one graph.
    import rlobjectives._core.compiled as compiled_module

    monkeypatch.setattr(compiled_module, "_COMPILED", {})
    log_probs = t([[-0.5, -0.5, -0.019026590511202812, math.nan]], torch.float32)
    old = t([[-0.5, -0.5000001, -0.24698390066623688, -0.5]], torch.float32)
    mask = torch.tensor([[True, True, True, False]])
    cases = [(0.0, [0, 1, 1]), (float(torch.tensor(0.2)), [0, 0, 1])]  # tau, outside per token
    layouts = [t([1.0], torch.float32), t([[1.0, 1.0, 1.0, math.nan]], torch.float32)]
    for (tau, outside), advantages in itertools.product(cases, layouts):
        results = []
        for setting in ("0", "1"):
            monkeypatch.setenv("RLOBJECTIVES_COMPILE", setting)
            leaf = log_probs.clone().requires_grad_(True)
            band = ProbabilityBand(tau=torch.tensor(tau), kappa=0.0)
            out = rlo.policy_loss(leaf, old, advantages, mask, surrogate=band)
            (grad,) = torch.autograd.grad(out.loss, [leaf])
            results.append((out, grad))
        for out, grad in results:  # kept tokens: gradient -r A / 3 = -r / 3; outside: 0
            ratio = torch.exp(log_probs - old)[0, :3]
            want = torch.where(torch.tensor(outside) > 0, 0.0, -ratio / 3)
            assert_close(grad[0, :3], want)
            assert grad[0, 3] == 0.0
            assert_close(out.diagnostics.clipped_fraction, sum(outside) / 3)
        (eager, _), (compiled, _) = results
        for value, expected in zip(compiled.diagnostics, eager.diagnostics, strict=True):
            assert_close(value, expected)
        assert compiled_module._COMPILED.get("failed") is None  # compiled, not the fallback


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


# --------------------------------------------------------------------------------------------
# TOPR (ROLL _compute_topr_loss)
# --------------------------------------------------------------------------------------------


def test_topr_golden() -> None:
    # Rewards [1, 0]: row 0 positive (w = w+ = 1), row 1 not (w = w- min(r, 1), w- = .5).
    # Row 0: p = [.5, .25], A = 1: s = [ln .5, ln .25]. Row 1: p = [.8, .2], p_old = [.5, .4],
    # r = [1.6, .5] -> min(r, 1) = [1, .5], w = [.5, .25], A = -1: s = [-.5 ln .8, -.25 ln .2].
    # loss = -(ln .5 + ln .25 - .5 ln .8 - .25 ln .2) / 4 = .3913775; grad = -w A / 4 =
    # [[-.25, -.25], [.125, .0625]]. Truncated: t(1, 0) (r > 1, A < 0: dual_clip_fraction 1/4).
    log_probs = t([[0.5, 0.25], [0.8, 0.2]]).log()
    old = t([[0.4, 0.5], [0.5, 0.4]]).log()
    mask = torch.ones(2, 2, dtype=torch.bool)
    out, grad = loss_and_grad(
        log_probs, old, t([1.0, -1.0]), mask,
        surrogate=TOPR(t([1.0, 0.0]), negative_weight=0.5), log_ratio_bound=None,
    )  # fmt: skip
    assert_close(out.loss, -(LN(0.5) + LN(0.25) - 0.5 * LN(0.8) - 0.25 * LN(0.2)) / 4)
    assert_close(grad, [[-0.25, -0.25], [0.125, 0.0625]])
    d = out.diagnostics
    assert_close(d.clipped_fraction, 0.25)
    assert_close(d.dual_clip_fraction, 0.25)
    assert_close(d.clip_fraction_high, 0.0)
    assert_close(d.weight_mean, (1 + 1 + 0.5 + 0.25) / 4)


@pytest.mark.parametrize(("positive", "negative"), [(1.0, 1.0), (1.5, 0.3), (0.0, 2.0)])
def test_topr_equals_roll(positive: float, negative: float) -> None:
    # ROLL's per-token loss matrix (its ratio unbounded: log_ratio_bound=None), at the selected
    # tokens; the gradient of its token mean; its upper clip fraction over the selected tokens.
    case = random_batch(6, 8, seed=7)
    mask, scores = case["mask"], case["rewards"] * torch.tensor([1, 1, 0, 1, 1, 0.5])  # zeros
    leaf = case["log_probs"].clone().requires_grad_(True)
    token_advantages = case["advantages"].unsqueeze(-1).expand(6, 8)
    ratio = peers.roll_ratio(leaf, case["old_log_probs"])
    loss, metrics = peers.roll_compute_topr_loss(
        ratio, leaf, case["old_log_probs"], token_advantages, scores, positive, negative
    )
    expected = (loss * mask).sum() / mask.sum()  # ROLL agg_loss "token-mean"
    (want,) = torch.autograd.grad(expected, [leaf])
    surrogate = TOPR(scores, positive_weight=positive, negative_weight=negative)
    args = (poisoned(case)["log_probs"], case["old_log_probs"], case["advantages"], mask)
    out, grad = loss_and_grad(*args, surrogate=surrogate, log_ratio_bound=None)
    assert_close(out.loss, expected)
    assert_close(grad, torch.where(mask, want, 0.0))
    per_token = rlo.policy_loss(
        *args, surrogate=surrogate, log_ratio_bound=None, reduction="none"
    ).loss
    assert_close(per_token, torch.where(mask, loss.detach(), 0.0))
    upper = (metrics["topr_negative_upper_clipped"] * mask).sum() / mask.sum()
    assert_close(out.diagnostics.clipped_fraction, upper)
    assert 0 < float(upper) < 1


def test_topr_rewards_are_checked_against_the_call() -> None:
    case = random_batch(3, 4, seed=1)
    args = (case["log_probs"], case["old_log_probs"], case["advantages"], case["mask"])
    with pytest.raises(ValueError, match=r"^TOPR.rewards must have shape \(B,\) = \(3,\)"):
        rlo.policy_loss(*args, surrogate=TOPR([1.0, 0.0]))
    packed = rlo.pack(case["log_probs"], torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^TOPR.rewards must have shape \(S,\) = \(3,\)"):
        rlo.policy_loss(
            packed.values, packed.values, t([1.0, 2.0, 3.0]), torch.ones(12, dtype=torch.bool),
            cu_seqlens=packed.cu_seqlens, surrogate=TOPR(t([1.0, 0.0, 1.0, 1.0])),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"^TOPR.rewards must have shape \(S,\) or \(S, 1\)"):
        TOPR(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"^TOPR.rewards must be on the device"):
        rlo.policy_loss(*args, surrogate=TOPR(torch.zeros(3, device="meta")))
    assert TOPR(t([[1.0], [0.0], [2.0]])).rewards.shape == (3,)  # (S, 1) is one per sequence
    out = rlo.policy_loss(*args, surrogate=TOPR([True, False, True]))  # bool: 1 / 0
    assert torch.isfinite(out.loss)


# --------------------------------------------------------------------------------------------
# REAL (ms-swift loss_type="real")
# --------------------------------------------------------------------------------------------


def test_real_golden() -> None:
    # Two groups of three (group_size=3), tau = .5. Group 0: S = mean log-ratio of each response
    # over its selected tokens: S0 = (.2 + .4) / 2 = .3 (A = 1: positive), S1 = -.1 (A = -1),
    # S2 = (.5 + .1 + 0) / 3 = .2 (A = 0: negative). L0 = ln(1 + e^{-.2} + e^{.4}) + ln(1 +
    # e^{-.6}) = ln 3.3105561 + ln 1.5488116 = 1.6345164. Group 1: every A > 0: L1 = 0 (it still
    # counts: prompt_mean over the 2 groups). loss = L0 / 2; d loss / d l = dL0/dS_i / (2 n_i):
    # dL0/dS0 = -2 e^{-.6} / 1.5488116, dL0/dS1 = 2 e^{-.2} / 3.3105561, dL0/dS2 = 2 e^{.4} /
    # 3.3105561; group 1's tokens get 0.
    delta = t([[0.2, 0.4, 9.0], [-0.1, 9.0, 9.0], [0.5, 0.1, 0.0], [0.3, -0.2, 0.1],
               [0.0, 0.0, 0.0], [1.0, 9.0, 9.0]])  # fmt: skip
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]]).bool()
    old = torch.full((6, 3), -1.5, dtype=F64)
    advantages = t([1.0, -1.0, 0.0, 2.0, 0.5, 1.0])
    out, grad = loss_and_grad(old + delta, old, advantages, mask, surrogate=REAL(tau=0.5),
                              group_size=3, reduction="prompt_mean")  # fmt: skip
    neg, pos = 1 + math.exp(-0.2) + math.exp(0.4), 1 + math.exp(-0.6)
    assert_close(out.loss, (LN(neg) + LN(pos)) / 2)
    d0, d1, d2 = -2 * math.exp(-0.6) / pos, 2 * math.exp(-0.2) / neg, 2 * math.exp(0.4) / neg
    want = t([[d0 / 4, d0 / 4, 0], [d1 / 2, 0, 0], [d2 / 6] * 3, [0] * 3, [0] * 3, [0] * 3])
    assert_close(grad, want)
    assert_close(out.diagnostics.selected_fraction, 6 / 11)  # the tokens of group 0
    assert_close(out.diagnostics.clipped_fraction, 0.0)
    # every token of group 0 carries -L0 (the per-token loss is L0)
    per_token = rlo.policy_loss(old + delta, old, advantages, mask, surrogate=REAL(tau=0.5),
                                group_size=3, reduction="none").loss  # fmt: skip
    assert_close(per_token[:3][mask[:3]], torch.full((6,), LN(neg) + LN(pos), dtype=F64))
    assert torch.equal(per_token[3:], torch.zeros(3, 3, dtype=F64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_real_equals_ms_swift(seed: int) -> None:
    # ms-swift: the groups of num_generations rows, the loss summed over the groups with both
    # labels and divided by every group (here: the 4 groups, one of them all positive).
    case = random_batch(12, 7, seed=seed, spread=0.3)
    advantages = case["advantages"].clone()
    advantages[3:6] = advantages[3:6].abs() + 0.1  # group 1: no negative response
    advantages[7] = 0.0  # zero counts as negative
    mask = case["mask"]
    leaf = case["log_probs"].clone().requires_grad_(True)
    token_advantages = advantages.unsqueeze(-1).expand(12, 7)
    expected = peers.swift_real_loss(
        leaf, case["old_log_probs"], token_advantages, mask.to(F64), 3, 0.7
    )
    (want,) = torch.autograd.grad(expected, [leaf])
    out, grad = loss_and_grad(
        poisoned(case)["log_probs"], case["old_log_probs"], advantages, mask,
        surrogate=REAL(tau=0.7), group_size=3, reduction="prompt_mean", log_ratio_bound=None,
    )  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(grad, torch.where(mask, want, 0.0))
    assert float(expected.detach()) > 0 and 0 < float(out.diagnostics.selected_fraction) < 1
    # group_ids in any order: the same groups
    order = torch.randperm(12, generator=torch.Generator().manual_seed(seed))
    ids = torch.arange(12).div(3, rounding_mode="floor")[order]
    shuffled, shuffled_grad = loss_and_grad(
        case["log_probs"][order], case["old_log_probs"][order], advantages[order], mask[order],
        surrogate=REAL(tau=0.7), group_ids=ids * 10 + 7, reduction="prompt_mean",
        log_ratio_bound=None,
    )  # fmt: skip
    assert_close(shuffled.loss, expected)
    assert_close(shuffled_grad, grad[order])


def test_real_needs_the_groups() -> None:
    case = random_batch(3, 4, seed=1)
    args = (case["log_probs"], case["old_log_probs"], case["advantages"], case["mask"])
    with pytest.raises(
        ValueError, match=r"^REAL needs the prompt groups of the call: pass group_size"
    ):
        rlo.policy_loss(*args, surrogate=REAL())
    with pytest.raises(ValueError, match=r"^surrogate=REAL\(tau=0.5\) scores each response"):
        rlo.policy_loss(*args, surrogate="real", ratio_level="sequence", group_size=3)
    out = rlo.policy_loss(*args, surrogate="real", group_size=3)  # the name: REAL() defaults
    assert torch.isfinite(out.loss)


def test_real_scores_far_from_zero_stay_finite() -> None:
    # S / tau = -+1900 (float32): the logsumexp with the 1 as a zero logit neither overflows nor
    # loses the gradient's bound 1 / tau. L = ln(1 + e^1900) + ln(1 + e^1900) = 3800 at both
    # tokens (token mean: 3800); dL/dS = -+1 / tau = -+100.
    old = torch.zeros(2, 1, dtype=torch.float32)
    log_probs = torch.tensor([[-19.0], [19.0]]).requires_grad_(True)
    out = rlo.policy_loss(log_probs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1, dtype=bool),
                          surrogate=REAL(tau=0.01), group_size=2)  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, [log_probs])
    assert_close(out.loss, 3800.0)
    assert_close(grad, [[-100.0], [100.0]])


# --------------------------------------------------------------------------------------------
# FIPO (ms-swift loss_type="fipo")
# --------------------------------------------------------------------------------------------


def test_fipo_golden() -> None:
    # gamma = .5, cap = .2 (f in [1, 1.2]), the band [.8, 1.2]. Row 0, A = 1, Delta = [.1, -.2,
    # .4]: F = [.1 - .1 + .1, -.2 + .2, .4] = [.1, 0, .4], f = [e^.1, 1, 1.2]; the clipped
    # surrogate min(r, clip(r)) = [e^.1, e^-.2, 1.2 (clipped)], s = [e^.2, e^-.2, 1.44].
    # Row 1, A = -1, Delta = [.1, (hole), .4]: the hole is a position (gamma^2 to t2):
    # F = [.1 + .25 * .4, .4] = [.2, .4], f = [1.2, 1.2]; A < 0 clips below .8 only:
    # s = [-1.2 e^.1, -1.2 e^.4]. loss = -sum / 5; grad = -f dclip/dl / 5 = [-e^.2, -e^-.2, 0]
    # / 5 and [1.2 e^.1, 0, 1.2 e^.4] / 5.
    delta = t([[0.1, -0.2, 0.4], [0.1, 5.0, 0.4]])
    mask = t([[1, 1, 1], [1, 0, 1]]).bool()
    old = torch.full((2, 3), -1.0, dtype=F64)
    surrogate = FIPO(gamma=0.5, cap=0.2)
    out, grad = loss_and_grad(old + delta, old, t([1.0, -1.0]), mask, surrogate=surrogate)
    e = math.exp
    values = [e(0.2), e(-0.2), 1.44, -1.2 * e(0.1), -1.2 * e(0.4)]
    assert_close(out.loss, -sum(values) / 5)
    assert_close(grad, [[-e(0.2) / 5, -e(-0.2) / 5, 0], [1.2 * e(0.1) / 5, 0, 1.2 * e(0.4) / 5]])
    assert_close(out.diagnostics.clip_fraction_high, 1 / 5)  # the band's edge: row 0, t2
    assert_close(out.diagnostics.weight_mean, (e(0.2) + e(-0.2) + 1.44 + 1.2 * e(0.1)
                                               + 1.2 * e(0.4)) / 5)  # fmt: skip
    # ms-swift's safety clamp: A < 0 and r = e^.4 > 1.3 at row 1, t2: f = clip(1.2, .8, 1) = 1
    safe = FIPO(gamma=0.5, cap=0.2, safety_threshold=1.3)
    out, grad = loss_and_grad(old + delta, old, t([1.0, -1.0]), mask, surrogate=safe)
    values[-1] = -e(0.4)
    assert_close(out.loss, -sum(values) / 5)
    assert_close(grad[1, 2], e(0.4) / 5)
    assert_close(out.diagnostics.selected_fraction, 1 / 5)  # the clamped tokens
    # no cap: f = e^F (row 0 t2: e^.4 = 1.49), symmetric cap: [.8, 1.2] (F = 0 gives 1)
    free = rlo.policy_loss(old + delta, old, t([1.0, -1.0]), mask,
                           surrogate=FIPO(gamma=0.5, cap=None), reduction="none").loss  # fmt: skip
    assert_close(free[0], [-e(0.2), -e(-0.2), -1.2 * e(0.4)])


@pytest.mark.parametrize(
    "config",
    [
        {"fipo_decay_rate": 32.0, "fipo_clip_range": 0.2, "fipo_clip_high_only": True,
         "delta": None, "fipo_safety_threshold": None},
        {"fipo_decay_rate": 4.0, "fipo_clip_range": 0.2, "fipo_clip_high_only": False,
         "delta": 1.5, "fipo_safety_threshold": 1.2},
        {"fipo_decay_rate": 2.0, "fipo_clip_range": None, "fipo_clip_high_only": True,
         "delta": None, "fipo_safety_threshold": 1.1},
    ],
    ids=["defaults", "official-32b-like", "no-cap"],
)  # fmt: skip
def test_fipo_equals_ms_swift(config: dict[str, Any]) -> None:
    case = random_batch(5, 40, seed=29, spread=0.3)  # long rows: the discount matters
    mask = case["mask"]
    leaf = case["log_probs"].clone().requires_grad_(True)
    token_advantages = case["advantages"].unsqueeze(-1).expand(5, 40)
    normalizer = float(mask.sum()) + 2.0  # ms-swift's num_items_in_batch / num_processes
    expected, metrics = peers.swift_fipo_loss(
        leaf, case["old_log_probs"], token_advantages, mask, 0.2, 0.28, config["delta"],
        config["fipo_decay_rate"], config["fipo_clip_range"], config["fipo_clip_high_only"],
        config["fipo_safety_threshold"], normalizer,
    )  # fmt: skip
    (want,) = torch.autograd.grad(expected, [leaf])
    surrogate = FIPO(
        gamma=2 ** (-1 / config["fipo_decay_rate"]), cap=config["fipo_clip_range"], low=0.2,
        high=0.28, delta=config["delta"], cap_high_only=config["fipo_clip_high_only"],
        safety_threshold=config["fipo_safety_threshold"],
    )  # fmt: skip
    out, grad = loss_and_grad(
        poisoned(case)["log_probs"], poisoned(case)["old_log_probs"], case["advantages"], mask,
        surrogate=surrogate, log_ratio_bound=None, normalizer=normalizer,
    )  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(grad, torch.where(mask, want, 0.0))
    clamped = (~metrics["safety_mask"] & mask).sum() / mask.sum()  # 1 - safety_keep_ratio
    assert_close(out.diagnostics.selected_fraction, clamped)
    # the influence weights themselves (1 on the unselected positions of ms-swift's matrix)
    influence = metrics["influence_weight"]
    assert not torch.allclose(influence[mask], torch.ones((), dtype=F64), atol=1e-3)  # it binds


def test_fipo_future_sums_stop_at_each_packed_sequence() -> None:
    # Two packed sequences [.1, .2 | .4]: F = [.1 + .5 * .2, .2 | .4] with gamma = .5 (the
    # second sequence's .4 does not reach the first); padded rows give the same.
    from rlobjectives._core.layout import packed_layout, padded
    from rlobjectives._core.segments import future_discounted_sums as future_sums

    values = t([[0.1, 0.2, 0.4]])
    packed = future_sums(values, packed_layout(torch.tensor([0, 2, 3]), 3), 0.5)
    assert_close(packed, [[0.2, 0.2, 0.4]])
    rows = future_sums(t([[0.1, 0.2], [0.4, 0.0]]), padded(2), 0.5)
    assert_close(rows, [[0.2, 0.2], [0.4, 0.0]])
    long = torch.randn(1, 37, dtype=F64)  # against the obvious double loop
    loop = [sum(0.9 ** (s - i) * float(long[0, s]) for s in range(i, 37)) for i in range(37)]
    assert_close(future_sums(long, padded(1), 0.9), [loop])


# --------------------------------------------------------------------------------------------
# Every new surrogate: the float64 reference, NaN, packed, micro-batches, hidden states
# --------------------------------------------------------------------------------------------

REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted",
              "prompt_mean", "none")  # fmt: skip
GROUP = 3  # the prompt groups of the test batches: rows 0-2, 3-5


def make(name: str, case: dict[str, Any]) -> tuple[rlo.Surrogate, dict[str, Any]]:
    """The surrogate ``name`` for ``case``'s rows, with the keywords of its call."""
    if name == "band":
        return ProbabilityBand(tau=0.08, kappa=0.3), {}
    if name == "topr":
        return TOPR(case["rewards"], positive_weight=1.5, negative_weight=0.7), {}
    if name == "real":
        return REAL(tau=0.7), {}
    if name == "fipo":  # the band, delta, the cap and the safety clamp each bind somewhere
        return FIPO(gamma=0.8, cap=0.3, low=0.2, high=0.28, delta=1.6, safety_threshold=1.2), {}
    raise ValueError(name)


NAMES = ("band", "topr", "real", "fipo")


def expected_loss(name: str, case: dict[str, Any], leaf: torch.Tensor, **options: Any) -> Any:
    """The float64 loop reference of ``policy_loss`` with ``make(name, case)``."""
    surrogate, extra = make(name, case)
    rows = case["mask"].shape[0]
    labels = [i // GROUP for i in range(rows)]
    return reference.policy_loss(
        leaf, case["old_log_probs"], case["advantages"], case["mask"], surrogate=surrogate,
        labels=labels, **extra, **options,
    )  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extras", ["plain", "weights+entropy", "sequence_ratio"])
def test_matches_the_float64_reference(name: str, reduction: str, extras: str) -> None:
    case = random_batch(6, 7, seed=11)
    surrogate, extra = make(name, case)
    if extras == "sequence_ratio" and not surrogate.takes_sequence_ratio:
        pytest.skip("the object forms its own sequence quantities (ratio_level='token' only)")
    g = torch.Generator().manual_seed(2)
    options: dict[str, Any] = {"reduction": reduction}
    entropy = None
    if extras == "weights+entropy":
        options["importance_weights"] = torch.rand(6, 7, generator=g, dtype=F64) + 0.5
        options["entropy_coef"] = 0.05
        entropy = (2 * torch.rand(6, 7, generator=g, dtype=F64)).requires_grad_(True)
    if extras == "sequence_ratio":
        options["ratio_level"] = "sequence"
    leaf = poisoned(case)["log_probs"].clone().requires_grad_(True)
    out = rlo.policy_loss(
        leaf, poisoned(case)["old_log_probs"], case["advantages"], case["mask"],
        surrogate=surrogate, entropy=entropy, group_size=GROUP, **extra, **options,
    )  # fmt: skip
    leaves = [leaf] if entropy is None else [leaf, entropy]
    grads = torch.autograd.grad(out.loss.sum(), leaves)
    wide = [case["log_probs"].clone().requires_grad_(True)]
    if entropy is not None:
        wide.append(entropy.detach().clone().requires_grad_(True))
    expected = expected_loss(name, case, wide[0], entropy=None if entropy is None else wide[1],
                             **options)  # fmt: skip
    want = torch.autograd.grad(expected.sum(), wide, allow_unused=True)
    assert_close(out.loss, expected)
    for got, ref in zip(grads, want, strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, torch.zeros_like(got) if ref is None else ref)
    if extras == "plain" and reduction == "token_mean":
        diagnostics = reference.policy_loss_diagnostics(
            case["log_probs"], case["old_log_probs"], case["advantages"], case["mask"],
            surrogate=surrogate, labels=[i // GROUP for i in range(6)], **extra,
        )  # fmt: skip
        for key, value in diagnostics.items():
            assert_close(getattr(out.diagnostics, key), value)


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    batch=st.integers(1, 6),
    tokens=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, F64]),
    reduction=st.sampled_from(["token_mean", "sequence_mean"]),
)
def test_property_odd_shapes_and_dtypes(
    name: str, batch: int, tokens: int, seed: int, dtype: torch.dtype, reduction: str
) -> None:
    case = random_batch(batch, tokens, seed)
    case["mask"][:, 0] = torch.rand(batch, generator=torch.Generator().manual_seed(seed)) < 0.8
    surrogate, extra = make(name, case)
    ids = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(seed))
    leaf = case["log_probs"].to(dtype).requires_grad_(True)
    out = rlo.policy_loss(
        leaf, case["old_log_probs"].to(dtype), case["advantages"].to(dtype), case["mask"],
        surrogate=surrogate, reduction=reduction, group_ids=ids, **extra,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    wide = case["log_probs"].to(dtype).double().requires_grad_(True)
    narrow = {**case, "old_log_probs": case["old_log_probs"].to(dtype).double(),
              "advantages": case["advantages"].to(dtype).double()}  # fmt: skip
    expected = reference.policy_loss(
        wide, narrow["old_log_probs"], narrow["advantages"], case["mask"], surrogate=surrogate,
        reduction=reduction, labels=ids.tolist(), **extra,
    )  # fmt: skip
    want = torch.zeros_like(wide)
    if expected.requires_grad:
        (want,) = torch.autograd.grad(expected, [wide])
    assert out.loss.dtype == dtype
    assert_close(out.loss, expected)
    assert_close(grad, want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_at_unselected_positions_reaches_nothing(name: str, bad: float) -> None:
    case = random_batch(6, 7, seed=13)
    surrogate, extra = make(name, case)
    mask = case["mask"]
    results = []
    for fill in (None, bad):
        tensors = [case["log_probs"], case["old_log_probs"], case["advantages"].expand(7, 6).T]
        if fill is not None:
            tensors = [torch.where(mask, x, fill) for x in tensors]
        leaf = tensors[0].clone().requires_grad_(True)
        out = rlo.policy_loss(leaf, tensors[1], tensors[2], mask, surrogate=surrogate,
                              reduction="sequence_mean", group_size=GROUP, **extra)  # fmt: skip
        (grad,) = torch.autograd.grad(out.loss, [leaf])
        results.append((out, grad))
    (clean, clean_grad), (dirty, dirty_grad) = results
    assert torch.isfinite(dirty.loss) and torch.isfinite(dirty_grad).all()
    assert torch.equal(dirty.loss, clean.loss) and torch.equal(dirty_grad, clean_grad)
    for a, b in zip(dirty.diagnostics, clean.diagnostics, strict=True):
        assert torch.equal(a, b)


def _attention(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "prompt_mean", "none"])
def test_packed_equals_padded(name: str, reduction: str) -> None:
    # Each sequence's positions kept in the packed row (its unselected holes too), an empty one.
    case = random_batch(6, 8, seed=17)
    attention = _attention([8, 5, 0, 7, 1, 6], 8)
    mask = case["mask"] & attention
    case = {**case, "mask": mask}
    surrogate, extra = make(name, case)
    leaf = poisoned(case)["log_probs"].clone().requires_grad_(True)
    padded = rlo.policy_loss(leaf, poisoned(case)["old_log_probs"], case["advantages"], mask,
                             surrogate=surrogate, reduction=reduction, group_size=GROUP,
                             return_per_token=True, **extra)  # fmt: skip
    (padded_grad,) = torch.autograd.grad(padded.loss.sum(), [leaf])
    packed_leaf = rlo.pack(leaf.detach(), attention).values.requires_grad_(True)
    cu = rlo.pack(mask, attention).cu_seqlens
    flat = rlo.policy_loss(
        packed_leaf, rlo.pack(poisoned(case)["old_log_probs"], attention).values,
        case["advantages"], rlo.pack(mask, attention).values, surrogate=surrogate,
        reduction=reduction, group_size=GROUP, cu_seqlens=cu, return_per_token=True, **extra,
    )  # fmt: skip
    (flat_grad,) = torch.autograd.grad(flat.loss.sum(), [packed_leaf])
    if reduction == "none":
        assert_close(flat.loss, rlo.pack(padded.loss.detach(), attention).values)
    else:
        assert_close(flat.loss, padded.loss)
    assert_close(flat_grad, rlo.pack(padded_grad, attention).values)
    for a, b in zip(flat.diagnostics, padded.diagnostics, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "prompt_mean"])
def test_micro_batches_with_the_global_normalizer(name: str, reduction: str) -> None:
    # Micro-batches of whole prompt groups (rows 0-2, 3-5), each padded to its own width.
    case = random_batch(6, 9, seed=19)
    lengths = [9, 4, 6, 2, 8, 5]
    mask = case["mask"] & _attention(lengths, 9)
    case = {**case, "mask": mask}
    normalizer = {"token_mean": int(mask.sum()), "sequence_mean": int((mask.sum(-1) > 0).sum()),
                  "prompt_mean": 2}[reduction]  # fmt: skip
    surrogate, extra = make(name, case)
    full, full_grad = loss_and_grad(case["log_probs"], case["old_log_probs"], case["advantages"],
                                    mask, surrogate=surrogate, reduction=reduction,
                                    group_size=GROUP, **extra)  # fmt: skip
    total, grad = torch.zeros((), dtype=F64), torch.zeros_like(full_grad)
    for start in (0, GROUP):
        rows = slice(start, start + GROUP)
        width = max(lengths[rows])
        part = {k: v[rows] for k, v in case.items()}
        part = {**part, **{k: part[k][:, :width] for k in ("log_probs", "old_log_probs", "mask")}}
        micro_surrogate, micro_extra = make(name, part)
        out, micro_grad = loss_and_grad(
            part["log_probs"], part["old_log_probs"], part["advantages"], part["mask"],
            surrogate=micro_surrogate, reduction=reduction, group_size=GROUP,
            normalizer=normalizer, **micro_extra,
        )  # fmt: skip
        total = total + out.loss.detach()
        grad[rows, :width] += micro_grad
    assert_close(total, full.loss)
    assert_close(grad, full_grad)


def _head(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, tokens, hidden, vocab = 6, 5, 8, 13
    return {
        "hidden": torch.randn(batch, tokens, hidden, generator=g, dtype=F64),
        "weight": torch.randn(vocab, hidden, generator=g, dtype=F64) / 2,
        "tokens": torch.randint(0, vocab, (batch, tokens), generator=g),
        "old_log_probs": -torch.rand(batch, tokens, generator=g, dtype=F64) * 2 - 1.5,
        "advantages": torch.randn(batch, generator=g, dtype=F64),
        "mask": torch.rand(batch, tokens, generator=g) < 0.8,
        "rewards": torch.randint(0, 2, (batch,), generator=g).to(F64),
    }


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "none"])
def test_from_hidden_states_equals_the_composition(name: str, reduction: str) -> None:
    # The token-local ones through the chunk loop, the others composed: both equal the policy
    # loss of the log-probabilities from the hidden states (values, gradients of both leaves).
    case = _head(seed=23)
    surrogate, extra = make(name, case)
    leaves = [case[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    out = rlo.fused_policy_loss_from_hidden(
        *leaves, case["tokens"], case["old_log_probs"], case["advantages"], case["mask"],
        surrogate=surrogate, reduction=reduction, chunk_size=4, group_size=GROUP, **extra,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss.sum(), leaves)
    wide = [case[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    log_probs = rlo.token_log_probs_from_hidden(*wide, case["tokens"])
    composed = rlo.policy_loss(
        log_probs, case["old_log_probs"], case["advantages"], case["mask"], surrogate=surrogate,
        reduction=reduction, group_size=GROUP, **extra,
    )  # fmt: skip
    want = torch.autograd.grad(composed.loss.sum(), wide)
    assert_close(out.loss, composed.loss)
    for got, ref in zip(grads, want, strict=True):
        assert_close(got, ref)


@pytest.mark.compile
@pytest.mark.parametrize("name", NAMES)
def test_compiled_equals_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # RLOBJECTIVES_COMPILE=1: the formula compiles (no fallback to eager), equals the eager call
    # (NaN at unselected positions), and a new object of the same kind (TOPR's rewards of the
    # next batch) runs the same compiled graph (no recompilation).
    import rlobjectives._core.compiled as compiled_module

    monkeypatch.setattr(compiled_module, "_COMPILED", {})
    cases = [poisoned(random_batch(6, 11, seed=seed)) for seed in (31, 32)]
    counters = []
    for case in cases:
        results = []
        for setting in ("0", "1"):
            monkeypatch.setenv("RLOBJECTIVES_COMPILE", setting)
            surrogate, extra = make(name, case)
            leaf = case["log_probs"].clone().to(torch.float32).requires_grad_(True)
            out = rlo.policy_loss(
                leaf, case["old_log_probs"].float(), case["advantages"].float(), case["mask"],
                surrogate=surrogate, reduction="sequence_mean", group_size=GROUP, **extra,
            )  # fmt: skip
            (grad,) = torch.autograd.grad(out.loss, [leaf])
            results.append((out, grad))
        (eager, eager_grad), (compiled, compiled_grad) = results
        assert_close(compiled.loss, eager.loss)
        assert_close(compiled_grad, eager_grad)
        assert torch.isfinite(compiled_grad).all()
        for value, expected in zip(compiled.diagnostics, eager.diagnostics, strict=True):
            assert_close(value, expected)
        assert compiled_module._COMPILED.get("failed") is None  # compiled, not the fallback
        counters.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counters[1] == counters[0]  # the second batch's object: no new graph


@pytest.mark.compile
def test_the_four_trace_fullgraph() -> None:
    # torch.compile(fullgraph=True) of one step with the four objects (aot_eager: the whole call
    # and its autograd graph, no graph break), equal to eager in value and gradient.
    case = random_batch(6, 9, seed=37)
    objects = [make(name, case)[0] for name in NAMES]
    old, advantages, mask = (case[k].float() for k in ("old_log_probs", "advantages", "mask"))
    mask = mask.bool()

    def step(x: torch.Tensor) -> torch.Tensor:
        losses = [
            rlo.policy_loss(x, old, advantages, mask, surrogate=surrogate, group_size=GROUP,
                            reduction="prompt_mean").loss
            for surrogate in objects
        ]  # fmt: skip
        return torch.stack(losses)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [case["log_probs"].float().requires_grad_(True) for _ in range(2)]
    result, eager = compiled(leaves[0]), step(leaves[1])
    assert_close(result, eager)
    result.sum().backward()
    eager.sum().backward()
    assert_close(leaves[0].grad, leaves[1].grad)
    assert (leaves[0].grad != 0).any()
