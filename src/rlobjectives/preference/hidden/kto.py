r"""KTO from hidden states and the LM head: :func:`kto_loss_from_hidden`."""

from __future__ import annotations

import torch

from ..._core.layout import per_sequence
from ..._core.validation import (
    ArrayLike,
    Scalar,
    as_mask,
    check_same_device,
    checks_environment,
    compute_dtype,
    validate_choice,
    validate_scalar,
)
from ...logprobs.head import HeadOptions, Temperature
from ...logprobs.vocab_parallel import VocabGroup
from ..inputs import SideInputs, reference_sums
from ..kto import _KINDS, KTOCall, KTOKind, KTOLossOutput, kto_finish, kto_formula, reference_point
from .driver import Sums, TokenWeights, UnitPlan, UnitsFromHidden, plan_units
from .inputs import HiddenRows, head_log_probs, per_token_or_sequence, prepare_rows
from .pairs import PARTIALS_SHARE

__all__ = ["kto_loss_from_hidden"]


class _ExampleLoss:
    """The :data:`~rlobjectives.preference.hidden.driver.UnitLoss` of KTO's examples."""

    def __init__(
        self, call: KTOCall, ref: torch.Tensor, lengths: torch.Tensor, total: torch.Tensor
    ):
        self.call, self.ref, self.lengths, self.total = call, ref, lengths, total

    def __call__(self, ids: torch.Tensor, sums: Sums) -> torch.Tensor:
        """The examples' loss: the formula over the global denominator."""
        valid = self.lengths.index_select(0, ids) > 0
        placeholder = torch.full((), -1.0, dtype=sums.sums.dtype, device=ids.device)
        values = torch.where(valid, sums.sums, placeholder)
        ref = torch.where(valid, self.ref.index_select(0, ids), placeholder)
        call = self.call._replace(desirable=self.call.desirable.index_select(0, ids))
        z0 = reference_point(self.call, ids.device)
        losses = kto_formula(call, values, ref, z0)
        zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
        return torch.where(valid, losses, zero).sum() / self.total


@checks_environment
def kto_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    mask: ArrayLike,
    desirable: ArrayLike,
    *,
    ref_log_probs: ArrayLike,
    kl: Scalar | None = None,
    beta: Scalar = 0.1,
    desirable_weight: Scalar = 1.0,
    undesirable_weight: Scalar = 1.0,
    kind: KTOKind = "kto",
    normalizer: Scalar | None = None,
    bias: torch.Tensor | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
    vocab_group: VocabGroup = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    fp32_head: bool = True,
) -> KTOLossOutput:
    r""":func:`rlobjectives.kto_loss` from hidden states, without the ``(N, V)`` logits.

    The token log-probabilities are :math:`\log\mathrm{softmax}(\mathrm{cap}_c(s(h W^\top + b))
    /\tau)_{y}` (``docs/objectives/logprobs.md``); the
    loss, its normaliser and named results are :func:`rlobjectives.kto_loss`'s. Each response
    is its own unit: its tokens (grouped with others while they fit a chunk) give its sum,
    autograd on KTO's formula its derivative, and the chunk's probabilities the gradient at
    once (three matrix products); a response longer than a chunk keeps one ``(V, H)`` float32
    partial of ``grad_weight``. Under ``vocab_group`` (or without a gradient) the
    log-probabilities come from :func:`rlobjectives.token_log_probs_from_hidden` instead.

    Args:
        hidden: ``(B, T, H)`` hidden states (packed ``(N, H)``).
        weight: ``(V, H)`` LM-head weight.
        tokens: ``(B, T)`` response token ids (packed ``(N,)``).
        mask: ``(B, T)`` the response tokens.
        desirable: ``(B,)`` bool labels.
        ref_log_probs: the reference's, per token or summed ``(B,)``.
        kl: KTO's reference point before clamping at 0 (None: 0).
        beta: :math:`\beta > 0`.
        desirable_weight: :math:`\lambda_D \ge 0`.
        undesirable_weight: :math:`\lambda_U \ge 0`.
        kind: ``"kto"`` or ``"apo_zero_unpaired"``.
        normalizer: the global count of responses.
        bias: optional ``(V,)`` LM-head bias.
        temperature: :math:`\tau > 0`, a number or per token (``tokens``' shape).
        chunk_size: rows per chunk.
        cu_seqlens: ``(B + 1,)`` boundaries of packed sequences.
        vocab_group: the process group over which ``weight``'s rows are split, or None.
        final_logit_softcapping: as :func:`rlobjectives.token_log_probs_from_hidden`.
        logit_scale: as :func:`rlobjectives.token_log_probs_from_hidden`.
        fp32_head: as :func:`rlobjectives.token_log_probs_from_hidden`.

    Returns:
        :class:`~rlobjectives.KTOLossOutput` (the loss in the computation dtype).

    Raises:
        ValueError: as :func:`rlobjectives.kto_loss` and
            :func:`rlobjectives.token_log_probs_from_hidden`.
        TypeError: as those functions.

    References:
        Ethayarajh et al. 2024, arXiv:2402.01306; Liger ``LigerFusedLinearKTOLoss``.

    Examples:
        >>> import torch
        >>> out = kto_loss_from_hidden(torch.zeros(2, 3, 4), torch.zeros(5, 4),
        ...     torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.tensor([True, False]),
        ...     ref_log_probs=torch.zeros(2, 3))
        >>> out.example_losses  # beta x = 0.1 * 3 log(1/5) = -0.483: 1 - sigmoid(-+0.483)
        tensor([0.6184, 0.3816])

    .. versionadded:: 0.3.0
    """
    rows = prepare_rows(
        hidden, weight, tokens, mask, bias=bias, temperature=temperature,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, vocab_group=vocab_group,
        head_options=HeadOptions(final_logit_softcapping, logit_scale, fp32_head),
    )  # fmt: skip
    if ref_log_probs is None:
        raise ValueError("ref_log_probs is required (KTO compares with the reference), got None")
    ref = per_token_or_sequence(ref_log_probs, "ref_log_probs", rows)
    device = rows.head.hidden.device
    labels = as_mask(desirable, "desirable", device)
    check_same_device({"hidden": rows.head.hidden, "desirable": labels})
    labels = per_sequence(labels, "desirable", rows.layout, "hidden")
    validate_choice(kind, "kind", _KINDS)
    dtype = compute_dtype(rows.head.hidden, ref)
    rows = rows._replace(head=rows.head._replace(dtype=dtype))  # the softmax in that dtype
    placeholder = torch.zeros(rows.batch_shape, dtype=dtype, device=device)
    side = SideInputs(placeholder, rows.mask, ref, None, rows.layout)
    call = KTOCall(
        side=side,
        desirable=labels,
        kl=None if kl is None else validate_scalar(kl, "kl", minimum=None),
        beta=validate_scalar(beta, "beta", minimum=0.0, strict=True),
        weights=(
            validate_scalar(desirable_weight, "desirable_weight"),
            validate_scalar(undesirable_weight, "undesirable_weight"),
        ),
        kind=str(kind),
        normalizer=None
        if normalizer is None
        else validate_scalar(normalizer, "normalizer", minimum=0.0, strict=True),
        dtype=dtype,
        output_dtype=dtype,
    )
    lengths = rows.layout.row_counts(rows.mask).to(dtype)
    ref_sums = reference_sums(side, dtype, None)
    assert ref_sums is not None
    head = rows.head
    wants_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (head.hidden, head.weight, head.bias) if t is not None
    )
    units = [[s] for s in range(len(rows.starts))]
    plan = plan_units(head, rows.starts, rows.ends, units, share=PARTIALS_SHARE, single=True)
    if vocab_group is not None or not wants_grad or plan is None:
        log_probs = head_log_probs(rows, rows.mask)
        sums = rows.layout.row_sums(torch.where(rows.mask, log_probs.to(dtype), 0.0))
        out = kto_finish(call, sums, lengths, ref_sums)
        return out._replace(example_losses=out.example_losses.detach())  # as the fused path's
    return _fused(rows, call, plan, lengths, ref_sums)


def _fused(
    rows: HiddenRows,
    call: KTOCall,
    plan: UnitPlan,
    lengths: torch.Tensor,
    ref_sums: torch.Tensor,
) -> KTOLossOutput:
    head, dtype = rows.head, call.dtype
    if call.normalizer is None:
        total = (lengths > 0).sum().to(dtype).clamp(min=1)
    else:
        total = torch.as_tensor(call.normalizer, dtype=dtype, device=lengths.device)
    mask = rows.mask.reshape(-1)
    weights = TokenWeights(mask, mask, mask.to(dtype), None, None)
    loss_fn = _ExampleLoss(call, ref_sums, lengths, total)
    anchor, sums, *_ = UnitsFromHidden.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head, plan, weights, loss_fn
    )
    out = kto_finish(call, sums, lengths, ref_sums)
    return out._replace(loss=out.loss.detach() + anchor, example_losses=out.example_losses.detach())
