r"""The peers' distillation losses as library calls: verl 0.9.1's and TRL 1.16's options.

- :func:`verl_distillation_loss`: verl's ``distillation_loss`` (``trainer/distillation/
  losses.py``) for every ``distillation_loss.loss_mode`` (``forward_kl_topk``, the estimators
  ``k1``/``kl``, ``k2``/``mse``, ``k3``/``low_var_kl``, ``abs`` and their ``+``
  straight-through forms), with ``log_prob_min_clamp``, ``loss_max_clamp``, the
  ``clamp_min(0)`` of ``forward_kl_topk``, ``use_policy_gradient`` (the distillation loss as the
  advantage of verl's vanilla PPO loss), ``use_task_rewards`` / ``distillation_loss_coef`` and
  verl's metric names;
- :func:`trl_generalized_jsd_loss`: TRL's ``GKDTrainer.generalized_jsd_loss`` (GKD, GOLD);
- :func:`trl_server_forward_kl_loss`: TRL's server / async distillation at ``beta=0``
  (``loss_add_tail``).

Each maps the peer's options onto :func:`rlobjectives.topk_forward_kl`,
:func:`rlobjectives.kl_estimate`, :func:`rlobjectives.generalized_jsd_loss` and
:func:`rlobjectives.aggregate`; nothing here re-implements a divergence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._core.masked import aggregate
from .._core.reduction import masked_fill_zero
from .._core.validation import checks_environment, validate_choice, validate_scalar
from ..distillation.jsd import generalized_jsd_loss
from ..distillation.slots import teacher_slot_log_probs
from ..distillation.topk import topk_forward_kl
from ..kl.loss import kl_estimate
from ._common import as_bool_mask, preset_count, preset_flag, preset_number
from ._verl import VERL_AGGREGATIONS, VerlLossOutput, verl_policy_loss

__all__ = [
    "TRL_JSD_REDUCTIONS",
    "VERL_DISTILLATION_ESTIMATORS",
    "VerlDistillationLoss",
    "trl_generalized_jsd_loss",
    "trl_server_forward_kl_loss",
    "verl_distillation_loss",
]

#: verl's estimator ``loss_mode`` (without the ``+``) -> (library estimator, verl's log-ratio
#: clamp, verl's value clamp). verl's ``kl_penalty`` clamps only k3 (log-ratio ±20, value
#: ±10).
VERL_DISTILLATION_ESTIMATORS: dict[str, tuple[str, float | None, float | None]] = {
    "k1": ("k1", None, None),
    "kl": ("k1", None, None),
    "abs": ("abs", None, None),
    "k2": ("k2", None, None),
    "mse": ("k2", None, None),
    "k3": ("k3", 20.0, 10.0),
    "low_var_kl": ("k3", 20.0, 10.0),
}
_MODES = (
    "forward_kl_topk",
    *VERL_DISTILLATION_ESTIMATORS,
    *(f"{m}+" for m in VERL_DISTILLATION_ESTIMATORS),
)


def _selected_extrema(
    values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``values`` over the selected entries (0, 0 for none), detached."""
    values = values.detach()
    any_selected = mask.any()
    low = torch.where(mask, values, torch.inf).amin() if values.numel() else values.new_zeros(())
    high = torch.where(mask, values, -torch.inf).amax() if values.numel() else values.new_zeros(())
    zero = values.new_zeros(())
    return torch.where(any_selected, low, zero), torch.where(any_selected, high, zero)


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    selected = masked_fill_zero(values.detach(), mask)
    return selected.sum() / mask.sum().clamp(min=1).to(selected.dtype)


@dataclass(frozen=True)
class VerlDistillationLoss:
    """verl's distillation loss for fixed options (built by :func:`verl_distillation_loss`)."""

    loss_mode: str
    topk: int | None
    log_prob_min_clamp: float | None
    loss_max_clamp: float | None
    use_policy_gradient: bool
    use_task_rewards: bool
    distillation_loss_coef: float
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None

    @checks_environment
    def __call__(
        self,
        response_mask: torch.Tensor,
        *,
        teacher_log_probs: torch.Tensor,
        teacher_ids: torch.Tensor | None = None,
        student_logits: torch.Tensor | None = None,
        log_prob: torch.Tensor | None = None,
        old_log_prob: torch.Tensor | None = None,
        loss_agg_mode: str = "token-mean",
        global_batch_info: dict[str, Any] | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> VerlLossOutput:
        """The ``distillation_loss`` of verl for these tensors: the coefficient times the loss.

        Args:
            response_mask: ``(B, T)`` response mask.
            teacher_log_probs: ``forward_kl_topk``: ``(B, T, K)`` the teacher's top-k
                log-probabilities (verl's ``teacher_logprobs``); estimator modes: ``(B, T)``
                (or ``(B, T, 1)``) the teacher's log-probabilities of the sampled tokens.
            teacher_ids: ``(B, T, K)`` their ids (``forward_kl_topk``).
            student_logits: ``(B, T, V)`` the student logits (``forward_kl_topk``; divided by
                ``temperature`` as verl's engine does before the logits processor).
            log_prob: ``(B, T)`` the student's log-probabilities of its sampled tokens (with
                grad): the estimator modes' input, and the policy gradient's current
                log-probabilities with ``use_policy_gradient``.
            old_log_prob: ``(B, T)`` the behaviour log-probabilities (``use_policy_gradient``).
            loss_agg_mode: verl's aggregation (``token-mean``, ``seq-mean-token-mean``, ...).
            global_batch_info: verl's ``dp_size``, ``batch_num_tokens``,
                ``global_batch_size``, ``loss_scale_factor`` (None: this call's counts).
            rollout_is_weights: verl's importance weights of the policy-gradient loss.
            temperature: the student's sampling temperature (``forward_kl_topk``).

        Returns:
            ``(loss, metrics)``: ``loss`` is ``distillation_loss_coef`` (1 without
            ``use_task_rewards``) times the distillation loss (add the task policy loss of
            :func:`rlobjectives.presets.verl_policy_loss` when ``use_task_rewards``, as verl's
            ``distillation_ppo_loss`` does); ``metrics`` under verl's names, 0-d tensors.
        """
        info = dict(global_batch_info or {})
        aggregation = validate_choice(loss_agg_mode, "loss_agg_mode", tuple(VERL_AGGREGATIONS))
        reference = student_logits if student_logits is not None else log_prob
        if reference is None:
            raise ValueError(
                f'loss_mode="{self.loss_mode}" needs '
                + ("student_logits" if self.loss_mode == "forward_kl_topk" else "log_prob")
            )
        mask = as_bool_mask(response_mask, reference)
        if self.loss_mode == "forward_kl_topk":
            losses, metrics = self._topk(
                student_logits, teacher_log_probs, teacher_ids, mask, temperature
            )
        else:
            losses, metrics = self._estimator(log_prob, teacher_log_probs, mask)
        low, high = _selected_extrema(losses, mask)
        metrics["distillation/loss_min"], metrics["distillation/loss_max"] = low, high
        if self.loss_max_clamp is not None:  # k1 can be negative: both sides
            losses = losses.clamp(min=-self.loss_max_clamp, max=self.loss_max_clamp)
        if self.use_policy_gradient:
            loss = self._policy_gradient(
                losses, log_prob, old_log_prob, mask, aggregation, info, rollout_is_weights, metrics
            )
        else:
            args = VERL_AGGREGATIONS[aggregation](mask, info)
            loss = aggregate(
                losses,
                mask,
                reduction=args.reduction,  # type: ignore[arg-type]
                normalizer=args.normalizer,
                max_response_length=args.max_response_length,
            )
        metrics["distillation/loss"] = loss.detach()
        coef = self.distillation_loss_coef if self.use_task_rewards else 1.0
        return VerlLossOutput(loss * coef, metrics)

    def _topk(
        self,
        student_logits: torch.Tensor | None,
        teacher_log_probs: torch.Tensor,
        teacher_ids: torch.Tensor | None,
        mask: torch.Tensor,
        temperature: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The ``compute_forward_kl_topk`` of verl + ``clamp_min(0)``: per-token losses, metrics."""
        if student_logits is None or teacher_ids is None:
            raise ValueError('loss_mode="forward_kl_topk" needs student_logits and teacher_ids')
        tau = preset_number(temperature, "temperature", strict=True)
        teacher = torch.as_tensor(teacher_log_probs, device=student_logits.device)
        valid = (teacher != -torch.inf) & mask.unsqueeze(-1)  # (B, T, K)
        if self.log_prob_min_clamp is None:
            losses = topk_forward_kl(
                student_logits,
                teacher,
                teacher_ids,
                mask,
                tail=False,
                temperature=tau,
                reduction="none",
            )
            student = teacher_slot_log_probs(
                student_logits.detach(), teacher, teacher_ids, mask, temperature=tau
            )
        else:
            student = teacher_slot_log_probs(
                student_logits, teacher, teacher_ids, mask, temperature=tau
            )
            floor = self.log_prob_min_clamp
            clamped_student = student.clamp(min=floor)
            clamped_teacher = teacher.to(student.dtype).clamp(min=floor)
            terms = clamped_teacher.exp() * (clamped_teacher - clamped_student)  # (B, T, K)
            losses = torch.where(valid, terms, 0.0).sum(-1)
        zero = torch.zeros((), dtype=student.dtype, device=student.device)
        student_mass = torch.where(valid, student.detach().exp(), zero).sum(-1)  # (B, T)
        teacher_mass = torch.where(valid, teacher.to(student.dtype).exp(), zero).sum(-1)
        metrics: dict[str, torch.Tensor] = {}
        for name, mass in (("student_mass", student_mass), ("teacher_mass", teacher_mass)):
            low, high = _selected_extrema(mass, mask)
            metrics[f"distillation/{name}"] = _mean(mass, mask)
            metrics[f"distillation/{name}_min"] = low
            metrics[f"distillation/{name}_max"] = high
        return masked_fill_zero(losses.clamp(min=0.0), mask), metrics

    def _estimator(
        self, log_prob: torch.Tensor | None, teacher_log_probs: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The ``kl_penalty(log_prob, teacher, loss_mode)`` of verl per token, and ``abs_loss``."""
        if log_prob is None:
            raise ValueError(f'loss_mode="{self.loss_mode}" needs log_prob')
        teacher = torch.as_tensor(teacher_log_probs, device=log_prob.device)
        if teacher.ndim == 3 and teacher.shape[-1] == 1:
            teacher = teacher.squeeze(-1)  # verl's (B, T, 1) teacher_logprobs
        straight = self.loss_mode.endswith("+")
        estimator, bound, value_clamp = VERL_DISTILLATION_ESTIMATORS[self.loss_mode.rstrip("+")]
        losses = kl_estimate(
            log_prob,
            teacher,
            mask,
            estimator=estimator,  # type: ignore[arg-type]
            log_ratio_bound=bound,
        )
        if value_clamp is not None:
            losses = losses.clamp(min=-value_clamp, max=value_clamp)
        if straight and estimator != "k2":  # verl: value detached + the unclamped k2's gradient
            k2 = kl_estimate(log_prob, teacher, mask, estimator="k2", log_ratio_bound=None)
            losses = losses.detach() + (k2 - k2.detach())
        return losses, {"distillation/abs_loss": _mean(losses.abs(), mask)}

    def _policy_gradient(
        self,
        losses: torch.Tensor,
        log_prob: torch.Tensor | None,
        old_log_prob: torch.Tensor | None,
        mask: torch.Tensor,
        aggregation: str,
        info: dict[str, Any],
        rollout_is_weights: torch.Tensor | None,
        metrics: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The vanilla PPO loss of verl with advantages ``-losses`` (detached), metrics renamed."""
        if log_prob is None or old_log_prob is None:
            raise ValueError("use_policy_gradient=True needs log_prob and old_log_prob")
        config = {
            "clip_ratio": self.clip_ratio,
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
            "global_batch_info": info,
        }
        out = verl_policy_loss("vanilla")(
            old_log_prob, log_prob, -losses.detach(), mask, aggregation, config, rollout_is_weights
        )
        for name, value in out.metrics.items():
            metrics["distillation/" + name.removeprefix("actor/")] = value
        return out.loss


@checks_environment
def verl_distillation_loss(
    loss_mode: str = "k3",
    *,
    topk: int | None = 128,
    log_prob_min_clamp: float | None = -10.0,
    loss_max_clamp: float | None = 10.0,
    use_policy_gradient: bool = True,
    use_task_rewards: bool = True,
    distillation_loss_coef: float = 1.0,
    policy_loss_mode: str = "vanilla",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = 0.2,
    clip_ratio_high: float | None = 0.2,
) -> VerlDistillationLoss:
    r"""The ``distillation_loss`` of verl 0.9.1 (``DistillationLossConfig``) as library calls.

    The keyword defaults are the dataclass's (``trainer/config/distillation/distillation.yaml``
    ships others: ``topk: 32``, ``loss_max_clamp: null``, ``log_prob_min_clamp: null``,
    ``use_policy_gradient: false``). The per-token distillation loss :math:`D`:

    - ``"forward_kl_topk"``: ``topk_forward_kl(student_logits, teacher_log_probs, teacher_ids,
      M, tail=False, temperature=τ, reduction="none")``, then ``clamp_min(0)``; with
      ``log_prob_min_clamp`` :math:`c` the slot log-probabilities clamped at :math:`c` first:
      :math:`\sum_k e^{\max(\ell^T_k, c)}(\max(\ell^T_k, c) - \max(\ell^S_k, c))`.
    - estimator modes: ``kl_estimate(log_prob, teacher_log_probs, M, estimator)`` with verl's
      clamps; ``"<mode>+"``: that value with the gradient of the unclamped :math:`k_2`.

    Metrics, clamps and what is left out: ``docs/objectives/distillation.md`` ("Presets").

    Then ``distillation/loss_min`` / ``loss_max`` (of :math:`D` over the response tokens),
    ``clamp(D, ±loss_max_clamp)``, and either ``agg_loss(D, loss_agg_mode)``
    (``use_policy_gradient=False``, the supervised GKD placement) or verl's vanilla PPO loss
    (:func:`rlobjectives.presets.verl_policy_loss`, ``clip_ratio*`` of this config) with
    advantages :math:`-D` detached (``use_policy_gradient=True``, the on-policy distillation
    recipe: ``k1`` recommended), its ``actor/...`` metrics renamed ``distillation/...``.
    ``distillation/loss`` is that loss; the returned loss is ``distillation_loss_coef`` times
    it when ``use_task_rewards`` (verl adds the task policy loss).

    Args:
        loss_mode: ``"forward_kl_topk"``, ``"k1"``, ``"kl"``, ``"abs"``, ``"k2"``,
            ``"mse"``, ``"k3"``, ``"low_var_kl"``, or one of these estimators with ``+``.
        topk: verl's ``topk`` (the engine's K; informational here, the tensors carry K).
        log_prob_min_clamp: clamp of the slot log-probabilities (``forward_kl_topk``), or None.
        loss_max_clamp: clamp of the per-token loss to :math:`\pm` this, or None.
        use_policy_gradient: the loss as a PPO advantage (True) or differentiated (False).
        use_task_rewards: the task policy loss is added by the caller; the distillation loss is
            scaled by ``distillation_loss_coef``.
        distillation_loss_coef: the coefficient with ``use_task_rewards``.
        policy_loss_mode: ``"vanilla"`` (the only one verl supports).
        clip_ratio: PPO clip of the policy-gradient placement.
        clip_ratio_low: its low edge (None: ``clip_ratio``).
        clip_ratio_high: its high edge (None: ``clip_ratio``).

    Returns:
        A :class:`VerlDistillationLoss`.

    Raises:
        ValueError: an unknown ``loss_mode``; ``loss_mode="k1"`` without policy gradient (as
            verl: its gradient does not depend on the teacher); ``policy_loss_mode`` other than
            ``"vanilla"``; an option out of range. At call time, a tensor the mode needs is
            missing, or an unknown ``loss_agg_mode``.
        TypeError: an option of the wrong type.

    Examples:
        >>> import torch
        >>> loss_fn = verl_distillation_loss("k3", use_policy_gradient=False)
        >>> log_prob = torch.log(torch.tensor([[0.5]])).requires_grad_(True)
        >>> loss, metrics = loss_fn(torch.ones(1, 1), log_prob=log_prob,
        ...                         teacher_log_probs=torch.log(torch.tensor([[0.25]])))
        >>> loss  # k3 at d = ln 2: 0.5 + ln 2 - 1
        tensor(0.1931, grad_fn=<...>)
    """
    validate_choice(loss_mode, "loss_mode", _MODES)
    validate_choice(policy_loss_mode, "policy_loss_mode", ("vanilla",))
    if topk is not None:
        preset_count(topk, "topk")
    floor = None
    if log_prob_min_clamp is not None:
        floor = preset_number(log_prob_min_clamp, "log_prob_min_clamp", minimum=None)
    ceiling = None if loss_max_clamp is None else preset_number(loss_max_clamp, "loss_max_clamp")
    gradient = preset_flag(use_policy_gradient, "use_policy_gradient")
    task = preset_flag(use_task_rewards, "use_task_rewards")
    coef = preset_number(distillation_loss_coef, "distillation_loss_coef", minimum=None)
    ratio = preset_number(clip_ratio, "clip_ratio")
    low = None if clip_ratio_low is None else preset_number(clip_ratio_low, "clip_ratio_low")
    high = None if clip_ratio_high is None else preset_number(clip_ratio_high, "clip_ratio_high")
    if not gradient and loss_mode in ("k1", "kl"):
        raise ValueError(
            'loss_mode="k1" needs use_policy_gradient=True (as verl: the gradient of a k1 loss '
            "does not depend on the teacher's log-probabilities); use k1 as a reward "
            "(use_policy_gradient=True, rlobjectives.reverse_kl_rewards) or k2/k3+ as a loss"
        )
    return VerlDistillationLoss(
        loss_mode, topk, floor, ceiling, gradient, task, coef, ratio, low, high
    )


#: TRL ``generalized_jsd_loss(reduction=)`` values this preset reproduces ("none" returns TRL's
#: element-wise ``(n, V)`` terms, which are not a per-token loss).
TRL_JSD_REDUCTIONS = ("batchmean", "sum", "mean")


@checks_environment
def trl_generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    r"""TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (GKD, GOLD) as a library call.

    ``generalized_jsd_loss(student_logits, teacher_logits, mask, beta=beta,
    temperature=temperature, reduction="token_mean", normalizer=...)`` with ``mask = labels !=
    -100`` (every position without labels) and TRL's normalisers: ``num_items_in_batch``
    (when given, whatever ``reduction``), ``"batchmean"``: the valid tokens (at least 1;
    without labels the batch size B, TRL's ``jsd.size(0)``), ``"sum"``: 1, ``"mean"``: the
    valid tokens times V (TRL averages the element-wise ``(n, V)`` terms). TRL's ``"none"``
    (the element-wise terms) is not reproduced. The arguments are TRL's, positional as there.

    Args:
        student_logits: ``(B, T, V)``.
        teacher_logits: ``(B, T, V)``.
        labels: ``(B, T)`` with -100 at the positions to ignore, or None.
        beta: TRL's :math:`\beta` (0: forward KL, 1: reverse KL).
        temperature: dividing both logits (the GKD trainer calls it with 1).
        reduction: ``"batchmean"``, ``"sum"`` or ``"mean"``.
        num_items_in_batch: TRL's global count of valid tokens, or None.

    Returns:
        The 0-d loss TRL returns.

    Raises:
        ValueError: ``reduction="none"`` or unknown, shapes or options as
            :func:`rlobjectives.generalized_jsd_loss` says.
    """
    validate_choice(reduction, "reduction", TRL_JSD_REDUCTIONS)
    batch_shape = tuple(student_logits.shape[:-1])
    if labels is None:
        mask = torch.ones(batch_shape, dtype=torch.bool, device=student_logits.device)
    else:
        mask = torch.as_tensor(labels, device=student_logits.device) != -100
    vocab = student_logits.shape[-1]
    normalizer: Any
    if num_items_in_batch is not None:  # TRL's count, checked under its name
        normalizer = validate_scalar(num_items_in_batch, "num_items_in_batch", strict=True)
    elif reduction == "batchmean":
        normalizer = mask.sum().clamp(min=1) if labels is not None else max(batch_shape[0], 1)
    elif reduction == "sum":
        normalizer = 1.0
    else:  # "mean"
        normalizer = mask.sum().clamp(min=1) * vocab
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(torch.float64)
    return generalized_jsd_loss(
        student_logits,
        teacher_logits,
        mask,
        beta=beta,
        temperature=temperature,
        normalizer=normalizer,
    )


@checks_environment
def trl_server_forward_kl_loss(
    student_logits: torch.Tensor,
    topk_logprobs: torch.Tensor,
    topk_token_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_add_tail: bool = True,
    temperature: float = 1.0,
    gradient_accumulation_steps: int = 1,
) -> torch.Tensor:
    r"""TRL 1.16's server / async distillation loss at ``beta=0`` (``loss_top_k`` slots).

    ``topk_forward_kl(student_logits, topk_logprobs, topk_token_ids, labels != -100,
    tail=loss_add_tail, renormalize=not loss_add_tail, temperature=temperature)`` with TRL's
    ``batchmean`` (the valid tokens, at least 1), divided by the gradient-accumulation steps
    (TRL divides in ``compute_loss`` while training; pass 1 in eval). ``-inf`` teacher slots
    are padding, as in TRL. TRL floors both tail masses at :math:`10^{-7}` (its
    ``log_sum <= -1e-7`` clamp); the library's tail is exact, so the two differ only where the
    teacher's top-k mass is within :math:`10^{-7}` of 1. The ``beta > 0`` top-1 support paths
    (``reverse_kl_top_1_mode``) are left out.

    Args:
        student_logits: ``(B, T, V)`` student logits at the completion positions.
        topk_logprobs: ``(B, T, K)`` the teacher server's top-k log-probabilities.
        topk_token_ids: ``(B, T, K)`` their ids.
        labels: ``(B, T)``, -100 at the positions to ignore.
        loss_add_tail: TRL's ``loss_add_tail`` (default True).
        temperature: TRL's ``temperature`` (the student log-softmax's).
        gradient_accumulation_steps: TRL's ``current_gradient_accumulation_steps``.

    Returns:
        The 0-d loss TRL returns.
    """
    tail = preset_flag(loss_add_tail, "loss_add_tail")
    steps = preset_count(gradient_accumulation_steps, "gradient_accumulation_steps")
    mask = torch.as_tensor(labels, device=student_logits.device) != -100
    loss = topk_forward_kl(
        student_logits,
        topk_logprobs,
        topk_token_ids,
        mask,
        tail=tail,
        renormalize=not tail,
        temperature=temperature,
    )
    return loss / steps if steps != 1 else loss
