"""``iw_opd_advantages`` (IW-OPD) against a float64 reference and TRL 1.16's own
``IWOPDTrainer._compute_iw_opd_loss`` (run here on a stub trainer)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo

D = torch.float64


def test_golden() -> None:
    # A = l^T - l^roll = [1, .5, -1 | 0, x, 2]; |A| sums 2.5 and 2 (x unselected)
    # row 0: prefix [0, 1, 1.5] -> w = 1 + .5 (1 - [0, .4, .6]) = [1.5, 1.3, 1.2]
    #        -> wA = [1.5, .65, -1.2]
    # row 1: prefix [0, -, 0] of 2 -> w = [1.5, -, 1.5] -> [0, 0, 3]
    teacher = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, float("nan"), -1.0]], dtype=D)
    rollout = torch.tensor([[-2.0, -1.5, -1.0], [-1.0, float("nan"), -3.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    out = rlo.iw_opd_advantages(teacher, rollout, mask, gamma=0.5)
    expected = torch.tensor([[1.5, 0.65, -1.2], [0.0, 0.0, 3.0]], dtype=D)
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=1e-16)
    assert not out.requires_grad
    # gamma = 0 is plain OPD (A); an all-zero row stays 0 (the eps floor)
    torch.testing.assert_close(
        rlo.iw_opd_advantages(teacher, rollout, mask, gamma=0.0),
        torch.where(mask, teacher - rollout, 0.0),
    )
    assert torch.equal(
        rlo.iw_opd_advantages(rollout, rollout, mask, gamma=2.0)[0], torch.zeros(3, dtype=D)
    )


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(0, 4),
    tokens=st.integers(0, 7),
    seed=st.integers(0, 2**16),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
)
def test_matches_the_reference(batch: int, tokens: int, seed: int, gamma: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    teacher = -3 * torch.rand(batch, tokens, generator=generator, dtype=D)
    rollout = -3 * torch.rand(batch, tokens, generator=generator, dtype=D)
    mask = torch.rand(batch, tokens, generator=generator) < 0.7
    ours = rlo.iw_opd_advantages(teacher, rollout, mask, gamma=gamma)
    expected = reference.iw_opd_advantages(teacher, rollout, mask, gamma=gamma)
    torch.testing.assert_close(ours, expected, rtol=1e-13, atol=1e-15)


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
iw_opd_trainer = pytest.importorskip("trl.experimental.iw_opd.iw_opd_trainer")


@pytest.mark.parametrize("gamma", [0.5, 1.7])
@pytest.mark.parametrize("items", [None, 23])
@pytest.mark.parametrize("rollout_given", [True, False])
def test_equals_trl(gamma: float, items: int | None, rollout_given: bool) -> None:
    # TRL's loss -l A w summed / N: the gradient w.r.t. the student's log-probabilities is
    # -w A / N, so the library's advantages reproduce TRL's loss and gradient through
    # aggregate(-l * A, mask, normalizer=N)
    generator = torch.Generator().manual_seed(35050)
    batch, tokens, vocab = 4, 7, 11
    logits = torch.randn(batch, tokens, vocab, generator=generator, dtype=D)
    completion = torch.randint(0, vocab, (batch, tokens), generator=generator)
    labels = torch.where(torch.rand(batch, tokens, generator=generator) < 0.75, completion, -100)
    teacher = -3 * torch.rand(batch, tokens, generator=generator, dtype=D)
    rollout = -3 * torch.rand(batch, tokens, generator=generator, dtype=D)
    stub = SimpleNamespace(
        temperature=0.9, iw_opd_gamma=gamma, iw_opd_epsilon=1e-8,
        model=SimpleNamespace(training=True), _metrics={"train": {
            name: [] for name in ("iw_opd/mean_advantage", "iw_opd/mean_abs_advantage",
                                  "iw_opd/mean_weight", "iw_opd/min_weight", "iw_opd/max_weight")
        }},
    )  # fmt: skip
    theirs_logits = logits.clone().requires_grad_(True)
    theirs = iw_opd_trainer.IWOPDTrainer._compute_iw_opd_loss(
        stub, theirs_logits, completion, labels, teacher,
        rollout if rollout_given else None, num_items_in_batch=items,
    )  # fmt: skip
    ours_logits = logits.clone().requires_grad_(True)
    log_probs = rlo.token_log_probs(ours_logits, completion, temperature=0.9)
    mask = labels != -100
    sampler = rollout if rollout_given else log_probs.detach()
    advantages = rlo.iw_opd_advantages(teacher, sampler, mask, gamma=gamma)
    ours = rlo.aggregate(-log_probs * advantages, mask, normalizer=items)
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-15)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logits)
    (ours_grad,) = torch.autograd.grad(ours, ours_logits)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-13, atol=1e-15)
