"""Tests of the distillation losses (issue 25, item 2).

Golden values with the arithmetic in comments (SPEC D1-D4); the float64 loop references of
tests/reference.py on random odd shapes (hypothesis: values and gradients, every option and
reduction), from hidden states == from logits (fused and recompute paths), the float32 tail
numerics, bf16 inputs, micro-batch invariance with explicit normalisers, and the numbers of
verl's, TRL's and NeMo-RL's own code on their batches (tests/distillation/peer_batches.py).
The NaN property and packed == padded run from the shared registries (tests/nan_cases.py,
tests/packed_cases.py).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from peer_batches import check, jsd_batch, reverse_batch, topk_batch
from tolerances import assert_close

D = torch.float64
LOG = math.log
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none")


def _batch(
    seed: int, batch: int, steps: int, vocab: int, slots: int, width: int = 3, *, pad: bool = True
) -> dict[str, torch.Tensor]:
    """Random student head and logits, a teacher (full logits, top-k with padding), a mask."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=D)

    hidden, weight, bias = randn(batch, steps, width), randn(vocab, width), randn(vocab)
    logits = hidden @ weight.T + bias
    teacher_logits = logits + randn(batch, steps, vocab)
    teacher = torch.log_softmax(teacher_logits, -1)
    log_probs, ids = teacher.topk(min(slots, vocab), -1)
    if pad and slots > 1:  # a server returning fewer than K: -inf slots with garbage ids
        cut = torch.rand(batch, steps, generator=generator) < 0.3
        log_probs[..., -1] = torch.where(cut, -math.inf, log_probs[..., -1])
        ids[..., -1] = torch.where(cut, 0, ids[..., -1])
    mask = torch.rand(batch, steps, generator=generator) < 0.75
    tokens = torch.randint(0, vocab, (batch, steps), generator=generator)
    teacher_token = teacher.gather(-1, tokens[..., None]).squeeze(-1)
    teacher_hidden, teacher_head = randn(batch, steps, 2), randn(vocab, 2)  # another hidden size
    return {
        "hidden": hidden,
        "weight": weight,
        "bias": bias,
        "logits": logits,
        "teacher_logits": teacher_logits,
        "log_probs": log_probs,
        "ids": ids,
        "mask": mask,
        "tokens": tokens,
        "teacher_token": teacher_token,
        "teacher_hidden": teacher_hidden,
        "teacher_head": teacher_head,
    }


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, reduction: str, **kw: Any) -> torch.Tensor:
    entries = {
        (i, t): per_token[i, t]
        for i in range(mask.shape[0])
        for t in range(mask.shape[1])
        if bool(mask[i, t])
    }
    return reference.reduce_losses(entries, tuple(mask.shape), reduction=reduction, **kw)  # type: ignore[arg-type]


def _value_and_grad(fn: Any, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = leaf.detach().clone().requires_grad_(True)
    value = fn(leaf)
    weights = 0.5 + torch.arange(value.numel(), dtype=D).reshape(value.shape) % 3 / 4
    if not value.requires_grad:  # nothing selected: a constant 0
        return value.detach(), torch.zeros_like(leaf)
    (value * weights).sum().backward()
    assert leaf.grad is not None
    return value.detach(), leaf.grad


# --- golden values (SPEC D1-D4) ---------------------------------------------------------------


def test_topk_forward_kl_golden_values_and_gradients() -> None:
    # Student [.4, .3, .2, .1]; the teacher's top-2 ids [0, 1] with log-probs log[.5, .3].
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]], dtype=D))
    teacher = torch.log(torch.tensor([[[0.5, 0.3]]], dtype=D))
    ids, mask = torch.tensor([[[0, 1]]]), torch.tensor([[True]])
    head = 0.5 * LOG(0.5 / 0.4) + 0.3 * LOG(0.3 / 0.3)  # 0.111572
    tail = 0.2 * LOG(0.2 / 0.3)  # teacher tail 1 - .8 = .2, student tail .2 + .1 = .3: -0.081093
    # renormalised over {0, 1}: teacher [.625, .375], student [4/7, 3/7]
    renormalized = 0.625 * LOG(0.625 / (0.4 / 0.7)) + 0.375 * LOG(0.375 / (0.3 / 0.7))
    cases = (
        ({}, head + tail, [-0.1, 0.0, 0.2 / 3, 0.1 / 3]),  # q - p_T on K; q (1 - .2/.3) off K
        ({"tail": False}, head, [0.8 * 0.4 - 0.5, 0.8 * 0.3 - 0.3, 0.8 * 0.2, 0.8 * 0.1]),
        ({"renormalize": True}, renormalized, [4 / 7 - 0.625, 3 / 7 - 0.375, 0.0, 0.0]),
    )
    for options, value, gradient in cases:
        x = logits.clone().requires_grad_(True)
        loss = rlo.topk_forward_kl(x, teacher, ids, mask, **options)
        loss.backward()
        assert_close(loss, value)
        assert x.grad is not None
        assert_close(x.grad[0, 0], gradient)
    assert_close(rlo.topk_forward_kl(logits, teacher, ids, mask), 0.030479, torch.float32)
    assert_close(
        rlo.topk_forward_kl(logits, teacher, ids, mask, renormalize=True), 0.005933, torch.float32
    )
    # A padding slot (-inf, id 0) changes nothing.
    padded = torch.log(torch.tensor([[[0.5, 0.3, 0.0]]], dtype=D))
    assert_close(
        rlo.topk_forward_kl(logits, padded, torch.tensor([[[0, 1, 0]]]), mask), head + tail
    )
    # Teacher mass 1 on K (log[.7, .3]): no tail, .7 ln(.7/.4) + .3 ln(.3/.3) = 0.391731.
    full = torch.log(torch.tensor([[[0.7, 0.3]]], dtype=D))
    assert_close(rlo.topk_forward_kl(logits, full, ids, mask), 0.7 * LOG(0.7 / 0.4))
    # NeMo-RL zero_outside_topk=True: the teacher log-softmaxed over K, the student full:
    # .625 ln(.625/.4) + .375 ln(.375/.3) = 0.362608.
    nemo = rlo.topk_forward_kl(logits, torch.log_softmax(teacher, -1), ids, mask)
    assert_close(nemo, 0.625 * LOG(0.625 / 0.4) + 0.375 * LOG(0.375 / 0.3))


def test_topk_forward_kl_edge_sets() -> None:
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]], dtype=D))
    mask = torch.tensor([[True]])
    # A teacher set covering the vocabulary has no tail bucket: head only.
    every = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.3]]], dtype=D))  # mass .9
    ids = torch.tensor([[[3, 2, 1, 0]]])
    head = 0.1 * LOG(0.1 / 0.1) + 0.2 * LOG(0.2 / 0.2) + 0.3 * LOG(0.3 / 0.3) + 0.3 * LOG(0.3 / 0.4)
    assert_close(rlo.topk_forward_kl(logits, every, ids, mask), head)
    # A student with no mass outside the set while the teacher has some: +inf, never NaN.
    banned = torch.tensor([[[0.0, 0.0, -math.inf, -math.inf]]], dtype=D)
    teacher = torch.log(torch.tensor([[[0.5, 0.3]]], dtype=D))
    x = banned.clone().requires_grad_(True)
    loss = rlo.topk_forward_kl(x, teacher, torch.tensor([[[0, 1]]]), mask)
    loss.backward()
    assert loss == math.inf
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # A row with only padding slots: KL 0 (the teacher's tail is 1, the student's 1).
    nothing = torch.full((1, 1, 2), -math.inf, dtype=D)
    assert rlo.topk_forward_kl(logits, nothing, torch.zeros(1, 1, 2, dtype=torch.long), mask) == 0


def test_reverse_kl_golden() -> None:
    # l_S = ln .5 (uniform over 2), l_T = ln .25: d = ln 2.
    logits = torch.zeros(1, 1, 2, dtype=D, requires_grad=True)
    teacher, mask, tokens = (
        torch.log(torch.tensor([[0.25]], dtype=D)),
        torch.tensor([[True]]),
        torch.tensor([[0]]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
        k1 = rlo.reverse_kl_loss(logits, tokens, teacher, mask, estimator="k1")
        k3 = rlo.reverse_kl_loss(logits, tokens, teacher, mask)
    assert_close(k1, LOG(2))  # 0.693147
    assert_close(k3, 0.5 + LOG(2) - 1)  # e^{-d} + d - 1 = 0.193147
    k3.backward()
    # dk3/dl_S = 1 - e^{-d} = 0.5, dl_S/dx = 1_y - q = [.5, -.5]
    assert logits.grad is not None
    assert_close(logits.grad[0, 0], [0.25, -0.25])
    rewards = rlo.reverse_kl_rewards(torch.log(torch.tensor([[0.5]], dtype=D)), teacher, mask)
    assert_close(rewards, [[-LOG(2)]])  # c (l_T - l_S) = ln(.25/.5)
    # Beyond the bound: d = -30 is clamped to -20, k3 = e^20 - 21 (verl then clamps at 10).
    far = rlo.kl_estimate(torch.zeros(1, 1, dtype=D) - 30, torch.zeros(1, 1, dtype=D), mask)
    assert_close(far, [[math.exp(20) - 21]])


def test_generalized_jsd_golden() -> None:
    # Student [.5, .5], teacher [.25, .75].
    student = torch.log(torch.tensor([[[0.5, 0.5]]], dtype=D))
    teacher = torch.log(torch.tensor([[[0.25, 0.75]]], dtype=D))
    mask = torch.tensor([[True]])
    forward = 0.25 * LOG(0.25 / 0.5) + 0.75 * LOG(0.75 / 0.5)  # KL(p_T || p_S) = 0.130812
    reverse = 0.5 * LOG(0.5 / 0.25) + 0.5 * LOG(0.5 / 0.75)  # KL(p_S || p_T) = 0.143841
    # beta = .5: m = [.375, .625]; .5 KL(p_T || m) + .5 KL(p_S || m) = 0.033822
    mixture = 0.5 * (0.25 * LOG(0.25 / 0.375) + 0.75 * LOG(0.75 / 0.625)) + 0.5 * (
        0.5 * LOG(0.5 / 0.375) + 0.5 * LOG(0.5 / 0.625)
    )
    for beta, value in ((0.0, forward), (1.0, reverse), (0.5, mixture)):
        assert_close(rlo.generalized_jsd_loss(student, teacher, mask, beta=beta), value)
    # The endpoints are special cases: beta = 1e-6 gives about 1e-6 * KL(p_T || p_S).
    tiny = rlo.generalized_jsd_loss(student, teacher, mask, beta=1e-6)
    assert 0 < float(tiny) < 2e-6 * forward
    # beta = 0 gradient q - p_T = [.25, -.25]; beta = 1: q (l_S - l_T - KL).
    x = student.clone().requires_grad_(True)
    rlo.generalized_jsd_loss(x, teacher, mask, beta=0.0).backward()
    assert x.grad is not None
    assert_close(x.grad[0, 0], [0.25, -0.25])


# --- the float64 references on random batches ---------------------------------------------------


@st.composite
def _shapes(draw: Any) -> dict[str, Any]:
    return {
        "seed": draw(st.integers(0, 2**16)),
        "batch": draw(st.integers(1, 3)),
        "steps": draw(st.integers(1, 4)),
        "vocab": draw(st.integers(2, 9)),
        "slots": draw(st.integers(1, 5)),
        "temperature": draw(st.sampled_from((1.0, 0.7))),
        "reduction": draw(st.sampled_from(REDUCTIONS)),
        "chunk_size": draw(st.sampled_from((None, 1, 2, 5))),
    }


@settings(max_examples=30)
@given(shape=_shapes(), mode=st.sampled_from(("tail", "head", "renormalize")))
def test_topk_forward_kl_equals_the_reference(shape: dict[str, Any], mode: str) -> None:
    b = _batch(shape["seed"], shape["batch"], shape["steps"], shape["vocab"], shape["slots"])
    options = {"tail": mode == "tail", "renormalize": mode == "renormalize"}
    tau, reduction, mask = shape["temperature"], shape["reduction"], b["mask"]

    def ours(x: torch.Tensor) -> torch.Tensor:
        return rlo.topk_forward_kl(
            x,
            b["log_probs"],
            b["ids"],
            mask,
            temperature=tau,
            reduction=reduction,
            chunk_size=shape["chunk_size"],
            **options,
        )

    def theirs(x: torch.Tensor) -> torch.Tensor:
        per_token = reference.topk_forward_kl(
            x, b["log_probs"], b["ids"], mask, temperature=tau, **options
        )
        return _reduce(per_token, mask, reduction)

    value, grad = _value_and_grad(ours, b["logits"])
    expected, expected_grad = _value_and_grad(theirs, b["logits"])
    assert_close(value, expected)
    assert_close(grad, expected_grad)


@settings(max_examples=20)
@given(shape=_shapes(), beta=st.sampled_from((0.0, 0.3, 1.0)))
def test_generalized_jsd_equals_the_reference(shape: dict[str, Any], beta: float) -> None:
    b = _batch(shape["seed"], shape["batch"], shape["steps"], shape["vocab"], 1)
    tau, reduction, mask = shape["temperature"], shape["reduction"], b["mask"]

    def ours(x: torch.Tensor) -> torch.Tensor:
        return rlo.generalized_jsd_loss(
            x,
            b["teacher_logits"],
            mask,
            beta=beta,
            temperature=tau,
            reduction=reduction,
            chunk_size=shape["chunk_size"],
        )

    def theirs(x: torch.Tensor) -> torch.Tensor:
        per_token = reference.generalized_jsd(
            x, b["teacher_logits"], mask, beta=beta, temperature=tau
        )
        return _reduce(per_token, mask, reduction)

    value, grad = _value_and_grad(ours, b["logits"])
    expected, expected_grad = _value_and_grad(theirs, b["logits"])
    assert_close(value, expected)
    assert_close(grad, expected_grad)


@settings(max_examples=20)
@given(
    shape=_shapes(),
    estimator=st.sampled_from(("k1", "k2", "k3", "abs")),
    straight_through=st.booleans(),
)
def test_reverse_kl_loss_equals_the_reference(
    shape: dict[str, Any], estimator: str, straight_through: bool
) -> None:
    b = _batch(shape["seed"], shape["batch"], shape["steps"], shape["vocab"], 1)
    tau, reduction, mask = shape["temperature"], shape["reduction"], b["mask"]
    options = {"estimator": estimator, "straight_through": straight_through}

    def ours(x: torch.Tensor) -> torch.Tensor:
        return rlo.reverse_kl_loss(
            x,
            b["tokens"],
            b["teacher_token"],
            mask,
            temperature=tau,
            reduction=reduction,
            chunk_size=shape["chunk_size"],
            **options,
        )

    def theirs(x: torch.Tensor) -> torch.Tensor:
        student = reference.token_log_probs(x, b["tokens"], mask, temperature=tau)
        return reference.kl_loss(student, b["teacher_token"], mask, reduction=reduction, **options)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
        value, grad = _value_and_grad(ours, b["logits"])
    expected, expected_grad = _value_and_grad(theirs, b["logits"])
    assert_close(value, expected)
    assert_close(grad, expected_grad)


def _hidden_losses(b: dict[str, torch.Tensor], **options: Any) -> dict[str, Any]:
    """(from hidden, from logits) pairs of the three losses, the same options."""
    mask = b["mask"]
    teacher_hidden, teacher_head = b["teacher_hidden"], b["teacher_head"]  # H_T = 2
    teacher_logits = teacher_hidden @ teacher_head.T
    return {
        "topk": (
            lambda h, w, c: rlo.topk_forward_kl_from_hidden(
                h, w, b["log_probs"], b["ids"], mask, bias=c, **options
            ),
            lambda z: rlo.topk_forward_kl(z, b["log_probs"], b["ids"], mask, **options),
        ),
        "jsd": (
            lambda h, w, c: rlo.generalized_jsd_loss_from_hidden(
                h, w, teacher_hidden, teacher_head, mask, bias=c, beta=0.3, **options
            ),
            lambda z: rlo.generalized_jsd_loss(z, teacher_logits, mask, beta=0.3, **options),
        ),
        "reverse": (
            lambda h, w, c: rlo.reverse_kl_loss_from_hidden(
                h, w, b["tokens"], b["teacher_token"], mask, bias=c, estimator="k2", **options
            ),
            lambda z: rlo.reverse_kl_loss(
                z, b["tokens"], b["teacher_token"], mask, estimator="k2", **options
            ),
        ),
    }


@settings(max_examples=15)
@given(shape=_shapes(), loss=st.sampled_from(("topk", "jsd", "reverse")), grad=st.booleans())
def test_from_hidden_equals_from_logits(shape: dict[str, Any], loss: str, grad: bool) -> None:
    # grad=False: under no_grad (the recompute Function's forward), else the fused path for a
    # reduced loss and the recompute path for "none".
    b = _batch(shape["seed"], shape["batch"], shape["steps"], shape["vocab"], shape["slots"])
    options = {"temperature": shape["temperature"], "reduction": shape["reduction"]}
    from_hidden, from_logits = _hidden_losses(b, **options)[loss]
    leaves = [b[name].clone().requires_grad_(grad) for name in ("hidden", "weight", "bias")]
    with torch.set_grad_enabled(grad):
        value = from_hidden(*leaves)
    logits = (leaves[0].detach() @ leaves[1].detach().T + leaves[2].detach()).requires_grad_(True)
    expected = from_logits(logits)
    assert_close(value, expected)
    if not grad:
        return
    weights = 0.5 + torch.arange(value.numel(), dtype=D).reshape(value.shape) % 3 / 4
    (value * weights).sum().backward()
    (expected * weights).sum().backward()
    assert logits.grad is not None
    rows = logits.grad.reshape(-1, logits.shape[-1])
    hidden_rows = b["hidden"].reshape(-1, b["hidden"].shape[-1])
    assert_close(leaves[0].grad, (rows @ b["weight"]).reshape(b["hidden"].shape))
    assert_close(leaves[1].grad, rows.T @ hidden_rows)
    assert_close(leaves[2].grad, rows.sum(0))


def test_from_hidden_chunk_sizes_and_low_precision_heads() -> None:
    b = _batch(3, 2, 5, 11, 4)
    expected = rlo.topk_forward_kl_from_hidden(
        b["hidden"], b["weight"], b["log_probs"], b["ids"], b["mask"], bias=b["bias"]
    )
    for chunk in (1, 3, 10):
        actual = rlo.topk_forward_kl_from_hidden(
            b["hidden"],
            b["weight"],
            b["log_probs"],
            b["ids"],
            b["mask"],
            bias=b["bias"],
            chunk_size=chunk,
        )
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-13)
    # bf16 head: the product in float32 (fp32_head=True, the default) or rounded to bf16 (as the
    # model's own product, fp32_head=False), the softmax and the KL in float32.
    head = [b[n].to(torch.bfloat16).requires_grad_(True) for n in ("hidden", "weight", "bias")]
    for fp32_head in (True, False):
        loss = rlo.topk_forward_kl_from_hidden(
            head[0], head[1], b["log_probs"].float(), b["ids"], b["mask"], bias=head[2],
            fp32_head=fp32_head,
        )  # fmt: skip
        loss.backward()
        assert loss.dtype == torch.float32 and head[0].grad is not None
        assert head[0].grad.dtype == torch.bfloat16 and head[1].grad is not None
        hidden, weight, bias = (t.detach() for t in head)
        if fp32_head:  # the exact product of the bf16 numbers
            logits = torch.addmm(bias.double(), hidden.reshape(-1, 3).double(), weight.double().T)
        else:  # the bf16 logits the model's own product gives
            logits = torch.addmm(bias, hidden.reshape(-1, 3), weight.T).double()
        logits = logits.reshape(*b["mask"].shape, -1)
        reference_loss = _reduce(
            reference.topk_forward_kl(logits, b["log_probs"], b["ids"], b["mask"]),
            b["mask"],
            "token_mean",
        )
        assert_close(loss, reference_loss, torch.float32)


# --- numerics -------------------------------------------------------------------------------------


def test_student_tail_mass_is_exact_in_float32() -> None:
    # V = 32000, K = 16: the student puts all but a 4.4e-6 tail on the teacher's 16 tokens.
    # 1 - sum(top-k probabilities) in float32 is 17% off there; the complement's log-sum-exp
    # is exact to float32 rounding.
    vocab, slots = 32000, 16
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1, vocab, generator=generator, dtype=D)
    logits[0, 0, :slots] += 20.0
    log_q = torch.log_softmax(logits, -1)
    exact_tail = float(log_q[0, 0, slots:].exp().sum())
    assert 3e-6 < exact_tail < 6e-6
    ids = torch.arange(slots).reshape(1, 1, slots)
    teacher = torch.log(torch.full((1, 1, slots), 0.9 / slots, dtype=D))  # teacher tail 0.1
    mask = torch.tensor([[True]])
    expected = rlo.topk_forward_kl(logits, teacher, ids, mask)
    actual = rlo.topk_forward_kl(logits.float(), teacher.float(), ids, mask)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=0)
    naive_tail = 1 - float(torch.log_softmax(logits.float(), -1)[0, 0, :slots].exp().sum())
    assert abs(naive_tail - exact_tail) / exact_tail > 0.05  # what the library avoids


def test_bf16_logits_are_computed_in_float32() -> None:
    b = _batch(5, 2, 4, 13, 4)
    logits = b["logits"].to(torch.bfloat16)
    for loss, expected in (
        (
            rlo.topk_forward_kl(logits, b["log_probs"].float(), b["ids"], b["mask"]),
            reference.topk_forward_kl(logits.double(), b["log_probs"], b["ids"], b["mask"]),
        ),
        (
            rlo.generalized_jsd_loss(logits, b["teacher_logits"].bfloat16(), b["mask"]),
            reference.generalized_jsd(
                logits.double(), b["teacher_logits"].bfloat16().double(), b["mask"], beta=0.5
            ),
        ),
    ):
        assert loss.dtype == torch.float32
        assert_close(loss, _reduce(expected, b["mask"], "token_mean"), torch.float32)


# --- layouts -------------------------------------------------------------------------------------


def test_strided_logits_are_read_without_a_copy() -> None:
    b = _batch(11, 2, 5, 7, 3)
    wide = torch.cat([b["logits"], torch.full_like(b["logits"][:, :1], math.nan)], 1)
    strided = wide[:, :-1]  # (B, T, V) not viewable as (B T, V)
    assert not strided.is_contiguous()
    for fn in (
        lambda z: rlo.topk_forward_kl(z, b["log_probs"], b["ids"], b["mask"], chunk_size=2),
        lambda z: rlo.generalized_jsd_loss(z, b["teacher_logits"], b["mask"], chunk_size=2),
    ):
        torch.testing.assert_close(fn(strided), fn(b["logits"]), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("loss", ["topk", "jsd", "reverse"])
@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_micro_batches_add_up_with_explicit_normalizers(loss: str, path: str) -> None:
    # Two micro-batches (rows 0..1 and 2..3) with the global token count as the normaliser:
    # the losses and the gradients add up to the full batch's (token_mean).
    b = _batch(21, 4, 5, 9, 3)
    total = float(b["mask"].sum())

    def run(rows: slice, normalizer: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        part = {k: (v[rows] if v.ndim >= 2 and v.shape[0] == 4 else v) for k, v in b.items()}
        from_hidden, from_logits = _hidden_losses(part, normalizer=normalizer)[loss]
        if path == "hidden":
            weight = part["weight"].clone().requires_grad_(True)
            value = from_hidden(part["hidden"], weight, part["bias"])
        else:
            weight = part["logits"].clone().requires_grad_(True)
            value = from_logits(weight)
        value.backward()
        assert weight.grad is not None
        return value.detach(), weight.grad

    full, full_grad = run(slice(0, 4), None)
    first, first_grad = run(slice(0, 2), total)
    second, second_grad = run(slice(2, 4), total)
    assert_close(first + second, full)
    if path == "hidden":
        assert_close(first_grad + second_grad, full_grad)
    else:
        assert_close(torch.cat([first_grad, second_grad]), full_grad)


# --- the peers' numbers on their batches -------------------------------------------------------


def test_topk_forward_kl_equals_verl_trl_and_nemo_rl() -> None:
    b = topk_batch()
    everything = torch.ones(1, 41, dtype=torch.bool)
    x = b["student"][None].clone().requires_grad_(True)
    head = rlo.topk_forward_kl(
        x, b["log_probs"][None], b["ids"][None], everything, tail=False, reduction="none"
    )
    head.sum().backward()
    check("verl_forward_kl_topk", head, tol=2e-6)  # verl computes in float32
    assert x.grad is not None
    check("verl_forward_kl_topk_grad", x.grad, tol=2e-6)
    labels_mask = b["mask"][None]
    for tail in (True, False):
        x = b["student"][None].clone().requires_grad_(True)
        per_token = rlo.topk_forward_kl(
            x,
            b["padded_log_probs"][None],
            b["padded_ids"][None],
            everything,
            tail=tail,
            renormalize=not tail,
            reduction="none",
        )
        per_token.sum().backward()
        check(f"trl_server_per_token_tail={tail}", per_token)
        assert x.grad is not None
        check(f"trl_server_grad_tail={tail}", x.grad)
        batchmean = rlo.topk_forward_kl(
            b["student"][None],
            b["padded_log_probs"][None],
            b["padded_ids"][None],
            labels_mask,
            tail=tail,
            renormalize=not tail,
        )
        check(f"trl_server_batchmean_tail={tail}", batchmean)
    nemo = rlo.topk_forward_kl(
        b["student"][None],
        b["log_probs"][None],
        b["ids"][None],
        everything,
        renormalize=True,
        reduction="none",
    )
    check("nemo_forward_zero_outside_topk=False", nemo)
    over_k = torch.log_softmax(b["log_probs"], -1)[None]  # the teacher's top-k renormalised
    nemo = rlo.topk_forward_kl(
        b["student"][None], over_k, b["ids"][None], everything, reduction="none"
    )
    check("nemo_forward_zero_outside_topk=True", nemo)
    # 0 <= the tail-bucket KL <= the full forward KL (the teacher's log-probabilities exact).
    bucket = rlo.topk_forward_kl(
        b["student"][None], b["log_probs"][None], b["ids"][None], everything, reduction="none"
    )[0]
    teacher = b["teacher_full"]
    full = (teacher.exp() * (teacher - torch.log_softmax(b["student"], -1))).sum(-1)
    assert (bucket >= -1e-15).all() and (bucket <= full + 1e-12).all()


def test_reverse_kl_equals_verl_nemo_rl_and_slime() -> None:
    b = reverse_batch()
    student, teacher, mask = b["student"], b["teacher"], b["mask"]
    everything = torch.ones_like(mask)
    unbounded = rlo.kl_estimate(student, teacher, everything, estimator="k1", log_ratio_bound=None)
    check("verl_kl_penalty_k1", unbounded)
    k3 = rlo.kl_estimate(student, teacher, everything)  # bound 20 (verl's), then verl's clamp 10
    check("verl_kl_penalty_k3", k3.clamp(max=10.0))
    check("nemo_calculate_kl_k3", k3.clamp(max=10.0))
    rewards = rlo.reverse_kl_rewards(student, teacher, mask)
    check("nemo_opd", rewards)
    check("slime_opd_selected", rewards[mask])


def test_generalized_jsd_equals_trl() -> None:
    b = jsd_batch()
    mask = b["labels"] != -100
    count, vocab = float(mask.sum()), b["student"].shape[-1]
    for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
        for tau in (1.0, 0.7):
            for reduction, normalizer in (
                ("batchmean", None),
                ("sum", 1.0),
                ("mean", count * vocab),
            ):
                x = b["student"].clone().requires_grad_(True)
                loss = rlo.generalized_jsd_loss(
                    x, b["teacher"], mask, beta=beta, temperature=tau, normalizer=normalizer
                )
                loss.backward()
                check(f"trl_gjsd_{beta}_{tau}_{reduction}", loss)
                assert x.grad is not None
                check(f"trl_gjsd_grad_{beta}_{tau}_{reduction}", x.grad)
            items = rlo.generalized_jsd_loss(
                b["student"], b["teacher"], mask, beta=beta, temperature=tau, normalizer=40
            )
            check(f"trl_gjsd_{beta}_{tau}_num_items", items)
    everything = torch.ones_like(mask)  # TRL batchmean without labels: sum / B
    no_labels = rlo.generalized_jsd_loss(b["student"], b["teacher"], everything, normalizer=3)
    check("trl_gjsd_nolabels", no_labels)


# --- behaviour ------------------------------------------------------------------------------------


def test_reverse_kl_rewards_are_detached_constants() -> None:
    student = torch.log(torch.tensor([[0.5, 0.2, 0.9]], dtype=D)).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.25, 0.4, 0.9]], dtype=D))
    mask = torch.tensor([[True, True, False]])
    rewards = rlo.reverse_kl_rewards(student, teacher, mask, coef=2.0)
    assert not rewards.requires_grad
    assert_close(rewards, [[2 * LOG(0.5), 2 * LOG(2.0), 0.0]])  # c (l_T - l_S)
    assert str(rewards[0, 2].item()) == "0.0"  # +0, not -0
    with pytest.warns(rlo.BiasedGradientWarning, match="k3"):
        rlo.reverse_kl_rewards(student, teacher, mask, estimator="k3")
    with pytest.warns(rlo.BiasedGradientWarning, match="bound"):
        rlo.reverse_kl_rewards(student, teacher, mask, log_ratio_bound=5.0)


def test_biased_loss_estimators_warn() -> None:
    b = _batch(1, 1, 2, 5, 1)
    args = (b["logits"], b["tokens"], b["teacher_token"], b["mask"])
    with pytest.warns(rlo.BiasedGradientWarning, match="reverse_kl_loss"):
        rlo.reverse_kl_loss(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rlo.reverse_kl_loss(*args, estimator="k2")
        rlo.reverse_kl_loss(*args, straight_through=True)


def test_teacher_inputs_get_no_gradient() -> None:
    b = _batch(2, 2, 3, 6, 3)
    teacher = b["teacher_logits"].clone().requires_grad_(True)
    top = b["log_probs"].clone().requires_grad_(True)
    loss = rlo.generalized_jsd_loss(b["logits"].requires_grad_(True), teacher, b["mask"])
    loss = loss + rlo.topk_forward_kl(b["logits"], top, b["ids"], b["mask"])
    loss.backward()
    assert teacher.grad is None and top.grad is None


def test_the_fused_path_supports_one_backward() -> None:
    b = _batch(4, 2, 3, 6, 3)
    hidden = b["hidden"].clone().requires_grad_(True)
    loss = rlo.topk_forward_kl_from_hidden(hidden, b["weight"], b["log_probs"], b["ids"], b["mask"])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


@pytest.mark.compile
def test_topk_forward_kl_from_hidden_traces_with_fullgraph() -> None:
    b = _batch(6, 2, 3, 6, 3)
    teacher, ids, mask = b["log_probs"].float(), b["ids"], b["mask"]

    def loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rlo.topk_forward_kl_from_hidden(hidden, weight, teacher, ids, mask)

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    results = []
    for function in (loss, compiled):
        hidden = b["hidden"].float().clone().requires_grad_(True)
        weight = b["weight"].float().clone().requires_grad_(True)
        value = function(hidden, weight)
        value.backward()
        results.append((value.detach(), hidden.grad, weight.grad))
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected)
