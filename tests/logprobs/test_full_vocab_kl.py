"""full_vocab_kl and full_vocab_kl_loss: exact KL(pi || ref) over the vocabulary, chunked."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import aggregate, full_vocab_kl, full_vocab_kl_loss
from tolerances import assert_close, tolerance

REDUCTIONS = ["token_mean", "sequence_mean", "sequence_sum_normalized", "none"]


def _case(
    seed: int, batch: int, tokens: int, vocab: int, three_d: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, tokens) if three_d else (batch * tokens,)
    logits = 2 * torch.randn(*shape, vocab, generator=generator, dtype=torch.float64)
    ref_logits = logits + torch.randn(*shape, vocab, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    return logits.to(dtype), ref_logits.to(dtype), mask


def _grads(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    y = ref_logits.detach().clone().requires_grad_(True)
    out = fn(x, y)
    if not out.requires_grad:  # a reference with every row masked is a constant
        return out.detach(), torch.zeros_like(x), torch.zeros_like(y)
    (out.to(torch.float64) * w).sum().backward()
    assert x.grad is not None and y.grad is not None
    return out.detach(), x.grad, y.grad


def test_golden() -> None:
    # p = [1/2, 1/2], q = [1/4, 3/4]:
    # KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3) = 0.14384103622589045
    logits = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    ref_logits = torch.log(torch.tensor([[0.25, 0.75]])).requires_grad_(True)
    kl = full_vocab_kl(logits, ref_logits)
    assert_close(kl, [0.14384103622589045])
    kl.sum().backward()
    # d/dx_v = p_v (ln p_v - ln q_v - KL): 0.5 (ln 2 - 0.143841) = 0.274653,
    #                                      0.5 (ln(2/3) - 0.143841) = -0.274653
    # d/dy_v = q_v - p_v = [-0.25, 0.25]
    assert logits.grad is not None and ref_logits.grad is not None
    assert_close(
        logits.grad,
        [
            [
                0.5 * (math.log(2) - 0.14384103622589045),
                0.5 * (math.log(2 / 3) - 0.14384103622589045),
            ]
        ],
    )
    assert_close(ref_logits.grad, [[-0.25, 0.25]])


def test_zero_when_policies_agree_and_nonnegative() -> None:
    logits, ref_logits, _ = _case(0, 3, 4, 6, True, torch.float64)
    assert_close(full_vocab_kl(logits, logits), torch.zeros(3, 4))
    assert (full_vocab_kl(logits, ref_logits) >= 0).all()
    # Shifting either distribution's logits by a per-row constant changes nothing.
    shifted = full_vocab_kl(
        logits + 7.0, ref_logits - torch.arange(4.0, dtype=torch.float64)[:, None]
    )
    torch.testing.assert_close(
        shifted, full_vocab_kl(logits, ref_logits), **tolerance(torch.float64)
    )


def test_minus_inf_logits() -> None:
    # Zero-probability tokens of the policy contribute 0 (not 0 * (-inf - -inf) = NaN).
    logits = torch.tensor([[0.0, 0.0, -math.inf]], requires_grad=True)
    ref_logits = torch.tensor([[0.0, math.log(3.0), -math.inf]], requires_grad=True)
    kl = full_vocab_kl(logits, ref_logits)
    assert_close(kl, [0.14384103622589045])  # as in test_golden
    kl.sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    assert torch.isfinite(logits.grad).all() and torch.isfinite(ref_logits.grad).all()
    # A token the reference excludes but the policy supports: KL = +inf (exact, not NaN).
    assert full_vocab_kl(torch.zeros(1, 2), torch.tensor([[0.0, -math.inf]]))[0] == math.inf


shapes = st.tuples(
    st.integers(0, 2**16),  # seed
    st.integers(1, 3),  # B
    st.integers(1, 5),  # T
    st.integers(1, 9),  # V
    st.integers(1, 7),  # chunk_size
    st.booleans(),  # (B, T, V) or (N, V)
    st.booleans(),  # mask
    st.sampled_from([1.0, 0.6, 1.8]),
)


@given(shapes, st.sampled_from([torch.float32, torch.float64]))
def test_matches_reference(
    case: tuple[int, int, int, int, int, bool, bool, float], dtype: torch.dtype
) -> None:
    seed, batch, tokens, vocab, chunk, three_d, use_mask, tau = case
    logits, ref_logits, mask = _case(seed, batch, tokens, vocab, three_d, dtype)
    mask_arg = mask if use_mask else None
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out, grad, ref_grad = _grads(
        lambda x, y: full_vocab_kl(x, y, mask=mask_arg, temperature=tau, chunk_size=chunk),
        logits,
        ref_logits,
        w,
    )
    expected, expected_grad, expected_ref_grad = _grads(
        lambda x, y: reference.full_vocab_kl(x, y, mask_arg, tau),
        logits.double(),
        ref_logits.double(),
        w,
    )
    assert out.dtype == dtype and out.shape == mask.shape
    assert_close(out, expected)
    assert grad.dtype == dtype and ref_grad.dtype == dtype
    assert_close(grad, expected_grad)
    assert_close(ref_grad, expected_ref_grad)


def test_gradcheck_float64() -> None:
    logits, ref_logits, mask = _case(4, 2, 3, 5, True, torch.float64)
    x = logits.clone().requires_grad_(True)
    y = ref_logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: full_vocab_kl(a, b, mask=mask, temperature=0.8, chunk_size=4), (x, y)
    )
    assert torch.autograd.gradcheck(lambda a, b: full_vocab_kl(a, b, chunk_size=1), (x, y))
    assert torch.autograd.gradcheck(
        lambda a: full_vocab_kl_loss(a, ref_logits, mask, reduction="sequence_mean", chunk_size=5),
        (x,),
    )


def test_ref_logits_gradient_only_when_required() -> None:
    logits, ref_logits, _ = _case(6, 2, 3, 4, True, torch.float32)
    x = logits.clone().requires_grad_(True)
    full_vocab_kl(x, ref_logits).sum().backward()
    assert x.grad is not None and ref_logits.grad is None
    y = ref_logits.clone().requires_grad_(True)
    full_vocab_kl(logits, y).sum().backward()
    assert y.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_float32(dtype: torch.dtype) -> None:
    # Upcasting the rounded logits is exact, so the float32 result must meet the float32
    # tolerance against the float64 reference on the same rounded logits; gradients come back
    # in the input dtype and are compared at its tolerance.
    logits, ref_logits, mask = _case(8, 3, 11, 53, True, dtype)
    w = torch.randn(mask.shape, dtype=torch.float64)
    out, grad, ref_grad = _grads(
        lambda x, y: full_vocab_kl(x, y, mask=mask, chunk_size=4), logits, ref_logits, w
    )
    expected, expected_grad, expected_ref_grad = _grads(
        lambda x, y: reference.full_vocab_kl(x, y, mask), logits.double(), ref_logits.double(), w
    )
    assert out.dtype == torch.float32
    assert_close(out, expected)
    assert grad.dtype == dtype and ref_grad.dtype == dtype
    assert_close(grad, expected_grad)
    assert_close(ref_grad, expected_ref_grad)


def test_mixed_dtypes() -> None:
    logits, ref_logits, mask = _case(10, 2, 4, 7, True, torch.float32)
    out = full_vocab_kl(logits.to(torch.bfloat16), ref_logits, mask=mask)
    assert out.dtype == torch.float32
    assert_close(
        out, reference.full_vocab_kl(logits.to(torch.bfloat16).double(), ref_logits.double(), mask)
    )
    assert full_vocab_kl(logits, ref_logits.double()).dtype == torch.float64


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_in_masked_rows_do_not_leak(poison: float) -> None:
    logits, ref_logits, mask = _case(12, 3, 5, 6, True, torch.float32)
    mask[1, :] = False  # a fully masked sequence too
    mask[0, 2] = False
    fill = torch.full_like(logits, poison)
    bad_logits = torch.where(mask.unsqueeze(-1), logits, fill)
    bad_ref = torch.where(mask.unsqueeze(-1), ref_logits, -fill)
    w = torch.randn(mask.shape, dtype=torch.float64)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return full_vocab_kl(x, y, mask=mask, chunk_size=4)

    out, grad, ref_grad = _grads(fn, bad_logits, bad_ref, w)
    clean, clean_grad, clean_ref_grad = _grads(fn, logits, ref_logits, w)
    for value in (out, grad, ref_grad):
        assert torch.isfinite(value).all()
    assert (out[~mask] == 0).all() and (grad[~mask] == 0).all() and (ref_grad[~mask] == 0).all()
    torch.testing.assert_close(out, clean)
    torch.testing.assert_close(grad, clean_grad)
    torch.testing.assert_close(ref_grad, clean_ref_grad)
    for reduction in REDUCTIONS:
        loss = full_vocab_kl_loss(bad_logits, bad_ref, mask, reduction=reduction)
        assert torch.isfinite(loss).all()


def test_fully_masked_batch_gives_zeros() -> None:
    logits = torch.full((2, 3, 4), math.nan, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for reduction in REDUCTIONS:
        loss = full_vocab_kl_loss(logits, torch.zeros(2, 3, 4), mask, reduction=reduction)
        assert (loss == 0).all()
        loss.sum().backward()
    assert logits.grad is not None and (logits.grad == 0).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_equals_aggregate_of_per_token_kl(reduction: str) -> None:
    logits, ref_logits, mask = _case(14, 3, 5, 6, True, torch.float64)
    w = torch.ones(()) if reduction != "none" else torch.randn(3, 5, dtype=torch.float64)
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    loss = full_vocab_kl_loss(
        x1, ref_logits, mask, reduction=reduction, max_response_length=8, chunk_size=4
    )
    expected = aggregate(
        reference.full_vocab_kl(x2, ref_logits, mask),
        mask,
        reduction=reduction,
        max_response_length=8,
    )
    torch.testing.assert_close(loss, expected, **tolerance(torch.float64))
    (loss * w).sum().backward()
    (expected * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, **tolerance(torch.float64))


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_micro_batches_with_normalizer_add_up_to_full_batch(reduction: str) -> None:
    logits, ref_logits, mask = _case(16, 4, 5, 6, True, torch.float64)
    mask[2] = False
    full = full_vocab_kl_loss(logits, ref_logits, mask, reduction=reduction)
    normalizer = {
        "token_mean": mask.sum(),
        "sequence_mean": (mask.sum(-1) > 0).sum(),
        "sequence_sum_normalized": 4,
    }[reduction]
    parts = sum(
        full_vocab_kl_loss(
            logits[i : i + 2],
            ref_logits[i : i + 2],
            mask[i : i + 2],
            reduction=reduction,
            normalizer=normalizer,
        )
        for i in (0, 2)
    )
    torch.testing.assert_close(parts, full, **tolerance(torch.float64))


def test_errors() -> None:
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(
        ValueError,
        match=r"ref_logits must have the same shape as logits \(2, 3, 4\), got shape \(2, 3, 5\)",
    ):
        full_vocab_kl(logits, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\).*got shape \(3, 2\)"):
        full_vocab_kl(logits, logits, mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"temperature must be > 0.0, got -1.0"):
        full_vocab_kl(logits, logits, temperature=-1.0)
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1"):
        full_vocab_kl(logits, logits, chunk_size=-2)
    with pytest.raises(
        ValueError,
        match=r"logits must have shape \(B, T, V\) for a reduced loss, got shape \(6, 4\)",
    ):
        full_vocab_kl_loss(logits.reshape(6, 4), logits.reshape(6, 4), torch.ones(6))
    with pytest.raises(ValueError, match=r"reduction must be one of"):
        full_vocab_kl_loss(logits, logits, torch.ones(2, 3), reduction="mean")
    with pytest.raises(ValueError, match=r"normalizer must be > 0"):
        full_vocab_kl_loss(logits, logits, torch.ones(2, 3), normalizer=0)
    with pytest.raises(ValueError, match=r"ref_logits must have shape \(B, T, V\) or \(N, V\)"):
        full_vocab_kl(logits, torch.zeros(2, 3, 4, 1))
