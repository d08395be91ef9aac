"""Top-k distillation from hidden states: chunked/fused vs the materialised-logits path (issue 25).

Operation (forward + backward with respect to ``hidden`` and ``weight``, float32): the sparse
top-k forward KL with the tail bucket, token mean over the selected tokens, from the teacher's
top-K log-probabilities and ids (a teacher served by an engine):

- ``naive eager`` (reference): ``logits = hidden @ weight.T`` (N, V), ``log_softmax``, gather at
  the teacher's ids, the tail bucket ``log(1 - sum exp)`` as TRL's server distillation writes it
  (``_add_tail_bucket``), the KL, a masked mean; and the same under ``torch.compile``;
- ``ours topk_forward_kl (materialised logits)``: ``hidden @ weight.T`` then the library's logits
  function (chunked over the logits, closed-form gradient);
- ``ours topk_forward_kl_from_hidden``: the chunked LM head, gradients formed in the forward pass;
  no (N, V) tensor;
- ``verl compute_forward_kl_topk`` (when ``verl`` is importable; a benchmark-only peer row):
  ``hidden @ weight.T`` then verl 0.9.1's own FSDP ``compute_forward_kl_topk`` (its default
  ``log_softmax`` path, and ``use_chunked_topk=True``; both also take the student's own top-k
  for verl's overlap metrics), ``clamp_min(0)`` and the masked token mean, as verl's
  ``forward_kl_topk`` loss does (head only, ``log_prob_min_clamp=-10``, the dataclass default).

Shapes: N = 4096, H = 1024, V = 32000, K = 64 (the issue's row); quick: N = 1024, H = 256,
V = 8000, K = 16. 90% of the tokens selected. Floor: the three matrix products alone. Activation
memory = peak (fresh process) minus ``grad_hidden`` and ``grad_weight``, as in
``bench_logprobs.py``. ``python benchmarks/bench_distillation.py`` runs it alone and writes
``results/distillation[-quick].csv``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_logprobs  # noqa: E402
import harness  # noqa: E402
import rlobjectives  # noqa: E402

Inputs = harness.Inputs
MODULE = "bench_distillation"


def _make(tokens: int, hidden_size: int, vocab: int, slots: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, tokens, hidden_size, generator=generator)
        weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
        # the teacher: the student's logits of a perturbed head, its top-K log-probabilities
        teacher_log_probs = torch.empty(1, tokens, slots)
        teacher_ids = torch.empty(1, tokens, slots, dtype=torch.int64)
        noise = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
        with torch.no_grad():
            for start in range(0, tokens, 512):  # never the whole (N, V) here either
                rows = slice(start, start + 512)
                logits = hidden[0, rows] @ (weight + 0.3 * noise).T
                values, ids = torch.log_softmax(logits, -1).topk(slots, -1)
                teacher_log_probs[0, rows], teacher_ids[0, rows] = values, ids
        mask = torch.ones(1, tokens, dtype=torch.bool)
        mask[:, int(0.9 * tokens) :] = False
        return {
            "hidden": hidden.to(device, dtype),
            "weight": weight.to(device, dtype),
            "teacher_log_probs": teacher_log_probs.to(device),
            "teacher_ids": teacher_ids.to(device),
            "mask": mask.to(device),
        }

    return make_inputs


def _naive(x: Inputs) -> torch.Tensor:
    """The materialised path as trainers write it (TRL's tail bucket, one masked mean)."""
    logits = (x["hidden"] @ x["weight"].T).float()  # (1, N, V)
    student = torch.log_softmax(logits, -1).gather(-1, x["teacher_ids"])  # (1, N, K)
    teacher = x["teacher_log_probs"]

    def bucket(log_probs: torch.Tensor) -> torch.Tensor:
        log_sum = torch.clamp(torch.logsumexp(log_probs, -1, keepdim=True), max=-1e-7)
        return torch.cat([log_probs, torch.log(-torch.expm1(log_sum))], -1)

    student, teacher = bucket(student), bucket(teacher)
    per_token = (teacher.exp() * (teacher - student)).sum(-1)  # (1, N)
    mask = x["mask"]
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _ours_logits(x: Inputs) -> torch.Tensor:
    logits = x["hidden"] @ x["weight"].T
    return rlobjectives.topk_forward_kl(logits, x["teacher_log_probs"], x["teacher_ids"], x["mask"])


def _ours_hidden(x: Inputs) -> torch.Tensor:
    return rlobjectives.topk_forward_kl_from_hidden(
        x["hidden"], x["weight"], x["teacher_log_probs"], x["teacher_ids"], x["mask"]
    )


def _verl_variants() -> list[harness.Variant]:
    """verl 0.9.1's FSDP ``compute_forward_kl_topk`` on materialised logits, when importable."""
    if importlib.util.find_spec("verl") is None:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from verl.trainer.distillation.fsdp import losses as verl_losses
    except Exception:  # noqa: BLE001 - any import failure skips the peer rows
        return []

    def variant(chunked: bool) -> harness.Variant:
        loss_config = types.SimpleNamespace(
            use_chunked_topk=chunked, chunked_topk_chunk_size=4096, log_prob_min_clamp=-10.0
        )
        config = types.SimpleNamespace(distillation_loss=loss_config)

        def verl(x: Inputs) -> torch.Tensor:
            logits = x["hidden"] @ x["weight"].T  # (1, N, V)
            tokens = logits.shape[1]
            offsets = torch.tensor([0, tokens], device=logits.device)
            nested = [
                torch.nested.nested_tensor_from_jagged(x[name][0], offsets)
                for name in ("teacher_log_probs", "teacher_ids")
            ]
            out = verl_losses.compute_forward_kl_topk(logits, *nested, config, "thd")
            per_token = out["distillation_losses"].clamp_min(0.0)  # (1, N)
            mask = x["mask"]
            return (per_token * mask).sum() / mask.sum().clamp(min=1)

        suffix = " use_chunked_topk" if chunked else ""
        return harness.Variant(f"verl compute_forward_kl_topk{suffix}", verl)

    return [variant(False), variant(True)]


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(N, H, V, K) of the cases."""
    return [(1024, 256, 8000, 16)] if quick else [(4096, 1024, 32000, 64)]


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    """The top-k distillation case(s)."""
    result = []
    for tokens, hidden_size, vocab, slots in shapes(quick):
        result.append(
            harness.Case(
                operation="topk_distillation_from_hidden",
                shape=f"N={tokens} H={hidden_size} V={vocab} K={slots}",
                dtype=torch.float32,
                make_inputs=_make(tokens, hidden_size, vocab, slots, torch.float32),
                grad_inputs=("hidden", "weight"),
                variants=(
                    harness.Variant("naive eager", _naive, role="reference"),
                    harness.Variant("naive eager", _naive, compile=True),
                    harness.Variant("ours topk_forward_kl (materialised logits)", _ours_logits),
                    harness.Variant("ours topk_forward_kl_from_hidden", _ours_hidden),
                    *_verl_variants(),
                ),
                floor=bench_logprobs._floor(tokens, hidden_size, vocab),
            )
        )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--output", default=None, help="results stem (distillation[-quick])")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = harness.machine_line("cpu")
    if args.clock == "process":
        machine += " | clock: process CPU time"
    print(machine, flush=True)
    rows = harness.run_cases(
        MODULE,
        cases(quick=args.quick, device="cpu"),
        device="cpu",
        quick=args.quick,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        memory=not args.no_memory,
        clock=args.clock,
        echo=lambda line: print(line, flush=True),
    )
    table = bench_logprobs.with_activation(rows)
    print(bench_logprobs.format_rows(table))
    stem = args.output or ("distillation-quick" if args.quick else "distillation")
    print(f"wrote {bench_logprobs.write_csv(table, machine, stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
