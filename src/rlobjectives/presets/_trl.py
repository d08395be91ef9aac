r"""TRL's ``GRPOTrainer._compute_loss`` as a pure function of tensors (TRL 1.16, PyPI).

:func:`trl_grpo_loss` maps the ``GRPOConfig`` options onto library calls, with one row per
``loss_type`` in :data:`TRL_LOSS_TYPES` (the ``policy_loss`` surrogate, the normaliser and the
metrics).

With :math:`M` the loss mask, :math:`n_i = \sum_t M_{it}`, B the local rows, GA the current
gradient-accumulation steps (1 in eval), P the processes, N ``num_items_in_batch`` and spg
``steps_per_generation``, TRL 1.16 returns

- ``grpo``, ``sapo``: :math:`\frac{1}{B\,GA}\sum_i \frac{1}{\max(n_i,1)}\sum_t M L` (empty
  rows count in B) = ``sequence_mean`` with ``normalizer = B·GA``;
- ``bnpo``: :math:`\sum M L / \max(\sum M, 1) / GA` = ``token_mean``, then ``/ GA``;
- ``dr_grpo``: :math:`\sum M L / (B \cdot \texttt{max\_completion\_length}) / GA` =
  ``sequence_sum_normalized`` with ``normalizer = B·GA``, ``max_response_length`` =
  ``max_completion_length``;
- ``dapo``, ``cispo``, ``vespo``: :math:`\sum M L / (\max(N,1)/P \cdot GA/spg)` =
  ``token_mean`` with that normaliser;
- ``luspo``: :math:`\frac{1}{B\,GA}\sum_i \sum_t M L` = ``length_weighted`` with
  ``normalizer = B·GA``.

The per-token loss :math:`L` is ``policy_loss``'s surrogate with no bound on the log-ratio (TRL
has none; VESPO clamps each log-ratio to :math:`\pm 20`, as TRL's ``get_gamma_weights``):
``Clip(low=epsilon, high=epsilon_high, delta=delta)`` for the clipped types,
``CISPO(cap=epsilon_high)``, ``SAPO(...)``, ``VESPO(...)``. TRL then multiplies it by the
off-policy sequence mask (``off_policy_mask_threshold``), the high-entropy mask
(``top_entropy_quantile``) and the vLLM
``importance_sampling_ratio`` (folded into :math:`\phi` for VESPO): here
``policy_loss(importance_weights=)``, the denominators keep :math:`M`. It adds
:math:`\beta\,k_3` (times the ratio with its gradient when ``use_bias_correction_kl``, TRL's
default since 1.10; ``kl_loss(importance_weights=)``), reduced like the policy term, and
subtracts ``entropy_coef`` times the token mean of the entropy over :math:`M` (times the
entropy mask) divided by GA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._core.masked import aggregate, masked_mean
from .._core.reduction import mean_selected
from .._core.validation import Scalar, checks_environment, validate_choice, validate_scalar
from ..distributed import global_top_entropy_mask
from ..kl.loss import kl_loss
from ..rollout.off_policy import off_policy_sequence_mask
from ._common import (
    as_bool_mask,
    check_options,
    float64_if_any,
    preset_count,
    preset_flag,
    preset_number,
    promote,
    reduce_terms,
    weighted_policy_loss,
)
from ._trl_metrics import MetricInputs, importance_ratio
from ._trl_rows import TRL_LOSS_TYPES, Batch, LossType

__all__ = ["TRL_LOSS_TYPES", "TRLGRPOLoss", "TRLLossOutput", "trl_grpo_loss"]


class TRLLossOutput(NamedTuple):
    """``(loss, metrics)``: TRL's returned loss and its metrics under TRL's names.

    ``metrics`` maps TRL's metric names to detached 0-d float32 tensors computed on this call's
    tensors: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
    ``clip_ratio/low_min``, ``clip_ratio/high_max`` (clipped loss types), ``cispo_clip_ratio``
    (cispo), ``vespo/phi_seq_mean`` (vespo), ``kl`` (``beta != 0``), ``policy_loss`` (entropy
    bonus on). TRL all-reduces them over processes before logging (see
    :class:`rlobjectives.integrations.trl.GRPOTrainer`).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


_LEVELS = ("token", "sequence")


class _Filters(NamedTuple):
    """TRL's 0/1 multipliers of the per-token policy loss, ``(B, T)`` bool or None."""

    off_policy: torch.Tensor | None
    entropy: torch.Tensor | None


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
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None

    @checks_environment
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
        entropy: torch.Tensor | None = None,
        sampling_log_probs: torch.Tensor | None = None,
        entropy_coef: float | None = None,
    ) -> TRLLossOutput:
        """The loss ``GRPOTrainer._compute_loss`` returns for these tensors, and its metrics.

        Args:
            log_probs: ``(B, T)`` per-token log-probabilities of the completions (with grad).
            old_log_probs: ``(B, T)``; TRL's ``old_per_token_logps``, or ``log_probs.detach()``
                when TRL omits them (on-policy).
            advantages: ``(B,)`` (TRL's) or ``(B, 1)``; ``(B, T)`` only at token level (and for
                cispo / vespo).
            mask: ``(B, T)`` completion mask (times ``tool_mask``), 0/1 or bool.
            ref_log_probs: ``(B, T)``, required when ``beta != 0``.
            importance_sampling_ratio: TRL's vLLM correction, ``(B, T)`` (token modes) or
                ``(B, 1)`` (sequence modes): multiplies the policy term (not the KL); VESPO
                takes it into its sequence weight.
            num_items_in_batch: TRL's global loss-token count of the generation batch (dapo,
                cispo, vespo); None = the selected tokens of this call (one process, whole
                generation batch).
            num_processes: P (``accelerator.num_processes``).
            gradient_accumulation_steps: TRL's ``current_gradient_accumulation_steps``; 1 in
                eval.
            steps_per_generation: ``args.steps_per_generation``; None = GA (TRL's default); 1 in
                eval.
            entropy: ``(B, T)`` per-token entropies (with grad for the bonus), required when
                ``top_entropy_quantile < 1`` or ``entropy_coef != 0``.
            sampling_log_probs: ``(B, T)`` the sampler's log-probabilities for the off-policy
                mask (TRL's ``sampling_per_token_logps``); None = ``old_log_probs`` (as TRL).
            entropy_coef: this call's bonus coefficient (TRL's ``use_adaptive_entropy``
                controller sets it per optimizer step); None = the preset's. Given, even 0,
                the bonus is on: ``policy_loss`` is logged and ``entropy`` is required.

        Returns:
            :class:`TRLLossOutput` ``(loss, metrics)``.

        Raises:
            ValueError: a tensor the options need is missing (``ref_log_probs``, ``entropy``);
                per-token advantages at sequence level for grpo-style and sapo losses (TRL
                spreads a sequence's loss over its tokens, the library's GSPO-token form
                weights each token by its own advantage: the gradients differ); a non-finite
                ``entropy_coef`` or counts (``num_processes``, ``gradient_accumulation_steps``,
                ``steps_per_generation``) that are not positive whole numbers, named.
        """
        coef = self.entropy_coef
        if entropy_coef is not None:  # this call's coefficient, checked as at construction
            coef = preset_number(entropy_coef, "entropy_coef", minimum=None)
        bonus_on = self.entropy_coef != 0.0 or entropy_coef is not None
        num_processes = preset_count(num_processes, "num_processes")
        gradient_accumulation_steps = preset_count(
            gradient_accumulation_steps, "gradient_accumulation_steps"
        )
        if steps_per_generation is not None:
            steps_per_generation = preset_count(steps_per_generation, "steps_per_generation")
        self._check_call(advantages, ref_log_probs, entropy, bonus_on)
        wide = float64_if_any(log_probs, old_log_probs, advantages, ref_log_probs,
                              importance_sampling_ratio, entropy, sampling_log_probs)  # fmt: skip
        log_probs, old_log_probs, advantages = (
            promote(t, wide) for t in (log_probs, old_log_probs, advantages)
        )
        ref_log_probs, importance_sampling_ratio, entropy, sampling_log_probs = (
            promote(t, wide)
            for t in (ref_log_probs, importance_sampling_ratio, entropy, sampling_log_probs)
        )
        selected = as_bool_mask(mask, log_probs)
        spg = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
        batch = Batch(log_probs.shape[0], num_items_in_batch, num_processes,
                       gradient_accumulation_steps, spg, self.max_completion_length)  # fmt: skip
        row = TRL_LOSS_TYPES[self.loss_type]
        args = row.reduction(batch)
        filters = self._filters(log_probs, old_log_probs, advantages, selected, entropy,
                                sampling_log_probs)  # fmt: skip
        weights, token_filter = self._weights(row, importance_sampling_ratio, filters, selected)
        policy = weighted_policy_loss(
            log_probs, old_log_probs, advantages, mask, options=row.options(self), args=args,
            weights=weights, token_filter=token_filter,
        )  # fmt: skip
        metrics = row.metrics(self._metric_inputs(log_probs, old_log_probs, advantages, selected,
                                                  importance_sampling_ratio))  # fmt: skip
        loss = policy.loss
        if self.beta != 0.0:
            assert ref_log_probs is not None  # checked in _check_call
            kl, metrics["kl"] = self._kl_term(log_probs, old_log_probs, ref_log_probs, selected)
            loss = loss + self.beta * reduce_terms(kl, selected, args)
        if bonus_on:
            assert entropy is not None  # checked in _check_call
            scale = 1 if row.per_call else gradient_accumulation_steps
            metrics["policy_loss"] = (loss.detach() * scale).float()
            effective = selected if filters.entropy is None else filters.entropy
            bonus = aggregate(entropy, effective, reduction="token_mean")
            loss = loss - coef * bonus / gradient_accumulation_steps
        return TRLLossOutput(loss, metrics)

    def _check_call(
        self,
        advantages: torch.Tensor,
        ref_log_probs: torch.Tensor | None,
        entropy: torch.Tensor | None,
        bonus_on: bool,
    ) -> None:
        if self.beta != 0.0 and ref_log_probs is None:
            raise ValueError(f"beta={self.beta} needs ref_log_probs (TRL's ref_per_token_logps)")
        if (self.top_entropy_quantile < 1.0 or bonus_on) and entropy is None:
            raise ValueError(
                f"top_entropy_quantile={self.top_entropy_quantile} and the entropy bonus "
                f"(entropy_coef={self.entropy_coef}) need entropy, the (B, T) per-token entropies"
            )
        sequence_value = TRL_LOSS_TYPES[self.loss_type].per_sequence_value
        if self.importance_sampling_level != "sequence" or not sequence_value:
            return
        if advantages.ndim == 2 and advantages.shape[-1] != 1:
            raise ValueError(
                "importance_sampling_level='sequence' with per-token advantages of shape "
                f"{tuple(advantages.shape)}: TRL spreads each sequence's loss over its tokens, "
                "the library's GSPO-token form weights each token by its own advantage, so the "
                "gradients differ; pass one advantage per sequence, (B,) or (B, 1)"
            )

    def _filters(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        selected: torch.Tensor,
        entropy: torch.Tensor | None,
        sampling_log_probs: torch.Tensor | None,
    ) -> _Filters:
        """TRL's off-policy sequence mask and high-entropy mask (None when off)."""
        off_policy = None
        if self.off_policy_mask_threshold is not None:
            sampler = old_log_probs if sampling_log_probs is None else sampling_log_probs
            off_policy = off_policy_sequence_mask(
                log_probs, sampler, advantages, selected, threshold=self.off_policy_mask_threshold
            )
        high_entropy = None
        if self.top_entropy_quantile < 1.0:
            assert entropy is not None  # checked in _check_call
            quantile = 1.0 - self.top_entropy_quantile  # TRL's threshold = 1 - rho
            # TRL takes the quantile of entropies[mask].float() whatever the other inputs'
            # dtypes: in float32 here too, not in the (float64) computation dtype
            high_entropy = global_top_entropy_mask(entropy.float(), selected, quantile=quantile)
        return _Filters(off_policy, high_entropy)

    def _weights(
        self,
        row: LossType,
        ratio: torch.Tensor | None,
        filters: _Filters,
        selected: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        r"""``(importance_weights, token_filter)`` of the policy term.

        The 0/1 masks travel as weights (times the vLLM ratio), except for a surrogate that
        folds the weights into its formula (VESPO): there they filter the per-token loss. At
        sequence level, per-token weights of a per-sequence loss become their mean over the
        sequence's selected tokens: TRL's :math:`\sum_t c_t L_i` with the sequence ratio's
        full gradient equals the GSPO-token form weighted by :math:`\bar c_i`, value and
        gradient.
        """
        keep = None
        for part in filters:
            if part is not None:
                keep = part if keep is None else keep & part
        weights = None if ratio is None else ratio.detach()
        if keep is not None and not row.folds_weights:
            keep_weights = keep.to(torch.float32)
            weights = keep_weights if weights is None else weights * keep_weights
            keep = None
        per_token = weights is not None and weights.ndim == 2 and weights.shape[-1] != 1
        if per_token and self.importance_sampling_level == "sequence" and row.per_sequence_value:
            assert weights is not None
            weights = mean_selected(weights, selected, dim=-1).unsqueeze(-1)  # (B, 1)
        return weights, keep

    def _metric_inputs(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        selected: torch.Tensor,
        ratio: torch.Tensor | None,
    ) -> MetricInputs:
        return MetricInputs(
            log_probs, old_log_probs, advantages, selected, self.importance_sampling_level,
            self.epsilon, self.epsilon_high, self.delta, self.vespo, ratio,
        )  # fmt: skip

    def _kl_term(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        ref_log_probs: torch.Tensor,
        selected: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's per-token k3 (no clamp), times the ratio (with grad) for bias correction.

        Returns ``(kl, metric)``: the ``(B, T)`` weighted terms and their token mean (TRL logs
        the weighted value).
        """
        ratio = None
        if self.use_bias_correction_kl:  # coef_1 before the delta cap, with its gradient
            level = self.importance_sampling_level
            ratio = importance_ratio(log_probs, old_log_probs, selected, level)
        kl = kl_loss(
            log_probs, ref_log_probs, selected, estimator="k3", log_ratio_bound=None,
            reduction="none", importance_weights=ratio,
        )  # fmt: skip
        return kl, masked_mean(kl.detach().float(), selected)


@checks_environment
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
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = True,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    off_policy_mask_threshold: float | None = None,
) -> TRLGRPOLoss:
    r"""TRL's GRPO loss (``GRPOTrainer._compute_loss``, TRL 1.16) for these ``GRPOConfig`` options.

    Returns a callable ``loss_fn(log_probs, old_log_probs, advantages, mask, *, ref_log_probs=None,
    importance_sampling_ratio=None, num_items_in_batch=None, num_processes=1,
    gradient_accumulation_steps=1, steps_per_generation=None, entropy=None,
    sampling_log_probs=None) -> (loss, metrics)`` whose loss equals TRL's, value and gradient,
    for the same tensors (see the module docstring for each ``loss_type``). The arguments are
    the ``GRPOConfig`` fields of the same names with TRL's defaults; ``epsilon_high=None`` means
    ``epsilon`` (for ``cispo`` that is a cap of 0.2 on the ratio, TRL's trap: TRL recommends
    ``epsilon_high=5.0`` there).

    TRL's earlier releases (the git snapshot f2cd577, 1.10.0.dev0) differ in the normalisers:
    ``docs/objectives/drop-in.md`` ("The releases reproduced, and what changed").

    Args:
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``, ``"luspo"``,
            ``"cispo"``, ``"sapo"`` or ``"vespo"``.
        epsilon: the lower clip :math:`\epsilon`, in ``[0, 1)``.
        epsilon_high: the upper clip (None = ``epsilon``); ``cispo``: the cap on the ratio.
        beta: KL coefficient (k3 against ``ref_log_probs``, no clamp).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO); ``vespo`` forms its
            own sequence weight either way.
        delta: TRL's two-sided clip (clipped loss types), any ``delta > 1``.
        max_completion_length: required for ``"dr_grpo"`` (TRL's constant normaliser).
        sapo_temperature_pos: SAPO temperature for :math:`A > 0`.
        sapo_temperature_neg: SAPO temperature for :math:`A \le 0`.
        vespo_k_pos: VESPO gamma shape :math:`k` for :math:`A \ge 0`.
        vespo_lambda_pos: VESPO rate :math:`\lambda` for :math:`A \ge 0`.
        vespo_k_neg: :math:`k` for :math:`A < 0`.
        vespo_lambda_neg: :math:`\lambda` for :math:`A < 0`.
        use_bias_correction_kl: multiply the k3 term by the ratio, with its gradient (TRL's
            default since 1.10).
        top_entropy_quantile: :math:`\rho \in [0, 1]`: only the tokens at or above the
            :math:`1-\rho` quantile of the selected entropies (over every rank of an initialised
            process group, as TRL; in float32, as TRL's ``entropies[mask].float()``, whatever
            the other inputs' dtypes) keep their policy loss; 1 = off.
        entropy_coef: the entropy bonus coefficient (TRL's static ``entropy_coef``).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask, or None.

    Returns:
        A :class:`TRLGRPOLoss` (callable, immutable).

    Raises:
        ValueError: naming the option (its ``GRPOConfig`` name), when the preset is built:
            unknown ``loss_type`` or ``importance_sampling_level``; ``dr_grpo`` without
            ``max_completion_length``, or one that is not a positive whole number; ``epsilon``
            outside ``[0, 1)``, a negative ``epsilon_high`` (``cispo``: not positive), a negative
            ``beta``, ``delta <= 1``, non-positive temperatures or rates, negative gamma
            shapes; ``top_entropy_quantile`` outside ``[0, 1]``; a non-finite threshold or
            coefficient (NaN, inf).
        TypeError: naming the option: a non-number (a bool, a string, a tensor), a non-bool
            ``use_bias_correction_kl``.

    Examples:
        >>> import torch
        >>> loss_fn = trl_grpo_loss(loss_type="grpo")
        >>> log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> loss_fn(log_probs, log_probs.detach(), torch.tensor([1.0]), torch.ones(1, 2)).loss
        tensor(-1., grad_fn=<...>)
    """
    validate_choice(loss_type, "loss_type", tuple(TRL_LOSS_TYPES))
    validate_choice(importance_sampling_level, "importance_sampling_level", _LEVELS)
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError(
            "loss_type='dr_grpo' divides by max_completion_length (GRPOConfig's, default 256); "
            "got max_completion_length=None"
        )
    _check_entropy_options(top_entropy_quantile, entropy_coef, off_policy_mask_threshold)
    # Every coefficient and threshold under its GRPOConfig name, as the library checks its own
    # hyperparameters (finite, in range, a number): at construction, never a NaN loss later.
    low = preset_number(epsilon, "epsilon", maximum=1.0)
    # cispo: epsilon_high is the cap on the ratio itself, which must be positive.
    positive_high = loss_type == "cispo"
    high = low if epsilon_high is None else epsilon_high
    high = preset_number(high, "epsilon_high", strict=positive_high)
    length = None
    if max_completion_length is not None:
        length = preset_count(max_completion_length, "max_completion_length")
    vespo = (
        preset_number(vespo_k_pos, "vespo_k_pos"),
        preset_number(vespo_lambda_pos, "vespo_lambda_pos", strict=True),
        preset_number(vespo_k_neg, "vespo_k_neg"),
        preset_number(vespo_lambda_neg, "vespo_lambda_neg", strict=True),
    )
    loss = TRLGRPOLoss(
        loss_type, low, high, preset_number(beta, "beta"), importance_sampling_level,
        None if delta is None else preset_number(delta, "delta", minimum=1.0, strict=True),
        length, preset_flag(use_bias_correction_kl, "use_bias_correction_kl"),
        preset_number(sapo_temperature_pos, "sapo_temperature_pos", strict=True),
        preset_number(sapo_temperature_neg, "sapo_temperature_neg", strict=True), vespo,
        float(top_entropy_quantile), float(entropy_coef),
        None if off_policy_mask_threshold is None else float(off_policy_mask_threshold),
    )  # fmt: skip
    # The row builds the surrogate object (its fields were checked above, under TRL's names).
    check_options(TRL_LOSS_TYPES[loss_type].options(loss))
    return loss


def _check_entropy_options(quantile: float, coef: float, threshold: float | None) -> None:
    validate_scalar(quantile, "top_entropy_quantile", minimum=0.0, allow_tensor=False)
    if not quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be <= 1 (a fraction), got {quantile}")
    validate_scalar(coef, "entropy_coef", minimum=None, allow_tensor=False)
    if threshold is not None:
        validate_scalar(threshold, "off_policy_mask_threshold", minimum=None, allow_tensor=False)
