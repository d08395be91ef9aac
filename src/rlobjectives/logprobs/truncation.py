r"""The sampler's kept set: log-probabilities and entropy over a truncated vocabulary.

With top-k or top-p sampling the engine draws from the renormalised distribution over the kept
set :math:`K` of each position (after the temperature), while a trainer's log-probabilities
are over the whole vocabulary, which biases the importance ratio (its mean is the kept mass).
The log-probability functions take the set as the engines hand it over, or the rule to
recompute it, and return

.. math::

    \log q_K(y) = x_y - \log\sum_{v \in K} e^{x_v} \quad (y \in K), \qquad
    \log q_K(y) = -\infty \quad (y \notin K), \qquad
    H_K = -\sum_{v \in K} q_K(v) \log q_K(v),

with :math:`x = \text{logits} / \tau`. The set is a decision (never differentiated): inside
each chunk the logits outside :math:`K` are set to :math:`-\infty` before the softmax, so the
untruncated chunk math (which already gives banned ``-inf`` tokens probability 0 and
:math:`0 \log 0 = 0`) computes the truncated quantities; a row whose sampled token is outside
the set gets exactly zero gradient (its upstream gradient is dropped with ``torch.where``).

The set, one of (:func:`validate_kept_set`):

- ``kept_ids`` ``(..., K)`` integer ids padded at the end with ``kept_pad`` (vLLM's mask replay,
  slime's ``rollout_top_p_token_ids``): each chunk scatters them into a ``(C, V)`` boolean
  (idempotent: duplicates count once; ids outside ``[0, V)`` other than the pad are ignored);
- ``kept_mask`` ``(..., V)`` bool, True = kept (SGLang's sampling mask, slime's
  ``log_prob_keep_mask``);
- ``min_p`` / ``top_k`` / ``top_p``: the sampler's rule recomputed on the given logits, in
  vLLM V1's order: after the temperature, min-p (keep :math:`p_v \ge p_{min} \max_u p_u`, i.e.
  :math:`x_v \ge \max_u x_u + \log p_{min}`), then top-k, then top-p on the distribution
  renormalised over what is left (vLLM V1's sampler applies min-p as an argmax-invariant logits
  processor before ``apply_top_k_top_p``; its V0 sampler applied min-p after top-k/top-p, which
  differs when top-p is set: the nucleus mass is then taken before min-p's cut), in the
  tie-inclusive threshold form :math:`K = \{v : x_v \ge t\}` (:func:`rule_thresholds`). The
  per-row threshold :math:`t` is computed in the forward pass and saved, so the backward pass
  replays :math:`x_v \ge t` on the recomputed logits instead of sorting again.

A row without a recorded set (every id ``kept_pad`` or outside ``[0, V)``, or an all-False mask
row) keeps the whole vocabulary (slime: "rows without a recorded nucleus stay all-True"; an
empty set cannot have produced a sample). Under vocabulary parallelism
(:mod:`rlobjectives.logprobs.vocab_parallel`) ids are global and each rank restricts its own
slice; ``kept_mask`` is this rank's slice; the top-k threshold is global: each rank sends its
``k`` largest values of every row (an all-gather of ``N k`` floats, in the chunks of the call),
the min-p threshold one all-reduce MAX of ``N`` floats and the top-p mass one all-reduce of
``N`` floats more. top-p alone across ranks would need the whole row sorted (``N V`` values
gathered) and is refused.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._core.chunking import Block
from .._core.validation import (
    ArrayLike,
    as_mask,
    as_token_ids,
    describe,
    validate_scalar,
)
from .vocab_parallel import (
    Shard,
    VocabGroup,
    gather_columns,
    max_over_ranks,
    resolve_shard,
    sum_over_ranks,
)

__all__ = [
    "KeptOptions",
    "KeptSet",
    "Restriction",
    "kept_rows",
    "restrict_",
    "restriction_of",
    "rule_thresholds",
    "validate_kept_set",
]


class KeptSet(NamedTuple):
    """A validated kept set: ids, mask or rule, with its rows flattened.

    Attributes:
        ids: ``(M, K)`` int64 kept ids (global under vocabulary parallelism), or None.
        pad: the padding id of ``ids``.
        mask: ``(M, V)`` bool (this rank's slice of the vocabulary), or None.
        top_k: the rule's k (None: no top-k), with ``ids`` and ``mask`` None.
        top_p: the rule's p in (0, 1) (None: no top-p).
        min_p: the rule's min-p in (0, 1] (None: no min-p).
        recorded: ``(M,)`` bool, whether row m holds a set (ids/mask; others keep everything).
        rows: ``(N,)`` int64: the row of ``ids``/``mask`` of each computed row (the one-token
            shift of :func:`~rlobjectives.response_log_probs`), or None for the identity.
    """

    ids: torch.Tensor | None
    pad: int
    mask: torch.Tensor | None
    top_k: int | None
    top_p: float | None
    recorded: torch.Tensor | None
    rows: torch.Tensor | None
    min_p: float | None = None

    @property
    def rule(self) -> bool:
        """Whether the set is recomputed from the logits (``top_k`` / ``top_p``)."""
        return self.ids is None and self.mask is None


def _validate_top_k(top_k: object) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be a positive int or None, got {describe(top_k)}")
    if top_k < 1:
        raise ValueError(
            f"top_k must be >= 1, got {top_k}; pass top_k=None to disable top-k (vLLM's "
            "top_k=-1 and TRL's top_k=0 mean None)"
        )
    return top_k


def _validate_top_p(top_p: object) -> float | None:
    if top_p is None:
        return None
    value = float(validate_scalar(top_p, "top_p", minimum=0.0, strict=True, allow_tensor=False))  # type: ignore[arg-type]
    if value > 1.0:
        raise ValueError(
            f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}; pass top_p=None "
            "to disable top-p"
        )
    return None if value == 1.0 else value


def _validate_min_p(min_p: object) -> float | None:
    if min_p is None:
        return None
    value = float(validate_scalar(min_p, "min_p", minimum=0.0, allow_tensor=False))  # type: ignore[arg-type]
    if value > 1.0:
        raise ValueError(
            f"min_p must be in [0, 1] (0 keeps every token), got {min_p!r}; pass min_p=None to "
            "disable min-p"
        )
    return None if value == 0.0 else value


def _check_device(tensor: torch.Tensor, name: str, device: torch.device, reference: str) -> None:
    if tensor.device != device:
        raise ValueError(
            f"{name} must be on the same device as {reference} ({device}), got device "
            f"{tensor.device}"
        )


def _leading(
    tensor: torch.Tensor, name: str, shape: tuple[int, ...], packed: bool, last: str
) -> torch.Tensor:
    """``tensor`` ``shape + (last,)``; packed ``(N, last)`` for a ``(1, N)`` shape too."""
    if packed and tensor.ndim == len(shape) and len(shape) == 2 and shape[0] == 1:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != len(shape) + 1 or tuple(tensor.shape[:-1]) != shape:
        raise ValueError(
            f"{name} must have shape {shape} + ({last},) (the shape of the log-probabilities "
            f"and the {last} axis), got shape {tuple(tensor.shape)}"
        )
    return tensor


def validate_kept_set(
    kept_ids: ArrayLike | None,
    kept_pad: int,
    kept_mask: ArrayLike | None,
    top_k: int | None,
    top_p: float | None,
    *,
    shape: tuple[int, ...],
    vocab: int,
    device: torch.device,
    reference: str,
    packed: bool = False,
    shard: Shard | None = None,
    min_p: float | None = None,
) -> KeptSet | None:
    """Validate the kept-set arguments of a log-probability function (module docstring).

    Args:
        kept_ids: the public argument (``(..., K)`` integer ids, padded with ``kept_pad``).
        kept_pad: the padding id of ``kept_ids``.
        kept_mask: the public argument (``(..., V)`` bool).
        top_k: the rule's k, or None.
        top_p: the rule's p, or None.
        shape: the leading shape the set must have (that of the log-probabilities).
        vocab: V of the logits (this rank's slice under vocabulary parallelism).
        device: the logits' device.
        reference: the argument that fixes ``shape`` and the device (for the messages).
        packed: accept ``(N, K)`` / ``(N, V)`` for a ``(1, N)`` ``shape``.
        shard: the vocabulary slice, or None.
        min_p: the rule's min-p, or None.

    Returns:
        The :class:`KeptSet`, or None when nothing is truncated (``top_k >= V``, ``top_p = 1``,
        ``min_p = 0``).

    Raises:
        ValueError: more than one kind of set, a wrong shape or device, ``top_k < 1``,
            ``top_p`` outside ``(0, 1]``, ``min_p`` outside ``[0, 1]``, top-p without top-k
            under vocabulary parallelism.
        TypeError: non-integer ids, a non-int ``kept_pad`` or ``top_k``, a non-number ``top_p``
            or ``min_p``.
    """
    if isinstance(kept_pad, bool) or not isinstance(kept_pad, int):
        raise TypeError(
            f"kept_pad must be an int (the padding id of kept_ids), got {describe(kept_pad)}"
        )
    k = _validate_top_k(top_k)
    p = _validate_top_p(top_p)
    minimum = _validate_min_p(min_p)
    arguments = (
        ("kept_ids", kept_ids),
        ("kept_mask", kept_mask),
        ("top_k", top_k),
        ("top_p", top_p),
        ("min_p", min_p),
    )
    given = [name for name, value in arguments if value is not None]
    if (kept_ids is not None or kept_mask is not None) and len(given) > 1:
        raise ValueError(
            f"{given[0]} and {given[1]} are alternatives: pass kept_ids (the engine's kept "
            "ids), kept_mask (a boolean (..., V) mask) or the rule min_p / top_k / top_p, got "
            + " and ".join(given)
        )
    if kept_ids is not None:
        ids = as_token_ids(kept_ids, "kept_ids", device)
        _check_device(ids, "kept_ids", device, reference)
        ids = _leading(ids, "kept_ids", shape, packed, "K").reshape(-1, ids.shape[-1]).long()
        # ids outside [0, V) are ignored like the pad: a row without a valid id has no set
        total: int | torch.Tensor = vocab if shard is None else shard.vocab_size()
        valid = (ids != kept_pad) & (ids >= 0) & (ids < total)  # (M, K)
        recorded = valid.any(dim=-1)  # (M,)
        return KeptSet(ids, kept_pad, None, None, None, recorded, None)
    if kept_mask is not None:
        mask = as_mask(kept_mask, "kept_mask", device)
        _check_device(mask, "kept_mask", device, reference)
        mask = _leading(mask, "kept_mask", shape, packed, "V")
        if mask.shape[-1] != vocab:
            where = "this rank's slice of the vocabulary" if shard is not None else "the logits"
            raise ValueError(
                f"kept_mask must have V = {vocab} entries in its last dimension ({where}), "
                f"got shape {tuple(mask.shape)}"
            )
        mask = mask.reshape(-1, vocab)
        recorded = mask.any(dim=-1)  # (M,)
        if shard is not None:  # a row's set may lie on other ranks' slices only
            recorded = sum_over_ranks(recorded.to(torch.int64), shard) > 0
        return KeptSet(None, 0, mask, None, None, recorded, None)
    if shard is None and k is not None and k >= vocab:
        k = None  # keeps every token: an exact no-op
    if shard is not None and p is not None and k is None:
        raise ValueError(
            "top_p without top_k is not supported with vocab_group: the nucleus needs each "
            "row sorted over the whole vocabulary (gathering the (N, V) logits); pass top_k "
            "too (vLLM's mask replay needs a finite top_k as well) or the engine's kept_ids"
        )
    if k is None and p is None and minimum is None:
        return None
    return KeptSet(None, 0, None, k, p, None, None, minimum)


def kept_rows(block: Block, leading_shape: tuple[int, ...]) -> slice:
    """The flat row range of ``block`` (``(slice,)`` or ``(b, slice)`` of a ``(B, T)`` layout)."""
    if len(block) == 1:
        rows = block[0]
        assert isinstance(rows, slice)
        return rows
    row, columns = block
    assert isinstance(row, int) and isinstance(columns, slice)
    offset = row * leading_shape[-1]
    return slice(offset + columns.start, offset + columns.stop)


def _restrict_to_ids_(
    scores: torch.Tensor, ids: torch.Tensor, recorded: torch.Tensor, pad: int, shard: Shard | None
) -> None:
    """Keep the logits of ``ids`` ``(C, K)`` only (rows with a recorded set), in place.

    The kept values are gathered, the recorded rows filled with ``-inf`` and the values
    scattered back: two passes over ``(C, V)`` fewer than a boolean mask would take. Invalid
    entries (the pad, ids off this slice or outside ``[0, V)``) point at the row's first valid
    id, so every write to a position carries the same value and duplicates count once.
    """
    size = scores.shape[1]
    local = ids if shard is None else ids - shard.start
    valid = (ids != pad) & (local >= 0) & (local < size)  # (C, K)
    any_valid = valid.any(dim=1, keepdim=True)  # (C, 1)
    first = valid.to(torch.int8).argmax(dim=1, keepdim=True)  # (C, 1) first valid entry
    stand_in = torch.where(any_valid, local.gather(1, first), 0)  # (C, 1)
    index = torch.where(valid, local, stand_in)  # (C, K), in [0, V)
    values = scores.gather(1, index)  # (C, K) the kept logits
    # a recorded row with no id on this slice keeps nothing here: -inf at its stand-in too
    values = torch.where(any_valid | ~recorded.unsqueeze(1), values, -math.inf)
    scores.masked_fill_(recorded.unsqueeze(1), -math.inf)  # rows without a set keep everything
    scores.scatter_(1, index, values)


def restrict_(
    scores: torch.Tensor,
    kept: KeptSet,
    rows: slice,
    shard: Shard | None,
    thresholds: torch.Tensor | None,
    *,
    decide: bool,
    active: torch.Tensor | None = None,
) -> None:
    r"""Set the logits outside the kept set to :math:`-\infty`, in place (``scores`` ``(C, V)``).

    ``rows`` are the flat rows of the chunk. For the rule, ``decide=True`` computes the
    thresholds (:func:`rule_thresholds`) and writes them into ``thresholds[rows]``;
    ``decide=False`` replays the saved ones. ``active`` ``(C,)``: rows to restrict (the others,
    recomputed from zeroed inputs in a backward pass, keep every logit, so their softmax stays
    finite; their gradient is 0 anyway).
    """
    negative = torch.full((), -math.inf, dtype=scores.dtype, device=scores.device)
    if kept.rule:
        assert thresholds is not None
        if decide:
            thresholds[rows] = rule_thresholds(
                scores, kept.top_k, kept.top_p, shard, min_p=kept.min_p
            )
        threshold = thresholds[rows].to(scores.dtype)  # (C,)
        if active is not None:
            threshold = torch.where(active, threshold, negative)
        torch.where(scores >= threshold.unsqueeze(1), scores, negative, out=scores)
        return
    index: slice | torch.Tensor = rows if kept.rows is None else kept.rows[rows]
    assert kept.recorded is not None
    recorded = kept.recorded[index]  # (C,)
    if active is not None:
        recorded = recorded & active
    if kept.ids is not None:
        _restrict_to_ids_(scores, kept.ids[index], recorded, kept.pad, shard)
        return
    assert kept.mask is not None
    keep = kept.mask[index] | ~recorded.unsqueeze(1)  # (C, V): rows without a set keep all
    torch.where(keep, scores, negative, out=scores)


def rule_thresholds(
    scores: torch.Tensor,
    top_k: int | None,
    top_p: float | None,
    shard: Shard | None,
    *,
    min_p: float | None = None,
) -> torch.Tensor:
    r"""Per-row threshold :math:`t` of min-p, then top-k, then top-p: :math:`K = \{v : x_v \ge t\}`.

    min-p: :math:`t_m = \max_u x_u + \log p_{min}` (vLLM keeps :math:`p_v \ge p_{min} \max_u
    p_u`, the same set in exact arithmetic). top-k: :math:`t_k = x_{(k)}`, the k-th largest value
    (every token tied with it is kept, as vLLM masks :math:`x < x_{(k)}`). The two are cuts of
    the same ordering, so their composition is :math:`t_0 = \max(t_m, t_k)`. top-p on the softmax
    :math:`q` over :math:`K_0 = \{x \ge t_0\}`: with the values of :math:`K_0` in decreasing
    order :math:`w_1 \ge w_2 \ge \dots`, :math:`t = w_J` for the largest :math:`J` whose mass
    before it, :math:`\sum_{i<J} q_i`, is below :math:`p`: the smallest prefix whose mass
    reaches :math:`p` (a prefix reaching exactly :math:`p` suffices), the top token always
    kept, ties at the boundary kept together. The masses are compared as :math:`\sum_{i<J}
    e^{w_i - w_1} < p \sum_{v \in K_0} e^{x_v - w_1}` (exact for the dyadic probabilities of
    the golden cases).

    Args:
        scores: ``(C, V)`` logits after the temperature (this rank's slice under vocabulary
            parallelism; every rank must call with the same rows).
        top_k: k, or None.
        top_p: p in (0, 1), or None.
        shard: the slice, or None.
        min_p: min-p in (0, 1], or None.

    Returns:
        ``(C,)`` thresholds in ``scores``' dtype (``-inf`` when nothing is cut).
    """
    threshold = torch.full(
        scores.shape[:1], -math.inf, dtype=scores.dtype, device=scores.device
    )  # (C,)
    if min_p is not None:
        largest = scores.amax(dim=1)  # (C,)
        if shard is not None:
            largest = max_over_ranks(largest, shard)
        threshold = largest + math.log(min_p)
    values = None
    if top_k is not None:
        local = min(top_k, scores.shape[1])
        values = scores.topk(local, dim=1).values  # (C, k) decreasing
        if shard is not None:
            if local < top_k:  # a slice smaller than k: pad with -inf, which any value beats
                values = torch.nn.functional.pad(values, (0, top_k - local), value=-math.inf)
            values = gather_columns(values, shard).topk(top_k, dim=1).values  # (C, k)
        threshold = torch.maximum(threshold, values[:, -1])  # x_(k)
    if top_p is None:
        return threshold
    cut = threshold.unsqueeze(1)  # (C, 1)
    if values is not None:
        ordered = torch.where(values >= cut, values, -math.inf)  # (C, k) the kept values
        top = ordered[:, :1]  # (C, 1) the row's largest value
        inside = scores >= cut
        weights = torch.where(inside, torch.exp(scores - top), 0.0).sum(dim=1)  # (C,)
        total = sum_over_ranks(weights, shard)  # (C,) sum over K_0 of e^{x - w_1}
    else:
        ordered = scores.sort(dim=1, descending=True).values  # (C, V)
        ordered = torch.where(ordered >= cut, ordered, -math.inf)
        top = ordered[:, :1]
        total = torch.exp(ordered - top).sum(dim=1)
    cumulative = torch.exp(ordered - top).cumsum(dim=1)  # (C, m), e^{-inf} = 0 past K_0
    before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # (C, m) mass before each
    below = (before < top_p * total.unsqueeze(1)) & (ordered > -math.inf)
    count = below.sum(dim=1)  # (C,) >= 1 (before_1 = 0)
    return ordered.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)


class Restriction(NamedTuple):
    """The vocabulary slice and the kept set of a call (either may be None, not both)."""

    shard: Shard | None
    kept: KeptSet | None


#: ``(vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p[, min_p])`` as the public functions
#: take them (``min_p`` may be left out: None).
KeptOptions = (
    tuple[VocabGroup, ArrayLike | None, int, ArrayLike | None, int | None, float | None]
    | tuple[
        VocabGroup, ArrayLike | None, int, ArrayLike | None, int | None, float | None, float | None
    ]
)


def restriction_of(
    options: KeptOptions,
    *,
    shape: tuple[int, ...],
    vocab: int,
    device: torch.device,
    reference: str,
    packed: bool = False,
) -> Restriction | None:
    """The vocabulary slice and kept set of a call, or None (the plain call).

    Args:
        options: ``(vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p[, min_p])`` as
            given.
        shape: the leading shape of the kept set (that of the log-probabilities).
        vocab: V of the logits (the local slice under ``vocab_group``).
        device: the device of the logits.
        reference: the argument that fixes the device (for the messages).
        packed: accept ``(N, K)`` for a ``(1, N)`` shape.

    Raises:
        As :func:`validate_kept_set` and :func:`~.vocab_parallel.resolve_shard`.
    """
    vocab_group, kept_ids, kept_pad, kept_mask, top_k, top_p = options[:6]
    min_p = options[6] if len(options) > 6 else None  # type: ignore[misc]
    shard = None
    if vocab_group is not None:
        shard = resolve_shard(vocab_group, vocab, device)
    kept = None
    rule = (top_k, top_p, min_p)
    if not (kept_ids is None and kept_mask is None and all(value is None for value in rule)):
        kept = validate_kept_set(
            kept_ids,
            kept_pad,
            kept_mask,
            top_k,
            top_p,
            shape=shape,
            vocab=vocab,
            device=device,
            reference=reference,
            packed=packed,
            shard=shard,
            min_p=min_p,
        )
    elif isinstance(kept_pad, bool) or not isinstance(kept_pad, int):
        raise TypeError(
            f"kept_pad must be an int (the padding id of kept_ids), got {describe(kept_pad)}"
        )
    if shard is None and kept is None:
        return None
    return Restriction(shard, kept)
