"""The error contract of every public function, table-driven from ``tests/cases.py``.

For each row of the registry: the valid arguments work, and each wrong input raises the expected
``ValueError``/``TypeError`` whose message names the argument (never a raw torch error, an
``OverflowError``, a ``RecursionError`` or silence). A meta-test checks that every public
function has a row, so a new function without one fails here.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any

import pytest
import torch

import rlobjectives
import rlobjectives.distributed
import rlobjectives.presets
from cases import CASES, B, Case, T, Wrong
from tolerances import tolerance


def _public_functions() -> set[str]:
    names = set()
    for module in (rlobjectives, rlobjectives.distributed):
        for name in module.__all__:
            if inspect.isfunction(getattr(module, name)):
                names.add(name)
    return names


def test_every_public_function_has_a_row() -> None:
    rows = [case.name for case in CASES]
    assert len(rows) == len(set(rows)), "one row per function"
    missing = _public_functions() - set(rows)
    assert not missing, f"add a row to tests/cases.py for {sorted(missing)}"
    for case in CASES:
        assert case.function is getattr(rlobjectives, case.name)


def test_every_argument_has_wrong_inputs() -> None:
    # Every parameter of every function is exercised by at least one wrong input, so a new
    # option added without rows fails here.
    for case in CASES:
        parameters = set(inspect.signature(case.function).parameters)
        covered = {wrong.argument for wrong in case.wrong}
        assert covered <= parameters, (case.name, covered - parameters)
        assert parameters <= covered, f"{case.name}: no wrong inputs for {parameters - covered}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_valid_arguments_work(case: Case) -> None:
    case.function(**case.valid())


def _rows() -> list[Any]:
    rows = []
    for case in CASES:
        for wrong in case.wrong:
            marks = []
            if wrong.xfail is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=wrong.xfail))
            rows.append(
                pytest.param(
                    case,
                    wrong,
                    id=f"{case.name}-{wrong.argument}-{wrong.kind}-{wrong.label}",
                    marks=marks,
                )
            )
    return rows


@pytest.mark.parametrize(("case", "wrong"), _rows())
def test_wrong_input_raises_a_named_error(case: Case, wrong: Wrong) -> None:
    arguments = case.valid()
    replacement = {wrong.argument: wrong.make(arguments)}
    if wrong.also is not None:
        replacement.update(wrong.also(arguments))
    with pytest.raises(wrong.error) as caught:
        case.function(**{**arguments, **replacement})
    message = str(caught.value)
    assert re.search(wrong.match, message), f"{message!r} does not match {wrong.match!r}"
    assert "\n" not in message.strip(), "one-line messages"
    # Decided for issue 10: a message never contradicts itself.
    assert not re.search(r"0-d real tensor, got Tensor\(shape=\(\)", message), message


# --- the dtype contract (issue 27): every floating input takes part in the computation dtype --

# Arguments that must share one dtype (the LM head: hidden @ weight.T + bias runs in its dtype);
# they are switched to float64 together.
DTYPE_GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "token_log_probs_from_hidden": (("hidden", "weight", "bias"),),
    "fused_policy_loss_from_hidden": (("hidden", "weight", "bias"),),
    "topk_forward_kl_from_hidden": (("hidden", "weight", "bias"),),
    "reverse_kl_loss_from_hidden": (("hidden", "weight", "bias"),),
    "preference_loss_from_hidden": (("hidden", "weight", "bias"),),
    "kto_loss_from_hidden": (("hidden", "weight", "bias"),),
    "generalized_jsd_loss_from_hidden": (
        ("hidden", "weight", "bias"),
        ("teacher_hidden", "teacher_weight", "teacher_bias"),
    ),
}
# The product of a float32 head runs in float32 (as the model's own matmul would): the tests give
# the head values on a grid of 1/8 (a few bits), whose float32 product is exact, so that the mixed
# call and the all-float64 call see the same logits.
HEAD_GRID = 8.0
# float64-accurate: the mixed call equals the all-float64 call on the same values to float64
# rounding (only the order of a few operations may differ).
FLOAT64_ACCURATE = {"rtol": 1e-12, "atol": 1e-12}


def _floating_groups(case: Case, arguments: dict[str, Any]) -> list[tuple[str, ...]]:
    floating = [
        name
        for name, value in arguments.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    ]
    grouped = DTYPE_GROUPS.get(case.name, ())
    alone = [(name,) for name in floating if not any(name in group for group in grouped)]
    return [*(group for group in grouped if set(group) <= set(floating)), *alone]


def _preset_batch() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(27)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator, dtype=torch.float64)

    log_probs = -randn(B, T).abs() - 0.5
    return {
        "log_probs": log_probs,
        "old_log_probs": log_probs + randn(B, T, scale=0.3),
        "advantages": randn(B),
        "mask": torch.tensor([[True, True, False], [True, True, True]]),
        "ref_log_probs": log_probs + randn(B, T, scale=0.2),
        "weights": randn(B, T).abs() + 0.5,
        "entropy": randn(B, T).abs(),
    }


def _trl(**a: Any) -> Any:
    loss_fn = rlobjectives.presets.trl_grpo_loss(loss_type="dapo", beta=0.1, entropy_coef=0.01)
    return loss_fn(a["log_probs"], a["old_log_probs"], a["advantages"], a["mask"],
                   ref_log_probs=a["ref_log_probs"], importance_sampling_ratio=a["weights"],
                   entropy=a["entropy"])  # fmt: skip


def _verl(**a: Any) -> Any:
    loss_fn = rlobjectives.presets.verl_policy_loss("vanilla")
    return loss_fn(a["old_log_probs"], a["log_probs"], a["advantages"][:, None].expand(B, T),
                   a["mask"], "seq-mean-token-mean", None, a["weights"])  # fmt: skip


def _openrlhf(**a: Any) -> Any:
    loss_fn = rlobjectives.presets.openrlhf_policy_loss(is_correction_level="token")
    return loss_fn(a["log_probs"], a["old_log_probs"], a["advantages"][:, None].expand(B, T),
                   a["mask"], rollout_log_probs=a["ref_log_probs"])  # fmt: skip


def _preset_arguments(*names: str) -> Any:
    return lambda: {name: value for name, value in _preset_batch().items() if name in names}


# The presets (not in the error registry: their options are the peers'), same dtype contract.
POLICY = ("log_probs", "old_log_probs", "advantages", "mask")
PRESET_CASES = (
    Case("presets.trl_grpo_loss", _trl, _preset_arguments(*POLICY, "ref_log_probs", "weights",
                                                          "entropy")),
    Case("presets.verl_policy_loss", _verl, _preset_arguments(*POLICY, "weights")),
    Case("presets.openrlhf_policy_loss", _openrlhf, _preset_arguments(*POLICY, "ref_log_probs")),
)  # fmt: skip


def _mixed_rows() -> list[Any]:
    rows = []
    for case in (*CASES, *PRESET_CASES):
        groups = _floating_groups(case, case.valid())
        if len(groups) < 2:  # one floating input: nothing to mix
            continue
        for group in groups:
            rows.append(pytest.param(case, group, id=f"{case.name}-{'+'.join(group)}"))
    return rows


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors of a result (tensor, named tuple, tuple, list or dict), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _outputs_and_gradients(
    case: Case, arguments: dict[str, Any]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The floating outputs and the gradients of a fixed weighted sum of them (float32-exact
    weights, so that a float32 output's cotangent is not rounded)."""
    leaves = {
        name: value.detach().clone().requires_grad_(True)
        for name, value in arguments.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = _tensors(case.function(**{**arguments, **leaves}))
    total = torch.zeros((), dtype=torch.float64)
    for output in outputs:
        if output.requires_grad:
            weights = 0.5 + (torch.arange(output.numel(), dtype=torch.float64) % 5) / 8
            total = total + (output.double() * weights.reshape(output.shape)).sum()
    gradients: dict[str, torch.Tensor] = {}
    if total.requires_grad:
        names = list(leaves)
        grads = torch.autograd.grad(total, [leaves[n] for n in names], allow_unused=True)
        gradients = {n: g for n, g in zip(names, grads, strict=True) if g is not None}
    return [output.detach() for output in outputs], gradients


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    accurate = actual.dtype == torch.float64
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        equal_nan=True,
        **(FLOAT64_ACCURATE if accurate else tolerance(actual.dtype)),
        msg=lambda m: f"{what} ({actual.dtype}): {m}",
    )


@pytest.mark.parametrize(("case", "group"), _mixed_rows())
def test_every_floating_input_takes_part_in_the_computation_dtype(
    case: Case, group: tuple[str, ...]
) -> None:
    # docs/conventions.md: "The math runs in float32, or in float64 when any floating input is
    # float64". Each floating argument in turn is float64, the others float32: the results and
    # the float64 argument's gradient equal the all-float64 call on the same (float32-rounded)
    # values to float64 rounding; float32 results and gradients are that call rounded once.
    valid = case.valid()
    for name in next(iter(DTYPE_GROUPS.get(case.name, ())), ()):
        valid[name] = torch.round(valid[name] * HEAD_GRID) / HEAD_GRID
    rounded = {
        name: value.float() if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in valid.items()
    }  # fmt: skip
    mixed = {**rounded, **{name: rounded[name].double() for name in group}}
    reference = {
        name: value.double() if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in rounded.items()
    }  # fmt: skip
    outputs, gradients = _outputs_and_gradients(case, mixed)
    expected_outputs, expected_gradients = _outputs_and_gradients(case, reference)
    assert len(outputs) == len(expected_outputs)
    for index, (actual, expected) in enumerate(zip(outputs, expected_outputs, strict=True)):
        _close(actual, expected, f"output {index}")
    assert gradients.keys() == expected_gradients.keys()
    for name in group:
        if name in gradients:
            assert gradients[name].dtype == torch.float64, name
    for name, gradient in gradients.items():
        _close(gradient, expected_gradients[name], f"gradient of {name}")


# --- configuration from the environment (issue 27): validated on every call of every function --


# The surrogate objects (Clip, CISPO, ...) are values: building one runs nothing, the call that
# takes it (policy_loss) validates the variable.
FUNCTION_CASES = [case for case in CASES if inspect.isfunction(case.function)]


@pytest.mark.parametrize("case", FUNCTION_CASES, ids=lambda case: case.name)
def test_every_function_validates_the_kernel_variable(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RLOBJECTIVES_KERNELS is validated by every public function, at every call, whatever path
    # the call takes: a misspelt value never applies to some calls and not to others.
    arguments = case.valid()
    monkeypatch.setenv("RLOBJECTIVES_KERNELS", "bogus")
    with pytest.raises(ValueError, match=r"^RLOBJECTIVES_KERNELS must be one of .* got 'bogus'"):
        case.function(**arguments)
    monkeypatch.setenv("RLOBJECTIVES_KERNELS", " Torch ")  # case and spaces do not matter
    case.function(**arguments)
