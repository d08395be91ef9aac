r"""verl 0.9.1's rollout correction inside the loss (``loss_mode="bypass_mode"``).

In bypass mode verl's trainer passes the rollout (sampler) log-probabilities as
``old_log_prob``; the loss computes, without gradient, from :math:`\lambda = \ell - \ell_{rollout}`
(``config.policy_loss.rollout_correction``, verl's ``RolloutCorrectionConfig``):

- the IS weights (``rollout_is`` ``"token"`` / ``"sequence"``, ``rollout_is_threshold``):
  :func:`rlobjectives.rollout_correction` with ``level`` and ``mode="truncate", upper=U``
  (TIS; a number) or ``mode="mask", lower=L, upper=U`` (IcePop; a ``"L_U"`` string), the
  log-ratio clamped to :math:`\pm 20` as verl's ``SAFETY_BOUND``; optionally divided by their
  mean (``rollout_is_batch_normalize``: over the selected tokens, or the non-empty sequences'
  means, all-reduced over the default process group when one is initialised, as verl);
- the rejection mask (``rollout_rs``, a comma-separated list that must all pass, with
  ``rollout_rs_threshold``): per option a statistic of :math:`\lambda_s = \mathrm{clip}(\lambda,
  \pm 20)`, ``k1`` :math:`-\lambda_s`, ``k2`` :math:`\lambda_s^2/2`, ``k3``
  :math:`e^{\lambda_s} - 1 - \lambda_s`, per token (``token_``) or per sequence (its masked
  ``seq_sum_``, ``seq_mean_``, ``seq_max_``), kept in ``[log L, log U]`` (k1, ratio bounds
  ``"L_U"``; one number U means ``L = 1/U``) or at most U (k2, k3);
- verl's ``rollout_corr/*`` metrics (off-policy gap, IS weights, each rejection option).

The loss is then verl's ``loss_type`` on the surviving tokens: ``"ppo_clip"`` the vanilla loss
against the rollout log-probs (no IS weight: the clip handles the ratio), ``"reinforce"``
:math:`-A\,\ell\,w`. Where verl raises (``ValueError`` on a call without a selected token,
``ZeroDivisionError`` when IcePop zeroes every weight of a call) the preset returns finite
numbers (0, or an infinite effective sample size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from .._core.reduction import mean_selected, safe_divide, sum_selected
from .._core.validation import compute_dtype
from ..rollout.correction import LOG_RATIO_BOUND, Level, rollout_correction
from ._common import option, preset_flag

__all__ = ["BYPASS_LOSS_TYPES", "RS_OPTIONS", "BypassCorrection", "RolloutOptions"]
__all__ += ["bypass_correction", "rollout_options"]

#: verl's ``loss_type`` of bypass mode.
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")

_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda log_ratio: -log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio**2,
    "k3": lambda log_ratio: torch.exp(log_ratio) - 1.0 - log_ratio,
}


def _row_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest selected value of each row, 0 for an empty row (verl's ``_sequence_max``)."""
    largest = torch.where(mask, values, -math.inf).amax(dim=-1)
    return torch.where(largest == -math.inf, torch.zeros_like(largest), largest)


#: The sequence statistics of the rejection options (``token_`` options have none).
_SCOPES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "seq_sum": lambda values, mask: sum_selected(values, mask, dim=-1),
    "seq_mean": lambda values, mask: mean_selected(values, mask, dim=-1),
    "seq_max": _row_max,
}

#: verl 0.9.1's ``rollout_rs`` options (``SUPPORTED_ROLLOUT_RS_OPTIONS``).
RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip


class Rejection(NamedTuple):
    """One ``rollout_rs`` option with its bounds (k1: ratio bounds, kept in log space)."""

    name: str
    lower: float | None  # k1 only
    upper: float

    @property
    def scope(self) -> str:
        return self.name.rsplit("_", 1)[0]

    @property
    def estimator(self) -> str:
        return self.name.rsplit("_", 1)[1]


class RolloutOptions(NamedTuple):
    """``RolloutCorrectionConfig`` as the loss reads it (validated as verl does)."""

    level: str | None  # rollout_is: "token", "sequence" or None (no weights)
    upper: float
    lower: float | None  # IcePop's lower bound, or None (TIS)
    batch_normalize: bool
    rejections: tuple[Rejection, ...]
    loss_type: str


def _is_threshold(spec: object) -> tuple[float, float | None]:
    """``rollout_is_threshold`` as verl parses it: ``U`` (TIS) or ``"L_U"`` (IcePop)."""
    if isinstance(spec, bool):  # verl's wording, which its own tests read
        raise TypeError(
            "rollout_is_threshold must be specified as a float or a string threshold "
            f"specification, not a boolean, got {spec!r}"
        )
    if not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a float or a threshold string, got {spec!r}")
    lower: float | None = None
    text = str(spec).strip() if isinstance(spec, str) else None
    if text == "":
        raise ValueError("rollout_is_threshold must not be an empty string")
    try:
        if text is not None and "_" in text:
            low_text, high_text = text.split("_", 1)
            lower, upper = float(low_text), float(high_text)
        else:
            upper = float(spec if text is None else text)
    except ValueError as error:
        raise ValueError(f"Invalid rollout_is_threshold {spec!r}") from error
    if not math.isfinite(upper) or upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None and not (math.isfinite(lower) and 0 < lower <= upper):
        raise ValueError(
            "rollout_is_threshold lower bound must be positive and <= the upper bound, "
            f"got {spec!r}"
        )
    return upper, lower


def _rejections(options: object, spec: object) -> tuple[Rejection, ...]:
    """``rollout_rs`` / ``rollout_rs_threshold`` as verl parses them (one bound per option)."""
    if options is None:
        return ()
    if not isinstance(options, str):
        raise ValueError(f"rollout_rs must be a comma-separated string, got {options!r}")
    names: list[str] = []
    for name in (part.strip() for part in options.split(",")):
        if name and name not in names:
            if name not in RS_OPTIONS:
                raise ValueError(f"Invalid rollout_rs option {name!r}; must be one of {RS_OPTIONS}")
            names.append(name)
    if not names:
        raise ValueError("rollout_rs must contain at least one valid option")
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a string or a number, got {spec!r}")
    specs = [str(spec)] if not isinstance(spec, str) else [
        part.strip() for part in spec.split(",") if part.strip()
    ]  # fmt: skip
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold must give one threshold or one per rollout_rs option "
            f"({len(names)}), got {spec!r}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    rejections = []
    for name, text in zip(names, specs, strict=True):
        if not name.endswith("k1") and "_" in text:
            raise ValueError(
                f"rollout_rs_threshold for {name!r} takes one upper bound (no '_'), got {text!r}"
            )
        try:
            if name.endswith("k1"):
                low_text, high_text = text.split("_", 1) if "_" in text else (None, text)
                upper = float(high_text)
                lower = float(str(1.0 / upper)) if low_text is None else float(low_text)
            else:
                lower, upper = None, float(text)
        except (ValueError, ZeroDivisionError) as error:
            raise ValueError(f"Invalid rollout_rs_threshold {text!r} for {name!r}") from error
        bounds = [upper] if lower is None else [lower, upper]
        if not all(math.isfinite(b) and b > 0 for b in bounds) or (lower or 0) > upper:
            raise ValueError(
                f"rollout_rs_threshold for {name!r} must be positive (lower <= upper), got {text!r}"
            )
        rejections.append(Rejection(name, lower, upper))
    return tuple(rejections)


def _get(correction: object, name: str, default: object) -> object:
    """``correction.get(name, default)`` as verl reads it: the default only for a missing key.

    A key given as None stays None (verl's ``rollout_is_threshold=None`` turns the IS weights
    off, a missing one is verl's default 2.0).
    """
    if isinstance(correction, Mapping):
        return correction.get(name, default)
    return getattr(correction, name, default)


def rollout_options(config: object) -> RolloutOptions:
    """``config.policy_loss.rollout_correction`` read and checked as verl reads it.

    Missing keys take the defaults of verl's ``compute_policy_loss_bypass_mode``
    (``loss_type="ppo_clip"``, ``rollout_is=None``, ``rollout_is_threshold=2.0``,
    ``rollout_is_batch_normalize=False``, ``rollout_rs=None``); a key given as None is None.

    Raises:
        ValueError: no ``rollout_correction``, an unknown ``rollout_is`` / ``rollout_rs`` /
            ``loss_type``, or a malformed threshold (verl's messages).
        TypeError: a threshold that is neither a number nor a string (a bool: verl's "not a
            boolean"), a ``rollout_is_batch_normalize`` that is not a bool.
    """
    policy = option(config, "policy_loss", None)
    correction = option(policy, "rollout_correction", None)
    if correction is None:
        raise ValueError(
            "loss_mode='bypass_mode' needs config.policy_loss.rollout_correction "
            "(verl's RolloutCorrectionConfig)"
        )
    loss_type = _get(correction, "loss_type", "ppo_clip")
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {list(BYPASS_LOSS_TYPES)}, got {loss_type!r}")
    level = _get(correction, "rollout_is", None)
    threshold = _get(correction, "rollout_is_threshold", 2.0)
    upper, lower = 1.0, None
    if level is not None and threshold is not None:
        if level not in ("token", "sequence"):
            raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {level!r}")
        upper, lower = _is_threshold(threshold)
    else:
        level = None
    normalize = _get(correction, "rollout_is_batch_normalize", False)
    normalize = False if normalize is None else preset_flag(normalize, "rollout_is_batch_normalize")
    rejections = _rejections(
        _get(correction, "rollout_rs", None), _get(correction, "rollout_rs_threshold", None)
    )
    return RolloutOptions(level, upper, lower, normalize, rejections, str(loss_type))


class BypassCorrection(NamedTuple):
    """The IS weights (or None), the surviving tokens and verl's ``rollout_corr/*`` metrics."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------
# masked statistics in verl's definitions (no host syncs: every branch is a torch.where)


def _max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, -math.inf).amax()


def _min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, math.inf).amin()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``sqrt(max(E[x²] - E[x]², 0))`` of the clamped values (verl's); 0 for one token or none."""
    clamped = values.clamp(low, high)
    variance = mean_selected(clamped.square(), mask) - mean_selected(clamped, mask).square()
    std = variance.clamp(min=0.0).sqrt()
    return torch.where(mask.sum() > 1, std, torch.zeros_like(std))


def _sample_std(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows].std()`` (Bessel's correction) without indexing; 0 for fewer than 2 rows."""
    count = rows.sum()
    centred = torch.where(rows, values - mean_selected(values, rows), 0.0)
    variance = centred.square().sum() / (count - 1).clamp(min=1).to(values.dtype)
    return torch.where(count > 1, variance.sqrt(), torch.zeros_like(variance))


def _fraction(condition: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fraction of the selected entries where ``condition`` holds."""
    return mean_selected(condition.to(dtype), mask)


def _global_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked mean over the default group when one exists, else local (verl's)."""
    if dist.is_available() and dist.is_initialized():
        totals = torch.stack([sum_selected(values, mask), mask.sum().to(values.dtype)])
        dist.all_reduce(totals)
        return totals[0] / totals[1]
    return sum_selected(values, mask) / mask.sum().to(values.dtype).clamp(min=1e-8)


# --------------------------------------------------------------------------------------------
# the three parts


def _weights(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, options: RolloutOptions
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The IS weights (TIS or IcePop, optionally normalised) and verl's ``rollout_is_*``."""
    assert options.level is not None
    level, upper, lower, dtype = options.level, options.upper, options.lower, trainer.dtype
    level_: Level = "token" if level == "token" else "sequence"
    raw_weights = rollout_correction(  # the raw ratio, 0 at unselected tokens: (B, T)
        trainer, rollout, mask, level=level_, mode="truncate", upper=None
    ).weights
    if lower is None:  # TIS
        weights = raw_weights.clamp(max=upper)
    else:  # IcePop
        weights = rollout_correction(
            trainer, rollout, mask, level=level_, mode="mask", lower=lower, upper=upper
        ).weights
    low = 1.0 / upper if lower is None else lower
    metrics: dict[str, torch.Tensor] = {"rollout_is_mean": mean_selected(weights, mask)}
    if level == "sequence":
        log_sums = sum_selected(trainer - rollout, mask, dim=-1)  # (B,) every row, as verl
        log_upper = torch.log(torch.tensor(upper, dtype=log_sums.dtype))
        log_lower = torch.log(torch.tensor(low, dtype=log_sums.dtype))
        metrics["rollout_is_max"] = log_sums.max().clamp(max=LOG_RATIO_BOUND).exp()
        metrics["rollout_is_min"] = log_sums.min().exp()
        metrics["rollout_is_ratio_fraction_high"] = (log_sums > log_upper).to(log_sums.dtype).mean()
        metrics["rollout_is_ratio_fraction_low"] = (log_sums < log_lower).to(log_sums.dtype).mean()
    else:
        metrics["rollout_is_ratio_fraction_high"] = _fraction(raw_weights > upper, mask, dtype)
        metrics["rollout_is_ratio_fraction_low"] = _fraction(raw_weights < low, mask, dtype)
        metrics["rollout_is_max"] = _max(weights, mask)
        metrics["rollout_is_min"] = _min(weights, mask)
    metrics["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    clamped = weights.clamp(0.0, upper)
    normalised = clamped / (mean_selected(clamped, mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / mean_selected(normalised.square(), mask)
    row_means = mean_selected(weights, mask, dim=-1)  # (B,), 0 for an empty row (counted)
    metrics["rollout_is_seq_mean"] = row_means.mean()
    every_row = torch.ones_like(row_means, dtype=torch.bool)
    metrics["rollout_is_seq_std"] = _sample_std(row_means, every_row)
    metrics["rollout_is_seq_max"] = row_means.max()
    metrics["rollout_is_seq_min"] = row_means.min()
    metrics["rollout_is_seq_max_deviation"] = (row_means - 1.0).abs().max()
    raw_row_means = mean_selected(raw_weights, mask, dim=-1)
    metrics["rollout_is_seq_fraction_high"] = (raw_row_means > upper).to(row_means.dtype).mean()
    metrics["rollout_is_seq_fraction_low"] = (raw_row_means < low).to(row_means.dtype).mean()
    if lower is not None:
        outside = (raw_weights < lower) | (raw_weights > upper)
        metrics["rollout_is_oob_ratio"] = _fraction(outside, mask, dtype)
    if options.batch_normalize:
        if level == "token":
            mean = _global_mean(weights, mask)
        else:
            mean = _global_mean(row_means, mask.any(dim=-1))
        positive = mean > 1e-8
        weights = torch.where(positive, weights / mean, weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(positive, mean, torch.ones_like(mean))
    return weights, metrics


def _rejection(
    log_ratio: torch.Tensor, mask: torch.Tensor, rejections: tuple[Rejection, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The surviving tokens of every rejection option and verl's ``rollout_rs_*`` metrics."""
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    dtype = log_ratio.dtype
    rows = mask.any(dim=-1)  # (B,) the non-empty rows
    keep_all = mask.clone()
    metrics: dict[str, torch.Tensor] = {}
    for rejection in rejections:
        token_statistic = _ESTIMATORS[rejection.estimator](bounded)  # (B, T)
        two_sided = rejection.lower is not None
        upper = math.log(rejection.upper) if two_sided else rejection.upper
        lower = math.log(rejection.lower) if rejection.lower is not None else 0.0
        if rejection.scope == "token":
            statistic = token_statistic
            row_values = mean_selected(statistic, mask, dim=-1)
        else:
            row_values = _SCOPES[rejection.scope](token_statistic, mask)  # (B,)
            statistic = row_values[:, None].expand_as(token_statistic)
        kept = statistic <= upper
        if two_sided:
            kept = kept & (statistic >= lower)
        prefix = f"rollout_rs_{rejection.name}"
        metrics[f"{prefix}_mean"] = mean_selected(statistic, mask)
        sequence_level = rejection.scope != "token"
        if sequence_level:
            metrics[f"{prefix}_max"] = _max(row_values, rows)
            metrics[f"{prefix}_min"] = _min(row_values, rows)
            metrics[f"{prefix}_fraction_high"] = _fraction(row_values > upper, rows, dtype)
            low_fraction = _fraction(row_values < lower, rows, dtype)
        else:
            metrics[f"{prefix}_max"] = _max(statistic, mask)
            metrics[f"{prefix}_min"] = _min(statistic, mask)
            metrics[f"{prefix}_fraction_high"] = _fraction(statistic > upper, mask, dtype)
            low_fraction = _fraction(statistic < lower, mask, dtype)
        metrics[f"{prefix}_fraction_low"] = (
            low_fraction if two_sided else torch.zeros((), dtype=dtype)
        )
        metrics[f"{prefix}_std"] = _clamped_std(statistic, mask, lower if two_sided else 0.0, upper)
        metrics[f"{prefix}_seq_mean"] = mean_selected(row_values, rows)
        metrics[f"{prefix}_seq_std"] = _sample_std(row_values, rows)
        metrics[f"{prefix}_seq_max"] = _max(row_values, rows)
        metrics[f"{prefix}_seq_min"] = _min(row_values, rows)
        metrics[f"{prefix}_seq_max_deviation"] = _max(row_values.abs(), rows)
        metrics[f"{prefix}_seq_fraction_high"] = _fraction(row_values > upper, rows, dtype)
        if two_sided:
            metrics[f"{prefix}_seq_fraction_low"] = _fraction(row_values < lower, rows, dtype)
        metrics[f"{prefix}_masked_fraction"] = _fraction(~kept, mask, dtype)
        row_kept = (kept | ~mask).all(dim=-1)
        metrics[f"{prefix}_seq_masked_fraction"] = safe_divide(
            (rows & ~row_kept).sum().to(log_ratio.dtype), rows.sum()
        )
        keep_all = keep_all & kept
    metrics["rollout_rs_masked_fraction"] = _fraction(~keep_all, mask, dtype)
    rejected_rows = (mask & ~keep_all).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_rows.to(log_ratio.dtype).mean()
    return keep_all, metrics


def _off_policy(
    trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The off-policy metrics of verl (``compute_offpolicy_metrics``): perplexities, KL, χ²."""
    trainer_means = mean_selected(trainer, mask, dim=-1)  # (B,), 0 for an empty row
    rollout_means = mean_selected(rollout, mask, dim=-1)
    log_ratio = trainer - rollout
    difference = rollout_means - trainer_means
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sequence = sum_selected(log_ratio, mask, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "training_ppl": torch.exp(-trainer_means).mean(),
        "training_log_ppl": (-trainer_means).mean(),
        "kl": mean_selected(rollout - trainer, mask),
        "k3_kl": mean_selected(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-rollout_means).mean(),
        "rollout_log_ppl": (-rollout_means).mean(),
        "log_ppl_diff": difference.mean(),
        "log_ppl_abs_diff": difference.abs().mean(),
        "log_ppl_diff_max": difference.max(),
        "log_ppl_diff_min": difference.min(),
        "ppl_ratio": torch.exp(difference).mean(),
        "chi2_token": mean_selected(bounded.exp().square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * sequence).mean() - 1.0,
    }


@torch.no_grad()
def bypass_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    options: RolloutOptions,
) -> BypassCorrection:
    """The IS weights, the rejection mask and the metrics of verl's bypass mode, no gradient.

    Args:
        log_prob: ``(B, T)`` the trainer's current log-probabilities (detached here).
        rollout_log_prob: ``(B, T)`` the sampler's (verl's ``old_log_prob`` in bypass mode).
        mask: ``(B, T)`` bool, the selected tokens.
        options: :func:`rollout_options` of the config.
    """
    dtype = compute_dtype(log_prob, rollout_log_prob)
    trainer, rollout = log_prob.detach().to(dtype), rollout_log_prob.detach().to(dtype)
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if options.level is not None:
        weights, is_metrics = _weights(trainer, rollout, mask, options)
        metrics.update(is_metrics)
    kept = mask
    if options.rejections:
        log_ratio = torch.where(mask, trainer - rollout, 0.0)
        kept, rs_metrics = _rejection(log_ratio, mask, options.rejections)
        metrics.update(rs_metrics)
    metrics.update(_off_policy(trainer, rollout, mask))
    named = {f"rollout_corr/{key}": value.to(dtype) for key, value in metrics.items()}
    return BypassCorrection(weights, kept, named)
