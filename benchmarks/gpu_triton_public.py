"""Correctness of ``gpu_triton.py``: the public functions on the kernels vs the PyTorch path.

Each public function is called on the device with ``RLOBJECTIVES_KERNELS=triton`` (float32 and
bfloat16 inputs) and, on the same rounded inputs in float64 on the CPU, with
``RLOBJECTIVES_KERNELS=torch`` (the library's definition): values, gradients and diagnostics.
Bounds are those of :mod:`gpu_triton_checks` (relative to the largest expected magnitude); a
diagnostic fraction may differ by one token (a ratio within an ulp of an edge: ``tl.exp`` is
the hardware approximation).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

import rlobjectives as rlo
from gpu_triton_checks import GRAD_TOLERANCE, VALUE_TOLERANCE, Result, compare
from rlobjectives import CISPO, Clip
from rlobjectives._core.backend import use_backend

Call = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
LEAVES = ("log_probs", "entropy", "hidden", "weight")

POLICY_OPTIONS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dapo+dual+delta": {
        "surrogate": Clip(high=0.28, dual=3.0, delta=1.5),
        "log_ratio_bound": 2.0,
        "reduction": "sequence_mean",
    },
    "cispo(cap)": {"surrogate": CISPO(cap=1.3)},
    "sapo": {"surrogate": "sapo", "reduction": "length_weighted"},
    "gspo": {
        "ratio_level": "sequence",
        "surrogate": Clip(low=3e-4, high=4e-4),
        "reduction": "sequence_mean",
    },
    "none": {"reduction": "none", "surrogate": Clip(low=None)},
}


def _inputs(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    batch, tokens = shape
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=g) * 3
    mask = torch.rand(batch, tokens, generator=g) < 0.7
    values = {
        "log_probs": old + 0.4 * torch.randn(batch, tokens, generator=g),
        "old_log_probs": old,
        "ref_log_probs": old + 0.3 * torch.randn(batch, tokens, generator=g),
        "advantages": torch.randn(batch, generator=g),
        "sequence_advantages": torch.randn(4, generator=g),  # the 4 packed sequences
        "weights": 0.5 + torch.rand(batch, tokens, generator=g),
        "entropy": 3 * torch.rand(batch, tokens, generator=g),
        "rewards": torch.randn(batch, generator=g),
        "hidden": torch.randn(batch, tokens, 32, generator=g),
        "head_old_log_probs": old - 2.0,  # near log(1/97): ratios of order 1 for the head
        "head_ref_log_probs": old - 1.8,
        "weight": torch.randn(97, 32, generator=g) / 4,
    }
    out = {name: value.to(dtype) for name, value in values.items()}
    out["mask"] = mask
    out["tokens"] = torch.randint(0, 97, (batch, tokens), generator=g)
    out["cu_seqlens"] = torch.tensor([0, 5, 5, tokens * batch - 7, tokens * batch])
    return out


def _run(call: Call, data: dict[str, torch.Tensor], device: str, backend: str) -> dict[str, Any]:
    """Outputs and the gradients of the summed floating outputs w.r.t. the leaves used.

    ``backend="torch"`` is the reference: float64 on the CPU.
    """
    on = {k: v.to(device) for k, v in data.items()}
    if backend == "torch":
        on = {k: v.double() if v.is_floating_point() else v for k, v in on.items()}
    for name in LEAVES:
        on[name].requires_grad_(True)
    with use_backend(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = call(on)
    total = sum(v.double().sum() for v in outputs.values() if v.requires_grad)
    grads: dict[str, torch.Tensor] = {}
    if isinstance(total, torch.Tensor) and total.requires_grad:
        used = [name for name in LEAVES if on[name].requires_grad]
        found = torch.autograd.grad(total, [on[n] for n in used], allow_unused=True)
        grads = {f"grad {n}": g for n, g in zip(used, found, strict=True) if g is not None}
    return {**{k: v.detach() for k, v in outputs.items()}, **grads}


def _policy(options: dict[str, Any], packed: bool = False) -> Call:
    def call(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        extra: dict[str, Any] = dict(options)
        names = ("log_probs", "old_log_probs", "advantages", "mask")
        tensors = [x[n] for n in names]
        if packed:  # (N,) tokens, (S,) advantages
            tensors = [x[n].reshape(-1) for n in names]
            tensors[2] = x["sequence_advantages"]
            extra["cu_seqlens"] = x["cu_seqlens"]
        out = rlo.policy_loss(*tensors, **extra)
        return {"loss": out.loss, **out.diagnostics._asdict()}

    return call


def _weighted_policy(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = rlo.policy_loss(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"],
        importance_weights=x["weights"], entropy=x["entropy"], entropy_coef=0.01,
    )  # fmt: skip
    return {"loss": out.loss, **out.diagnostics._asdict()}


def _others() -> dict[str, Call]:
    def kl(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss = rlo.kl_loss(x["log_probs"], x["ref_log_probs"], x["mask"],
                           reduction="sequence_mean", importance_weights=x["weights"])  # fmt: skip
        return {"loss": loss}

    def rewards(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return rlo.kl_penalized_rewards(x["log_probs"], x["ref_log_probs"], x["rewards"],
                                        x["mask"], 0.3)  # fmt: skip

    def seed(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return rlo.grpo_clipped_surrogate(x["log_probs"], x["old_log_probs"], x["advantages"],
                                          x["mask"], 0.2)  # fmt: skip

    def head(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = rlo.token_log_probs_from_hidden(x["hidden"], x["weight"], x["tokens"],
                                              mask=x["mask"], return_entropy=True)  # fmt: skip
        return {"log_probs": out.log_probs, "entropy": out.entropy}

    def fused(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = rlo.fused_policy_loss_from_hidden(
            x["hidden"], x["weight"], x["tokens"], x["head_old_log_probs"], x["advantages"],
            x["mask"], surrogate=Clip(high=0.28, dual=3.0), reduction="sequence_mean",
            ref_log_probs=x["head_ref_log_probs"], kl_coef=0.1, kl_estimator="k2",
            entropy_coef=0.01,
        )  # fmt: skip
        return {"loss": out.loss, "kl": out.kl_loss, "entropy": out.entropy_loss}

    return {
        "kl_loss": kl,
        "kl_penalized_rewards": rewards,
        "grpo_clipped_surrogate": seed,
        "token_log_probs_from_hidden": head,
        "fused_policy_loss_from_hidden": fused,
    }


def _compare(tag: str, got: dict[str, Any], want: dict[str, Any], dtype: torch.dtype,
             selected: int) -> list[Result]:  # fmt: skip
    results = []
    for name, value in want.items():
        if "fraction" in name:  # counts: one token either side of an edge at most
            difference = abs(float(got[name]) - float(value))
            ok = difference <= 1.01 / max(selected, 1)
            results.append((f"{tag} {name}", ok, f"abs diff {difference:.2e}"))
            continue
        bound = GRAD_TOLERANCE[dtype] if name.startswith("grad") else VALUE_TOLERANCE[dtype]
        if dtype == torch.bfloat16 and got[name].dtype == torch.bfloat16:
            bound = GRAD_TOLERANCE[dtype]  # a bf16 output: rounded once
        results.append(compare(f"{tag} {name}", got[name], value, bound))
    return results


def check_public(device: torch.device, dry: bool = False) -> list[Result]:
    """Every public function with kernels, on the device (triton) vs float64 CPU (torch)."""
    shape = (3, 17) if dry else (16, 257)
    calls: dict[str, Call] = {f"policy_loss {k}": _policy(v) for k, v in POLICY_OPTIONS.items()}
    calls["policy_loss packed"] = _policy({"reduction": "sequence_mean"}, packed=True)
    calls["policy_loss weights+entropy"] = _weighted_policy
    calls.update(_others())
    results: list[Result] = []
    for dtype in (torch.float32, torch.bfloat16):
        data = _inputs(shape, dtype, seed=21)
        selected = int(data["mask"].sum())
        for name, call in calls.items():
            got = _run(call, data, str(device), "triton")
            want = _run(call, data, "cpu", "torch")
            results += _compare(f"public {name} {str(dtype)[6:]}", got, want, dtype, selected)
    return results


def public_check(dry: bool) -> Callable[[torch.device], list[Result]]:
    """:func:`check_public` bound to the dry-run shapes if asked (a check of ``gpu_triton``)."""

    def check_public_functions(device: torch.device) -> list[Result]:
        return check_public(device, dry)

    return check_public_functions
