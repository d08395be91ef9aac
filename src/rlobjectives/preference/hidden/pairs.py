r"""The preference loss from hidden states and the LM head: :func:`preference_loss_from_hidden`."""

from __future__ import annotations

import torch

from ..._core.layout import token_matrix
from ..._core.validation import (
    ArrayLike,
    Scalar,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_scalar,
)
from ...logprobs.head import HeadOptions, Temperature
from ...logprobs.vocab_parallel import VocabGroup
from ..inputs import (
    Denominators,
    PairCall,
    PreferenceLossOutput,
    SideInputs,
    SideSums,
    check_objective,
    denominators,
    finish,
    pair_losses,
    pair_quantities,
    pair_weights,
    reference_sums,
    validate_ld_alpha,
    wpo_weights,
)
from ..loss import run_pair_call
from ..objectives.base import PreferenceObjective
from ..objectives.margin import DPO
from .driver import Sums, TokenWeights, UnitPlan, UnitsFromHidden, plan_units
from .inputs import (
    HiddenRows,
    head_log_probs,
    per_token_or_sequence,
    prepare_rows,
    side_layouts,
    split_sides,
)

__all__ = ["preference_loss_from_hidden"]


def _positive(value: Scalar | None, name: str) -> float | torch.Tensor | None:
    return None if value is None else validate_scalar(value, name, minimum=0.0, strict=True)


def _pair_call(
    rows: HiddenRows,
    objective: PreferenceObjective,
    ref: torch.Tensor | None,
    nll_mask: torch.Tensor | None,
    log_sum_sq: torch.Tensor | None,
    options: tuple[Scalar | None, Scalar | None, Scalar | None],
) -> PairCall:
    """The :class:`PairCall` of the two sides (their log-probabilities: placeholders)."""
    sequences = rows.layout.num_sequences
    if sequences % 2:
        what = "cu_seqlens" if rows.packed else "hidden"
        raise ValueError(
            f"{what} must hold 2B sequences, the B chosen then the B rejected responses, got "
            f"{sequences}"
        )
    pairs = sequences // 2
    layout_c, layout_r = side_layouts(rows, pairs)
    dtype = rows.head.dtype
    placeholder = torch.zeros(rows.batch_shape, dtype=dtype, device=rows.head.hidden.device)
    parts = [
        split_sides(t, rows, pairs) if t is not None else (None, None)
        for t in (placeholder, rows.mask, ref, log_sum_sq)
    ]
    sides = [
        SideInputs(parts[0][k], parts[1][k], parts[2][k], parts[3][k], layout)  # type: ignore[arg-type]
        for k, layout in enumerate((layout_c, layout_r))
    ]
    nll_c = None if nll_mask is None else split_sides(nll_mask, rows, pairs)[0]
    ld_alpha, normalizer, nll_normalizer = options
    return PairCall(
        chosen=sides[0],
        rejected=sides[1],
        nll_mask=nll_c,
        objective=objective,
        ld_alpha=validate_ld_alpha(ld_alpha),
        normalizer=_positive(normalizer, "normalizer"),
        nll_normalizer=_positive(nll_normalizer, "nll_normalizer"),
        dtype=dtype,
        output_dtype=dtype,
    )


def _composed(rows: HiddenRows, call: PairCall) -> PreferenceLossOutput:
    """Log-probabilities from the head (recompute in backward), then the formula by autograd."""
    log_probs = head_log_probs(rows, _active(rows, call))
    pairs = rows.layout.num_sequences // 2
    chosen, rejected = split_sides(log_probs, rows, pairs)
    call = call._replace(
        chosen=call.chosen._replace(log_probs=chosen),
        rejected=call.rejected._replace(log_probs=rejected),
    )
    out = run_pair_call(call)
    return out._replace(pair_losses=out.pair_losses.detach())  # as the fused path's


def _flat(side_c: torch.Tensor, side_r: torch.Tensor) -> torch.Tensor:
    return torch.cat([side_c.reshape(-1), side_r.reshape(-1)])


def _token_weights(call: PairCall, rows: HiddenRows) -> TokenWeights:
    """The flat per-row weights ``a`` (the sums), ``b`` (the NLL) and WPO's term."""
    c, r = call.chosen, call.rejected
    weights_c, weights_r = pair_weights(call)
    dtype = call.dtype
    a_c = c.mask.to(dtype) if weights_c is None else weights_c
    a_r = r.mask.to(dtype) if weights_r is None else weights_r
    nll = None
    if call.objective.uses_nll:
        nll_c = c.mask if call.nll_mask is None else call.nll_mask
        nll = _flat(nll_c.to(dtype), torch.zeros_like(r.mask, dtype=dtype))
    log_sum_sq = None
    if c.log_sum_sq is not None and r.log_sum_sq is not None:
        log_sum_sq = _flat(c.log_sum_sq.detach(), r.log_sum_sq.detach()).to(dtype)
    mask = rows.mask.reshape(-1)
    active = mask if nll is None else mask | (nll > 0)
    return TokenWeights(mask, active, _flat(a_c, a_r), nll, log_sum_sq)


class _PairLoss:
    """The :data:`~rlobjectives.preference.hidden.driver.UnitLoss` of the pairs' formula."""

    def __init__(
        self,
        call: PairCall,
        totals: Denominators,
        lengths: tuple[torch.Tensor, torch.Tensor],
        refs: tuple[torch.Tensor | None, torch.Tensor | None],
        wpo: bool,
    ) -> None:
        self.call, self.totals, self.lengths, self.refs, self.wpo = call, totals, lengths, refs, wpo

    def __call__(self, ids: torch.Tensor, sums: Sums) -> torch.Tensor:
        """The loss of the pairs whose sequences are ``ids`` (chosen, rejected, chosen, ...)."""
        pairs = ids[0::2]  # the chosen members: global ids 0..B-1 are the pair indices
        sides = []
        for k in (0, 1):
            side_ref = self.refs[k]
            ref = None if side_ref is None else side_ref.index_select(0, pairs)
            wpo = sums.wpo[k::2] if self.wpo else None
            lengths = self.lengths[k].index_select(0, pairs)
            sides.append(SideSums(sums.sums[k::2], lengths, ref, sums.plain[k::2], wpo))
        totals = self.totals._replace(valid=self.totals.valid.index_select(0, pairs))
        q = pair_quantities(sides[0], sides[1], sums.nll[0::2], totals)
        return pair_losses(self.call.objective, q, totals, wpo_weights(sides[0], sides[1]))[0]


def _fused(rows: HiddenRows, call: PairCall, plan: UnitPlan) -> PreferenceLossOutput:
    """Three matrix products: the gradients formed in forward, one unit (pair) at a time."""
    head, pairs = rows.head, rows.layout.num_sequences // 2
    weights_c, weights_r = pair_weights(call)
    lengths = (
        call.chosen.layout.row_counts(call.chosen.mask).to(call.dtype),
        call.rejected.layout.row_counts(call.rejected.mask).to(call.dtype),
    )
    refs = (
        reference_sums(call.chosen, call.dtype, weights_c),
        reference_sums(call.rejected, call.dtype, weights_r),
    )
    totals = denominators(call, lengths[0], lengths[1])
    weights = _token_weights(call, rows)
    loss_fn = _PairLoss(call, totals, lengths, refs, weights.log_sum_sq is not None)
    anchor, sums, nll, plain, wpo = UnitsFromHidden.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head, plan, weights, loss_fn
    )
    has_wpo = weights.log_sum_sq is not None
    chosen = SideSums(sums[:pairs], lengths[0], refs[0], plain[:pairs],
                      wpo[:pairs] if has_wpo else None)  # fmt: skip
    rejected = SideSums(sums[pairs:], lengths[1], refs[1], plain[pairs:],
                        wpo[pairs:] if has_wpo else None)  # fmt: skip
    q = pair_quantities(chosen, rejected, nll[:pairs], totals)
    out = finish(call, q, totals, wpo_weights(chosen, rejected))
    return out._replace(loss=out.loss.detach() + anchor, pair_losses=out.pair_losses.detach())


#: The extra buffers of the three-product passes (a pair's ``(rows, V)`` scores beyond a chunk,
#: or its sequences' ``(V, H)`` float32 partials) may hold at most this share of the ``(N, V)``
#: logits of the call (the partials: ``2 H <= N / 8``); otherwise a pair larger than a chunk is
#: computed with recompute (four matrix products, no such buffer).
PARTIALS_SHARE = 1 / 8
#: Take a pair larger than a chunk whole when its buffer is no larger than its partials.
WHOLE_UNITS = True


def _plan(rows: HiddenRows, call: PairCall, vocab_group: VocabGroup) -> UnitPlan | None:
    """The three-product plan, or None for the composition (log-probs, then the formula)."""
    head = rows.head
    tensors = [head.hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if vocab_group is not None or not call.objective.pair_local or not wants_grad:
        return None
    pairs = len(rows.starts) // 2
    single = call.ld_alpha is None and (not call.objective.uses_nll or call.nll_mask is None)
    units = [[i, pairs + i] for i in range(pairs)]
    return plan_units(head, rows.starts, rows.ends, units, share=PARTIALS_SHARE, single=single,
                      whole_units=WHOLE_UNITS)  # fmt: skip


@checks_environment
def preference_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: ArrayLike,
    mask: ArrayLike,
    *,
    objective: PreferenceObjective = DPO(beta=0.1),  # noqa: B008 - a frozen dataclass
    ref_log_probs: ArrayLike | None = None,
    nll_mask: ArrayLike | None = None,
    ld_alpha: Scalar | None = None,
    log_sum_sq_probs: ArrayLike | None = None,
    normalizer: Scalar | None = None,
    nll_normalizer: Scalar | None = None,
    bias: torch.Tensor | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
    vocab_group: VocabGroup = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    fp32_head: bool = True,
) -> PreferenceLossOutput:
    r""":func:`rlobjectives.preference_loss` from hidden states, without the ``(N, V)`` logits.

    The token log-probabilities are
    :math:`\ell_t = \log\mathrm{softmax}(x_t)_{y_t}`, :math:`x_t` the transformed logits
    :math:`\mathrm{cap}_c(s(h_t W^\top + b))/\tau` (``docs/objectives/logprobs.md``), of the
    ``[chosen; rejected]`` batch (TRL's and Liger's concatenation: rows ``0..B-1`` the chosen
    responses, ``B..2B-1`` the rejected ones); the loss is the objective's, exactly as
    :func:`rlobjectives.preference_loss` of those log-probabilities (the same formula, sums,
    normalisers and named results). Gradients to ``hidden``, ``weight`` and ``bias`` are exact:
    a pair-local objective (all but ``AOT``) takes three matrix products per token (each pair's
    sums, autograd on the formula their derivative, the chunk's probabilities the gradient at
    once); otherwise (``AOT``, ``vocab_group``, no gradient) the chunked pass of
    :func:`rlobjectives.token_log_probs_from_hidden` and the formula by autograd
    (``docs/objectives/preference.md``). The softmax runs in float32 (float64 when ``hidden``,
    ``ref_log_probs`` or ``log_sum_sq_probs`` is); the product in float32 from a bf16 head.

    Args:
        hidden: ``(2B, T, H)`` hidden states (packed: ``(N, H)`` / ``(1, N, H)``).
        weight: ``(V, H)`` LM-head weight (this rank's rows under ``vocab_group``).
        tokens: ``(2B, T)`` the response token ids (packed ``(N,)``); any id where unselected.
        mask: ``(2B, T)`` the response tokens (packed ``(N,)``).
        objective: a preference object (``DPO(...)``, ..., or a weighted sum).
        ref_log_probs: the reference's log-probabilities, per token (``tokens``' shape) or
            summed per sequence ``(2B,)``; required by reference-based objectives only.
        nll_mask: the chosen responses' NLL tokens (``tokens``' shape; rejected rows ignored).
        ld_alpha: LD-DPO's :math:`\alpha \in [0, 1]`, or None.
        log_sum_sq_probs: per-token :math:`\log\sum_v\pi_v^2` (WPO), ``tokens``' shape, or None.
        normalizer: the pair normaliser :math:`D` (global valid pairs).
        nll_normalizer: the NLL token normaliser.
        bias: optional ``(V,)`` LM-head bias.
        temperature: :math:`\tau > 0`, a number or per token (``tokens``' shape).
        chunk_size: rows per chunk (default: the head's budget, 256 rows or more).
        cu_seqlens: ``(2B + 1,)`` boundaries of the packed sequences, chosen first.
        vocab_group: a process group / ``VocabParallel`` over which ``weight``'s rows are split.
        final_logit_softcapping: as :func:`rlobjectives.token_log_probs_from_hidden`.
        logit_scale: as :func:`rlobjectives.token_log_probs_from_hidden`.
        fp32_head: as :func:`rlobjectives.token_log_probs_from_hidden`.

    Returns:
        :class:`~rlobjectives.PreferenceLossOutput` (the loss in the computation dtype).

    Raises:
        ValueError: as :func:`rlobjectives.preference_loss` and
            :func:`rlobjectives.token_log_probs_from_hidden`; an odd number of sequences.
        TypeError: as those functions; ``objective`` not a preference objective.

    References:
        Liger-Kernel, arXiv:2410.10989 (``LigerFusedLinearDPOLoss``); CCE, arXiv:2411.09009.

    Examples:
        >>> import torch
        >>> from rlobjectives import DPO
        >>> hidden, weight = torch.zeros(2, 3, 4), torch.zeros(5, 4)
        >>> out = preference_loss_from_hidden(hidden, weight, torch.zeros(2, 3, dtype=torch.long),
        ...     torch.ones(2, 3), objective=DPO(beta=0.1), ref_log_probs=torch.zeros(2))
        >>> round(out.loss.item(), 4)  # log 2: equal log-ratios (3 log(1/5) each)
        0.6931

    .. versionadded:: 0.3.0
    """
    checked = check_objective(objective)
    rows = prepare_rows(
        hidden, weight, tokens, mask, bias=bias, temperature=temperature,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, vocab_group=vocab_group,
        head_options=HeadOptions(final_logit_softcapping, logit_scale, fp32_head),
    )  # fmt: skip
    ref = (
        None
        if ref_log_probs is None
        else per_token_or_sequence(ref_log_probs, "ref_log_probs", rows)
    )
    _check_reference(checked, ref)
    nll = None
    if nll_mask is not None:
        nll = as_mask(nll_mask, "nll_mask", rows.head.hidden.device)
        nll = token_matrix(nll, "nll_mask", rows.packed)
        check_same_device({"hidden": rows.head.hidden, "nll_mask": nll})
        check_shape(nll, "nll_mask", rows.batch_shape, "tokens")
    squares = None
    if log_sum_sq_probs is not None:
        squares = per_token_or_sequence(log_sum_sq_probs, "log_sum_sq_probs", rows)
        if squares.ndim == 1:
            raise ValueError(
                f"log_sum_sq_probs must be per token, the shape of tokens {rows.batch_shape}, "
                f"got shape {tuple(squares.shape)}"
            )
    dtype = compute_dtype(*(t for t in (rows.head.hidden, ref, squares) if t is not None))
    rows = rows._replace(head=rows.head._replace(dtype=dtype))  # the softmax in that dtype
    call = _pair_call(rows, checked, ref, nll, squares, (ld_alpha, normalizer, nll_normalizer))
    plan = _plan(rows, call, vocab_group)
    if plan is not None:
        return _fused(rows, call, plan)
    return _composed(rows, call)


def _active(rows: HiddenRows, call: PairCall) -> torch.Tensor:
    """The tokens whose log-probability a sum reads: the responses and the NLL tokens."""
    if call.nll_mask is None or not call.objective.uses_nll:
        return rows.mask
    pairs = rows.layout.num_sequences // 2
    rejected = split_sides(rows.mask, rows, pairs)[1]
    nll_tokens = torch.cat(
        [call.nll_mask, torch.zeros_like(rejected)], dim=-1 if rows.packed else 0
    )
    return rows.mask | nll_tokens


def _check_reference(objective: PreferenceObjective, ref: torch.Tensor | None) -> None:
    if objective.needs_reference and ref is None:
        raise ValueError(
            f"ref_log_probs is required by {objective!r} (it compares the policy with the "
            "reference model), got None"
        )
    if not objective.needs_reference and ref is not None:
        raise ValueError(
            f"ref_log_probs must be None for {objective!r}: it is reference-free and would "
            "ignore it"
        )
