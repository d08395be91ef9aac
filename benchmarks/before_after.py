"""``policy_loss`` of another version of the library against this one, in the same run.

Usage (from the repository root; the baseline is the ``src/rlobjectives`` of another checkout,
e.g. ``git worktree add /tmp/main main``)::

    python benchmarks/before_after.py --baseline /tmp/main/src/rlobjectives \\
        --threads 1 --clock process --keep-memory --output cpu-policy-before-after

The baseline package is copied under another name (``rlobjectives_baseline``: the library's
imports are relative) and imported next to this one, so both run in one process and the
interleaved rounds of ``harness`` see the same machine state. Cases: ``bench_policy``'s (not
the B=8 T=16384 bfloat16 one); variants: the eager reference, verl's eager
``compute_policy_loss_vanilla``, ours and the baseline with the default options and with verl's
(``Clip(low=0.2, dual=3.0)``; a baseline before 0.3 is called with ``clip_low=0.2,
dual_clip=3.0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the eager references

import bench_policy  # noqa: E402
import harness  # noqa: E402

Inputs = harness.Inputs
KEPT = (
    "eager reference",
    "verl compute_policy_loss_vanilla (eager)",
    "ours",
    "ours, verl's options (Clip(dual=3.0))",
)


def _load_baseline(source: Path) -> ModuleType:
    directory = Path(tempfile.mkdtemp(prefix="rlobjectives-baseline-"))
    shutil.copytree(source, directory / "rlobjectives_baseline")
    sys.path.insert(0, str(directory))
    return importlib.import_module("rlobjectives_baseline")


def _baseline_variants(baseline: ModuleType) -> list[harness.Variant]:
    def default(x: Inputs) -> torch.Tensor:
        return baseline.policy_loss(  # type: ignore[no-any-return]
            x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"]
        ).loss

    verl: dict[str, Any] = {"clip_low": 0.2, "dual_clip": 3.0}
    if hasattr(baseline, "Clip"):
        verl = {"surrogate": baseline.Clip(low=0.2, dual=3.0)}

    def verl_options(x: Inputs) -> torch.Tensor:
        return baseline.policy_loss(  # type: ignore[no-any-return]
            x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"], **verl
        ).loss

    return [
        harness.Variant("baseline", default),
        harness.Variant("baseline, verl's options", verl_options),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another src/rlobjectives")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "process"), default="process")
    parser.add_argument("--keep-memory", action="store_true")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--output", default="", help="results file stem under results/")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    baseline = _load_baseline(args.baseline)
    cases = []
    for case in bench_policy.cases(quick=False, device="cpu"):
        if case.shape == "B=8 T=16384" and case.dtype == torch.bfloat16:
            continue
        variants = [v for v in case.variants if v.name in KEPT and not v.compile]
        cases.append(dataclasses.replace(case, variants=(*variants, *_baseline_variants(baseline))))
    machine = harness.machine_line("cpu")
    if args.clock == "process":
        machine += " | clock: process CPU time"
    if args.keep_memory:
        kept = harness.keep_memory_mapped()
        machine += " | malloc: freed memory kept mapped" if kept else " | malloc: default"
    print(machine, flush=True)
    rows = harness.run_cases(
        "bench_policy", cases, device="cpu", quick=False, warmup=5, repeats=args.repeats,
        threads=args.threads, memory=False, clock=args.clock, echo=print,
    )  # fmt: skip
    harness.print_table(rows, machine)
    if args.output:
        csv_path, _ = harness.write_results(rows, machine, args.output)
        print(f"wrote {csv_path.relative_to(harness.REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
