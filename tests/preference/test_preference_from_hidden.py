"""``preference_loss_from_hidden`` and ``kto_loss_from_hidden`` (issue 34).

Against the float64 references (``reference.token_log_probs_from_hidden`` then the loss's loop
reference), values and gradients to ``hidden``, ``weight`` and ``bias``, on each path: whole
pairs per chunk, pairs split over chunks with ``(V, H)`` partials (forced by the share), and the
composition with ``token_log_probs_from_hidden`` (AOT, no gradient, a large ``H``); packed ==
padded with sequences of different lengths; bf16 computed in float32; one backward only.
``tests/logprobs/test_vocab_parallel.py`` runs both under ``vocab_group`` on 2 and 3 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_preference_loss import gradients, terms

import reference
import rlobjectives as rlo
from rlobjectives import AOT, CPO, DPO, IPO, NCA, ORPO, SFT, SimPO, kto_loss_from_hidden
from rlobjectives import preference_loss_from_hidden as from_hidden
from rlobjectives.preference.hidden import pairs as pair_module
from tolerances import LAYOUT_TOLERANCE, assert_close

D = torch.float64
V, H = 7, 5
PATHS = ("group", "split", "composed")


def _head(pairs: int, steps: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = 2 * pairs
    mask = torch.rand(rows, steps, generator=g) < 0.75
    return {
        "hidden": torch.randn(rows, steps, H, generator=g, dtype=D),
        "weight": torch.randn(V, H, generator=g, dtype=D),
        "bias": torch.randn(V, generator=g, dtype=D),
        "tokens": torch.randint(0, V, (rows, steps), generator=g),
        "mask": mask,
        "ref": torch.randn(rows, steps, generator=g, dtype=D) - 1,
        "nll": torch.rand(rows, steps, generator=g) < 0.8,
        "sq": -torch.rand(rows, steps, generator=g, dtype=D) - 1.5,
    }


def _path(monkeypatch: pytest.MonkeyPatch, path: str, steps: int) -> dict[str, Any]:
    """Keyword arguments (and a patched share) that select one path."""
    if path == "group":
        return {"chunk_size": 2 * steps + 1}
    monkeypatch.setattr(pair_module, "PARTIALS_SHARE", 100.0 if path == "split" else 0.0)
    monkeypatch.setattr(pair_module, "WHOLE_UNITS", False)  # larger pairs split, not whole
    return {"chunk_size": 3}


def _expected(b: dict[str, torch.Tensor], leaves: list[torch.Tensor], objective: Any,
              **options: Any) -> torch.Tensor:  # fmt: skip
    hidden, weight, bias = leaves
    temperature = options.pop("temperature", 1.0)
    lp, _ = reference.token_log_probs_from_hidden(
        hidden, weight, b["tokens"], bias=bias, temperature=temperature
    )
    pairs = lp.shape[0] // 2
    kw: dict[str, Any] = {k: v for k, v in options.items() if k in ("ld_alpha", "normalizer")}
    if objective.needs_reference:
        kw |= {"ref_chosen": b["ref"][:pairs], "ref_rejected": b["ref"][pairs:]}
    if options.get("nll_mask") is not None:
        kw["nll_mask"] = options["nll_mask"][:pairs]
    if options.get("log_sum_sq_probs") is not None:
        kw |= {"chosen_sq": b["sq"][:pairs], "rejected_sq": b["sq"][pairs:]}
    mask = b["mask"]
    if isinstance(objective, AOT):  # a batch-level sort: its own reference
        return reference.aot_loss(lp[:pairs], lp[pairs:], mask[:pairs], mask[pairs:],
                                  b["ref"][:pairs], b["ref"][pairs:], beta=objective.beta,
                                  label_smoothing=objective.label_smoothing,
                                  unpaired=objective.unpaired)  # fmt: skip
    return reference.preference_loss(lp[:pairs], lp[pairs:], mask[:pairs], mask[pairs:],
                                     terms(objective), **kw)["loss"]  # fmt: skip


OBJECTIVES = [DPO(beta=0.3), 0.6 * DPO() + 0.4 * NCA() + SFT(), CPO(beta=0.2), ORPO(beta=0.3),
              SimPO(beta=1.0, gamma=0.2), IPO(beta=0.5), AOT(beta=0.2)]  # fmt: skip


@settings(max_examples=24, deadline=None)
@given(
    pairs=st.integers(1, 3),
    steps=st.integers(1, 4),
    seed=st.integers(0, 999),
    objective=st.sampled_from(OBJECTIVES),
    path=st.sampled_from(PATHS),
    option=st.sampled_from(["none", "ld_alpha", "nll_mask", "wpo", "temperature"]),
)
def test_from_hidden_equals_the_reference(
    pairs: int, steps: int, seed: int, objective: Any, path: str, option: str
) -> None:
    assume(not isinstance(objective, AOT) or option in ("none", "temperature"))
    b = _head(pairs, steps, seed)
    with pytest.MonkeyPatch.context() as monkeypatch:
        kwargs = _path(monkeypatch, path, steps)
        options: dict[str, Any] = {
            "none": {}, "ld_alpha": {"ld_alpha": 0.3}, "nll_mask": {"nll_mask": b["nll"]},
            "wpo": {"log_sum_sq_probs": b["sq"]}, "temperature": {"temperature": 0.6},
        }[option]  # fmt: skip
        leaves = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        refs = {"ref_log_probs": b["ref"]} if objective.needs_reference else {}
        out = from_hidden(leaves[0], leaves[1], b["tokens"], b["mask"], objective=objective,
                          bias=leaves[2], **refs, **options, **kwargs)  # fmt: skip
        copies = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        expected = _expected(b, copies, objective, **dict(options))
        assert_close(out.loss, expected)
        assert_close(gradients(out.loss, *leaves), gradients(expected, *copies))


@pytest.mark.parametrize("path", PATHS)
def test_packed_equals_padded(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    b = _head(3, 4, 11)
    lengths = torch.tensor([4, 2, 3, 1, 4, 3])  # the chosen, then the rejected responses
    attention = torch.arange(4)[None] < lengths[:, None]
    mask = b["mask"] & attention
    kwargs = _path(monkeypatch, path, 4)
    objective = 0.5 * DPO(beta=0.4) + SFT()
    padded = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    out = from_hidden(padded[0], padded[1], b["tokens"], mask, objective=objective,
                      ref_log_probs=b["ref"], bias=padded[2], **kwargs)  # fmt: skip
    packed = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    hidden_p = rlo.pack(packed[0], attention)
    ours = from_hidden(
        hidden_p.values, packed[1], rlo.pack(b["tokens"], attention).values,
        rlo.pack(mask, attention).values, objective=objective,
        ref_log_probs=rlo.pack(b["ref"], attention).values, bias=packed[2],
        cu_seqlens=hidden_p.cu_seqlens, **kwargs,
    )  # fmt: skip
    torch.testing.assert_close(ours.loss, out.loss, **LAYOUT_TOLERANCE)
    torch.testing.assert_close(ours.margins, out.margins, **LAYOUT_TOLERANCE)
    torch.testing.assert_close(
        gradients(ours.loss, *packed), gradients(out.loss, *padded), **LAYOUT_TOLERANCE
    )


@pytest.mark.parametrize("chunk", [None, 2, 20])
def test_kto_from_hidden_equals_the_reference(chunk: int | None) -> None:
    b = _head(2, 5, 4)
    desirable = torch.tensor([True, False, False, True])
    leaves = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    out = kto_loss_from_hidden(leaves[0], leaves[1], b["tokens"], b["mask"], desirable,
                               ref_log_probs=b["ref"], kl=0.2, beta=0.4, bias=leaves[2],
                               undesirable_weight=1.5, chunk_size=chunk)  # fmt: skip
    copies = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    lp, _ = reference.token_log_probs_from_hidden(copies[0], copies[1], b["tokens"], bias=copies[2])
    expected = reference.kto_loss(lp, b["mask"], desirable.tolist(), b["ref"], kl=0.2, beta=0.4,
                                  weights=(1.0, 1.5), kind="kto")  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(gradients(out.loss, *leaves), gradients(expected, *copies))


def test_paths_and_their_conditions(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    original = pair_module._plan

    def spy(*args: Any) -> Any:
        plan = original(*args)
        seen.append("composed" if plan is None else f"whole<={plan.whole_rows}")
        return plan

    monkeypatch.setattr(pair_module, "_plan", spy)
    b = _head(2, 4, 1)
    hidden = b["hidden"].requires_grad_(True)
    refs = {"ref_log_probs": b["ref"]}
    from_hidden(hidden, b["weight"], b["tokens"], b["mask"], chunk_size=8, **refs)
    from_hidden(hidden, b["weight"], b["tokens"], b["mask"], chunk_size=3, **refs)  # no weight grad
    from_hidden(hidden, b["weight"], b["tokens"], b["mask"], objective=AOT(), **refs)
    with torch.no_grad():
        from_hidden(hidden, b["weight"], b["tokens"], b["mask"], **refs)
    weight = b["weight"].requires_grad_(True)
    from_hidden(hidden, weight, b["tokens"], b["mask"], chunk_size=3, **refs)  # 2T > N / 8
    monkeypatch.setattr(pair_module, "PARTIALS_SHARE", 1.0)
    from_hidden(hidden, weight, b["tokens"], b["mask"], chunk_size=3, **refs)  # whole: 2T <= 2H
    monkeypatch.setattr(pair_module, "WHOLE_UNITS", False)
    from_hidden(hidden, weight, b["tokens"], b["mask"], chunk_size=3, **refs)  # split
    assert seen == ["whole<=8", "whole<=3", "composed", "composed", "composed", "whole<=10",
                    "whole<=3"]  # fmt: skip


@pytest.mark.parametrize("fp32_head", [True, False])
def test_low_precision_head_and_one_backward(fp32_head: bool) -> None:
    b = _head(2, 4, 2)
    hidden = b["hidden"].bfloat16().requires_grad_(True)
    weight = b["weight"].bfloat16().requires_grad_(True)
    out = from_hidden(hidden, weight, b["tokens"], b["mask"], ref_log_probs=b["ref"].float(),
                      fp32_head=fp32_head)  # fmt: skip
    # fp32_head: the product of the bf16 values in float32; else rounded to bf16 (hidden @
    # weight.T); the softmax in float32 either way
    product = hidden.float() @ weight.float().T if fp32_head else (hidden @ weight.T).float()
    lp = torch.log_softmax(product, -1).gather(-1, b["tokens"][..., None])
    lp, mask, ref = lp.squeeze(-1), b["mask"], b["ref"].float()
    naive = rlo.preference_loss(lp[:2], lp[2:], mask[:2], mask[2:], ref_chosen_log_probs=ref[:2],
                                ref_rejected_log_probs=ref[2:])  # fmt: skip
    assert out.loss.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, naive.loss, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="one backward pass"):
        out.loss.backward()


def _transformed_log_probs(
    leaves: list[torch.Tensor], tokens: torch.Tensor, transform: dict[str, float]
) -> torch.Tensor:
    """``log_softmax(cap_c(s (h W^T + b)) / tau)`` at the tokens, float64 autograd throughout."""
    hidden, weight, bias = leaves
    x = reference.transformed_logits(hidden @ weight.T + bias, **transform)
    return torch.log_softmax(x, -1).gather(-1, tokens[..., None]).squeeze(-1)


HEAD_TRANSFORMS = [
    {"final_logit_softcapping": 1.5},
    {"logit_scale": 0.6, "temperature": 0.8},
    {"final_logit_softcapping": 2.0, "logit_scale": 1.7, "temperature": 0.7},
]


@pytest.mark.parametrize("transform", HEAD_TRANSFORMS)
@pytest.mark.parametrize("path", PATHS)
def test_head_transform_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch, path: str, transform: dict[str, float]
) -> None:
    # log_softmax(cap_c(s (h W^T + b)) / tau) at the token (reference.transformed_logits), then
    # the loss's reference; the gradient through the tanh by float64 autograd
    b = _head(2, 4, 7)
    objective = 0.7 * DPO(beta=0.3) + 0.3 * SFT()
    kwargs = _path(monkeypatch, path, 4)
    leaves = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    out = from_hidden(leaves[0], leaves[1], b["tokens"], b["mask"], objective=objective,
                      ref_log_probs=b["ref"], bias=leaves[2], **transform, **kwargs)  # fmt: skip
    copies = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    lp = _transformed_log_probs(copies, b["tokens"], transform)
    mask, ref = b["mask"], b["ref"]
    expected = reference.preference_loss(
        lp[:2], lp[2:], mask[:2], mask[2:], terms(objective), ref_chosen=ref[:2],
        ref_rejected=ref[2:],
    )["loss"]  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(gradients(out.loss, *leaves), gradients(expected, *copies))


@pytest.mark.parametrize("chunk", [None, 3])
def test_kto_head_transform_equals_the_reference(chunk: int | None) -> None:
    b = _head(2, 5, 8)
    transform = {"final_logit_softcapping": 1.2, "logit_scale": 1.3, "temperature": 0.9}
    desirable = torch.tensor([True, False, False, True])
    leaves = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    out = kto_loss_from_hidden(leaves[0], leaves[1], b["tokens"], b["mask"], desirable,
                               ref_log_probs=b["ref"], beta=0.4, bias=leaves[2], chunk_size=chunk,
                               **transform)  # fmt: skip
    copies = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    lp = _transformed_log_probs(copies, b["tokens"], transform)
    expected = reference.kto_loss(lp, b["mask"], desirable.tolist(), b["ref"], kl=None, beta=0.4,
                                  weights=(1.0, 1.0), kind="kto")  # fmt: skip
    assert_close(out.loss, expected)
    assert_close(gradients(out.loss, *leaves), gradients(expected, *copies))


def test_reference_and_shape_contracts() -> None:
    b = _head(2, 4, 3)
    with pytest.raises(ValueError, match="^ref_log_probs is required by DPO"):
        from_hidden(b["hidden"], b["weight"], b["tokens"], b["mask"])
    with pytest.raises(ValueError, match="^ref_log_probs must be None for SimPO"):
        from_hidden(b["hidden"], b["weight"], b["tokens"], b["mask"], objective=SimPO(),
                    ref_log_probs=b["ref"])  # fmt: skip
    with pytest.raises(ValueError, match="^hidden must hold 2B sequences"):
        from_hidden(b["hidden"][:3], b["weight"], b["tokens"][:3], b["mask"][:3],
                    ref_log_probs=b["ref"][:3])  # fmt: skip
    with pytest.raises(ValueError, match="^log_sum_sq_probs must be per token"):
        from_hidden(b["hidden"], b["weight"], b["tokens"], b["mask"], ref_log_probs=b["ref"],
                    log_sum_sq_probs=torch.zeros(4))  # fmt: skip
