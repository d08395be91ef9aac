"""The six examples of the two seed specifications, verbatim (lists as written).

The float32 cases run on both backends (``backend``: the PyTorch path, then the Triton kernels
through the interpreter): the second GRPO example puts both ratios exactly on the clip edges,
where the kernels used to count NumPy's ``exp`` of log(1.2) (1.1999999285) against the float32
edges; the decision rule (``docs/conventions.md``, "Decisions at a bound") gives 0 on both.
"""

from __future__ import annotations

import pytest
import torch

from rlobjectives import grpo_clipped_surrogate, kl_penalized_rewards

true, false = True, False  # the seeds write JSON booleans

GRPO_EXAMPLES = [
    (
        dict(
            new_log_probs=[[0.4054651081081644, -0.6931471805599453], [0, 0]],
            old_log_probs=[[0, 0], [0, 0]],
            advantages=[2, -1],
            token_mask=[[true, true], [true, false]],
            clip_epsilon=0.2,
        ),
        # r = [1.5, 0.5, 1]; s = [min(3, 2.4), min(1, 1.6), min(-1, -1)] = [2.4, 1, -1]
        # loss = -(2.4 + 1 - 1)/3 = -0.8; per sequence [(2.4 + 1)/2, -1]; clipped 2/3
        {"loss": -0.8, "per_sequence_surrogate": [1.7, -1], "clipped_fraction": 0.666667},
    ),
    (
        dict(
            new_log_probs=[[0.1823215567939546, -0.2231435513142097]],
            old_log_probs=[[0, 0]],
            advantages=[1],
            token_mask=[[true, true]],
            clip_epsilon=0.2,
        ),
        # r = [1.2, 0.8] (both on the band's edges, not clipped); s = [1.2, 0.8]; loss = -1
        {"loss": -1, "per_sequence_surrogate": [1], "clipped_fraction": 0},
    ),
    (
        dict(
            new_log_probs=[[2, -2]],
            old_log_probs=[[0, 0]],
            advantages=[3],
            token_mask=[[false, false]],
            clip_epsilon=0.2,
        ),
        # nothing selected: everything is 0
        {"loss": 0, "per_sequence_surrogate": [0], "clipped_fraction": 0},
    ),
]

KL_EXAMPLES = [
    (
        dict(
            policy_log_probs=[[-1, -2]],
            reference_log_probs=[[-1.5, -2.5]],
            rewards=[3],
            response_mask=[[true, true]],
            beta=0.5,
        ),
        # D = 0.5 + 0.5 = 1; r~ = 3 - 0.5 * 1 = 2.5
        {"objective": 2.5, "penalized_rewards": [2.5], "sampled_divergences": [1]},
    ),
    (
        dict(
            policy_log_probs=[[-1, -2, -3], [-0.5, -0.5, -0.5]],
            reference_log_probs=[[-1.2, -2.1, -3.4], [-0.7, -0.4, -0.2]],
            rewards=[1, -1],
            response_mask=[[true, true, false], [true, true, true]],
            beta=0.2,
        ),
        # D = [0.2 + 0.1, 0.2 - 0.1 - 0.3] = [0.3, -0.2]; r~ = [1 - 0.06, -1 + 0.04]
        # J = (0.94 - 0.96)/2 = -0.01
        {
            "objective": -0.01,
            "penalized_rewards": [0.94, -0.96],
            "sampled_divergences": [0.3, -0.2],
        },
    ),
    (
        dict(
            policy_log_probs=[[-1, -2]],
            reference_log_probs=[[-3, -4]],
            rewards=[-2],
            response_mask=[[false, false]],
            beta=3,
        ),
        # nothing selected: D = 0, r~ = r
        {"objective": -2, "penalized_rewards": [-2], "sampled_divergences": [0]},
    ),
]


def _check(outputs: dict[str, torch.Tensor], expected: dict[str, object], atol: float) -> None:
    assert set(outputs) == set(expected)
    for key, value in expected.items():
        actual = outputs[key]
        assert isinstance(actual, torch.Tensor)
        target = torch.tensor(value, dtype=torch.float64)
        assert actual.shape == target.shape, key
        torch.testing.assert_close(actual.double(), target, rtol=0, atol=atol)


@pytest.mark.parametrize(("inputs", "expected"), GRPO_EXAMPLES)
def test_grpo_seed_examples(
    inputs: dict[str, object], expected: dict[str, object], backend: str
) -> None:
    outputs = grpo_clipped_surrogate(**inputs)  # type: ignore[arg-type]
    # 0.666667 is written with 6 decimals in the spec; everything else is exact to float32.
    _check(outputs, expected, atol=1e-6)
    # integer log-probs (the third example) become the default float dtype
    assert all(v.dtype == torch.get_default_dtype() for v in outputs.values())


@pytest.mark.parametrize(("inputs", "expected"), KL_EXAMPLES)
def test_kl_seed_examples(
    inputs: dict[str, object], expected: dict[str, object], backend: str
) -> None:
    outputs = kl_penalized_rewards(**inputs)  # type: ignore[arg-type]
    _check(outputs, expected, atol=1e-6)
    assert all(v.dtype == torch.float32 for v in outputs.values())


@pytest.mark.parametrize(("inputs", "expected"), GRPO_EXAMPLES)
def test_grpo_seed_examples_float64(inputs: dict[str, object], expected: dict[str, object]) -> None:
    converted = {
        k: torch.tensor(v, dtype=torch.float64) if "log_probs" in k else v
        for k, v in inputs.items()
    }
    outputs = grpo_clipped_surrogate(**converted)  # type: ignore[arg-type]
    assert all(v.dtype == torch.float64 for v in outputs.values())
    _check(outputs, expected, atol=1e-6 if "clipped_fraction" in expected else 1e-12)
    torch.testing.assert_close(
        outputs["loss"].double(),
        torch.tensor(float(expected["loss"]), dtype=torch.float64),  # type: ignore[arg-type]
        rtol=0,
        atol=1e-12,
    )
