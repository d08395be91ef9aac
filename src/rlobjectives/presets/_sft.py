r"""TRL's SFT losses (``SFTConfig.loss_type``) as library calls (TRL 1.16, PyPI).

:func:`trl_sft_loss` maps ``SFTTrainer.compute_loss`` (the fused LM-head path, no
``compute_loss_func``, no label smoothing) onto :func:`rlobjectives.nll_loss` and
:func:`rlobjectives.dft_loss`: with :math:`M` the label mask (``labels != -100`` after the shift),
:math:`N` ``num_items_in_batch`` and :math:`P` the processes,

- ``"nll"``: :math:`\sum M (-\ell) / \max(N, 1) \cdot P` = ``nll_loss(normalizer=max(N, 1) / P)``;
- ``"dft"``: :math:`\sum M (-\mathrm{sg}(p)\,\ell) / \max(N, 1) \cdot P` = ``dft_loss(...)``;

without ``num_items_in_batch`` (evaluation, or a trainer that does not pass it) TRL divides by
the micro-batch's label tokens and does not multiply by :math:`P`: the default ``token_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.validation import ArrayLike, checks_environment, validate_choice
from ..supervised.losses import dft_loss, nll_loss
from ._common import preset_count, preset_flag, preset_number

__all__ = ["TRL_SFT_LOSS_TYPES", "TRLSFTLoss", "trl_sft_loss"]

#: ``SFTConfig.loss_type`` values of TRL 1.16.
TRL_SFT_LOSS_TYPES: tuple[str, ...] = ("nll", "dft")


@dataclass(frozen=True)
class TRLSFTLoss:
    """TRL's SFT loss for fixed options: ``loss(log_probs, mask, *, cu_seqlens=None)``."""

    loss_type: str
    normalizer: float | None

    def __call__(
        self, log_probs: ArrayLike, mask: ArrayLike, *, cu_seqlens: ArrayLike | None = None
    ) -> torch.Tensor:
        """The loss of one micro-batch (``log_probs`` of the label tokens, ``(B, T)``)."""
        function = dft_loss if self.loss_type == "dft" else nll_loss
        return function(log_probs, mask, normalizer=self.normalizer, cu_seqlens=cu_seqlens)


@checks_environment
def trl_sft_loss(
    *,
    loss_type: str = "nll",
    num_items_in_batch: float | None = None,
    num_processes: int = 1,
    average_tokens_across_devices: bool = True,
) -> TRLSFTLoss:
    r"""TRL 1.16's ``SFTTrainer.compute_loss`` for ``SFTConfig.loss_type`` ``"nll"`` / ``"dft"``.

    The returned callable takes the label tokens' log-probabilities ``(B, T)`` (packed:
    ``(N,)`` with ``cu_seqlens``, TRL's ``padding_free``) and their mask and returns TRL's loss
    of the micro-batch, value and gradient: ``token_mean`` with ``normalizer =
    max(num_items_in_batch, 1) / num_processes`` (TRL multiplies its loss by the processes
    when ``average_tokens_across_devices``, so that DDP's average gives the global token
    mean), or the local token mean without ``num_items_in_batch``.

    Args:
        loss_type: ``"nll"`` (cross-entropy) or ``"dft"`` (:func:`rlobjectives.dft_loss`).
        num_items_in_batch: the label tokens of the optimizer step over every rank and
            micro-batch (``Trainer``'s ``num_items_in_batch``), or None.
        num_processes: ``accelerator.num_processes // tp_size``, a positive int.
        average_tokens_across_devices: TRL's ``TrainingArguments`` option (default True).

    Returns:
        :class:`TRLSFTLoss`, a callable ``(log_probs, mask, *, cu_seqlens=None) -> loss``.

    Raises:
        ValueError: an unknown ``loss_type``, a negative ``num_items_in_batch`` or a
            non-positive ``num_processes``.
        TypeError: non-numeric or non-bool options.
    """
    kind = validate_choice(loss_type, "loss_type", TRL_SFT_LOSS_TYPES)
    processes = preset_count(num_processes, "num_processes")
    average = preset_flag(average_tokens_across_devices, "average_tokens_across_devices")
    if num_items_in_batch is None:
        return TRLSFTLoss(kind, None)
    items = max(preset_number(num_items_in_batch, "num_items_in_batch"), 1.0)
    return TRLSFTLoss(kind, items / processes if average else items)
