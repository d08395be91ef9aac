"""The policy loss as one formula: eager and compiled, against verl's eager loss, same process.

Usage (from the repository root; verl 0.9.1 installed: ``requirements/peers-nodeps.txt``)::

    python benchmarks/bench_formula.py                  # B=64 T=4096 and B=8 T=16384, fp32
    python benchmarks/bench_formula.py --quick          # one small shape, a smoke run
    python benchmarks/bench_formula.py --surrogates     # issue 35's surrogates against Clip()

Forward + backward with respect to ``log_probs``, CPU, ``--threads`` threads (default 1),
process CPU time, the variants interleaved round by round (``harness.time_case``), medians.
Variants:

- ``verl``: verl 0.9.1's own ``compute_policy_loss_vanilla`` (its default config: clip 0.2, the
  dual clip c = 3 always on, token-mean, three metrics read on the host), advantages ``(B, T)``;
- ``eager (verl options)`` / ``compiled (verl options)``: ``policy_loss(...,
  surrogate=Clip(low=0.2, dual=3.0))`` with ``RLOBJECTIVES_COMPILE`` unset / ``=1``, the ten
  diagnostics included (a dict of tensors, nothing read on the host);
- ``eager Clip()`` / ``compiled Clip()``: the default surrogate;
- ``eager tanh (user's)``: ``tests/custom_surrogate.py``'s ``TanhSurrogate``, written outside
  the library;
- ``naive``: the trainer-style eager loss of ``tests/eager_reference.py`` (mask multiplication,
  no diagnostics).

``--surrogates``: ``Clip()`` (the ratio's reference) and issue 35's ``ProbabilityBand()``,
``TOPR(rewards)``, ``REAL()`` (``group_size=8``) and ``FIPO(gamma=2 ** (-1 / 32), cap=0.2)``,
each eager and compiled, with ``CISPO()`` and ``DPPO()`` for context (the library's
``sg(w) A l`` and float64 trust region), B=64 T=4096 by default; results in
``benchmarks/results/surrogates35-<threads>thread.csv``. ``--token-advantages``: advantages
``(B, T)`` (each token its sequence's value, contiguous) in place of ``(B, 1)``; the file's stem
gains ``-token-advantages``.

Also printed: the bytes autograd keeps for backward (``saved_tensors_hooks``) per variant, in
``(B, T)`` float32 tensors. Results: ``benchmarks/results/policy-formula-<threads>.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import eager_reference  # noqa: E402
import harness  # noqa: E402
import rlobjectives as rlo  # noqa: E402
from custom_surrogate import TanhSurrogate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VERL_CLIP = rlo.Clip(low=0.2, dual=3.0)


class _VerlConfig:
    """The fields of verl's ``ActorConfig`` that ``compute_policy_loss_vanilla`` reads."""

    clip_ratio, clip_ratio_low, clip_ratio_high = 0.2, 0.2, 0.2
    global_batch_info: dict[str, Any] = {}

    def get(self, key: str, default: Any) -> Any:
        return {"clip_ratio_c": 3.0}.get(key, default)


def _inputs(
    batch: int, tokens: int, per_token: bool = False
) -> Callable[[torch.device], dict[str, torch.Tensor]]:
    def make(device: torch.device) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        old = -torch.rand(batch, tokens, generator=generator) * 3
        log_probs = old + 0.3 * torch.randn(batch, tokens, generator=generator)
        lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=generator)
        mask = torch.arange(tokens).unsqueeze(0) < lengths  # prefix masks, ~70% selected
        advantages = torch.randn(batch, 1, generator=generator)
        rewards = (advantages.squeeze(-1) > 0).float()  # TOPR: the sign of the reward
        token_advantages = advantages.expand(batch, tokens).contiguous()
        return {
            "rewards": rewards.to(device),
            "log_probs": log_probs.to(device),
            "old_log_probs": old.to(device),
            "advantages": (token_advantages if per_token else advantages).to(device),
            "token_advantages": token_advantages.to(device),
            "mask": mask.to(device),
        }

    return make


def _ours(
    surrogate: Any, compiled: bool, **options: Any
) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        if compiled:
            os.environ["RLOBJECTIVES_COMPILE"] = "1"
        try:
            objective = surrogate(x) if callable(surrogate) else surrogate  # TOPR: the batch's
            out = rlo.policy_loss(
                x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"],
                surrogate=objective, **options,
            )  # fmt: skip
        finally:
            os.environ.pop("RLOBJECTIVES_COMPILE", None)
        return out.loss

    return run


def _verl(x: dict[str, torch.Tensor]) -> torch.Tensor:
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    loss, _ = compute_policy_loss_vanilla(
        x["old_log_probs"], x["log_probs"], x["token_advantages"], x["mask"],
        config=_VerlConfig(),  # type: ignore[arg-type]
    )  # fmt: skip
    return loss


def _naive(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return eager_reference.policy_loss(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"]
    )


VARIANTS: list[tuple[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]] = [
    ("verl", _verl),
    ("eager (verl options)", _ours(VERL_CLIP, False)),
    ("compiled (verl options)", _ours(VERL_CLIP, True)),
    ("eager Clip()", _ours(rlo.Clip(), False)),
    ("compiled Clip()", _ours(rlo.Clip(), True)),
    ("eager tanh (user's)", _ours(TanhSurrogate(), False)),
    ("naive", _naive),
]


def _topr(x: dict[str, torch.Tensor]) -> rlo.TOPR:
    return rlo.TOPR(x["rewards"])


FIPO = rlo.FIPO(gamma=2 ** (-1 / 32), cap=0.2)  # ms-swift's defaults (without its safety)
SURROGATE_VARIANTS: list[tuple[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]] = [
    (f"{mode} {name}", _ours(surrogate, mode == "compiled", **options))
    for name, surrogate, options in (
        ("Clip()", rlo.Clip(), {}),
        ("ProbabilityBand()", rlo.ProbabilityBand(), {}),
        ("TOPR(rewards)", _topr, {}),
        ("REAL()", rlo.REAL(), {"group_size": 8}),
        ("FIPO(gamma, cap)", FIPO, {}),
        ("CISPO() (context)", rlo.CISPO(), {}),  # the library's sg(w) A l, as TOPR
        ("DPPO() (context)", rlo.DPPO(), {}),  # the float64 trust region, as ProbabilityBand
    )
    for mode in ("eager", "compiled")
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shape", type=int, nargs=2, action="append", help="B T (repeatable)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--surrogates", action="store_true", help="issue 35's, against Clip()")
    parser.add_argument(
        "--token-advantages", action="store_true", help="advantages (B, T), not (B, 1)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [(8, 512)] if args.quick else [(64, 4096), (8, 16384)]
    if args.surrogates and not args.quick:
        shapes = [(64, 4096)]
    chosen = SURROGATE_VARIANTS if args.surrogates else VARIANTS
    reference = "eager Clip()" if args.surrogates else "verl"
    shapes = [tuple(shape) for shape in args.shape] if args.shape else shapes
    device = torch.device("cpu")
    machine = harness.machine_line("cpu") + " | clock: process CPU time"
    print(machine)
    rows = []
    for batch, tokens in shapes:
        variants = tuple(
            harness.Variant(name, fn, role="reference" if name == reference else "candidate")
            for name, fn in chosen
        )
        case = harness.Case(
            "policy_loss", f"B={batch} T={tokens}", torch.float32,
            _inputs(batch, tokens, args.token_advantages),
            ("log_probs",), variants,
        )  # fmt: skip
        timings = harness.time_case(
            case, device, warmup=args.warmup, repeats=args.repeats, clock="process"
        )
        base = timings[reference][0].median_ms
        for variant in variants:
            median = timings[variant.key][0].median_ms
            saved = harness.saved_for_backward_mib(case, variant, device)
            tensors = None if saved is None else saved * 2**20 / (batch * tokens * 4)
            if args.surrogates:  # against Clip() in the same mode (eager / compiled)
                mode = variant.name.split()[0]
                ratio = {"this / Clip()": round(median / timings[f"{mode} Clip()"][0].median_ms, 3)}
            else:
                ratio = {"verl / this": round(base / median, 2)}
            row = {
                "shape": f"B={batch} T={tokens}",
                "variant": variant.name,
                "fwd+bwd ms": round(median, 3),
                **ratio,
                "saved MiB": None if saved is None else round(saved, 2),
                "saved (B,T) fp32": None if tensors is None else round(tensors, 2),
            }
            rows.append(row)
            print(row, flush=True)
    if not args.quick and not args.shape:
        RESULTS.mkdir(exist_ok=True)
        stem = "surrogates35" if args.surrogates else "policy-formula"
        stem += "-token-advantages" if args.token_advantages else ""
        path = RESULTS / f"{stem}-{args.threads}thread.csv"
        with path.open("w", newline="") as handle:
            handle.write(f"# {machine}\n")
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
