"""Correctness checks of ``gpu_triton.py``: the Triton kernels on a device vs float64 on the CPU.

Each check is ``check(device) -> list[(name, ok, detail)]``. Errors are measured relative to the
largest magnitude of the expected tensor (``max |got - want| / max |want|``), against a bound per
dtype: float32 math everywhere (approximate ``exp`` on the GPU, fp32 ``tl.dot`` in IEEE mode) and,
for bf16 gradients, the two roundings the autograd path also makes (``dL/dz`` and the result).
Decisions at a bound do not depend on ``tl.exp``'s rounding (``docs/conventions.md``,
"Decisions at a bound"): :func:`check_boundary_decisions` runs the sweep of
``tests/boundary_cases.py`` (log-ratios at and one ulp around every bound) through the public
``policy_loss`` on the kernels and requires the rule's counts and gradient factors exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from rlobjectives.kernels.from_hidden import (
    FusedPolicyLossFromHiddenFunction,
    LogProbsFromHiddenFunction,
)
from rlobjectives.kernels.kl import KLPenalizedRewardsFunction, kl_loss_forward
from rlobjectives.kernels.token_loss import TokenLossFunction, TokenLossOptions, TokenLossSums

import boundary_cases
import triton_reference as reference
from rlobjectives import CISPO, DPPO, SAPO, Clip, grpo_clipped_surrogate, policy_loss
from rlobjectives._core.backend import use_backend

Result = tuple[str, bool, str]
VALUE_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-5}  # fp32 math on rounded inputs
GRAD_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # bf16: result rounded to bf16
COUNTS = ("selected", "out_of_band", "binding_low", "binding_high", "dual_binding",
          "bound_fired")  # fmt: skip

POLICY_CASES: dict[str, tuple[TokenLossOptions, dict[str, bool]]] = {
    "grpo": (TokenLossOptions(), {}),
    "dapo+dual+delta": (
        TokenLossOptions(
            surrogate=Clip(low=0.2, high=0.28, dual=3.0, delta=1.5), log_ratio_bound=2.0
        ),
        {"sequence_mean": True},
    ),  # fmt: skip
    "cispo(trl cap)": (TokenLossOptions(surrogate=CISPO(cap=1.3)), {}),
    "sapo": (TokenLossOptions(surrogate=SAPO()), {"sequence_mean": True}),
    "is+kl(k3)+entropy": (
        TokenLossOptions(kl_coef=0.1, entropy_coef=0.01, log_ratio_bound=1.0),
        {"terms": True},
    ),
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max(max |want|, tiny)`` in float64 (0 for empty tensors)."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    if want64.numel() == 0:
        return 0.0
    scale = max(float(want64.abs().max()), 1e-30)
    return float((got64 - want64).abs().max()) / scale


def compare(name: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> Result:
    error = relative_error(got, want)
    finite = bool(torch.isfinite(got.detach().double().cpu()).all())
    return name, finite and error <= bound, f"rel err {error:.2e} (bound {bound:.0e})"


def _token_batch(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    batch, tokens = shape
    count = batch * tokens
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(count, generator=g) * 3
    new = old + 0.4 * torch.randn(count, generator=g)
    new[::29] += 2.5
    mask = torch.rand(count, generator=g) < 0.7
    values = {
        "log_probs": torch.where(mask, new, math.nan),  # poisoned padding
        "old_log_probs": old,
        "advantages": torch.randn(batch, generator=g),
        "importance": 0.5 + torch.rand(count, generator=g),
        "ref": old + 0.3 * torch.randn(count, generator=g),
        "entropy": 3 * torch.rand(count, generator=g),
    }
    out = {k: v.to(dtype) for k, v in values.items()}
    out["mask"] = mask
    return out


def _weights(mask: torch.Tensor, tokens: int, sequence_mean: bool) -> torch.Tensor:
    if not sequence_mean:
        return torch.tensor(1.0) / mask.sum().clamp(min=1)
    counts = mask.view(-1, tokens).sum(-1).float()
    sequences = (counts > 0).sum().clamp(min=1)
    return torch.where(counts > 0, 1.0 / (counts.clamp(min=1) * sequences), 0.0)


def _policy_case(
    device: torch.device, dtype: torch.dtype, name: str, shape: tuple[int, int]
) -> list[Result]:
    options, extras = POLICY_CASES[name]
    batch, tokens = shape
    data = _token_batch(shape, dtype, seed=len(name))
    weights = _weights(data["mask"], tokens, extras.get("sequence_mean", False))
    terms = extras.get("terms", False)
    kwargs: dict[str, Any] = {"options": options, "row_length": tokens}
    ref_kwargs: dict[str, Any] = {"weights": weights.repeat_interleave(tokens)
                                  if weights.ndim else weights}  # fmt: skip
    if terms:
        kwargs.update(importance_weights=data["importance"].to(device),
                      ref_log_probs=data["ref"].to(device))  # fmt: skip
        ref_kwargs.update(importance_weights=data["importance"], ref_log_probs=data["ref"])
    on = {k: v.to(device) for k, v in data.items()}
    entropy = on["entropy"].clone().requires_grad_(True) if terms else None
    log_probs = on["log_probs"].clone().requires_grad_(True)
    loss, _, totals = TokenLossFunction.apply(
        log_probs, entropy, on["old_log_probs"], on["advantages"], on["mask"],
        weights.to(device), kwargs,
    )  # fmt: skip
    loss.backward()
    leaf = data["log_probs"].double().requires_grad_(True)
    entropy_leaf = data["entropy"].double().requires_grad_(True) if terms else None
    expected = reference.token_loss(
        leaf, data["old_log_probs"], data["advantages"].repeat_interleave(tokens), data["mask"],
        options, entropy=entropy_leaf, **ref_kwargs,
    )  # fmt: skip
    expected.loss.backward()
    tag = f"token loss {name} {str(dtype)[6:]}"
    assert leaf.grad is not None and log_probs.grad is not None
    results = [
        compare(f"{tag} loss", loss, expected.loss, VALUE_TOLERANCE[dtype]),
        compare(f"{tag} grad", log_probs.grad, torch.where(data["mask"], leaf.grad, 0.0),
                GRAD_TOLERANCE[dtype]),
    ]  # fmt: skip
    if entropy is not None and entropy_leaf is not None and entropy_leaf.grad is not None:
        assert entropy.grad is not None
        results.append(compare(f"{tag} entropy grad", entropy.grad, entropy_leaf.grad,
                               GRAD_TOLERANCE[dtype]))  # fmt: skip
    sums = dict(zip(TokenLossSums._fields, totals.cpu().unbind(), strict=True))
    worst = max(abs(float(sums[k]) - float(expected.sums.get(k, 0))) for k in COUNTS)
    results.append((f"{tag} counts", worst <= 1, f"max count difference {worst:.0f}"))
    return results


def check_token_losses(device: torch.device, dry: bool = False) -> list[Result]:
    shape = (3, 17) if dry else (16, 257)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for name in POLICY_CASES:
            results += _policy_case(device, dtype, name, shape)
    return results


def _kl_case(
    device: torch.device, data: tuple[torch.Tensor, ...], estimator: str, straight: bool
) -> list[Result]:
    log_probs, ref, mask = data
    weight = torch.tensor(1.0 / mask.numel())
    out = kl_loss_forward(
        log_probs.to(device), ref.to(device), mask.to(device), weights=weight.to(device),
        estimator=estimator, straight_through=straight, log_ratio_bound=2.0,
    )  # fmt: skip
    options = TokenLossOptions(surrogate="none", log_ratio_bound=2.0, kl_coef=1.0,
                               kl_estimator=estimator, kl_straight_through=straight)  # fmt: skip
    leaf = log_probs.double().requires_grad_(True)
    want = reference.token_loss(leaf, None, None, mask, options, weights=weight,
                                ref_log_probs=ref)  # fmt: skip
    (grad,) = torch.autograd.grad(want.loss, leaf)
    tag = f"kl_loss {estimator}{'+st' if straight else ''} {str(log_probs.dtype)[6:]}"
    return [
        compare(f"{tag} value", out.loss, want.loss, 2e-5),
        compare(f"{tag} coefficient", out.coefficient, grad, 2e-5),
    ]


def check_kl(device: torch.device, dry: bool = False) -> list[Result]:
    count = 51 if dry else 4099
    g = torch.Generator().manual_seed(7)
    ref = -torch.rand(count, generator=g) * 3
    log_probs = ref + 0.5 * torch.randn(count, generator=g)
    mask = torch.rand(count, generator=g) < 0.8
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        data = (log_probs.to(dtype), ref.to(dtype), mask)
        # every estimator in float32; two in bf16 (each variant is one more kernel compile)
        combos = [(e, st) for e in ("k1", "k2", "k3", "abs") for st in (False, True)]
        if dtype == torch.bfloat16:
            combos = [("k3", False), ("k2", True)]
        for estimator, straight in combos:
            results += _kl_case(device, data, estimator, straight)
    return results + _check_kl_rewards(device, dry)


def _check_kl_rewards(device: torch.device, dry: bool) -> list[Result]:
    batch, tokens = (3, 45) if dry else (64, 1031)
    g = torch.Generator().manual_seed(8)
    policy = -torch.rand(batch, tokens, generator=g) * 2
    reference_lp = -torch.rand(batch, tokens, generator=g) * 2
    rewards = torch.randn(batch, generator=g)
    mask = torch.rand(batch, tokens, generator=g) < 0.7
    leaves = [t.to(device).clone().requires_grad_(True) for t in (policy, reference_lp, rewards)]
    outputs = KLPenalizedRewardsFunction.apply(*leaves, mask.to(device), 0.3)
    outputs[0].backward()
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (policy, reference_lp, rewards)]
    divergence = torch.where(mask, ref_leaves[0] - ref_leaves[1], 0.0).sum(-1)
    penalized = ref_leaves[2] - 0.3 * divergence
    objective = penalized.mean()
    objective.backward()
    results = [
        compare("kl_penalized_rewards objective", outputs[0], objective, 1e-5),
        compare("kl_penalized_rewards divergences", outputs[2], divergence, 1e-5),
    ]
    for name, leaf, want in zip(("policy", "reference", "rewards"), leaves, ref_leaves,
                                strict=True):  # fmt: skip
        assert leaf.grad is not None and want.grad is not None
        results.append(compare(f"kl_penalized_rewards grad {name}", leaf.grad, want.grad, 1e-6))
    return results


def _head(shape: tuple[int, int, int], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    rows, width, vocab = shape
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, generator=g) < 0.8
    bias = torch.randn(vocab, generator=g)
    banned = torch.arange(vocab) % 97 == 5
    bias[banned] = -math.inf
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    tokens = torch.where(banned[tokens], 0, tokens)
    hidden = torch.where(mask[:, None], torch.randn(rows, width, generator=g), math.nan)
    return {
        "hidden": hidden.to(dtype),
        "weight": (2 * torch.randn(vocab, width, generator=g) / math.sqrt(width)).to(dtype),
        "bias": bias.to(dtype),
        "tokens": torch.where(mask, tokens, -100),
        "mask": mask,
    }


def check_lm_head(device: torch.device, dry: bool = False) -> list[Result]:
    shape = (13, 40, 37) if dry else (300, 256, 5003)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for chunk_bytes in (None, shape[0] * 2 * 16 if dry else shape[0] * 2 * 1024):
            data = _head(shape, dtype, seed=11)
            on = {k: v.to(device) for k, v in data.items()}
            leaves = {k: on[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
            log_probs, entropy = LogProbsFromHiddenFunction.apply(
                leaves["hidden"], leaves["weight"], leaves["bias"], on["tokens"], on["mask"],
                {"temperature": 0.8, "with_entropy": True, "chunk_bytes": chunk_bytes},
            )  # fmt: skip
            g = torch.Generator().manual_seed(12)
            upstream = torch.randn(shape[0], generator=g), torch.randn(shape[0], generator=g)
            ((log_probs * upstream[0].to(device)).sum()
             + (entropy * upstream[1].to(device)).sum()).backward()  # fmt: skip
            ref = {k: data[k].double().requires_grad_(True) for k in ("hidden", "weight", "bias")}
            want = reference.head_log_probs(
                ref["hidden"],
                ref["weight"],
                data["tokens"],
                data["mask"],
                bias=ref["bias"],
                temperature=0.8,
            )
            ((want[0] * upstream[0]).sum() + (want[1] * upstream[1]).sum()).backward()
            tag = f"lm head {str(dtype)[6:]} chunks={'1' if chunk_bytes is None else 'many'}"
            results.append(compare(f"{tag} log_probs", log_probs, want[0], 2e-5))
            results.append(compare(f"{tag} entropy", entropy, want[1], 2e-5))
            for name, leaf in leaves.items():
                assert leaf.grad is not None and ref[name].grad is not None
                results.append(compare(f"{tag} grad {name}", leaf.grad, ref[name].grad,
                                       GRAD_TOLERANCE[dtype]))  # fmt: skip
            masked = leaves["hidden"].grad[~on["mask"]]  # type: ignore[index]
            results.append((f"{tag} masked rows get zero grad", bool((masked == 0).all()), ""))
        results += _check_fused(device, dtype, shape)
    return results


def _check_fused(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]
) -> list[Result]:
    data = _head(shape, dtype, seed=13)
    rows = shape[0]
    g = torch.Generator().manual_seed(14)
    old = (-torch.rand(rows, generator=g) * 8).to(dtype)
    advantages = torch.randn(rows, generator=g).to(dtype)
    weights = torch.tensor(1.0) / data["mask"].sum()
    options = TokenLossOptions(surrogate=Clip(low=0.2, high=0.28), entropy_coef=0.01)
    on = {k: v.to(device) for k, v in data.items()}
    leaves = {k: on[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    loss, *_ = FusedPolicyLossFromHiddenFunction.apply(
        leaves["hidden"], leaves["weight"], leaves["bias"], on["tokens"], on["mask"],
        old.to(device), advantages.to(device), weights.to(device), {"temperature": 1.0},
        {"options": options},
    )  # fmt: skip
    loss.backward()
    ref = {k: data[k].double().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    log_probs, entropy = reference.head_log_probs(ref["hidden"], ref["weight"], data["tokens"],
                                                  data["mask"], bias=ref["bias"])  # fmt: skip
    want = reference.token_loss(log_probs, old, advantages, data["mask"], options,
                                weights=weights, entropy=entropy)  # fmt: skip
    want.loss.backward()
    tag = f"fused policy loss from hidden {str(dtype)[6:]}"
    results = [compare(f"{tag} loss", loss, want.loss, 2e-5)]
    for name, leaf in leaves.items():
        assert leaf.grad is not None and ref[name].grad is not None
        results.append(compare(f"{tag} grad {name}", leaf.grad, ref[name].grad,
                               GRAD_TOLERANCE[dtype]))  # fmt: skip
    return results


def check_boundary_decisions(device: torch.device, dry: bool = False) -> list[Result]:
    """The rule's decisions at every bound on the kernels (counts exact, gradient factors)."""
    del dry  # the sweep is small on every device
    results: list[Result] = []
    with use_backend("triton"):
        example = grpo_clipped_surrogate(
            torch.tensor([[0.1823215567939546, -0.2231435513142097]], device=device),
            torch.zeros(1, 2, device=device), torch.ones(1, device=device),
            torch.ones(1, 2, dtype=torch.bool, device=device), 0.2,
        )  # fmt: skip
        fraction = float(example["clipped_fraction"])
        results.append(("specification example clipped_fraction", fraction == 0.0, f"{fraction}"))
        for dtype in (torch.float32, torch.bfloat16):
            for case, surrogate in boundary_cases.CASES.items():
                results.append(_boundary_case(device, dtype, case, surrogate))
            for divergence in ("tv", "kl"):  # DPPO: float64 evaluation, the exact decision
                results.append(_dppo_case(device, dtype, DPPO(divergence)))
    return results


def _dppo_case(device: torch.device, dtype: torch.dtype, surrogate: DPPO) -> Result:
    positive, positive_old, negative, negative_old = boundary_cases.dppo_sweep(surrogate, dtype)
    kept = [boundary_cases.dppo_exact_kept(surrogate, lp, lo, sign)
            for logs, olds, sign in ((positive, positive_old, 1), (negative, negative_old, -1))
            for lp, lo in zip(logs, olds, strict=True)]  # fmt: skip
    log_probs = torch.tensor([positive, negative], dtype=torch.float64).to(dtype).to(device)
    old = torch.tensor([positive_old, negative_old], dtype=torch.float64).to(dtype).to(device)
    leaf = log_probs.requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0], dtype=dtype, device=device)
    mask = torch.ones(leaf.shape, dtype=torch.bool, device=device)
    out = policy_loss(leaf, old, advantages, mask, surrogate=surrogate)
    (gradient,) = torch.autograd.grad(out.loss, leaf)
    same = bool(torch.equal(gradient.reshape(-1).cpu() != 0, torch.tensor(kept)))
    outside = round(float(out.diagnostics.clipped_fraction) * len(kept))
    ok = same and outside == kept.count(False)
    detail = (
        f"outside {outside} (exact {kept.count(False)}), kept tokens {'ok' if same else 'differ'}"
    )
    return (f"boundary dppo_{surrogate.divergence} {str(dtype)[6:]}", ok, detail)


def _boundary_case(device: torch.device, dtype: torch.dtype, case: str, surrogate: Any) -> Result:
    points = boundary_cases.sweep_points(surrogate, dtype)
    log_probs, old, advantages, mask = boundary_cases.boundary_batch(points, dtype)
    leaf = log_probs.to(device).requires_grad_(True)
    out = policy_loss(leaf, old.to(device), advantages.to(device), mask.to(device),
                      surrogate=surrogate)  # fmt: skip
    (gradient,) = torch.autograd.grad(out.loss, leaf)
    counts, factors = boundary_cases.expected_totals(surrogate, points, torch.float32)
    selected = 2 * len(points)
    got = [round(float(getattr(out.diagnostics, name)) * selected)
           for name in boundary_cases.COUNTS]  # fmt: skip
    ok, detail = got == counts, f"counts {got} (rule {counts})"
    if factors[0] is not None:  # the gradient's factor of r A: 1, 0 or 1/2 (the dual tie)
        ratio = torch.exp(log_probs.float())
        signs = torch.tensor([[1.0], [-1.0]])
        observed = (-gradient.float().cpu() * selected / (signs * ratio)).reshape(-1)
        want = torch.tensor(factors, dtype=torch.float32)
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        same_zeros = bool(torch.equal(observed == 0, want == 0))
        close = bool(((observed - want).abs() <= tolerance * want.abs()).all())
        ok = ok and same_zeros and close
        detail += f", gradient factors {'ok' if same_zeros and close else 'differ'}"
    return (f"boundary {case} {str(dtype)[6:]}", ok, detail)


def correctness_checks(dry: bool) -> list[Callable[[torch.device], list[Result]]]:
    """The checks in order (token losses, decisions at a bound, KL, LM head), dry-run shapes."""

    def bind(check: Callable[..., list[Result]]) -> Callable[[torch.device], list[Result]]:
        def bound(device: torch.device) -> list[Result]:
            return check(device, dry)

        bound.__name__ = check.__name__
        return bound

    checks = (check_token_losses, check_boundary_decisions, check_kl, check_lm_head)
    return [bind(check) for check in checks]
