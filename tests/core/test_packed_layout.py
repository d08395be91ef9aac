"""Every function on packed sequences equals the same function on their padded layout.

The property that defines the packed layout (issue 15): for random batches (uneven lengths,
empty sequences, one-token sequences, sequences with no selected token, right or left padding)
the packed call (``(N,)`` tensors + ``cu_seqlens``) gives the values and gradients of the padded
call, to float64 rounding; NaN/inf at unselected tokens changes nothing (bit for bit). The cases
are the registry of ``tests/packed_cases.py``: a new function is one entry there. The cases of
the functions with Triton kernels also run on them (the ``backend`` fixture, float32: packed ==
padded to float32 rounding, the sums being ordered differently).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import FIXTURE_HEALTH, dtype_for, triton_param
from packed_cases import CASES, Batch, Case, Outputs, View, make_batch, make_tensors
from tolerances import LAYOUT_TOLERANCE, tolerance

batches = st.builds(
    make_batch,
    lengths=st.lists(st.sampled_from([0, 1, 1, 2, 3, 5, 8]), min_size=0, max_size=5),
    extra=st.integers(0, 2),
    side=st.sampled_from(["right", "left"]),
    seed=st.integers(0, 2**16),
)


def _weights(outputs: Outputs) -> Outputs:
    """Fixed cotangents: one distinct weight per entry of every differentiable output."""
    return {
        name: torch.linspace(0.5, 1.5, max(value.numel(), 1), dtype=torch.float64)[
            : value.numel()
        ].reshape(value.shape)
        for name, value in outputs.items()
    }


def _evaluate(
    case: Case, batch: Batch, *, packed: bool, poison: bool, dtype: torch.dtype
) -> tuple[Outputs, Outputs]:
    """The case's outputs and the gradients of a fixed weighted sum of them w.r.t. its leaves."""
    tensors = make_tensors(batch, poison=poison, dtype=dtype)
    outputs = case.run(View(batch, tensors, packed))
    outputs = {name: value.to(torch.float64) for name, value in outputs.items()}
    weights = _weights(outputs)
    total = sum(
        ((value * weights[name]).sum() for name, value in outputs.items() if value.requires_grad),
        torch.zeros((), dtype=torch.float64),
    )
    leaves = [tensors[name] for name in case.leaves]
    gradients: Outputs = {}
    if leaves and total.requires_grad:
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        for name, leaf, grad in zip(case.leaves, leaves, grads, strict=True):
            gradients[name] = torch.zeros_like(leaf) if grad is None else grad
    return {n: v.detach() for n, v in outputs.items()}, gradients


def _assert_same(
    actual: Outputs, expected: Outputs, what: str, exact: bool = False, rtol_atol: Any = None
) -> None:
    assert actual.keys() == expected.keys(), what
    for name, value in actual.items():
        assert value.shape == expected[name].shape, f"{what}: {name} shape"
        if exact:
            assert torch.equal(value, expected[name]), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(
                value,
                expected[name],
                **(rtol_atol or LAYOUT_TOLERANCE),
                msg=lambda m, n=name: f"{what} {n}: {m}",
            )


def _check_case(case: Case, batch: Batch, dtype: torch.dtype = torch.float64) -> None:
    padded, padded_grads = _evaluate(case, batch, packed=False, poison=True, dtype=dtype)
    packed, packed_grads = _evaluate(case, batch, packed=True, poison=True, dtype=dtype)
    rounding = None if dtype == torch.float64 else tolerance(dtype)
    _assert_same(packed, padded, "values", rtol_atol=rounding)
    _assert_same(packed_grads, padded_grads, "gradients", rtol_atol=rounding)
    # NaN/inf at every unselected token reaches nothing: bit-identical to the clean packed call.
    clean, clean_grads = _evaluate(case, batch, packed=True, poison=False, dtype=dtype)
    _assert_same(packed, clean, "poisoned values", exact=True)
    _assert_same(packed_grads, clean_grads, "poisoned gradients", exact=True)
    for name, value in packed.items():
        assert torch.isfinite(value).all(), f"{name} is not finite"


LIGHT = [case for case in CASES if not case.heavy]
HEAVY = [case for case in CASES if case.heavy]
# The functions with Triton kernels (their PyTorch-only variants excluded).
KERNEL_FUNCTIONS = (
    "policy_loss", "grpo_clipped_surrogate", "kl_loss", "kl_penalized_rewards",
    "token_log_probs_from_hidden", "fused_policy_loss_from_hidden",
)  # fmt: skip
TORCH_VARIANTS = ("gmpo", "vespo", "autograd")


def _backend_cases(cases: list[Case]) -> list[Any]:
    """Every case on PyTorch; those with kernels on the Triton backend too."""
    on_kernels = [
        case
        for case in cases
        if case.name.split("-")[0] in KERNEL_FUNCTIONS
        and case.kernels
        and not any(variant in case.name for variant in TORCH_VARIANTS)
    ]
    return [
        *(pytest.param("torch", case, id=f"torch-{case.name}") for case in cases),
        *(triton_param(case, id=f"triton-{case.name}") for case in on_kernels),
    ]


@pytest.mark.parametrize(("backend", "case"), _backend_cases(LIGHT), indirect=["backend"])
@settings(FIXTURE_HEALTH, max_examples=15)
@given(batch=batches)
def test_packed_equals_padded(backend: str, case: Case, batch: Batch) -> None:
    _check_case(case, batch, dtype_for(backend))


@pytest.mark.parametrize(("backend", "case"), _backend_cases(HEAVY), indirect=["backend"])
@settings(FIXTURE_HEALTH, max_examples=8)
@given(batch=batches)
def test_packed_equals_padded_vocabulary(backend: str, case: Case, batch: Batch) -> None:
    # The chunked vocabulary passes (logits, LM head) cost more per call: fewer examples.
    _check_case(case, batch, dtype_for(backend))


def test_registry_covers_the_boundary_functions() -> None:
    names = {case.name.split("-")[0] for case in CASES}
    expected = {
        "aggregate",
        "policy_loss",
        "grpo_clipped_surrogate",
        "kl_loss",
        "kl_penalized_rewards",
        "kl_penalized_token_rewards",
        "full_vocab_kl_loss",
        "token_log_probs_from_hidden",
        "fused_policy_loss_from_hidden",
        "global_normalizers",
        "gae",
        "reinforce_plus_plus_advantages",
        "value_loss",
        "opo_advantages",
        "remax_advantages",
    }
    assert expected <= names


def test_one_row_and_flat_shapes_agree() -> None:
    # (1, N) as models return it gives the same values as (N,), in the (1, N) shape.
    batch = make_batch([3, 0, 1, 4], extra=1, side="left", seed=3)
    tensors = make_tensors(batch, poison=True)
    view = View(batch, tensors, packed=True)
    import rlobjectives as rlo

    flat = rlo.policy_loss(
        view["log_probs"], view["old_log_probs"], view["advantages"], view["mask"],
        reduction="none", cu_seqlens=view.cu_seqlens,
    )  # fmt: skip
    row = rlo.policy_loss(
        view["log_probs"][None], view["old_log_probs"][None], view["advantages"],
        view["mask"][None], reduction="none", cu_seqlens=view.cu_seqlens,
    )  # fmt: skip
    assert flat.loss.shape == (int(batch.attention.sum()),)
    assert row.loss.shape == (1, flat.loss.shape[0])
    assert torch.equal(row.loss[0], flat.loss)
