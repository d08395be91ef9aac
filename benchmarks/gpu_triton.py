"""One GPU run: the Triton LM head and the policy loss, correctness first, then timings.

Usage (from the repository root, with the package and triton installed)::

    python benchmarks/gpu_triton.py                  # default limit 400 s, writes the results
    python benchmarks/gpu_triton.py --time-limit 300 --skip-peers
    python benchmarks/gpu_triton.py --dry-run        # tiny shapes on CPU (Triton interpreter)

Sections, in order (each checks the remaining time first; the results files are rewritten after
every section, so a run cut short still leaves what it measured):

1. **correctness** on the device against float64 on the CPU: the LM-head launchers
   (``gpu_triton_checks.check_lm_head``: log-probs, entropy, gradients to hidden / weight / bias,
   one and several vocabulary splits and chunks, ``-inf`` bias, NaN in masked rows, the logit
   scale / softcap / per-row temperature / rounded product where the kernels take them), the
   public ``token_log_probs_from_hidden`` and ``fused_policy_loss_from_hidden`` under
   ``use_backend("triton")`` vs ``use_backend("torch")`` in float64 (``gpu_triton_public.py``),
   ``policy_loss`` eager on the device vs float64 (values, gradients, diagnostics; bf16 and
   fp32), the decisions at every clip bound, then ``policy_loss`` with ``RLOBJECTIVES_COMPILE=1``.
2. **policy loss** timings, bf16 and fp32, B=64 T=4096 and B=8 T=16384: naive eager reference,
   verl-style eager loss, ``policy_loss`` eager, ``policy_loss`` with ``RLOBJECTIVES_COMPILE=1``,
   the copy floor (``gpu_triton_cases.py``).
3. **hidden-state path**, bf16, N=16384 H=4096 V=152064 and N=8192 H=4096 V=128256: time and
   peak memory beyond inputs and gradients of ``fused_policy_loss_from_hidden`` and
   ``token_log_probs_from_hidden`` (as a cross-entropy) on the triton and torch backends,
   Liger-Kernel's ``LigerFusedLinearGRPOLoss`` / ``LigerFusedLinearCrossEntropyLoss`` and Cut
   Cross-Entropy's ``linear_cross_entropy`` (pip-installed with ``--no-deps`` from ``.whl/`` or
   the index when missing; skipped with the reason recorded when that fails), and the three-GEMM
   floor.

Outputs: ``benchmarks/results/cuda-triton.csv`` / ``.json`` (timing rows, harness format;
``peak_mib`` is the memory beyond inputs and gradients for the hidden-state rows) and
``cuda-triton.txt`` (machine line: GPU, driver, CUDA, torch and triton versions; correctness
lines; tables; target verdicts). A dry run writes the same files to a temporary folder.
Exit status: 0 when every correctness check passed, 1 otherwise, 2 without a GPU (and no
``--dry-run``), 3 when the time limit cut the run (results so far are written).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv[1:]:  # before anything imports triton: its documented switch
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
for _path in (BENCH_DIR, BENCH_DIR.parent / "tests"):
    sys.path.insert(0, str(_path))

import gpu_triton_cases as cases  # noqa: E402
import gpu_triton_checks as checks  # noqa: E402
import gpu_triton_public as public  # noqa: E402
import harness  # noqa: E402

STEM = "cuda-triton"
MARKS = {True: "ok  ", False: "FAIL", None: "SKIP"}
WHEELS = BENCH_DIR.parent / ".whl"  # carried wheels (a machine without network), if any
# (module, pip package, entries that must import) of the peers of the hidden-state path
PEERS = (
    ("liger_kernel", "liger-kernel==0.8.5",
     ("liger_kernel.chunked_loss", "liger_kernel.transformers")),
    ("cut_cross_entropy", "cut-cross-entropy==25.1.1", ("cut_cross_entropy",)),
)  # fmt: skip


class TimeLimit(Exception):
    """Raised by the SIGALRM handler when the hard time limit is reached."""


@dataclasses.dataclass
class Run:
    """State of one run: deadline, results so far, text report lines."""

    deadline: float
    device: torch.device
    dry_run: bool
    results_dir: Path
    blocks: list[list[harness.Row]] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    machine: str = ""

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def needs(self, seconds: float) -> float:
        """A GPU time estimate for this run (a tenth on a dry run's tiny shapes)."""
        return seconds / 10 if self.dry_run else seconds

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


_EXPIRED: list[bool] = []  # set by the alarm: a library may wrap the TimeLimit it raised


def _on_alarm(signum: int, frame: Any) -> None:
    _EXPIRED.append(True)
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
    else:
        parts.append("dry run: Triton interpreter, timings meaningless")
    return " | ".join(parts)


def ensure_peer(module: str, package: str, entries: tuple[str, ...], run: Run) -> str | None:
    """Import ``entries``, pip-installing ``package`` (no deps) if needed; None or the reason."""
    reason = _install(module, package, run)
    if reason is not None:
        return reason
    for entry in entries:
        try:
            importlib.import_module(entry)
        except Exception as error:  # noqa: BLE001 - any import failure skips the peer's rows
            return f"import {entry} failed: {error!r}"[:300]
    return None


def _install(module: str, package: str, run: Run) -> str | None:
    """Install ``package`` without dependencies: from ``.whl/`` if present, else the index."""
    if importlib.util.find_spec(module) is not None:
        return None
    if run.dry_run:
        return "not installed (a dry run installs nothing)"
    budget = min(90.0, max(run.remaining() - 240.0, 0.0))
    if budget < 15:
        return "not installed (no time left to install)"
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
            "--disable-pip-version-check"]  # fmt: skip
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


def correctness_checks(dry: bool) -> list[Callable[[torch.device], list[checks.Result]]]:
    """LM head, public hidden-state functions, policy_loss eager, bounds, policy_loss compiled."""
    lm_head, boundary = checks.correctness_checks(dry)
    policy_eager, hidden, policy_compiled = public.public_checks(dry)
    return [lm_head, hidden, policy_eager, boundary, policy_compiled]


def section_correctness(run: Run) -> None:
    run.say("== correctness (device vs float64 on the CPU)")
    for check in correctness_checks(run.dry_run):
        name = getattr(check, "__name__", "check")
        if run.remaining() < run.needs(30):
            run.say(f"SKIP  {name} and the checks after it: time limit")
            run.failures.append("correctness incomplete")
            return
        start = time.monotonic()
        try:
            for label, ok, detail in check(run.device):
                run.say(f"{MARKS[ok]}  {label:72s} {detail}")
                if ok is False:
                    run.failures.append(label)
        except TimeLimit:
            raise
        except Exception as error:  # noqa: BLE001 - report and continue with the next check
            if _EXPIRED:  # the alarm's TimeLimit, wrapped (e.g. by Triton's interpreter)
                raise TimeLimit from error
            run.failures.append(name)
            run.say(f"FAIL  {name}: {error!r}")
            traceback.print_exc()
        run.say(f"--    {name}: {time.monotonic() - start:.1f} s")


def section_timings(run: Run, title: str, factory: Callable[..., list[cases.Planned]],
                    **kwargs: Any) -> None:  # fmt: skip
    run.say(f"== {title}")
    for planned in factory(run.device, run.dry_run, **kwargs):
        if run.remaining() < run.needs(planned.estimate_s):
            run.say(f"SKIP  {planned.label}: needs about {run.needs(planned.estimate_s):.0f} s, "
                    f"{run.remaining():.0f} left")  # fmt: skip
            continue
        start = time.monotonic()
        try:
            cases.measure_memory(planned, run.device)
            rows = cases.rows_for(planned, run.device)
        except TimeLimit:
            raise
        except Exception as error:  # noqa: BLE001 - a failing variant must not end the run
            if _EXPIRED:
                raise TimeLimit from error
            run.say(f"FAIL  {planned.label}: {error!r}")
            traceback.print_exc()
            continue
        run.blocks.append(rows)
        run.say(harness.format_table(rows))
        run.say(f"--    {planned.label}: {time.monotonic() - start:.1f} s")
        write(run)


def write(run: Run) -> None:
    """Rewrite ``<results>/cuda-triton.{csv,json,txt}`` with everything measured so far."""
    harness.RESULTS_DIR = run.results_dir  # harness.write_results writes there
    harness.write_results([row for block in run.blocks for row in block], run.machine, STEM)
    text = [run.machine, "", *run.lines, "", "== targets", *cases.verdicts(run.blocks)]
    (run.results_dir / f"{STEM}.txt").write_text("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=400.0, help="hard limit, seconds")
    parser.add_argument("--skip-peers", action="store_true", help="no Liger / CCE rows")
    parser.add_argument(
        "--skip-compile",
        action="store_true",
        help="no RLOBJECTIVES_COMPILE=1 timing rows (the checks still run)",
    )
    parser.add_argument("--skip-hidden", action="store_true", help="no hidden-state timings")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="default benchmarks/results (a temporary folder for a dry run)",
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(int(args.time_limit), 1))
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    results_dir = args.results_dir or (
        Path(tempfile.mkdtemp(prefix="gpu-triton-dry-")) if args.dry_run else harness.RESULTS_DIR
    )
    results_dir.mkdir(parents=True, exist_ok=True)
    run = Run(deadline=start + args.time_limit - 15.0, device=device, dry_run=args.dry_run,
              results_dir=results_dir)  # fmt: skip
    public.TIME_LEFT = run.remaining  # the compiled checks leave time for the timings
    run.machine = machine_line(device)
    run.say(run.machine)
    status = 0
    try:
        section_correctness(run)
        write(run)
        compile_reason = None if args.skip_compile else checks.compile_unavailable(device.type)
        if compile_reason is not None:
            run.say(f"policy_loss RLOBJECTIVES_COMPILE=1 rows skipped: {compile_reason}")
        section_timings(run, "policy loss", cases.policy_cases,
                        compiled=not args.skip_compile and compile_reason is None)  # fmt: skip
        if not args.skip_hidden:
            peers: dict[str, str | None] = {}
            for module, package, entries in PEERS if not args.skip_peers else ():
                peers[module] = ensure_peer(module, package, entries, run)
                run.say(f"peer {module}: {peers[module] or 'available'}")
            section_timings(run, "hidden-state path", cases.hidden_cases, peers=peers)
    except TimeLimit:
        run.say(f"TIME LIMIT reached after {time.monotonic() - start:.0f} s: results so far kept")
        status = 3
    finally:
        signal.alarm(0)
        write(run)
    run.say(f"done in {time.monotonic() - start:.0f} s; correctness failures: {run.failures}")
    run.say(f"results: {results_dir / STEM}.{{csv,json,txt}}")
    write(run)
    return status or (1 if run.failures else 0)


if __name__ == "__main__":
    sys.exit(main())
