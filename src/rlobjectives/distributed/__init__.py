r"""Global normalisers for exact losses under data parallelism and gradient accumulation.

An optimizer step usually sees its batch in pieces: ``W`` data-parallel ranks, each running
``M`` micro-batches (gradient accumulation). A loss whose denominator is computed per piece
(each micro-batch divides by its own token count, or by ``M``) weights tokens differently
depending on how the batch was cut, so long and short responses get different weights and
gradients shrink or grow with the split. The cure is to count once, before the micro-batch
loop, over every micro-batch of the step and every rank, and to pass that count as the
``normalizer`` of every micro-batch loss: the micro-batch losses are then *additive*, and their
sum over micro-batches and ranks is the full-batch loss.

.. math::

    \mathcal{L}_{\text{full}} = \sum_{r=1}^{W} \sum_{m=1}^{M}
        \frac{\sum_{(i, t) \in \text{piece}_{rm}} M_{it} L_{it}}{N_{\text{global}}}

Data-parallel wrappers (``DistributedDataParallel``, FSDP with its default settings) *average*
gradients over the ``W`` ranks, so each rank must multiply its loss by ``W``
(:func:`data_parallel_loss_scale`) to obtain the gradient of the sum. The full recipe, with
the reasoning and the bugs it avoids, is in ``docs/distributed/data-parallel.md``; context
parallelism (``context_group=``) in ``docs/distributed/context-parallel.md``.

Example (one optimizer step on one rank)::

    counts = global_normalizers([mb.mask for mb in micro_batches], group=dp_group)
    normalizer = normalizer_for_reduction(counts, reduction="token_mean")
    scale = data_parallel_loss_scale(group=dp_group)
    diagnostics = []
    for k, mb in enumerate(micro_batches):
        with model.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
            out = policy_loss(..., reduction="token_mean", normalizer=normalizer,
                              diagnostics_normalizer=normalizer)
            (out.loss * scale).backward()
        diagnostics.append(out.diagnostics)
    optimizer.step()
    step_diagnostics = sum_diagnostics(diagnostics, group=dp_group)
"""

from __future__ import annotations

from .global_batch import (
    global_cov_selection,
    global_m2po_mask,
    global_masked_whiten,
    global_top_entropy_mask,
)
from .normalizers import (
    Normalizers,
    data_parallel_loss_scale,
    global_normalizers,
    normalizer_for_reduction,
    sum_diagnostics,
)

__all__ = [
    "Normalizers",
    "data_parallel_loss_scale",
    "global_cov_selection",
    "global_m2po_mask",
    "global_masked_whiten",
    "global_normalizers",
    "global_top_entropy_mask",
    "normalizer_for_reduction",
    "sum_diagnostics",
]
