"""The LM head as trainers and samplers compute it: log-probs from hidden states (issue 33).

Operation: ``token_log_probs_from_hidden`` forward + backward with respect to ``hidden`` and
``weight``, float32 on CPU (the issue's shape: N = 4096, H = 1024, V = 32000), against

- TRL 1.16's ``trl.kernels.ChunkedLogProbFunction`` (its CPU path: ``(4096, 32768)`` tiles folded
  in torch, the chunk size ``add_fused_lm_head`` uses), log-probs alone, with the entropy, with
  all four statistics, and with a softcap and logit scale;
- the naive path ``log_softmax(hidden @ weight.T).gather(...)`` (the eager reference);
- the floor: the three matrix products ``hidden @ W.T``, ``grad @ W``, ``grad.T @ hidden``.

Ours: the log-probs alone, with the entropy (``return_entropy=True``), with all four
``statistics``, with ``final_logit_softcapping`` (+ ``logit_scale``), and the log-probs with
every chunk recomputed in backward (``SAVED_LOGITS = 0``, the four-GEMM path the default
replaces). Activation memory = peak memory (fresh process) minus ``grad_hidden`` and
``grad_weight``. ``python benchmarks/bench_head.py --threads 1 --clock process`` runs it alone
and writes ``results/head[-quick].csv``; ``--quick``: N = 1024, H = 256, V = 8000.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "tests"):
    sys.path.insert(0, str(_path))

import bench_logprobs  # noqa: E402
import harness  # noqa: E402
import rlobjectives  # noqa: E402
from rlobjectives.logprobs import saved_logits  # noqa: E402

Inputs = harness.Inputs
MODULE = "bench_head"
STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: TRL's ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (vocabulary columns per tile) in ``add_fused_lm_head``.
TRL_CHUNK = 32768
SOFTCAP = {"final_logit_softcapping": 30.0, "logit_scale": 0.5}
#: ``--variant``: the variants to time besides the reference (None: all)
ONLY: set[str] | None = None


def _make(tokens: int, hidden_size: int, vocab: int) -> Callable[[torch.device], Inputs]:
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        return {
            "hidden": torch.randn(tokens, hidden_size, generator=generator).to(device),
            "weight": (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5)
            .mul(4.0)
            .to(device),
            "tokens": torch.randint(0, vocab, (tokens,), generator=generator).to(device),
        }

    return make_inputs


def _naive(x: Inputs) -> torch.Tensor:
    logits = x["hidden"] @ x["weight"].T
    return torch.log_softmax(logits, -1).gather(-1, x["tokens"][:, None]).squeeze(-1)


def _ours(
    statistics: Sequence[str] | None = None, **options: object
) -> Callable[[Inputs], torch.Tensor]:
    def run(x: Inputs) -> torch.Tensor:
        out = rlobjectives.token_log_probs_from_hidden(
            x["hidden"], x["weight"], x["tokens"], cu_seqlens=_whole(x), statistics=statistics,
            **options,  # type: ignore[arg-type]
        )  # fmt: skip
        if statistics is None:
            return out  # type: ignore[return-value]
        return out.log_probs + out.entropy  # type: ignore[union-attr,operator]

    return run


def _whole(x: Inputs) -> torch.Tensor:
    return torch.tensor([0, x["tokens"].shape[0]], device=x["tokens"].device)


def _recomputed(x: Inputs) -> torch.Tensor:
    budget = saved_logits.SAVED_LOGITS
    saved_logits.SAVED_LOGITS = 0
    try:
        out = rlobjectives.token_log_probs_from_hidden(
            x["hidden"], x["weight"], x["tokens"], cu_seqlens=_whole(x)
        )
    finally:
        saved_logits.SAVED_LOGITS = budget
    return out  # the backward reads SAVED_LOGITS from the forward's record, not the module


def _trl(outputs: tuple[str, ...], **options: object) -> Callable[[Inputs], torch.Tensor] | None:
    if importlib.util.find_spec("trl") is None:
        return None
    from trl.kernels import ChunkedLogProbFunction

    softcap = options.get("final_logit_softcapping")
    scale = options.get("logit_scale", 1.0)

    def run(x: Inputs) -> torch.Tensor:
        out = ChunkedLogProbFunction.apply(
            x["hidden"], x["weight"], None, x["tokens"], 1.0, TRL_CHUNK, softcap, scale, outputs
        )
        return out[0] if out[1] is None else out[0] + out[1]  # type: ignore[no-any-return]

    return run


def shapes(quick: bool) -> list[tuple[int, int, int]]:
    """``(N, H, V)``: the issue's CPU shape (quick: a small one)."""
    return [(1024, 256, 8000)] if quick else [(4096, 1024, 32000)]


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    result = []
    for tokens, hidden_size, vocab in shapes(quick):
        variants = [
            harness.Variant("naive eager", _naive, role="reference"),
            harness.Variant("ours log-probs", _ours()),
            harness.Variant("ours log-probs, recomputed (4 GEMMs)", _recomputed),
            harness.Variant("ours log-probs + entropy", _ours(("entropy",))),
            harness.Variant("ours all four statistics", _ours(STATS)),
            harness.Variant("ours log-probs, softcap + scale", _ours(**SOFTCAP)),
            harness.Variant("ours log-probs + entropy, softcap + scale", _ours(("entropy",),
                                                                               **SOFTCAP)),
        ]  # fmt: skip
        for name, outputs, options in (
            ("TRL ChunkedLogProbFunction log-probs", (), {}),
            ("TRL ChunkedLogProbFunction + entropy", ("entropy",), {}),
            ("TRL ChunkedLogProbFunction all four", STATS, {}),
            ("TRL ChunkedLogProbFunction log-probs, softcap + scale", (), SOFTCAP),
        ):
            fn = _trl(outputs, **options)
            if fn is not None:
                variants.append(harness.Variant(name, fn))
        if ONLY is not None:
            variants = [v for v in variants if v.role == "reference" or v.name in ONLY]
        result.append(
            harness.Case(
                operation="log_probs_from_hidden",
                shape=f"N={tokens} H={hidden_size} V={vocab}",
                dtype=torch.float32,
                make_inputs=_make(tokens, hidden_size, vocab),
                grad_inputs=("hidden", "weight"),
                variants=tuple(variants),
                floor=bench_logprobs._floor(tokens, hidden_size, vocab),
            )
        )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--clock", choices=("wall", "process"), default="process")
    parser.add_argument("--output", default=None, help="results stem (default head[-quick])")
    parser.add_argument(
        "--variant", action="append", default=None, metavar="NAME",
        help="time only these variants and the reference (with --no-memory)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.variant is not None:
        if not args.no_memory:
            parser.error("--variant needs --no-memory (the memory runs rebuild every variant)")
        global ONLY
        ONLY = set(args.variant)
    torch.set_num_threads(args.threads)
    machine = harness.machine_line("cpu")
    if args.clock == "process":
        machine += " | clock: process CPU time"
    print(machine, flush=True)
    rows = harness.run_cases(
        MODULE, cases(quick=args.quick, device="cpu"), device="cpu", quick=args.quick,
        warmup=args.warmup, repeats=args.repeats, threads=args.threads,
        memory=not args.no_memory, clock=args.clock, echo=lambda line: print(line, flush=True),
    )  # fmt: skip
    table = bench_logprobs.with_activation(rows)
    print(bench_logprobs.format_rows(table))
    stem = args.output or ("head-quick" if args.quick else "head")
    print(f"wrote {bench_logprobs.write_csv(table, machine, stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
