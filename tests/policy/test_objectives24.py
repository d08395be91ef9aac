"""Issue 24's objectives: DPPO, DRO, M2PO, Clip-Cov / KL-Cov, and ``nll_loss``.

Golden values derived by hand from the peers' code (verl 0.9.1 ``core_algos.py``, AReaL's
``_get_m2po_loss_mask`` / ``ppo_actor_loss_fn``, prime-rl ``default_loss_fn``, SkyRL
``dppo_policy_loss``), with the arithmetic in the comments, on both paths (the fused stage and
the autograd specification) and, for the token-local objects, the Triton kernels; parity with
the peers' own outputs on random float64 batches (``tests/data/objectives24_peers.pt``: verl
0.9.1's functions run through its ``ActorConfig``, AReaL / prime-rl / SkyRL transcriptions);
the device-side selections (M2PO's greedy mask, KL-Cov's top-k, Clip-Cov's seeded draw:
reproducible, uniform, layout-free, compilable); NaN at unselected positions; bf16 computed in
float32; the micro-batch recipe of the selections and of the NLL term. The option tables of
``test_policy_loss.py`` / ``test_fused.py`` / ``test_from_hidden.py`` (``family_cases.py``) and
the packed-layout registry cover every reduction, the importance weights and the entropy bonus
against the float64 references of ``tests/reference.py``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from backends import dtype_for
from rlobjectives import (
    DPPO,
    DRO,
    M2PO,
    Clip,
    ClipCov,
    KLCov,
    cov_selection,
    fused_policy_loss_from_hidden,
    m2po_mask,
    nll_loss,
    policy_loss,
)
from rlobjectives._core.selection import (
    draw_seed,
    random_subset,
    splitmix64,
    stable_ranks,
    top_k,
)
from rlobjectives.distributed import sum_diagnostics
from rlobjectives.presets._verl import VERL_AGGREGATIONS
from tolerances import assert_close

F64 = torch.float64
LN = math.log
PEERS = torch.load(Path(__file__).parents[1] / "data" / "objectives24_peers.pt", weights_only=False)


def t(values: Any, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def both_paths(
    log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    **kwargs: Any,
) -> tuple[Any, torch.Tensor]:  # fmt: skip
    """policy_loss's output and its d loss / d log_probs (autograd of the one formula)."""
    leaf = log_probs.detach().clone().requires_grad_(True)
    out = policy_loss(leaf, old, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(out.loss.sum(), [leaf])
    return out, grad


# --------------------------------------------------------------------------------------------
# DPPO goldens (verl dppo_tv / dppo_kl: -A sg(min(r, c)) l on the kept tokens, token-mean)
# --------------------------------------------------------------------------------------------


def test_dppo_tv_golden(backend: str) -> None:
    # p_old = 0.5, p = [.6, .8, .25, .4], A = [1, 1, -1, -1], delta = 0.2, c = 20:
    # p - p_old = [.1, .3, -.25, -.1]; A > 0 kept iff <= .2 (t0 in, t1 out); A <= 0 kept iff
    # >= -.2 (t2 out, t3 in). r = p / p_old = [1.2, 1.6, .5, .8];
    # loss = (-1.2 ln .6 + .8 ln .4) / 4 = (0.6129907 - 0.7330326) / 4 = -0.0300105 (verl);
    # grad = -A w / 4 = [-.3, 0, 0, .2]; verl's pg_clipfrac = 2/4, pg_clipfrac_lower = 0,
    # ppo_kl = -(ln 1.2 + ln 1.6 + ln .5 + ln .8) / 4 = -ln(.768) / 4.
    dtype = dtype_for(backend)
    old = t([[0.5] * 4]).log().to(dtype)
    log_probs = t([[0.6, 0.8, 0.25, 0.4]]).log().to(dtype)
    advantages = t([[1.0, 1.0, -1.0, -1.0]], dtype)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out, grad = both_paths(log_probs, old, advantages, mask, surrogate=DPPO("tv", low=0.2))
    assert_close(out.loss, -0.030010459245033788)
    assert_close(grad, [[-0.3, 0.0, 0.0, 0.2]])
    d = out.diagnostics
    assert_close(d.clipped_fraction, 0.5)  # verl pg_clipfrac (x N / (N + 1e-8))
    assert_close(d.clip_fraction_low, 0.25)  # prime-rl is_masked_low: t2
    assert_close(d.clip_fraction_high, 0.25)  # prime-rl is_masked_high: t1
    assert_close(d.dual_clip_fraction, 0.0)  # verl pg_clipfrac_lower
    assert_close(d.approx_kl_k1, -LN(0.768) / 4)  # verl ppo_kl
    assert_close(d.weight_mean, (1.2 + 0.8) / 4)  # w = [1.2, 0, 0, .8]
    assert_close(d.selected_fraction, 0.0)


def test_dppo_tv_boundary_and_zero_advantage() -> None:
    # verl, low .2, high .25, c 1.5: p_old = [.25, .5, .1, (pad)], p = [.5, .1, .05, (pad)],
    # A = [2, 0, -1, 5]. t0: p - p_old = .25 <= .25 (inclusive): kept, r = 2 capped at 1.5;
    # t1: A = 0 takes the A <= 0 rule: -.4 < -.2, outside (verl counts it in pg_clipfrac);
    # t2: -.05 >= -.2 kept, r = .5. loss = (-1.5 * 2 ln .5 - .5 * (-1) ln .05) / 3 =
    # (3 ln 2 + .5 ln .05) / 3 = 0.1938585; grad = [-1.5 * 2, 0, .5] / 3 = [-1, 0, 1/6, 0].
    # pg_clipfrac = 1/3 (the A = 0 token); pg_clipfrac_lower = 1/3: t0 capped with A > 0.
    # (The boundary is exact in float64: PyTorch only; the kernels' exp is backend-rounded.)
    old = t([[0.25, 0.5, 0.1, 0.3]]).log()
    log_probs = t([[0.5, 0.1, 0.05, 0.3]]).log()
    mask = t([[1, 1, 1, 0]]).bool()
    surrogate = DPPO("tv", low=0.2, high=0.25, ratio_cap=1.5)
    out, grad = both_paths(log_probs, old, t([[2.0, 0.0, -1.0, 5.0]]), mask, surrogate=surrogate)
    assert_close(out.loss, (3 * LN(2) + 0.5 * LN(0.05)) / 3)
    assert_close(grad, [[-1.0, 0.0, 1 / 6, 0.0]])
    d = out.diagnostics
    assert_close(d.clipped_fraction, 1 / 3)  # verl pg_clipfrac: includes the A = 0 token
    assert_close(d.clip_fraction_low + d.clip_fraction_high, 0.0)  # neither sign
    assert_close(d.dual_clip_fraction, 1 / 3)  # verl pg_clipfrac_lower: any sign


def test_dppo_kl_golden(backend: str) -> None:
    # p_old = .5: D = -ln(4 p (1 - p)) / 2: .0204110 for p in {.4, .6}, .2231436 for {.2, .8};
    # delta = .05. Row 0: p = [.6, .8, .2, .2], A = [1, 1, 1, -1]: in (D small), out (D big,
    # p up), in (A > 0 and p <= p_old: the direction clause), out (A < 0, p down, D big).
    # Row 1: p = [.8, .4, .6, .5], A = [-1, -1, -1, 3]: in (p up), in (D small), in (p up),
    # in (D = 0). w = r = 2p. loss = (-1.2 ln .6 - .4 ln .2 + 1.6 ln .8 + .8 ln .4 + 1.2 ln .6
    # - 3 ln .5) / 8 = 0.2041443; grad = -A w / 8.
    dtype = dtype_for(backend)
    old = t([[0.5] * 4] * 2).log().to(dtype)
    log_probs = t([[0.6, 0.8, 0.2, 0.2], [0.8, 0.4, 0.6, 0.5]]).log().to(dtype)
    advantages = t([[1.0, 1.0, 1.0, -1.0], [-1.0, -1.0, -1.0, 3.0]], dtype)
    mask = torch.ones(2, 4, dtype=torch.bool)
    out, grad = both_paths(log_probs, old, advantages, mask, surrogate=DPPO("kl"))
    assert_close(out.loss, 0.20414430488142704)
    assert_close(grad, [[-0.15, 0.0, -0.05, 0.0], [0.2, 0.1, 0.15, -0.375]])
    assert_close(out.diagnostics.clipped_fraction, 0.25)
    assert_close(out.diagnostics.clip_fraction_low, 0.125)
    assert_close(out.diagnostics.clip_fraction_high, 0.125)


def test_dppo_kl_with_verl_default_cap(backend: str) -> None:
    # verl's ActorConfig.clip_ratio_c is 3.0: p_old = .1, p = [.4, .05], A = [-1, 1]: both kept
    # by the direction clause (A < 0 and p up; A > 0 and p down); r = [4, .5] -> w = [3, .5];
    # loss = (3 ln .4 - .5 ln .05) / 2 = -0.6255030; grad = -A w / 2 = [1.5, -.25];
    # pg_clipfrac_lower = 1/2 (t0 capped).
    dtype = dtype_for(backend)
    out, grad = both_paths(
        t([[0.4, 0.05]]).log().to(dtype), t([[0.1, 0.1]]).log().to(dtype), t([[-1.0, 1.0]], dtype),
        torch.ones(1, 2, dtype=torch.bool), surrogate=DPPO("kl", ratio_cap=3.0),
    )  # fmt: skip
    assert_close(out.loss, (3 * LN(0.4) - 0.5 * LN(0.05)) / 2)
    assert_close(grad, [[1.5, -0.25]])
    assert_close(out.diagnostics.dual_clip_fraction, 0.5)
    assert_close(out.diagnostics.clipped_fraction, 0.0)


def test_dppo_without_cap_is_prime_rl_and_skyrl(backend: str) -> None:
    # prime-rl default_loss_fn (kl_tau = 0) and SkyRL dppo_policy_loss: -keep A r, summed.
    # The batch of test_dppo_tv_golden: -(1.2 - .8) = -0.4 (prime-rl's loss_sum); the gradient
    # -keep A r = [-1.2, 0, 0, .8] equals verl's (r < c): only the value form differs.
    dtype = dtype_for(backend)
    log_probs = t([[0.6, 0.8, 0.25, 0.4]]).log().to(dtype)
    old = t([[0.5] * 4]).log().to(dtype)
    advantages, mask = t([[1.0, 1.0, -1.0, -1.0]], dtype), torch.ones(1, 4, dtype=torch.bool)
    out, grad = both_paths(
        log_probs, old, advantages, mask, surrogate=DPPO(ratio_cap=None), log_ratio_bound=None,
        normalizer=1,
    )  # fmt: skip
    assert_close(out.loss, -0.4)
    assert_close(grad, [[-1.2, 0.0, 0.0, 0.8]])
    verl, verl_grad = both_paths(log_probs, old, advantages, mask, surrogate=DPPO(), normalizer=1)
    assert_close(verl_grad, grad)  # the same gradient
    assert abs(float(verl.loss.detach()) - float(out.loss.detach())) > 0.1  # another value
    assert_close(out.diagnostics.clipped_fraction, 0.5)  # prime-rl is_masked


def test_dppo_binary_kl_no_nan_at_probability_0_and_1() -> None:
    # p_old = 1: D = -l (the complement term is 0 * finite); p = 1, p_old = .5: D finite thanks
    # to eps, .5 ln .5 ... ; p_old = 0 (l_old = -inf): the first term's limit 0; float32 near
    # p = 1 (l = -1e-8): 1 - p = -expm1(l) keeps its digits (verl's 1 - exp(l) is 0 there).
    from rlobjectives.kl.estimators import binary_kl

    log_probs = t([-0.5, 0.0, -0.3, -1e-8])
    old = t([0.0, LN(0.5), -math.inf, -2e-8])
    divergence = binary_kl(log_probs, old)
    assert torch.isfinite(divergence).all()
    assert_close(divergence[0], 0.5)  # -l
    # p_old = .5, p = 1: .5 ln .5 + .5 ln((.5 + eps) / eps)
    assert_close(divergence[1], 0.5 * LN(0.5) + 0.5 * LN((0.5 + 1e-8) / 1e-8))
    assert_close(divergence[2], LN(1 / (1 - math.exp(-0.3) + 1e-8)))  # the complement term
    float32 = binary_kl(log_probs.float(), old.float())
    assert torch.isfinite(float32).all()
    # p_old = e^-2e-8, p = e^-1e-8: q = 1e-8, q_old = 2e-8:
    # D = p_old (l_old - l) + q_old ln((q_old + eps) / (q + eps)) = -(1 - q_old) 1e-8 + 2e-8 ln 1.5
    # (negative: the eps of verl's formula makes D no divergence at this scale)
    q, q_old = 1e-8, 2e-8
    expected = -(1 - q_old) * 1e-8 + q_old * LN((q_old + 1e-8) / (q + 1e-8))
    assert_close(divergence[3], expected)
    torch.testing.assert_close(float32[3].double(), t(expected), rtol=1e-4, atol=0)


# --------------------------------------------------------------------------------------------
# DRO golden (verl dro: -(l A - beta (l - l_old)^2 / 2))
# --------------------------------------------------------------------------------------------


def test_dro_golden(backend: str) -> None:
    # l = ln[.5, .25, .8], l_old = ln[.25, .25, .4], A = [1, -1, 0], beta = .5:
    # Delta = [ln 2, 0, ln 2]; L = [ln 2 + ln^2 2 / 4, -2 ln 2, ln^2 2 / 4]
    # = [0.8132604, -1.3862944, 0.1201133]; loss = sum / 3 = -0.1509736; the penalty acts at
    # A = 0 (t2). grad = (-A + beta Delta) / 3 = [(-1 + ln 2 / 2), 1, ln 2 / 2] / 3;
    # verl's ppo_kl = -2 ln 2 / 3.
    dtype = dtype_for(backend)
    out, grad = both_paths(
        t([[0.5, 0.25, 0.8]]).log().to(dtype), t([[0.25, 0.25, 0.4]]).log().to(dtype),
        t([[1.0, -1.0, 0.0]], dtype), torch.ones(1, 3, dtype=torch.bool), surrogate=DRO(beta=0.5),
    )  # fmt: skip
    assert_close(out.loss, -0.1509735578669482)
    assert_close(grad, [[(-1 + LN(2) / 2) / 3, 1 / 3, LN(2) / 6]])
    assert_close(out.diagnostics.approx_kl_k1, -2 * LN(2) / 3)
    assert_close(out.diagnostics.weight_mean, 1.0)
    assert_close(out.diagnostics.clipped_fraction, 0.0)


def test_dro_ignores_the_log_ratio_bound() -> None:
    # DRO has no ratio: Delta = 30 enters raw (the bound 20 only bounds the diagnostics' ratio).
    # L = -(l A - beta Delta^2 / 2) with l = -1, A = 1, beta = .1: 1 + .05 * 900 = 46.
    out, grad = both_paths(t([[-1.0]]), t([[-31.0]]), t([[1.0]]), torch.ones(1, 1).bool(),
                           surrogate=DRO(beta=0.1))  # fmt: skip
    assert_close(out.loss, 46.0)
    assert_close(grad, [[-1.0 + 0.1 * 30]])
    assert_close(out.diagnostics.log_ratio_bound_fraction, 1.0)


# --------------------------------------------------------------------------------------------
# KL-Cov and Clip-Cov goldens (verl kl_cov / clip_cov)
# --------------------------------------------------------------------------------------------


def test_kl_cov_golden() -> None:
    # l = [-.4, -2.2, -1.5, -1.9], Delta = [.1, -.2, 0, .3], A = [2, -2, 2, -2], ratio .5,
    # coef 1: mean A = 0, mean l = -1.5, cov = A (l + 1.5) = [2.2, 1.4, 0, .8]; k = 2: t0, t1.
    # L = -A r + |Delta| sel = [-2 e^.1 + .1, 2 e^-.2 + .2, -2, 2 e^.3]; loss = sum / 4
    # = 0.1067093; grad = (-A r + sign(Delta) sel) / 4; verl's ppo_kl (mean |Delta|) = .6 / 4.
    log_probs = t([[-0.4, -2.2, -1.5, -1.9]])
    old = log_probs - t([[0.1, -0.2, 0.0, 0.3]])
    out, grad = both_paths(
        log_probs, old, t([[2.0, -2.0, 2.0, -2.0]]), torch.ones(1, 4).bool(),
        surrogate=KLCov(ratio=0.5, coef=1.0), log_ratio_bound=None,
    )  # fmt: skip
    e = math.exp
    assert_close(out.loss, (-2 * e(0.1) + 0.1 + 2 * e(-0.2) + 0.2 - 2 + 2 * e(0.3)) / 4)
    assert_close(grad, [[(-2 * e(0.1) + 1) / 4, (2 * e(-0.2) - 1) / 4, -0.5, 2 * e(0.3) / 4]])
    assert_close(out.diagnostics.selected_fraction, 0.5)
    assert_close(out.diagnostics.clipped_fraction, 0.0)


def test_kl_cov_sequence_mean_and_the_smallest_ratio() -> None:
    # ratio 2e-4 (verl's default): k = max(floor(4 * 2e-4), 1) = 1. l = [[-.4, -2.2], [-1.5,
    # -1.9]], Delta = [[.5, 0], [0, -1]], A = [[2, -2], [2, -2]], coef .1: cov = A (l + 1.5) =
    # [[2.2, 1.4], [0, .8]]: t00 penalised. seq-mean-token-mean: row 0 (-2 e^.5 + .05 + 2) / 2,
    # row 1 (-2 + 2 e^-1) / 2; loss = (-2 e^.5 + .05 + 2 e^-1) / 4 = -0.6279209 (verl divides
    # each row by n_i + 1e-8: -0.62792091160, 5e-9 relative from the exact value).
    log_probs = t([[-0.4, -2.2], [-1.5, -1.9]])
    old = log_probs - t([[0.5, 0.0], [0.0, -1.0]])
    out, grad = both_paths(
        log_probs, old, t([[2.0, -2.0], [2.0, -2.0]]), torch.ones(2, 2).bool(),
        surrogate=KLCov(), reduction="sequence_mean", log_ratio_bound=None,
    )  # fmt: skip
    assert_close(out.loss, (-2 * math.exp(0.5) + 0.05 + 2 * math.exp(-1)) / 4)
    assert_close(grad, [[(-2 * math.exp(0.5) + 0.1) / 4, 0.5], [-0.5, 2 * math.exp(-1) / 4]])
    assert_close(out.diagnostics.selected_fraction, 0.25)


def test_clip_cov_golden() -> None:
    # l = [-.5, -2.5, -1.5, -1.5], l_old = [-.5, -2, -1.5, -1.5], A = [2, -2, 2, -2]: mean A = 0,
    # mean l = -1.5, cov = [2, 2, 0, 0]; t1 is clipped by the band (r = e^-.5 < .8, A < 0):
    # not a candidate; candidates (1 < cov < 5): t0 only; k = 1: t0 detached, whatever the
    # draw. L = [0, max(2 e^-.5, 2 * .8) = 1.6, -2, 2]; loss = 1.6 / 4 = 0.4;
    # grad = [0, 0 (clipped), -.5, .5]; verl's pg_clipfrac = 1/4 (the detached token).
    out, grad = both_paths(
        t([[-0.5, -2.5, -1.5, -1.5]]), t([[-0.5, -2.0, -1.5, -1.5]]), t([[2.0, -2.0, 2.0, -2.0]]),
        torch.ones(1, 4).bool(), surrogate=ClipCov(), log_ratio_bound=None,
    )  # fmt: skip
    assert_close(out.loss, 0.4)
    assert_close(grad, [[0.0, 0.0, -0.5, 0.5]])
    d = out.diagnostics
    assert_close(d.selected_fraction, 0.25)  # verl's pg_clipfrac for clip_cov
    assert_close(d.clipped_fraction, 0.25)  # the band's meaning (Clip): t1 below .8
    assert_close(d.clip_fraction_low, 0.25)


def test_clip_cov_k_of_several() -> None:
    # Two rows of 3 selected tokens (N = 6), on-policy (r = 1), ratio .5: k = 3. mean A = 0,
    # mean l = -8.8 / 6; cov = A (l + 8.8 / 6) = [[1.9, 2.3, .7], [.7, 1.7, -.7]]: candidates
    # 1.9, 2.3, 1.7 (3 <= k: all detached). loss = (-1.5 - 1.5 + 1.5) / 6 = -.25;
    # grad = [[0, 0, -.25, 0], [-.25, 0, .25, 0]]; selected_fraction = 3 / 6.
    log_probs = t([[-0.2, -3.0, -1.0, -1.0], [-1.0, -2.6, -1.0, -9.0]])
    advantages = t([[1.5, -1.5, 1.5, 0.0], [1.5, -1.5, -1.5, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 1, 0]]).bool()
    out, grad = both_paths(log_probs, log_probs, advantages, mask, surrogate=ClipCov(ratio=0.5))
    assert_close(out.loss, -0.25)
    assert_close(grad, [[0.0, 0.0, -0.25, 0.0], [-0.25, 0.0, 0.25, 0.0]])
    assert_close(out.diagnostics.selected_fraction, 0.5)
    selection = cov_selection(log_probs, log_probs, advantages, mask, surrogate=ClipCov(ratio=0.5))
    assert selection.selected.tolist() == [[True, True, False, False], [False, True, False, False]]
    assert selection.candidates.equal(selection.selected) and int(selection.k) == 3


# --------------------------------------------------------------------------------------------
# M2PO goldens (AReaL _get_m2po_loss_mask, the kept-count denominator of ppo_actor_loss_fn)
# --------------------------------------------------------------------------------------------


def test_m2po_golden_decoupled_and_paper_denominator() -> None:
    # Delta = [.1, -.5, .3, .05, 1, .2], tau = .04: the squares sorted 1, .25, .09, .04, .01,
    # .0025; suffix means .2321, .0785, .035625 < .04: mask the 2 largest (t4, t1).
    # AReaL decoupled: r = 1 at the proximal point, A = [1, 2, -1, .5, 3, -2]:
    # loss = -(1 - 1 + .5 - 2) / |K| = 1.5 / 4 = .375; the paper's denominator (all 6 tokens):
    # 1.5 / 6 = .25; grad = -A / 4 at the kept tokens.
    delta = t([[0.1, -0.5, 0.3, 0.05, 1.0, 0.2]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    kept = m2po_mask(delta, mask, threshold=0.04)
    assert kept.tolist() == [[True, False, True, True, False, True]]
    assert kept.tolist() == reference.m2po_mask(delta, mask, 0.04)
    advantages = t([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]])
    log_probs = t([[-1.0] * 6])
    out, grad = both_paths(log_probs, log_probs, advantages, kept, surrogate=Clip(low=None))
    assert_close(out.loss, 0.375)
    assert_close(grad, [[-0.25, 0.0, 0.25, -0.125, 0.0, 0.5]])
    paper, _ = both_paths(
        log_probs, log_probs, advantages, kept, surrogate=Clip(low=None), normalizer=6
    )
    assert_close(paper.loss, 0.25)


def test_m2po_object_golden() -> None:
    # The object masks on the call's own Delta = l - l_old = [-.1, .5, -.3, -.05, -1, -.2]
    # (the squares of the test above: t1, t4 masked), then r A on the kept tokens / |K|:
    # loss = -(e^-.1 - e^-.3 + .5 e^-.05 - 2 e^-.2) / 4 = 0.2494569; grad = -A r / 4 at K.
    log_probs = t([[-1.1, -0.7, -1.0, -2.05, -1.3, -1.8]])
    old = t([[-1.0, -1.2, -0.7, -2.0, -0.3, -1.6]])
    advantages = t([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]])
    out, grad = both_paths(log_probs, old, advantages, torch.ones(1, 6).bool(), surrogate=M2PO())
    e = math.exp
    assert_close(out.loss, -(e(-0.1) - e(-0.3) + 0.5 * e(-0.05) - 2 * e(-0.2)) / 4)
    assert_close(grad, [[-e(-0.1) / 4, 0.0, e(-0.3) / 4, -0.5 * e(-0.05) / 4, 0.0, e(-0.2) / 2]])
    assert_close(out.diagnostics.selected_fraction, 2 / 6)  # the masked fraction
    # the diagnostics stay over the call's 6 tokens: k1 = mean(-Delta) = 1.15 / 6
    assert_close(out.diagnostics.approx_kl_k1, 1.15 / 6)


def test_m2po_edges() -> None:
    # (a) Delta = [.5, -.6], tau = .04: the suffix means .305, .25 are never below: AReaL keeps
    # one token (the smallest square). (b) Delta = [.5, .25, .25], tau = .0625: suffix means
    # .125, .0625, .0625 (strict <: none): the two largest are masked; the tie .25 = .25 masks
    # the earlier one (stable sort): t2 is kept. (c) padding is ignored: Delta = [.1, 3, .3, 0]
    # with t1 unselected: .09, .01, 0 -> the first suffix mean .0333 < .04: nothing masked.
    # (d) nothing selected: nothing kept.
    def kept(delta: list[float], tau: float, mask: list[bool] | None = None) -> list[list[bool]]:
        m = torch.tensor([mask or [True] * len(delta)])
        out = m2po_mask(t([delta]), m, threshold=tau).tolist()
        assert out == reference.m2po_mask(t([delta]), m, tau)
        return out

    assert kept([0.5, -0.6], 0.04) == [[True, False]]
    assert kept([0.5, 0.25, 0.25], 0.0625) == [[False, False, True]]
    assert kept([0.1, 3.0, 0.3, 0.0], 0.04, [True, False, True, True]) == [
        [True, False, True, True]
    ]
    assert kept([0.1, 0.2], 0.04, [False, False]) == [[False, False]]
    assert m2po_mask(torch.zeros(0, 3), torch.zeros(0, 3), threshold=0.1).shape == (0, 3)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 4),
    tokens=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
    threshold=st.sampled_from([0.01, 0.05, 0.2, 1.0]),
    ties=st.booleans(),
)
def test_m2po_mask_matches_reference(
    rows: int, tokens: int, seed: int, threshold: float, ties: bool
) -> None:
    # The greedy rule on random odd shapes (ties: values from a 3-value set, stable tie-break),
    # against the plain loop; the kept second moment is below tau unless one token is left.
    generator = torch.Generator().manual_seed(seed)
    delta = torch.randn(rows, tokens, generator=generator, dtype=F64) * 0.4
    if ties:
        delta = t([-0.25, 0.25, 0.1])[torch.randint(0, 3, (rows, tokens), generator=generator)]
    mask = torch.rand(rows, tokens, generator=generator) < 0.7
    kept = m2po_mask(delta, mask, threshold=threshold)
    assert kept.tolist() == reference.m2po_mask(delta, mask, threshold)
    assert bool((kept <= mask).all())
    if mask.any():
        assert int(kept.sum()) >= 1
        second = float((delta[kept] ** 2).mean())
        assert second < threshold or int(kept.sum()) == 1


# --------------------------------------------------------------------------------------------
# The device-side selections: KL-Cov's top-k, Clip-Cov's seeded draw
# --------------------------------------------------------------------------------------------


def test_kl_cov_ties_go_to_the_earlier_token() -> None:
    # GRPO's identical responses have identical (A, l): their covariances tie exactly. Rows 0
    # and 1 are the same response; k = 1 (ratio .2 of 5 tokens): the earlier one (row 0).
    log_probs = t([[-0.5, -2.0], [-0.5, -2.0], [-1.0, -1.5]])
    advantages = t([1.0, 1.0, -2.0])
    mask = t([[1, 1], [1, 1], [1, 0]]).bool()
    selection = cov_selection(log_probs, log_probs, advantages, mask, surrogate=KLCov(ratio=0.2))
    assert selection.selected.tolist() == [[True, False], [False, False], [False, False]]
    # ratio .4: k = 2, both copies
    selection = cov_selection(log_probs, log_probs, advantages, mask, surrogate=KLCov(ratio=0.4))
    assert selection.selected.tolist() == [[True, False], [True, False], [False, False]]


def _clip_cov_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(4, 9, generator=generator, dtype=F64) * 3
    advantages = torch.randn(4, 9, generator=generator, dtype=F64) * 2
    mask = torch.rand(4, 9, generator=generator) < 0.8
    return log_probs, advantages, mask


def test_clip_cov_draw_is_reproducible_and_a_uniform_subset() -> None:
    log_probs, advantages, mask = _clip_cov_batch()
    objective = ClipCov(ratio=0.1, cov_lb=-10.0, cov_ub=10.0)  # every unclipped token
    first = cov_selection(
        log_probs, log_probs, advantages, mask,
        surrogate=dataclasses.replace(objective, generator=torch.Generator().manual_seed(5)),
    )  # fmt: skip
    again = cov_selection(
        log_probs, log_probs, advantages, mask,
        surrogate=dataclasses.replace(objective, generator=torch.Generator().manual_seed(5)),
    )  # fmt: skip
    assert first.selected.equal(again.selected)  # the same generator state: the same draw
    n, k = int(first.candidates.sum()), int(first.k)
    assert int(first.selected.sum()) == min(k, n) and bool(
        (first.selected <= first.candidates).all()
    )
    assert k == max(int(0.1 * int(mask.sum())), 1)
    # the draw is the reference's splitmix64 of the seed and the tokens' ordinals
    seed = int(draw_seed(torch.Generator().manual_seed(5), torch.device("cpu")))
    tokens = reference._selected_tokens(mask)
    ordinals = {token: j for j, token in enumerate(tokens)}
    candidates = [tok for tok in tokens if bool(first.candidates[tok])]
    expected = reference.random_subset(candidates, ordinals, k, seed)
    assert {tok for tok in tokens if bool(first.selected[tok])} == expected
    # the default generator: reproducible under torch.manual_seed
    torch.manual_seed(11)
    global_first = cov_selection(log_probs, log_probs, advantages, mask, surrogate=objective)
    torch.manual_seed(11)
    global_again = cov_selection(log_probs, log_probs, advantages, mask, surrogate=objective)
    assert global_first.selected.equal(global_again.selected)


def test_clip_cov_draw_frequencies_are_uniform() -> None:
    # 3 candidates, k = 1, 1200 seeds: each candidate chosen 400 times in expectation (binomial
    # sd 16.3): every count within 5 sd (a false alarm has probability below 1e-5).
    candidates = t([[1, 0, 1, 1]]).bool()
    counts = torch.zeros(4)
    for seed in range(1200):
        chosen = random_subset(candidates, torch.ones(1, 4).bool(), t(1).long(), t(seed).long())
        counts += chosen[0].to(torch.float32)
    assert counts[1] == 0 and float(counts.sum()) == 1200
    assert bool(((counts[[0, 2, 3]] - 400).abs() < 5 * 16.33).all()), counts
    # splitmix64 on int64 with wrap-around: the reference's values
    values = torch.tensor([0, 1, -5, 2**62, -(2**63), 2**63 - 1])
    assert [int(v) for v in splitmix64(values)] == [reference.splitmix64(int(v)) for v in values]


def test_clip_cov_draw_is_the_same_packed_and_padded() -> None:
    log_probs, advantages, mask = _clip_cov_batch(1)
    objective = ClipCov(ratio=0.15, cov_lb=-10.0, cov_ub=10.0)
    padded = cov_selection(
        log_probs, log_probs, advantages, mask,
        surrogate=dataclasses.replace(objective, generator=torch.Generator().manual_seed(2)),
    )  # fmt: skip
    lengths = [9, 9, 9, 9]
    cu_seqlens = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    packed = cov_selection(
        log_probs.reshape(-1), log_probs.reshape(-1), advantages.reshape(-1), mask.reshape(-1),
        surrogate=dataclasses.replace(objective, generator=torch.Generator().manual_seed(2)),
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    assert packed.selected.reshape(4, 9).equal(padded.selected)
    # dropping the unselected tokens (a different packing of the same selected tokens)
    dense = cov_selection(
        log_probs[mask][None], log_probs[mask][None], advantages[mask][None],
        torch.ones(1, int(mask.sum()), dtype=torch.bool),
        surrogate=dataclasses.replace(objective, generator=torch.Generator().manual_seed(2)),
    )  # fmt: skip
    assert dense.selected[0].equal(padded.selected[mask])


def test_selections_compile_fullgraph() -> None:
    # The three selections in one compiled function (inductor, fullgraph: no graph break, no
    # host sync): the eager values for a given seed (the int64 hash wraps around in the
    # generated code as in eager), and the default generator's draw traced too (inductor draws
    # its own stream: reproducible under torch.manual_seed, not eager's numbers).
    log_probs, advantages, mask = _clip_cov_batch(2)
    from rlobjectives._core.selection import m2po_kept

    def select(
        lp: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, seed: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        kept = m2po_kept(torch.where(m, lp + 1.5, 0.0), m, 0.3)
        top = top_k(torch.where(m, adv * lp, -torch.inf), m, torch.tensor(3))
        drawn = random_subset(m & (adv > 0), m, torch.tensor(4), seed)
        fresh = random_subset(m & (adv > 0), m, torch.tensor(4), draw_seed(None, lp.device))
        return kept, top, drawn, stable_ranks(lp.reshape(-1), descending=True), fresh

    seed = torch.tensor(-(2**62) - 12345)
    eager = select(log_probs, advantages, mask, seed)
    compiled = torch.compile(select, fullgraph=True, dynamic=False)
    torch.manual_seed(3)
    traced = compiled(log_probs, advantages, mask, seed)
    for a, b in zip(eager[:4], traced[:4], strict=True):
        assert a.equal(b)
    torch.manual_seed(3)
    assert compiled(log_probs, advantages, mask, seed)[4].equal(traced[4])
    candidates = mask & (advantages > 0)
    assert int(traced[4].sum()) == min(4, int(candidates.sum()))
    assert bool((traced[4] <= candidates).all())


def test_selection_field_replaces_the_selection() -> None:
    log_probs, advantages, mask = _clip_cov_batch(3)
    old = log_probs + 0.05
    objective = KLCov(ratio=0.2, coef=0.5)
    selection = cov_selection(log_probs, old, advantages, mask, surrogate=objective)
    given = dataclasses.replace(objective, selection=selection.selected)
    for surrogate in (objective, given):
        out, _ = both_paths(log_probs, old, advantages, mask, surrogate=surrogate)
        assert_close(
            out.diagnostics.selected_fraction, float(selection.selected.sum() / mask.sum())
        )
    a = policy_loss(log_probs, old, advantages, mask, surrogate=objective).loss
    b = policy_loss(log_probs, old, advantages, mask, surrogate=given).loss
    assert_close(a, b)
    assert given == objective  # the selection is not part of equality
    # the wrong shape or device, at the call
    wrong = dataclasses.replace(objective, selection=torch.zeros(4, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^KLCov.selection must have the shape of the mask"):
        policy_loss(log_probs, old, advantages, mask, surrogate=wrong)
    meta = ClipCov(selection=torch.zeros(4, 9, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"^ClipCov.selection must be on the device of the mask"):
        policy_loss(log_probs, old, advantages, mask, surrogate=meta)
    # packed: the (N,) spelling of a (1, N) selection
    flat = dataclasses.replace(objective, selection=selection.selected.reshape(-1))
    packed = policy_loss(
        log_probs.reshape(-1), old.reshape(-1), advantages.reshape(-1), mask.reshape(-1),
        surrogate=flat, cu_seqlens=torch.tensor([0, 9, 18, 27, 36]),
    )  # fmt: skip
    assert_close(packed.loss, a)


# --------------------------------------------------------------------------------------------
# Peer parity on random float64 batches (tests/data/objectives24_peers.pt)
# --------------------------------------------------------------------------------------------

VERL_MODES = ("verl_dppo_tv", "verl_dppo_kl", "verl_dro", "verl_kl_cov", "verl_clip_cov")


def _verl_object(name: str, options: dict[str, Any], selected: torch.Tensor | None) -> Any:
    """The library object of a verl loss mode (the mapping reported for the verl preset)."""
    low = options.get("clip_ratio_low") or options.get("clip_ratio")
    high = options.get("clip_ratio_high") or options.get("clip_ratio")
    if name.startswith("verl_dppo"):
        return DPPO(name[-2:], low=low, high=high, ratio_cap=options.get("clip_ratio_c", 20.0))
    if name == "verl_dro":
        return DRO(beta=options["dro_beta"])
    if name == "verl_kl_cov":
        return KLCov(ratio=options["kl_cov_ratio"], coef=options["ppo_kl_coef"])
    return ClipCov(
        ratio=options["clip_cov_ratio"], low=low, high=high, cov_lb=options["clip_cov_lb"],
        cov_ub=options["clip_cov_ub"], selection=selected,
    )  # fmt: skip


@pytest.mark.parametrize("name", VERL_MODES)
def test_verl_parity(name: str) -> None:
    # verl 0.9.1's own loss, gradient and metrics on random float64 batches (masked positions
    # hold finite garbage: verl is not NaN-safe there). Clip-Cov: verl's randperm draw,
    # re-derived with the case's seed, handed over through ``selection`` (the verl preset's
    # path); the library's own draw is not verl's.
    data = PEERS[name]
    for index in range(len(data["loss_agg_mode"])):
        mask = data["response_mask"][index].bool()
        mode = data["loss_agg_mode"][index]
        selected = data["selected"][index] if name == "verl_clip_cov" else None
        surrogate = _verl_object(name, data["options"][index], selected)
        bound = 20.0 if name.startswith("verl_dppo") else None  # verl clamps DPPO's ratio only
        weights = data["rollout_is_weights"][index] if data["weighted"][index] else None
        reduction = VERL_AGGREGATIONS[mode](mask, {})  # the verl preset's loss_agg_mode table
        assert reduction.divisor == 1.0
        out, grad = both_paths(
            data["log_prob"][index], data["old_log_prob"][index], data["advantages"][index], mask,
            surrogate=surrogate, log_ratio_bound=bound, importance_weights=weights,
            reduction=reduction.reduction, normalizer=reduction.normalizer,
            max_response_length=reduction.max_response_length,
        )  # fmt: skip
        # verl divides each row of seq-mean-token-mean by n_i + 1e-8: 1e-8 relative
        tolerance = 1e-7 if mode == "seq-mean-token-mean" else 1e-12
        torch.testing.assert_close(out.loss, data["loss"][index], rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(grad, data["grad"][index], rtol=tolerance, atol=tolerance)
        count = float(mask.sum())
        verl = count / (count + 1e-8)  # verl's masked_mean divides by N + 1e-8
        metrics, d = data["metrics"], out.diagnostics
        if name.startswith("verl_dppo"):
            assert_close(d.clipped_fraction * verl, metrics["actor/pg_clipfrac"][index])
            assert_close(d.dual_clip_fraction * verl, metrics["actor/pg_clipfrac_lower"][index])
            assert_close(d.approx_kl_k1 * verl, metrics["actor/ppo_kl"][index])
        elif name == "verl_clip_cov":
            assert_close(d.selected_fraction * verl, metrics["actor/pg_clipfrac"][index])
            assert_close(d.approx_kl_k1 * verl, metrics["actor/ppo_kl"][index])
        elif name == "verl_dro":
            assert_close(d.approx_kl_k1 * verl, metrics["actor/ppo_kl"][index])
        else:  # kl_cov's ppo_kl is the mean |Delta|
            delta = data["log_prob"][index] - data["old_log_prob"][index]
            mean_abs = torch.where(mask, delta.abs(), 0.0).sum() / (count + 1e-8)
            assert_close(mean_abs, metrics["actor/ppo_kl"][index])


def test_verl_clip_cov_draw_replicated_from_its_candidates() -> None:
    # The verl preset's draw: randperm(n, generator seeded like torch.manual_seed) over the
    # row-major candidates of cov_selection, the first min(k, n): verl's selection exactly.
    data = PEERS["verl_clip_cov"]
    for index in range(len(data["seed"])):
        options = data["options"][index]
        mask = data["response_mask"][index].bool()
        selection = cov_selection(
            data["log_prob"][index], data["old_log_prob"][index], data["advantages"][index], mask,
            surrogate=_verl_object("verl_clip_cov", options, None), log_ratio_bound=None,
        )  # fmt: skip
        rows = torch.nonzero(selection.candidates)
        generator = torch.Generator().manual_seed(int(data["seed"][index]))
        chosen = rows[torch.randperm(len(rows), generator=generator)[: int(selection.k)]]
        drawn = torch.zeros_like(mask)
        drawn[chosen[:, 0], chosen[:, 1]] = True
        assert drawn.equal(data["selected"][index].bool())


def test_areal_m2po_parity() -> None:
    # AReaL: the M2PO mask on Delta = behaviour - proximal log-probs, then ppo_actor_loss_fn
    # (the plain r A, or the eps_clip band) at the proximal point over the kept tokens / |K|.
    data = PEERS["areal_m2po"]
    for index in range(len(data["threshold"])):
        mask = data["loss_mask"][index].bool()
        delta = data["behave_log_prob"][index] - data["prox_log_prob"][index]
        kept = m2po_mask(delta, mask, threshold=data["threshold"][index])
        assert kept.equal(data["m2_mask"][index].bool())
        eps = data["eps_clip"][index]
        surrogate = Clip(low=None) if eps is None else Clip(low=eps)
        prox = data["prox_log_prob"][index]
        out, grad = both_paths(prox, prox, data["advantages"][index], kept, surrogate=surrogate)
        torch.testing.assert_close(out.loss, data["loss"][index], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, data["grad"][index], rtol=1e-12, atol=1e-12)


def test_prime_rl_and_skyrl_dppo_parity() -> None:
    # prime-rl default_loss_fn = DPPO("tv", ratio_cap=None) without a bound, plus its
    # kl_tau (l - l_inf)^2 term on every loss token, summed per sample (normalizer 1 here).
    data = PEERS["prime_default_loss"]
    for index in range(len(data["kl_tau"])):
        mask = data["loss_mask"][index].bool()[None]
        log_probs = data["trainer_logprobs"][index][None]
        old = data["inference_logprobs"][index][None]
        surrogate = DPPO(
            "tv", low=data["dppo_mask_low"][index], high=data["dppo_mask_high"][index],
            ratio_cap=None,
        )  # fmt: skip
        leaf = log_probs.clone().requires_grad_(True)
        out = policy_loss(
            leaf, old, data["advantages"][index][None], mask, surrogate=surrogate,
            log_ratio_bound=None, normalizer=1,
        )  # fmt: skip
        kl = data["kl_tau"][index] * torch.where(mask, (leaf - old) ** 2, 0.0).sum()
        (grad,) = torch.autograd.grad(out.loss + kl, [leaf])
        torch.testing.assert_close(out.loss + kl, data["loss_sum"][index], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad[0], data["grad"][index], rtol=1e-12, atol=1e-12)
        assert_close(out.diagnostics.clipped_fraction, data["is_masked"][index])
    # SkyRL dppo_policy_loss (its ratio in float32: 1e-6), summed
    data = PEERS["skyrl_dppo"]
    for index in range(len(data["dppo_type"])):
        divergence = "tv" if data["dppo_type"][index] == "binary_tv" else "kl"
        surrogate = DPPO(
            divergence, low=data["delta_low"][index], high=data["delta_high"][index],
            ratio_cap=None,
        )  # fmt: skip
        out, grad = both_paths(
            data["log_probs"][index], data["old_log_probs"][index], data["advantages"][index],
            data["loss_mask"][index].bool(), surrogate=surrogate, normalizer=1,
        )  # fmt: skip
        torch.testing.assert_close(out.loss, data["loss_sum"][index], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, data["grad"][index], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# NaN at unselected positions, bf16 in float32, the micro-batch recipe of the selections
# --------------------------------------------------------------------------------------------

BATCH_LEVEL = [
    M2PO(threshold=0.1),
    M2PO(threshold=0.05, low=0.2, high=0.28),
    KLCov(ratio=0.3, coef=1.0),
    ClipCov(ratio=0.2, cov_lb=-1.0, cov_ub=3.0),  # a real draw: fresh generators below
]


def _fresh(surrogate: Any) -> Any:
    if isinstance(surrogate, ClipCov):
        return dataclasses.replace(surrogate, generator=torch.Generator().manual_seed(9))
    return surrogate


def _random_batch(seed: int, dtype: torch.dtype = F64) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    log_probs = -2 * torch.rand(5, 7, generator=generator, dtype=F64)
    old = log_probs + 0.3 * torch.randn(5, 7, generator=generator, dtype=F64)
    advantages = torch.randn(5, 7, generator=generator, dtype=F64)
    mask = torch.rand(5, 7, generator=generator) < 0.7
    mask[1] = False
    return log_probs.to(dtype), old.to(dtype), advantages.to(dtype), mask


@pytest.mark.parametrize("surrogate", BATCH_LEVEL, ids=repr)
def test_batch_level_nan_at_unselected_positions_reaches_nothing(surrogate: Any) -> None:
    # float64, bit for bit: the selections (means, sorts, draws) never read unselected values.
    log_probs, old, advantages, mask = _random_batch(4)
    results = []
    for fill in (0.0, math.nan, math.inf, -math.inf):
        leaf = torch.where(mask, log_probs, fill).requires_grad_(True)
        out = policy_loss(
            leaf, torch.where(mask, old, -fill), torch.where(mask, advantages, fill), mask,
            surrogate=_fresh(surrogate), entropy=torch.where(mask, 1.0, fill), entropy_coef=0.1,
            importance_weights=torch.where(mask, 1.5, fill), return_per_token=True,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(out.loss, [leaf])
        results.append((out.loss, grad, out.per_token_loss, *out.diagnostics))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("surrogate", [*BATCH_LEVEL, DPPO("kl"), DRO(beta=0.5)], ids=repr)
def test_bfloat16_is_computed_in_float32(surrogate: Any) -> None:
    # bf16 inputs: the float32 computation on the upcast inputs, rounded once (the selections
    # decide in float32 too).
    log_probs, old, advantages, mask = _random_batch(5, torch.bfloat16)
    outs = []
    for dtype in (torch.bfloat16, torch.float32):
        leaf = log_probs.to(dtype).requires_grad_(True)
        out = policy_loss(
            leaf, old.to(dtype), advantages.to(dtype), mask, surrogate=_fresh(surrogate),
            return_per_token=True,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(out.loss, [leaf])
        outs.append((out, grad))
    (low, low_grad), (high, high_grad) = outs
    assert low.loss.dtype == torch.bfloat16 and low_grad.dtype == torch.bfloat16
    torch.testing.assert_close(low.loss, high.loss.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(low_grad, high_grad.to(torch.bfloat16), rtol=0, atol=0)
    for a, b in zip(low.diagnostics, high.diagnostics, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("surrogate", BATCH_LEVEL, ids=repr)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_selection_once_per_mini_batch_is_split_invariant(surrogate: Any, reduction: str) -> None:
    # The recipe of docs/objectives/policy.md: select once on the mini-batch (M2PO: m2po_mask on
    # its log-ratio, then Clip on the kept tokens; Cov: cov_selection, then selection=), hand
    # each micro-batch its rows, normalise by the global count: the micro-batch losses and
    # gradients add up to the full call (a per-micro-batch selection would not).
    log_probs, old, advantages, mask = _random_batch(6)

    def objective(rows: slice, selection: Any) -> tuple[Any, dict[str, Any]]:
        if isinstance(surrogate, M2PO):
            kept = selection[rows]
            clip = (
                Clip(low=None)
                if surrogate.low is None
                else Clip(low=surrogate.low, high=surrogate.high)
            )
            return kept, {"surrogate": clip}
        return mask[rows], {"surrogate": dataclasses.replace(surrogate, selection=selection[rows])}

    if isinstance(surrogate, M2PO):
        selection = m2po_mask(log_probs - old, mask, threshold=surrogate.threshold)
        loss_mask = selection
    else:
        selection = cov_selection(
            log_probs, old, advantages, mask, surrogate=_fresh(surrogate)
        ).selected
        loss_mask = mask
    counts = {
        "token_mean": int(loss_mask.sum()),
        "sequence_mean": int((loss_mask.sum(-1) > 0).sum()),
    }
    full_mask, options = objective(slice(0, 5), selection)
    leaf = log_probs.clone().requires_grad_(True)
    full = policy_loss(leaf, old, advantages, full_mask, reduction=reduction, **options)
    (full_grad,) = torch.autograd.grad(full.loss, [leaf])
    # the full call with the object itself selects the same tokens
    direct = policy_loss(
        log_probs, old, advantages, mask, surrogate=_fresh(surrogate), reduction=reduction
    )
    assert_close(direct.loss, full.loss)
    total, grad = torch.zeros((), dtype=F64), torch.zeros_like(log_probs)
    for rows in (slice(0, 2), slice(2, 5)):
        micro_mask, options = objective(rows, selection)
        micro = log_probs[rows].clone().requires_grad_(True)
        out = policy_loss(
            micro, old[rows], advantages[rows], micro_mask, reduction=reduction,
            normalizer=max(counts[reduction], 1), **options,
        )  # fmt: skip
        total = total + out.loss.detach()
        grad[rows] = torch.autograd.grad(out.loss, [micro])[0]
    assert_close(total, full.loss)
    assert_close(grad, full_grad)


def test_selected_fraction_sums_over_micro_batches() -> None:
    # sum_diagnostics adds the new field like the others (with the global diagnostics_normalizer)
    log_probs, old, advantages, mask = _random_batch(7)
    objective = KLCov(ratio=0.3)
    selection = cov_selection(log_probs, old, advantages, mask, surrogate=objective).selected
    pieces = [
        policy_loss(
            log_probs[rows], old[rows], advantages[rows], mask[rows],
            surrogate=dataclasses.replace(objective, selection=selection[rows]),
            diagnostics_normalizer=int(mask.sum()),
        ).diagnostics
        for rows in (slice(0, 3), slice(3, 5))
    ]  # fmt: skip
    total = sum_diagnostics(pieces)
    assert_close(total.selected_fraction, float(selection.sum() / mask.sum()))
    full = policy_loss(log_probs, old, advantages, mask, surrogate=objective).diagnostics
    for a, b in zip(total, full, strict=True):
        assert_close(a, b)


def test_fused_from_hidden_takes_the_new_objects() -> None:
    # Token-local DPPO / DRO through the fused chunk loop (gradients formed in forward), the
    # batch-level ones by composition: both equal token_log_probs_from_hidden + policy_loss.
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(3, 5, 4, generator=generator, dtype=F64)
    weight = torch.randn(6, 4, generator=generator, dtype=F64)
    tokens = torch.randint(0, 6, (3, 5), generator=generator)
    old = -torch.rand(3, 5, generator=generator, dtype=F64) - 1.4
    advantages = torch.randn(3, generator=generator, dtype=F64)
    mask = torch.rand(3, 5, generator=generator) < 0.8
    weights = 2 * torch.rand(3, 5, generator=generator, dtype=F64)
    from rlobjectives import token_log_probs_from_hidden

    for surrogate in (DPPO(), DPPO("kl", ratio_cap=None), DRO(beta=0.3), *BATCH_LEVEL):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fused_policy_loss_from_hidden(
            h, w, tokens, old, advantages, mask, surrogate=_fresh(surrogate), chunk_size=4,
            importance_weights=weights, entropy_coef=0.05, reduction="sequence_mean",
        )  # fmt: skip
        grads = torch.autograd.grad(out.loss, [h, w])
        h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp = token_log_probs_from_hidden(h2, w2, tokens, mask=mask, return_entropy=True)
        expected = policy_loss(
            lp.log_probs, old, advantages, mask, surrogate=_fresh(surrogate),
            importance_weights=weights, entropy=lp.entropy, entropy_coef=0.05,
            reduction="sequence_mean",
        )  # fmt: skip
        assert_close(out.loss, expected.loss)
        for a, b in zip(grads, torch.autograd.grad(expected.loss, [h2, w2]), strict=True):
            assert_close(a, b)
        for a, b in zip(out.diagnostics, expected.diagnostics, strict=True):
            assert_close(a, b)


# --------------------------------------------------------------------------------------------
# nll_loss
# --------------------------------------------------------------------------------------------


def test_nll_golden() -> None:
    # The correct responses (rewards [1, 0, 1]) of l = [[-.5, -1, -2], [-.1, -.3, -9],
    # [-4, -4, -4]] with mask [[1, 1, 0], [1, 1, 1], [1, 0, 0]]: tokens (0,0), (0,1), (2,0).
    # token_mean (VAPO, NeMo-RL on one micro-batch): (.5 + 1 + 4) / 3 = 1.8333, grad -1/3;
    # sequence_mean (slime): ((.5 + 1) / 2 + 4) / 2 = 2.375; the sum (normalizer 1): 5.5.
    log_probs = t([[-0.5, -1.0, -2.0], [-0.1, -0.3, -9.0], [-4.0, -4.0, -4.0]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).bool()
    correct = mask & (t([1.0, 0.0, 1.0]) > 0)[:, None]
    loss = nll_loss(log_probs, correct)
    assert_close(loss, 5.5 / 3)
    (grad,) = torch.autograd.grad(loss, [log_probs])
    assert_close(grad, [[-1 / 3, -1 / 3, 0.0], [0.0, 0.0, 0.0], [-1 / 3, 0.0, 0.0]])
    assert_close(nll_loss(log_probs, correct, reduction="sequence_mean"), 2.375)
    assert_close(nll_loss(log_probs, correct, normalizer=1), 5.5)
    assert_close(nll_loss(log_probs, torch.zeros_like(mask)), 0.0)  # nothing selected: 0


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 4),
    tokens=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
    reduction=st.sampled_from(["token_mean", "sequence_mean", "sequence_sum_normalized",
                               "length_weighted", "none"]),
    normalizer=st.sampled_from([None, 3.0]),
)  # fmt: skip
def test_nll_matches_reference(
    rows: int, tokens: int, seed: int, reduction: str, normalizer: float | None
) -> None:
    generator = torch.Generator().manual_seed(seed)
    log_probs = -3 * torch.rand(rows, tokens, generator=generator, dtype=F64)
    mask = torch.rand(rows, tokens, generator=generator) < 0.6
    poisoned = torch.where(mask, log_probs, math.nan).requires_grad_(True)
    loss = nll_loss(poisoned, mask, reduction=reduction, normalizer=normalizer)
    leaf = log_probs.clone().requires_grad_(True)
    expected = reference.nll_loss(leaf, mask, reduction=reduction, normalizer=normalizer)
    assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss.sum(), [poisoned])
    expected_grad = torch.zeros_like(leaf)  # the reference's empty selection is a constant 0
    if expected.requires_grad:
        (expected_grad,) = torch.autograd.grad(expected.sum(), [leaf])
    assert torch.isfinite(grad).all()
    assert_close(grad, expected_grad)
    # float32 for bf16 input, rounded once
    low = nll_loss(log_probs.to(torch.bfloat16), mask, reduction=reduction, normalizer=normalizer)
    high = nll_loss(log_probs.to(torch.bfloat16).float(), mask, reduction=reduction,
                    normalizer=normalizer)  # fmt: skip
    torch.testing.assert_close(low, high.to(torch.bfloat16), rtol=0, atol=0)


def test_rl_plus_nll_recipe_is_micro_batch_invariant() -> None:
    # docs/objectives/policy.md, "RL + NLL on the correct responses" in one process: each term
    # with its own global normaliser (the policy loss: every token; the NLL: the correct ones),
    # the micro-batch losses summed equal one call on the whole batch (VAPO's token mean).
    # The distributed version (2 gloo ranks) is tests/distributed/test_global_selections.py.
    log_probs, old, advantages, mask = _random_batch(10)
    rewards = t([1.0, 0.0, 1.0, 1.0, 0.0])
    correct = mask & (rewards > 0)[:, None]
    mu = 0.1
    n_rl, n_ce = int(mask.sum()), int(correct.sum())

    def step(rows: slice, normalizers: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = log_probs[rows].clone().requires_grad_(True)
        rl_normalizer = None if normalizers is None else normalizers[0]
        rl = policy_loss(
            leaf,
            old[rows],
            advantages[rows],
            mask[rows],
            surrogate=DPPO(),
            normalizer=rl_normalizer,
        ).loss
        ce = nll_loss(
            leaf, correct[rows], normalizer=None if normalizers is None else normalizers[1]
        )
        total = rl + mu * ce
        return total.detach(), torch.autograd.grad(total, [leaf])[0]

    full, full_grad = step(slice(0, 5), None)
    total, grad = torch.zeros((), dtype=F64), torch.zeros_like(log_probs)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 5)):
        value, micro_grad = step(rows, (n_rl, n_ce))
        total, grad[rows] = total + value, micro_grad
    assert_close(total, full)
    assert_close(grad, full_grad)


def test_dppo_cap_below_one_weight_mean_over_the_selected_tokens() -> None:
    # Regression: the fused stage subtracted w = 1 per unselected token, but with c = 0.5 the
    # unselected tokens (r = 1) have w = min(1, 0.5) = 0.5. Every selected token here has
    # r = exp(0.01) (inside the trust region), so w = min(1.01005, 0.5) = 0.5 and
    # weight_mean = 0.5; 3 of the 8 positions are unselected (the old bug gave
    # (5 * 0.5 + 3 * 0.5 - 3) / 5 = 0.2).
    log_probs = torch.full((2, 4), -1.0)
    old = log_probs - 0.01
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    advantages = torch.tensor([1.0, -1.0])
    fused = policy_loss(log_probs, old, advantages, mask, surrogate=DPPO(ratio_cap=0.5))
    formula = policy_loss(log_probs, old, advantages, mask, surrogate=DPPO(ratio_cap=0.5))
    for out in (fused, formula):
        assert float(out.diagnostics.weight_mean) == pytest.approx(0.5, rel=1e-6)
