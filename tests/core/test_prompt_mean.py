"""``reduction="prompt_mean"``: the token mean within each prompt's responses, averaged over the
prompts (SkyRL PR #1719, AReaL PR #1546), on ``aggregate``, ``nll_loss`` and ``dft_loss``.

Packed == padded, NaN at unselected tokens and the error contract are the shared registries
(``tests/packed_cases.py``, ``tests/nan_cases.py``, ``tests/cases.py``); context parallelism is
``tests/_context_workers.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from peer_transcriptions import (
    AReaLPromptMean,
    skyrl_apply_loss_reduction_to_advantages_minibatch,
    skyrl_reduce_loss,
)
from rlobjectives._core.layout import padded
from rlobjectives._core.reduction import (
    ReductionSpec,
    prompt_groups,
    row_weights,
    token_gradient_weights,
)

D = torch.float64


def test_golden() -> None:
    # Prompt 0 = rows 0, 1: selected values 1, 2 | 4 -> N_0 = 3, mean 7/3.
    # Prompt 1 = rows 2, 3: nothing | 1, 1, 1 -> N_1 = 3, mean 1.
    # Prompt 2 = rows 4, 5: nothing selected -> not counted (AReaL); SkyRL counts it.
    # prompt_mean = (7/3 + 1) / 2 = 5/3; with normalizer=3 (SkyRL): (7/3 + 1) / 3 = 10/9.
    values = torch.tensor(
        [[1.0, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1], [5, 5, 5], [6, 6, 6]], dtype=D
    )
    mask = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.bool
    )
    out = rlo.aggregate(values, mask, reduction="prompt_mean", group_size=2)
    assert torch.allclose(out, torch.tensor(5 / 3, dtype=D), rtol=0, atol=1e-15)
    skyrl = rlo.aggregate(values, mask, reduction="prompt_mean", group_size=2, normalizer=3)
    assert torch.allclose(skyrl, torch.tensor(10 / 9, dtype=D), rtol=0, atol=1e-15)
    # the same prompts by label, in any order: rows 0 and 1 -> "x", 2, 3 -> "y", 4, 5 -> "z"
    ids = ["x", "x", "y", "y", "z", "z"]
    assert torch.equal(rlo.aggregate(values, mask, reduction="prompt_mean", group_ids=ids), out)
    # nll_loss and dft_loss reduce -l and -p l the same way
    nll = rlo.nll_loss(-values, mask, reduction="prompt_mean", group_size=2)
    assert torch.allclose(nll, out, rtol=0, atol=1e-15)
    # gradient: d/dL_it = 1 / (N_p D) = 1/6 at each selected token (N_p = 3, D = 2), 0 elsewhere
    leaf = values.clone().requires_grad_(True)
    rlo.aggregate(leaf, mask, reduction="prompt_mean", group_size=2).backward()
    expected = torch.where(mask, torch.tensor(1 / 6, dtype=D), torch.tensor(0.0, dtype=D))
    torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=1e-16)


def _labels(draw: st.DrawFn, batch: int) -> list[int]:
    return draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matches_the_reference(data: st.DataObject) -> None:
    batch = data.draw(st.integers(0, 6))
    tokens = data.draw(st.integers(0, 5))
    seed = data.draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, tokens, generator=generator, dtype=D)
    mask = torch.rand(batch, tokens, generator=generator) < 0.6
    labels = data.draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch))
    normalizer = data.draw(st.sampled_from([None, 0.5, 4.0]))
    function = data.draw(st.sampled_from(["aggregate", "nll_loss", "dft_loss"]))
    leaf = values.clone().requires_grad_(True)
    inputs = -leaf.abs() if function != "aggregate" else leaf
    ours = getattr(rlo, function)(
        inputs, mask, reduction="prompt_mean", group_ids=labels, normalizer=normalizer
    )
    expected_leaf = values.clone().requires_grad_(True)
    expected_inputs = -expected_leaf.abs() if function != "aggregate" else expected_leaf
    if function == "aggregate":
        losses = {(i, t): expected_inputs[i, t] for i, t in reference._selected_tokens(mask)}
        expected = reference.reduce_losses(
            losses, (batch, tokens), reduction="prompt_mean", normalizer=normalizer, labels=labels
        )
    else:
        expected = getattr(reference, function)(
            expected_inputs, mask, reduction="prompt_mean", normalizer=normalizer, labels=labels
        )
    torch.testing.assert_close(ours, expected, rtol=1e-13, atol=1e-14)
    if ours.requires_grad and expected.requires_grad:
        ours.backward()
        expected.backward()
        torch.testing.assert_close(leaf.grad, expected_leaf.grad, rtol=1e-13, atol=1e-14)


def _prompt_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows of 6 prompts with 1 to 4 responses each (one prompt with nothing selected)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [3, 1, 4, 2, 2, 3]
    rows, tokens = sum(sizes), 7
    values = torch.randn(rows, tokens, generator=generator, dtype=D)
    lengths = torch.randint(0, tokens + 1, (rows,), generator=generator)
    mask = torch.arange(tokens) < lengths[:, None]
    mask[3:4] = False  # prompt 1 (one response) selects nothing
    return values, mask, sizes


def test_equals_skyrl_and_areal() -> None:
    values, mask, sizes = _prompt_batch(35001)
    labels = [p for p, size in enumerate(sizes) for _ in range(size)]
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    boundaries = [(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    # SkyRL scales the advantages (any per-token loss linear in them) and sums: P counts every
    # prompt, the empty one included -> normalizer = P
    scaled = skyrl_apply_loss_reduction_to_advantages_minibatch(
        values, mask.to(D), "prompt_mean", boundaries
    )
    skyrl = skyrl_reduce_loss(scaled, mask.to(D))
    ours = rlo.aggregate(
        values, mask, reduction="prompt_mean", group_ids=labels, normalizer=len(sizes)
    )
    torch.testing.assert_close(ours, skyrl, rtol=1e-15, atol=1e-15)
    # AReaL (PR #1546): the non-empty prompts -> the default
    areal = AReaLPromptMean().aggregate(values, mask, group_sizes=sizes)
    default = rlo.aggregate(values, mask, reduction="prompt_mean", group_ids=labels)
    torch.testing.assert_close(default, areal, rtol=1e-15, atol=1e-15)
    assert float(AReaLPromptMean().normalizer(mask, group_sizes=sizes)) == len(sizes) - 1
    # packed, as AReaL takes it (cu_seqlens over the sequences' selected runs)
    packed = rlo.pack(values, mask)
    areal_packed = AReaLPromptMean().aggregate(
        packed.values, torch.ones_like(packed.values, dtype=torch.bool),
        cu_seqlens=packed.cu_seqlens, group_sizes=sizes,
    )  # fmt: skip
    ours_packed = rlo.aggregate(
        packed.values, torch.ones_like(packed.values, dtype=torch.bool),
        reduction="prompt_mean", group_ids=labels, cu_seqlens=packed.cu_seqlens,
    )  # fmt: skip
    torch.testing.assert_close(ours_packed, areal_packed, rtol=1e-15, atol=1e-15)


def test_micro_batches_with_the_global_count_sum_to_the_full_batch() -> None:
    # Micro-batches hold whole prompts (as SkyRL's mini-batch boundaries and AReaL's
    # granularity); each is padded to its own width; the global count of non-empty prompts as
    # normalizer makes the losses and gradients add up.
    values, mask, sizes = _prompt_batch(35002)
    labels = torch.tensor([p for p, size in enumerate(sizes) for _ in range(size)])
    leaf = values.clone().requires_grad_(True)
    full = rlo.aggregate(leaf, mask, reduction="prompt_mean", group_ids=labels)
    (full_grad,) = torch.autograd.grad(full, leaf)
    nonempty = int(sum(bool(mask[labels == p].any()) for p in range(len(sizes))))
    split = [0, 4, 8, 12, 15]  # prompts {0, 1} | {2} | {3, 4} | {5}
    total = torch.zeros((), dtype=D)
    grads = torch.zeros_like(values)
    for start, end in zip(split[:-1], split[1:], strict=True):
        width = int(mask[start:end].sum(-1).max()) if end > start else 0
        part = leaf[start:end, :width]
        out = rlo.aggregate(
            part, mask[start:end, :width], reduction="prompt_mean",
            group_ids=labels[start:end], normalizer=nonempty,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(out, leaf)
        total, grads = total + out.detach(), grads + grad
    torch.testing.assert_close(total, full.detach(), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(grads, full_grad, rtol=1e-14, atol=1e-15)
    # averaging local prompt means instead (no global count) is a different loss
    naive = sum(
        rlo.aggregate(values[a:b], mask[a:b], reduction="prompt_mean", group_ids=labels[a:b])
        for a, b in zip(split[:-1], split[1:], strict=True)
    ) / (len(split) - 1)
    assert abs(float(naive) - float(full.detach())) > 1e-3


def test_group_size_and_ids_agree_and_any_order_works() -> None:
    values, mask, _ = _prompt_batch(35003)
    rows = values.shape[0] - 1  # 14 rows: groups of 2 and 7
    values, mask = values[:rows], mask[:rows]
    for size in (1, 2, 7, 14):
        by_size = rlo.aggregate(values, mask, reduction="prompt_mean", group_size=size)
        by_ids = rlo.aggregate(
            values, mask, reduction="prompt_mean", group_ids=torch.arange(rows) // size
        )
        assert torch.equal(by_size, by_ids)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    shuffled = rlo.aggregate(
        values[order],
        mask[order],
        reduction="prompt_mean",
        group_ids=(torch.arange(rows) // 2)[order],
    )
    torch.testing.assert_close(
        shuffled, rlo.aggregate(values, mask, reduction="prompt_mean", group_size=2)
    )
    # group_size=1 is sequence_mean; one group is token_mean
    torch.testing.assert_close(
        rlo.aggregate(values, mask, reduction="prompt_mean", group_size=1),
        rlo.aggregate(values, mask, reduction="sequence_mean"),
    )
    torch.testing.assert_close(
        rlo.aggregate(values, mask, reduction="prompt_mean", group_size=rows),
        rlo.aggregate(values, mask, reduction="token_mean"),
    )


def test_row_weights_are_the_gradient_for_the_fused_paths() -> None:
    # The per-token weights every fused path reads (row_weights + token_gradient_weights) are
    # the gradient of the autograd reduction: the lead wires policy_loss through them.
    values, mask, sizes = _prompt_batch(35004)
    labels = [p for p, size in enumerate(sizes) for _ in range(size)]
    groups = prompt_groups(None, labels, values.shape[0], values.device)
    spec = ReductionSpec("prompt_mean", None, 1.0, groups)
    layout = padded(values.shape[0])
    weights = row_weights(mask.sum(-1), spec, dtype=D, batch=values.shape[0])
    per_token = token_gradient_weights(weights, layout, D).expand(mask.shape)
    leaf = values.clone().requires_grad_(True)
    rlo.aggregate(leaf, mask, reduction="prompt_mean", group_ids=labels).backward()
    torch.testing.assert_close(torch.where(mask, per_token, 0.0), leaf.grad, rtol=1e-15, atol=0)


def test_half_precision_and_empty() -> None:
    values = torch.randn(4, 3, dtype=torch.bfloat16)
    mask = torch.rand(4, 3) < 0.7
    out = rlo.aggregate(values, mask, reduction="prompt_mean", group_size=2)
    wide = rlo.aggregate(values.float(), mask, reduction="prompt_mean", group_size=2)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.to(torch.bfloat16))
    empty = rlo.aggregate(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool),
                          reduction="prompt_mean", group_size=2)  # fmt: skip
    assert float(empty) == 0.0
    assert float(rlo.aggregate(values, torch.zeros_like(mask), reduction="prompt_mean",
                               group_size=2)) == 0.0  # fmt: skip


def test_refusals_name_the_groups() -> None:
    values, mask = torch.randn(4, 3), torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^reduction 'prompt_mean' needs the prompt groups"):
        rlo.aggregate(values, mask, reduction="prompt_mean")
    with pytest.raises(ValueError, match=r"which this function does not take: aggregate"):
        rlo.kl_loss(values, values, mask, reduction="prompt_mean")
    with pytest.raises(ValueError, match=r"^group_size 3 does not divide the 4 sequences"):
        rlo.aggregate(values, mask, reduction="prompt_mean", group_size=3)
    with pytest.raises(ValueError, match=r"^pass exactly one of group_size"):
        rlo.aggregate(values, mask, reduction="prompt_mean", group_size=2, group_ids=[0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"prompt counts"):
        rlo.normalizer_for_reduction(rlo.global_normalizers(mask), reduction="prompt_mean")
    # the groups are validated (and unused) under another reduction
    assert torch.equal(rlo.aggregate(values, mask, group_size=2), rlo.aggregate(values, mask))


@pytest.mark.compile
def test_under_torch_compile() -> None:
    values, mask, sizes = _prompt_batch(35005)
    values = values.float()
    ids = torch.tensor([p for p, size in enumerate(sizes) for _ in range(size)])

    def step(x: torch.Tensor) -> torch.Tensor:
        by_ids = rlo.aggregate(x, mask, reduction="prompt_mean", group_ids=ids)
        nll = rlo.nll_loss(-x.abs(), mask, reduction="prompt_mean", group_size=5, normalizer=7.0)
        dft = rlo.dft_loss(-x.abs(), mask, reduction="prompt_mean", group_size=3)
        return by_ids + nll + dft

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(values), step(values))
