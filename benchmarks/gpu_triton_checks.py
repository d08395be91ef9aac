"""Correctness checks of ``gpu_triton.py``: the Triton LM head and the policy loss's decisions.

Each check is ``check(device) -> list[(name, ok, detail)]``. Errors are measured relative to the
largest magnitude of the expected tensor (``max |got - want| / max |want|``), against a bound per
dtype: float32 math everywhere (approximate ``exp`` on the GPU, float32 ``tl.dot`` in IEEE mode)
and, for bf16 gradients, the rounding of ``dL/dz`` and of the result to bf16 (as autograd rounds).

- :func:`check_lm_head`: the launchers of ``rlobjectives.kernels`` (``lm_head_forward``,
  ``lm_head_backward``) against float64 autograd of ``log_softmax`` (``tests/triton_reference.py``
  and ``tests/reference.py``'s ``transformed_logits``): log-probs, entropy, the gradients to
  hidden / weight / bias, one and several vocabulary splits and ``dZ`` chunks, ``-inf`` bias
  entries, NaN in masked rows (their gradient exactly 0), and, where the kernels take
  ``LogitOptions``, the logit scale, the softcap, one temperature per row and the product rounded
  to bf16 (``fp32_head=False``).
- :func:`check_boundary_decisions`: ``tests/boundary_cases.py``'s sweep of log-ratios at and one
  ulp around every clip bound through the public ``policy_loss`` on the device (eager, and with
  ``RLOBJECTIVES_COMPILE=1`` for one case): exactly the rule's counts and gradient factors
  (``docs/conventions.md``, "Decisions at a bound"), and DPPO's exact kept tokens.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import boundary_cases
import reference
import triton_reference
from rlobjectives import DPPO, policy_loss
from rlobjectives.kernels.head_backward import lm_head_backward
from rlobjectives.kernels.head_forward import lm_head_forward

try:  # the head's logit transform (scale, softcap, per-row temperature, rounded product)
    from rlobjectives.kernels.head_forward import LogitOptions
except ImportError:  # a version without it: those checks are skipped
    LogitOptions = None  # type: ignore[assignment, misc]

Result = tuple[str, bool | None, str]  # (name, passed, detail); None: skipped, not failed
VALUE_BOUND = 2e-5  # float32 math on the (rounded) inputs
GRAD_BOUND = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # bf16: dL/dz and the result rounded
COMPILE_VARIABLE = "RLOBJECTIVES_COMPILE"
NOT_READ = "does not read"


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


@contextlib.contextmanager
def compiling(on: bool = True) -> Iterator[None]:
    """``RLOBJECTIVES_COMPILE=1`` inside the block (restored after it); nothing if not ``on``."""
    previous = os.environ.get(COMPILE_VARIABLE)
    if on:
        os.environ[COMPILE_VARIABLE] = "1"
    try:
        yield
    finally:
        if on and previous is None:
            os.environ.pop(COMPILE_VARIABLE, None)
        elif on and previous is not None:
            os.environ[COMPILE_VARIABLE] = previous


@functools.cache
def compile_unavailable(device_type: str) -> str | None:
    """None when ``RLOBJECTIVES_COMPILE=1`` compiles ``policy_loss`` on the device, else why not.

    One tiny float32 call (the default surrogate: the graph the checks and timings reuse): a new
    Dynamo graph must appear and no fallback warning may be raised.
    """
    from torch._dynamo.utils import counters

    device = torch.device(device_type)
    log_probs = torch.zeros(3, 17, device=device, requires_grad=True)
    mask = torch.ones(3, 17, dtype=torch.bool, device=device)
    before = counters["stats"]["unique_graphs"]
    with compiling(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        advantages = torch.ones(3, device=device)
        out = policy_loss(log_probs, torch.zeros_like(log_probs), advantages, mask)
        out.loss.backward()
    fallback = [str(w.message) for w in caught if COMPILE_VARIABLE in str(w.message)]
    if fallback:
        return f"torch.compile fell back to eager: {fallback[0][:200]}"
    if counters["stats"]["unique_graphs"] == before:
        return f"this version's policy_loss {NOT_READ} {COMPILE_VARIABLE} (no graph compiled)"
    return None


def compile_skip(device: torch.device, what: str) -> Result | None:
    """None when compiled checks can run; else a line: skipped if the library ignores the
    variable (a version without it), a failure if ``torch.compile`` fell back to eager."""
    reason = compile_unavailable(device.type)
    if reason is None:
        return None
    return (f"{what}: not run ({reason})", None if NOT_READ in reason else False, "")


# ------------------------------------------------------------------------------------ LM head
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
        "temperature": 0.5 + torch.rand(rows, generator=g),  # one per row (transform cases)
        "upstream": torch.randn(2, rows, generator=g, dtype=torch.float64),
    }


# (label, logit_scale, softcap, per-row temperature, round the product) of the transform cases
TRANSFORMS: tuple[tuple[str, float, float | None, bool, bool], ...] = (
    ("plain T=0.8", 1.0, None, False, False),
    ("scale 1.5 + softcap 3 + per-row T", 1.5, 3.0, True, False),
    ("scale 1.5 + softcap 3 + per-row T + rounded product", 1.5, 3.0, True, True),
)


def _expected(
    data: dict[str, torch.Tensor], transform: tuple[str, float, float | None, bool, bool]
) -> dict[str, torch.Tensor]:
    """Float64 log-probs, entropy and gradients of the upstream-weighted sum."""
    _, scale, softcap, per_row, rounded = transform
    mask = data["mask"]
    leaves = {k: data[k].double().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    temperature = 1.0 / data["temperature"].float().reciprocal().double()  # the kernels' 1/T
    if scale == 1.0 and softcap is None and not rounded:
        log_probs, entropy = triton_reference.head_log_probs(
            leaves["hidden"], leaves["weight"], data["tokens"], mask, bias=leaves["bias"],
            temperature=0.8,
        )  # fmt: skip
    else:
        hidden = torch.where(mask[:, None], leaves["hidden"], 0.0)
        logits = hidden @ leaves["weight"].T + leaves["bias"]
        if rounded:  # the product in the input dtype, as the model's own hidden @ weight.T
            error = (logits.to(data["hidden"].dtype).double() - logits).detach()
            logits = logits + torch.where(logits.isfinite(), error, 0.0)
        x = reference.transformed_logits(
            logits, temperature=temperature if per_row else 0.8, logit_scale=scale,
            final_logit_softcapping=softcap,
        )  # fmt: skip
        log_p = torch.log_softmax(x, dim=-1)
        p_log_p = torch.where(log_p.exp() > 0, log_p.exp() * log_p, 0.0)
        chosen = log_p.gather(1, torch.where(mask, data["tokens"], 0)[:, None])[:, 0]
        log_probs = torch.where(mask, chosen, 0.0)
        entropy = torch.where(mask, -p_log_p.sum(-1), 0.0)
    upstream = data["upstream"]
    ((log_probs * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    grads = {f"grad {k}": leaf.grad for k, leaf in leaves.items() if leaf.grad is not None}
    return {"log_probs": log_probs, "entropy": entropy, **grads}


def _launch(
    data: dict[str, torch.Tensor],
    device: torch.device,
    transform: tuple[str, float, float | None, bool, bool],
    splits: int | None,
    chunk_bytes: int | None,
) -> dict[str, torch.Tensor]:
    """The launchers on ``device``: forward, then the backward of the upstream-weighted sum."""
    _, scale, softcap, per_row, rounded = transform
    on = {k: v.to(device) for k, v in data.items()}
    extra: dict[str, Any] = {"temperature": 0.8}
    if LogitOptions is not None and transform is not TRANSFORMS[0]:
        inverse = on["temperature"].float().reciprocal() if per_row else None
        extra["options"] = LogitOptions(scale, softcap, inverse, rounded)
    head = (on["hidden"], on["weight"], on["tokens"], on["mask"])
    out = lm_head_forward(*head, bias=on["bias"], with_entropy=True, splits=splits, **extra)
    assert out.entropy is not None
    upstream = on["upstream"].float()
    grads = lm_head_backward(
        *head, out.lse, upstream[0], bias=on["bias"], entropy=out.entropy,
        grad_entropy=upstream[1], need_bias=True, chunk_bytes=chunk_bytes, **extra,
    )  # fmt: skip
    return {"log_probs": out.log_probs, "entropy": out.entropy, "grad hidden": grads.hidden,
            "grad weight": grads.weight, "grad bias": grads.bias}  # fmt: skip


def check_lm_head(device: torch.device, dry: bool = False) -> list[Result]:
    """The launchers against float64 autograd (see the module docstring)."""
    shape = (13, 40, 37) if dry else (300, 232, 5003)  # H: not a multiple of the tile
    small_chunk = shape[0] * 2 * (16 if dry else 1024)  # a few vocabulary chunks of dZ
    transforms = TRANSFORMS if LogitOptions is not None else TRANSFORMS[:1]
    results: list[Result] = []
    if LogitOptions is None:
        results.append(("lm head transforms: not in this version (no LogitOptions)", None, ""))
    for dtype in (torch.float32, torch.bfloat16):
        data = _head(shape, dtype, seed=11)
        for transform in transforms:
            rounded = transform[4]
            if rounded and dtype == torch.float32:
                continue  # rounding a float32 product to float32 changes nothing
            want = _expected(data, transform)
            layouts = [(None, None), (3, small_chunk)] if transform[0] != "plain T=0.8" else [
                (None, None), (1, None), (3, small_chunk)]  # fmt: skip
            for splits, chunk_bytes in layouts:
                got = _launch(data, device, transform, splits, chunk_bytes)
                tag = (f"lm head {str(dtype)[6:]} {transform[0]} splits={splits or 'auto'} "
                       f"chunks={'one' if chunk_bytes is None else 'several'}")  # fmt: skip
                value_bound = GRAD_BOUND[torch.bfloat16] if rounded else VALUE_BOUND
                for name, expected in want.items():
                    bound = GRAD_BOUND[dtype] if name.startswith("grad") else value_bound
                    results.append(compare(f"{tag} {name}", got[name], expected, bound))
                masked = got["grad hidden"][~data["mask"].to(device)]
                zero = bool((masked == 0).all())
                results.append((f"{tag} masked NaN rows: zero grad hidden", zero, ""))
    return results


# ------------------------------------------------------------------------ decisions at a bound
def check_boundary_decisions(device: torch.device, dry: bool = False) -> list[Result]:
    """The rule's decisions at every bound through ``policy_loss`` on the device."""
    del dry  # the sweep is small on every device
    results: list[Result] = []
    for dtype in (torch.float32, torch.bfloat16):
        for case, surrogate in boundary_cases.CASES.items():
            results.append(_boundary_case(device, dtype, case, surrogate, compiled=False))
        for divergence in ("tv", "kl"):  # DPPO: float64 evaluation, the exact decision
            results.append(_dppo_case(device, dtype, DPPO(divergence)))
    skip = compile_skip(device, "boundary compiled")
    if skip is None:
        dual = boundary_cases.CASES["dual"]
        results.append(_boundary_case(device, torch.float32, "dual", dual, compiled=True))
    else:
        results.append(skip)
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
    verdict = "ok" if same else "differ"
    detail = f"outside {outside} (exact {kept.count(False)}), kept tokens {verdict}"
    return (f"boundary dppo_{surrogate.divergence} {str(dtype)[6:]}", ok, detail)


def _boundary_case(
    device: torch.device, dtype: torch.dtype, case: str, surrogate: Any, *, compiled: bool
) -> Result:
    points = boundary_cases.sweep_points(surrogate, dtype)
    log_probs, old, advantages, mask = boundary_cases.boundary_batch(points, dtype)
    leaf = log_probs.to(device).requires_grad_(True)
    with compiling(compiled):
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
    mode = "compiled" if compiled else "eager"
    return (f"boundary {case} {str(dtype)[6:]} {mode}", ok, detail)


def correctness_checks(dry: bool) -> list[Callable[[torch.device], list[Result]]]:
    """The checks of this module in order (LM head, decisions at a bound), dry-run shapes."""

    def bind(check: Callable[..., list[Result]]) -> Callable[[torch.device], list[Result]]:
        def bound(device: torch.device) -> list[Result]:
            return check(device, dry)

        bound.__name__ = check.__name__
        return bound

    return [bind(check) for check in (check_lm_head, check_boundary_decisions)]
