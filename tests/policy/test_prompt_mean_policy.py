"""``reduction="prompt_mean"`` on ``policy_loss`` and ``fused_policy_loss_from_hidden``.

The loss is ``aggregate(per_token_loss, mask, reduction="prompt_mean", ...)`` of the same call's
per-token loss (one formula, one reduction): checked against that composition, padded and
packed, with ``group_size`` and ``group_ids``, values and gradients, and a hand golden.
"""

from __future__ import annotations

import pytest
import torch

import rlobjectives as rlo
from tolerances import assert_close

F64 = torch.float64


def _batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 5, generator=g, dtype=F64) * 2
    log_probs = old + 0.4 * torch.randn(6, 5, generator=g, dtype=F64)
    mask = torch.rand(6, 5, generator=g) < 0.7
    mask[3] = False  # an empty response in the second prompt
    return log_probs, old, torch.randn(6, generator=g, dtype=F64), mask


def test_golden() -> None:
    # Clip(low=None): L = -r A per token. Two prompts of two responses, one token each except
    # response 1 (two tokens); on-policy (r = 1): L = -A.
    # prompt 0: responses 0, 1 with A = 1, 2: tokens L = -1, -2, -2 -> sum -5 over 3 tokens
    # prompt 1: responses 2, 3 with A = -1, 4: tokens L = 1, -4 -> sum -3 over 2 tokens
    # prompt_mean = (-5/3 + -3/2) / 2 = -1.5833333
    log_probs = torch.zeros(4, 2, dtype=F64)
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, 2.0, -1.0, 4.0], dtype=F64)
    out = rlo.policy_loss(
        log_probs, log_probs, advantages, mask, surrogate=rlo.Clip(low=None),
        reduction="prompt_mean", group_size=2,
    )  # fmt: skip
    assert_close(out.loss, torch.tensor((-5 / 3 - 3 / 2) / 2, dtype=F64))


@pytest.mark.parametrize("groups", [{"group_size": 2}, {"group_ids": [7, 7, 3, 3, 3, 9]}])
def test_equals_aggregate_of_the_per_token_loss(groups: dict[str, object]) -> None:
    log_probs, old, advantages, mask = _batch(1)
    leaf = log_probs.clone().requires_grad_(True)
    out = rlo.policy_loss(leaf, old, advantages, mask, reduction="prompt_mean", **groups)
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    leaf2 = log_probs.clone().requires_grad_(True)
    per_token = rlo.policy_loss(leaf2, old, advantages, mask, reduction="none").loss
    want = rlo.aggregate(per_token, mask, reduction="prompt_mean", **groups)
    (want_grad,) = torch.autograd.grad(want, [leaf2])
    assert_close(out.loss, want)
    assert_close(grad, want_grad)
    packed = rlo.pack(log_probs, mask)
    flat = rlo.policy_loss(
        packed.values, rlo.pack(old, mask).values, advantages,
        torch.ones_like(packed.values, dtype=torch.bool), reduction="prompt_mean",
        cu_seqlens=packed.cu_seqlens, **groups,
    )  # fmt: skip
    torch.testing.assert_close(flat.loss, out.loss.detach(), rtol=1e-12, atol=1e-12)


def test_from_hidden_equals_policy_loss_on_its_log_probs() -> None:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 3, 5, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(9, 5, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 9, (4, 3), generator=g)
    old = -torch.rand(4, 3, generator=g, dtype=F64) - 1.5
    advantages = torch.randn(4, generator=g, dtype=F64)
    mask = torch.rand(4, 3, generator=g) < 0.8
    out = rlo.fused_policy_loss_from_hidden(
        hidden, weight, tokens, old, advantages, mask, reduction="prompt_mean", group_size=2,
        chunk_size=5,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss, [hidden, weight])
    leaves = [
        hidden.detach().clone().requires_grad_(True),
        weight.detach().clone().requires_grad_(True),
    ]
    log_probs = rlo.token_log_probs_from_hidden(leaves[0], leaves[1], tokens)
    want = rlo.policy_loss(log_probs, old, advantages, mask, reduction="prompt_mean", group_size=2)
    want_grads = torch.autograd.grad(want.loss, leaves)
    assert_close(out.loss, want.loss)
    for got, ref in zip(grads, want_grads, strict=True):
        assert_close(got, ref)


def test_prompt_mean_needs_the_groups() -> None:
    log_probs, old, advantages, mask = _batch(3)
    with pytest.raises(ValueError, match="group_size"):
        rlo.policy_loss(log_probs, old, advantages, mask, reduction="prompt_mean")
