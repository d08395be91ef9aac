"""DPPO and DRO on hostile inputs: a sampled token of probability 0, decisions on the inputs.

A token with :math:`\\ell = -\\infty` (probability 0 under the current policy, e.g. a sample
outside a recomputed kept set) contributes value and gradient 0 and stays in the denominator,
never NaN; DPPO decides its trust region on :math:`\\ell` and :math:`\\ell^{old}` as given (in
float64), never on :math:`\\ell^{old}` rebuilt as :math:`\\ell - \\mathrm{fl}(\\Delta)`.
"""

from __future__ import annotations

import math

import pytest
import torch

import rlobjectives as rlo
from tolerances import assert_close

F64 = torch.float64
SURROGATES = {
    "dppo-tv": rlo.DPPO("tv"),
    "dppo-kl": rlo.DPPO("kl"),
    "dppo-tv-nocap": rlo.DPPO("tv", ratio_cap=None),
    "dro": rlo.DRO(beta=0.1),
    "cispo": rlo.CISPO(cap=5.0),
    "vespo": rlo.VESPO(),
    "probability_band": rlo.ProbabilityBand(kappa=0.1),
}


@pytest.mark.parametrize("name", sorted(SURROGATES))
@pytest.mark.parametrize("advantage", [-1.0, 1.0])
def test_zero_probability_token_gives_zero_not_nan(name: str, advantage: float) -> None:
    # t0: l = -inf (p = 0), p_old = e^-0.3 = 0.74; t1: l = -1, l_old = -1.1, r = e^0.1.
    # For DPPO with A = -1, t0 is outside the trust region (p - p_old = -0.74 < -0.2); with
    # A = +1 it is inside by the rule but has no probability mass: value and gradient 0 either
    # way, and the token counts in the token mean's denominator (2 tokens).
    log_probs = torch.tensor([[-math.inf, -1.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.3, -1.1]], dtype=F64)
    advantages = torch.tensor([advantage], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = rlo.policy_loss(log_probs, old, advantages, mask, surrogate=SURROGATES[name])
    (grad,) = torch.autograd.grad(out.loss, [log_probs])
    assert torch.isfinite(out.loss), name
    assert torch.isfinite(grad).all() and grad[0, 0] == 0.0, (name, grad)
    for value in out.diagnostics:  # k1 of a zero-probability token is +inf, never NaN
        assert not torch.isnan(value), (name, out.diagnostics)
    # the finite token alone, divided by the two tokens of the mean
    alone = rlo.policy_loss(
        log_probs.detach()[:, 1:].requires_grad_(True), old[:, 1:], advantages, mask[:, 1:],
        surrogate=SURROGATES[name], normalizer=2.0,
    )  # fmt: skip
    if name == "probability_band":  # its penalty of the bounded log-ratio -20: a constant there
        assert_close(out.loss, alone.loss + 0.1 * 400.0 / 2)
    elif name != "vespo":  # VESPO's sequence weight reads the whole sequence's log-ratio
        assert_close(out.loss, alone.loss)


def test_dro_golden_with_a_zero_probability_token() -> None:
    # DRO, beta = 0.1: t1 alone, s = l A - beta/2 Delta^2 = -1 (-1) - 0.05 (0.1)^2 = 0.9995;
    # loss = -0.9995 / 2 (t0 counts in the denominator); d/dl1 = -(A - beta Delta) / 2
    # = -(-1 - 0.01) / 2 = 0.505.
    log_probs = torch.tensor([[-math.inf, -1.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.3, -1.1]], dtype=F64)
    out = rlo.policy_loss(
        log_probs, old, torch.tensor([-1.0], dtype=F64), torch.ones(1, 2, dtype=torch.bool),
        surrogate=rlo.DRO(beta=0.1),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, [log_probs])
    assert_close(out.loss, torch.tensor(-0.9995 / 2, dtype=F64))
    assert_close(grad, torch.tensor([[0.0, 0.505]], dtype=F64))


@pytest.mark.parametrize("surrogate", [rlo.DPPO("tv"), rlo.DRO(beta=0.1)], ids=["dppo", "dro"])
def test_from_hidden_token_outside_the_recomputed_kept_set(surrogate: rlo.Surrogate) -> None:
    # top_k = 1 keeps only the argmax: a sampled token that is not the argmax has l = -inf.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    old = -torch.rand(2, 3, generator=g, dtype=F64) - 0.2
    out = rlo.fused_policy_loss_from_hidden(
        hidden, weight, tokens, old, torch.tensor([-1.0, 1.0], dtype=F64),
        torch.ones(2, 3, dtype=torch.bool), top_k=1, surrogate=surrogate,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss, [hidden, weight])
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert torch.isinf(out.log_probs).any()  # the case does exercise a token outside the set


def test_dppo_tv_float32_decision_on_the_inputs_as_given() -> None:
    # e^l - e^l_old with these float32 inputs is exactly 0.2 - 9.1e-9 (in float64 from the
    # given values): inside the trust region, so nothing is clipped and s = r A (no cap).
    log_probs = torch.tensor([[-0.01902659982442856]], dtype=torch.float32)
    old = torch.tensor([[-0.24698390066623688]], dtype=torch.float32)
    gap = math.exp(float(log_probs)) - math.exp(float(old))
    assert 0.2 - 1e-8 < gap < 0.2  # the case is what the comment says
    out = rlo.policy_loss(
        log_probs.requires_grad_(True), old, torch.tensor([1.0]), torch.ones(1, 1, dtype=bool),
        surrogate=rlo.DPPO("tv", ratio_cap=None),
    )  # fmt: skip
    assert out.diagnostics.clipped_fraction == 0.0
    assert out.loss != 0.0  # kept: -r A


@pytest.mark.parametrize(
    ("log_prob", "kept"),
    [
        # D(p_old || p) - 0.05 = -3.26e-9 from the given float32 values: inside (A <= 0);
        # rebuilding l_old = l - fl32(l - l_old) gives +3.4e-9, outside.
        (-0.22692999243736267, True),
        # one float32 step lower: D - 0.05 = +5.23e-9 (outside); the rebuilt l_old: inside.
        (-0.22693000733852386, False),
    ],
)
def test_dppo_kl_float32_decision_on_the_inputs_as_given(log_prob: float, kept: bool) -> None:
    log_probs = torch.tensor([[log_prob]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-0.09142301231622696]], dtype=torch.float32)
    out = rlo.policy_loss(
        log_probs, old, torch.tensor([-1.0]), torch.ones(1, 1, dtype=bool),
        surrogate=rlo.DPPO("kl", ratio_cap=None),
    )  # fmt: skip
    assert out.diagnostics.clipped_fraction == (0.0 if kept else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sampled_log_probs_is_torch_where_and_keeps_no_bool(dtype: torch.dtype) -> None:
    # sampled_log_probs(l) = where(l > -inf, l, 0): l = -1.5 -> -1.5 (grad 1); -inf, NaN -> 0
    # (grad 0); +inf -> +inf (grad 1), the gradient of torch.where. What it keeps for the backward
    # is an int8 selection, never a bool (a bool the compiled CPU backward stores slowly).
    from rlobjectives.policy.surrogates.base import sampled_log_probs

    values = [-1.5, -math.inf, math.nan, math.inf, 0.0]
    log_probs = torch.tensor(values, dtype=dtype, requires_grad=True)
    saved: list[torch.dtype] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = sampled_log_probs(log_probs)
    expected = torch.tensor([-1.5, 0.0, 0.0, math.inf, 0.0], dtype=dtype)
    assert torch.equal(out.detach(), expected) and out.dtype == dtype
    weights = torch.tensor([2.0, 3.0, 5.0, 7.0, 11.0], dtype=dtype, requires_grad=True)
    (grad,) = torch.autograd.grad((out * weights).sum(), [log_probs], create_graph=True)
    assert torch.equal(grad.detach(), torch.tensor([2.0, 0.0, 0.0, 7.0, 11.0], dtype=dtype))
    assert saved == [torch.int8], saved
    reference = torch.tensor(values, dtype=dtype, requires_grad=True)
    kept = torch.where(reference > -math.inf, reference, 0.0)
    (reference_grad,) = torch.autograd.grad((kept * weights.detach()).sum(), [reference])
    assert torch.equal(grad.detach(), reference_grad)
    # the backward is differentiable (create_graph): d sum(grad) / d weights is the selection
    (second,) = torch.autograd.grad(grad.sum(), [weights])
    assert torch.equal(second, torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=dtype))


def test_sampled_log_probs_under_torch_func() -> None:
    # torch.func.grad and vmap of the selection give torch.where's: weights where l > -inf
    from rlobjectives.policy.surrogates.base import sampled_log_probs

    log_probs = torch.tensor([[-0.5, -math.inf], [math.nan, -2.0]], dtype=F64)
    weights = torch.tensor([[2.0, 3.0], [5.0, 7.0]], dtype=F64)
    grad = torch.func.grad(lambda values: (sampled_log_probs(values) * weights).sum())(log_probs)
    assert torch.equal(grad, torch.tensor([[2.0, 0.0], [0.0, 7.0]], dtype=F64))
    rows = torch.func.vmap(sampled_log_probs)(log_probs)
    assert torch.equal(rows, torch.tensor([[-0.5, 0.0], [0.0, -2.0]], dtype=F64))
