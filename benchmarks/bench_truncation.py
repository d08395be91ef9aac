"""Truncated log-probabilities from hidden states: the kept set's cost over the untruncated call.

Operations (forward + backward with respect to ``hidden`` and ``weight``, float32), each
against the same call without a kept set (``role="reference"``: the ``x ref`` column is the
ratio the issue bounds by 1.2 for ``kept_ids``, ``kept_mask`` and ``top_k``):

- ``log_probs_from_hidden``: ``token_log_probs_from_hidden`` (chunked, recompute in backward);
- ``fused_policy_loss``: ``fused_policy_loss_from_hidden`` (gradients in the forward chunk loop).

Kept sets: ``kept_ids`` ``(N, 64)`` with 8 to 64 real ids per row (the rest ``-1``: vLLM's
compacted mask replay, slime's top-p ids), ``kept_mask`` ``(N, V)`` bool of the same sets,
``top_k=50``, ``top_k=50, top_p=0.9`` (top-p sorts the ``(chunk, 50)`` top-k values only) and
``top_p=0.9`` alone (sorts every ``(chunk, V)`` row: the cost the issue asks to state).

Shapes (full run): N = 4096, H = 1024, V = 32000 (the issue's). Quick: N = 1024, H = 256,
V = 8000. ``python benchmarks/bench_truncation.py`` runs this module alone and writes
``results/truncation[-quick].csv``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import rlobjectives  # noqa: E402

Inputs = harness.Inputs
MODULE = "bench_truncation"
WIDTH = 64  # the padded K of kept_ids

KEPT: dict[str, Callable[[Inputs], dict[str, Any]]] = {
    "kept_ids": lambda x: {"kept_ids": x["kept_ids"]},
    "kept_mask": lambda x: {"kept_mask": x["kept_mask"]},
    "top_k=50": lambda x: {"top_k": 50},
    "top_k=50 top_p=0.9": lambda x: {"top_k": 50, "top_p": 0.9},
    "top_p=0.9 (sorts V)": lambda x: {"top_p": 0.9},
}


def _make(tokens: int, hidden_size: int, vocab: int):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, tokens, hidden_size, generator=generator)
        weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
        ids = torch.randint(0, vocab, (1, tokens), generator=generator)
        kept = torch.randint(0, vocab, (1, tokens, WIDTH), generator=generator)
        kept[..., 0] = ids
        counts = torch.randint(8, WIDTH + 1, (1, tokens, 1), generator=generator)
        kept = torch.where(torch.arange(WIDTH) < counts, kept, -1)
        mask = torch.zeros(tokens, vocab, dtype=torch.bool)
        rows = torch.arange(tokens)[:, None].expand(-1, WIDTH)
        mask[rows[kept[0] >= 0], kept[0][kept[0] >= 0]] = True
        return {
            "hidden": hidden.to(device),
            "weight": weight.to(device),
            "tokens": ids.to(device),
            "kept_ids": kept.to(device),
            "kept_mask": mask.reshape(1, tokens, vocab).to(device),
            "old_log_probs": torch.full((1, tokens), -10.5, device=device),
            "advantages": torch.randn(1, generator=generator).to(device),
            "mask": torch.ones(1, tokens, dtype=torch.bool, device=device),
        }

    return make_inputs


def _log_probs(kept: Callable[[Inputs], dict[str, Any]] | None) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        options = {} if kept is None else kept(x)
        out = rlobjectives.token_log_probs_from_hidden(
            x["hidden"], x["weight"], x["tokens"], **options
        )
        return torch.where(torch.isfinite(out), out, 0.0)

    return run


def _loss(kept: Callable[[Inputs], dict[str, Any]] | None) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        options = {} if kept is None else kept(x)
        return rlobjectives.fused_policy_loss_from_hidden(
            x["hidden"], x["weight"], x["tokens"], x["old_log_probs"], x["advantages"],
            x["mask"], **options,
        ).loss  # fmt: skip

    return run


def shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(N, H, V) of the cases."""
    return [(1024, 256, 8000)] if quick else [(4096, 1024, 32000)]


def cases(
    *, quick: bool, device: str, shape: tuple[int, int, int] | None = None
) -> list[harness.Case]:
    result = []
    for tokens, hidden_size, vocab in [shape] if shape is not None else shapes(quick):
        shape = f"N={tokens} H={hidden_size} V={vocab}"
        make = _make(tokens, hidden_size, vocab)
        for operation, build, plain in (
            ("log_probs_from_hidden truncated", _log_probs, "token_log_probs_from_hidden"),
            ("fused_policy_loss truncated", _loss, "fused_policy_loss_from_hidden"),
        ):
            variants = [harness.Variant(f"{plain} (untruncated)", build(None), role="reference")]
            variants += [harness.Variant(name, build(kept)) for name, kept in KEPT.items()]
            result.append(
                harness.Case(
                    operation=operation,
                    shape=shape,
                    dtype=torch.float32,
                    make_inputs=make,
                    grad_inputs=("hidden", "weight"),
                    variants=tuple(variants),
                )
            )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "process"), default="process")
    parser.add_argument(
        "--keep-memory",
        action="store_true",
        help="glibc: keep freed memory mapped (no page faults in the times)",
    )
    parser.add_argument("--only", action="append", type=int, default=None, metavar="INDEX")
    parser.add_argument("--output", default=None, help="results stem (default truncation[-quick])")
    parser.add_argument("--shape", default=None, metavar="N,H,V", help="one shape instead")
    args = parser.parse_args(argv)  # fmt: skip
    torch.set_num_threads(args.threads)
    shape = None if args.shape is None else tuple(int(v) for v in args.shape.split(","))
    kept = args.keep_memory and harness.keep_memory_mapped()
    machine = harness.machine_line("cpu") + f" | clock: {args.clock}"
    machine += " | malloc: freed memory kept mapped" if kept else ""
    print(machine, flush=True)
    rows = harness.run_cases(
        MODULE, cases(quick=args.quick, device="cpu", shape=shape), device="cpu", quick=args.quick,
        warmup=args.warmup, repeats=args.repeats, threads=args.threads, memory=False,
        clock=args.clock, only=args.only, echo=lambda line: print(line, flush=True),
    )  # fmt: skip
    harness.print_table(rows, machine)
    stem = (
        args.output if args.output is not None else "truncation" + ("-quick" if args.quick else "")
    )
    if stem:
        csv_path, _ = harness.write_results(rows, machine, stem)
        print(f"wrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
