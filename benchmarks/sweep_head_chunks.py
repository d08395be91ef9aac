"""Sweep of the hidden-state chunk size on CPU: ``fused_policy_loss_from_hidden`` time / floor.

The measurement behind ``HEAD_BUDGET``'s row floor (``src/rlobjectives/_lm_head_chunks.py``):
fwd+bwd of ``fused_policy_loss_from_hidden`` at ``N=4096 H=1024 V=32000`` float32 for several
``chunk_size`` values, against the three-GEMM floor (``hidden @ W.T``, ``g @ W``, ``g.T @ hidden``)
timed in the same run, with process CPU time (shared machines). Writes
``results/cpu-head-chunk-sweep.csv`` with the machine line.

    python benchmarks/sweep_head_chunks.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import harness
from rlobjectives import fused_policy_loss_from_hidden


def _time(function: Callable[[], None], repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        function()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, hidden_size, vocab = 4096, 1024, 32000
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, rows, hidden_size, generator=generator).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=generator) / 32).requires_grad_(True)
    tokens = torch.randint(0, vocab, (1, rows), generator=generator)
    old = -torch.rand(1, rows, generator=generator) * 3
    advantages = torch.randn(1, generator=generator)
    mask = torch.ones(1, rows, dtype=torch.bool)
    grad = torch.randn(rows, vocab, generator=generator)

    def floor() -> None:
        logits = hidden[0].detach() @ weight.detach().T
        grad @ weight.detach()
        grad.T @ hidden[0].detach()
        del logits

    def ours(chunk: int | None) -> Callable[[], None]:
        def run() -> None:
            hidden.grad = weight.grad = None
            out = fused_policy_loss_from_hidden(
                hidden, weight, tokens, old, advantages, mask, chunk_size=chunk
            )
            out.loss.backward()

        return run

    floor_ms = _time(floor, args.repeats)
    machine = harness.machine_line("cpu") + " | clock: process CPU time"
    lines = [f"# {machine}", "chunk_rows,fwd_bwd_ms,floor_ms,vs_floor"]
    for chunk in [*args.chunks, None]:
        ms = _time(ours(chunk), args.repeats)
        name = "default" if chunk is None else str(chunk)
        lines.append(f"{name},{ms:.1f},{floor_ms:.1f},{ms / floor_ms:.3f}")
        print(lines[-1], flush=True)
    path = Path(__file__).parent / "results" / "cpu-head-chunk-sweep.csv"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
