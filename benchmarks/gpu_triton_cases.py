"""Timing cases of ``gpu_triton.py``: token losses and the hidden-state path, memory, verdicts.

Token losses (issue 17): ``policy_loss`` (GRPO defaults, token mean), ``kl_loss`` (k3, token
mean) and the seed ``kl_penalized_rewards`` at B=64 T=4096 and B=8 T=16384, bf16 and fp32, prefix
masks (~70% selected). Variants: the naive eager reference (``tests/eager_reference.py``, the ratio
baseline), the public function with ``RLOBJECTIVES_KERNELS=triton`` (the Triton kernels, boundary
validation and the reduction weights included) and with ``RLOBJECTIVES_KERNELS=torch`` (the
library's PyTorch path), the copy floor (inputs read once, gradient written once), and in the
compiled pass ``torch.compile`` of the reference. (Setting the variable inside the timed call
costs a few microseconds.)

Hidden-state path: bf16 N=16384 H=4096 V=152064 and N=8192 H=4096 V=128256, 90% of the rows
selected, backward with respect to ``hidden`` and ``weight``. Variants: the public
``fused_policy_loss_from_hidden`` with ``RLOBJECTIVES_KERNELS=triton`` (the Triton LM head and
token-loss kernels), Cut Cross-Entropy's ``linear_cross_entropy`` (cross-entropy: the same
logits/lse/gradient structure), Liger-Kernel's ``LigerFusedLinearGRPOLoss``
(``loss_type="bnpo"`` = token mean, no KL, its default ``torch.compile`` of the chunk loss), the
public function with ``RLOBJECTIVES_KERNELS=torch`` (the chunked PyTorch path), and the
three-GEMM floor. Memory: peak allocated during one fwd+bwd beyond the inputs and the two
gradients (``(N*H + V*H)`` elements), measured in this process after a warm-up call.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

import eager_reference as eager
import harness
import rlobjectives
from rlobjectives._core.backend import use_backend

Inputs = harness.Inputs
TRITON = "triton (RLOBJECTIVES_KERNELS=triton)"  # the verdicts find the row by this prefix
TORCH = "torch (RLOBJECTIVES_KERNELS=torch)"


@dataclasses.dataclass
class Planned:
    """A harness case with its repeat counts, time estimate and measured memory."""

    case: harness.Case
    warmup: int
    repeats: int
    estimate_s: float
    measure_memory: bool = False
    memory: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.case.label


# ----------------------------------------------------------------------------------- token losses
def _token_inputs(batch: int, tokens: int, dtype: torch.dtype) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        g = torch.Generator(device=device).manual_seed(0)
        old = -torch.rand(batch, tokens, generator=g, device=device) * 3
        log_probs = old + 0.3 * torch.randn(batch, tokens, generator=g, device=device)
        lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=g,
                                device=device)  # fmt: skip
        mask = torch.arange(tokens, device=device).unsqueeze(0) < lengths
        return {
            "log_probs": log_probs.to(dtype),
            "old_log_probs": old.to(dtype),
            "ref_log_probs": (
                old + 0.2 * torch.randn(batch, tokens, generator=g, device=device)
            ).to(dtype),  # fmt: skip
            "advantages": torch.randn(batch, 1, generator=g, device=device),
            "rewards": torch.randn(batch, generator=g, device=device),
            "mask": mask,
        }

    return make


def _policy(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with use_backend(backend):
            return rlobjectives.policy_loss(
                x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"]
            ).loss

    return run


def _policy_reference(x: Inputs) -> torch.Tensor:
    return eager.policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"])


def _kl(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with use_backend(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # k3's BiasedGradientWarning
            return rlobjectives.kl_loss(x["log_probs"], x["ref_log_probs"], x["mask"])

    return run


def _kl_reference(x: Inputs) -> torch.Tensor:
    return eager.kl_loss(x["log_probs"], x["ref_log_probs"], x["mask"])


def _rewards(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with use_backend(backend):
            return rlobjectives.kl_penalized_rewards(
                x["log_probs"], x["ref_log_probs"], x["rewards"], x["mask"], 0.1
            )["objective"]

    return run


def _rewards_reference(x: Inputs) -> torch.Tensor:
    return eager.kl_penalized_rewards(
        x["log_probs"], x["ref_log_probs"], x["rewards"], x["mask"], 0.1
    )


TOKEN_OPERATIONS = {
    "policy_loss": (_policy_reference, _policy),
    "kl_loss": (_kl_reference, _kl),
    "kl_penalized_rewards": (_rewards_reference, _rewards),
}


def token_cases(device: torch.device, dry: bool, *, compiled: bool) -> list[Planned]:
    """The token-loss cases; ``compiled``: the pass with ``torch.compile`` of the reference."""
    shapes = [(4, 33)] if dry else [(64, 4096), (8, 16384)]
    planned = []
    for name, (reference, public) in TOKEN_OPERATIONS.items():
        for batch, tokens in shapes:
            for dtype in (torch.bfloat16, torch.float32):
                element = torch.finfo(dtype).bits // 8
                count = batch * tokens
                floor = harness.CopyFloor(count * (2 * element + 1),
                                          count * (3 * element + 1))  # fmt: skip
                variants = [
                    harness.Variant("eager reference", reference, role="reference"),
                    harness.Variant(TRITON, public("triton")),
                ]
                if compiled:
                    variants.append(harness.Variant("eager reference", reference, compile=True))
                else:
                    variants.append(harness.Variant(TORCH, public("torch")))
                case = harness.Case(
                    operation=name, shape=f"B={batch} T={tokens}", dtype=dtype,
                    make_inputs=_token_inputs(batch, tokens, dtype),
                    grad_inputs=("log_probs",), variants=tuple(variants),
                    floor=None if compiled else floor,
                )  # fmt: skip
                estimate = 60.0 if compiled else 8.0
                repeats = 3 if dry else 25
                planned.append(Planned(case, warmup=2 if dry else 5, repeats=repeats,
                                       estimate_s=estimate))  # fmt: skip
    return planned


# ----------------------------------------------------------------------------- hidden-state path
def _hidden_inputs(rows: int, width: int, vocab: int) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(rows, width, generator=g, device=device, dtype=torch.bfloat16)
        weight = torch.randn(vocab, width, generator=g, device=device, dtype=torch.bfloat16)
        weight = weight / width**0.5
        mask = torch.rand(rows, generator=g, device=device) < 0.9
        tokens = torch.randint(0, vocab, (rows,), generator=g, device=device)
        # near the log-probability of a token of a random head (-log V), so ratios are ~1
        old = -math.log(vocab) + 0.2 * torch.randn(rows, generator=g, device=device)
        return {
            "hidden": hidden, "weight": weight, "tokens": tokens, "mask": mask,
            "old_log_probs": old, "advantages": torch.randn(rows, generator=g, device=device),
        }  # fmt: skip

    return make


def _hidden(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with use_backend(backend):
            return rlobjectives.fused_policy_loss_from_hidden(
                x["hidden"][None], x["weight"], x["tokens"][None], x["old_log_probs"][None],
                x["advantages"][None], x["mask"][None],
            ).loss  # fmt: skip

    return run


def _cce_variant() -> harness.Variant:
    from cut_cross_entropy import linear_cross_entropy

    def cce(x: Inputs) -> torch.Tensor:
        targets = torch.where(x["mask"], x["tokens"], -100)
        return linear_cross_entropy(x["hidden"], x["weight"], targets)  # type: ignore[no-any-return]

    return harness.Variant("cut-cross-entropy linear_cross_entropy", cce)


def _liger_variant() -> harness.Variant:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo")

    def liger(x: Inputs) -> torch.Tensor:
        rows = x["hidden"].shape[0]
        batch = 8 if rows % 8 == 0 else 1
        out = loss_fn(
            x["hidden"].view(batch, rows // batch, -1), x["weight"],
            x["tokens"].view(batch, -1), x["mask"].view(batch, -1).long(),
            x["advantages"].view(batch, -1)[:, 0],
            old_per_token_logps=x["old_log_probs"].view(batch, -1),
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]

    return harness.Variant("liger LigerFusedLinearGRPOLoss", liger)


def hidden_cases(device: torch.device, dry: bool, *, peers: dict[str, str | None]) -> list[Planned]:
    shapes = [(13, 40, 37)] if dry else [(16384, 4096, 152064), (8192, 4096, 128256)]
    planned = []
    for rows, width, vocab in shapes:
        variants = [harness.Variant(TRITON, _hidden("triton"))]
        for module, factory in (("liger_kernel", _liger_variant),
                                ("cut_cross_entropy", _cce_variant)):  # fmt: skip
            if module in peers and peers[module] is None:
                variants.append(factory())
        variants.append(harness.Variant(TORCH, _hidden("torch")))
        reference = next((i for i, v in enumerate(variants) if v.name.startswith("liger")), 0)
        variants[reference] = dataclasses.replace(variants[reference], role="reference")
        floor = harness.MatmulFloor(
            forward=((rows, width, vocab),),
            forward_backward=((rows, width, vocab), (rows, vocab, width), (vocab, rows, width)),
            dtype=torch.bfloat16,
        )
        case = harness.Case(
            operation="fused_policy_loss_from_hidden", shape=f"N={rows} H={width} V={vocab}",
            dtype=torch.bfloat16, make_inputs=_hidden_inputs(rows, width, vocab),
            grad_inputs=("hidden", "weight"), variants=tuple(variants), floor=floor,
        )  # fmt: skip
        planned.append(Planned(case, warmup=1, repeats=2 if dry else 4, estimate_s=120.0,
                               measure_memory=True))  # fmt: skip
    return planned


def _fwd_bwd(
    fn: Callable[[Inputs], torch.Tensor], inputs: Inputs, leaves: list[torch.Tensor]
) -> None:
    for leaf in leaves:
        leaf.grad = None
    fn(inputs).backward()


def measure_memory(planned: Planned, device: torch.device) -> None:
    """MiB allocated at the peak of one fwd+bwd beyond inputs and gradients, per variant."""
    if not planned.measure_memory or device.type != "cuda":
        return
    case = planned.case
    inputs = case.make_inputs(device)
    leaves = [inputs[name].requires_grad_(True) for name in case.grad_inputs]
    gradient_bytes = sum(leaf.numel() * leaf.element_size() for leaf in leaves)
    for variant in case.variants:
        fn = harness.compiled(variant.fn) if variant.compile else variant.fn
        _fwd_bwd(fn, inputs, leaves)  # warm-up: compilation, autotuning, lazy initialisation
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _fwd_bwd(fn, inputs, leaves)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before - gradient_bytes
        planned.memory[variant.key] = peak / harness.MIB
    for leaf in leaves:
        leaf.grad = None
    inputs.clear()
    torch.cuda.empty_cache()


def rows_for(planned: Planned, device: torch.device) -> list[harness.Row]:
    """Time the case (variants interleaved) and build the table rows."""
    case = planned.case
    timings = harness.time_case(case, device, warmup=planned.warmup, repeats=planned.repeats)
    references = [v.key for v in case.variants if v.role == "reference"]
    reference = timings[references[0]][0] if references else None
    floor = timings.get("floor")
    rows = []
    entries: list[tuple[str, str, Any]] = [(v.key, v.role, timings[v.key]) for v in case.variants]
    if floor is not None:
        kind = "copy" if isinstance(case.floor, harness.CopyFloor) else "matmul"
        entries.append((f"floor ({kind})", "floor", floor))
    for key, role, (total, forward) in entries:
        rows.append(harness.Row(
            operation=case.operation, shape=case.shape, dtype=harness.dtype_name(case.dtype),
            variant=key, role=role, fwd_bwd_ms=total.median_ms, fwd_bwd_min_ms=total.min_ms,
            fwd_bwd_max_ms=total.max_ms, fwd_ms=forward.median_ms, fwd_min_ms=forward.min_ms,
            fwd_max_ms=forward.max_ms,
            vs_reference=None if reference is None else total.median_ms / reference.median_ms,
            vs_floor=None if floor is None else total.median_ms / floor[0].median_ms,
            peak_mib=planned.memory.get(key), saved_mib=None,
            vs_reference_min=None if reference is None else total.min_ms / reference.min_ms,
        ))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------- targets
def _find(block: list[harness.Row], prefix: str) -> harness.Row | None:
    return next((row for row in block if row.variant.startswith(prefix)), None)


def _hidden_verdicts(block: list[harness.Row], ours: harness.Row, tag: str) -> list[str]:
    lines = []
    targets = (
        ("liger", "time <= Liger", "fwd_bwd_ms"),
        ("cut-cross", "memory beyond inputs+grads <= CCE", "peak_mib"),
    )
    for prefix, what, value in targets:
        peer = _find(block, prefix)
        mine, theirs = getattr(ours, value), None if peer is None else getattr(peer, value)
        if mine is None or theirs is None:
            lines.append(f"n/a   {tag}: {what} (not measured)")
        else:
            verdict = "PASS" if mine <= theirs else "MISS"
            lines.append(f"{verdict}  {tag}: {what}: {mine:.1f} vs {theirs:.1f}")
    return lines


def verdicts(blocks: list[list[harness.Row]]) -> list[str]:
    """One line per issue-17 target and case (rows of one case were timed interleaved)."""
    lines = []
    for block in blocks:
        ours = _find(block, TRITON)
        if ours is None:
            continue
        tag = f"{ours.operation} {ours.shape} {ours.dtype}"
        if ours.operation == "fused_policy_loss_from_hidden":
            lines += _hidden_verdicts(block, ours, tag)
            continue
        for row in block:
            if row.variant == "floor (copy)":
                ratio = ours.fwd_bwd_ms / row.fwd_bwd_ms
                verdict = "PASS" if ratio <= 3.0 else "MISS"
                lines.append(f"{verdict}  {tag}: triton within 3x of the copy floor: {ratio:.2f}x")
            elif row.variant.startswith("eager reference"):
                verdict = "PASS" if ours.fwd_bwd_ms < row.fwd_bwd_ms else "MISS"
                lines.append(f"{verdict}  {tag}: triton faster than {row.variant}: "
                             f"{ours.fwd_bwd_ms:.3f} vs {row.fwd_bwd_ms:.3f} ms")  # fmt: skip
            elif row.variant == TORCH:
                verdict = "info" if row.vs_reference is None else (
                    "PASS" if row.vs_reference <= 1.0 else "MISS")  # fmt: skip
                lines.append(f"{verdict}  {tag}: {TORCH} vs eager reference: "
                             f"{row.vs_reference or float('nan'):.2f}x")  # fmt: skip
    return lines
