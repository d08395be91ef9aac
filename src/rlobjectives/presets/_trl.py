r"""TRL's ``GRPOTrainer._compute_loss`` as a pure function of tensors (TRL 1.16, PyPI).

:func:`trl_grpo_loss` maps the ``GRPOConfig`` options onto library calls, with one row per
``loss_type`` in :data:`TRL_LOSS_TYPES` (the surrogate and the normaliser) and the options that
need a library feature this version does not have in :data:`TRL_PENDING` (each raises
``NotImplementedError`` naming what is missing; nothing is approximated).

With :math:`M` the loss mask, :math:`n_i = \sum_t M_{it}`, B the local rows, GA the current
gradient-accumulation steps (1 in eval), P the processes, N ``num_items_in_batch`` and spg
``steps_per_generation``, TRL 1.16 returns

- ``grpo``: :math:`\frac{1}{B\,GA}\sum_i \frac{1}{\max(n_i,1)}\sum_t M L` (empty rows count in B)
  = ``sequence_mean`` with ``normalizer = B·GA``;
- ``bnpo``: :math:`\sum M L / \max(\sum M, 1) / GA` = ``token_mean``, then ``/ GA``;
- ``dr_grpo``: :math:`\sum M L / (B \cdot \texttt{max\_completion\_length}) / GA` =
  ``sequence_sum_normalized`` with ``normalizer = B·GA``, ``max_response_length`` =
  ``max_completion_length``;
- ``dapo``: :math:`\sum M L / (\max(N,1)/P \cdot GA/spg)` = ``token_mean`` with that normaliser;
- ``luspo``: :math:`\frac{1}{B\,GA}\sum_i \sum_t M L` = ``sequence_sum_normalized`` with
  ``normalizer = B·GA`` and ``max_response_length=1`` (each sequence weighted by its length).

The per-token loss is :math:`L = -\min(rA, \mathrm{clip}(r, 1-\epsilon, 1+\epsilon_{high})A)`
with no bound on the log-ratio (TRL has none), plus :math:`\beta\,k_3` (times the ratio with its
gradient when ``use_bias_correction_kl``, TRL's default since 1.10).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._kl import kl_estimate
from .._masking import masked_fill_zero, masked_mean
from .._validation import Scalar, validate_choice
from ._common import ReductionArgs, as_bool_mask, not_yet, reduce_terms, weighted_policy_loss

__all__ = ["TRL_LOSS_TYPES", "TRL_PENDING", "TRLGRPOLoss", "TRLLossOutput", "trl_grpo_loss"]


class TRLLossOutput(NamedTuple):
    """``(loss, metrics)``: TRL's returned loss and its metrics under TRL's names.

    ``metrics`` maps TRL's metric names (``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``, ``kl``) to
    detached 0-d float32 tensors computed on this call's tensors (TRL all-reduces the means over
    processes before logging; see :class:`rlobjectives.integrations.trl.GRPOTrainer`).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


class _Batch(NamedTuple):
    """The call-dependent quantities of TRL's normalisers."""

    rows: int
    num_items: Scalar | None
    processes: int
    accumulation: int
    steps_per_generation: int
    max_completion_length: int | None


def _sequence_mean(batch: _Batch) -> ReductionArgs:
    return ReductionArgs("sequence_mean", normalizer=max(batch.rows, 1) * batch.accumulation)


def _local_token_mean(batch: _Batch) -> ReductionArgs:
    return ReductionArgs("token_mean", divisor=float(batch.accumulation))


def _constant_length(batch: _Batch) -> ReductionArgs:
    rows = max(batch.rows, 1) * batch.accumulation
    return ReductionArgs("sequence_sum_normalized", rows, batch.max_completion_length)


def _generation_token_mean(batch: _Batch) -> ReductionArgs:
    window = batch.accumulation / batch.steps_per_generation  # TRL >= 1.10: GA / spg
    if batch.num_items is None:  # this call holds the whole generation batch
        return ReductionArgs("token_mean", divisor=batch.processes**-1 * window)
    items = batch.num_items
    items = items.clamp(min=1) if isinstance(items, torch.Tensor) else max(items, 1)
    return ReductionArgs("token_mean", normalizer=items / batch.processes * window)


def _length_weighted(batch: _Batch) -> ReductionArgs:
    return ReductionArgs("sequence_sum_normalized", max(batch.rows, 1) * batch.accumulation, 1)


class _LossType(NamedTuple):
    """One TRL ``loss_type``: the ``policy_loss`` surrogate keyword and the normaliser."""

    surrogate: str
    reduction: Callable[[_Batch], ReductionArgs]


#: TRL ``loss_type`` -> (surrogate, normaliser). cispo / sapo / vespo are one row each once
#: ``policy_loss(surrogate=...)`` exists (issue 13): ("cispo", _generation_token_mean),
#: ("sapo", _sequence_mean), ("vespo", _generation_token_mean).
TRL_LOSS_TYPES: dict[str, _LossType] = {
    "grpo": _LossType("clip", _sequence_mean),
    "bnpo": _LossType("clip", _local_token_mean),
    "dr_grpo": _LossType("clip", _constant_length),
    "dapo": _LossType("clip", _generation_token_mean),
    "luspo": _LossType("clip", _length_weighted),
}

#: TRL options this version cannot reproduce: option -> what it needs.
TRL_PENDING: dict[str, str] = {
    "loss_type='cispo'": "policy_loss(surrogate='cispo', cispo_cap=epsilon_high) (issue 13)",
    "loss_type='sapo'": "policy_loss(surrogate='sapo', sapo_temperature_pos/neg) (issue 13)",
    "loss_type='vespo'": "policy_loss(surrogate='vespo', vespo_k/lambda_pos/neg) (issue 13)",
    "delta <= 1 + epsilon_high": "policy_loss(delta=) (issue 13); delta > 1 + epsilon_high "
    "is supported (it equals dual_clip=delta)",
    "top_entropy_quantile < 1": "top_entropy_mask and the token entropies (issue 13)",
    "entropy_coef != 0": "policy_loss(entropy=, entropy_coef=) (issue 13)",
    "off_policy_mask_threshold": "off_policy_sequence_mask (issue 12)",
}

_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class TRLGRPOLoss:
    """TRL's GRPO loss for fixed ``GRPOConfig`` options (built by :func:`trl_grpo_loss`)."""

    loss_type: str
    epsilon: float
    epsilon_high: float
    beta: float
    importance_sampling_level: str
    delta: float | None
    max_completion_length: int | None
    use_bias_correction_kl: bool

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        ref_log_probs: torch.Tensor | None = None,
        importance_sampling_ratio: torch.Tensor | None = None,
        num_items_in_batch: Scalar | None = None,
        num_processes: int = 1,
        gradient_accumulation_steps: int = 1,
        steps_per_generation: int | None = None,
    ) -> TRLLossOutput:
        """The loss ``GRPOTrainer._compute_loss`` returns for these tensors, and its metrics.

        Args:
            log_probs: ``(B, T)`` per-token log-probabilities of the completions (with grad).
            old_log_probs: ``(B, T)``; TRL's ``old_per_token_logps``, or ``log_probs.detach()``
                when TRL omits them (on-policy).
            advantages: ``(B,)`` (TRL's) or ``(B, 1)``; ``(B, T)`` at token level only.
            mask: ``(B, T)`` completion mask (times ``tool_mask``), 0/1 or bool.
            ref_log_probs: ``(B, T)``, required when ``beta != 0``.
            importance_sampling_ratio: TRL's vLLM correction, ``(B, T)`` (token modes) or
                ``(B, 1)`` (sequence modes), multiplied into the policy term (not the KL).
            num_items_in_batch: TRL's global loss-token count of the generation batch (dapo);
                None = the selected tokens of this call (one process, whole generation batch).
            num_processes: P (``accelerator.num_processes``).
            gradient_accumulation_steps: TRL's ``current_gradient_accumulation_steps``; 1 in
                eval.
            steps_per_generation: ``args.steps_per_generation``; None = GA (TRL's default); 1 in
                eval.

        Returns:
            :class:`TRLLossOutput` ``(loss, metrics)``.

        Raises:
            ValueError: ``beta != 0`` without ``ref_log_probs``; a per-token ratio or per-token
                advantages at sequence level (TRL spreads a sequence's loss over its tokens,
                the library's GSPO-token form does not: the gradients differ).
        """
        selected = as_bool_mask(mask, log_probs)
        self._check_call(advantages, importance_sampling_ratio, ref_log_probs)
        spg = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
        batch = _Batch(
            log_probs.shape[0],
            num_items_in_batch,
            num_processes,
            gradient_accumulation_steps,
            spg,
            self.max_completion_length,
        )
        args = TRL_LOSS_TYPES[self.loss_type].reduction(batch)
        policy = weighted_policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            options=self._surrogate_options(),
            args=args,
            weights=importance_sampling_ratio,
        )
        metrics = clip_metrics(
            log_probs, old_log_probs, advantages, selected, self.importance_sampling_level,
            self.epsilon, self.epsilon_high,
        )  # fmt: skip
        loss = policy.loss
        if self.beta != 0.0:
            assert ref_log_probs is not None  # checked in _check_call
            kl = self._kl_terms(log_probs, old_log_probs, ref_log_probs, selected)  # (B, T)
            loss = loss + self.beta * reduce_terms(kl, selected, args)
            metrics["kl"] = masked_mean(kl.detach().float(), selected)
        return TRLLossOutput(loss, metrics)

    def _surrogate_options(self) -> dict[str, Any]:
        return {
            "clip_low": self.epsilon,
            "clip_high": self.epsilon_high,
            # TRL's delta caps min(r, delta) in the unclipped branch; for delta > 1 + eps_high
            # that is the dual clip at c = delta (A > 0 tokens are unchanged).
            "dual_clip": self.delta,
            "ratio_level": self.importance_sampling_level,
            "log_ratio_bound": None,  # TRL exponentiates the raw log-ratio
        }

    def _check_call(
        self,
        advantages: torch.Tensor,
        importance_sampling_ratio: torch.Tensor | None,
        ref_log_probs: torch.Tensor | None,
    ) -> None:
        if self.beta != 0.0 and ref_log_probs is None:
            raise ValueError(f"beta={self.beta} needs ref_log_probs (TRL's ref_per_token_logps)")
        if self.importance_sampling_level != "sequence":
            return
        for name, value in (("advantages", advantages), ("importance_sampling_ratio",
                                                         importance_sampling_ratio)):  # fmt: skip
            if value is not None and value.ndim == 2 and value.shape[-1] != 1:
                raise ValueError(
                    f"importance_sampling_level='sequence' with per-token {name} of shape "
                    f"{tuple(value.shape)}: TRL spreads each sequence's loss over its tokens, "
                    "the library's GSPO-token form weights each token by its own value, so the "
                    f"gradients differ; pass one value per sequence, (B,) or (B, 1)"
                )

    def _kl_terms(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        ref_log_probs: torch.Tensor,
        selected: torch.Tensor,
    ) -> torch.Tensor:
        """TRL's per-token k3 (no clamp), times the ratio (with grad) for bias correction."""
        kl = kl_estimate(log_probs, ref_log_probs, selected, estimator="k3", log_ratio_bound=None)
        if not self.use_bias_correction_kl:
            return kl
        ratio = importance_ratio(log_probs, old_log_probs, selected, self.importance_sampling_level)
        return kl * ratio.to(kl.dtype)


def importance_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, selected: torch.Tensor, level: str
) -> torch.Tensor:
    """TRL's ``coef_1`` with its gradient: ``exp(Δ)`` ``(B, T)`` or ``exp(mean_t Δ)`` ``(B, 1)``."""
    log_ratio = masked_fill_zero(log_probs - old_log_probs.detach(), selected)  # (B, T)
    if level == "sequence":
        counts = selected.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        log_ratio = log_ratio.sum(-1, keepdim=True) / counts  # (B, 1)
    return torch.exp(log_ratio)


@torch.no_grad()
def clip_metrics(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    selected: torch.Tensor,
    level: str,
    epsilon: float,
    epsilon_high: float,
) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/*`` metrics of the clipped loss types (float32, this call's tensors).

    Means are over the selected tokens (token level) or over all B rows (sequence level, one
    ratio per sequence); ``low_min`` / ``high_max`` are the extremes of the per-sequence
    fractions, empty sequences ignored (NaN when every sequence is empty), as TRL's ``nanmin``.
    """
    ratio = importance_ratio(log_probs.float(), old_log_probs.float(), selected, level)
    advantages = advantages.float()
    advantages = advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    metrics: dict[str, torch.Tensor] = {}
    for name, clipped in (("low", low), ("high", high), ("region", low | high)):
        metrics[f"clip_ratio/{name}_mean"] = _global_mean(clipped.float(), selected)
    low_rows = _sequence_means(low.float(), selected)
    high_rows = _sequence_means(high.float(), selected)
    metrics["clip_ratio/low_min"] = _nan_extreme(low_rows, largest=False)
    metrics["clip_ratio/high_max"] = _nan_extreme(high_rows, largest=True)
    return metrics


def _global_mean(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    if values.shape[-1] == 1:  # one value per sequence: mean over all rows
        return values.sum() / max(values.shape[0], 1)
    return masked_mean(values, selected)


def _sequence_means(values: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    if values.shape[-1] == 1:
        return values.squeeze(-1)  # (B,)
    sums = masked_fill_zero(values, selected).sum(-1)
    return sums / selected.sum(-1).to(sums.dtype)  # (B,), NaN for an empty row (as TRL)


def _nan_extreme(values: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """TRL's ``nanmax`` (``largest``) or ``nanmin`` of ``values``: NaN when every value is NaN."""
    nan = torch.full((), math.nan, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return nan
    missing = torch.isnan(values)
    fill = -math.inf if largest else math.inf
    filled = torch.where(missing, fill, values)
    extreme = filled.max() if largest else filled.min()
    return torch.where(missing.all(), nan, extreme)


def trl_grpo_loss(
    *,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    max_completion_length: int | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    use_bias_correction_kl: bool = True,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    off_policy_mask_threshold: float | None = None,
) -> TRLGRPOLoss:
    r"""TRL's GRPO loss (``GRPOTrainer._compute_loss``, TRL 1.16) for these ``GRPOConfig`` options.

    Returns a callable ``loss_fn(log_probs, old_log_probs, advantages, mask, *, ref_log_probs=None,
    importance_sampling_ratio=None, num_items_in_batch=None, num_processes=1,
    gradient_accumulation_steps=1, steps_per_generation=None) -> (loss, metrics)`` whose loss
    equals TRL's, value and gradient, for the same tensors (see the module docstring for each
    ``loss_type``'s normaliser). The arguments are the ``GRPOConfig`` fields of the same names
    with TRL's defaults; ``epsilon_high=None`` means ``epsilon``.

    Differences from the git snapshot f2cd577 (1.10.0.dev0) of TRL: there ``dapo`` divides by
    ``N/P`` without the ``GA/spg`` factor, ``luspo`` averages ``L·n_i`` over all ``B·T``
    elements (padding included), and ``use_bias_correction_kl`` defaults to False. Pass
    ``steps_per_generation=gradient_accumulation_steps`` to get the snapshot's ``dapo``.

    Args:
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"`` or ``"luspo"``
            (``"cispo"``, ``"sapo"``, ``"vespo"`` raise ``NotImplementedError`` until
            ``policy_loss(surrogate=)`` exists).
        epsilon: the lower clip :math:`\epsilon`, in ``[0, 1)``.
        epsilon_high: the upper clip (None = ``epsilon``).
        beta: KL coefficient (k3 against ``ref_log_probs``, no clamp).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        delta: TRL's two-sided clip; any ``delta > 1 + epsilon_high`` (equal to
            ``dual_clip=delta``); smaller values raise ``NotImplementedError``.
        max_completion_length: required for ``"dr_grpo"`` (TRL's constant normaliser).
        sapo_temperature_pos: SAPO temperature for :math:`A > 0` (used once ``"sapo"`` exists).
        sapo_temperature_neg: SAPO temperature for :math:`A \le 0`.
        use_bias_correction_kl: multiply the k3 term by the ratio, with its gradient (TRL's
            default since 1.10).
        top_entropy_quantile: only 1.0 (off) is supported.
        entropy_coef: only 0.0 is supported.
        off_policy_mask_threshold: only None is supported.

    Returns:
        A :class:`TRLGRPOLoss` (callable, immutable).

    Raises:
        ValueError: unknown ``loss_type`` or ``importance_sampling_level``; ``dr_grpo`` without
            ``max_completion_length``; clip values out of range.
        NotImplementedError: an option listed in :data:`TRL_PENDING`.

    Examples:
        >>> import torch
        >>> loss_fn = trl_grpo_loss(loss_type="grpo")
        >>> log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> loss_fn(log_probs, log_probs.detach(), torch.tensor([1.0]), torch.ones(1, 2)).loss
        tensor(-1., grad_fn=<...>)
    """
    known = (*TRL_LOSS_TYPES, "cispo", "sapo", "vespo")
    validate_choice(loss_type, "loss_type", known)
    validate_choice(importance_sampling_level, "importance_sampling_level", _LEVELS)
    high = epsilon if epsilon_high is None else epsilon_high
    pending = {
        f"loss_type={loss_type!r}": loss_type not in TRL_LOSS_TYPES,
        "delta <= 1 + epsilon_high": delta is not None and delta <= 1 + high,
        "top_entropy_quantile < 1": top_entropy_quantile < 1.0,
        "entropy_coef != 0": entropy_coef != 0.0,
        "off_policy_mask_threshold": off_policy_mask_threshold is not None,
    }
    for name, missing in pending.items():
        if missing:
            raise not_yet(f"TRL {name}", TRL_PENDING[name])
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError(
            "loss_type='dr_grpo' divides by max_completion_length (GRPOConfig's, default 256); "
            "got max_completion_length=None"
        )
    del sapo_temperature_pos, sapo_temperature_neg  # used by the "sapo" row (issue 13)
    return TRLGRPOLoss(
        loss_type, float(epsilon), float(high), float(beta), importance_sampling_level,
        None if delta is None else float(delta), max_completion_length, use_bias_correction_kl,
    )  # fmt: skip
