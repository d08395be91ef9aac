"""Run the benchmark suite: every ``benchmarks/bench_*.py`` module, one table.

Usage (from the repository root)::

    python benchmarks/run.py                      # everything, CPU, 2 threads
    python benchmarks/run.py --quick              # small shapes, few repeats (about a minute)
    python benchmarks/run.py --only policy        # modules/operations whose name has "policy"
    python benchmarks/run.py --device cuda        # on a GPU (CUDA events, max_memory_allocated)
    python benchmarks/run.py --no-memory          # skip the fresh-process memory measurements
    python benchmarks/run.py --threads 1 --clock process --keep-memory   # shared CPU machine

Results go to ``benchmarks/results/<device>[-quick].csv`` and ``.json`` (``--output STEM`` to
rename, ``--output ''`` to skip). See ``benchmarks/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def discover() -> list[str]:
    return sorted(path.stem for path in harness.BENCH_DIR.glob("bench_*.py"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run modules or operations whose name contains NAME (repeatable)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per variant")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory processes")
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="CPU timer: wall clock, or process CPU time (for shared machines)",
    )
    parser.add_argument(
        "--keep-memory",
        action="store_true",
        help="CPU (glibc): keep freed memory mapped, so page faults do not enter the times",
    )
    parser.add_argument("--output", default=None, help="results file stem under results/")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    repeats = args.repeats if args.repeats is not None else (7 if args.quick else 25)
    machine = harness.machine_line(args.device)
    if args.device == "cpu" and args.clock == "process":
        machine += " | clock: process CPU time"
    if args.device == "cpu" and args.keep_memory:
        kept = harness.keep_memory_mapped()
        machine += " | malloc: freed memory kept mapped" if kept else " | malloc: default"
    print(machine, flush=True)

    rows: list[harness.Row] = []
    for module in discover():
        cases = harness.load_cases(module, quick=args.quick, device=args.device)
        selected = [
            index
            for index, case in enumerate(cases)
            if not args.only or any(name in module or name in case.operation for name in args.only)
        ]
        if not selected:
            continue
        print(f"{module}: {len(selected)} case(s)", flush=True)
        rows += harness.run_cases(
            module,
            cases,
            device=args.device,
            quick=args.quick,
            warmup=warmup,
            repeats=repeats,
            threads=args.threads,
            memory=not args.no_memory,
            clock=args.clock,
            only=selected,
            echo=lambda line: print(line, flush=True),
        )
    print()
    harness.print_table(rows, machine)
    stem = (
        args.output if args.output is not None else args.device + ("-quick" if args.quick else "")
    )
    if stem:
        csv_path, json_path = harness.write_results(rows, machine, stem)
        print(f"\nwrote {csv_path.relative_to(harness.REPO_ROOT)} and {json_path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
