"""Slow, obvious float64 references: one per public function, written as plain loops.

They take float64 tensors (so autograd can differentiate them for gradient comparisons) and a
Python list-of-lists bool mask. Nothing here imports the library.
"""

from __future__ import annotations

import math
from typing import Any

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
    delta: float | None = None,
) -> Tensor:
    """The clipped surrogate s of one token (PPO/GRPO/DAPO/dual-clip, TRL's two-sided delta)."""
    delta_log = log_prob - old_log_prob
    if log_ratio_bound is not None:
        delta_log = torch.clamp(delta_log, -log_ratio_bound, log_ratio_bound)
    ratio = torch.exp(delta_log)
    # TRL: coef_1 = clamp(coef_1, max=delta) in the unclipped branch only
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    if clip_low is None:
        s = capped * advantage
    else:
        high = clip_low if clip_high is None else clip_high
        clipped = torch.clamp(ratio, 1 - clip_low, 1 + high)
        s = torch.minimum(capped * advantage, clipped * advantage)
    if dual_clip is not None and float(advantage.detach()) < 0:
        s = torch.maximum(s, dual_clip * advantage)
    return s


# Defaults of the surrogate options (as rlobjectives.policy_loss).
FAMILY_DEFAULTS: dict[str, object] = {
    "surrogate": "clip",
    "delta": None,
    "cispo_cap": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "dppo_divergence": "tv",  # DPPO(): TV, the thresholds 0.2, the cap 20
    "dppo_low": 0.2,
    "dppo_high": 0.2,
    "dppo_ratio_cap": 20.0,
    "m2po_threshold": 0.04,
    "cov_ratio": 0.0002,  # verl's clip_cov_ratio / kl_cov_ratio
    "cov_lb": 1.0,
    "cov_ub": 5.0,
    "kl_cov_coef": 0.1,
    "cov_generator": None,
    "cov_selection": None,
    "band_tau": 0.1,  # ProbabilityBand(): prime-rl's ipo_threshold and kl_tau
    "band_kappa": 1e-3,
    "topr_rewards": None,  # TOPR(rewards): one per row (required)
    "topr_positive_weight": 1.0,
    "topr_negative_weight": 1.0,
    "labels": None,  # the prompt group of each row (group_size= / group_ids= of the call)
    "real_tau": 0.5,
    "fipo_gamma": None,  # FIPO(gamma, cap): required
    "fipo_cap": None,
    "fipo_cap_high_only": True,
    "fipo_safety_threshold": None,
}
VESPO_LOG_LOW, VESPO_LOG_HIGH = math.log(1e-8), 20.0
SAPO_HALF_PEAK = 2.0 * math.log(1.0 + math.sqrt(2.0))  # 4 sigma (1 - sigma) = 1/2

#: The reference's flat names (the 0.2 keywords, the symbols of the formulas below) of the
#: fields of each surrogate object: ``Clip(low=a)`` is ``clip_low=a``.
_FLAT_NAMES: dict[str, dict[str, str]] = {
    "clip": {"low": "clip_low", "high": "clip_high", "dual": "dual_clip", "delta": "delta"},
    "cispo": {"cap": "cispo_cap", "low": "clip_low", "high": "clip_high"},
    "sapo": {
        "temperature_pos": "sapo_temperature_pos",
        "temperature_neg": "sapo_temperature_neg",
    },
    "gmpo": {"low": "clip_low", "high": "clip_high"},
    "vespo": {
        "k_pos": "vespo_k_pos",
        "lambda_pos": "vespo_lambda_pos",
        "k_neg": "vespo_k_neg",
        "lambda_neg": "vespo_lambda_neg",
    },
    "dppo": {
        "divergence": "dppo_divergence",
        "low": "dppo_low",
        "high": "dppo_high",
        "ratio_cap": "dppo_ratio_cap",
    },
    "dro": {"beta": "dro_beta"},
    "m2po": {"threshold": "m2po_threshold", "low": "clip_low", "high": "clip_high"},
    "clip_cov": {
        "ratio": "cov_ratio",
        "low": "clip_low",
        "high": "clip_high",
        "cov_lb": "cov_lb",
        "cov_ub": "cov_ub",
        "generator": "cov_generator",
        "selection": "cov_selection",
    },
    "kl_cov": {"ratio": "cov_ratio", "coef": "kl_cov_coef", "selection": "cov_selection"},
    "probability_band": {"tau": "band_tau", "kappa": "band_kappa"},
    "real": {"tau": "real_tau"},
    "fipo": {
        "gamma": "fipo_gamma",
        "cap": "fipo_cap",
        "low": "clip_low",
        "high": "clip_high",
        "delta": "delta",
        "cap_high_only": "fipo_cap_high_only",
        "safety_threshold": "fipo_safety_threshold",
    },
    "topr": {
        "rewards": "topr_rewards",
        "positive_weight": "topr_positive_weight",
        "negative_weight": "topr_negative_weight",
    },
}
#: The batch-level surrogates: their token sets need the whole call (see ``batch_selection``).
BATCH_LEVEL = ("m2po", "clip_cov", "kl_cov")


def surrogate_options(surrogate: object = "clip") -> dict[str, object]:
    """A surrogate object (``Clip(low=0.1)``) or name as the references' flat options.

    Reads the object's fields only (its ``name`` and its dataclass fields): the references keep
    their own formulas. A name gives ``{"surrogate": name}`` (the references' defaults).
    """
    if isinstance(surrogate, str):
        return {"surrogate": surrogate}
    name = type(surrogate).name  # type: ignore[attr-defined]
    flat: dict[str, object] = {"surrogate": name}
    for field, value in vars(surrogate).items():
        if field.startswith("_"):  # the object's own helpers (FIPO's Clip), not its fields
            continue
        value = float(value) if isinstance(value, torch.Tensor) and value.ndim == 0 else value
        flat[_FLAT_NAMES[name][field]] = value
    return flat


def surrogate_name(surrogate: object = "clip") -> str:
    """The name of a surrogate object or name (``CISPO(cap=5.0)`` -> ``"cispo"``)."""
    return str(surrogate_options(surrogate)["surrogate"])


def _flat(function):  # type: ignore[no-untyped-def]
    """Let a reference take ``surrogate=<object>`` (flattened) as well as the flat options."""

    def wrapped(*args, surrogate="clip", **kwargs):  # type: ignore[no-untyped-def]
        return function(*args, **{**kwargs, **surrogate_options(surrogate)})

    wrapped.__name__ = function.__name__
    wrapped.__doc__ = function.__doc__
    return wrapped


def _weight(weights: Tensor | None, i: int, t: int) -> Tensor | float:
    if weights is None:
        return 1.0
    return _advantage(weights, i, t)  # the same (B,) / (B, 1) / (B, T) shapes as advantages


def _bounded(delta: Tensor, bound: float | None) -> Tensor:
    return delta if bound is None else torch.clamp(delta, -bound, bound)


def _cispo_bounds(options: dict[str, object]) -> tuple[float, float]:
    """CISPO's weight range: [0, cap] (TRL cispo_cap) or the clip band (verl), or none."""
    if options["cispo_cap"] is not None:
        return -math.inf, float(options["cispo_cap"])  # type: ignore[arg-type]
    if options["clip_low"] is None:
        return -math.inf, math.inf
    low = float(options["clip_low"])  # type: ignore[arg-type]
    high = low if options["clip_high"] is None else float(options["clip_high"])  # type: ignore[arg-type]
    return 1 - low, 1 + high


def _gmpo_row(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    i: int,
    selected: list[int],
    options: dict[str, object],
) -> tuple[Tensor, dict[int, Tensor]]:
    """GMPO (verl geo_mean) of row i: (mean advantage, {t: token-form log rho_it})."""
    clipped: dict[int, Tensor] = {}
    for t in selected:
        d = _bounded(log_probs[i, t] - old_log_probs[i, t], options["log_ratio_bound"])  # type: ignore[arg-type]
        a = float(_advantage(advantages, i, t))
        sign = (a > 0) - (a < 0)
        if options["clip_low"] is not None:
            low = float(options["clip_low"])  # type: ignore[arg-type]
            high = low if options["clip_high"] is None else float(options["clip_high"])  # type: ignore[arg-type]
            d_clamp = torch.clamp(d, -low, high)
            d = sign * torch.minimum(sign * d, sign * d_clamp)
        else:
            d = sign * sign * d
        clipped[t] = d
    n = len(selected)
    mean_log = sum(v.detach() for v in clipped.values()) / n
    mean_advantage = sum(_advantage(advantages, i, t) for t in selected) / n
    token_form = {t: v - v.detach() + mean_log for t, v in clipped.items()}
    return mean_advantage, token_form  # type: ignore[return-value]


def _vespo_log_weight(
    log_probs: Tensor,
    old_log_probs: Tensor,
    i: int,
    selected: list[int],
    options: dict[str, object],
    weights: Tensor | None,
) -> float:
    """TRL get_gamma_weights: log W_i = clip(sum_t Delta + sum_t log w_t, log 1e-8, 20)."""
    total = 0.0
    for t in selected:
        d = float((log_probs[i, t] - old_log_probs[i, t]).detach())
        bound = options["log_ratio_bound"]
        total += d if bound is None else min(max(d, -bound), bound)  # type: ignore[operator]
    if weights is not None:
        per_sequence = weights.ndim == 1 or weights.shape[1] == 1
        tokens = selected[:1] if per_sequence else selected
        for t in tokens:  # a sequence weight enters once
            w = float(_weight(weights, i, t))
            log_w = math.log(w) if w > 0 else -math.inf
            total += min(max(log_w, VESPO_LOG_LOW), VESPO_LOG_HIGH)
    return min(max(total, VESPO_LOG_LOW), VESPO_LOG_HIGH)


def _vespo_phi(log_weight: float, advantage: float, options: dict[str, object]) -> float:
    """phi(W) = exp(lambda + k log W - lambda W), (k, lambda) by the sign of A (A >= 0: pos)."""
    suffix = "pos" if advantage >= 0 else "neg"
    k = float(options[f"vespo_k_{suffix}"])  # type: ignore[arg-type]
    lam = float(options[f"vespo_lambda_{suffix}"])  # type: ignore[arg-type]
    return math.exp(lam + k * log_weight - lam * math.exp(log_weight))


@_flat
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
    importance_weights: Tensor | None = None,
    **family: object,
) -> dict[tuple[int, int], Tensor]:
    """{(i, t): s_it} over the selected tokens only (unselected entries are never touched)."""
    options = {**FAMILY_DEFAULTS, **family, "clip_low": clip_low, "clip_high": clip_high}
    options["log_ratio_bound"] = log_ratio_bound
    surrogate = options["surrogate"]
    m = _as_list_mask(mask)
    out: dict[tuple[int, int], Tensor] = {}
    if surrogate in BATCH_LEVEL:
        return batch_level_surrogates(log_probs, old_log_probs, advantages, mask, options)
    if surrogate == "real":
        return real_surrogates(log_probs, old_log_probs, advantages, mask, options)
    for i, row in enumerate(m):
        selected = [t for t, keep in enumerate(row) if keep]
        if not selected:
            continue
        if surrogate == "gmpo":
            mean_advantage, token_form = _gmpo_row(
                log_probs, old_log_probs, advantages, i, selected, options
            )
            for t in selected:
                out[(i, t)] = mean_advantage * torch.exp(token_form[t])
            continue
        if surrogate == "vespo":
            log_w = _vespo_log_weight(
                log_probs, old_log_probs, i, selected, options, importance_weights
            )
            for t in selected:
                a = _advantage(advantages, i, t)
                phi = _vespo_phi(log_w, float(a), options)
                out[(i, t)] = phi * a * log_probs[i, t]
            continue
        if ratio_level == "sequence":
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
            a = _advantage(advantages, i, t)
            if surrogate == "clip":
                out[(i, t)] = surrogate_token(
                    lp, old_log_probs[i, t], a, clip_low=clip_low, clip_high=clip_high,
                    dual_clip=dual_clip, log_ratio_bound=log_ratio_bound,
                    delta=options["delta"],  # type: ignore[arg-type]
                )  # fmt: skip
                continue
            ratio = torch.exp(_bounded(lp - old_log_probs[i, t], log_ratio_bound))
            if surrogate == "cispo":  # -sg(clip(r)) A log pi (MiniMax-M1)
                low, high = _cispo_bounds(options)
                weight = min(max(float(ratio.detach()), low), high)
                out[(i, t)] = weight * a * log_probs[i, t]
            elif surrogate == "sapo":  # 4/tau sigmoid(tau (r - 1)) A, tau_neg for A <= 0
                positive = float(a) > 0
                tau = options["sapo_temperature_pos" if positive else "sapo_temperature_neg"]
                out[(i, t)] = torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a  # type: ignore[operator]
            elif surrogate == "dppo":
                kept = dppo_kept(float(lp.detach()), float(old_log_probs[i, t]), float(a), options)
                cap = options["dppo_ratio_cap"]
                if not kept:  # value 0, gradient 0 (the token stays in the denominator)
                    out[(i, t)] = 0.0 * log_probs[i, t]
                elif cap is None:  # prime-rl / SkyRL: r A
                    out[(i, t)] = ratio * a
                else:  # verl: sg(min(r, c)) A log pi
                    weight = min(float(ratio.detach()), float(cap))  # type: ignore[arg-type]
                    out[(i, t)] = weight * a * log_probs[i, t]
            elif surrogate == "probability_band":  # prime-rl ipo
                out[(i, t)] = probability_band_token(
                    lp, old_log_probs[i, t], a, log_ratio_bound=log_ratio_bound,
                    tau=float(options["band_tau"]), kappa=float(options["band_kappa"]),  # type: ignore[arg-type]
                )  # fmt: skip
            elif surrogate == "fipo":  # the clipped surrogate times the influence weight
                influence, _ = fipo_influence(
                    log_probs, old_log_probs, advantages, mask, i, options
                )
                clipped = surrogate_token(
                    lp, old_log_probs[i, t], a, clip_low=clip_low, clip_high=clip_high,
                    dual_clip=None, log_ratio_bound=log_ratio_bound,
                    delta=options["delta"],  # type: ignore[arg-type]
                )  # fmt: skip
                out[(i, t)] = influence[t] * clipped
            elif surrogate == "topr":  # ROLL: w A l, w = w+ (R > 0) or w- sg(clip(r, 0, 1))
                weight = topr_weight(float(ratio.detach()), i, options)
                out[(i, t)] = weight * a * (log_probs[i, t] if log_probs[i, t] > -math.inf else 0.0)
            elif surrogate == "dro":  # l A - beta (l - l_old)^2 / 2, the raw log-ratio
                beta = float(options["dro_beta"])  # type: ignore[arg-type]
                delta = log_probs[i, t] - old_log_probs[i, t]
                out[(i, t)] = log_probs[i, t] * a - 0.5 * beta * delta * delta
            else:
                raise ValueError(surrogate)
    return out


def _real_groups(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    options: dict[str, object],
) -> dict[object, tuple[Tensor | None, list[int]]]:
    """REAL per group label: (L_g or None where the group lacks a label, its non-empty rows)."""
    labels, tau = options["labels"], float(options["real_tau"])  # type: ignore[arg-type]
    assert labels is not None, "REAL needs the rows' group labels"
    bound = options["log_ratio_bound"]
    out: dict[object, tuple[Tensor | None, list[int]]] = {}
    for label, rows in _members(labels).items():  # type: ignore[arg-type]
        scores: dict[int, Tensor] = {}
        signs: dict[int, bool] = {}
        for i in rows:
            selected = [t for t in range(mask.shape[1]) if bool(mask[i, t])]
            if not selected:  # no selected token: no part in the group
                continue
            deltas = [_bounded(log_probs[i, t] - old_log_probs[i, t], bound) for t in selected]  # type: ignore[arg-type]
            scores[i] = sum(deltas) / len(selected)  # type: ignore[assignment]
            mean_advantage = sum(float(_advantage(advantages, i, t)) for t in selected)
            signs[i] = mean_advantage / len(selected) > 0
        positive = [scores[i] for i in scores if signs[i]]
        negative = [scores[i] for i in scores if not signs[i]]
        if positive and negative:
            loss = torch.log(1 + sum(torch.exp(x / tau) for x in negative)) + torch.log(
                1 + sum(torch.exp(-x / tau) for x in positive)
            )
            out[label] = (loss, list(scores))
        else:
            out[label] = (None, list(scores))
    return out


def real_surrogates(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    options: dict[str, object],
) -> dict[tuple[int, int], Tensor]:
    """REAL: ``-L_g`` at every selected token of group ``g`` (0 where ``g`` lacks a label)."""
    out: dict[tuple[int, int], Tensor] = {}
    for loss, rows in _real_groups(log_probs, old_log_probs, advantages, mask, options).values():
        for i in rows:
            for t in range(mask.shape[1]):
                if bool(mask[i, t]):
                    out[(i, t)] = -loss if loss is not None else 0.0 * log_probs[i, t]
    return out


def future_discounted_sums(values: list[float], gamma: float) -> list[float]:
    """``F_t = sum_{s >= t} gamma^(s - t) v_s`` by the recursion ``F_t = v_t + gamma F_{t+1}``
    (``F_T = 0``), FIPO's future log-ratio of one sequence."""
    out, later = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        later = values[t] + gamma * later
        out[t] = later
    return out


def fipo_influence(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    row: int,
    options: dict[str, object],
) -> tuple[list[float], list[bool]]:
    """FIPO's influence weight of every position of row ``row`` and where the safety clamp
    applied: ``F_t = sum_{s >= t} gamma^(s - t) M_s x_s [r_s <= delta]``, then
    ``clip(e^F, 1 (or 1 - c), 1 + c)``, then ``clip(f, .8, 1)`` where ``A < 0`` and ``r > th``."""
    gamma, cap = float(options["fipo_gamma"]), options["fipo_cap"]  # type: ignore[arg-type]
    delta, threshold = options["delta"], options["fipo_safety_threshold"]
    bound = options["log_ratio_bound"]
    width = mask.shape[1]
    x = [0.0] * width
    for s in range(width):
        if bool(mask[row, s]):
            x[s] = float(_bounded((log_probs[row, s] - old_log_probs[row, s]).detach(), bound))  # type: ignore[arg-type]
            if delta is not None and math.exp(x[s]) > delta:  # type: ignore[operator]
                x[s] = 0.0
    influence, safety = [], []
    for t, future in enumerate(future_discounted_sums(x, gamma)):
        f = math.exp(future) if future < 700 else math.inf
        if cap is not None:
            low = 1.0 if options["fipo_cap_high_only"] else 1.0 - cap  # type: ignore[operator]
            f = min(max(f, low), 1.0 + cap)  # type: ignore[operator]
        clamped = False
        if threshold is not None and bool(mask[row, t]):
            a = float(_advantage(advantages, row, t))
            delta_t = (log_probs[row, t] - old_log_probs[row, t]).detach()
            r = math.exp(float(_bounded(delta_t, bound)))  # type: ignore[arg-type]
            clamped = a < 0 and r > threshold  # type: ignore[operator]
            f = min(max(f, 0.8), 1.0) if clamped else f
        influence.append(f)
        safety.append(clamped)
    return influence, safety


def topr_weight(ratio: float, row: int, options: dict[str, object]) -> float:
    """TOPR's weight of a token of row ``row``: ``w+`` if its reward is > 0, else
    ``w- min(r, 1)``."""
    reward = float(options["topr_rewards"][row])  # type: ignore[index]
    if reward > 0:
        return float(options["topr_positive_weight"])  # type: ignore[arg-type]
    return float(options["topr_negative_weight"]) * min(ratio, 1.0)  # type: ignore[arg-type]


def probability_band_token(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantage: Tensor,
    *,
    tau: float,
    kappa: float,
    log_ratio_bound: float | None,
) -> Tensor:
    """ProbabilityBand of one token: ``1[|p - p_old| <= tau] r A - kappa x^2`` (prime-rl ipo).

    The band is decided on the float64 probabilities of the inputs as given (``math.exp``).
    """
    x = _bounded(log_prob - old_log_prob, log_ratio_bound)
    moved = math.exp(float(log_prob.detach())) - math.exp(float(old_log_prob))
    penalty = kappa * x * x
    if abs(moved) <= tau:
        return torch.exp(x) * advantage - penalty
    return 0.0 * x - penalty


def reduce_losses(
    losses: dict[tuple[int, int], Tensor],
    shape: tuple[int, int],
    *,
    reduction: str,
    normalizer: float | None = None,
    max_response_length: int | None = None,
    labels: list[object] | None = None,
) -> Tensor:
    """Reduce {(i, t): loss} with the named reduction, as the docs define it (``labels``: the
    prompt of each row, for ``"prompt_mean"``)."""
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
    if reduction == "length_weighted":  # TRL luspo: mean over rows of sum_t L (n_i x token mean)
        total = zero
        for i in range(batch):
            values = [v for (j, _), v in losses.items() if j == i]
            if values:
                total = total + len(values) * (sum(values, zero) / len(values))
        rows = batch if normalizer is None else normalizer
        return total / rows if rows else zero
    if reduction == "prompt_mean":  # mean over prompts of the token mean of their responses
        assert labels is not None and len(labels) == batch
        total = zero
        non_empty = 0
        for rows_of_prompt in _members(labels).values():
            values = [v for (j, _), v in losses.items() if j in rows_of_prompt]
            if values:
                total = total + sum(values, zero) / len(values)
                non_empty += 1
        count = non_empty if normalizer is None else normalizer
        return total / count if count else zero
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
    importance_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    labels: list[object] | None = None,
    **options: object,
) -> Tensor:
    """Reference of rlobjectives.policy_loss(...).loss: reduce(-w s - entropy_coef H).

    ``old_log_probs``, ``advantages`` and the importance weights ``w`` are constants of the loss
    (detached); VESPO takes ``w`` inside its sequence weight and does not multiply by it.
    ``labels``: the prompt group of each row (``"prompt_mean"``, REAL).
    """
    old_log_probs, advantages = old_log_probs.detach(), advantages.detach()
    weights = None if importance_weights is None else importance_weights.detach()
    surrogates = per_token_surrogates(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        importance_weights=weights,
        labels=labels,
        **options,  # type: ignore[arg-type]
    )
    folds = surrogate_name(options.get("surrogate", "clip")) == "vespo"
    losses = {
        (i, t): -value * (1.0 if folds else _weight(weights, i, t))
        for (i, t), value in surrogates.items()
    }
    reduce = {
        "reduction": reduction,
        "normalizer": normalizer,
        "max_response_length": max_response_length,
        "labels": labels,
    }
    if surrogate_name(options.get("surrogate", "clip")) == "m2po":
        # M2PO: the surrogate over its kept tokens (the dict's keys), the bonus over the mask's
        loss = reduce_losses(losses, tuple(mask.shape), **reduce)  # type: ignore[arg-type]
        if entropy is not None and entropy_coef != 0:
            bonus = {k: -entropy_coef * entropy[k] for k in _selected_tokens(mask)}
            loss = loss + reduce_losses(bonus, tuple(mask.shape), **reduce)  # type: ignore[arg-type]
        return loss
    if entropy is not None and entropy_coef != 0:
        losses = {(i, t): v - entropy_coef * entropy[i, t] for (i, t), v in losses.items()}
    return reduce_losses(losses, tuple(mask.shape), **reduce)  # type: ignore[arg-type]


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
            if float(r.detach()) < 1 - clip_epsilon or float(r.detach()) > 1 + clip_epsilon:
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


def _clip_sets(
    r: float, a: float, options: dict[str, object]
) -> tuple[bool, bool, bool, bool, float]:
    """(out of band, low binds, high binds, dual binds, w) of one "clip" token, s = w A."""
    clip_low, delta, dual = options["clip_low"], options["delta"], options["dual_clip"]
    inf = math.inf
    band = None
    upper_pos = inf if delta is None else delta
    lower_neg, upper_neg = -inf, upper_pos
    if clip_low is not None:
        high = clip_low if options["clip_high"] is None else options["clip_high"]
        band = (1 - clip_low, 1 + high)  # type: ignore[operator]
        lower_neg = band[0]
        upper_pos = min(band[1], upper_pos)  # type: ignore[call-overload]
        upper_neg = inf if delta is None else max(band[1], delta)  # type: ignore[call-overload]
    if dual is not None:
        upper_neg = min(upper_neg, dual)  # type: ignore[call-overload]
    out = band is not None and (r < band[0] or r > band[1])  # type: ignore[operator]
    low, high = a < 0 and r < lower_neg, a > 0 and r > upper_pos  # type: ignore[operator]
    dual_binds = a < 0 and r > upper_neg  # type: ignore[operator]
    if a > 0:
        w = min(r, upper_pos)  # type: ignore[call-overload]
    elif a < 0:
        w = min(max(r, lower_neg), upper_neg)  # type: ignore[call-overload]
    else:
        w = r
    return out, low, high, dual_binds, w


@_flat
def policy_loss_diagnostics(
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
    diagnostics_normalizer: float | None = None,
    importance_weights: Tensor | None = None,
    **family: object,
) -> dict[str, float]:
    """Reference of rlobjectives.policy_loss(...).diagnostics, as Python floats (one token loop).

    Every diagnostic is a sum over selected tokens divided by the selected-token count (or
    ``diagnostics_normalizer``); 0 when the denominator is 0. ``log_ratio`` at a token is the
    token's own ``log_probs - old_log_probs`` (sequence mode: the mean over the sequence's
    selected tokens) for the clip counts, the bound and the ratio; k1 and k3 always use the
    token's own log-ratio (k3 with it clamped to the bound, 20 when the bound is None). The
    clip sets and the advantage factor w of each surrogate are as PolicyLossDiagnostics says.
    """
    options = {**FAMILY_DEFAULTS, **family, "clip_low": clip_low, "clip_high": clip_high}
    options.update(dual_clip=dual_clip, log_ratio_bound=log_ratio_bound)
    surrogate = options["surrogate"]
    m = _as_list_mask(mask)
    lp = log_probs.detach().tolist()
    old = old_log_probs.detach().tolist()
    names = (
        "clipped_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
        "log_ratio_bound_fraction", "ratio_mean", "approx_kl_k1", "approx_kl_k3", "weight_mean",
        "selected_fraction",
    )  # fmt: skip
    totals = dict.fromkeys(names, 0.0)
    count = 0
    chosen: set[tuple[int, int]] = set()  # M2PO's masked, Clip-Cov's detached, KL-Cov's tokens
    if surrogate in BATCH_LEVEL:
        chosen = batch_selection(log_probs.detach(), old_log_probs, advantages, mask, options)
    if surrogate == "real":  # the tokens of the groups with both labels
        groups = _real_groups(log_probs.detach(), old_log_probs, advantages, mask, options)
        chosen = {
            (i, t)
            for loss, rows in groups.values()
            if loss is not None
            for i in rows
            for t in range(mask.shape[1])
            if bool(mask[i, t])
        }
    for i, row in enumerate(m):
        selected = [t for t, keep in enumerate(row) if keep]
        if not selected:
            continue
        sequence_delta = sum(lp[i][t] - old[i][t] for t in selected) / len(selected)
        if surrogate == "gmpo":
            mean_a, token_form = _gmpo_row(
                log_probs.detach(), old_log_probs, advantages, i, selected, options
            )
            rho = math.exp(float(next(iter(token_form.values()))))
        if surrogate == "vespo":
            log_w = _vespo_log_weight(
                log_probs.detach(), old_log_probs, i, selected, options, importance_weights
            )
        for t in selected:
            count += 1
            delta = lp[i][t] - old[i][t]
            ratio_delta = sequence_delta if ratio_level == "sequence" else delta
            a = float(_advantage(advantages, i, t))
            if log_ratio_bound is not None:
                if abs(ratio_delta) > log_ratio_bound:
                    totals["log_ratio_bound_fraction"] += 1
                ratio_delta = min(max(ratio_delta, -log_ratio_bound), log_ratio_bound)
            r = math.exp(ratio_delta)
            totals["ratio_mean"] += r
            flags = (False, False, False, False)
            if surrogate == "clip":
                *flag_list, w = _clip_sets(r, a, options)
                flags = tuple(flag_list)  # type: ignore[assignment]
            elif surrogate == "cispo":
                low, high = _cispo_bounds(options)
                below, above = r < low, r > high
                flags = (below or above, below and a < 0, above and a > 0, above and a < 0)
                w = min(max(r, low), high)
            elif surrogate == "sapo":
                tau = float(options["sapo_temperature_pos" if a > 0 else "sapo_temperature_neg"])  # type: ignore[arg-type]
                x = tau * (r - 1)
                soft = abs(x) > SAPO_HALF_PEAK
                flags = (soft, soft and x < 0 and a < 0, soft and x > 0 and a > 0,
                         soft and x > 0 and a < 0)  # fmt: skip
                w = 4 / tau / (1 + math.exp(-x))
            elif surrogate == "gmpo":
                if clip_low is not None:
                    high = clip_low if clip_high is None else clip_high
                    below, above = ratio_delta < -clip_low, ratio_delta > high
                    flags = (below or above, below and a < 0, above and a > 0, False)
                w = rho
            elif surrogate == "vespo":  # no clipping
                w = _vespo_phi(log_w, a, options)
            elif surrogate == "dppo":
                kept = dppo_kept(lp[i][t], old[i][t], a, options)
                cap = options["dppo_ratio_cap"]
                capped = kept and cap is not None and r > cap  # type: ignore[operator]
                flags = (not kept, not kept and a < 0, not kept and a > 0, capped)
                w = 0.0 if not kept else (r if cap is None else min(r, cap))  # type: ignore[call-overload]
            elif surrogate == "probability_band":  # the band on p - p_old, either sign of A
                moved = math.exp(lp[i][t]) - math.exp(old[i][t])
                up, down = moved > options["band_tau"], moved < -options["band_tau"]  # type: ignore[operator]
                flags = (up or down, down and a < 0, up and a > 0, up and a < 0)
                w = 0.0 if up or down else r
            elif surrogate == "fipo":  # the band of Clip(low, high, delta), w times f
                influence, safety = fipo_influence(
                    log_probs.detach(), old_log_probs, advantages, mask, i, options
                )
                *flag_list, w = _clip_sets(r, a, dict(options, dual_clip=None))
                flags = tuple(flag_list)  # type: ignore[assignment]
                w = w * influence[t]
                totals["selected_fraction"] += safety[t]
            elif surrogate == "topr":  # the truncation at 1 of the non-positive rewards
                w = topr_weight(r, i, options)
                truncated = not float(options["topr_rewards"][i]) > 0 and r > 1  # type: ignore[index]
                flags = (truncated, False, truncated and a > 0, truncated and a < 0)
            elif surrogate == "real":  # no clipping; w = the sequence ratio e^{S_i}
                limit = math.inf if log_ratio_bound is None else log_ratio_bound
                clamped = [min(max(lp[i][u] - old[i][u], -limit), limit) for u in selected]
                w = math.exp(sum(clamped) / len(selected))
            elif surrogate == "dro":  # no ratio in the loss, no clipping; w = 1
                w = 1.0
            elif surrogate == "kl_cov":  # no clipping; w = r
                w = r
            else:  # m2po, clip_cov: the band of Clip(low, high) (M2PO: at the kept tokens)
                band_options = dict(options, dual_clip=None, delta=None)
                if options["clip_low"] is not None:
                    *flag_list, w = _clip_sets(r, a, band_options)
                    flags = tuple(flag_list)  # type: ignore[assignment]
                else:
                    w = r
                if surrogate == "m2po" and (i, t) in chosen:
                    flags, w = (False, False, False, False), 0.0
                elif surrogate == "clip_cov" and (i, t) in chosen:
                    w = 0.0
            totals["selected_fraction"] += (i, t) in chosen
            for name, flag in zip(names[:4], flags, strict=True):
                totals[name] += flag
            totals["weight_mean"] += w
            bound = 20.0 if log_ratio_bound is None else log_ratio_bound
            kl_delta = min(max(delta, -bound), bound)
            totals["approx_kl_k1"] += -delta
            totals["approx_kl_k3"] += math.expm1(kl_delta) - kl_delta
    denominator = count if diagnostics_normalizer is None else diagnostics_normalizer
    return {k: (v / denominator if denominator else 0.0) for k, v in totals.items()}


def global_normalizers(masks: list[Tensor]) -> tuple[int, int, int]:
    """Reference of rlobjectives.distributed.global_normalizers in one process (plain loops).

    Returns (selected tokens, sequences with at least one selected token, sequences) over all
    the micro-batch masks; with W ranks, the counts of all ranks' masks together.
    """
    tokens = nonempty = sequences = 0
    for mask in masks:
        for row in _as_list_mask(mask):
            selected = sum(1 for keep in row if keep)
            tokens += selected
            nonempty += 1 if selected > 0 else 0
            sequences += 1
    return tokens, nonempty, sequences


# --- log-probabilities, entropy, full-vocabulary KL, causal-LM alignment (issue 7) -------------


def _rows(values: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(B, T, V) or (N, V) -> ((N, V), batch shape)."""
    return values.reshape(-1, values.shape[-1]), tuple(values.shape[:-1])


def _row_keep(mask: Tensor | None, n: int) -> list[bool]:
    if mask is None:
        return [True] * n
    return [bool(v) for v in mask.reshape(-1).tolist()]


def token_log_probs(
    logits: Tensor, tokens: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """Reference of rlobjectives.token_log_probs: log_softmax(row / tau)[token], 0 if masked."""
    rows, shape = _rows(logits)
    flat_tokens = tokens.reshape(-1).tolist()
    out = []
    for n, keep in enumerate(_row_keep(mask, rows.shape[0])):
        if keep:
            out.append(torch.log_softmax(rows[n].double() / temperature, -1)[flat_tokens[n]])
        else:
            out.append(torch.zeros((), dtype=torch.float64))
    return torch.stack(out).reshape(shape) if out else torch.zeros(shape, dtype=torch.float64)


def token_entropy(logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """Reference of rlobjectives.token_entropy: -sum_v p log p per row, 0 if masked."""
    rows, shape = _rows(logits)
    out = []
    for n, keep in enumerate(_row_keep(mask, rows.shape[0])):
        if keep:
            log_p = torch.log_softmax(rows[n].double() / temperature, -1)
            terms = [log_p[v].exp() * log_p[v] for v in range(len(log_p))]
            out.append(-sum(terms, torch.zeros((), dtype=torch.float64)))
        else:
            out.append(torch.zeros((), dtype=torch.float64))
    return torch.stack(out).reshape(shape) if out else torch.zeros(shape, dtype=torch.float64)


def full_vocab_kl(
    logits: Tensor, ref_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """Reference of rlobjectives.full_vocab_kl: sum_v p_v (log p_v - log q_v) per row."""
    rows, shape = _rows(logits)
    ref_rows, _ = _rows(ref_logits)
    out = []
    for n, keep in enumerate(_row_keep(mask, rows.shape[0])):
        if keep:
            log_p = torch.log_softmax(rows[n].double() / temperature, -1)
            log_q = torch.log_softmax(ref_rows[n].double() / temperature, -1)
            terms = [log_p[v].exp() * (log_p[v] - log_q[v]) for v in range(len(log_p))]
            out.append(sum(terms, torch.zeros((), dtype=torch.float64)))
        else:
            out.append(torch.zeros((), dtype=torch.float64))
    return torch.stack(out).reshape(shape) if out else torch.zeros(shape, dtype=torch.float64)


def response_log_probs(
    logits: Tensor,
    input_ids: Tensor,
    prompt_lengths: list[int],
    attention_mask: Tensor,
    response_length: int,
) -> tuple[Tensor, list[list[bool]]]:
    """Reference of rlobjectives.response_log_probs: loop over rows and response positions.

    Row b's real tokens are the contiguous run of ones in attention_mask[b], starting at f; the
    response is positions j in [f + P_b, f + n_b); token j is predicted by logits[b, j - 1].
    """
    out: list[Tensor] = []
    mask: list[list[bool]] = []
    zero = torch.zeros((), dtype=torch.float64)
    for b, row in enumerate(_as_list_mask(attention_mask)):
        attended = [j for j, keep in enumerate(row) if keep]
        first, count = (attended[0], len(attended)) if attended else (0, 0)
        row_mask = []
        for t in range(response_length):
            j = first + prompt_lengths[b] + t
            if j < first + count:
                log_p = torch.log_softmax(logits[b, j - 1].double(), -1)
                out.append(log_p[int(input_ids[b, j])])
                row_mask.append(True)
            else:
                out.append(zero)
                row_mask.append(False)
        mask.append(row_mask)
    return torch.stack(out).reshape(len(mask), response_length), mask


# --- KL estimators, KL placements and advantages (rlobjectives.kl.estimators,
# rlobjectives.advantages.gae, rlobjectives.advantages.reinforce) ---


def _matrix(entries: dict[tuple[int, int], Tensor], shape: tuple[int, int]) -> Tensor:
    """A (B, T) float64 tensor with ``entries`` at their positions and 0 elsewhere (autograd ok)."""
    batch, tokens = shape
    zero = torch.zeros((), dtype=torch.float64)
    if batch == 0 or tokens == 0:
        return torch.zeros(shape, dtype=torch.float64)
    rows = [torch.stack([entries.get((i, t), zero) for t in range(tokens)]) for i in range(batch)]
    return torch.stack(rows)


def kl_token(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    *,
    estimator: str,
    straight_through: bool,
    log_ratio_bound: float | None,
) -> Tensor:
    """One token's KL estimate: k1 = d, k2 = d^2/2, k3 = exp(-d) + d - 1 (d clamped first)."""
    d = log_prob - ref_log_prob
    if log_ratio_bound is not None:
        d = torch.clamp(d, -log_ratio_bound, log_ratio_bound)
    k2 = d * d / 2
    if estimator == "k1":
        k = d
    elif estimator == "abs":
        k = torch.abs(d)
    elif estimator == "k2":
        k = k2
    else:
        k = torch.exp(-d) + d - 1
    if straight_through:
        k = k.detach() + k2 - k2.detach()
    return k


def kl_estimate(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    straight_through: bool = False,
    log_ratio_bound: float | None = 20.0,
) -> Tensor:
    """Reference of rlobjectives.kl_estimate: (B, T), zeros at unselected tokens."""
    m = _as_list_mask(mask)
    entries = {
        (i, t): kl_token(
            log_probs[i, t],
            ref_log_probs[i, t],
            estimator=estimator,
            straight_through=straight_through,
            log_ratio_bound=log_ratio_bound,
        )
        for i, row in enumerate(m)
        for t, keep in enumerate(row)
        if keep
    }
    return _matrix(entries, tuple(mask.shape))  # type: ignore[arg-type]


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    straight_through: bool = False,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    max_response_length: int | None = None,
    log_ratio_bound: float | None = 20.0,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """Reference of rlobjectives.kl_loss: the per-token estimates (times the weights, which keep
    their gradient) reduced by reduce_losses."""
    m = _as_list_mask(mask)
    losses = {
        (i, t): kl_token(
            log_probs[i, t],
            ref_log_probs[i, t],
            estimator=estimator,
            straight_through=straight_through,
            log_ratio_bound=log_ratio_bound,
        )
        for i, row in enumerate(m)
        for t, keep in enumerate(row)
        if keep
    }
    if importance_weights is not None:
        losses = {(i, t): v * _advantage(importance_weights, i, t) for (i, t), v in losses.items()}
    return reduce_losses(
        losses,
        tuple(mask.shape),  # type: ignore[arg-type]
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )


def kl_penalized_token_rewards(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    scores: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
    log_ratio_bound: float | None = None,
) -> Tensor:
    """Reference of rlobjectives.kl_penalized_token_rewards: -kl_coef*k, score at last token."""
    m = _as_list_mask(mask)
    entries: dict[tuple[int, int], Tensor] = {}
    for i, row in enumerate(m):
        selected = [t for t, keep in enumerate(row) if keep]
        for t in selected:
            k = kl_token(
                log_probs[i, t],
                ref_log_probs[i, t],
                estimator=estimator,
                straight_through=False,
                log_ratio_bound=log_ratio_bound,
            )
            entries[(i, t)] = -kl_coef * k
        if selected:
            last = selected[-1]
            entries[(i, last)] = entries[(i, last)] + scores.reshape(-1)[i]
    return _matrix(entries, tuple(mask.shape))  # type: ignore[arg-type]


def group_relative_advantages(
    rewards: Tensor, group_size: int, *, scale: str = "std", eps: float = 1e-6
) -> Tensor:
    """Reference of rlobjectives.group_relative_advantages (unbiased std; std := 0 for G = 1)."""
    out: list[Tensor] = []
    for start in range(0, rewards.shape[0], group_size):
        group = [rewards[start + j] for j in range(group_size)]
        mean = sum(group, torch.zeros((), dtype=torch.float64)) / group_size
        if group_size > 1:
            variance = sum((r - mean) ** 2 for r in group) / (group_size - 1)
            std = torch.sqrt(variance)
        else:
            std = torch.zeros((), dtype=torch.float64)
        for r in group:
            if scale == "none":
                out.append(r - mean)
            elif float(std.detach()) + eps > 0:
                out.append((r - mean) / (std + eps))
            else:
                out.append(torch.zeros((), dtype=torch.float64))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Reference of rlobjectives.rloo_advantages: r_i - mean of the other rewards of the group."""
    out: list[Tensor] = []
    for start in range(0, rewards.shape[0], group_size):
        group = [rewards[start + j] for j in range(group_size)]
        for j, r in enumerate(group):
            others = [group[k] for k in range(group_size) if k != j]
            out.append(r - sum(others, torch.zeros((), dtype=torch.float64)) / (group_size - 1))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    group_size: int | None = None,
    eps: float = 1e-8,
    holes: str = "skip",
) -> Tensor:
    """Reference of rlobjectives.reinforce_plus_plus_advantages (loops over selected tokens).

    ``group_size`` is :func:`reinforce_plus_plus_grouped` with contiguous group labels.
    ``holes="zero"``: the loop visits every position up to the last selected one (reward 0 at
    unselected ones) and keeps the returns of the selected ones.
    """
    labels = None if group_size is None else [i // group_size for i in range(mask.shape[0])]
    return reinforce_plus_plus_grouped(
        rewards, mask, labels=labels, token_rewards=token_rewards, gamma=gamma, eps=eps, holes=holes
    )


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float | list[float],
    value_lam: float | list[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference of rlobjectives.gae: (advantages, returns) over each row's selected tokens.

    ``lam`` / ``value_lam``: one number, or one per row (VAPO); the returns are the advantages
    of ``value_lam`` (default ``lam``) plus the values.
    """
    m = _as_list_mask(mask)
    zero = torch.zeros((), dtype=torch.float64)

    def run(trace: float | list[float]) -> dict[tuple[int, int], Tensor]:
        out: dict[tuple[int, int], Tensor] = {}
        for i, row in enumerate(m):
            row_lam = trace[i] if isinstance(trace, list) else trace
            selected = [t for t, keep in enumerate(row) if keep]
            next_advantage = zero
            for k in reversed(range(len(selected))):
                t = selected[k]
                next_value = values[i, selected[k + 1]] if k + 1 < len(selected) else zero
                delta = rewards[i, t] + gamma * next_value - values[i, t]
                next_advantage = delta + gamma * row_lam * next_advantage
                out[(i, t)] = next_advantage
        return out

    advantages = run(lam)
    critic = advantages if value_lam is None else run(value_lam)
    returns = {(i, t): a + values[i, t] for (i, t), a in critic.items()}
    shape = tuple(mask.shape)
    return _matrix(advantages, shape), _matrix(returns, shape)  # type: ignore[arg-type]


# --- log-probabilities and the fused policy loss from hidden states (issue 7, _from_hidden) ----


def token_log_probs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference of rlobjectives.token_log_probs_from_hidden: (log_probs, entropy), (B, T) each.

    Token by token: logits = hidden[i, t] @ weight.T (+ bias), all in float64, then
    log_softmax(logits / temperature) at the token and -sum_v p log p; 0 where mask is False.
    """
    batch, steps = tokens.shape
    keep = _row_keep(mask, batch * steps)
    zero = torch.zeros((), dtype=torch.float64)
    log_probs: list[Tensor] = []
    entropies: list[Tensor] = []
    for i in range(batch):
        for t in range(steps):
            if not keep[i * steps + t]:
                log_probs.append(zero)
                entropies.append(zero)
                continue
            logits = weight.double() @ hidden[i, t].double()  # (V,)
            if bias is not None:
                logits = logits + bias.double()
            log_p = torch.log_softmax(logits / temperature, -1)  # (V,)
            log_probs.append(log_p[int(tokens[i, t])])
            entropies.append(-sum((log_p[v].exp() * log_p[v] for v in range(len(log_p))), zero))
    if not log_probs:
        empty = torch.zeros((batch, steps), dtype=torch.float64)
        return empty, empty
    return (
        torch.stack(log_probs).reshape(batch, steps),
        torch.stack(entropies).reshape(batch, steps),
    )


def fused_policy_loss_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    max_response_length: int | None = None,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_straight_through: bool = False,
    entropy_coef: float = 0.0,
    **options: object,
) -> Tensor:
    """Reference of rlobjectives.fused_policy_loss_from_hidden(...).loss: the unfused composition.

    log_probs and entropies H from the loop above, then policy_loss(..., entropy=H,
    entropy_coef=...) + kl_coef * kl_loss(...) with the same reduction, normalizer and
    log-ratio bound.
    """
    log_probs, entropy = token_log_probs_from_hidden(
        hidden, weight, tokens, bias=bias, temperature=temperature, mask=mask
    )
    reduce = {
        "reduction": reduction,
        "normalizer": normalizer,
        "max_response_length": max_response_length,
    }
    loss = policy_loss(
        log_probs, old_log_probs, advantages, mask, **reduce, entropy=entropy,
        entropy_coef=entropy_coef, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    if ref_log_probs is not None and kl_coef > 0:
        bound = options.get("log_ratio_bound", 20.0)
        loss = loss + kl_coef * kl_loss(
            log_probs,
            ref_log_probs,
            mask,
            estimator=kl_estimator,
            straight_through=kl_straight_through,
            log_ratio_bound=bound,  # type: ignore[arg-type]
            **reduce,  # type: ignore[arg-type]
        )
    return loss


# === PPO: whitening, value loss, GAE options, REINFORCE++ options, outcome advantages ===

# (issue 14: rlobjectives.advantages.whitening, _value, _advantages, _outcome_advantages,
# _kl_control)


def _selected_entries(values: Tensor, mask: Tensor) -> list[tuple[tuple[int, ...], Tensor]]:
    """[(index, value)] of the selected entries of a tensor of any shape, in row-major order."""
    keep = mask.reshape(-1).tolist()
    flat = values.reshape(-1)
    shape = tuple(values.shape)
    out = []
    for k, selected in enumerate(keep):
        if selected:
            index = []
            rest = k
            for size in reversed(shape):
                index.append(rest % size)
                rest //= size
            out.append((tuple(reversed(index)), flat[k]))
    return out


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Reference of rlobjectives.masked_whiten: (x - mean) / sqrt(var + eps) on selected entries."""
    entries = _selected_entries(values, mask)
    zero = torch.zeros((), dtype=torch.float64)
    out = torch.zeros(values.shape, dtype=torch.float64)
    count = len(entries)
    if count == 0:
        return out
    mean = sum((v for _, v in entries), zero) / count
    divisor = max(count - 1, 1) if unbiased else count
    variance = sum(((v - mean) ** 2 for _, v in entries), zero) / divisor
    if float(variance.detach()) + eps == 0:
        return out
    for index, v in entries:
        w = (v - mean) / torch.sqrt(variance + eps)
        out = out.index_put(
            tuple(torch.tensor([i]) for i in index), (w + (0 if shift_mean else mean)).reshape(1)
        )
    return out


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Reference of rlobjectives.value_loss(...).loss: 0.5 max((V-R)^2, (clip(V)-R)^2), reduced."""
    m = _as_list_mask(mask)
    losses: dict[tuple[int, int], Tensor] = {}
    for i, row in enumerate(m):
        for t, keep in enumerate(row):
            if not keep:
                continue
            unclipped = (values[i, t] - returns[i, t]) ** 2
            if clip is None:
                losses[(i, t)] = 0.5 * unclipped
                continue
            low, high = old_values[i, t] - clip, old_values[i, t] + clip
            clipped = (torch.clamp(values[i, t], float(low), float(high)) - returns[i, t]) ** 2
            losses[(i, t)] = 0.5 * torch.maximum(unclipped, clipped)
    return reduce_losses(
        losses,
        tuple(mask.shape),  # type: ignore[arg-type]
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
    )


def value_loss_diagnostics(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None = 0.2
) -> dict[str, float]:
    """clip_fraction (clipped term strictly larger) and explained variance, as Python floats."""
    m = _as_list_mask(mask)
    v, old, ret = values.tolist(), old_values.tolist(), returns.tolist()
    binding = 0
    residuals: list[float] = []
    targets: list[float] = []
    for i, row in enumerate(m):
        for t, keep in enumerate(row):
            if not keep:
                continue
            residuals.append(ret[i][t] - v[i][t])
            targets.append(ret[i][t])
            if clip is not None:
                clipped = min(max(v[i][t], old[i][t] - clip), old[i][t] + clip)
                binding += (clipped - ret[i][t]) ** 2 > (v[i][t] - ret[i][t]) ** 2
    count = len(targets)

    def variance(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)

    explained = 1 - variance(residuals) / (variance(targets) + 1e-5) if count >= 2 else 0.0
    return {"clip_fraction": binding / count if count else 0.0, "explained_variance": explained}


def gae_with_options(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
    holes: str = "skip",
) -> tuple[Tensor, Tensor]:
    """Reference of rlobjectives.gae with whiten/holes.

    ``holes="zero"``: OpenRLHF's loop over every position up to the last selected token, with
    reward and value 0 at unselected positions.
    """
    if holes == "skip":
        advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    else:
        m = _as_list_mask(mask)
        zero = torch.zeros((), dtype=torch.float64)
        entries: dict[tuple[int, int], Tensor] = {}
        targets: dict[tuple[int, int], Tensor] = {}
        for i, row in enumerate(m):
            r = [rewards[i, t] if keep else zero for t, keep in enumerate(row)]
            v = [values[i, t] if keep else zero for t, keep in enumerate(row)]
            running = zero
            for t in reversed(range(len(row))):
                next_value = v[t + 1] if t + 1 < len(row) else zero
                running = r[t] + gamma * next_value - v[t] + gamma * lam * running
                if row[t]:
                    entries[(i, t)] = running
                    targets[(i, t)] = running + v[t]
        shape = tuple(mask.shape)
        advantages = _matrix(entries, shape)  # type: ignore[arg-type]
        returns = _matrix(targets, shape)  # type: ignore[arg-type]
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def group_labels(length: int, group_size: int | None, group_ids: object) -> list[object]:
    """One hashable label per sequence: ``k // group_size``, or the given labels."""
    if group_ids is None:
        assert group_size is not None
        return [k // group_size for k in range(length)]
    if isinstance(group_ids, Tensor):
        return [int(x) for x in group_ids.tolist()]
    return list(group_ids)  # type: ignore[call-overload]


def _members(labels: list[object]) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = {}
    for k, label in enumerate(labels):
        groups.setdefault(label, []).append(k)
    return groups


def _std(values: list[Tensor]) -> Tensor:
    """Unbiased std of a list of 0-d tensors (0 for fewer than two)."""
    zero = torch.zeros((), dtype=torch.float64)
    if len(values) < 2:
        return zero
    mean = sum(values, zero) / len(values)
    variance = sum(((x - mean) ** 2 for x in values), zero) / (len(values) - 1)
    return torch.sqrt(variance) if float(variance.detach()) > 0 else zero


def group_relative_advantages_grouped(
    rewards: Tensor, labels: list[object], *, scale: str = "std", eps: float = 1e-6
) -> Tensor:
    """Reference of rlobjectives.group_relative_advantages with any grouping (loops)."""
    zero = torch.zeros((), dtype=torch.float64)
    items = [rewards[k] for k in range(rewards.shape[0])]
    batch_std = _std(items)
    out: list[Tensor] = [zero] * len(items)
    for members in _members(labels).values():
        group = [items[k] for k in members]
        mean = sum(group, zero) / len(group)
        std = _std(group) if scale == "std" else batch_std
        for k in members:
            centered = items[k] - mean
            if len(members) == 1:
                out[k] = zero
            elif scale == "none":
                out[k] = centered
            elif float(std.detach()) + eps > 0:
                out[k] = centered / (std + eps)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def rloo_advantages_grouped(rewards: Tensor, labels: list[object]) -> Tensor:
    """Reference of rlobjectives.rloo_advantages with any grouping: 0 for a group of one."""
    zero = torch.zeros((), dtype=torch.float64)
    out: list[Tensor] = [zero] * rewards.shape[0]
    for members in _members(labels).values():
        for k in members:
            others = [rewards[j] for j in members if j != k]
            if others:
                out[k] = rewards[k] - sum(others, zero) / len(others)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def passk_advantages(
    rewards: Tensor, labels: list[object], *, scale: str = "std", eps: float = 1e-6
) -> Tensor:
    """Reference of rlobjectives.passk_advantages: (best - second best) at the first best."""
    zero = torch.zeros((), dtype=torch.float64)
    out: list[Tensor] = [zero] * rewards.shape[0]
    for members in _members(labels).values():
        if len(members) < 2:
            continue
        values = [float(rewards[k].detach()) for k in members]
        best = members[values.index(max(values))]
        rest = [k for k in members if k != best]
        rest_values = [float(rewards[k].detach()) for k in rest]
        second = rest[rest_values.index(max(rest_values))]
        margin = rewards[best] - rewards[second]
        if scale == "std":
            std = _std([rewards[k] for k in members])
            margin = margin / (std + eps) if float(std.detach()) + eps > 0 else zero
        out[best] = margin
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def opo_advantages(rewards: Tensor, mask: Tensor, labels: list[object]) -> Tensor:
    """Reference of rlobjectives.opo_advantages: r - sum(l r) / sum(l) over the group."""
    zero = torch.zeros((), dtype=torch.float64)
    lengths = [sum(1 for keep in row if keep) for row in _as_list_mask(mask)]
    out: list[Tensor] = [zero] * rewards.shape[0]
    for members in _members(labels).values():
        total = sum(lengths[k] for k in members)
        if total > 0:
            baseline = sum((lengths[k] * rewards[k] for k in members), zero) / total
        else:
            baseline = sum((rewards[k] for k in members), zero) / len(members)
        for k in members:
            out[k] = rewards[k] - baseline
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def remax_advantages(rewards: Tensor, baseline: Tensor, mask: Tensor | None = None) -> Tensor:
    """Reference of rlobjectives.remax_advantages: (reward-to-go) minus the greedy reward."""
    if mask is None:
        return rewards - baseline.reshape(-1)
    m = _as_list_mask(mask)
    zero = torch.zeros((), dtype=torch.float64)
    entries: dict[tuple[int, int], Tensor] = {}
    for i, row in enumerate(m):
        running = zero
        for t in reversed(range(len(row))):
            if row[t]:
                running = running + rewards[i, t]
                entries[(i, t)] = running - baseline.reshape(-1)[i]
    return _matrix(entries, tuple(mask.shape))  # type: ignore[arg-type]


def reinforce_plus_plus_grouped(
    rewards: Tensor,
    mask: Tensor,
    *,
    labels: list[object] | None = None,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    unbiased: bool = False,
    eps: float = 1e-8,
    holes: str = "skip",
) -> Tensor:
    """Reference of rlobjectives.reinforce_plus_plus_advantages with group labels / unbiased.

    ``holes``: as in :func:`reinforce_plus_plus_advantages`.
    """
    zero = torch.zeros((), dtype=torch.float64)
    scores = [rewards.reshape(-1)[i] for i in range(mask.shape[0])]
    if labels is not None:
        baselined = list(scores)
        for members in _members(labels).values():
            mean = sum((scores[k] for k in members), zero) / len(members)
            for k in members:
                baselined[k] = scores[k] - mean
        scores = baselined
    returns: dict[tuple[int, int], Tensor] = {}
    for i, row in enumerate(_as_list_mask(mask)):
        selected = [t for t, keep in enumerate(row) if keep]
        steps = selected if holes == "skip" else list(range(selected[-1] + 1 if selected else 0))
        running = zero
        for t in reversed(steps):
            reward = zero
            if row[t]:
                reward = token_rewards[i, t] if token_rewards is not None else zero
            if t == selected[-1]:
                reward = reward + scores[i]
            running = reward + gamma * running
            if row[t]:
                returns[(i, t)] = running
    count = len(returns)
    if count == 0:
        return torch.zeros(tuple(mask.shape), dtype=torch.float64)
    mean = sum(returns.values(), zero) / count
    divisor = max(count - 1, 1) if unbiased else count
    variance = sum(((g - mean) ** 2 for g in returns.values()), zero) / divisor
    std = torch.sqrt(variance) if float(variance.detach()) > 0 else zero
    if float(std.detach()) + eps == 0:
        return torch.zeros(tuple(mask.shape), dtype=torch.float64)
    entries = {key: (g - mean) / (std + eps) for key, g in returns.items()}
    return _matrix(entries, tuple(mask.shape))  # type: ignore[arg-type]


def adaptive_kl_values(
    init_kl_coef: float, target: float, horizon: float, updates: list[tuple[float, int]]
) -> list[float]:
    """The coefficient after each (current_kl, n_steps) update (Ziegler et al. 2019, Sec. 2.2)."""
    value = init_kl_coef
    out = []
    for current_kl, n_steps in updates:
        error = current_kl / target - 1
        if error > 0.2:
            error = 0.2
        if error < -0.2:
            error = -0.2
        value = value * (1 + error * n_steps / horizon)
        out.append(value)
    return out


# ---------------------------------------------------------------------------------------------
# Peer presets (rlobjectives.presets): each peer's loss written out from its formulas, as loops.


def _selected(mask: Tensor) -> list[list[bool]]:
    return _as_list_mask(mask != 0)


def _trl_vespo_phi(
    log_probs: Tensor,
    old_log_probs: Tensor,
    tokens: list[int],
    i: int,
    advantage: float,
    ratio: Tensor | None,
    vespo: tuple[float, float, float, float],
) -> float:
    """TRL ``get_gamma_weights`` of row i (the vLLM ratio summed over the selected tokens)."""
    low = math.log(1e-8)
    total = sum(
        min(max(float((log_probs[i, t] - old_log_probs[i, t]).detach()), -20.0), 20.0)
        for t in tokens
    )
    if ratio is not None:
        columns = [0] if ratio.shape[-1] == 1 else tokens
        total += sum(min(max(math.log(float(ratio[i, t])), low), 20.0) for t in columns)
    log_w = min(max(total, low), 20.0)
    k_pos, lambda_pos, k_neg, lambda_neg = vespo
    k, lam = (k_pos, lambda_pos) if advantage >= 0 else (k_neg, lambda_neg)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def _trl_token_loss(
    loss_type: str,
    coef_1: Tensor,
    a: Tensor,
    log_prob: Tensor,
    phi: float,
    options: dict[str, float | None],
) -> Tensor:
    """TRL's per-token policy loss of one token (before the masks, weights and KL)."""
    eps, high, delta = options["epsilon"], options["epsilon_high"], options["delta"]
    assert eps is not None and high is not None
    if loss_type == "cispo":
        return -torch.clamp(coef_1, max=high).detach() * a * log_prob
    if loss_type == "sapo":
        tau = options["sapo_temperature_pos"] if a > 0 else options["sapo_temperature_neg"]
        assert tau is not None
        return -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * a
    if loss_type == "vespo":
        return -phi * a * log_prob
    clipped = torch.clamp(coef_1, 1 - eps, 1 + high)
    capped = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
    return -torch.minimum(capped * a, clipped * a)


def trl_grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_log_probs: Tensor | None = None,
    level: str = "token",
    delta: float | None = None,
    max_completion_length: int | None = None,
    use_bias_correction_kl: bool = True,
    importance_sampling_ratio: Tensor | None = None,
    num_items_in_batch: int | None = None,
    num_processes: int = 1,
    accumulation: int = 1,
    steps_per_generation: int | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    off_policy_keep: Tensor | None = None,
    entropy_keep: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss``, every loss type, token by token.

    At sequence level ``coef_1 = exp(mean_t Δ)`` carries its full gradient to every token of the
    sequence and the per-token masks and ratios multiply that one value (TRL's broadcasting).
    ``off_policy_keep`` / ``entropy_keep``: TRL's 0/1 masks (from :func:`off_policy_sequence_mask`
    and :func:`top_entropy_mask`); ``entropy``: the bonus term's entropies.
    """
    high = epsilon if epsilon_high is None else epsilon_high
    options = {"epsilon": epsilon, "epsilon_high": high, "delta": delta,
               "sapo_temperature_pos": sapo_temperature_pos,
               "sapo_temperature_neg": sapo_temperature_neg}  # fmt: skip
    keep = _selected(mask)
    rows, width = len(keep), len(keep[0]) if keep else 0
    row_sums, counts = [], []
    zero = torch.zeros((), dtype=torch.float64)
    for i in range(rows):
        tokens = [t for t in range(width) if keep[i][t]]
        sequence_log_ratio = sum(
            (log_probs[i, t] - old_log_probs[i, t] for t in tokens), torch.zeros(())
        ) / max(len(tokens), 1)
        total = zero
        for t in tokens:
            log_ratio = log_probs[i, t] - old_log_probs[i, t] if level == "token" else (
                sequence_log_ratio
            )  # fmt: skip
            coef_1 = torch.exp(log_ratio)
            a = _advantage(advantages, i, t)
            phi = 0.0
            if loss_type == "vespo":  # the gamma weight of the row, (k, λ) by this token's sign
                phi = _trl_vespo_phi(log_probs, old_log_probs, tokens, i, float(a),
                                     importance_sampling_ratio, vespo)  # fmt: skip
            loss = _trl_token_loss(loss_type, coef_1, a, log_probs[i, t], phi, options)
            for multiplier in (off_policy_keep, entropy_keep):
                if multiplier is not None:
                    loss = loss * float(multiplier[i, t])
            if importance_sampling_ratio is not None and loss_type != "vespo":
                loss = loss * _advantage(importance_sampling_ratio, i, t)
            if beta != 0.0:
                assert ref_log_probs is not None
                d = ref_log_probs[i, t] - log_probs[i, t]
                kl = torch.exp(d) - d - 1
                loss = loss + beta * (kl * coef_1 if use_bias_correction_kl else kl)
            total = total + loss
        row_sums.append(total)
        counts.append(len(tokens))
    loss = _trl_normalise(
        row_sums,
        counts,
        loss_type,
        max_completion_length,
        num_items_in_batch,
        num_processes,
        accumulation,
        steps_per_generation,
    )
    if entropy_coef != 0.0:
        assert entropy is not None
        kept = [(i, t) for i in range(rows) for t in range(width) if keep[i][t]
                and (entropy_keep is None or bool(entropy_keep[i, t]))]  # fmt: skip
        bonus = sum((entropy[i, t] for i, t in kept), zero) / max(len(kept), 1)
        loss = loss - entropy_coef * bonus / accumulation
    return loss


def _trl_normalise(
    row_sums: list[Tensor],
    counts: list[int],
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: int | None,
    num_processes: int,
    accumulation: int,
    steps_per_generation: int | None,
) -> Tensor:
    """TRL's normaliser of each loss type applied to the per-row sums ``Σ_t M L``."""
    rows = len(row_sums)
    total = sum(row_sums, torch.zeros((), dtype=torch.float64))
    ga = accumulation
    if loss_type in ("grpo", "sapo"):
        means = [s / max(n, 1) for s, n in zip(row_sums, counts, strict=True)]
        return sum(means, total * 0) / rows / ga
    if loss_type == "bnpo":
        return total / max(sum(counts), 1) / ga
    if loss_type == "dr_grpo":
        assert max_completion_length is not None
        return total / (rows * max_completion_length) / ga
    if loss_type in ("dapo", "cispo", "vespo"):
        items = sum(counts) if num_items_in_batch is None else num_items_in_batch
        spg = ga if steps_per_generation is None else steps_per_generation
        return total / (max(items, 1) / num_processes * ga / spg)
    assert loss_type == "luspo"
    return total / rows / ga


def verl_agg_loss(
    losses: Tensor,
    mask: Tensor,
    mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """verl ``agg_loss`` (HEAD, after PRs #5366 and #5417), row by row."""
    keep = _selected(mask)
    rows = [[losses[i, t] for t in range(len(row)) if row[t]] for i, row in enumerate(keep)]
    zero = torch.zeros((), dtype=torch.float64)
    tokens = sum(len(r) for r in rows)
    nonempty = sum(1 for r in rows if r)
    if mode in ("token-mean", "token-sum"):
        total = sum((v for r in rows for v in r), zero)
        if mode == "token-sum":
            return total * dp_size
        return total / (tokens if batch_num_tokens is None else batch_num_tokens) * dp_size
    count = nonempty if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        means = [sum(r, zero) / (len(r) + 1e-8) for r in rows if r]
        return sum(means, zero) / count * dp_size
    sums = sum((sum(r, zero) for r in rows if r), zero) / count * dp_size
    if mode == "seq-mean-token-sum-norm":
        return sums / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    assert mode == "seq-mean-token-sum"
    return sums


def verl_policy_losses(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_mode: str,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    weights: Tensor | None = None,
    dro_beta: float = 0.0,
    kl_coef: float = 1.0,
    selected: set[tuple[int, int]] | None = None,
) -> Tensor:
    """verl's per-token ``pg_losses`` (times ``rollout_is_weights``), ``(B, T)``, 0 unselected.

    vanilla / gspo / cispo / sapo / gpg / dppo_tv / dppo_kl / dro / clip_cov / kl_cov
    (``geo_mean`` is per row: :func:`verl_geo_mean_loss`); ``selected``: Clip-Cov's detached
    or KL-Cov's penalised tokens (the caller draws them as verl does).
    """
    keep = _selected(mask)
    out = torch.zeros_like(log_prob)
    entries: dict[tuple[int, int], Tensor] = {}
    for i, row in enumerate(keep):
        tokens = [t for t in range(len(row)) if row[t]]
        for t in tokens:
            a = _advantage(advantages, i, t)
            if loss_mode in _VERL_SELECTING_MODES:
                loss = _verl_issue24_loss(
                    loss_mode, old_log_prob[i, t], log_prob[i, t], a, (i, t) in (selected or set()),
                    clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, dro_beta=dro_beta,
                    kl_coef=kl_coef,
                )  # fmt: skip
                entries[(i, t)] = loss if weights is None else loss * weights[i, t]
                continue
            if loss_mode == "gspo":
                mean = sum((log_prob[i, u] - old_log_prob[i, u] for u in tokens), out[0, 0] * 0)
                log_ratio = log_prob[i, t] - log_prob[i, t].detach() + (mean / len(tokens)).detach()
                ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
            else:
                ratio = torch.exp(torch.clamp(log_prob[i, t] - old_log_prob[i, t], -20.0, 20.0))
            if loss_mode == "gpg":
                loss = -log_prob[i, t] * a
            elif loss_mode == "cispo":
                clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
                loss = -clipped.detach() * a * log_prob[i, t]
            elif loss_mode == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * a
            else:
                clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
                loss = torch.maximum(-a * ratio, -a * clipped)
                if loss_mode == "vanilla" and a < 0:
                    loss = torch.minimum(-a * clip_c, loss)
            entries[(i, t)] = loss if weights is None else loss * weights[i, t]
    return _matrix(entries, tuple(log_prob.shape)) if entries else out


_VERL_SELECTING_MODES = ("dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov")


def _verl_issue24_loss(
    loss_mode: str,
    old: Tensor,
    new: Tensor,
    a: Tensor,
    selected: bool,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float,
    dro_beta: float,
    kl_coef: float,
) -> Tensor:
    """One token's verl 0.9.1 loss of dppo_tv / dppo_kl (ratio from the ±20-clamped log-ratio),
    dro, clip_cov and kl_cov (unclamped ratio); ``selected``: Clip-Cov detaches the token,
    KL-Cov penalises it."""
    delta = new - old
    if loss_mode in ("dppo_tv", "dppo_kl"):
        ratio = torch.exp(torch.clamp(delta, -20.0, 20.0))
        options = {"dppo_divergence": loss_mode[-2:], "dppo_low": clip_low,
                   "dppo_high": clip_high}  # fmt: skip
        kept = dppo_kept(float(new.detach()), float(old), float(a), options)
        return -a * torch.clamp(ratio, max=clip_c).detach() * new * float(kept)
    if loss_mode == "dro":
        return -(new * a - 0.5 * dro_beta * delta**2)
    ratio = torch.exp(delta)
    if loss_mode == "clip_cov":
        clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
        return torch.maximum(-a * ratio, -a * clipped) * (0.0 if selected else 1.0)
    assert loss_mode == "kl_cov"
    return -a * ratio + (kl_coef * torch.abs(delta) if selected else 0.0)


def verl_bypass_losses(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[Tensor, Tensor]:
    """verl 0.9.1 ``bypass_mode`` (``old_log_prob`` = the sampler's), token by token.

    Returns the per-token losses ``(B, T)`` (0 at rejected and unselected tokens) and the
    surviving mask, for :func:`verl_agg_loss`. vanilla (clip 0.2, c = 3) without weights for
    ``"ppo_clip"``; ``-A·ℓ·w`` for ``"reinforce"``.
    """
    keep = _selected(mask)
    rows, width = mask.shape
    log_ratio = [[float(log_prob[i, t].detach()) - float(old_log_prob[i, t])
                  for t in range(width)] for i in range(rows)]  # fmt: skip
    bounded = [[min(max(v, -20.0), 20.0) for v in row] for row in log_ratio]
    weights: dict[tuple[int, int], float] = {}
    if rollout_is is not None:
        if isinstance(rollout_is_threshold, str) and "_" in rollout_is_threshold:
            low_text, high_text = rollout_is_threshold.split("_")
            low: float | None = float(low_text)
            high = float(high_text)
        else:
            low, high = None, float(rollout_is_threshold)
        for i in range(rows):
            tokens = [t for t in range(width) if keep[i][t]]
            sequence = math.exp(min(max(sum(log_ratio[i][t] for t in tokens), -20.0), 20.0))
            for t in tokens:
                raw = math.exp(bounded[i][t]) if rollout_is == "token" else sequence
                if low is None:
                    weights[i, t] = min(raw, high)
                else:
                    weights[i, t] = raw if low <= raw <= high else 0.0
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean = sum(weights.values()) / max(len(weights), 1)
            else:
                row_means = [
                    sum(weights[i, t] for t in range(width) if keep[i][t]) / sum(keep[i])
                    for i in range(rows) if any(keep[i])
                ]  # fmt: skip
                mean = sum(row_means) / max(len(row_means), 1)
            if mean > 1e-8:
                weights = {k: v / mean for k, v in weights.items()}
    kept = [list(row) for row in keep]
    if rollout_rs is not None:
        names = list(dict.fromkeys(n.strip() for n in rollout_rs.split(",") if n.strip()))
        specs = str(rollout_rs_threshold).split(",")
        specs = specs * len(names) if len(specs) == 1 else specs
        estimators = {"k1": lambda v: -v, "k2": lambda v: 0.5 * v * v,
                      "k3": lambda v: math.exp(v) - 1.0 - v}  # fmt: skip
        for name, spec in zip(names, specs, strict=True):
            scope, estimator = name.rsplit("_", 1)
            if estimator == "k1":
                low_t, high_t = spec.split("_") if "_" in spec else (None, spec)
                upper = float(high_t)
                lower = 1.0 / upper if low_t is None else float(low_t)
                band = (math.log(lower), math.log(upper))
            else:
                band = (-math.inf, float(spec))
            for i in range(rows):
                tokens = [t for t in range(width) if keep[i][t]]
                values = [estimators[estimator](bounded[i][t]) for t in tokens]
                if scope == "token":
                    for t, v in zip(tokens, values, strict=True):
                        kept[i][t] = kept[i][t] and band[0] <= v <= band[1]
                    continue
                if scope == "seq_sum":
                    statistic = sum(values)
                elif scope == "seq_mean":
                    statistic = sum(values) / len(values) if values else 0.0
                else:
                    statistic = max(values) if values else 0.0
                if not band[0] <= statistic <= band[1]:
                    kept[i] = [False] * width
    survivors = torch.tensor(kept, dtype=torch.bool)
    if loss_type == "ppo_clip":
        return verl_policy_losses(old_log_prob, log_prob, advantages, survivors,
                                  loss_mode="vanilla"), survivors  # fmt: skip
    entries = {}
    for i in range(rows):
        for t in range(width):
            if kept[i][t]:
                entries[i, t] = (
                    -_advantage(advantages, i, t) * log_prob[i, t] * weights.get((i, t), 1.0)
                )
    return _matrix(entries, (rows, width)), survivors


def verl_geo_mean_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights: Tensor | None = None,
) -> Tensor:
    """verl ``compute_policy_loss_geo_mean``: per row ``-mean_t(A)·exp(mean_t clipped Δ)``.

    The clip is per token in log space and sign-aware (``A > 0``: only the upper bound,
    ``A < 0``: only the lower one); the rows are averaged with ``torch.mean`` over all B rows;
    ``rollout_is_weights`` enter as the row's ``exp(mean_t log(w + 1e-10))``. verl's
    ``n_i + 1e-8`` is kept.
    """
    keep = _selected(mask)
    zero = torch.zeros((), dtype=torch.float64)
    losses = []
    for i, row in enumerate(keep):
        tokens = [t for t in range(len(row)) if row[t]]
        n = len(tokens) + 1e-8
        log_sum, advantage_sum, log_weights = zero, zero, zero
        for t in tokens:
            a = _advantage(advantages, i, t)
            delta = log_prob[i, t] - old_log_prob[i, t]
            sign = torch.sign(a)
            clipped = torch.clamp(delta, -clip_low, clip_high)
            log_sum = log_sum + sign * torch.minimum(sign * delta, sign * clipped)
            advantage_sum = advantage_sum + a
            if weights is not None:
                log_weights = log_weights + torch.log(weights[i, t] + 1e-10)
        loss = -(advantage_sum / n) * torch.exp(log_sum / n)
        losses.append(loss * torch.exp(log_weights / n) if weights is not None else loss)
    return sum(losses, zero) / len(losses)


def openrlhf_policy_forward(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_level_loss: bool = True,
    policy_loss_type: str = "ppo",
    is_correction_level: str = "off",
    is_correction_mode: str = "mask",
    is_correction_gating: str = "ratio",
    is_correction_threshold: tuple[float, float] = (0.5, 5.0),
    rollout_log_probs: Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
) -> dict[str, Any]:
    """OpenRLHF 0.11.2 ``PolicyLoss.forward``, token by token: its five results by name.

    ``loss`` is a float64 tensor (autograd through ``log_probs``; gspo differentiates the
    sequence ratio itself); ``clip_ratio``, ``ppo_kl``, ``vllm_kl``, ``is_filter_ratio`` are
    Python floats (the last two None unless ppo with ``is_correction_level != "off"``).
    """
    keep = _selected(mask)
    zero = torch.zeros((), dtype=torch.float64)
    corrected = is_correction_level != "off"
    behaviour = rollout_log_probs if policy_loss_type == "gspo" and corrected else old_log_probs
    assert behaviour is not None
    row_losses: list[list[Tensor]] = []
    clipped = selected = 0
    row_filtered: list[bool] = []
    token_filtered: list[bool] = []
    for i, row in enumerate(keep):
        tokens = [t for t in range(len(row)) if row[t]]
        mean = sum((log_probs[i, t] - behaviour[i, t] for t in tokens), zero)
        coefficients: dict[int, float] = {}
        if policy_loss_type == "ppo" and corrected:
            assert rollout_log_probs is not None
            gate = _openrlhf_gate(
                old_log_probs, rollout_log_probs, i, tokens, is_correction_level,
                is_correction_mode, is_correction_gating, is_correction_threshold,
            )  # fmt: skip
            coefficients = gate[0]
            (row_filtered if is_correction_level == "seq" else token_filtered).extend(gate[1])
        losses = []
        for t in tokens:
            a = _advantage(advantages, i, t)
            if policy_loss_type == "gspo":  # the sequence ratio with its full gradient
                ratio = torch.exp(mean / max(len(tokens), 1))
            else:
                ratio = torch.exp(torch.clamp(log_probs[i, t] - old_log_probs[i, t], -20.0, 20.0))
            first = ratio * a
            second = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * a
            clipped += bool(second < first)
            selected += 1
            surrogate = torch.minimum(first, second)
            if dual_clip is not None and a < 0:
                surrogate = torch.maximum(surrogate, dual_clip * a)
            losses.append(-surrogate * coefficients.get(t, 1.0))
        row_losses.append(losses)
    if token_level_loss and policy_loss_type == "ppo":
        total = sum((v for r in row_losses for v in r), zero)
        count = sum(len(r) for r in row_losses)
        loss = total / count if batch_num_tokens is None else total / batch_num_tokens * dp_size
    else:
        means = [sum(r, zero) / (len(r) + 1e-8) for r in row_losses if r]
        if global_batch_size is None:
            loss = sum(means, zero) / len(means)
        else:
            loss = sum(means, zero) / global_batch_size * dp_size
    pairs = [(i, t) for i, row in enumerate(keep) for t in range(len(row)) if row[t]]
    count = max(len(pairs), 1)
    out: dict[str, Any] = {
        "loss": loss,
        "clip_ratio": clipped / max(selected, 1),
        "ppo_kl": sum(float(old_log_probs[i, t] - log_probs[i, t].detach()) for i, t in pairs)
        / count,
        "vllm_kl": None,
        "is_filter_ratio": None,
    }
    if policy_loss_type == "ppo" and corrected:
        assert rollout_log_probs is not None
        out["vllm_kl"] = (
            sum(float(rollout_log_probs[i, t] - old_log_probs[i, t]) for i, t in pairs) / count
        )
        filtered = row_filtered if is_correction_level == "seq" else token_filtered
        units = len(keep) if is_correction_level == "seq" else count
        out["is_filter_ratio"] = sum(filtered) / units
    return out


def openrlhf_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                         mask: Tensor, **options: Any) -> Tensor:  # fmt: skip
    """The ``loss`` of :func:`openrlhf_policy_forward`."""
    return openrlhf_policy_forward(log_probs, old_log_probs, advantages, mask, **options)["loss"]


def _openrlhf_gate(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    i: int,
    tokens: list[int],
    level: str,
    mode: str,
    gating: str,
    threshold: tuple[float, float],
) -> tuple[dict[int, float], list[bool]]:
    """OpenRLHF's IS gate on row i: each selected token's coefficient, the filtered units.

    The units are the tokens (``level="token"``) or the row (``"seq"``: one flag; an empty
    row's statistic is NaN in OpenRLHF, out of every band: filtered).
    """
    low, high = threshold
    log_rho = {t: float(old_log_probs[i, t]) - float(rollout_log_probs[i, t]) for t in tokens}

    def divergence(t: int) -> float:
        p = min(max(math.exp(float(rollout_log_probs[i, t])), 1e-6), 1 - 1e-6)
        q = min(max(math.exp(float(old_log_probs[i, t])), 1e-6), 1 - 1e-6)
        if gating == "binary_kl":
            return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
        assert gating == "tv"
        return abs(p - q)

    if level == "token":
        statistics = {
            t: math.exp(log_rho[t]) if gating == "ratio" else divergence(t) for t in tokens
        }
        if mode == "clip":
            return (
                {t: min(max(v, low), high) for t, v in statistics.items()},
                [not low <= v <= high for v in statistics.values()],
            )
        kept = {t: low <= v <= high for t, v in statistics.items()}
        return {t: math.exp(log_rho[t]) * kept[t] for t in tokens}, [not k for k in kept.values()]
    assert level == "seq" and mode == "mask"
    if not tokens:
        return {}, [True]
    if gating == "ratio":
        statistic = math.exp(sum(log_rho.values()) / len(tokens))
    else:
        statistic = sum(divergence(t) for t in tokens) / len(tokens)
    inside = low <= statistic <= high
    return {t: math.exp(log_rho[t]) * inside for t in tokens}, [not inside]


# --- rollout correction and off-policy sequence masking (issue 12,
# rlobjectives.rollout.correction) -------

ROLLOUT_BOUND = 20.0


def rollout_correction(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float | None = 2.0,
    lower: float | None = None,
    veto: float | None = None,
) -> dict[str, object]:
    """Reference of rlobjectives.rollout_correction, in Python floats, one token at a time.

    Returns {"weights": (B, T) float64, "mask": (B, T) bool, "metrics": {name: float}} with the
    derived metric values (ratio_mean, ratio_min, ratio_max, effective_sample_size,
    truncated_fraction, masked_fraction, kl_k1, kl_k3, chi_square).
    """
    m = _as_list_mask(mask)
    batch, tokens = mask.shape
    weights = [[0.0] * tokens for _ in range(batch)]
    keep_mask = [[False] * tokens for _ in range(batch)]
    ratios: list[float] = []
    applied: list[float] = []
    kl1: list[float] = []
    kl3: list[float] = []
    truncated = removed = 0

    def clip(x: float) -> float:
        return min(max(x, -ROLLOUT_BOUND), ROLLOUT_BOUND)

    for i, row in enumerate(m):
        selected = [t for t, keep in enumerate(row) if keep]
        delta = {}
        for t in selected:
            d = float(log_probs[i, t]) - float(rollout_log_probs[i, t])
            delta[t] = 0.0 if math.isnan(d) else d  # a missing sampler log-prob: ratio 1
        if level == "sequence":
            row_log = clip(sum(delta.values()))
        elif level == "geometric":
            row_log = clip(sum(delta.values()) / len(selected)) if selected else 0.0
        vetoed = veto is not None and any(d < math.log(veto) for d in delta.values())
        for t in selected:
            log_ratio = clip(delta[t]) if level == "token" else row_log
            rho = math.exp(log_ratio)
            inside = (lower is None or rho >= lower) and (upper is None or rho <= upper)
            keep = not vetoed
            if mode == "truncate":
                w = rho if lower is None else max(rho, lower)
                w = w if upper is None else min(w, upper)
                truncated += int(keep and not inside)
            elif mode == "mask":
                w = rho if inside else 0.0
            else:  # reject
                w = 1.0
                keep = keep and inside
            zeroed = (mode == "mask" and not inside) or not keep
            removed += int(zeroed)
            w = w if keep else 0.0
            weights[i][t] = w
            keep_mask[i][t] = keep
            ratios.append(rho)
            applied.append(w)
            d = clip(delta[t])
            kl1.append(-d)
            kl3.append(math.exp(d) - 1.0 - d)
    n = len(ratios)
    square_sum = sum(w * w for w in applied)
    metrics = {
        "ratio_mean": sum(ratios) / n if n else 0.0,
        "ratio_min": min(ratios) if n else 0.0,
        "ratio_max": max(ratios) if n else 0.0,
        "effective_sample_size": sum(applied) ** 2 / (n * square_sum) if square_sum else 0.0,
        "truncated_fraction": truncated / n if n else 0.0,
        "masked_fraction": removed / n if n else 0.0,
        "kl_k1": sum(kl1) / n if n else 0.0,
        "kl_k3": sum(kl3) / n if n else 0.0,
        "chi_square": sum(r * r - 1.0 for r in ratios) / n if n else 0.0,
    }
    return {
        "weights": torch.tensor(weights, dtype=torch.float64).reshape(batch, tokens),
        "mask": torch.tensor(keep_mask, dtype=torch.bool).reshape(batch, tokens),
        "metrics": metrics,
    }


def off_policy_sequence_mask(
    log_probs: Tensor,
    sampling_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    threshold: float,
) -> Tensor:
    """Reference of rlobjectives.off_policy_sequence_mask (TRL get_off_policy_mask), (B, T) bool."""
    m = _as_list_mask(mask)
    batch, tokens = mask.shape
    out = [[False] * tokens for _ in range(batch)]
    for i, row in enumerate(m):
        selected = [t for t, keep in enumerate(row) if keep]
        kl = [float(sampling_log_probs[i, t]) - float(log_probs[i, t]) for t in selected]
        kl = [0.0 if math.isnan(k) else k for k in kl]
        mean_kl = sum(kl) / max(len(selected), 1)
        for t in selected:
            out[i][t] = float(_advantage(advantages, i, t)) >= 0 or mean_kl <= threshold
    return torch.tensor(out, dtype=torch.bool).reshape(batch, tokens)


# --- entropy mask (issue 13) ------------------------------------------------------------------


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> list[list[bool]]:
    """Reference of rlobjectives.top_entropy_mask: H >= the linear quantile of the selected H.

    The quantile of the sorted selected values v_0 <= ... <= v_{n-1} at level q is
    v_lo + (rank - lo) (v_hi - v_lo) with rank = q (n - 1), lo = floor(rank), hi = ceil(rank)
    (numpy/torch "linear"), in float64; nothing is kept when nothing is selected.
    """
    m = _as_list_mask(mask)
    values = sorted(float(entropy[i, t]) for i, row in enumerate(m) for t, k in enumerate(row) if k)
    if not values:
        return [[False] * len(row) for row in m]
    rank = quantile * (len(values) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    threshold = values[lo] + (rank - lo) * (values[hi] - values[lo])
    return [
        [k and float(entropy[i, t]) >= threshold for t, k in enumerate(row)]
        for i, row in enumerate(m)
    ]


# --- the packed (padding-free) layout (issue 15) ------------------------------------------------


def pack(values: Tensor, attention_mask: Tensor) -> tuple[Tensor, list[int]]:
    """Reference of rlobjectives.pack: each row's attended positions, row after row.

    Returns the ``(N, ...)`` values and ``cu_seqlens`` as a Python list.
    """
    rows: list[Tensor] = []
    cu_seqlens = [0]
    for b in range(attention_mask.shape[0]):
        for t in range(attention_mask.shape[1]):
            if bool(attention_mask[b, t]):
                rows.append(values[b, t])
        cu_seqlens.append(len(rows))
    if not rows:
        return values.reshape(-1, *values.shape[2:])[:0], cu_seqlens
    return torch.stack(rows), cu_seqlens


def unpack(
    values: Tensor, cu_seqlens: list[int], length: int, *, padding_side: str = "right"
) -> tuple[Tensor, Tensor]:
    """Reference of rlobjectives.unpack: sequence s in row s, right or left aligned; 0 elsewhere."""
    sequences = len(cu_seqlens) - 1
    out = torch.zeros((sequences, length, *values.shape[1:]), dtype=values.dtype)
    mask = torch.zeros((sequences, length), dtype=torch.bool)
    for s in range(sequences):
        n = cu_seqlens[s + 1] - cu_seqlens[s]
        first = 0 if padding_side == "right" else length - n
        for k in range(n):
            out[s, first + k] = values[cu_seqlens[s] + k]
            mask[s, first + k] = True
    return out, mask


# --------------------------------------------------------------------------------------------
# The decision rule at a bound (docs/conventions.md, "Decisions at a bound"): an independent
# oracle with mpmath (torch's own dependency), by the definition and not by thresholds.
# --------------------------------------------------------------------------------------------


def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (nearest, ties to even), as a Python float."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def neighbour(value: float, dtype: torch.dtype, direction: float) -> float:
    """The next number of ``dtype`` after ``value`` towards ``direction``."""
    here = torch.tensor(value, dtype=dtype)
    return float(torch.nextafter(here, torch.tensor(direction, dtype=dtype)))


def correctly_rounded_exp(x: float, dtype: torch.dtype) -> float:
    """``fl(e^x)`` in ``dtype``: the number of ``dtype`` nearest to ``e^x`` (300-bit mpmath).

    The nearest of three candidates around ``e^x``, measured exactly (no tie is possible: ``e^x``
    is transcendental for ``x != 0``).
    """
    import mpmath

    with mpmath.workprec(300):
        exact = mpmath.exp(mpmath.mpf(x))
        guess = rounded(float(exact), dtype)
        candidates = [guess, neighbour(guess, dtype, math.inf), neighbour(guess, dtype, -math.inf)]
        finite = [c for c in candidates if math.isfinite(c)]
        best = min(finite, key=lambda c: abs(mpmath.mpf(c) - exact))
        largest = float(torch.finfo(dtype).max)
        if (
            best == largest
            and exact
            > mpmath.mpf(largest)
            + (mpmath.mpf(largest) - mpmath.mpf(neighbour(largest, dtype, 0.0))) / 2
        ):
            return math.inf
        return best


def rule_compare(x: float, bound: float, dtype: torch.dtype) -> int:
    """The sign of ``fl(e^x) - fl(B)`` in ``dtype``: -1 (ratio below), 0 (on), 1 (above)."""
    if math.isnan(x):
        return 2  # in no set
    ratio, edge = correctly_rounded_exp(x, dtype), rounded(bound, dtype)
    return (ratio > edge) - (ratio < edge)


# === Issue 24: DPPO, DRO, M2PO, Clip-Cov / KL-Cov, nll_loss ==================================

BINARY_KL_EPSILON = 1e-8  # verl / SkyRL


def _log(x: float) -> float:
    """``math.log`` with NaN for a negative argument and -inf at 0 (as torch.log)."""
    if x != x or x < 0:
        return math.nan
    return -math.inf if x == 0 else math.log(x)


def binary_kl(log_prob: float, old_log_prob: float) -> float:
    """DPPO's binary KL: p_old log(p_old / p) + (1 - p_old) log((1 - p_old + e) / (1 - p + e))."""
    p, p_old = math.exp(log_prob), math.exp(old_log_prob)
    first = 0.0 if p_old == 0 else p_old * (old_log_prob - log_prob)
    logs = _log(1 - p_old + BINARY_KL_EPSILON) - _log(1 - p + BINARY_KL_EPSILON)
    return first + (1 - p_old) * logs


def dppo_kept(
    log_prob: float, old_log_prob: float, advantage: float, options: dict[str, object]
) -> bool:
    """Whether a token stays in DPPO's trust region (A <= 0 takes the low rule)."""
    low, high = float(options["dppo_low"]), float(options["dppo_high"])  # type: ignore[arg-type]
    if options["dppo_divergence"] == "tv":
        moved = math.exp(log_prob) - math.exp(old_log_prob)
        return moved <= high if advantage > 0 else moved >= -low
    divergence = binary_kl(log_prob, old_log_prob)
    if advantage > 0:
        return divergence <= high or log_prob <= old_log_prob
    return divergence <= low or log_prob >= old_log_prob


def _selected_tokens(mask: Tensor) -> list[tuple[int, int]]:
    return [
        (i, t) for i, row in enumerate(_as_list_mask(mask)) for t, keep in enumerate(row) if keep
    ]


def m2po_masked(log_ratios: list[float], threshold: float) -> list[int]:
    """Indices (into ``log_ratios``) M2PO masks: the fewest largest squares, rest's mean < tau.

    Sorted descending with ties by position (the earlier masked first); the suffix sums are
    accumulated from the smallest value up; at least one value is kept.
    """
    n = len(log_ratios)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda j: (-(log_ratios[j] ** 2), j))
    squares = [log_ratios[j] ** 2 for j in order]
    suffix = [0.0] * n
    total = 0.0
    for position in range(n - 1, -1, -1):
        total += squares[position]
        suffix[position] = total
    first = n - 1
    for position in range(n):
        if suffix[position] / (n - position) < threshold:
            first = position
            break
    return order[:first]


def m2po_mask(log_ratio: Tensor, mask: Tensor, threshold: float) -> list[list[bool]]:
    """Reference of rlobjectives.m2po_mask: the kept tokens of the whole batch."""
    tokens = _selected_tokens(mask)
    values = [float(log_ratio[i, t]) for i, t in tokens]
    masked = {tokens[j] for j in m2po_masked(values, threshold)}
    return [[keep and (i, t) not in masked for t, keep in enumerate(row)]
            for i, row in enumerate(_as_list_mask(mask))]  # fmt: skip


def covariances(
    log_probs: Tensor, advantages: Tensor, mask: Tensor
) -> dict[tuple[int, int], float]:
    """(A - mean A)(l - mean l) over the selected tokens, exact means (plain sums)."""
    tokens = _selected_tokens(mask)
    if not tokens:
        return {}
    a = {k: float(_advantage(advantages, *k)) for k in tokens}
    lp = {k: float(log_probs[k]) for k in tokens}
    mean_a = sum(a.values()) / len(tokens)
    mean_lp = sum(lp.values()) / len(tokens)
    return {k: (a[k] - mean_a) * (lp[k] - mean_lp) for k in tokens}


def selection_count(ratio: float, count: int) -> int:
    """verl's max(int(ratio * N), 1)."""
    return max(int(ratio * count), 1)


_M64 = 1 << 64


def splitmix64(value: int) -> int:
    """SplitMix64 of a Python int (mod 2**64), as a signed 64-bit int."""
    z = (value + 0x9E3779B97F4A7C15) % _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _M64
    z ^= z >> 31
    return z - _M64 if z >= 1 << 63 else z


def random_subset(
    candidates: list[tuple[int, int]], ordinals: dict[tuple[int, int], int], k: int, seed: int
) -> set[tuple[int, int]]:
    """The k candidates of smallest splitmix64(seed + ordinal) (ties by ordinal)."""
    keyed = sorted(candidates, key=lambda c: (splitmix64(seed + ordinals[c]), ordinals[c]))
    return set(keyed[:k])


def clip_cov_candidates(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    options: dict[str, object],
) -> list[tuple[int, int]]:  # fmt: skip
    """Selected tokens the band [1 - low, 1 + high] does not clip, cov_lb < cov < cov_ub."""
    low = float(options["clip_low"])  # type: ignore[arg-type]
    high = low if options["clip_high"] is None else float(options["clip_high"])  # type: ignore[arg-type]
    bound = options["log_ratio_bound"]
    cov = covariances(log_probs, advantages, mask)
    out = []
    for i, t in _selected_tokens(mask):
        delta = float(log_probs[i, t] - old_log_probs[i, t])
        if bound is not None:
            delta = min(max(delta, -float(bound)), float(bound))  # type: ignore[arg-type]
        r, a = math.exp(delta), float(_advantage(advantages, i, t))
        clipped = (a > 0 and r > 1 + high) or (a < 0 and r < 1 - low)
        if not clipped and float(options["cov_lb"]) < cov[(i, t)] < float(options["cov_ub"]):  # type: ignore[arg-type]
            out.append((i, t))
    return out


def batch_selection(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    options: dict[str, object],
) -> set[tuple[int, int]]:  # fmt: skip
    """M2PO's masked tokens, Clip-Cov's detached tokens or KL-Cov's penalised tokens.

    A precomputed ``cov_selection`` is used as given (and the mask). Clip-Cov draws with
    ``cov_seed`` (the int64 seed of the call) when it has more candidates than ``k``; with at
    most ``k`` candidates every candidate is detached, whatever the draw.
    """
    surrogate = options["surrogate"]
    tokens = _selected_tokens(mask)
    if surrogate == "m2po":
        values = [float(log_probs[k] - old_log_probs[k]) for k in tokens]
        return {tokens[j] for j in m2po_masked(values, float(options["m2po_threshold"]))}  # type: ignore[arg-type]
    given = options.get("cov_selection")
    if given is not None:
        chosen = given.reshape(mask.shape)  # type: ignore[attr-defined]
        return {k for k in tokens if bool(chosen[k])}
    k = selection_count(float(options["cov_ratio"]), len(tokens))  # type: ignore[arg-type]
    if surrogate == "kl_cov":
        cov = covariances(log_probs, advantages, mask)
        ranked = sorted(range(len(tokens)), key=lambda j: (-cov[tokens[j]], j))
        return {tokens[j] for j in ranked[:k]}
    candidates = clip_cov_candidates(log_probs, old_log_probs, advantages, mask, options)
    if len(candidates) <= k:
        return set(candidates)
    seed = options.get("cov_seed")
    if seed is None:
        raise ValueError(
            "the reference needs cov_seed for a Clip-Cov draw with more than k candidates"
        )
    ordinals = {token: j for j, token in enumerate(tokens)}
    return random_subset(candidates, ordinals, k, int(seed))  # type: ignore[call-overload]


def batch_level_surrogates(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    options: dict[str, object],
) -> dict[tuple[int, int], Tensor]:  # fmt: skip
    """{(i, t): s_it} of M2PO (kept tokens only: the loss's selection), Clip-Cov, KL-Cov."""
    surrogate, bound = options["surrogate"], options["log_ratio_bound"]
    chosen = batch_selection(log_probs.detach(), old_log_probs, advantages, mask, options)
    out: dict[tuple[int, int], Tensor] = {}
    for i, t in _selected_tokens(mask):
        a = _advantage(advantages, i, t)
        lp, old = log_probs[i, t], old_log_probs[i, t]
        ratio = torch.exp(_bounded(lp - old, bound))  # type: ignore[arg-type]
        if surrogate == "kl_cov":
            penalty = float(options["kl_cov_coef"]) * torch.abs(_bounded(lp - old, bound))  # type: ignore[arg-type]
            out[(i, t)] = ratio * a - (penalty if (i, t) in chosen else 0.0)
            continue
        if surrogate == "m2po" and (i, t) in chosen:
            continue  # masked: out of the loss's selection (AReaL's denominator)
        if options["clip_low"] is None:
            s = ratio * a
        else:
            s = surrogate_token(
                lp, old, a, clip_low=options["clip_low"], clip_high=options["clip_high"],  # type: ignore[arg-type]
                dual_clip=None, log_ratio_bound=bound,  # type: ignore[arg-type]
            )  # fmt: skip
        out[(i, t)] = 0.0 * lp if (i, t) in chosen else s  # Clip-Cov: detached, in the denominator
    return out


def nll_loss(
    log_probs: Tensor,
    mask: Tensor,
    *,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    max_response_length: int | None = None,
    labels: list[object] | None = None,
) -> Tensor:
    """Reference of rlobjectives.nll_loss: reduce(-log_probs) over the selected tokens."""
    losses = {(i, t): -log_probs[i, t] for i, t in _selected_tokens(mask)}
    return reduce_losses(
        losses, tuple(mask.shape), reduction=reduction, normalizer=normalizer,  # type: ignore[arg-type]
        max_response_length=max_response_length, labels=labels,
    )  # fmt: skip


# --- on-policy distillation and the 2026 advantages (issue 25) ---------------------------------


def _token_rows(values: Tensor) -> Tensor:
    """(B, T, X) -> (B * T, X)."""
    return values.reshape(-1, values.shape[-1])


def topk_forward_kl(
    logits: Tensor,
    teacher_log_probs: Tensor,
    teacher_ids: Tensor,
    mask: Tensor,
    *,
    tail: bool = True,
    renormalize: bool = False,
    temperature: float = 1.0,
) -> Tensor:
    """Reference of rlobjectives.topk_forward_kl(reduction="none"): (B, T), 0 where unselected.

    Per selected token: x = logits / tau in float64, log q = log_softmax(x); the teacher's slots
    with a log-probability above -inf; head = sum_k p_k (l^T_k - log q[id_k]); tail: the
    teacher's tail 1 - sum_k p_k (0 when <= 0: no bucket) against the student's, the sum of q
    over the tokens outside the set (0 bucket when the set covers the vocabulary);
    renormalize: both renormalised over the slots.
    """
    shape = tuple(mask.shape)
    rows, teacher, ids = (
        _token_rows(logits),
        _token_rows(teacher_log_probs),
        _token_rows(teacher_ids),
    )
    keep = [bool(v) for v in mask.reshape(-1).tolist()]
    zero = torch.zeros((), dtype=torch.float64)
    out = []
    for n, selected in enumerate(keep):
        if not selected:
            out.append(zero)
            continue
        log_q = torch.log_softmax(rows[n].double() / temperature, -1)
        slots = [k for k in range(teacher.shape[1]) if float(teacher[n, k]) != -math.inf]
        lt = [teacher[n, k].double().detach() for k in slots]
        ls = [log_q[int(ids[n, k])] for k in slots]
        if not slots:
            out.append(zero)
            continue
        if renormalize:
            lt_sum, ls_sum = (
                torch.logsumexp(torch.stack(lt), 0),
                torch.logsumexp(torch.stack(ls), 0),
            )
            value = sum(
                (
                    torch.exp(a - lt_sum) * ((a - lt_sum) - (b - ls_sum))
                    for a, b in zip(lt, ls, strict=True)
                ),
                zero,
            )
            out.append(value)
            continue
        value = sum((torch.exp(a) * (a - b) for a, b in zip(lt, ls, strict=True)), zero)
        if tail:
            teacher_tail = 1.0 - sum((torch.exp(a) for a in lt), zero)
            members = {int(ids[n, k]) for k in slots}
            rest = [log_q[v].exp() for v in range(log_q.shape[0]) if v not in members]
            if float(teacher_tail) > 0 and rest:
                student_tail = sum(rest, zero)
                value = value + teacher_tail * torch.log(teacher_tail / student_tail)
        out.append(value)
    return torch.stack(out).reshape(shape) if out else torch.zeros(shape, dtype=torch.float64)


def generalized_jsd(
    logits: Tensor, teacher_logits: Tensor, mask: Tensor, *, beta: float, temperature: float = 1.0
) -> Tensor:
    """Reference of rlobjectives.generalized_jsd_loss(reduction="none"): (B, T).

    q = softmax(student / tau), p = softmax(teacher / tau) (detached); beta = 0: KL(p || q),
    beta = 1: KL(q || p), else beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1-beta) q;
    terms with zero probability are 0.
    """
    shape = tuple(mask.shape)
    rows, teacher = _token_rows(logits), _token_rows(teacher_logits)
    keep = [bool(v) for v in mask.reshape(-1).tolist()]
    zero = torch.zeros((), dtype=torch.float64)

    def kl(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(a > 0, a * (torch.log(torch.where(a > 0, a, 1.0)) - torch.log(b)),
                           zero).sum()  # fmt: skip

    out = []
    for n, selected in enumerate(keep):
        if not selected:
            out.append(zero)
            continue
        q = torch.softmax(rows[n].double() / temperature, -1)
        p = torch.softmax(teacher[n].double().detach() / temperature, -1)
        if beta == 0.0:
            out.append(kl(p, q))
        elif beta == 1.0:
            out.append(kl(q, p))
        else:
            m = beta * p + (1 - beta) * q
            out.append(beta * kl(p, m) + (1 - beta) * kl(q, m))
    return torch.stack(out).reshape(shape) if out else torch.zeros(shape, dtype=torch.float64)


def reverse_kl_rewards(
    log_probs: Tensor,
    teacher_log_probs: Tensor,
    mask: Tensor,
    *,
    coef: float = 1.0,
    estimator: str = "k1",
    log_ratio_bound: float | None = None,
) -> Tensor:
    """Reference of rlobjectives.reverse_kl_rewards: -coef * k(l^S - l^T) at selected tokens."""
    estimates = kl_estimate(log_probs, teacher_log_probs, mask, estimator=estimator,
                            log_ratio_bound=log_ratio_bound)  # fmt: skip
    return (-coef * estimates).detach() + 0.0


def gdpo_advantages(
    rewards: Tensor,
    labels: list[object],
    *,
    weights: list[float] | None = None,
    eps: float = 1e-6,
    whiten: bool = True,
) -> Tensor:
    """Reference of rlobjectives.gdpo_advantages: loops over components and groups (float64).

    Per component: (r - mean_g) / (std_g + eps), unbiased std, 0 for a group of one (and where
    std + eps is 0); the weighted sum; then (S - mean) / (std + eps) over the batch (0 for one
    sequence, or where std + eps is 0).
    """
    zero = torch.zeros((), dtype=torch.float64)
    batch, components = rewards.shape
    weight = [1.0] * components if weights is None else list(weights)
    total: list[Tensor] = [zero] * batch
    for k in range(components):
        column = [rewards[b, k].double() for b in range(batch)]
        for members in _members(labels).values():
            group = [column[b] for b in members]
            mean = sum(group, zero) / len(group)
            std = _std(group)
            for b in members:
                centered = column[b] - mean
                if len(members) > 1 and float(std.detach()) + eps > 0:
                    total[b] = total[b] + weight[k] * centered / (std + eps)
    if not whiten:
        return torch.stack(total) if total else torch.zeros(0, dtype=torch.float64)
    mean = sum(total, zero) / max(batch, 1)
    std = _std(total)
    spread = float(std.detach()) + eps
    out = [(x - mean) / (std + eps) if batch > 1 and spread > 0 else zero for x in total]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def maxrl_advantages(rewards: Tensor, labels: list[object], *, eps: float = 0.0) -> Tensor:
    """Reference of rlobjectives.maxrl_advantages: (r - mu) / (mu + eps) for groups of >= 2
    with mu > 0, else 0."""
    zero = torch.zeros((), dtype=torch.float64)
    items = [rewards[k].double() for k in range(rewards.shape[0])]
    out: list[Tensor] = [zero] * len(items)
    for members in _members(labels).values():
        group = [items[k] for k in members]
        mean = sum(group, zero) / len(group)
        if len(group) < 2 or float(mean.detach()) <= 0:
            continue
        for k in members:
            out[k] = (items[k] - mean) / (mean + eps)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def length_adaptive_lambda(lengths: list[float], *, alpha: float) -> list[float]:
    """Reference of rlobjectives.length_adaptive_lambda: max(0, 1 - 1/(alpha l)), 0 at l <= 0."""
    return [max(0.0, 1.0 - 1.0 / (alpha * length)) if length > 0 else 0.0 for length in lengths]


def overlong_penalty(
    lengths: list[float], max_length: int, cache_length: int, *, factor: float = 1.0
) -> list[float]:
    """Reference of rlobjectives.overlong_penalty: DAPO Eq. 13 times factor (by cases)."""
    out = []
    for length in lengths:
        if length <= max_length - cache_length:
            out.append(0.0)
        elif length <= max_length:
            out.append(factor * ((max_length - cache_length) - length) / cache_length)
        else:
            out.append(-factor)
    return out


# --- the peers' formulas (restated from their code; issue 25) ------------------------------------


def verl_forward_kl_topk(
    logits: Tensor,
    teacher_log_probs: Tensor,
    teacher_ids: Tensor,
    *,
    log_prob_min_clamp: float | None = None,
    temperature: float = 1.0,
) -> dict[str, Tensor]:
    """verl 0.9.1 ``compute_forward_kl_topk`` (fsdp): per-token head KL and the top-k masses.

    ``log_softmax(logits)`` gathered at the teacher's ids; the masses before the clamp; both
    log-probabilities clamped from below at ``log_prob_min_clamp``; ``sum_k e^{l^T}(l^T - l^S)``
    (no padding support in verl).
    """
    student = torch.log_softmax(logits.double() / temperature, -1).gather(-1, teacher_ids)
    teacher = teacher_log_probs.double()
    student_mass, teacher_mass = student.exp().sum(-1), teacher.exp().sum(-1)
    if log_prob_min_clamp is not None:
        student = student.clamp_min(log_prob_min_clamp)
        teacher = teacher.clamp_min(log_prob_min_clamp)
    losses = (teacher.exp() * (teacher - student)).sum(-1)
    return {"losses": losses, "student_mass": student_mass, "teacher_mass": teacher_mass}


def verl_kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, mode: str) -> Tensor:
    """verl ``kl_penalty(logprob, ref_logprob, kl_penalty)``: k1/kl, abs, k2/mse, k3/low_var_kl
    (``ref - log`` clamped to +-20, the value to +-10), and the ``+`` straight-through forms."""
    base = mode[:-1] if mode.endswith("+") else mode
    d = log_prob - ref_log_prob
    if base in ("kl", "k1"):
        forward = d
    elif base == "abs":
        forward = d.abs()
    elif base in ("mse", "k2"):
        forward = 0.5 * d.square()
    else:
        kl = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not mode.endswith("+") or base in ("mse", "k2"):
        return forward
    backward = 0.5 * d.square()
    return backward - backward.detach() + forward.detach()


def trl_server_forward_kl(
    student_log_probs: Tensor,
    teacher_log_probs: Tensor,
    teacher_ids: Tensor,
    labels: Tensor,
    *,
    loss_add_tail: bool,
) -> Tensor:
    """TRL 1.16 ``_compute_server_forward_kl_loss`` (beta = 0): ``-inf`` slots are padding; the
    tail bucket ``log(1 - exp(min(logsumexp, -1e-7)))`` on both sides, or both renormalised;
    ``sum p_T (log p_T - log p_S)`` over the support; batchmean over ``labels != -100``."""
    valid = teacher_log_probs > -math.inf
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64)
    student = torch.where(valid, student_log_probs.gather(-1, teacher_ids), neg_inf)
    teacher = torch.where(valid, teacher_log_probs.double(), neg_inf)

    def bucket(log_probs: Tensor) -> Tensor:
        log_sum = torch.clamp(torch.logsumexp(log_probs, -1, keepdim=True), max=-1e-7)
        return torch.cat([log_probs, torch.log(-torch.expm1(log_sum))], -1)

    if loss_add_tail:
        student, teacher = bucket(student), bucket(teacher)
        support = torch.cat([valid, torch.ones_like(valid[..., :1])], -1)
    else:
        student = student - torch.logsumexp(student, -1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, -1, keepdim=True)
        support = valid
    terms = torch.where(support, teacher.exp() * (teacher - student), 0.0).sum(-1)
    mask = labels != -100
    return terms[mask].sum() / mask.sum().clamp_min(1)


def trl_generalized_jsd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: float | None = None,
) -> Tensor:
    """TRL 1.16 ``GKDTrainer.generalized_jsd_loss``: ``F.kl_div`` terms (beta 0: KL(p_T || p_S),
    1: KL(p_S || p_T), else the mixture via logsumexp), masked by labels, then TRL's reduction."""
    student = torch.log_softmax(student_logits / temperature, -1)
    teacher = torch.log_softmax(teacher_logits / temperature, -1)
    kl = torch.nn.functional.kl_div
    if beta == 0:
        jsd = kl(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        jsd = kl(teacher, student, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student.dtype)
        mixture = torch.logsumexp(
            torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), 0
        )
        jsd = beta * kl(mixture, teacher, reduction="none", log_target=True) + (1 - beta) * kl(
            mixture, student, reduction="none", log_target=True
        )
    mask = None if labels is None else labels != -100
    if mask is not None:
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        return jsd.sum() / num_items_in_batch
    if reduction == "batchmean":
        denominator = mask.sum().clamp_min(1) if mask is not None else max(jsd.size(0), 1)
        return jsd.sum() / denominator
    return jsd.sum() if reduction == "sum" else jsd.mean()


def verl_gdpo(
    scores: Tensor,
    response_mask: Tensor,
    index: list[object],
    *,
    weights: list[float] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Tensor:
    """verl 0.9.1 ``compute_gdpo_outcome_advantage``: per key verl's grpo (a group of one: mu = 0,
    sigma = 1; torch.std), the weighted sum broadcast to the tokens, ``masked_whiten`` over
    them (unbiased, rsqrt(var + 1e-8)), times the mask."""
    zero = torch.zeros((), dtype=torch.float64)
    batch, components = scores.shape
    weight = [1.0] * components if weights is None else list(weights)
    total = [zero] * batch
    for k in range(components):
        column = [scores[b, k].double() for b in range(batch)]
        for members in _members(index).values():
            group = [column[b] for b in members]
            mean = sum(group, zero) / len(group) if len(group) > 1 else zero
            std = torch.std(torch.stack(group)) if len(group) > 1 else zero + 1.0
            for b in members:
                value = column[b] - mean
                if norm_adv_by_std_in_grpo:
                    value = value / (std + epsilon)
                total[b] = total[b] + weight[k] * value
    per_token = torch.stack(total)[:, None].expand(response_mask.shape)
    return masked_whiten(per_token, response_mask, eps=1e-8)


def trl_multi_objective_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    weights: list[float] | None = None,
    aggregation: str = "sum_then_normalize",
    scale_rewards: str = "group",
) -> Tensor:
    """TRL 1.16 GRPO advantages (no NaN rewards): ``sum_then_normalize`` (weighted sum, group
    mean, the group's / the batch's unbiased std + 1e-4, or none) or ``normalize_then_sum``
    (each function z-scored in its group with std + 1e-4, weighted sum, then the batch's)."""
    batch, components = rewards.shape
    w = (
        torch.ones(components, dtype=torch.float64)
        if weights is None
        else torch.tensor(weights, dtype=torch.float64)
    )
    grouped = rewards.double().view(-1, num_generations, components)

    def std(x: Tensor, dim: int | None = None) -> Tensor:
        return x.std(dim=dim, keepdim=dim is not None) if x.numel() > 1 else torch.zeros(())

    if aggregation == "normalize_then_sum":
        mean_k = grouped.mean(1, keepdim=True)
        std_k = grouped.std(1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        summed = (((grouped - mean_k) / (std_k + 1e-4)).reshape(batch, components) * w).sum(1)
        return (summed - summed.mean()) / (std(summed) + 1e-4)
    summed = (rewards.double() * w).sum(1)
    mean_g = summed.view(-1, num_generations).mean(1).repeat_interleave(num_generations)
    if scale_rewards == "none":
        return summed - mean_g
    if scale_rewards == "group":
        group_std = summed.view(-1, num_generations).std(1) if num_generations > 1 else None
        spread = (
            torch.zeros_like(summed)
            if group_std is None
            else group_std.repeat_interleave(num_generations)
        )
    else:
        spread = std(summed).expand_as(summed)
    return (summed - mean_g) / (spread + 1e-4)


# --- the sampler's kept set: truncated log-probabilities and entropy (issue 25, item 1) --------


def kept_set(
    row: Tensor,
    *,
    ids: list[int] | None = None,
    pad: int = -1,
    keep: list[bool] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> list[bool]:
    """The kept set of one row of logits (already divided by the temperature), as booleans.

    ``ids``: kept ids (``pad`` ignored; none left: the whole vocabulary). ``keep``: a mask
    (all False: the whole vocabulary). Otherwise the rule, written from its definition in
    vLLM V1's order: min-p keeps ``p_v >= min_p * max_u p_u`` (the probabilities of the whole
    row); top-k keeps, of those, ``x >= x_(k)`` (the k-th largest value, ties kept); top-p keeps,
    of those, every token whose renormalised mass strictly above it is below p (the top token
    always).
    """
    vocab = row.shape[0]
    if ids is not None:
        real = {i for i in ids if i != pad}
        return [v in real for v in range(vocab)] if real else [True] * vocab
    if keep is not None:
        return list(keep) if any(keep) else [True] * vocab
    values = [float(x) for x in row.tolist()]
    kept = [True] * vocab
    if min_p is not None:
        largest = max(values)
        total = sum(math.exp(x - largest) for x in values)
        probs = [math.exp(x - largest) / total for x in values]
        kept = [p >= min_p * max(probs) for p in probs]
    if top_k is not None:
        inside = sorted((x for x, k in zip(values, kept, strict=True) if k), reverse=True)
        if top_k < len(inside):
            kth = inside[top_k - 1]
            kept = [k and x >= kth for x, k in zip(values, kept, strict=True)]
    if top_p is not None:
        top = max(x for x, k in zip(values, kept, strict=True) if k)
        total = sum(math.exp(x - top) for x, k in zip(values, kept, strict=True) if k)
        mass = [math.exp(x - top) / total if k else 0.0 for x, k in zip(values, kept, strict=True)]
        above = [sum(m for m in mass if m > mass[v]) for v in range(vocab)]
        kept = [kept[v] and (above[v] < top_p or values[v] == top) for v in range(vocab)]
    return kept


def _kept_rows(
    rows: Tensor,
    kept_ids: Tensor | None,
    kept_mask: Tensor | None,
    pad: int,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None = None,
) -> list[list[bool]]:
    """The kept set of every row of ``rows`` ``(N, V)`` (after the temperature)."""
    sets = []
    for n in range(rows.shape[0]):
        ids = (
            None
            if kept_ids is None
            else [int(i) for i in kept_ids.reshape(-1, kept_ids.shape[-1])[n]]
        )
        keep = (
            None
            if kept_mask is None
            else [bool(k) for k in kept_mask.reshape(-1, rows.shape[1])[n]]
        )
        sets.append(
            kept_set(
                rows[n].detach(), ids=ids, pad=pad, keep=keep, top_k=top_k, top_p=top_p, min_p=min_p
            )  # fmt: skip
        )
    return sets


def truncated_log_probs(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    *,
    kept_ids: Tensor | None = None,
    kept_mask: Tensor | None = None,
    kept_pad: int = -1,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference of token_log_probs / token_entropy with a kept set: ``(log_probs, entropy)``.

    Row by row in float64: ``x = logits / tau``, K from :func:`kept_set`; ``x_y - logsumexp(x_K)``
    (``-inf``, a constant, when y is not in K) and ``-sum_{v in K} q log q``; 0 where masked.
    Differentiable with respect to ``logits`` (``x_K`` is selected by indexing).
    """
    rows, shape = _rows(logits)
    scaled = rows.double() / temperature
    sets = _kept_rows(scaled, kept_ids, kept_mask, kept_pad, top_k, top_p)
    flat_tokens = tokens.reshape(-1).tolist()
    zero = torch.zeros((), dtype=torch.float64)
    log_probs, entropies = [], []
    for n, keep in enumerate(_row_keep(mask, rows.shape[0])):
        if not keep:
            log_probs.append(zero)
            entropies.append(zero)
            continue
        index = torch.tensor([v for v, k in enumerate(sets[n]) if k])
        inside = scaled[n][index]  # (|K|,)
        lse = torch.logsumexp(inside, 0)
        y = int(flat_tokens[n])
        log_probs.append(
            scaled[n][y] - lse if sets[n][y] else torch.tensor(-math.inf, dtype=torch.float64)
        )
        log_q = inside - lse
        entropies.append(-(log_q.exp() * log_q).sum())
    if not log_probs:
        empty = torch.zeros(shape, dtype=torch.float64)
        return empty, empty
    return torch.stack(log_probs).reshape(shape), torch.stack(entropies).reshape(shape)


def truncated_log_probs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    **kept: object,
) -> tuple[Tensor, Tensor]:
    """Reference of token_log_probs_from_hidden with a kept set: the float64 logits, then
    :func:`truncated_log_probs`."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return truncated_log_probs(logits, tokens, mask, temperature, **kept)  # type: ignore[arg-type]


# --- issue 35: prompt_mean, DFT, decoupled PPO, GPG, IW-OPD and the rest ------------------------


def dft_loss(
    log_probs: Tensor,
    mask: Tensor,
    *,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    max_response_length: int | None = None,
    labels: list[object] | None = None,
) -> Tensor:
    """Reference of rlobjectives.dft_loss: reduce(-sg(exp(l)) l) over the selected tokens."""
    losses = {
        (i, t): -math.exp(float(log_probs[i, t].detach())) * log_probs[i, t]
        for i, t in _selected_tokens(mask)
    }
    return reduce_losses(
        losses, tuple(mask.shape), reduction=reduction, normalizer=normalizer,  # type: ignore[arg-type]
        max_response_length=max_response_length, labels=labels,
    )  # fmt: skip


def gpg_advantages(rewards: Tensor, labels: list[object], *, f_norm: float = 1.0) -> Tensor:
    """GPG: alpha (r - mean of the group) / f_norm, alpha = B / max(#{r != 0}, 1); 0 alone."""
    batch = rewards.shape[0]
    alpha = batch / max(sum(1 for k in range(batch) if float(rewards[k].detach()) != 0.0), 1)
    out = [torch.zeros((), dtype=torch.float64)] * batch
    for members in _members(labels).values():
        mean = sum((rewards[k] for k in members), torch.zeros((), dtype=torch.float64))
        mean = mean / len(members)
        for k in members:
            out[k] = alpha * (rewards[k] - mean) / f_norm if len(members) > 1 else 0.0 * rewards[k]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def relative_position_lambda(lengths: list[float], *, q: float) -> list[float]:
    """lambda = q ** (1 / (L - 1)) for L >= 2, 1 for L = 1, 0 for L = 0 (float64)."""
    return [q ** (1.0 / (n - 1)) if n >= 2 else (1.0 if n == 1 else 0.0) for n in lengths]


def group_length_penalty(
    rewards: Tensor, quantities: Tensor, weights: list[float], labels: list[object]
) -> Tensor:
    """r - mean_g(r) sum_k w_k x_k / max(max_g x_k, 1), minus its group mean (loops)."""
    out = [torch.zeros((), dtype=torch.float64)] * rewards.shape[0]
    for members in _members(labels).values():
        mean = sum((rewards[k] for k in members), torch.zeros((), dtype=torch.float64))
        mean = mean / len(members)
        shaped = {}
        for k in members:
            penalty = torch.zeros((), dtype=torch.float64)
            for column, weight in enumerate(weights):
                longest = max(max(float(quantities[j, column].detach()) for j in members), 1.0)
                penalty = penalty + weight * quantities[k, column] / longest
            shaped[k] = rewards[k] - mean * penalty
        shaped_mean = sum(shaped.values(), torch.zeros((), dtype=torch.float64)) / len(members)
        for k in members:
            out[k] = shaped[k] - shaped_mean
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def proximal_log_probs(
    log_probs: Tensor,
    behavior: Tensor,
    versions: Tensor,
    current_version: int,
    method: str = "loglinear",
) -> Tensor:
    """AReaL's proximal policy, element by element (float64, differentiable)."""
    flat_lp, flat_b = log_probs.reshape(-1), behavior.reshape(-1)
    out = []
    for k, v in enumerate(versions.reshape(-1).tolist()):
        ahead = current_version - v
        alpha = min(max((ahead - 1) / ahead, 0.0), 1.0) if ahead > 0 and v >= 0 else 0.0
        if method == "loglinear":
            out.append(flat_b[k] + alpha * (flat_lp[k] - flat_b[k]))
        else:
            out.append(
                torch.log((1 - alpha) * torch.exp(flat_b[k]) + alpha * torch.exp(flat_lp[k]))
            )
    if not out:
        return torch.zeros(log_probs.shape, dtype=torch.float64)
    return torch.stack(out).reshape(log_probs.shape)


def _binary_kl_value(log_p: float, log_q: float) -> float:
    eps = 1e-8
    p = min(max(math.exp(log_p), eps), 1 - eps)
    q = min(max(math.exp(log_q), eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def rejection_mask(
    proximal: Tensor,
    behavior: Tensor,
    mask: Tensor,
    *,
    upper: float,
    lower: float | None = None,
    level: str = "token",
    estimator: str = "ratio",
    aggregate: str = "mean",
    symmetric: bool = False,
) -> list[list[bool]]:
    """AReaL's kept mask by loops: per-token metrics, the sequence aggregate, both bounds."""

    def metric(i: int, t: int) -> float:
        a, b = float(proximal[i, t]), float(behavior[i, t])
        d = a - b
        if symmetric:
            return max(_binary_kl_value(a, b), _binary_kl_value(b, a))
        if estimator == "ratio":
            return d  # the log-ratio; the bounds compare its correctly rounded exp
        if estimator == "k1":
            return d
        if estimator == "k2":
            return d * d / 2
        return math.exp(-d) - 1 + d

    def inside(value: float) -> bool:
        if math.isnan(value):
            return False
        if estimator == "ratio" and not symmetric:
            dtype = torch.float64
            return rule_compare(value, upper, dtype) <= 0 and (
                lower is None or rule_compare(value, lower, dtype) >= 0
            )
        return value <= upper and (lower is None or value >= lower)

    rows, tokens = mask.shape
    keep = [[False] * tokens for _ in range(rows)]
    for i in range(rows):
        selected = [t for t in range(tokens) if bool(mask[i, t])]
        values = [metric(i, t) for t in selected]
        if level == "sequence":
            if not values:
                continue
            if aggregate == "sum":
                value = sum(values)
            elif aggregate == "mean":
                value = sum(values) / len(values)
            else:
                value = max(values)
            for t in selected:
                keep[i][t] = inside(value)
        else:
            for t, value in zip(selected, values, strict=True):
                keep[i][t] = inside(value)
    return keep


def iw_opd_advantages(
    teacher: Tensor, rollout: Tensor, mask: Tensor, *, gamma: float, eps: float = 1e-8
) -> Tensor:
    """IW-OPD: w_t A_t, w_t = 1 + gamma (1 - prefix |A| / max(total |A|, eps)), row by row."""
    out = torch.zeros(teacher.shape, dtype=torch.float64)
    for i in range(teacher.shape[0]):
        selected = [t for t in range(teacher.shape[1]) if bool(mask[i, t])]
        advantage = {t: float(teacher[i, t]) - float(rollout[i, t]) for t in selected}
        total = max(sum(abs(a) for a in advantage.values()), eps)
        before = 0.0
        for t in selected:
            out[i, t] = (1 + gamma * (1 - before / total)) * advantage[t]
            before += abs(advantage[t])
    return out


def adaptive_entropy_values(
    init: float, target: float, delta: float, low: float, high: float, entropies: list[float]
) -> list[float]:
    """The applied coefficients after each update (TRL's rule and gate, in Python floats)."""
    coef, last, out = init, math.inf, []
    for entropy in entropies:
        coef = min(coef + delta, high) if entropy <= target else max(coef - delta, low)
        last = entropy
        out.append(coef if last <= target else 0.0)
    return out


# --- preference objectives (issue 34) -------------------------------------------------------------


def _log_sigmoid(z: Tensor) -> Tensor:
    """log(1 / (1 + e^{-z})), written both ways so that neither side overflows."""
    if float(z.detach()) >= 0:
        return -torch.log1p(torch.exp(-z))
    return z - torch.log1p(torch.exp(z))


def _f_score(x: Tensor, kind: str, alpha: float) -> Tensor:
    if kind == "reverse_kl":
        return x
    if kind == "forward_kl":
        return 1 - torch.exp(-x)
    if kind == "js_divergence":
        return math.log(2.0) + _log_sigmoid(x)
    if abs(alpha - 1.0) < 1e-6:
        return x
    t = torch.clamp((alpha - 1.0) * x, max=80.0)
    return (torch.exp(t) - 1.0) / (alpha - 1.0)


def preference_pair_loss(name: str, o: dict[str, Any], p: dict[str, Tensor], nll: Tensor) -> Tensor:
    """One pair's loss. ``p``: S_c, S_r, n_c, n_r (floats), R_c, R_r (None for reference-free)."""
    s_c, s_r, n_c, n_r = p["S_c"], p["S_r"], max(p["n_c"], 1.0), max(p["n_r"], 1.0)
    beta = o.get("beta", 0.1)
    if name in ("simpo", "orpo", "cpo", "sft"):
        m_c, m_r = s_c / n_c, s_r / n_r
        if name == "simpo":
            z = beta * (m_c - m_r) - o["gamma"]
            eps = o["label_smoothing"]
            return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
        if name == "orpo":
            log_odds = (m_c - m_r) - (torch.log(1 - torch.exp(m_c)) - torch.log(1 - torch.exp(m_r)))
            return nll - beta * _log_sigmoid(log_odds)
        if name == "cpo":
            z = beta * (s_c - s_r)
            eps = o["label_smoothing"]
            return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z) + o["nll_coef"] * nll
        return nll
    x_c, x_r = s_c - p["R_c"], s_r - p["R_r"]
    if name in ("dpo", "ipo", "hinge", "robust", "exo", "discopop"):
        f_c = _f_score(x_c, o["f_divergence"], o["alpha"])
        f_r = _f_score(x_r, o["f_divergence"], o["alpha"])
        if o.get("length_normalized", False):
            f_c, f_r = f_c / n_c, f_r / n_r
        u = f_c - f_r
        z = beta * u
        if name == "dpo":
            eps = o["label_smoothing"]
            return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
        if name == "ipo":
            return (u - 1 / (2 * beta)) ** 2
        if name == "hinge":
            return torch.clamp(1 - z, min=0.0)
        if name == "robust":
            eps = o["label_smoothing"]
            return (-(1 - eps) * _log_sigmoid(z) + eps * _log_sigmoid(-z)) / (1 - 2 * eps)
        if name == "exo":
            eps = o["epsilon"]
            q_w, q_l = torch.sigmoid(z), torch.sigmoid(-z)
            return q_w * (_log_sigmoid(z) - math.log(1 - eps)) + q_l * (
                _log_sigmoid(-z) - math.log(eps)
            )
        m = torch.sigmoid(z / o["tau"])
        return (1 - m) * (-_log_sigmoid(z)) + m * torch.exp(-z)
    r_c, r_r = beta * x_c, beta * x_r
    if name == "nca":
        return -_log_sigmoid(r_c) - 0.5 * _log_sigmoid(-r_c) - 0.5 * _log_sigmoid(-r_r)
    if name == "bco":
        return -_log_sigmoid(r_c - o["delta"]) - _log_sigmoid(-(r_r - o["delta"]))
    if name == "sppo_hard":
        return (x_c - 0.5 / beta) ** 2 + (x_r + 0.5 / beta) ** 2
    if name == "apo_zero":
        return 1 - torch.sigmoid(r_c) + torch.sigmoid(r_r)
    if name == "apo_down":
        return torch.sigmoid(r_c) + 1 - torch.sigmoid(r_c - r_r)
    raise ValueError(name)


def _side_sum(
    values: Tensor, mask: list[list[bool]], i: int, weights: list[float] | None = None
) -> Tensor:
    total = values.new_zeros(())
    k = 0
    for t, selected in enumerate(mask[i]):
        if selected:
            total = total + (1.0 if weights is None else weights[k]) * values[i, t]
            k += 1
    return total


def _ld(count: int, shared: int, alpha: float | None) -> list[float] | None:
    if alpha is None:
        return None
    return [1.0 if k < shared else alpha for k in range(count)]


def preference_loss(
    chosen: Tensor,
    rejected: Tensor,
    chosen_mask: Tensor,
    rejected_mask: Tensor,
    terms: list[tuple[float, str, dict[str, Any]]],
    *,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    nll_mask: Tensor | None = None,
    ld_alpha: float | None = None,
    chosen_sq: Tensor | None = None,
    rejected_sq: Tensor | None = None,
    normalizer: float | None = None,
    nll_normalizer: float | None = None,
) -> dict[str, Any]:
    """Pair by pair, term by term: sums, the terms' formulas, WPO's weight, the reduction.

    ``ref_*`` per token ``(B, T)`` or per sequence ``(B,)``. Returns ``loss`` and per-pair
    ``pair_losses`` and the sums ``S_c``, ``S_r``.
    """
    cm, rm = _as_list_mask(chosen_mask), _as_list_mask(rejected_mask)
    nm = cm if nll_mask is None else _as_list_mask(nll_mask)
    pairs = chosen.shape[0]
    n_c = [sum(row) for row in cm]
    n_r = [sum(row) for row in rm]
    valid = [n_c[i] > 0 and n_r[i] > 0 for i in range(pairs)]
    d = float(sum(valid)) if normalizer is None else normalizer
    d = max(d, 1.0) if normalizer is None else d
    nll_count = sum(sum(nm[i]) for i in range(pairs) if valid[i])
    n_nll = max(float(nll_count), 1.0) if nll_normalizer is None else nll_normalizer
    losses, sums_c, sums_r = [], [], []
    for i in range(pairs):
        if not valid[i]:
            losses.append(chosen.new_zeros(()))
            sums_c.append(chosen.new_zeros(()))
            sums_r.append(chosen.new_zeros(()))
            continue
        shared = min(n_c[i], n_r[i])
        w_c, w_r = _ld(n_c[i], shared, ld_alpha), _ld(n_r[i], shared, ld_alpha)
        p: dict[str, Any] = {
            "S_c": _side_sum(chosen, cm, i, w_c),
            "S_r": _side_sum(rejected, rm, i, w_r),
            "n_c": float(n_c[i]),
            "n_r": float(n_r[i]),
        }
        for key, ref, mask, w in (("R_c", ref_chosen, cm, w_c), ("R_r", ref_rejected, rm, w_r)):
            if ref is not None:
                p[key] = ref[i] if ref.ndim == 1 else _side_sum(ref, mask, i, w)
        nll = -_side_sum(chosen, nm, i) * d / n_nll
        loss = chosen.new_zeros(())
        for weight, name, options in terms:
            loss = loss + weight * preference_pair_loss(name, options, p, nll)
        if chosen_sq is not None and rejected_sq is not None:
            log_w = _side_sum(chosen.detach() - chosen_sq, cm, i) / n_c[i]
            log_w = log_w + _side_sum(rejected.detach() - rejected_sq, rm, i) / n_r[i]
            loss = loss * torch.exp(log_w)
        losses.append(loss)
        sums_c.append(p["S_c"])
        sums_r.append(p["S_r"])
    total = sum(losses, chosen.new_zeros(())) / d
    return {
        "loss": total,
        "pair_losses": torch.stack(losses) if losses else chosen.new_zeros(0),
        "S_c": sums_c,
        "S_r": sums_r,
        "valid": valid,
    }


def aot_loss(
    chosen: Tensor,
    rejected: Tensor,
    chosen_mask: Tensor,
    rejected_mask: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float,
    unpaired: bool,
) -> Tensor:
    """AOT: sorted (over the valid pairs) margins, the smoothed DPO loss of each rank, mean."""
    cm, rm = _as_list_mask(chosen_mask), _as_list_mask(rejected_mask)
    first, second = [], []
    for i in range(chosen.shape[0]):
        if not (any(cm[i]) and any(rm[i])):
            continue
        s_c, s_r = _side_sum(chosen, cm, i), _side_sum(rejected, rm, i)
        r_c, r_r = _side_sum(ref_chosen, cm, i), _side_sum(ref_rejected, rm, i)
        if unpaired:
            first.append(s_c - r_c)
            second.append(s_r - r_r)
        else:
            first.append(s_c - s_r)
            second.append(r_c - r_r)
    if not first:
        return chosen.new_zeros(())
    a = torch.sort(torch.stack(first)).values
    b = torch.sort(torch.stack(second)).values
    total = chosen.new_zeros(())
    for k in range(len(first)):
        z = beta * (a[k] - b[k])
        total = total - (1 - label_smoothing) * _log_sigmoid(z) - label_smoothing * _log_sigmoid(-z)
    return total / len(first)


def kto_loss(
    log_probs: Tensor,
    mask: Tensor,
    desirable: list[bool],
    ref: Tensor,
    *,
    kl: float | None,
    beta: float,
    weights: tuple[float, float],
    kind: str,
    normalizer: float | None = None,
) -> Tensor:
    """KTO / unpaired APO-zero, response by response."""
    m = _as_list_mask(mask)
    z0 = 0.0 if kl is None or kind != "kto" else max(kl, 0.0)
    total, count = log_probs.new_zeros(()), 0
    for i in range(log_probs.shape[0]):
        if not any(m[i]):
            continue
        count += 1
        x = _side_sum(log_probs, m, i) - (ref[i] if ref.ndim == 1 else _side_sum(ref, m, i))
        if kind == "kto":
            value = 1 - torch.sigmoid(beta * (x - z0 if desirable[i] else z0 - x))
        else:
            value = 1 - torch.sigmoid(beta * x) if desirable[i] else torch.sigmoid(beta * x)
        total = total + (weights[0] if desirable[i] else weights[1]) * value
    d = max(count, 1) if normalizer is None else normalizer
    return total / d


def reward_model_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None, center: float, kind: str
) -> Tensor:
    """Bradley-Terry (or its log(1 + e^x) form) plus the centring term, mean over pairs."""
    total = chosen.new_zeros(())
    for i in range(chosen.shape[0]):
        m = 0.0 if margin is None else margin[i]
        if kind == "bradley_terry":
            value = -_log_sigmoid(chosen[i] - rejected[i] - m)
        else:
            value = torch.log1p(torch.exp(rejected[i] - chosen[i] + m))
        total = total + value + center * (chosen[i] + rejected[i]) ** 2
    return total / max(chosen.shape[0], 1)


# --- the LM head as trainers and samplers compute it (issue 33) -------------------------------


def transformed_logits(
    logits: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
) -> Tensor:
    """``cap_c(s z) / tau`` in float64, differentiable: ``c tanh(s z / c)`` with a softcap.

    ``temperature``: a number or a per-row tensor of the leading shape of ``logits``.
    """
    scaled = logits.double() * logit_scale
    if final_logit_softcapping is not None:
        cap = final_logit_softcapping
        scaled = cap * torch.tanh(scaled / cap)
    if isinstance(temperature, Tensor):
        return scaled / temperature.double().unsqueeze(-1)
    return scaled / temperature


def head_statistics(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor | None = None,
    *,
    temperature: float | Tensor = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    kept_ids: Tensor | None = None,
    kept_mask: Tensor | None = None,
    kept_pad: int = -1,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> dict[str, Tensor]:
    """Reference of ``token_log_probs(..., statistics=...)``: every statistic, row by row.

    ``x`` = :func:`transformed_logits`; K the kept set of ``x`` (:func:`kept_set`, the whole
    vocabulary without one); ``log_probs = x_y - logsumexp(x_K)`` (``-inf`` outside K),
    ``entropy = -sum_K q log q``, ``log_sum_sq_probs = log sum_K q^2``, ``mean_logits`` the mean
    of ``x`` over the whole vocabulary, ``is_top1``: y is the first index of ``max_K x``. 0 (and
    False) where masked. Differentiable with respect to ``logits``.
    """
    x = transformed_logits(
        logits, temperature=temperature, logit_scale=logit_scale,
        final_logit_softcapping=final_logit_softcapping,
    )  # fmt: skip
    rows, shape = _rows(x)
    sets = _kept_rows(rows, kept_ids, kept_mask, kept_pad, top_k, top_p, min_p)
    flat_tokens = tokens.reshape(-1).tolist()
    zero = torch.zeros((), dtype=torch.float64)
    names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")
    out: dict[str, list[Tensor]] = {name: [] for name in names}
    top1: list[bool] = []
    for n, keep in enumerate(_row_keep(mask, rows.shape[0])):
        if not keep:
            for name in names:
                out[name].append(zero)
            top1.append(False)
            continue
        index = torch.tensor([v for v, k in enumerate(sets[n]) if k])
        inside = rows[n][index]
        lse = torch.logsumexp(inside, 0)
        y = int(flat_tokens[n])
        minus_inf = torch.tensor(-math.inf, dtype=torch.float64)
        out["log_probs"].append(rows[n][y] - lse if sets[n][y] else minus_inf)
        log_q = inside - lse
        out["entropy"].append(-(log_q.exp() * log_q).sum())
        out["log_sum_sq_probs"].append(torch.log((2 * log_q).exp().sum()))
        out["mean_logits"].append(rows[n].mean())
        values = [float(v) if k else -math.inf for v, k in zip(rows[n].tolist(), sets[n],
                                                                 strict=True)]  # fmt: skip
        top1.append(values.index(max(values)) == y)
    result = {
        name: torch.stack(values).reshape(shape) if values else torch.zeros(shape,
                                                                            dtype=torch.float64)
        for name, values in out.items()
    }  # fmt: skip
    result["is_top1"] = torch.tensor(top1, dtype=torch.bool).reshape(shape)
    return result


def head_statistics_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    **options: Any,
) -> dict[str, Tensor]:
    """Reference of ``token_log_probs_from_hidden(..., statistics=...)``: the float64 product
    ``hidden @ weight.T + bias`` of the given numbers, then :func:`head_statistics`."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return head_statistics(logits, tokens, **options)


def optimal_token_baseline(
    rewards: Tensor,
    mask: list[list[bool]],
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    groups: list[object],
    *,
    importance_weights: Tensor | None = None,
    alignment: str = "position",
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Reference of optimal_token_baseline_advantages (advantages), written from the definition.

    Per row: ``G_t = sum_{s >= t, selected} r_s`` and ``W_t = sum_{s <= t, selected} rho_s^2 (1 -
    2 pi_s + sum pi^2_s)``; the steps of a group aligned by column (``"position"``) or by the
    rank among the row's selected tokens (``"token"``, rows without a token belong to no
    group); ``b_k = sum_i G W / (sum_i W + eps)`` over the group's rows that hold step k; 0 for
    a group of one; with ``handle_zero_tail`` a unique longest row gets 0 from the second
    longest length on; ``A = G - b`` at the selected tokens.
    """
    batch, width = rewards.shape
    steps: list[list[tuple[int, float, float]]] = []  # per row: (column, G, W) of its steps
    for i in range(batch):
        g = [sum(float(rewards[i, s]) for s in range(t, width) if mask[i][s])
             for t in range(width)]  # fmt: skip
        w_sum, row = 0.0, []
        for t in range(width):
            if mask[i][t]:
                rho = 1.0 if importance_weights is None else float(importance_weights[i, t])
                pi = math.exp(float(old_log_probs[i, t]))
                w_sum += rho * rho * (1 - 2 * pi + float(sum_pi_squared[i, t]))
            row.append((t, g[t], w_sum))
        if alignment == "token":
            row = [(rank, gt, wt) for rank, (t, gt, wt) in
                   enumerate(entry for entry in row if mask[i][entry[0]])]  # fmt: skip
        steps.append(row)
    lengths = [sum(mask[i]) for i in range(batch)]
    members: dict[object, list[int]] = {}
    for i, label in enumerate(groups):
        if alignment == "position" or lengths[i] > 0:
            members.setdefault(label, []).append(i)
    baseline = [[0.0] * width for _ in range(batch)]
    for rows in members.values():
        if len(rows) < 2:
            continue
        for i in rows:
            for k, _, _ in steps[i]:
                holders = [
                    (gt, wt) for j in rows for kk, gt, wt in steps[j]
                    if kk == k and (alignment == "token" or mask[j][k])
                ]  # fmt: skip
                numerator = sum(gt * wt for gt, wt in holders)
                denominator = sum(wt for _, wt in holders) + eps
                baseline[i][k] = numerator / denominator
        if handle_zero_tail:
            ordered = sorted(lengths[i] for i in rows)
            longest = [i for i in rows if lengths[i] == ordered[-1]]
            if len(longest) == 1 and ordered[-1] > ordered[-2]:
                for k in range(ordered[-2], width):
                    baseline[longest[0]][k] = 0.0
    advantages = torch.zeros(batch, width, dtype=torch.float64)
    for i in range(batch):
        for k, gt, _ in steps[i]:
            column = k if alignment == "position" else [t for t in range(width) if mask[i][t]][k]
            if mask[i][column]:
                advantages[i, column] = gt - baseline[i][k]
    return advantages
