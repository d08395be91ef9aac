"""grpo_clipped_surrogate: reference, gradients, dtypes, masking, edge cases.

Every test but the gradcheck, the exact padding check and the compiled call runs on both
backends (the ``backend`` fixture, ``tests/backends.py``: float64 batches become float32 on the
Triton kernels, since float64 always takes PyTorch).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from backends import FIXTURE_HEALTH, dtype_for
from rlobjectives import grpo_clipped_surrogate
from tolerances import assert_close

KEYS = ("loss", "per_sequence_surrogate", "clipped_fraction")


def make_batch(
    batch: int,
    tokens: int,
    seed: int,
    *,
    dtype: torch.dtype = torch.float64,
    advantage_shape: str = "B",
    keep: float = 0.6,
    scale: float = 0.4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=generator, dtype=torch.float64) * 3
    new = old + scale * torch.randn(batch, tokens, generator=generator, dtype=torch.float64)
    shape = {"B": (batch,), "B1": (batch, 1), "BT": (batch, tokens)}[advantage_shape]
    advantages = torch.randn(*shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(batch, tokens, generator=generator) < keep
    return new.to(dtype), old.to(dtype), advantages.to(dtype), mask


def reference_outputs(new, old, advantages, mask, eps):  # type: ignore[no-untyped-def]
    return reference.grpo_clipped_surrogate(
        new.double(), old.double(), advantages.double(), mask, eps
    )


@FIXTURE_HEALTH
@given(
    batch=st.integers(0, 6),
    tokens=st.integers(0, 7),
    seed=st.integers(0, 10_000),
    advantage_shape=st.sampled_from(["B", "B1", "BT"]),
    eps=st.sampled_from([0.0, 0.1, 0.2, 0.35]),
)
def test_matches_float64_reference_values_and_gradients(
    backend: str, batch: int, tokens: int, seed: int, advantage_shape: str, eps: float
) -> None:
    new, old, advantages, mask = make_batch(
        batch, tokens, seed, advantage_shape=advantage_shape, dtype=dtype_for(backend)
    )
    new_ours = new.clone().requires_grad_(True)
    new_ref = new.double().requires_grad_(True)
    ours = grpo_clipped_surrogate(new_ours, old, advantages, mask, eps)
    expected = reference.grpo_clipped_surrogate(
        new_ref, old.double(), advantages.double(), mask, eps
    )
    for key in KEYS:
        assert ours[key].shape == expected[key].shape
        assert_close(ours[key], expected[key])
    # gradients of loss and of a random combination of the per-sequence surrogates
    weights = torch.randn(batch, dtype=torch.float64)
    (ours["loss"] + (ours["per_sequence_surrogate"] * weights).sum()).backward()
    target = expected["loss"] + (expected["per_sequence_surrogate"] * weights).sum()
    if target.requires_grad:
        target.backward()
    grad_ref = new_ref.grad if new_ref.grad is not None else torch.zeros_like(new_ref)
    assert_close(new_ours.grad, grad_ref)  # type: ignore[arg-type]


def test_gradcheck_float64() -> None:
    new, old, advantages, mask = make_batch(3, 5, 1, advantage_shape="BT")
    mask[0, 0] = True

    def loss(x: torch.Tensor) -> torch.Tensor:
        out = grpo_clipped_surrogate(x, old, advantages, mask, 0.2)
        return torch.cat([out["loss"].reshape(1), out["per_sequence_surrogate"]])

    assert torch.autograd.gradcheck(loss, (new.clone().requires_grad_(True),))


def test_gradient_is_zero_at_unselected_positions(backend: str) -> None:
    new, old, advantages, mask = make_batch(4, 6, 2, dtype=dtype_for(backend))
    new.requires_grad_(True)
    grpo_clipped_surrogate(new, old, advantages, mask, 0.2)["loss"].backward()
    assert new.grad is not None
    assert torch.all(new.grad[~mask] == 0)


def test_token_mean_is_not_mean_of_sequence_means(backend: str) -> None:
    # Sequence 0: 1 token, s = 1*2 = 2; sequence 1: 3 tokens, s = 1*(-1) each.
    # token mean: -(2 - 3)/4 = 0.25; the mean of sequence means would be -(2 - 1)/2 = -0.5.
    new = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    out = grpo_clipped_surrogate(new, new, [2.0, -1.0], mask, 0.2)
    assert out["loss"].item() == pytest.approx(0.25)
    assert out["per_sequence_surrogate"].tolist() == pytest.approx([2.0, -1.0])


@pytest.mark.parametrize("advantage_shape", ["B", "B1", "BT"])
def test_advantage_shapes(backend: str, advantage_shape: str) -> None:
    new, old, advantages, mask = make_batch(
        3, 4, 3, advantage_shape=advantage_shape, dtype=dtype_for(backend)
    )
    ours = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    expected = reference_outputs(new, old, advantages, mask, 0.2)
    for key in KEYS:
        assert_close(ours[key], expected[key])


def test_sequence_advantages_broadcast_like_per_token_copies(backend: str) -> None:
    new, old, advantages, mask = make_batch(3, 4, 4, dtype=dtype_for(backend))
    per_sequence = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    as_column = grpo_clipped_surrogate(new, old, advantages[:, None], mask, 0.2)
    per_token = grpo_clipped_surrogate(new, old, advantages[:, None].expand(3, 4), mask, 0.2)
    for key in KEYS:
        torch.testing.assert_close(per_sequence[key], as_column[key], rtol=0, atol=0)
        torch.testing.assert_close(per_sequence[key], per_token[key], rtol=0, atol=0)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.uint8])
def test_mask_dtypes(backend: str, mask_dtype: torch.dtype) -> None:
    new, old, advantages, mask = make_batch(3, 5, 5, dtype=dtype_for(backend))
    expected = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    numeric = mask.to(mask_dtype)
    if mask_dtype == torch.float32:
        numeric = numeric * 0.5  # any nonzero entry selects
    ours = grpo_clipped_surrogate(new, old, advantages, numeric, 0.2)
    for key in KEYS:
        torch.testing.assert_close(ours[key], expected[key], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_dtype_rules(backend: str, dtype: torch.dtype) -> None:
    new, old, advantages, mask = make_batch(4, 9, 6, dtype=dtype)
    new.requires_grad_(True)
    ours = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    for key in KEYS:
        assert ours[key].dtype == dtype
        assert ours[key].device == new.device
    # the reference runs in float64 on the same (rounded) inputs
    expected = reference_outputs(new.detach(), old, advantages, mask, 0.2)
    for key in KEYS:
        assert_close(ours[key], expected[key])
    ours["loss"].backward()
    assert new.grad is not None and new.grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_computed_in_float32(backend: str, dtype: torch.dtype) -> None:
    # bf16/fp16 results equal the float32 computation on the same inputs, rounded once.
    new, old, advantages, mask = make_batch(5, 33, 7, dtype=dtype)
    ours = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    in_float32 = grpo_clipped_surrogate(new.float(), old.float(), advantages.float(), mask, 0.2)
    for key in KEYS:
        torch.testing.assert_close(ours[key], in_float32[key].to(dtype), rtol=0, atol=0)


def test_fp16_large_log_ratio_does_not_overflow(backend: str) -> None:
    # exp(12) = 162754.8 overflows fp16 (max 65504): the ratio must be formed in float32.
    # s = min(r * A, 1.2 * A) with A = 1 -> 1.2; loss = -1.2 (finite).
    new = torch.tensor([[12.0]], dtype=torch.float16)
    out = grpo_clipped_surrogate(new, torch.zeros(1, 1, dtype=torch.float16), [1.0], [[1]], 0.2)
    assert out["loss"].item() == pytest.approx(-1.2, abs=1e-3)


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_at_masked_positions_are_ignored(backend: str, poison: float) -> None:
    new, old, advantages, mask = make_batch(4, 6, 8, advantage_shape="BT", dtype=dtype_for(backend))
    mask[:, 0] = True
    clean_new = new.clone().requires_grad_(True)
    clean = grpo_clipped_surrogate(clean_new, old, advantages, mask, 0.2)
    clean["loss"].backward()

    dirty_new_values = torch.where(mask, new, torch.full_like(new, poison))
    dirty_new = dirty_new_values.clone().requires_grad_(True)
    dirty_old = torch.where(
        mask, old, torch.full_like(old, -poison if poison == poison else poison)
    )
    dirty_adv = torch.where(mask, advantages, torch.full_like(advantages, poison))
    dirty = grpo_clipped_surrogate(dirty_new, dirty_old, dirty_adv, mask, 0.2)
    dirty["loss"].backward()
    for key in KEYS:
        assert torch.isfinite(dirty[key]).all()
        torch.testing.assert_close(dirty[key], clean[key], rtol=0, atol=0)
    assert dirty_new.grad is not None and clean_new.grad is not None
    assert torch.isfinite(dirty_new.grad).all()
    torch.testing.assert_close(dirty_new.grad, clean_new.grad, rtol=0, atol=0)


def test_nan_at_selected_position_propagates(backend: str) -> None:
    new = torch.tensor([[0.0, math.nan]])
    out = grpo_clipped_surrogate(new, torch.zeros(1, 2), [1.0], [[True, True]], 0.2)
    assert math.isnan(out["loss"].item())
    assert math.isnan(out["per_sequence_surrogate"][0].item())


def test_padding_columns_and_rows_change_nothing() -> None:
    new, old, advantages, mask = make_batch(3, 5, 9)
    new.requires_grad_(True)
    base = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    (grad_base,) = torch.autograd.grad(base["loss"], new)

    padded_new = torch.cat([new, torch.full((3, 4), 123.0, dtype=new.dtype)], dim=1)
    padded_old = torch.cat([old, torch.full((3, 4), -77.0, dtype=old.dtype)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], dim=1)
    padded = grpo_clipped_surrogate(padded_new, padded_old, advantages, padded_mask, 0.2)
    (grad_padded,) = torch.autograd.grad(padded["loss"], new)
    for key in KEYS:
        torch.testing.assert_close(padded[key], base[key], rtol=0, atol=1e-15)
    torch.testing.assert_close(grad_padded, grad_base, rtol=0, atol=1e-15)


@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (3, 0)])
def test_empty_batches(backend: str, shape: tuple[int, int]) -> None:
    zeros = torch.zeros(shape)
    out = grpo_clipped_surrogate(zeros, zeros, torch.zeros(shape[0]), zeros.bool(), 0.2)
    assert out["loss"].item() == 0.0
    assert out["clipped_fraction"].item() == 0.0
    assert out["per_sequence_surrogate"].shape == (shape[0],)
    assert torch.all(out["per_sequence_surrogate"] == 0)


def test_plain_empty_lists(backend: str) -> None:
    out = grpo_clipped_surrogate([], [], [], [], 0.2)
    assert out["loss"].item() == 0.0 and out["per_sequence_surrogate"].shape == (0,)


def test_all_masked_gives_zero_loss_and_zero_gradient(backend: str) -> None:
    new = torch.randn(3, 4, requires_grad=True)
    out = grpo_clipped_surrogate(new, torch.zeros(3, 4), torch.ones(3), torch.zeros(3, 4), 0.2)
    out["loss"].backward()
    assert out["loss"].item() == 0.0
    assert new.grad is not None and torch.all(new.grad == 0)


@pytest.mark.parametrize("log_ratio", [1e4, -1e4])
def test_extreme_log_ratios_are_bounded_by_the_clamp(backend: str, log_ratio: float) -> None:
    # r = exp(clamp(+-1e4, -60, 60)) = exp(+-60): finite in float32; with A = 1 and eps = 0.2
    # s = min(r, clip(r)) = 1.2 for r = e^60 and e^-60 for r = e^-60 (the unclipped branch).
    new = torch.tensor([[log_ratio]], requires_grad=True)
    out = grpo_clipped_surrogate(new, torch.zeros(1, 1), [1.0], [[True]], 0.2)
    expected = -1.2 if log_ratio > 0 else -math.exp(-60)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-6)
    assert out["clipped_fraction"].item() == 1.0
    out["loss"].backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()
    assert new.grad.item() == 0.0  # the clamp is saturated: d clamp / d x = 0


def test_ratio_exactly_on_band_edges_is_not_clipped(backend: str) -> None:
    # r = exp(log(1.25)) = 1.25 = 1 + eps and r = exp(log(0.75)) = 0.75 = 1 - eps exactly
    # (powers of two, exact in float32 and float64), so neither is strictly outside.
    for dtype in (torch.float32, torch.float64):
        new = torch.tensor([[math.log(1.25), math.log(0.75)]], dtype=dtype)
        assert torch.exp(new).tolist()[0] == [1.25, 0.75]
        out = grpo_clipped_surrogate(new, torch.zeros(1, 2, dtype=dtype), [1.0], [[1, 1]], 0.25)
        assert out["clipped_fraction"].item() == 0.0
        # just outside the band on both sides is counted
        outside = torch.tensor([[math.log(1.26), math.log(0.74)]], dtype=dtype)
        out = grpo_clipped_surrogate(outside, torch.zeros(1, 2, dtype=dtype), [1.0], [[1, 1]], 0.25)
        assert out["clipped_fraction"].item() == 1.0


def test_clipped_fraction_counts_both_signs_of_advantage(backend: str) -> None:
    # r = 0.5 with A > 0 (the unclipped branch wins the min) is still outside the band: counted.
    new = torch.tensor([[math.log(0.5), math.log(1.0)]])
    out = grpo_clipped_surrogate(new, torch.zeros(1, 2), [1.0], [[1, 1]], 0.2)
    assert out["clipped_fraction"].item() == pytest.approx(0.5)


def test_inputs_are_not_modified(backend: str) -> None:
    new, old, advantages, mask = make_batch(
        3, 4, 10, advantage_shape="BT", dtype=dtype_for(backend)
    )
    new[~mask] = math.nan
    copies = [t.clone() for t in (new, old, advantages, mask)]
    grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    for original, copy in zip((new, old, advantages, mask), copies, strict=True):
        torch.testing.assert_close(original, copy, equal_nan=True, rtol=0, atol=0)


def test_non_contiguous_inputs(backend: str) -> None:
    new, old, advantages, mask = make_batch(
        5, 4, 11, advantage_shape="BT", dtype=dtype_for(backend)
    )
    expected = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    transposed = [t.t().contiguous().t() for t in (new, old, advantages, mask)]
    assert not transposed[0].is_contiguous()
    ours = grpo_clipped_surrogate(*transposed, 0.2)
    for key in KEYS:
        torch.testing.assert_close(ours[key], expected[key], rtol=0, atol=1e-15)


def test_numpy_and_list_inputs() -> None:
    new, old, advantages, mask = make_batch(3, 4, 12)
    expected = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    from_numpy = grpo_clipped_surrogate(
        new.numpy(), old.numpy(), advantages.numpy(), mask.numpy(), np.float64(0.2)
    )
    from_lists = grpo_clipped_surrogate(
        new.tolist(), tuple(old.tolist()), advantages.tolist(), mask.tolist(), 0.2
    )
    for key in KEYS:
        assert from_numpy[key].dtype == torch.float64
        torch.testing.assert_close(from_numpy[key], expected[key], rtol=0, atol=0)
        # Python floats become the default dtype (float32)
        assert_close(from_lists[key], expected[key])


def test_clip_epsilon_as_zero_dim_tensor(backend: str) -> None:
    new, old, advantages, mask = make_batch(3, 4, 13, dtype=dtype_for(backend))
    expected = grpo_clipped_surrogate(new, old, advantages, mask, 0.2)
    ours = grpo_clipped_surrogate(
        new, old, advantages, mask, torch.tensor(0.2, dtype=torch.float64)
    )
    for key in KEYS:
        torch.testing.assert_close(ours[key], expected[key], rtol=0, atol=0)


@pytest.mark.compile
def test_compiles_without_graph_breaks() -> None:
    new, old, advantages, mask = make_batch(3, 5, 14, dtype=torch.float32)
    compiled = torch.compile(grpo_clipped_surrogate, fullgraph=True)
    x_compiled = new.clone().requires_grad_(True)
    x_eager = new.clone().requires_grad_(True)
    ours = compiled(x_compiled, old, advantages, mask, 0.2)
    expected = grpo_clipped_surrogate(x_eager, old, advantages, mask, 0.2)
    for key in KEYS:
        assert_close(ours[key], expected[key].double())
    ours["loss"].backward()
    expected["loss"].backward()
    assert_close(x_compiled.grad, x_eager.grad.double())  # type: ignore[arg-type,union-attr]
