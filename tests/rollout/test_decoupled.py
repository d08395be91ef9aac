"""AReaL's decoupled PPO: ``proximal_log_probs`` and ``rejection_mask``, against float64
references, AReaL's code (transcribed, ``tests/peer_transcriptions.py``) and the docs recipe
(``policy_loss`` against the proximal policy with :math:`\\pi_{prox}/\\pi_b` as importance
weights) against AReaL's ``ppo_actor_loss_fn``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from peer_transcriptions import (
    RejectionSamplingConfig,
    apply_rejection_sampling,
    compute_prox_logp_approximations,
    ppo_actor_loss_fn,
)
from rlobjectives._core.decisions import upper_threshold

D = torch.float64


# --- proximal_log_probs ------------------------------------------------------------------------


def test_proximal_golden() -> None:
    # current version c = 10; l = -1, l_b = -3 everywhere
    # v = 7: alpha = (10 - 1 - 7) / (10 - 7) = 2/3 -> -3 + 2/3 * 2 = -5/3
    # v = 9 (the last version): alpha = 0 -> l_b = -3; v = 10, 12 (not behind): 0 -> -3
    # v = -1 (a prompt token): 0 -> -3; v = 8: 1/2 -> -2, linear: log((e^-3 + e^-1) / 2)
    versions = torch.tensor([[7, 9, 10, 12, -1, 8]])
    lp, lb = torch.full((1, 6), -1.0, dtype=D), torch.full((1, 6), -3.0, dtype=D)
    out = rlo.proximal_log_probs(lp, lb, versions=versions, current_version=10)
    expected = torch.tensor([[-5 / 3, -3, -3, -3, -3, -2]], dtype=D)
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=0)
    linear = rlo.proximal_log_probs(lp, lb, versions=versions, current_version=10, method="linear")
    mixed = math.log((math.exp(-3) + math.exp(-1)) / 2)
    assert math.isclose(float(linear[0, 5]), mixed, rel_tol=1e-15)
    assert math.isclose(
        float(linear[0, 0]), math.log(math.exp(-3) / 3 + 2 * math.exp(-1) / 3), rel_tol=1e-15
    )
    torch.testing.assert_close(linear[0, 1:5], lb[0, 1:5], rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(0,), (5,), (2, 3), (3, 4)]),
    seed=st.integers(0, 2**16),
    current=st.integers(0, 6),
    method=st.sampled_from(["loglinear", "linear"]),
)
def test_proximal_matches_the_reference(
    shape: tuple[int, ...], seed: int, current: int, method: str
) -> None:
    generator = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(shape, generator=generator, dtype=D)
    lb = -3 * torch.rand(shape, generator=generator, dtype=D)
    versions = torch.randint(-1, 8, shape, generator=generator)
    leaves = [lp.clone().requires_grad_(True), lb.clone().requires_grad_(True)]
    refs = [lp.clone().requires_grad_(True), lb.clone().requires_grad_(True)]
    ours = rlo.proximal_log_probs(
        *leaves, versions=versions, current_version=current, method=method
    )
    expected = reference.proximal_log_probs(*refs, versions, current, method)
    torch.testing.assert_close(ours, expected, rtol=1e-14, atol=1e-15)
    if ours.numel():
        cotangent = torch.linspace(0.5, 1.5, ours.numel(), dtype=D).reshape(shape)
        got = torch.autograd.grad((ours * cotangent).sum(), leaves, allow_unused=True)
        want = torch.autograd.grad((expected * cotangent).sum(), refs, allow_unused=True)
        for g, w, leaf in zip(got, want, leaves, strict=True):
            g = torch.zeros_like(leaf) if g is None else g
            w = torch.zeros_like(leaf) if w is None else w
            torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15)


def test_proximal_equals_areal() -> None:
    generator = torch.Generator().manual_seed(35040)
    lp = -4 * torch.rand(6, 9, generator=generator)  # float32, as AReaL computes
    lb = -4 * torch.rand(6, 9, generator=generator)
    versions = torch.randint(-1, 12, (6, 9), generator=generator)
    areal = compute_prox_logp_approximations(lb, lp, versions, current_version=11)
    ours = rlo.proximal_log_probs(lp, lb, versions=versions, current_version=11)
    assert torch.equal(ours, areal["loglinear"])  # float32: the same operations, bit for bit
    linear = rlo.proximal_log_probs(lp, lb, versions=versions, current_version=11, method="linear")
    torch.testing.assert_close(linear, areal["linear"], rtol=2e-6, atol=1e-6)  # + 1e-10 in AReaL
    # float64: AReaL forms alpha in float32 (versions.float()): ~1e-8 apart
    areal64 = compute_prox_logp_approximations(lb.double(), lp.double(), versions, 11)
    ours64 = rlo.proximal_log_probs(lp.double(), lb.double(), versions=versions, current_version=11)
    torch.testing.assert_close(ours64, areal64["loglinear"], rtol=1e-7, atol=1e-7)


def test_proximal_is_elementwise_under_nan() -> None:
    lp, lb = -torch.rand(3, 4, dtype=D), -torch.rand(3, 4, dtype=D)
    versions = torch.randint(0, 5, (3, 4))
    clean = rlo.proximal_log_probs(lp, lb, versions=versions, current_version=5, method="linear")
    poisoned = lp.clone()
    poisoned[1, 2] = math.nan
    out = rlo.proximal_log_probs(
        poisoned, lb, versions=versions, current_version=5, method="linear"
    )
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(out[keep], clean[keep])


# --- rejection_mask ----------------------------------------------------------------------------


def test_rejection_golden() -> None:
    # d = l_prox - l_b: [2, 0, -2 | 1, 1, x]; ratio <= 5 keeps e^0, e^-2, e^1 and rejects e^2
    prox = torch.tensor([[0.0, -0.1, -2.0], [-1.0, -1.0, 0.0]], dtype=D)
    behavior = torch.tensor([[-2.0, -0.1, 0.0], [-2.0, -2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    keep = rlo.rejection_mask(prox, behavior, mask, upper=5.0)
    assert keep.tolist() == [[False, True, True], [True, True, False]]
    # lower 0.5: e^-2 = 0.135 rejected too
    keep = rlo.rejection_mask(prox, behavior, mask, upper=5.0, lower=0.5)
    assert keep.tolist() == [[False, True, False], [True, True, False]]
    # sequence level, geometric mean (mean of d): row 0: 0 -> e^0 = 1 kept; row 1: e^1 kept;
    # sum: row 0 e^0 kept, row 1 e^2 = 7.39 > 5 rejected; max: row 0 e^2 rejected
    seq = rlo.rejection_mask(prox, behavior, mask, upper=5.0, level="sequence")
    assert seq.tolist() == [[True, True, True], [True, True, False]]
    seq = rlo.rejection_mask(prox, behavior, mask, upper=5.0, level="sequence", aggregate="sum")
    assert seq.tolist() == [[True, True, True], [False, False, False]]
    seq = rlo.rejection_mask(prox, behavior, mask, upper=5.0, level="sequence", aggregate="max")
    assert seq.tolist() == [[False, False, False], [True, True, False]]
    # k2 = d^2 / 2: [2, 0, 2 | .5, .5]; upper 1 keeps d = 0 and the row-1 tokens
    k2 = rlo.rejection_mask(prox, behavior, mask, upper=1.0, estimator="k2")
    assert k2.tolist() == [[False, True, False], [True, True, False]]
    # k3 = e^-d - 1 + d: d = 2: e^-2 + 1 = 1.135; d = -2: e^2 - 3 = 4.389; d = 1: e^-1 = 0.368
    k3 = rlo.rejection_mask(prox, behavior, mask, upper=1.2, estimator="k3")
    assert k3.tolist() == [[True, True, False], [True, True, False]]
    # k1 mean per sequence: row 0: 0, row 1: 1; upper 0.5 -> row 1 rejected
    k1 = rlo.rejection_mask(
        prox, behavior, mask, upper=0.5, estimator="k1", level="sequence", aggregate="mean"
    )
    assert k1.tolist() == [[True, True, True], [False, False, False]]


def test_rejection_decides_at_the_bound_by_the_rule() -> None:
    # the largest float32 log-ratio whose correctly rounded exp is <= 5 is kept, the next one
    # is not (no backend's exp enters)
    edge = upper_threshold(5.0, torch.float32)
    above = float(torch.nextafter(torch.tensor(edge), torch.tensor(math.inf)))
    prox = torch.tensor([[edge, above]], dtype=torch.float32)
    keep = rlo.rejection_mask(prox, torch.zeros_like(prox), torch.ones(1, 2), upper=5.0)
    assert keep.tolist() == [[True, False]]


def test_rejection_rejects_nan_at_a_selected_token() -> None:
    prox = torch.tensor([[math.nan, -1.0, -math.inf]])
    keep = rlo.rejection_mask(prox, torch.full_like(prox, -1.0), torch.ones(1, 3), upper=5.0)
    assert keep.tolist() == [[False, True, True]]  # ratio 0 is <= 5 (no lower bound)


_OPTIONS = st.fixed_dictionaries(
    {
        "level": st.sampled_from(["token", "sequence"]),
        "estimator": st.sampled_from(["ratio", "k1", "k2", "k3"]),
        "aggregate": st.sampled_from(["sum", "mean", "max"]),
        "symmetric": st.booleans(),
        "bounds": st.sampled_from([(2.0, None), (1.5, 0.6), (0.3, None), (0.8, -0.2)]),
    }
)


def _problem(seed: int, rows: int, tokens: int, dtype: torch.dtype = D) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    behavior = -2.5 * torch.rand(rows, tokens, generator=generator, dtype=D)
    prox = behavior + 0.8 * torch.randn(rows, tokens, generator=generator, dtype=D)
    prox = prox.clamp(max=-1e-3)
    mask = torch.rand(rows, tokens, generator=generator) < 0.7
    return prox.to(dtype), behavior.to(dtype), mask


def _bounds(options: dict[str, object]) -> dict[str, float | None]:
    upper, lower = options["bounds"]  # type: ignore[misc]
    ratio = options["estimator"] == "ratio" and not options["symmetric"]
    if ratio and (lower is not None and lower <= 0):
        lower = None
    return {"upper": upper, "lower": lower}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(0, 4), tokens=st.integers(0, 6),
       options=_OPTIONS)  # fmt: skip
def test_rejection_matches_the_reference(
    seed: int, rows: int, tokens: int, options: dict[str, object]
) -> None:
    prox, behavior, mask = _problem(seed, rows, tokens)
    bounds = _bounds(options)
    rest = {k: v for k, v in options.items() if k != "bounds"}
    ours = rlo.rejection_mask(prox, behavior, mask, **bounds, **rest)  # type: ignore[arg-type]
    expected = reference.rejection_mask(prox, behavior, mask, **bounds, **rest)  # type: ignore[arg-type]
    assert ours.tolist() == expected


_LEVEL_AGGREGATES = [
    ("token", "mean"),
    ("sequence", "sum"),
    ("sequence", "mean"),
    ("sequence", "max"),
]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("metric", ["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"])
@pytest.mark.parametrize(("level", "agg"), _LEVEL_AGGREGATES)
def test_rejection_equals_areal(metric: str, level: str, agg: str, packed: bool) -> None:
    prox, behavior, mask = _problem(35041, 7, 9, torch.float32)  # AReaL computes in float32
    mask[3] = False  # a sequence without selected tokens
    upper, lower = {"ratio": (2.5, 0.4), "kl_k1": (0.6, -0.6), "binary_kl": (0.05, None)}.get(
        metric, (0.4, None)
    )
    config = RejectionSamplingConfig(level=level, metric=metric, agg=agg, upper=upper, lower=lower)
    options = {
        "upper": upper,
        "lower": lower,
        "level": level,
        "aggregate": agg,
        "symmetric": metric == "binary_kl",
        "estimator": metric.removeprefix("kl_") if metric.startswith("kl_") else "ratio",
    }
    if packed:  # the rows as packed sequences of 9 tokens
        flat = [t.reshape(-1) for t in (prox, behavior, mask)]
        cu = torch.arange(0, 7 * 9 + 1, 9, dtype=torch.int32)
        areal = apply_rejection_sampling(*flat, cu, config).loss_mask
        ours = rlo.rejection_mask(*flat, cu_seqlens=cu, **options)  # type: ignore[arg-type]
    else:
        areal = apply_rejection_sampling(prox, behavior, mask, None, config).loss_mask
        ours = rlo.rejection_mask(prox, behavior, mask, **options)  # type: ignore[arg-type]
    assert torch.equal(ours, areal.bool())


@pytest.mark.parametrize(
    ("level", "metric", "upper"), [("token", "ratio", 2.0), ("sequence", "kl_k2", 0.3)]
)
def test_decoupled_recipe_equals_areal_ppo_actor_loss(
    level: str, metric: str, upper: float
) -> None:
    # AReaL: ratio pi / pi_prox clipped, times pi_prox / pi_b, the rejected tokens out of the
    # numerator but not of the denominator (the original mask's count). Ours: the docs recipe.
    generator = torch.Generator().manual_seed(35042)
    rows, tokens = 6, 8
    behavior = -2 * torch.rand(rows, tokens, generator=generator, dtype=D) - 0.05
    versions = torch.randint(2, 6, (rows, tokens), generator=generator)
    current = -2 * torch.rand(rows, tokens, generator=generator, dtype=D) - 0.05
    advantages = torch.randn(rows, 1, generator=generator, dtype=D).expand(rows, tokens)
    mask = torch.rand(rows, tokens, generator=generator) < 0.8
    prox = rlo.proximal_log_probs(current, behavior, versions=versions, current_version=6)
    config = RejectionSamplingConfig(level=level, metric=metric, agg="sum", upper=upper)
    theirs_leaf, ours_leaf = (
        current.clone().requires_grad_(True),
        current.clone().requires_grad_(True),
    )
    theirs, _ = ppo_actor_loss_fn(
        theirs_leaf, prox, behavior, advantages, 0.2, mask, eps_clip_higher=0.28, c_clip=3.0,
        rejection_sampling=config,
    )  # fmt: skip
    estimator = "ratio" if metric == "ratio" else metric.removeprefix("kl_")
    keep = rlo.rejection_mask(
        prox, behavior, mask, upper=upper, level=level, estimator=estimator, aggregate="sum"
    )
    out = rlo.policy_loss(
        ours_leaf, prox, advantages, keep,
        # pi_prox / pi_b, formed in float32 as AReaL forms it (.float() of both)
        importance_weights=torch.exp(prox.float() - behavior.float()).double(),
        surrogate=rlo.Clip(low=0.2, high=0.28, dual=3.0), normalizer=int(mask.sum()),
        log_ratio_bound=None,
    )  # fmt: skip
    assert int(keep.sum()) < int(mask.sum())  # some tokens are rejected
    torch.testing.assert_close(out.loss, theirs, rtol=1e-14, atol=1e-15)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_leaf)
    (ours_grad,) = torch.autograd.grad(out.loss, ours_leaf)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-13, atol=1e-15)


@pytest.mark.compile
def test_under_torch_compile() -> None:
    prox, behavior, mask = _problem(35043, 4, 6, torch.float32)
    versions = torch.randint(0, 6, (4, 6), generator=torch.Generator().manual_seed(1))

    def step(lp: torch.Tensor, lb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        proximal = rlo.proximal_log_probs(lp, lb, versions=versions, current_version=6)
        linear = rlo.proximal_log_probs(
            lp, lb, versions=versions, current_version=6, method="linear"
        )
        token = rlo.rejection_mask(proximal, lb, mask, upper=1.5, lower=0.7)
        sequence = rlo.rejection_mask(
            proximal, lb, mask, upper=0.2, level="sequence", estimator="k3", aggregate="max"
        )
        opd = rlo.iw_opd_advantages(lp, lb, mask, gamma=0.5)
        return proximal, linear, token, sequence, opd

    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(prox, behavior), step(prox, behavior), strict=True):
        torch.testing.assert_close(got, want)
