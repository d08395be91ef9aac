r"""TRL's ``GRPOTrainer`` with its loss computed by rlobjectives (``rlobjectives[trl]`` extra).

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
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from trl import GRPOTrainer as _TRLGRPOTrainer  # type: ignore[attr-defined]
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rlobjectives.integrations.trl needs TRL: pip install 'rlobjectives[trl]'"
    ) from error

from ..distributed import global_top_entropy_mask
from ..presets import TRLGRPOLoss, trl_grpo_loss

__all__ = ["GRPOTrainer", "loss_from_config"]

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
