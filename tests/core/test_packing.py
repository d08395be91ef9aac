"""pack / unpack, cu_seqlens validation, packed micro-batches, packed causal-LM alignment, compile.

The equality of every function on the packed and the padded layout is in
``tests/test_packed_layout.py``; this file tests the layout itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from packed_cases import make_batch, make_tensors
from rlobjectives._core.layout import _traced_sequence_ids
from tolerances import LAYOUT_TOLERANCE

F64 = torch.float64

# --------------------------------------------------------------------------------------------
# pack / unpack
# --------------------------------------------------------------------------------------------


def test_pack_unpack_golden() -> None:
    # Row 0 right-padded [a b _], row 1 empty, row 2 left-padded [_ c d]:
    # packed = [a b c d], cu_seqlens = [0, 2, 2, 4] (lengths 2, 0, 2).
    values = torch.tensor([[1.0, 2.0, 9.0], [9.0, 9.0, 9.0], [9.0, 3.0, 4.0]])
    attention = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    packed = rlo.pack(values, attention)
    assert packed.values.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert packed.cu_seqlens.tolist() == [0, 2, 2, 4]
    right = rlo.unpack(packed.values, packed.cu_seqlens)  # width = longest = 2
    assert right.values.tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]
    assert right.mask.tolist() == [[True, True], [False, False], [True, True]]
    left = rlo.unpack(packed.values[None], packed.cu_seqlens, length=3, padding_side="left")
    assert left.values.tolist() == [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [0.0, 3.0, 4.0]]
    assert left.mask.tolist() == [[False, True, True], [False, False, False], [False, True, True]]


@settings(max_examples=20)
@given(
    lengths=st.lists(st.integers(0, 5), max_size=5),
    extra=st.integers(0, 2),
    side=st.sampled_from(["right", "left"]),
    features=st.sampled_from([(), (3,)]),
)
def test_pack_unpack_match_reference(
    lengths: list[int], extra: int, side: str, features: tuple[int, ...]
) -> None:
    batch = make_batch(lengths, extra, side, seed=len(lengths))
    width = batch.attention.shape[1]
    values = torch.randn(*batch.attention.shape, *features, dtype=F64, requires_grad=True)
    packed = rlo.pack(values, batch.attention)
    expected, cu_seqlens = reference.pack(values, batch.attention)
    assert packed.cu_seqlens.tolist() == cu_seqlens
    assert torch.equal(packed.values, expected)
    unpacked = rlo.unpack(packed.values, packed.cu_seqlens, length=width, padding_side=side)
    expected_values, expected_mask = reference.unpack(
        packed.values, cu_seqlens, width, padding_side=side
    )
    assert torch.equal(unpacked.mask, expected_mask) and torch.equal(unpacked.mask, batch.attention)
    assert torch.equal(unpacked.values, expected_values)
    # round trip: unpack(pack(x)) is x at the sequences' positions; gradients are the gather's
    keep = batch.attention.reshape(*batch.attention.shape, *(1,) * len(features))
    assert torch.equal(unpacked.values, torch.where(keep, values, 0.0))
    shape = unpacked.values.shape
    weights = torch.linspace(-1, 2, unpacked.values.numel(), dtype=F64).reshape(shape)
    (grad,) = torch.autograd.grad((unpacked.values * weights).sum(), values, retain_graph=True)
    expected_grad = torch.zeros_like(values)  # no token at all: the reference has no graph
    if expected_values.requires_grad:
        (expected_grad,) = torch.autograd.grad((expected_values * weights).sum(), values)
    assert torch.equal(grad, expected_grad)


def test_pack_errors() -> None:
    with pytest.raises(ValueError, match=r"attention_mask must have the shape \(B, T\)"):
        rlo.pack(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        rlo.pack(torch.zeros(2, 3), torch.ones(2, 3, 1))
    with pytest.raises(ValueError, match="padding_side must be one of"):
        rlo.unpack(torch.zeros(2), torch.tensor([0, 2]), padding_side="middle")
    with pytest.raises(ValueError, match=r"length must be >= the longest sequence 2, got 1"):
        rlo.unpack(torch.zeros(3), torch.tensor([0, 2, 3]), length=1)


# --------------------------------------------------------------------------------------------
# cu_seqlens validation: every function that takes it
# --------------------------------------------------------------------------------------------

N = 4
TOKENS = torch.zeros(N)
MASK = torch.ones(N, dtype=torch.bool)
HIDDEN, WEIGHT = torch.zeros(N, 3), torch.zeros(5, 3)
IDS = torch.zeros(N, dtype=torch.int64)
SCORES = torch.zeros(2)

CALLS: dict[str, Callable[[Any], object]] = {
    "policy_loss": lambda cu: rlo.policy_loss(TOKENS, TOKENS, SCORES, MASK, cu_seqlens=cu),
    "aggregate": lambda cu: rlo.aggregate(TOKENS, MASK, cu_seqlens=cu),
    "grpo_clipped_surrogate": lambda cu: rlo.grpo_clipped_surrogate(
        TOKENS, TOKENS, SCORES, MASK, 0.2, cu_seqlens=cu
    ),
    "kl_loss": lambda cu: rlo.kl_loss(TOKENS, TOKENS, MASK, estimator="k2", cu_seqlens=cu),
    "kl_penalized_rewards": lambda cu: rlo.kl_penalized_rewards(
        TOKENS, TOKENS, SCORES, MASK, 0.1, cu_seqlens=cu
    ),
    "kl_penalized_token_rewards": lambda cu: rlo.kl_penalized_token_rewards(
        TOKENS, TOKENS, SCORES, MASK, kl_coef=0.1, cu_seqlens=cu
    ),
    "token_log_probs_from_hidden": lambda cu: rlo.token_log_probs_from_hidden(
        HIDDEN, WEIGHT, IDS, cu_seqlens=cu
    ),
    "fused_policy_loss_from_hidden": lambda cu: rlo.fused_policy_loss_from_hidden(
        HIDDEN, WEIGHT, IDS, TOKENS, SCORES, MASK, cu_seqlens=cu
    ),
    "response_log_probs": lambda cu: rlo.response_log_probs(
        torch.zeros(N, 5), IDS, torch.ones(2, dtype=torch.int64), None, cu_seqlens=cu
    ),
    "response_alignment": lambda cu: rlo.response_alignment(
        IDS, torch.ones(2, dtype=torch.int64), None, cu_seqlens=cu
    ),
    "full_vocab_kl_loss": lambda cu: rlo.full_vocab_kl_loss(
        torch.zeros(N, 5), torch.zeros(N, 5), MASK, cu_seqlens=cu
    ),
    "global_normalizers": lambda cu: rlo.global_normalizers(MASK, cu_seqlens=cu),
    "gae": lambda cu: rlo.gae(TOKENS, TOKENS, MASK, gamma=0.9, lam=0.9, cu_seqlens=cu),
    "reinforce_plus_plus_advantages": lambda cu: rlo.reinforce_plus_plus_advantages(
        SCORES, MASK, cu_seqlens=cu
    ),
    "value_loss": lambda cu: rlo.value_loss(TOKENS, TOKENS, TOKENS, MASK, cu_seqlens=cu),
    "opo_advantages": lambda cu: rlo.opo_advantages(SCORES, MASK, 2, cu_seqlens=cu),
    "remax_advantages": lambda cu: rlo.remax_advantages(TOKENS, SCORES, mask=MASK, cu_seqlens=cu),
    "unpack": lambda cu: rlo.unpack(TOKENS, cu),
}

MALFORMED = {
    "decreasing": (torch.tensor([0, 3, 1, 4]), "must be non-decreasing"),
    "not starting at 0": (torch.tensor([1, 2, 4]), r"must start at 0, got cu_seqlens\[0\] = 1"),
    "not ending at N": (torch.tensor([0, 2, 3]), "must end at N = 4"),
    "float dtype": (torch.tensor([0.0, 2.0, 4.0]), "must be an integer tensor.*float32"),
    "bool dtype": (torch.tensor([False, True]), "must be an integer tensor.*bool"),
    "rank 2": (torch.tensor([[0, 2, 4]]), r"must have shape \(S \+ 1,\).*got shape \(1, 3\)"),
    "empty": (torch.zeros(0, dtype=torch.int64), r"must have shape.*got shape \(0,\)"),
}


@pytest.mark.parametrize("function", CALLS)
@pytest.mark.parametrize("malformed", MALFORMED)
def test_malformed_cu_seqlens_raise(function: str, malformed: str) -> None:
    cu_seqlens, match = MALFORMED[malformed]
    with pytest.raises(ValueError, match="cu_seqlens " + match):
        CALLS[function](cu_seqlens)


@pytest.mark.parametrize("function", CALLS)
def test_well_formed_cu_seqlens_pass(function: str) -> None:
    # int32 (flash-attention's dtype) and Python lists are accepted; an empty sequence is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
        CALLS[function](torch.tensor([0, 1, 4], dtype=torch.int32))
        CALLS[function]([0, 1, 4])


def test_packed_shape_errors() -> None:
    cu = torch.tensor([0, 1, 4])
    with pytest.raises(ValueError, match=r"log_probs must have shape \(N,\) or \(1, N\)"):
        rlo.policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), SCORES, MASK, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"advantages must have shape \(S,\) = \(2,\)"):
        rlo.policy_loss(TOKENS, TOKENS, torch.zeros(3), MASK, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"rewards must have shape \(S,\) = \(2,\)"):
        rlo.kl_penalized_rewards(TOKENS, TOKENS, torch.zeros(4), MASK, 0.1, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"hidden must have shape \(B, T, H\)"):
        rlo.token_log_probs_from_hidden(HIDDEN, WEIGHT, IDS)  # (N, H) needs cu_seqlens
    with pytest.raises(ValueError, match="response_length does not apply to the packed"):
        rlo.response_alignment(IDS, [1, 1], None, response_length=2, cu_seqlens=cu)
    with pytest.raises(ValueError, match="prompt_lengths must leave at least one prompt token"):
        rlo.response_alignment(IDS, [1, 0], None, cu_seqlens=cu)
    with pytest.raises(ValueError, match="prompt_lengths must leave the response inside"):
        rlo.response_alignment(IDS, [2, 1], None, cu_seqlens=cu)


# --------------------------------------------------------------------------------------------
# Per-sequence inputs, the default Dr. GRPO constant
# --------------------------------------------------------------------------------------------


def test_advantage_forms_and_default_constant() -> None:
    batch = make_batch([3, 0, 1, 5], extra=0, side="right", seed=5)
    tensors = make_tensors(batch, poison=True)
    lp, old = (batch.pack(tensors[name]) for name in ("log_probs", "old_log_probs"))
    mask, cu = batch.pack(batch.mask), batch.cu_seqlens
    advantages = tensors["advantages"]
    options: dict[str, Any] = {"reduction": "sequence_sum_normalized", "cu_seqlens": cu}
    per_sequence = rlo.policy_loss(lp, old, advantages, mask, **options).loss
    column = rlo.policy_loss(lp, old, advantages[:, None], mask, **options).loss
    token_advantages = batch.pack(advantages[:, None].expand(4, 5))  # (N,), N = 9 != S
    per_token = rlo.policy_loss(lp, old, token_advantages, mask, **options)
    assert torch.equal(per_sequence, column)
    torch.testing.assert_close(per_token.loss, per_sequence, **LAYOUT_TOLERANCE)
    # Default C: the longest sequence (5) = the padded width T of this batch (no extra padding).
    padded = rlo.policy_loss(
        tensors["log_probs"], tensors["old_log_probs"], advantages, batch.mask,
        reduction="sequence_sum_normalized",
    )  # fmt: skip
    torch.testing.assert_close(per_sequence, padded.loss, **LAYOUT_TOLERANCE)
    explicit = rlo.policy_loss(lp, old, advantages, mask, max_response_length=5, **options)
    assert torch.equal(explicit.loss, per_sequence)


# --------------------------------------------------------------------------------------------
# Long sequences: the packed recursions (recursive doubling) vs the padded blocked scan
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gamma", "lam", "holes"), [(0.9, 0.8, "skip"), (0.99, 0.95, "zero")])
def test_packed_advantages_on_long_sequences(gamma: float, lam: float, holes: str) -> None:
    # Hundreds of tokens: the padded scan works in several blocks (gamma * lam = 0.72: ~100
    # tokens each) and the packed one in ceil(log2 N) doubling steps; they agree to rounding.
    batch = make_batch([300, 0, 1, 517, 64], extra=3, side="right", seed=7)
    tensors = make_tensors(batch, poison=True)
    rewards, values, cu = tensors["token_rewards"], tensors["values"], batch.cu_seqlens
    padded = rlo.gae(rewards, values, batch.mask, gamma=gamma, lam=lam, holes=holes)
    packed = rlo.gae(
        batch.pack(rewards), batch.pack(values), batch.pack(batch.mask), gamma=gamma, lam=lam,
        holes=holes, cu_seqlens=cu,
    )  # fmt: skip
    for name in ("advantages", "returns"):
        expected = batch.pack(getattr(padded, name))
        torch.testing.assert_close(getattr(packed, name), expected, **LAYOUT_TOLERANCE)
    scores = tensors["rewards"]
    padded_rpp = rlo.reinforce_plus_plus_advantages(
        scores, batch.mask, token_rewards=rewards, gamma=gamma
    )
    packed_rpp = rlo.reinforce_plus_plus_advantages(
        scores, batch.pack(batch.mask), token_rewards=batch.pack(rewards), gamma=gamma,
        cu_seqlens=cu,
    )  # fmt: skip
    torch.testing.assert_close(packed_rpp, batch.pack(padded_rpp), **LAYOUT_TOLERANCE)


# --------------------------------------------------------------------------------------------
# Micro-batches of packed rows with the global normaliser
# --------------------------------------------------------------------------------------------


def _packed_rows(batch: Any, tensors: dict[str, torch.Tensor], rows: list[int]) -> dict[str, Any]:
    """The sequences ``rows`` of a padded batch as one packed micro-batch."""
    attention = batch.attention[rows]
    packed = {
        name: rlo.pack(tensors[name][rows], attention).values
        for name in ("log_probs", "old_log_probs")
    }
    packed["mask"] = rlo.pack(batch.mask[rows], attention).values
    packed["advantages"] = tensors["advantages"][rows]
    packed["cu_seqlens"] = rlo.pack(batch.mask[rows], attention).cu_seqlens
    return packed


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sequence_sum_normalized"])
def test_packed_micro_batches_with_global_normalizer_equal_the_full_batch(reduction: str) -> None:
    batch = make_batch([4, 0, 1, 7, 2, 0, 5], extra=1, side="left", seed=11)
    tensors = make_tensors(batch, poison=True)
    pieces = [_packed_rows(batch, tensors, rows) for rows in ([0, 1, 2], [3], [4, 5, 6])]
    counts = rlo.global_normalizers(
        [piece["mask"] for piece in pieces], cu_seqlens=[piece["cu_seqlens"] for piece in pieces]
    )
    options = {"reduction": reduction, "max_response_length": 7, "surrogate": rlo.Clip(high=0.28)}
    normalizer = rlo.normalizer_for_reduction(counts, reduction=reduction)
    total = torch.zeros((), dtype=F64)
    diagnostics = []
    for piece in pieces:
        out = rlo.policy_loss(
            piece["log_probs"], piece["old_log_probs"], piece["advantages"], piece["mask"],
            cu_seqlens=piece["cu_seqlens"], normalizer=normalizer,
            diagnostics_normalizer=counts.tokens, **options,
        )  # fmt: skip
        total = total + out.loss
        diagnostics.append(out.diagnostics)
    full = _packed_rows(batch, tensors, list(range(7)))
    expected = rlo.policy_loss(
        full["log_probs"], full["old_log_probs"], full["advantages"], full["mask"],
        cu_seqlens=full["cu_seqlens"], **options,
    )  # fmt: skip
    torch.testing.assert_close(total, expected.loss, **LAYOUT_TOLERANCE)
    leaf = tensors["log_probs_leaf"]
    (grad,) = torch.autograd.grad(total, leaf, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected.loss, leaf)
    torch.testing.assert_close(grad, expected_grad, **LAYOUT_TOLERANCE)
    summed = rlo.sum_diagnostics(diagnostics)
    for field, value in summed._asdict().items():
        torch.testing.assert_close(value, getattr(expected.diagnostics, field), **LAYOUT_TOLERANCE)
    assert counts.sequences == 7
    assert counts.sequences_nonempty == int((batch.mask.sum(-1) > 0).sum())


# --------------------------------------------------------------------------------------------
# Causal-LM alignment on packed rows
# --------------------------------------------------------------------------------------------


def _sequences(prompts: list[int], responses: list[int], side: str) -> tuple[torch.Tensor, ...]:
    """Padded ``[prompt, response]`` rows (left or right padded) and their attention mask."""
    lengths = [p + r for p, r in zip(prompts, responses, strict=True)]
    batch = make_batch(lengths, extra=1, side=side, seed=sum(lengths))
    ids = torch.randint(0, 6, batch.attention.shape, generator=torch.Generator().manual_seed(1))
    return ids, batch.attention, torch.tensor(prompts)


@settings(max_examples=12)
@given(
    shape=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3)), min_size=1, max_size=4),
    side=st.sampled_from(["right", "left"]),
)
def test_packed_response_log_probs_equal_padded(shape: list[tuple[int, int]], side: str) -> None:
    prompts, responses = [p for p, _ in shape], [r for _, r in shape]
    ids, attention, prompt_lengths = _sequences(prompts, responses, side)
    logits = torch.randn(*ids.shape, 6, dtype=F64, requires_grad=True)
    padded = rlo.response_log_probs(logits, ids, prompt_lengths, attention, chunk_size=3)
    packed_ids = rlo.pack(ids, attention)
    packed = rlo.response_log_probs(
        rlo.pack(logits, attention).values, packed_ids.values, prompt_lengths, None,
        cu_seqlens=packed_ids.cu_seqlens, chunk_size=3,
    )  # fmt: skip
    assert packed.log_probs.shape == packed_ids.values.shape
    assert int(packed.mask.sum()) == sum(responses) == int(padded.mask.sum())
    # Response tokens in sequence order: the padded (B, R) rows, the packed positions.
    assert torch.equal(packed.log_probs[packed.mask], padded.log_probs[padded.mask])
    (grad,) = torch.autograd.grad(packed.log_probs.sum(), logits)
    (expected,) = torch.autograd.grad(padded.log_probs.sum(), logits)
    torch.testing.assert_close(grad, expected, **LAYOUT_TOLERANCE)
    # The same tokens given by their absolute start in the packed row.
    starts = packed_ids.cu_seqlens[:-1] + prompt_lengths
    alignment = rlo.response_alignment(
        packed_ids.values, None, None, response_start=starts, cu_seqlens=packed_ids.cu_seqlens
    )
    assert torch.equal(alignment.mask, packed.mask)


def test_packed_shift_never_crosses_a_boundary() -> None:
    # Two sequences [p r r | p r]: token 3 (the second prompt) is not scored, and token 4 is
    # scored by row 3 (its own prompt), whatever row 2 (the end of sequence 0) holds.
    ids = torch.tensor([1, 2, 3, 4, 5])
    cu = torch.tensor([0, 3, 5])
    logits = torch.randn(5, 6, dtype=F64)
    out = rlo.response_log_probs(logits, ids, torch.tensor([1, 1]), None, cu_seqlens=cu)
    assert out.mask.tolist() == [False, True, True, False, True]
    expected = torch.log_softmax(logits, -1)
    assert out.log_probs[4] == expected[3, 5] and out.log_probs[1] == expected[0, 2]
    changed = logits.clone()
    changed[2] = float("nan")  # the last row of sequence 0 predicts nothing inside it
    again = rlo.response_log_probs(changed, ids, torch.tensor([1, 1]), None, cu_seqlens=cu)
    assert torch.equal(again.log_probs, out.log_probs)
    # Without the host check a prompt of length 0 still never reaches across: token 3 unscored.
    unchecked = rlo.response_alignment(ids, [1, 0], None, cu_seqlens=cu, check_layout=False)
    assert unchecked.mask.tolist() == [False, True, True, False, True]


# --------------------------------------------------------------------------------------------
# torch.compile (one compile)
# --------------------------------------------------------------------------------------------


def test_traced_sequence_ids_equal_eager() -> None:
    # The ids built while tracing (boundary counts + cumsum) equal repeat_interleave's, with
    # empty sequences anywhere (first, middle, last) and an empty row.
    generator = torch.Generator().manual_seed(4)
    for lengths in (
        [0, 3, 0, 0, 2, 0],
        [5],
        [0],
        [],
        *(torch.randint(0, 4, (9,), generator=generator).tolist() for _ in range(3)),
    ):
        cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
        tokens = int(cu[-1])
        eager = torch.repeat_interleave(cu.diff(), output_size=tokens)
        assert torch.equal(_traced_sequence_ids(cu, tokens), eager), lengths


@pytest.mark.compile
def test_compiled_packed_policy_loss() -> None:
    batch = make_batch([3, 0, 1, 6, 2], extra=0, side="right", seed=2)
    tensors = make_tensors(batch, poison=True)
    inputs = [batch.pack(tensors[n]).detach() for n in ("log_probs", "old_log_probs")]
    mask, cu, advantages = batch.pack(batch.mask), batch.cu_seqlens, tensors["advantages"]

    def step(log_probs: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = rlo.policy_loss(
            log_probs, old, advantages, mask, reduction="sequence_mean", ratio_level="sequence",
            surrogate=rlo.Clip(high=0.28), cu_seqlens=cu,
        )  # fmt: skip
        dr_grpo = rlo.policy_loss(
            log_probs, old, advantages, mask, reduction="sequence_sum_normalized", cu_seqlens=cu
        )
        return out.loss + dr_grpo.loss, *out.diagnostics

    # aot_eager traces the whole call (fullgraph=True: no graph break, hence no host sync in
    # the math) and its autograd graph; inductor's code generation adds nothing we test.
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_leaf = inputs[0].clone().requires_grad_(True)
    compiled_leaf = inputs[0].clone().requires_grad_(True)
    eager = step(eager_leaf, inputs[1])
    result = compiled(compiled_leaf, inputs[1])
    for actual, expected in zip(result, eager, strict=True):
        torch.testing.assert_close(actual, expected)
    (grad,) = torch.autograd.grad(result[0], compiled_leaf)
    (expected_grad,) = torch.autograd.grad(eager[0], eager_leaf)
    torch.testing.assert_close(grad, expected_grad)
    assert (grad != 0).any()
