"""Slow, obvious float64 references: one per public function, written as plain loops.

They take float64 tensors (so autograd can differentiate them for gradient comparisons) and a
Python list-of-lists bool mask. Nothing here imports the library.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _as_list_mask(mask: Tensor) -> list[list[bool]]:
    return [[bool(v) for v in row] for row in mask.tolist()]


def _advantage(advantages: Tensor, i: int, t: int) -> Tensor:
    if advantages.ndim == 1:
        return advantages[i]
    if advantages.shape[1] == 1:
        return advantages[i, 0]
    return advantages[i, t]


def surrogate_token(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantage: Tensor,
    *,
    clip_low: float | None,
    clip_high: float | None,
    dual_clip: float | None,
    log_ratio_bound: float | None,
) -> Tensor:
    """The clipped surrogate s of one token (PPO/GRPO/DAPO/dual-clip)."""
    delta = log_prob - old_log_prob
    if log_ratio_bound is not None:
        delta = torch.clamp(delta, -log_ratio_bound, log_ratio_bound)
    ratio = torch.exp(delta)
    if clip_low is None:
        s = ratio * advantage
    else:
        high = clip_low if clip_high is None else clip_high
        clipped = torch.clamp(ratio, 1 - clip_low, 1 + high)
        s = torch.minimum(ratio * advantage, clipped * advantage)
    if dual_clip is not None and float(advantage) < 0:
        s = torch.maximum(s, dual_clip * advantage)
    return s


def per_token_surrogates(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    log_ratio_bound: float | None = 20.0,
) -> dict[tuple[int, int], Tensor]:
    """{(i, t): s_it} over the selected tokens only (unselected entries are never touched)."""
    m = _as_list_mask(mask)
    out: dict[tuple[int, int], Tensor] = {}
    for i, row in enumerate(m):
        selected = [t for t, keep in enumerate(row) if keep]
        if ratio_level == "sequence" and selected:
            # GSPO token form: value log s_i at every token, gradient 1 w.r.t. log pi_it.
            mean_delta = sum((log_probs[i, t] - old_log_probs[i, t]).detach() for t in selected)
            mean_delta = mean_delta / len(selected)
        for t in selected:
            if ratio_level == "sequence":
                lp = log_probs[i, t] - log_probs[i, t].detach() + mean_delta + old_log_probs[i, t]
                if log_ratio_bound is not None and abs(float(mean_delta)) > log_ratio_bound:
                    lp = (mean_delta + old_log_probs[i, t]).detach()
            else:
                lp = log_probs[i, t]
            out[(i, t)] = surrogate_token(
                lp,
                old_log_probs[i, t],
                _advantage(advantages, i, t),
                clip_low=clip_low,
                clip_high=clip_high,
                dual_clip=dual_clip,
                log_ratio_bound=log_ratio_bound,
            )
    return out


def reduce_losses(
    losses: dict[tuple[int, int], Tensor],
    shape: tuple[int, int],
    *,
    reduction: str,
    normalizer: float | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Reduce {(i, t): loss} with the named reduction, as the docs define it."""
    batch, tokens = shape
    zero = torch.zeros((), dtype=torch.float64)
    if reduction == "none":
        out = torch.zeros(shape, dtype=torch.float64)
        for (i, t), value in losses.items():
            out = out.index_put((torch.tensor([i]), torch.tensor([t])), value.reshape(1))
        return out
    if reduction == "token_mean":
        total = sum(losses.values(), zero)
        count = len(losses) if normalizer is None else normalizer
        return total / count if count else zero
    if reduction == "sequence_mean":
        total = zero
        non_empty = 0
        for i in range(batch):
            values = [v for (j, _), v in losses.items() if j == i]
            if values:
                total = total + sum(values, zero) / len(values)
                non_empty += 1
        count = non_empty if normalizer is None else normalizer
        return total / count if count else zero
    if reduction == "sequence_sum_normalized":
        constant = tokens if max_response_length is None else max_response_length
        sequences = batch if normalizer is None else normalizer
        denominator = sequences * constant
        return sum(losses.values(), zero) / denominator if denominator else zero
    raise ValueError(reduction)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    max_response_length: int | None = None,
    **options: object,
) -> Tensor:
    """Reference of rlobjectives.policy_loss(...).loss: reduce(-s)."""
    surrogates = per_token_surrogates(log_probs, old_log_probs, advantages, mask, **options)  # type: ignore[arg-type]
    losses = {key: -value for key, value in surrogates.items()}
    return reduce_losses(
        losses,
        tuple(mask.shape),  # type: ignore[arg-type]
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )


def grpo_clipped_surrogate(
    new_log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    token_mask: Tensor,
    clip_epsilon: float,
) -> dict[str, Tensor]:
    """Reference of the seed GRPO surrogate (float64 loops)."""
    m = _as_list_mask(token_mask)
    zero = torch.zeros((), dtype=torch.float64)
    all_s: list[Tensor] = []
    per_sequence: list[Tensor] = []
    clipped = 0
    for i, row in enumerate(m):
        seq: list[Tensor] = []
        for t, keep in enumerate(row):
            if not keep:
                continue
            delta = torch.clamp(new_log_probs[i, t] - old_log_probs[i, t], -60.0, 60.0)
            r = torch.exp(delta)
            a = _advantage(advantages, i, t)
            s = torch.minimum(r * a, torch.clamp(r, 1 - clip_epsilon, 1 + clip_epsilon) * a)
            seq.append(s)
            all_s.append(s)
            if float(r) < 1 - clip_epsilon or float(r) > 1 + clip_epsilon:
                clipped += 1
        per_sequence.append(sum(seq, zero) / len(seq) if seq else zero)
    count = len(all_s)
    loss = -sum(all_s, zero) / count if count else zero
    fraction = torch.tensor(clipped / count if count else 0.0, dtype=torch.float64)
    stacked = torch.stack(per_sequence) if per_sequence else torch.zeros(0, dtype=torch.float64)
    return {"loss": loss, "per_sequence_surrogate": stacked, "clipped_fraction": fraction}


def kl_penalized_rewards(
    policy_log_probs: Tensor,
    reference_log_probs: Tensor,
    rewards: Tensor,
    response_mask: Tensor,
    beta: float,
) -> dict[str, Tensor]:
    """Reference of the seed KL-penalized rewards (float64 loops)."""
    m = _as_list_mask(response_mask)
    zero = torch.zeros((), dtype=torch.float64)
    divergences: list[Tensor] = []
    penalized: list[Tensor] = []
    for i, row in enumerate(m):
        d = zero
        for t, keep in enumerate(row):
            if keep:
                d = d + (policy_log_probs[i, t] - reference_log_probs[i, t])
        divergences.append(d)
        penalized.append(rewards[i] - beta * d)
    batch = len(m)
    objective = sum(penalized, zero) / batch if batch else zero
    empty = torch.zeros(0, dtype=torch.float64)
    return {
        "objective": objective,
        "penalized_rewards": torch.stack(penalized) if penalized else empty,
        "sampled_divergences": torch.stack(divergences) if divergences else empty,
    }
