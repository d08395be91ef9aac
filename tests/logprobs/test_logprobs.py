"""token_log_probs, token_entropy and the shared chunking helpers of rlobjectives._logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import token_entropy, token_log_probs
from rlobjectives._core.chunking import DEFAULT_CHUNK_ELEMENTS, resolve_chunk_size, row_chunks
from rlobjectives.logprobs.blocks import (
    chunk_entropy,
    chunk_entropy_grad,
    chunk_token_log_probs,
    chunk_token_log_probs_grad,
)
from tolerances import assert_close, tolerance

TEMPERATURES = [1.0, 0.7, 2.5]


def _case(
    seed: int, batch: int, tokens: int, vocab: int, three_d: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, tokens) if three_d else (batch * tokens,)
    logits = (3 * torch.randn(*shape, vocab, generator=generator, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, vocab, shape, generator=generator)
    mask = torch.rand(shape, generator=generator) < 0.7
    return logits, ids, mask


def _grad(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    if not out.requires_grad:  # a reference with every row masked is a constant
        return out.detach(), torch.zeros_like(x)
    (out.to(torch.float64) * w).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


# --- golden values ------------------------------------------------------------------------------


def test_token_log_probs_golden() -> None:
    # logits [0, ln 9] at temperature 2 -> x = [0, ln 3] -> p = [1/4, 3/4].
    logits = torch.tensor([[0.0, math.log(9.0)]], requires_grad=True)
    out = token_log_probs(logits, torch.tensor([0]), temperature=2.0)
    assert out.dtype == torch.float32 and out.shape == (1,)
    assert_close(out, [math.log(0.25)])  # -1.3862943611
    out.sum().backward()
    # (onehot - p) / tau = ([1, 0] - [0.25, 0.75]) / 2 = [0.375, -0.375]
    assert logits.grad is not None
    assert_close(logits.grad, [[0.375, -0.375]])


def test_token_entropy_golden() -> None:
    # p = [1/4, 3/4]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351446188083
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    out = token_entropy(logits)
    assert_close(out, [0.5623351446188083])
    out.sum().backward()
    # dH/dx_v = -p_v (log p_v + H): v=0: -0.25 (ln 0.25 + 0.56234) = 0.2060397
    #                               v=1: -0.75 (ln 0.75 + 0.56234) = -0.2060397
    assert logits.grad is not None
    expected = [-0.25 * (math.log(0.25) + 0.5623351446188083)]
    expected.append(-0.75 * (math.log(0.75) + 0.5623351446188083))
    assert_close(logits.grad, [expected])
    # Uniform over 4 tokens: ln 4; -inf logits of banned tokens contribute 0, not NaN.
    assert_close(token_entropy(torch.zeros(4)[None]), [math.log(4.0)])
    banned = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]], requires_grad=True)
    h = token_entropy(banned)
    assert_close(h, [math.log(2.0)])
    h.sum().backward()
    assert banned.grad is not None and torch.isfinite(banned.grad).all()


def test_minus_inf_logit_at_unsampled_token_is_exact() -> None:
    logits = torch.tensor([[0.0, -math.inf, 0.0]], requires_grad=True)
    out = token_log_probs(logits, torch.tensor([2]))
    assert_close(out, [math.log(0.5)])
    out.sum().backward()
    assert logits.grad is not None
    assert_close(logits.grad, [[-0.5, 0.0, 0.5]])


# --- reference comparisons (hypothesis) ---------------------------------------------------------


shapes = st.tuples(
    st.integers(0, 2**16),  # seed
    st.integers(1, 3),  # B
    st.integers(1, 5),  # T
    st.integers(1, 9),  # V
    st.integers(1, 7),  # chunk_size (often not dividing N)
    st.booleans(),  # (B, T, V) or (N, V)
    st.booleans(),  # with mask
    st.sampled_from(TEMPERATURES),
)


@given(shapes, st.sampled_from([torch.float32, torch.float64]))
def test_token_log_probs_matches_reference(
    case: tuple[int, int, int, int, int, bool, bool, float], dtype: torch.dtype
) -> None:
    seed, batch, tokens, vocab, chunk, three_d, use_mask, tau = case
    logits, ids, mask = _case(seed, batch, tokens, vocab, three_d, dtype)
    mask_arg = mask if use_mask else None
    w = torch.randn(
        ids.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )

    out, grad = _grad(
        lambda x: token_log_probs(x, ids, mask=mask_arg, temperature=tau, chunk_size=chunk),
        logits,
        w,
    )
    ref_out, ref_grad = _grad(
        lambda x: reference.token_log_probs(x, ids, mask_arg, tau), logits.double(), w
    )
    assert out.dtype == dtype and out.shape == ids.shape
    assert_close(out, ref_out)
    assert grad.dtype == dtype
    assert_close(grad, ref_grad)


@given(shapes, st.sampled_from([torch.float32, torch.float64]))
def test_token_entropy_matches_reference(
    case: tuple[int, int, int, int, int, bool, bool, float], dtype: torch.dtype
) -> None:
    seed, batch, tokens, vocab, chunk, three_d, use_mask, tau = case
    logits, ids, mask = _case(seed, batch, tokens, vocab, three_d, dtype)
    mask_arg = mask if use_mask else None
    w = torch.randn(
        ids.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )

    out, grad = _grad(
        lambda x: token_entropy(x, mask=mask_arg, temperature=tau, chunk_size=chunk), logits, w
    )
    ref_out, ref_grad = _grad(
        lambda x: reference.token_entropy(x, mask_arg, tau), logits.double(), w
    )
    assert out.dtype == dtype and out.shape == ids.shape
    assert_close(out, ref_out)
    assert_close(grad, ref_grad)


@given(
    st.integers(0, 2**16),
    st.integers(1, 6),
    st.integers(2, 8),
    st.floats(-30, 30),
)
def test_invariant_to_shifting_each_row(seed: int, rows: int, vocab: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    shift = scale * torch.randn(rows, 1, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, vocab, (rows,), generator=generator)
    for fn in (
        lambda x: token_log_probs(x, ids, chunk_size=2),
        lambda x: token_entropy(x, chunk_size=2),
    ):
        torch.testing.assert_close(fn(logits + shift), fn(logits), **tolerance(torch.float64))


def test_chunk_size_does_not_change_results() -> None:
    logits, ids, _ = _case(3, 3, 7, 11, True, torch.float32)
    w = torch.randn(ids.shape, dtype=torch.float64)
    results = [
        _grad(lambda x, c=c: token_log_probs(x, ids, chunk_size=c), logits, w)
        for c in (1, 4, 21, 1000)
    ]
    results.append(_grad(lambda x: token_log_probs(x, ids), logits, w))  # default chunk size
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0], **tolerance(torch.float32))
        torch.testing.assert_close(grad, results[0][1], **tolerance(torch.float32))


def test_noncontiguous_logits_equal_contiguous() -> None:
    logits = torch.randn(5, 3, 7).transpose(0, 1)  # (3, 5, 7), non-contiguous
    ids = torch.randint(0, 7, (3, 5))
    assert not logits.is_contiguous()
    w = torch.randn(3, 5, dtype=torch.float64)
    out, grad = _grad(lambda x: token_log_probs(x, ids, chunk_size=4), logits, w)
    ref_out, ref_grad = _grad(
        lambda x: token_log_probs(x, ids, chunk_size=4), logits.contiguous(), w
    )
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


# --- gradcheck (float64) ------------------------------------------------------------------------


def test_gradcheck_float64() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[True, False, True], [True, True, False]])
    assert torch.autograd.gradcheck(
        lambda x: token_log_probs(x, ids, mask=mask, temperature=0.7, chunk_size=4), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda x: token_entropy(x, mask=mask, temperature=1.3, chunk_size=4), (logits,)
    )
    assert torch.autograd.gradcheck(lambda x: token_log_probs(x, ids, chunk_size=1), (logits,))
    assert torch.autograd.gradcheck(
        lambda x: token_entropy(x.reshape(6, 5), chunk_size=5), (logits,)
    )


# --- low precision ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_float32(dtype: torch.dtype) -> None:
    # The logits are rounded to bf16/fp16 once; upcasting them is exact, so the float32 result
    # must match the float64 reference on the rounded logits at the *float32* tolerance (a bf16
    # or fp16 log-softmax would miss it by orders of magnitude). The gradient is returned in the
    # logits' dtype and is compared at that dtype's tolerance.
    logits, ids, mask = _case(11, 3, 17, 67, True, dtype)
    w = torch.randn(ids.shape, dtype=torch.float64)
    for fn, ref in (
        (
            lambda x: token_log_probs(x, ids, mask=mask, chunk_size=5),
            lambda x: reference.token_log_probs(x, ids, mask),
        ),
        (
            lambda x: token_entropy(x, mask=mask, chunk_size=5),
            lambda x: reference.token_entropy(x, mask),
        ),
    ):
        out, grad = _grad(fn, logits, w)
        ref_out, ref_grad = _grad(ref, logits.double(), w)
        assert out.dtype == torch.float32
        assert_close(out, ref_out)
        assert grad.dtype == dtype
        assert_close(grad, ref_grad)


def test_no_float32_copy_of_the_logits_is_saved_for_backward() -> None:
    batch, tokens, vocab = 2, 8, 64
    logits = torch.randn(batch, tokens, vocab).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, vocab, (batch, tokens))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_log_probs(logits, ids, chunk_size=3) + token_entropy(logits, chunk_size=3)
    out.sum().backward()
    big = [t for t in saved if t.numel() >= batch * tokens * vocab]
    assert big, "the logits themselves must be saved"
    for tensor in big:  # only the bf16 logits (a view of the input), never an upcast copy
        assert tensor.dtype == torch.bfloat16
        assert tensor.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    small = [t for t in saved if t.numel() < batch * tokens * vocab]
    assert all(t.numel() <= batch * tokens for t in small)


# --- masking and non-finite values --------------------------------------------------------------


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_in_masked_rows_do_not_leak(poison: float) -> None:
    logits, ids, mask = _case(5, 3, 6, 9, True, torch.float32)
    mask[0, 0], mask[2, 5] = False, False
    poisoned = torch.where(mask.unsqueeze(-1), logits, torch.full_like(logits, poison))
    bad_ids = torch.where(mask, ids, -100)  # padding ids outside [0, V) at masked positions
    w = torch.randn(ids.shape, dtype=torch.float64)
    for fn in (
        lambda x: token_log_probs(x, bad_ids, mask=mask, chunk_size=4),
        lambda x: token_entropy(x, mask=mask, chunk_size=4),
    ):
        out, grad = _grad(fn, poisoned, w)
        clean_out, clean_grad = _grad(fn, logits, w)
        assert torch.isfinite(out).all() and torch.isfinite(grad).all()
        assert (out[~mask] == 0).all() and (grad[~mask] == 0).all()
        torch.testing.assert_close(out, clean_out)
        torch.testing.assert_close(grad, clean_grad)


def test_rows_masked_downstream_get_zero_gradient_even_if_nan() -> None:
    # Without a mask argument a NaN row gives a NaN output, but a caller that masks it with
    # torch.where sends a zero upstream gradient, which must give an exact zero (not 0 * NaN).
    logits = torch.randn(4, 5)
    logits[1] = math.nan
    keep = torch.tensor([True, False, True, True])
    ids = torch.tensor([0, 1, 2, 3])
    for fn in (lambda x: token_log_probs(x, ids, chunk_size=3), lambda x: token_entropy(x)):
        x = logits.clone().requires_grad_(True)
        out = fn(x)
        assert torch.isnan(out[1])
        torch.where(keep, out, 0.0).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


def test_masked_equals_kept_rows_only() -> None:
    logits, ids, mask = _case(9, 2, 6, 5, True, torch.float64)
    out = token_log_probs(logits, ids, mask=mask, chunk_size=3)
    kept = token_log_probs(logits[mask], ids[mask], chunk_size=3)
    torch.testing.assert_close(out[mask], kept)
    assert (out[~mask] == 0).all()


def test_empty_inputs() -> None:
    logits = torch.zeros(0, 3, 4, requires_grad=True)
    ids = torch.zeros(0, 3, dtype=torch.int64)
    out = token_log_probs(logits, ids)
    assert out.shape == (0, 3)
    (out.sum() + token_entropy(logits).sum()).backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_inputs_are_not_mutated() -> None:
    logits, ids, mask = _case(2, 2, 3, 4, True, torch.float32)
    before = (logits.clone(), ids.clone(), mask.clone())
    token_log_probs(logits, ids, mask=mask, temperature=0.5, chunk_size=2)
    token_entropy(logits, mask=mask, temperature=0.5, chunk_size=2)
    for a, b in zip((logits, ids, mask), before, strict=True):
        assert torch.equal(a, b)


def test_accepts_lists() -> None:
    out = token_log_probs([[0.0, 0.0]], [1], mask=[1])
    assert_close(out, [math.log(0.5)])


# --- chunking helpers ---------------------------------------------------------------------------


def test_row_chunks_and_resolve_chunk_size() -> None:
    assert row_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert row_chunks(4, 4) == [(0, 4)]
    assert row_chunks(3, 10) == [(0, 3)]
    assert row_chunks(0, 3) == []
    assert resolve_chunk_size(None, row_width=32000) == DEFAULT_CHUNK_ELEMENTS // 32000
    assert resolve_chunk_size(None, row_width=DEFAULT_CHUNK_ELEMENTS * 4) == 1
    assert resolve_chunk_size(7, row_width=5) == 7


def test_chunk_math_helpers_match_autograd() -> None:
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 5, 2, 2])
    g = torch.randn(4, dtype=torch.float64)
    log_probs = chunk_token_log_probs(x, ids, dtype=torch.float64)
    (log_probs * g).sum().backward()
    assert x.grad is not None
    expected = chunk_token_log_probs_grad(x.detach(), ids, g, dtype=torch.float64)
    torch.testing.assert_close(expected, x.grad)
    x.grad = None
    entropy = -(torch.log_softmax(x, -1).exp() * torch.log_softmax(x, -1)).sum(-1)
    (entropy * g).sum().backward()
    helper_entropy = chunk_entropy(x.detach(), dtype=torch.float64)
    torch.testing.assert_close(helper_entropy, entropy.detach())
    torch.testing.assert_close(
        chunk_entropy_grad(x.detach(), helper_entropy, g, dtype=torch.float64), x.grad
    )
    # bf16 chunk: the upcast is fused into the float32 (log_)softmax.
    chunk = torch.randn(3, 7).to(torch.bfloat16)
    out = chunk_token_log_probs(chunk, ids[:3])
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out, torch.log_softmax(chunk.float(), -1).gather(-1, ids[:3, None])[:, 0]
    )


# --- errors -------------------------------------------------------------------------------------


def test_errors() -> None:
    logits = torch.zeros(2, 3, 4)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        token_log_probs(logits, ids, temperature=0.0)
    with pytest.raises(ValueError, match=r"temperature must be finite"):
        token_entropy(logits, temperature=math.inf)
    with pytest.raises(TypeError, match=r"temperature must be a real number"):
        token_log_probs(logits, ids, temperature=torch.tensor(1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1.*got 0"):
        token_log_probs(logits, ids, chunk_size=0)
    with pytest.raises(TypeError, match=r"chunk_size must be a positive int.*float"):
        token_entropy(logits, chunk_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"logits must have shape \(B, T, V\) or \(N, V\), got shape \(4,\)"
    ):
        token_log_probs(torch.zeros(4), torch.zeros((), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"vocabulary dimension V >= 1"):
        token_entropy(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"tokens must have shape \(2, 3\).*got shape \(3, 2\)"):
        token_log_probs(logits, ids.T)
    with pytest.raises(TypeError, match=r"tokens must be an integer tensor.*float32"):
        token_log_probs(logits, ids.float())
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\).*got shape \(2,\)"):
        token_entropy(logits, mask=torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"logits must contain only numbers"):
        token_entropy([["a"]])


# --- torch.compile ------------------------------------------------------------------------------


@pytest.mark.compile
def test_compiles_and_matches_eager() -> None:
    from rlobjectives import full_vocab_kl

    logits = torch.randn(2, 5, 7)
    ref_logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.rand(2, 5) < 0.7

    def objective(x: torch.Tensor) -> torch.Tensor:
        log_probs = token_log_probs(x, ids, mask=mask, temperature=0.9, chunk_size=3)
        entropy = token_entropy(x, mask=mask, chunk_size=4)
        kl = full_vocab_kl(x, ref_logits, mask=mask, chunk_size=3)
        return (log_probs + 0.1 * entropy + 0.5 * kl).sum()

    compiled = torch.compile(objective, fullgraph=True)
    x_eager = logits.clone().requires_grad_(True)
    x_compiled = logits.clone().requires_grad_(True)
    eager = objective(x_eager)
    eager.backward()
    result = compiled(x_compiled)
    result.backward()
    torch.testing.assert_close(result, eager)
    torch.testing.assert_close(x_compiled.grad, x_eager.grad)
