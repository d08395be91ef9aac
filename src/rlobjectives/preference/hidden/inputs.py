r"""The boundary of the hidden-state forms: the LM head, the mask, the sequences, the sides.

The preference form takes the ``[chosen; rejected]`` concatenated batch TRL and Liger use:
padded ``hidden`` ``(2B, T, H)`` with rows ``0..B-1`` the chosen responses and ``B..2B-1`` the
rejected ones, or packed ``(N, H)`` with ``cu_seqlens`` of ``2B`` sequences in that order. The
KTO form takes ``B`` responses. :func:`prepare_rows` validates what both share;
:func:`split_sides` cuts a per-token tensor into the two sides.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..._core.layout import Layout, layout_from_cu_seqlens, packed_layout, padded, token_matrix
from ..._core.validation import (
    ArrayLike,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
)
from ...logprobs.head import Head, HeadOptions, prepare_head
from ...logprobs.passes import LogProbsFromHidden
from ...logprobs.vocab_parallel import VocabGroup, reduce_hidden_gradient

__all__ = [
    "HiddenRows",
    "head_log_probs",
    "per_token_or_sequence",
    "prepare_rows",
    "side_layouts",
    "split_sides",
]


class HiddenRows(NamedTuple):
    """The validated head, mask and sequences of a hidden-state call."""

    head: Head  # flat (N, H) hidden, (N,) tokens
    batch_shape: tuple[int, int]  # (2B, T) padded, (1, N) packed
    mask: torch.Tensor  # bool, batch_shape
    layout: Layout  # the S sequences
    starts: list[int]  # host: each sequence's first flat row
    ends: list[int]  # one past its last row
    packed: bool


def prepare_rows(
    hidden: object,
    weight: object,
    tokens: ArrayLike,
    mask: ArrayLike,
    *,
    bias: object,
    temperature: object,
    chunk_size: int | None,
    cu_seqlens: ArrayLike | None,
    vocab_group: VocabGroup,
    head_options: HeadOptions,
) -> HiddenRows:
    """Validate the LM head, tokens, mask and sequence boundaries (one host read of them).

    ``temperature``: a number or a per-token tensor; ``head_options``: the head's transform and
    precision, as :func:`rlobjectives.token_log_probs_from_hidden` takes them.
    """
    packed = cu_seqlens is not None
    options = (vocab_group, None, -1, None, None, None)
    head, batch_shape = prepare_head(
        hidden, weight, tokens, bias, temperature, chunk_size, packed=packed, options=options,
        head_options=head_options, mask=mask,
    )  # fmt: skip
    device = head.hidden.device
    mask_t = token_matrix(as_mask(mask, "mask", device), "mask", packed)
    check_same_device({"hidden": head.hidden, "mask": mask_t})
    check_shape(mask_t, "mask", batch_shape, "tokens")
    rows, width = batch_shape
    if packed:
        layout = packed_layout(cu_seqlens, width, device=device)
        assert layout.cu_seqlens is not None
        bounds = layout.cu_seqlens.tolist()  # one host read at the boundary
        starts, ends = bounds[:-1], bounds[1:]
    else:
        layout = padded(rows)
        starts = [row * width for row in range(rows)]
        ends = [start + width for start in starts]
    return HiddenRows(head, batch_shape, mask_t, layout, starts, ends, packed)


def per_token_or_sequence(value: ArrayLike, name: str, rows: HiddenRows) -> torch.Tensor:
    """A per-token tensor (``batch_shape``) or per-sequence values ``(S,)`` / ``(S, 1)``.

    Padded, a tensor of ``batch_shape`` is per token; packed, ``(S,)`` is per sequence (also
    when ``N == S``) and ``(N,)`` / ``(1, N)`` per token.
    """
    tensor = as_float_tensor(value, name, rows.head.hidden.device)
    check_same_device({"hidden": rows.head.hidden, name: tensor})
    sequences = rows.layout.num_sequences
    if not rows.packed and tuple(tensor.shape) == tuple(rows.batch_shape):
        return tensor
    if tensor.shape in ((sequences,), (sequences, 1)):
        return tensor.reshape(sequences)
    if rows.packed and tensor.ndim == 1:
        tensor = tensor.reshape(1, -1)
    if tuple(tensor.shape) != tuple(rows.batch_shape):
        what = "S" if rows.packed else "2B"
        raise ValueError(
            f"{name} must have the shape of tokens {tuple(rows.batch_shape)} (per token) or "
            f"({what},) = ({sequences},) (per-sequence sums), got shape {tuple(tensor.shape)}"
        )
    return tensor


def split_sides(
    tensor: torch.Tensor, rows: HiddenRows, pairs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` parts of a per-token ``batch_shape`` or per-sequence ``(2B,)``."""
    if tensor.ndim == 1:
        return tensor[:pairs], tensor[pairs:]
    if not rows.packed:
        return tensor[:pairs], tensor[pairs:]
    cut = rows.starts[pairs] if pairs < len(rows.starts) else rows.batch_shape[1]
    return tensor[:, :cut], tensor[:, cut:]


def side_layouts(rows: HiddenRows, pairs: int) -> tuple[Layout, Layout]:
    """The layouts of the two sides (packed: the boundaries cut at the first rejected row)."""
    if not rows.packed:
        return padded(pairs), padded(pairs)
    bounds = rows.starts + rows.ends[-1:] if rows.ends else [0]
    cut = bounds[pairs]
    device = rows.head.hidden.device
    chosen = torch.tensor(bounds[: pairs + 1], dtype=torch.int64, device=device)
    rejected = torch.tensor([b - cut for b in bounds[pairs:]], dtype=torch.int64, device=device)
    total = rows.batch_shape[1]
    return layout_from_cu_seqlens(chosen, cut), layout_from_cu_seqlens(rejected, total - cut)


def head_log_probs(rows: HiddenRows, active: torch.Tensor) -> torch.Tensor:
    """The token log-probabilities ``batch_shape`` of the chunked pass (recompute in backward).

    :class:`~rlobjectives.logprobs.passes.LogProbsFromHidden`, the pass of
    :func:`rlobjectives.token_log_probs_from_hidden`, in the head's computation dtype; 0 where
    ``active`` is False. Under vocabulary parallelism with ``hidden_grad="reduced"`` the hidden
    states pass through Megatron's copy to the tensor-parallel region first.
    """
    head = rows.head
    if head.shard is not None:
        head = head._replace(hidden=reduce_hidden_gradient(head.hidden, head.shard))
    outputs: tuple[torch.Tensor, torch.Tensor] = LogProbsFromHidden.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head, active.reshape(-1), False
    )
    return outputs[0].reshape(rows.batch_shape)
