"""Tests of :func:`rlobjectives.policy_loss`: every option against the float64 loop reference.

Covers the clip variants (symmetric, asymmetric/DAPO, none/vanilla PG, dual-clip), GSPO's
sequence ratio, the log-ratio bound, every reduction with an explicit normalizer, diagnostics,
NaN/inf at masked positions, dtypes, micro-batch invariance, errors and one compiled call.
The reference comparisons, the NaN, dtype and micro-batch tests run on both backends (the
``backend`` fixture of ``tests/backends.py``: PyTorch, then the Triton kernels through the
interpreter, in float32 since float64 always takes PyTorch).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from backends import FIXTURE_HEALTH, dtype_for, on_kernels, triton_param
from family_cases import FAMILY_OPTION_SETS
from rlobjectives import (
    CISPO,
    DPPO,
    DRO,
    FIPO,
    GMPO,
    M2PO,
    SAPO,
    VESPO,
    Clip,
    ClipCov,
    KLCov,
    ProbabilityBand,
    grpo_clipped_surrogate,
    policy_loss,
)
from tolerances import assert_close

F64 = torch.float64
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none")
DIAGNOSTIC_NAMES = (
    "clipped_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "dual_clip_fraction",
    "log_ratio_bound_fraction",
    "ratio_mean",
    "approx_kl_k1",
    "approx_kl_k3",
    "weight_mean",
)


class Batch(NamedTuple):
    log_probs: torch.Tensor  # (B, T)
    old_log_probs: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B,) or (B, T)
    mask: torch.Tensor  # (B, T) bool


def make_batch(
    batch: int,
    tokens: int,
    seed: int,
    *,
    per_token: bool = False,
    spread: float = 0.4,
    dtype: torch.dtype = F64,
    empty_row_probability: float = 0.25,
) -> Batch:
    """Random batch: ratios spread across the clip band, ~30% masked tokens, some empty rows."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = -2.0 * torch.rand(batch, tokens, generator=generator, dtype=F64)  # (B, T)
    old_log_probs = log_probs + spread * torch.randn(batch, tokens, generator=generator, dtype=F64)
    shape = (batch, tokens) if per_token else (batch,)
    advantages = torch.randn(*shape, generator=generator, dtype=F64)
    mask = torch.rand(batch, tokens, generator=generator) < 0.7  # (B, T)
    empty_rows = torch.rand(batch, generator=generator) < empty_row_probability  # (B,)
    mask = mask & ~empty_rows.unsqueeze(-1)
    return Batch(log_probs.to(dtype), old_log_probs.to(dtype), advantages.to(dtype), mask)


def grads_of(output: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ``output.sum()``; zeros for inputs the output does not depend on."""
    if not output.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad(output.sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


def leaves(batch: Batch, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    tensors = (batch.log_probs, batch.old_log_probs, batch.advantages)
    return [x.detach().to(dtype or x.dtype).clone().requires_grad_(True) for x in tensors]


def run_library(batch: Batch, **kwargs: Any) -> tuple[Any, list[torch.Tensor]]:
    """Output and gradients of policy_loss, with and without grad on the constant inputs.

    (a) Only ``log_probs`` requires grad (the usual training call); (b) every input requires
    grad: ``old_log_probs`` and ``advantages`` are constants of the loss, so (b) must give the
    same result and zero gradient for them. The result is (a)'s output with (a)'s ``log_probs``
    gradient and (b)'s other gradients (zeros).
    """
    log_probs = batch.log_probs.detach().clone().requires_grad_(True)
    out = policy_loss(log_probs, batch.old_log_probs, batch.advantages, batch.mask, **kwargs)
    (log_probs_grad,) = grads_of(out.loss, [log_probs])
    inputs = leaves(batch)
    all_grad = policy_loss(*inputs, batch.mask, **kwargs)
    grads = grads_of(all_grad.loss, inputs)
    assert all(not torch.any(g) for g in grads[1:]), "old_log_probs/advantages are constants"
    dtype = batch.log_probs.dtype
    assert_close(out.loss, all_grad.loss, dtype)
    assert_close(log_probs_grad, grads[0], dtype)
    if out.per_token_loss is not None or all_grad.per_token_loss is not None:
        assert_close(out.per_token_loss, all_grad.per_token_loss, dtype)
    for fused_value, autograd_value in zip(out.diagnostics, all_grad.diagnostics, strict=True):
        assert fused_value.dtype == autograd_value.dtype
        assert_close(fused_value, autograd_value)
    return out, [log_probs_grad, *grads[1:]]


def run_reference(batch: Batch, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    log_probs, old_log_probs, advantages = inputs = leaves(batch, F64)
    loss = reference.policy_loss(log_probs, old_log_probs, advantages, batch.mask, **kwargs)
    return loss, grads_of(loss, inputs)


def reference_per_token(batch: Batch, **options: Any) -> torch.Tensor:
    """``(B, T)`` reference per-token loss ``-s`` (zeros at unselected tokens)."""
    tensors = [x.detach().to(F64) for x in batch[:3]]
    surrogates = reference.per_token_surrogates(*tensors, batch.mask, **options)
    out = torch.zeros(batch.mask.shape, dtype=F64)
    for (i, t), value in surrogates.items():
        out[i, t] = -value.detach()
    return out


def assert_diagnostics_match(diagnostics: Any, expected: dict[str, float]) -> None:
    for name in DIAGNOSTIC_NAMES:
        value = getattr(diagnostics, name)
        assert value.shape == (), name
        assert value.grad_fn is None and not value.requires_grad, name
        assert_close(value, expected[name])


OPTION_SETS: list[dict[str, Any]] = [
    {},  # PPO/GRPO defaults: clip 0.2, bound 20
    {"surrogate": Clip(low=0.2, high=0.28)},  # DAPO clip-higher
    {"surrogate": Clip(low=0.1, high=0.3, dual=3.0)},
    {"surrogate": Clip(low=0.2, dual=1.5)},  # dual bound binds often
    {"surrogate": Clip(low=None)},  # vanilla importance-weighted PG
    {"surrogate": Clip(low=None, dual=2.0)},
    {"surrogate": Clip(low=0.2), "log_ratio_bound": None},
    {"surrogate": Clip(low=0.2), "log_ratio_bound": 0.3},  # the bound fires often
    {"surrogate": Clip(low=None), "log_ratio_bound": 0.25},
    {"surrogate": Clip(low=0.0, high=0.0)},  # degenerate band [1, 1]
    {"ratio_level": "sequence", "surrogate": Clip(low=3e-4, high=4e-4)},  # GSPO-like widths
    {"ratio_level": "sequence", "surrogate": Clip(low=0.2, high=0.28, dual=2.0)},
    {"ratio_level": "sequence", "surrogate": Clip(low=None)},
    {"ratio_level": "sequence", "surrogate": Clip(low=0.2), "log_ratio_bound": 0.1},
    {"ratio_level": "sequence", "surrogate": Clip(low=0.2), "log_ratio_bound": None},
]
OPTION_SETS = OPTION_SETS + FAMILY_OPTION_SETS


# --------------------------------------------------------------------------------------------
# Reference comparisons: every option set x every reduction, outputs and gradients (float64)
# --------------------------------------------------------------------------------------------


def _option_id(options: dict[str, Any]) -> str:
    return repr(options) if options else "defaults"


def _every_option_cases() -> list[Any]:
    """PyTorch: every option x reduction x advantage shape. Kernels: every option row that runs
    on them, for both advantage shapes, with the reductions in turn (a reduction enters the
    kernel only as per-token weights, whatever the option)."""
    cases = [
        pytest.param(
            "torch", options, reduction, per_token,
            id=f"torch-{'token' if per_token else 'seq'}_adv-{_option_id(options)}-{reduction}",
        )
        for per_token in (False, True)
        for options in OPTION_SETS
        for reduction in REDUCTIONS
    ]  # fmt: skip
    for index, options in enumerate(filter(on_kernels, OPTION_SETS)):
        for per_token in (False, True):
            reduction = REDUCTIONS[(index + per_token) % len(REDUCTIONS)]
            name = f"triton-{'token' if per_token else 'seq'}_adv-{_option_id(options)}"
            cases.append(triton_param(options, reduction, per_token, id=f"{name}-{reduction}"))
    return cases


@pytest.mark.parametrize(
    ("backend", "options", "reduction", "per_token"), _every_option_cases(), indirect=["backend"]
)
def test_matches_reference_every_option(
    backend: str, options: dict[str, Any], reduction: str, per_token: bool
) -> None:
    batch = make_batch(5, 7, seed=11, per_token=per_token, dtype=dtype_for(backend))
    kwargs = dict(options, reduction=reduction)
    out, grads = run_library(batch, **kwargs, return_per_token=True)
    expected, expected_grads = run_reference(batch, **kwargs)
    assert out.loss.dtype == dtype_for(backend)
    assert_close(out.loss, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected_grad)
    assert_close(out.per_token_loss, reference_per_token(batch, **options))
    assert_diagnostics_match(out.diagnostics, reference.policy_loss_diagnostics(*batch, **options))


@pytest.mark.parametrize(
    ("reduction", "normalizer", "max_response_length"),
    [
        ("token_mean", 17, None),
        ("token_mean", torch.tensor(23.0, dtype=F64), None),
        ("sequence_mean", 9, None),
        ("sequence_sum_normalized", None, 11),
        ("sequence_sum_normalized", 8, None),
        ("sequence_sum_normalized", torch.tensor(8.0), 13),
    ],
)
def test_matches_reference_with_normalizer(
    backend: str, reduction: str, normalizer: Any, max_response_length: int | None
) -> None:
    batch = make_batch(6, 5, seed=3, dtype=dtype_for(backend))
    kwargs = dict(reduction=reduction, normalizer=normalizer)
    kwargs["max_response_length"] = max_response_length
    out, grads = run_library(batch, surrogate=Clip(low=0.2, high=0.25), **kwargs)
    ref_normalizer = None if normalizer is None else float(normalizer)
    expected, expected_grads = run_reference(
        batch,
        clip_low=0.2,
        clip_high=0.25,
        reduction=reduction,
        normalizer=ref_normalizer,
        max_response_length=max_response_length,
    )
    assert_close(out.loss, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected_grad)


option_strategy = st.fixed_dictionaries(
    {
        "surrogate": st.tuples(
            st.sampled_from([None, 0.0, 0.1, 0.2]),  # low
            st.sampled_from([None, 0.28]),  # high
            st.sampled_from([None, 1.5, 3.0]),  # dual
        )
        .filter(lambda edges: not (edges[0] is None and edges[1] is not None))
        .map(lambda edges: Clip(low=edges[0], high=edges[1], dual=edges[2])),
        "ratio_level": st.sampled_from(["token", "sequence"]),
        "log_ratio_bound": st.sampled_from([None, 20.0, 0.3]),
    }
)


@FIXTURE_HEALTH
@given(
    batch_size=st.integers(0, 6),
    tokens=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
    per_token=st.booleans(),
    options=option_strategy,
    reduction=st.sampled_from(REDUCTIONS),
    normalizer=st.sampled_from([None, 1, 7]),
    max_response_length=st.sampled_from([None, 9]),
)
def test_matches_reference_property(
    backend: str,
    batch_size: int,
    tokens: int,
    seed: int,
    per_token: bool,
    options: dict[str, Any],
    reduction: str,
    normalizer: int | None,
    max_response_length: int | None,
) -> None:
    batch = make_batch(batch_size, tokens, seed, per_token=per_token, dtype=dtype_for(backend))
    kwargs = dict(
        options, reduction=reduction, normalizer=normalizer, max_response_length=max_response_length
    )
    out, grads = run_library(batch, **kwargs, diagnostics_normalizer=normalizer)
    expected, expected_grads = run_reference(batch, **kwargs)
    assert_close(out.loss, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(grad).all()
        assert_close(grad, expected_grad)
    assert_diagnostics_match(
        out.diagnostics,
        reference.policy_loss_diagnostics(*batch, **options, diagnostics_normalizer=normalizer),
    )


@FIXTURE_HEALTH
@given(
    batch_size=st.integers(0, 6),
    tokens=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
    per_token=st.booleans(),
    options=st.sampled_from(FAMILY_OPTION_SETS),
    reduction=st.sampled_from(REDUCTIONS),
    normalizer=st.sampled_from([None, 7]),
    weights=st.sampled_from([None, "token", "sequence"]),
    entropy_coef=st.sampled_from([0.0, 0.3]),
)
def test_family_matches_reference_property(
    backend: str,
    batch_size: int,
    tokens: int,
    seed: int,
    per_token: bool,
    options: dict[str, Any],
    reduction: str,
    normalizer: int | None,
    weights: str | None,
    entropy_coef: float,
) -> None:
    # Every surrogate of the family on random odd shapes (empty batches and rows included), with
    # importance weights and the entropy bonus: values and gradients (log_probs and entropy) of
    # the library (fused or autograd path) and of the float64 loop reference.
    dtype = dtype_for(backend)
    batch = make_batch(batch_size, tokens, seed, per_token=per_token, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    entropy = (3 * torch.rand(batch_size, tokens, generator=generator, dtype=F64)).to(dtype)
    kwargs: dict[str, Any] = dict(options, reduction=reduction, normalizer=normalizer)
    if weights is not None:
        shape = (batch_size, tokens) if weights == "token" else (batch_size, 1)
        weight_values = 2 * torch.rand(*shape, generator=generator, dtype=F64)
        kwargs["importance_weights"] = weight_values.to(dtype)
    kwargs["entropy_coef"] = entropy_coef
    leaves_ = [batch.log_probs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)]
    out = policy_loss(leaves_[0], *batch[1:], entropy=leaves_[1], **kwargs)
    ref_leaves = [x.to(F64).requires_grad_(True) for x in (batch.log_probs, entropy)]
    ref_batch = [x.to(F64) for x in batch[1:3]]
    expected = reference.policy_loss(
        ref_leaves[0], *ref_batch, batch.mask, entropy=ref_leaves[1], **kwargs
    )
    assert_close(out.loss, expected)
    for grad, expected_grad in zip(
        grads_of(out.loss, leaves_), grads_of(expected, ref_leaves), strict=True
    ):
        assert torch.isfinite(grad).all()
        assert_close(grad, expected_grad)
    assert_diagnostics_match(
        out.diagnostics,
        reference.policy_loss_diagnostics(
            *batch, **options, importance_weights=kwargs.get("importance_weights")
        ),
    )


def test_seed_function_is_policy_loss_with_bound_60() -> None:
    batch = make_batch(4, 6, seed=5, spread=1.0)
    seed_out = grpo_clipped_surrogate(*batch, 0.2)
    out = policy_loss(*batch, surrogate=Clip(low=0.2), log_ratio_bound=60.0)
    torch.testing.assert_close(seed_out["loss"], out.loss, rtol=0, atol=0)
    torch.testing.assert_close(
        seed_out["clipped_fraction"], out.diagnostics.clipped_fraction, rtol=0, atol=0
    )


# --------------------------------------------------------------------------------------------
# gradcheck (float64), away from the kinks of clip/min/max
# --------------------------------------------------------------------------------------------


def _distance_to_kinks(batch: Batch, edges: list[float]) -> float:
    ratio = torch.exp(batch.log_probs - batch.old_log_probs)[batch.mask]
    return min((ratio - edge).abs().min().item() for edge in edges) if ratio.numel() else 1.0


@pytest.mark.parametrize(
    ("options", "reduction"),
    [
        ({"surrogate": Clip(low=0.2)}, "token_mean"),
        ({"surrogate": Clip(low=0.2, high=0.28, dual=1.5)}, "sequence_mean"),
        ({"surrogate": Clip(low=None)}, "sequence_sum_normalized"),
        ({"surrogate": Clip(low=0.1), "log_ratio_bound": 0.3}, "none"),
    ],
)
def test_gradcheck_token_level(options: dict[str, Any], reduction: str) -> None:
    batch = make_batch(3, 5, seed=21, per_token=True)
    clip = options["surrogate"]
    high = clip.high or clip.low or 0.0
    edges = [1 - (clip.low or 0.0), 1 + high, math.exp(0.3), math.exp(-0.3)]
    assert _distance_to_kinks(batch, edges) > 1e-3  # so finite differences never straddle a kink
    mask = batch.mask

    old, advantages = batch.old_log_probs, batch.advantages

    def loss(lp: torch.Tensor) -> torch.Tensor:
        # the autograd specification (the fused path is gradchecked below)
        return policy_loss(lp, old, advantages, mask, reduction=reduction, **options).loss

    assert torch.autograd.gradcheck(loss, (leaves(batch)[0],))


@pytest.mark.parametrize(
    "options",
    [
        {"surrogate": Clip(low=0.2, high=0.28, dual=1.5), "reduction": "sequence_mean"},
        {
            "surrogate": Clip(low=None),
            "log_ratio_bound": 0.3,
            "reduction": "sequence_sum_normalized",
        },
        {"surrogate": Clip(low=0.05), "ratio_level": "sequence", "reduction": "token_mean"},
        {"surrogate": Clip(low=0.1), "reduction": "none", "normalizer": 3},
    ],
)
def test_gradcheck_log_probs_only(options: dict[str, Any]) -> None:
    # Only log_probs requires grad: the path a training step takes (the fused function).
    batch = make_batch(3, 5, 21, spread=0.15)
    assert _distance_to_kinks(batch, [0.8, 0.9, 0.95, 1.05, 1.1, 1.2, 1.28]) > 1e-3
    assert _distance_to_kinks(batch, [math.exp(0.3), math.exp(-0.3)]) > 1e-3
    old, advantages, mask = batch.old_log_probs, batch.advantages, batch.mask

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, old, advantages, mask, **options).loss

    assert torch.autograd.gradcheck(loss, (leaves(batch)[0],))


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_gradcheck_sequence_level(reduction: str) -> None:
    # With per-sequence advantages every token of sequence i weighs the same, so the stop-gradient
    # token form has the true gradient of exp(mean_t log_ratio) A_i w.r.t. log_probs
    # (old_log_probs and advantages are constants of the loss).
    batch = make_batch(4, 5, seed=8, spread=0.15)
    old, advantages, mask = batch.old_log_probs, batch.advantages, batch.mask

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            lp,
            old,
            advantages,
            mask,
            ratio_level="sequence",
            surrogate=Clip(low=0.05),
            reduction=reduction,
        ).loss

    assert torch.autograd.gradcheck(loss, (leaves(batch)[0],))
    assert torch.autograd.gradcheck(
        lambda lp: (
            policy_loss(
                lp,
                old,
                advantages,
                mask,
                ratio_level="sequence",
                surrogate=Clip(low=0.05),
                reduction=reduction,
            ).loss
        ),
        (leaves(batch)[0],),
    )


# --------------------------------------------------------------------------------------------
# Golden tests (arithmetic in the comments)
# --------------------------------------------------------------------------------------------


def _one_token(delta: float, advantage: float, **kwargs: Any) -> torch.Tensor:
    log_probs = torch.tensor([[math.log(delta)]], dtype=F64)  # ratio = delta
    return policy_loss(
        log_probs, torch.zeros(1, 1, dtype=F64), [advantage], [[True]], **kwargs
    ).loss


def test_golden_dual_clip() -> None:
    # A=-1, r=4, eps=0.2, c=3: s = max(min(-4, -1.2), -3) = max(-4, -3) = -3; loss = 3
    assert_close(_one_token(4.0, -1.0, surrogate=Clip(low=0.2, dual=3.0)), 3.0)
    # without dual clip: s = min(-4, -1.2) = -4; loss = 4
    assert_close(_one_token(4.0, -1.0, surrogate=Clip(low=0.2)), 4.0)
    # A=+1, r=4: dual clip does not apply; s = min(4, 1.2) = 1.2; loss = -1.2
    assert_close(_one_token(4.0, 1.0, surrogate=Clip(low=0.2, dual=3.0)), -1.2)
    # A=-1, r=2 < c: s = max(min(-2, -1.2), -3) = -2; loss = 2 (dual bound not binding)
    assert_close(_one_token(2.0, -1.0, surrogate=Clip(low=0.2, dual=3.0)), 2.0)


def test_golden_asymmetric_clip() -> None:
    # DAPO clip-higher: eps_low=0.2, eps_high=0.28
    # A=+1, r=1.5: s = min(1.5, 1.28) = 1.28; loss = -1.28 (symmetric would give -1.2)
    assert_close(_one_token(1.5, 1.0, surrogate=Clip(low=0.2, high=0.28)), -1.28)
    assert_close(_one_token(1.5, 1.0, surrogate=Clip(low=0.2)), -1.2)
    # A=-1, r=0.5: s = min(-0.5, -0.8) = -0.8; loss = 0.8 (the low edge is eps_low)
    assert_close(_one_token(0.5, -1.0, surrogate=Clip(low=0.2, high=0.28)), 0.8)
    # A=-1, r=1.5: s = min(-1.5, -1.28) = -1.5 (unclipped branch); loss = 1.5
    assert_close(_one_token(1.5, -1.0, surrogate=Clip(low=0.2, high=0.28)), 1.5)


def test_golden_vanilla_and_bound() -> None:
    # clip_low=None: s = r A = 4 * 2 = 8; loss = -8
    assert_close(_one_token(4.0, 2.0, surrogate=Clip(low=None)), -8.0)
    # log_ratio_bound=1: log r = log 4 = 1.386 > 1 -> r = e; s = 2e; loss = -2e
    assert_close(_one_token(4.0, 2.0, surrogate=Clip(low=None), log_ratio_bound=1.0), -2 * math.e)


def test_golden_reductions() -> None:
    # Two sequences, per-token losses with r = 1 (log_probs == old): L = -A.
    # Sequence 0: A=1, 1 token; sequence 1: A=4, 3 tokens; T=4; padding masked.
    mask = [[True, False, False, False], [True, True, True, False]]
    zeros = torch.zeros(2, 4, dtype=F64)
    advantages = torch.tensor([1.0, 4.0], dtype=F64)

    def loss(**kwargs: Any) -> torch.Tensor:
        return policy_loss(zeros, zeros, advantages, mask, **kwargs).loss

    # token_mean: -(1 + 4 + 4 + 4) / 4 = -13/4 = -3.25
    assert_close(loss(reduction="token_mean"), -3.25)
    # sequence_mean: -(1/1 + 12/3) / 2 = -(1 + 4)/2 = -2.5
    assert_close(loss(reduction="sequence_mean"), -2.5)
    # sequence_sum_normalized (Dr. GRPO), C = T = 4: -13 / (2 * 4) = -1.625
    assert_close(loss(reduction="sequence_sum_normalized"), -1.625)
    # ... with max_response_length=10: -13 / (2 * 10) = -0.65
    assert_close(loss(reduction="sequence_sum_normalized", max_response_length=10), -0.65)
    # token_mean with a global normalizer of 26 tokens: -13/26 = -0.5
    assert_close(loss(reduction="token_mean", normalizer=26), -0.5)
    # sequence_mean with normalizer 5 sequences: -5/5 = -1
    assert_close(loss(reduction="sequence_mean", normalizer=5), -1.0)
    # sequence_sum_normalized with normalizer 4 sequences, C=10: -13/40 = -0.325
    assert_close(
        loss(reduction="sequence_sum_normalized", normalizer=4, max_response_length=10), -0.325
    )
    # none: -A at selected tokens, 0 elsewhere
    assert_close(loss(reduction="none"), [[-1.0, 0.0, 0.0, 0.0], [-4.0, -4.0, -4.0, 0.0]])


def test_golden_gspo() -> None:
    # One sequence, log_ratio = [log 2, 0]: s = exp((log 2 + 0) / 2) = sqrt(2) at both tokens.
    # A = 1, no clipping: per-token loss -sqrt(2) at both; loss = -sqrt(2).
    log_probs = torch.tensor([[math.log(2.0), 0.0, 5.0]], dtype=F64, requires_grad=True)
    mask = [[True, True, False]]  # the third token is padding and must not enter the mean
    out = policy_loss(
        log_probs,
        torch.zeros(1, 3, dtype=F64),
        [1.0],
        mask,
        surrogate=Clip(low=None),
        ratio_level="sequence",
        return_per_token=True,
    )
    assert_close(out.loss, -math.sqrt(2))
    assert out.per_token_loss is not None
    assert_close(out.per_token_loss, [[-math.sqrt(2), -math.sqrt(2), 0.0]])
    assert_close(out.diagnostics.ratio_mean, math.sqrt(2))
    # Paper: loss = -s A with s = exp(mean_t log r), so d loss / d l_t = -A s / |y| = -sqrt(2)/2
    # = -0.7071 at each selected token, and 0 at the padding token.
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    assert_close(grad, [[-math.sqrt(2) / 2, -math.sqrt(2) / 2, 0.0]])
    # with clip_low=0.2: s = sqrt(2) = 1.414 > 1.2 and A > 0 -> clipped to 1.2; loss -1.2, grad 0
    clipped = policy_loss(
        log_probs, torch.zeros(1, 3, dtype=F64), [1.0], mask, ratio_level="sequence"
    )
    assert_close(clipped.loss, -1.2)
    assert_close(clipped.diagnostics.clip_fraction_high, 1.0)  # both tokens, per token count


# --------------------------------------------------------------------------------------------
# Dual clip, GSPO and vanilla-PG properties
# --------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), dual_clip=st.sampled_from([1.1, 1.5, 3.0]))
def test_dual_clip_only_changes_negative_advantages(seed: int, dual_clip: float) -> None:
    batch = make_batch(5, 6, seed, per_token=True, spread=1.5, empty_row_probability=0.0)
    plain = policy_loss(*batch, surrogate=Clip(low=0.2), return_per_token=True).per_token_loss
    dual = policy_loss(
        *batch, surrogate=Clip(low=0.2, dual=dual_clip), return_per_token=True
    ).per_token_loss
    assert plain is not None and dual is not None
    positive = batch.advantages >= 0
    torch.testing.assert_close(dual[positive], plain[positive], rtol=0, atol=0)
    negative = (batch.advantages < 0) & batch.mask
    # for A < 0 the loss is min(plain, -c A) (s = max(s, c A))
    expected = torch.minimum(plain, -dual_clip * batch.advantages)
    torch.testing.assert_close(dual[negative], expected[negative], rtol=0, atol=0)


def test_dual_clip_changes_something() -> None:
    # guard for the property above: with spread 1.5 the dual bound does bind somewhere
    batch = make_batch(5, 6, 0, per_token=True, spread=1.5, empty_row_probability=0.0)
    out = policy_loss(*batch, surrogate=Clip(low=0.2, dual=1.5))
    assert out.diagnostics.dual_clip_fraction > 0
    assert out.loss != policy_loss(*batch, surrogate=Clip(low=0.2)).loss


@pytest.mark.parametrize("dual_clip", [1.0, 0.5, 0.0, -2.0, torch.tensor(1.0)])
def test_dual_clip_at_most_one_raises(dual_clip: Any) -> None:
    batch = make_batch(2, 3, 0)
    with pytest.raises(ValueError, match=r"^Clip.dual must be > 1"):
        policy_loss(*batch, surrogate=Clip(dual=dual_clip))


@given(seed=st.integers(0, 2**31 - 1), clip_low=st.sampled_from([None, 0.5]))
def test_gspo_gradient_equals_paper_formula(seed: int, clip_low: float | None) -> None:
    # Independent check: GSPO objective J = (1/S) sum_i exp(mean_t (logp - old)) A_i, differentiated
    # directly by autograd (no stop-gradient), vs policy_loss(ratio_level="sequence") under
    # sequence_mean. Unclipped region: clip_low None, or ratios within [0.5, 1.5] (spread 0.05).
    batch = make_batch(5, 6, seed, spread=0.05)
    log_probs = batch.log_probs.clone().requires_grad_(True)
    advantages = batch.advantages
    out = policy_loss(
        log_probs,
        batch.old_log_probs,
        advantages,
        batch.mask,
        surrogate=Clip(low=clip_low),
        ratio_level="sequence",
        reduction="sequence_mean",
        return_per_token=True,
    )
    grads = torch.autograd.grad(out.loss, [log_probs])

    paper_log_probs = batch.log_probs.clone().requires_grad_(True)
    paper_advantages = batch.advantages  # a constant of the loss
    objective = torch.zeros((), dtype=F64)
    sequence_ratios = []
    non_empty = 0
    for i in range(5):
        selected = batch.mask[i]
        if not selected.any():
            sequence_ratios.append(torch.zeros((), dtype=F64))
            continue
        non_empty += 1
        log_ratio = paper_log_probs[i][selected] - batch.old_log_probs[i][selected]
        ratio = torch.exp(log_ratio.mean())
        sequence_ratios.append(ratio.detach())
        objective = objective + ratio * paper_advantages[i]
    paper_loss = -objective / max(non_empty, 1)
    expected = grads_of(paper_loss, [paper_log_probs])
    assert_close(out.loss, paper_loss.detach())
    assert_close(grads[0], expected[0])
    # the value at every selected token is -s_i A_i with the sequence ratio s_i
    per_token_expected = torch.where(
        batch.mask,
        -(torch.stack(sequence_ratios) * batch.advantages).unsqueeze(-1),
        torch.zeros((), dtype=F64),
    )
    assert out.per_token_loss is not None
    assert_close(out.per_token_loss, per_token_expected)


def test_gspo_differs_from_token_level() -> None:
    # guard: the sequence ratio is not the token ratio
    batch = make_batch(3, 5, 1, empty_row_probability=0.0)
    token = policy_loss(*batch, surrogate=Clip(low=None), reduction="sequence_mean").loss
    sequence = policy_loss(
        *batch, surrogate=Clip(low=None), ratio_level="sequence", reduction="sequence_mean"
    )
    assert not torch.allclose(token, sequence.loss)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_vanilla_pg_is_reinforce(reduction: str) -> None:
    # old = logp.detach(): r = 1 with gradient d r / d logp = 1, so the gradient of
    # -reduce(r A) is -A / N (token_mean), -A / (n_i S) (sequence_mean), -A / (B C) (Dr. GRPO).
    batch = make_batch(4, 6, 2, per_token=True)
    log_probs = batch.log_probs.clone().requires_grad_(True)
    out = policy_loss(
        log_probs, log_probs.detach(), batch.advantages, batch.mask, surrogate=Clip(low=None),
        reduction=reduction,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    mask = batch.mask
    counts = mask.sum(-1, keepdim=True).to(F64)  # (B, 1)
    if reduction == "token_mean":
        denominator = mask.sum().to(F64).expand_as(counts)
    elif reduction == "sequence_mean":
        denominator = counts * (counts > 0).sum()
    else:
        denominator = torch.full_like(counts, 4 * 6.0)
    expected = torch.where(mask, -batch.advantages / denominator, torch.zeros((), dtype=F64))
    assert_close(grad, expected)
    assert mask.any() and (grad != 0).any()


@given(
    batch_size=st.integers(0, 6),
    tokens=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
    per_token=st.booleans(),
    options=option_strategy,
    reduction=st.sampled_from(REDUCTIONS),
)
def test_ratio_one_gives_minus_reduced_advantages(
    batch_size: int,
    tokens: int,
    seed: int,
    per_token: bool,
    options: dict[str, Any],
    reduction: str,
) -> None:
    batch = make_batch(batch_size, tokens, seed, per_token=per_token)
    out = policy_loss(
        batch.log_probs, batch.log_probs, batch.advantages, batch.mask, reduction=reduction,
        **options,
    )  # fmt: skip
    advantages = batch.advantages if per_token else batch.advantages.unsqueeze(-1)
    per_token_advantages = {
        (i, t): advantages[i, t if per_token else 0]
        for i in range(batch_size)
        for t in range(tokens)
        if batch.mask[i, t]
    }
    expected = reference.reduce_losses(
        {key: -value for key, value in per_token_advantages.items()},
        (batch_size, tokens),
        reduction=reduction,
    )
    assert_close(out.loss, expected)
    assert_close(out.diagnostics.ratio_mean, 1.0 if batch.mask.any() else 0.0)
    assert_close(out.diagnostics.clipped_fraction, 0.0)
    assert_close(out.diagnostics.approx_kl_k3, 0.0)


# --------------------------------------------------------------------------------------------
# Masking: kept tokens only, padding invariance, NaN/inf at masked positions
# --------------------------------------------------------------------------------------------


def _pack(values: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Move each row's selected entries to the left of a (B, width) tensor (zeros after)."""
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for i in range(values.shape[0]):
        kept = values[i][mask[i]]
        out[i, : kept.numel()] = kept
    return out


@given(
    batch_size=st.integers(1, 6),
    tokens=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    options=option_strategy,
    reduction=st.sampled_from(["token_mean", "sequence_mean", "sequence_sum_normalized"]),
)
def test_masked_equals_kept_tokens_only(
    batch_size: int, tokens: int, seed: int, options: dict[str, Any], reduction: str
) -> None:
    batch = make_batch(batch_size, tokens, seed, per_token=True)
    width = int(batch.mask.sum(-1).max())
    counts = batch.mask.sum(-1, keepdim=True)  # (B, 1)
    packed_mask = torch.arange(width).unsqueeze(0) < counts  # (B, width)
    packed = Batch(
        *(_pack(x, batch.mask, width) for x in batch[:3]),
        packed_mask,
    )
    kwargs = dict(options, reduction=reduction, max_response_length=10)
    out, grads = run_library(batch, **kwargs)
    packed_out, packed_grads = run_library(packed, **kwargs)
    assert_close(out.loss, packed_out.loss.detach())
    for grad, packed_grad in zip(grads, packed_grads, strict=True):
        assert_close(_pack(grad, batch.mask, width), packed_grad)
        assert_close(grad[~batch.mask], torch.zeros(int((~batch.mask).sum()), dtype=F64))
    for name in DIAGNOSTIC_NAMES:
        assert_close(getattr(out.diagnostics, name), getattr(packed_out.diagnostics, name))


@given(
    batch_size=st.integers(0, 5),
    tokens=st.integers(0, 6),
    extra_rows=st.integers(0, 3),
    extra_columns=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
    options=option_strategy,
    reduction=st.sampled_from(["token_mean", "sequence_mean", "sequence_sum_normalized"]),
    garbage=st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e30]),
)
def test_extra_padding_changes_nothing(
    batch_size: int,
    tokens: int,
    extra_rows: int,
    extra_columns: int,
    seed: int,
    options: dict[str, Any],
    reduction: str,
    garbage: float,
) -> None:
    # Padding columns/rows are masked out and filled with garbage. Dr. GRPO's denominator counts
    # sequences and the constant C, so both are given explicitly (B sequences, C = 10).
    batch = make_batch(batch_size, tokens, seed, per_token=True)
    padded_shape = (batch_size + extra_rows, tokens + extra_columns)

    def pad(x: torch.Tensor, fill: Any) -> torch.Tensor:
        out = torch.full(padded_shape, fill, dtype=x.dtype)
        out[:batch_size, :tokens] = x
        return out

    padded = Batch(*(pad(x, garbage) for x in batch[:3]), pad(batch.mask, False))
    normalizer = batch_size if reduction == "sequence_sum_normalized" and batch_size else None
    kwargs = dict(options, reduction=reduction, max_response_length=10, normalizer=normalizer)
    out, grads = run_library(batch, **kwargs)
    padded_out, padded_grads = run_library(padded, **kwargs)
    assert_close(padded_out.loss, out.loss.detach())
    for grad, padded_grad in zip(grads, padded_grads, strict=True):
        assert torch.isfinite(padded_grad).all()
        assert_close(padded_grad, pad(grad, 0.0))
    for name in DIAGNOSTIC_NAMES:
        assert_close(getattr(padded_out.diagnostics, name), getattr(out.diagnostics, name))


POISONS = (math.nan, math.inf, -math.inf)
NONFINITE_OPTIONS: list[dict[str, Any]] = [
    {},
    {"surrogate": Clip(low=0.2, high=0.28, dual=3.0)},
    {"surrogate": Clip(low=None), "log_ratio_bound": None},
    {"ratio_level": "sequence"},
    {"ratio_level": "sequence", "surrogate": Clip(low=None), "log_ratio_bound": None},
    {"surrogate": Clip(low=0.1, dual=1.3, delta=1.6)},
    {"surrogate": CISPO(cap=1.3)},
    {"surrogate": "sapo", "ratio_level": "sequence"},
    {"surrogate": "gmpo"},
    {"surrogate": "vespo", "log_ratio_bound": None},
]


def _nonfinite_cases() -> list[Any]:
    """PyTorch: every poison x reduction x option x dtype. Kernels: every option they run, for
    both dtypes, with the poisons and reductions in turn."""
    dtypes = (torch.float32, torch.bfloat16)
    cases = [
        pytest.param("torch", poison, reduction, options, dtype)
        for poison in POISONS
        for reduction in REDUCTIONS
        for options in NONFINITE_OPTIONS
        for dtype in dtypes
    ]
    for index, options in enumerate(filter(on_kernels, NONFINITE_OPTIONS)):
        for offset, dtype in enumerate(dtypes):
            poison, reduction = POISONS[index % 3], REDUCTIONS[(index + offset) % 5]
            cases.append(triton_param(poison, reduction, options, dtype))
    return cases


@pytest.mark.parametrize(
    ("backend", "poison", "reduction", "options", "dtype"), _nonfinite_cases(), indirect=["backend"]
)
def test_nonfinite_at_masked_positions(
    backend: str, poison: float, reduction: str, options: dict[str, Any], dtype: torch.dtype
) -> None:
    clean = make_batch(4, 6, 9, per_token=True, dtype=dtype)
    unselected = ~clean.mask
    assert unselected.any() and clean.mask.any()
    poisoned = Batch(
        *(torch.where(unselected, torch.tensor(poison, dtype=dtype), x) for x in clean[:3]),
        clean.mask,
    )
    kwargs = dict(options, reduction=reduction, return_per_token=True)
    out, grads = run_library(clean, **kwargs)
    poisoned_out, poisoned_grads = run_library(poisoned, **kwargs)
    assert torch.isfinite(poisoned_out.loss).all()
    torch.testing.assert_close(poisoned_out.loss, out.loss, rtol=0, atol=0)
    torch.testing.assert_close(poisoned_out.per_token_loss, out.per_token_loss, rtol=0, atol=0)
    for grad, poisoned_grad in zip(grads, poisoned_grads, strict=True):
        assert torch.isfinite(poisoned_grad).all()
        torch.testing.assert_close(poisoned_grad, grad, rtol=0, atol=0)
    for name in DIAGNOSTIC_NAMES:
        value = getattr(poisoned_out.diagnostics, name)
        assert torch.isfinite(value)
        torch.testing.assert_close(value, getattr(out.diagnostics, name), rtol=0, atol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(0, 0), (0, 4), (3, 0), (3, 4)])
def test_nothing_selected_gives_zeros(backend: str, reduction: str, shape: tuple[int, int]) -> None:
    log_probs = torch.full(shape, 3.0, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    out = policy_loss(
        log_probs,
        torch.zeros(shape),
        torch.ones(shape),
        mask,
        reduction=reduction,
        surrogate=Clip(dual=2.0),
    )
    assert_close(out.loss, torch.zeros(out.loss.shape))
    (grad,) = grads_of(out.loss, [log_probs])
    assert_close(grad, torch.zeros(shape))
    for name in DIAGNOSTIC_NAMES:
        value = getattr(out.diagnostics, name)
        assert value.shape == () and value.grad_fn is None
        assert value == 0, name


def test_accepts_lists_numpy_and_numeric_masks() -> None:
    np = pytest.importorskip("numpy")
    batch = make_batch(3, 4, 4, empty_row_probability=0.0)
    expected = policy_loss(*batch).loss
    as_lists = policy_loss(
        batch.log_probs.tolist(),
        batch.old_log_probs.tolist(),
        batch.advantages.tolist(),
        batch.mask.tolist(),
    ).loss
    as_numpy = policy_loss(
        batch.log_probs.numpy(),
        batch.old_log_probs.numpy(),
        batch.advantages.numpy(),
        batch.mask.numpy().astype(np.float32) * 0.5,  # nonzero selects
    ).loss
    torch.testing.assert_close(as_lists.double(), expected)
    torch.testing.assert_close(as_numpy, expected)
    # integer log-probabilities become the default float dtype
    integer = policy_loss([[0, -1]], [[0, 0]], [1], [[1, 1]])
    assert integer.loss.dtype == torch.get_default_dtype()


def test_noncontiguous_equals_contiguous(backend: str) -> None:
    batch = make_batch(5, 6, 13, per_token=True, dtype=dtype_for(backend))
    # strided views: every other column of a wider tensor, and transposes of (T, B) storage
    wide = [torch.repeat_interleave(x, 2, dim=-1) for x in batch]
    views = Batch(*(x[:, ::2] for x in wide[:3]), wide[3][:, ::2])
    transposed = Batch(*(x.t().contiguous().t() for x in batch))
    assert not views.log_probs.is_contiguous() and not transposed.log_probs.is_contiguous()
    kwargs = dict(surrogate=Clip(low=0.2, high=0.3, dual=2.0), return_per_token=True)
    for reduction in REDUCTIONS:
        out, grads = run_library(batch, reduction=reduction, **kwargs)
        for strided in (views, transposed):
            strided_leaves = [x.detach().clone().requires_grad_(True) for x in strided[:3]]
            # keep the layout: clone() of a non-contiguous tensor preserves its strides
            strided_out = policy_loss(*strided_leaves, strided.mask, reduction=reduction, **kwargs)
            strided_grads = grads_of(strided_out.loss, strided_leaves)
            torch.testing.assert_close(strided_out.loss, out.loss)
            for grad, strided_grad in zip(grads, strided_grads, strict=True):
                torch.testing.assert_close(strided_grad, grad)


def test_inputs_not_mutated(backend: str) -> None:
    batch = make_batch(3, 4, 6, dtype=dtype_for(backend))
    poisoned = Batch(batch.log_probs.masked_fill(~batch.mask, math.nan), *batch[1:])
    copies = [x.clone() for x in poisoned]
    policy_loss(*poisoned, ratio_level="sequence", return_per_token=True)
    for before, after in zip(copies, poisoned, strict=True):
        torch.testing.assert_close(after, before, equal_nan=True, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------


DTYPE_OPTIONS: list[dict[str, Any]] = [
    {},
    {"surrogate": Clip(high=0.28, dual=3.0)},
    {"ratio_level": "sequence", "surrogate": Clip(low=None)},
    {"surrogate": Clip(delta=1.1)},
    {"surrogate": CISPO(cap=1.3)},
    {"surrogate": "sapo"},
    {"surrogate": "gmpo"},
    {"surrogate": "vespo"},
    {"surrogate": DPPO("kl", ratio_cap=3.0)},
    {"surrogate": DRO(beta=0.5)},
    {"surrogate": M2PO(threshold=0.12, low=0.2)},
    {"surrogate": KLCov(ratio=0.3, coef=1.0)},
    {"surrogate": ClipCov(ratio=1.0, cov_lb=0.0, cov_ub=1.0)},
]
DTYPE_REDUCTIONS = ("token_mean", "sequence_mean", "none")


def _dtype_cases() -> list[Any]:
    """PyTorch: every dtype x option x reduction. Kernels: the dtypes they read (float64 takes
    PyTorch) for every option they run, the reductions in turn."""
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    cases = [
        pytest.param("torch", dtype, options, reduction)
        for dtype in dtypes
        for options in DTYPE_OPTIONS
        for reduction in DTYPE_REDUCTIONS
    ]
    for index, options in enumerate(filter(on_kernels, DTYPE_OPTIONS)):
        for offset, dtype in enumerate(dtypes[1:]):
            reduction = DTYPE_REDUCTIONS[(index + offset) % 3]
            cases.append(triton_param(dtype, options, reduction))
    return cases


@pytest.mark.parametrize(
    ("backend", "dtype", "options", "reduction"), _dtype_cases(), indirect=["backend"]
)
def test_dtypes(backend: str, dtype: torch.dtype, options: dict[str, Any], reduction: str) -> None:
    batch = make_batch(4, 5, 17, per_token=True, dtype=dtype)
    out, grads = run_library(batch, reduction=reduction, return_per_token=True, **options)
    assert out.loss.dtype == dtype
    assert out.per_token_loss is not None and out.per_token_loss.dtype == dtype
    assert all(g.dtype == dtype for g in grads)
    diagnostics_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(d.dtype == diagnostics_dtype for d in out.diagnostics)
    # compared with the float64 reference on the same (rounded) inputs
    expected, expected_grads = run_reference(batch, reduction=reduction, **options)
    assert_close(out.loss, expected)
    if dtype in (torch.bfloat16, torch.float16):
        # computed in float32 and rounded once: identical to the float32 computation, rounded
        upcast = Batch(*(x.float() for x in batch[:3]), batch.mask)
        out32, grads32 = run_library(upcast, reduction=reduction, return_per_token=True, **options)
        torch.testing.assert_close(out.loss, out32.loss.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(
            out.per_token_loss, out32.per_token_loss.to(dtype), rtol=0, atol=0
        )
        for grad, grad32 in zip(grads, grads32, strict=True):
            torch.testing.assert_close(grad, grad32.to(dtype), rtol=0, atol=0)
        for low, high in zip(out.diagnostics, out32.diagnostics, strict=True):
            torch.testing.assert_close(low, high, rtol=0, atol=0)
    else:
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            assert_close(grad, expected_grad)


def test_float16_large_log_ratio_is_computed_in_float32(backend: str) -> None:
    # log r = 15: exp(15) = 3.3e6 overflows float16 (max 65504) but not float32; A = 1 and the
    # clip gives s = 1.2, loss = -1.2 (the float16 value nearest to -1.2 is -1.2001953125)
    log_probs = torch.tensor([[15.0, 0.0]], dtype=torch.float16, requires_grad=True)
    out = policy_loss(log_probs, torch.zeros(1, 2, dtype=torch.float16), [1.0], [[True, False]])
    assert out.loss.dtype == torch.float16
    assert_close(out.loss, -1.2)
    assert_close(out.diagnostics.ratio_mean, math.exp(15))
    out.loss.backward()
    assert log_probs.grad is not None and torch.isfinite(log_probs.grad).all()


def test_mixed_float64_computes_in_float64() -> None:
    # float32 log_probs with float64 advantages: math in float64, output float32
    batch = make_batch(3, 4, 1)
    out = policy_loss(batch.log_probs.float(), batch.old_log_probs, batch.advantages, batch.mask)
    assert out.loss.dtype == torch.float32
    assert out.diagnostics.ratio_mean.dtype == torch.float64


# --------------------------------------------------------------------------------------------
# Diagnostics: hand counts
# --------------------------------------------------------------------------------------------


def test_diagnostics_hand_count() -> None:
    # eps_low=0.2, eps_high=0.28 -> band [0.8, 1.28]; c = 3; bound 20.
    #  token  r        A    out-of-band  low-binding  high-binding  dual   bound
    #  1      0.5     -1    yes          yes          -             no: min(-.5,-.8)=-.8 > -3
    #  2      0.5     +1    yes          -            -             -
    #  3      1.5     +1    yes          -            yes           -
    #  4      1.5     -1    yes          -            -             no: -1.5 > -3
    #  5      4       -1    yes          -            -             yes: min(-4,-1.28)=-4 < -3
    #  6      1       +2    no           -            -             -
    #  7      e^25    0     yes          - (A=0)      - (A=0)       -      yes (|25| > 20)
    #  8      0.8     -1    no (edge)    no (edge)    -             -
    #  9      1.28    +1    no (edge)    -            no (edge)     -
    #  (masked: r = 100, A = -5: ignored)
    ratios = [0.5, 0.5, 1.5, 1.5, 4.0, 1.0, None, 0.8, 1.28, 100.0]
    log_ratios = [25.0 if r is None else math.log(r) for r in ratios]
    advantages = [-1.0, 1.0, 1.0, -1.0, -1.0, 2.0, 0.0, -1.0, 1.0, -5.0]
    mask = [[True] * 9 + [False]]
    out = policy_loss(
        torch.tensor([log_ratios], dtype=F64),
        torch.zeros(1, 10, dtype=F64),
        torch.tensor([advantages], dtype=F64),
        mask,
        surrogate=Clip(low=0.2, high=0.28, dual=3.0),
    )
    d = out.diagnostics
    n = 9
    assert_close(d.clipped_fraction, 6 / n)  # tokens 1-5 and 7
    assert_close(d.clip_fraction_low, 1 / n)  # token 1
    assert_close(d.clip_fraction_high, 1 / n)  # token 3
    assert_close(d.dual_clip_fraction, 1 / n)  # token 5
    assert_close(d.log_ratio_bound_fraction, 1 / n)  # token 7
    bounded = [math.exp(20.0) if r is None else r for r in ratios[:9]]
    assert_close(d.ratio_mean, sum(bounded) / n)  # the ratio after the bound
    # k1 = mean(-log r) with the raw log-ratio (25 for token 7)
    assert_close(d.approx_kl_k1, -sum(log_ratios[:9]) / n)
    # k3 = mean(r - 1 - log r) with log r clamped to the bound (20 for token 7)
    k3 = [math.expm1(min(x, 20.0)) - min(x, 20.0) for x in log_ratios[:9]]
    assert_close(d.approx_kl_k3, sum(k3) / n)
    for value in d:
        assert value.grad_fn is None and not value.requires_grad


def test_diagnostics_boundary_not_counted_float32(backend: str) -> None:
    # Band [1, 1] (clip_low = clip_high = 0) and r = exp(0) = 1 exactly: on the edge, not counted.
    out = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), [1.0, -1.0], torch.ones(2, 3))
    assert out.diagnostics.clipped_fraction == 0
    edge = policy_loss(
        torch.zeros(2, 3), torch.zeros(2, 3), [1.0, -1.0], torch.ones(2, 3),
        surrogate=Clip(low=0.0, high=0.0),
    )  # fmt: skip
    assert edge.diagnostics.clipped_fraction == 0
    assert edge.diagnostics.clip_fraction_low == 0 and edge.diagnostics.clip_fraction_high == 0
    # r = exp(1e-3) > 1: now out of the [1, 1] band for all 6 tokens; binding for the A > 0 row
    above = policy_loss(
        torch.full((2, 3), 1e-3), torch.zeros(2, 3), [1.0, -1.0], torch.ones(2, 3),
        surrogate=Clip(low=0.0, high=0.0),
    )  # fmt: skip
    assert_close(above.diagnostics.clipped_fraction, 1.0)
    assert_close(above.diagnostics.clip_fraction_high, 0.5)
    assert_close(above.diagnostics.clip_fraction_low, 0.0)


def test_diagnostics_without_clip_or_dual_are_zero() -> None:
    batch = make_batch(3, 5, 2, spread=2.0, empty_row_probability=0.0)
    out = policy_loss(*batch, surrogate=Clip(low=None), log_ratio_bound=None)
    assert out.diagnostics.clipped_fraction == 0
    assert out.diagnostics.clip_fraction_low == 0 and out.diagnostics.clip_fraction_high == 0
    assert out.diagnostics.dual_clip_fraction == 0
    assert out.diagnostics.log_ratio_bound_fraction == 0
    assert out.diagnostics.ratio_mean > 0


def test_diagnostics_sequence_level_count_tokens() -> None:
    # GSPO: the sequence ratio is repeated at each token, so a clipped sequence of 3 tokens counts
    # 3 times (as verl). Sequence 0: log r = [0.5, 0.5, 0.5] -> s = e^0.5 = 1.65 > 1.2, A = 1;
    # sequence 1: one token, log r = 0 -> inside. Clipped 3/4 tokens.
    log_probs = torch.tensor([[0.5, 0.5, 0.5], [0.0, 9.0, 9.0]], dtype=F64)
    mask = [[True, True, True], [True, False, False]]
    out = policy_loss(
        log_probs, torch.zeros(2, 3, dtype=F64), [1.0, 1.0], mask, ratio_level="sequence"
    )
    assert_close(out.diagnostics.clipped_fraction, 0.75)
    assert_close(out.diagnostics.clip_fraction_high, 0.75)
    assert_close(out.diagnostics.ratio_mean, (3 * math.exp(0.5) + 1) / 4)
    # k1 uses the token log-ratios: -(0.5 * 3 + 0) / 4
    assert_close(out.diagnostics.approx_kl_k1, -0.375)


# --------------------------------------------------------------------------------------------
# Micro-batch invariance
# --------------------------------------------------------------------------------------------

LENGTHS = [1, 12, 3, 0, 11, 2, 7]  # very different response lengths; one empty response
SPLITS = [(0, 2), (2, 3), (3, 6), (6, 7)]


def _long_short_batch(dtype: torch.dtype = F64) -> Batch:
    batch = make_batch(len(LENGTHS), 12, 31, per_token=True, empty_row_probability=0.0, dtype=dtype)
    mask = torch.arange(12).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(-1)  # (B, T)
    return Batch(batch.log_probs, batch.old_log_probs, batch.advantages, mask)


def _micro_batch(batch: Batch, start: int, stop: int) -> Batch:
    # each micro-batch is padded only to its own longest response (as a trainer would)
    width = max(1, max(LENGTHS[start:stop]))
    return Batch(*(x[start:stop, :width] for x in batch))


MICRO_REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted")
MICRO_OPTIONS: list[dict[str, Any]] = [
    {"surrogate": Clip(low=0.2, high=0.28, dual=2.0), "log_ratio_bound": 0.5},
    {"ratio_level": "sequence", "surrogate": Clip(low=0.1)},
    {"surrogate": Clip(low=None)},
    {"surrogate": Clip(low=0.2, delta=1.1)},
    {"surrogate": CISPO(cap=1.3)},
    {"surrogate": "cispo"},
    {"surrogate": "sapo"},
    {"surrogate": "gmpo"},
    {"surrogate": "vespo"},
    {"surrogate": DPPO()},  # token-local: the trust region and the cap are per token
    {"surrogate": DPPO("kl", ratio_cap=None)},
    {"surrogate": DRO(beta=0.5)},
    {"surrogate": ProbabilityBand(tau=0.05, kappa=0.5)},  # token-local: the band per token
    {"surrogate": FIPO(gamma=0.9, cap=0.2, safety_threshold=1.2)},  # the future sums per row
]


def _micro_batch_cases() -> list[Any]:
    """PyTorch: every reduction x option. Kernels: every option they run, reductions in turn."""
    cases = [
        pytest.param("torch", reduction, options)
        for reduction in MICRO_REDUCTIONS
        for options in MICRO_OPTIONS
    ]
    for index, options in enumerate(filter(on_kernels, MICRO_OPTIONS)):
        cases.append(triton_param(MICRO_REDUCTIONS[index % 4], options))
    return cases


@pytest.mark.parametrize(
    ("backend", "reduction", "options"), _micro_batch_cases(), indirect=["backend"]
)
def test_micro_batch_invariance(backend: str, reduction: str, options: dict[str, Any]) -> None:
    batch = _long_short_batch(dtype_for(backend))
    tokens = int(batch.mask.sum())  # global selected-token count
    non_empty = int((batch.mask.sum(-1) > 0).sum())  # global non-empty sequence count
    normalizer = {
        "token_mean": tokens,
        "sequence_mean": non_empty,
        "sequence_sum_normalized": len(LENGTHS),
        "length_weighted": len(LENGTHS),
    }[reduction]
    kwargs = dict(options, reduction=reduction, max_response_length=12)
    full, full_grads = run_library(batch, **kwargs)

    dtype = batch.log_probs.dtype
    total = torch.zeros((), dtype=dtype)
    grads = [torch.zeros_like(x) for x in batch[:3]]
    diagnostics = dict.fromkeys(DIAGNOSTIC_NAMES, torch.zeros((), dtype=dtype))
    naive = torch.zeros((), dtype=dtype)
    for start, stop in SPLITS:
        micro = _micro_batch(batch, start, stop)
        out, micro_grads = run_library(
            micro, **kwargs, normalizer=normalizer, diagnostics_normalizer=tokens
        )
        total = total + out.loss.detach()
        width = micro.mask.shape[1]
        for grad, micro_grad in zip(grads, micro_grads, strict=True):
            if grad.ndim == 1:
                grad[start:stop] += micro_grad
            else:
                grad[start:stop, :width] += micro_grad
        for name in DIAGNOSTIC_NAMES:
            diagnostics[name] = diagnostics[name] + getattr(out.diagnostics, name)
        # naive gradient accumulation: local normalization, averaged over micro-batches
        local_kwargs = dict(kwargs, max_response_length=None)
        naive = naive + policy_loss(*micro, **local_kwargs).loss / len(SPLITS)

    assert_close(total, full.loss.detach())
    for grad, full_grad in zip(grads, full_grads, strict=True):
        assert_close(grad, full_grad)
    for name in DIAGNOSTIC_NAMES:
        assert_close(diagnostics[name], getattr(full.diagnostics, name))
    # the test can fail: per-micro-batch normalization gives a different loss
    assert abs(float(naive.detach()) - float(full.loss.detach())) > 1e-3


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _valid() -> dict[str, Any]:
    return {
        "log_probs": torch.zeros(2, 3),
        "old_log_probs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 3, dtype=torch.bool),
    }


ERROR_CASES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"log_probs": torch.zeros(2, 3, 4)}, ValueError, r"log_probs must have shape \(B, T\)"),
    ({"log_probs": torch.zeros(3)}, ValueError, r"log_probs must have shape \(B, T\)"),
    ({"old_log_probs": torch.zeros(2, 4)}, ValueError, r"old_log_probs must have the same shape"),
    ({"mask": torch.ones(3, 3)}, ValueError, r"mask must have the same shape"),
    ({"advantages": torch.zeros(3)}, ValueError, r"advantages must have shape \(B,\), \(B, 1\)"),
    ({"advantages": torch.zeros(2, 2)}, ValueError, r"advantages must have shape"),
    ({"advantages": torch.zeros(2, 3, 1)}, ValueError, r"advantages must have shape"),
    ({"log_probs": "abc"}, TypeError, r"log_probs must be"),
    ({"log_probs": [["a", "b", "c"], ["d", "e", "f"]]}, TypeError, r"log_probs must contain"),
    ({"log_probs": [[0.0, 0.0, 0.0], [0.0]]}, ValueError, r"log_probs is a ragged"),
    ({"old_log_probs": torch.zeros(2, 3, dtype=torch.complex64)}, TypeError, r"old_log_probs"),
    ({"mask": None}, TypeError, r"mask must be"),
    ({"old_log_probs": torch.zeros(2, 3, device="meta")}, ValueError, r"old_log_probs must be on"),
    ({"log_ratio_bound": 0.0}, ValueError, r"log_ratio_bound must be > 0"),
    ({"log_ratio_bound": -1.0}, ValueError, r"log_ratio_bound must be > 0"),
    ({"ratio_level": "tokens"}, ValueError, r"ratio_level must be one of"),
    ({"reduction": "mean"}, ValueError, r"reduction must be one of"),
    ({"reduction": None}, ValueError, r"reduction must be one of"),
    ({"normalizer": 0}, ValueError, r"normalizer must be > 0"),
    ({"normalizer": -3.0}, ValueError, r"normalizer must be > 0"),
    ({"normalizer": math.inf}, ValueError, r"normalizer must be finite"),
    ({"normalizer": torch.ones(2)}, TypeError, r"normalizer must be a real number or a 0-d"),
    ({"normalizer": "10"}, TypeError, r"normalizer must be a real number"),
    (
        {"reduction": "sequence_sum_normalized", "max_response_length": 0},
        ValueError,
        r"max_response_length must be > 0",
    ),
    (
        {"reduction": "sequence_sum_normalized", "max_response_length": 2.5},
        ValueError,
        r"max_response_length must be > 0 and a whole number",
    ),
    ({"diagnostics_normalizer": -1}, ValueError, r"diagnostics_normalizer must be > 0"),
    ({"surrogate": "ppo"}, ValueError, r"surrogate must be one of \['clip', 'cispo'"),
    ({"surrogate": 3}, TypeError, r"surrogate must be one of .* or a surrogate object"),
    ({"surrogate": Clip}, TypeError, r"surrogate must be one of .* or a surrogate object"),
    (
        {"surrogate": "gmpo", "ratio_level": "sequence"},
        ValueError,
        r"surrogate=GMPO\(low=0.2, high=None\) forms its own sequence ratio: ratio_level must be",
    ),
    (
        {"surrogate": "vespo", "ratio_level": "sequence"},
        ValueError,
        r"ratio_level must be 'token'",
    ),
    ({"importance_weights": torch.ones(3)}, ValueError, r"importance_weights must have shape"),
    ({"importance_weights": torch.ones(2, 2)}, ValueError, r"importance_weights must have shape"),
    ({"importance_weights": "w"}, TypeError, r"importance_weights must be"),
    (
        {"importance_weights": torch.ones(2, 3, device="meta")},
        ValueError,
        r"importance_weights must be on the same device",
    ),
    ({"entropy": torch.ones(2, 4)}, ValueError, r"entropy must have the same shape"),
    ({"entropy": torch.ones(2)}, ValueError, r"entropy must have shape \(B, T\)"),
    ({"entropy_coef": 0.1}, ValueError, r"entropy_coef != 0 requires entropy"),
    ({"entropy": torch.ones(2, 3), "entropy_coef": math.inf}, ValueError, r"entropy_coef must be"),
    ({"diagnostics_normalizer": "a"}, TypeError, r"diagnostics_normalizer must be a real"),
]


@pytest.mark.parametrize(("override", "error", "match"), ERROR_CASES)
def test_errors(override: dict[str, Any], error: type[Exception], match: str) -> None:
    arguments = _valid()
    tensors = {k: override.pop(k) for k in list(override) if k in arguments}
    arguments.update(tensors)
    with pytest.raises(error, match=match):
        policy_loss(**arguments, **override)


# The surrogate objects validate their fields when built (0.2's flat keywords, now fields).
SURROGATE_ERROR_CASES: list[tuple[type, dict[str, Any], type[Exception], str]] = [
    (Clip, {"low": -0.1}, ValueError, r"^Clip.low must be >= 0"),
    (Clip, {"low": math.nan}, ValueError, r"^Clip.low must be finite"),
    (Clip, {"low": math.inf}, ValueError, r"^Clip.low must be finite"),
    (Clip, {"low": 1.0}, ValueError, r"^Clip.low must be < 1"),
    (Clip, {"low": True}, TypeError, r"^Clip.low must be a real number"),
    (Clip, {"low": "0.2"}, TypeError, r"^Clip.low must be a real number"),
    (Clip, {"low": torch.tensor([0.2])}, TypeError, r"^Clip.low must be a real number or a 0-d"),
    (Clip, {"high": -0.2}, ValueError, r"^Clip.high must be >= 0"),
    (Clip, {"low": None, "high": 0.2}, ValueError, r"^Clip.high requires Clip.low"),
    (Clip, {"dual": 1.0}, ValueError, r"^Clip.dual must be > 1"),
    (Clip, {"dual": math.nan}, ValueError, r"^Clip.dual must be finite"),
    (Clip, {"delta": 1.0}, ValueError, r"^Clip.delta must be > 1"),
    (Clip, {"delta": math.nan}, ValueError, r"^Clip.delta must be finite"),
    (CISPO, {"cap": 0.0}, ValueError, r"^CISPO.cap must be > 0"),
    (CISPO, {"cap": 5.0, "high": 0.28}, ValueError, r"^CISPO.high does not apply with CISPO.cap"),
    (CISPO, {"cap": 5.0, "low": 0.2}, ValueError, r"^CISPO.low does not apply with CISPO.cap"),
    (CISPO, {"low": None, "high": 0.2}, ValueError, r"^CISPO.high requires CISPO.low"),
    (SAPO, {"temperature_pos": 0.0}, ValueError, r"^SAPO.temperature_pos must be > 0"),
    (SAPO, {"temperature_neg": -1.0}, ValueError, r"^SAPO.temperature_neg must be > 0"),
    (GMPO, {"low": 1.5}, ValueError, r"^GMPO.low must be < 1"),
    (GMPO, {"low": None, "high": 0.3}, ValueError, r"^GMPO.high requires GMPO.low"),
    (VESPO, {"k_pos": -1.0}, ValueError, r"^VESPO.k_pos must be >= 0"),
    (VESPO, {"lambda_neg": 0.0}, ValueError, r"^VESPO.lambda_neg must be > 0"),
    (VESPO, {"k_neg": "3"}, TypeError, r"^VESPO.k_neg must be a real number"),
]


@pytest.mark.parametrize(("cls", "fields", "error", "match"), SURROGATE_ERROR_CASES)
def test_surrogate_object_errors(
    cls: type, fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        cls(**fields)


def test_hyperparameters_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        policy_loss(*_valid().values(), 0.2)  # type: ignore[misc]


def test_tensor_hyperparameters(backend: str) -> None:
    # 0-d tensor hyperparameters give the same result as Python numbers
    batch = make_batch(4, 5, 3, per_token=True, spread=1.0, dtype=dtype_for(backend))

    def tensor(value: float) -> torch.Tensor:
        return torch.tensor(float(value), dtype=F64)

    expected = policy_loss(
        *batch, surrogate=Clip(low=0.2, high=0.3, dual=2.0), log_ratio_bound=0.8, normalizer=9
    )
    actual = policy_loss(
        *batch,
        surrogate=Clip(low=tensor(0.2), high=tensor(0.3), dual=tensor(2.0)),
        log_ratio_bound=tensor(0.8),
        normalizer=tensor(9),
    )
    assert_close(actual.loss, expected.loss)
    for a, b in zip(actual.diagnostics, expected.diagnostics, strict=True):
        assert_close(a, b)
    family: list[tuple[type, dict[str, float]]] = [
        (Clip, dict(delta=1.1, dual=2.0, high=0.3)),
        (CISPO, dict(cap=1.2)),
        (SAPO, dict(temperature_pos=2.0, temperature_neg=3.0)),
        (VESPO, dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.0)),
        (GMPO, dict(low=0.1, high=0.3)),
    ]
    for cls, numbers in family:
        tensors = {k: tensor(v) for k, v in numbers.items()}
        expected = policy_loss(*batch, surrogate=cls(**numbers))
        actual = policy_loss(*batch, surrogate=cls(**tensors))
        assert_close(actual.loss, expected.loss)
        for a, b in zip(actual.diagnostics, expected.diagnostics, strict=True):
            assert_close(a, b)


# --------------------------------------------------------------------------------------------
# torch.compile (one compile)
# --------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_compiled_equals_eager() -> None:
    batch = make_batch(3, 5, 7, per_token=True, dtype=torch.float32, spread=1.0)
    normalizer = torch.tensor(11.0)

    def step(
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        out = policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            surrogate=Clip(low=0.2, high=0.28, dual=3.0),
            log_ratio_bound=0.8,
            reduction="sequence_mean",
            normalizer=normalizer,
            diagnostics_normalizer=normalizer,
        )
        return (out.loss, *out.diagnostics)

    # aot_eager traces the whole call (fullgraph=True: no graph break) and its autograd graph in
    # ~15 s; inductor's C++ code generation would double that on CI's CPUs without testing our code.
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_log_probs = batch.log_probs.clone().requires_grad_(True)
    compiled_log_probs = batch.log_probs.clone().requires_grad_(True)
    eager = step(eager_log_probs, *batch[1:])
    result = compiled(compiled_log_probs, *batch[1:])
    for a, b in zip(result, eager, strict=True):
        torch.testing.assert_close(a, b)
    eager_grads = grads_of(eager[0], [eager_log_probs])
    compiled_grads = grads_of(result[0], [compiled_log_probs])
    torch.testing.assert_close(compiled_grads[0], eager_grads[0])
    assert (compiled_grads[0] != 0).any()
