"""Float64 references of the Triton kernels' contracts (plain autograd, flat token layout).

Written from the math in ``rlobjectives.kernels`` docstrings (the library's definitions of the
surrogates and of the diagnostics, PolicyLossDiagnostics), as autograd formulas (``torch.clamp``
passes the gradient on the closed interval, selection with ``torch.where``; ties of
``torch.minimum``/``maximum`` are not exercised by the random batches). Nothing here imports
the kernels.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

Tensor = torch.Tensor
F64 = torch.float64


def _clamp(values: Tensor, low: float, high: float) -> Tensor:
    return torch.clamp(values, low, high)


def _where(mask: Tensor, values: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype))


class TokenReference(NamedTuple):
    per_token: Tensor  # (N,) total loss L
    loss: Tensor  # sum w L
    sums: dict[str, Tensor]


def _clip_edges(options: Any) -> tuple[tuple[float, float] | None, float, float, float]:
    """``(band, upper for A > 0, lower for A < 0, upper for A < 0)`` (inf: no edge)."""
    inf = math.inf
    delta = inf if options.delta is None else options.delta
    band = None
    upper_pos, lower_neg, upper_neg = delta, -inf, delta
    if options.clip_low is not None:
        high = options.clip_low if options.clip_high is None else options.clip_high
        band = (1.0 - options.clip_low, 1.0 + high)
        lower_neg, upper_pos = band[0], min(band[1], delta)
        upper_neg = inf if options.delta is None else max(band[1], delta)
    if options.dual_clip is not None:
        upper_neg = min(upper_neg, options.dual_clip)
    return band, upper_pos, lower_neg, upper_neg


def _clip_surrogate(ratio: Tensor, advantages: Tensor, options: Any) -> tuple[Tensor, ...]:
    """``s = min(min(r, delta) A, clip(r) A)``, then ``max(s, cA)`` for A < 0 (autograd), the
    clip sets of PolicyLossDiagnostics and the factor ``w`` of ``s = w A``."""
    unclipped = ratio
    if options.delta is not None:
        unclipped = torch.clamp(ratio, max=options.delta)
    surrogate = unclipped * advantages
    if options.clip_low is not None:
        high = options.clip_low if options.clip_high is None else options.clip_high
        clipped = _clamp(ratio, 1.0 - options.clip_low, 1.0 + high) * advantages
        surrogate = torch.minimum(surrogate, clipped)
    if options.dual_clip is not None:
        floor = options.dual_clip * advantages
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, floor), surrogate)
    band, upper_pos, lower_neg, upper_neg = _clip_edges(options)
    r = ratio.detach()
    positive, negative = advantages > 0, advantages < 0
    out = torch.zeros_like(r, dtype=torch.bool) if band is None else (r < band[0]) | (r > band[1])
    factor = torch.where(positive, r.clamp(max=upper_pos), r)
    factor = torch.where(negative, r.clamp(lower_neg, upper_neg), factor)
    sets = (out, negative & (r < lower_neg), positive & (r > upper_pos), negative & (r > upper_neg))
    return surrogate, *sets, factor


def _policy_surrogate(
    ratio: Tensor, adv: Tensor, lp: Tensor, options: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(s, out of band, low, high, dual, factor)`` of the surrogate ``options`` names."""
    if options.surrogate == "clip":
        return _clip_surrogate(ratio, adv, options)  # type: ignore[return-value]
    r = ratio.detach()
    if options.surrogate == "cispo":
        low, high = -math.inf, math.inf
        if options.cispo_cap is not None:
            high = options.cispo_cap
        elif options.clip_low is not None:
            eps_high = options.clip_low if options.clip_high is None else options.clip_high
            low, high = 1 - options.clip_low, 1 + eps_high
        factor = r.clamp(low, high)
        below, above = r < low, r > high
        sets = (below | above, below & (adv < 0), above & (adv > 0), above & (adv < 0))
        return factor * adv * lp, *sets, factor
    tau = torch.where(adv > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
    gate = 4 / tau * torch.sigmoid(tau * (ratio - 1))
    x = (tau * (r - 1)).detach()
    soft = x.abs() > 2.0 * math.log1p(math.sqrt(2.0))
    up = soft & (x > 0)
    sets = (soft, soft & (x < 0) & (adv < 0), up & (adv > 0), up & (adv < 0))
    return gate * adv, *sets, gate.detach()


def _flat_options(options: Any) -> Any:
    """The kernel options with the surrogate object's fields under the flat names used here."""
    from types import SimpleNamespace

    import reference

    flat = {"surrogate": "none"}
    if options.surrogate is not None:
        flat = reference.surrogate_options(options.surrogate)
    defaults = {
        "clip_low": 0.2 if flat["surrogate"] == "clip" else None,
        "clip_high": None, "dual_clip": None, "delta": None, "cispo_cap": None,
        "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
    }  # fmt: skip
    return SimpleNamespace(**{**options._asdict(), **defaults, **flat})


def _kl(d: Tensor, estimator: str, straight_through: bool) -> Tensor:
    values = {
        "k1": lambda: d,
        "k2": lambda: 0.5 * d.square(),
        "k3": lambda: torch.expm1(-d) + d,
        "abs": lambda: d.abs(),
    }[estimator]()
    if straight_through:
        k2 = 0.5 * d.square()
        values = values.detach() + (k2 - k2.detach())
    return values


def token_loss(
    log_probs: Tensor,
    old_log_probs: Tensor | None,
    advantages: Tensor | None,
    mask: Tensor,
    options: Any,
    *,
    weights: Tensor | None = None,
    sequence_log_ratio: Tensor | None = None,
    importance_weights: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> TokenReference:
    """Float64 per-token loss, weighted loss and sums; ``log_probs``/``entropy`` may be leaves.

    Per-row tensors must already be expanded to ``(N,)``.
    """
    options = _flat_options(options)
    n = mask.shape[0]
    lp = _where(mask, log_probs.to(F64))
    zeros = torch.zeros(n, dtype=F64)
    policy = zeros
    sums: dict[str, Tensor] = {}
    bound = options.log_ratio_bound
    if options.surrogate != "none":
        assert old_log_probs is not None and advantages is not None
        old = _where(mask, old_log_probs.to(F64))
        adv = _where(mask, advantages.to(F64).expand(n))
        token_log_ratio = lp - old
        log_ratio = token_log_ratio
        if sequence_log_ratio is not None:  # value of the sequence's, gradient 1
            seq = _where(mask, sequence_log_ratio.to(F64).expand(n))
            log_ratio = _where(mask, lp - lp.detach() + seq)
        fired = torch.zeros(n, dtype=torch.bool)
        if bound is not None:
            fired = mask & (log_ratio.detach().abs() > bound)
            log_ratio = _clamp(log_ratio, -bound, bound)
        ratio = torch.exp(log_ratio)
        surrogate, *sets, factor = _policy_surrogate(ratio, adv, lp, options)
        policy = _where(mask, -surrogate)
        if importance_weights is not None:
            policy = policy * _where(mask, importance_weights.to(F64).expand(n))
        r = ratio.detach()
        diag = options.diagnostic_bound or (20.0 if bound is None else bound)
        x = _clamp(token_log_ratio.detach(), -diag, diag)
        names = ("out_of_band", "binding_low", "binding_high", "dual_binding")
        sums.update({name: (mask & flag).sum() for name, flag in zip(names, sets, strict=True)})
        sums.update(
            bound_fired=fired.sum(),
            ratio_sum=_where(mask, r).sum(),
            k1_sum=-token_log_ratio.detach().sum(),
            k3_sum=_where(mask, torch.expm1(x) - x).sum(),
            weight_sum=_where(mask, factor).sum(),
        )
    total = policy
    kl = zeros
    if ref_log_probs is not None:
        d = lp - _where(mask, ref_log_probs.to(F64))
        if bound is not None:
            d = _clamp(d, -bound, bound)
        kl = _kl(d, options.kl_estimator, options.kl_straight_through)
        if options.kl_importance_weighted:
            kl = kl * _where(mask, importance_weights.to(F64).expand(n))
        kl = _where(mask, kl)
        total = total + options.kl_coef * kl
    ent = zeros
    if entropy is not None:
        ent = _where(mask, entropy.to(F64))
        total = total - options.entropy_coef * ent
    total = _where(mask, total)
    w = _where(mask, torch.ones(n, dtype=F64) if weights is None else weights.to(F64).expand(n))
    loss = (w * total).sum()
    sums.update(
        weighted_loss=loss.detach(),
        weighted_policy=(w * policy).sum().detach(),
        weighted_kl=(w * kl).sum().detach(),
        weighted_entropy=(w * ent).sum().detach(),
        policy_sum=policy.sum().detach(),
        kl_sum=kl.sum().detach(),
        entropy_sum=ent.sum().detach(),
        selected=mask.sum(),
    )
    return TokenReference(total, loss, sums)


def head_log_probs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    mask: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Float64 ``(log_probs, entropy)`` via ``log_softmax`` (leaves may require grad).

    Masked rows are zeroed before the product (so NaN there reaches nothing); the entropy uses
    ``xlogy``-style ``p log p = 0`` at ``p = 0``.
    """
    h = _where(mask[:, None], hidden.to(F64))
    logits = h @ weight.to(F64).T
    if bias is not None:
        logits = logits + bias.to(F64)
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    p = log_p.exp()
    finite_log_p = torch.where(p > 0, log_p, torch.zeros((), dtype=F64))  # no 0 * -inf
    entropy = -(p * finite_log_p).sum(-1)
    safe_tokens = torch.where(mask, tokens, 0)
    chosen = log_p.gather(1, safe_tokens[:, None])[:, 0]
    return _where(mask, chosen), _where(mask, entropy)
