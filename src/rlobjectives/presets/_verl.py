r"""verl 0.9.1's registered policy losses (``verl/trainer/ppo/core_algos.py``) as library calls.

:func:`verl_policy_loss` returns a function with verl's registered signature
``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
rollout_is_weights=None) -> (loss, metrics)``; register it with
``verl.trainer.ppo.core_algos.register_policy_loss(name)(fn)``. One row per ``loss_mode`` in
:data:`VERL_LOSS_MODES`, one per ``loss_agg_mode`` in :data:`VERL_AGGREGATIONS`.

``agg_loss`` with ``dp_size`` D, global tokens N, global sequences G and scale factor C (from
``config.global_batch_info``; the local fallbacks count this call's mask):

- ``token-mean``: :math:`\sum M L / N \cdot D` = ``token_mean``, ``normalizer = N/D``
  (local: the selected tokens);
- ``token-sum``: :math:`\sum M L \cdot D` = ``token_mean``, ``normalizer = 1/D``;
- ``seq-mean-token-sum``: :math:`\sum_i \sum_t M L / G \cdot D` = ``sequence_sum_normalized``,
  ``max_response_length=1``, ``normalizer = G/D`` (local: the **non-empty** rows, not B);
- ``seq-mean-token-sum-norm``: the same divided by C (``loss_scale_factor``, default the padded
  T): ``normalizer = G·C/D`` (verl PR #5417; before it, PR #5366 did not divide by G);
- ``seq-mean-token-mean``: :math:`\sum_i \frac{1}{n_i}\sum_t M L / G \cdot D` =
  ``sequence_mean``, ``normalizer = G/D`` (local: the non-empty rows).

verl divides the per-row token mean by :math:`n_i + 10^{-8}` and its masked means by the count
:math:`+10^{-8}` (relative differences below :math:`10^{-8}`); a fully masked local call gives 0
here, NaN in verl.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._core.masked import masked_mean
from .._core.reduction import clamp, masked_fill_zero, mean_selected
from .._core.validation import checks_environment, compute_dtype, validate_choice, validate_scalar
from ..policy.call import PolicyLossDiagnostics
from ..policy.surrogates import CISPO, DPPO, DRO, GMPO, SAPO, Clip, ClipCov, KLCov
from ..selection.batch import cov_selection
from ._common import (
    ReductionArgs,
    WeightedPolicyTerm,
    as_bool_mask,
    float64_if_any,
    nonempty_rows,
    option,
    preset_count,
    preset_number,
    promote,
    reduce_terms,
    weighted_policy_loss,
)
from ._verl_rollout import bypass_correction, rollout_options

__all__ = ["VERL_AGGREGATIONS", "VERL_LOSS_MODES", "VerlPolicyLoss"]
__all__ += ["VerlLossOutput", "verl_policy_loss"]


class VerlLossOutput(NamedTuple):
    """``(loss, metrics)`` with verl's metric keys (``actor/pg_clipfrac``, ...), 0-d tensors.

    verl's own functions return Python floats (``.item()``); verl's ``Metric`` accepts tensors
    and reads them itself, so no host sync happens inside the loss.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


class _Call(NamedTuple):
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # bool
    config: object
    weights: torch.Tensor | None
    aggregation: str = "token-mean"  # the loss_agg_mode in force


def _global_info(config: object) -> dict[str, Any]:
    info = option(config, "global_batch_info", {})
    return dict(info) if info else {}


def _count_or_local(info: dict[str, Any], key: str, local: Callable[[], Any], dp_size: Any) -> Any:
    value = info.get(key)
    if value is not None:
        return value / dp_size
    if not (isinstance(dp_size, (int, float)) and dp_size == 1):
        raise ValueError(f"loss_agg_mode needs global_batch_info[{key!r}] when dp_size > 1")
    return local()


def _token_mean(mask: torch.Tensor, info: dict[str, Any]) -> ReductionArgs:
    dp = info.get("dp_size", 1)
    return ReductionArgs("token_mean", _count_or_local(info, "batch_num_tokens", lambda: None, dp))


def _token_sum(mask: torch.Tensor, info: dict[str, Any]) -> ReductionArgs:
    return ReductionArgs("token_mean", normalizer=1 / info.get("dp_size", 1))


def _sequence_sum(mask: torch.Tensor, info: dict[str, Any], scale: Any = 1) -> ReductionArgs:
    dp = info.get("dp_size", 1)
    rows = _count_or_local(info, "global_batch_size", lambda: nonempty_rows(mask), dp)
    return ReductionArgs("sequence_sum_normalized", normalizer=rows * scale, max_response_length=1)


def _sequence_sum_norm(mask: torch.Tensor, info: dict[str, Any]) -> ReductionArgs:
    scale = info.get("loss_scale_factor")
    return _sequence_sum(mask, info, mask.shape[-1] if scale is None else scale)


def _sequence_mean(mask: torch.Tensor, info: dict[str, Any]) -> ReductionArgs:
    dp = info.get("dp_size", 1)
    rows = _count_or_local(info, "global_batch_size", lambda: None, dp)
    return ReductionArgs("sequence_mean", normalizer=rows)


#: verl ``loss_agg_mode`` -> the library reduction (see the module docstring).
VERL_AGGREGATIONS: dict[str, Callable[[torch.Tensor, dict[str, Any]], ReductionArgs]] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _sequence_sum,
    "seq-mean-token-sum-norm": _sequence_sum_norm,
    "seq-mean-token-mean": _sequence_mean,
}


def _check_config(config: object, loss_mode: str) -> None:
    """The config values under verl's names, checked like the library's hyperparameters.

    verl passes ``config`` with the tensors, so they are checked at every call (before any
    tensor work), whichever mode reads them: the clip band (``clip_ratio_low`` or, without it,
    ``clip_ratio`` in ``[0, 1)``; ``clip_ratio_high``, ``clip_ratio`` >= 0; for ``dppo_tv``,
    whose band is a threshold on ``|p - p_old| <= 1``, the high edge at most 1),
    ``clip_ratio_c > 1``, ``tau_pos``, ``tau_neg`` > 0, ``global_batch_info``'s ``dp_size``
    (a positive whole number), ``batch_num_tokens``, ``global_batch_size`` and
    ``loss_scale_factor`` (positive, finite), and ``policy_loss``'s numbers
    (:func:`_check_policy_options`).
    """
    ratio = preset_number(option(config, "clip_ratio", 0.2), "clip_ratio")
    if option(config, "clip_ratio_low", None) is None:
        preset_number(ratio, "clip_ratio", maximum=1.0)  # it is the low edge too
    else:
        preset_number(option(config, "clip_ratio_low", None), "clip_ratio_low", maximum=1.0)
    given_high = option(config, "clip_ratio_high", None) is not None
    high_name = "clip_ratio_high" if given_high else "clip_ratio"
    high = preset_number(option(config, "clip_ratio_high", ratio), high_name)
    if loss_mode == "dppo_tv" and high > 1.0:
        raise ValueError(
            f"{high_name} must be <= 1 for loss_mode='dppo_tv' (the high edge is a threshold on "
            f"|p - p_old| <= 1), got {high}"
        )
    preset_number(option(config, "clip_ratio_c", 3.0), "clip_ratio_c", minimum=1.0, strict=True)
    for name, default in (("tau_pos", 1.0), ("tau_neg", 1.05)):
        preset_number(option(config, name, default), name, strict=True)
    info = _global_info(config)
    if info.get("dp_size") is not None:
        preset_count(info["dp_size"], "global_batch_info['dp_size']")
    for key in ("batch_num_tokens", "global_batch_size", "loss_scale_factor"):
        if info.get(key) is not None:
            validate_scalar(info[key], f"global_batch_info[{key!r}]", strict=True)
    _check_policy_options(_policy_options(config))


def _check_policy_options(policy: object) -> None:
    """``config.policy_loss``'s numbers, named ``policy_loss.<name>`` as verl names them.

    ``clip_cov_ratio`` and ``kl_cov_ratio`` in ``(0, 1]``, ``clip_cov_lb < clip_cov_ub``
    (finite), ``ppo_kl_coef >= 0`` and ``dro_beta > 0`` when given (finite); missing values
    take verl's defaults.
    """
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        _selection_ratio(policy, name)
    _clip_cov_bounds(policy)
    preset_number(option(policy, "ppo_kl_coef", 1.0), "policy_loss.ppo_kl_coef")
    beta = option(policy, "dro_beta", None)
    if beta is not None:
        preset_number(beta, "policy_loss.dro_beta", strict=True)


def _clip_cov_bounds(policy: object) -> tuple[float, float]:
    """``(policy_loss.clip_cov_lb, policy_loss.clip_cov_ub)`` (verl's 1.0 and 5.0), lb < ub."""
    lower = preset_number(
        option(policy, "clip_cov_lb", 1.0), "policy_loss.clip_cov_lb", minimum=None
    )
    upper = preset_number(
        option(policy, "clip_cov_ub", 5.0), "policy_loss.clip_cov_ub", minimum=None
    )
    if lower >= upper:
        raise ValueError(
            f"policy_loss.clip_cov_lb must be < policy_loss.clip_cov_ub, got clip_cov_lb={lower} "
            f"and clip_cov_ub={upper}"
        )
    return lower, upper


def _clip_band(config: object) -> tuple[float, float]:
    """Verl's ``(clip_ratio_low, clip_ratio_high)``, each defaulting to ``clip_ratio`` (0.2)."""
    ratio = option(config, "clip_ratio", 0.2)
    return option(config, "clip_ratio_low", ratio), option(config, "clip_ratio_high", ratio)


def _metric_dtype(call: _Call) -> torch.dtype:
    """The computation dtype of the loss (float64 if an input is float64, float32 otherwise)."""
    return compute_dtype(call.log_prob, call.old_log_prob, call.advantages)


def _k1(call: _Call, bound: float | None) -> torch.Tensor:
    """The ``ppo_kl`` of verl: masked mean of ``-(log_prob - old_log_prob)`` (clamped if bound)."""
    dtype = _metric_dtype(call)
    log_ratio = call.log_prob.detach().to(dtype) - call.old_log_prob.to(dtype)
    log_ratio = masked_fill_zero(log_ratio, call.mask)
    if bound is not None:
        log_ratio = clamp(log_ratio, -bound, bound)
    return masked_mean(-log_ratio, call.mask)


def _metrics(
    call: _Call, clipfrac: torch.Tensor, lower: torch.Tensor | None, kl_bound: float | None
) -> dict[str, torch.Tensor]:
    """The three metric keys of verl (``lower`` None: verl's constant 0.0)."""
    dtype = _metric_dtype(call)
    zero = torch.zeros((), dtype=dtype, device=call.log_prob.device)
    return {
        "actor/pg_clipfrac": clipfrac.to(dtype),
        "actor/ppo_kl": _k1(call, kl_bound),
        "actor/pg_clipfrac_lower": zero if lower is None else lower.to(dtype),
    }


def _vanilla(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    """PPO clip with verl's always-on dual clip ``clip_ratio_c`` and the ±20 log-ratio clamp."""
    low, high = _clip_band(call.config)
    dual = option(call.config, "clip_ratio_c", 3.0)
    options = {"surrogate": Clip(low=low, high=high, dual=dual), "log_ratio_bound": 20.0}
    term = _policy_term(call, args, options)
    clipfrac = _pg_clipfrac(term.diagnostics)
    lower = term.diagnostics.dual_clip_fraction
    return VerlLossOutput(term.loss, _metrics(call, clipfrac, lower, 20.0))


#: verl's gspo clamps the sequence log-ratio from above only, ``clamp(log s, max=10)``.
GSPO_LOG_RATIO_CAP = 10.0


def _gspo(call: _Call, args: ReductionArgs) -> VerlLossOutput:
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
    low, high = _clip_band(call.config)
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


def _cispo(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    """CISPO with verl's two-sided band on the (±20-clamped) ratio, any sign of A."""
    low, high = _clip_band(call.config)
    options = {"surrogate": CISPO(low=low, high=high), "log_ratio_bound": 20.0}
    term = _policy_term(call, args, options)
    # verl: ratio != clip(ratio), either side, whatever the sign of A
    clipfrac = term.diagnostics.clipped_fraction
    return VerlLossOutput(term.loss, _metrics(call, clipfrac, None, 20.0))


def _sapo(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    """SAPO's soft gate with ``tau_pos`` / ``tau_neg`` (A = 0 takes tau_neg); no clip metric."""
    sapo = SAPO(
        temperature_pos=option(call.config, "tau_pos", 1.0),
        temperature_neg=option(call.config, "tau_neg", 1.05),
    )
    options = {"surrogate": sapo, "log_ratio_bound": 20.0}
    term = _policy_term(call, args, options)
    zero = torch.zeros((), dtype=_metric_dtype(call), device=call.log_prob.device)
    return VerlLossOutput(term.loss, _metrics(call, zero, None, 20.0))


def _geo_mean(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    r"""GMPO (verl ``geo_mean``): the geometric-mean ratio, mean over the B rows.

    verl ignores ``loss_agg_mode`` and the global counts (``torch.mean`` over the rows, empty
    rows included) and weights each row by the geometric mean of its ``rollout_is_weights``,
    :math:`\exp(\mathrm{mean}_t \log(w + 10^{-10}))`.
    """
    low, high = _clip_band(call.config)
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
def _gmpo_metrics(call: _Call, low: float, high: float) -> dict[str, torch.Tensor]:
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


def _gpg(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    """GPG: ``-A·log_prob`` (times the weights), aggregated; no metrics.

    ``policy_loss(log_prob, log_prob.detach(), A, M, surrogate=CISPO(low=None))``: the ratio
    is 1, so CISPO's weight is 1 and its value and gradient are ``-A·log_prob``.
    """
    options = {"surrogate": CISPO(low=None), "log_ratio_bound": None}
    on_policy = call._replace(old_log_prob=call.log_prob.detach())
    return VerlLossOutput(_policy_term(on_policy, args, options).loss, {})


def _dppo(divergence: str) -> Callable[[_Call, ReductionArgs], VerlLossOutput]:
    """The verl ``dppo_tv`` / ``dppo_kl`` loss: :class:`~rlobjectives.DPPO`, verl's thresholds."""

    def loss(call: _Call, args: ReductionArgs) -> VerlLossOutput:
        r"""DPPO-Binary-TV / KL: ``DPPO(divergence, low, high, ratio_cap=clip_ratio_c)``.

        ``log_ratio_bound=20`` (verl clamps the log-ratio before the ratio and its cap);
        verl reads ``config.get("clip_ratio_c", 20.0)``: the ``ActorConfig`` field (3.0 unless
        set), 20 only for a config without it. ``actor/pg_clipfrac``: the tokens outside the
        trust region; ``actor/pg_clipfrac_lower``: the kept tokens whose ratio the cap changes
        (either sign of :math:`A`); ``actor/ppo_kl``: the clamped ``-Δ``.
        """
        low, high = _clip_band(call.config)
        cap = option(call.config, "clip_ratio_c", 20.0)
        dppo = DPPO(divergence, low=low, high=high, ratio_cap=cap)
        term = _policy_term(call, args, {"surrogate": dppo, "log_ratio_bound": 20.0})
        diagnostics = term.diagnostics
        metrics = _metrics(call, diagnostics.clipped_fraction, diagnostics.dual_clip_fraction, 20.0)
        return VerlLossOutput(term.loss, metrics)

    loss.__name__ = f"_dppo_{divergence}"
    return loss


def _policy_options(config: object) -> object:
    """``config.policy_loss`` (verl's ``PolicyLossConfig``, or a mapping), or None."""
    return option(config, "policy_loss", None)


def _selection_ratio(policy: object, name: str) -> float:
    """``policy_loss.<name>`` (verl's default 0.0002), a fraction in ``(0, 1]``."""
    value = preset_number(option(policy, name, 0.0002), f"policy_loss.{name}", strict=True)
    if value > 1.0:
        raise ValueError(f"policy_loss.{name} must be <= 1 (a fraction of the tokens), got {value}")
    return value


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


def _clip_cov(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    r"""Clip-Cov: ``ClipCov(ratio, low, high, cov_lb, cov_ub)`` with verl's own random draw.

    :func:`rlobjectives.cov_selection` gives the candidates (its own draw, from a private
    generator, is discarded: the global generator is left to verl's draw alone), then
    :func:`_verl_clip_cov_draw` picks the detached tokens exactly as verl and hands them to the
    object (``selection=``); ``log_ratio_bound=None`` (verl's ratio is unbounded).
    ``actor/pg_clipfrac``: the detached fraction; ``actor/ppo_kl``: the unclamped ``-Δ``.
    """
    low, high = _clip_band(call.config)
    policy = _policy_options(call.config)
    ratio = _selection_ratio(policy, "clip_cov_ratio")
    lower, upper = _clip_cov_bounds(policy)
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


def _kl_cov(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    r"""KL-Cov: ``KLCov(ratio=kl_cov_ratio, coef=ppo_kl_coef)``, ``log_ratio_bound=None``.

    verl's defaults when the config lacks them: 0.0002 and 1.0 (its code's; verl's
    ``PolicyLossConfig`` sets ``ppo_kl_coef=0.1``). The only metric, ``actor/ppo_kl``, is the
    mean of :math:`|\Delta|` (verl's, under the usual key).
    """
    policy = _policy_options(call.config)
    coef = preset_number(option(policy, "ppo_kl_coef", 1.0), "policy_loss.ppo_kl_coef")
    kl_cov = KLCov(ratio=_selection_ratio(policy, "kl_cov_ratio"), coef=coef)
    term = _policy_term(call, args, {"surrogate": kl_cov, "log_ratio_bound": None})
    dtype = _metric_dtype(call)
    log_ratio = call.log_prob.detach().to(dtype) - call.old_log_prob.to(dtype)
    absolute = masked_mean(torch.abs(masked_fill_zero(log_ratio, call.mask)), call.mask)
    return VerlLossOutput(term.loss, {"actor/ppo_kl": absolute})


def _dro(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    r"""DRO: ``DRO(beta=policy_loss.dro_beta)``, :math:`-(\ell A - \frac12\beta\Delta^2)`.

    ``log_ratio_bound=None`` (verl's :math:`\Delta` is unclamped); ``actor/ppo_kl`` (the only
    metric) the unclamped ``-Δ``. ``dro_beta`` has no default: missing, or not positive, is
    verl's ``ValueError``.
    """
    beta = option(_policy_options(call.config), "dro_beta", None)
    if beta is None:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO, got None")
    beta = preset_number(beta, "policy_loss.dro_beta", strict=True)
    term = _policy_term(call, args, {"surrogate": DRO(beta=beta), "log_ratio_bound": None})
    return VerlLossOutput(term.loss, {"actor/ppo_kl": _k1(call, None)})


def _bypass_mode(call: _Call, args: ReductionArgs) -> VerlLossOutput:
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
    info = _global_info(call.config)
    surviving = call._replace(mask=correction.mask)
    args = _FORCED_AGGREGATIONS[call.aggregation](correction.mask, info)
    if options.loss_type == "ppo_clip":
        out = _vanilla(surviving._replace(weights=None), args)
    else:
        out = _reinforce(surviving._replace(weights=correction.weights), args)
    return VerlLossOutput(out.loss, {**out.metrics, **correction.metrics})


def _reinforce(call: _Call, args: ReductionArgs) -> VerlLossOutput:
    """Verl's REINFORCE loss of bypass mode: ``-A·log_prob·w``; ``actor/ppo_kl`` unclamped."""
    options = {"surrogate": CISPO(low=None), "log_ratio_bound": None}
    on_policy = call._replace(old_log_prob=call.log_prob.detach())
    loss = _policy_term(on_policy, args, options).loss
    return VerlLossOutput(loss, {"actor/ppo_kl": _k1(call, None)})


def _policy_term(call: _Call, args: ReductionArgs, options: dict[str, Any]) -> WeightedPolicyTerm:
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


class _Mode(NamedTuple):
    """One verl ``loss_mode``: its formula and the aggregation it forces (None = the user's)."""

    loss: Callable[[_Call, ReductionArgs], VerlLossOutput]
    forced_aggregation: str | None


def _rows_mean(mask: torch.Tensor, info: dict[str, Any]) -> ReductionArgs:
    """The ``torch.mean`` over the B rows of verl ``geo_mean`` (empty rows count; no counts)."""
    del info
    return ReductionArgs("sequence_mean", normalizer=max(mask.shape[0], 1))


_FORCED_AGGREGATIONS = {**VERL_AGGREGATIONS, "rows": _rows_mean}

#: verl ``loss_mode`` -> (formula, forced aggregation). gspo and sapo force
#: ``seq-mean-token-mean``; geo_mean averages over the rows ("rows"), whatever
#: ``loss_agg_mode`` and ``global_batch_info`` say (as verl).
VERL_LOSS_MODES: dict[str, _Mode] = {
    "vanilla": _Mode(_vanilla, None),
    "gspo": _Mode(_gspo, None),
    "cispo": _Mode(_cispo, None),
    "sapo": _Mode(_sapo, "seq-mean-token-mean"),
    "geo_mean": _Mode(_geo_mean, "rows"),
    "gpg": _Mode(_gpg, None),
    "dppo_tv": _Mode(_dppo("tv"), None),
    "dppo_kl": _Mode(_dppo("kl"), None),
    "clip_cov": _Mode(_clip_cov, None),
    "kl_cov": _Mode(_kl_cov, None),
    "dro": _Mode(_dro, None),
    "bypass_mode": _Mode(_bypass_mode, None),
}


@dataclass(frozen=True)
class VerlPolicyLoss:
    """A verl policy loss (built by :func:`verl_policy_loss`), callable with verl's signature."""

    loss_mode: str

    @checks_environment
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: object = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> VerlLossOutput:
        """The ``(pg_loss, pg_metrics)`` of verl for these tensors (:func:`verl_policy_loss`)."""
        _check_config(config, self.loss_mode)
        mode = VERL_LOSS_MODES[self.loss_mode]
        # checked for every mode, also those that force their own aggregation (verl's
        # ActorConfig refuses an unknown loss_agg_mode whatever the loss_mode)
        validate_choice(loss_agg_mode, "loss_agg_mode", tuple(VERL_AGGREGATIONS))
        aggregation = mode.forced_aggregation or loss_agg_mode
        wide = float64_if_any(old_log_prob, log_prob, advantages, rollout_is_weights)
        old_log_prob, log_prob, advantages = (
            promote(t, wide) for t in (old_log_prob, log_prob, advantages)
        )
        rollout_is_weights = promote(rollout_is_weights, wide)
        mask = as_bool_mask(response_mask, log_prob)
        args = _FORCED_AGGREGATIONS[aggregation](mask, _global_info(config))
        call = _Call(
            old_log_prob, log_prob, advantages, mask, config, rollout_is_weights, aggregation
        )
        return mode.loss(call, args)


@checks_environment
def verl_policy_loss(loss_mode: str = "vanilla") -> VerlPolicyLoss:
    r"""The registered verl policy loss ``loss_mode``, built from library calls.

    The returned function has verl's signature ``(old_log_prob, log_prob, advantages,
    response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None) ->
    (loss, metrics)`` and can be registered with ``register_policy_loss``. ``config`` is any
    object (or mapping) with verl's names: ``clip_ratio``, ``clip_ratio_low``,
    ``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``, ``tau_neg``, ``global_batch_info``
    (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) and
    ``policy_loss`` (``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``,
    ``ppo_kl_coef``, ``dro_beta``, ``rollout_correction``); missing values take the defaults
    of verl's code (0.2, 0.2, 0.2, 3.0, 1.0, 1.05, local counts; 0.0002, 1.0, 5.0, 0.0002,
    1.0, none).

    - ``"vanilla"``: ``policy_loss(surrogate=Clip(low=clip_ratio_low, high=clip_ratio_high,
      dual=clip_ratio_c), log_ratio_bound=20)``; metrics ``actor/pg_clipfrac`` (the
      binding clips), ``actor/ppo_kl`` (mean of the clamped ``-Δ``),
      ``actor/pg_clipfrac_lower`` (the dual clip binds).
    - ``"gspo"``: ``policy_loss(surrogate=Clip(low=clip_ratio_low, high=clip_ratio_high),
      ratio_level="sequence", log_ratio_bound=None)`` aggregated by ``loss_agg_mode`` (verl
      0.9; verl 0.7 and 0.8 forced ``"seq-mean-token-mean"``), the sequence log-ratio capped
      from above at 10 as verl (the rows above the cap take the constant loss at the ratio
      :math:`e^{10}`); the GSPO-token form, as verl, so per-token advantages are verl's too;
      ``actor/pg_clipfrac_lower`` is 0 and ``actor/ppo_kl`` the unclamped mean of ``-Δ``.
    - ``"cispo"``: ``policy_loss(surrogate=CISPO(low=clip_ratio_low, high=clip_ratio_high),
      log_ratio_bound=20)`` (verl's two-sided band, any sign of
      :math:`A`); ``actor/pg_clipfrac`` = the ratio outside the band; ``_lower`` is 0.
    - ``"sapo"``: ``policy_loss(surrogate=SAPO(temperature_pos=tau_pos,
      temperature_neg=tau_neg), log_ratio_bound=20)`` (``config.tau_pos`` / ``tau_neg``,
      1.0 / 1.05) aggregated as ``"seq-mean-token-mean"`` (forced, as verl); both clip
      fractions are 0.
    - ``"geo_mean"``: ``policy_loss(surrogate=GMPO(low=clip_ratio_low, high=clip_ratio_high),
      log_ratio_bound=None, reduction="sequence_mean",
      normalizer=B)``: verl's ``torch.mean`` over the B rows, whatever ``loss_agg_mode`` and
      the global counts say; ``rollout_is_weights`` enter as each row's geometric mean
      :math:`\exp(\mathrm{mean}_t\log(w + 10^{-10}))` (verl's); ``actor/pg_clipfrac`` /
      ``_lower``: the log-ratio outside ``[-clip_ratio_low, clip_ratio_high]`` (either side)
      where :math:`A > 0` / :math:`A < 0`.
    - ``"gpg"``: ``policy_loss(log_prob, log_prob.detach(), A, M,
      surrogate=CISPO(low=None))`` = ``-A·log_prob`` aggregated; no metrics.
    - ``"dppo_tv"`` / ``"dppo_kl"``: ``policy_loss(surrogate=DPPO("tv" / "kl",
      low=clip_ratio_low, high=clip_ratio_high, ratio_cap=clip_ratio_c), log_ratio_bound=20)``
      (the ``ActorConfig`` field ``clip_ratio_c``, 3.0 unless set; 20 for a config without
      it, as verl's ``config.get``); ``actor/pg_clipfrac`` = outside the trust region,
      ``_lower`` = kept tokens whose ratio the cap changes, ``actor/ppo_kl`` clamped.
    - ``"clip_cov"``: ``policy_loss(surrogate=ClipCov(ratio=clip_cov_ratio, low, high,
      cov_lb=clip_cov_lb, cov_ub=clip_cov_ub, selection=...), log_ratio_bound=None)`` with
      verl's own draw (``torch.randperm`` over the row-major candidates of
      :func:`rlobjectives.cov_selection`, on the global CPU generator, host-side: a run
      seeded as verl's detaches the same tokens); ``actor/pg_clipfrac`` = the detached
      fraction, ``actor/ppo_kl`` unclamped (no ``_lower`` key, as verl).
    - ``"kl_cov"``: ``policy_loss(surrogate=KLCov(ratio=kl_cov_ratio, coef=ppo_kl_coef),
      log_ratio_bound=None)`` (the top-k covariance tokens penalised by ``coef·|Δ|``); the
      only metric ``actor/ppo_kl`` is the mean of ``|Δ|``, as verl.
    - ``"dro"``: ``policy_loss(surrogate=DRO(beta=policy_loss.dro_beta),
      log_ratio_bound=None)``; the only metric ``actor/ppo_kl`` (unclamped).
    - ``"bypass_mode"``: verl's rollout correction inside the loss (``old_log_prob`` is the
      sampler's; ``rollout_is_weights`` is ignored, as verl), from
      ``config.policy_loss.rollout_correction`` (``rollout_is``, ``rollout_is_threshold``,
      ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``,
      ``loss_type``): :func:`rlobjectives.rollout_correction` for the IS weights, verl's
      eleven rejection gates, then ``"ppo_clip"`` (vanilla on the surviving tokens, no
      weights) or ``"reinforce"`` (:math:`-A\,\ell\,w`); metrics: the mode's ``actor/*``
      keys and every ``rollout_corr/*`` key of verl (see
      :mod:`rlobjectives.presets._verl_rollout`).

    ``rollout_is_weights`` multiply the per-token loss before the aggregation (verl's
    placement; ``policy_loss(importance_weights=)``). The metric values are 0-d tensors in the
    computation dtype (float64 for float64 inputs, float32 otherwise). ``actor/ppo_kl`` is the
    mean of ``-Δ``, clamped to ±20 where verl clamps (vanilla, cispo, sapo). Tested against
    verl 0.9.1's own functions and inside its real training step
    (``tests/integrations/test_verl_integration.py``).

    Args:
        loss_mode: a verl 0.9.1 ``loss_mode``: ``"vanilla"``, ``"gspo"``, ``"cispo"``,
            ``"sapo"``, ``"geo_mean"``, ``"gpg"``, ``"dppo_tv"``, ``"dppo_kl"``,
            ``"clip_cov"``, ``"kl_cov"``, ``"dro"``, ``"bypass_mode"`` (every mode verl
            registers; :data:`VERL_LOSS_MODES`).

    Returns:
        A :class:`VerlPolicyLoss`.

    Raises:
        ValueError: an unknown ``loss_mode``; at call time (verl passes ``config`` with the
            tensors) an unknown ``loss_agg_mode`` (every mode, also those that force their own),
            ``dp_size > 1`` without the global count the mode needs (as verl), or a ``config``
            value that is non-finite or out of range, named as verl names it, in every mode
            (``clip_ratio_low`` outside ``[0, 1)``, ``clip_ratio_c <= 1``, ``tau_pos <= 0``,
            ``global_batch_info['dp_size']`` not a positive whole number,
            ``policy_loss.dro_beta`` not positive (missing in ``"dro"``),
            ``policy_loss.clip_cov_ratio`` / ``kl_cov_ratio`` outside ``(0, 1]``,
            ``clip_cov_lb >= clip_cov_ub``; for ``"dppo_tv"`` ``clip_ratio_high``, or the
            ``clip_ratio`` it defaults to, above 1...).
        TypeError: at call time, a ``config`` value that is not a number.

    Examples:
        >>> import torch
        >>> loss_fn = verl_policy_loss("vanilla")
        >>> log_prob = torch.zeros(1, 2, requires_grad=True)
        >>> mask = torch.ones(1, 2)
        >>> loss, metrics = loss_fn(torch.zeros(1, 2), log_prob, torch.ones(1, 2), mask)
        >>> loss
        tensor(-1., grad_fn=<...>)
    """
    validate_choice(loss_mode, "loss_mode", tuple(VERL_LOSS_MODES))
    return VerlPolicyLoss(loss_mode)
