"""A user's own surrogate (``tests/custom_surrogate.py``, outside the library) on every path.

``TanhSurrogate`` implements only ``surrogate(self, log_ratio, advantages)``. It must run on
:func:`policy_loss` (every reduction, GSPO's sequence ratio, packed, importance weights, the
entropy bonus) and on :func:`fused_policy_loss_from_hidden` (the chunk loop, kept sets), values
and gradients equal to its float64 loop reference; ``context_group`` and ``vocab_group`` are
checked on spawned ranks (``tests/_context_workers.py``, ``tests/_vocab_workers.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from custom_surrogate import TanhSurrogate, saturated_fraction, tanh_surrogates
from tolerances import assert_close

F64 = torch.float64
REDUCTIONS = ["token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none"]


def _batch(batch: int, tokens: int, seed: int, dtype: torch.dtype = F64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=g, dtype=F64) * 3
    log_probs = old + 0.6 * torch.randn(batch, tokens, generator=g, dtype=F64)
    mask = torch.rand(batch, tokens, generator=g) < 0.7
    mask[0] = False  # an empty sequence
    return {
        "log_probs": torch.where(mask, log_probs, torch.nan).to(dtype),  # NaN where unselected
        "old_log_probs": torch.where(mask, old, torch.inf).to(dtype),
        "advantages": torch.randn(batch, generator=g, dtype=F64).to(dtype),
        "mask": mask,
        "weights": (torch.rand(batch, tokens, generator=g, dtype=F64) + 0.5).to(dtype),
        "entropy": (torch.rand(batch, tokens, generator=g, dtype=F64) * 2).to(dtype),
    }


def _expected(case: dict[str, Any], leaf: torch.Tensor, entropy: torch.Tensor | None,
              **options: Any) -> torch.Tensor:  # fmt: skip
    mask, weights = case["mask"], options.pop("importance_weights", None)
    surrogates = tanh_surrogates(
        leaf, case["old_log_probs"], case["advantages"], mask,
        ratio_level=options.pop("ratio_level", "token"),
    )  # fmt: skip
    coef = options.pop("entropy_coef", 0.0)
    losses = {}
    for (i, t), value in surrogates.items():
        loss = -value * (1.0 if weights is None else weights[i, t].double())
        losses[(i, t)] = loss if entropy is None else loss - coef * entropy[i, t].double()
    return reference.reduce_losses(losses, tuple(mask.shape), **options)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("extras", ["plain", "weights+entropy"])
def test_policy_loss_matches_the_float64_reference(
    reduction: str, ratio_level: str, extras: str
) -> None:
    case = _batch(5, 7, seed=1)
    leaf = case["log_probs"].clone().requires_grad_(True)
    entropy = case["entropy"].clone().requires_grad_(True) if extras != "plain" else None
    options: dict[str, Any] = {"reduction": reduction, "ratio_level": ratio_level}
    if extras != "plain":
        options.update(importance_weights=case["weights"], entropy_coef=0.03)
    out = rlo.policy_loss(
        leaf, case["old_log_probs"], case["advantages"], case["mask"],
        surrogate=TanhSurrogate(), entropy=entropy, **options,
    )  # fmt: skip
    leaves = [leaf] if entropy is None else [leaf, entropy]
    grads = torch.autograd.grad(out.loss.sum(), leaves)
    want_leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    expected = _expected(case, want_leaves[0], None if entropy is None else want_leaves[1],
                         **options)  # fmt: skip
    want = torch.autograd.grad(expected.sum(), want_leaves)
    assert_close(out.loss, expected)
    for got, ref in zip(grads, want, strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, ref)
    if ratio_level == "token":  # the saturation count it names is its clipped_fraction
        saturated = saturated_fraction(case["log_probs"], case["old_log_probs"], case["mask"])
        assert_close(out.diagnostics.clipped_fraction, saturated)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 5),
    tokens=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_property_odd_shapes_and_dtypes(batch: int, tokens: int, seed: int,
                                        dtype: torch.dtype) -> None:  # fmt: skip
    case = _batch(batch, tokens, seed, dtype)
    leaf = case["log_probs"].clone().requires_grad_(True)
    out = rlo.policy_loss(
        leaf, case["old_log_probs"], case["advantages"], case["mask"], surrogate=TanhSurrogate()
    )
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    wide = case["log_probs"].double().requires_grad_(True)
    wide_case = {**case, "old_log_probs": case["old_log_probs"].double(),
                 "advantages": case["advantages"].double()}  # fmt: skip
    expected = _expected(wide_case, wide, None, reduction="token_mean")
    want = torch.zeros_like(wide)  # nothing selected: the reference is a constant 0
    if expected.requires_grad:
        (want,) = torch.autograd.grad(expected, [wide])
    assert out.loss.dtype == dtype
    assert_close(out.loss, expected)
    assert_close(grad, want)


def test_packed_equals_padded() -> None:
    case = _batch(4, 6, seed=3)
    packed = rlo.pack(case["log_probs"], case["mask"])
    old = rlo.pack(case["old_log_probs"], case["mask"]).values
    for reduction in ("sequence_mean", "token_mean"):
        padded = rlo.policy_loss(
            case["log_probs"], case["old_log_probs"], case["advantages"], case["mask"],
            surrogate=TanhSurrogate(), reduction=reduction, ratio_level="sequence",
        )  # fmt: skip
        flat = rlo.policy_loss(
            packed.values, old, case["advantages"], torch.ones_like(packed.values, dtype=bool),
            surrogate=TanhSurrogate(), reduction=reduction, ratio_level="sequence",
            cu_seqlens=packed.cu_seqlens,
        )  # fmt: skip
        torch.testing.assert_close(flat.loss, padded.loss, rtol=1e-12, atol=1e-12)


def _head(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, tokens, hidden, vocab = 3, 5, 8, 13
    mask = torch.rand(batch, tokens, generator=g) < 0.8
    return {
        "hidden": torch.randn(batch, tokens, hidden, generator=g, dtype=F64),
        "weight": torch.randn(vocab, hidden, generator=g, dtype=F64) / 2,
        "bias": torch.randn(vocab, generator=g, dtype=F64),
        "tokens": torch.randint(0, vocab, (batch, tokens), generator=g),
        "old_log_probs": -torch.rand(batch, tokens, generator=g, dtype=F64) * 3 - 1,
        "advantages": torch.randn(batch, generator=g, dtype=F64),
        "mask": mask,
    }


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "none"])
@pytest.mark.parametrize("kept", [{}, {"top_k": 6}], ids=["full", "top_k"])
def test_from_hidden_chunk_loop_matches_the_reference(reduction: str, kept: dict[str, Any]) -> None:
    case = _head(seed=4)
    leaves = [case[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    out = rlo.fused_policy_loss_from_hidden(
        leaves[0], leaves[1], case["tokens"], case["old_log_probs"], case["advantages"],
        case["mask"], bias=leaves[2], surrogate=TanhSurrogate(), reduction=reduction,
        chunk_size=4, temperature=0.9, **kept,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss.sum(), leaves)
    wide = [case[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    log_probs, _ = reference.truncated_log_probs_from_hidden(
        wide[0], wide[1], case["tokens"], bias=wide[2], temperature=0.9, mask=case["mask"], **kept
    )
    # a sampled token outside the recomputed kept set: probability 0, no gradient
    mask = case["mask"] & torch.isfinite(log_probs)
    surrogates = tanh_surrogates(
        torch.where(mask, log_probs, 0.0), case["old_log_probs"], case["advantages"], mask
    )
    losses = {key: -value for key, value in surrogates.items()}
    for key in zip(*torch.nonzero(case["mask"] & ~mask, as_tuple=True), strict=True):
        i, t = int(key[0]), int(key[1])  # the clipped ratio e^-20: a constant, as the library's
        bounded = torch.tensor(-20.0, dtype=F64)
        value = case["advantages"][i] * torch.tanh((torch.exp(bounded) - 1.0) / 0.5)
        losses[(i, t)] = -value
    expected = reference.reduce_losses(losses, tuple(case["mask"].shape), reduction=reduction)
    want = torch.autograd.grad(expected.sum(), wide)
    assert_close(out.loss, expected)
    for got, ref in zip(grads, want, strict=True):
        assert_close(got, ref)
