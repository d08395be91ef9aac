"""Context parallelism (issue 23): each call on 2 CPU ranks (half of every sequence each) against
one process holding whole sequences; and what crosses the ranks per call.

``python benchmarks/bench_context.py [--quick] [--repeats N] [--output STEM]``

Two gloo ranks are spawned (a file store), one torch thread each. Every round, interleaved so a
shared machine's slow phases hit both alike: (a) rank 0 runs the unsplit call on the whole
``(B, T)`` batch while rank 1 waits at a barrier (one process, one core); (b) both ranks run the
call with ``context_group`` on their contiguous half of every sequence. The time of (b) is the
slower rank's, wall clock and process CPU time (all of a process's threads; a rank waiting in a
collective sleeps): on a machine shared with other jobs the CPU time per rank against the one
process's (ideal 0.5: each rank does half the work) is the better guide. Times are forward +
backward (forward only where nothing is differentiated).
The traffic is measured on one more call by wrapping ``torch.distributed.all_reduce`` /
``all_gather``: the payload bytes of each collective (the float64 buffer of the batched sums; a
ring all-reduce sends about twice its payload times ``(W - 1) / W`` per rank).

Shapes (full run): ``B = 64`` sequences of ``T = 4096`` tokens (about 70% selected); the
hidden-state loss ``B = 8``, ``T = 1024``, ``H = 256``, ``V = 8192``. ``--quick``: a quarter.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import rlobjectives as rlo  # noqa: E402

WORLD = 2
Make = Callable[[dict[str, torch.Tensor], Any], torch.Tensor | None]


def _problem(batch: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, tokens)
    lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=generator)
    mask = torch.arange(tokens) < lengths
    log_probs = -torch.rand(shape, generator=generator) * 3
    return {
        "log_probs": log_probs,
        "old_log_probs": log_probs + 0.1 * torch.randn(shape, generator=generator),
        "ref_log_probs": log_probs + 0.1 * torch.randn(shape, generator=generator),
        "values": torch.randn(shape, generator=generator),
        "returns": torch.randn(shape, generator=generator),
        "rewards": torch.randn(shape, generator=generator) * 0.1,
        "mask": mask,
        "advantages": torch.randn(batch, generator=generator),
    }


def _half(problem: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s contiguous half of every sequence (per-sequence values unchanged)."""
    out = {}
    for name, value in problem.items():
        if value.ndim == 2 and name != "head_weight":
            width = value.shape[1] // WORLD
            value = value[:, rank * width : (rank + 1) * width]
        out[name] = value.contiguous()
    return out


def _grad(name: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def leaf(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return p[name].clone().requires_grad_(True)

    return leaf


def _policy(**options: Any) -> Make:
    def call(p: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
        log_probs = p["log_probs"].requires_grad_(True)
        return rlo.policy_loss(
            log_probs,
            p["old_log_probs"],
            p["advantages"],
            p["mask"],
            **options,
            context_group=group,
        ).loss

    return call


def _kl(p: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
    log_probs = p["log_probs"].requires_grad_(True)
    return rlo.kl_loss(
        log_probs,
        p["ref_log_probs"],
        p["mask"],
        estimator="k2",
        reduction="sequence_mean",
        context_group=group,
    )


def _value(p: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
    values = p["values"].requires_grad_(True)
    out = rlo.value_loss(
        values,
        p["values"] + 0.05,
        p["returns"],
        p["mask"],
        reduction="sequence_mean",
        context_group=group,
    )
    return out.loss


def _rollout(p: dict[str, torch.Tensor], group: Any) -> None:
    rlo.rollout_correction(
        p["log_probs"],
        p["old_log_probs"],
        p["mask"],
        level="sequence",
        mode="mask",
        upper=3.0,
        veto=1e-4,
        context_group=group,
    )


def _gae(p: dict[str, torch.Tensor], group: Any) -> None:
    rlo.gae(p["rewards"], p["values"], p["mask"], gamma=1.0, lam=0.95, context_group=group)


def _fused(p: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    batch, tokens = p["mask"].shape
    hidden = (torch.randn(batch, tokens, HIDDEN, generator=generator) * 0.5).requires_grad_(True)
    weight = p["head_weight"].requires_grad_(True)
    ids = torch.randint(0, weight.shape[0], (batch, tokens), generator=generator)
    return rlo.fused_policy_loss_from_hidden(
        hidden,
        weight,
        ids,
        p["old_log_probs"],
        p["advantages"],
        p["mask"],
        reduction="sequence_mean",
        context_group=group,
    ).loss


HIDDEN = 256
CALLS: dict[str, tuple[Make, bool]] = {  # name: (call, has a backward)
    "policy_loss token_mean": (_policy(), True),
    "policy_loss sequence_mean": (_policy(reduction="sequence_mean"), True),
    "policy_loss GSPO (sequence ratio)": (_policy(ratio_level="sequence"), True),
    "policy_loss GMPO sequence_mean": (_policy(surrogate="gmpo", reduction="sequence_mean"), True),
    "kl_loss k2 sequence_mean": (_kl, True),
    "value_loss sequence_mean": (_value, True),
    "rollout_correction sequence mask + veto": (_rollout, False),
    "gae (forward)": (_gae, False),
    "fused_policy_loss_from_hidden sequence_mean": (_fused, True),
}


def _shape(name: str, quick: bool) -> tuple[int, int]:
    if name.startswith("fused"):
        return (2, 512) if quick else (8, 1024)
    return (16, 1024) if quick else (64, 4096)


def _run(call: Make, backward: bool, problem: dict[str, torch.Tensor], group: Any) -> None:
    loss = call({k: v.clone() for k, v in problem.items()}, group)
    if backward and loss is not None:
        loss.backward()


class _Traffic:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __enter__(self) -> _Traffic:
        self.saved = (dist.all_reduce, dist.all_gather)
        reduce_, gather = self.saved

        def all_reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
            return reduce_(tensor, *a, **k)

        def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.calls.append(("all_gather", tensor.numel() * tensor.element_size()))
            return gather(out, tensor, *a, **k)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather = self.saved  # type: ignore[assignment]


def _worker(rank: int, store: str, out: str, quick: bool, repeats: int) -> None:
    torch.set_num_threads(1)
    harness.keep_memory_mapped()
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    group = dist.group.WORLD
    rows = []
    try:
        for name, (call, backward) in CALLS.items():
            batch, tokens = _shape(name, quick)
            whole = _problem(batch, tokens)
            if name.startswith("fused"):
                vocab = 2048 if quick else 8192
                generator = torch.Generator().manual_seed(2)
                whole["head_weight"] = torch.randn(vocab, HIDDEN, generator=generator) * 0.05
            half = _half(whole, rank)
            for _ in range(2):  # warm-up
                if rank == 0:
                    _run(call, backward, whole, None)
                _run(call, backward, half, group)
            with _Traffic() as traffic:
                _run(call, backward, half, group)
            single, split, single_cpu, split_cpu = [], [], [], []
            for _ in range(repeats):
                dist.barrier()
                if rank == 0:
                    start, cpu = time.perf_counter(), time.process_time()
                    _run(call, backward, whole, None)
                    single.append(time.perf_counter() - start)
                    single_cpu.append(time.process_time() - cpu)
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                _run(call, backward, half, group)
                elapsed = torch.tensor(
                    [time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64
                )
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank
                split.append(float(elapsed[0]))
                split_cpu.append(float(elapsed[1]))
            if rank == 0:
                rows.append(
                    {
                        "call": name,
                        "shape": f"B={batch} T={tokens}"
                        + (f" H={HIDDEN} V={vocab}" if name.startswith("fused") else ""),
                        "one process ms": 1e3 * statistics.median(single),
                        "2 ranks ms": 1e3 * statistics.median(split),
                        "2 ranks / one (min)": min(split) / min(single),
                        "one process CPU ms": 1e3 * statistics.median(single_cpu),
                        "per rank CPU ms": 1e3 * statistics.median(split_cpu),
                        "per rank / one CPU": statistics.median(split_cpu)
                        / statistics.median(single_cpu),
                        "collectives": "; ".join(
                            f"{kind} {size} B" for kind, size in traffic.calls
                        ),
                        "bytes per rank": sum(size for _, size in traffic.calls),
                    }
                )
        if rank == 0:
            Path(out).write_text(json.dumps({"machine": harness.machine_line(), "rows": rows}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    """No in-process cases for ``run.py``: this benchmark spawns its ranks, run it alone."""
    del quick, device
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--output", default="cpu-context")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    with tempfile.TemporaryDirectory() as directory:
        result = os.path.join(directory, "result.json")
        context = mp.get_context("spawn")
        processes = [
            context.Process(
                target=_worker,
                args=(r, os.path.join(directory, "store"), result, args.quick, repeats),
            )
            for r in range(WORLD)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if any(p.exitcode for p in processes):
            print("a rank failed", file=sys.stderr)
            return 1
        data = json.loads(Path(result).read_text())
    machine = data["machine"] + " | 2 gloo ranks x 1 thread vs 1 process x 1 thread"
    print(machine)
    columns = list(data["rows"][0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in data["rows"]:
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    if args.output:
        stem = (
            Path(__file__).resolve().parent
            / "results"
            / (args.output + ("-quick" if args.quick else ""))
        )
        stem.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        with stem.with_suffix(".csv").open("w", newline="") as handle:
            handle.write(f"# {machine}\n")
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(data["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
