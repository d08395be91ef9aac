"""Log-probabilities and the GRPO loss from hidden states: chunked/fused vs materialised logits.

Operations (forward + backward with respect to ``hidden`` and ``weight``, float32):

- ``log_probs_from_hidden``: ``token_log_probs_from_hidden`` (ours, recompute in backward) vs the
  naive ``(hidden @ weight.T).log_softmax(-1).gather(...)`` (eager reference) and the same under
  ``torch.compile``. Backward with a ones gradient.
- ``fused_policy_loss``: ``fused_policy_loss_from_hidden`` (ours, gradients formed in forward) vs
  the naive log-probs followed by the trainer-style eager loss (``tests/eager_reference.py``), the
  same compiled, and Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (eager, ``loss_type="dapo"`` =
  token mean, no KL) when ``liger_kernel`` is importable -- a benchmark-only comparison row,
  never a dependency of the library. ``--chunk-size ROWS`` (repeatable) adds our fused loss at
  fixed chunk sizes: the sweep behind ``HEAD_BUDGET`` in ``src/rlobjectives/logprobs/head.py``.

Shapes (full run): N = B*T = 4096, H = 1024 and N = 8192, H = 256, each at V = 32000 and
V = 128000. Quick run: N = 1024, H = 256, V = 8000. Every token selected except a 10% tail.
Floor: the three matrix products alone, ``hidden @ W.T`` (N, H, V), ``grad @ W`` (N, V, H) and
``grad.T @ hidden`` (V, N, H), timed in the same run.

Activation memory = peak memory (fresh process) minus the gradient buffers every variant must
hold (``grad_hidden`` N*H and ``grad_weight`` V*H floats). ``python benchmarks/bench_logprobs.py``
runs this module alone (fewer repeats than ``run.py``: one call here is seconds on a CPU), prints
the table with the activation columns and writes ``results/logprobs[-quick].csv``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "tests"):
    sys.path.insert(0, str(_path))

import eager_reference as eager  # noqa: E402
import harness  # noqa: E402
import rlobjectives  # noqa: E402

Inputs = harness.Inputs
MODULE = "bench_logprobs"


def _make(batch: int, tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(batch, tokens, hidden_size, generator=generator).to(device)
        weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(
            device
        )
        ids = torch.randint(0, vocab, (batch, tokens), generator=generator).to(device)
        mask = torch.ones(batch, tokens, dtype=torch.bool, device=device)
        mask[:, int(0.9 * tokens) :] = False  # a padded tail
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        with torch.no_grad():
            old = torch.empty(batch, tokens, device=device)
            for b in range(batch):  # row by row: never the whole (N, V) here either
                logits = (hidden[b] @ weight.T).float()
                old[b] = torch.log_softmax(logits, -1).gather(-1, ids[b, :, None]).squeeze(-1)
                del logits
        noise = 0.2 * torch.randn(batch, tokens, generator=generator)
        return {
            "hidden": hidden,
            "weight": weight,
            "tokens": ids,
            "mask": mask,
            "old_log_probs": old + noise.to(device),
            "advantages": torch.randn(batch, generator=generator).to(device),
        }

    return make_inputs


def _naive_log_probs(x: Inputs) -> torch.Tensor:
    logits = x["hidden"] @ x["weight"].T  # (B, T, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1)


def _naive_loss(x: Inputs) -> torch.Tensor:
    log_probs = _naive_log_probs(x)
    return eager.policy_loss(log_probs, x["old_log_probs"], x["advantages"][:, None], x["mask"])


def _ours_log_probs(x: Inputs) -> torch.Tensor:
    return rlobjectives.token_log_probs_from_hidden(x["hidden"], x["weight"], x["tokens"])


def _ours_loss(x: Inputs, chunk_size: int | None = None) -> torch.Tensor:
    return rlobjectives.fused_policy_loss_from_hidden(
        x["hidden"],
        x["weight"],
        x["tokens"],
        x["old_log_probs"],
        x["advantages"],
        x["mask"],
        chunk_size=chunk_size,
    ).loss


def _ours_loss_chunked(chunk_size: int) -> harness.Variant:
    """Our fused loss at a fixed ``chunk_size`` (the sweep behind ``HEAD_BUDGET``)."""
    return harness.Variant(
        f"ours fused_policy_loss_from_hidden chunk_size={chunk_size}",
        lambda x: _ours_loss(x, chunk_size),
    )


def _liger_variant() -> harness.Variant | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception:  # noqa: BLE001 - any import failure (e.g. Triton missing) skips the row
        return None
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0, use_ref_model=False, compiled=False, loss_type="dapo", chunk_size=1
    )

    def liger(x: Inputs) -> torch.Tensor:
        out = loss_fn(
            x["hidden"],
            x["weight"],
            x["tokens"],
            x["mask"].long(),
            x["advantages"],
            old_per_token_logps=x["old_log_probs"],
        )
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]

    return harness.Variant("liger LigerFusedLinearGRPOLoss", liger)


def _floor(
    tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype = torch.float32
) -> harness.MatmulFloor:
    return harness.MatmulFloor(
        dtype=dtype,
        forward=((tokens, hidden_size, vocab),),
        forward_backward=(
            (tokens, hidden_size, vocab),  # hidden @ W.T
            (tokens, vocab, hidden_size),  # grad_logits @ W
            (vocab, tokens, hidden_size),  # grad_logits.T @ hidden
        ),
    )


def shapes(quick: bool, device: str = "cpu") -> list[tuple[int, int, int, int]]:
    """(B, T, H, V) of the cases; on a GPU one realistic bf16 shape: N=16k, H=4096, V=152k."""
    if device == "cuda" and not quick:
        return [(4, 4096, 4096, 152064)]
    if quick:
        return [(2, 512, 256, 8000)]
    return [(4, 1024, 1024, 32000), (8, 1024, 256, 32000), (4, 1024, 1024, 128000),
            (8, 1024, 256, 128000)]  # fmt: skip


def cases(*, quick: bool, device: str, chunk_sizes: Sequence[int] = ()) -> list[harness.Case]:
    """The cases; ``chunk_sizes`` adds our fused loss at each fixed chunk size to its cases."""
    result: list[harness.Case] = []
    liger = _liger_variant()
    dtype = torch.bfloat16 if device == "cuda" and not quick else torch.float32
    for batch, tokens, hidden_size, vocab in shapes(quick, device):
        shape = f"N={batch * tokens} H={hidden_size} V={vocab}"
        make = _make(batch, tokens, hidden_size, vocab, dtype)
        floor = _floor(batch * tokens, hidden_size, vocab, dtype)
        result.append(
            harness.Case(
                operation="log_probs_from_hidden",
                shape=shape,
                dtype=dtype,
                make_inputs=make,
                grad_inputs=("hidden", "weight"),
                variants=(
                    harness.Variant("naive eager", _naive_log_probs, role="reference"),
                    harness.Variant("naive eager", _naive_log_probs, compile=True),
                    harness.Variant("ours token_log_probs_from_hidden", _ours_log_probs),
                ),
                floor=floor,
            )
        )
        loss_variants = [
            harness.Variant("naive eager (unfused loss)", _naive_loss, role="reference"),
            harness.Variant("naive eager (unfused loss)", _naive_loss, compile=True),
            harness.Variant("ours fused_policy_loss_from_hidden", _ours_loss),
            *(_ours_loss_chunked(chunk) for chunk in chunk_sizes),
        ]
        if liger is not None:
            loss_variants.append(liger)
        result.append(
            harness.Case(
                operation="fused_policy_loss",
                shape=shape,
                dtype=dtype,
                make_inputs=make,
                grad_inputs=("hidden", "weight"),
                variants=tuple(loss_variants),
                floor=floor,
            )
        )
    return result


# ------------------------------------------------------------------------- standalone entry point
@dataclasses.dataclass
class ActivationRow:
    row: harness.Row
    gradient_mib: float
    activation_mib: float | None
    activation_vs_reference: float | None


def _gradient_mib(shape: str, dtype: str = "float32") -> float:
    sizes = dict(part.split("=") for part in shape.split())
    tokens, hidden_size, vocab = int(sizes["N"]), int(sizes["H"]), int(sizes["V"])
    size = 2 if dtype in ("bfloat16", "float16") else 4
    return (tokens * hidden_size + vocab * hidden_size) * size / harness.MIB


def with_activation(rows: Sequence[harness.Row]) -> list[ActivationRow]:
    """Add activation memory (peak minus grad_hidden and grad_weight) and its ratio to naive."""
    out: list[ActivationRow] = []
    for row in rows:
        gradients = _gradient_mib(row.shape, row.dtype)
        activation = None if row.peak_mib is None else max(row.peak_mib - gradients, 0.0)
        out.append(ActivationRow(row, gradients, activation, None))
    for item in out:
        reference = next(
            (
                other
                for other in out
                if other.row.role == "reference"
                and other.row.operation == item.row.operation
                and other.row.shape == item.row.shape
            ),
            None,
        )
        if reference is not None and reference.activation_mib and item.activation_mib is not None:
            item.activation_vs_reference = item.activation_mib / reference.activation_mib
    return out


def format_rows(rows: Sequence[ActivationRow]) -> str:
    header = ["operation", "shape", "variant", "fwd+bwd ms", "spread", "x ref", "x floor",
              "peak MiB", "activation MiB", "act x ref"]  # fmt: skip

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    body = [
        [
            item.row.operation,
            item.row.shape,
            item.row.variant,
            f"{item.row.fwd_bwd_ms:.1f}",
            f"{item.row.fwd_bwd_min_ms:.0f}-{item.row.fwd_bwd_max_ms:.0f}",
            number(item.row.vs_reference, "{:.2f}"),
            number(item.row.vs_floor, "{:.2f}"),
            number(item.row.peak_mib, "{:.0f}"),
            number(item.activation_mib, "{:.0f}"),
            number(item.activation_vs_reference, "{:.3f}"),
        ]
        for item in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * width for width in widths))
    lines += [
        " | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in body
    ]
    return "\n".join(lines)


def write_csv(rows: Sequence[ActivationRow], machine: str, stem: str) -> Path:
    harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = harness.RESULTS_DIR / f"{stem}.csv"
    fields = [field.name for field in dataclasses.fields(harness.Row)]
    fields += ["gradient_mib", "activation_mib", "activation_vs_reference"]
    with open(path, "w", newline="") as handle:
        handle.write(f"# {machine}\n")
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for item in rows:
            record = dataclasses.asdict(item.row)
            record.update(
                gradient_mib=round(item.gradient_mib, 3),
                activation_mib=item.activation_mib,
                activation_vs_reference=item.activation_vs_reference,
            )
            writer.writerow(record)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="wall clock, or process CPU time (shared machines)")  # fmt: skip
    parser.add_argument("--only", action="append", type=int, default=None, metavar="INDEX",
                        help="case indices to run (repeatable); default all")  # fmt: skip
    parser.add_argument("--chunk-size", action="append", type=int, default=[], metavar="ROWS",
                        help="also time our fused loss at this chunk_size")  # fmt: skip
    parser.add_argument("--output", default=None, help="results stem (default logprobs[-quick])")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = harness.machine_line(args.device)
    if args.device == "cpu" and args.clock == "process":
        machine += " | clock: process CPU time"
    print(machine, flush=True)
    all_cases = cases(quick=args.quick, device=args.device, chunk_sizes=args.chunk_size)
    rows = harness.run_cases(
        MODULE,
        all_cases,
        device=args.device,
        quick=args.quick,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        memory=not args.no_memory,
        clock=args.clock,
        only=args.only,
        echo=lambda line: print(line, flush=True),
    )
    table = with_activation(rows)
    print(format_rows(table))
    stem = args.output or ("logprobs-quick" if args.quick else "logprobs") + (
        "" if args.device == "cpu" else f"-{args.device}"
    )
    if stem:
        print(f"wrote {write_csv(table, machine, stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
