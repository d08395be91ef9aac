r"""TRL's ``GRPOTrainer`` and ``DPOTrainer`` with their losses computed by rlobjectives.

The ``rlobjectives[trl]`` extra.

Swap the import and keep everything else::

    # instead of: from trl import GRPOTrainer
    from rlobjectives.integrations.trl import GRPOTrainer

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

By default the loss is :func:`rlobjectives.presets.trl_grpo_loss` built from the trainer's
``GRPOConfig`` (:func:`loss_from_config`): the same value and gradient as TRL's own
``_compute_loss`` (tested against the real trainer for every ``loss_type``, and for the
entropy mask, entropy bonus and off-policy mask). Pass ``loss_fn=`` to train with any other
objective of the library; it is called once per micro-batch as

``loss_fn(log_probs, old_log_probs, advantages, mask, *, ref_log_probs, importance_sampling_ratio,
num_items_in_batch, num_processes, gradient_accumulation_steps, steps_per_generation, entropy,
sampling_log_probs)``

(``entropy``: TRL's per-token entropies, with their gradient; ``sampling_log_probs``: TRL's
``sampling_per_token_logps`` or None; accept ``**kwargs`` to ignore what you do not use) and
returns ``(loss, metrics)``: the loss already scaled for gradient accumulation (TRL does not
rescale it: ``loss_is_scaled_for_ga``) and a mapping of metric names to 0-d tensors, logged
under those names.

With ``use_adaptive_entropy`` the trainer runs TRL's controller on TRL's own state attributes
(``entropy_coef``, checkpointed by TRL) and passes each call's coefficient as
``entropy_coef=`` (a custom ``loss_fn`` receives it too).

Tested with TRL 1.16 (the minimum, 1.10, is the first release with the loss semantics the
preset follows).

``DPOTrainer`` likewise: swap ``from trl import DPOTrainer`` for
``from rlobjectives.integrations.trl import DPOTrainer``; the ``DPOConfig`` stays. Its loss is
:func:`rlobjectives.presets.trl_dpo_loss` of the config (:func:`dpo_loss_from_config`), the same
value, gradient and metrics as TRL's ``_compute_loss`` for every ``loss_type`` list and option
(TRL 1.16); ``loss_fn=`` trains another preference objective, called per micro-batch as
``loss_fn(chosen_log_probs, rejected_log_probs, chosen_mask, rejected_mask, *,
ref_chosen_log_probs, ref_rejected_log_probs, chosen_log_sum_sq_probs,
rejected_log_sum_sq_probs)`` (TRL's per-token log-probabilities of the two halves of its
``[chosen; rejected]`` batch with their completion masks; the reference's per-token
log-probabilities, or TRL's precomputed per-sequence sums; TRL's ``log_sum_sq_probs`` halves
with ``use_weighting``, else None) and returning ``(loss, metrics)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from trl import DPOTrainer as _TRLDPOTrainer  # type: ignore[attr-defined]
    from trl import GRPOTrainer as _TRLGRPOTrainer  # type: ignore[attr-defined]
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rlobjectives.integrations.trl needs TRL: pip install 'rlobjectives[trl]'"
    ) from error

from ..distributed import global_top_entropy_mask
from ..presets import TRLDPOLoss, TRLGRPOLoss, trl_dpo_loss, trl_grpo_loss

__all__ = ["DPOTrainer", "GRPOTrainer", "dpo_loss_from_config", "loss_from_config"]

#: The keyword arguments of ``_get_per_token_logps_and_entropies`` that come from ``inputs``.
_MODEL_INPUTS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def loss_from_config(args: Any) -> TRLGRPOLoss:
    """The preset equal to TRL's loss for a ``GRPOConfig`` (any object with its field names).

    Args:
        args: a ``trl.GRPOConfig``.

    Returns:
        :func:`rlobjectives.presets.trl_grpo_loss` of the config's loss options.

    Raises:
        ValueError: an option value the preset rejects (its message names it).
    """
    return trl_grpo_loss(
        loss_type=args.loss_type,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        beta=args.beta,
        importance_sampling_level=args.importance_sampling_level,
        delta=getattr(args, "delta", None),
        max_completion_length=args.max_completion_length,
        sapo_temperature_pos=getattr(args, "sapo_temperature_pos", 1.0),
        sapo_temperature_neg=getattr(args, "sapo_temperature_neg", 1.05),
        vespo_k_pos=getattr(args, "vespo_k_pos", 2.0),
        vespo_lambda_pos=getattr(args, "vespo_lambda_pos", 3.0),
        vespo_k_neg=getattr(args, "vespo_k_neg", 3.0),
        vespo_lambda_neg=getattr(args, "vespo_lambda_neg", 2.0),
        use_bias_correction_kl=getattr(args, "use_bias_correction_kl", False),
        top_entropy_quantile=getattr(args, "top_entropy_quantile", 1.0),
        entropy_coef=getattr(args, "entropy_coef", 0.0),
        off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
    )


class GRPOTrainer(_TRLGRPOTrainer):  # type: ignore[misc]
    """``trl.GRPOTrainer`` whose ``_compute_loss`` calls an rlobjectives loss function.

    Everything but the loss is TRL's: generation, rewards, advantages, buffering, logging. The
    per-token log-probabilities come from TRL's own ``_get_per_token_logps_and_entropies``.

    Args:
        *args: ``trl.GRPOTrainer``'s positional arguments.
        loss_fn: the loss (see the module docstring); None = :func:`loss_from_config` of
            ``args``, TRL's own loss.
        **kwargs: ``trl.GRPOTrainer``'s keyword arguments.

    Raises:
        ValueError: with ``loss_fn=None``, a ``GRPOConfig`` loss option out of range.
    """

    def __init__(self, *args: Any, loss_fn: Callable[..., Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss_from_config(self.args) if loss_fn is None else loss_fn

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The loss of one micro-batch (always through :meth:`_compute_loss`)."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return self._compute_loss(model, inputs)

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        log_probs, entropies, aux_loss = self._log_probs(model, inputs)
        training = model.training
        accumulation = self.current_gradient_accumulation_steps if training else 1
        generation_steps = self.args.steps_per_generation if training else 1  # type: ignore[attr-defined]
        old_log_probs = inputs.get("old_per_token_logps")
        correction = self.use_vllm and self.vllm_importance_sampling_correction
        ratio = inputs.get("importance_sampling_ratio") if correction else None
        adaptive = getattr(self, "use_adaptive_entropy", False)
        extra = {"entropy_coef": self._adaptive_coefficient()} if adaptive else {}
        loss, metrics = self.loss_fn(
            log_probs,
            log_probs.detach() if old_log_probs is None else old_log_probs,
            inputs["advantages"],
            mask,
            ref_log_probs=inputs.get("ref_per_token_logps"),
            importance_sampling_ratio=ratio,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=accumulation,
            steps_per_generation=generation_steps,
            entropy=entropies,
            sampling_log_probs=inputs.get("sampling_per_token_logps"),
            **extra,
        )
        mode = "train" if training else "eval"
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            aux = self.accelerator.gather_for_metrics(aux_loss).mean().item()
            self._metrics[mode]["aux_loss"].append(aux)
        self._log_metrics(mode, entropies, mask, metrics)
        if adaptive and mode == "train":
            self._update_entropy_coefficient(entropies, mask)
        bonus = getattr(self, "_entropy_bonus_enabled", False)
        if bonus and mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)  # as TRL
        return loss

    def _adaptive_coefficient(self) -> float:
        """TRL's adaptive bonus coefficient of this step (0 until the first window is measured).

        ``entropy_coef`` while the last window's global entropy is at or below
        ``entropy_target``, else 0.
        """
        config: Any = self.args  # a GRPOConfig (typed as TrainingArguments)
        last = float(self._last_world_entropy)
        return float(self.entropy_coef) if last <= config.entropy_target else 0.0

    @torch.no_grad()
    def _update_entropy_coefficient(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's adaptive entropy controller, on the state attributes TRL checkpoints.

        Sums the entropy and the count of the tokens the bonus acts on (the selected tokens, or
        the high-entropy ones with ``top_entropy_quantile < 1``) over the accumulation window;
        at the optimizer step, their global mean moves ``entropy_coef`` up by
        ``entropy_coef_delta`` when at or below ``entropy_target`` and down otherwise, within
        ``[entropy_coef_min, entropy_coef_max]``.
        """
        effective = mask != 0
        if self.top_entropy_quantile < 1.0:
            quantile = 1.0 - self.top_entropy_quantile
            effective = global_top_entropy_mask(entropies, effective, quantile=quantile)
        values = torch.where(effective, entropies.detach(), torch.zeros_like(entropies))
        stats = torch.stack([values.sum(), effective.sum().to(values.dtype)])
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats  # type: ignore[assignment]
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world = (totals[0] / totals[1].clamp(min=1.0)).item()
        config: Any = self.args  # a GRPOConfig (typed as TrainingArguments)
        coef = float(self.entropy_coef)
        if world <= config.entropy_target:
            self.entropy_coef = min(coef + config.entropy_coef_delta, config.entropy_coef_max)
        else:
            self.entropy_coef = max(coef - config.entropy_coef_delta, config.entropy_coef_min)
        self._last_world_entropy = world
        self._entropy_window_stats = None

    def _log_probs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
        """TRL's per-token log-probabilities, entropies and aux loss of the completions."""
        completion_ids = inputs["completion_ids"]
        parameters = inspect.signature(self._get_per_token_logps_and_entropies).parameters
        extra = {name: inputs.get(name) for name in _MODEL_INPUTS if name in parameters}
        return self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **extra,
        )

    @torch.no_grad()
    def _log_metrics(
        self,
        mode: str,
        entropies: torch.Tensor,
        mask: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
    ) -> None:
        """TRL's ``entropy`` (global token mean) and the loss function's metrics.

        A metric ending in ``_min`` / ``_max`` is the extreme over processes (NaN ignored);
        the others are averaged over processes (on one process: the loss function's values).
        """
        selected = mask.float()
        totals = torch.stack([(entropies.float() * selected).sum(), selected.sum()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        for name, value in metrics.items():
            gathered = self.accelerator.gather(torch.as_tensor(value).float().reshape(1))
            finite = gathered[~torch.isnan(gathered)]
            if finite.numel() == 0:
                self._metrics[mode][name].append(float("nan"))
            elif name.endswith("_min"):
                self._metrics[mode][name].append(finite.min().item())
            elif name.endswith("_max"):
                self._metrics[mode][name].append(finite.max().item())
            else:
                self._metrics[mode][name].append(finite.mean().item())


def dpo_loss_from_config(args: Any) -> TRLDPOLoss:
    """The preset equal to TRL's DPO loss for a ``DPOConfig`` (any object with its field names).

    Args:
        args: a ``trl.DPOConfig``.

    Returns:
        :func:`rlobjectives.presets.trl_dpo_loss` of the config's loss options.

    Raises:
        ValueError: an option combination TRL refuses, or one out of range (named).
    """
    return trl_dpo_loss(
        loss_type=args.loss_type,
        loss_weights=args.loss_weights,
        beta=args.beta,
        label_smoothing=args.label_smoothing,
        f_divergence_type=args.f_divergence_type,
        f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        ld_alpha=args.ld_alpha,
        use_weighting=args.use_weighting,
        discopop_tau=args.discopop_tau,
    )


#: The batch keys of TRL's preference collator that are not model inputs.
_DPO_NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


class DPOTrainer(_TRLDPOTrainer):  # type: ignore[misc]
    """``trl.DPOTrainer`` whose ``_compute_loss`` calls an rlobjectives preference loss.

    Everything but the loss is TRL's: the dataset, the collator, the fused LM head that returns
    the per-token log-probabilities (and entropies, mean logits, top-1 flags, ``log_sum_sq_probs``
    with ``use_weighting``), the reference model (or PEFT's disabled adapter, or the precomputed
    reference log-probabilities), logging. The loss and its ``rewards/*`` / ``logps/*`` metrics
    come from ``loss_fn``; the other metrics TRL logs (``entropy``, ``num_tokens``,
    ``logits/chosen``, ``logits/rejected``, ``mean_token_accuracy``, ``aux_loss``) are computed
    here as TRL defines them.

    Args:
        *args: ``trl.DPOTrainer``'s positional arguments.
        loss_fn: the loss (see the module docstring); None = :func:`dpo_loss_from_config` of
            ``args``, TRL's own loss.
        **kwargs: ``trl.DPOTrainer``'s keyword arguments.

    Raises:
        ValueError: with ``loss_fn=None``, an option combination TRL refuses (TRL's reason).
    """

    def __init__(self, *args: Any, loss_fn: Callable[..., Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_fn = dpo_loss_from_config(self.args) if loss_fn is None else loss_fn

    def _compute_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False
    ) -> Any:
        mode = "train" if self.model.training else "eval"  # type: ignore[union-attr]
        model_kwargs = {k: v for k, v in inputs.items() if k not in _DPO_NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        mask = completion_mask[..., 1:] != 0  # the mask of the next-token log-probabilities
        width, pairs = mask.shape[1], mask.shape[0] // 2
        log_probs = outputs.log_probs[:, -width:]  # prompt-learning PEFT prepends tokens
        references = self._reference_log_probs(inputs)
        extra: dict[str, Any] = {}
        if getattr(outputs, "log_sum_sq_probs", None) is not None:
            squares = outputs.log_sum_sq_probs[:, -width:]
            extra = {
                "chosen_log_sum_sq_probs": squares[:pairs],
                "rejected_log_sum_sq_probs": squares[pairs:],
            }
        loss, metrics = self.loss_fn(
            log_probs[:pairs], log_probs[pairs:], mask[:pairs], mask[pairs:],
            ref_chosen_log_probs=references[0], ref_rejected_log_probs=references[1], **extra,
        )  # fmt: skip
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
            aux = self.accelerator.gather_for_metrics(outputs.aux_loss).mean().item()
            self._metrics[mode]["aux_loss"].append(aux)
        self._log_dpo_metrics(mode, inputs, outputs, mask, metrics)
        if return_outputs:  # TRL recomputes the logits for compute_metrics (deprecated there)
            with torch.no_grad():
                return loss, model(**model_kwargs)
        return loss

    def _reference_log_probs(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed log-probabilities of the two halves (TRL's own computation).

        The precomputed ones, or TRL's ``compute_ref_log_probs`` (the reference model, or the
        policy with its adapter disabled under PEFT; LD-weighted with ``ld_alpha``).
        """
        if self.precompute_ref_logps:
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        reference = self.ref_model if self.ref_model is not None else self.model
        chosen, rejected = self.compute_ref_log_probs(reference, inputs)  # type: ignore[no-untyped-call]
        return chosen, rejected

    @torch.no_grad()
    def _log_dpo_metrics(
        self,
        mode: str,
        inputs: dict[str, Any],
        outputs: Any,
        mask: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
    ) -> None:
        """TRL's token-level metrics of the micro-batch and the loss function's metrics."""
        gather = self.accelerator.gather_for_metrics
        width, pairs = mask.shape[1], mask.shape[0] // 2
        selected = mask.float()

        def ratio(values: torch.Tensor, tokens: torch.Tensor) -> float:
            totals = gather(torch.stack([values.sum().float(), tokens.sum().float()]).reshape(1, 2))
            total, count = totals.reshape(-1, 2).sum(0).tolist()
            return total / count if count > 0 else 0.0

        zero = torch.zeros((), device=mask.device)
        entropy = torch.where(mask, outputs.entropy[:, -width:].float(), zero)
        self._metrics[mode]["entropy"].append(ratio(entropy, selected))
        if mode == "train":
            tokens = gather(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        mean_logits = torch.where(mask, outputs.mean_logits[:, -width:].float(), zero)
        for half, rows in (("chosen", slice(0, pairs)), ("rejected", slice(pairs, None))):
            self._metrics[mode][f"logits/{half}"].append(ratio(mean_logits[rows], selected[rows]))
        top1 = outputs.is_top1[:, -width:][:pairs] & mask[:pairs]
        self._metrics[mode]["mean_token_accuracy"].append(ratio(top1.float(), selected[:pairs]))
        for name, value in metrics.items():
            gathered = self.accelerator.gather(torch.as_tensor(value).float().reshape(1))
            self._metrics[mode][name].append(gathered.mean().item())
