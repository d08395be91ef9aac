"""GPU correctness check: every public objective on CUDA equals its float64 reference on the CPU.

Run on a machine with a GPU: ``python benchmarks/gpu_check.py`` (exit status 0 when every check
passes; ``--cpu`` runs the same checks on the CPU, a dry run of the script). The test suite
covers the same functions on the CPU; this script checks that the CUDA path (device placement,
the default backend of the LM head, ``torch.compile(policy_loss, fullgraph=True)``, bf16 inputs)
gives the same numbers. It prints one line per check and writes nothing. The longer GPU run
(the Triton LM head, ``RLOBJECTIVES_COMPILE=1``, timings) is ``benchmarks/gpu_triton.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import reference  # noqa: E402
import rlobjectives as rlo  # noqa: E402

FAILURES: list[str] = []
DEVICE = torch.device("cuda")


def check(
    name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> None:
    """Compare a CUDA result with a CPU float64 reference and record the outcome."""
    try:
        assert actual.device.type == DEVICE.type, f"result on {actual.device}"
        torch.testing.assert_close(
            actual.detach().double().cpu(), expected.detach().double().cpu(), rtol=rtol, atol=atol
        )
        error = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().max()
        print(f"ok    {name:58s} max abs error {float(error) if error.numel() else 0.0:.2e}")
    except AssertionError as failure:
        FAILURES.append(name)
        print(f"FAIL  {name}: {str(failure).splitlines()[0]}")


def batch(b: int, t: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    new = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    new = torch.where(mask, new, torch.nan)  # poison the padding: must not matter
    return new.to(dtype), old.to(dtype), advantages.to(dtype), mask


def policy_checks(dtype: torch.dtype, compiled: bool) -> None:
    new, old, advantages, mask = batch(16, 257, dtype)
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 8e-3)}[dtype]
    fn: Callable[..., rlo.PolicyLossOutput] = rlo.policy_loss
    if compiled:
        fn = torch.compile(rlo.policy_loss, fullgraph=True)  # type: ignore[assignment]
    tag = f"{'compiled ' if compiled else ''}{str(dtype)[6:]}"
    for options in (
        dict(),
        dict(surrogate=rlo.Clip(low=0.2, high=0.28, dual=3.0)),
        dict(ratio_level="sequence", reduction="sequence_mean"),
        dict(reduction="sequence_sum_normalized", max_response_length=300),
    ):
        x = new.to(DEVICE).detach().clone().requires_grad_(True)
        out = fn(x, old.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), **options)
        out.loss.backward()
        x_ref = new.detach().double().clone().requires_grad_(True)
        expected = reference.policy_loss(x_ref, old.double(), advantages.double(), mask, **options)
        expected.backward()
        label = ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"
        check(f"policy_loss {tag} [{label}] loss", out.loss, expected, *tol)
        assert x.grad is not None and x_ref.grad is not None
        grad_ref = torch.where(mask, x_ref.grad, 0.0)
        check(f"policy_loss {tag} [{label}] grad", x.grad, grad_ref, tol[0], tol[1] * 1e-2)


def seed_checks() -> None:
    new, old, advantages, mask = batch(7, 33, torch.float32, seed=1)
    out = rlo.grpo_clipped_surrogate(
        new.to(DEVICE), old.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), 0.2
    )
    expected = reference.grpo_clipped_surrogate(
        new.double(), old.double(), advantages.double(), mask, 0.2
    )
    for key in out:
        check(f"grpo_clipped_surrogate {key}", out[key], expected[key], 1e-5, 1e-6)
    ref_lp = old
    rewards = advantages
    kl = rlo.kl_penalized_rewards(
        new.to(DEVICE), ref_lp.to(DEVICE), rewards.to(DEVICE), mask.to(DEVICE), 0.1
    )
    kl_expected = reference.kl_penalized_rewards(
        new.double(), ref_lp.double(), rewards.double(), mask, 0.1
    )
    for key in kl:
        assert kl[key].dtype == torch.float32
        check(f"kl_penalized_rewards {key}", kl[key], kl_expected[key], 1e-5, 1e-5)


def logprob_checks() -> None:
    g = torch.Generator().manual_seed(2)
    n, h, v = 300, 64, 5003
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5
    tokens = torch.randint(0, v, (n,), generator=g)
    logits = hidden @ weight.T
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    for dtype, tol in ((torch.float32, (1e-5, 1e-5)), (torch.bfloat16, (2e-2, 3e-2))):
        ours = rlo.token_log_probs(logits.to(dtype).to(DEVICE), tokens.to(DEVICE))
        check(f"token_log_probs {str(dtype)[6:]}", ours, expected, *tol)
        hidden_d = hidden.to(dtype).to(DEVICE).detach().clone().requires_grad_(True)
        weight_d = weight.to(dtype).to(DEVICE).detach().clone().requires_grad_(True)
        ours = rlo.token_log_probs_from_hidden(
            hidden_d[None], weight_d, tokens.to(DEVICE)[None], chunk_size=97
        )
        log_probs = (ours if isinstance(ours, torch.Tensor) else ours.log_probs)[0]
        check(f"token_log_probs_from_hidden {str(dtype)[6:]}", log_probs, expected, *tol)
        log_probs.sum().backward()
        hidden_r = hidden.clone().requires_grad_(True)
        torch.log_softmax(hidden_r @ weight.T, -1).gather(-1, tokens[:, None]).sum().backward()
        assert hidden_d.grad is not None and hidden_r.grad is not None
        check(
            f"token_log_probs_from_hidden {str(dtype)[6:]} grad_hidden",
            hidden_d.grad,
            hidden_r.grad,
            tol[0],
            tol[1] * 10,
        )
    ref_logits = logits + 0.1 * torch.randn(n, v, generator=g, dtype=torch.float64)
    p = torch.log_softmax(logits, -1)
    q = torch.log_softmax(ref_logits, -1)
    kl_expected = (p.exp() * (p - q)).sum(-1)
    kl = rlo.full_vocab_kl(logits.float().to(DEVICE), ref_logits.float().to(DEVICE))
    check("full_vocab_kl float32", kl, kl_expected, 1e-4, 1e-6)


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU (dry run)")
    args = parser.parse_args(argv)
    if args.cpu:  # a dry run of the script itself on a machine without a GPU
        DEVICE = torch.device("cpu")
        policy_checks(torch.float32, compiled=False)
        seed_checks()
        logprob_checks()
        print(f"{len(FAILURES)} failed" if FAILURES else "all checks passed (cpu dry run)")
        return 1 if FAILURES else 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    seed_checks()
    for dtype in (torch.float32, torch.bfloat16):
        policy_checks(dtype, compiled=False)
    policy_checks(torch.float32, compiled=True)
    logprob_checks()
    print(f"{len(FAILURES)} failed" if FAILURES else "all GPU checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
