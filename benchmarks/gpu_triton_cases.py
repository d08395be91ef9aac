"""Timing cases of ``gpu_triton.py``: the policy loss and the hidden-state path, memory, verdicts.

**Policy loss** at B=64 T=4096 and B=8 T=16384, bf16 and fp32, prefix masks (~70% selected),
advantages per sequence, forward + backward with respect to ``log_probs``. Variants: the naive
eager reference (``tests/eager_reference.py``'s ``policy_loss``: the ratio baseline), verl's
eager loss as ``tests/eager_reference.py`` transcribes it (``compute_policy_loss_vanilla``: dual
clip 3, its three metrics read on the host), the public ``policy_loss`` eager (``Clip()``, and
``Clip(low=0.2, dual=3.0)``: verl's options) with its ten diagnostics, the same call with
``RLOBJECTIVES_COMPILE=1`` (set around each call; skipped where the library does not read it),
and the copy floor (inputs read once, gradient written once).

**Hidden-state path**, bf16, N=16384 H=4096 V=152064 and N=8192 H=4096 V=128256, 90% of the rows
selected, backward with respect to ``hidden`` and ``weight``. Two operations:

- ``fused_policy_loss_from_hidden`` (GRPO, token mean): the public call under
  ``use_backend("triton")`` and ``use_backend("torch")``, Liger-Kernel's
  ``LigerFusedLinearGRPOLoss`` (``loss_type="bnpo"`` = token mean, no KL, its default
  ``torch.compile`` of the chunk loss; the ratio baseline when present);
- ``token_log_probs_from_hidden`` as a cross-entropy (``-sum l / count``): the public call on
  both backends, Liger's ``LigerFusedLinearCrossEntropyLoss`` (the baseline when present) and
  Cut Cross-Entropy's ``linear_cross_entropy``;

each with the three-GEMM floor (``h W^T``, ``G W``, ``G^T h``). Memory: peak allocated during one
fwd+bwd beyond the inputs and the two gradients, after a warm-up call (CUDA only).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

import eager_reference as eager
import harness
import rlobjectives
from gpu_triton_checks import compiling
from rlobjectives import Clip

Inputs = harness.Inputs
NAIVE = "naive eager (tests/eager_reference.py)"
VERL = "verl-style eager (vanilla, dual clip 3, host metrics)"
EAGER = "policy_loss eager"
EAGER_VERL = "policy_loss eager, verl options"
COMPILED = "policy_loss RLOBJECTIVES_COMPILE=1"
TRITON = "triton (use_backend)"  # the verdicts find the rows by these names
TORCH = "torch (use_backend)"


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


# ------------------------------------------------------------------------------------ policy loss
def _token_inputs(batch: int, tokens: int, dtype: torch.dtype) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        g = torch.Generator(device=device).manual_seed(0)
        old = -torch.rand(batch, tokens, generator=g, device=device) * 3
        log_probs = old + 0.3 * torch.randn(batch, tokens, generator=g, device=device)
        lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=g,
                                device=device)  # fmt: skip
        advantages = torch.randn(batch, generator=g, device=device)
        return {
            "log_probs": log_probs.to(dtype),
            "old_log_probs": old.to(dtype),
            "advantages": advantages,  # (B,): the correctness checks' graph, compiled
            "column": advantages[:, None].contiguous(),  # (B, 1) for the trainer-style losses
            "mask": torch.arange(tokens, device=device).unsqueeze(0) < lengths,
        }

    return make


def _naive(x: Inputs) -> torch.Tensor:
    return eager.policy_loss(x["log_probs"], x["old_log_probs"], x["column"], x["mask"])


def _verl(x: Inputs) -> torch.Tensor:
    loss, _ = eager.verl_vanilla_policy_loss(
        x["log_probs"], x["old_log_probs"], x["column"], x["mask"]
    )
    return loss


def _ours(surrogate: Clip, compiled: bool = False) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with compiling(compiled):
            return rlobjectives.policy_loss(
                x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"],
                surrogate=surrogate,
            ).loss  # fmt: skip

    return run


def policy_cases(device: torch.device, dry: bool, *, compiled: bool) -> list[Planned]:
    """The policy-loss cases; ``compiled``: with the ``RLOBJECTIVES_COMPILE=1`` variant."""
    del device
    shapes = [(4, 33)] if dry else [(64, 4096), (8, 16384)]
    planned = []
    for batch, tokens in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            element = torch.finfo(dtype).bits // 8
            count = batch * tokens
            floor = harness.CopyFloor(count * (2 * element + 1), count * (3 * element + 1))
            variants = [
                harness.Variant(NAIVE, _naive, role="reference"),
                harness.Variant(VERL, _verl),
                harness.Variant(EAGER, _ours(Clip())),
                harness.Variant(EAGER_VERL, _ours(Clip(low=0.2, dual=3.0))),
            ]
            if compiled:
                variants.append(harness.Variant(COMPILED, _ours(Clip(), compiled=True)))
            case = harness.Case(
                operation="policy_loss", shape=f"B={batch} T={tokens}", dtype=dtype,
                make_inputs=_token_inputs(batch, tokens, dtype), grad_inputs=("log_probs",),
                variants=tuple(variants), floor=floor,
            )  # fmt: skip
            first = batch == shapes[0][0]  # a dtype's first case may compile its graph
            estimate = 45.0 if compiled and first else 12.0
            planned.append(Planned(case, warmup=2 if dry else 5, repeats=3 if dry else 25,
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
            "targets": torch.where(mask, tokens, -100), "count": mask.sum().float(),
            "old_log_probs": old, "advantages": torch.randn(rows, generator=g, device=device),
        }  # fmt: skip

    return make


def _fused(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with rlobjectives.use_backend(backend):
            return rlobjectives.fused_policy_loss_from_hidden(
                x["hidden"][None], x["weight"], x["tokens"][None], x["old_log_probs"][None],
                x["advantages"][None], x["mask"][None],
            ).loss  # fmt: skip

    return run


def _cross_entropy(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        with rlobjectives.use_backend(backend):
            log_probs = rlobjectives.token_log_probs_from_hidden(
                x["hidden"][None], x["weight"], x["tokens"][None], mask=x["mask"][None]
            )
        return -log_probs.sum() / x["count"]

    return run


def _liger_grpo(device: torch.device) -> harness.Variant:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    compiled = device.type == "cuda"  # its default; eager on a CPU dry run (compile time)
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo",
                                       compiled=compiled)  # fmt: skip

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


def _liger_cross_entropy(device: torch.device) -> harness.Variant:
    del device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def liger(x: Inputs) -> torch.Tensor:
        return loss_fn(x["weight"], x["hidden"], x["targets"])  # type: ignore[no-any-return]

    return harness.Variant("liger LigerFusedLinearCrossEntropyLoss", liger)


def _cce(device: torch.device) -> harness.Variant:
    del device
    from cut_cross_entropy import linear_cross_entropy

    def cce(x: Inputs) -> torch.Tensor:
        return linear_cross_entropy(x["hidden"], x["weight"], x["targets"])  # type: ignore[no-any-return]

    return harness.Variant("cut-cross-entropy linear_cross_entropy", cce)


# operation -> (our function, [(peer module, needs CUDA, variant factory)])
HIDDEN_OPERATIONS: dict[str, tuple[Callable[..., Any], list[tuple[str, bool, Any]]]] = {
    "fused_policy_loss_from_hidden": (_fused, [("liger_kernel", False, _liger_grpo)]),
    "token_log_probs_from_hidden (cross-entropy)": (
        _cross_entropy,
        [("liger_kernel", True, _liger_cross_entropy), ("cut_cross_entropy", True, _cce)],
    ),
}


def hidden_cases(device: torch.device, dry: bool, *, peers: dict[str, str | None]) -> list[Planned]:
    """The hidden-state cases, shape by shape; a peer's rows where ``peers[module]`` is None."""
    shapes = [(13, 40, 37)] if dry else [(16384, 4096, 152064), (8192, 4096, 128256)]
    planned = []
    for rows, width, vocab in shapes:
        for operation, (ours, peer_variants) in HIDDEN_OPERATIONS.items():
            variants = [harness.Variant(TRITON, ours("triton"))]
            for module, needs_cuda, factory in peer_variants:
                if peers.get(module, "not asked") is None and (device.type == "cuda"
                                                                or not needs_cuda):  # fmt: skip
                    variants.append(factory(device))
            variants.append(harness.Variant(TORCH, ours("torch")))
            reference = next((i for i, v in enumerate(variants) if v.name.startswith("liger")), 0)
            variants[reference] = dataclasses.replace(variants[reference], role="reference")
            floor = harness.MatmulFloor(
                forward=((rows, width, vocab),),
                forward_backward=((rows, width, vocab), (rows, vocab, width), (vocab, rows, width)),
                dtype=torch.bfloat16,
            )
            case = harness.Case(
                operation=operation, shape=f"N={rows} H={width} V={vocab}",
                dtype=torch.bfloat16, make_inputs=_hidden_inputs(rows, width, vocab),
                grad_inputs=("hidden", "weight"), variants=tuple(variants), floor=floor,
            )  # fmt: skip
            estimate = 20.0 + 10.0 * len(variants) + (30.0 if "fused" in operation else 0.0)
            planned.append(Planned(case, warmup=1, repeats=2 if dry else 4, estimate_s=estimate,
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
        _fwd_bwd(variant.fn, inputs, leaves)  # warm-up: compilation, lazy initialisation
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _fwd_bwd(variant.fn, inputs, leaves)
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
def _find(block: list[harness.Row], name: str) -> harness.Row | None:
    """The row named ``name``, else the first whose name starts with it."""
    exact = next((row for row in block if row.variant == name), None)
    return exact or next((row for row in block if row.variant.startswith(name)), None)


def _line(ok: bool | None, tag: str, what: str, value: str) -> str:
    verdict = "info" if ok is None else ("PASS" if ok else "MISS")
    return f"{verdict:5s} {tag}: {what}: {value}"


def _policy_verdicts(block: list[harness.Row], tag: str) -> list[str]:
    names = (NAIVE, VERL, EAGER, EAGER_VERL, COMPILED, "floor")
    rows = {name: _find(block, name) for name in names}
    naive, verl, eager_row, options = rows[NAIVE], rows[VERL], rows[EAGER], rows[EAGER_VERL]
    compiled, floor = rows[COMPILED], rows["floor"]
    lines = []
    if eager_row and naive:
        ratio = eager_row.fwd_bwd_ms / naive.fwd_bwd_ms
        lines.append(_line(ratio <= 0.5, tag, "eager at most 0.5x naive eager", f"{ratio:.2f}x"))
    if options and verl:
        ratio = options.fwd_bwd_ms / verl.fwd_bwd_ms
        lines.append(_line(None, tag, "eager (verl options) vs verl-style eager", f"{ratio:.2f}x"))
    if compiled and floor:
        ratio = compiled.fwd_bwd_ms / floor.fwd_bwd_ms
        lines.append(_line(ratio <= 3.0, tag, "compiled within 3x of the copy floor",
                           f"{ratio:.2f}x"))  # fmt: skip
    if compiled and naive:
        ratio = compiled.fwd_bwd_ms / naive.fwd_bwd_ms
        lines.append(_line(ratio < 1.0, tag, "compiled faster than naive eager", f"{ratio:.2f}x"))
    return lines


def _hidden_verdicts(block: list[harness.Row], ours: harness.Row, tag: str) -> list[str]:
    lines = []
    floor, torch_row = _find(block, "floor"), _find(block, TORCH)
    if floor is not None:
        ratio = ours.fwd_bwd_ms / floor.fwd_bwd_ms
        lines.append(_line(ratio <= 1.2, tag, "triton within 1.2x of the three-GEMM floor",
                           f"{ratio:.2f}x"))  # fmt: skip
    peers = [("liger", "Liger's")]
    if "cross-entropy" in ours.operation:
        peers.append(("cut-cross", "CCE's"))
    for (prefix, whose), (what, key) in itertools.product(
        peers, (("time", "fwd_bwd_ms"), ("memory", "peak_mib"))
    ):
        what = f"{what} <= {whose}"
        peer = _find(block, prefix)
        mine, theirs = getattr(ours, key), None if peer is None else getattr(peer, key)
        if mine is None or theirs is None:
            lines.append(_line(None, tag, what, "not measured"))
        else:
            lines.append(_line(mine <= theirs, tag, what, f"{mine:.1f} vs {theirs:.1f}"))
    if torch_row is not None:
        ratio = torch_row.fwd_bwd_ms / ours.fwd_bwd_ms
        lines.append(_line(None, tag, "torch backend / triton", f"{ratio:.2f}x"))
    return lines


def verdicts(blocks: list[list[harness.Row]]) -> list[str]:
    """One line per target and case (the rows of one case were timed interleaved)."""
    lines = []
    for block in blocks:
        first = block[0]
        tag = f"{first.operation} {first.shape} {first.dtype}"
        if first.operation == "policy_loss":
            lines += _policy_verdicts(block, tag)
            continue
        ours = _find(block, TRITON)
        if ours is not None:
            lines += _hidden_verdicts(block, ours, tag)
    return lines
