"""Tests of token_log_probs_from_hidden and fused_policy_loss_from_hidden (issue 7).

Every result is compared with the float64 loop references in tests/reference.py (outputs and
gradients) and with the naive path ``hidden @ weight.T -> log_softmax -> gather -> policy_loss``.
The reference comparisons, NaN, dtype and golden tests also run on the Triton LM-head kernels
(the ``backend`` fixture, ``tests/backends.py``; float64 cases in float32 there, since float64
always takes PyTorch, and ``chunk_size`` does not apply to the kernels).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import reference
import rlobjectives
from backends import FIXTURE_HEALTH, dtype_for, triton_param
from family_cases import FAMILY_OPTION_SETS
from rlobjectives import CISPO, Clip, kl_loss, policy_loss
from rlobjectives.kl.estimators import BiasedGradientWarning
from rlobjectives.logprobs import saved_logits
from rlobjectives.logprobs.head import HEAD_BUDGET, chunk_row_bytes
from rlobjectives.logprobs.hidden import (
    TokenLogProbsOutput,
    default_chunk_size,
    token_log_probs_from_hidden,
)
from rlobjectives.policy.from_hidden import FusedPolicyLossOutput, fused_policy_loss_from_hidden
from tolerances import assert_close

REDUCTIONS = ["token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none"]


def make_case(
    batch: int,
    steps: int,
    hidden_size: int,
    vocab: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    with_bias: bool = True,
    keep: float = 0.7,
) -> dict[str, Any]:
    """Random inputs; old/ref log-probs near the current ones (clipping both binds and not)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    hidden = randn(batch, steps, hidden_size)
    weight = randn(vocab, hidden_size, scale=0.5)
    bias = randn(vocab, scale=0.5) if with_bias else None
    tokens = torch.randint(0, vocab, (batch, steps), generator=generator)
    mask = torch.rand(batch, steps, generator=generator) < keep
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        if bias is not None:
            logits = logits + bias.double()
        log_probs = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old = log_probs + 0.3 * torch.randn(batch, steps, generator=generator, dtype=torch.float64)
    ref = log_probs + 0.3 * torch.randn(batch, steps, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    return {
        "hidden": hidden,
        "weight": weight,
        "bias": bias,
        "tokens": tokens,
        "mask": mask,
        "old_log_probs": old,
        "ref_log_probs": ref,
        "advantages": advantages,
    }


def leaves(case: dict[str, Any]) -> list[torch.Tensor]:
    """Fresh differentiable copies of hidden, weight (and bias)."""
    names = ["hidden", "weight"] + (["bias"] if case["bias"] is not None else [])
    return [case[name].detach().clone().requires_grad_(True) for name in names]


def grads(loss: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Gradients of ``loss.sum()``; zeros when it does not depend on the inputs at all."""
    if not loss.requires_grad:  # e.g. a reference over a fully masked batch: a constant 0
        return tuple(torch.zeros_like(tensor) for tensor in inputs)
    return torch.autograd.grad(loss.sum(), inputs, allow_unused=True, materialize_grads=True)


def naive_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The unfused path the fused functions must reproduce."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def finite_difference_check(
    function: Any, inputs: list[torch.Tensor], eps: float = 1e-6, tol: float = 1e-6
) -> None:
    """Central differences against one analytical backward (float64).

    ``torch.autograd.gradcheck`` needs several backward passes through one graph, which the fused
    loss deliberately does not support (its gradients are formed in forward and handed over in
    backward without a copy), so the same check is written out here.
    """
    analytical = grads(function(*inputs), inputs)
    for tensor, grad in zip(inputs, analytical, strict=True):
        numerical = torch.zeros_like(tensor)
        flat, flat_numerical = tensor.detach().view(-1), numerical.view(-1)
        for k in range(flat.numel()):
            original = float(flat[k])
            with torch.no_grad():
                flat[k] = original + eps
                plus = float(function(*inputs).sum())
                flat[k] = original - eps
                minus = float(function(*inputs).sum())
                flat[k] = original
            flat_numerical[k] = (plus - minus) / (2 * eps)
        torch.testing.assert_close(grad, numerical, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# token_log_probs_from_hidden
# --------------------------------------------------------------------------------------------


def test_golden_uniform_and_temperature(backend: str) -> None:
    # Zero hidden states: every logit is 0, so p = 1/V and log p = -log 4 = -1.3862944 for V = 4,
    # at any temperature; the entropy is log 4.
    hidden, weight = torch.zeros(1, 2, 3), torch.randn(4, 3)
    out = token_log_probs_from_hidden(
        hidden, weight, torch.tensor([[0, 3]]), temperature=0.5, return_entropy=True
    )
    assert isinstance(out, TokenLogProbsOutput)
    assert_close(out.log_probs, [[-math.log(4), -math.log(4)]])
    assert_close(out.entropy, [[math.log(4), math.log(4)]])
    # One hidden unit, weight rows (0, 1, 2): logits (0, h, 2h) with h = 1 and tau = 2 give
    # scores (0, .5, 1): log p(token 2) = 1 - log(1 + e^.5 + e^1) = 1 - log(5.367003) = -0.680292.
    lp = token_log_probs_from_hidden(
        torch.ones(1, 1, 1), torch.tensor([[0.0], [1.0], [2.0]]), [[2]], temperature=2.0
    )
    assert_close(lp, [[1 - math.log(1 + math.exp(0.5) + math.e)]])


@FIXTURE_HEALTH
@given(
    batch=st.integers(1, 3),
    steps=st.integers(1, 4),
    hidden_size=st.integers(1, 5),
    vocab=st.integers(1, 7),
    chunk_size=st.integers(1, 13),
    temperature=st.sampled_from([1.0, 0.7, 1.9]),
    with_bias=st.booleans(),
    with_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_log_probs_match_reference(
    backend: str,
    batch: int,
    steps: int,
    hidden_size: int,
    vocab: int,
    chunk_size: int,
    temperature: float,
    with_bias: bool,
    with_mask: bool,
    seed: int,
) -> None:
    dtype = dtype_for(backend)
    case = make_case(batch, steps, hidden_size, vocab, seed=seed, with_bias=with_bias, dtype=dtype)
    mask = case["mask"] if with_mask else None
    inputs = leaves(case)
    bias = inputs[2] if with_bias else None
    out = token_log_probs_from_hidden(
        inputs[0],
        inputs[1],
        case["tokens"],
        bias=bias,
        temperature=temperature,
        chunk_size=chunk_size,
        mask=mask,
        return_entropy=True,
    )
    ref_inputs = [x.double() for x in leaves(case)]
    expected = reference.token_log_probs_from_hidden(
        ref_inputs[0],
        ref_inputs[1],
        case["tokens"],
        bias=ref_inputs[2] if with_bias else None,
        temperature=temperature,
        mask=mask,
    )
    assert out.log_probs.dtype == dtype
    assert_close(out.log_probs, expected[0])
    assert_close(out.entropy, expected[1])
    # Mixed upstream gradients for both outputs.
    weights = torch.randn(2, batch, steps, dtype=torch.float64).to(dtype)
    actual = grads((out.log_probs * weights[0] + out.entropy * weights[1]).sum(), inputs)
    weights = weights.double()
    wanted = grads((expected[0] * weights[0] + expected[1] * weights[1]).sum(), ref_inputs)
    for a, e in zip(actual, wanted, strict=True):
        assert_close(a, e)


def test_log_probs_gradcheck_float64() -> None:
    case = make_case(2, 3, 4, 5, seed=1)
    tokens, mask = case["tokens"], case["mask"]

    def function(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = token_log_probs_from_hidden(
            inputs[0],
            inputs[1],
            tokens,
            bias=inputs[2],
            temperature=0.8,
            chunk_size=4,  # does not divide N = 6
            return_entropy=True,
        )
        masked = token_log_probs_from_hidden(
            inputs[0], inputs[1], tokens, bias=inputs[2], chunk_size=5, mask=mask
        )
        return out.log_probs, out.entropy, masked

    assert torch.autograd.gradcheck(function, tuple(leaves(case)))


CHUNK_CASES = [
    *(pytest.param("torch", chunk) for chunk in (1, 2, 5, 7, 64, None)),
    triton_param(None),  # the kernels size their own tiles: one case
]


@pytest.mark.parametrize(("backend", "chunk_size"), CHUNK_CASES, indirect=["backend"])
def test_log_probs_match_naive_float32_any_chunk(backend: str, chunk_size: int | None) -> None:
    case = make_case(3, 7, 16, 33, seed=2, dtype=torch.float32)  # N = 21 rows
    inputs, naive_inputs = leaves(case), leaves(case)
    tokens = case["tokens"]
    actual = token_log_probs_from_hidden(
        inputs[0], inputs[1], tokens, bias=inputs[2], temperature=0.9, chunk_size=chunk_size
    )
    expected = naive_log_probs(*naive_inputs[:2], tokens, naive_inputs[2], 0.9)
    assert actual.dtype == torch.float32
    assert_close(actual, expected.detach().double())
    upstream = torch.randn(3, 7)
    for a, e in zip(
        grads(actual * upstream, inputs), grads(expected * upstream, naive_inputs), strict=True
    ):
        assert_close(a, e.double())


def test_default_chunk_size() -> None:
    # The budget (HEAD_BUDGET): at most N // 16 rows and 2**26 bytes of buffers (float32 scores,
    # plus the low-precision copy), at least 256 rows, at most N.
    assert default_chunk_size(32000, 4096) == 4096 // 16 == 256  # the issue-17 shape: 32 MiB
    assert default_chunk_size(32000, 8192) == 8192 // 16 == 512
    assert default_chunk_size(32000, 10**6) == 2**26 // (4 * 32000) == 524  # 64 MiB ceiling
    assert default_chunk_size(32000, 10**6, torch.bfloat16) == 2**26 // (6 * 32000) == 349
    assert default_chunk_size(32000, 10**6, torch.float64) == 2**26 // (8 * 32000) == 262
    assert default_chunk_size(128000, 10**6) == default_chunk_size(2**30, 10**6) == 256  # floor
    assert default_chunk_size(32000, 1000) == 256  # floor wins over N // 16
    assert default_chunk_size(32000, 100) == 100  # never more than N
    assert default_chunk_size(32000, 0) == 1
    assert default_chunk_size(0, 10**6) == 10**6 // 16


@given(
    vocab=st.integers(1, 2**20),
    rows=st.integers(0, 2**20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_default_chunk_size_fits_the_budget(vocab: int, rows: int, dtype: torch.dtype) -> None:
    chunk = default_chunk_size(vocab, rows, dtype)
    row_bytes = chunk_row_bytes(vocab, dtype)
    assert 1 <= chunk <= max(rows, 1)
    if chunk > HEAD_BUDGET.min_rows:  # above the floor: both bounds hold, and one binds
        assert chunk <= rows * HEAD_BUDGET.fraction and chunk * row_bytes <= HEAD_BUDGET.max_bytes
        assert (chunk + 1) > rows * HEAD_BUDGET.fraction or (
            chunk + 1
        ) * row_bytes > HEAD_BUDGET.max_bytes
    else:
        assert chunk == min(HEAD_BUDGET.min_rows, max(rows, 1))


class _LargeAllocations(TorchDispatchMode):
    """Counts the op results of at least ``numel`` elements that are fresh allocations.

    A result counts when its storage is none of the op's tensor arguments' (``out=`` and
    in-place results, and views, do not).
    """

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        arguments = [*args, *kwargs.values()]
        inputs = {t.untyped_storage().data_ptr() for t in arguments if isinstance(t, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.numel:
                self.count += tensor.untyped_storage().data_ptr() not in inputs
        return out


@pytest.mark.parametrize("fp32_head", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_one_chunk_buffer_per_pass(
    dtype: torch.dtype, entropy_coef: float, fp32_head: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every chunk reuses the pass's ``(chunk, V)`` buffers: no per-chunk ``(n, V)`` temporary.

    N = 96 rows in 3 chunks of 32; a ``(16, V)`` block is half a chunk, larger than the
    entropy's scratch (8 rows at V = 16384) and than the weight and its gradient ``(V, 8)``.
    The log-probabilities keep the logits of the chunks within ``SAVED_LOGITS`` for the
    backward pass (one buffer, here all the rows: then, with the product formed at once, there
    is no chunk block at all); with ``SAVED_LOGITS = 0`` they recompute every chunk.
    """
    vocab, chunk = 16384, 32
    case = make_case(2, 48, 8, vocab, seed=5, dtype=dtype)
    inputs = leaves(case)
    common = {k: case[k] for k in ("tokens", "mask")}
    common |= {k: case[k].float() for k in ("old_log_probs", "advantages")}  # float32 loss
    low = dtype != torch.float32 and not fp32_head  # the product rounded in its own buffer
    with _LargeAllocations(16 * vocab) as fused:
        out = fused_policy_loss_from_hidden(
            *inputs[:2], bias=inputs[2], **common, chunk_size=chunk, entropy_coef=entropy_coef,
            fp32_head=fp32_head,
        )  # fmt: skip
        out.loss.backward()
    assert fused.count == 1 + low  # the scores (and the low-precision product)
    for budget, saved in ((saved_logits.SAVED_LOGITS, 1), (0, 0)):
        monkeypatch.setattr(saved_logits, "SAVED_LOGITS", budget)
        with _LargeAllocations(16 * vocab) as recompute:
            log_probs, entropy = token_log_probs_from_hidden(
                *inputs[:2], case["tokens"], bias=inputs[2], chunk_size=chunk,
                return_entropy=True, fp32_head=fp32_head,
            )  # fmt: skip
            (log_probs.sum() + entropy.sum()).backward()
        # the saved logits alone, or the chunk blocks in forward and in backward (and those)
        assert recompute.count == (1 if saved and not low else 2 * (1 + low) + saved)


def assert_bf16_gradient(
    actual: torch.Tensor, naive: torch.Tensor, expected: torch.Tensor, name: str
) -> None:
    """bf16 gradient check, tolerance loosened with a reason.

    The bf16 product ``hidden @ weight.T`` rounds every logit to 8 mantissa bits, and the
    gradients are cancelling sums over V (grad_hidden) or N (grad_weight) of terms of size ~1, so
    their absolute error is ~ sqrt(V or N) * 2**-8 rather than one output rounding: the bf16 row of
    the tolerance table does not bound it. What the fused function must guarantee is that it is
    no less accurate than the unfused bf16 path it replaces (same rounded logits, float32
    accumulation of grad_weight instead of a bf16 product), and within 4x the table's atol.
    """
    assert actual.dtype == torch.bfloat16, name
    error = (actual.double() - expected).abs().max()
    naive_error = (naive.double() - expected).abs().max()
    assert error <= 1.25 * naive_error + 2**-9, (name, float(error), float(naive_error))
    rtol, atol = 1.6e-2, 4 * 8e-3
    torch.testing.assert_close(actual.double(), expected.detach(), rtol=rtol, atol=atol)


def test_log_probs_bfloat16_within_tolerance(backend: str) -> None:
    case = make_case(2, 5, 16, 40, seed=3, dtype=torch.bfloat16)
    inputs, naive_inputs = leaves(case), leaves(case)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in leaves(case)]
    out = token_log_probs_from_hidden(
        inputs[0], inputs[1], case["tokens"], bias=inputs[2], chunk_size=3, return_entropy=True
    )
    assert out.log_probs.dtype == torch.float32  # widened, not rounded back to bf16
    expected = reference.token_log_probs_from_hidden(
        ref_inputs[0], ref_inputs[1], case["tokens"], bias=ref_inputs[2]
    )
    # One rounding of each logit to bf16 (as hidden @ weight.T does): bf16 tolerance.
    assert_close(out.log_probs, expected[0], dtype=torch.bfloat16)
    assert_close(out.entropy, expected[1], dtype=torch.bfloat16)
    naive = naive_log_probs(naive_inputs[0], naive_inputs[1], case["tokens"], naive_inputs[2])
    actual = grads(out.log_probs, inputs)
    wanted = grads(expected[0], ref_inputs)
    unfused = grads(naive, naive_inputs)
    for name, a, n, e in zip(("hidden", "weight", "bias"), actual, unfused, wanted, strict=True):
        assert_bf16_gradient(a, n, e, name)
    # Entropy gradient as well (no unfused entropy-from-hidden path to compare with).
    inputs = leaves(case)
    out2 = token_log_probs_from_hidden(
        inputs[0], inputs[1], case["tokens"], bias=inputs[2], chunk_size=3, return_entropy=True
    )
    ref_inputs = [t.detach().double().requires_grad_(True) for t in leaves(case)]
    expected_entropy = reference.token_log_probs_from_hidden(
        ref_inputs[0], ref_inputs[1], case["tokens"], bias=ref_inputs[2]
    )[1]
    for a, e in zip(grads(out2.entropy, inputs), grads(expected_entropy, ref_inputs), strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1.6e-2, atol=4 * 8e-3)


def test_bfloat16_weight_gradient_accumulates_in_float32(backend: str) -> None:
    # Zero weights, V = 3: p = 1/3 at every row; all tokens are 0 and hidden = 1, so
    # grad_weight[0] = N (1 - 1/3) = 341.33 and grad_weight[1] = -N / 3 = -170.67 (N = 512).
    # Summed over 256 chunks in bf16 (ulp 2 above 256), the +1.33 per chunk would stall; the
    # float32 accumulator gives the exact sum, rounded once to bf16 (342, -170).
    hidden = torch.ones(1, 512, 2, dtype=torch.bfloat16)
    weight = torch.zeros(3, 2, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.zeros(1, 512, dtype=torch.int64)
    token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=2).sum().backward()
    assert weight.grad is not None
    expected = torch.tensor([[512 * 2 / 3] * 2, [-512 / 3] * 2, [-512 / 3] * 2])
    assert_close(weight.grad, expected)


def test_log_probs_nan_at_masked_positions_and_bad_ids(backend: str) -> None:
    case = make_case(3, 4, 5, 6, seed=5, dtype=dtype_for(backend))
    mask = case["mask"].clone()
    mask[0, 0], mask[1, 1] = False, True
    dirty = case["hidden"].clone()
    dirty[~mask] = float("nan")
    dirty[0, 0, 0] = float("inf")
    tokens = torch.where(mask, case["tokens"], torch.full_like(case["tokens"], -100))
    clean = leaves(case)
    poisoned = [dirty.requires_grad_(True), *leaves(case)[1:]]
    results = []
    for inputs in (clean, poisoned):
        out = token_log_probs_from_hidden(
            inputs[0], inputs[1], tokens, bias=inputs[2], mask=mask, chunk_size=5,
            return_entropy=True,
        )  # fmt: skip
        results.append((out, grads(out.log_probs + 2 * out.entropy, inputs)))
    (clean_out, clean_grads), (dirty_out, dirty_grads) = results
    assert torch.equal(dirty_out.log_probs, clean_out.log_probs)
    assert torch.equal(dirty_out.entropy, clean_out.entropy)
    assert (dirty_out.log_probs[~mask] == 0).all()
    for a, e in zip(dirty_grads, clean_grads, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, e)
    assert (dirty_grads[0][~mask] == 0).all()


def test_log_probs_nan_rows_without_gradient_do_not_poison_weight_grad(backend: str) -> None:
    # No mask given: a NaN hidden row gives a NaN log-prob, but if the caller selects it away
    # (its upstream gradient is 0) the weight gradient stays finite.
    case = make_case(2, 3, 4, 5, seed=6, with_bias=False, dtype=dtype_for(backend))
    hidden = case["hidden"].clone()
    hidden[1, 2] = float("nan")
    weight = case["weight"].clone().requires_grad_(True)
    lp = token_log_probs_from_hidden(hidden, weight, case["tokens"], chunk_size=2)
    assert torch.isnan(lp[1, 2])
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    torch.where(keep, lp, 0.0).sum().backward()
    weight64 = case["weight"].clone().requires_grad_(True)
    expected = naive_log_probs(case["hidden"], weight64, case["tokens"])
    torch.where(keep, expected, 0.0).sum().backward()
    assert weight.grad is not None and weight64.grad is not None
    assert_close(weight.grad, weight64.grad)


def test_log_probs_noncontiguous_and_empty(backend: str) -> None:
    dtype = dtype_for(backend)
    case = make_case(3, 4, 5, 6, seed=7, dtype=dtype)
    transposed = case["hidden"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not transposed.is_contiguous()
    expected = token_log_probs_from_hidden(case["hidden"], case["weight"], case["tokens"])
    actual = token_log_probs_from_hidden(transposed, case["weight"], case["tokens"])
    assert_close(actual, expected)
    empty_hidden = torch.zeros(0, 3, 5, dtype=dtype)
    empty = token_log_probs_from_hidden(empty_hidden, case["weight"], torch.zeros(0, 3).long())
    assert empty.shape == (0, 3)


def test_log_probs_does_not_mutate_inputs(backend: str) -> None:
    case = make_case(2, 3, 4, 5, seed=8, dtype=dtype_for(backend))
    snapshot = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    inputs = leaves(case)
    out = token_log_probs_from_hidden(inputs[0], inputs[1], case["tokens"], bias=inputs[2])
    out.sum().backward()
    for name, value in snapshot.items():
        assert torch.equal(case[name], value), name


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden": torch.zeros(2, 3)}, ValueError, r"hidden must have shape \(B, T, H\)"),
        ({"hidden": torch.zeros(1, 2, 3, dtype=torch.int64)}, TypeError, "hidden must be a float"),
        ({"weight": torch.zeros(4, 2)}, ValueError, r"weight must have shape \(V, H\) with H = 3"),
        ({"weight": torch.zeros(4, 3, dtype=torch.float64)}, ValueError, "dtype of hidden"),
        ({"tokens": torch.zeros(1, 2)}, TypeError, "tokens must be an integer tensor"),
        ({"tokens": torch.zeros(1, 3, dtype=torch.int64)}, ValueError, "tokens must have the sam"),
        ({"bias": torch.zeros(3)}, ValueError, r"bias must have shape \(4,\)"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size must be a positive int"),
        ({"mask": torch.ones(2, 2)}, ValueError, "mask must have the same shape"),
    ],
)
def test_log_probs_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    arguments: dict[str, Any] = {
        "hidden": torch.zeros(1, 2, 3),
        "weight": torch.zeros(4, 3),
        "tokens": torch.zeros(1, 2, dtype=torch.int64),
        **kwargs,
    }
    hidden, weight, tokens = (
        arguments.pop("hidden"),
        arguments.pop("weight"),
        arguments.pop("tokens"),
    )
    with pytest.raises(error, match=match):
        token_log_probs_from_hidden(hidden, weight, tokens, **arguments)


@pytest.mark.compile
def test_log_probs_under_torch_compile() -> None:
    case = make_case(2, 3, 4, 5, seed=9, dtype=torch.float32)
    inputs, eager_inputs = leaves(case), leaves(case)

    def function(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return token_log_probs_from_hidden(hidden, weight, case["tokens"], bias=bias, chunk_size=4)

    compiled = torch.compile(function, backend="aot_eager")
    actual = compiled(*inputs)
    expected = function(*eager_inputs)
    assert_close(actual, expected.detach().double())
    for a, e in zip(grads(actual, inputs), grads(expected, eager_inputs), strict=True):
        assert_close(a, e.double())


# --------------------------------------------------------------------------------------------
# fused_policy_loss_from_hidden
# --------------------------------------------------------------------------------------------


def fused_and_reference(
    case: dict[str, Any], **options: Any
) -> tuple[FusedPolicyLossOutput, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The library's result and the float64 reference's (on float64 copies of the inputs)."""
    inputs = leaves(case)
    ref_inputs = [x.detach().double().requires_grad_(True) for x in inputs]
    with_bias = case["bias"] is not None
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}
    ref_log_probs = options.pop("ref_log_probs", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BiasedGradientWarning)
        out = fused_policy_loss_from_hidden(
            inputs[0],
            inputs[1],
            bias=inputs[2] if with_bias else None,
            ref_log_probs=ref_log_probs,
            **common,
            **options,
        )
    options.pop("chunk_size", None)
    options.pop("diagnostics_normalizer", None)
    if options.get("importance_weights") is not None:
        options["importance_weights"] = options["importance_weights"].double()
    expected = reference.fused_policy_loss_from_hidden(
        ref_inputs[0],
        ref_inputs[1],
        bias=ref_inputs[2] if with_bias else None,
        ref_log_probs=ref_log_probs,
        **common,
        **options,
    )
    return out, expected, inputs, ref_inputs


@FIXTURE_HEALTH
@given(
    batch=st.integers(1, 3),
    steps=st.integers(1, 4),
    vocab=st.integers(1, 6),
    chunk_size=st.integers(1, 9),
    reduction=st.sampled_from(REDUCTIONS),
    explicit_normalizer=st.booleans(),
    kl=st.sampled_from([None, "k1", "k2", "k3", "k3+"]),
    clip=st.sampled_from(
        ["symmetric", "asymmetric", "dual", "none", "delta", "cispo", "cispo_cap", "sapo"]
    ),
    temperature=st.sampled_from([1.0, 0.6]),
    seed=st.integers(0, 2**16),
    weights=st.sampled_from([None, "token", "sequence"]),
    entropy_coef=st.sampled_from([0.0, 0.0, 0.2]),
)
def test_fused_matches_reference(
    backend: str,
    batch: int,
    steps: int,
    vocab: int,
    chunk_size: int,
    reduction: str,
    explicit_normalizer: bool,
    kl: str | None,
    clip: str,
    temperature: float,
    seed: int,
    weights: str | None,
    entropy_coef: float,
) -> None:
    dtype = dtype_for(backend)
    case = make_case(batch, steps, 3, vocab, seed=seed, with_bias=seed % 2 == 0, dtype=dtype)
    options: dict[str, Any] = {
        "symmetric": {"surrogate": Clip(low=0.2)},
        "asymmetric": {"surrogate": Clip(low=0.1, high=0.28)},
        "dual": {"surrogate": Clip(low=0.2, dual=2.0)},
        "none": {"surrogate": Clip(low=None)},
        "delta": {"surrogate": Clip(low=0.2, delta=1.1)},
        "cispo": {"surrogate": "cispo"},
        "cispo_cap": {"surrogate": CISPO(cap=1.1)},
        "sapo": {"surrogate": "sapo"},
    }[clip]
    if weights is not None:  # constants: a NaN at an unselected token must reach nothing
        shape = (batch, steps) if weights == "token" else (batch, 1)
        importance = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2
        options["importance_weights"] = importance.to(dtype).masked_fill(
            ~case["mask"] if weights == "token" else torch.zeros(shape, dtype=torch.bool),
            math.nan,
        )
    options["entropy_coef"] = entropy_coef
    options.update(reduction=reduction, temperature=temperature, chunk_size=chunk_size)
    if explicit_normalizer and reduction != "none":
        options["normalizer"] = 7.0
    if reduction == "sequence_sum_normalized" and seed % 3 == 0:
        options["max_response_length"] = 9
    if kl is not None:
        options.update(
            ref_log_probs=case["ref_log_probs"],
            kl_coef=0.3,
            kl_estimator=kl[:2],
            kl_straight_through=kl.endswith("+"),
        )
    out, expected, inputs, ref_inputs = fused_and_reference(case, **options)
    assert out.loss.dtype == dtype
    assert_close(out.loss, expected)
    upstream = torch.randn(out.loss.shape, dtype=torch.float64)  # scalar, or (B, T) for "none"
    actual_grads = grads(out.loss * upstream.to(dtype), inputs)
    expected_grads = grads(expected * upstream, ref_inputs)
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert_close(a, e)


FAMILY_REDUCTIONS = ("token_mean", "sequence_mean", "length_weighted")


def _family_cases() -> list[Any]:
    """PyTorch: every family row x reduction; kernels: every row (GMPO and VESPO compose the
    Triton log-probabilities with the PyTorch loss), the reductions in turn."""
    cases = [
        pytest.param("torch", options, reduction, id=f"torch-{reduction}-{options!r}")
        for reduction in FAMILY_REDUCTIONS
        for options in FAMILY_OPTION_SETS
    ]
    for index, options in enumerate(FAMILY_OPTION_SETS):
        reduction = FAMILY_REDUCTIONS[index % 3]
        cases.append(triton_param(options, reduction, id=f"triton-{reduction}-{options!r}"))
    return cases


@pytest.mark.parametrize(("backend", "options", "reduction"), _family_cases(), indirect=["backend"])
def test_family_matches_reference(backend: str, options: dict[str, Any], reduction: str) -> None:
    # Every surrogate of the family from hidden states, with token importance weights and the
    # entropy bonus: the token-local ones through the fused chunk loop (the entropy and its
    # gradient formed chunk by chunk), GSPO-level, GMPO and VESPO by composition.
    dtype = dtype_for(backend)
    case = make_case(3, 4, 3, 5, seed=23, dtype=dtype)
    weights = torch.rand(3, 4, generator=torch.Generator().manual_seed(1), dtype=dtype)
    out, expected, inputs, ref_inputs = fused_and_reference(
        case, **options, reduction=reduction, chunk_size=5, importance_weights=weights,
        entropy_coef=0.15,
    )  # fmt: skip
    assert_close(out.loss, expected)
    for a, e in zip(grads(out.loss, inputs), grads(expected, ref_inputs), strict=True):
        assert_close(a, e)
    # the parts: the surrogate without the bonus, and the reduced entropy
    bias = None if case["bias"] is None else case["bias"].double()
    log_probs, entropy = reference.token_log_probs_from_hidden(
        *(t.detach() for t in ref_inputs[:2]), case["tokens"], bias=bias, mask=case["mask"]
    )
    policy = reference.policy_loss(
        log_probs, case["old_log_probs"], case["advantages"], case["mask"], reduction=reduction,
        importance_weights=weights.double(), **options,
    )  # fmt: skip
    entropy_loss = reference.reduce_losses(
        {(i, t): entropy[i, t] for i, t in case["mask"].nonzero().tolist()},
        (3, 4),
        reduction=reduction,
    )
    assert_close(out.policy_loss, policy)
    assert_close(out.entropy_loss, entropy_loss)
    assert_close(out.loss, policy - 0.15 * entropy_loss)


def test_fused_entropy_bonus_float32_and_bfloat16(backend: str) -> None:
    # The chunked entropy bonus against the naive path (full logits, autograd) in float32, and
    # against the float64 reference for bfloat16 inputs (computed in float32).
    case = make_case(3, 6, 8, 31, seed=24, dtype=torch.float32)
    inputs, naive_inputs = leaves(case), leaves(case)
    common = {k: case[k] for k in ("old_log_probs", "advantages", "mask")}
    out = fused_policy_loss_from_hidden(
        inputs[0], inputs[1], case["tokens"], **common, bias=inputs[2], chunk_size=4,
        surrogate=CISPO(cap=2.0), entropy_coef=0.3, reduction="sequence_mean",
    )  # fmt: skip
    logits = naive_inputs[0] @ naive_inputs[1].T + naive_inputs[2]
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, case["tokens"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    expected = policy_loss(
        log_probs, **common, surrogate=CISPO(cap=2.0), entropy=entropy,
        entropy_coef=0.3, reduction="sequence_mean",
    )  # fmt: skip
    assert_close(out.loss, expected.loss.detach().double())
    for a, e in zip(grads(out.loss, inputs), grads(expected.loss, naive_inputs), strict=True):
        assert_close(a, e.double())
    # bfloat16 hidden states and head, computed in float32
    low = make_case(2, 5, 16, 40, seed=25, dtype=torch.bfloat16)
    low_inputs = leaves(low)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in leaves(low)]
    low_common = {k: low[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}
    low_out = fused_policy_loss_from_hidden(
        low_inputs[0], low_inputs[1], bias=low_inputs[2], **low_common, chunk_size=3,
        surrogate="sapo", entropy_coef=0.2,
    )  # fmt: skip
    wanted = reference.fused_policy_loss_from_hidden(
        ref_inputs[0], ref_inputs[1], bias=ref_inputs[2], **low_common, surrogate="sapo",
        entropy_coef=0.2,
    )  # fmt: skip
    assert low_out.loss.dtype == torch.float32
    assert_close(low_out.loss, wanted, dtype=torch.bfloat16)


def test_fused_entropy_masked_nan_rows_reach_nothing(backend: str) -> None:
    case = make_case(3, 4, 5, 6, seed=26, dtype=dtype_for(backend))
    mask = case["mask"]
    dirty = case["hidden"].clone()
    dirty[~mask] = float("nan")
    options = {"entropy_coef": 0.4, "chunk_size": 3, "surrogate": "sapo"}
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}
    clean = leaves(case)
    clean_out = fused_policy_loss_from_hidden(
        clean[0], clean[1], bias=clean[2], **common, **options
    )
    dirty_inputs = [dirty.requires_grad_(True), *leaves(case)[1:]]
    dirty_out = fused_policy_loss_from_hidden(
        dirty_inputs[0], dirty_inputs[1], bias=dirty_inputs[2], **common, **options
    )
    assert torch.equal(dirty_out.loss.detach(), clean_out.loss.detach())
    assert torch.equal(dirty_out.entropy_loss, clean_out.entropy_loss)
    for a, e in zip(grads(dirty_out.loss, dirty_inputs), grads(clean_out.loss, clean), strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, e)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_fused_finite_differences_float64(reduction: str) -> None:
    case = make_case(2, 3, 3, 5, seed=10)
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}

    def function(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return fused_policy_loss_from_hidden(
            hidden,
            weight,
            bias=bias,
            **common,
            surrogate=Clip(low=0.2, dual=3.0),
            temperature=0.8,
            chunk_size=4,
            reduction=reduction,
            ref_log_probs=case["ref_log_probs"],
            kl_coef=0.2,
            kl_estimator="k2",
            entropy_coef=0.3,
        ).loss

    finite_difference_check(function, leaves(case))


def test_fused_gradcheck_unfused_paths() -> None:
    # reduction="none" and ratio_level="sequence" compose the chunked log-probs with policy_loss.
    case = make_case(2, 3, 3, 5, seed=11)
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}

    def function(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        none = fused_policy_loss_from_hidden(
            inputs[0], inputs[1], bias=inputs[2], **common, reduction="none", chunk_size=4
        ).loss
        gspo = fused_policy_loss_from_hidden(
            inputs[0], inputs[1], bias=inputs[2], **common, ratio_level="sequence", chunk_size=4,
            reduction="sequence_mean",
        ).loss  # fmt: skip
        return none, gspo

    assert torch.autograd.gradcheck(function, tuple(leaves(case)))


def test_fused_gspo_matches_policy_loss(backend: str) -> None:
    case = make_case(3, 4, 3, 5, seed=12, dtype=torch.float32)
    inputs, naive_inputs = leaves(case), leaves(case)
    common = {k: case[k] for k in ("old_log_probs", "advantages", "mask")}
    out = fused_policy_loss_from_hidden(
        inputs[0], inputs[1], case["tokens"], **common, bias=inputs[2], ratio_level="sequence",
        reduction="sequence_mean", chunk_size=5,
    )  # fmt: skip
    log_probs = naive_log_probs(*naive_inputs[:2], case["tokens"], naive_inputs[2])
    expected = policy_loss(log_probs, **common, ratio_level="sequence", reduction="sequence_mean")
    assert_close(out.loss, expected.loss.detach().double())
    for a, e in zip(grads(out.loss, inputs), grads(expected.loss, naive_inputs), strict=True):
        assert_close(a, e.double())


@pytest.mark.parametrize(
    ("backend", "chunk_size"),
    [*(pytest.param("torch", chunk) for chunk in (1, 4, 6, 50, None)), triton_param(None)],
    indirect=["backend"],
)
def test_fused_matches_naive_composition_float32(backend: str, chunk_size: int | None) -> None:
    case = make_case(3, 6, 8, 31, seed=13, dtype=torch.float32)
    inputs, naive_inputs = leaves(case), leaves(case)
    common = {k: case[k] for k in ("old_log_probs", "advantages", "mask")}
    ref_log_probs = case["ref_log_probs"].float()
    with pytest.warns(BiasedGradientWarning, match="k3"):
        out = fused_policy_loss_from_hidden(
            inputs[0], inputs[1], case["tokens"], **common, bias=inputs[2], chunk_size=chunk_size,
            surrogate=Clip(low=0.1, high=0.3), ref_log_probs=ref_log_probs, kl_coef=0.05,
            diagnostics_normalizer=20,
        )  # fmt: skip
    log_probs = naive_log_probs(*naive_inputs[:2], case["tokens"], naive_inputs[2])
    unfused = policy_loss(
        log_probs, **common, surrogate=Clip(low=0.1, high=0.3), diagnostics_normalizer=20
    )
    with pytest.warns(BiasedGradientWarning):
        kl = kl_loss(log_probs, ref_log_probs, case["mask"])
    expected = unfused.loss + 0.05 * kl
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, expected.detach().double())
    assert_close(out.policy_loss, unfused.loss.detach().double())
    assert_close(out.kl_loss, kl.detach().double())
    assert_close(out.log_probs, torch.where(case["mask"], log_probs, 0.0).detach().double())
    for name in out.diagnostics._fields:
        assert_close(getattr(out.diagnostics, name), getattr(unfused.diagnostics, name))
    for a, e in zip(grads(out.loss, inputs), grads(expected, naive_inputs), strict=True):
        assert_close(a, e.double())


def test_fused_golden(backend: str) -> None:
    # Zero hidden states, V = 4: log p = -log 4 at every token; old = -log 4, so r = 1 and the
    # surrogate is A: loss = -(A0 + A0 + A1) / 3 = -(2 + 2 - 1) / 3 = -1 (token_mean), and
    # -(2 + (-1)) / 2 = -0.5 (sequence_mean); with k2 and ref = old + 0.5, d = -0.5 and
    # k2 = 0.125, so kl_coef = 2 adds 0.25.
    hidden, weight = torch.zeros(2, 2, 3), torch.randn(4, 3)
    old = torch.full((2, 2), -math.log(4))
    mask = torch.tensor([[True, True], [True, False]])
    args = (hidden, weight, torch.tensor([[0, 1], [2, 3]]), old, torch.tensor([2.0, -1.0]), mask)
    assert_close(fused_policy_loss_from_hidden(*args).loss, -1.0)
    assert_close(fused_policy_loss_from_hidden(*args, reduction="sequence_mean").loss, -0.5)
    out = fused_policy_loss_from_hidden(
        *args, ref_log_probs=old + 0.5, kl_coef=2.0, kl_estimator="k2"
    )
    assert_close(out.loss, -1.0 + 0.25)
    assert_close(out.kl_loss, 0.125)
    assert_close(out.diagnostics.ratio_mean, 1.0)


def test_fused_masked_nan_and_fully_masked(backend: str) -> None:
    case = make_case(3, 4, 5, 6, seed=14, dtype=dtype_for(backend))
    mask = case["mask"]
    dirty = case["hidden"].clone()
    dirty[~mask] = float("nan")
    tokens = torch.where(mask, case["tokens"], torch.full_like(case["tokens"], -1))
    old = torch.where(mask, case["old_log_probs"], float("-inf"))
    ref = torch.where(mask, case["ref_log_probs"], float("nan"))
    common = {"advantages": case["advantages"], "mask": mask, "ref_log_probs": ref}
    options = {"kl_coef": 0.1, "kl_estimator": "k2", "chunk_size": 3, "surrogate": Clip(dual=2.5)}
    clean = leaves(case)
    clean_out = fused_policy_loss_from_hidden(
        clean[0], clean[1], case["tokens"], case["old_log_probs"], bias=clean[2],
        advantages=case["advantages"], mask=mask, ref_log_probs=case["ref_log_probs"], **options,
    )  # fmt: skip
    dirty_inputs = [dirty.requires_grad_(True), *leaves(case)[1:]]
    dirty_out = fused_policy_loss_from_hidden(
        dirty_inputs[0], dirty_inputs[1], tokens, old, bias=dirty_inputs[2], **common, **options
    )
    assert_close(dirty_out.loss, clean_out.loss)
    for a, e in zip(grads(dirty_out.loss, dirty_inputs), grads(clean_out.loss, clean), strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, e)
    # Nothing selected: loss and diagnostics 0, gradients exactly 0, no NaN.
    nothing = torch.zeros_like(mask)
    empty_inputs = [dirty.detach().clone().requires_grad_(True), *leaves(case)[1:]]
    out = fused_policy_loss_from_hidden(
        empty_inputs[0], empty_inputs[1], tokens, old, case["advantages"], nothing,
        bias=empty_inputs[2], reduction="sequence_mean",
    )  # fmt: skip
    assert float(out.loss.detach()) == 0.0
    assert all(float(value) == 0.0 for value in out.diagnostics)
    for grad in grads(out.loss, empty_inputs):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_fused_scales_by_upstream_gradient_and_frozen_head(backend: str) -> None:
    case = make_case(2, 3, 4, 5, seed=15, dtype=dtype_for(backend))
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}
    inputs = leaves(case)
    base = grads(fused_policy_loss_from_hidden(*inputs[:2], bias=inputs[2], **common).loss, inputs)
    scaled_loss = fused_policy_loss_from_hidden(*inputs[:2], bias=inputs[2], **common).loss
    scaled = grads(-2.5 * scaled_loss, inputs)
    for a, e in zip(scaled, base, strict=True):
        assert_close(a, -2.5 * e)
    # Frozen LM head: only grad_hidden is formed and it is unchanged.
    hidden = case["hidden"].clone().requires_grad_(True)
    frozen = fused_policy_loss_from_hidden(hidden, case["weight"], bias=case["bias"], **common)
    (grad_hidden,) = torch.autograd.grad(frozen.loss, hidden)
    assert_close(grad_hidden, base[0])


def test_fused_second_backward(backend: str) -> None:
    # The PyTorch chunk loop forms the gradients in the forward pass: one backward per forward.
    # The Triton LM head recomputes the logits in backward: a second backward adds them again.
    case = make_case(2, 3, 4, 5, seed=16, dtype=dtype_for(backend))
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}
    inputs = leaves(case)
    loss = fused_policy_loss_from_hidden(*inputs[:2], bias=inputs[2], **common).loss
    loss.backward(retain_graph=True)
    if backend == "torch":
        with pytest.raises(RuntimeError, match="one backward pass per forward"):
            loss.backward()
        return
    assert inputs[0].grad is not None
    first = inputs[0].grad.clone()
    loss.backward()
    assert_close(inputs[0].grad, 2 * first)


def test_fused_bfloat16_within_tolerance(backend: str) -> None:
    case = make_case(2, 5, 16, 40, seed=17, dtype=torch.bfloat16)
    inputs, naive_inputs = leaves(case), leaves(case)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in leaves(case)]
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}
    kl = {"ref_log_probs": case["ref_log_probs"], "kl_coef": 0.1, "kl_estimator": "k2"}
    out = fused_policy_loss_from_hidden(
        inputs[0], inputs[1], bias=inputs[2], **common, chunk_size=3, **kl
    )
    expected = reference.fused_policy_loss_from_hidden(
        ref_inputs[0], ref_inputs[1], bias=ref_inputs[2], **common, **kl
    )
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, expected, dtype=torch.bfloat16)
    log_probs = naive_log_probs(naive_inputs[0], naive_inputs[1], case["tokens"], naive_inputs[2])
    naive = policy_loss(log_probs, *(case[k] for k in ("old_log_probs", "advantages", "mask")))
    naive_loss = naive.loss + 0.1 * kl_loss(
        log_probs, case["ref_log_probs"], case["mask"], estimator="k2"
    )
    actual = grads(out.loss, inputs)
    unfused = grads(naive_loss, naive_inputs)
    wanted = grads(expected, ref_inputs)
    for name, a, n, e in zip(("hidden", "weight", "bias"), actual, unfused, wanted, strict=True):
        assert_bf16_gradient(a, n, e, name)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kl_coef": -1.0}, ValueError, "kl_coef must be >= 0"),
        ({"kl_coef": 0.1}, ValueError, "kl_coef > 0 requires ref_log_probs"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator must be one of"),
        ({"kl_straight_through": 1}, TypeError, "kl_straight_through must be a bool"),
        ({"reduction": "mean"}, ValueError, "reduction must be one of"),
        ({"ratio_level": "seq"}, ValueError, "ratio_level must be one of"),
        ({"surrogate": 3}, TypeError, "surrogate must be one of"),
        ({"normalizer": 0}, ValueError, "normalizer must be > 0"),
        ({"old_log_probs": torch.zeros(1, 3)}, ValueError, "old_log_probs"),
        ({"ref_log_probs": torch.zeros(2, 2)}, ValueError, "ref_log_probs must have the same"),
        ({"mask": torch.ones(1, 3)}, ValueError, "mask must have the same shape"),
        ({"advantages": torch.ones(2)}, ValueError, r"advantages must have shape \(B,\)"),
        ({"hidden": torch.zeros(1, 2)}, ValueError, r"hidden must have shape \(B, T, H\)"),
    ],
)
def test_fused_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    arguments: dict[str, Any] = {
        "hidden": torch.zeros(1, 2, 3),
        "weight": torch.zeros(4, 3),
        "tokens": torch.zeros(1, 2, dtype=torch.int64),
        "old_log_probs": torch.zeros(1, 2),
        "advantages": torch.ones(1),
        "mask": torch.ones(1, 2),
        **kwargs,
    }
    positional = [
        arguments.pop(name)
        for name in ("hidden", "weight", "tokens", "old_log_probs", "advantages", "mask")
    ]
    with pytest.raises(error, match=match):
        fused_policy_loss_from_hidden(*positional, **arguments)


def test_exported() -> None:
    for name in ("token_log_probs_from_hidden", "fused_policy_loss_from_hidden"):
        assert getattr(rlobjectives, name) is globals()[name]
        assert name in rlobjectives.__all__


@pytest.mark.compile
def test_fused_under_torch_compile() -> None:
    case = make_case(2, 3, 4, 5, seed=18, dtype=torch.float32)
    inputs, eager_inputs = leaves(case), leaves(case)
    common = {k: case[k] for k in ("tokens", "old_log_probs", "advantages", "mask")}

    def function(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # One chunk: each chunk adds a traced per-chunk autograd graph (compile time, not coverage).
        return fused_policy_loss_from_hidden(hidden, weight, bias=bias, **common, chunk_size=8).loss

    actual = torch.compile(function, backend="aot_eager")(*inputs)
    expected = function(*eager_inputs)
    assert_close(actual, expected.detach().double())
    for a, e in zip(grads(actual, inputs), grads(expected, eager_inputs), strict=True):
        assert_close(a, e.double())
