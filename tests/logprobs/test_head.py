"""The LM head as trainers and samplers compute it (issue 33).

The logit transform (``logit_scale``, then ``final_logit_softcapping``, then the temperature,
one number or one per token), min-p in vLLM V1's order, the ``statistics`` of TRL 1.16's
``ChunkedLogProbFunction`` and the float32 product of bf16 heads, on every path: against the
float64 references of ``tests/reference.py`` (values and gradients, random odd shapes), golden
values with their arithmetic, the logits kept from forward to backward against recompute, and
the installed peers: TRL 1.16's ``ChunkedLogProbFunction`` (its CPU path) and its
``add_fused_lm_head`` on models built from Gemma 2/3, Cohere, Granite and MiniCPM3 configs, and
verl 0.9.1's ``calculate_sum_pi_squared_from_logits``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from rlobjectives.integrations.transformers import head_options
from rlobjectives.logprobs import chunks as chunks_module
from rlobjectives.logprobs import saved_logits
from tolerances import assert_close, tolerance

F64 = torch.float64
STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
EXACT = {"rtol": 1e-10, "atol": 1e-10}


def _finite_projection(outputs: list[torch.Tensor], seed: int) -> torch.Tensor:
    """A fixed random weighting of the finite, differentiable outputs."""
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros((), dtype=F64)
    for output in outputs:
        weights = torch.randn(output.shape, generator=generator, dtype=F64)
        if output.requires_grad:
            finite = torch.isfinite(output)
            total = total + (torch.where(finite, output.double(), 0.0) * weights).sum()
    return total


def _grads(total: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The gradients of ``total`` (zeros when it does not depend on the leaves)."""
    if not total.requires_grad:
        return tuple(torch.zeros_like(leaf) for leaf in leaves)
    return torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)


def _compare_statistics(out: Any, want: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for name in ("log_probs", *STATS):
        value = getattr(out, name)
        if name == "is_top1":
            assert value.dtype == torch.bool
            assert torch.equal(value, want[name]), name
            continue
        finite = torch.isfinite(want[name])
        assert torch.equal(torch.isfinite(value), finite), name
        assert_close(torch.where(finite, value, 0.0), torch.where(finite, want[name], 0.0), dtype)


# --- golden values --------------------------------------------------------------------------


def test_golden_softcap_scale_temperature() -> None:
    # z = [40, 0, -40], s = 0.5, c = 10, tau = 2: s z = [20, 0, -20], 10 tanh(s z / 10) =
    # [9.640276, 0, -9.640276], / 2 = [4.820138, 0, -4.820138]; lse = 4.820138 +
    # log(1 + e^-4.820138 + e^-9.640276) = 4.828184; log p_0 = -0.008046.
    logits = torch.tensor([[40.0, 0.0, -40.0]], dtype=F64, requires_grad=True)
    x = 10 * math.tanh(2.0) / 2
    lse = x + math.log(1 + math.exp(-x) + math.exp(-2 * x))
    out = rlo.token_log_probs(
        logits, torch.tensor([0]), temperature=2.0, logit_scale=0.5, final_logit_softcapping=10.0,
        statistics=STATS,
    )  # fmt: skip
    assert_close(out.log_probs, [x - lse])
    assert_close(out.mean_logits, [0.0])  # the transformed logits are odd around 0
    assert bool(out.is_top1[0])
    # d log p_0 / d z_0 = (1 - p_0) s (1 - tanh(2)^2) / tau: the tanh's derivative enters
    out.log_probs.sum().backward()
    p0 = math.exp(x - lse)
    assert logits.grad is not None
    assert_close(logits.grad[0, 0], (1 - p0) * 0.5 * (1 - math.tanh(2.0) ** 2) / 2)


def test_golden_statistics() -> None:
    # p = [.5, .25, .125, .125]: H = 1.213008, sum p^2 = .25 + .0625 + 2 * .015625 = .34375,
    # mean of log p = (log .5 + log .25 + 2 log .125) / 4 = -1.559581; token 0 is the top one,
    # token 3 ties token 2 and is not the first maximal logit of a row whose max is token 0.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 2, dtype=F64))
    out = rlo.token_log_probs(logits, torch.tensor([0, 3]), statistics=STATS)
    assert_close(out.entropy, [1.2130075659799042] * 2)
    assert_close(out.log_sum_sq_probs, [math.log(0.34375)] * 2)
    assert_close(out.mean_logits, [math.log(0.5 * 0.25 * 0.125**2) / 4] * 2)
    assert out.is_top1.tolist() == [True, False]
    # ties: [1, 3, 3] -> the first maximal logit is token 1, not token 2 (TRL's rule)
    tied = torch.tensor([[1.0, 3.0, 3.0]] * 2, dtype=F64)
    out = rlo.token_log_probs(tied, torch.tensor([1, 2]), statistics=("is_top1",))
    assert out.is_top1.tolist() == [True, False] and out.entropy is None


def test_golden_min_p_order() -> None:
    # p = [.5, .25, .15, .1], min_p = 0.25: keep p >= .125 -> K = {0, 1, 2}; top_p = 0.7 on the
    # renormalised [.5/.9, .25/.9, .15/.9] = [.5556, .2778, .1667]: mass before token 1 is .5556
    # < .7, before token 2 .8333 >= .7 -> K = {0, 1} (vLLM V1: min-p, then top-p). vLLM V0's
    # order (top-p on the full distribution first: mass before token 2 is .75 >= .7 -> {0, 1},
    # then min-p) agrees here; with top_p = 0.8 V1 keeps {0, 1} (.8333 >= .8) and V0 keeps
    # {0, 1, 2} (.75 < .8, and min-p keeps token 2).
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]], dtype=F64)).expand(4, 4)
    tokens = torch.arange(4)
    out = rlo.token_log_probs(logits, tokens, min_p=0.25)
    assert_close(out[:3], torch.log(torch.tensor([0.5, 0.25, 0.15], dtype=F64) / 0.9))
    assert out[3].item() == -math.inf
    v1 = rlo.token_log_probs(logits, tokens, min_p=0.25, top_p=0.8)
    assert_close(v1[:2], torch.log(torch.tensor([0.5, 0.25], dtype=F64) / 0.75))
    assert torch.isinf(v1[2:]).all()
    assert rlo.token_log_probs(logits, tokens, min_p=0.0).isfinite().all()  # 0: off
    # min_p = 1 keeps the maximal logits only
    assert_close(rlo.token_log_probs(logits, tokens, min_p=1.0)[0], 0.0)


def test_min_p_rejects_other_sets_and_bad_values() -> None:
    logits, tokens = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^kept_ids and min_p are alternatives"):
        rlo.token_log_probs(logits, tokens, kept_ids=torch.zeros(2, 1, dtype=torch.long), min_p=0.1)
    with pytest.raises(ValueError, match=r"^min_p must be in \[0, 1\]"):
        rlo.token_log_probs(logits, tokens, min_p=1.5)
    with pytest.raises(ValueError, match=r"^final_logit_softcapping must be > 0"):
        rlo.token_entropy(logits, final_logit_softcapping=0.0)
    with pytest.raises(ValueError, match=r"^temperature must be a number or a per-token tensor"):
        rlo.token_entropy(logits, temperature=torch.ones(3))
    with pytest.raises(ValueError, match=r"^statistics must name statistics from"):
        rlo.token_log_probs(logits, tokens, statistics=("entropy", "variance"))


# --- references: logits, response, hidden states ----------------------------------------------


def _kept(draw: Any, vocabulary: int) -> dict[str, Any]:
    kind = draw(st.sampled_from(("none", "min_p", "top_k", "min_p+top_k+top_p")))
    if kind == "min_p":
        return {"min_p": draw(st.sampled_from((0.05, 0.3)))}
    if kind == "top_k":
        return {"top_k": draw(st.integers(1, vocabulary))}
    if kind == "min_p+top_k+top_p":
        return {"min_p": 0.02, "top_k": draw(st.integers(1, vocabulary)), "top_p": 0.8}
    return {}


def _head_options(draw: Any, shape: tuple[int, ...], generator: torch.Generator) -> dict[str, Any]:
    options: dict[str, Any] = {
        "final_logit_softcapping": draw(st.sampled_from((None, 0.8, 30.0))),
        "logit_scale": draw(st.sampled_from((1.0, 0.0625, 1.7))),
        "temperature": draw(st.sampled_from((1.0, 0.6))),
    }
    if draw(st.booleans()):  # one temperature per token
        options["temperature"] = 0.4 + torch.rand(shape, generator=generator, dtype=F64)
    return options


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_logits_statistics_match_the_reference(data: st.DataObject) -> None:
    draw = data.draw
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 5)))
    vocabulary = draw(st.integers(1, 9))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = 3 * torch.randn(*shape, vocabulary, generator=generator, dtype=F64)
    logits.requires_grad_(True)
    tokens = torch.randint(0, vocabulary, shape, generator=generator)
    mask = torch.rand(shape, generator=generator) < 0.8
    options = {**_head_options(draw, shape, generator), **_kept(draw, vocabulary)}
    chunk = draw(st.sampled_from((None, 1, 2)))
    out = rlo.token_log_probs(logits, tokens, mask=mask, chunk_size=chunk, statistics=STATS,
                              **options)  # fmt: skip
    want = reference.head_statistics(logits, tokens, mask, **options)
    _compare_statistics(out, want, F64)
    seed = draw(st.integers(0, 100))
    got = _grads(_finite_projection([out.log_probs, out.entropy], seed), (logits,))
    expected = _grads(_finite_projection([want["log_probs"], want["entropy"]], seed), (logits,))
    torch.testing.assert_close(got[0], expected[0], **EXACT)
    entropy = rlo.token_entropy(logits, mask=mask, chunk_size=chunk, **options)
    assert_close(entropy, want["entropy"])
    plain = rlo.token_log_probs(logits.detach(), tokens, mask=mask, **options)
    assert_close(torch.where(plain.isfinite(), plain, 0.0),
                 torch.where(want["log_probs"].isfinite(), want["log_probs"], 0.0))  # fmt: skip


@settings(max_examples=20, deadline=None, derandomize=True)
@given(data=st.data())
def test_hidden_statistics_match_the_reference(data: st.DataObject) -> None:
    draw = data.draw
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 5)))
    vocabulary, width = draw(st.integers(1, 9)), draw(st.integers(1, 4))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    hidden = torch.randn(*shape, width, generator=generator, dtype=F64).requires_grad_(True)
    weight = torch.randn(vocabulary, width, generator=generator, dtype=F64).requires_grad_(True)
    bias = torch.randn(vocabulary, generator=generator, dtype=F64).requires_grad_(True)
    tokens = torch.randint(0, vocabulary, shape, generator=generator)
    mask = torch.rand(shape, generator=generator) < 0.8
    options = {**_head_options(draw, shape, generator), **_kept(draw, vocabulary)}
    # the logits kept from forward to backward: all (the default), some chunks, none
    budget = draw(st.sampled_from((saved_logits.SAVED_LOGITS, 2 * vocabulary, 0)))
    chunk = draw(st.sampled_from((None, 1, 2)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(saved_logits, "SAVED_LOGITS", budget)
        out = rlo.token_log_probs_from_hidden(
            hidden, weight, tokens, bias=bias, mask=mask, chunk_size=chunk, statistics=STATS,
            **options,
        )  # fmt: skip
    want = reference.head_statistics_from_hidden(
        hidden, weight, tokens, bias=bias, mask=mask, **options
    )
    _compare_statistics(out, want, F64)
    seed = draw(st.integers(0, 100))
    leaves = (hidden, weight, bias)
    with pytest.MonkeyPatch.context() as patch:  # the backward reads what forward kept
        patch.setattr(saved_logits, "SAVED_LOGITS", budget)
        got = _grads(_finite_projection([out.log_probs, out.entropy], seed), leaves)
    expected = _grads(_finite_projection([want["log_probs"], want["entropy"]], seed), leaves)
    for actual, reference_grad in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, reference_grad, **EXACT)


def test_saved_logits_equal_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    # float32, N = 37 rows in chunks of 8 at V = 13: all saved, 2 chunks saved, none saved give
    # the same gradients (the same products and transform, read back or recomputed) up to the
    # order of float32 sums: the saved rows' gradient products are one GEMM, not one per chunk.
    # A second backward through the same graph (the saved logits consumed by the first, formed
    # again) gives the first one's gradients to the bit.
    generator = torch.Generator().manual_seed(33)
    hidden = torch.randn(37, 6, generator=generator).requires_grad_(True)
    weight = torch.randn(13, 6, generator=generator).requires_grad_(True)
    tokens = torch.randint(0, 13, (37,), generator=generator)
    mask = torch.rand(37, generator=generator) < 0.9
    grads = []
    for budget in (saved_logits.SAVED_LOGITS, 16 * 13, 0):
        monkeypatch.setattr(saved_logits, "SAVED_LOGITS", budget)
        out = rlo.token_log_probs_from_hidden(
            hidden, weight, tokens, mask=mask, cu_seqlens=torch.tensor([0, 37]), chunk_size=8,
            return_entropy=True, final_logit_softcapping=3.0, top_k=5,
        )  # fmt: skip
        total = out.log_probs.sum() + 0.3 * out.entropy.sum()
        first = torch.autograd.grad(total, (hidden, weight), retain_graph=True)
        again = torch.autograd.grad(total, (hidden, weight))
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        grads.append(first)
    for other in grads[1:]:
        for actual, expected in zip(other, grads[0], strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_response_statistics_and_per_token_temperature() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 7, generator=generator, dtype=F64).requires_grad_(True)
    ids = torch.randint(0, 7, (2, 6), generator=generator)
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    tau = 0.5 + torch.rand(2, 5, generator=generator, dtype=F64)  # one per response token
    out = rlo.response_log_probs(
        logits, ids, [2, 1], attention, response_length=5, temperature=tau,
        final_logit_softcapping=2.0, logit_scale=0.9, min_p=0.05, statistics=STATS,
    )  # fmt: skip
    assert isinstance(out, rlo.ResponseStatistics)
    alignment = rlo.response_alignment(ids, [2, 1], attention, response_length=5)
    rows = logits.gather(1, alignment.positions.unsqueeze(-1).expand(-1, -1, 7))  # (B, R, V)
    want = reference.head_statistics(
        rows, alignment.tokens, alignment.mask, temperature=tau, final_logit_softcapping=2.0,
        logit_scale=0.9, min_p=0.05,
    )  # fmt: skip
    _compare_statistics(out, want, F64)
    got = torch.autograd.grad(_finite_projection([out.log_probs, out.entropy], 3), logits)
    expected = torch.autograd.grad(_finite_projection([want["log_probs"], want["entropy"]], 3),
                                   logits)  # fmt: skip
    torch.testing.assert_close(got[0], expected[0], **EXACT)
    plain = rlo.response_log_probs(
        logits,
        ids,
        [2, 1],
        attention,
        response_length=5,
        temperature=tau,
        final_logit_softcapping=2.0,
        logit_scale=0.9,
    )
    assert isinstance(plain, rlo.ResponseLogProbs)  # without statistics: the 2-field result


@pytest.mark.parametrize("surrogate", ["clip", "gspo"])
def test_fused_policy_loss_with_the_head_transform(surrogate: str) -> None:
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(3, 4, 5, generator=generator, dtype=F64).requires_grad_(True)
    weight = torch.randn(9, 5, generator=generator, dtype=F64).requires_grad_(True)
    tokens = torch.randint(0, 9, (3, 4), generator=generator)
    mask = torch.rand(3, 4, generator=generator) < 0.8
    tau = 0.5 + torch.rand(3, 4, generator=generator, dtype=F64)
    old = -torch.rand(3, 4, generator=generator, dtype=F64) * 3
    advantages = torch.randn(3, generator=generator, dtype=F64)
    options = {"temperature": tau, "final_logit_softcapping": 1.5, "logit_scale": 0.8}
    ratio_level = "sequence" if surrogate == "gspo" else "token"
    out = rlo.fused_policy_loss_from_hidden(
        hidden, weight, tokens, old, advantages, mask, ratio_level=ratio_level, entropy_coef=0.05,
        **options,
    )  # fmt: skip
    want = reference.head_statistics_from_hidden(hidden, weight, tokens, mask=mask, **options)
    expected = reference.policy_loss(
        want["log_probs"], old, advantages, mask, ratio_level=ratio_level,
        entropy=want["entropy"], entropy_coef=0.05,
    )  # fmt: skip
    assert_close(out.loss, expected)
    got = torch.autograd.grad(out.loss, (hidden, weight))
    reference_grads = torch.autograd.grad(expected, (hidden, weight))
    for actual, wanted in zip(got, reference_grads, strict=True):
        torch.testing.assert_close(actual, wanted, **EXACT)


@pytest.mark.parametrize("loss", ["topk", "reverse", "jsd"])
def test_distillation_from_hidden_with_the_head_transform(loss: str) -> None:
    # Equal to the logits functions on the float64 transformed logits (temperature 1 there).
    generator = torch.Generator().manual_seed(21)
    hidden = torch.randn(2, 3, 4, generator=generator, dtype=F64).requires_grad_(True)
    weight = torch.randn(8, 4, generator=generator, dtype=F64).requires_grad_(True)
    mask = torch.rand(2, 3, generator=generator) < 0.8
    tau = 0.5 + torch.rand(2, 3, generator=generator, dtype=F64)
    head = {"final_logit_softcapping": 2.5, "logit_scale": 0.7}
    x = reference.transformed_logits(hidden @ weight.T, temperature=tau, **head)
    if loss == "topk":
        teacher, ids = torch.log_softmax(torch.randn(2, 3, 8, generator=generator,
                                                     dtype=F64), -1).topk(3, -1)  # fmt: skip
        out = rlo.topk_forward_kl_from_hidden(hidden, weight, teacher, ids, mask, temperature=tau,
                                              **head)  # fmt: skip
        want = rlo.topk_forward_kl(x, teacher, ids, mask)
    elif loss == "reverse":
        tokens = torch.randint(0, 8, (2, 3), generator=generator)
        teacher = -torch.rand(2, 3, generator=generator, dtype=F64)
        out = rlo.reverse_kl_loss_from_hidden(hidden, weight, tokens, teacher, mask,
                                              estimator="k2", temperature=tau, **head)  # fmt: skip
        want = rlo.reverse_kl_loss(x, tokens, teacher, mask, estimator="k2")
    else:
        teacher_hidden = torch.randn(2, 3, 2, generator=generator, dtype=F64)
        teacher_weight = torch.randn(8, 2, generator=generator, dtype=F64)
        out = rlo.generalized_jsd_loss_from_hidden(
            hidden, weight, teacher_hidden, teacher_weight, mask, beta=0.4, temperature=tau,
            teacher_final_logit_softcapping=1.5, teacher_logit_scale=2.0, **head,
        )  # fmt: skip
        teacher_x = reference.transformed_logits(
            teacher_hidden @ teacher_weight.T, temperature=tau, logit_scale=2.0,
            final_logit_softcapping=1.5,
        )  # fmt: skip
        want = rlo.generalized_jsd_loss(x, teacher_x, mask, beta=0.4)
    assert_close(out, want)
    got = torch.autograd.grad(out, (hidden, weight))
    expected = torch.autograd.grad(want, (hidden, weight))
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted, **EXACT)
    # and the per-token temperature of the logits functions
    if loss == "topk":
        assert_close(rlo.topk_forward_kl(x.detach() * tau.unsqueeze(-1), teacher, ids, mask,
                                         temperature=tau), want)  # fmt: skip


# --- the float32 product of bf16/fp16 heads ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_head_forms_the_product_in_float32(dtype: torch.dtype) -> None:
    # H = 512, logits of order 10: the product rounded to bf16 (8 bits) is off by up to ~0.06
    # per logit, and the log-probs with it; the default keeps the float32 product of the same
    # 16-bit numbers (float32 tolerance against the float64 product).
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 512, generator=generator).to(dtype)
    weight = (torch.randn(300, 512, generator=generator) / 2).to(dtype)
    tokens = torch.randint(0, 300, (64,), generator=generator)
    exact = reference.head_statistics_from_hidden(hidden, weight, tokens, temperature=0.7)
    wide = rlo.token_log_probs_from_hidden(
        hidden, weight, tokens, temperature=0.7, cu_seqlens=torch.tensor([0, 64]), statistics=STATS
    )
    assert wide.log_probs.dtype == torch.float32
    assert_close(wide.log_probs, exact["log_probs"], torch.float32)
    assert_close(wide.entropy, exact["entropy"], torch.float32)
    rounded = rlo.token_log_probs_from_hidden(
        hidden, weight, tokens, temperature=0.7, cu_seqlens=torch.tensor([0, 64]), fp32_head=False
    )
    product = (hidden @ weight.T).double()  # the 16-bit product, as hidden @ weight.T
    want = reference.head_statistics(product, tokens, temperature=0.7)["log_probs"]
    assert_close(rounded, want, torch.float32)
    error = (rounded.double() - exact["log_probs"]).abs().max().item()
    assert error > 100 * tolerance(torch.float32)["atol"]  # the rounding the default avoids


def test_fp32_head_gradients_accumulate_in_float32() -> None:
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 64, generator=generator).bfloat16().requires_grad_(True)
    weight = torch.randn(50, 64, generator=generator).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, 50, (40,), generator=generator)
    out = rlo.token_log_probs_from_hidden(hidden, weight, tokens, cu_seqlens=torch.tensor([0, 40]),
                                          chunk_size=16, final_logit_softcapping=5.0)  # fmt: skip
    out.sum().backward()
    leaves = (hidden.detach().double().requires_grad_(True),
              weight.detach().double().requires_grad_(True))  # fmt: skip
    want = reference.head_statistics_from_hidden(*leaves, tokens, final_logit_softcapping=5.0)
    want["log_probs"].sum().backward()
    assert hidden.grad is not None and weight.grad is not None and leaves[0].grad is not None
    assert hidden.grad.dtype == torch.bfloat16
    # one bf16 rounding of a float32-accumulated gradient
    assert_close(hidden.grad, leaves[0].grad.bfloat16().double(), torch.bfloat16)
    assert_close(weight.grad, leaves[1].grad.bfloat16().double(), torch.bfloat16)


def test_cuda_product_uses_out_dtype() -> None:
    # The CUDA branch of the 16-bit product, checked on the meta device: torch.mm with
    # out_dtype=float32 from bf16 operands into a float32 buffer (CUDA-only at run time).
    left = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    right = torch.empty(5, 8, dtype=torch.bfloat16, device="meta")
    out = torch.empty(4, 5, device="meta")
    assert torch.mm(left, right.T, out_dtype=torch.float32, out=out).dtype == torch.float32
    assert chunks_module.wide_product.__doc__ is not None


# --- peers ----------------------------------------------------------------------------------


trl_kernels = pytest.importorskip("trl.kernels")


@pytest.mark.parametrize(
    ("softcap", "scale", "temperature"),
    [(None, 1.0, 1.0), (30.0, 1.0, 0.7), (2.0, 0.0625, 1.3), (None, 0.125, 0.9)],
)
def test_trl_chunked_log_prob_function(
    softcap: float | None, scale: float, temperature: float
) -> None:
    # TRL 1.16's ChunkedLogProbFunction on CPU (float32 tiles folded in torch): log-probs,
    # entropy, log_sum_sq_probs, mean_logits, is_top1, and the gradients of the first two.
    generator = torch.Generator().manual_seed(1616)
    hidden = (3 * torch.randn(23, 16, generator=generator)).requires_grad_(True)
    weight = torch.randn(37, 16, generator=generator).requires_grad_(True)
    bias = torch.randn(37, generator=generator).requires_grad_(True)
    targets = torch.randint(0, 37, (23,), generator=generator)
    targets[:3] = (hidden.detach() @ weight.detach().T + bias.detach())[:3].argmax(-1)  # top-1
    theirs = trl_kernels.ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, temperature, 16, softcap, scale, STATS
    )
    ours = rlo.token_log_probs_from_hidden(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=7,
        final_logit_softcapping=softcap, logit_scale=scale, cu_seqlens=torch.tensor([0, 23]),
        statistics=STATS,
    )  # fmt: skip
    fp32 = tolerance(torch.float32)
    for index, name in enumerate(("log_probs", *STATS)):
        if name == "is_top1":
            assert torch.equal(getattr(ours, name), theirs[index])
        else:
            torch.testing.assert_close(getattr(ours, name), theirs[index].detach(), **fp32)
    upstream = torch.randn(2, 23, generator=generator)
    assert ours.entropy is not None
    mine_total = (ours.log_probs * upstream[0]).sum() + (ours.entropy * upstream[1]).sum()
    peer_total = (theirs[0] * upstream[0]).sum() + (theirs[1] * upstream[1]).sum()
    mine = torch.autograd.grad(mine_total, (hidden, weight, bias))
    peer = torch.autograd.grad(peer_total, (hidden, weight, bias))
    for actual, expected in zip(mine, peer, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def _tiny_config(model_type: str) -> Any:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 16}  # fmt: skip
    if model_type == "gemma2":
        return transformers.Gemma2Config(**small, final_logit_softcapping=3.0)
    if model_type == "gemma3":  # a vision-language config: the text config holds the softcap
        text = transformers.Gemma3TextConfig(**small, final_logit_softcapping=4.0)
        return transformers.Gemma3Config(text_config=text.to_dict())
    if model_type == "cohere":
        return transformers.CohereConfig(**small, logit_scale=0.25)
    if model_type == "granite":
        return transformers.GraniteConfig(**small, logits_scaling=8.0)
    if model_type == "minicpm3":
        return transformers.MiniCPM3Config(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            q_lora_rank=16,
            kv_lora_rank=16,
            dim_model_base=8,
        )  # fmt: skip  (logits_scaling = hidden_size / dim_model_base = 4)
    raise AssertionError(model_type)


EXPECTED_OPTIONS = {
    "gemma2": {"final_logit_softcapping": 3.0, "logit_scale": 1.0},
    "gemma3": {"final_logit_softcapping": 4.0, "logit_scale": 1.0},
    "cohere": {"final_logit_softcapping": None, "logit_scale": 0.25},
    "granite": {"final_logit_softcapping": None, "logit_scale": 1 / 8.0},
    "minicpm3": {"final_logit_softcapping": None, "logit_scale": 1 / 4.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(EXPECTED_OPTIONS))
def test_head_options_equal_trl_add_fused_lm_head(model_type: str) -> None:
    # A tiny model of each family (random weights, no download): TRL's add_fused_lm_head reads
    # the config and returns the per-token log-probs of its fused head; ours, from the same
    # backbone's hidden states with head_options(config), equal them (and the model's own
    # logits' log-softmax).
    transformers = pytest.importorskip("transformers")
    trl_utils = pytest.importorskip("trl.trainer.utils")
    config = _tiny_config(model_type)
    options = head_options(config)
    assert options == pytest.approx(EXPECTED_OPTIONS[model_type])
    torch.manual_seed(0)
    if model_type == "gemma3":
        model = transformers.Gemma3ForCausalLM(config.get_text_config()).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # logits of a visible size (a random init gives tiny ones)
        model.get_output_embeddings().weight.mul_(40.0)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state  # (2, 9, 32)
        logits = model(input_ids=ids).logits.float()
    trl_utils.add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    labels = ids.clone()
    with torch.no_grad():
        theirs = model(input_ids=ids, labels=labels, fused_lm_head=True)
    weight = model.get_output_embeddings().weight
    ours = rlo.token_log_probs_from_hidden(
        hidden[:, :-1], weight, ids[:, 1:], temperature=0.8, return_entropy=True, **options
    )
    fp32 = tolerance(torch.float32)
    torch.testing.assert_close(ours.log_probs, theirs.log_probs[:, : ids.shape[1] - 1], **fp32)
    torch.testing.assert_close(ours.entropy, theirs.entropy[:, : ids.shape[1] - 1], **fp32)
    model_own = torch.log_softmax(logits[:, :-1] / 0.8, -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(ours.log_probs, model_own, rtol=1e-4, atol=1e-4)


def test_head_options_reads_every_field_as_trl() -> None:
    def config(**fields: Any) -> Any:
        text = SimpleNamespace(model_type=fields.pop("model_type", "x"), **fields)
        return SimpleNamespace(get_text_config=lambda: text)

    assert head_options(config()) == {"final_logit_softcapping": None, "logit_scale": 1.0}
    assert head_options(config(logit_scale=None))["logit_scale"] == 1.0  # MPT: None is absent
    assert head_options(config(logit_scale=0.0))["logit_scale"] == 0.0  # a real 0 is kept
    assert head_options(config(output_multiplier=0.2, final_logit_softcapping=20.0)) == {
        "final_logit_softcapping": 20.0, "logit_scale": 0.2}  # Muse Glimmer  # fmt: skip
    assert head_options(config(lm_head_multiplier=0.5))["logit_scale"] == 0.5  # Falcon-H1
    assert head_options(config(logits_scaling=4.0))["logit_scale"] == 0.25  # Granite
    hyperclova = config(logits_scaling=4.0, model_type="hyperclovax")
    assert head_options(hyperclova)["logit_scale"] == 4.0  # HyperCLOVA X multiplies
    # the first field set wins, in TRL's order
    assert head_options(config(logit_scale=0.1, output_multiplier=0.2))["logit_scale"] == 0.1
    with pytest.raises(TypeError, match=r"^config must be a Hugging Face model config"):
        head_options({"logit_scale": 1.0})
    with pytest.raises(TypeError, match=r"^config.logit_scale must be a real number"):
        head_options(config(logit_scale="big"))


def test_head_options_of_transformers_configs() -> None:
    transformers = pytest.importorskip("transformers")
    cases = {
        "hyperclovax": {"final_logit_softcapping": None, "logit_scale": 1.0},
        "falcon_h1": {"final_logit_softcapping": None, "logit_scale": 1.0},
        "muse_glimmer": {"final_logit_softcapping": 20.0, "logit_scale": 0.19611613513818404},
        "cohere2": {"final_logit_softcapping": None, "logit_scale": 0.0625},
    }
    for model_type, expected in cases.items():
        assert head_options(transformers.AutoConfig.for_model(model_type)) == expected


def test_sum_pi_squared_equals_verl() -> None:
    # verl 0.9.1's calculate_sum_pi_squared_from_logits (exp(lse(2x) - 2 lse(x))) is
    # exp(log_sum_sq_probs), on logits and from hidden states.
    verl_functional = pytest.importorskip("verl.utils.torch_functional")
    generator = torch.Generator().manual_seed(9)
    logits = 4 * torch.randn(3, 5, 11, generator=generator, dtype=F64)
    tokens = torch.randint(0, 11, (3, 5), generator=generator)
    theirs = verl_functional.calculate_sum_pi_squared_from_logits(logits)
    ours = rlo.token_log_probs(logits, tokens, statistics=("log_sum_sq_probs",))
    torch.testing.assert_close(ours.log_sum_sq_probs.exp(), theirs, rtol=1e-12, atol=1e-14)
    hidden = torch.randn(3, 5, 4, generator=generator, dtype=F64)
    weight = torch.randn(11, 4, generator=generator, dtype=F64)
    from_hidden = rlo.token_log_probs_from_hidden(hidden, weight, tokens,
                                                  statistics=("log_sum_sq_probs",))  # fmt: skip
    assert from_hidden.log_sum_sq_probs is not None
    expected = verl_functional.calculate_sum_pi_squared_from_logits(hidden @ weight.T)
    torch.testing.assert_close(from_hidden.log_sum_sq_probs.exp(), expected, rtol=1e-12,
                               atol=1e-14)  # fmt: skip
