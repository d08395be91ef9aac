"""One GPU run of the Triton kernels: correctness first, then timings, under a hard time limit.

Usage (from the repository root, with the package and triton installed)::

    python benchmarks/gpu_triton.py                  # default limit 480 s, writes the results
    python benchmarks/gpu_triton.py --time-limit 300 --skip-peers
    python benchmarks/gpu_triton.py --dry-run        # tiny shapes on CPU (Triton interpreter)

Sections, in order (each checks the remaining time first; the results files are rewritten after
every section, so a run cut short still leaves what it measured):

1. **correctness**: every kernel on CUDA against the float64 references of the test suite
   (``tests/triton_reference.py``), float32 and bfloat16 inputs: token policy loss (GRPO, DAPO
   with dual clip and delta, CISPO, SAPO, importance weights + KL + entropy), ``kl_loss``
   estimators, ``kl_penalized_rewards``, LM-head log-probs/entropy and gradients (one and several
   vocabulary chunks, ``-inf`` bias, NaN in masked rows), the fused policy loss from hidden;
   the decisions at every clip bound (``tests/boundary_cases.py``'s sweep at and one ulp around
   each bound, and the specification's ratios on the edges: exactly the rule's counts and
   gradient factors, whatever the GPU's approximate ``exp`` returns);
   then every public function with kernels under ``RLOBJECTIVES_KERNELS=triton`` on CUDA
   against the same call under ``RLOBJECTIVES_KERNELS=torch`` in float64 on the CPU
   (``gpu_triton_public.py``: values, gradients, diagnostics; padded and packed).
2. **token losses** (issue 17 targets), bf16 and fp32, B=64 T=4096 and B=8 T=16384: fwd+bwd of
   the public ``policy_loss`` / ``kl_loss`` / ``kl_penalized_rewards`` with
   ``RLOBJECTIVES_KERNELS=triton`` and ``=torch``, the naive eager reference
   (``tests/eager_reference.py``), the copy floor, and ``torch.compile`` of the reference
   (compiled last: compilation dominates this script's budget).
3. **hidden-state path**, bf16, N=16384 H=4096 V=152064 and N=8192 H=4096 V=128256: time and
   peak memory beyond inputs and gradients of the public ``fused_policy_loss_from_hidden`` with
   ``RLOBJECTIVES_KERNELS=triton`` and ``=torch``, Cut Cross-Entropy's
   ``linear_cross_entropy``, Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (both pip-installed with
   ``--no-deps`` when missing; skipped with the reason recorded when that fails, e.g. no
   network), and the three-GEMM floor.

Outputs: ``benchmarks/results/cuda-triton.csv`` (timing rows, harness format; ``peak_mib`` is the
memory beyond inputs and gradients for the hidden-state rows) and ``cuda-triton.txt`` (machine
line: GPU, driver, CUDA, torch and triton versions; correctness lines; tables; target verdicts).
Exit status: 0 when every correctness check passed, 1 otherwise, 3 when the time limit cut the
run (results so far are written).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
for _path in (BENCH_DIR, BENCH_DIR.parent / "tests"):
    sys.path.insert(0, str(_path))

import gpu_triton_cases as cases  # noqa: E402
import gpu_triton_checks as checks  # noqa: E402
import gpu_triton_public as public  # noqa: E402
import harness  # noqa: E402

STEM = "cuda-triton"


class TimeLimit(Exception):
    """Raised by the SIGALRM handler when the hard time limit is reached."""


@dataclasses.dataclass
class Run:
    """State of one run: deadline, results so far, text report lines."""

    deadline: float
    device: torch.device
    dry_run: bool
    blocks: list[list[harness.Row]] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    machine: str = ""

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeLimit


def machine_line(device: torch.device) -> str:
    """GPU name, driver, CUDA, torch and triton versions (CPU line for a dry run)."""
    import triton

    parts = [harness.machine_line(device.type), f"triton {triton.__version__}"]
    if device.type == "cuda":
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip().splitlines()[0]  # fmt: skip
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = "unknown"
        properties = torch.cuda.get_device_properties(device)
        parts.insert(1, f"driver {driver}, {properties.multi_processor_count} SMs, "
                        f"{properties.total_memory / 2**30:.0f} GiB")  # fmt: skip
    return " | ".join(parts)


def ensure_peer(module: str, package: str, entry: str, run: Run) -> str | None:
    """Import ``entry``, pip-installing ``package`` (no deps) if needed; None or the reason."""
    reason = _install(module, package, run)
    if reason is not None:
        return reason
    try:
        importlib.import_module(entry)
    except Exception as error:  # noqa: BLE001 - any import failure skips the peer's rows
        return f"import {entry} failed: {error!r}"[:300]
    return None


WHEELS = BENCH_DIR.parent / ".whl"  # carried wheels (a machine without network), if any


def _install(module: str, package: str, run: Run) -> str | None:
    """Install ``package`` without dependencies: from ``.whl/`` if present, else the index."""
    if importlib.util.find_spec(module) is not None:
        return None
    if run.dry_run:
        return "dry run: peers not installed"
    budget = min(90.0, max(run.remaining() - 240.0, 0.0))
    if budget < 15:
        return "not installed (no time left to install)"
    base = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--disable-pip-version-check",
    ]
    sources = [["--retries", "0", "--timeout", "10", package]]
    if WHEELS.is_dir():
        sources.insert(0, ["--no-index", "--find-links", str(WHEELS), package])
    reasons = []
    for source in sources:
        try:
            result = subprocess.run(base + source, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            reasons.append(f"timed out after {budget:.0f} s")
            continue
        importlib.invalidate_caches()
        if result.returncode == 0 and importlib.util.find_spec(module) is not None:
            return None
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
        reasons.append(tail[0][:160])
    return f"pip install {package} failed (no network, no .whl/?): {'; '.join(reasons)}"


def section_correctness(run: Run) -> None:
    run.say("== correctness (CUDA vs float64 references)")
    for check in [*checks.correctness_checks(run.dry_run), public.public_check(run.dry_run)]:
        if run.remaining() < 30:
            run.say("SKIP  remaining correctness checks: time limit")
            run.failures.append("correctness incomplete")
            return
        try:
            for name, ok, detail in check(run.device):
                run.say(f"{'ok  ' if ok else 'FAIL'}  {name:64s} {detail}")
                if not ok:
                    run.failures.append(name)
        except TimeLimit:
            raise
        except Exception as error:  # noqa: BLE001 - report and continue with the next check
            run.failures.append(getattr(check, "__name__", "check"))
            run.say(f"FAIL  {getattr(check, '__name__', 'check')}: {error!r}")
            traceback.print_exc()


def section_timings(run: Run, title: str, factory: Callable[..., list[cases.Planned]],
                    **kwargs: Any) -> None:  # fmt: skip
    run.say(f"== {title}")
    for planned in factory(run.device, run.dry_run, **kwargs):
        if run.remaining() < planned.estimate_s:
            run.say(f"SKIP  {planned.label}: needs about {planned.estimate_s:.0f} s, "
                    f"{run.remaining():.0f} left")  # fmt: skip
            continue
        try:
            cases.measure_memory(planned, run.device)
            rows = cases.rows_for(planned, run.device)
        except TimeLimit:
            raise
        except Exception as error:  # noqa: BLE001 - a failing variant must not end the run
            run.say(f"FAIL  {planned.label}: {error!r}")
            traceback.print_exc()
            continue
        run.blocks.append(rows)
        run.say(harness.format_table(rows))
        write(run)


def write(run: Run) -> None:
    """Rewrite ``results/cuda-triton.{csv,txt}`` with everything measured so far."""
    if run.dry_run:
        return
    harness.write_results([row for block in run.blocks for row in block], run.machine, STEM)
    verdicts = cases.verdicts(run.blocks)
    text = [run.machine, "", *run.lines, "", "== targets (issue 17)", *verdicts]
    (harness.RESULTS_DIR / f"{STEM}.txt").write_text("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=480.0, help="hard limit, seconds")
    parser.add_argument("--skip-peers", action="store_true", help="no CCE / Liger rows")
    parser.add_argument("--skip-compile", action="store_true", help="no torch.compile rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(int(args.time_limit), 1))
    if args.dry_run:
        os.environ["RLOBJECTIVES_KERNELS"] = "triton"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    run = Run(deadline=start + args.time_limit - 15.0, device=device, dry_run=args.dry_run)
    run.machine = machine_line(device)
    run.say(run.machine)
    peers: dict[str, str | None] = {}
    status = 0
    try:
        section_correctness(run)
        write(run)
        section_timings(run, "token losses (eager variants)", cases.token_cases, compiled=False)
        if not args.skip_peers:
            peers["cut_cross_entropy"] = ensure_peer(
                "cut_cross_entropy", "cut-cross-entropy", "cut_cross_entropy", run
            )
            peers["liger_kernel"] = ensure_peer(
                "liger_kernel", "liger-kernel", "liger_kernel.chunked_loss", run
            )
            for module, reason in peers.items():
                run.say(f"peer {module}: {'available' if reason is None else reason}")
        section_timings(run, "hidden-state path", cases.hidden_cases, peers=peers)
        if not args.skip_compile:
            section_timings(run, "token losses (torch.compile of the reference)",
                            cases.token_cases, compiled=True)  # fmt: skip
    except TimeLimit:
        run.say(f"TIME LIMIT reached after {time.monotonic() - start:.0f} s: results so far kept")
        status = 3
    finally:
        signal.alarm(0)
        write(run)
    run.say(f"done in {time.monotonic() - start:.0f} s; correctness failures: {run.failures}")
    return status or (1 if run.failures else 0)


if __name__ == "__main__":
    sys.exit(main())
