"""Causal-LM alignment: response_alignment and response_log_probs (the one-token shift)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from rlobjectives import response_alignment, response_log_probs
from tolerances import assert_close

VOCAB = 11
PAD = 0


class TinyCausalLM(torch.nn.Module):
    """Embedding -> GRU -> linear head: causal by construction (position j sees tokens <= j)."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.rnn = torch.nn.GRU(8, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))
        return out  # (B, L, H)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden_states(input_ids))  # (B, L, V)


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM().double()


def _build(
    prompts: list[list[int]], responses: list[list[int]], layout: str, response_length: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """input_ids / attention_mask for 'right', 'left' or 'split' (left-padded prompt + right-padded
    response, the verl/TRL layout)."""
    rows, masks = [], []
    prompt_width = max(len(p) for p in prompts)
    total = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    for p, r in zip(prompts, responses, strict=True):
        seq = p + r
        if layout == "right":
            pad = total - len(seq)
            rows.append(seq + [PAD] * pad)
            masks.append([1] * len(seq) + [0] * pad)
        elif layout == "left":
            pad = total - len(seq)
            rows.append([PAD] * pad + seq)
            masks.append([0] * pad + [1] * len(seq))
        else:
            left, right = prompt_width - len(p), response_length - len(r)
            rows.append([PAD] * left + seq + [PAD] * right)
            masks.append([0] * left + [1] * len(seq) + [0] * right)
    return torch.tensor(rows), torch.tensor(masks), [len(p) for p in prompts]


PROMPTS = [[3, 4], [5, 6, 7, 8], [9]]
RESPONSES = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]


@pytest.mark.parametrize("layout", ["right", "left", "split"])
def test_tiny_model_matches_per_token_loop(layout: str) -> None:
    model = _model()
    ids, attention, prompt_lengths = _build(PROMPTS, RESPONSES, layout, 5)
    w = torch.randn(3, 5, dtype=torch.float64)

    out = response_log_probs(
        model(ids), ids, prompt_lengths, attention, response_length=5, chunk_size=4
    )
    assert out.log_probs.dtype == torch.float64 and out.log_probs.shape == (3, 5)
    (out.log_probs * w).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    # The obvious loop: log_softmax(logits[b, j - 1])[input_ids[b, j]] for response positions j.
    expected, expected_mask = reference.response_log_probs(
        model(ids), ids, prompt_lengths, attention, 5
    )
    assert out.mask.tolist() == expected_mask
    assert out.mask.tolist() == [[t < len(r) for t in range(5)] for r in RESPONSES]
    assert_close(out.log_probs, expected)
    (expected * w).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None
        assert_close(grads[name], p.grad)


def test_split_layout_equals_plain_slicing() -> None:
    # verl/TRL layout: responses start at the fixed column P_max, so the response log-probs are
    # log_softmax(logits[:, P_max - 1 : -1]) gathered at input_ids[:, P_max:].
    model = _model()
    ids, attention, prompt_lengths = _build(PROMPTS, RESPONSES, "split", 5)
    logits = model(ids)
    out = response_log_probs(logits, ids, prompt_lengths, attention, response_length=5)
    prompt_width = 4
    sliced = torch.log_softmax(logits[:, prompt_width - 1 : -1], -1)
    sliced = sliced.gather(-1, ids[:, prompt_width:, None]).squeeze(-1)
    response_mask = attention[:, prompt_width:].bool()
    assert torch.equal(out.mask, response_mask)
    assert_close(out.log_probs, torch.where(response_mask, sliced, 0.0))
    # An off-by-one (logits at j instead of j - 1) gives different values: the test can fail.
    unshifted = torch.log_softmax(logits[:, prompt_width:], -1)
    unshifted = unshifted.gather(-1, ids[:, prompt_width:, None]).squeeze(-1)
    assert not torch.allclose(torch.where(response_mask, unshifted, 0.0), out.log_probs)


def test_split_layout_with_response_start() -> None:
    # Issue 10: in the verl/TRL layout the padded prompt width is the response start, not a prompt
    # length. response_start=4 (the padded width) gives the responses exactly; passing 4 as
    # prompt_lengths would skip the first f_b response tokens of left-padded rows (row 0 has
    # f_0 = 2: start 2 + 4 = 6 instead of 4, dropping its tokens 1 and 2).
    model = _model()
    ids, attention, prompt_lengths = _build(PROMPTS, RESPONSES, "split", 5)
    logits = model(ids)
    expected = response_log_probs(logits, ids, prompt_lengths, attention, response_length=5)
    for start in (4, torch.tensor([4, 4, 4])):
        out = response_log_probs(
            logits, ids, None, attention, response_start=start, response_length=5
        )
        assert torch.equal(out.mask, expected.mask)
        assert torch.equal(out.log_probs, expected.log_probs)
    alignment = response_alignment(ids, None, attention, response_start=4, response_length=5)
    assert alignment.tokens[0].tolist() == [1, 2, 3, 0, 0]
    # the misuse is caught: row 0 is padded on both sides, so all responses start at one column
    with pytest.raises(ValueError, match=r"^prompt_lengths: .*starts \[6, 4, 7\]"):
        response_alignment(ids, [4, 4, 4], attention, response_length=5)


@pytest.mark.parametrize(
    ("prompt_lengths", "response_start", "match"),
    [
        ([2, 4, 1], 4, "exactly one of prompt_lengths .* got both"),
        (None, None, "exactly one of prompt_lengths .* got neither"),
        (None, [4, 4], r"response_start must have shape \(B,\) = \(3,\)"),
        (None, 2, "response_start must leave at least one prompt token"),
        (None, 20, "response_start must leave the response inside"),
    ],
)
def test_response_start_errors(prompt_lengths: Any, response_start: Any, match: str) -> None:
    ids, attention, _ = _build(PROMPTS, RESPONSES, "split", 5)
    with pytest.raises(ValueError, match=match):
        response_alignment(ids, prompt_lengths, attention, response_start=response_start)


def test_hidden_state_composition() -> None:
    # The documented hidden-state path: gather the predicting rows, then apply the LM head.
    model = _model()
    ids, attention, prompt_lengths = _build(PROMPTS, RESPONSES, "left", 5)
    alignment = response_alignment(ids, prompt_lengths, attention, response_length=5)
    hidden = model.hidden_states(ids)  # (B, L, H)
    rows = hidden.gather(1, alignment.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    log_probs = torch.log_softmax(model.head(rows), -1).gather(-1, alignment.tokens[..., None])
    log_probs = torch.where(alignment.mask, log_probs.squeeze(-1), 0.0)
    out = response_log_probs(model(ids), ids, prompt_lengths, attention, response_length=5)
    assert_close(log_probs, out.log_probs)


def test_alignment_golden() -> None:
    # Row 0, left padding [pad, pad, 5, 6, 7, 8], prompt 2: response tokens 7 (j=4), 8 (j=5),
    # predicted by rows 3 and 4. Row 1, right padding [5, 6, 7, 0, 0, 0], prompt 1: response
    # tokens 6 (j=1), 7 (j=2), predicted by rows 0 and 1.
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 0, 0, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    alignment = response_alignment(ids, torch.tensor([2, 1]), attention, response_length=3)
    assert alignment.tokens.tolist() == [[7, 8, 0], [6, 7, 0]]
    assert alignment.mask.tolist() == [[True, True, False], [True, True, False]]
    assert alignment.positions[alignment.mask].tolist() == [3, 4, 0, 1]
    # Default response_length = L - 1 = 5: same values, more fully masked columns.
    default = response_alignment(ids, [2, 1], attention)
    assert default.tokens.shape == (2, 5)
    assert torch.equal(default.tokens[:, :3], alignment.tokens)
    assert not default.mask[:, 2:].any()


@given(
    st.integers(0, 2**16),
    st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=4),
    st.sampled_from(["right", "left", "split"]),
    st.sampled_from([1.0, 0.7]),
    st.integers(1, 9),
)
def test_random_layouts_match_reference(
    seed: int, lengths: list[tuple[int, int]], layout: str, tau: float, chunk: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (p,), generator=generator).tolist() for p, _ in lengths]
    responses = [torch.randint(1, VOCAB, (r,), generator=generator).tolist() for _, r in lengths]
    response_length = max(1, max(r for _, r in lengths))
    ids, attention, prompt_lengths = _build(prompts, responses, layout, response_length)
    logits = torch.randn(*ids.shape, VOCAB, generator=generator, dtype=torch.float64)
    logits[~attention.bool()] = float("nan")  # padding rows never reach the result
    x = logits.clone().requires_grad_(True)
    out = response_log_probs(
        x,
        ids,
        prompt_lengths,
        attention,
        response_length=response_length,
        temperature=tau,
        chunk_size=chunk,
    )
    y = logits.clone().requires_grad_(True)
    expected, expected_mask = reference.response_log_probs(
        y / tau, ids, prompt_lengths, attention, response_length
    )
    assert out.mask.tolist() == expected_mask
    assert_close(out.log_probs, expected)
    w = torch.randn(out.log_probs.shape, generator=generator, dtype=torch.float64)
    (out.log_probs * w).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if expected.requires_grad:
        (expected * w).sum().backward()
        assert y.grad is not None
        assert_close(x.grad, torch.nan_to_num(y.grad))
    else:
        assert (x.grad == 0).all()


def test_bfloat16_logits() -> None:
    model = _model()
    ids, attention, prompt_lengths = _build(PROMPTS, RESPONSES, "right", 5)
    logits = model(ids).detach().to(torch.bfloat16).requires_grad_(True)
    out = response_log_probs(logits, ids, prompt_lengths, attention, response_length=5)
    expected, _ = reference.response_log_probs(logits.double(), ids, prompt_lengths, attention, 5)
    assert out.log_probs.dtype == torch.float32
    assert_close(out.log_probs, expected)  # float32 math on exactly upcast bf16 logits
    out.log_probs.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_errors() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    attention = ids != 0
    logits = torch.zeros(2, 4, VOCAB)
    with pytest.raises(ValueError, match=r"one contiguous run of ones"):
        response_alignment(ids, [1, 1], torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"prompt_lengths must be >= 1.*got \[0, 1\]"):
        response_alignment(ids, [0, 1], attention)
    with pytest.raises(
        ValueError, match=r"prompt_lengths must be <= the number of attended tokens"
    ):
        response_alignment(ids, [4, 1], attention)
    with pytest.raises(
        ValueError, match=r"response_length=2 is shorter than the longest response 3"
    ):
        response_alignment(ids, [1, 1], attention, response_length=2)
    with pytest.raises(ValueError, match=r"response_length must be >= 1, got 0"):
        response_alignment(ids, [1, 1], attention, response_length=0)
    with pytest.raises(TypeError, match=r"response_length must be an int"):
        response_alignment(ids, [1, 1], attention, response_length=2.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"prompt_lengths must have shape \(B,\) = \(2,\).*got shape \(3,\)"
    ):
        response_alignment(ids, [1, 1, 1], attention)
    with pytest.raises(ValueError, match=r"attention_mask must have the same shape as input_ids"):
        response_alignment(ids, [1, 1], attention[:, :3])
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor.*float32"):
        response_alignment(ids.float(), [1, 1], attention)
    with pytest.raises(TypeError, match=r"prompt_lengths must be an integer tensor"):
        response_alignment(ids, [1.0, 1.0], attention)
    with pytest.raises(
        ValueError, match=r"logits must have shape \(B, L, V\), got shape \(8, 11\)"
    ):
        response_log_probs(logits.reshape(8, VOCAB), ids, [1, 1], attention)
    with pytest.raises(
        ValueError, match=r"input_ids must have the same shape as logits without V \(2, 4\)"
    ):
        response_log_probs(logits, ids[:, :3], [1, 1], attention[:, :3])
    # check_layout=False skips the host-side checks (for trusted pipelines / hot loops).
    unchecked = response_alignment(ids, [1, 1], attention, response_length=2, check_layout=False)
    assert unchecked.mask.tolist() == [[True, True], [True, True]]
