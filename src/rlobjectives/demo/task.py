"""The demo's verifiable task: transform a short digit sequence, generated on the fly.

A prompt is ``length`` random digits followed by a separator; the correct response is the
transformed digits followed by an end-of-sequence token:

- ``"sort-unique"``: the distinct digits in increasing order (``3 1 3 0`` -> ``0 1 3``), so the
  correct response length varies from prompt to prompt;
- ``"sort"``: all digits in increasing order;
- ``"reverse"``: the digits in reverse order.

Rewards are checked exactly, position by position: the partial credit is the fraction of the
``n + 1`` target positions (``n`` digits and the end token) that the response gets right, the
exact match is 1 when all of them are right, and the reward is their average, in ``[0, 1]``.

Prompts are split once and for all into a training part (about 90%) and a held-out part by a fixed
hash of the digits, so held-out accuracy measures prompts the policy never trained on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TASKS", "DigitTask", "Rewards"]

TASKS = ("sort-unique", "sort", "reverse")
NUM_DIGITS = 10
SEPARATOR = 10
END = 11
PAD = 12
VOCAB_SIZE = 13
_HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash
_HELD_OUT_BUCKETS = 10  # one bucket in ten is held out


class Rewards(NamedTuple):
    """Per-sequence rewards ``(B,)`` of a batch of responses (float32).

    Attributes:
        reward: ``(partial_credit + exact_match) / 2``.
        exact_match: 1.0 when the response equals the target (end token included), else 0.0.
        partial_credit: fraction of target positions answered correctly.
    """

    reward: torch.Tensor
    exact_match: torch.Tensor
    partial_credit: torch.Tensor


class DigitTask:
    """Prompts, targets and rewards of one digit task.

    Args:
        kind: one of :data:`TASKS`.
        length: digits per prompt.
    """

    def __init__(self, kind: str = "sort-unique", *, length: int = 6) -> None:
        if kind not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {kind!r}")
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        self.kind = kind
        self.length = length
        self.vocab_size = VOCAB_SIZE
        self.pad = PAD
        self.end = END
        self.prompt_length = length + 1  # digits and the separator
        self.max_response_length = length + 1  # digits and the end token
        self.context_length = self.prompt_length + self.max_response_length

    def is_held_out(self, digits: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool: the digits ``(B, length)`` belong to the held-out split."""
        powers = NUM_DIGITS ** torch.arange(self.length - 1, -1, -1, dtype=torch.int64)
        code = (digits.to(torch.int64) * powers).sum(-1)  # (B,)
        hashed = (code * _HASH_MULTIPLIER) % (1 << 32)
        return (hashed >> 16) % _HELD_OUT_BUCKETS == 0

    def sample_digits(
        self, count: int, generator: torch.Generator, *, held_out: bool
    ) -> torch.Tensor:
        """``(count, length)`` uniformly random digits from the training or held-out split."""
        kept: list[torch.Tensor] = []
        found = 0
        while found < count:
            # Draw extra rows so that one or two rounds suffice for either split.
            draw = 12 * count if held_out else 2 * count
            digits = torch.randint(NUM_DIGITS, (draw, self.length), generator=generator)
            digits = digits[self.is_held_out(digits) == held_out]
            kept.append(digits)
            found += digits.shape[0]
        return torch.cat(kept)[:count]

    def prompts(self, digits: torch.Tensor) -> torch.Tensor:
        """``(B, length + 1)`` prompt tokens: the digits and the separator."""
        separator = torch.full((digits.shape[0], 1), SEPARATOR, dtype=torch.int64)
        return torch.cat([digits.to(torch.int64), separator], dim=1)

    def targets(self, digits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target responses ``(B, length + 1)`` (digits, end token, padding) and lengths ``(B,)``.

        The length counts the end token.
        """
        digits = digits.to(torch.int64)
        batch = digits.shape[0]
        if self.kind == "reverse":
            body = digits.flip(-1)  # (B, n)
            lengths = torch.full((batch,), self.length + 1, dtype=torch.int64)
        elif self.kind == "sort":
            body = digits.sort(-1).values  # (B, n)
            lengths = torch.full((batch,), self.length + 1, dtype=torch.int64)
        else:
            present = torch.zeros(batch, NUM_DIGITS, dtype=torch.bool)
            present.scatter_(1, digits, True)  # (B, 10)
            # Present digits first, in increasing order; absent ones are pushed to the end.
            order = torch.where(present, torch.arange(NUM_DIGITS), NUM_DIGITS + 1)
            body = order.sort(-1).values[:, : self.length]  # (B, n)
            counts = present.sum(-1)  # (B,)
            lengths = counts + 1
        positions = torch.arange(self.max_response_length)  # (R,)
        padded = torch.cat([body, torch.full((batch, 1), PAD, dtype=torch.int64)], dim=1)
        targets = torch.where(positions < lengths.unsqueeze(1) - 1, padded, PAD)  # (B, R)
        targets = torch.where(positions == lengths.unsqueeze(1) - 1, END, targets)
        return targets, lengths

    def rewards(self, digits: torch.Tensor, responses: torch.Tensor) -> Rewards:
        """Score responses ``(B, R)`` (``PAD`` after the end token) against the prompts' digits."""
        targets, lengths = self.targets(digits)  # (B, R), (B,)
        positions = torch.arange(self.max_response_length)  # (R,)
        scored = positions < lengths.unsqueeze(1)  # (B, R): target digits and the end token
        correct = (responses == targets) & scored  # (B, R)
        partial = correct.sum(-1).float() / lengths.float()  # (B,)
        exact = (correct.sum(-1) == lengths).float()  # (B,)
        return Rewards(reward=(partial + exact) / 2, exact_match=exact, partial_credit=partial)
