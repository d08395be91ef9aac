"""The preference objects and ``preference_loss`` (issue 34) against the float64 references.

Golden values derived by hand (arithmetic in the comments); every objective, combination and
option (LD-DPO, the NLL mask, WPO, the normalisers) against the loop reference of
``tests/reference.py`` on random odd shapes with empty responses (hypothesis), values and
gradients; AOT against its sorting reference; empty batches give zeros; micro-batches with
global normalisers add up to the full batch; bf16 computes in float32; the objects' field
checks; reference-free objectives refuse references and the others require them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from rlobjectives import (
    AOT,
    BCO,
    CPO,
    DPO,
    EXO,
    IPO,
    NCA,
    ORPO,
    SFT,
    APODown,
    APOZero,
    DiscoPOP,
    Hinge,
    PreferenceObjective,
    RobustDPO,
    SimPO,
    SPPOHard,
    preference_loss,
)
from rlobjectives.preference import Combination
from tolerances import assert_close

D = torch.float64


def gradients(loss: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """The gradients of ``loss`` with respect to ``inputs``, flattened (0 where unused)."""
    if not loss.requires_grad:
        return torch.cat([torch.zeros(t.numel(), dtype=t.dtype) for t in inputs])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return torch.cat([
        (torch.zeros_like(t) if g is None else g).reshape(-1)
        for g, t in zip(grads, inputs, strict=True)
    ])  # fmt: skip


def terms(objective: PreferenceObjective) -> list[tuple[float, str, dict[str, Any]]]:
    """The reference's description of an objective: its fields, not its formula."""
    parts = objective.parts if isinstance(objective, Combination) else ((1.0, objective),)
    return [(float(w), o.name, dataclasses.asdict(o)) for w, o in parts]  # type: ignore[call-overload]


OBJECTIVES: list[PreferenceObjective] = [
    DPO(beta=0.3),
    DPO(beta=0.2, label_smoothing=0.15),
    DPO(beta=0.2, f_divergence="forward_kl"),
    DPO(beta=0.2, f_divergence="js_divergence", length_normalized=True),
    DPO(beta=0.2, f_divergence="alpha_divergence", alpha=0.3),
    DPO(beta=0.2, f_divergence="alpha_divergence", alpha=1.0),
    IPO(beta=0.4),
    IPO(beta=0.4, length_normalized=False, f_divergence="forward_kl"),
    Hinge(beta=0.6),
    RobustDPO(beta=0.3, label_smoothing=0.2),
    EXO(beta=0.3, epsilon=0.01, f_divergence="js_divergence"),
    NCA(beta=0.5),
    BCO(beta=0.5, delta=0.2),
    SPPOHard(beta=0.7),
    APOZero(beta=0.5),
    APODown(beta=0.5),
    DiscoPOP(beta=0.3, tau=0.4),
    SimPO(beta=1.5, gamma=0.3, label_smoothing=0.1),
    ORPO(beta=0.2),
    CPO(beta=0.3, nll_coef=0.5, label_smoothing=0.05),
    SFT(),
    0.8 * DPO(beta=0.1) + 0.2 * BCO(beta=0.1) + 1.0 * SFT(),  # MPO
    0.5 * SimPO(beta=2.0, gamma=0.5) + 0.3 * SFT(),  # CPO-SimPO
]


# --- golden values, by hand ---------------------------------------------------------------------


def _one_pair(chosen: list[float], rejected: list[float]) -> tuple[torch.Tensor, ...]:
    c = torch.tensor([chosen], dtype=D, requires_grad=True)
    r = torch.tensor([rejected], dtype=D, requires_grad=True)
    return c, r, torch.ones_like(c, dtype=torch.bool), torch.ones_like(r, dtype=torch.bool)


def test_dpo_golden() -> None:
    # S_c = -1 - 2 = -3, R_c = -3.5 (x_c = 0.5); S_r = -4, R_r = -3 (x_r = -1); u = 1.5;
    # beta = 0.5: z = 0.75, L = softplus(-0.75) = log(1 + e^-0.75) = 0.39858...;
    # dL/dS_c = -beta sigma(-z) = -0.5 * 0.32082 = -0.16041 on each chosen token.
    c, r, mc, mr = _one_pair([-1.0, -2.0], [-4.0])
    out = preference_loss(c, r, mc, mr, ref_chosen_log_probs=torch.tensor([-3.5], dtype=D),
                          ref_rejected_log_probs=torch.tensor([-3.0], dtype=D),
                          objective=DPO(beta=0.5))  # fmt: skip
    assert_close(out.loss, math.log1p(math.exp(-0.75)))
    out.loss.backward()
    sig = 1 / (1 + math.exp(0.75))
    assert_close(c.grad, torch.tensor([[-0.5 * sig, -0.5 * sig]]))
    assert_close(r.grad, torch.tensor([[0.5 * sig]]))
    assert_close(out.chosen_rewards, [0.25])  # 0.5 * 0.5
    assert_close(out.rejected_rewards, [-0.5])  # 0.5 * -1
    assert_close(out.margins, [0.75])
    assert_close(out.accuracy, [1.0])


def test_ipo_golden_length_normalized() -> None:
    # x_c = -3 - (-4) = 1 over 2 tokens -> 0.5; x_r = -1 - (-1) = 0 over 1 -> 0; u = 0.5;
    # beta = 0.25: L = (0.5 - 1 / 0.5)^2 = (0.5 - 2)^2 = 2.25; OpenRLHF's raw sums: (1 - 2)^2 = 1.
    c, r, mc, mr = _one_pair([-1.0, -2.0], [-1.0])
    refs = {"ref_chosen_log_probs": torch.tensor([-4.0], dtype=D),
            "ref_rejected_log_probs": torch.tensor([-1.0], dtype=D)}  # fmt: skip
    assert_close(preference_loss(c, r, mc, mr, objective=IPO(beta=0.25), **refs).loss, 2.25)
    raw = IPO(beta=0.25, length_normalized=False)
    assert_close(preference_loss(c, r, mc, mr, objective=raw, **refs).loss, 1.0)


def test_orpo_golden() -> None:
    # m_c = log 0.5, m_r = log 0.25: log odds = (log 0.5 - log 0.25) - (log 0.5 - log 0.75)
    # = log 2 + log 1.5 = log 3; -beta log sigma(log 3) = -0.1 log 0.75 = 0.028768...;
    # the NLL share of one pair is the token mean -m_c = log 2; L = log 2 - 0.1 log 0.75.
    c, r, mc, mr = _one_pair([math.log(0.5)], [math.log(0.25)])
    out = preference_loss(c, r, mc, mr, objective=ORPO(beta=0.1))
    assert_close(out.loss, math.log(2) - 0.1 * math.log(0.75))
    assert_close(out.chosen_rewards, [0.1 * math.log(0.5)])


def test_simpo_and_cpo_golden() -> None:
    # SimPO: m_c = -1, m_r = -2; z = 2 (1) - 0.5 = 1.5; L = softplus(-1.5) = 0.20141...
    c, r, mc, mr = _one_pair([-0.5, -1.5], [-2.0])
    assert_close(
        preference_loss(c, r, mc, mr, objective=SimPO(beta=2.0, gamma=0.5)).loss,
        math.log1p(math.exp(-1.5)),
    )
    # CPO: S_c - S_r = -2 + 2 = 0: -log sigma(0) = log 2; NLL token mean = (0.5 + 1.5) / 2 = 1;
    # L = log 2 + 0.3 * 1.
    cpo = preference_loss(c, r, mc, mr, objective=CPO(beta=0.1, nll_coef=0.3))
    assert_close(cpo.loss, math.log(2) + 0.3)


def test_combination_golden() -> None:
    # x_c = 0, x_r = 0 -> DPO: log 2; BCO: -log sigma(0) - log sigma(0) = 2 log 2;
    # SFT: token mean of -(-1) = 1. 0.8 log 2 + 0.2 * 2 log 2 + 1 = 1.2 log 2 + 1.
    c, r, mc, mr = _one_pair([-1.0], [-2.0])
    refs = {"ref_chosen_log_probs": c.detach(), "ref_rejected_log_probs": r.detach()}
    mpo = 0.8 * DPO() + 0.2 * BCO() + 1.0 * SFT()
    assert_close(preference_loss(c, r, mc, mr, objective=mpo, **refs).loss, 1.2 * math.log(2) + 1)


# --- against the float64 reference --------------------------------------------------------------


@st.composite
def batches(draw: Any) -> dict[str, Any]:
    pairs = draw(st.integers(0, 4))
    t_c, t_r = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    chosen = -torch.rand(pairs, t_c, generator=g, dtype=D) * 1.5 - 0.05
    rejected = -torch.rand(pairs, t_r, generator=g, dtype=D) * 1.5 - 0.05
    mc = torch.rand(pairs, t_c, generator=g) < 0.7
    mr = torch.rand(pairs, t_r, generator=g) < 0.7
    return {
        "chosen": chosen, "rejected": rejected, "mc": mc, "mr": mr,
        "ref_c": chosen + 0.3 * torch.randn(pairs, t_c, generator=g, dtype=D),
        "ref_r": rejected + 0.3 * torch.randn(pairs, t_r, generator=g, dtype=D),
        "nll": torch.rand(pairs, t_c, generator=g) < 0.8,
        "sq_c": chosen - torch.rand(pairs, t_c, generator=g, dtype=D),
        "sq_r": rejected - torch.rand(pairs, t_r, generator=g, dtype=D),
        "objective": draw(st.sampled_from(OBJECTIVES)),
        "ld_alpha": draw(st.sampled_from([None, 0.0, 0.4, 1.0])),
        "use_nll_mask": draw(st.booleans()),
        "wpo": draw(st.booleans()),
        "normalizers": draw(st.sampled_from([(None, None), (3.0, 11.0)])),
        "per_sequence_ref": draw(st.booleans()),
    }  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(batches())
def test_preference_loss_equals_the_reference(b: dict[str, Any]) -> None:
    objective = b["objective"]
    c = b["chosen"].clone().requires_grad_(True)
    r = b["rejected"].clone().requires_grad_(True)
    kwargs: dict[str, Any] = {"objective": objective, "ld_alpha": b["ld_alpha"]}
    ref_kwargs: dict[str, Any] = {"ld_alpha": b["ld_alpha"]}
    if objective.needs_reference:
        ref_c, ref_r = b["ref_c"], b["ref_r"]
        if b["per_sequence_ref"] and b["ld_alpha"] is None:  # already summed
            ref_c = torch.where(b["mc"], ref_c, 0.0).sum(-1)
            ref_r = torch.where(b["mr"], ref_r, 0.0).sum(-1)
        kwargs |= {"ref_chosen_log_probs": ref_c, "ref_rejected_log_probs": ref_r}
        ref_kwargs |= {"ref_chosen": ref_c, "ref_rejected": ref_r}
    if b["use_nll_mask"]:
        kwargs["nll_mask"] = ref_kwargs["nll_mask"] = b["nll"]
    if b["wpo"]:
        kwargs |= {"chosen_log_sum_sq_probs": b["sq_c"], "rejected_log_sum_sq_probs": b["sq_r"]}
        ref_kwargs |= {"chosen_sq": b["sq_c"], "rejected_sq": b["sq_r"]}
    norm, nll_norm = b["normalizers"]
    kwargs |= {"normalizer": norm, "nll_normalizer": nll_norm}
    ref_kwargs |= {"normalizer": norm, "nll_normalizer": nll_norm}
    out = preference_loss(c, r, b["mc"], b["mr"], **kwargs)
    c2 = b["chosen"].clone().requires_grad_(True)
    r2 = b["rejected"].clone().requires_grad_(True)
    expected = reference.preference_loss(c2, r2, b["mc"], b["mr"], terms(objective), **ref_kwargs)
    assert_close(out.loss, expected["loss"])
    assert_close(out.pair_losses, expected["pair_losses"].detach())
    assert torch.isfinite(out.loss)
    assert_close(gradients(out.loss, c, r), gradients(expected["loss"], c2, r2))


@pytest.mark.parametrize("unpaired", [False, True])
def test_aot_equals_the_reference(unpaired: bool) -> None:
    g = torch.Generator().manual_seed(3)
    chosen = -torch.rand(5, 4, generator=g, dtype=D) * 2
    rejected = -torch.rand(5, 3, generator=g, dtype=D) * 2
    mc = torch.rand(5, 4, generator=g) < 0.8
    mr = torch.rand(5, 3, generator=g) < 0.8
    mc[2] = False  # an empty response: left out of the sort
    ref_c, ref_r = chosen + torch.randn(5, 4, generator=g, dtype=D), rejected * 0.7
    c, c2 = chosen.clone().requires_grad_(True), chosen.clone().requires_grad_(True)
    objective = AOT(beta=0.4, label_smoothing=0.1, unpaired=unpaired)
    out = preference_loss(c, rejected, mc, mr, ref_chosen_log_probs=ref_c,
                          ref_rejected_log_probs=ref_r, objective=objective)  # fmt: skip
    expected = reference.aot_loss(c2, rejected, mc, mr, ref_c, ref_r, beta=0.4,
                                  label_smoothing=0.1, unpaired=unpaired)  # fmt: skip
    assert_close(out.loss, expected)
    out.loss.backward()
    expected.backward()
    assert_close(c.grad, c2.grad)


# --- empty inputs, micro-batches, dtypes ------------------------------------------------------


@pytest.mark.parametrize("objective", OBJECTIVES + [AOT()], ids=lambda o: o.name)
def test_empty_batches_and_responses_give_zeros(objective: PreferenceObjective) -> None:
    refs = {"ref_chosen_log_probs": torch.zeros(0, 0), "ref_rejected_log_probs": torch.zeros(0, 3)}
    refs = refs if objective.needs_reference else {}
    out = preference_loss(torch.zeros(0, 0), torch.zeros(0, 3), torch.zeros(0, 0),
                          torch.zeros(0, 3), objective=objective, **refs)  # fmt: skip
    assert out.loss.item() == 0.0 and out.pair_losses.shape == (0,)
    # every response empty (NaN where unselected): zeros, no NaN, zero gradient
    c = torch.full((2, 3), float("nan"), requires_grad=True)
    r = torch.full((2, 2), -float("inf"), requires_grad=True)
    refs = {"ref_chosen_log_probs": torch.full((2, 3), float("nan")),
            "ref_rejected_log_probs": torch.full((2, 2), float("inf"))}  # fmt: skip
    refs = refs if objective.needs_reference else {}
    out = preference_loss(c, r, torch.zeros(2, 3), torch.ones(2, 2), objective=objective, **refs)
    assert out.loss.item() == 0.0
    assert torch.equal(gradients(out.loss, c, r), torch.zeros(10))
    for value in out[1:]:
        assert torch.equal(value, torch.zeros(2))


@pytest.mark.parametrize("objective", [o for o in OBJECTIVES if o.pair_local], ids=lambda o: o.name)
def test_micro_batches_with_global_normalizers_add_up(objective: PreferenceObjective) -> None:
    g = torch.Generator().manual_seed(1)
    lengths_c, lengths_r = [3, 0, 5, 2, 4], [1, 4, 2, 0, 3]
    chosen = -torch.rand(5, 5, generator=g, dtype=D)
    rejected = -torch.rand(5, 4, generator=g, dtype=D)
    mc = torch.arange(5)[None] < torch.tensor(lengths_c)[:, None]
    mr = torch.arange(4)[None] < torch.tensor(lengths_r)[:, None]
    refs_c, refs_r = chosen * 0.9, rejected * 1.1
    valid = int(((mc.sum(-1) > 0) & (mr.sum(-1) > 0)).sum())
    nll_tokens = int(mc[(mc.sum(-1) > 0) & (mr.sum(-1) > 0)].sum())

    def call(rows: slice, c: torch.Tensor, r: torch.Tensor, **kw: Any) -> torch.Tensor:
        width_c, width_r = max(int(mc[rows].sum(-1).max()), 1), max(int(mr[rows].sum(-1).max()), 1)
        refs = {"ref_chosen_log_probs": refs_c[rows, :width_c],
                "ref_rejected_log_probs": refs_r[rows, :width_r]}  # fmt: skip
        return preference_loss(
            c[rows, :width_c], r[rows, :width_r], mc[rows, :width_c], mr[rows, :width_r],
            objective=objective, **(refs if objective.needs_reference else {}), **kw,
        ).loss  # fmt: skip

    c, r = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
    full = call(slice(0, 5), c, r)
    c2, r2 = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
    kw = {"normalizer": valid, "nll_normalizer": nll_tokens}
    parts = call(slice(0, 2), c2, r2, **kw) + call(slice(2, 5), c2, r2, **kw)
    assert_close(parts, full)
    assert_close(gradients(parts, c2, r2), gradients(full, c, r))
    local = (call(slice(0, 2), c2, r2) + call(slice(2, 5), c2, r2)) / 2  # mean of local means
    assert not torch.allclose(local, full)  # weighs the pairs unequally


def test_low_precision_inputs_compute_in_float32() -> None:
    g = torch.Generator().manual_seed(5)
    chosen = -torch.rand(3, 6, generator=g)
    rejected = -torch.rand(3, 4, generator=g)
    mask_c, mask_r = torch.ones(3, 6), torch.ones(3, 4)
    half = preference_loss(chosen.bfloat16(), rejected.bfloat16(), mask_c, mask_r,
                           ref_chosen_log_probs=chosen.bfloat16() * 0.9,
                           ref_rejected_log_probs=rejected.bfloat16())  # fmt: skip
    wide = preference_loss(chosen.bfloat16().float(), rejected.bfloat16().float(), mask_c,
                           mask_r, ref_chosen_log_probs=(chosen.bfloat16() * 0.9).float(),
                           ref_rejected_log_probs=rejected.bfloat16().float())  # fmt: skip
    assert half.loss.dtype == torch.bfloat16 and half.margins.dtype == torch.float32
    assert torch.equal(half.loss, wide.loss.bfloat16())  # the float32 result, rounded once
    assert torch.equal(half.margins, wide.margins)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_tensor_alpha_equals_its_number(alpha: float) -> None:
    # f-DPO's alpha-divergence at alpha = 1 is its limit x (a 0-d tensor alpha gave 0/0 = NaN)
    g = torch.Generator().manual_seed(8)
    chosen = (-torch.rand(2, 3, generator=g)).requires_grad_()
    rejected, ref = -torch.rand(2, 3, generator=g), -torch.rand(2, 3, generator=g)
    mask = torch.ones(2, 3)

    def run(value: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        objective = DPO(f_divergence="alpha_divergence", alpha=value)
        loss = preference_loss(chosen, rejected, mask, mask, ref_chosen_log_probs=ref,
                               ref_rejected_log_probs=ref, objective=objective).loss  # fmt: skip
        return loss, torch.autograd.grad(loss, chosen)[0]

    number, tensor = run(alpha), run(torch.tensor(alpha))
    assert torch.isfinite(tensor[0]) and torch.isfinite(tensor[1]).all()
    assert_close(tensor[0], number[0])
    assert_close(tensor[1], number[1])


# --- contracts -----------------------------------------------------------------------------------


def test_reference_inputs_contract() -> None:
    c, r, mc, mr = _one_pair([-1.0], [-2.0])
    with pytest.raises(ValueError, match="^ref_chosen_log_probs is required by DPO"):
        preference_loss(c, r, mc, mr)
    with pytest.raises(ValueError, match="^ref_rejected_log_probs is required"):
        preference_loss(c, r, mc, mr, ref_chosen_log_probs=c.detach())
    with pytest.raises(ValueError, match="^ref_chosen_log_probs must be None for SimPO"):
        preference_loss(c, r, mc, mr, ref_chosen_log_probs=c.detach(), objective=SimPO())
    with pytest.raises(TypeError, match="^objective must be a preference objective"):
        preference_loss(c, r, mc, mr, objective="dpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^rejected_log_sum_sq_probs must be given"):
        preference_loss(c, r, mc, mr, objective=SFT(), chosen_log_sum_sq_probs=c.detach())


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: DPO(beta=0.0), "^DPO.beta must be > 0"),
        (lambda: DPO(label_smoothing=0.5), "^DPO.label_smoothing must be < 0.5"),
        (lambda: DPO(f_divergence="kl"), "^DPO.f_divergence must be one of"),
        (lambda: DPO(alpha=float("nan")), "^DPO.alpha must be finite"),
        (lambda: IPO(length_normalized="yes"), "^IPO.length_normalized must be a bool"),
        (lambda: RobustDPO(label_smoothing=0.5), "^RobustDPO.label_smoothing must be < 0.5"),
        (lambda: EXO(epsilon=0.0), "^EXO.epsilon must be > 0"),
        (lambda: DiscoPOP(tau=0.0), "^DiscoPOP.tau must be > 0"),
        (lambda: BCO(delta=float("inf")), "^BCO.delta must be finite"),
        (lambda: SimPO(gamma="1"), "^SimPO.gamma must be a real number"),
        (lambda: CPO(nll_coef=-1.0), "^CPO.nll_coef must be >= 0"),
        (lambda: AOT(unpaired=1), "^AOT.unpaired must be a bool"),
        (lambda: 0.5 * DPO() + "x", "unsupported operand"),
        (lambda: float("nan") * DPO(), "^weight must be finite"),
        (lambda: Combination(()), "^Combination.parts must be a non-empty tuple"),
    ],
)
def test_object_fields_are_checked(build: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_combination_flags_and_rewards() -> None:
    mix = 0.5 * SimPO() + 2 * (DPO(beta=0.3) + SFT())
    assert [w for w, _ in mix.parts] == [0.5, 2.0, 2.0]
    assert mix.needs_reference and mix.uses_nll and mix.pair_local
    assert not (AOT() + DPO()).pair_local
    assert not (SimPO() + SFT()).needs_reference


@pytest.mark.slow
def test_compiles_without_graph_breaks() -> None:
    def loss(*tensors: torch.Tensor) -> torch.Tensor:
        c, r, mc, mr, rc, rr = tensors
        objective = 0.5 * DPO(beta=0.2, f_divergence="js_divergence") + SFT()
        return preference_loss(c, r, mc, mr, ref_chosen_log_probs=rc, ref_rejected_log_probs=rr,
                               objective=objective, normalizer=torch.tensor(3.0)).loss  # fmt: skip

    g = torch.Generator().manual_seed(9)
    c, r = -torch.rand(3, 5, generator=g), -torch.rand(3, 4, generator=g)
    tensors = (c, r, torch.rand(3, 5, generator=g) < 0.7, torch.rand(3, 4, generator=g) < 0.7,
               c * 0.9, r * 1.1)  # fmt: skip
    compiled = torch.compile(loss, fullgraph=True)
    torch.testing.assert_close(compiled(*tensors), loss(*tensors))
