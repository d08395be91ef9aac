"""A user's own surrogate, written outside the library: docs/objectives/custom.md's example.

``TanhSurrogate`` implements only ``surrogate(self, log_ratio, advantages)``; the tests check
that it runs on every path of ``policy_loss`` and ``fused_policy_loss_from_hidden`` (and, from
the spawned-rank harnesses, under ``context_group`` and ``vocab_group``) against the float64
loop :func:`tanh_reference`, with no library file touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import rlobjectives as rlo

# tanh'(u) = 1 - tanh(u)^2 < 1/2 beyond |u| = atanh(1 / sqrt 2): the saturated tokens
SATURATION = math.atanh(1.0 / math.sqrt(2.0))


@dataclass(frozen=True)
class TanhSurrogate(rlo.Surrogate):
    r"""``s = A tanh((r - 1) / scale)``: a soft clip whose gradient saturates far from r = 1."""

    scale: float = 0.5

    def surrogate(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> rlo.SurrogateTerms:
        deviation = torch.expm1(log_ratio) / self.scale  # (r - 1) / scale
        saturated = deviation.detach().abs() > SATURATION
        return rlo.SurrogateTerms(advantages * torch.tanh(deviation), out_of_band=saturated)


def tanh_surrogates(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float = 0.5,
    ratio_level: str = "token",
    bound: float = 20.0,
) -> dict[tuple[int, int], torch.Tensor]:
    """Float64 ``{(i, t): s_it}`` over the selected tokens, by loops (differentiable).

    ``ratio_level="sequence"``: GSPO's token form, the sequence's mean log-ratio at every token
    with gradient 1 with respect to the token's log-probability.
    """
    out: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(mask.shape[0]):
        selected = [t for t in range(mask.shape[1]) if bool(mask[i, t])]
        if not selected:
            continue
        deltas = [log_probs[i, t].double() - old_log_probs[i, t].double() for t in selected]
        mean = sum(d.detach() for d in deltas) / len(selected)
        for t, delta in zip(selected, deltas, strict=True):
            if ratio_level == "sequence":
                delta = log_probs[i, t].double() - log_probs[i, t].double().detach() + mean
            delta = torch.clamp(delta, -bound, bound)
            advantage = advantages[i, t] if advantages.ndim == 2 else advantages[i]
            out[(i, t)] = advantage.double() * torch.tanh((torch.exp(delta) - 1.0) / scale)
    return out


def saturated_fraction(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float = 0.5,
) -> float:
    """The fraction of selected tokens with ``|r - 1| / scale > atanh(1 / sqrt 2)``."""
    selected = mask.bool()
    ratio = torch.exp((log_probs.double() - old_log_probs.double())[selected].clamp(-20, 20))
    return (
        float(((ratio - 1.0).abs() / scale > SATURATION).double().mean()) if ratio.numel() else 0.0
    )
