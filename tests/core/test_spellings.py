"""The peers' spellings: accepted aliases give the same results, the others say "did you mean"."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import rlobjectives
from rlobjectives._core.spellings import ESTIMATOR_HINTS, REDUCTION_ALIASES, REDUCTION_HINTS
from tolerances import assert_close

# L = [[1, 2, 3], [4, 5, 99(pad)]] with an empty third row; verl's agg_loss on it (local):
# token-mean 15/5 = 3, seq-mean-token-mean (6/3 + 9/2)/2 = 3.25 (empty rows are not counted),
# seq-mean-token-sum (6 + 9)/2 = 7.5 (non-empty rows), seq-mean-token-sum-norm 7.5/T(=3) = 2.5.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
VERL = {
    "token-mean": 3.0,
    "seq-mean-token-mean": 3.25,
    "seq-mean-token-sum": 7.5,
    "seq-mean-token-sum-norm": 2.5,
    "token-sum": 15.0,
}


@pytest.mark.parametrize("alias", list(REDUCTION_ALIASES))
def test_reduction_aliases_are_accepted_everywhere(alias: str) -> None:
    canonical = REDUCTION_ALIASES[alias]
    assert_close(rlobjectives.aggregate(VALUES, MASK, reduction=alias), VERL[alias])  # type: ignore[arg-type]
    log_probs = torch.randn(3, 3, requires_grad=True)
    old, advantages = torch.randn(3, 3), torch.randn(3)
    for function in (rlobjectives.policy_loss, rlobjectives.policy_loss):
        ours = function(log_probs, old, advantages, MASK, reduction=alias, normalizer=2.5)
        expected = function(log_probs, old, advantages, MASK, reduction=canonical, normalizer=2.5)
        assert torch.equal(ours.loss, expected.loss)
    kl = rlobjectives.kl_loss(log_probs, old, MASK, estimator="k2", reduction=alias)  # type: ignore[arg-type]
    assert torch.equal(
        kl, rlobjectives.kl_loss(log_probs, old, MASK, estimator="k2", reduction=canonical)
    )  # type: ignore[arg-type]
    counts = rlobjectives.global_normalizers(MASK)
    assert torch.equal(
        rlobjectives.normalizer_for_reduction(counts, reduction=alias),
        rlobjectives.normalizer_for_reduction(counts, reduction=canonical),
    )


@pytest.mark.parametrize("name", list(REDUCTION_HINTS))
def test_reduction_hints_say_did_you_mean(name: str) -> None:
    hint = re.escape(REDUCTION_HINTS[name])
    with pytest.raises(ValueError, match=f"reduction={name!r}.*did you mean {hint}"):
        rlobjectives.aggregate(VALUES, MASK, reduction=name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="did you mean"):
        rlobjectives.policy_loss(VALUES, VALUES, torch.ones(3), MASK, reduction=name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="did you mean"):
        counts = rlobjectives.global_normalizers(MASK)
        rlobjectives.normalizer_for_reduction(counts, reduction=name)
    preset = "trl_grpo_loss" if "-" not in name else "verl_policy_loss"
    with pytest.raises(ValueError, match=f"rlobjectives.presets.{preset}"):
        rlobjectives.aggregate(VALUES, MASK, reduction=name)  # type: ignore[arg-type]


def test_verl_reduction_hints_give_verl_numbers() -> None:
    # The calls the hints give reproduce verl's local agg_loss: S = 2 non-empty rows, T = 3.
    aggregate = rlobjectives.aggregate
    sequences = 2
    sums = aggregate(VALUES, MASK, reduction="sequence_sum_normalized", max_response_length=1,
                     normalizer=sequences)  # fmt: skip
    assert_close(sums, VERL["seq-mean-token-sum"])
    assert_close(aggregate(VALUES, MASK, reduction="sequence_sum_normalized",
                           max_response_length=3, normalizer=sequences),
                 VERL["seq-mean-token-sum-norm"])  # fmt: skip
    assert_close(aggregate(VALUES, MASK, reduction="token_mean", normalizer=1), VERL["token-sum"])
    # and the default sequence_sum_normalized divides by all B = 3 rows, not the non-empty 2
    assert_close(aggregate(VALUES, MASK, reduction="sequence_sum_normalized",
                           max_response_length=1), 15.0 / 3)  # fmt: skip


ESTIMATOR_CALLS = {
    "kl": {"estimator": "k1"},
    "mse": {"estimator": "k2"},
    "low_var_kl": {"estimator": "k3"},
    "k1+": {"estimator": "k1", "straight_through": True},
    "kl+": {"estimator": "k1", "straight_through": True},
    "k2+": {"estimator": "k2"},
    "mse+": {"estimator": "k2"},
    "k3+": {"estimator": "k3", "straight_through": True},
    "low_var_kl+": {"estimator": "k3", "straight_through": True},
    "abs+": {"estimator": "k2"},
}


@pytest.mark.parametrize("name", list(ESTIMATOR_HINTS))
def test_estimator_hints_say_did_you_mean(name: str) -> None:
    log_probs, ref_log_probs = torch.randn(2, 3), torch.randn(2, 3)
    hint = re.escape(ESTIMATOR_HINTS[name])
    for function in (rlobjectives.kl_loss, rlobjectives.kl_estimate):
        with pytest.raises(
            ValueError, match=f"estimator={re.escape(repr(name))}.*did you mean {hint}"
        ):
            function(log_probs, ref_log_probs, MASK[:2], estimator=name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"estimator={re.escape(repr(name))}.*did you mean"):
        rlobjectives.kl_penalized_token_rewards(
            log_probs, ref_log_probs, torch.ones(2), MASK[:2], kl_coef=0.1, estimator=name,  # type: ignore[arg-type]
        )  # fmt: skip
    with pytest.raises(ValueError, match=f"kl_estimator={re.escape(repr(name))}.*did you mean"):
        rlobjectives.fused_policy_loss_from_hidden(
            torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long),
            log_probs, torch.ones(2), MASK[:2], ref_log_probs=ref_log_probs, kl_coef=0.1,
            kl_estimator=name,  # type: ignore[arg-type]
        )  # fmt: skip


@pytest.mark.parametrize("name", list(ESTIMATOR_CALLS))
def test_estimator_hints_are_calls_that_run(name: str) -> None:
    # The suggested call runs; with straight_through (or k2) its gradient is d = log_probs - ref.
    log_probs = torch.tensor([[0.5, -0.2, 1.0]], requires_grad=True)
    call = ESTIMATOR_CALLS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlobjectives.BiasedGradientWarning)
        loss = rlobjectives.kl_loss(
            log_probs, torch.zeros(1, 3), torch.ones(1, 3), reduction="none", **call
        )  # type: ignore[arg-type]
    loss.sum().backward()
    assert log_probs.grad is not None
    if call.get("straight_through") or call["estimator"] == "k2":
        assert_close(log_probs.grad, log_probs.detach())


def test_canonical_names_are_untouched() -> None:
    for name in ("token_mean", "sequence_mean", "sequence_sum_normalized", "none"):
        rlobjectives.aggregate(VALUES, MASK, reduction=name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be one of"):
        rlobjectives.aggregate(VALUES, MASK, reduction="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="estimator must be one of"):
        rlobjectives.kl_loss(VALUES, VALUES, MASK, estimator="k4")  # type: ignore[arg-type]
