"""Vocabulary parallelism: bytes each rank sends per call, and wall time on 2 CPU ranks.

Usage (from the repository root; spawns gloo ranks, a file store in a temporary directory)::

    python benchmarks/vocab_parallel.py bytes     # N=4096, V in (32000, 152064), 2 and 4 ranks
    python benchmarks/vocab_parallel.py time      # 2 ranks x 1 thread against one process
    python benchmarks/vocab_parallel.py bytes --quick

**Bytes.** Every ``torch.distributed`` collective a rank calls is wrapped (``all_reduce``,
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``, ``broadcast``) and its payload
counted: the bytes of the tensor this rank contributes (``all_reduce``: the buffer; gathers: the
input). A ring moves about ``2 (R - 1) / R`` times an all-reduce's payload and ``R - 1`` times a
gather's out of each rank: the ``ring`` column. Calls, one rank, forward + backward:

- ``token_log_probs`` on this rank's ``(N, V/R)`` bfloat16 logits with ``vocab_group`` (and with
  ``top_k=50, top_p=0.9``: the global threshold gathers ``N k`` values), against the same call
  after gathering the logits (``all_gather`` of the slices, chunk by chunk: ``N V/R`` values);
- ``token_log_probs_from_hidden(return_entropy=True)`` and ``fused_policy_loss_from_hidden``
  (``H = 32``: bytes do not depend on ``H``) with ``vocab_group``, against gathering the
  ``(N, V/R)`` logits of the local head rows. ``grad_hidden`` is this rank's part
  (``hidden_grad="partial"``): the all-reduce of ``N H`` values that sums the parts is the
  caller's in both designs (Megatron's copy to the tensor-parallel region) and is not counted.

**Time.** ``token_log_probs_from_hidden`` and ``fused_policy_loss_from_hidden`` forward +
backward at N = 1024, H = 256, V = 32000 (float32): one process holding the whole head (1 and 2
threads) against 2 gloo ranks of 1 thread each holding half of it, medians of the wall time
(the slowest rank of each round), and the process CPU time of the same rounds (robust to a
loaded machine: the work one rank does against the work of one process).
Results: ``results/vocab-parallel-{bytes,time}[-quick].csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import rlobjectives  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast")


class Meter:
    """Wraps the collectives of ``torch.distributed``; counts this rank's payload per op."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Meter:
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self.originals[name] = original

            def wrapped(*args: Any, _name: str = name, _original: Any = original,
                        **kwargs: Any) -> Any:  # fmt: skip
                self.calls[_name] += 1
                self.bytes[_name] += self._payload(_name, args, kwargs)
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)

    @staticmethod
    def _payload(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if name in ("all_reduce", "broadcast"):
            tensor = args[0] if args else kwargs["tensor"]
        elif name == "reduce_scatter":
            pieces = args[1] if len(args) > 1 else kwargs["input_list"]
            return sum(int(t.nbytes) for t in pieces)
        else:  # gathers: the tensor this rank contributes
            tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
        return int(tensor.nbytes)

    def ring_bytes(self, world: int) -> float:
        """Bytes a ring moves out of each rank: 2 (R-1)/R per all-reduce, R-1 per gather."""
        reduce = self.bytes["all_reduce"] + self.bytes["reduce_scatter"] / world
        gather = self.bytes["all_gather"] + self.bytes["all_gather_into_tensor"]
        return 2 * (world - 1) / world * reduce + (world - 1) * gather


class _GatherSlices(torch.autograd.Function):
    """Megatron's gather from the tensor-parallel region: all-gather the vocabulary slices;
    backward keeps this rank's slice of the (replicated) gradient, with no communication."""

    @staticmethod
    def forward(ctx: Any, piece: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(piece) for _ in range(world)]
        dist.all_gather(parts, piece.contiguous(), group=group)
        ctx.bounds = (sum(p.shape[1] for p in parts[:rank]), piece.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        start, width = ctx.bounds
        return grad[:, start : start + width], None


def _gathered_log_probs(logits: torch.Tensor, tokens: torch.Tensor, group: Any,
                        chunk: int = 256) -> torch.Tensor:  # fmt: skip
    """The baseline: the ``(N, V/R)`` slices gathered (chunk by chunk), then one process's call."""
    out = []
    for start in range(0, logits.shape[0], chunk):
        full = _GatherSlices.apply(logits[start : start + chunk], group)
        out.append(rlobjectives.token_log_probs(full, tokens[start : start + chunk]))
    return torch.cat(out)


def _bytes_calls(rows: int, vocab: int, world: int, rank: int,
                 group: Any) -> dict[str, Callable[[], torch.Tensor]]:  # fmt: skip
    """The metered calls of one rank (each returns a loss for backward, or None)."""
    generator = torch.Generator().manual_seed(0)
    local = vocab // world + (1 if rank < vocab % world else 0)
    logits = torch.randn(rows, local, generator=generator).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    width = 32  # the bytes do not depend on H; a narrow head keeps the 4-rank runs short
    hidden = torch.randn(rows, width, generator=generator).requires_grad_()
    weight = (torch.randn(local, width, generator=generator) / 16).requires_grad_()
    old = torch.full((1, rows), -10.0)
    advantages = torch.ones(1)
    mask = torch.ones(1, rows, dtype=torch.bool)

    def gather_head() -> torch.Tensor:
        return _gathered_log_probs(hidden @ weight.T, tokens, group).sum()

    return {
        "token_log_probs": lambda: rlobjectives.token_log_probs(
            logits, tokens, vocab_group=group
        ).sum(),  # fmt: skip
        "token_log_probs top_k=50 top_p=0.9": lambda: (
            rlobjectives.token_log_probs(logits, tokens, vocab_group=group, top_k=50, top_p=0.9)
            .nan_to_num(neginf=0.0)
            .sum()
        ),  # fmt: skip
        "token_log_probs (gather the logits)": lambda: _gathered_log_probs(
            logits, tokens, group
        ).sum(),  # fmt: skip
        "token_log_probs_from_hidden + entropy": lambda: sum(
            rlobjectives.token_log_probs_from_hidden(
                hidden[None], weight, tokens[None], vocab_group=group, return_entropy=True
            )
        ).sum(),  # fmt: skip
        "fused_policy_loss_from_hidden": lambda: (
            rlobjectives.fused_policy_loss_from_hidden(
                hidden[None],
                weight,
                tokens[None],
                old,
                advantages,
                mask,
                vocab_group=group,
                entropy_coef=0.01,
            ).loss
        ),  # fmt: skip
        "log-probs from hidden (gather the logits)": gather_head,
    }


def _init(rank: int, world: int, store: str) -> Any:
    importlib.import_module("torch._dynamo")  # before the group (demo/_process_group.py)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    return dist.group.WORLD


def bytes_worker(rank: int, world: int, store: str, out: str, rows: int, vocab: int) -> None:
    torch.set_num_threads(1)
    group = _init(rank, world, store)
    try:
        results = []
        for name, call in _bytes_calls(rows, vocab, world, rank, group).items():
            with Meter() as meter:
                call().backward()
            results.append({
                "call": name, "N": rows, "V": vocab, "ranks": world,
                "payload_bytes": sum(meter.bytes.values()),
                "ring_bytes": meter.ring_bytes(world),
                "collectives": sum(meter.calls.values()),
                "ops": " ".join(f"{op}x{count}" for op, count in sorted(meter.calls.items())),
            })  # fmt: skip
        if rank == 0:
            torch.save(results, Path(out) / "bytes.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _time_calls(group: Any, rank: int, world: int) -> dict[str, Callable[[], torch.Tensor]]:
    rows, width, vocab = 1024, 256, 32000
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, rows, width, generator=generator).requires_grad_()
    full = torch.randn(vocab, width, generator=generator) / width**0.5
    local = vocab // world
    weight = full[rank * local : (rank + 1) * local].clone().requires_grad_()
    tokens = torch.randint(0, vocab, (1, rows), generator=generator)
    old = torch.full((1, rows), -10.0)
    advantages = torch.ones(1)
    mask = torch.ones(1, rows, dtype=torch.bool)
    options = {"vocab_group": group} if group is not None else {}
    return {
        "token_log_probs_from_hidden": lambda: rlobjectives.token_log_probs_from_hidden(
            hidden, weight, tokens, **options
        ).sum(),  # fmt: skip
        "fused_policy_loss_from_hidden": lambda: (
            rlobjectives.fused_policy_loss_from_hidden(
                hidden, weight, tokens, old, advantages, mask, **options
            ).loss
        ),  # fmt: skip
    }


def _median_times(calls: dict[str, Callable[[], torch.Tensor]], repeats: int,
                  group: Any) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Median (wall ms, process CPU ms) per call; with a group, the slowest rank's of each."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, call in calls.items():
            if group is not None:
                dist.barrier()
            begin, begin_cpu = time.perf_counter(), time.process_time()
            call().backward()
            elapsed = torch.tensor([time.perf_counter() - begin, time.process_time() - begin_cpu])
            if group is not None:  # the slowest rank's times
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_:
                times[name].append((float(elapsed[0]) * 1e3, float(elapsed[1]) * 1e3))
    return {
        name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
        for name, values in times.items()
    }


def time_worker(rank: int, world: int, store: str, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    group = _init(rank, world, store)
    try:
        medians = _median_times(_time_calls(group, rank, world), repeats, group)
        if rank == 0:
            torch.save(medians, Path(out) / "time.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(target: Callable[..., None], world: int, *args: Any) -> Path:
    directory = Path(tempfile.mkdtemp())
    mp.start_processes(target, args=(world, str(directory / "store"), str(directory), *args),
                       nprocs=world, start_method="spawn")  # fmt: skip
    return directory


def _write(rows: list[dict[str, Any]], machine: str, stem: str) -> Path:
    harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = harness.RESULTS_DIR / f"{stem}.csv"
    with open(path, "w", newline="") as handle:
        handle.write(f"# {machine}\n")
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def run_bytes(quick: bool) -> list[dict[str, Any]]:
    rows = 512 if quick else 4096
    vocabularies = (8000,) if quick else (32000, 152064)
    results: list[dict[str, Any]] = []
    for vocab in vocabularies:
        for world in (2, 4):
            print(f"  bytes: N={rows} V={vocab} ranks={world} ...", flush=True)
            directory = _spawn(bytes_worker, world, rows, vocab)
            results += torch.load(directory / "bytes.pt", weights_only=False)
    return results


def run_time(repeats: int) -> list[dict[str, Any]]:
    results = []
    single: dict[int, dict[str, tuple[float, float]]] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        single[threads] = _median_times(_time_calls(None, 0, 1), repeats, None)
    torch.set_num_threads(1)
    directory = _spawn(time_worker, 2, repeats)
    ranks: dict[str, tuple[float, float]] = torch.load(directory / "time.pt", weights_only=False)
    for name, (wall, cpu) in ranks.items():
        results.append({
            "call": name, "shape": "N=1024 H=256 V=32000 float32",
            "one_process_1_thread_ms": round(single[1][name][0], 1),
            "one_process_2_threads_ms": round(single[2][name][0], 1),
            "two_ranks_1_thread_each_ms": round(wall, 1),
            "ranks_vs_2_threads": round(wall / single[2][name][0], 2),
            "one_process_1_thread_cpu_ms": round(single[1][name][1], 1),
            "two_ranks_cpu_ms_slowest_rank": round(cpu, 1),
            "ranks_cpu_vs_1_thread": round(cpu / single[1][name][1], 2),
        })  # fmt: skip
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("bytes", "time"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    machine = harness.machine_line("cpu")
    print(machine, flush=True)
    results = run_bytes(args.quick) if args.what == "bytes" else run_time(args.repeats)
    for row in results:
        print(" | ".join(f"{key}={value}" for key, value in row.items()))
    stem = f"vocab-parallel-{args.what}" + ("-quick" if args.quick else "")
    print(f"wrote {_write(results, machine, stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
