"""Peer presets, the family rows: TRL cispo / sapo / vespo, the entropy mask, the entropy bonus,
the off-policy mask and ``delta <= 1 + epsilon_high``; verl cispo / sapo / geo_mean; OpenRLHF's
vLLM IS correction (tis / icepop / seq-mask-tis).

Golden values are the peers' own numbers on the small batches of ``tests/test_presets.py``
(TRL: Δ = [[0.3, -0.1, 0], [-0.4, 0.1, ·]], A = [1, -0.5]; verl: r = [[1.5, 0.5, 1], [4, 0.75,
·]], A = ±1; OpenRLHF: r = [[1.5, 0.7, 1], [0.5, 3, ·]], A = [1, -2]); the arithmetic is in the
comments. The float64 references of ``tests/reference.py`` are compared on random batches with
padding, an empty row and NaN at unselected positions, values and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_presets import (
    _openrlhf_batch,
    _random_batch,
    _trl_batch,
    _verl_batch,
    _with_nan_padding,
)

import reference as ref
from rlobjectives.presets import openrlhf_policy_loss, trl_grpo_loss, verl_policy_loss
from tolerances import assert_close

# TRL entropies of the golden batch (the padded entry never counts)
TRL_ENTROPY = [[0.5, 2.0, 1.0], [1.5, 0.2, 3.0]]

TRL_FAMILY_GOLDEN = [
    # cispo, epsilon_high = 1.3 (an absolute cap): w = min(r, 1.3) = [[1.3, 0.9048374, 1],
    # [0.6703200, 1.1051709]]; L = -w A ℓ = [1.3, 1.8096748, 0.5, -0.2346120, -0.6631025];
    # Σ = 2.7119602, / N = 5; gradient -w A / 5; cispo_clip_ratio: r > 1.3 with A > 0: 1/5
    (
        {"loss_type": "cispo", "epsilon_high": 1.3},
        {"num_items_in_batch": 5},
        0.5423920538,
        [[-0.26, -0.1809674836, -0.2], [0.0670320046, 0.1105170918, 0]],
        {"cispo_clip_ratio": 0.2},
    ),
    # epsilon_high = 5: no cap binds -> Σ -r A ℓ / 5
    (
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"num_items_in_batch": 5},
        0.5523638153,
        None,
        {"cispo_clip_ratio": 0.0},
    ),  # fmt: skip
    # sapo: row 1 (A > 0, τ = 1) gates 4σ(r - 1) = [2.3463334, 1.9049092, 2]; row 2 (τ = 1.05)
    # 4σ(1.05(r - 1))/1.05 = [1.5783351, 2.0098261], × 0.5; grpo's mean of row means:
    # mean(-6.2512426/3, 1.7940806/2); gradient -4σ(1-σ) r A / (n_i B); no metric
    (
        {"loss_type": "sapo"},
        {},
        -0.5933536089,
        [[-0.2182301663, -0.1504653288, -0.1666666667], [0.0813291708, 0.1377260571, 0]],
        {},
    ),
    # vespo (k, λ) = (2, 3) for A >= 0, (3, 2) for A < 0; log W = Σ_t Δ = [0.2, -0.3];
    # log φ = λ + k log W - λ W = [-0.2642083, -0.3816364] -> φ = [0.7678136, 0.6827432];
    # L = -φ A ℓ: Σ = 2.6873476 - 0.6486060 = 2.0387416, / 5; gradient -φ A / 5;
    # vespo/phi_seq_mean = mean(φ)
    (
        {"loss_type": "vespo"},
        {"num_items_in_batch": 5},
        0.4077483121,
        [[-0.1535627214] * 3, [0.0682743225] * 2 + [0.0]],
        {"vespo/phi_seq_mean": 0.7252784162},
    ),
    # top_entropy_quantile 0.5: the median of [0.5, 2, 1, 1.5, 0.2] is 1.0; kept H >= 1: row 1
    # t1, t2 and row 2 t0; dapo (-0.9048374 - 1 + 0.4)/5 (the denominator stays 5)
    (
        {"loss_type": "dapo", "top_entropy_quantile": 0.5},
        {"num_items_in_batch": 5},
        -0.3009674836,
        [[0, -0.1809674836, -0.2], [0, 0, 0]],
        None,
    ),  # fmt: skip
    # grpo: mean(-1.9048374/3, 0.4/2)
    ({"loss_type": "grpo", "top_entropy_quantile": 0.5}, {}, -0.2174729030, None, None),
    # top_entropy_quantile 0: only the maximum (2.0, row 1 t1) keeps its loss: -0.9048374/5
    (
        {"loss_type": "dapo", "top_entropy_quantile": 0.0},
        {"num_items_in_batch": 5},
        -0.1809674836,
        None,
        None,
    ),  # fmt: skip
    # off_policy_mask_threshold 0.1: mean_t(old - ℓ) = [-0.0667, 0.15]; row 2 (A < 0, 0.15 >
    # 0.1) is dropped, its tokens stay in N: -3.1048374/5
    (
        {"loss_type": "dapo", "off_policy_mask_threshold": 0.1},
        {"num_items_in_batch": 5},
        -0.6209674836,
        None,
        None,
    ),  # fmt: skip
    # entropy_coef 0.01: - 0.01 · ΣH/ΣM = 0.01 · 5.2/5 for every loss type; TRL logs the policy
    # term as policy_loss
    (
        {"loss_type": "dapo", "entropy_coef": 0.01},
        {"num_items_in_batch": 5},
        -0.4408503918,
        None,
        {"policy_loss": -0.4304503918},
    ),  # fmt: skip
    (
        {"loss_type": "grpo", "entropy_coef": 0.01},
        {},
        -0.2897265382,
        None,
        {"policy_loss": -0.2793265382},
    ),  # fmt: skip
    # GA = 2: grpo / 2 and the bonus / 2; policy_loss is logged before TRL's division by GA
    (
        {"loss_type": "grpo", "entropy_coef": 0.01},
        {"gradient_accumulation_steps": 2},
        -0.1448632691,
        None,
        {"policy_loss": -0.2793265382},
    ),  # fmt: skip
    # delta = 1.1 < 1 + eps_high: row 1 t0 min(1.3499, 1.1) = 1.1 -> L = -min(1.1, 1.2) = -1.1;
    # the metrics read the capped ratio: no high clip any more
    (
        {"loss_type": "grpo", "delta": 1.1},
        {},
        -0.2626598716,
        None,
        {"clip_ratio/high_mean": 0.0, "clip_ratio/low_mean": 0.2},
    ),  # fmt: skip
]


@pytest.mark.parametrize(("options", "call", "expected", "gradient", "metrics"), TRL_FAMILY_GOLDEN)
def test_trl_family_golden(
    options: dict[str, object],
    call: dict[str, int],
    expected: float,
    gradient: list[list[float]] | None,
    metrics: dict[str, float] | None,
) -> None:
    log_probs, old, advantages, mask = _trl_batch()
    entropy = torch.tensor(TRL_ENTROPY, dtype=torch.float64)
    out = trl_grpo_loss(**options)(  # type: ignore[arg-type]
        log_probs, old, advantages, mask, entropy=entropy, **call
    )
    assert_close(out.loss, expected)
    if gradient is not None:
        out.loss.backward()
        assert log_probs.grad is not None
        assert_close(log_probs.grad, gradient)
    if metrics == {}:
        assert out.metrics == {}
    for name, value in (metrics or {}).items():
        assert_close(out.metrics[name], value, torch.float32)


def test_trl_family_golden_edges() -> None:
    log_probs, old, advantages, mask = _trl_batch()
    # sapo with A = 0 (it takes tau_neg): row 1 contributes exactly 0 -> 0.8970403/2
    zero_first = torch.tensor([0.0, -0.5], dtype=torch.float64)
    sapo = trl_grpo_loss(loss_type="sapo")(log_probs, old, zero_first, mask)
    assert_close(sapo.loss, 0.4485201456)
    # vespo with the vLLM ratio [[0.9, 1.5, 1], [0.5, 1.2, ·]] folded into W (not multiplied):
    # row 1 log W = 0.2 + ln 0.9 + ln 1.5 = 0.5001046, φ = 0.3881079; row 2 with 0.5 instead
    # of TRL's 0 golden (ln 0 = -inf clamps to ln 1e-8 and kills the row)
    for row_two, expected, phi in ((0.0, 0.2716755027, 0.1940539305), (0.5, 0.2209937806, None)):
        ratio = torch.tensor([[0.9, 1.5, 1.0], [row_two, 1.2, 1.0]], dtype=torch.float64)
        out = trl_grpo_loss(loss_type="vespo")(
            log_probs, old, advantages, mask, importance_sampling_ratio=ratio, num_items_in_batch=5
        )
        assert_close(out.loss, expected)
        if phi is not None:
            assert_close(out.metrics["vespo/phi_seq_mean"], phi, torch.float32)
    # the off-policy mask against the sampler's log-probs instead of old (threshold 0): row 2's
    # mean(sampler - ℓ) = 0.15 - 0.2 < 0 keeps it -> the plain dapo loss
    sampler = old - 0.2
    out = trl_grpo_loss(loss_type="dapo", off_policy_mask_threshold=0.0)(
        log_probs, old, advantages, mask, sampling_log_probs=sampler, num_items_in_batch=5
    )
    assert_close(out.loss, -0.4304503918)


def test_trl_call_entropy_coef() -> None:
    # TRL's adaptive controller sets the coefficient per call; given (even 0) the bonus is on:
    # dapo -0.4304503918 - 0.02 · 5.2/5, and with 0 the loss is unchanged but policy_loss logged
    log_probs, old, advantages, mask = _trl_batch()
    entropy = torch.tensor(TRL_ENTROPY, dtype=torch.float64)
    loss_fn = trl_grpo_loss(loss_type="dapo")
    for coef, expected in ((0.02, -0.4512503918), (0.0, -0.4304503918)):
        out = loss_fn(log_probs, old, advantages, mask, num_items_in_batch=5, entropy=entropy,
                      entropy_coef=coef)  # fmt: skip
        assert_close(out.loss, expected)
        assert_close(out.metrics["policy_loss"], -0.4304503918, torch.float32)
    with pytest.raises(ValueError, match="need entropy"):
        loss_fn(log_probs, old, advantages, mask, entropy_coef=0.0)


TRL_FAMILY_CASES = [
    {"loss_type": "cispo", "epsilon_high": 1.3},
    {"loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence"},
    {"loss_type": "sapo", "sapo_temperature_pos": 0.7, "beta": 0.04},
    {"loss_type": "sapo", "importance_sampling_level": "sequence", "top_entropy_quantile": 0.6},
    {"loss_type": "vespo", "vespo_k_neg": 2.5, "beta": 0.04},
    {"loss_type": "vespo", "top_entropy_quantile": 0.8, "off_policy_mask_threshold": -0.15},
    {"loss_type": "grpo", "delta": 1.1, "entropy_coef": 0.02, "top_entropy_quantile": 0.4},
    {
        "loss_type": "dapo",
        "importance_sampling_level": "sequence",
        "top_entropy_quantile": 0.5,
        "off_policy_mask_threshold": -0.15,
        "entropy_coef": -0.01,
    },  # fmt: skip
    {"loss_type": "luspo", "importance_sampling_level": "sequence", "entropy_coef": 0.01},
]


@pytest.mark.filterwarnings("ignore::rlobjectives.BiasedGradientWarning")
@pytest.mark.parametrize("options", TRL_FAMILY_CASES)
def test_trl_family_matches_reference(options: dict[str, object]) -> None:
    log_probs, old, advantages, mask = _random_batch(11)
    generator = torch.Generator().manual_seed(12)
    ref_log_probs = log_probs + 0.3 * torch.randn(5, 7, generator=generator, dtype=torch.float64)
    entropy = torch.rand(5, 7, generator=generator, dtype=torch.float64) * 2
    # per-token vLLM ratios also at sequence level: TRL multiplies its (B, 1) loss by them
    ratio = torch.rand(5, 7, generator=generator, dtype=torch.float64) + 0.5
    level = str(options.get("importance_sampling_level", "token"))
    call = {"num_items_in_batch": 40, "num_processes": 2, "gradient_accumulation_steps": 2}
    inputs = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    entropies = [entropy.clone().requires_grad_(True) for _ in range(2)]
    actual = trl_grpo_loss(**options)(  # type: ignore[arg-type]
        _with_nan_padding(inputs[0], mask), _with_nan_padding(old, mask), advantages, mask,
        ref_log_probs=_with_nan_padding(ref_log_probs, mask), importance_sampling_ratio=ratio,
        entropy=_with_nan_padding(entropies[0], mask), **call,
    ).loss  # fmt: skip
    quantile = float(options.get("top_entropy_quantile", 1.0))  # type: ignore[arg-type]
    threshold = options.get("off_policy_mask_threshold")
    entropy_keep = None
    if quantile < 1.0:
        entropy_keep = torch.tensor(ref.top_entropy_mask(entropy, mask, 1.0 - quantile))
    off_policy_keep = None
    if threshold is not None:
        off_policy_keep = ref.off_policy_sequence_mask(
            log_probs,
            old,
            advantages,
            mask,
            threshold=float(threshold),  # type: ignore[arg-type]
        )
    skip = ("importance_sampling_level", "top_entropy_quantile", "off_policy_mask_threshold")
    reference_options = {k: v for k, v in options.items() if k not in skip}
    vespo = (
        float(options.get("vespo_k_pos", 2.0)), 3.0,  # type: ignore[arg-type]
        float(options.get("vespo_k_neg", 3.0)), 2.0,  # type: ignore[arg-type]
    )  # fmt: skip
    reference_options.pop("vespo_k_neg", None)
    expected = ref.trl_grpo_loss(
        inputs[1], old, advantages, mask, level=level, ref_log_probs=ref_log_probs,
        importance_sampling_ratio=ratio, num_items_in_batch=40, num_processes=2, accumulation=2,
        off_policy_keep=off_policy_keep, entropy_keep=entropy_keep, entropy=entropies[1],
        vespo=vespo, **reference_options,  # type: ignore[arg-type]
    )  # fmt: skip
    assert_close(actual, expected.detach())
    (actual + expected).backward()  # separate leaves: each gets its own gradient
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)
    if "entropy_coef" in options:  # the bonus: -coef ∂(token mean of H)/∂H at kept tokens
        assert entropies[0].grad is not None and entropies[1].grad is not None
        assert_close(entropies[0].grad, entropies[1].grad)


# ---------------------------------------------------------------------------------------------
# verl: r = [[1.5, 0.5, 1], [4, 0.75, ·]], A = [[1]*3, [-1]*3], clip 0.2;
# ppo_kl = -(ln 1.5 + ln 0.5 + 0 + ln 4 + ln 0.75)/5 = -ln(2.25)/5 = -0.16218604
VERL_WEIGHTS = [[1.5, 0.5, 1.0], [2.0, 0.75, 0.0]]

VERL_FAMILY_GOLDEN = [
    # cispo: ĉ = clip(r, 0.8, 1.2) = [[1.2, 0.8, 1], [1.2, 0.8]]; L = -ĉ A ℓ =
    # [0.6129908, 0.9631782, 0.6931472, -0.2677723, -0.4086605], Σ 1.5928834 / 5;
    # pg_clipfrac: 1.5, 0.5, 4 and 0.75 leave the band (either side, any sign of A): 4/5
    ("cispo", {}, 0.31857668, [[-0.24, -0.16, -0.2], [0.24, 0.16, 0]], 0.8, 0.0),
    # sapo (forced seq-mean-token-mean): row 1 gates 4σ(r - 1) = [2.4898373, 1.5101627, 2]
    # -> mean -2; row 2 (τ = 1.05) [3.6529856, 1.6561876] -> mean +2.6545866; (-2 +
    # 2.6545866)/2; gradient -4σ(x)σ(-x) r A / (n_i · 2), x = τ(r - 1): row 1 4·0.2350037·
    # [1.5, 0.5, 1]/6 (σ(1)σ(-1) = 1/4 at r = 1), row 2 4·[0.0394028, 0.2457423]·[4, 0.75]/4;
    # no clip fractions
    (
        "sapo",
        {},
        0.32729331,
        [[-0.2350037122, -0.0783345707, -0.1666666667], [0.1576111402, 0.1843067550, 0]],
        0.0,
        0.0,
    ),
    # geo_mean: row 1 clipped log-ratios [0.2, -0.6931472, 0] -> ρ = exp(-0.4931472/3) =
    # 0.8484164, loss -0.8484164; row 2 [1.3862944, -0.2] -> ρ = exp(0.5931472) = 1.8096749,
    # loss +1.8096749; mean over the rows; pg_clipfrac (outside [-0.2, 0.2], A > 0): t0, t1 of
    # row 1: 2/5; _lower (A < 0): both tokens of row 2: 2/5
    ("geo_mean", {}, 0.48062865, [[0, -0.1414027, -0.1414027], [0.4524187, 0, 0]], 0.4, 0.4),
    # with rollout_is_weights: rows × their geometric mean weight [0.75^(1/3), sqrt(1.5)] =
    # [0.9085603, 1.2247449]: (-0.7708375 + 2.2163901)/2 (verl's run: 0.72277573674946)
    ("geo_mean", {"rollout_is_weights": VERL_WEIGHTS}, 0.72277574, None, 0.4, 0.4),
    # gpg: -A ℓ: -(ln .6 + ln .3 + ln .5) + (ln .8 + ln .6) = 1.6739764 -> / 5 (as before, now
    # through policy_loss(surrogate="cispo", clip_low=None))
    ("gpg", {"rollout_is_weights": [[1.0] * 3, [1.0] * 3]}, 0.33479529, None, None, None),
]


@pytest.mark.parametrize(
    ("mode", "call", "expected", "gradient", "clipfrac", "lower"), VERL_FAMILY_GOLDEN
)
def test_verl_family_golden(
    mode: str,
    call: dict[str, list[list[float]]],
    expected: float,
    gradient: list[list[float]] | None,
    clipfrac: float | None,
    lower: float | None,
) -> None:
    old, log_prob, advantages, mask = _verl_batch()
    weights = {k: torch.tensor(v, dtype=torch.float64) for k, v in call.items()}
    # sapo forces seq-mean-token-mean and geo_mean ignores the mode: "token-sum" changes nothing
    aggregation = "token-sum" if mode in ("sapo", "geo_mean") else "token-mean"
    loss, metrics = verl_policy_loss(mode)(old, log_prob, advantages, mask, aggregation, **weights)
    assert_close(loss, expected, torch.float32)  # the notes give 8 digits
    if gradient is not None:
        loss.backward()
        assert log_prob.grad is not None
        assert_close(log_prob.grad, gradient, torch.float32)  # 7 digits
    if clipfrac is None:
        assert metrics == {}
        return
    assert_close(metrics["actor/pg_clipfrac"], clipfrac, torch.float32)
    assert_close(metrics["actor/pg_clipfrac_lower"], lower, torch.float32)
    assert_close(metrics["actor/ppo_kl"], -math.log(2.25) / 5, torch.float32)


@pytest.mark.parametrize(
    ("mode", "aggregation", "info"),
    [
        ("cispo", "token-mean", {}),
        ("cispo", "seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 9}),
        ("sapo", "token-mean", {"dp_size": 2, "global_batch_size": 9}),
        ("geo_mean", "token-mean", {"dp_size": 4}),  # geo_mean reads no global count
    ],
)
def test_verl_family_matches_reference(mode: str, aggregation: str, info: dict[str, int]) -> None:
    log_prob, old, _, mask = _random_batch(13)
    generator = torch.Generator().manual_seed(14)
    advantages = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    weights = torch.rand(5, 7, generator=generator, dtype=torch.float64) * 2
    config = {"clip_ratio_low": 0.15, "clip_ratio_high": 0.28, "tau_pos": 0.8, "tau_neg": 1.3,
              "global_batch_info": info}  # fmt: skip
    inputs = [log_prob.clone().requires_grad_(True) for _ in range(2)]
    loss, _ = verl_policy_loss(mode)(
        _with_nan_padding(old, mask), _with_nan_padding(inputs[0], mask), advantages, mask,
        aggregation, config, _with_nan_padding(weights, mask),
    )  # fmt: skip
    clips = {"clip_low": 0.15, "clip_high": 0.28}
    if mode == "geo_mean":
        expected = ref.verl_geo_mean_loss(old, inputs[1], advantages, mask, weights=weights,
                                          **clips)  # fmt: skip
    else:
        losses = ref.verl_policy_losses(
            old, inputs[1], advantages, mask, loss_mode=mode, tau_pos=0.8, tau_neg=1.3,
            weights=weights, **clips,
        )  # fmt: skip
        forced = "seq-mean-token-mean" if mode == "sapo" else aggregation
        expected = ref.verl_agg_loss(losses, mask, forced, **info)
    assert_close(loss, expected.detach())
    (loss + expected).backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)


# ---------------------------------------------------------------------------------------------
# OpenRLHF 0.11.2's train/rollout IS correction: r = [[1.5, 0.7, 1], [0.5, 3, ·]],
# A = [[1]*3, [-2]*3]; per-token losses [-1.2, -0.7, -1.0, 1.6, 6.0] (token mean over 5); the
# sampler ratio ρ = exp(old - rollout) = [[8, 4, 6], [2, 0.4, ·]]. With q = e^-1 (old) and
# p = q/ρ = [[.045985, .091970, .061313], [.183940, .919699]] (rollout):
# binary KL p ln(p/q) + (1-p) ln((1-p)/(1-q)) = [[.297049, .201389, .261300], [.080931, .677026]]
# (row means .253246, .378979); tv |p - q| = [[.321895, .275910, .306566], [.183940, .551819]]
# (row means .301457, .367879).

OPENRLHF_RHO = [[8.0, 4.0, 6.0], [2.0, 0.4, 100.0]]
NO_GRAD_ROW = [0.0, 0.0, 0.0]

OPENRLHF_IS_GOLDEN = [
    # (level, mode, gating, [low, high], loss, gradient, is_filter_ratio)
    # TIS: w = clip(ρ, 0.5, 5) = [5, 4, 5, 2, 0.5]: (-6 - 2.8 - 5 + 3.2 + 3)/5; 8, 6, 0.4 outside
    ("token", "clip", "ratio", [0.5, 5.0], -1.52, [[0, -0.56, -1.0], [0, 0.6, 0]], 0.6),
    # ICEPOP: ρ inside [0.5, 5] else 0: [0, 4, 0, 2, 0]: (-2.8 + 3.2)/5
    ("token", "mask", "ratio", [0.5, 5.0], 0.08, [[0, -0.56, 0], NO_GRAD_ROW], 0.6),
    # seq-mask-tis: geometric means [5.7690, 0.8944]: row 1 out; row 2 keeps ρ = [2, 0.4]:
    # (3.2 + 2.4)/5; one row of two filtered
    ("seq", "mask", "ratio", [0.5, 5.0], 1.12, [NO_GRAD_ROW, [0, 0.48, 0]], 0.5),
    # binary KL <= 0.27 keeps t = (0,1), (0,2), (1,0) at ρ: (-2.8 - 6 + 3.2)/5; 2 of 5 dropped
    ("token", "mask", "binary_kl", [0.0, 0.27], -1.12, [[0, -0.56, -1.2], NO_GRAD_ROW], 0.4),
    # row means .2532 (kept) / .3790 (dropped) vs 0.3: (-9.6 - 2.8 - 6)/5
    ("seq", "mask", "binary_kl", [0.0, 0.3], -3.68, [[0, -0.56, -1.2], NO_GRAD_ROW], 0.5),
    # tv <= 0.31 keeps (0,1), (0,2), (1,0): as the binary KL row above
    ("token", "mask", "tv", [0.0, 0.31], -1.12, [[0, -0.56, -1.2], NO_GRAD_ROW], 0.4),
    # row means .3015, .3679 <= 0.4: every token at ρ: (-9.6 - 2.8 - 6 + 3.2 + 2.4)/5
    ("seq", "mask", "tv", [0.0, 0.4], -2.56, [[0, -0.56, -1.2], [0, 0.48, 0]], 0.0),
]


@pytest.mark.parametrize(
    ("level", "mode", "gating", "threshold", "expected", "gradient", "filtered"),
    OPENRLHF_IS_GOLDEN,
    ids=[f"{row[0]}-{row[1]}-{row[2]}" for row in OPENRLHF_IS_GOLDEN],
)
def test_openrlhf_is_correction_golden(
    level: str,
    mode: str,
    gating: str,
    threshold: list[float],
    expected: float,
    gradient: list[list[float]],
    filtered: float,
) -> None:
    log_probs, old, advantages, mask = _openrlhf_batch()
    rollout = old - torch.tensor(OPENRLHF_RHO, dtype=torch.float64).log()
    loss_fn = openrlhf_policy_loss(
        is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
        is_correction_threshold=threshold,
    )  # fmt: skip
    out = loss_fn(log_probs, old, advantages, mask, rollout_log_probs=rollout)
    assert len(out) == 5  # ActorPPOTrainer.training_step unpacks five values
    assert_close(out.loss, expected)
    # vllm_kl = mean(rollout - old) = -(ln 8 + ln 4 + ln 6 + ln 2 + ln 0.4)/5
    assert out.vllm_kl is not None and out.is_filter_ratio is not None
    assert_close(out.vllm_kl, -5.0343522 / 5, torch.float32)
    assert_close(out.is_filter_ratio, filtered)
    assert_close(out.clip_ratio, 0.4, torch.float32)  # the weights do not change the clips
    out.loss.backward()
    assert log_probs.grad is not None
    assert_close(log_probs.grad, gradient)


def test_openrlhf_sequence_gate_counts_an_empty_row_as_filtered() -> None:
    # OpenRLHF's per-row mean of an empty row is 0/0 = NaN, outside every band: of the 3 rows
    # (the golden batch plus an empty one) the ratio gate [0.5, 5] drops row 1 and the empty row
    log_probs, old, advantages, mask = _openrlhf_batch()
    pad = torch.zeros(1, 3, dtype=torch.float64)
    rho = torch.tensor([*OPENRLHF_RHO, [1.0, 1.0, 1.0]], dtype=torch.float64)
    old3 = torch.cat([old, pad])
    loss_fn = openrlhf_policy_loss(is_correction_level="seq")
    out = loss_fn(torch.cat([log_probs.detach(), pad]), old3, torch.cat([advantages, pad]),
                  torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)]),
                  rollout_log_probs=old3 - rho.log())  # fmt: skip
    assert out.is_filter_ratio is not None
    assert_close(out.is_filter_ratio, 2 / 3)
    assert_close(out.loss, 1.12)  # the empty row adds nothing (seq-mask-tis row above)


OPENRLHF_GATES = [(level, mode, gating) for level, mode, gating, *_ in OPENRLHF_IS_GOLDEN]


@pytest.mark.parametrize(("level", "mode", "gating"), OPENRLHF_GATES)
@pytest.mark.parametrize("token_level", [True, False])
def test_openrlhf_is_correction_matches_reference(
    level: str, mode: str, gating: str, token_level: bool
) -> None:
    log_probs, old, advantages, mask = _random_batch(15)
    advantages = advantages[:, None].expand(5, 7)
    generator = torch.Generator().manual_seed(16)
    old = old - 1.5  # probabilities away from 1, so that the divergences spread out
    log_probs = log_probs - 1.5
    rollout = old + 0.5 * torch.randn(5, 7, generator=generator, dtype=torch.float64)
    inputs = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    # bands through the middle of this batch's statistics (some units in, some out)
    band = {"ratio": (0.7, 1.4), "binary_kl": (0.0, 0.003), "tv": (0.0, 0.015)}[gating]
    options = {
        "dual_clip": 3.0, "token_level_loss": token_level, "is_correction_level": level,
        "is_correction_mode": mode, "is_correction_gating": gating,
        "is_correction_threshold": band,
    }  # fmt: skip
    counts = {"dp_size": 2, "batch_num_tokens": 31, "global_batch_size": 8}
    out = openrlhf_policy_loss(**options)(  # type: ignore[arg-type]
        _with_nan_padding(inputs[0], mask), _with_nan_padding(old, mask), advantages, mask,
        rollout_log_probs=_with_nan_padding(rollout, mask), **counts,
    )  # fmt: skip
    expected = ref.openrlhf_policy_forward(
        inputs[1], old, advantages, mask, rollout_log_probs=rollout, **options, **counts,  # type: ignore[arg-type]
    )  # fmt: skip
    assert_close(out.loss, expected["loss"].detach())
    for name in ("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"):
        assert_close(getattr(out, name), expected[name])
    assert 0.0 < expected["is_filter_ratio"] < 1.0  # the gate binds on this batch
    (out.loss + expected["loss"]).backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)


# ---------------------------------------------------------------------------------------------
# verl 0.9.1's dppo_tv, dppo_kl, dro, kl_cov and clip_cov on the objects of issue 24. The verl
# batch above: p_old = [[.4, .6, .5], [.2, .8, .5]], p = [[.6, .3, .5], [.8, .6, .5]],
# r = [[1.5, 0.5, 1], [4, 0.75, ·]], A = [[1]*3, [-1]*3], token-mean over N = 5;
# ln p = [[-0.5108256, -1.2039728, -0.6931472], [-0.2231436, -0.5108256]].
VERL_NEW_GOLDEN = [
    # dppo_tv (low 0.25, high 0.15, c = 3): p - p_old = [[0.2, -0.3, 0], [0.6, -0.2]]; A > 0
    # keeps <= 0.15: [F, T, T]; A < 0 keeps >= -0.25: [T, T]. -A min(r, 3) ln p on the kept:
    # 0.5·1.2039728 + 0.6931472 - 3·0.2231436 - 0.75·0.5108256 = 0.2425837 -> / 5; gradient
    # -A min(r, 3)/5 on the kept; pg_clipfrac 1/5 (row 1 t0); _lower: kept with r > 3 (row 2
    # t0): 1/5
    ("dppo_tv", {"clip_ratio_low": 0.25, "clip_ratio_high": 0.15, "clip_ratio_c": 3.0},
     0.04851674, [[0, -0.1, -0.2], [0.6, 0.15, 0]], {"actor/pg_clipfrac": 0.2,
                                                     "actor/pg_clipfrac_lower": 0.2}),
    # dppo_kl (0.05 both): D = p_old ln(p_old/p) + (1 - p_old) ln((1 - p_old)/(1 - p)) =
    # [[0.0810930, 0.1920420, 0], [0.8317766, 0.0915163]]; A > 0 keeps D <= 0.05 or p <= p_old:
    # [F, T, T]; A < 0 keeps D <= 0.05 or p >= p_old: [T, F]. 0.6019864 + 0.6931472 - 0.6694307
    # = 0.6257029 -> / 5; pg_clipfrac 2/5, _lower 1/5 (row 2 t0, r = 4 > 3)
    ("dppo_kl", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 3.0},
     0.12514059, [[0, -0.1, -0.2], [0.6, 0, 0]], {"actor/pg_clipfrac": 0.4,
                                                  "actor/pg_clipfrac_lower": 0.2}),
    # dro (β = 0.5): -(ℓA - β/2 Δ²): -Σ ℓA = 1.6739764, β/2 Σ Δ² = 0.25·2.6494280 = 0.6623570;
    # 2.3363334 / 5; gradient -(A - βΔ)/5, Δ = [[0.4054651, -0.6931472, 0], [1.3862944,
    # -0.2876821]]
    ("dro", {"policy_loss": {"dro_beta": 0.5}}, 0.46726669,
     [[-0.1594535, -0.2693147, -0.2], [0.3386294, 0.1712318, 0]], {}),
    # kl_cov (ratio 0.4 -> k = int(0.4·5) = 2, coef 0.5): Ā = 0.2, ℓ̄ = -0.6283830, cov =
    # [[0.0940459, -0.4604718, -0.0518114], [-0.4862873, -0.1410689]]: top 2 = row 1 t0, t2;
    # -A r + 0.5|Δ| there: -1.5 + 0.2027326 - 0.5 - 1 + 0 + 4 + 0.75 = 1.9527326 -> / 5;
    # gradient -A r/5 + 0.5 sign(Δ)/5 (row 1 t0: -0.3 + 0.1; t2: Δ = 0, no penalty gradient)
    ("kl_cov", {"policy_loss": {"kl_cov_ratio": 0.4, "ppo_kl_coef": 0.5}}, 0.39054651,
     [[-0.2, -0.1, -0.2], [0.8, 0.15, 0]], {"actor/ppo_kl": 2.7725888 / 5}),
    # clip_cov (ratio 0.4 -> k = 2, cov in (-0.47, 5)): unclipped = row 1 t1, t2, row 2 t0;
    # their cov [-0.4604718, -0.0518114, -0.4862873]: candidates row 1 t1, t2 (2 <= k: both
    # detached, whatever the draw). max(-A r, -A clip(r)): -1.2 + 0 + 0 + 4 + 0.8 = 3.6 -> / 5;
    # gradient r/5 = 0.8 at row 2 t0 only (the others clipped or detached); pg_clipfrac 2/5
    ("clip_cov", {"policy_loss": {"clip_cov_ratio": 0.4, "clip_cov_lb": -0.47}}, 0.72,
     [[0, 0, 0], [0.8, 0, 0]], {"actor/pg_clipfrac": 0.4}),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "config", "expected", "gradient", "metrics"), VERL_NEW_GOLDEN)
def test_verl_issue24_modes_golden(
    mode: str,
    config: dict[str, object],
    expected: float,
    gradient: list[list[float]],
    metrics: dict[str, float],
) -> None:
    old, log_prob, advantages, mask = _verl_batch()
    loss, out = verl_policy_loss(mode)(old, log_prob, advantages, mask, "token-mean", config)
    assert_close(loss, expected, torch.float32)  # the notes give 8 digits
    loss.backward()
    assert log_prob.grad is not None
    assert_close(log_prob.grad, gradient, torch.float32)
    keys = {"actor/ppo_kl"} | (
        {"actor/pg_clipfrac"} if mode != "dro" and mode != "kl_cov" else set()
    )
    keys |= {"actor/pg_clipfrac_lower"} if mode.startswith("dppo") else set()
    assert set(out) == keys  # verl's keys for the mode
    expected_metrics = {"actor/ppo_kl": -math.log(2.25) / 5, **metrics}
    for key, value in expected_metrics.items():
        assert_close(out[key], value, torch.float32)


def _verl_clip_cov_reference_draw(
    candidates: list[tuple[int, int]], count: int, seed: int
) -> set[tuple[int, int]]:
    """verl's draw: ``torch.randperm(n)`` of the row-major candidates on the global generator."""
    if not candidates:
        return set()
    torch.manual_seed(seed)
    return {candidates[j] for j in torch.randperm(len(candidates))[: min(count, len(candidates))]}


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "dro", "kl_cov", "clip_cov"])
@pytest.mark.parametrize(
    ("aggregation", "info"),
    [("token-mean", {}), ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 9}),
     ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 9})],
)  # fmt: skip
def test_verl_issue24_modes_match_reference(
    mode: str, aggregation: str, info: dict[str, int]
) -> None:
    log_prob, old, _, mask = _random_batch(17, rows=6, tokens=9)
    log_prob = log_prob / 3  # p from 0.37 to 1: DPPO's thresholds bind both ways
    old = log_prob + (old - log_prob * 3)  # Δ ~ N(0, 0.4²): ratios above the cap 1.3 too
    generator = torch.Generator().manual_seed(18)
    advantages = torch.randn(6, 9, generator=generator, dtype=torch.float64)  # per token
    weights = torch.rand(6, 9, generator=generator, dtype=torch.float64) * 2
    clip_low, clip_high = (0.05, 0.03) if mode != "clip_cov" else (0.15, 0.28)
    ratio, cov_lb = 0.3, -0.05
    policy = {"dro_beta": 0.7, "kl_cov_ratio": ratio, "ppo_kl_coef": 0.4,
              "clip_cov_ratio": ratio, "clip_cov_lb": cov_lb, "clip_cov_ub": 5.0}  # fmt: skip
    config = {"clip_ratio_low": clip_low, "clip_ratio_high": clip_high, "clip_ratio_c": 1.3,
              "global_batch_info": info, "policy_loss": policy}  # fmt: skip
    inputs = [log_prob.clone().requires_grad_(True) for _ in range(2)]
    torch.manual_seed(5)  # the preset draws clip_cov's tokens as verl: global CPU generator
    loss, metrics = verl_policy_loss(mode)(
        _with_nan_padding(old, mask), _with_nan_padding(inputs[0], mask), advantages, mask,
        aggregation, config, _with_nan_padding(weights, mask),
    )  # fmt: skip
    count = ref.selection_count(ratio, int(mask.sum()))
    selected: set[tuple[int, int]] = set()
    if mode == "kl_cov":
        covariance = ref.covariances(log_prob, advantages, mask)
        selected = set(sorted(covariance, key=lambda k: -covariance[k])[:count])
    elif mode == "clip_cov":
        options = {"clip_low": clip_low, "clip_high": clip_high, "log_ratio_bound": None,
                   "cov_lb": cov_lb, "cov_ub": 5.0}  # fmt: skip
        candidates = ref.clip_cov_candidates(log_prob, old, advantages, mask, options)
        assert len(candidates) > count  # the draw decides which are detached
        selected = _verl_clip_cov_reference_draw(candidates, count, seed=5)
        assert_close(metrics["actor/pg_clipfrac"], len(selected) / int(mask.sum()))
    losses = ref.verl_policy_losses(
        old, inputs[1], advantages, mask, loss_mode=mode, clip_low=clip_low, clip_high=clip_high,
        clip_c=1.3, weights=weights, dro_beta=0.7, kl_coef=0.4, selected=selected,
    )  # fmt: skip
    expected = ref.verl_agg_loss(losses, mask, aggregation, **info)
    assert_close(loss, expected.detach())
    (loss + expected).backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)
    if mode.startswith("dppo"):  # both rules bind: some tokens out, some capped
        assert 0 < float(metrics["actor/pg_clipfrac"]) < 1
        assert float(metrics["actor/pg_clipfrac_lower"]) > 0
