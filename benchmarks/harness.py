"""Benchmark harness: timing, fresh-process peak memory, floors, tables and result files.

A benchmark module ``benchmarks/bench_<name>.py`` defines one function::

    def cases(*, quick: bool, device: str) -> list[Case]: ...

returning :class:`Case` objects built lazily (no tensor is allocated until a case runs, so the
fresh memory process can rebuild the case list cheaply). ``python benchmarks/run.py`` imports every
``bench_*.py`` module, runs its cases and prints one table (see ``benchmarks/README.md``).

API (keep it small):

- :func:`machine_line` -- CPU model / GPU name, threads, torch version: heads every output.
- :class:`Case` -- one operation at one shape and dtype: ``make_inputs(device)`` returns a dict of
  tensors, ``grad_inputs`` names those that require grad (the backward is with respect to them),
  ``variants`` the implementations, ``floor`` the bytes (or matmuls) that must move.
- :class:`Variant` -- ``fn(inputs) -> Tensor`` (a loss or any output; non-scalar outputs are
  back-propagated with a ones gradient). ``role="reference"`` marks the baseline of the ratio
  column (one per case); ``compile=True`` wraps ``fn`` in ``torch.compile(fullgraph=True)``.
- :class:`CopyFloor` / :class:`MatmulFloor` -- the floor of a case, timed in the same run.
- :func:`time_case` -- medians and min-max spreads of forward+backward and forward alone, with the
  variants interleaved round by round so that machine noise hits all of them alike.
- :func:`peak_memory_mib` -- peak memory of one variant's forward+backward, in a fresh process.
- :func:`saved_for_backward_mib` -- bytes kept alive for backward (``saved_tensors_hooks``).
- :func:`run_cases`, :func:`print_table`, :func:`write_results` -- rows, table, CSV/JSON.

Timing: ``--warmup`` untimed calls (these also trigger compilation), then ``--repeats`` rounds; in
each round every variant runs once (forward + backward), then once more forward-only (graph built,
no backward). On CUDA each call is bracketed by CUDA events; on CPU by ``time.perf_counter``
(``clock="wall"``) or by ``time.process_time`` (``clock="process"``: CPU seconds of all threads of
this process; on a machine shared with other jobs it ignores the time spent descheduled, but it
also counts threads spinning while they wait for work, so use it with ``--threads 1``).

Memory: each variant runs in a new Python process (``python benchmarks/harness.py --memory ...``)
that builds the inputs, runs one warm-up call, then measures one forward+backward: on CUDA
``torch.cuda.max_memory_allocated`` minus the allocation before the call; on CPU the growth of the
peak resident set size (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; falls back
to ``ru_maxrss`` growth when the reset is not permitted), with ``MALLOC_MMAP_THRESHOLD_=65536`` so
that glibc maps every block of 64 KiB or more separately and unmaps it on free: the resident peak
then follows the peak of live tensor bytes. CPU numbers have page granularity and ignore blocks
under 64 KiB; read them as "MiB of memory the call held at its peak beyond its inputs".
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
for _path in (str(REPO_ROOT), str(REPO_ROOT / "tests"), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

Inputs = dict[str, torch.Tensor]
MIB = 1024.0 * 1024.0


# ----------------------------------------------------------------------------------- descriptions
@dataclasses.dataclass(frozen=True)
class Variant:
    """One implementation of a case's operation.

    Attributes:
        name: short label shown in the table (e.g. ``"eager reference"``, ``"ours"``).
        fn: ``fn(inputs) -> Tensor``; called with the case's inputs dict.
        role: ``"reference"`` (the ratio baseline, exactly one per case) or ``"candidate"``.
        compile: wrap ``fn`` in ``torch.compile(fullgraph=True)`` (compiled on the warm-up call).
        backward: False for forward-only operations (then the fwd+bwd column is the forward).
    """

    name: str
    fn: Callable[[Inputs], torch.Tensor]
    role: str = "candidate"
    compile: bool = False
    backward: bool = True

    @property
    def key(self) -> str:
        """Unique label within a case: the name, plus ``[compiled]`` for compiled variants."""
        return self.name + (" [compiled]" if self.compile else "")


@dataclasses.dataclass(frozen=True)
class CopyFloor:
    """Memory-bound floor: one copy that moves the bytes a single pass must move.

    ``forward_bytes``/``forward_backward_bytes`` count inputs read once plus outputs (and input
    gradients) written once. The floor is timed as ``dst.copy_(src)`` with ``src`` holding half of
    those bytes (a copy reads and writes the same amount), in the same run as the variants.
    """

    forward_bytes: int
    forward_backward_bytes: int


@dataclasses.dataclass(frozen=True)
class MatmulFloor:
    """Matrix-bound floor: the matrix products alone, ``[(m, k, n), ...]`` per pass."""

    forward: tuple[tuple[int, int, int], ...]
    forward_backward: tuple[tuple[int, int, int], ...]
    dtype: torch.dtype = torch.float32


@dataclasses.dataclass(frozen=True)
class Case:
    """One operation at one shape and dtype, with its variants and floor."""

    operation: str
    shape: str
    dtype: torch.dtype
    make_inputs: Callable[[torch.device], Inputs]
    grad_inputs: tuple[str, ...]
    variants: tuple[Variant, ...]
    floor: CopyFloor | MatmulFloor | None = None

    @property
    def label(self) -> str:
        return f"{self.operation} {self.shape} {dtype_name(self.dtype)}"


@dataclasses.dataclass
class Timing:
    """Milliseconds: median and spread (min, max) over the timed rounds."""

    median_ms: float
    min_ms: float
    max_ms: float


@dataclasses.dataclass
class Row:
    """One table row (one variant of one case, or the case's floor)."""

    operation: str
    shape: str
    dtype: str
    variant: str
    role: str
    fwd_bwd_ms: float
    fwd_bwd_min_ms: float
    fwd_bwd_max_ms: float
    fwd_ms: float
    fwd_min_ms: float
    fwd_max_ms: float
    vs_reference: float | None
    vs_floor: float | None
    peak_mib: float | None
    saved_mib: float | None
    # min fwd+bwd / the reference's min fwd+bwd: a second ratio, robust to a loaded machine.
    vs_reference_min: float | None = None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------------- machine line
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(device: str = "cpu") -> str:
    """One line naming the hardware and software the numbers were measured on."""
    parts = [
        f"cpu: {_cpu_model()} ({os.cpu_count()} cores visible)",
        f"torch threads: {torch.get_num_threads()}",
        f"torch {torch.__version__}",
        f"python {platform.python_version()}",
    ]
    if device == "cuda" and torch.cuda.is_available():
        parts.insert(0, f"gpu: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    try:
        parts.append(f"load avg {os.getloadavg()[0]:.2f}")
    except OSError:  # pragma: no cover - not on Linux
        pass
    return " | ".join(parts)


# ----------------------------------------------------------------------------------- running calls
def keep_memory_mapped() -> bool:
    """glibc: keep freed memory mapped (no trimming, no per-block ``mmap``); False elsewhere.

    By default glibc returns freed memory to the OS when the free top of the heap exceeds a
    threshold that it adapts to the sizes freed so far, and maps large blocks separately; the
    next call then pays a page fault per 4 KiB page it touches again. Which calls pay depends on
    the order and the sizes of everything freed before (the other variants of the round, the
    previous case), so on CPU it can add half of a loss's time to some rounds and not to others.
    ``mallopt(M_TRIM_THRESHOLD)`` and ``mallopt(M_MMAP_THRESHOLD)`` at 1 GiB turn both off for
    this process (a GPU caching allocator never returns memory between calls either).
    """
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim_threshold, mmap_threshold, gib = -1, -3, 1 << 30  # glibc's M_* parameter numbers
    return bool(libc.mallopt(trim_threshold, gib)) and bool(libc.mallopt(mmap_threshold, gib))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(case: Case, device: torch.device) -> Inputs:
    inputs = case.make_inputs(device)
    for name in case.grad_inputs:
        inputs[name] = inputs[name].detach().requires_grad_(True)
    return inputs


def _step(
    case: Case, variant: Variant, fn: Callable[[Inputs], torch.Tensor], inputs: Inputs
) -> Callable[[bool], None]:
    leaves = [inputs[name] for name in case.grad_inputs]

    def step(backward: bool) -> None:
        for leaf in leaves:
            leaf.grad = None
        out = fn(inputs)
        if backward and variant.backward and leaves:
            if out.ndim == 0:
                out.backward()
            else:
                out.backward(torch.ones_like(out))

    return step


def _floor_steps(
    floor: CopyFloor | MatmulFloor, device: torch.device
) -> tuple[Callable[[bool], None], Callable[[], None]]:
    """(step(backward), release) for the floor: a copy of the bytes or the matmuls alone."""
    if isinstance(floor, CopyFloor):
        buffers: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for backward, count in ((False, floor.forward_bytes), (True, floor.forward_backward_bytes)):
            elements = max(count // 2 // 4, 1)  # float32 elements in src (= in dst)
            src = torch.rand(elements, device=device)
            buffers[backward] = (src, torch.empty_like(src))

        def copy_step(backward: bool) -> None:
            src, dst = buffers[backward]
            dst.copy_(src)

        return copy_step, buffers.clear

    operands: dict[bool, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for backward, shapes in ((False, floor.forward), (True, floor.forward_backward)):
        operands[backward] = [
            (
                torch.randn(m, k, device=device, dtype=floor.dtype),
                torch.randn(k, n, device=device, dtype=floor.dtype),
            )
            for m, k, n in shapes
        ]

    def matmul_step(backward: bool) -> None:
        for left, right in operands[backward]:
            torch.matmul(left, right)

    return matmul_step, operands.clear


def _timed(
    step: Callable[[bool], None], backward: bool, device: torch.device, clock: str = "wall"
) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(backward)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    timer = time.process_time if clock == "process" else time.perf_counter
    begin = timer()
    step(backward)
    return (timer() - begin) * 1e3


def _summary(samples: Sequence[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples))


def compiled(fn: Callable[[Inputs], torch.Tensor]) -> Callable[[Inputs], torch.Tensor]:
    """``torch.compile(fn, fullgraph=True)`` (dynamic=False: one shape per case)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)  # type: ignore[no-any-return]


def time_case(
    case: Case, device: torch.device, *, warmup: int, repeats: int, clock: str = "wall"
) -> dict[str, tuple[Timing, Timing]]:
    """Time every variant (and the floor): ``{name: (fwd+bwd timing, fwd timing)}``.

    Variants are interleaved: each round runs every variant once, so slow phases of a noisy
    machine land on all of them and the ratios stay meaningful.
    """
    inputs = _prepare(case, device)
    steps: dict[str, Callable[[bool], None]] = {}
    for variant in case.variants:
        fn = compiled(variant.fn) if variant.compile else variant.fn
        steps[variant.key] = _step(case, variant, fn, inputs)
    release: Callable[[], None] | None = None
    if case.floor is not None:
        steps["floor"], release = _floor_steps(case.floor, device)
    for step in steps.values():
        for _ in range(warmup):
            step(True)
            step(False)
    _synchronize(device)
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name][0].append(_timed(step, True, device, clock))
        for name, step in steps.items():
            samples[name][1].append(_timed(step, False, device, clock))
    if release is not None:
        release()
    return {name: (_summary(bwd), _summary(fwd)) for name, (bwd, fwd) in samples.items()}


def saved_for_backward_mib(case: Case, variant: Variant, device: torch.device) -> float | None:
    """MiB of tensors autograd keeps for backward (distinct storages), eager variants only.

    Storages of the inputs themselves (e.g. a mask the caller keeps anyway) are counted too:
    this is what the graph holds alive, not what it allocated.
    """
    if variant.compile or not variant.backward or not case.grad_inputs:
        return None
    inputs = _prepare(case, device)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = variant.fn(inputs)
    del out
    return sum(storages.values()) / MIB


# ----------------------------------------------------------------------------------- peak memory
def _cpu_peak_rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found")


def _cpu_current_rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmRSS not found")


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _measure_memory_here(case: Case, variant: Variant, device: torch.device) -> float:
    """Peak MiB of one forward+backward of ``variant``, measured in this (fresh) process."""
    fn = compiled(variant.fn) if variant.compile else variant.fn
    inputs = _prepare(case, device)
    step = _step(case, variant, fn, inputs)
    step(True)  # warm-up: lazy initialisation, compilation
    for leaf in case.grad_inputs:
        inputs[leaf].grad = None
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(True)
        _synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / MIB
    import gc
    import resource

    gc.collect()
    if _reset_cpu_peak():
        before = _cpu_current_rss_bytes()
        step(True)
        return max(_cpu_peak_rss_bytes() - before, 0) / MIB
    before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step(True)
    after_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(after_peak - before_peak, 0) / MIB


def peak_memory_mib(
    module: str, case_index: int, variant: str, *, quick: bool, device: str, threads: int
) -> float | None:
    """Run :func:`_measure_memory_here` in a fresh interpreter; None if it failed."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory",
        module,
        str(case_index),
        variant,
        "--device",
        device,
        "--threads",
        str(threads),
    ]
    if quick:
        command.append("--quick")
    # glibc: serve every allocation of 64 KiB or more by its own mmap, returned to the system on
    # free, so the resident-set peak follows the peak of live tensor bytes (page granularity).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:
        sys.stderr.write(f"memory measurement failed for {module}[{case_index}] {variant}:\n")
        sys.stderr.write(result.stderr[-2000:])
        return None
    return float(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------- running all
def load_cases(module: str, *, quick: bool, device: str) -> list[Case]:
    """The cases of a ``bench_*`` module; none for a standalone script (no ``cases``)."""
    bench = importlib.import_module(module)
    if not hasattr(bench, "cases"):
        return []  # e.g. bench_formula.py: one process, its own table (run it directly)
    return list(bench.cases(quick=quick, device=device))


def run_cases(
    module: str,
    cases: Sequence[Case],
    *,
    device: str,
    quick: bool,
    warmup: int,
    repeats: int,
    threads: int,
    memory: bool,
    clock: str = "wall",
    only: Sequence[int] | None = None,
    echo: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time (and measure) every case of ``module``; ``only`` restricts to some case indices."""
    torch_device = torch.device(device)
    rows: list[Row] = []
    for index, case in enumerate(cases):
        if only is not None and index not in only:
            continue
        if echo is not None:
            echo(f"  running {case.label} ...")
        timings = time_case(case, torch_device, warmup=warmup, repeats=repeats, clock=clock)
        references = [v.key for v in case.variants if v.role == "reference"]
        reference = timings[references[0]] if references else None
        floor = timings.get("floor")
        for variant in case.variants:
            total, forward = timings[variant.key]
            peak = (
                peak_memory_mib(
                    module, index, variant.key, quick=quick, device=device, threads=threads
                )
                if memory
                else None
            )
            rows.append(
                Row(
                    operation=case.operation,
                    shape=case.shape,
                    dtype=dtype_name(case.dtype),
                    variant=variant.key,
                    role=variant.role,
                    fwd_bwd_ms=total.median_ms,
                    fwd_bwd_min_ms=total.min_ms,
                    fwd_bwd_max_ms=total.max_ms,
                    fwd_ms=forward.median_ms,
                    fwd_min_ms=forward.min_ms,
                    fwd_max_ms=forward.max_ms,
                    vs_reference=None
                    if reference is None
                    else total.median_ms / reference[0].median_ms,
                    vs_floor=None if floor is None else total.median_ms / floor[0].median_ms,
                    peak_mib=peak,
                    saved_mib=saved_for_backward_mib(case, variant, torch_device),
                    vs_reference_min=None
                    if reference is None
                    else total.min_ms / reference[0].min_ms,
                )
            )
        if floor is not None:
            total, forward = floor
            kind = "copy" if isinstance(case.floor, CopyFloor) else "matmul"
            rows.append(
                Row(
                    operation=case.operation,
                    shape=case.shape,
                    dtype=dtype_name(case.dtype),
                    variant=f"floor ({kind})",
                    role="floor",
                    fwd_bwd_ms=total.median_ms,
                    fwd_bwd_min_ms=total.min_ms,
                    fwd_bwd_max_ms=total.max_ms,
                    fwd_ms=forward.median_ms,
                    fwd_min_ms=forward.min_ms,
                    fwd_max_ms=forward.max_ms,
                    vs_reference=None
                    if reference is None
                    else total.median_ms / reference[0].median_ms,
                    vs_floor=1.0,
                    peak_mib=None,
                    saved_mib=None,
                )
            )
    return rows


COLUMNS = (
    ("operation", "operation", "{}"),
    ("shape", "shape", "{}"),
    ("dtype", "dtype", "{}"),
    ("variant", "variant", "{}"),
    ("fwd_bwd_ms", "fwd+bwd ms", "{:.3f}"),
    ("spread", "spread (min-max)", "{}"),
    ("fwd_ms", "fwd ms", "{:.3f}"),
    ("vs_reference", "x ref", "{:.2f}"),
    ("vs_reference_min", "x ref (min)", "{:.2f}"),
    ("vs_floor", "x floor", "{:.2f}"),
    ("peak_mib", "peak MiB", "{:.1f}"),
    ("saved_mib", "saved MiB", "{:.2f}"),
)


def _cell(row: Row, key: str, fmt: str) -> str:
    if key == "spread":
        return f"{row.fwd_bwd_min_ms:.3f}-{row.fwd_bwd_max_ms:.3f}"
    value = getattr(row, key)
    return "-" if value is None else fmt.format(value)


def format_table(rows: Sequence[Row]) -> str:
    header = [title for _, title, _ in COLUMNS]
    body = [[_cell(row, key, fmt) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * width for width in widths))
    lines += [
        " | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in body
    ]
    return "\n".join(lines)


def print_table(rows: Sequence[Row], machine: str) -> None:
    print(machine)
    print(format_table(rows))


def write_results(rows: Sequence[Row], machine: str, stem: str) -> tuple[Path, Path]:
    """Write ``results/<stem>.csv`` (machine line as a leading comment) and ``<stem>.json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = RESULTS_DIR / f"{stem}.csv", RESULTS_DIR / f"{stem}.json"
    fields = [field.name for field in dataclasses.fields(Row)]
    with open(csv_path, "w", newline="") as handle:
        handle.write(f"# {machine}\n")
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))
    payload: dict[str, Any] = {"machine": machine, "rows": [dataclasses.asdict(r) for r in rows]}
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    return csv_path, json_path


def _memory_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description="internal: peak memory of one variant")
    parser.add_argument("--memory", nargs=3, metavar=("MODULE", "CASE", "VARIANT"), required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    module, index, name = args.memory
    case = load_cases(module, quick=args.quick, device=args.device)[int(index)]
    variant = next(v for v in case.variants if v.key == name)
    print(f"{_measure_memory_here(case, variant, torch.device(args.device)):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(_memory_main(sys.argv[1:]))
