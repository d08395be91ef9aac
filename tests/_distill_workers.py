"""Spawned ranks of the distillation losses' multi-process test (2 real gloo processes).

Each rank holds two of the four sequences of :func:`distill_problem` and splits them into two
micro-batches of one sequence; the normaliser of the optimizer step comes from
``global_normalizers`` over the ranks; the losses (from hidden states) and the ``weight``
gradients are summed over the micro-batches and all-reduced. The test compares them with the
single-process full batch. Launched with ``_dist_workers.launch`` (one spawn per module).
"""

from __future__ import annotations

import datetime
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import rlobjectives as rlo
from rlobjectives.distributed import global_normalizers, normalizer_for_reduction

REDUCTIONS = ("token_mean", "sequence_mean")
LOSSES = ("topk_forward_kl", "reverse_kl_loss", "generalized_jsd_loss")
RANK_ROWS = ((0, 1), (2, 3))


def distill_problem() -> dict[str, torch.Tensor]:
    """4 sequences of 6 tokens (lengths 6, 3, 0, 5), H = 8, V = 11, teacher top-3, float64."""
    generator = torch.Generator().manual_seed(25)
    hidden = torch.randn(4, 6, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64)
    teacher_hidden = torch.randn(4, 6, 8, generator=generator, dtype=torch.float64)
    teacher_weight = torch.randn(11, 8, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(teacher_hidden @ teacher_weight.T, -1)
    top_log_probs, top_ids = teacher.topk(3, -1)
    tokens = torch.randint(0, 11, (4, 6), generator=generator)
    mask = torch.arange(6) < torch.tensor([6, 3, 0, 5])[:, None]
    return {
        "hidden": hidden,
        "weight": weight,
        "teacher_hidden": teacher_hidden,
        "teacher_weight": teacher_weight,
        "top_log_probs": top_log_probs,
        "top_ids": top_ids,
        "tokens": tokens,
        "teacher_token_log_probs": teacher.gather(-1, tokens[..., None])[..., 0],
        "mask": mask,
    }


def distill_loss(
    name: str, part: dict[str, torch.Tensor], weight: torch.Tensor, **options: Any
) -> torch.Tensor:
    """One loss from hidden states on the rows of ``part`` (``weight`` the student's head; the
    reverse KL with its unbiased straight-through gradient)."""
    if name == "topk_forward_kl":
        return rlo.topk_forward_kl_from_hidden(
            part["hidden"], weight, part["top_log_probs"], part["top_ids"], part["mask"], **options
        )
    if name == "reverse_kl_loss":
        return rlo.reverse_kl_loss_from_hidden(
            part["hidden"], weight, part["tokens"], part["teacher_token_log_probs"], part["mask"],
            straight_through=True, **options,
        )  # fmt: skip
    return rlo.generalized_jsd_loss_from_hidden(
        part["hidden"], weight, part["teacher_hidden"], part["teacher_weight"], part["mask"],
        beta=0.3, **options,
    )  # fmt: skip


def rows_of(problem: dict[str, torch.Tensor], rows: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The sequences ``rows`` of the problem (the heads shared)."""
    index = torch.tensor(rows)
    return {
        key: value if key.endswith("weight") else value[index] for key, value in problem.items()
    }


def rank_results(rank: int) -> dict[str, Any]:
    problem = distill_problem()
    micro_batches = [rows_of(problem, (row,)) for row in RANK_ROWS[rank]]
    counts = global_normalizers([part["mask"] for part in micro_batches])  # all-reduced
    results: dict[str, Any] = {}
    for name in LOSSES:
        for reduction in REDUCTIONS:
            normalizer = normalizer_for_reduction(counts, reduction=reduction)
            weight = problem["weight"].clone().requires_grad_(True)
            total = torch.zeros((), dtype=torch.float64)
            for part in micro_batches:
                loss = distill_loss(name, part, weight, reduction=reduction, normalizer=normalizer)
                loss.backward()
                total = total + loss.detach()
            assert weight.grad is not None
            grad = weight.grad.clone()
            dist.all_reduce(total)
            dist.all_reduce(grad)
            results[f"{name}/{reduction}"] = {"loss": total, "grad_weight": grad}
    return results


def distill_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry point of a spawned rank: results to ``rank{r}.pt``, traceback to ``rank{r}.err``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60.0),
        )
        torch.save(rank_results(rank), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["LOSSES", "REDUCTIONS", "distill_loss", "distill_problem", "distill_worker"]
