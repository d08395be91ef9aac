"""Tests of the rollout correction (rlobjectives.rollout.correction, _rollout_metrics, _off_policy).

Golden values are derived by hand from the peers' code (TRL 1.16 ``grpo_trainer.py``, verl
``rollout_corr_helper.py``, OpenRLHF ``models/loss.py``); the arithmetic is in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import eager_reference
import reference
from rlobjectives import (
    RolloutCorrection,
    RolloutCorrectionMetrics,
    aggregate,
    off_policy_sequence_mask,
    policy_loss,
    rollout_correction,
)
from rlobjectives.distributed import sum_diagnostics
from tolerances import assert_close

NAN, INF = float("nan"), float("inf")
METRICS = (
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "effective_sample_size",
    "truncated_fraction",
    "masked_fraction",
    "kl_k1",
    "kl_k3",
    "chi_square",
)


def _log_pair(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs and sampler log-probs whose ratio exp(l - l_rollout) is ``ratios``."""
    trainer = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=torch.float64)
    rollout = trainer - torch.tensor(ratios, dtype=torch.float64).log()
    return trainer, rollout


def _check_metrics(metrics: RolloutCorrectionMetrics, expected: dict[str, float]) -> None:
    summary = metrics.summary()
    assert set(summary) == set(METRICS)
    for name, value in expected.items():
        assert_close(summary[name], value)


def _check_against_reference(out: RolloutCorrection, expected: dict[str, object]) -> None:
    assert_close(out.weights, expected["weights"])
    assert torch.equal(out.mask, expected["mask"])  # type: ignore[arg-type]
    _check_metrics(out.metrics, expected["metrics"])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ verl goldens
# verl rollout_corr_helper: M = [[1,1,1],[1,1,0]], r = pi_train/pi_rollout =
# [[1.5,0.5,1],[4,0.75,.]] (pad ratio 9, never used); an empty third row with NaN/inf values
# must change nothing.
VERL_RATIOS = [[1.5, 0.5, 1.0], [4.0, 0.75, 9.0], [1.0, 1.0, 1.0]]
VERL_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)


def _verl_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    trainer, rollout = _log_pair(VERL_RATIOS)
    trainer[2] = torch.tensor([NAN, INF, -INF])
    rollout[1, 2], rollout[2] = NAN, torch.tensor([INF, NAN, 0.0])
    return trainer, rollout


def test_verl_rollout_is_token_truncate_golden() -> None:
    trainer, rollout = _verl_inputs()
    out = rollout_correction(trainer, rollout, VERL_MASK, upper=2.5)
    # w = min(r, 2.5) = [[1.5, 0.5, 1], [2.5, 0.75, 0]]; empty row 0
    assert_close(out.weights, [[1.5, 0.5, 1.0], [2.5, 0.75, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(out.mask, VERL_MASK)
    assert not out.weights.requires_grad and out.weights.dtype == torch.float64
    # raw mean (1.5+0.5+1+4+0.75)/5 = 1.55; ESS = 6.25^2 / (5 * 10.3125) = 0.7575758 (verl's
    # rollout_is_eff_sample_size); truncated: r = 4 > 2.5 -> 1/5 (verl ratio_fraction_high).
    # kl k1 = mean(-log r) = -ln(2.25)/5 = -0.1621860 (verl rollout_corr/kl); k3 = mean(r-1-ln r)
    # = (0.0945349+0.1931472+0+1.6137056+0.0376821)/5 = 0.3878140 (verl k3_kl); chi2 =
    # (2.25+0.25+1+16+0.5625)/5 - 1 = 3.0125 (verl chi2_token).
    _check_metrics(
        out.metrics,
        {
            "ratio_mean": 1.55,
            "ratio_min": 0.5,
            "ratio_max": 4.0,
            "effective_sample_size": 6.25**2 / (5 * 10.3125),
            "truncated_fraction": 0.2,
            "masked_fraction": 0.0,
            "kl_k1": -math.log(2.25) / 5,
            "kl_k3": sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 4.0, 0.75)) / 5,
            "chi_square": 3.0125,
        },
    )
    assert abs(float(out.metrics.kl_k3) - 0.3878140) < 1e-7


def test_verl_rollout_is_sequence_truncate_golden() -> None:
    trainer, rollout = _verl_inputs()
    out = rollout_correction(trainer, rollout, VERL_MASK, level="sequence", upper=2.5)
    # row products 0.75 and 3 -> min(., 2.5): [[0.75]*3, [2.5, 2.5, 0]]
    assert_close(out.weights, [[0.75, 0.75, 0.75], [2.5, 2.5, 0.0], [0.0, 0.0, 0.0]])
    # raw max 3.0 (verl reports the untruncated rollout_is_max); token-weighted raw mean
    # (3*0.75 + 2*3)/5 = 1.65; ESS = 7.25^2/(5*(3*0.5625 + 2*6.25)) = 52.5625/70.9375 = 0.7409692;
    # the two tokens of row 2 are truncated: 2/5.
    _check_metrics(
        out.metrics,
        {
            "ratio_mean": 1.65,
            "ratio_min": 0.75,
            "ratio_max": 3.0,
            "effective_sample_size": 52.5625 / 70.9375,
            "truncated_fraction": 0.4,
            "chi_square": (3 * 0.5625 + 2 * 9.0) / 5 - 1,
        },
    )


def test_verl_icepop_golden() -> None:
    trainer, rollout = _verl_inputs()
    out = rollout_correction(trainer, rollout, VERL_MASK, mode="mask", lower=0.6, upper=2.5)
    # "0.6_2.5": r = 0.5 and 4 are out of band -> 0; mask unchanged
    assert_close(out.weights, [[1.5, 0.0, 1.0], [0.0, 0.75, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(out.mask, VERL_MASK)
    # rollout_is_oob_ratio 2/5 = 0.4; ESS = 3.25^2/(5*3.8125) = 0.4225/0.7625 = 0.5540984
    _check_metrics(
        out.metrics,
        {
            "masked_fraction": 0.4,
            "truncated_fraction": 0.0,
            "effective_sample_size": 0.4225 / 0.7625,
        },
    )


def test_verl_rollout_rs_golden() -> None:
    trainer, rollout = _verl_inputs()
    # token_k1 "0.6_1.8" bounds 1/r: keep 1/1.8 <= r <= 1/0.6 -> r = 0.5 and 4 rejected
    out = rollout_correction(
        trainer, rollout, VERL_MASK, mode="reject", lower=1 / 1.8, upper=1 / 0.6
    )
    expected_mask = torch.tensor([[1, 0, 1], [0, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(out.mask, expected_mask)
    assert_close(out.weights, expected_mask.double())  # w = 1 where kept, 0 elsewhere
    # rollout_rs_masked_fraction 0.4; ESS = 3^2/(5*3) = 0.6 (the kept fraction)
    _check_metrics(out.metrics, {"masked_fraction": 0.4, "effective_sample_size": 0.6})
    # seq_sum_k1 "0.5_2.0": row products 0.75 (kept) and 3 (rejected, whole row)
    out = rollout_correction(
        trainer, rollout, VERL_MASK, level="sequence", mode="reject", lower=0.5, upper=2.0
    )
    assert torch.equal(out.mask, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.bool))
    _check_metrics(out.metrics, {"masked_fraction": 0.4})
    # seq_mean_k1 (geometric) "0.5_2.0": row geometric means 0.75^(1/3) = 0.9086 and
    # sqrt(3) = 1.7321: both kept; with "0.5_1.5" row 2 is rejected.
    kept = rollout_correction(
        trainer, rollout, VERL_MASK, level="geometric", mode="reject", lower=0.5, upper=2.0
    )
    assert torch.equal(kept.mask, VERL_MASK)
    _check_metrics(kept.metrics, {"ratio_max": math.sqrt(3.0), "ratio_min": 0.75 ** (1 / 3)})
    out = rollout_correction(
        trainer, rollout, VERL_MASK, level="geometric", mode="reject", lower=0.5, upper=1.5
    )
    assert torch.equal(out.mask, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.bool))


def test_verl_token_veto_golden() -> None:
    trainer, rollout = _verl_inputs()
    # The former rollout_token_veto_threshold = 0.6: row 1 has r = 0.5 < 0.6 -> the whole row
    # leaves the mask; row 2 (min r 0.75) stays, truncated at 2.5.
    out = rollout_correction(trainer, rollout, VERL_MASK, upper=2.5, veto=0.6)
    assert torch.equal(out.mask, torch.tensor([[0, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool))
    assert_close(out.weights, [[0.0, 0.0, 0.0], [2.5, 0.75, 0.0], [0.0, 0.0, 0.0]])
    # masked 3/5, truncated 1/5 (only surviving tokens count as truncated)
    _check_metrics(out.metrics, {"masked_fraction": 0.6, "truncated_fraction": 0.2})


def test_veto_compares_the_unclamped_log_ratio() -> None:
    # A token with r = 1e-12 (log r = -27.6, beyond the -20 clamp) and veto 1e-10 (log -23.0):
    # verl's veto compares log r < log(veto) before any clamp, so the row is removed.
    trainer, rollout = _log_pair([[1e-12, 1.0], [0.5, 1.0]])
    out = rollout_correction(trainer, rollout, [[1, 1], [1, 1]], upper=None, veto=1e-10)
    assert out.mask.tolist() == [[False, False], [True, True]]
    assert_close(out.weights, [[0.0, 0.0], [0.5, 1.0]])


@pytest.mark.parametrize("mode", ["truncate", "mask", "reject"])
def test_band_edges_are_inclusive(mode: str) -> None:
    # r = 1 exactly (equal log-probs) with lower = upper = 1: inside the closed band (TRL masks
    # r < min or r > max strictly, OpenRLHF and verl keep min <= r <= max).
    out = rollout_correction(
        [[-1.0, -1.0]], [[-1.0, -2.0]], [[1, 1]], mode=mode, lower=1.0, upper=1.0
    )
    assert out.mask.tolist() == [[True, mode != "reject"]]
    expected = {"truncate": [[1.0, 1.0]], "mask": [[1.0, 0.0]], "reject": [[1.0, 0.0]]}[mode]
    assert_close(out.weights, expected)
    assert float(out.metrics.truncated_fraction) == (0.5 if mode == "truncate" else 0.0)
    assert float(out.metrics.masked_fraction) == (0.0 if mode == "truncate" else 0.5)


# ------------------------------------------------------------------------------- TRL goldens
# TRL 1.16 _generate_and_score_completions: diff = (old - sampling) * mask, ratio exp(diff)
# (token) or exp(sum diff) (sequence), then clamp (truncate) or masked_fill 0 outside (mask).
# The TRL golden batch: Delta = old - sampling = [[0.3, -0.1, 0.0], [-0.4, 0.1, (pad)]].
TRL_DELTA = torch.tensor([[0.3, -0.1, 0.0], [-0.4, 0.1, 0.7]], dtype=torch.float64)
TRL_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def test_trl_vllm_importance_sampling_modes_golden() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], dtype=torch.float64)
    sampling = old - TRL_DELTA
    e = math.exp
    # token_truncate, clip_max 1.2: [[min(e^.3, 1.2), e^-.1, 1], [e^-.4, e^.1]]
    out = rollout_correction(old, sampling, TRL_MASK, upper=1.2)
    assert_close(out.weights, [[1.2, e(-0.1), 1.0], [e(-0.4), e(0.1), 0.0]])
    # token_truncate with clip_min 0.7 as well: e^-.4 = 0.6703 -> 0.7
    out = rollout_correction(old, sampling, TRL_MASK, upper=1.2, lower=0.7)
    assert_close(out.weights, [[1.2, e(-0.1), 1.0], [0.7, e(0.1), 0.0]])
    # token_mask, [0.7, 1.3]: e^.3 = 1.3499 > 1.3 and e^-.4 < 0.7 -> 0
    out = rollout_correction(old, sampling, TRL_MASK, mode="mask", upper=1.3, lower=0.7)
    assert_close(out.weights, [[0.0, e(-0.1), 1.0], [0.0, e(0.1), 0.0]])
    # sequence_truncate, clip_max 1.2: sums 0.2, -0.3 -> [min(e^.2, 1.2), e^-.3] = [1.2, 0.7408]
    out = rollout_correction(old, sampling, TRL_MASK, level="sequence", upper=1.2)
    assert_close(out.weights, [[1.2, 1.2, 1.2], [e(-0.3), e(-0.3), 0.0]])
    # sequence_mask (TRL's default mode) with clip_max 3 (TRL's default): both rows kept
    out = rollout_correction(old, sampling, TRL_MASK, level="sequence", mode="mask", upper=3.0)
    assert_close(out.weights, [[e(0.2)] * 3, [e(-0.3), e(-0.3), 0.0]])
    # sequence_mask with clip_max 1.2: row 1 (e^.2 = 1.2214) zeroed, but it stays in the mask
    out = rollout_correction(old, sampling, TRL_MASK, level="sequence", mode="mask", upper=1.2)
    assert_close(out.weights, [[0.0] * 3, [e(-0.3), e(-0.3), 0.0]])
    assert torch.equal(out.mask, TRL_MASK)


def test_trl_loss_with_the_vllm_ratio_golden() -> None:
    # TRL golden (verified by running _compute_loss): dapo with importance_sampling_ratio
    # [[0.9, 1.5, 1.0], [0.0, 1.2, .]] multiplied into the per-token loss:
    # (-1.2*0.9 - 0.9048374*1.5 - 1.0 + 0.4*0 + 0.5525855*1.2) / 5 = -0.5548307152.
    # token_mask with [0.5, 1.6] and sampler ratios [[0.9, 1.5, 1.0], [0.3, 1.2]] gives it.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], dtype=torch.float64)
    old = logp - TRL_DELTA
    sampling = old - torch.tensor([[0.9, 1.5, 1.0], [0.3, 1.2, 1.0]], dtype=torch.float64).log()
    correction = rollout_correction(old, sampling, TRL_MASK, mode="mask", lower=0.5, upper=1.6)
    assert_close(correction.weights, [[0.9, 1.5, 1.0], [0.0, 1.2, 0.0]])
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    per_token = policy_loss(logp, old, advantages, TRL_MASK, return_per_token=True).per_token_loss
    assert per_token is not None
    loss = aggregate(per_token * correction.weights, correction.mask, normalizer=5)
    assert_close(loss, -0.5548307152)


# --------------------------------------------------------------------------- OpenRLHF goldens
# OpenRLHF PolicyLoss (ppo): rho = exp(old - rollout) = [[8, 4, 6], [2, 0.4, (pad 100)]],
# vllm_is_truncated_threshold [0.5, 5]; per-token PPO losses of its golden batch
# (r = [[1.5, 0.7, 1.0], [0.5, 3.0]], A = [[1]*3, [-2]*3], eps 0.2):
# [[-1.2, -0.7, -1.0], [1.6, 6.0]].
OPENRLHF_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def _openrlhf_loss(weights: torch.Tensor) -> torch.Tensor:
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = old + torch.tensor([[1.5, 0.7, 1.0], [0.5, 3.0, 10.0]], dtype=torch.float64).log()
    advantages = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    out = policy_loss(logp, old, advantages, OPENRLHF_MASK, return_per_token=True)
    assert out.per_token_loss is not None
    return aggregate(out.per_token_loss * weights, OPENRLHF_MASK)


def test_openrlhf_tis_icepop_seq_mask_tis_golden() -> None:
    old, rollout = _log_pair([[8.0, 4.0, 6.0], [2.0, 0.4, 100.0]])
    # tis: clamp(rho, 0.5, 5) = [[5, 4, 5], [2, 0.5]] -> (-6 - 2.8 - 5 + 3.2 + 3)/5 = -1.52
    tis = rollout_correction(old, rollout, OPENRLHF_MASK, lower=0.5, upper=5.0)
    assert_close(tis.weights, [[5.0, 4.0, 5.0], [2.0, 0.5, 0.0]])
    assert_close(_openrlhf_loss(tis.weights), -1.52)
    # icepop: rho in [0.5, 5] else 0 = [[0, 4, 0], [2, 0]] -> (-2.8 + 3.2)/5 = 0.08
    icepop = rollout_correction(old, rollout, OPENRLHF_MASK, mode="mask", lower=0.5, upper=5.0)
    assert_close(icepop.weights, [[0.0, 4.0, 0.0], [2.0, 0.0, 0.0]])
    assert_close(_openrlhf_loss(icepop.weights), 0.08)
    # seq-mask-tis: geometric means (8*4*6)^(1/3) = 5.769 > 5 (row 1 filtered) and
    # sqrt(2*0.4) = 0.894 (kept); weight = untruncated token ratio [2, 0.4] -> (3.2 + 2.4)/5 = 1.12
    gate = rollout_correction(
        old, rollout, OPENRLHF_MASK, level="geometric", mode="reject", lower=0.5, upper=5.0
    )
    ratio = rollout_correction(old, rollout, OPENRLHF_MASK, mode="truncate", upper=None)
    weights = gate.weights * ratio.weights
    assert_close(weights, [[0.0, 0.0, 0.0], [2.0, 0.4, 0.0]])
    assert_close(_openrlhf_loss(weights), 1.12)
    # vllm_kl = mean(rollout - old) = -(ln8+ln4+ln6+ln2+ln0.4)/5 = -1.0068704 (our kl_k1)
    assert_close(tis.metrics.kl_k1, -math.log(8 * 4 * 6 * 2 * 0.4) / 5)


# --------------------------------------------------------------------------- edge cases
def test_empty_batch_and_all_masked_give_zeros() -> None:
    for shape in [(0, 0), (0, 3), (2, 0), (2, 3)]:
        values = torch.full(shape, NAN)
        out = rollout_correction(values, values, torch.zeros(shape, dtype=torch.bool), veto=0.1)
        assert out.weights.shape == shape and not out.mask.any()
        assert torch.equal(out.weights, torch.zeros(shape))
        for name, value in out.metrics.summary().items():
            assert float(value) == 0.0, name


def test_nan_inf_at_unselected_positions_reach_nothing() -> None:
    generator = torch.Generator().manual_seed(3)
    trainer = -torch.rand(4, 6, generator=generator, dtype=torch.float64)
    rollout = trainer + 0.5 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=generator) < 0.6
    mask[1] = False
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask", "reject"):
            options = {"level": level, "mode": mode, "lower": 0.8, "upper": 1.4, "veto": 0.5}
            clean = rollout_correction(trainer, rollout, mask, **options)  # type: ignore[arg-type]
            for poison in (NAN, INF, -INF):
                out = rollout_correction(
                    torch.where(mask, trainer, poison),
                    torch.where(mask, rollout, poison),
                    mask,
                    **options,  # type: ignore[arg-type]
                )
                assert torch.equal(out.weights, clean.weights)
                assert torch.equal(out.mask, clean.mask)
                for got, want in zip(out.metrics, clean.metrics, strict=True):
                    assert torch.equal(got, want)


def test_missing_sampler_log_prob_counts_as_ratio_one() -> None:
    # TRL >= 1.16: a NaN sampler log-prob (vLLM returned None) gives a zero difference.
    out = rollout_correction([[0.0, 0.0]], [[NAN, -0.5]], [[1, 1]], level="sequence", upper=None)
    assert_close(out.weights, [[math.exp(0.5), math.exp(0.5)]])
    # extreme log-ratios are clamped to +-20 before exp, every level
    out = rollout_correction([[0.0, 0.0]], [[-INF, -30.0]], [[1, 1]], upper=None)
    assert_close(out.weights, [[math.exp(20.0)] * 2], torch.float32)
    assert torch.isfinite(out.metrics.kl_k3) and torch.isfinite(out.metrics.chi_square)


def test_inputs_are_not_modified_and_weights_carry_no_gradient() -> None:
    trainer = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, NAN]])
    before = rollout.clone()
    out = rollout_correction(trainer, rollout, [[1, 1]], level="geometric")
    assert not out.weights.requires_grad
    assert all(not value.requires_grad for value in out.metrics)
    assert torch.equal(rollout.isnan(), before.isnan())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_float32(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    trainer = (-torch.rand(3, 8, generator=generator) * 2).to(dtype)
    rollout = (trainer.float() + 0.4 * torch.randn(3, 8, generator=generator)).to(dtype)
    mask = torch.rand(3, 8, generator=generator) < 0.7
    for level in ("token", "sequence", "geometric"):
        out = rollout_correction(trainer, rollout, mask, level=level, upper=1.5, lower=0.7)
        assert out.weights.dtype == torch.float32
        expected = reference.rollout_correction(
            trainer.double(), rollout.double(), mask, level=level, upper=1.5, lower=0.7
        )
        assert_close(out.weights, expected["weights"], torch.float32)
        for name, value in expected["metrics"].items():  # type: ignore[attr-defined]
            assert_close(out.metrics.summary()[name], value, torch.float32)


# ---------------------------------------------------------------------- float64 reference
bounds = st.sampled_from([(None, 2.0), (0.5, 2.0), (0.8, 1.25), (None, None), (0.9, None)])


@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 7)),
    seed=st.integers(0, 2**16),
    level=st.sampled_from(["token", "sequence", "geometric"]),
    mode=st.sampled_from(["truncate", "mask", "reject"]),
    band=bounds,
    veto=st.sampled_from([None, 0.3, 0.7]),
    scale=st.sampled_from([0.1, 0.5, 3.0, 30.0]),
)
def test_matches_reference(
    shape: tuple[int, int],
    seed: int,
    level: str,
    mode: str,
    band: tuple[float | None, float | None],
    veto: float | None,
    scale: float,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    rollout = trainer + scale * torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    mask[0] = False  # an empty row
    lower, upper = band
    options = {"level": level, "mode": mode, "lower": lower, "upper": upper, "veto": veto}
    out = rollout_correction(trainer, rollout, mask, **options)  # type: ignore[arg-type]
    expected = reference.rollout_correction(trainer, rollout, mask, **options)  # type: ignore[arg-type]
    _check_against_reference(out, expected)


def test_bounds_as_tensors_and_numpy_lists() -> None:
    import numpy as np

    trainer, rollout = _log_pair([[1.5, 0.5, 1.0], [4.0, 0.75, 9.0]])
    mask = [[1, 1, 1], [1, 1, 0]]
    expected = rollout_correction(trainer, rollout, mask, mode="mask", lower=0.6, upper=2.5)
    got = rollout_correction(
        trainer.numpy(),
        np.asarray(rollout.tolist()),
        mask,
        mode="mask",
        lower=torch.tensor(0.6),
        upper=torch.tensor(2.5, dtype=torch.float64),
        veto=torch.tensor(0.01),
    )
    assert_close(got.weights, expected.weights)


@pytest.mark.parametrize(
    ("level", "mode"), [("token", "truncate"), ("sequence", "mask"), ("geometric", "reject")]
)
def test_eager_benchmark_baseline_agrees(level: str, mode: str) -> None:
    # tests/eager_reference.rollout_correction is the benchmark baseline: it must compute the same
    generator = torch.Generator().manual_seed(7)
    trainer = -torch.rand(6, 11, generator=generator)
    rollout = trainer + 0.3 * torch.randn(6, 11, generator=generator)
    mask = torch.rand(6, 11, generator=generator) < 0.7
    options = {"level": level, "mode": mode, "lower": 0.8, "upper": 1.3}
    weights, keep, metrics = eager_reference.rollout_correction(trainer, rollout, mask, **options)  # type: ignore[arg-type]
    out = rollout_correction(trainer, rollout, mask, **options)  # type: ignore[arg-type]
    assert_close(out.weights, weights)
    assert torch.equal(out.mask, keep)
    for name, value in metrics.items():
        assert_close(out.metrics.summary()[name], value)


# ------------------------------------------------------------------- micro-batches and ranks
def test_micro_batches_give_the_full_batch_weights_and_metrics() -> None:
    generator = torch.Generator().manual_seed(11)
    trainer = -torch.rand(7, 9, generator=generator, dtype=torch.float64)
    rollout = trainer + 0.6 * torch.randn(7, 9, generator=generator, dtype=torch.float64)
    mask = torch.rand(7, 9, generator=generator) < 0.6
    mask[2] = False
    splits = [[0, 1, 2], [3], [2], [4, 5, 6]]  # [2] alone: an empty micro-batch
    for level in ("token", "sequence", "geometric"):
        full = rollout_correction(trainer, rollout, mask, level=level, mode="mask", lower=0.7)
        pieces = [
            rollout_correction(trainer[r], rollout[r], mask[r], level=level, mode="mask", lower=0.7)
            for r in splits
        ]
        rows = [0, 1, 2, 3, 4, 5, 6]
        stacked = torch.cat([p.weights for k, p in enumerate(pieces) if k != 2])
        assert torch.equal(stacked, full.weights[rows])
        combined = sum_diagnostics([p.metrics for p in pieces])
        assert isinstance(combined, RolloutCorrectionMetrics)
        for name, value in full.metrics.summary().items():
            assert_close(combined.summary()[name], value)
        assert float(combined.ratio_min) == float(full.metrics.ratio_min) > 0


def test_sum_diagnostics_of_empty_pieces_only() -> None:
    empty = rollout_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    combined = sum_diagnostics([empty.metrics, empty.metrics])
    assert float(combined.ratio_min) == 0.0 and float(combined.ratio_max) == 0.0


# --------------------------------------------------------------------------------- errors
def test_errors_name_the_argument() -> None:
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    cases = [
        (
            {"level": "seq"},
            ValueError,
            r"level must be one of \['token', 'sequence', 'geometric'\]",
        ),
        ({"mode": "clip"}, ValueError, r"mode must be one of \['truncate', 'mask', 'reject'\]"),
        ({"upper": 0.0}, ValueError, "upper must be > 0.0, got 0.0"),
        ({"upper": INF}, ValueError, "upper must be finite, got inf"),
        ({"lower": -0.1}, ValueError, "lower must be >= 0.0, got -0.1"),
        ({"lower": 3.0}, ValueError, "lower must be <= upper, got lower=3.0 and upper=2.0"),
        ({"veto": 0}, ValueError, "veto must be > 0.0, got 0.0"),
        ({"upper": "2"}, TypeError, "upper must be a real number, got str"),
        ({"veto": torch.ones(2)}, TypeError, "veto must be a real number or a 0-d real tensor"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            rollout_correction(x, x, mask, **options)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"rollout_log_probs must have the same shape as log_probs"
    ):
        rollout_correction(x, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match=r"mask must have the same shape as log_probs \(2, 3\)"):
        rollout_correction(x, x, torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"log_probs must have shape \(B, T\)"):
        rollout_correction(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(TypeError, match="rollout_log_probs must contain only numbers"):
        rollout_correction(x, [["a"]], mask)


# ------------------------------------------------------------------ off-policy sequence mask
def test_off_policy_sequence_mask_trl_golden() -> None:
    # TRL golden batch, sampling = old: mean_t M(old - logp): row 1 mean(-0.3, 0.1, 0) = -0.0667
    # (A = 1 >= 0: kept anyway); row 2 mean(0.4, -0.1) = 0.15 > 0.1 with A = -0.5 < 0: dropped.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], dtype=torch.float64)
    old = logp - TRL_DELTA
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    keep = off_policy_sequence_mask(logp, old, advantages, TRL_MASK, threshold=0.1)
    assert torch.equal(keep, torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool))
    assert torch.equal(
        off_policy_sequence_mask(logp, old, advantages, TRL_MASK, threshold=0.0), keep
    )
    assert torch.equal(
        off_policy_sequence_mask(logp, old, advantages, TRL_MASK, threshold=0.2), TRL_MASK
    )
    # TRL dapo with the mask multiplied in (denominator keeps M): -3.1048374/5 = -0.6209674836
    per_token = policy_loss(logp, old, advantages, TRL_MASK, return_per_token=True).per_token_loss
    assert per_token is not None
    assert_close(aggregate(per_token * keep, TRL_MASK), -0.6209674836)
    # (B, 1) and (B, T) advantages broadcast as in TRL; NaN sampler log-prob counts as 0
    assert torch.equal(
        off_policy_sequence_mask(logp, old, advantages.unsqueeze(1), TRL_MASK, threshold=0.1), keep
    )
    per_token_advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, 0.5, -0.5]])
    assert torch.equal(
        off_policy_sequence_mask(logp, old, per_token_advantages, TRL_MASK, threshold=0.1),
        torch.tensor([[1, 1, 1], [0, 1, 0]], dtype=torch.bool),
    )
    nan_old = old.clone()
    nan_old[1, 0] = NAN  # row 2 mean (0 - 0.1)/2 = -0.05 <= 0.1: kept
    assert torch.equal(
        off_policy_sequence_mask(logp, nan_old, advantages, TRL_MASK, threshold=0.1), TRL_MASK
    )


@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 7)), seed=st.integers(0, 2**16))
def test_off_policy_sequence_mask_matches_reference(shape: tuple[int, int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=generator, dtype=torch.float64)
    sampling = logp + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape[0], generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    threshold = float(torch.rand((), generator=generator)) * 0.2 - 0.05
    poisoned = torch.where(mask, sampling, torch.tensor(NAN, dtype=torch.float64))
    got = off_policy_sequence_mask(logp, poisoned, advantages, mask, threshold=threshold)
    expected = reference.off_policy_sequence_mask(
        logp, sampling, advantages, mask, threshold=threshold
    )
    assert torch.equal(got, expected)


def test_off_policy_sequence_mask_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"advantages must have shape \(B,\), \(B, 1\) or \(B, T\)"
    ):
        off_policy_sequence_mask(x, x, torch.zeros(3), torch.ones(2, 3), threshold=0.1)
    with pytest.raises(ValueError, match="threshold must be finite, got nan"):
        off_policy_sequence_mask(x, x, torch.zeros(2), torch.ones(2, 3), threshold=NAN)
    with pytest.raises(ValueError, match="sampling_log_probs must have the same shape"):
        off_policy_sequence_mask(
            x, torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3), threshold=0
        )
    with pytest.raises(
        TypeError, match="off_policy_sequence_mask\\(\\) missing 1 required keyword"
    ):
        off_policy_sequence_mask(x, x, torch.zeros(2), torch.ones(2, 3))  # type: ignore[call-arg]


# ------------------------------------------------------------------------------- compile
@pytest.mark.compile
def test_traces_without_graph_breaks() -> None:
    trainer, rollout = _verl_inputs()
    compiled = torch.compile(rollout_correction, fullgraph=True, dynamic=False)
    options = {"level": "sequence", "mode": "reject", "lower": 0.5, "upper": 2.0, "veto": 0.6}
    got = compiled(trainer, rollout, VERL_MASK, **options)
    expected = rollout_correction(trainer, rollout, VERL_MASK, **options)  # type: ignore[arg-type]
    assert torch.equal(got.weights, expected.weights) and torch.equal(got.mask, expected.mask)
    for a, b in zip(got.metrics, expected.metrics, strict=True):
        assert_close(a, b)
