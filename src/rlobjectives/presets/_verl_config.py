r"""verl's ``loss_agg_mode`` as library reductions, and verl's config read and checked.

:data:`VERL_AGGREGATIONS` maps each ``loss_agg_mode`` onto a reduction and its ``normalizer``
(:data:`FORCED_AGGREGATIONS` adds the row mean ``geo_mean`` forces); :func:`check_config` checks
the config values under verl's names at every call (verl passes ``config`` with the tensors);
:func:`clip_band`, :func:`clip_cov_bounds`, :func:`policy_options` and :func:`selection_ratio`
read them with verl's defaults.

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

from collections.abc import Callable
from typing import Any

import torch

from .._core.validation import validate_scalar
from ._common import ReductionArgs, nonempty_rows, option, preset_count, preset_number

__all__ = [
    "FORCED_AGGREGATIONS",
    "VERL_AGGREGATIONS",
    "check_config",
    "clip_band",
    "clip_cov_bounds",
    "global_info",
    "policy_options",
    "selection_ratio",
]


def global_info(config: object) -> dict[str, Any]:
    """``config.global_batch_info`` as a dict (empty when missing or None)."""
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


def _rows_mean(mask: torch.Tensor, info: dict[str, Any]) -> ReductionArgs:
    """The ``torch.mean`` over the B rows of verl ``geo_mean`` (empty rows count; no counts)."""
    del info
    return ReductionArgs("sequence_mean", normalizer=max(mask.shape[0], 1))


#: :data:`VERL_AGGREGATIONS` and the mean over the rows that ``geo_mean`` forces (``"rows"``).
FORCED_AGGREGATIONS = {**VERL_AGGREGATIONS, "rows": _rows_mean}


def check_config(config: object, loss_mode: str) -> None:
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
    info = global_info(config)
    if info.get("dp_size") is not None:
        preset_count(info["dp_size"], "global_batch_info['dp_size']")
    for key in ("batch_num_tokens", "global_batch_size", "loss_scale_factor"):
        if info.get(key) is not None:
            validate_scalar(info[key], f"global_batch_info[{key!r}]", strict=True)
    _check_policy_options(policy_options(config))


def _check_policy_options(policy: object) -> None:
    """``config.policy_loss``'s numbers, named ``policy_loss.<name>`` as verl names them.

    ``clip_cov_ratio`` and ``kl_cov_ratio`` in ``(0, 1]``, ``clip_cov_lb < clip_cov_ub``
    (finite), ``ppo_kl_coef >= 0`` and ``dro_beta > 0`` when given (finite); missing values
    take verl's defaults.
    """
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        selection_ratio(policy, name)
    clip_cov_bounds(policy)
    preset_number(option(policy, "ppo_kl_coef", 1.0), "policy_loss.ppo_kl_coef")
    beta = option(policy, "dro_beta", None)
    if beta is not None:
        preset_number(beta, "policy_loss.dro_beta", strict=True)


def clip_cov_bounds(policy: object) -> tuple[float, float]:
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


def clip_band(config: object) -> tuple[float, float]:
    """Verl's ``(clip_ratio_low, clip_ratio_high)``, each defaulting to ``clip_ratio`` (0.2)."""
    ratio = option(config, "clip_ratio", 0.2)
    return option(config, "clip_ratio_low", ratio), option(config, "clip_ratio_high", ratio)


def policy_options(config: object) -> object:
    """``config.policy_loss`` (verl's ``PolicyLossConfig``, or a mapping), or None."""
    return option(config, "policy_loss", None)


def selection_ratio(policy: object, name: str) -> float:
    """``policy_loss.<name>`` (verl's default 0.0002), a fraction in ``(0, 1]``."""
    value = preset_number(option(policy, name, 0.0002), f"policy_loss.{name}", strict=True)
    if value > 1.0:
        raise ValueError(f"policy_loss.{name} must be <= 1 (a fraction of the tokens), got {value}")
    return value
