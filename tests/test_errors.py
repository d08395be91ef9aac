"""Bad input: ValueError/TypeError naming the argument, the expectation and what was received."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlobjectives import grpo_clipped_surrogate, kl_penalized_rewards


def grpo(**overrides: object) -> dict[str, torch.Tensor]:
    arguments: dict[str, object] = dict(
        new_log_probs=torch.zeros(2, 3),
        old_log_probs=torch.zeros(2, 3),
        advantages=torch.ones(2),
        token_mask=torch.ones(2, 3, dtype=torch.bool),
        clip_epsilon=0.2,
    )
    arguments.update(overrides)
    return grpo_clipped_surrogate(**arguments)  # type: ignore[arg-type]


def kl(**overrides: object) -> dict[str, torch.Tensor]:
    arguments: dict[str, object] = dict(
        policy_log_probs=torch.zeros(2, 3),
        reference_log_probs=torch.zeros(2, 3),
        rewards=torch.ones(2),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
        beta=0.1,
    )
    arguments.update(overrides)
    return kl_penalized_rewards(**arguments)  # type: ignore[arg-type]


GRPO_CASES = [
    (
        dict(old_log_probs=torch.zeros(2, 4)),
        ValueError,
        r"old_log_probs must have the same shape as new_log_probs \(2, 3\), got shape \(2, 4\)",
    ),
    (
        dict(token_mask=torch.ones(3, 3)),
        ValueError,
        r"token_mask must have the same shape as new_log_probs \(2, 3\), got shape \(3, 3\)",
    ),
    (
        dict(new_log_probs=torch.zeros(2, 3, 1)),
        ValueError,
        r"new_log_probs must have shape \(B, T\).*got shape \(2, 3, 1\)",
    ),
    (
        dict(new_log_probs=torch.zeros(6)),
        ValueError,
        r"new_log_probs must have shape \(B, T\).*got shape \(6,\)",
    ),
    (
        dict(advantages=torch.ones(3)),
        ValueError,
        r"advantages must have shape \(B,\), \(B, 1\) or \(B, T\) with \(B, T\) = \(2, 3\)"
        r".*got shape \(3,\)",
    ),
    (
        dict(advantages=torch.ones(2, 2)),
        ValueError,
        r"advantages must have shape .*got shape \(2, 2\)",
    ),
    (
        dict(advantages=torch.ones(2, 3, 1)),
        ValueError,
        r"advantages must have shape .*got shape \(2, 3, 1\)",
    ),
    (dict(clip_epsilon=-0.1), ValueError, r"clip_epsilon must be >= 0.0, got -0.1"),
    (dict(clip_epsilon=math.nan), ValueError, r"clip_epsilon must be finite, got nan"),
    (dict(clip_epsilon=math.inf), ValueError, r"clip_epsilon must be finite, got inf"),
    (dict(clip_epsilon=torch.tensor(-1.0)), ValueError, r"clip_epsilon must be >= 0.0, got -1.0"),
    (dict(clip_epsilon="0.2"), TypeError, r"clip_epsilon must be a real number, got str"),
    (dict(clip_epsilon=True), TypeError, r"clip_epsilon must be a real number, got bool"),
    (
        dict(clip_epsilon=torch.ones(2)),
        TypeError,
        r"clip_epsilon must be a real number or a 0-d real tensor",
    ),
    (
        dict(new_log_probs=[[0.0, "a", 1.0], [0, 0, 0]]),
        TypeError,
        r"new_log_probs must contain only numbers or bools, got str \('a'\) "
        r"at new_log_probs\[0\]\[1\]",
    ),
    (
        dict(new_log_probs=[[0.0, 1.0, 2.0], [0.0, 1.0]]),
        ValueError,
        r"new_log_probs is a ragged nested list",
    ),
    (dict(token_mask=[[1, 1, 1], [1, 1]]), ValueError, r"token_mask is a ragged nested list"),
    (
        dict(advantages=[None, 1.0]),
        TypeError,
        r"advantages must contain only numbers or bools, got NoneType",
    ),
    (
        dict(old_log_probs=np.array([["a", "b", "c"], ["d", "e", "f"]])),
        TypeError,
        r"old_log_probs must be a numeric or bool array, got NumPy dtype <U1",
    ),
    (
        dict(old_log_probs="zeros"),
        TypeError,
        r"old_log_probs must be a torch.Tensor, a NumPy array or a nested list of numbers, got str",
    ),
    (
        dict(new_log_probs=torch.zeros(2, 3, dtype=torch.complex64)),
        TypeError,
        r"new_log_probs must be a real tensor",
    ),
]


@pytest.mark.parametrize(("overrides", "error", "message"), GRPO_CASES)
def test_grpo_errors(overrides: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        grpo(**overrides)


KL_CASES = [
    (
        dict(reference_log_probs=torch.zeros(2, 2)),
        ValueError,
        r"reference_log_probs must have the same shape as policy_log_probs \(2, 3\), "
        r"got shape \(2, 2\)",
    ),
    (
        dict(response_mask=torch.ones(2)),
        ValueError,
        r"response_mask must have shape \(B, T\).*got shape \(2,\)",
    ),
    (
        dict(rewards=torch.ones(3)),
        ValueError,
        r"rewards must have shape \(B,\) = \(2,\).*got shape \(3,\)",
    ),
    (
        dict(rewards=torch.ones(2, 3)),
        ValueError,
        r"rewards must have shape \(B,\) = \(2,\).*got shape \(2, 3\)",
    ),
    (dict(rewards=1.0), ValueError, r"rewards must have shape \(B,\) = \(2,\).*got shape \(\)"),
    (dict(beta=-1), ValueError, r"beta must be >= 0.0, got -1.0"),
    (dict(beta=math.nan), ValueError, r"beta must be finite, got nan"),
    (dict(beta=-math.inf), ValueError, r"beta must be finite, got -inf"),
    (dict(beta=None), TypeError, r"beta must be a real number, got NoneType"),
    (
        dict(policy_log_probs=[[1, 2, 3], [1, 2]]),
        ValueError,
        r"policy_log_probs is a ragged nested list",
    ),
    (dict(rewards=["a", "b"]), TypeError, r"rewards must contain only numbers or bools, got str"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), KL_CASES)
def test_kl_errors(overrides: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        kl(**overrides)


@pytest.mark.skipif(
    not torch.backends.mps.is_available() and not torch.cuda.is_available(),
    reason="needs a second device",
)
def test_tensors_on_different_devices() -> None:  # pragma: no cover - GPU only
    device = "cuda" if torch.cuda.is_available() else "mps"
    with pytest.raises(
        ValueError, match=r"old_log_probs must be on the same device as new_log_probs"
    ):
        grpo(old_log_probs=torch.zeros(2, 3, device=device))


def test_tensors_on_different_devices_meta() -> None:
    # The meta device stands in for a second device on a CPU-only machine.
    with pytest.raises(
        ValueError,
        match=r"old_log_probs must be on the same device as new_log_probs \(cpu\), got device meta",
    ):
        grpo(old_log_probs=torch.zeros(2, 3, device="meta"))
    with pytest.raises(
        ValueError,
        match=r"rewards must be on the same device as policy_log_probs \(cpu\), got device meta",
    ):
        kl(rewards=torch.ones(2, device="meta"))
