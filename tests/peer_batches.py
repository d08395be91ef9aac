"""The random float64 batches the peers' code was run on (issue 25), and their recorded outputs.

Each ``*_batch()`` regenerates, draw for draw, the inputs given to verl 0.9.1, TRL 1.16 and the
transcribed NeMo-RL / slime / SkyRL / prime-rl / OpenRLHF functions; ``peer_numbers.json`` holds
what they returned (a sum, a sum of magnitudes and a few entries per output). :func:`check`
compares a library result with one recorded output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

D = torch.float64
PEER_NUMBERS: dict[str, Any] = json.loads((Path(__file__).parent / "peer_numbers.json").read_text())


def check(name: str, actual: torch.Tensor, *, tol: float = 1e-12) -> None:
    """``actual`` has the recorded sum, sum of magnitudes and entries of peer output ``name``."""
    recorded = PEER_NUMBERS[name]
    flat = actual.detach().double().reshape(-1)
    finite = flat[torch.isfinite(flat)]
    scale = max(1.0, abs(recorded["abs_sum"]))
    assert abs(float(finite.sum()) - recorded["sum"]) <= tol * scale, (name, float(finite.sum()))
    assert abs(float(finite.abs().sum()) - recorded["abs_sum"]) <= tol * scale, name
    for index, value in recorded.get("at", {}).items():
        assert math.isclose(float(flat[int(index)]), value, rel_tol=tol, abs_tol=tol), (
            name,
            index,
            float(flat[int(index)]),
            value,
        )


def topk_batch() -> dict[str, torch.Tensor]:
    """Seed 25002: 41 tokens, V = 64, the teacher's top-8 (5 rows padded by 3 slots: -inf, id 0)."""
    generator = torch.Generator().manual_seed(25002)
    tokens, vocab, slots = 41, 64, 8
    student = torch.randn(tokens, vocab, generator=generator, dtype=D) * 1.5
    teacher = torch.log_softmax(
        student + torch.randn(tokens, vocab, generator=generator, dtype=D), -1
    )
    log_probs, ids = teacher.topk(slots, -1)
    padded_log_probs, padded_ids = log_probs.clone(), ids.clone()
    for row in (2, 9, 17, 30, 40):
        padded_log_probs[row, slots - 3 :] = -math.inf
        padded_ids[row, slots - 3 :] = 0
    mask = torch.rand(tokens, generator=generator) > 0.2
    low = student.clone()
    low[5, ids[5, 0]] = -40.0  # the teacher's top-1 below verl's log_prob_min_clamp for the student
    return {
        "student": student,
        "teacher_full": teacher,
        "log_probs": log_probs,
        "ids": ids,
        "padded_log_probs": padded_log_probs,
        "padded_ids": padded_ids,
        "mask": mask,
        "student_low": low,
    }


def reverse_batch() -> dict[str, torch.Tensor]:
    """Seed 25003: (6, 11) student and teacher log-probs; two log-ratios beyond +-20."""
    generator = torch.Generator().manual_seed(25003)
    batch, tokens = 6, 11
    student = -torch.rand(batch, tokens, generator=generator, dtype=D) * 4
    teacher = -torch.rand(batch, tokens, generator=generator, dtype=D) * 4
    student[0, 0], teacher[0, 0] = -0.1, -28.0
    student[1, 1], teacher[1, 1] = -26.0, -0.1
    mask = torch.rand(batch, tokens, generator=generator) > 0.25
    return {"student": student, "teacher": teacher, "mask": mask}


def jsd_batch() -> dict[str, torch.Tensor]:
    """Seed 25004: (3, 7, 23) student and teacher logits, labels with -100 at 30%."""
    generator = torch.Generator().manual_seed(25004)
    batch, tokens, vocab = 3, 7, 23
    student = torch.randn(batch, tokens, vocab, generator=generator, dtype=D) * 1.3
    teacher = torch.randn(batch, tokens, vocab, generator=generator, dtype=D) * 1.3
    labels = torch.randint(0, vocab, (batch, tokens), generator=generator)
    labels[torch.rand(batch, tokens, generator=generator) < 0.3] = -100
    return {"student": student, "teacher": teacher, "labels": labels}


def gdpo_batch() -> dict[str, Any]:
    """Seed 25005: 6 groups of 4, three components (binary, continuous, ties), response masks."""
    generator = torch.Generator().manual_seed(25005)
    groups, size = 6, 4
    count = groups * size
    rewards = torch.stack(
        [
            torch.randint(0, 2, (count,), generator=generator).to(D),
            torch.rand(count, generator=generator, dtype=D),
            torch.randint(0, 3, (count,), generator=generator).to(D) * 0.5,
        ],
        dim=1,
    )
    rewards[4:8, 0] = 1.0  # a group constant in component 0
    lengths = torch.randint(1, 9, (count,), generator=generator)
    mask = torch.arange(9).unsqueeze(0) < lengths.unsqueeze(1)
    return {"rewards": rewards, "group_size": size, "weights": [1.0, 0.5, 2.0], "mask": mask}


def maxrl_batch() -> dict[str, Any]:
    """Seed 25006: 5 groups of 8 binary rewards (none, all, mixed), then 13 continuous ones."""
    generator = torch.Generator().manual_seed(25006)
    size = 8
    rewards = torch.randint(0, 2, (5 * size,), generator=generator).to(D)
    rewards[:size] = 0.0
    rewards[size : 2 * size] = 1.0
    rewards[2 * size] = 1.0
    continuous = torch.rand(13, generator=generator, dtype=D)
    ids = torch.tensor([0, 1, 0, 2, 1, 0, 1, 2, 3, 0, 2, 1, 2])
    return {"rewards": rewards, "group_size": size, "continuous": continuous, "group_ids": ids}


def gae_batch() -> dict[str, torch.Tensor]:
    """Seed 25007: 7 rows of lengths 0..40 (a hole at 10..13 in row 5), rewards and values."""
    generator = torch.Generator().manual_seed(25007)
    batch, tokens = 7, 40
    lengths = torch.tensor([0, 1, 15, 20, 21, 33, 40])
    mask = torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)
    mask[5, 10:14] = False
    rewards = torch.where(mask, torch.randn(batch, tokens, generator=generator, dtype=D) * 0.1, 0.0)
    values = torch.randn(batch, tokens, generator=generator, dtype=D)
    return {"rewards": rewards, "values": values, "mask": mask}
