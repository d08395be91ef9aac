"""The DPO loss from hidden states: ``preference_loss_from_hidden`` vs Liger and the naive path.

Operation: forward + backward with respect to ``hidden`` and ``weight`` of the DPO loss of ``B``
pairs (``2B`` rows of ``T`` tokens, the ``[chosen; rejected]`` batch TRL and Liger use, 90% of
each row selected), float32, reference log-probabilities given (per-sequence sums; they cost no
matrix product in any variant):

- ``naive eager`` (the ratio reference): the full ``(2B, T, V)`` logits, ``log_softmax``,
  ``gather``, the masked sums and ``-logsigmoid(beta * margin)`` in eager PyTorch;
- ``ours preference_loss_from_hidden`` (``DPO(beta=0.1)``): three matrix products per token
  (``src/rlobjectives/preference/hidden/driver.py``);
- ``liger LigerFusedLinearDPOLoss`` (Liger-Kernel 0.8.5, ``chunk_size=1`` pair per chunk,
  ``use_ref_model=False``: its reference log-probabilities are 0, ours are given as zeros),
  eager (``compiled=False``) and, when ``torch.compile`` works here, compiled;
- the floor: the three matrix products alone (``hidden @ W.T``, ``grad @ W``,
  ``grad.T @ hidden``), timed in the same run.

Activation memory = peak (fresh process) minus ``grad_hidden`` and ``grad_weight``, as in
``bench_logprobs.py``. ``python benchmarks/bench_preference.py --threads 1 --clock process``
(the issue's setting: B = 8 pairs, T = 1024, H = 1024, V = 32000) prints the table and writes
``results/preference[-quick].csv``; ``--quick`` runs a small shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_logprobs  # noqa: E402
import harness  # noqa: E402
import rlobjectives  # noqa: E402

Inputs = harness.Inputs
MODULE = "bench_preference"
BETA = 0.1


def _make(pairs: int, tokens: int, hidden_size: int, vocab: int):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        rows = 2 * pairs
        hidden = torch.randn(rows, tokens, hidden_size, generator=generator)
        weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
        ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
        mask = torch.ones(rows, tokens, dtype=torch.bool)
        mask[:, int(0.9 * tokens) :] = False
        return {
            "hidden": hidden.to(device),
            "weight": weight.to(device),
            "tokens": ids.to(device),
            "mask": mask.to(device),
            "ref": torch.zeros(rows, device=device),
            "target": torch.where(mask, ids, -100).to(device),
        }

    return make_inputs


def _naive(x: Inputs) -> torch.Tensor:
    logits = x["hidden"] @ x["weight"].T  # (2B, T, V)
    log_probs = torch.log_softmax(logits, -1).gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1)
    sums = torch.where(x["mask"], log_probs, 0.0).sum(-1) - x["ref"]
    chosen, rejected = sums.chunk(2)
    return -F.logsigmoid(BETA * (chosen - rejected)).mean()


def _ours(x: Inputs) -> torch.Tensor:
    return rlobjectives.preference_loss_from_hidden(
        x["hidden"], x["weight"], x["tokens"], x["mask"],
        objective=rlobjectives.DPO(beta=BETA), ref_log_probs=x["ref"],
    ).loss  # fmt: skip


def _liger_variants() -> list[harness.Variant]:
    if importlib.util.find_spec("liger_kernel") is None:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    except Exception:  # noqa: BLE001 - any import failure skips the rows
        return []
    variants = []
    for compiled in (False, True):
        loss_fn = LigerFusedLinearDPOLoss(
            beta=BETA, use_ref_model=False, compiled=compiled, chunk_size=1
        )

        def liger(x: Inputs, loss_fn: LigerFusedLinearDPOLoss = loss_fn) -> torch.Tensor:
            out = loss_fn(x["weight"], x["hidden"], x["target"])
            return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]

        label = "liger LigerFusedLinearDPOLoss" + (" (compiled=True)" if compiled else "")
        variants.append(harness.Variant(label, liger))
    return variants


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(B pairs, T, H, V)."""
    if quick:
        return [(2, 256, 256, 8000)]
    return [(8, 1024, 1024, 32000)]


def cases(*, quick: bool, device: str, liger_compiled: bool = True) -> list[harness.Case]:
    """The cases (the same list in the fresh memory processes)."""
    result = []
    liger = _liger_variants()
    if not liger_compiled:
        liger = [v for v in liger if "compiled" not in v.name]
    for pairs, tokens, hidden_size, vocab in shapes(quick):
        rows = 2 * pairs * tokens
        result.append(
            harness.Case(
                operation="dpo_loss_from_hidden",
                shape=f"N={rows} H={hidden_size} V={vocab}",
                dtype=torch.float32,
                make_inputs=_make(pairs, tokens, hidden_size, vocab),
                grad_inputs=("hidden", "weight"),
                variants=(
                    harness.Variant("naive eager", _naive, role="reference"),
                    harness.Variant("ours preference_loss_from_hidden", _ours),
                    *liger,
                ),
                floor=bench_logprobs._floor(rows, hidden_size, vocab),
            )
        )
    return result


def _saved_or_none(
    case: harness.Case, variant: harness.Variant, device: torch.device
) -> float | None:
    """The harness's saved-for-backward MiB; None where the variant refuses saved-tensor hooks
    (Liger's ``torch.func.grad_and_value``)."""
    try:
        return _SAVED(case, variant, device)
    except RuntimeError:
        return None


_SAVED = harness.saved_for_backward_mib
harness.saved_for_backward_mib = _saved_or_none


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--clock", choices=("wall", "process"), default="process")
    parser.add_argument("--no-liger-compiled", action="store_true",
                        help="skip Liger with torch.compile (a C++ toolchain on CPU)")  # fmt: skip
    parser.add_argument("--output", default=None, help="results stem (default preference[-quick])")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = harness.machine_line(args.device)
    if args.device == "cpu" and args.clock == "process":
        machine += " | clock: process CPU time"
    print(machine, flush=True)
    all_cases = cases(quick=args.quick, device=args.device,
                      liger_compiled=not args.no_liger_compiled)  # fmt: skip
    rows = harness.run_cases(
        MODULE, all_cases, device=args.device, quick=args.quick, warmup=args.warmup,
        repeats=args.repeats, threads=args.threads, memory=not args.no_memory, clock=args.clock,
        echo=lambda line: print(line, flush=True),
    )  # fmt: skip
    table = bench_logprobs.with_activation(rows)
    print(bench_logprobs.format_rows(table))
    stem = args.output or ("preference-quick" if args.quick else "preference")
    print(f"wrote {bench_logprobs.write_csv(table, machine, stem)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
