"""Tests of the one policy-loss path (the surrogate's formula under autograd) and the baselines.

:func:`policy_loss` and :func:`grpo_clipped_surrogate` are compared with the float64 loop
reference (``tests/reference.py``) on outputs, gradients and diagnostics, for every option,
reduction, advantage shape and dtype; plus NaN/inf handling, the saved-tensor budget, the tie
conventions, second-order gradients, one compiled call, and the eager trainer-style baselines of
``tests/eager_reference.py`` (shared with ``benchmarks/``) against the library. The ``backend``
fixture (``tests/backends.py``) runs them once more in float32 with the Triton backend chosen,
which the policy loss (it has no kernel) must ignore.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import eager_reference
import reference
from backends import FIXTURE_HEALTH, dtype_for, on_kernels, triton_param
from family_cases import FAMILY_OPTION_SETS, TOKEN_LOCAL_FAMILY
from rlobjectives import CISPO, Clip, grpo_clipped_surrogate, kl_penalized_rewards, policy_loss
from tolerances import assert_close

F64 = torch.float64
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none")
OPTION_SETS: list[dict[str, Any]] = [
    {},
    {"surrogate": Clip(low=0.2, high=0.28)},
    {"surrogate": Clip(low=0.1, high=0.3, dual=3.0)},
    {"surrogate": Clip(low=0.2, dual=1.2)},  # the dual bound binds often
    {"surrogate": Clip(low=None)},
    {"surrogate": Clip(low=None, dual=2.0)},
    {"surrogate": Clip(low=0.2), "log_ratio_bound": None},
    {"surrogate": Clip(low=0.2), "log_ratio_bound": 0.3},  # the log-ratio bound fires often
    {"surrogate": Clip(low=0.0, high=0.0)},  # degenerate band [1, 1]
    {"surrogate": Clip(low=0.95)},  # 1 - clip_low = 0.05: the low edge (almost) never binds
    {"ratio_level": "sequence", "surrogate": Clip(low=3e-4, high=4e-4)},
    {"ratio_level": "sequence", "surrogate": Clip(low=0.2, dual=2.0)},
    {"ratio_level": "sequence", "surrogate": Clip(low=None), "log_ratio_bound": None},
    {"ratio_level": "sequence", "surrogate": Clip(low=0.2), "log_ratio_bound": 0.1},
    *FAMILY_OPTION_SETS,
]
DIAGNOSTIC_NAMES = (
    "clipped_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "dual_clip_fraction",
    "log_ratio_bound_fraction",
    "ratio_mean",
    "approx_kl_k1",
    "approx_kl_k3",
    "weight_mean",
)


def make_batch(
    batch: int,
    tokens: int,
    seed: int,
    *,
    per_token: bool = False,
    spread: float = 0.4,
    dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random batch: ratios across the clip band, ~30% masked tokens, one empty row if B > 2."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = -2.0 * torch.rand(batch, tokens, generator=generator, dtype=F64)  # (B, T)
    old_log_probs = log_probs + spread * torch.randn(batch, tokens, generator=generator, dtype=F64)
    shape = (batch, tokens) if per_token else (batch,)
    advantages = torch.randn(*shape, generator=generator, dtype=F64)
    mask = torch.rand(batch, tokens, generator=generator) < 0.7  # (B, T)
    if batch > 2:
        mask[1] = False
    return log_probs.to(dtype), old_log_probs.to(dtype), advantages.to(dtype), mask


def loss_and_grad(fn: Any, log_probs: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``fn`` output and the gradient of its (summed) loss w.r.t. ``log_probs`` only."""
    leaf = log_probs.detach().clone().requires_grad_(True)
    out = fn(leaf, *args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out["loss"]
    (grad,) = torch.autograd.grad(loss.sum(), [leaf])
    return out, grad


def grad_of(output: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """Gradient of ``output.sum()`` (zeros when the output does not depend on ``leaf``)."""
    if not output.requires_grad:
        return torch.zeros_like(leaf)
    (grad,) = torch.autograd.grad(output.sum(), [leaf], allow_unused=True)
    return torch.zeros_like(leaf) if grad is None else grad


def assert_fused_matches_autograd(
    log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: Any, **kw: Any
) -> tuple[Any, torch.Tensor]:
    fused, fused_grad = loss_and_grad(policy_loss, log_probs, old, advantages, mask, **kw)
    unfused, unfused_grad = loss_and_grad(policy_loss, log_probs, old, advantages, mask, **kw)
    dtype = log_probs.dtype
    assert fused.loss.dtype == unfused.loss.dtype == dtype
    assert fused_grad.dtype == dtype
    assert_close(fused.loss, unfused.loss, dtype)
    assert_close(fused_grad, unfused_grad, dtype)
    if kw.get("return_per_token"):
        assert fused.per_token_loss is not None and unfused.per_token_loss is not None
        assert_close(fused.per_token_loss, unfused.per_token_loss, dtype)
    for name in DIAGNOSTIC_NAMES:
        value, expected = getattr(fused.diagnostics, name), getattr(unfused.diagnostics, name)
        assert value.dtype == expected.dtype and not value.requires_grad, name
        assert_close(value, expected)
    return fused, fused_grad


TORCH_ONLY = pytest.mark.parametrize("backend", ["torch"], indirect=True)


def _in_turn(rows: list[dict[str, Any]], choices: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """The rows the kernels run, each with the next of ``choices`` in turn."""
    return [(row, choices[i % len(choices)]) for i, row in enumerate(filter(on_kernels, rows))]


# --------------------------------------------------------------------------------------------
# Against the float64 loop reference and against the autograd path: every option x reduction
# --------------------------------------------------------------------------------------------


def _reference_cases() -> list[Any]:
    """PyTorch: every option x reduction x advantage shape; kernels: each option once, the
    reductions and advantage shapes in turn."""
    cases = [
        pytest.param("torch", options, reduction, per_token)
        for per_token in (False, True)
        for options in OPTION_SETS
        for reduction in REDUCTIONS
    ]
    for index, (options, reduction) in enumerate(_in_turn(OPTION_SETS, REDUCTIONS)):
        cases.append(triton_param(options, reduction, index % 2 == 1))
    return cases


@pytest.mark.parametrize(
    ("backend", "options", "reduction", "per_token"), _reference_cases(), indirect=["backend"]
)
def test_matches_reference_and_autograd(
    backend: str, options: dict[str, Any], reduction: str, per_token: bool
) -> None:
    log_probs, old, advantages, mask = make_batch(
        5, 7, seed=11, per_token=per_token, dtype=dtype_for(backend)
    )
    fused, grad = assert_fused_matches_autograd(
        log_probs, old, advantages, mask, **options, reduction=reduction, return_per_token=True
    )
    leaf = log_probs.to(F64).requires_grad_(True)
    expected = reference.policy_loss(
        leaf, old.to(F64), advantages.to(F64), mask, **options, reduction=reduction
    )
    expected_grad = grad_of(expected, leaf)
    assert_close(fused.loss, expected)
    assert_close(grad, expected_grad)
    expected_diagnostics = reference.policy_loss_diagnostics(
        log_probs, old, advantages, mask, **options
    )
    for name in DIAGNOSTIC_NAMES:
        assert_close(getattr(fused.diagnostics, name), expected_diagnostics[name])


@pytest.mark.parametrize(
    ("reduction", "normalizer", "max_response_length"),
    [
        ("token_mean", 17, None),
        ("token_mean", torch.tensor(23.0, dtype=F64), None),
        ("sequence_mean", 9, None),
        ("sequence_sum_normalized", None, 11),
        ("sequence_sum_normalized", torch.tensor(8.0), 13),
    ],
)
def test_normalizers_match_reference(
    reduction: str, normalizer: Any, max_response_length: int | None
) -> None:
    log_probs, old, advantages, mask = make_batch(6, 5, seed=3)
    kw = dict(reduction=reduction, normalizer=normalizer, max_response_length=max_response_length)
    fused, grad = assert_fused_matches_autograd(log_probs, old, advantages, mask, **kw)
    leaf = log_probs.clone().requires_grad_(True)
    ref_kw = dict(kw, normalizer=None if normalizer is None else float(normalizer))
    expected = reference.policy_loss(leaf, old, advantages, mask, **ref_kw)
    expected_grad = grad_of(expected, leaf)
    assert_close(fused.loss, expected)
    assert_close(grad, expected_grad)


option_strategy = st.fixed_dictionaries(
    {
        "surrogate": st.tuples(
            st.sampled_from([None, 0.0, 0.1, 0.2]),  # low
            st.sampled_from([None, 0.28]),  # high
            st.sampled_from([None, 1.5, 3.0]),  # dual
        )
        .filter(lambda edges: not (edges[0] is None and edges[1] is not None))
        .map(lambda edges: Clip(low=edges[0], high=edges[1], dual=edges[2])),
        "ratio_level": st.sampled_from(["token", "sequence"]),
        "log_ratio_bound": st.sampled_from([None, 20.0, 0.3]),
    }
)


@FIXTURE_HEALTH
@given(
    batch_size=st.integers(0, 6),
    tokens=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
    per_token=st.booleans(),
    options=option_strategy,
    reduction=st.sampled_from(REDUCTIONS),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_property_fused_equals_autograd_and_reference(
    backend: str,
    batch_size: int,
    tokens: int,
    seed: int,
    per_token: bool,
    options: dict[str, Any],
    reduction: str,
    dtype: torch.dtype,
) -> None:
    log_probs, old, advantages, mask = make_batch(
        batch_size, tokens, seed, per_token=per_token, dtype=dtype
    )
    fused, grad = assert_fused_matches_autograd(
        log_probs, old, advantages, mask, **options, reduction=reduction
    )
    assert torch.isfinite(grad).all()
    leaf = log_probs.to(F64).requires_grad_(True)
    expected = reference.policy_loss(
        leaf, old.to(F64), advantages.to(F64), mask, **options, reduction=reduction
    )
    expected_grad = grad_of(expected, leaf)
    assert_close(fused.loss, expected)
    assert_close(grad, expected_grad)


@pytest.mark.parametrize(
    "options",
    [{}, {"surrogate": Clip(low=0.1, high=0.3, dual=1.5)}, {"surrogate": Clip(low=None)}],
    ids=["defaults", "dual", "vanilla"],
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(options: dict[str, Any], reduction: str) -> None:
    log_probs, old, advantages, mask = make_batch(3, 4, seed=7, spread=0.3)
    leaf = log_probs.clone().requires_grad_(True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return policy_loss(x, old, advantages, mask, **options, reduction=reduction).loss

    assert torch.autograd.gradcheck(fn, (leaf,))


def test_grpo_surrogate_matches_reference_including_per_sequence_grad(backend: str) -> None:
    log_probs, old, advantages, mask = make_batch(4, 6, seed=5, spread=1.0, dtype=torch.float32)
    weights = torch.arange(1.0, 5.0)
    leaf = log_probs.clone().requires_grad_(True)
    out = grpo_clipped_surrogate(leaf, old, advantages, mask, 0.2)
    objective = out["loss"] + (weights * out["per_sequence_surrogate"]).sum()
    (grad,) = torch.autograd.grad(objective, [leaf])
    wide = log_probs.double().requires_grad_(True)
    want = reference.grpo_clipped_surrogate(wide, old.double(), advantages.double(), mask, 0.2)
    objective = want["loss"] + (weights.double() * want["per_sequence_surrogate"]).sum()
    (want_grad,) = torch.autograd.grad(objective, [wide])
    for key in ("loss", "per_sequence_surrogate", "clipped_fraction"):
        assert out[key].dtype == torch.float32
        assert_close(out[key], want[key].float())
    assert_close(grad, want_grad.float())


# --------------------------------------------------------------------------------------------
# Golden values and the tie conventions (torch.clamp closed, minimum/maximum split ties)
# --------------------------------------------------------------------------------------------


def test_golden_clip_and_coefficient(backend: str) -> None:
    # Two tokens, A = 1, clip 0.2: r = exp(0.1) = 1.10517 (in band, gradient r A = 1.10517),
    # r = exp(0.5) = 1.64872 (clipped at 1.2, gradient 0). Token mean over 2 tokens:
    # loss = -(1.10517 + 1.2) / 2 = -1.152585; d loss / d log_probs = (-1.10517 / 2, 0).
    dtype = dtype_for(backend)
    log_probs = torch.tensor([[0.1, 0.5]], dtype=dtype, requires_grad=True)
    out = policy_loss(
        log_probs,
        torch.zeros(1, 2, dtype=dtype),
        torch.tensor([1.0], dtype=dtype),
        torch.ones(1, 2, dtype=torch.bool),
    )
    out.loss.backward()
    assert_close(out.loss, -(math.exp(0.1) + 1.2) / 2)
    assert_close(log_probs.grad, [[-math.exp(0.1) / 2, 0.0]])
    assert_close(out.diagnostics.clip_fraction_high, 0.5)


def test_tie_at_band_edge_passes_full_gradient(backend: str) -> None:
    # Band [1, 1] (clip 0), log-ratio 0: r = 1 = both edges. torch.minimum ties (1/2 each) and
    # torch.clamp passes its half on the closed interval: the total is the full gradient r A = A.
    advantages = torch.tensor([2.0, -3.0])
    log_probs = torch.zeros(2, 1, requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.bool)
    out = policy_loss(
        log_probs,
        torch.zeros(2, 1),
        advantages,
        mask,
        surrogate=Clip(low=0.0),
        reduction="sequence_sum_normalized",
    )
    out.loss.backward()
    # loss = -(2 - 3) / (2 * 1) = 0.5; gradient -A / 2 = (-1, 1.5)
    assert_close(out.loss, 0.5)
    assert_close(log_probs.grad, [[-1.0], [1.5]])
    assert_fused_matches_autograd(
        torch.zeros(2, 1), torch.zeros(2, 1), advantages, mask, surrogate=Clip(low=0.0)
    )


def test_dual_clip_tie_passes_half_gradient(backend: str) -> None:
    # A = -1, dual_clip c = 2 and r = exp(log 2) == 2 exactly in float32: s = r A = c A, a tie
    # of torch.maximum, which passes half the gradient: d(-s)/d log_probs = -(r A) / 2 = 1.
    delta = torch.tensor(math.log(2.0), dtype=torch.float32)
    assert torch.exp(delta) == 2.0  # precondition of the tie
    log_probs = delta.reshape(1, 1)
    kw = dict(surrogate=Clip(low=0.2, dual=2.0), reduction="sequence_sum_normalized")
    args = (torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool))
    fused, grad = assert_fused_matches_autograd(log_probs, *args, **kw)
    assert_close(fused.loss, 2.0)  # -s = -(2 * -1)
    assert_close(grad, [[1.0]])


def test_log_ratio_bound_edge_is_closed(backend: str) -> None:
    # |log-ratio| == bound exactly: torch.clamp passes the gradient (closed interval).
    dtype = dtype_for(backend)
    log_probs = torch.tensor([[0.25, -0.25, 0.5]], dtype=dtype)
    kw = dict(surrogate=Clip(low=None), log_ratio_bound=0.25, reduction="sequence_sum_normalized")
    args = (
        torch.zeros(1, 3, dtype=dtype),
        torch.tensor([1.0], dtype=dtype),
        torch.ones(1, 3, dtype=torch.bool),
    )
    fused, grad = assert_fused_matches_autograd(log_probs, *args, **kw)
    # gradient -r A / 3 at the two edge tokens, 0 where the bound fires (0.5 > 0.25)
    assert_close(grad, [[-math.exp(0.25) / 3, -math.exp(-0.25) / 3, 0.0]])
    assert_close(fused.diagnostics.log_ratio_bound_fraction, 1 / 3)


# --------------------------------------------------------------------------------------------
# NaN / inf
# --------------------------------------------------------------------------------------------


NONFINITE_OPTIONS = OPTION_SETS[:8] + OPTION_SETS[10:12] + TOKEN_LOCAL_FAMILY
BAD = (float("nan"), float("inf"), -float("inf"))


def _nonfinite_cases() -> list[Any]:
    """PyTorch: every value x reduction x option; kernels: each option, values and reductions
    in turn."""
    cases = [
        pytest.param("torch", bad, reduction, options)
        for bad in BAD
        for reduction in REDUCTIONS
        for options in NONFINITE_OPTIONS
    ]
    for index, (options, reduction) in enumerate(_in_turn(NONFINITE_OPTIONS, REDUCTIONS)):
        cases.append(triton_param(BAD[index % 3], reduction, options))
    return cases


@pytest.mark.parametrize(
    ("backend", "bad", "reduction", "options"), _nonfinite_cases(), indirect=["backend"]
)
def test_nonfinite_at_masked_positions_reaches_nothing(
    backend: str, bad: float, reduction: str, options: dict[str, Any]
) -> None:
    log_probs, old, advantages, mask = make_batch(4, 6, seed=2, per_token=True, dtype=torch.float32)
    clean, clean_grad = loss_and_grad(
        policy_loss, log_probs, old, advantages, mask, **options, reduction=reduction
    )
    dirty = [x.clone() for x in (log_probs, old, advantages)]
    for tensor in dirty:
        tensor[~mask] = bad
    out, grad = loss_and_grad(
        policy_loss, dirty[0], dirty[1], dirty[2], mask, **options, reduction=reduction
    )
    assert torch.isfinite(out.loss).all() and torch.isfinite(grad).all()
    assert torch.equal(out.loss, clean.loss)
    assert torch.equal(grad, clean_grad)
    for name in DIAGNOSTIC_NAMES:
        assert torch.equal(getattr(out.diagnostics, name), getattr(clean.diagnostics, name))


def test_nan_per_sequence_advantage_of_empty_row_reaches_nothing(backend: str) -> None:
    log_probs, old, advantages, mask = make_batch(4, 6, seed=4, dtype=torch.float32)
    assert not mask[1].any()
    clean, clean_grad = loss_and_grad(policy_loss, log_probs, old, advantages, mask)
    advantages = advantages.clone()
    advantages[1] = float("nan")
    out, grad = loss_and_grad(policy_loss, log_probs, old, advantages, mask)
    assert torch.equal(out.loss, clean.loss) and torch.equal(grad, clean_grad)


@pytest.mark.parametrize("where", ["log_probs", "old_log_probs", "advantages"])
@pytest.mark.parametrize("options", [{}, {"surrogate": Clip(low=0.2, dual=2.0)}], ids=repr)
def test_nan_at_selected_position_propagates_like_autograd(
    backend: str, where: str, options: dict[str, Any]
) -> None:
    log_probs, old, advantages, mask = make_batch(3, 5, seed=9, per_token=True, dtype=torch.float32)
    mask[0, 2] = True
    tensors = {"log_probs": log_probs, "old_log_probs": old, "advantages": advantages}
    tensors[where] = tensors[where].clone()
    tensors[where][0, 2] = float("nan")
    args = (tensors["log_probs"], tensors["old_log_probs"], tensors["advantages"], mask)
    fused, grad = loss_and_grad(policy_loss, *args, **options)
    unfused, unfused_grad = loss_and_grad(policy_loss, *args, **options)
    assert torch.isnan(fused.loss) and torch.isnan(unfused.loss)
    # Every gradient entry (the NaN position included) as autograd's: with the default bound
    # the NaN log-ratio gets gradient 0 (clamp), a NaN advantage a NaN gradient.
    torch.testing.assert_close(grad, unfused_grad, equal_nan=True)


def test_reduction_none_ignores_upstream_gradient_at_masked_positions(backend: str) -> None:
    log_probs, old, advantages, mask = make_batch(3, 4, seed=1, dtype=torch.float32)
    upstream = torch.randn(3, 4)
    upstream[~mask] = float("nan")
    leaf = log_probs.clone().requires_grad_(True)
    out = policy_loss(leaf, old, advantages, mask, reduction="none")
    (grad,) = torch.autograd.grad(out.loss, [leaf], grad_outputs=upstream)
    assert torch.isfinite(grad).all()
    clean = torch.where(mask, upstream, 0.0)
    (want,) = torch.autograd.grad(
        policy_loss(leaf, old, advantages, mask, reduction="none").loss, [leaf], clean
    )
    assert torch.equal(grad, want)


def test_nothing_selected_gives_zeros(backend: str) -> None:
    for reduction in REDUCTIONS:
        out, grad = loss_and_grad(
            policy_loss,
            torch.randn(2, 3),
            torch.randn(2, 3),
            torch.randn(2),
            torch.zeros(2, 3, dtype=torch.bool),
            reduction=reduction,
        )
        assert torch.equal(out.loss, torch.zeros_like(out.loss))
        assert torch.equal(grad, torch.zeros(2, 3))
        assert all(torch.equal(d, torch.zeros(())) for d in out.diagnostics)


# --------------------------------------------------------------------------------------------
# dtypes, saved tensors, double backward, fallbacks, compile
# --------------------------------------------------------------------------------------------


DTYPE_OPTIONS: list[dict[str, Any]] = [
    {},
    {"surrogate": Clip(low=0.1, high=0.3, dual=1.5)},
    {"ratio_level": "sequence"},
    {"surrogate": Clip(low=0.1, dual=1.3, delta=1.6)},
    {"surrogate": "cispo"},
    {"surrogate": "sapo"},
]
DTYPE_REDUCTIONS = ("token_mean", "sequence_mean", "none")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 takes PyTorch


def _dtype_cases() -> list[Any]:
    """PyTorch: every dtype x option x reduction; kernels: each option with the kernel dtypes
    and the reductions in turn."""
    cases = [
        pytest.param("torch", dtype, options, reduction)
        for dtype in (torch.float32, F64, torch.bfloat16, torch.float16)
        for options in DTYPE_OPTIONS
        for reduction in DTYPE_REDUCTIONS
    ]
    for index, (options, dtype) in enumerate(_in_turn(DTYPE_OPTIONS, KERNEL_DTYPES)):
        cases.append(triton_param(dtype, options, DTYPE_REDUCTIONS[index % 3]))
    return cases


@pytest.mark.parametrize(
    ("backend", "dtype", "options", "reduction"), _dtype_cases(), indirect=["backend"]
)
def test_dtypes(backend: str, dtype: torch.dtype, options: dict[str, Any], reduction: str) -> None:
    log_probs, old, advantages, mask = make_batch(4, 9, seed=6, dtype=dtype)
    fused, grad = assert_fused_matches_autograd(
        log_probs, old, advantages, mask, **options, reduction=reduction
    )
    # Against the float64 reference evaluated on the same (rounded) inputs.
    leaf = log_probs.to(F64).requires_grad_(True)
    expected = reference.policy_loss(
        leaf, old.to(F64), advantages.to(F64), mask, **options, reduction=reduction
    )
    expected_grad = grad_of(expected, leaf)
    assert_close(fused.loss, expected, dtype)
    assert_close(grad, expected_grad, dtype)
    compute = F64 if dtype == F64 else torch.float32
    assert all(d.dtype == compute for d in fused.diagnostics)


def saved_bytes(fn: Any) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


BUDGET_OPTIONS: list[dict[str, Any]] = [
    {},
    {"surrogate": Clip(low=0.2, dual=2.0)},
    {"ratio_level": "sequence"},
    {"surrogate": Clip(delta=1.5)},
    {"surrogate": CISPO(cap=2.0)},
    {"surrogate": "sapo"},
    {"importance_weights": "token"},
]


def _budget_cases() -> list[Any]:
    """PyTorch: every dtype x option x reduction; kernels: each option with float32 and
    bfloat16, the reductions in turn."""
    cases = [
        pytest.param("torch", dtype, options, reduction)
        for dtype in (torch.float32, torch.bfloat16, F64)
        for options in BUDGET_OPTIONS
        for reduction in REDUCTIONS
    ]
    for index, options in enumerate(BUDGET_OPTIONS):
        for offset, dtype in enumerate((torch.float32, torch.bfloat16)):
            cases.append(triton_param(dtype, options, REDUCTIONS[(index + offset) % 5]))
    return cases


@pytest.mark.parametrize(
    ("backend", "dtype", "options", "reduction"), _budget_cases(), indirect=["backend"]
)
def test_saved_tensor_budget(
    backend: str, dtype: torch.dtype, options: dict[str, Any], reduction: str
) -> None:
    batch, tokens = 16, 64
    log_probs, old, advantages, mask = make_batch(batch, tokens, seed=8, dtype=dtype)
    leaf = log_probs.clone().requires_grad_(True)
    if options.get("importance_weights") == "token":  # constants: not saved for backward
        options = {"importance_weights": torch.rand(batch, tokens, dtype=dtype)}
    compute_itemsize = 8 if dtype == F64 else 4
    # What autograd keeps of the formula: at most six float (B, T) tensors plus bool masks and
    # O(B) (docs/objectives/policy.md states the measured figures).
    budget = 6 * batch * tokens * compute_itemsize + 4 * batch * tokens + 2 * batch * 8
    used = saved_bytes(
        lambda: policy_loss(leaf, old, advantages, mask, **options, reduction=reduction)
    )
    assert 0 < used <= budget
    used_seed = saved_bytes(lambda: grpo_clipped_surrogate(leaf, old, advantages, mask, 0.2))
    assert used_seed <= budget


def test_second_order_gradients(backend: str) -> None:
    # One formula under autograd: the loss is twice differentiable. For the plain ratio
    # surrogate (no clip) L = -sum_t M r A / N, so d2L / dl2 = -M r A / N on the diagonal.
    log_probs, old, advantages, mask = make_batch(2, 3, seed=0, dtype=torch.float64)
    leaf = log_probs.clone().requires_grad_(True)
    loss = policy_loss(leaf, old, advantages, mask, surrogate=Clip(low=None)).loss
    (grad,) = torch.autograd.grad(loss, [leaf], create_graph=True)
    (hessian_diagonal,) = torch.autograd.grad(grad.sum(), [leaf])
    ratio = torch.exp(torch.where(mask.bool(), log_probs - old, 0.0))
    expected = torch.where(mask.bool(), -ratio * advantages.reshape(-1, 1), 0.0) / mask.sum()
    assert_close(hessian_diagonal, expected)


@TORCH_ONLY
def test_constant_inputs_get_no_gradient_and_a_learnable_clip_one(backend: str) -> None:
    # old_log_probs and advantages are constants of the loss on every path (issue 10): an
    # undetached critic or behaviour policy never receives policy gradient.
    log_probs, old, advantages, mask = make_batch(3, 4, seed=3, dtype=torch.float32)
    old_leaf = old.clone().requires_grad_(True)
    advantages_leaf = advantages.clone().requires_grad_(True)
    leaf = log_probs.clone().requires_grad_(True)
    out = policy_loss(leaf, old_leaf, advantages_leaf, mask)
    grads = torch.autograd.grad(out.loss, [leaf, old_leaf, advantages_leaf], allow_unused=True)
    assert grads[0] is not None and grads[1] is None and grads[2] is None
    # a learnable (requires-grad) hyperparameter is differentiated by the autograd specification
    clip = torch.tensor(0.2, requires_grad=True)
    out = policy_loss(
        log_probs.clone().requires_grad_(True), old, advantages, mask, surrogate=Clip(low=clip)
    )
    (clip_grad,) = torch.autograd.grad(out.loss, [clip])
    assert torch.isfinite(clip_grad)


def test_inputs_not_mutated(backend: str) -> None:
    log_probs, old, advantages, mask = make_batch(3, 5, seed=2, per_token=True, dtype=torch.float32)
    copies = [x.clone() for x in (log_probs, old, advantages, mask)]
    loss_and_grad(
        policy_loss, log_probs, old, advantages, mask, reduction="none", return_per_token=True
    )
    for original, copy in zip((log_probs, old, advantages, mask), copies, strict=True):
        assert torch.equal(original, copy)


@pytest.mark.compile
def test_compiled_fullgraph_equals_eager() -> None:
    log_probs, old, advantages, mask = make_batch(4, 9, seed=12, dtype=torch.float32)
    kw = dict(surrogate=Clip(low=0.2, high=0.28, dual=3.0))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = policy_loss(x, old, advantages, mask, **kw)
        return out.loss, out.diagnostics.clip_fraction_high

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    leaves = [log_probs.clone().requires_grad_(True) for _ in range(2)]
    (loss, fraction), (eager_loss, eager_fraction) = compiled(leaves[0]), fn(leaves[1])
    loss.backward()
    eager_loss.backward()
    assert_close(loss, eager_loss)
    assert_close(fraction, eager_fraction)
    assert_close(leaves[0].grad, leaves[1].grad)


# --------------------------------------------------------------------------------------------
# The eager trainer-style baselines (shared with benchmarks/) agree with the library
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"surrogate": Clip(low=0.2, high=0.28)},
        {"surrogate": Clip(low=0.2, dual=1.5)},
        {"surrogate": Clip(low=None)},
        {"surrogate": Clip(low=0.2), "log_ratio_bound": 0.3},
        {"ratio_level": "sequence", "surrogate": Clip(low=0.2)},
    ],
    ids=repr,
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_eager_policy_loss_baseline_agrees(
    backend: str, options: dict[str, Any], reduction: str
) -> None:
    log_probs, old, advantages, mask = make_batch(5, 8, seed=13, dtype=torch.float32)
    mask[:, 0] = True  # the baseline divides by per-row counts (verl/TRL do not guard 0/0)
    ours, ours_grad = loss_and_grad(
        policy_loss, log_probs, old, advantages, mask, **options, reduction=reduction
    )
    leaf = log_probs.clone().requires_grad_(True)
    flat = {**options, **reference.surrogate_options(options.get("surrogate", "clip"))}
    flat = {k: v for k, v in flat.items() if k != "surrogate" and not (k == "delta" and v is None)}
    baseline = eager_reference.policy_loss(
        leaf, old, advantages.unsqueeze(-1), mask, **flat, reduction=reduction
    )
    (baseline_grad,) = torch.autograd.grad(baseline.sum(), [leaf])
    assert_close(ours.loss, baseline)
    assert_close(ours_grad, baseline_grad)


def test_verl_vanilla_baseline_agrees(backend: str) -> None:
    # The benchmark's "verl compute_policy_loss_vanilla (eager)" is our Clip(dual=3.0) call.
    log_probs, old, advantages, mask = make_batch(5, 8, seed=13, dtype=torch.float32)
    mask[:, 0] = True
    clip = Clip(low=0.2, dual=3.0)
    ours, ours_grad = loss_and_grad(policy_loss, log_probs, old, advantages, mask, surrogate=clip)
    leaf = log_probs.clone().requires_grad_(True)
    baseline, metrics = eager_reference.verl_vanilla_policy_loss(
        leaf, old, advantages.unsqueeze(-1), mask
    )
    (grad,) = torch.autograd.grad(baseline, leaf)
    assert_close(ours.loss, baseline)
    assert_close(ours_grad, grad)
    assert_close(ours.diagnostics.dual_clip_fraction, metrics["actor/pg_clipfrac_lower"])


def test_eager_kl_baselines_agree(backend: str) -> None:
    log_probs, ref_log_probs, rewards, mask = make_batch(4, 6, seed=14, dtype=torch.float32)
    ours = kl_penalized_rewards(log_probs, ref_log_probs, rewards, mask, 0.1)["objective"]
    baseline = eager_reference.kl_penalized_rewards(log_probs, ref_log_probs, rewards, mask, 0.1)
    assert_close(ours, baseline)
    try:
        kl = importlib.import_module("rlobjectives.kl.loss")
    except ImportError:  # pragma: no cover - optional module
        return
    mask[:, 0] = True
    for estimator in ("k1", "k2", "k3"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = kl.kl_loss(log_probs, ref_log_probs, mask, estimator=estimator)
        baseline = eager_reference.kl_loss(log_probs, ref_log_probs, mask, estimator=estimator)
        assert_close(ours, baseline)
