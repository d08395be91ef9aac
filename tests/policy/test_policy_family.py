"""The rest of the policy-loss family (issue 13) and importance weights (issue 12, policy side).

Parity with the peers on hand-checked examples (TRL ``GRPOTrainer._compute_loss`` of PyPI 1.16,
verl ``core_algos.py``; the numbers are the ones of ``/work/notes`` derived from their code,
arithmetic in the comments), the semantics of ``importance_weights`` and of the entropy bonus
against the float64 reference, ``top_entropy_mask`` against TRL's ``get_high_entropy_mask``
formula, micro-batch invariance with weights and entropy, and one compiled call. The option
tables of test_policy_loss.py / test_fused.py / test_from_hidden.py cover every variant against
the reference on random batches.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import CISPO, Clip, kl_loss, policy_loss, top_entropy_mask
from rlobjectives.kl.estimators import BiasedGradientWarning
from tolerances import assert_close

F64 = torch.float64

# TRL's example (notes/trl.md 1.3): B = 2, T = 3, the last token of row 2 is padding.
TRL_LOG_PROBS = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], dtype=F64)
TRL_LOG_RATIO = torch.tensor([[0.3, -0.1, 0.0], [-0.4, 0.1, 0.7]], dtype=F64)
TRL_OLD = TRL_LOG_PROBS - TRL_LOG_RATIO
TRL_MASK = torch.tensor([[True, True, True], [True, True, False]])
TRL_ADVANTAGES = torch.tensor([1.0, -0.5], dtype=F64)
TRL_ENTROPY = torch.tensor([[0.5, 2.0, 1.0], [1.5, 0.2, 3.0]], dtype=F64)
TRL_REF = torch.tensor([[-1.2, -1.8, -0.5], [-0.9, -1.0, -2.0]], dtype=F64)
TRL_IS_RATIO = torch.tensor([[0.9, 1.5, 1.0], [0.0, 1.2, 1.0]], dtype=F64)
TRL_N = 5  # num_items_in_batch (dapo/cispo/vespo normaliser, one process, GA = spg = 1)

# verl's example (notes/verl.md 2): r = [[1.5, 0.5, 1.0], [4.0, 0.75, (pad)]], A = +1 / -1.
VERL_OLD = torch.tensor([[0.4, 0.6, 0.5], [0.2, 0.8, 0.5]], dtype=F64).log()
VERL_LOG_PROBS = torch.tensor([[0.6, 0.3, 0.5], [0.8, 0.6, 0.5]], dtype=F64).log()
VERL_ADVANTAGES = torch.tensor([1.0, -1.0], dtype=F64)
VERL_WEIGHTS = torch.tensor([[1.5, 0.5, 1.0], [2.0, 0.75, 0.0]], dtype=F64)


def trl(**kwargs: Any) -> tuple[Any, torch.Tensor]:
    """policy_loss on TRL's example: output and d loss / d log_probs (fused and autograd agree)."""
    return _run(TRL_LOG_PROBS, TRL_OLD, TRL_ADVANTAGES, **kwargs)


def verl(**kwargs: Any) -> tuple[Any, torch.Tensor]:
    return _run(VERL_LOG_PROBS, VERL_OLD, VERL_ADVANTAGES, **kwargs)


def _run(
    log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, **kwargs: Any
) -> tuple[Any, torch.Tensor]:
    leaf = log_probs.clone().requires_grad_(True)
    out = policy_loss(leaf, old, advantages, TRL_MASK, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    return out, grad


# --------------------------------------------------------------------------------------------
# TRL (GRPOTrainer._compute_loss, PyPI 1.16; identical in the snapshot unless said)
# --------------------------------------------------------------------------------------------


def test_trl_cispo() -> None:
    # cispo, epsilon_high = 1.3 (an absolute cap): w = min(r, 1.3) = [[1.3, 0.9048374, 1.0],
    # [0.6703200, 1.1051709]]; L = -w A logp = [1.3, 1.8096748, 0.5] (sum 3.6096748) and
    # [-0.2346120, -0.6631025] (sum -0.8977146); loss = 2.7119602 / 5 = 0.5423920538.
    out, grad = trl(surrogate=CISPO(cap=1.3), normalizer=TRL_N)
    assert_close(out.loss, 0.5423920538)
    # grad = -w A / 5
    assert_close(grad, [[-0.26, -0.1809674836, -0.2], [0.0670320046, 0.1105170918, 0.0]])
    assert_close(out.diagnostics.clip_fraction_high, 0.2)  # TRL cispo_clip_ratio: 1 of 5
    # epsilon_high = 5.0 (ScaleRL's value): nothing capped
    out, _ = trl(surrogate=CISPO(cap=5.0), normalizer=TRL_N)
    assert_close(out.loss, 0.5523638153)
    assert_close(out.diagnostics.clip_fraction_high, 0.0)


def test_trl_sapo() -> None:
    # sapo (grpo normalisation: mean over the rows of the token means), tau = 1 for A > 0,
    # 1.05 otherwise: row 1: -4 sigmoid(r - 1) = -[2.3463334, 1.9049092, 2.0] -> mean
    # -2.0837475; row 2: 0.5 * 4/1.05 sigmoid(1.05 (r - 1)) = [0.7891675, 1.0049130] -> mean
    # 0.8970403; loss = (-2.0837475 + 0.8970403) / 2 = -0.5933536089.
    out, grad = trl(surrogate="sapo", reduction="sequence_mean")
    assert_close(out.loss, -0.5933536089)
    assert_close(
        grad,
        [[-0.2182301663, -0.1504653288, -0.1666666667], [0.0813291708, 0.1377260571, 0.0]],
    )
    # A = 0 takes the negative temperature and contributes exactly 0: only row 2 remains
    zero_first = policy_loss(
        TRL_LOG_PROBS, TRL_OLD, torch.tensor([0.0, -0.5], dtype=F64), TRL_MASK,
        surrogate="sapo", reduction="sequence_mean",
    )  # fmt: skip
    assert_close(zero_first.loss, 0.4485201456)


def test_trl_vespo() -> None:
    # Sequence log-ratio = SUM of the token log-ratios: row 1 0.2, row 2 -0.3;
    # phi = exp(lam + k log w - lam w): row 1 (A >= 0: k = 2, lam = 3): 3 + 0.4 - 3 e^0.2
    # = -0.2642083 -> 0.7678136; row 2 (k = 3, lam = 2): 2 - 0.9 - 2 e^-0.3 -> 0.6827432.
    # L = -phi A logp; loss = (0.7678136 * 3.5 - 0.3413716 * 1.9) / 5 = 0.4077483121.
    out, grad = trl(surrogate="vespo", normalizer=TRL_N)
    assert_close(out.loss, 0.4077483121)
    row_1, row_2 = -0.1535627214, 0.0682743225  # -phi A / 5 at every selected token
    assert_close(grad, [[row_1, row_1, row_1], [row_2, row_2, 0.0]])
    phi = (math.exp(3 + 0.4 - 3 * math.exp(0.2)), math.exp(2 - 0.9 - 2 * math.exp(-0.3)))
    # TRL's vespo/phi_seq_mean is (phi_1 + phi_2) / 2 = 0.7252784162 per sequence; ours per token
    assert_close(out.diagnostics.weight_mean, (3 * phi[0] + 2 * phi[1]) / 5)
    # The vLLM importance ratio enters phi in log space (not the loss): row 1 log w = 0.2 +
    # ln 0.9 + ln 1.5 = 0.5001046 -> phi = 0.3881079; row 2 has a zero ratio -> log clamped to
    # ln 1e-8 and the whole log w too -> phi = e^(2 + 3 ln 1e-8 - 2e-8) = 7.6e-24 (killed).
    weighted, _ = trl(surrogate="vespo", normalizer=TRL_N, importance_weights=TRL_IS_RATIO)
    assert_close(weighted.loss, 0.2716755027)


def test_trl_delta_two_sided_clip() -> None:
    # delta = 1.1 < 1 + eps_high: row 1 token 0 (r = 1.3499, A = 1) -> min(min(r, 1.1),
    # clip(r)) = 1.1, L = -1.1; grpo loss = mean(-(1.1 + 0.9048374 + 1)/3, 0.9525855/2)
    # = -0.2626598716; the capped token has no gradient.
    out, grad = trl(surrogate=Clip(delta=1.1), reduction="sequence_mean")
    assert_close(out.loss, -0.2626598716)
    assert grad[0, 0] == 0
    # delta = 1.3 > 1 + eps_high: nothing changes (no A < 0 token above 1.3)
    assert_close(trl(surrogate=Clip(delta=1.3), reduction="sequence_mean")[0].loss, -0.2793265382)
    # For A < 0, delta > 1 + eps_high is the dual clip with c = delta (verl clip_ratio_c).
    batch = (torch.tensor([[math.log(4.0)]], dtype=F64), torch.zeros(1, 1, dtype=F64))
    minus = torch.tensor([-1.0], dtype=F64)
    # r = 4, A = -1: -min(min(4, 3) (-1), clip(4) (-1)) = -min(-3, -1.2) = 3
    assert_close(policy_loss(*batch, minus, [[True]], surrogate=Clip(delta=3.0)).loss, 3.0)
    assert_close(policy_loss(*batch, minus, [[True]], surrogate=Clip(dual=3.0)).loss, 3.0)


def test_trl_loss_types_are_reductions() -> None:
    # The clipped surrogate L = [-1.2, -0.9048374, -1.0 | 0.4, 0.5525855] under TRL's
    # normalisations: grpo mean(-3.1048374/3, 0.9525855/2) = -0.2793265382; dapo/bnpo
    # -2.1522519/5 = -0.4304503918; dr_grpo (max_completion_length 4) -2.1522519/(2*4)
    # = -0.2690314949; luspo (>= 1.10) mean over rows of the row sums -2.1522519/2.
    assert_close(trl(reduction="sequence_mean")[0].loss, -0.2793265382)
    assert_close(trl(normalizer=TRL_N)[0].loss, -0.4304503918)
    assert_close(
        trl(reduction="sequence_sum_normalized", max_response_length=4)[0].loss, -0.2690314949
    )
    out, grad = trl(reduction="length_weighted")
    assert_close(out.loss, -1.0761259795)
    assert_close(grad, [[0.0, -0.452418709, -0.5], [0.0, 0.2762927295, 0.0]])
    # luspo with importance_sampling_level="sequence": s = [1.0689391, 0.8607080]:
    # (3 * -1.0689391 + 2 * 0.4303540) / 2 = -1.1730546704
    sequence, _ = trl(reduction="length_weighted", ratio_level="sequence")
    assert_close(sequence.loss, -1.1730546704)


def test_trl_importance_sampling_ratio_before_kl() -> None:
    # per_token_loss * importance_sampling_ratio, then + beta * kl (not weighted):
    # dapo = (-1.2 * 0.9 - 0.9048374 * 1.5 - 1.0 + 0.4 * 0 + 0.5525855 * 1.2) / 5
    # = -2.7741536 / 5 = -0.5548307152; with beta = 0.1: + 0.1 * 0.0802671 / 5 -> -0.5532253748
    out, _ = trl(normalizer=TRL_N, importance_weights=TRL_IS_RATIO)
    assert_close(out.loss, -0.5548307152)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        kl = kl_loss(TRL_LOG_PROBS, TRL_REF, TRL_MASK, estimator="k3", normalizer=TRL_N)
    assert_close(out.loss + 0.1 * kl, -0.5532253748)


def test_trl_entropy_bonus_and_entropy_mask() -> None:
    # entropy_coef = 0.01, dapo: the bonus is sum H M / sum M = 5.2 / 5 (TRL >= 1.10 uses the
    # token mean for every loss type): -0.4304503918 - 0.01 * 1.04 = -0.4408503918.
    out, grad = trl(normalizer=TRL_N, entropy=TRL_ENTROPY, entropy_coef=0.01)
    assert_close(out.loss, -0.4408503918)
    # grpo: TRL still subtracts the token mean; ours (verl's entropy_coeff) the surrogate's
    # reduction, the mean of the row means: (3.5/3 + 1.7/2)/2 = 1.0083333.
    grpo, _ = trl(reduction="sequence_mean", entropy=TRL_ENTROPY, entropy_coef=0.01)
    assert_close(grpo.loss, -0.2793265382 - 0.01 * (3.5 / 3 + 1.7 / 2) / 2)
    # top_entropy_quantile = 0.5 -> quantile = 0.5: threshold = median(0.5, 2, 1, 1.5, 0.2) = 1
    # keeps row 1 tokens 1, 2 and row 2 token 0; TRL multiplies the loss, the denominators keep
    # every selected token: dapo (-0.9048374 - 1.0 + 0.4) / 5 = -0.3009674836.
    keep = top_entropy_mask(TRL_ENTROPY, TRL_MASK, quantile=0.5)
    assert keep.tolist() == [[False, True, True], [True, False, False]]
    kept, _ = trl(normalizer=TRL_N, importance_weights=keep.to(F64))
    assert_close(kept.loss, -0.3009674836)
    grpo_kept, _ = trl(reduction="sequence_mean", importance_weights=keep.to(F64))
    assert_close(grpo_kept.loss, -0.2174729030)  # mean(-1.9048374/3, 0.4/2)
    # top_entropy_quantile = 0 -> quantile = 1: only the highest entropy (2.0) is kept
    top = top_entropy_mask(TRL_ENTROPY, TRL_MASK, quantile=1.0)
    only, _ = trl(normalizer=TRL_N, importance_weights=top.to(F64))
    assert_close(only.loss, -0.1809674836)


# --------------------------------------------------------------------------------------------
# verl (core_algos.py compute_policy_loss_*)
# --------------------------------------------------------------------------------------------


def test_verl_cispo() -> None:
    # clip(r, 0.8, 1.2) = [[1.2, 0.8, 1.0], [1.2, 0.8]]; L = -c A logp = [0.6129908, 0.9631782,
    # 0.6931472, -0.2677723, -0.4086605]; token-mean 1.5928834 / 5 = 0.31857668
    out, grad = verl(surrogate="cispo")
    assert_close(out.loss, 0.3185766824)
    assert_close(grad, [[-0.24, -0.16, -0.2], [0.24, 0.16, 0.0]])  # -c A / 5
    assert_close(out.diagnostics.clipped_fraction, 0.8)  # verl pg_clipfrac: 1.5, 0.5, 4, 0.75
    assert_close(out.diagnostics.weight_mean, 1.0)  # (1.2 + 0.8 + 1 + 1.2 + 0.8) / 5


def test_verl_sapo() -> None:
    # seq-mean-token-mean: row 1 (tau 1) mean(-4 sigmoid(r - 1)) = -6/3 = -2; row 2 (tau 1.05)
    # mean(4/1.05 sigmoid(1.05 (r - 1))) = (3.6529856 + 1.6561876)/2; loss = 0.3272933088
    out, grad = verl(surrogate="sapo", reduction="sequence_mean")
    assert_close(out.loss, 0.3272933088)

    def slope(r: float, tau: float) -> float:  # d gate / d logp = 4 sigma (1 - sigma) r
        sigma = 1 / (1 + math.exp(-tau * (r - 1)))
        return 4 * sigma * (1 - sigma) * r

    row_1 = [-slope(r, 1.0) / 6 for r in (1.5, 0.5, 1.0)]
    row_2 = [slope(r, 1.05) / 4 for r in (4.0, 0.75)] + [0.0]
    assert_close(grad, [row_1, row_2])


def test_verl_geo_mean() -> None:
    # log-space clip [-0.2, 0.2]: row 1 (A > 0) min(D, clip(D)) = [0.2, -0.6931472, 0] -> mean
    # -0.1643824 -> rho 0.8484164; row 2 (A < 0) max(D, clip(D)) = [1.3862944, -0.2] -> rho
    # 1.8096749; torch.mean over the rows (= sequence_mean with normalizer B):
    # (-0.8484164 + 1.8096749) / 2 = 0.48062865
    out, grad = verl(surrogate="gmpo", reduction="sequence_mean", normalizer=2)
    assert_close(out.loss, 0.4806286528)
    rho_1 = math.exp((0.2 + math.log(0.5)) / 3)  # 0.8484164
    rho_2 = math.exp((math.log(4.0) - 0.2) / 2)  # 1.8096749
    assert_close(out.loss, (-rho_1 + rho_2) / 2)
    g = rho_1 / 6  # rho / (n_1 B) at the two unclipped tokens of row 1; row 2: rho / (2 B)
    assert_close(grad, [[0.0, -g, -g], [rho_2 / 4, 0.0, 0.0]])
    # verl's pg_clipfrac counts out-of-band tokens with A > 0 on either side (2/5); ours counts
    # the one that binds (row 1 token 0) and reports every out-of-band token separately (4/5)
    assert_close(out.diagnostics.clip_fraction_high, 0.2)
    assert_close(out.diagnostics.clip_fraction_low, 0.2)  # row 2 token 1 (D = -0.288)
    assert_close(out.diagnostics.clipped_fraction, 0.8)
    # verl's rollout weights: the geometric mean per sequence [0.75^(1/3), sqrt(1.5)] as
    # sequence weights: (-0.7708375 + 2.2163901) / 2 = 0.72277574
    geometric = torch.tensor([[0.75 ** (1 / 3)], [1.5**0.5]], dtype=F64)
    weighted, _ = verl(
        surrogate="gmpo", reduction="sequence_mean", normalizer=2, importance_weights=geometric
    )
    assert_close(weighted.loss, 0.7227757367)


def test_verl_vanilla_with_rollout_weights_gpg_dro_reinforce() -> None:
    # vanilla (dual clip c = 3 always on) x rollout_is_weights: [-1.8, -0.25, -1, 6, 0.6] / 5
    assert_close(verl(surrogate=Clip(dual=3.0), importance_weights=VERL_WEIGHTS)[0].loss, 0.71)
    # gpg: -A logp = CISPO with old = logp.detach() (w = 1): 1.6739764 / 5 = 0.33479529
    leaf = VERL_LOG_PROBS.clone().requires_grad_(True)
    gpg = policy_loss(leaf, leaf.detach(), VERL_ADVANTAGES, TRL_MASK, surrogate="cispo")
    assert_close(gpg.loss, 0.3347952852)
    (grad,) = torch.autograd.grad(gpg.loss, [leaf])
    assert_close(grad, [[-0.2, -0.2, -0.2], [0.2, 0.2, 0.0]])
    # dro (beta 0.5): gpg + beta * k2(logp, old) = (1.6739764 + 0.25 * 2.6494280) / 5
    dro = gpg.loss + 0.5 * kl_loss(leaf, VERL_OLD, TRL_MASK, estimator="k2")
    assert_close(dro, 0.46726669)
    # bypass reinforce, seq-mean-token-sum: row sums [2.4079456, -0.7339692] / 2
    reinforce = policy_loss(
        leaf, leaf.detach(), VERL_ADVANTAGES, TRL_MASK, surrogate="cispo",
        reduction="sequence_sum_normalized", max_response_length=1,
    )  # fmt: skip
    assert_close(reinforce.loss, 0.83698822)


# --------------------------------------------------------------------------------------------
# Importance weights and the entropy bonus: every surrogate, against the reference
# --------------------------------------------------------------------------------------------

SURROGATE_ROWS: list[dict[str, Any]] = [
    {"surrogate": Clip(low=0.2, high=0.28, dual=2.0)},
    {"surrogate": Clip(delta=1.1)},
    {"surrogate": CISPO(cap=1.3)},
    {"surrogate": "sapo"},
    {"surrogate": "cispo", "ratio_level": "sequence"},
    {"surrogate": "gmpo"},
    {"surrogate": "vespo"},
]


def _batch(seed: int, *, per_token: bool = True) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    log_probs = -2.0 * torch.rand(5, 7, generator=generator, dtype=F64)
    old = log_probs + 0.4 * torch.randn(5, 7, generator=generator, dtype=F64)
    advantages = torch.randn(5, 7 if per_token else 1, generator=generator, dtype=F64)
    mask = torch.rand(5, 7, generator=generator) < 0.7
    mask[2] = False  # an empty row
    entropy = 3.0 * torch.rand(5, 7, generator=generator, dtype=F64)
    weights = 2.0 * torch.rand(5, 7, generator=generator, dtype=F64)
    return log_probs, old, advantages, mask, entropy, weights


@pytest.mark.parametrize("options", SURROGATE_ROWS, ids=repr)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "length_weighted", "none"])
@pytest.mark.parametrize("weight_shape", ["token", "sequence"])
def test_weights_and_entropy_match_reference(
    options: dict[str, Any], reduction: str, weight_shape: str
) -> None:
    log_probs, old, advantages, mask, entropy, weights = _batch(3)
    if weight_shape == "sequence":
        weights = weights[:, 0]  # (B,): one weight per sequence
    kwargs = dict(options, reduction=reduction, importance_weights=weights, entropy_coef=0.07)
    outputs = []
    for fn in (policy_loss,):
        leaves = [log_probs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)]
        out = fn(
            leaves[0], old, advantages, mask, entropy=leaves[1], return_per_token=True, **kwargs
        )
        outputs.append((out, torch.autograd.grad(out.loss.sum(), leaves)))
    leaves = [log_probs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)]
    expected = reference.policy_loss(leaves[0], old, advantages, mask, entropy=leaves[1], **kwargs)
    expected_grads = torch.autograd.grad(expected.sum(), leaves)
    for out, grads in outputs:
        assert_close(out.loss, expected)
        assert out.per_token_loss is not None
        none = reference.policy_loss(
            log_probs, old, advantages, mask, entropy=entropy, **dict(kwargs, reduction="none")
        )
        assert_close(out.per_token_loss, none)  # -w s - c H: the loss is its reduction
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            assert_close(grad, expected_grad)
    # the diagnostics do not depend on the weights or the entropy (but VESPO's phi takes the
    # weights in: its weight_mean changes)
    plain = policy_loss(log_probs, old, advantages, mask, **options).diagnostics
    for name, value in outputs[0][0].diagnostics._asdict().items():
        if not (
            name == "weight_mean"
            and reference.surrogate_name(options.get("surrogate", "clip")) == "vespo"
        ):
            assert torch.equal(value, getattr(plain, name)), name


@pytest.mark.parametrize("options", SURROGATE_ROWS, ids=repr)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_weights_and_entropy_nonfinite_at_unselected_reach_nothing(
    options: dict[str, Any], bad: float
) -> None:
    log_probs, old, advantages, mask, entropy, weights = _batch(4)
    results = []
    for poison in (False, True):
        tensors = [log_probs, old, advantages, entropy, weights]
        if poison:
            tensors = [x.masked_fill(~mask, bad) for x in tensors]
        leaves = [tensors[0].clone().requires_grad_(True), tensors[3].clone().requires_grad_(True)]
        out = policy_loss(
            leaves[0], tensors[1], tensors[2], mask, entropy=leaves[1], entropy_coef=0.1,
            importance_weights=tensors[4], return_per_token=True, **options,
        )  # fmt: skip
        results.append((out, torch.autograd.grad(out.loss, leaves)))
    (clean, clean_grads), (dirty, dirty_grads) = results
    assert torch.isfinite(dirty.loss) and torch.equal(dirty.loss, clean.loss)
    assert torch.equal(dirty.per_token_loss, clean.per_token_loss)
    for a, b in zip(dirty_grads, clean_grads, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    for a, b in zip(dirty.diagnostics, clean.diagnostics, strict=True):
        assert torch.equal(a, b)


def test_importance_weights_are_constants_and_shapes_agree() -> None:
    log_probs, old, advantages, mask, _, weights = _batch(5)
    sequence = weights[:, :1].clone()
    leaf = sequence.clone().requires_grad_(True)
    for options in ({}, {"surrogate": "cispo"}, {"surrogate": "sapo"}, {"surrogate": "gmpo"}):
        lp = log_probs.clone().requires_grad_(True)
        out = policy_loss(lp, old, advantages, mask, importance_weights=leaf, **options)
        grads = torch.autograd.grad(out.loss, [lp, leaf], allow_unused=True)
        assert grads[1] is None  # not differentiated
        # (B,), (B, 1) and the (B, T) broadcast give the same loss
        for shaped in (sequence.squeeze(-1), sequence.expand(5, 7)):
            other = policy_loss(
                log_probs, old, advantages, mask, importance_weights=shaped, **options
            )
            assert_close(other.loss, out.loss.detach())
    # VESPO: a sequence weight w_i enters log W once; token weights as the product over the
    # sequence, so w_i^(1/n_i) at each selected token is the same
    counts = mask.sum(-1, keepdim=True).clamp(min=1).to(F64)
    tokens = torch.where(mask, sequence ** (1 / counts), torch.ones((), dtype=F64))
    per_sequence = policy_loss(
        log_probs, old, advantages, mask, surrogate="vespo", importance_weights=sequence
    )
    per_token = policy_loss(
        log_probs, old, advantages, mask, surrogate="vespo", importance_weights=tokens
    )
    assert_close(per_sequence.loss, per_token.loss)


def test_entropy_bonus_gradient_and_coef_tensor() -> None:
    # d loss / d H = -c x (the reduction's weight): -c / N under token_mean, 0 at unselected
    log_probs, old, advantages, mask, entropy, _ = _batch(6)
    leaf = entropy.clone().requires_grad_(True)
    out = policy_loss(log_probs, old, advantages, mask, entropy=leaf, entropy_coef=0.5)
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    expected = torch.where(mask, -0.5 / mask.sum(), torch.zeros((), dtype=F64))
    assert_close(grad, expected)
    # a learnable coefficient gets its gradient: d loss / d c = -reduce(H) = -mean selected H
    coef = torch.tensor(0.5, dtype=F64, requires_grad=True)
    out = policy_loss(log_probs, old, advantages, mask, entropy=entropy, entropy_coef=coef)
    (coef_grad,) = torch.autograd.grad(out.loss, [coef])
    assert_close(coef_grad, -entropy[mask].mean())
    # entropy given but coefficient 0: no term (the loss does not depend on it)
    zero = policy_loss(log_probs, old, advantages, mask, entropy=entropy)
    assert torch.equal(zero.loss, policy_loss(log_probs, old, advantages, mask).loss)


# --------------------------------------------------------------------------------------------
# Micro-batch invariance with weights and entropy (global normaliser)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"surrogate": Clip(high=0.28, delta=1.1)},
        {"surrogate": "cispo"},
        {"surrogate": "sapo"},
        {"surrogate": "gmpo"},
        {"surrogate": "vespo"},
    ],
    ids=repr,
)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "length_weighted"])
def test_micro_batches_with_weights_and_entropy_add_up(
    options: dict[str, Any], reduction: str
) -> None:
    log_probs, old, advantages, mask, entropy, weights = _batch(7)
    tokens, non_empty, rows = int(mask.sum()), int((mask.sum(-1) > 0).sum()), mask.shape[0]
    normalizer = {"token_mean": tokens, "sequence_mean": non_empty, "length_weighted": rows}[
        reduction
    ]
    kwargs = dict(options, reduction=reduction, entropy_coef=0.1)

    def run(rows_: slice, **extra: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        leaf = log_probs[rows_].clone().requires_grad_(True)
        out = policy_loss(
            leaf, old[rows_], advantages[rows_], mask[rows_], entropy=entropy[rows_],
            importance_weights=weights[rows_], **kwargs, **extra,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(out.loss, [leaf])
        return out.loss.detach(), grad, out.diagnostics

    full_loss, full_grad, full_diagnostics = run(slice(None))
    pieces = [
        run(slice(a, b), normalizer=normalizer, diagnostics_normalizer=tokens)
        for a, b in ((0, 2), (2, 3), (3, 5))
    ]
    assert_close(sum(p[0] for p in pieces), full_loss)
    assert_close(torch.cat([p[1] for p in pieces]), full_grad)
    for index, value in enumerate(full_diagnostics):
        assert_close(sum(p[2][index] for p in pieces), value)


# --------------------------------------------------------------------------------------------
# top_entropy_mask
# --------------------------------------------------------------------------------------------


def trl_high_entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """TRL's GRPOTrainer.get_high_entropy_mask on one process (its formula, not its code)."""
    local = entropy[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    cut = torch.quantile(local, threshold)
    return ((entropy * mask.float()) >= cut) & mask.bool()


@given(
    rows=st.integers(0, 5),
    columns=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
    quantile=st.sampled_from([0.0, 0.2, 0.5, 0.8, 0.9, 1.0, 1 / 3]),
    ties=st.booleans(),
)
def test_top_entropy_mask_equals_trl_and_reference(
    rows: int, columns: int, seed: int, quantile: float, ties: bool
) -> None:
    generator = torch.Generator().manual_seed(seed)
    entropy = 3.0 * torch.rand(rows, columns, generator=generator)
    if ties:  # repeated values: the threshold lands on a tie
        entropy = (entropy * 2).round() / 2
    mask = torch.rand(rows, columns, generator=generator) < 0.7
    kept = top_entropy_mask(entropy, mask, quantile=quantile)
    assert kept.dtype == torch.bool and kept.shape == mask.shape
    assert torch.equal(kept, trl_high_entropy_mask(entropy, mask, quantile))
    assert kept.tolist() == reference.top_entropy_mask(entropy.double(), mask, quantile)
    assert not (kept & ~mask).any()
    # unselected entries never matter
    dirty = entropy.masked_fill(~mask, math.nan)
    assert torch.equal(top_entropy_mask(dirty, mask, quantile=quantile), kept)


def test_top_entropy_mask_edges() -> None:
    entropy = torch.tensor([[0.5, 2.0, 1.0], [1.5, 0.2, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert top_entropy_mask(entropy, mask, quantile=0.0).tolist() == mask.bool().tolist()
    assert top_entropy_mask(entropy, torch.zeros(2, 3), quantile=0.5).sum() == 0
    assert top_entropy_mask(torch.zeros(0, 4), torch.zeros(0, 4), quantile=0.5).shape == (0, 4)
    # bfloat16 entropies: the quantile in float32, as TRL's .float()
    low = entropy.to(torch.bfloat16)
    assert torch.equal(
        top_entropy_mask(low, mask, quantile=0.5), trl_high_entropy_mask(low, mask, 0.5)
    )
    # a NaN entropy at a selected token: the threshold is NaN, nothing kept (torch.quantile)
    nan = entropy.clone()
    nan[0, 0] = math.nan
    assert top_entropy_mask(nan, mask, quantile=0.5).sum() == 0
    # the input is not modified and no gradient is formed
    leaf = entropy.clone().requires_grad_(True)
    assert not top_entropy_mask(leaf, mask, quantile=0.5).requires_grad


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"quantile": 1.5}, ValueError, r"quantile must be <= 1"),
        ({"quantile": -0.1}, ValueError, r"quantile must be >= 0"),
        ({"quantile": math.nan}, ValueError, r"quantile must be finite"),
        ({"quantile": torch.tensor(0.5)}, TypeError, r"quantile must be a real number"),
        ({"mask": torch.ones(2, 2)}, ValueError, r"mask must have the same shape as entropy"),
        ({"entropy": torch.ones(3)}, ValueError, r"entropy must have shape \(B, T\)"),
    ],
)
def test_top_entropy_mask_errors(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {
        "entropy": torch.ones(2, 3),
        "mask": torch.ones(2, 3),
        "quantile": 0.5,
    }
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        top_entropy_mask(arguments.pop("entropy"), arguments.pop("mask"), **arguments)


# --------------------------------------------------------------------------------------------
# torch.compile (one compile for the new surrogates, weights, entropy and the mask)
# --------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_family_compiled_fullgraph_equals_eager() -> None:
    log_probs, old, advantages, mask, entropy, weights = (
        x.float() if x.is_floating_point() else x for x in _batch(8)
    )
    advantages = advantages[:, :1]

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        keep = top_entropy_mask(entropy, mask, quantile=0.4).float()
        cispo = policy_loss(x, old, advantages, mask, surrogate=CISPO(cap=1.3))
        sapo = policy_loss(x, old, advantages, mask, surrogate="sapo", importance_weights=keep)
        clip = policy_loss(
            x, old, advantages, mask, surrogate=Clip(delta=1.1), importance_weights=weights,
            entropy=entropy, entropy_coef=0.01, reduction="length_weighted",
        )  # fmt: skip
        gmpo = policy_loss(x, old, advantages, mask, surrogate="gmpo", reduction="sequence_mean")
        vespo = policy_loss(x, old, advantages, mask, surrogate="vespo", importance_weights=weights)
        loss = cispo.loss + sapo.loss + clip.loss + gmpo.loss + vespo.loss
        return loss, cispo.diagnostics.clip_fraction_high, sapo.diagnostics.weight_mean, keep

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    result, eager = compiled(leaves[0]), step(leaves[1])
    for a, b in zip(result, eager, strict=True):
        torch.testing.assert_close(a, b)
    result[0].backward()
    eager[0].backward()
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad)
    assert (leaves[0].grad != 0).any()
