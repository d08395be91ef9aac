"""Correctness of ``gpu_triton.py``: the public functions on the device vs float64 on the CPU.

- **Hidden-state functions** (:func:`check_hidden_public`): ``token_log_probs_from_hidden`` and
  ``fused_policy_loss_from_hidden`` under ``use_backend("triton")`` on the device against the same
  call under ``use_backend("torch")`` in float64 on the CPU: values, gradients to hidden / weight /
  bias, diagnostics; padded and packed; NaN hidden rows where the mask is False, ``-inf`` bias
  entries; where the public API has them, ``logit_scale``, ``final_logit_softcapping`` and one
  temperature per token, and ``fp32_head=False`` (bf16; compared with the torch backend on the
  CPU in bf16, since rounding the product to bf16 is the definition and float64 cannot round).
- **policy_loss** (:func:`check_policy_eager`, :func:`check_policy_compiled`): on the device eager
  and with ``RLOBJECTIVES_COMPILE=1`` against the eager float64 call on the CPU (GRPO, DAPO + dual
  clip + delta, CISPO cap, SAPO, GSPO, ``"none"``, packed, importance weights + entropy bonus;
  NaN log-probs where the mask is False): values, gradients, every diagnostic.

Bounds are those of :mod:`gpu_triton_checks` (relative to the largest expected magnitude); a
diagnostic fraction may differ by one token (a ratio within an ulp of an edge, decided in float32
on the device and in float64 on the CPU).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

import rlobjectives as rlo
from gpu_triton_checks import GRAD_BOUND, VALUE_BOUND, Result, compare, compile_skip
from gpu_triton_checks import compiling as compile_block
from rlobjectives import CISPO, Clip

Tensors = dict[str, torch.Tensor]
Call = Callable[[Tensors], tuple[Tensors, torch.Tensor]]  # (outputs, the differentiated sum)
LEAVES = ("log_probs", "entropy", "hidden", "weight", "bias")
_HEAD_KEYWORDS = inspect.signature(rlo.token_log_probs_from_hidden).parameters
HEAD_OPTIONS = "final_logit_softcapping" in _HEAD_KEYWORDS  # the head options of this version

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
COMPILED_CASES = ("grpo", "dapo+dual+delta")  # one graph each per dtype: compiling costs
COMPILE_RESERVE_S = 150.0  # a compiled case starts only with this much time left (timings)


def _unlimited() -> float:
    return math.inf


TIME_LEFT: Callable[[], float] = _unlimited  # seconds left; gpu_triton.py sets its clock


# ---------------------------------------------------------------------------------------- inputs
def _policy_inputs(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> Tensors:
    batch, tokens = shape
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=g) * 3
    mask = torch.rand(batch, tokens, generator=g) < 0.7
    new = old + 0.4 * torch.randn(batch, tokens, generator=g)
    values = {
        "log_probs": torch.where(mask, new, math.nan),  # poisoned padding
        "old_log_probs": old,
        "advantages": torch.randn(batch, generator=g),
        "sequence_advantages": torch.randn(4, generator=g),  # the 4 packed sequences
        "weights": 0.5 + torch.rand(batch, tokens, generator=g),
        "entropy": 3 * torch.rand(batch, tokens, generator=g),
    }
    out = {name: value.to(dtype) for name, value in values.items()}
    out["mask"] = mask
    out["cu_seqlens"] = torch.tensor([0, 5, 5, tokens * batch - 7, tokens * batch])
    return out


def _head_inputs(shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int) -> Tensors:
    batch, tokens, width, vocab = shape
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, tokens, generator=g) < 0.8
    bias = torch.randn(vocab, generator=g)
    banned = torch.arange(vocab) % 89 == 7
    bias[banned] = -math.inf
    ids = torch.randint(0, vocab, (batch, tokens), generator=g)
    hidden = torch.randn(batch, tokens, width, generator=g)
    old = -math.log(vocab) + 0.3 * torch.randn(batch, tokens, generator=g)  # ratios of order 1
    values = {
        "hidden": torch.where(mask[..., None], hidden, math.nan),
        "weight": 2 * torch.randn(vocab, width, generator=g) / math.sqrt(width),
        "bias": bias,
        "old_log_probs": old,
        "ref_log_probs": old + 0.2 * torch.randn(batch, tokens, generator=g),
        "advantages": torch.randn(batch, generator=g),
    }
    out = {name: value.to(dtype) for name, value in values.items()}
    out["tokens"] = torch.where(mask, torch.where(banned[ids], 0, ids), -100)  # -100: unread
    out["mask"] = mask
    out["temperature"] = 0.5 + torch.rand(batch, tokens, generator=g)  # per token, float32
    out["upstream"] = torch.randn(2, batch, tokens, generator=g)
    out["cu_seqlens"] = torch.tensor([0, 3, 3, batch * tokens - 2, batch * tokens])
    return out


def _run(call: Call, data: Tensors, device: str, *, backend: str, float64: bool,
         compiled: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """Outputs and the gradients of the call's objective w.r.t. the leaves it uses."""
    on = {k: v.to(device).detach().clone() for k, v in data.items()}
    if float64:
        on = {k: v.double() if v.is_floating_point() else v for k, v in on.items()}
    leaves = [name for name in LEAVES if name in on]
    for name in leaves:
        on[name].requires_grad_(True)
    with (
        rlo.use_backend(backend),
        compile_block(compiled),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")  # recorded: BiasedGradientWarning of k1/k3, a fallback
        outputs, objective = call(on)
        found = torch.autograd.grad(objective, [on[n] for n in leaves], allow_unused=True)
    fallback = [str(w.message) for w in caught if "RLOBJECTIVES_COMPILE" in str(w.message)]
    if fallback:  # the compiled checks must not pass on the eager fallback
        raise RuntimeError(f"RLOBJECTIVES_COMPILE=1 fell back to eager: {fallback[0][:300]}")
    grads = {f"grad {n}": g for n, g in zip(leaves, found, strict=True) if g is not None}
    return {**{k: v.detach() for k, v in outputs.items()}, **grads}


def _compare(tag: str, got: dict[str, Any], want: dict[str, Any], dtype: torch.dtype,
             selected: int, loose: bool = False) -> list[Result]:  # fmt: skip
    results = []
    for name, value in want.items():
        if "fraction" in name:  # counts: one token either side of an edge at most
            difference = abs(float(got[name]) - float(value))
            ok = difference <= 1.01 / max(selected, 1)
            results.append((f"{tag} {name}", ok, f"abs diff {difference:.2e}"))
            continue
        bound = GRAD_BOUND[dtype] if name.startswith("grad") or loose else VALUE_BOUND
        if dtype == torch.bfloat16 and got[name].dtype == torch.bfloat16:
            bound = GRAD_BOUND[dtype]  # a bf16 output: rounded once
        results.append(compare(f"{tag} {name}", got[name], value, bound))
    return results


# ----------------------------------------------------------------------------- hidden-state path
def _log_probs(packed: bool = False, **options: Any) -> Call:
    def call(x: Tensors) -> tuple[Tensors, torch.Tensor]:
        extra = dict(options)
        if extra.pop("per_token_temperature", False):
            extra["temperature"] = x["temperature"].reshape(-1) if packed else x["temperature"]
        hidden, tokens, mask = x["hidden"], x["tokens"], x["mask"]
        if packed:  # (N, H) hidden, (N,) tokens and mask
            hidden, tokens, mask = hidden.flatten(0, 1), tokens.reshape(-1), mask.reshape(-1)
            extra["cu_seqlens"] = x["cu_seqlens"]
        out = rlo.token_log_probs_from_hidden(
            hidden, x["weight"], tokens, bias=x["bias"], mask=mask, return_entropy=True, **extra
        )
        upstream = x["upstream"].to(out.log_probs.dtype).reshape(2, *out.log_probs.shape)
        total = (out.log_probs * upstream[0]).sum() + (out.entropy * upstream[1]).sum()
        return {"log_probs": out.log_probs, "entropy": out.entropy}, total

    return call


def _fused(**options: Any) -> Call:
    def call(x: Tensors) -> tuple[Tensors, torch.Tensor]:
        extra = dict(options)
        if extra.pop("per_token_temperature", False):
            extra["temperature"] = x["temperature"]
        if extra.get("kl_coef"):
            extra["ref_log_probs"] = x["ref_log_probs"]
        out = rlo.fused_policy_loss_from_hidden(
            x["hidden"], x["weight"], x["tokens"], x["old_log_probs"], x["advantages"],
            x["mask"], bias=x["bias"], **extra,
        )  # fmt: skip
        values = {"loss": out.loss, "policy_loss": out.policy_loss, "kl_loss": out.kl_loss,
                  "entropy_loss": out.entropy_loss, "log_probs": out.log_probs,
                  **out.diagnostics._asdict()}  # fmt: skip
        return {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}, out.loss

    return call


def _hidden_calls() -> dict[str, Call]:
    transform = {"logit_scale": 1.5, "final_logit_softcapping": 3.0, "per_token_temperature": True}
    calls: dict[str, Call] = {
        "token_log_probs_from_hidden T=0.8": _log_probs(temperature=0.8),
        "token_log_probs_from_hidden packed": _log_probs(packed=True),
        "fused_policy_loss_from_hidden grpo": _fused(),
        "fused_policy_loss_from_hidden dapo+dual+kl(k2)+entropy": _fused(
            surrogate=Clip(high=0.28, dual=3.0),
            reduction="sequence_mean",
            kl_coef=0.1,
            kl_estimator="k2",
            entropy_coef=0.01,
        ),  # fmt: skip
        "fused_policy_loss_from_hidden gspo (composition)": _fused(
            ratio_level="sequence", surrogate=Clip(low=3e-4, high=4e-4), reduction="sequence_mean"
        ),
    }
    if HEAD_OPTIONS:
        calls["token_log_probs_from_hidden scale+softcap+per-token T"] = _log_probs(**transform)
        calls["token_log_probs_from_hidden packed scale+softcap+per-token T"] = _log_probs(
            packed=True, **transform
        )
        calls["fused_policy_loss_from_hidden scale+softcap+per-token T+entropy"] = _fused(
            entropy_coef=0.01, **transform
        )
    return calls


def check_hidden_public(device: torch.device, dry: bool = False) -> list[Result]:
    """Triton on the device vs the torch backend in float64 on the CPU (module docstring)."""
    shape = (3, 11, 32, 97) if dry else (4, 257, 256, 5003)
    calls = _hidden_calls()
    results: list[Result] = []
    if not HEAD_OPTIONS:
        results.append(("public head options: not in this version's API", None, ""))
    for dtype in (torch.float32, torch.bfloat16):
        data = _head_inputs(shape, dtype, seed=31)
        selected = int(data["mask"].sum())
        for name, call in calls.items():
            got = _run(call, data, str(device), backend="triton", float64=False)
            want = _run(call, data, "cpu", backend="torch", float64=True)
            results += _compare(f"public {name} {str(dtype)[6:]}", got, want, dtype, selected)
        if HEAD_OPTIONS and dtype == torch.bfloat16:  # the product rounded to bf16 first
            call = _log_probs(fp32_head=False, temperature=0.8)
            got = _run(call, data, str(device), backend="triton", float64=False)
            want = _run(call, data, "cpu", backend="torch", float64=False)
            tag = "public token_log_probs_from_hidden fp32_head=False bfloat16 (vs CPU bf16)"
            results += _compare(tag, got, want, dtype, selected, loose=True)
    return results


# ---------------------------------------------------------------------------------- policy_loss
def _policy(options: dict[str, Any], packed: bool = False) -> Call:
    def call(x: Tensors) -> tuple[Tensors, torch.Tensor]:
        extra: dict[str, Any] = dict(options)
        names = ("log_probs", "old_log_probs", "advantages", "mask")
        tensors = [x[n] for n in names]
        if packed:  # (N,) tokens, (S,) advantages
            tensors = [x[n].reshape(-1) for n in names]
            tensors[2] = x["sequence_advantages"]
            extra["cu_seqlens"] = x["cu_seqlens"]
        out = rlo.policy_loss(*tensors, **extra)
        return {"loss": out.loss, **out.diagnostics._asdict()}, out.loss.double().sum()

    return call


def _weighted_policy(x: Tensors) -> tuple[Tensors, torch.Tensor]:
    out = rlo.policy_loss(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"],
        importance_weights=x["weights"], entropy=x["entropy"], entropy_coef=0.01,
    )  # fmt: skip
    return {"loss": out.loss, **out.diagnostics._asdict()}, out.loss


def _policy_calls(names: tuple[str, ...] | None = None) -> dict[str, Call]:
    calls = {k: _policy(v) for k, v in POLICY_OPTIONS.items()}
    calls["packed sequence_mean"] = _policy({"reduction": "sequence_mean"}, packed=True)
    calls["weights+entropy"] = _weighted_policy
    return calls if names is None else {k: calls[k] for k in names}


def _check_policy(device: torch.device, dry: bool, compiled: bool) -> list[Result]:
    shape = (3, 17) if dry else (16, 257)
    mode = "compiled" if compiled else "eager"
    calls = _policy_calls(COMPILED_CASES if compiled else None)
    results: list[Result] = []
    for dtype in (torch.float32, torch.bfloat16):
        data = _policy_inputs(shape, dtype, seed=21)
        selected = int(data["mask"].sum())
        for name, call in calls.items():
            tag = f"policy_loss {mode} {name} {str(dtype)[6:]}"
            reserve = COMPILE_RESERVE_S / (10 if dry else 1)
            if compiled and TIME_LEFT() < reserve:  # each case compiles a graph
                results.append((f"{tag}: not run (time kept for the timings)", None, ""))
                continue
            got = _run(call, data, str(device), backend="auto", float64=False, compiled=compiled)
            want = _run(call, data, "cpu", backend="torch", float64=True)
            results += _compare(tag, got, want, dtype, selected)
    return results


def check_policy_eager(device: torch.device, dry: bool = False) -> list[Result]:
    """``policy_loss`` eager on the device vs float64 on the CPU."""
    return _check_policy(device, dry, compiled=False)


def check_policy_compiled(device: torch.device, dry: bool = False) -> list[Result]:
    """``policy_loss`` with ``RLOBJECTIVES_COMPILE=1`` on the device vs float64 eager on the CPU."""
    skip = compile_skip(device, "policy_loss compiled")
    if skip is not None:
        return [skip]
    return _check_policy(device, dry, compiled=True)


def public_checks(dry: bool) -> list[Callable[[torch.device], list[Result]]]:
    """The checks of this module bound to the dry-run shapes if asked, in order."""

    def bind(check: Callable[..., list[Result]]) -> Callable[[torch.device], list[Result]]:
        def bound(device: torch.device) -> list[Result]:
            return check(device, dry)

        bound.__name__ = check.__name__
        return bound

    checks = (check_policy_eager, check_hidden_public, check_policy_compiled)
    return [bind(check) for check in checks]
