"""Token-level policy-loss kernel (Triton interpreter on CPU) against the float64 reference."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends import requires_triton
from rlobjectives import CISPO, GMPO, SAPO, Clip
from rlobjectives._core.backend import use_kernels
from rlobjectives.kernels.token_loss import (
    TokenLossFunction,
    TokenLossOptions,
    TokenLossSums,
    token_loss_forward,
)
from tolerances import assert_close
from triton_reference import token_loss as reference_loss

pytestmark = requires_triton

B, T = 5, 21  # N = 105 (odd), 4 programs of 32 tokens
N = B * T
BLOCK = 32
COUNTS = ("selected", "out_of_band", "binding_low", "binding_high", "dual_binding",
          "bound_fired")  # fmt: skip


@pytest.fixture(autouse=True)
def _triton_backend() -> Any:
    with use_kernels("triton"):
        yield


def _batch(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, generator=g) * 3
    new = old + 0.4 * torch.randn(N, generator=g)
    new[::17] += 3.0  # some log-ratios beyond the bounds used below
    mask = torch.rand(N, generator=g) < 0.75
    mask[T : 2 * T] = False  # an empty sequence
    return {
        "log_probs": new.to(dtype),
        "old_log_probs": old.to(dtype),
        "advantages": torch.randn(B, generator=g).to(dtype),
        "mask": mask,
        "importance": (0.5 + torch.rand(N, generator=g)).to(dtype),
        "ref": (old + 0.3 * torch.randn(N, generator=g)).to(dtype),
        "entropy": (3 * torch.rand(N, generator=g)).to(dtype),
    }


def _sequence_mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-row weights 1 / (n_i S) of the sequence_mean reduction."""
    counts = mask.view(B, T).sum(-1).float()
    sequences = (counts > 0).sum().clamp(min=1)
    return torch.where(counts > 0, 1.0 / (counts.clamp(min=1) * sequences), 0.0)


CASES: dict[str, tuple[TokenLossOptions, dict[str, Any]]] = {
    "grpo": (TokenLossOptions(), {"weights": "token_mean"}),
    "dapo_dual_delta": (
        TokenLossOptions(
            surrogate=Clip(low=0.2, high=0.28, dual=3.0, delta=1.5), log_ratio_bound=2.0
        ),
        {"weights": "sequence_mean"},
    ),  # fmt: skip
    "vanilla_unbounded": (TokenLossOptions(surrogate=Clip(low=None), log_ratio_bound=None), {}),
    "cispo_trl_cap": (TokenLossOptions(surrogate=CISPO(cap=1.3)), {}),
    "cispo_verl_band": (
        TokenLossOptions(surrogate=CISPO(low=0.2, high=0.25)),
        {"weights": "token"},
    ),
    "sapo": (TokenLossOptions(surrogate=SAPO()), {"weights": "sequence_mean"}),
    "terms": (
        TokenLossOptions(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, log_ratio_bound=1.0),
        {"weights": "token_mean", "importance": True, "ref": True, "entropy": True},
    ),
    "kl_straight_through_abs": (
        TokenLossOptions(kl_coef=0.3, kl_estimator="abs", kl_straight_through=True),
        {"ref": True},
    ),
    "gspo": (
        TokenLossOptions(surrogate=Clip(low=3e-4, high=4e-4), log_ratio_bound=None),
        {"weights": "sequence_mean", "sequence": True},
    ),
}


def _arguments(batch: dict[str, torch.Tensor], extras: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the launcher, and the matching (expanded) reference arguments."""
    mask = batch["mask"]
    kind = extras.get("weights")
    kernel: dict[str, Any] = {"row_length": T}
    ref: dict[str, Any] = {}
    if kind == "token_mean":
        kernel["weights"] = torch.tensor(1.0) / mask.sum().clamp(min=1)
        ref["weights"] = kernel["weights"]
    elif kind == "sequence_mean":
        kernel["weights"] = _sequence_mean_weights(mask)
        ref["weights"] = kernel["weights"].repeat_interleave(T)
    elif kind == "token":
        kernel["weights"] = torch.rand(N, generator=torch.Generator().manual_seed(3))
        ref["weights"] = kernel["weights"]
    if extras.get("sequence"):
        ratio = (batch["log_probs"].float() - batch["old_log_probs"].float()).view(B, T)
        per_row = torch.where(mask.view(B, T), ratio, 0.0).sum(-1) / mask.view(B, T).sum(-1).clamp(
            min=1
        )
        kernel["sequence_log_ratio"] = per_row
        ref["sequence_log_ratio"] = per_row.repeat_interleave(T)
    for key, name in (("importance", "importance_weights"), ("ref", "ref_log_probs")):
        if extras.get(key):
            kernel[name] = ref[name] = batch[key]
    return {"kernel": kernel, "reference": ref}


def _check_sums(sums: TokenLossSums, expected: dict[str, Any], atol: float) -> None:
    for name in TokenLossSums._fields:
        want = torch.as_tensor(expected.get(name, 0.0), dtype=torch.float64)
        got = getattr(sums, name).double()
        if name in COUNTS:
            assert got == want, name
        else:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=atol, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case: str) -> None:
    options, extras = CASES[case]
    batch = _batch()
    arguments = _arguments(batch, extras)
    entropy = batch["entropy"] if extras.get("entropy") else None
    out = token_loss_forward(
        batch["log_probs"], batch["old_log_probs"], batch["advantages"], batch["mask"],
        options=options, entropy=entropy, return_per_token=True, block_size=BLOCK,
        **arguments["kernel"],
    )  # fmt: skip
    leaf = batch["log_probs"].double().requires_grad_(True)
    expected = reference_loss(
        leaf, batch["old_log_probs"], batch["advantages"].repeat_interleave(T), batch["mask"],
        options, entropy=entropy, **arguments["reference"],
    )  # fmt: skip
    (gradient,) = torch.autograd.grad(expected.loss, leaf)
    assert out.per_token_loss is not None and out.coefficient.dtype == torch.float32
    torch.testing.assert_close(out.per_token_loss.double(), expected.per_token.detach(),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    torch.testing.assert_close(out.coefficient.double(), gradient, rtol=1e-5, atol=1e-7)
    _check_sums(out.sums, expected.sums, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype: torch.dtype) -> None:
    options, extras = CASES["terms"]
    batch = _batch(dtype)
    arguments = _arguments(batch, extras)
    out = token_loss_forward(
        batch["log_probs"], batch["old_log_probs"], batch["advantages"], batch["mask"],
        options=options, entropy=batch["entropy"], block_size=BLOCK, **arguments["kernel"],
    )  # fmt: skip
    leaf = batch["log_probs"].double().requires_grad_(True)
    expected = reference_loss(
        leaf, batch["old_log_probs"], batch["advantages"].repeat_interleave(T), batch["mask"],
        options, entropy=batch["entropy"], **arguments["reference"],
    )  # fmt: skip
    (gradient,) = torch.autograd.grad(expected.loss, leaf)
    # Same float32 tolerance as float32 inputs: the rounded inputs are the reference's inputs.
    torch.testing.assert_close(out.coefficient.double(), gradient, rtol=1e-5, atol=1e-7)
    _check_sums(out.sums, expected.sums, atol=1e-5)


def _tie_inputs() -> tuple[torch.Tensor, ...]:
    # log-ratios exactly 0 (r = 1) and exactly 0.5 (= the bound), both signs of A.
    log_probs = torch.tensor([0.0, 0.0, 0.5, 0.5, -0.5, 0.0, 0.75])
    old = torch.zeros(7)
    advantages = torch.tensor([1.0, -1.0, 1.0, -2.0, 1.0, -3.0, -1.0])
    return log_probs, old, advantages, torch.ones(7, dtype=torch.bool)


def _unchecked_clip(**fields: Any) -> Clip:
    """A ``Clip`` with edges the public API rejects (c = 1, delta = 1): the launcher's ties."""
    clip = object.__new__(Clip)
    for name in ("low", "high", "dual", "delta"):
        object.__setattr__(clip, name, fields.get(name, 0.2 if name == "low" else None))
    return clip


@pytest.mark.parametrize(
    "options",
    [
        # band [1, 1]: r = 1 sits on both clamp edges, torch.minimum ties -> full gradient
        TokenLossOptions(surrogate=Clip(low=0.0), log_ratio_bound=0.5),
        # dual clip c = 1 ties with r = 1 for A < 0 -> half the gradient
        TokenLossOptions(surrogate=_unchecked_clip(low=0.0, dual=1.0), log_ratio_bound=0.5),
        # delta equal to exp(0.5) rounded: min(r, delta) passes the gradient at r == delta
        TokenLossOptions(surrogate=Clip(low=None, delta=math.exp(0.5)), log_ratio_bound=0.5),
        TokenLossOptions(surrogate=_unchecked_clip(low=None, delta=1.0), log_ratio_bound=0.75),
    ],
)
def test_tie_conventions_follow_the_pytorch_paths(options: TokenLossOptions) -> None:
    log_probs, old, advantages, mask = _tie_inputs()
    out = token_loss_forward(log_probs, old, advantages, mask, options=options)
    leaf = log_probs.double().requires_grad_(True)
    expected = reference_loss(leaf, old, advantages, mask, options)
    (gradient,) = torch.autograd.grad(expected.loss, leaf)
    torch.testing.assert_close(out.coefficient.double(), gradient, rtol=1e-6, atol=0.0)


def test_nan_and_inf_at_unselected_tokens_change_nothing() -> None:
    options, extras = CASES["terms"]
    batch = _batch()
    arguments = _arguments(batch, extras)
    kwargs = dict(options=options, return_per_token=True, block_size=BLOCK, **arguments["kernel"])
    clean = token_loss_forward(
        batch["log_probs"], batch["old_log_probs"], batch["advantages"], batch["mask"],
        entropy=batch["entropy"], **kwargs,
    )  # fmt: skip
    poison = torch.tensor([math.nan, math.inf, -math.inf]).repeat(N)[:N]
    unselected = ~batch["mask"]
    dirty = {key: torch.where(unselected, poison, value) for key, value in batch.items()
             if key in ("log_probs", "old_log_probs", "importance", "ref", "entropy")}  # fmt: skip
    kernel_args = dict(arguments["kernel"])
    kernel_args.update(importance_weights=dirty["importance"], ref_log_probs=dirty["ref"])
    kwargs.update(kernel_args)
    poisoned = token_loss_forward(
        dirty["log_probs"], dirty["old_log_probs"], batch["advantages"], batch["mask"],
        entropy=dirty["entropy"], **kwargs,
    )  # fmt: skip
    assert torch.equal(clean.coefficient, poisoned.coefficient)
    assert clean.per_token_loss is not None and poisoned.per_token_loss is not None
    assert torch.equal(clean.per_token_loss, poisoned.per_token_loss)
    assert torch.equal(clean.totals, poisoned.totals)


@pytest.mark.parametrize("count", [0, 7])
def test_empty_selection_gives_zeros(count: int) -> None:
    values = torch.full((count,), math.nan)
    out = token_loss_forward(
        values, values, values, torch.zeros(count, dtype=torch.bool),
        options=CASES["terms"][0], weights=torch.tensor(1.0), ref_log_probs=values,
        importance_weights=values, entropy=values, return_per_token=True,
    )  # fmt: skip
    assert out.coefficient.shape == (count,)
    assert torch.equal(out.coefficient, torch.zeros(count))
    assert torch.equal(out.totals, torch.zeros(len(TokenLossSums._fields)))


def test_k3_diagnostic_keeps_relative_precision_at_small_log_ratios() -> None:
    log_ratio = torch.tensor([1e-4, -1e-4, 3e-3, 0.7, -0.99, 1.5])
    old = torch.zeros(6)
    for value in log_ratio:
        out = token_loss_forward(
            value.reshape(1), old[:1], old[:1], torch.ones(1, dtype=torch.bool)
        )
        x = value.double()
        expected = torch.expm1(x) - x  # r - 1 - log r with log r = x (exactly the float32 input)
        assert abs(float(out.sums.k3_sum) / float(expected) - 1) < 2e-6, float(x)


def test_autograd_function_backward_matches_reference() -> None:
    options, extras = CASES["terms"]
    batch = _batch()
    arguments = _arguments(batch, extras)
    log_probs = batch["log_probs"].clone().requires_grad_(True)
    entropy = batch["entropy"].clone().requires_grad_(True)
    kwargs = dict(options=options, block_size=BLOCK, **arguments["kernel"])
    weights = kwargs.pop("weights")
    loss, _, totals = TokenLossFunction.apply(
        log_probs, entropy, batch["old_log_probs"], batch["advantages"], batch["mask"], weights,
        kwargs,
    )  # fmt: skip
    (3.0 * loss).backward()
    leaf = batch["log_probs"].double().requires_grad_(True)
    entropy_leaf = batch["entropy"].double().requires_grad_(True)
    expected = reference_loss(
        leaf, batch["old_log_probs"], batch["advantages"].repeat_interleave(T), batch["mask"],
        options, entropy=entropy_leaf, **arguments["reference"],
    )  # fmt: skip
    (3.0 * expected.loss).backward()
    assert log_probs.grad is not None and entropy.grad is not None and leaf.grad is not None
    torch.testing.assert_close(loss.double(), expected.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(log_probs.grad.double(), leaf.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(entropy.grad.double(), entropy_leaf.grad, rtol=1e-5, atol=1e-8)
    assert not totals.requires_grad


def test_unweighted_mode_differentiates_the_per_token_loss() -> None:
    options, _ = CASES["grpo"]
    batch = _batch(torch.bfloat16)
    log_probs = batch["log_probs"].clone().requires_grad_(True)
    loss, per_token, _ = TokenLossFunction.apply(
        log_probs, None, batch["old_log_probs"], batch["advantages"], batch["mask"], None,
        {"options": options, "row_length": T, "return_per_token": True, "block_size": BLOCK},
    )  # fmt: skip
    upstream = torch.linspace(-1, 1, N)
    (per_token * upstream).sum().add(2 * loss).backward()
    leaf = batch["log_probs"].double().requires_grad_(True)
    expected = reference_loss(
        leaf, batch["old_log_probs"], batch["advantages"].repeat_interleave(T), batch["mask"],
        options,
    )  # fmt: skip
    (expected.per_token * upstream.double()).sum().add(2 * expected.loss).backward()
    assert log_probs.grad is not None and log_probs.grad.dtype == torch.bfloat16
    assert leaf.grad is not None
    assert_close(log_probs.grad, leaf.grad)  # bf16 tolerance: the gradient is rounded once


def test_contract_errors() -> None:
    values = torch.zeros(4)
    mask = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        token_loss_forward(values, values, torch.zeros(3), mask)
    with pytest.raises(TypeError, match="log_probs"):
        token_loss_forward(values.double(), values, values, mask)
    with pytest.raises(ValueError, match="surrogate"):
        token_loss_forward(values, values, values, mask, options=TokenLossOptions(surrogate="x"))
    with pytest.raises(ValueError, match="surrogate"):  # sequence-level: not a kernel surrogate
        token_loss_forward(values, values, values, mask, options=TokenLossOptions(surrogate=GMPO()))
    with pytest.raises(ValueError, match="importance_weights"):
        token_loss_forward(values, values, values, mask, importance_weights=torch.ones(3))
