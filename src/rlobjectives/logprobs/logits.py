"""Log-probabilities and entropy from logits (public functions), and their argument checks.

Every function reads the logits ``(B, T, V)`` / ``(N, V)`` one block of rows at a time through
the chunked autograd Functions of :mod:`rlobjectives.logprobs.functions`: no float32 copy of the
whole logits tensor is ever made (a strided view such as ``logits[:, :-1]`` is read block by
block, not copied), and only per-row statistics are kept for the backward pass. The exact
full-vocabulary KL from logits is in :mod:`rlobjectives.logprobs.divergence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch

from .._core.validation import (
    ArrayLike,
    as_float_tensor,
    as_mask,
    as_token_ids,
    check_same_device,
    checks_environment,
    compute_dtype,
    validate_scalar,
)
from .functions import EntropyFunction, TokenLogProbsFunction
from .head import Temperature, validate_transform
from .restricted import (
    LogitsCall,
    RestrictedEntropyFunction,
    RestrictedLogProbsFunction,
    restricted_chunk_size,
)
from .statistics import LogProbStatistics, Wanted, statistics_result, validate_statistics
from .transform import LogitTransform
from .truncation import Restriction, restriction_of
from .vocab_parallel import VocabGroup

__all__ = [
    "as_logits",
    "logits_transform",
    "row_mask",
    "scalar_temperature",
    "token_entropy",
    "token_log_probs",
]


# ---------------------------------------------------------------------------------------------
# Boundary validation
# ---------------------------------------------------------------------------------------------


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if logits.ndim not in (2, 3):
        raise ValueError(
            f"{name} must have shape (B, T, V) or (N, V), got shape {tuple(logits.shape)} "
            f"({logits.ndim} dimensions)"
        )
    if logits.shape[-1] < 1:
        raise ValueError(
            f"{name} must have a vocabulary dimension V >= 1, got shape {tuple(logits.shape)}"
        )


def as_logits(logits: ArrayLike, name: str) -> torch.Tensor:
    """``logits`` as a floating tensor of shape ``(B, T, V)`` or ``(N, V)``, ``V >= 1``."""
    tensor = as_float_tensor(logits, name)
    _check_logits(tensor, name)
    return tensor


def row_mask(
    mask: ArrayLike | None, name: str, logits: torch.Tensor, logits_name: str
) -> torch.Tensor:
    """The bool rows to compute (the leading shape of ``logits``): ``mask``, or all True."""
    batch_shape = tuple(logits.shape[:-1])
    if mask is None:
        return torch.ones(batch_shape, dtype=torch.bool, device=logits.device)
    mask_t = as_mask(mask, name, logits.device)
    check_same_device({logits_name: logits, name: mask_t})
    if tuple(mask_t.shape) != batch_shape:
        raise ValueError(
            f"{name} must have shape {batch_shape} (the shape of {logits_name} without its last "
            f"dimension V), got shape {tuple(mask_t.shape)}"
        )
    return mask_t


def _validate_temperature(temperature: float) -> float:
    value = validate_scalar(
        temperature, "temperature", minimum=0.0, strict=True, allow_tensor=False
    )
    return float(value)


def scalar_temperature(transform: LogitTransform, temperature: object) -> float | None:
    """The one temperature of a transform that only divides by it, as given; None otherwise.

    No scale, no softcap, one number: the plain chunked Functions divide by it.
    """
    if transform.scale != 1.0 or transform.softcap is not None or transform.per_row:
        return None
    return float(temperature)  # type: ignore[arg-type]


def logits_transform(
    temperature: object,
    final_logit_softcapping: object,
    logit_scale: object,
    logits: torch.Tensor,
    active: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    packed: bool = False,
) -> LogitTransform:
    """The validated transform of a call on ``logits``.

    A per-token temperature has their leading shape; its inverse is 1 where ``active`` is False.
    """
    return validate_transform(
        temperature,
        final_logit_softcapping,
        logit_scale,
        shape=tuple(logits.shape[:-1]),
        device=logits.device,
        dtype=dtype,
        active=active,
        packed=packed,
        reference="logits without V",
    )


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


@overload
def token_log_probs(
    logits: ArrayLike,
    tokens: ArrayLike,
    *,
    mask: ArrayLike | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    vocab_group: VocabGroup = ...,
    kept_ids: ArrayLike | None = ...,
    kept_pad: int = ...,
    kept_mask: ArrayLike | None = ...,
    top_k: int | None = ...,
    top_p: float | None = ...,
    min_p: float | None = ...,
    final_logit_softcapping: float | None = ...,
    logit_scale: float = ...,
    statistics: None = ...,
) -> torch.Tensor: ...


@overload
def token_log_probs(
    logits: ArrayLike,
    tokens: ArrayLike,
    *,
    mask: ArrayLike | None = ...,
    temperature: Temperature = ...,
    chunk_size: int | None = ...,
    vocab_group: VocabGroup = ...,
    kept_ids: ArrayLike | None = ...,
    kept_pad: int = ...,
    kept_mask: ArrayLike | None = ...,
    top_k: int | None = ...,
    top_p: float | None = ...,
    min_p: float | None = ...,
    final_logit_softcapping: float | None = ...,
    logit_scale: float = ...,
    statistics: Sequence[str],
) -> LogProbStatistics: ...


@checks_environment
def token_log_probs(
    logits: ArrayLike,
    tokens: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    vocab_group: VocabGroup = None,
    kept_ids: ArrayLike | None = None,
    kept_pad: int = -1,
    kept_mask: ArrayLike | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    statistics: Sequence[str] | None = None,
) -> torch.Tensor | LogProbStatistics:
    r"""Log-probabilities of the sampled tokens, computed in float32 chunk by chunk.

    With :math:`x = \text{logits} / \tau` and :math:`p = \mathrm{softmax}(x)`:

    .. math::

        \log \pi(y_{bt}) = x_{bt, y_{bt}} - \log \sum_{v=1}^{V} \exp(x_{btv}), \qquad
        \frac{\partial \log \pi(y_{bt})}{\partial \text{logits}_{btv}}
        = \frac{\mathbb{1}[v = y_{bt}] - p_{btv}}{\tau},

    on blocks of ``chunk_size`` rows upcast one at a time (no float32 copy of the logits; the
    backward recomputes each chunk). A kept set :math:`K` gives :math:`\log q_K(y)`, ``-inf``
    with zero gradient for :math:`y \notin K`; ``vocab_group`` gives the unsharded result.
    Details: docs/objectives/logprobs.md, "token_log_probs".

    Args:
        logits: ``(B, T, V)`` or ``(N, V)`` floating logits (any float dtype).
        tokens: ``(B, T)`` or ``(N,)`` integer ids in ``[0, V)`` where ``mask`` is True.
        mask: optional ``(B, T)`` / ``(N,)``, nonzero = compute; elsewhere 0, nothing read.
        temperature: :math:`\tau > 0`, a number or a per-token ``(B, T)`` / ``(N,)`` tensor.
        chunk_size: rows per chunk, or None for ``max(1, 2**23 // V)`` (about 32 MiB).
        vocab_group: None, or the process group over which the vocabulary is split (or a
            :class:`~rlobjectives.VocabParallel`); ``tokens`` are global ids.
        kept_ids: ``(B, T, K)`` / ``(N, K)`` integer kept ids, padded with ``kept_pad``.
        kept_pad: the padding id of ``kept_ids`` (default -1).
        kept_mask: ``(B, T, V)`` / ``(N, V)`` bool, True = kept (this rank's slice).
        top_k: the sampler's top-k on the logits after the temperature (int >= 1; None: off).
        top_p: the sampler's top-p in ``(0, 1]`` after top-k (with ``vocab_group``: needs it).
        min_p: the sampler's min-p in ``[0, 1]``, before top-k and top-p (0 or None: off).
        final_logit_softcapping: :math:`c > 0`: the logits become :math:`c \tanh(s z / c)`
            before the temperature (Gemma 2/3), or None.
        logit_scale: :math:`s`, multiplying the logits first (Cohere's ``logit_scale``).
        statistics: names from ``("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")``
            (TRL 1.16's ``ChunkedLogProbFunction`` outputs); None: the log-probabilities alone.

    Returns:
        ``(B, T)`` or ``(N,)`` log-probabilities, float32 (float64 for float64 logits); with
        ``statistics`` a :class:`LogProbStatistics` (None for the statistics not asked for).

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``temperature <= 0`` or
            non-finite, ``chunk_size < 1``; more than one kind of kept set, ``top_k < 1``,
            ``top_p`` outside ``(0, 1]`` (or without ``top_k`` under ``vocab_group``), a
            ``vocab_group`` without initialised ``torch.distributed``.
        TypeError: on non-numeric logits, non-integer tokens or kept ids, a non-int
            ``chunk_size`` or ``top_k``, a non-number ``temperature`` or ``top_p``, a
            ``vocab_group`` that is not a process group.

    References:
        PPO, arXiv:1707.06347 Eq. 6-7; Liger-Kernel, arXiv:2410.10989 Sec. 3.3; Cut
        Cross-Entropy, arXiv:2411.09009; DeepSeek-V3.2, arXiv:2512.02556 Sec. 3.1 (kept set);
        Megatron, arXiv:1909.08053 (vocabulary parallelism); the peers: the docs page.

    Examples:
        >>> import torch
        >>> token_log_probs(torch.log(torch.tensor([[0.25, 0.75]])), torch.tensor([1]))
        tensor([-0.2877])

    .. versionadded:: 0.1.0
    """
    logits_t = as_logits(logits, "logits")
    tokens_t = _as_tokens(tokens, "tokens", logits_t, "logits")
    active = row_mask(mask, "mask", logits_t, "logits")
    dtype = compute_dtype(logits_t)
    transform = logits_transform(
        temperature, final_logit_softcapping, logit_scale, logits_t, active, dtype=dtype
    )
    wanted = validate_statistics(statistics)
    options = (vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p, min_p)
    restriction = restriction_of(
        options,
        shape=tuple(logits_t.shape[:-1]),
        vocab=logits_t.shape[-1],
        device=logits_t.device,
        reference="logits",
    )
    chunk = restricted_chunk_size(chunk_size, logits_t, restriction)
    safe_tokens = torch.where(active, tokens_t.to(torch.int64), 0)  # (B, T) or (N,)
    tau = scalar_temperature(transform, temperature)
    if restriction is None and tau is not None and wanted is None:
        out: torch.Tensor = TokenLogProbsFunction.apply(  # type: ignore[no-untyped-call]
            logits_t, safe_tokens, active, mask is not None, tau, chunk, dtype
        )
        return out
    restriction = restriction or Restriction(None, None)
    call = LogitsCall(transform, dtype, restriction, (), wanted or Wanted())
    outputs = RestrictedLogProbsFunction.apply(  # type: ignore[no-untyped-call]
        logits_t, safe_tokens, active, mask is not None, call, chunk
    )
    if wanted is None:
        return outputs[0]  # type: ignore[no-any-return]
    return statistics_result(wanted, outputs)


def _as_tokens(
    tokens: ArrayLike, name: str, logits: torch.Tensor, logits_name: str
) -> torch.Tensor:
    tokens_t = as_token_ids(tokens, name, logits.device)
    check_same_device({logits_name: logits, name: tokens_t})
    expected = tuple(logits.shape[:-1])
    if tuple(tokens_t.shape) != expected:
        raise ValueError(
            f"{name} must have shape {expected} (the shape of {logits_name} without its last "
            f"dimension V), got shape {tuple(tokens_t.shape)}"
        )
    return tokens_t


@checks_environment
def token_entropy(
    logits: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    temperature: Temperature = 1.0,
    chunk_size: int | None = None,
    vocab_group: VocabGroup = None,
    kept_ids: ArrayLike | None = None,
    kept_pad: int = -1,
    kept_mask: ArrayLike | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    r"""Entropy of the next-token distribution at every position, in float32, chunk by chunk.

    With :math:`p = \mathrm{softmax}(\text{logits} / \tau)` over the vocabulary,

    .. math::

        H_{bt} = -\sum_{v=1}^{V} p_{btv} \log p_{btv}, \qquad
        \frac{\partial H_{bt}}{\partial \text{logits}_{btv}}
        = -\frac{p_{btv} (\log p_{btv} + H_{bt})}{\tau}.

    Terms with :math:`p_v = 0` (e.g. ``-inf`` logits of banned tokens) contribute 0. Memory and
    dtype behaviour as in :func:`token_log_probs`: float32 chunks, only the logits and two
    ``(N,)`` vectors saved, exact gradient in the logits' dtype, no second-order gradients.

    With a kept set the entropy is that of the truncated distribution :math:`q_K` (the one the
    sampler drew from): :math:`H_K = -\sum_{v \in K} q_K(v) \log q_K(v)` (slime's entropy
    stays full-vocabulary). With ``vocab_group`` the slices' entropies are combined as
    :math:`H = \sum_r \pi_r (h_r - \log \pi_r)` (:math:`\pi_r` the slice's mass): one
    all-reduce MAX and one SUM of ``2 N`` floats.

    Args:
        logits: ``(B, T, V)`` or ``(N, V)`` floating logits.
        mask: optional ``(B, T)`` / ``(N,)``; unselected positions give 0 and never reach the
            output or the gradient. Default: every position.
        temperature: :math:`\tau > 0`, or a per-token tensor, as :func:`token_log_probs`.
        chunk_size: rows per chunk, or None for ``max(1, 2**23 // V)``.
        vocab_group: as :func:`token_log_probs`.
        kept_ids: as :func:`token_log_probs`.
        kept_pad: as :func:`token_log_probs`.
        kept_mask: as :func:`token_log_probs`.
        top_k: as :func:`token_log_probs`.
        top_p: as :func:`token_log_probs`.
        min_p: as :func:`token_log_probs`.
        final_logit_softcapping: as :func:`token_log_probs`.
        logit_scale: as :func:`token_log_probs`.

    Returns:
        ``(B, T)`` or ``(N,)`` entropies in nats, float32 (float64 for float64 logits).

    Raises:
        ValueError: on wrong ranks, mismatched shapes or devices, ``temperature <= 0``,
            ``chunk_size < 1``, and for the kept set and ``vocab_group`` as
            :func:`token_log_probs`.
        TypeError: on non-numeric logits or a non-int ``chunk_size``, and as
            :func:`token_log_probs`.

    References:
        Shannon 1948; the entropy bonus of Mnih et al. 2016, A3C, arXiv:1602.01783 Sec. 4, and
        the entropy diagnostics of DAPO, arXiv:2503.14476 Sec. 3.1; verl
        ``vocab_parallel_entropy``, NeMo-RL ``ChunkedDistributedEntropy``.

    Examples:
        >>> import torch
        >>> token_entropy(torch.zeros(1, 4))  # uniform over 4 tokens: log 4
        tensor([1.3863])

    .. versionadded:: 0.1.0
    """
    logits_t = as_logits(logits, "logits")
    active = row_mask(mask, "mask", logits_t, "logits")
    dtype = compute_dtype(logits_t)
    transform = logits_transform(
        temperature, final_logit_softcapping, logit_scale, logits_t, active, dtype=dtype
    )
    options = (vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p, min_p)
    restriction = restriction_of(
        options,
        shape=tuple(logits_t.shape[:-1]),
        vocab=logits_t.shape[-1],
        device=logits_t.device,
        reference="logits",
    )
    chunk = restricted_chunk_size(chunk_size, logits_t, restriction)
    tau = scalar_temperature(transform, temperature)
    if restriction is None and tau is not None:
        out: torch.Tensor = EntropyFunction.apply(  # type: ignore[no-untyped-call]
            logits_t, active, mask is not None, tau, chunk, dtype
        )
        return out
    call = LogitsCall(transform, dtype, restriction or Restriction(None, None), ())
    restricted: torch.Tensor = RestrictedEntropyFunction.apply(  # type: ignore[no-untyped-call]
        logits_t, active, mask is not None, call, chunk
    )
    return restricted
