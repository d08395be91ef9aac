"""Peer presets: TRL, verl and OpenRLHF losses as library calls (golden values and references).

The golden values are the peers' own numbers on small hand-built batches (the arithmetic is in
the comments); the float64 references in ``tests/reference.py`` are the peers' formulas written
out token by token and are compared on random batches with padding, an empty row and NaN at
unselected positions, values and gradients.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import reference as ref
from rlobjectives.presets import _verl as presets_verl
from rlobjectives.presets import (
    openrlhf_policy_loss,
    trl_generalized_jsd_loss,
    trl_grpo_advantages,
    trl_grpo_loss,
    verl_gdpo_advantages,
    verl_policy_loss,
)
from tolerances import assert_close

# ---------------------------------------------------------------------------------------------
# TRL. Batch: B=2, T=3, the last token of row 2 is padding.
#   log-ratio Δ = [[0.3, -0.1, 0.0], [-0.4, 0.1, 0.7(pad)]], r = exp(Δ)
#   row 1 (A=+1): r = [1.3498588, 0.9048374, 1]; clip(r) = [1.2, 0.9048374, 1] -> L = -min
#                 = [-1.2 (high clip), -0.9048374, -1.0], ΣL = -3.1048374
#   row 2 (A=-.5): r = [0.6703200, 1.1051709]; L = [0.4 (low clip), 0.5525855], ΣL = 0.9525855
TRL_LOG_PROBS = [[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]]
TRL_LOG_RATIO = [[0.3, -0.1, 0.0], [-0.4, 0.1, 0.7]]
TRL_MASK = [[1, 1, 1], [1, 1, 0]]
TRL_ADVANTAGES = [1.0, -0.5]
TRL_REF = [[-1.2, -1.8, -0.5], [-0.9, -1.0, -2.0]]


def _trl_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    log_probs = torch.tensor(TRL_LOG_PROBS, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(TRL_LOG_PROBS, dtype=torch.float64) - torch.tensor(
        TRL_LOG_RATIO, dtype=torch.float64
    )
    return log_probs, old, torch.tensor(TRL_ADVANTAGES, dtype=torch.float64), torch.tensor(TRL_MASK)


TRL_GOLDEN = [
    # grpo: mean_i(ΣL_i / n_i) = mean(-3.1048374/3, 0.9525855/2)
    ("grpo", "token", {}, -0.2793265382),
    # bnpo and dapo (N = 5): (-3.1048374 + 0.9525855) / 5
    ("bnpo", "token", {}, -0.4304503918),
    ("dapo", "token", {"num_items_in_batch": 5}, -0.4304503918),
    # dr_grpo: -2.1522519 / (B=2 · max_completion_length=4)
    ("dr_grpo", "token", {}, -0.2690314949),
    # luspo (TRL >= 1.10): mean_i Σ_t M L = -2.1522519 / 2
    ("luspo", "token", {}, -1.0761259795),
    # GA = 2: grpo / 2; dapo with spg = 1 divides by N·GA/spg = 10, with spg = 2 by 5
    ("grpo", "token", {"gradient_accumulation_steps": 2}, -0.1396632691),
    (
        "dapo",
        "token",
        {"num_items_in_batch": 5, "gradient_accumulation_steps": 2, "steps_per_generation": 1},
        -0.2152251959,
    ),  # fmt: skip
    ("dapo", "token", {"num_items_in_batch": 5, "gradient_accumulation_steps": 2}, -0.4304503918),
    # sequence level: s = exp(mean Δ) = [1.0689391, 0.8607080] (inside the band);
    # L = [-1.0689391, +0.4303540] per token
    ("grpo", "sequence", {}, -0.3192925588),  # mean(L)
    ("dapo", "sequence", {"num_items_in_batch": 5}, -0.4692218682),  # (3 L1 + 2 L2) / 5
    ("bnpo", "sequence", {}, -0.4692218682),
    ("dr_grpo", "sequence", {}, -0.2932636676),  # (3 L1 + 2 L2) / 8
    ("luspo", "sequence", {}, -1.1730546704),  # (3 L1 + 2 L2) / 2
]


@pytest.mark.parametrize(("loss_type", "level", "call", "expected"), TRL_GOLDEN)
def test_trl_golden(loss_type: str, level: str, call: dict[str, int], expected: float) -> None:
    log_probs, old, advantages, mask = _trl_batch()
    loss_fn = trl_grpo_loss(
        loss_type=loss_type, importance_sampling_level=level, max_completion_length=4
    )
    assert_close(loss_fn(log_probs, old, advantages, mask, **call).loss, expected)


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        # grpo: -A·r/(n_i·B) at unclipped tokens: row 1 [0, -0.9048374/6, -1/6], row 2
        # [0 (clipped), 0.5·1.1051709/4]
        ("grpo", [[0, -0.1508062363, -0.1666666667], [0, 0.1381463648, 0]]),
        ("dapo", [[0, -0.1809674836, -0.2], [0, 0.1105170918, 0]]),  # -A·r/5
        ("luspo", [[0, -0.452418709, -0.5], [0, 0.2762927295, 0]]),  # -A·r/2
    ],
)
def test_trl_golden_gradients(loss_type: str, expected: list[list[float]]) -> None:
    log_probs, old, advantages, mask = _trl_batch()
    trl_grpo_loss(loss_type=loss_type)(log_probs, old, advantages, mask).loss.backward()
    assert log_probs.grad is not None
    assert_close(log_probs.grad, expected)


def test_trl_golden_options_and_metrics() -> None:
    log_probs, old, advantages, mask = _trl_batch()
    # epsilon_high=0.28: row 1 token 0 becomes -min(1.3498588, 1.28) = -1.28
    high = trl_grpo_loss(loss_type="grpo", epsilon_high=0.28)(log_probs, old, advantages, mask)
    assert_close(high.loss, -0.2926598716)
    # delta = 1.3 > 1 + eps_high: the dual clip at 1.3; no token of the batch reaches it
    out = trl_grpo_loss(loss_type="grpo", delta=1.3)(log_probs, old, advantages, mask)
    assert_close(out.loss, -0.2793265382)
    # low: row 2 token 0 (r = 0.67 < 0.8, A < 0): 1/5; high: row 1 token 0: 1/5;
    # per-sequence low fractions [0, 1/2] -> min 0; high fractions [1/3, 0] -> max 1/3
    metrics = out.metrics
    assert_close(metrics["clip_ratio/low_mean"], 0.2, torch.float32)
    assert_close(metrics["clip_ratio/high_mean"], 0.2, torch.float32)
    assert_close(metrics["clip_ratio/region_mean"], 0.4, torch.float32)
    assert_close(metrics["clip_ratio/low_min"], 0.0, torch.float32)
    assert_close(metrics["clip_ratio/high_max"], 1 / 3, torch.float32)
    assert "kl" not in metrics


@pytest.mark.filterwarnings(
    "ignore::rlobjectives.BiasedGradientWarning"
)  # k3 without TRL's correction
def test_trl_golden_kl() -> None:
    log_probs, old, advantages, mask = _trl_batch()
    ref_log_probs = torch.tensor(TRL_REF, dtype=torch.float64)
    # k3 = e^d - d - 1, d = ref - logp: row 1 [0.0187308, 0.0214028, 0], row 2 [0.0187308,
    # 0.0214028]; ΣM k3 = 0.0802671
    plain = trl_grpo_loss(loss_type="dapo", beta=0.1, use_bias_correction_kl=False)
    out = plain(log_probs, old, advantages, mask, ref_log_probs=ref_log_probs)
    assert_close(out.loss, -0.4288450514)  # (-2.1522519 + 0.1·0.0802671)/5
    assert_close(out.metrics["kl"], 0.0160534045, torch.float32)  # 0.0802671/5
    grpo = trl_grpo_loss(loss_type="grpo", beta=0.1, use_bias_correction_kl=False)
    assert_close(grpo(log_probs, old, advantages, mask, ref_log_probs=ref_log_probs).loss,
                 -0.2776543086)  # fmt: skip
    # bias correction (TRL's default): k3·r = [0.0252838, 0.0193661, 0, 0.0125556, 0.0236537]
    corrected = trl_grpo_loss(loss_type="dapo", beta=0.1)
    out = corrected(log_probs, old, advantages, mask, ref_log_probs=ref_log_probs)
    assert_close(out.loss, -0.4288332079)
    assert_close(out.metrics["kl"], 0.0161718387, torch.float32)
    # luspo + KL (no correction): (-2.1522519 + 0.0080267)/2; sequence level (-2.3461093 + ...)/2
    for level, expected in (("token", -1.0721126284), ("sequence", -1.1690413193)):
        luspo = trl_grpo_loss(
            loss_type="luspo", beta=0.1, use_bias_correction_kl=False,
            importance_sampling_level=level,
        )  # fmt: skip
        assert_close(luspo(log_probs, old, advantages, mask, ref_log_probs=ref_log_probs).loss,
                     expected)  # fmt: skip


@pytest.mark.filterwarnings(
    "ignore::rlobjectives.BiasedGradientWarning"
)  # k3 without TRL's correction
def test_trl_golden_importance_sampling_ratio_and_edges() -> None:
    log_probs, old, advantages, mask = _trl_batch()
    ratio = torch.tensor([[0.9, 1.5, 1.0], [0.0, 1.2, 1.0]], dtype=torch.float64)
    dapo = trl_grpo_loss(loss_type="dapo", beta=0.1, use_bias_correction_kl=False)
    # (-1.2·0.9 - 0.9048374·1.5 - 1.0 + 0.4·0 + 0.5525855·1.2)/5; the KL is not weighted
    out = trl_grpo_loss(loss_type="dapo")(
        log_probs, old, advantages, mask, importance_sampling_ratio=ratio
    )
    assert_close(out.loss, -0.5548307152)
    ref_log_probs = torch.tensor(TRL_REF, dtype=torch.float64)
    out = dapo(log_probs, old, advantages, mask, ref_log_probs=ref_log_probs,
               importance_sampling_ratio=ratio)  # fmt: skip
    assert_close(out.loss, -0.5532253748)
    # an empty row counts in grpo's mean over rows: mean(-1.0349458, 0)
    empty = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert_close(trl_grpo_loss(loss_type="grpo")(log_probs, old, advantages, empty).loss,
                 -0.5174729030)  # fmt: skip
    # nothing selected: 0, metrics 0 and NaN extremes (TRL drops NaN when logging)
    out = trl_grpo_loss(loss_type="dapo")(log_probs, old, advantages, torch.zeros(2, 3))
    assert out.loss.item() == 0.0
    assert out.metrics["clip_ratio/low_mean"].item() == 0.0
    assert math.isnan(out.metrics["clip_ratio/low_min"].item())


def _random_batch(
    seed: int, rows: int = 5, tokens: int = 7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(rows, tokens, generator=generator, dtype=torch.float64) * 3
    old = log_probs + 0.4 * torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=generator)
    lengths[1] = 0  # an empty row
    mask = torch.arange(tokens) < lengths[:, None]
    return log_probs, old, advantages, mask


def _with_nan_padding(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.full_like(values, math.nan))


TRL_CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo", "epsilon_high": 0.28},
    {"loss_type": "dr_grpo", "max_completion_length": 9},
    {"loss_type": "dapo", "beta": 0.04},
    {"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.04},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.1, "delta": 1.5},
    {"loss_type": "dapo", "delta": 1.4, "beta": 0.04, "use_bias_correction_kl": False},
]


@pytest.mark.filterwarnings("ignore::rlobjectives.BiasedGradientWarning")
@pytest.mark.parametrize("options", TRL_CASES)
def test_trl_matches_reference(options: dict[str, object]) -> None:
    log_probs, old, advantages, mask = _random_batch(3)
    ref_log_probs = log_probs + 0.3 * torch.randn_like(log_probs)
    weights = torch.rand_like(log_probs) + 0.5
    call = {"num_items_in_batch": 40, "num_processes": 2, "gradient_accumulation_steps": 2}
    level = str(options.get("importance_sampling_level", "token"))
    weights_arg = weights[:, :1] if level == "sequence" else weights
    inputs = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    loss_fn = trl_grpo_loss(**options)  # type: ignore[arg-type]
    actual = loss_fn(
        _with_nan_padding(inputs[0], mask), _with_nan_padding(old, mask), advantages, mask,
        ref_log_probs=_with_nan_padding(ref_log_probs, mask), importance_sampling_ratio=weights_arg,
        **call,
    ).loss  # fmt: skip
    reference_options = {k: v for k, v in options.items() if k != "importance_sampling_level"}
    expected = ref.trl_grpo_loss(
        inputs[1], old, advantages, mask, level=level, ref_log_probs=ref_log_probs,
        importance_sampling_ratio=weights_arg, num_items_in_batch=40, num_processes=2,
        accumulation=2, **reference_options,  # type: ignore[arg-type]
    )  # fmt: skip
    assert_close(actual, expected.detach())
    actual.backward()
    expected.backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)


def test_trl_errors() -> None:
    with pytest.raises(ValueError, match="delta must be > 1"):
        trl_grpo_loss(loss_type="grpo", delta=1.0)
    with pytest.raises(ValueError, match="top_entropy_quantile must be <= 1"):
        trl_grpo_loss(loss_type="grpo", top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="off_policy_mask_threshold must be finite"):
        trl_grpo_loss(loss_type="grpo", off_policy_mask_threshold=math.inf)
    with pytest.raises(ValueError, match="sapo_temperature_neg must be > 0"):
        trl_grpo_loss(loss_type="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="vespo_lambda_pos must be > 0"):
        trl_grpo_loss(loss_type="vespo", vespo_lambda_pos=-1.0)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        trl_grpo_loss(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        trl_grpo_loss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        trl_grpo_loss(loss_type="grpo", importance_sampling_level="sequence_token")
    log_probs, old, advantages, mask = _trl_batch()
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        trl_grpo_loss(loss_type="grpo", beta=0.1)(log_probs, old, advantages, mask)
    with pytest.raises(ValueError, match="need entropy"):
        trl_grpo_loss(loss_type="grpo", top_entropy_quantile=0.2)(log_probs, old, advantages, mask)
    with pytest.raises(ValueError, match="need entropy"):
        trl_grpo_loss(loss_type="dapo", entropy_coef=0.01)(log_probs, old, advantages, mask)
    sequence = trl_grpo_loss(loss_type="grpo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="per-token advantages"):
        sequence(log_probs, old, advantages[:, None].expand(2, 3), mask)


# ---------------------------------------------------------------------------------------------
# verl. Batch: M = [[1,1,1],[1,1,0]], old p = [[.4,.6,.5],[.2,.8,.5]], new p = [[.6,.3,.5],
# [.8,.6,.5]] -> r = [[1.5, 0.5, 1], [4, 0.75, ·]]; A = [[1]*3, [-1]*3]; clip 0.2, c = 3.


def _verl_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[0.4, 0.6, 0.5], [0.2, 0.8, 0.5]], dtype=torch.float64).log()
    new = torch.tensor([[0.6, 0.3, 0.5], [0.8, 0.6, 0.5]], dtype=torch.float64).log()
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    return old, new.requires_grad_(True), advantages, torch.tensor(TRL_MASK, dtype=torch.bool)


def test_verl_vanilla_golden() -> None:
    old, log_prob, advantages, mask = _verl_batch()
    loss, metrics = verl_policy_loss("vanilla")(old, log_prob, advantages, mask)
    # row 1: [-max(1.5, 1.2), -max(0.5, 0.8), -1] = [-1.2, -0.5, -1]; row 2: t0 r = 4 -> dual
    # clip min(3, 4) = 3, t1 max(0.75, 0.8) = 0.8. (-1.2 - 0.5 - 1 + 3 + 0.8)/5 = 0.22
    assert_close(loss, 0.22)
    assert_close(metrics["actor/pg_clipfrac"], 0.4)  # row 1 t0, row 2 t1
    assert_close(metrics["actor/pg_clipfrac_lower"], 0.2)  # row 2 t0
    assert_close(metrics["actor/ppo_kl"], -math.log(2.25) / 5)
    # Metrics in the computation dtype: float64 here, float32 for bf16 inputs.
    assert {value.dtype for value in metrics.values()} == {torch.float64}
    low = verl_policy_loss("vanilla")(*(x.to(torch.bfloat16) for x in (old, log_prob, advantages)),
                                      mask)  # fmt: skip
    assert {value.dtype for value in low.metrics.values()} == {torch.float32}
    loss.backward()
    assert log_prob.grad is not None
    assert_close(log_prob.grad, [[0, -0.1, -0.2], [0, 0, 0]])  # -A r / 5 where unclipped
    # seq-mean-token-mean: row means [-0.9, 1.9] -> 0.5
    assert_close(verl_policy_loss()(old, log_prob, advantages, mask, "seq-mean-token-mean")[0], 0.5)
    # rollout_is_weights multiply the per-token losses: [-1.8, -0.25, -1, 6, 0.6]/5 = 0.71
    weights = torch.tensor([[1.5, 0.5, 1.0], [2.0, 0.75, 0.0]], dtype=torch.float64)
    out = verl_policy_loss()(old, log_prob, advantages, mask, rollout_is_weights=weights)
    assert_close(out.loss, 0.71)


def test_verl_gspo_and_gpg_golden() -> None:
    old, log_prob, advantages, mask = _verl_batch()
    # s = [0.75^(1/3), sqrt(3)] = [0.9085603, 1.7320508]; row 1 inside [0.8, 1.2]: -A s;
    # row 2 (A = -1): max(s, 1.2) = s. verl 0.9 honours loss_agg_mode for gspo: token-sum
    # 3·(-0.9085603) + 2·1.7320508 = 0.7384207 (verl <= 0.8 forced seq-mean-token-mean:
    # (-0.9085603 + 1.7320508)/2 = 0.41174525, below)
    loss, metrics = verl_policy_loss("gspo")(old, log_prob, advantages, mask, "token-sum")
    assert_close(loss, 0.73842073, torch.float32)
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    assert log_prob.grad is not None
    # the GSPO-token gradient of token t is -A_t s_i (token-sum: no divisor)
    assert_close(log_prob.grad, [[-0.9085603] * 3, [1.7320508] * 2 + [0.0]], torch.float32)
    log_prob.grad = None
    loss, _ = verl_policy_loss("gspo")(old, log_prob, advantages, mask, "seq-mean-token-mean")
    assert_close(loss, 0.41174525, torch.float32)
    loss.backward()
    # row 1: -s1/(3·2); row 2: +s2/(2·2)
    assert_close(log_prob.grad, [[-0.1514267] * 3, [0.4330127] * 2 + [0.0]], torch.float32)
    log_prob.grad = None
    loss, metrics = verl_policy_loss("gpg")(old, log_prob, advantages, mask)
    # -(ln .6 + ln .3 + ln .5) + (ln .8 + ln .6) = 1.6739764 -> / 5
    assert_close(loss, 0.33479529, torch.float32)
    assert metrics == {}
    loss.backward()
    assert_close(log_prob.grad, [[-0.2] * 3, [0.2, 0.2, 0.0]])


def test_verl_gspo_caps_the_sequence_log_ratio_from_above_only() -> None:
    # verl: log s = min(mean_t Δ, 10), no lower bound. Row 1: Δ = [12, 12] -> s = e^10 (capped,
    # no gradient), A = -1: loss max(e^10, 1.2) = 22026.4658 per token. Row 2: Δ = [-12, -12]
    # -> s = e^-12 = 6.1442e-6 (not bounded), A = 1: max(-s, -0.8) = -s, gradient -s.
    # token-mean: (2·22026.4658 - 2·6.1442e-6)/4 = 11013.2329
    old = torch.tensor([[-12.0, -12.0], [0.0, 0.0]], dtype=torch.float64)
    log_prob = torch.tensor([[0.0, 0.0], [-12.0, -12.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, metrics = verl_policy_loss("gspo")(old, log_prob, advantages, mask)
    e10, e12 = math.exp(10.0), math.exp(-12.0)
    assert_close(loss, (2 * e10 - 2 * e12) / 4)
    loss.backward()
    assert log_prob.grad is not None
    assert_close(log_prob.grad, [[0.0, 0.0], [-e12 / 4, -e12 / 4]])
    # pg_clipfrac counts pg2 > pg1: row 1 1.2 < e^10, row 2 -0.8 < -6.1e-6: neither row
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert_close(metrics["actor/ppo_kl"], 0.0)  # mean of -Δ = (-24 + 24)/4


AGG_GOLDEN = [
    # L = [[1,2,3],[4,5,99(pad)]], local: token-mean 15/5, token-sum 15, seq-mean-token-sum
    # (6+9)/2, seq-mean-token-mean (2+4.5)/2, seq-mean-token-sum-norm 7.5/T(=3)
    ("token-mean", [[1, 1, 1], [1, 1, 0]], {}, 3.0),
    ("token-sum", [[1, 1, 1], [1, 1, 0]], {}, 15.0),
    ("seq-mean-token-sum", [[1, 1, 1], [1, 1, 0]], {}, 7.5),
    ("seq-mean-token-mean", [[1, 1, 1], [1, 1, 0]], {}, 3.25),
    ("seq-mean-token-sum-norm", [[1, 1, 1], [1, 1, 0]], {}, 2.5),
    ("seq-mean-token-sum-norm", [[1, 1, 1], [1, 1, 0]], {"loss_scale_factor": 4}, 1.875),
    # global counts, dp_size 2, N = 10, G = 4: 15/10·2, 15/4·2, 6.5/4·2, 15/4·2/3
    ("token-mean", [[1, 1, 1], [1, 1, 0]], {"dp_size": 2, "batch_num_tokens": 10}, 3.0),
    ("token-sum", [[1, 1, 1], [1, 1, 0]], {"dp_size": 2}, 30.0),
    ("seq-mean-token-sum", [[1, 1, 1], [1, 1, 0]], {"dp_size": 2, "global_batch_size": 4}, 7.5),
    ("seq-mean-token-mean", [[1, 1, 1], [1, 1, 0]], {"dp_size": 2, "global_batch_size": 4}, 3.25),
    (
        "seq-mean-token-sum-norm",
        [[1, 1, 1], [1, 1, 0]],
        {"dp_size": 2, "global_batch_size": 4},
        2.5,
    ),  # fmt: skip
    # an empty row: the local seq-mean-token-sum* divide by the NON-EMPTY rows (6/1, 6/1/3),
    # the engine's global_batch_size counts every row (6/2, 6/2/3)
    ("seq-mean-token-sum", [[1, 1, 1], [0, 0, 0]], {}, 6.0),
    ("seq-mean-token-sum", [[1, 1, 1], [0, 0, 0]], {"global_batch_size": 2}, 3.0),
    ("seq-mean-token-sum-norm", [[1, 1, 1], [0, 0, 0]], {}, 2.0),
    ("seq-mean-token-sum-norm", [[1, 1, 1], [0, 0, 0]], {"global_batch_size": 2}, 1.0),
    ("token-mean", [[1, 1, 1], [0, 0, 0]], {}, 2.0),
]


@pytest.mark.parametrize(("mode", "mask", "info", "expected"), AGG_GOLDEN)
def test_verl_loss_agg_modes_golden(
    mode: str, mask: list[list[int]], info: dict[str, int], expected: float
) -> None:
    # gpg with A = -1 makes the per-token loss the log-probs themselves: -(-1)·L = L
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], dtype=torch.float64)
    config = {"global_batch_info": info}
    loss, _ = verl_policy_loss("gpg")(values, values, -torch.ones(2, 3), torch.tensor(mask), mode,
                                      config)  # fmt: skip
    assert_close(loss, expected)
    assert_close(loss, ref.verl_agg_loss(values, torch.tensor(mask), mode, **info))


class _ActorConfig:
    """Any object with verl's attribute names works as ``config``."""

    clip_ratio = 0.2
    clip_ratio_low = 0.15
    clip_ratio_high = 0.28
    clip_ratio_c = 2.5

    def __init__(self, info: dict[str, int]) -> None:
        self.global_batch_info = info


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "gpg"])
@pytest.mark.parametrize(
    ("mode", "info"),
    [
        ("token-mean", {}),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 9}),
        (
            "seq-mean-token-sum-norm",
            {"dp_size": 2, "global_batch_size": 9, "loss_scale_factor": 11},
        ),
        ("token-mean", {"dp_size": 4, "batch_num_tokens": 30, "global_batch_size": 9}),
    ],
)
def test_verl_matches_reference(loss_mode: str, mode: str, info: dict[str, int]) -> None:
    log_prob, old, _, mask = _random_batch(5)
    advantages = torch.randn(5, 7, dtype=torch.float64)
    inputs = [log_prob.clone().requires_grad_(True) for _ in range(2)]
    config = _ActorConfig(info)
    loss, _ = verl_policy_loss(loss_mode)(
        _with_nan_padding(old, mask), _with_nan_padding(inputs[0], mask), advantages, mask, mode,
        config,
    )  # fmt: skip
    losses = ref.verl_policy_losses(
        old, inputs[1], advantages, mask, loss_mode=loss_mode, clip_low=0.15, clip_high=0.28,
        clip_c=2.5,
    )  # fmt: skip
    expected = ref.verl_agg_loss(losses, mask, mode, **info)
    assert_close(loss, expected.detach())
    loss.backward()
    expected.backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)


def _bypass_config(**correction: object) -> dict[str, object]:
    return {"clip_ratio": 0.2, "clip_ratio_c": 3.0,
            "policy_loss": {"rollout_correction": {"bypass_mode": True, **correction}}}  # fmt: skip


def test_verl_bypass_mode_ppo_clip_golden() -> None:
    # bypass mode: old_log_prob is the sampler's; the loss is vanilla's against it, the IS
    # weights only feed the metrics. Ratios r = [[1.5, 0.5, 1], [4, 0.75, ·]] -> loss 0.22 (the
    # vanilla golden). Token TIS at 2.5: w = [1.5, 0.5, 1, 2.5, 0.75] -> mean 6.25/5 = 1.25, max
    # 2.5, min 0.5; raw above 2.5: one of 5; below 1/2.5: none. kl = mean(ℓ_rollout - ℓ) =
    # -ln(1.5·0.5·4·0.75)/5 = -ln(2.25)/5; chi2_token = mean(r²) - 1 = 20.0625/5 - 1 = 3.0125.
    old, log_prob, advantages, mask = _verl_batch()
    config = _bypass_config(rollout_is="token", rollout_is_threshold=2.5, loss_type="ppo_clip")
    loss, metrics = verl_policy_loss("bypass_mode")(old, log_prob, advantages, mask,
                                                    "token-mean", config)  # fmt: skip
    assert_close(loss, 0.22)
    assert_close(metrics["actor/pg_clipfrac"], 0.4)
    assert_close(metrics["rollout_corr/rollout_is_mean"], 1.25)
    assert_close(metrics["rollout_corr/rollout_is_max"], 2.5)
    assert_close(metrics["rollout_corr/rollout_is_min"], 0.5)
    assert_close(metrics["rollout_corr/rollout_is_ratio_fraction_high"], 0.2)
    assert_close(metrics["rollout_corr/rollout_is_ratio_fraction_low"], 0.0)
    assert_close(metrics["rollout_corr/kl"], -math.log(2.25) / 5)
    assert_close(metrics["rollout_corr/chi2_token"], 3.0125)
    assert "rollout_corr/rollout_is_oob_ratio" not in metrics  # IcePop only
    loss.backward()
    assert log_prob.grad is not None
    assert_close(log_prob.grad, [[0, -0.1, -0.2], [0, 0, 0]])  # vanilla's


def test_verl_bypass_mode_reinforce_with_rejection_golden() -> None:
    # rollout_rs token_k1 "0.6_1.6": keep -ln r in [ln 0.6, ln 1.6], i.e. r in [0.625, 1.667]:
    # r = [1.5 ✓, 0.5 ✗, 1 ✓, 4 ✗, 0.75 ✓]; no IS weights (rollout_is=None). REINFORCE on the 3
    # surviving tokens, token-mean over them: (-ln .6 - ln .5 + ln .6)/3 = ln 2 / 3; gradient
    # -A/3 there. actor/ppo_kl = mean of ℓ_old - ℓ over them = -ln(1.5·0.75)/3. 2 of 5 tokens
    # and both rows rejected something.
    old, log_prob, advantages, mask = _verl_batch()
    config = _bypass_config(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6",
                            loss_type="reinforce")  # fmt: skip
    loss, metrics = verl_policy_loss("bypass_mode")(old, log_prob, advantages, mask,
                                                    "token-mean", config)  # fmt: skip
    assert_close(loss, math.log(2.0) / 3)
    assert_close(metrics["actor/ppo_kl"], -math.log(1.125) / 3)
    assert {k for k in metrics if k.startswith("actor/")} == {"actor/ppo_kl"}
    assert_close(metrics["rollout_corr/rollout_rs_masked_fraction"], 0.4)
    assert_close(metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0)
    assert_close(metrics["rollout_corr/rollout_rs_token_k1_mean"], -math.log(2.25) / 5)
    assert not any(k.startswith("rollout_corr/rollout_is_") for k in metrics)
    loss.backward()
    assert log_prob.grad is not None
    third = 1.0 / 3
    assert_close(log_prob.grad, [[-third, 0, -third], [0, third, 0]])


def test_verl_bypass_mode_matches_reference() -> None:
    log_prob, old, _, mask = _random_batch(11)
    advantages = torch.randn(5, 7, dtype=torch.float64)
    cases = [
        ({"rollout_is": "token", "rollout_is_threshold": "0.6_1.8", "loss_type": "reinforce"},
         "seq-mean-token-sum"),
        ({"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": "seq_mean_k2",
          "rollout_rs_threshold": 0.11, "rollout_is_batch_normalize": True,
          "loss_type": "reinforce"}, "token-mean"),
        ({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k3,seq_sum_k1",
          "rollout_rs_threshold": "0.1,0.5_2.0", "loss_type": "ppo_clip"}, "seq-mean-token-mean"),
    ]  # fmt: skip
    for correction, aggregation in cases:
        inputs = [log_prob.clone().requires_grad_(True) for _ in range(2)]
        loss, _ = verl_policy_loss("bypass_mode")(
            _with_nan_padding(old, mask), _with_nan_padding(inputs[0], mask), advantages, mask,
            aggregation, _bypass_config(**correction),
        )  # fmt: skip
        losses, kept = ref.verl_bypass_losses(old, inputs[1], advantages, mask, **correction)  # type: ignore[arg-type]
        expected = ref.verl_agg_loss(losses, kept, aggregation)
        assert_close(loss, expected.detach())
        loss.backward()
        expected.backward()
        assert inputs[0].grad is not None and inputs[1].grad is not None
        assert_close(inputs[0].grad, inputs[1].grad)


def test_verl_bypass_mode_errors() -> None:
    old, log_prob, advantages, mask = _verl_batch()
    loss_fn = verl_policy_loss("bypass_mode")
    with pytest.raises(ValueError, match="rollout_correction"):
        loss_fn(old, log_prob, advantages, mask, "token-mean", {"clip_ratio": 0.2})
    bad = [
        ({"loss_type": "ppo"}, ValueError, "loss_type must be one of"),
        ({"rollout_is": "geometric", "rollout_is_threshold": 2.0}, ValueError, "rollout_is"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, ValueError, "lower bound"),
        ({"rollout_is": "token", "rollout_is_threshold": -1.0}, ValueError, "upper bound"),
        ({"rollout_is": "token", "rollout_is_threshold": True}, TypeError, "rollout_is_threshold"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 1.0}, ValueError, "rollout_rs"),
        ({"rollout_rs": "token_k2"}, ValueError, "rollout_rs_threshold must be provided"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_1"}, ValueError, "one upper"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1,2,3"}, ValueError,
         "one per rollout_rs option"),
    ]  # fmt: skip
    for correction, error, match in bad:
        with pytest.raises(error, match=match):
            loss_fn(old, log_prob, advantages, mask, "token-mean", _bypass_config(**correction))


def test_verl_errors() -> None:
    with pytest.raises(ValueError, match="loss_mode must be one of"):
        verl_policy_loss("no_such_mode")
    old, log_prob, advantages, mask = _verl_batch()
    # the options of the new modes, under verl's names (dro_beta has no default: verl raises)
    for mode, policy, message in (
        ("dro", {}, "policy_loss.dro_beta must be a positive value"),
        ("dro", {"dro_beta": 0.0}, "policy_loss.dro_beta"),
        ("clip_cov", {"clip_cov_ratio": 0.0}, "policy_loss.clip_cov_ratio"),
        ("clip_cov", {"clip_cov_ratio": 1.5}, "policy_loss.clip_cov_ratio must be <= 1"),
        ("clip_cov", {"clip_cov_lb": 2.0, "clip_cov_ub": 1.0}, "clip_cov_lb must be <"),
        ("clip_cov", {"clip_cov_ub": math.inf}, "policy_loss.clip_cov_ub"),
        ("kl_cov", {"kl_cov_ratio": -0.1}, "policy_loss.kl_cov_ratio"),
        ("kl_cov", {"ppo_kl_coef": -1.0}, "policy_loss.ppo_kl_coef"),
    ):
        with pytest.raises(ValueError, match=message):
            verl_policy_loss(mode)(old, log_prob, advantages, mask, "token-mean",
                                   {"policy_loss": policy})  # fmt: skip
    with pytest.raises(TypeError, match="policy_loss.dro_beta"):
        verl_policy_loss("dro")(old, log_prob, advantages, mask, "token-mean",
                                {"policy_loss": {"dro_beta": "0.1"}})  # fmt: skip
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        verl_policy_loss()(old, log_prob, advantages, mask, "token_mean")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        verl_policy_loss()(old, log_prob, advantages, mask, "token-mean",
                           {"global_batch_info": {"dp_size": 2}})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# OpenRLHF. Batch: old = -1, r = [[1.5, 0.7, 1.0], [0.5, 3.0, 10(pad)]], A = [[1]*3, [-2]*3].


def _openrlhf_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = -torch.ones(2, 3, dtype=torch.float64)
    ratio = torch.tensor([[1.5, 0.7, 1.0], [0.5, 3.0, 10.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    return (old + ratio.log()).requires_grad_(True), old, advantages, torch.tensor(TRL_MASK)


def test_openrlhf_golden() -> None:
    log_probs, old, advantages, mask = _openrlhf_batch()
    # token mode: [-1.2 (clipped), -0.7, -1.0, 1.6 (clipped), 6.0] -> 4.7/5
    out = openrlhf_policy_loss()(log_probs, old, advantages, mask)
    assert len(out) == 5  # OpenRLHF 0.11's forward: (loss, clip_ratio, ppo_kl, vllm_kl,
    # is_filter_ratio); the last two only with the IS correction
    assert_close(out.loss, 0.94)
    assert_close(out.clip_ratio, 0.4, torch.float32)
    assert_close(out.ppo_kl, -math.log(1.5 * 0.7 * 0.5 * 3.0) / 5)
    assert out.vllm_kl is None and out.is_filter_ratio is None
    out.loss.backward()
    assert log_probs.grad is not None
    assert_close(log_probs.grad, [[0, -0.14, -0.2], [0, 1.2, 0]])
    # token_level_loss with the trainer's global count N of the step and dp_size: Σ L / N · dp
    # (4.7/10·2); every micro-batch of a step uses the same N, so their losses add up
    global_out = openrlhf_policy_loss()(
        log_probs, old, advantages, mask, dp_size=2, batch_num_tokens=10
    )
    assert_close(global_out.loss, 0.94)
    # sample mode: mean(-2.9/3, 7.6/2)
    sample = openrlhf_policy_loss(token_level_loss=False)(log_probs, old, advantages, mask)
    assert_close(sample.loss, 1.4166666667)
    # dual clip 2.5: the r = 3 token (A = -2) becomes max(-6, -5) -> loss 5: (-2.9+1.6+5)/5
    log_probs.grad = None
    dual = openrlhf_policy_loss(dual_clip=2.5)(log_probs, old, advantages, mask)
    assert_close(dual.loss, 0.74)
    dual.loss.backward()
    assert_close(log_probs.grad, [[0, -0.14, -0.2], [0, 0, 0]])
    # gspo: s = [exp(mean log r)] = [1.0163964, sqrt(1.5)]: mean(-1.0163964, 2.4494897)
    log_probs.grad = None
    gspo = openrlhf_policy_loss(policy_loss_type="gspo")(log_probs, old, advantages, mask)
    assert_close(gspo.loss, 0.7165467, torch.float32)
    assert gspo.clip_ratio.item() == 0.0
    gspo.loss.backward()
    assert_close(log_probs.grad, [[-0.1693994] * 3, [0.6123724] * 2 + [0.0]], torch.float32)


def test_openrlhf_gspo_gradient_is_the_sequence_mean_for_per_token_advantages() -> None:
    # OpenRLHF differentiates s_i = exp(mean_t Δ) itself: d/dℓ_u = Σ_t ∂L_t/∂log s_i / n_i, the
    # same for every token of the row. Row 1: s = 1.05^(1/3) = 1.0163964 (inside the band),
    # A = [1, 2, 3]: row mean -s·(1 + 2 + 3)/3 = -2s; row 2: s = sqrt(1.5) = 1.2247449 > 1.2 but
    # A = [-1, -3] < 0, unclipped: row mean s·(1 + 3)/2 = 2s. Sample mode over the 2 rows:
    # (-2.0327928 + 2.4494897)/2. Gradients: row 1 (1/2)·(-2)·s/3 = -0.3387988 on each token
    # (the GSPO-token form would give -s·A_u/6), row 2 (1/2)·2·s/2 = 0.6123724 on each.
    log_probs, old, _, mask = _openrlhf_batch()
    advantages = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -3.0, 0.0]], dtype=torch.float64)
    out = openrlhf_policy_loss(policy_loss_type="gspo")(log_probs, old, advantages, mask)
    assert_close(out.loss, (-2.0327928 + 2.4494897) / 2, torch.float32)
    out.loss.backward()
    assert log_probs.grad is not None
    assert_close(log_probs.grad, [[-0.3387988] * 3, [0.6123724] * 2 + [0.0]], torch.float32)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"clip_eps_low": 0.1, "clip_eps_high": 0.28, "dual_clip": 3.0},
        {"token_level_loss": False},
        {"policy_loss_type": "gspo", "dual_clip": 2.0},
        {"policy_loss_type": "gspo", "clip_eps_low": 0.05, "clip_eps_high": 0.05},
    ],
)
@pytest.mark.parametrize("token_advantages", [False, True])
def test_openrlhf_matches_reference(options: dict[str, object], token_advantages: bool) -> None:
    log_probs, old, advantages, mask = _random_batch(7)
    advantages = advantages[:, None].expand(5, 7)  # OpenRLHF's (B, T) advantages
    if token_advantages:  # GAE or KL-in-reward: they vary along the sequence
        advantages = advantages + torch.randn(5, 7, dtype=torch.float64)
    inputs = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    counts = {"dp_size": 2, "batch_num_tokens": 31, "global_batch_size": 8}
    out = openrlhf_policy_loss(**options)(  # type: ignore[arg-type]
        _with_nan_padding(inputs[0], mask), _with_nan_padding(old, mask), advantages, mask,
        **counts,
    )  # fmt: skip
    expected = ref.openrlhf_policy_forward(inputs[1], old, advantages, mask, **options, **counts)  # type: ignore[arg-type]
    assert_close(out.loss, expected["loss"].detach())
    assert_close(out.clip_ratio, expected["clip_ratio"])
    assert_close(out.ppo_kl, expected["ppo_kl"])
    out.loss.backward()
    expected["loss"].backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    assert_close(inputs[0].grad, inputs[1].grad)


def test_openrlhf_errors() -> None:
    for threshold in ([2.0, 1.0], [-0.1, 1.0], [0.5, math.inf], [0.0, 0.0], [1, 2, 3]):
        with pytest.raises(ValueError, match="is_correction_threshold must be"):
            openrlhf_policy_loss(is_correction_threshold=threshold)
    for wrong_type in ("0.5", None, torch.tensor(2.0)):  # not a number or a sequence of them
        with pytest.raises(TypeError, match="^is_correction_threshold must be"):
            openrlhf_policy_loss(is_correction_threshold=wrong_type)  # type: ignore[arg-type]
    assert openrlhf_policy_loss(is_correction_threshold=[2.0]).is_correction_threshold == (0, 2)
    assert openrlhf_policy_loss(is_correction_threshold=0.1).is_correction_threshold == (0, 0.1)
    log_probs, old, advantages, mask = _openrlhf_batch()
    for level in ("token", "seq"):
        with pytest.raises(ValueError, match=f"is_correction_level='{level}' needs rollout"):
            openrlhf_policy_loss(is_correction_level=level)(log_probs, old, advantages, mask)
    for name, value in (("is_correction_level", "on"), ("is_correction_mode", "truncate"),
                        ("is_correction_gating", "kl"), ("policy_loss_type", "cispo")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{name} must be one of"):
            openrlhf_policy_loss(**{name: value})  # type: ignore[arg-type]
    # OpenRLHF's own rules: clip needs the token level and the ratio; a divergence an upper
    # bound only
    for level, gating in (("seq", "ratio"), ("token", "binary_kl"), ("off", "tv")):
        with pytest.raises(ValueError, match="is_correction_mode='clip' requires"):
            openrlhf_policy_loss(is_correction_mode="clip", is_correction_level=level,
                                 is_correction_gating=gating)  # fmt: skip
    with pytest.raises(ValueError, match="takes an upper bound only"):
        openrlhf_policy_loss(is_correction_level="seq", is_correction_gating="binary_kl")
    openrlhf_policy_loss(is_correction_gating="tv")  # level off: the band is not read
    with pytest.raises(ValueError, match="dual_clip must be > 1.0"):
        openrlhf_policy_loss(dual_clip=1.0)
    with pytest.raises(TypeError, match="enable_vllm_is_correction"):  # the 0.10 API is gone
        openrlhf_policy_loss(enable_vllm_is_correction=True)  # type: ignore[call-arg]


def test_openrlhf_gspo_against_the_sampler() -> None:
    # gspo with any correction level: the sequence ratio is taken against rollout_log_probs,
    # no weight, no vllm_kl / is_filter_ratio (as OpenRLHF)
    log_probs, old, advantages, mask = _openrlhf_batch()
    rollout = old.detach() - 0.1
    loss_fn = openrlhf_policy_loss(policy_loss_type="gspo", is_correction_level="token")
    out = loss_fn(log_probs, old, advantages, mask, rollout_log_probs=rollout)
    plain = openrlhf_policy_loss(policy_loss_type="gspo")(log_probs, rollout, advantages, mask)
    assert_close(out.loss, plain.loss.detach())
    assert_close(out.ppo_kl, -math.log(1.5 * 0.7 * 0.5 * 3.0) / 5)  # still against old
    assert out.vllm_kl is None and out.is_filter_ratio is None


def test_presets_import_no_peer() -> None:
    code = (
        "import sys, rlobjectives, rlobjectives.presets, rlobjectives.integrations; "
        "peers = ('trl', 'transformers', 'verl', 'openrlhf', 'deepspeed', 'ray'); "
        "assert not any(m.split('.')[0] in peers for m in sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Every preset coefficient and threshold is checked like the library's own hyperparameters
# (issue 27): a non-finite, out-of-range or non-number value is a ValueError / TypeError naming
# the option under the peer's name, when the preset is built (verl: when it is called, since
# verl passes its config with the tensors), never a NaN or inf loss later.
NAN, INF = math.nan, math.inf
BAD_NUMBERS = ((NAN, ValueError), (INF, ValueError), (-INF, ValueError), ("0.2", TypeError),
               (True, TypeError))  # fmt: skip
# option -> (out-of-range values, extra options the row needs)
TRL_OPTIONS: dict[str, tuple[tuple[float, ...], dict[str, object]]] = {
    "epsilon": ((-0.1, 1.0), {}),
    "epsilon_high": ((-0.1,), {}),
    "beta": ((-0.1,), {}),
    "delta": ((1.0, 0.5), {}),
    "max_completion_length": ((0, 2.5, -3), {"loss_type": "dr_grpo"}),
    "sapo_temperature_pos": ((0.0, -1.0), {"loss_type": "sapo"}),
    "sapo_temperature_neg": ((0.0,), {"loss_type": "sapo"}),
    "vespo_k_pos": ((-0.1,), {"loss_type": "vespo"}),
    "vespo_lambda_pos": ((0.0,), {"loss_type": "vespo"}),
    "vespo_k_neg": ((-0.1,), {"loss_type": "vespo"}),
    "vespo_lambda_neg": ((0.0,), {"loss_type": "vespo"}),
    "top_entropy_quantile": ((-0.1, 1.5), {}),
    "entropy_coef": ((), {}),
    "off_policy_mask_threshold": ((), {}),
}
OPENRLHF_OPTIONS: dict[str, tuple[tuple[float, ...], dict[str, object]]] = {
    "clip_eps_low": ((-0.1, 1.0), {}),
    "clip_eps_high": ((-0.1,), {}),
    "dual_clip": ((1.0, 0.5), {}),
}
VERL_OPTIONS: dict[str, tuple[float, ...]] = {
    "clip_ratio": (-0.1, 1.0),
    "clip_ratio_low": (-0.1, 1.0),
    "clip_ratio_high": (-0.1,),
    "clip_ratio_c": (1.0, 0.5),
    "tau_pos": (0.0,),
    "tau_neg": (-1.0,),
}
VERL_BATCH_INFO: dict[str, tuple[object, ...]] = {
    "dp_size": (0, 2.5, NAN),
    "batch_num_tokens": (0.0, NAN, INF),
    "global_batch_size": (-1.0, NAN),
    "loss_scale_factor": (0.0, INF),
}


def _bad_values(out_of_range: tuple[object, ...]) -> list[tuple[object, type[Exception]]]:
    return [*BAD_NUMBERS, *((value, ValueError) for value in out_of_range)]


def _preset_rows(
    options: dict[str, tuple[tuple[float, ...], dict[str, object]]],
) -> list[object]:
    return [
        pytest.param(name, value, error, extra, id=f"{name}={value!r}")
        for name, (out_of_range, extra) in options.items()
        for value, error in _bad_values(out_of_range)
    ]


@pytest.mark.parametrize(("name", "value", "error", "extra"), _preset_rows(TRL_OPTIONS))
def test_trl_options_are_validated_at_construction(
    name: str, value: object, error: type[Exception], extra: dict[str, object]
) -> None:
    arguments: dict[str, object] = {"loss_type": "grpo", **extra, name: value}
    if name == "max_completion_length" and isinstance(value, float) and value == 2.5:
        error = ValueError  # a fractional length is a value error, as max_response_length's
    with pytest.raises(error, match=rf"^{name}\b"):
        trl_grpo_loss(**arguments)  # type: ignore[arg-type]


def test_trl_cispo_cap_and_flags_are_validated_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^epsilon_high must be > 0"):
        trl_grpo_loss(loss_type="cispo", epsilon_high=0.0)  # the cap on the ratio itself
    with pytest.raises(TypeError, match=r"^use_bias_correction_kl must be a bool"):
        trl_grpo_loss(loss_type="grpo", use_bias_correction_kl="no")  # type: ignore[arg-type]
    loss_fn = trl_grpo_loss(loss_type="dapo", entropy_coef=0.01)
    log_probs, old, advantages, mask = _trl_batch()
    entropy = torch.ones(2, 3, dtype=torch.float64)
    calls = (("entropy_coef", NAN), ("num_processes", 0), ("gradient_accumulation_steps", 1.5),
             ("steps_per_generation", -1))  # fmt: skip
    for name, value in calls:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            loss_fn(log_probs, old, advantages, mask, entropy=entropy, **{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "value", "error", "extra"), _preset_rows(OPENRLHF_OPTIONS))
def test_openrlhf_options_are_validated_at_construction(
    name: str, value: object, error: type[Exception], extra: dict[str, object]
) -> None:
    with pytest.raises(error, match=rf"^{name}\b"):
        openrlhf_policy_loss(**{**extra, name: value})  # type: ignore[arg-type]


def test_openrlhf_flags_are_validated_at_construction() -> None:
    with pytest.raises(TypeError, match=r"^token_level_loss must be a bool"):
        openrlhf_policy_loss(token_level_loss="yes")  # type: ignore[arg-type]
    for threshold in ([NAN, 2.0], [0.5, NAN], [True, 2.0]):
        with pytest.raises(ValueError, match=r"^is_correction_threshold must be"):
            openrlhf_policy_loss(is_correction_threshold=threshold)
    log_probs, old, advantages, mask = _openrlhf_batch()
    with pytest.raises(ValueError, match=r"^dp_size\b"):
        openrlhf_policy_loss()(log_probs, old, advantages, mask, dp_size=0)


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        pytest.param(name, value, error, id=f"{name}={value!r}")
        for name, out_of_range in VERL_OPTIONS.items()
        for value, error in _bad_values(out_of_range)
    ],
)
def test_verl_config_is_validated_at_every_call(
    name: str, value: object, error: type[Exception]
) -> None:
    old, log_prob, advantages, mask = _verl_batch()
    for mode in ("vanilla", "geo_mean", "sapo"):  # whether the mode reads the option or not
        with pytest.raises(error, match=rf"^{name}\b"):
            verl_policy_loss(mode)(old, log_prob, advantages, mask, "token-mean", {name: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [pytest.param(k, v, id=f"{k}={v!r}") for k, values in VERL_BATCH_INFO.items() for v in values],
)
def test_verl_global_batch_info_is_validated_at_every_call(key: str, value: object) -> None:
    old, log_prob, advantages, mask = _verl_batch()
    config = {"global_batch_info": {key: value}}
    with pytest.raises(ValueError, match=rf"^global_batch_info\['{key}'\]"):
        verl_policy_loss()(old, log_prob, advantages, mask, "token-mean", config)


# ---------------------------------------------------------------------------------------------
# Issue 31: the same class in every mode and at every call. Every verl mode checks every option
# (also those it does not read, and the ones that force their own aggregation), verl's
# policy_loss.* numbers included; dppo_tv's high edge is a TV threshold, at most 1, named as
# verl names it; bypass mode reads its sub-config as verl does; the call-time counts of TRL and
# OpenRLHF and the advantage presets' weights are checked under the peers' names.
VERL_MODES = tuple(presets_verl.VERL_LOSS_MODES)
VERL_POLICY_OPTIONS: dict[str, tuple[float, ...]] = {
    "clip_cov_ratio": (0.0, 1.5),
    "kl_cov_ratio": (0.0, 1.5),
    "clip_cov_lb": (),
    "clip_cov_ub": (),
    "ppo_kl_coef": (-0.1,),
    "dro_beta": (0.0, -1.0),
}


def _verl_config(mode: str, **top: object) -> dict[str, object]:
    """A config every mode accepts (dro needs its beta, bypass mode its correction)."""
    policy: dict[str, object] = {"dro_beta": 0.1}
    if mode == "bypass_mode":
        policy["rollout_correction"] = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    return {"policy_loss": policy, **top}


@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_every_option_is_validated_in_every_mode(mode: str) -> None:
    old, log_prob, advantages, mask = _verl_batch()
    loss = verl_policy_loss(mode)
    with pytest.raises(ValueError, match=r"^loss_agg_mode must be one of"):
        loss(old, log_prob, advantages, mask, "bogus", _verl_config(mode))
    for name, out_of_range in VERL_OPTIONS.items():
        for value, error in _bad_values(out_of_range):
            with pytest.raises(error, match=rf"^{name}\b"):
                loss(
                    old,
                    log_prob,
                    advantages,
                    mask,
                    "token-mean",
                    _verl_config(mode, **{name: value}),
                )
    for name, out_of_range in VERL_POLICY_OPTIONS.items():
        for value, error in _bad_values(out_of_range):
            config = _verl_config(mode)
            config["policy_loss"] = {**config["policy_loss"], name: value}  # type: ignore[dict-item]
            with pytest.raises(error, match=rf"^policy_loss\.{name}\b"):
                loss(old, log_prob, advantages, mask, "token-mean", config)
    config = _verl_config(mode)
    config["policy_loss"] = {**config["policy_loss"], "clip_cov_lb": 5.0, "clip_cov_ub": 1.0}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^policy_loss\.clip_cov_lb must be < "):
        loss(old, log_prob, advantages, mask, "token-mean", config)


def test_verl_dppo_tv_high_edge_is_at_most_one_under_verls_name() -> None:
    old, log_prob, advantages, mask = _verl_batch()
    for top, name in (({"clip_ratio_high": 1.5}, "clip_ratio_high"),
                      ({"clip_ratio": 1.2, "clip_ratio_low": 0.2}, "clip_ratio")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{name} must be <= 1 for loss_mode='dppo_tv'"):
            verl_policy_loss("dppo_tv")(old, log_prob, advantages, mask, "token-mean", top)
    # a threshold of exactly 1 is a band no token leaves (|p - p_old| <= 1), as DPPO's own
    verl_policy_loss("dppo_tv")(
        old, log_prob, advantages, mask, "token-mean", {"clip_ratio_high": 1.0}
    )


def test_verl_bypass_sub_config_is_read_as_verl_reads_it() -> None:
    old, log_prob, advantages, mask = _verl_batch()
    loss_fn = verl_policy_loss("bypass_mode")
    bad = [
        ({"loss_type": None}, ValueError, r"^loss_type must be one of"),
        ({"rollout_is": "token", "rollout_is_batch_normalize": "yes"}, TypeError,
         r"^rollout_is_batch_normalize must be a bool"),
        ({"rollout_is": "token", "rollout_is_threshold": False}, TypeError, "not a boolean"),
        ({"rollout_is": "token", "rollout_is_threshold": " "}, ValueError,
         r"^rollout_is_threshold must not be an empty string"),
    ]  # fmt: skip
    for correction, error, match in bad:
        with pytest.raises(error, match=match):
            loss_fn(old, log_prob, advantages, mask, "token-mean", _bypass_config(**correction))
    # a missing threshold is verl's 2.0: the same numbers as 2.0 given
    missing = loss_fn(old, log_prob, advantages, mask, "token-mean",
                      _bypass_config(rollout_is="sequence", loss_type="reinforce"))  # fmt: skip
    given = loss_fn(old, log_prob, advantages, mask, "token-mean",
                    _bypass_config(rollout_is="sequence", rollout_is_threshold=2.0,
                                   loss_type="reinforce"))  # fmt: skip
    assert_close(missing.loss, given.loss)
    assert missing.metrics.keys() == given.metrics.keys()


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_trl_num_items_in_batch_is_validated_where_read(loss_type: str) -> None:
    log_probs, old, advantages, mask = _trl_batch()
    loss_fn = trl_grpo_loss(loss_type=loss_type)
    wrong = ((NAN, ValueError), (-1.0, ValueError), ("26", TypeError),
             (torch.tensor(NAN), ValueError), (torch.tensor([26.0]), TypeError))  # fmt: skip
    for value, error in wrong:
        with pytest.raises(error, match=r"^num_items_in_batch\b"):
            loss_fn(log_probs, old, advantages, mask, num_items_in_batch=value)  # type: ignore[arg-type]
    loss_fn(log_probs, old, advantages, mask, num_items_in_batch=torch.tensor(0.0))  # TRL: >= 1


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_openrlhf_global_counts_are_validated_under_their_names(token_level_loss: bool) -> None:
    log_probs, old, advantages, mask = _openrlhf_batch()
    loss_fn = openrlhf_policy_loss(token_level_loss=token_level_loss)
    name = "batch_num_tokens" if token_level_loss else "global_batch_size"
    for value, error in ((NAN, ValueError), (0, ValueError), ("5", TypeError),
                         (torch.tensor(-1.0), ValueError)):  # fmt: skip
        with pytest.raises(error, match=rf"^{name}\b"):
            loss_fn(log_probs, old, advantages, mask, **{name: value})


def test_advantage_presets_check_weights_and_groups_under_the_peers_names() -> None:
    rewards = torch.randn(4, 2, dtype=torch.float64)
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        with pytest.raises(ValueError, match=r"^reward_weights must be finite"):
            trl_grpo_advantages(rewards, 2, reward_weights=[1.0, NAN],
                                multi_objective_aggregation=aggregation)  # fmt: skip
        with pytest.raises(ValueError, match=r"^num_generations must divide"):
            trl_grpo_advantages(rewards, 3, multi_objective_aggregation=aggregation)
    with pytest.raises(ValueError, match=r"^gdpo_reward_weights must be finite"):
        verl_gdpo_advantages(rewards, torch.ones(4, 3), [0, 0, 1, 1],
                             gdpo_reward_weights=[INF, 1.0])  # fmt: skip
    with pytest.raises(TypeError, match=r"^gdpo_reward_weights\b"):
        verl_gdpo_advantages(rewards, torch.ones(4, 3), [0, 0, 1, 1], gdpo_reward_weights="3")


def test_trl_jsd_num_items_in_batch_is_validated_under_its_name() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    for value, error in ((0, ValueError), (NAN, ValueError), ("4", TypeError)):
        with pytest.raises(error, match=r"^num_items_in_batch\b"):
            trl_generalized_jsd_loss(logits, logits, num_items_in_batch=value)
