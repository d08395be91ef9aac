r"""The exact full-vocabulary KL from logits: the public functions and its Function over slices.

:func:`full_vocab_kl` and :func:`full_vocab_kl_loss` read the two logits tensors one block of rows
at a time: through :class:`~rlobjectives.logprobs.functions.FullVocabKLFunction` for one
temperature on one process, or :class:`RestrictedKLFunction` for a vocabulary slice
(``vocab_group=``) or a per-token temperature. No float32 copy of either tensor is made, and only
per-row statistics are kept for the backward pass.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .._core.chunking import Block, block_rows, resolve_chunk_size, run_blocks
from .._core.layout import sequence_layout, token_matrix, token_ndim, token_output
from .._core.reduction import Reduction, masked_fill_zero, reduce, validate_layout_reduction
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
)
from .blocks import slice_kl, slice_kl_grads
from .functions import FullVocabKLFunction, backward_rows, load_block
from .head import Temperature
from .logits import as_logits, logits_transform, row_mask
from .transform import LogitTransform, apply_transform_
from .vocab_parallel import Shard, VocabGroup, combine_rows, resolve_shard, sum_over_ranks

__all__ = ["RestrictedKLFunction", "full_vocab_kl", "full_vocab_kl_loss"]


def _prepare_kl(
    logits: ArrayLike,
    ref_logits: ArrayLike,
    mask: ArrayLike | None,
    temperature: object,
    chunk_size: int | None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogitTransform, int]:
    logits_t = as_logits(logits, "logits")
    ref_t = as_logits(ref_logits, "ref_logits")
    check_same_device({"logits": logits_t, "ref_logits": ref_t})
    check_shape(ref_t, "ref_logits", tuple(logits_t.shape), "logits")
    active = row_mask(mask, "mask", logits_t, "logits")
    dtype = compute_dtype(logits_t, ref_t)
    transform = logits_transform(temperature, None, 1.0, logits_t, active, dtype=dtype,
                                 packed=packed)  # fmt: skip
    chunk = resolve_chunk_size(chunk_size, row_width=logits_t.shape[-1])
    return logits_t, ref_t, active, transform, chunk


def _kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    active: torch.Tensor,
    options: tuple[bool, LogitTransform, int],
    vocab_group: VocabGroup,
) -> torch.Tensor:
    """The KL Function of the call.

    Over vocabulary slices with ``vocab_group``, or with a per-token temperature.
    """
    masked, transform, chunk = options
    dtype = compute_dtype(logits, ref_logits)
    if vocab_group is not None or transform.per_row:
        shard = None
        if vocab_group is not None:
            shard = resolve_shard(vocab_group, logits.shape[-1], logits.device)
        sharded: torch.Tensor = RestrictedKLFunction.apply(  # type: ignore[no-untyped-call]
            logits, ref_logits, active, masked, transform, chunk, dtype, shard
        )
        return sharded
    tau = 1.0 / float(transform.inverse)  # type: ignore[arg-type]
    out: torch.Tensor = FullVocabKLFunction.apply(  # type: ignore[no-untyped-call]
        logits, ref_logits, active, masked, tau, chunk, dtype
    )
    return out


@checks_environment
def full_vocab_kl(
    logits: ArrayLike,
    ref_logits: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    vocab_group: VocabGroup = None,
) -> torch.Tensor:
    r"""Exact per-token KL(pi || ref) over the whole vocabulary, chunked over tokens.

    With :math:`p = \mathrm{softmax}(\text{logits}/\tau)` and
    :math:`q = \mathrm{softmax}(\text{ref\_logits}/\tau)` at each position,

    .. math::

        \mathrm{KL}_{bt} = \sum_{v=1}^{V} p_{btv} (\log p_{btv} - \log q_{btv}) \ \ge 0,

    .. math::

        \frac{\partial \mathrm{KL}}{\partial \text{logits}_v}
        = \frac{p_v (\log p_v - \log q_v - \mathrm{KL})}{\tau}, \qquad
        \frac{\partial \mathrm{KL}}{\partial \text{ref\_logits}_v} = \frac{q_v - p_v}{\tau}.

    The exact value that the sampled estimators k1/k2/k3 (Schulman 2020) estimate from one
    token per position; none of verl (``kl_penalty="full"`` raises NotImplementedError), TRL or
    OpenRLHF computes it. Terms with :math:`p_v = 0` contribute 0; the KL is ``inf`` where the
    reference gives zero probability to a token the policy supports. With ``vocab_group`` both
    logit tensors are this rank's vocabulary slice and every term is the unsharded call's.
    Memory, gradients, communication: docs/objectives/kl.md, "full_vocab_kl".

    To reduce to a loss use :func:`full_vocab_kl_loss` (or
    ``aggregate(full_vocab_kl(...), mask, reduction=...)``).

    Args:
        logits: ``(B, T, V)`` or ``(N, V)`` policy logits.
        ref_logits: reference-policy logits, same shape (any float dtype).
        mask: optional ``(B, T)`` / ``(N,)``; unselected positions give exactly 0, and NaN/inf
            in their logits reaches neither the output nor a gradient. Default: every position.
        temperature: :math:`\tau > 0`, applied to both logit tensors (or a per-token tensor of
            the leading shape, as :func:`token_log_probs`).
        chunk_size: positions per chunk, or None for ``max(1, 2**23 // V)``.
        vocab_group: None, or the process group over which the vocabulary is split (or a
            :class:`~rlobjectives.VocabParallel`), as :func:`token_log_probs`.

    Returns:
        ``(B, T)`` or ``(N,)`` KL in nats, float32 (float64 if either input is float64).

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``temperature <= 0``,
            ``chunk_size < 1``.
        TypeError: on non-numeric logits or a non-int ``chunk_size``.

    References:
        Kullback & Leibler 1951; the KL-regularised RL objective of Ouyang et al. 2022,
        arXiv:2203.02155 Eq. 2, and GRPO, arXiv:2402.03300 Eq. 3-4 (whose k3 term estimates this
        quantity from the sampled token).

    Examples:
        >>> import torch
        >>> logits = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> ref_logits = torch.log(torch.tensor([[0.25, 0.75]]))
        >>> full_vocab_kl(logits, ref_logits)  # 0.5 log 2 + 0.5 log(2/3)
        tensor([0.1438])

    .. versionadded:: 0.1.0
    """
    logits_t, ref_t, active, transform, chunk = _prepare_kl(
        logits, ref_logits, mask, temperature, chunk_size
    )
    return _kl(logits_t, ref_t, active, (mask is not None, transform, chunk), vocab_group)


@checks_environment
def full_vocab_kl_loss(
    logits: ArrayLike,
    ref_logits: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    cu_seqlens: ArrayLike | None = None,
    vocab_group: VocabGroup = None,
) -> torch.Tensor:
    r"""Exact full-vocabulary KL(pi || ref) reduced to a loss term.

    .. math::

        \mathcal{L}_{KL} = \mathrm{reduce}_{M}\big(\mathrm{KL}_{bt}\big),

    with :math:`\mathrm{KL}_{bt}` from :func:`full_vocab_kl` and the reduction of
    :func:`rlobjectives.aggregate` (``"token_mean"``, ``"sequence_mean"``,
    ``"sequence_sum_normalized"``, ``"none"``). Multiply by the KL coefficient and add it to the
    policy loss (GRPO's KL term, arXiv:2402.03300 Eq. 3, with the exact KL in place of k3).
    With an explicit ``normalizer`` the loss of micro-batches adds up to the full-batch loss.
    Packed sequences (``cu_seqlens`` given): ``logits`` ``(N, V)`` or ``(1, N, V)`` and ``mask``
    ``(N,)`` or ``(1, N)``, reduced per sequence as :func:`rlobjectives.aggregate` does.

    Args:
        logits: ``(B, T, V)`` policy logits.
        ref_logits: ``(B, T, V)`` reference logits.
        mask: ``(B, T)`` bool or numeric; nonzero selects the token.
        reduction: see :func:`rlobjectives.aggregate`.
        normalizer: optional explicit denominator (see :func:`rlobjectives.aggregate`).
        max_response_length: Dr. GRPO constant for ``"sequence_sum_normalized"``.
        temperature: :math:`\tau > 0`, applied to both logit tensors (or a per-token tensor:
            ``(B, T)``, packed ``(N,)``).
        chunk_size: positions per chunk, or None for ``max(1, 2**23 // V)``.
        cu_seqlens: optional ``(S + 1,)`` integer boundaries of packed sequences (0 first,
            non-decreasing, ``N`` last); see :func:`rlobjectives.policy_loss`.
        vocab_group: as :func:`full_vocab_kl` (the loss is the same on every rank).

    Returns:
        Scalar loss (``(B, T)`` for ``reduction="none"``, packed: the shape of ``mask``),
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: as :func:`full_vocab_kl`, for logits that are not ``(B, T, V)`` (packed:
            ``(N, V)`` / ``(1, N, V)``), an unknown ``reduction``, a non-positive
            ``normalizer`` or a malformed ``cu_seqlens``.
        TypeError: on non-numeric logits.

    References:
        Shao et al. 2024, GRPO, arXiv:2402.03300 Eq. 3; Ouyang et al. 2022, arXiv:2203.02155
        Eq. 2.

    Examples:
        >>> import torch
        >>> loss = full_vocab_kl_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3),
        ...                           torch.ones(1, 2, dtype=torch.bool))
        >>> loss
        tensor(0.)

    .. versionadded:: 0.1.0
    """
    packed = cu_seqlens is not None
    logits_t = as_logits(logits, "logits")
    if packed and logits_t.ndim == 2:
        logits_t = logits_t.unsqueeze(0)  # (1, N, V)
        ref_logits = as_logits(ref_logits, "ref_logits")
        ref_logits = ref_logits.unsqueeze(0) if ref_logits.ndim == 2 else ref_logits
    if logits_t.ndim != 3 or (packed and logits_t.shape[0] != 1):
        expected = "(N, V) or (1, N, V) (packed: cu_seqlens given)" if packed else "(B, T, V)"
        raise ValueError(
            f"logits must have shape {expected} for a reduced loss, got shape "
            f"{tuple(logits_t.shape)}"
        )
    flat = packed and token_ndim(mask) == 1
    mask_t = token_matrix(as_mask(mask, "mask", logits_t.device), "mask", packed)
    layout = sequence_layout(cu_seqlens, logits_t[..., 0])
    spec = validate_layout_reduction(
        reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        layout=layout,
        tokens=logits_t.shape[1],
    )
    logits_t, ref_t, active, transform, chunk = _prepare_kl(
        logits_t, ref_logits, mask_t, temperature, chunk_size, packed
    )
    kl = _kl(logits_t, ref_t, active, (True, transform, chunk), vocab_group)  # (B, T)
    loss = reduce(kl, active, spec, layout)
    return token_output(loss, flat and loss.ndim == 2)


# ---------------------------------------------------------------------------------------------
# Full-vocabulary KL over vocabulary slices (no kept set)
# ---------------------------------------------------------------------------------------------


def _kl_chunk(
    tensor: torch.Tensor,
    block: Block,
    selected: torch.Tensor | None,
    transform: LogitTransform,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The chunk of one logits tensor after the temperature, a fresh tensor of ``dtype``."""
    chunk = load_block(tensor, block, selected, 1.0, dtype).to(dtype, copy=True)
    return apply_transform_(chunk, transform, block)


def _kl_normalizer_step(
    pair: tuple[torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    masked: bool,
    options: tuple[LogitTransform, torch.dtype],
    block: Block,
) -> list[torch.Tensor]:
    transform, dtype = options
    selected = active[block] if masked else None
    chunk = _kl_chunk(pair[0], block, selected, transform, dtype)
    ref_chunk = _kl_chunk(pair[1], block, selected, transform, dtype)
    return [torch.logsumexp(chunk, dim=1), torch.logsumexp(ref_chunk, dim=1)]


def _kl_step(
    pair: tuple[torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    masked: bool,
    normalizers: tuple[torch.Tensor, torch.Tensor],
    options: tuple[LogitTransform, torch.dtype],
    block: Block,
) -> list[torch.Tensor]:
    transform, dtype = options
    selected = active[block] if masked else None
    chunk = _kl_chunk(pair[0], block, selected, transform, dtype)
    ref_chunk = _kl_chunk(pair[1], block, selected, transform, dtype)
    return [slice_kl(chunk, ref_chunk, normalizers[0][block], normalizers[1][block])]


def _kl_grad_step(
    pair: tuple[torch.Tensor, torch.Tensor],
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    needs: tuple[bool, bool],
    options: tuple[LogitTransform, torch.dtype],
    block: Block,
) -> list[torch.Tensor]:
    active, lse_x, lse_y, kl, grad = saved
    transform, dtype = options
    upstream = grad[block].to(dtype)
    selected = backward_rows(active[block], upstream)
    chunk = _kl_chunk(pair[0], block, selected, transform, dtype)
    ref_chunk = _kl_chunk(pair[1], block, selected, transform, dtype)
    factor = transform.row_factor(block)
    scaled = masked_fill_zero(upstream, selected) * (
        factor.to(dtype) if isinstance(factor, torch.Tensor) else factor
    )
    return slice_kl_grads(
        chunk,
        ref_chunk,
        (masked_fill_zero(lse_x[block], selected), masked_fill_zero(lse_y[block], selected)),
        masked_fill_zero(kl[block], selected),
        scaled,
        need_logits=needs[0],
        need_ref=needs[1],
    )


class RestrictedKLFunction(torch.autograd.Function):
    r"""Exact ``KL(softmax(x / tau) || softmax(y / tau))`` per row, chunked in two passes.

    Two passes over the logits: the log-normalisers (combined over the ranks of a vocabulary
    slice), then this slice's terms :math:`p_v (\log p_v - \log q_v)` with them, summed over
    the ranks: every term is the unsharded call's. Without a shard (``None``): one process, a
    per-token temperature (``transform``'s inverse in the leading shape of the logits).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        ref_logits: torch.Tensor,
        active: torch.Tensor,
        masked: bool,
        transform: LogitTransform,
        chunk_size: int,
        dtype: torch.dtype,
        shard: Shard | None,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        leading = tuple(active.shape)
        blocks = block_rows(leading, chunk_size, flat=False)  # index both tensors alike
        pair = (logits, ref_logits)
        options = (transform, dtype)
        stats = [torch.zeros(leading, dtype=dtype, device=logits.device) for _ in "ab"]
        run_blocks(blocks, partial(_kl_normalizer_step, pair, active, masked, options), stats)
        lse_x = combine_rows(stats[0].reshape(-1), None, [], shard).log_normalizer.reshape(leading)
        lse_y = combine_rows(stats[1].reshape(-1), None, [], shard).log_normalizer.reshape(leading)
        kl = torch.zeros(leading, dtype=dtype, device=logits.device)
        step = partial(_kl_step, pair, active, masked, (lse_x, lse_y), options)
        run_blocks(blocks, step, [kl])
        kl = sum_over_ranks(kl, shard)
        kl = masked_fill_zero(kl, active) if masked else kl
        ctx.save_for_backward(logits, ref_logits, active, lse_x, lse_y, kl)
        ctx.options = (transform, chunk_size, dtype)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, ref_logits, active, lse_x, lse_y, kl = ctx.saved_tensors
        transform, chunk_size, dtype = ctx.options
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        blocks = block_rows(tuple(active.shape), chunk_size, flat=False)
        outputs = [
            torch.empty(logits.shape, dtype=source.dtype, device=source.device)
            for source, need in zip((logits, ref_logits), needs, strict=True)
            if need
        ]
        saved = (active, lse_x, lse_y, kl, grad)
        step = partial(_kl_grad_step, (logits, ref_logits), saved, needs, (transform, dtype))
        run_blocks(blocks, step, outputs)
        grads = iter(outputs)
        grad_logits = next(grads) if needs[0] else None
        grad_ref = next(grads) if needs[1] else None
        return grad_logits, grad_ref, None, None, None, None, None, None
