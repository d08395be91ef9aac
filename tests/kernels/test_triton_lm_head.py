"""Hidden-state path on the Triton kernels (interpreter, tiny shapes) against float64 autograd."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends import requires_triton
from rlobjectives._core.backend import use_backend
from rlobjectives.kernels.head_backward import lm_head_backward, vocab_chunk
from rlobjectives.kernels.head_forward import lm_head_forward
from rlobjectives.logprobs.triton_head import TritonLogProbs
from tolerances import assert_close
from triton_reference import head_log_probs

pytestmark = requires_triton

N, H, V = 13, 40, 37  # 16-wide tiles: 1 row block, 3 hidden steps, 3 vocabulary blocks
# float32 tolerance for products over H = 40 terms and softmax sums over V = 37 terms
FP32 = {"rtol": 1e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _triton_backend() -> Any:
    with use_backend("triton"):
        yield


def _head(dtype: torch.dtype, *, banned: bool = False, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / math.sqrt(H) * 2
    bias = torch.randn(V, generator=g)
    mask = torch.rand(N, generator=g) < 0.7
    tokens = torch.randint(0, V, (N,), generator=g)
    if banned:
        bias[[3, 17, 18, 36]] = -math.inf
        tokens = torch.where(torch.isin(tokens, torch.tensor([3, 17, 18, 36])), 0, tokens)
    hidden = torch.where(mask[:, None], hidden, math.nan)  # masked rows hold NaN
    tokens = torch.where(mask, tokens, -100)  # and invalid ids
    return {
        "hidden": hidden.to(dtype),
        "weight": weight.to(dtype),
        "bias": bias.to(dtype),
        "tokens": tokens,
        "mask": mask,
    }


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("banned", [False, True])
def test_forward_matches_log_softmax(splits: int, banned: bool) -> None:
    head = _head(torch.float32, banned=banned)
    out = lm_head_forward(
        head["hidden"], head["weight"], head["tokens"], head["mask"], bias=head["bias"],
        temperature=0.7, with_entropy=True, splits=splits,
    )  # fmt: skip
    log_probs, entropy = head_log_probs(
        head["hidden"], head["weight"], head["tokens"], head["mask"], bias=head["bias"],
        temperature=0.7,
    )  # fmt: skip
    assert out.entropy is not None
    assert torch.isfinite(out.log_probs).all() and torch.isfinite(out.entropy).all()
    torch.testing.assert_close(out.log_probs.double(), log_probs, **FP32)
    torch.testing.assert_close(out.entropy.double(), entropy, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_autograd(dtype: torch.dtype) -> None:
    head = _head(dtype, banned=True, seed=1)
    leaves = {k: head[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    out = lm_head_forward(
        head["hidden"], head["weight"], head["tokens"], head["mask"], bias=head["bias"],
        temperature=1.3, with_entropy=True, splits=2,
    )  # fmt: skip
    log_probs, entropy = TritonLogProbs.apply(
        leaves["hidden"], leaves["weight"], leaves["bias"], head["tokens"], head["mask"], 1.3,
        True, None,
    )  # fmt: skip
    assert out.entropy is not None
    torch.testing.assert_close(entropy.detach(), out.entropy, **FP32)
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ((log_probs * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    reference = {k: head[k].double().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    expected = head_log_probs(
        reference["hidden"], reference["weight"], head["tokens"], head["mask"],
        bias=reference["bias"], temperature=1.3,
    )  # fmt: skip
    ((expected[0] * upstream[0]).sum() + (expected[1] * upstream[1]).sum()).backward()
    torch.testing.assert_close(log_probs.double(), expected[0].detach(), **FP32)
    for name, leaf in leaves.items():
        want = reference[name].grad
        assert leaf.grad is not None and want is not None and leaf.grad.dtype == dtype
        assert torch.isfinite(leaf.grad).all(), name
        if dtype == torch.float32:
            torch.testing.assert_close(leaf.grad.double(), want, **FP32, msg=name)
        else:  # one bf16 rounding of dL/dz before the products, one of the result
            assert_close(leaf.grad, want)
    assert torch.equal(leaves["hidden"].grad[~head["mask"]], torch.zeros(1, H, dtype=dtype)
                       .expand(int((~head["mask"]).sum()), H))  # fmt: skip


def test_vocab_chunk_respects_the_budget() -> None:
    assert vocab_chunk(1000, 64, 50000, 2, 128, None) == 33536  # 64 MiB / (1000 * 2) -> tiles
    assert vocab_chunk(8, 4, 100, 4, 16, 1) == 16  # at least one tile
    assert vocab_chunk(8, 4, 100, 4, 16, 10**9) == 100  # at most V


def test_backward_without_requested_gradients_and_empty_rows() -> None:
    head = _head(torch.float32)
    out = lm_head_forward(head["hidden"], head["weight"], head["tokens"], head["mask"])
    grads = lm_head_backward(
        head["hidden"], head["weight"], head["tokens"], head["mask"], out.lse,
        torch.ones(N), need_hidden=False, need_weight=False,
    )  # fmt: skip
    assert grads == (None, None, None)
    none = torch.zeros(N, dtype=torch.bool)
    empty = lm_head_forward(head["hidden"], head["weight"], head["tokens"], none)
    assert torch.equal(empty.log_probs, torch.zeros(N))
    grads = lm_head_backward(
        head["hidden"], head["weight"], head["tokens"], none, empty.lse, torch.ones(N)
    )
    assert grads.hidden is not None and grads.weight is not None
    assert torch.equal(grads.hidden, torch.zeros(N, H))
    assert torch.equal(grads.weight, torch.zeros(V, H))


def test_backward_in_vocabulary_chunks_equals_one_chunk() -> None:
    head = _head(torch.float32, banned=True, seed=4)
    out = lm_head_forward(
        head["hidden"], head["weight"], head["tokens"], head["mask"], bias=head["bias"],
        temperature=1.3, with_entropy=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    upstream = torch.randn(N, generator=g), torch.randn(N, generator=g)
    grads = [
        lm_head_backward(
            head["hidden"],
            head["weight"],
            head["tokens"],
            head["mask"],
            out.lse,
            upstream[0],
            bias=head["bias"],
            temperature=1.3,
            entropy=out.entropy,
            grad_entropy=upstream[1],
            chunk_bytes=chunk_bytes,
            need_bias=True,
        )  # fmt: skip
        for chunk_bytes in (None, 1)  # one chunk, or one 16-wide chunk per step
    ]
    for whole, chunked in zip(grads[0], grads[1], strict=True):  # hidden, weight, bias
        assert whole is not None and chunked is not None
        torch.testing.assert_close(chunked, whole, **FP32)


def test_a_selected_id_outside_the_vocabulary_raises_as_on_pytorch() -> None:
    import rlobjectives as rlo

    hidden, weight = torch.randn(1, 2, 3), torch.randn(5, 3)
    for backend in ("torch", "triton"):
        with rlo.use_backend(backend), pytest.raises(RuntimeError):
            rlo.token_log_probs_from_hidden(hidden, weight, torch.tensor([[1, 7]]))
    # an unselected position may hold any id (padding)
    with rlo.use_backend("triton"):
        out = rlo.token_log_probs_from_hidden(
            hidden, weight, torch.tensor([[1, -100]]), mask=torch.tensor([[True, False]])
        )
    assert torch.isfinite(out[0, 0]) and out[0, 1] == 0.0


@pytest.mark.parametrize(
    ("dtype", "fp32_head"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
)
def test_logit_transform_on_the_kernels(dtype: torch.dtype, fp32_head: bool) -> None:
    # The scale, the softcap, one temperature per row, and the product rounded to bf16 with
    # fp32_head=False, on the interpreted kernels against the float64 reference (issue 33).
    import reference
    import rlobjectives as rlo
    from tolerances import tolerance

    head = _head(dtype, banned=True, seed=3)
    temperature = 0.5 + torch.rand(N, generator=torch.Generator().manual_seed(4))
    leaves = {
        name: head[name].clone().requires_grad_(True) for name in ("hidden", "weight", "bias")
    }
    options = {"final_logit_softcapping": 2.0, "logit_scale": 1.5, "temperature": temperature}
    out = rlo.token_log_probs_from_hidden(
        leaves["hidden"], leaves["weight"], head["tokens"], bias=leaves["bias"], mask=head["mask"],
        cu_seqlens=torch.tensor([0, N]), return_entropy=True, fp32_head=fp32_head, **options,
    )  # fmt: skip
    assert "TritonLogProbsBackward" in str(out.log_probs.grad_fn.next_functions)  # type: ignore[union-attr]
    mask = head["mask"]
    exact = {name: head[name].double().requires_grad_(True) for name in ("weight", "bias")}
    exact["hidden"] = torch.where(mask.unsqueeze(-1), head["hidden"], 0.0).double()
    exact["hidden"].requires_grad_(True)
    logits = exact["hidden"] @ exact["weight"].T + exact["bias"]
    if not fp32_head:  # the reference on the model's own rounded product
        rounding_error = (logits.to(dtype).double() - logits).detach()
        logits = logits + torch.where(logits.isfinite(), rounding_error, 0.0)
    want = reference.head_statistics(logits, head["tokens"].clamp(min=0), mask, **options)
    rounding = tolerance(torch.float32 if fp32_head else torch.bfloat16)
    torch.testing.assert_close(out.log_probs.double(), want["log_probs"], **rounding)
    torch.testing.assert_close(out.entropy.double(), want["entropy"], **rounding)
    upstream = torch.randn(2, N, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    total = (out.log_probs * upstream[0]).sum() + (out.entropy * upstream[1]).sum()
    grads = torch.autograd.grad(total, [leaves[name] for name in ("hidden", "weight", "bias")])
    expected = torch.autograd.grad(
        (want["log_probs"] * upstream[0]).sum() + (want["entropy"] * upstream[1]).sum(),
        [exact[name] for name in ("hidden", "weight", "bias")],
    )
    loose = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else FP32
    for name, got, wanted in zip(("hidden", "weight", "bias"), grads, expected, strict=True):
        if name == "hidden":
            got, wanted = got[mask], wanted[mask]
        torch.testing.assert_close(got.double(), wanted, **loose, msg=name)
