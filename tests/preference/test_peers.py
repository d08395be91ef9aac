"""The preference objects and presets against the peers' own code, run from the installed peers.

- TRL 1.16: ``DPOTrainer._compute_loss`` (every ``loss_type``, combinations, f-divergences,
  ``label_smoothing``, ``ld_alpha``, ``use_weighting`` with TRL's own ``log_sum_sq_probs``
  kernel, precomputed or model reference), ``KTOTrainer._compute_loss``,
  ``RewardTrainer.compute_loss``, ``CPOTrainer`` / ``ORPOTrainer.get_batch_loss_metrics``: each
  run on a stand-in ``self`` that carries the trainer's options and a stand-in model that
  returns the per-token log-probabilities (or logits) of a leaf tensor; the loss, its gradient
  and the logged metrics are compared with ``presets.trl_dpo_loss`` / ``trl_reward_loss`` and
  the library's objects.
- OpenRLHF 0.11.2: ``DPOLoss`` (cDPO, IPO), ``PairWiseLoss``, ``LogExpLoss``.
- Liger-Kernel 0.8.5 ``chunked_loss`` (eager, ``compiled=False``): the fused-linear DPO (every
  loss type it has), ORPO, CPO, SimPO and KTO losses against ``preference_loss_from_hidden`` /
  ``kto_loss_from_hidden``, values and gradients to ``hidden``, ``weight`` and ``bias``.

float64 and 1e-10 where the peer computes in float64; float32 where it does not (TRL's
alpha-divergence and EXO's ``log(epsilon)``, its ORPO's odds ratio, Liger's float32
log-softmax).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from rlobjectives import (
    BCO,
    CPO,
    DPO,
    EXO,
    NCA,
    ORPO,
    SFT,
    APODown,
    APOZero,
    DiscoPOP,
    Hinge,
    RobustDPO,
    SimPO,
    SPPOHard,
    kto_loss,
    kto_loss_from_hidden,
    preference_loss,
    preference_loss_from_hidden,
    presets,
    reward_model_loss,
)
from rlobjectives.presets._preference import TRL_DPO_LOSS_TYPES

D = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-10}
FLOAT32 = {"rtol": 2e-5, "atol": 2e-6}


def _module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_gradient_checkpointing = False  # type: ignore[assignment]
    return module


def _accelerator() -> Any:
    return types.SimpleNamespace(
        device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
        num_processes=1, autocast=contextlib.nullcontext,
    )  # fmt: skip


def _metrics() -> dict[str, Any]:
    return {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}


# --- TRL DPOTrainer ------------------------------------------------------------------------------

PAIRS, LENGTH = 4, 7
LENGTHS = [3, 5, 2, 6, 4, 1, 5, 3]  # the chosen completions, then the rejected ones


def _dpo_batch(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(2 * PAIRS, LENGTH, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        completion[row, 1 : 1 + length] = 1  # a one-token prompt, then the completion
    shift = completion[:, 1:]
    logits = torch.randn(2 * PAIRS, LENGTH - 1, 9, generator=g, dtype=D)
    tokens = torch.randint(0, 9, (2 * PAIRS, LENGTH - 1), generator=g)
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    squares = torch.logsumexp(2 * torch.log_softmax(logits, -1), -1)  # log sum_v p^2
    ref = log_probs + 0.4 * torch.randn(log_probs.shape, generator=g, dtype=D)
    return {
        "completion": completion, "shift": shift, "log_probs": log_probs.to(dtype),
        "ref": ref.to(dtype), "squares": squares.to(dtype), "logits": logits.to(dtype),
        "tokens": tokens,
    }  # fmt: skip


def _trl_dpo(
    options: dict[str, Any],
    b: dict[str, torch.Tensor],
    leaf: torch.Tensor,
    precompute: bool,
    squares: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    trl = pytest.importorskip("trl")
    shift = b["shift"]

    def model(**_: Any) -> Any:
        lp = leaf.masked_fill(shift == 0, 0.0)  # TRL's fused head: 0 off the completions
        zero = torch.zeros_like(lp)
        sq = None if squares is None else squares.masked_fill(shift == 0, 0.0)
        return types.SimpleNamespace(log_probs=lp, entropy=zero, mean_logits=zero,
                                     is_top1=zero.bool(), log_sum_sq_probs=sq)  # fmt: skip

    def ref_model(**_: Any) -> Any:
        return types.SimpleNamespace(log_probs=b["ref"].masked_fill(shift == 0, 0.0))

    loss_types = options.get("loss_type", ["sigmoid"])
    shim = types.SimpleNamespace(
        model=_module(), accelerator=_accelerator(), aux_loss_enabled=False,
        ld_alpha=options.get("ld_alpha"), precompute_ref_logps=precompute,
        f_divergence_type=options.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=options.get("f_alpha_divergence_coef", 0.5),
        loss_types=loss_types,
        loss_weights=options.get("loss_weights") or [1.0] * len(loss_types),
        beta=options.get("beta", 0.1), label_smoothing=options.get("label_smoothing", 0.0),
        use_weighting=options.get("use_weighting", False),
        args=types.SimpleNamespace(discopop_tau=options.get("discopop_tau", 0.05),
                                   gradient_checkpointing_kwargs=None),
        _metrics=_metrics(), _tp_size=1, _total_train_tokens=0, ref_model=ref_model,
    )  # fmt: skip
    rows = 2 * PAIRS
    inputs: dict[str, Any] = {
        "input_ids": torch.ones(rows, LENGTH, dtype=torch.long),
        "attention_mask": torch.ones(rows, LENGTH, dtype=torch.long),
        "completion_mask": b["completion"],
    }
    if precompute:  # the reference's sums, LD-weighted as TRL's compute_ref_log_probs does
        shim.ref_model = None
        ref_c, ref_r = trl.DPOTrainer.compute_ref_log_probs(shim, ref_model, inputs)
        shim.ref_model = ref_model
        inputs |= {"ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = trl.DPOTrainer._compute_loss(shim, model, inputs, False)
    return loss, {k: v[-1] for k, v in shim._metrics["train"].items()}


def _ours_dpo(options: dict[str, Any], b: dict[str, torch.Tensor], leaf: torch.Tensor,
              precompute: bool, squares: torch.Tensor | None = None) -> Any:  # fmt: skip
    loss_fn = presets.trl_dpo_loss(**options)
    shift = b["shift"].bool()
    ref: torch.Tensor = b["ref"]
    refs: tuple[torch.Tensor, torch.Tensor] = (ref[:PAIRS], ref[PAIRS:])
    if precompute:  # the per-sequence sums TRL precomputes (LD-weighted)
        refs = _ld_sums(ref, shift, options.get("ld_alpha"))
    extra = {}
    if squares is not None:
        extra = {"chosen_log_sum_sq_probs": squares[:PAIRS],
                 "rejected_log_sum_sq_probs": squares[PAIRS:]}  # fmt: skip
    return loss_fn(
        leaf[:PAIRS], leaf[PAIRS:], shift[:PAIRS], shift[PAIRS:],
        ref_chosen_log_probs=refs[0], ref_rejected_log_probs=refs[1], **extra,
    )  # fmt: skip


def _ld_sums(values: torch.Tensor, mask: torch.Tensor,
             alpha: float | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-sequence sums, LD-weighted: the shorter response's length at weight 1, then alpha."""
    lengths = mask.sum(-1)
    shared = torch.minimum(lengths[:PAIRS], lengths[PAIRS:]).repeat(2)
    position = mask.cumsum(-1)
    weight = torch.where(position <= shared[:, None], 1.0, 1.0 if alpha is None else alpha)
    sums = torch.where(mask, values * weight, 0.0).sum(-1)
    return sums[:PAIRS], sums[PAIRS:]


DPO_CASES: list[dict[str, Any]] = [
    *({"loss_type": [name]} for name in TRL_DPO_LOSS_TYPES if name != "exo_pair"),
    {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    {"loss_type": ["sigmoid"], "label_smoothing": 0.3, "beta": 0.5},  # TRL ignores it there
    {"loss_type": ["robust"], "label_smoothing": 0.2},
    {"loss_type": ["aot"], "label_smoothing": 0.1},
    {"loss_type": ["aot_unpaired"], "label_smoothing": 0.1, "beta": 0.3},
    {"loss_type": ["discopop"], "discopop_tau": 0.3},
    {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},  # MPO
    {"loss_type": ["ipo", "sft"], "loss_weights": [0.5, 2.0], "beta": 0.4},
    *({"loss_type": ["sigmoid", "hinge", "ipo", "robust", "discopop", "sigmoid_norm", "sft"],
       "f_divergence_type": kind, "label_smoothing": 0.1}
      for kind in ("forward_kl", "js_divergence")),
    {"loss_type": ["nca_pair", "apo_down"], "ld_alpha": 0.5},
    {"loss_type": ["sigmoid", "ipo", "sigmoid_norm"], "ld_alpha": 0.0, "beta": 0.2},
]  # fmt: skip


@pytest.mark.parametrize("precompute", [False, True])
@pytest.mark.parametrize("options", DPO_CASES, ids=lambda o: "+".join(o["loss_type"]) + str(len(o)))
def test_trl_dpo_loss_equals_trl(options: dict[str, Any], precompute: bool) -> None:
    b = _dpo_batch(D)
    leaf = b["log_probs"].clone().requires_grad_(True)
    theirs, logged = _trl_dpo(options, b, leaf, precompute)
    mine = b["log_probs"].clone().requires_grad_(True)
    ours = _ours_dpo(options, b, mine, precompute)
    tolerance = FLOAT32 if "exo_pair" in options["loss_type"] else TIGHT
    torch.testing.assert_close(ours.loss, theirs, **tolerance)
    (grad_theirs,) = torch.autograd.grad(theirs, leaf)
    (grad_ours,) = torch.autograd.grad(ours.loss, mine)
    shift = b["shift"].bool()
    torch.testing.assert_close(grad_ours, torch.where(shift, grad_theirs, 0.0), **tolerance)
    for name, value in ours.metrics.items():
        assert abs(float(value) - float(logged[name])) < 1e-6, name


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "exo_pair", "robust", "hinge"])
def test_trl_alpha_divergence_in_float32(loss_type: str) -> None:
    # TRL evaluates alpha-divergence scores in float32 only (its clamp table has no float64).
    b = _dpo_batch(torch.float32, seed=2)
    options = {"loss_type": [loss_type], "f_divergence_type": "alpha_divergence",
               "f_alpha_divergence_coef": 0.3, "label_smoothing": 0.01, "beta": 0.3}  # fmt: skip
    leaf = b["log_probs"].clone().requires_grad_(True)
    theirs, _ = _trl_dpo(options, b, leaf, False)
    mine = b["log_probs"].clone().requires_grad_(True)
    ours = _ours_dpo(options, b, mine, False)
    torch.testing.assert_close(ours.loss, theirs, **FLOAT32)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours.loss, mine)[0]
    torch.testing.assert_close(grads[1], torch.where(b["shift"].bool(), grads[0], 0.0), **FLOAT32)


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["nca_pair", "apo_zero"], ["discopop"]])
def test_trl_use_weighting_with_trls_log_sum_sq_probs(loss_type: list[str]) -> None:
    kernel = pytest.importorskip("trl.kernels.chunked_logprob")
    b = _dpo_batch(D, seed=4)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(2 * PAIRS * (LENGTH - 1), 5, generator=g, dtype=D)
    weight = torch.randn(9, 5, generator=g, dtype=D)
    labels = b["tokens"].reshape(-1)
    outputs = ("log_probs", "log_sum_sq_probs")
    per_token = kernel.ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 4, None, 1.0,
                                                     outputs)  # fmt: skip
    log_probs, squares = per_token[0].reshape(2 * PAIRS, -1), per_token[2].reshape(2 * PAIRS, -1)
    logits = hidden @ weight.T  # TRL's squares are log sum_v softmax^2 of the logits
    expected = torch.logsumexp(2 * torch.log_softmax(logits, -1), -1).reshape(2 * PAIRS, -1)
    torch.testing.assert_close(squares.double(), expected, **FLOAT32)  # TRL's are float32
    b["log_probs"] = log_probs.detach().double()
    options = {"loss_type": loss_type, "use_weighting": True, "beta": 0.5}
    leaf = b["log_probs"].clone().requires_grad_(True)
    theirs, _ = _trl_dpo(options, b, leaf, False, squares)
    mine = b["log_probs"].clone().requires_grad_(True)
    ours = _ours_dpo(options, b, mine, False, squares)
    torch.testing.assert_close(ours.loss, theirs, **TIGHT)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours.loss, mine)[0]
    torch.testing.assert_close(grads[1], torch.where(b["shift"].bool(), grads[0], 0.0), **TIGHT)


def test_trl_refusals_carry_trls_reasons() -> None:
    trl = pytest.importorskip("trl")
    with pytest.raises(ValueError, match="loss_weights") as ours:
        presets.trl_dpo_loss(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="same length") as theirs:
        trl.DPOConfig(output_dir="/tmp/unused", loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    assert "same length as loss_type" in str(ours.value) and theirs.value
    with pytest.raises(ValueError, match="only supported for the loss types"):
        presets.trl_dpo_loss(loss_type=["bco_pair"], f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="greater than 0.0 when using 'exo_pair'"):
        presets.trl_dpo_loss(loss_type=["exo_pair"])
    with pytest.raises(ValueError, match="sort samples"):
        presets.trl_dpo_loss(loss_type=["aot"], use_weighting=True)
    with pytest.raises(ValueError, match="RuntimeError"):
        presets.trl_dpo_loss(loss_type=["sft"], use_weighting=True)
    b = _dpo_batch(D)  # TRL itself fails on sft with use_weighting (in-place on an expansion)
    with pytest.raises(RuntimeError):
        _trl_dpo({"loss_type": ["sft"], "use_weighting": True}, b, b["log_probs"], False,
                 b["squares"])  # fmt: skip
    with pytest.raises(ValueError, match="^use_weighting=True needs"):
        presets.trl_dpo_loss(use_weighting=True)(
            b["log_probs"], b["log_probs"], b["shift"], b["shift"],
            ref_chosen_log_probs=b["ref"], ref_rejected_log_probs=b["ref"],
        )  # fmt: skip


# --- TRL KTOTrainer, RewardTrainer, CPOTrainer, ORPOTrainer ------------------------------------


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_equals_trls_kto_trainer(loss_type: str) -> None:
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(1)
    rows, length = 5, 6
    completion = torch.zeros(rows, length, dtype=torch.long)
    for row, size in enumerate([3, 5, 2, 4, 1]):
        completion[row, 1 : 1 + size] = 1
    shift = completion[:, 1:]
    lp = -torch.rand(rows, length - 1, generator=g, dtype=D)
    ref = lp + 0.3 * torch.randn(rows, length - 1, generator=g, dtype=D)
    kl_lp, kl_ref = (
        -torch.rand(rows, length - 1, generator=g, dtype=D),
        -torch.rand(rows, length - 1, generator=g, dtype=D),
    )
    labels = torch.tensor([True, False, True, True, False])
    leaf = lp.clone().requires_grad_(True)

    def model(**kwargs: Any) -> Any:
        kl = kwargs["input_ids"].shape[1] == length + 1  # the KL batch: one more column
        values = kl_lp if kl else leaf.masked_fill(shift == 0, 0.0)
        zero = torch.zeros_like(values)
        return types.SimpleNamespace(log_probs=values, entropy=zero, mean_logits=zero)

    def ref_model(**kwargs: Any) -> Any:
        kl = kwargs["input_ids"].shape[1] == length + 1
        return types.SimpleNamespace(log_probs=kl_ref if kl else ref.masked_fill(shift == 0, 0.0))

    shim = types.SimpleNamespace(
        model=_module(), accelerator=_accelerator(), aux_loss_enabled=False, beta=0.3,
        loss_type=loss_type, calculate_KL=loss_type == "kto", desirable_weight=1.2,
        undesirable_weight=0.7, precompute_ref_logps=False, ref_model=ref_model,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None), _metrics=_metrics(),
        _tp_size=1, _total_train_tokens=0,
    )  # fmt: skip
    shim._compute_kl_logps = types.MethodType(trl.KTOTrainer._compute_kl_logps, shim)
    batch = {
        "input_ids": torch.ones(rows, length, dtype=torch.long), "label": labels,
        "attention_mask": torch.ones(rows, length, dtype=torch.long), "completion_mask": completion,
        "KL_input_ids": torch.ones(rows, length + 1, dtype=torch.long),
        "KL_attention_mask": torch.ones(rows, length + 1, dtype=torch.long),
        "KL_completion_mask": torch.ones(rows, length + 1, dtype=torch.long),
    }  # fmt: skip
    theirs = trl.KTOTrainer._compute_loss(shim, model, batch, False)
    kl = float((kl_lp.sum(-1) - kl_ref.sum(-1)).mean()) if loss_type == "kto" else None
    mine = lp.clone().requires_grad_(True)
    ours = kto_loss(mine, shift, labels, ref_log_probs=ref, kl=kl, beta=0.3, desirable_weight=1.2,
                    undesirable_weight=0.7, kind=loss_type)  # fmt: skip
    torch.testing.assert_close(ours.loss, theirs, **TIGHT)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours.loss, mine)[0]
    torch.testing.assert_close(grads[1], torch.where(shift.bool(), grads[0], 0.0), **TIGHT)
    logged = shim._metrics["train"]
    assert abs(float(ours.kl) - logged["kl"][-1]) < 1e-9
    chosen = ours.rewards[labels].mean()
    assert abs(float(chosen) - logged["rewards/chosen"][-1]) < 1e-9


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_trl_reward_loss_equals_trls_reward_trainer(margin: bool, center: float | None) -> None:
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(8, 1, generator=g, dtype=D)
    leaf = scores.clone().requires_grad_(True)
    shim = types.SimpleNamespace(
        model=_module(), accelerator=_accelerator(), _metrics=_metrics(), _tp_size=1,
        _total_train_tokens=0, args=types.SimpleNamespace(center_rewards_coefficient=center),
    )  # fmt: skip
    inputs: dict[str, Any] = {"attention_mask": torch.ones(8, 3, dtype=torch.long)}
    margins = torch.rand(4, generator=g, dtype=D)
    if margin:
        inputs["margin"] = margins
    theirs = trl.RewardTrainer.compute_loss(
        shim, lambda **_: types.SimpleNamespace(logits=leaf), inputs
    )
    mine = scores.clone().requires_grad_(True)
    ours = presets.trl_reward_loss(center_rewards_coefficient=center)(
        mine[:4], mine[4:], margins if margin else None
    )
    torch.testing.assert_close(ours.loss, theirs, **TIGHT)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours.loss, mine)[0]
    torch.testing.assert_close(grads[1], grads[0], **TIGHT)
    for name, value in ours.metrics.items():
        assert abs(float(value) - shim._metrics["train"][name][-1]) < 1e-6, name


def _cpo_orpo_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    rows, length, vocab = 6, 6, 7
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    prompt = [2, 1, 3, 2, 1, 3]
    ends = [5, 6, 4, 6, 3, 5]
    response = torch.zeros(rows, length, dtype=torch.bool)
    attention = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        response[row, prompt[row] : ends[row]] = True
        attention[row, : ends[row]] = 1
    return {
        "logits": torch.randn(rows, length, vocab, generator=g, dtype=D),
        "input_ids": labels, "labels": torch.where(response, labels, -100),
        "attention": attention, "response": response,
    }  # fmt: skip


def _trl_pair_trainer(name: str, b: dict[str, torch.Tensor], leaf: torch.Tensor,
                      **options: Any) -> torch.Tensor:  # fmt: skip
    trl = pytest.importorskip("trl")
    if name == "cpo":
        from trl.experimental.cpo import CPOTrainer as trainer
    else:
        from trl.experimental.orpo import ORPOTrainer as trainer
    half = b["labels"].shape[0] // 2
    batch = {
        "chosen_input_ids": b["input_ids"][:half], "rejected_input_ids": b["input_ids"][half:],
        "chosen_attention_mask": b["attention"][:half],
        "rejected_attention_mask": b["attention"][half:],
        "chosen_labels": b["labels"][:half], "rejected_labels": b["labels"][half:],
    }  # fmt: skip
    shim = types.SimpleNamespace(
        accelerator=_accelerator(), is_encoder_decoder=False, pad_token_id=0, padding_value=0,
        label_pad_token_id=-100, aux_loss_enabled=False, **options,
    )  # fmt: skip
    shim.concatenated_inputs = trainer.concatenated_inputs
    shim.get_batch_logps = trainer.get_batch_logps
    for method in ("concatenated_forward", "cpo_loss", "odds_ratio_loss"):
        if hasattr(trainer, method):
            setattr(shim, method, types.MethodType(getattr(trainer, method), shim))
    model = lambda *_, **__: types.SimpleNamespace(logits=leaf)  # noqa: E731
    del trl
    return trainer.get_batch_loss_metrics(shim, model, batch)[0]


def _shifted_log_probs(logits: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
    targets = b["input_ids"][:, 1:]
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize(("loss_type", "cpo_alpha"), [("sigmoid", 1.0), ("sigmoid", 0.0),
                                                      ("simpo", 0.5)])  # fmt: skip
def test_cpo_and_simpo_equal_trls_cpo_trainer(loss_type: str, cpo_alpha: float) -> None:
    b = _cpo_orpo_batch()
    leaf = b["logits"].clone().requires_grad_(True)
    options = {"beta": 0.4, "alpha": 0.0, "loss_type": loss_type, "label_smoothing": 0.1,
               "simpo_gamma": 0.3, "cpo_alpha": cpo_alpha}  # fmt: skip
    theirs = _trl_pair_trainer("cpo", b, leaf, **options)
    mine = b["logits"].clone().requires_grad_(True)
    lp, mask = _shifted_log_probs(mine, b), b["response"][:, 1:]
    if loss_type == "simpo":
        objective = SimPO(beta=0.4, gamma=0.3, label_smoothing=0.1) + cpo_alpha * SFT()
    else:
        objective = CPO(beta=0.4, nll_coef=cpo_alpha, label_smoothing=0.1)
    ours = preference_loss(lp[:3], lp[3:], mask[:3], mask[3:], objective=objective)
    torch.testing.assert_close(ours.loss, theirs, **TIGHT)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours.loss, mine)[0]
    torch.testing.assert_close(grads[1], grads[0], **TIGHT)


def test_orpo_equals_trls_orpo_trainer_with_its_prompt_nll() -> None:
    b = _cpo_orpo_batch()
    leaf = b["logits"].clone().requires_grad_(True)
    theirs = _trl_pair_trainer("orpo", b, leaf, beta=0.25)
    mine = b["logits"].clone().requires_grad_(True)
    lp, mask = _shifted_log_probs(mine, b), b["response"][:, 1:]
    nll = b["attention"][:, 1:].bool()  # TRL's ORPO NLL: the prompt and the response
    ours = preference_loss(lp[:3], lp[3:], mask[:3], mask[3:], objective=ORPO(beta=0.25),
                           nll_mask=nll[:3])  # fmt: skip
    # TRL's odds_ratio_loss casts the mean log-probabilities to float32: compare there
    torch.testing.assert_close(ours.loss, theirs, **FLOAT32)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours.loss, mine)[0]
    torch.testing.assert_close(grads[1], grads[0], **FLOAT32)


# --- OpenRLHF ------------------------------------------------------------------------------------


def _openrlhf_loss_module() -> Any:
    """``openrlhf.models.loss``, imported under the ``flash_attn`` stub of the trainer tests."""
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip("OpenRLHF is not installed")
    shims = sys.modules.get("_trainer_shims")
    if shims is None:
        path = Path(__file__).resolve().parents[1] / "integrations" / "_trainer_shims.py"
        spec = importlib.util.spec_from_file_location("_trainer_shims", path)
        assert spec is not None and spec.loader is not None
        shims = importlib.util.module_from_spec(spec)
        sys.modules["_trainer_shims"] = shims
        spec.loader.exec_module(shims)
    with shims.flash_attn_stub():
        return importlib.import_module("openrlhf.models.loss")


@pytest.mark.parametrize(("label_smoothing", "ipo"), [(0.0, False), (0.2, False), (0.2, True)])
def test_openrlhf_dpo_loss_equals_openrlhf(label_smoothing: float, ipo: bool) -> None:
    loss_module = _openrlhf_loss_module()
    g = torch.Generator().manual_seed(3)
    sums = -torch.rand(4, 6, generator=g, dtype=D) * 5
    leaf, mine = sums.clone().requires_grad_(True), sums.clone().requires_grad_(True)
    theirs = loss_module.DPOLoss(0.3, label_smoothing, ipo)(*leaf.unbind(0))
    ours = presets.openrlhf_dpo_loss(beta=0.3, label_smoothing=label_smoothing, ipo=ipo)(
        *mine.unbind(0)
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)
    grads = torch.autograd.grad(theirs[0], leaf)[0], torch.autograd.grad(ours[0], mine)[0]
    # the policy rows (the references are constants here, detached: OpenRLHF gets them so)
    torch.testing.assert_close(grads[1][:2], grads[0][:2], **TIGHT)


@pytest.mark.parametrize("kind", ["pairwise", "log_exp"])
def test_openrlhf_reward_losses_equal_openrlhf(kind: str) -> None:
    loss_module = _openrlhf_loss_module()
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 6, generator=g, dtype=D)
    leaf, mine = scores.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    peer = loss_module.PairWiseLoss() if kind == "pairwise" else loss_module.LogExpLoss()
    preset = (
        presets.openrlhf_pairwise_loss() if kind == "pairwise" else presets.openrlhf_log_exp_loss()
    )
    theirs, ours = peer(*leaf.unbind(0)), preset(*mine.unbind(0))
    torch.testing.assert_close(ours, theirs, **TIGHT)
    grads = torch.autograd.grad(theirs, leaf)[0], torch.autograd.grad(ours, mine)[0]
    torch.testing.assert_close(grads[1][:2], grads[0][:2], **TIGHT)  # the margin: a constant
    # the library's log_exp uses a margin where OpenRLHF's ignores it
    with_margin = reward_model_loss(scores[0], scores[1], margin=scores[2].abs(), kind="log_exp")
    assert not torch.allclose(with_margin.loss, ours)


# --- Liger-Kernel 0.8.5 chunked_loss -------------------------------------------------------------

LIGER_DPO = {
    "sigmoid": DPO(beta=0.2), "hinge": Hinge(beta=0.2), "nca_pair": NCA(beta=0.2),
    "robust": RobustDPO(beta=0.2, label_smoothing=0.1), "bco_pair": BCO(beta=0.2),
    "sppo_hard": SPPOHard(beta=0.2), "apo_zero": APOZero(beta=0.2),
    "apo_down": APODown(beta=0.2), "discopop": DiscoPOP(beta=0.2, tau=0.3),
    "exo_pair": EXO(beta=0.2, epsilon=0.1),
}  # fmt: skip


def _liger_head(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pairs, steps, hidden, vocab = 3, 5, 8, 11
    target = torch.randint(0, vocab, (2 * pairs, steps), generator=g)
    target[:, :1] = -100  # a prompt token
    target[1, 4:] = -100
    target[4, 3:] = -100
    return {
        "hidden": torch.randn(2 * pairs, steps, hidden, generator=g),
        "weight": torch.randn(vocab, hidden, generator=g) / 2,
        "bias": torch.randn(vocab, generator=g),
        "ref_hidden": torch.randn(2 * pairs, steps, hidden, generator=g),
        "ref_weight": torch.randn(vocab, hidden, generator=g) / 2,
        "target": target,
    }


def _ours_from_hidden(h: dict[str, torch.Tensor], leaves: list[torch.Tensor], objective: Any,
                      *, reference: bool = True) -> torch.Tensor:  # fmt: skip
    tokens, mask = h["target"].clamp(min=0), h["target"] != -100
    refs = {}
    if reference:
        ref = torch.log_softmax(h["ref_hidden"] @ h["ref_weight"].T, -1)
        refs = {"ref_log_probs": ref.gather(-1, tokens[..., None]).squeeze(-1)}
    return preference_loss_from_hidden(leaves[0], leaves[1], tokens, mask, bias=leaves[2],
                                       objective=objective, **refs).loss  # fmt: skip


def _compare(theirs: torch.Tensor, leaves: list[torch.Tensor], ours: torch.Tensor,
             mine: list[torch.Tensor]) -> None:  # fmt: skip
    torch.testing.assert_close(ours, theirs, **FLOAT32)
    for a, b in zip(torch.autograd.grad(ours, mine), torch.autograd.grad(theirs, leaves),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, **FLOAT32)


@pytest.mark.parametrize("loss_type", list(LIGER_DPO))
def test_from_hidden_equals_liger_dpo(loss_type: str) -> None:
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    h = _liger_head()
    leaves = [h[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    options = {"label_smoothing": 0.1, "discopop_tau": 0.3}
    loss = chunked.LigerFusedLinearDPOLoss(beta=0.2, compiled=False, loss_type=loss_type,
                                           **options)  # fmt: skip
    theirs = loss(leaves[1], leaves[0], h["target"], leaves[2], h["ref_hidden"], h["ref_weight"])[0]
    mine = [h[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    _compare(theirs, leaves, _ours_from_hidden(h, mine, LIGER_DPO[loss_type]), mine)


@pytest.mark.parametrize("name", ["orpo", "cpo", "simpo"])
def test_from_hidden_equals_liger_reference_free(name: str) -> None:
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    h = _liger_head(1)
    leaves = [h[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    if name == "orpo":
        liger, ours_objective = (
            chunked.LigerFusedLinearORPOLoss(beta=0.3, compiled=False),
            ORPO(beta=0.3),
        )
    elif name == "cpo":
        liger = chunked.LigerFusedLinearCPOLoss(
            beta=0.3, alpha=0.7, label_smoothing=0.1, compiled=False
        )
        ours_objective = CPO(beta=0.3, nll_coef=0.7, label_smoothing=0.1)
    else:  # Liger's SimPO adds its NLL term (alpha = 1 by default): CPO-SimPO
        liger = chunked.LigerFusedLinearSimPOLoss(beta=0.3, gamma=0.4, compiled=False)
        ours_objective = SimPO(beta=0.3, gamma=0.4) + 1.0 * SFT()
    theirs = liger(leaves[1], leaves[0], h["target"], leaves[2])[0]
    mine = [h[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    _compare(theirs, leaves, _ours_from_hidden(h, mine, ours_objective, reference=False), mine)


def test_kto_from_hidden_equals_liger_kto() -> None:
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    h = _liger_head(2)
    labels = torch.tensor([True, False, True, True, False, False])
    leaves = [h[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    liger = chunked.LigerFusedLinearKTOLoss(beta=0.4, compiled=False, use_ref_model=True)
    kl = torch.tensor(0.15)
    theirs = liger(leaves[0], leaves[1], h["target"], leaves[2], labels, h["ref_hidden"],
                   h["ref_weight"], None, kl)[0]  # fmt: skip
    mine = [h[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    tokens, mask = h["target"].clamp(min=0), h["target"] != -100
    ref = torch.log_softmax(h["ref_hidden"] @ h["ref_weight"].T, -1)
    ref = ref.gather(-1, tokens[..., None]).squeeze(-1)
    ours = kto_loss_from_hidden(mine[0], mine[1], tokens, mask, labels, ref_log_probs=ref,
                                kl=0.15, beta=0.4, bias=mine[2]).loss  # fmt: skip
    _compare(theirs, leaves, ours, mine)
