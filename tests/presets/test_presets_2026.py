"""The presets of issue 25: verl's distillation losses and gdpo, TRL's GKD / server distillation
and ``multi_objective_aggregation``.

Each preset against the peer's formula restated in tests/reference.py on random float64
batches (values and gradients) and against the numbers of the peer's own code on its batch
(tests/peer_batches.py).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import reference
import rlobjectives as rlo
from peer_batches import PEER_NUMBERS, check, gdpo_batch, jsd_batch, reverse_batch, topk_batch
from rlobjectives import presets
from tolerances import assert_close

D = torch.float64


def _student(
    seed: int, batch: int = 2, steps: int = 4, vocab: int = 9, slots: int = 3
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, steps, vocab, generator=generator, dtype=D) * 2
    teacher = torch.log_softmax(
        logits + torch.randn(batch, steps, vocab, generator=generator, dtype=D), -1
    )
    log_probs, ids = teacher.topk(slots, -1)
    mask = torch.rand(batch, steps, generator=generator) < 0.8
    mask[0, 0] = True
    tokens = torch.randint(0, vocab, (batch, steps), generator=generator)
    student = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return {
        "logits": logits,
        "teacher": teacher,
        "log_probs": log_probs,
        "ids": ids,
        "mask": mask,
        "student": student,
        "teacher_token": teacher.gather(-1, tokens[..., None]).squeeze(-1),
        "old": student + 0.1 * torch.randn(batch, steps, generator=generator, dtype=D),
    }


# --- verl distillation -------------------------------------------------------------------------


@pytest.mark.parametrize("floor", [None, -2.0])
@pytest.mark.parametrize("ceiling", [None, 0.3])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_verl_forward_kl_topk_equals_verl_formula(
    floor: float | None, ceiling: float | None, aggregation: str
) -> None:
    b = _student(1)
    loss_fn = presets.verl_distillation_loss(
        "forward_kl_topk",
        log_prob_min_clamp=floor,
        loss_max_clamp=ceiling,
        use_policy_gradient=False,
        use_task_rewards=False,
    )
    logits = b["logits"].clone().requires_grad_(True)
    out = loss_fn(
        b["mask"],
        teacher_log_probs=b["log_probs"],
        teacher_ids=b["ids"],
        student_logits=logits,
        loss_agg_mode=aggregation,
        temperature=0.8,
    )
    out.loss.backward()
    x = b["logits"].clone().requires_grad_(True)
    verl = reference.verl_forward_kl_topk(
        x, b["log_probs"], b["ids"], log_prob_min_clamp=floor, temperature=0.8
    )
    losses = verl["losses"].clamp_min(0.0)
    if ceiling is not None:
        losses = losses.clamp(-ceiling, ceiling)
    mask = b["mask"]
    if aggregation == "token-mean":
        expected = losses[mask].sum() / mask.sum()
    else:
        expected = torch.stack(
            [losses[i][mask[i]].mean() for i in range(2) if mask[i].any()]
        ).mean()
    expected.backward()
    assert_close(out.loss, expected)
    assert_close(logits.grad, x.grad)
    assert_close(out.metrics["distillation/student_mass"], verl["student_mass"][mask].mean())
    assert_close(out.metrics["distillation/teacher_mass_max"], verl["teacher_mass"][mask].max())
    assert_close(out.metrics["distillation/loss_max"], verl["losses"].clamp_min(0)[mask].max())
    assert set(out.metrics) == {
        "distillation/student_mass",
        "distillation/student_mass_min",
        "distillation/student_mass_max",
        "distillation/teacher_mass",
        "distillation/teacher_mass_min",
        "distillation/teacher_mass_max",
        "distillation/loss_min",
        "distillation/loss_max",
        "distillation/loss",
    }


def test_verl_forward_kl_topk_equals_verl_on_its_batch() -> None:
    b = topk_batch()
    everything = torch.ones(1, 41)
    for floor, name, student in (
        (None, "verl_forward_kl_topk", b["student"]),
        (-10.0, "verl_forward_kl_topk_clamp", b["student_low"]),
    ):
        loss_fn = presets.verl_distillation_loss(
            "forward_kl_topk",
            log_prob_min_clamp=floor,
            loss_max_clamp=None,
            use_policy_gradient=False,
        )
        out = loss_fn(
            everything,
            teacher_log_probs=b["log_probs"][None],
            teacher_ids=b["ids"][None],
            student_logits=student[None],
        )
        # every head of this batch is positive (clamp_min(0) is idle): token-mean = sum / 41
        assert_close(out.loss * 41, reference_sum(name), torch.float32)


def reference_sum(name: str) -> float:
    return float(PEER_NUMBERS[name]["sum"])


@pytest.mark.parametrize(
    "mode", ["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+", "abs+"]
)
def test_verl_estimator_modes_equal_kl_penalty(mode: str) -> None:
    b = _student(2)
    mask = b["mask"]
    # k1 needs use_policy_gradient (verl raises otherwise): compare its supervised value by hand
    gradient = mode in ("k1", "kl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
        loss_fn = presets.verl_distillation_loss(
            mode, use_policy_gradient=gradient, loss_max_clamp=1.5
        )
        student = b["student"].clone().requires_grad_(True)
        old = b["old"]
        out = loss_fn(
            mask,
            log_prob=student,
            teacher_log_probs=b["teacher_token"][..., None],
            old_log_prob=old,
        )
    out.loss.backward()
    x = b["student"].clone().requires_grad_(True)
    losses = reference.verl_kl_penalty(x, b["teacher_token"], mode).clamp(-1.5, 1.5)
    if gradient:  # verl's vanilla PPO loss with advantages -D (detached)
        theirs = presets.verl_policy_loss("vanilla")(old, x, -losses.detach(), mask.double())
        expected = theirs.loss
        assert "distillation/pg_clipfrac" in out.metrics and "distillation/ppo_kl" in out.metrics
    else:
        expected = losses[mask].sum() / mask.sum()
    expected.backward()
    assert_close(out.loss, expected)
    assert_close(student.grad, x.grad)
    unclamped = reference.verl_kl_penalty(b["student"], b["teacher_token"], mode)
    assert_close(out.metrics["distillation/abs_loss"], unclamped[mask].abs().mean())


def test_verl_estimator_modes_equal_verl_on_its_batch() -> None:
    b = reverse_batch()
    loss_fn = presets.verl_distillation_loss("k3", use_policy_gradient=False, loss_max_clamp=None)
    for aggregation in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
            out = loss_fn(
                b["mask"],
                log_prob=b["student"],
                teacher_log_probs=b["teacher"],
                loss_agg_mode=aggregation,
            )
        # verl divides each row's token mean by n_i + 1e-8: a relative 1e-9 here
        check(f"verl_agg_k3_{aggregation}", out.loss, tol=1e-8)


def test_verl_distillation_coefficients_and_errors() -> None:
    b = _student(3)
    args = {"log_prob": b["student"], "teacher_log_probs": b["teacher_token"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
        base = presets.verl_distillation_loss("k3+", use_policy_gradient=False)(b["mask"], **args)
        scaled = presets.verl_distillation_loss(
            "k3+", use_policy_gradient=False, distillation_loss_coef=0.25
        )(b["mask"], **args)
        alone = presets.verl_distillation_loss(
            "k3+", use_policy_gradient=False, use_task_rewards=False, distillation_loss_coef=0.25
        )(b["mask"], **args)
    assert_close(scaled.loss, 0.25 * base.loss)
    assert_close(alone.loss, base.loss)  # without task rewards the coefficient is 1 (verl)
    assert_close(scaled.metrics["distillation/loss"], base.loss)
    with pytest.raises(ValueError, match="use_policy_gradient"):
        presets.verl_distillation_loss("k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="^loss_mode"):
        presets.verl_distillation_loss("forward_kl")
    with pytest.raises(ValueError, match="^policy_loss_mode"):
        presets.verl_distillation_loss(policy_loss_mode="gspo")
    with pytest.raises(ValueError, match="student_logits"):
        presets.verl_distillation_loss("forward_kl_topk")(
            b["mask"], teacher_log_probs=b["log_probs"]
        )
    with pytest.raises(ValueError, match="old_log_prob"):
        presets.verl_distillation_loss("k1")(b["mask"], **args)


# --- TRL distillation --------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("labelled", [True, False])
def test_trl_generalized_jsd_loss_equals_trl(beta: float, reduction: str, labelled: bool) -> None:
    b = _student(4, batch=3, steps=5, vocab=7)
    labels = torch.where(b["mask"], 1, -100) if labelled else None
    teacher = b["logits"] + torch.randn(
        b["logits"].shape, generator=torch.Generator().manual_seed(0), dtype=D
    )
    x = b["logits"].clone().requires_grad_(True)
    ours = presets.trl_generalized_jsd_loss(x, teacher, labels, beta, 0.9, reduction)
    y = b["logits"].clone().requires_grad_(True)
    theirs = reference.trl_generalized_jsd_loss(y, teacher, labels, beta, 0.9, reduction)
    ours.backward()
    theirs.backward()
    assert_close(ours, theirs)
    assert_close(x.grad, y.grad)
    items = presets.trl_generalized_jsd_loss(
        b["logits"], teacher, labels, beta, num_items_in_batch=torch.tensor(17)
    )
    assert_close(
        items,
        reference.trl_generalized_jsd_loss(
            b["logits"], teacher, labels, beta, num_items_in_batch=17
        ),
    )


def test_trl_generalized_jsd_loss_equals_trl_on_its_batch() -> None:
    b = jsd_batch()
    for beta in (0.0, 0.5, 1.0):
        for reduction in ("batchmean", "sum", "mean"):
            loss = presets.trl_generalized_jsd_loss(
                b["student"], b["teacher"], b["labels"], beta, 0.7, reduction
            )
            check(f"trl_gjsd_{beta}_0.7_{reduction}", loss)
    check("trl_gjsd_nolabels", presets.trl_generalized_jsd_loss(b["student"], b["teacher"]))
    with pytest.raises(ValueError, match="^reduction"):
        presets.trl_generalized_jsd_loss(b["student"], b["teacher"], b["labels"], reduction="none")


@pytest.mark.parametrize("tail", [True, False])
def test_trl_server_forward_kl_loss_equals_trl(tail: bool) -> None:
    b = _student(5, vocab=11, slots=4)
    log_probs = b["log_probs"].clone()
    log_probs[1, :, -1] = -math.inf  # padding slots
    labels = torch.where(b["mask"], 3, -100)
    x = b["logits"].clone().requires_grad_(True)
    ours = presets.trl_server_forward_kl_loss(
        x,
        log_probs,
        b["ids"],
        labels,
        loss_add_tail=tail,
        temperature=0.8,
        gradient_accumulation_steps=2,
    )
    y = b["logits"].clone().requires_grad_(True)
    theirs = (
        reference.trl_server_forward_kl(
            torch.log_softmax(y / 0.8, -1), log_probs, b["ids"], labels, loss_add_tail=tail
        )
        / 2
    )
    ours.backward()
    theirs.backward()
    assert_close(ours, theirs)
    assert_close(x.grad, y.grad)
    b = topk_batch()
    labels = torch.where(b["mask"], 1, -100)[None]
    loss = presets.trl_server_forward_kl_loss(
        b["student"][None],
        b["padded_log_probs"][None],
        b["padded_ids"][None],
        labels,
        loss_add_tail=tail,
    )
    check(f"trl_server_batchmean_tail={tail}", loss)


# --- advantages ------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("generations", [1, 3])
def test_trl_grpo_advantages_equal_trl(aggregation: str, scale: str, generations: int) -> None:
    generator = torch.Generator().manual_seed(6)
    rewards = torch.randint(0, 3, (12, 3), generator=generator).to(D) * 0.5
    rewards[:, 1] += torch.rand(12, generator=generator, dtype=D)
    weights = [1.0, 0.5, 2.0]
    ours = presets.trl_grpo_advantages(
        rewards,
        generations,
        multi_objective_aggregation=aggregation,
        reward_weights=weights,
        scale_rewards=scale,
    )
    theirs = reference.trl_multi_objective_advantages(
        rewards, generations, weights=weights, aggregation=aggregation, scale_rewards=scale
    )
    assert_close(ours, theirs)


def test_trl_grpo_advantages_equal_trl_on_its_batch() -> None:
    b = gdpo_batch()
    rewards, weights = b["rewards"], b["weights"]
    check(
        "trl_normalize_then_sum",
        presets.trl_grpo_advantages(
            rewards, 4, multi_objective_aggregation="normalize_then_sum", reward_weights=weights
        ),
        tol=1e-7,
    )
    for scale in ("group", "batch", "none"):
        check(
            f"trl_sum_then_normalize_{scale}",
            presets.trl_grpo_advantages(rewards, 4, reward_weights=weights, scale_rewards=scale),
            tol=1e-7,
        )
    with pytest.raises(ValueError, match="^multi_objective_aggregation"):
        presets.trl_grpo_advantages(rewards, 4, multi_objective_aggregation="sum")
    with pytest.raises(ValueError, match="^scale_rewards"):
        presets.trl_grpo_advantages(rewards, 4, scale_rewards="std")


@pytest.mark.parametrize("by_std", [True, False])
def test_verl_gdpo_advantages_equal_verl(by_std: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    scores = torch.rand(9, 2, generator=generator, dtype=D)
    index = ["a", "b", "a", "c", "b", "a", "d", "c", "b"]  # "d": a group of one (r / (1 + eps))
    mask = torch.arange(5)[None] < torch.randint(1, 6, (9, 1), generator=generator)
    out = presets.verl_gdpo_advantages(
        scores, mask, index, gdpo_reward_weights=[1.0, 0.3], norm_adv_by_std_in_grpo=by_std
    )
    expected = reference.verl_gdpo(
        scores, mask, index, weights=[1.0, 0.3], norm_adv_by_std_in_grpo=by_std
    )
    assert_close(out.advantages, expected)
    assert out.returns is out.advantages
    b = gdpo_batch()
    index = (torch.arange(24) // 4).tolist()
    check(
        "verl_gdpo",
        presets.verl_gdpo_advantages(
            b["rewards"], b["mask"], index, gdpo_reward_weights=b["weights"]
        ).advantages,
        tol=1e-6,
    )
