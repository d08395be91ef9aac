r"""verl 0.9.1's policy losses, one formula per ``loss_mode``, as library calls.

Each ``loss_mode`` of :data:`VERL_LOSS_MODES` is a function of the call (:class:`VerlCall`) and
the reduction of its ``loss_agg_mode``, returning :class:`VerlLossOutput` with verl's metric
keys; the table also names the aggregation a mode forces. What each mode computes:
``docs/objectives/drop-in.md`` ("verl").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._core.masked import masked_mean
from .._core.reduction import clamp, masked_fill_zero, mean_selected
from .._core.validation import compute_dtype
from ..policy.call import PolicyLossDiagnostics
from ..policy.surrogates import CISPO, DPPO, DRO, GMPO, SAPO, Clip, ClipCov, KLCov
from ..selection.batch import cov_selection
from ._common import (
    ReductionArgs,
    WeightedPolicyTerm,
    option,
    preset_number,
    reduce_terms,
    weighted_policy_loss,
)
from ._verl_config import (
    FORCED_AGGREGATIONS,
    clip_band,
    clip_cov_bounds,
    global_info,
    policy_options,
    selection_ratio,
)
from ._verl_rollout import bypass_correction, rollout_options

__all__ = ["GSPO_LOG_RATIO_CAP", "VERL_LOSS_MODES", "VerlCall", "VerlLossOutput", "VerlMode"]


class VerlLossOutput(NamedTuple):
    """``(loss, metrics)`` with verl's metric keys (``actor/pg_clipfrac``, ...), 0-d tensors.

    verl's own functions return Python floats (``.item()``); verl's ``Metric`` accepts tensors
    and reads them itself, so no host sync happens inside the loss.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


class VerlCall(NamedTuple):
    """One call of a verl policy loss: its tensors (promoted, bool mask), config and weights."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # bool
    config: object
    weights: torch.Tensor | None
    aggregation: str = "token-mean"  # the loss_agg_mode in force


def _metric_dtype(call: VerlCall) -> torch.dtype:
    """The computation dtype of the loss (float64 if an input is float64, float32 otherwise)."""
    return compute_dtype(call.log_prob, call.old_log_prob, call.advantages)


def _k1(call: VerlCall, bound: float | None) -> torch.Tensor:
    """The ``ppo_kl`` of verl: masked mean of ``-(log_prob - old_log_prob)`` (clamped if bound)."""
    dtype = _metric_dtype(call)
    log_ratio = call.log_prob.detach().to(dtype) - call.old_log_prob.to(dtype)
    log_ratio = masked_fill_zero(log_ratio, call.mask)
    if bound is not None:
        log_ratio = clamp(log_ratio, -bound, bound)
    return masked_mean(-log_ratio, call.mask)


def _metrics(
    call: VerlCall, clipfrac: torch.Tensor, lower: torch.Tensor | None, kl_bound: float | None
) -> dict[str, torch.Tensor]:
    """The three metric keys of verl (``lower`` None: verl's constant 0.0)."""
    dtype = _metric_dtype(call)
    zero = torch.zeros((), dtype=dtype, device=call.log_prob.device)
    return {
        "actor/pg_clipfrac": clipfrac.to(dtype),
        "actor/ppo_kl": _k1(call, kl_bound),
        "actor/pg_clipfrac_lower": zero if lower is None else lower.to(dtype),
    }


def _vanilla(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    """PPO clip with verl's always-on dual clip ``clip_ratio_c`` and the ±20 log-ratio clamp."""
    low, high = clip_band(call.config)
    dual = option(call.config, "clip_ratio_c", 3.0)
    options = {"surrogate": Clip(low=low, high=high, dual=dual), "log_ratio_bound": 20.0}
    term = _policy_term(call, args, options)
    clipfrac = _pg_clipfrac(term.diagnostics)
    lower = term.diagnostics.dual_clip_fraction
    return VerlLossOutput(term.loss, _metrics(call, clipfrac, lower, 20.0))


#: verl's gspo clamps the sequence log-ratio from above only, ``clamp(log s, max=10)``.
GSPO_LOG_RATIO_CAP = 10.0


def _gspo(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    r"""GSPO-token (verl's stop-gradient form), aggregated by ``loss_agg_mode`` (verl >= 0.9).

    ``policy_loss(surrogate=Clip(low, high), ratio_level="sequence", log_ratio_bound=None,
    reduction="none")``, reduced as ``loss_agg_mode``. verl bounds the sequence log-ratio
    :math:`\log s_i` from above only (:math:`\min(\log s_i, 10)`, no gradient where it fires);
    the library's bound is two-sided, so the rows with :math:`\log s_i > 10` take the loss of
    the same call at the ratio :math:`e^{10}` instead (a constant: :math:`\max(-A e^{10},
    -A\,\mathrm{clip}(e^{10}))\,w`), exactly verl's. The clip decisions, hence
    ``actor/pg_clipfrac``, are the same at :math:`s_i` and at :math:`e^{10}` (both above the
    band).
    """
    low, high = clip_band(call.config)
    clip = Clip(low=low, high=high)
    dtype = _metric_dtype(call)  # per-token losses in float32 (float64) before the reduction
    log_prob, old_log_prob = call.log_prob.to(dtype), call.old_log_prob.to(dtype)
    options = {"surrogate": clip, "ratio_level": "sequence", "log_ratio_bound": None}
    none = ReductionArgs("none")
    term = weighted_policy_loss(
        log_prob, old_log_prob, call.advantages, call.mask, options=options, args=none,
        weights=call.weights,
    )  # fmt: skip
    sequence_log_ratio = mean_selected(log_prob.detach() - old_log_prob, call.mask, dim=-1)
    capped = weighted_policy_loss(
        torch.full_like(old_log_prob, GSPO_LOG_RATIO_CAP),
        torch.zeros_like(old_log_prob),
        call.advantages,
        call.mask,
        options={"surrogate": clip, "log_ratio_bound": None},
        args=none,
        weights=call.weights,
    ).loss  # (B, T): the loss at the ratio e^10, a constant
    above = (sequence_log_ratio > GSPO_LOG_RATIO_CAP).unsqueeze(-1)  # (B, 1)
    per_token = torch.where(above, capped, term.loss)
    loss = reduce_terms(per_token, call.mask, args)
    return VerlLossOutput(loss, _metrics(call, _pg_clipfrac(term.diagnostics), None, None))


def _cispo(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    """CISPO with verl's two-sided band on the (±20-clamped) ratio, any sign of A."""
    low, high = clip_band(call.config)
    options = {"surrogate": CISPO(low=low, high=high), "log_ratio_bound": 20.0}
    term = _policy_term(call, args, options)
    # verl: ratio != clip(ratio), either side, whatever the sign of A
    clipfrac = term.diagnostics.clipped_fraction
    return VerlLossOutput(term.loss, _metrics(call, clipfrac, None, 20.0))


def _sapo(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    """SAPO's soft gate with ``tau_pos`` / ``tau_neg`` (A = 0 takes tau_neg); no clip metric."""
    sapo = SAPO(
        temperature_pos=option(call.config, "tau_pos", 1.0),
        temperature_neg=option(call.config, "tau_neg", 1.05),
    )
    options = {"surrogate": sapo, "log_ratio_bound": 20.0}
    term = _policy_term(call, args, options)
    zero = torch.zeros((), dtype=_metric_dtype(call), device=call.log_prob.device)
    return VerlLossOutput(term.loss, _metrics(call, zero, None, 20.0))


def _geo_mean(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    r"""GMPO (verl ``geo_mean``): the geometric-mean ratio, mean over the B rows.

    verl ignores ``loss_agg_mode`` and the global counts (``torch.mean`` over the rows, empty
    rows included) and weights each row by the geometric mean of its ``rollout_is_weights``,
    :math:`\exp(\mathrm{mean}_t \log(w + 10^{-10}))`.
    """
    low, high = clip_band(call.config)
    options = {"surrogate": GMPO(low=low, high=high), "log_ratio_bound": None}
    weights = None
    if call.weights is not None:
        log_weights = torch.log(call.weights.detach() + 1e-10)
        weights = torch.exp(mean_selected(log_weights, call.mask, dim=-1)).unsqueeze(-1)  # (B, 1)
    term = weighted_policy_loss(
        call.log_prob, call.old_log_prob, call.advantages, call.mask, options=options,
        args=args, weights=weights,
    )  # fmt: skip
    return VerlLossOutput(term.loss, _gmpo_metrics(call, low, high))


@torch.no_grad()
def _gmpo_metrics(call: VerlCall, low: float, high: float) -> dict[str, torch.Tensor]:
    """The geo_mean metrics of verl: the log-ratio outside ``[-low, high]`` by sign.

    verl counts a token whichever side it leaves the band on (so also tokens the sign-aware
    clip does not clip), split by ``A > 0`` (``pg_clipfrac``) and ``A < 0`` (``_lower``).
    """
    log_ratio = masked_fill_zero(call.log_prob.detach() - call.old_log_prob, call.mask).float()
    outside = (log_ratio < -low) | (log_ratio > high)
    advantages = call.advantages.detach()
    advantages = advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages
    dtype = _metric_dtype(call)
    clipfrac = masked_mean((outside & (advantages > 0)).to(dtype), call.mask)
    lower = masked_mean((outside & (advantages < 0)).to(dtype), call.mask)
    return _metrics(call, clipfrac, lower, None)


def _gpg(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    """GPG: ``-A·log_prob`` (times the weights), aggregated; no metrics.

    ``policy_loss(log_prob, log_prob.detach(), A, M, surrogate=CISPO(low=None))``: the ratio
    is 1, so CISPO's weight is 1 and its value and gradient are ``-A·log_prob``.
    """
    options = {"surrogate": CISPO(low=None), "log_ratio_bound": None}
    on_policy = call._replace(old_log_prob=call.log_prob.detach())
    return VerlLossOutput(_policy_term(on_policy, args, options).loss, {})


def _dppo(divergence: str) -> Callable[[VerlCall, ReductionArgs], VerlLossOutput]:
    """The verl ``dppo_tv`` / ``dppo_kl`` loss: :class:`~rlobjectives.DPPO`, verl's thresholds."""

    def loss(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
        r"""DPPO-Binary-TV / KL: ``DPPO(divergence, low, high, ratio_cap=clip_ratio_c)``.

        ``log_ratio_bound=20`` (verl clamps the log-ratio before the ratio and its cap);
        verl reads ``config.get("clip_ratio_c", 20.0)``: the ``ActorConfig`` field (3.0 unless
        set), 20 only for a config without it. ``actor/pg_clipfrac``: the tokens outside the
        trust region; ``actor/pg_clipfrac_lower``: the kept tokens whose ratio the cap changes
        (either sign of :math:`A`); ``actor/ppo_kl``: the clamped ``-Δ``.
        """
        low, high = clip_band(call.config)
        cap = option(call.config, "clip_ratio_c", 20.0)
        dppo = DPPO(divergence, low=low, high=high, ratio_cap=cap)
        term = _policy_term(call, args, {"surrogate": dppo, "log_ratio_bound": 20.0})
        diagnostics = term.diagnostics
        metrics = _metrics(call, diagnostics.clipped_fraction, diagnostics.dual_clip_fraction, 20.0)
        return VerlLossOutput(term.loss, metrics)

    loss.__name__ = f"_dppo_{divergence}"
    return loss


@torch.no_grad()
def _verl_clip_cov_draw(candidates: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    r"""The Clip-Cov draw of verl: ``torch.randperm`` of the candidates, global CPU generator.

    verl 0.9.1 (``compute_policy_loss_clip_cov``) takes ``clip_num = max(int(ratio ·
    ΣM), 1)`` (a host number), the candidates' ``nonzero`` indices in row-major order, and,
    only when there is at least one, ``torch.randperm(n)`` with no generator and no device
    (the process-global CPU generator, one draw of length ``n``), keeping the first
    ``min(clip_num, n)``. This repeats that draw bit for bit, so a run seeded as verl's draws
    the same tokens; it is host-side (``.item()``, ``nonzero``), as verl's, and lives in the
    preset only (:class:`~rlobjectives.ClipCov`'s own draw is device-side and reproducible
    from its ``generator``, but another sequence).

    Args:
        candidates: ``(B, T)`` bool, the tokens verl may detach (``ClipCov``'s candidates:
            unclipped, ``clip_cov_lb < cov < clip_cov_ub``).
        mask: ``(B, T)`` bool, the response mask of the call.
        ratio: verl's ``policy_loss.clip_cov_ratio``.

    Returns:
        ``(B, T)`` bool, the detached tokens, on ``mask``'s device.
    """
    count = max(int(ratio * mask.sum().item()), 1)
    index = torch.nonzero(candidates)
    selected = torch.zeros_like(mask)
    if len(index) > 0:
        index = index[torch.randperm(len(index))[: min(count, len(index))].to(index.device)]
        selected[index[:, 0], index[:, 1]] = True
    return selected


def _clip_cov(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    r"""Clip-Cov: ``ClipCov(ratio, low, high, cov_lb, cov_ub)`` with verl's own random draw.

    :func:`rlobjectives.cov_selection` gives the candidates (its own draw, from a private
    generator, is discarded: the global generator is left to verl's draw alone), then
    :func:`_verl_clip_cov_draw` picks the detached tokens exactly as verl and hands them to the
    object (``selection=``); ``log_ratio_bound=None`` (verl's ratio is unbounded).
    ``actor/pg_clipfrac``: the detached fraction; ``actor/ppo_kl``: the unclamped ``-Δ``.
    """
    low, high = clip_band(call.config)
    policy = policy_options(call.config)
    ratio = selection_ratio(policy, "clip_cov_ratio")
    lower, upper = clip_cov_bounds(policy)
    clip_cov = ClipCov(
        ratio=ratio,
        low=low,
        high=high,
        cov_lb=lower,
        cov_ub=upper,
        generator=torch.Generator(device=call.log_prob.device),
    )
    found = cov_selection(
        call.log_prob.detach(), call.old_log_prob, call.advantages, call.mask,
        surrogate=clip_cov, log_ratio_bound=None,
    )  # fmt: skip
    selected = _verl_clip_cov_draw(found.candidates, call.mask, ratio)
    surrogate = dataclasses.replace(clip_cov, generator=None, selection=selected)
    term = _policy_term(call, args, {"surrogate": surrogate, "log_ratio_bound": None})
    metrics = _metrics(call, term.diagnostics.selected_fraction, None, None)
    del metrics["actor/pg_clipfrac_lower"]  # verl's clip_cov has no such key
    return VerlLossOutput(term.loss, metrics)


def _kl_cov(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    r"""KL-Cov: ``KLCov(ratio=kl_cov_ratio, coef=ppo_kl_coef)``, ``log_ratio_bound=None``.

    verl's defaults when the config lacks them: 0.0002 and 1.0 (its code's; verl's
    ``PolicyLossConfig`` sets ``ppo_kl_coef=0.1``). The only metric, ``actor/ppo_kl``, is the
    mean of :math:`|\Delta|` (verl's, under the usual key).
    """
    policy = policy_options(call.config)
    coef = preset_number(option(policy, "ppo_kl_coef", 1.0), "policy_loss.ppo_kl_coef")
    kl_cov = KLCov(ratio=selection_ratio(policy, "kl_cov_ratio"), coef=coef)
    term = _policy_term(call, args, {"surrogate": kl_cov, "log_ratio_bound": None})
    dtype = _metric_dtype(call)
    log_ratio = call.log_prob.detach().to(dtype) - call.old_log_prob.to(dtype)
    absolute = masked_mean(torch.abs(masked_fill_zero(log_ratio, call.mask)), call.mask)
    return VerlLossOutput(term.loss, {"actor/ppo_kl": absolute})


def _dro(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    r"""DRO: ``DRO(beta=policy_loss.dro_beta)``, :math:`-(\ell A - \frac12\beta\Delta^2)`.

    ``log_ratio_bound=None`` (verl's :math:`\Delta` is unclamped); ``actor/ppo_kl`` (the only
    metric) the unclamped ``-Δ``. ``dro_beta`` has no default: missing, or not positive, is
    verl's ``ValueError``.
    """
    beta = option(policy_options(call.config), "dro_beta", None)
    if beta is None:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO, got None")
    beta = preset_number(beta, "policy_loss.dro_beta", strict=True)
    term = _policy_term(call, args, {"surrogate": DRO(beta=beta), "log_ratio_bound": None})
    return VerlLossOutput(term.loss, {"actor/ppo_kl": _k1(call, None)})


def _bypass_mode(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    r"""Verl's bypass mode: rollout correction inside the loss, ``old_log_prob`` = the sampler's.

    :func:`~rlobjectives.presets._verl_rollout.bypass_correction` forms the IS weights, the
    rejection mask and the ``rollout_corr/*`` metrics from ``config.policy_loss.
    rollout_correction`` (``rollout_is_weights`` is ignored, as verl); then ``loss_type``
    ``"ppo_clip"`` is the vanilla loss on the surviving tokens without weights (the clip
    handles the ratio) and ``"reinforce"`` is :math:`-A\,\ell\,w` on them; the local
    aggregation counts the surviving tokens (the global counts stay the trainer's).
    """
    options = rollout_options(call.config)
    correction = bypass_correction(call.log_prob, call.old_log_prob, call.mask, options)
    info = global_info(call.config)
    surviving = call._replace(mask=correction.mask)
    args = FORCED_AGGREGATIONS[call.aggregation](correction.mask, info)
    if options.loss_type == "ppo_clip":
        out = _vanilla(surviving._replace(weights=None), args)
    else:
        out = _reinforce(surviving._replace(weights=correction.weights), args)
    return VerlLossOutput(out.loss, {**out.metrics, **correction.metrics})


def _reinforce(call: VerlCall, args: ReductionArgs) -> VerlLossOutput:
    """Verl's REINFORCE loss of bypass mode: ``-A·log_prob·w``; ``actor/ppo_kl`` unclamped."""
    options = {"surrogate": CISPO(low=None), "log_ratio_bound": None}
    on_policy = call._replace(old_log_prob=call.log_prob.detach())
    loss = _policy_term(on_policy, args, options).loss
    return VerlLossOutput(loss, {"actor/ppo_kl": _k1(call, None)})


def _policy_term(
    call: VerlCall, args: ReductionArgs, options: dict[str, Any]
) -> WeightedPolicyTerm:
    return weighted_policy_loss(
        call.log_prob,
        call.old_log_prob,
        call.advantages,
        call.mask,
        options=options,
        args=args,
        weights=call.weights,
    )


def _pg_clipfrac(diagnostics: PolicyLossDiagnostics) -> torch.Tensor:
    """The ``pg_clipfrac`` of verl = the binding clips: ``(A>0, r>1+ε_h) ∪ (A<0, r<1-ε_l)``."""
    return diagnostics.clip_fraction_low + diagnostics.clip_fraction_high


class VerlMode(NamedTuple):
    """One verl ``loss_mode``: its formula and the aggregation it forces (None = the user's)."""

    loss: Callable[[VerlCall, ReductionArgs], VerlLossOutput]
    forced_aggregation: str | None


#: verl ``loss_mode`` -> (formula, forced aggregation). gspo and sapo force
#: ``seq-mean-token-mean``; geo_mean averages over the rows ("rows"), whatever
#: ``loss_agg_mode`` and ``global_batch_info`` say (as verl).
VERL_LOSS_MODES: dict[str, VerlMode] = {
    "vanilla": VerlMode(_vanilla, None),
    "gspo": VerlMode(_gspo, None),
    "cispo": VerlMode(_cispo, None),
    "sapo": VerlMode(_sapo, "seq-mean-token-mean"),
    "geo_mean": VerlMode(_geo_mean, "rows"),
    "gpg": VerlMode(_gpg, None),
    "dppo_tv": VerlMode(_dppo("tv"), None),
    "dppo_kl": VerlMode(_dppo("kl"), None),
    "clip_cov": VerlMode(_clip_cov, None),
    "kl_cov": VerlMode(_kl_cov, None),
    "dro": VerlMode(_dro, None),
    "bypass_mode": VerlMode(_bypass_mode, None),
}
