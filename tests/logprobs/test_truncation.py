"""The sampler's kept set (issue 25, item 1): kept_ids / kept_mask / top_k / top_p.

Golden cases with the arithmetic in comments (SPEC T1-T5), the peers' kept sets (vLLM's
``apply_top_k_top_p_pytorch`` and NeMo-RL's ``apply_top_k_top_p`` on 37 random rows, 10 rule
settings, and slime's log-probabilities: ``tests/data/truncation_peers.pt``, numbers written by
faithful transcriptions of the peers' code, NeMo-RL's masks identical to vLLM's), float64
references (``tests/reference.py``) on random odd shapes for values and gradients, the
``-inf``/zero-gradient contract, the no-op settings, the one-``(chunk, V)``-buffer memory
contract of the hidden-state paths, and the thresholds saved for backward (no sort in backward).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from rlobjectives.logprobs import saved_logits
from tolerances import assert_close, tolerance

PEERS = Path(__file__).resolve().parents[1] / "data" / "truncation_peers.pt"
F64 = torch.float64
INF = math.inf


def _grad(output: torch.Tensor, leaf: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Gradient of ``sum(w * output)`` over the finite outputs (``-inf`` rows are constants)."""
    finite = torch.isfinite(output)
    total = torch.where(finite, output.double(), 0.0).mul(weights).sum()
    if not total.requires_grad:
        return torch.zeros_like(leaf)
    (gradient,) = torch.autograd.grad(total, leaf, retain_graph=True)
    return gradient


# --- golden values ------------------------------------------------------------------------------


def test_golden_kept_ids_t1() -> None:
    # logits log[.5, .25, .125, .125], K = {0, 1}: q_K = [2/3, 1/3, 0, 0].
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3, dtype=F64)).requires_grad_()
    kept = torch.tensor([[0, 1, -1]] * 3)
    out = rlo.token_log_probs(logits, torch.tensor([1, 0, 2]), kept_ids=kept)
    # y=1: log(0.25 / 0.75) = -1.098612; y=0: log(2/3) = -0.405465; y=2 not in K: -inf
    assert_close(out[:2], [math.log(1 / 3), math.log(2 / 3)])
    assert out[2].item() == -INF
    # full vocabulary at y=1: log .25 = -1.386294 (the truncation changes it)
    assert_close(rlo.token_log_probs(logits.detach(), torch.tensor([1, 0, 2]))[0], math.log(0.25))
    out.where(torch.isfinite(out), 0.0).sum().backward()
    # d/dx (x_y - lse_K): 1[v = y] - q_K(v); the row outside K gets exactly 0
    assert logits.grad is not None
    assert_close(logits.grad[0], [-2 / 3, 2 / 3, 0.0, 0.0])
    assert_close(logits.grad[1], [1 / 3, -1 / 3, 0.0, 0.0])
    assert torch.equal(logits.grad[2], torch.zeros(4, dtype=F64))
    # H_K = -(2/3 ln 2/3 + 1/3 ln 1/3) = 0.636514 (full vocabulary: 1.213008)
    entropy = rlo.token_entropy(logits.detach(), kept_ids=kept)
    assert_close(entropy, [0.6365141682948128] * 3)
    assert_close(rlo.token_entropy(logits.detach()[:1]), [1.2130075659799042])


def test_golden_top_p_boundary_t2() -> None:
    # The same logits; descending masses .5, .25, .125, .125, mass before each 0, .5, .75, .875.
    # top_p = 0.75: the prefix {0, 1} reaches exactly 0.75 -> K = {0, 1} (vLLM and NeMo-RL agree:
    # their ascending cumsum [.125, .25, .5, 1] <= 1 - p = .25 removes two).
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=F64)).expand(4, 4)
    tokens = torch.arange(4)
    out = rlo.token_log_probs(logits, tokens, top_p=0.75)
    assert_close(out[:2], [math.log(2 / 3), math.log(1 / 3)])
    assert torch.isinf(out[2:]).all()
    # top_p = 0.76: the mass before the tied pair is 0.75 < 0.76, so both are kept (the
    # tie-inclusive rule: K = all four, log-probs = the full ones; vLLM's unstable sort keeps
    # [1, 1, 0, 1] here, which is why an exact replay should pass the engine's kept_ids).
    assert_close(rlo.token_log_probs(logits, tokens, top_p=0.76), torch.log(logits[0].exp()))


def test_golden_top_k_then_top_p_t3() -> None:
    # logits log[.1, .2, .3, .4], top_k=2 keeps {2, 3} with q = [3/7, 4/7]; the mass above token
    # 2 is 4/7 >= .5 -> K = {3}: log q_K(3) = 0, token 2 outside. (top-p first would keep {2, 3}.)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=F64)).expand(2, 4)
    out = rlo.token_log_probs(logits, torch.tensor([3, 2]), top_k=2, top_p=0.5)
    assert_close(out[0], 0.0)
    assert out[1].item() == -INF
    assert_close(rlo.token_entropy(logits, top_k=2, top_p=0.5), [0.0, 0.0])


def test_golden_temperature_before_the_set_t4() -> None:
    # logits [2, 1, 0, -1], top_p = 0.9. tau = 1: p = [.6439, .2369, .0871, .0321], mass before
    # = [0, .6439, .8808, .9679] -> K = {0, 1, 2}. tau = 0.5: p = [.8650, .1171, .0158, .0021],
    # mass before [0, .8650, .9821, ...] -> K = {0, 1}; log q_K(1) = 2 - log(e^4 + e^2) = -2.126928.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=F64).expand(4, 4)
    tokens = torch.arange(4)
    warm = rlo.token_log_probs(logits, tokens, top_p=0.9)
    assert torch.isfinite(warm[:3]).all() and warm[3].item() == -INF
    cold = rlo.token_log_probs(logits, tokens, top_p=0.9, temperature=0.5)
    assert_close(cold[1], 2.0 - math.log(math.exp(4.0) + math.exp(2.0)))  # -2.126928
    assert torch.isinf(cold[2:]).all()


def test_golden_kept_mass_is_the_ratio_bias_t5() -> None:
    # 32k vocabulary, top_p = 0.8: for every sampled y in K the ratio pi(y) / q_K(y) is the kept
    # mass S, so E_{y ~ q_K}[pi / q_K] = S = 0.800066 (TRL #7269: mean ratio = kept mass).
    generator = torch.Generator().manual_seed(7269)
    logits = torch.randn(1, 32000, generator=generator, dtype=F64) * 2.5
    top = logits.argmax(dim=1)  # always in K
    full = rlo.token_log_probs(logits, top)
    truncated = rlo.token_log_probs(logits, top, top_p=0.8)
    assert abs(math.exp(float(full - truncated)) - 0.800066) < 5e-7


def test_the_recipe_same_support_removes_the_rollout_correction_bias() -> None:
    # docs/objectives/logprobs.md, the recipe. Golden: logits log[.5, .25, .125, .125], the
    # sampler keeps K = {0, 1} (mass S = .75) and draws y = 1 with q_K(1) = .25/.75 = 1/3; the
    # trainer's full-vocabulary log-prob is log .25, so the ratio is .25 / (1/3) = .75 = S; on
    # the sampler's support it is (1/3) / (1/3) = 1.
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=F64).log()
    rollout = torch.tensor([[math.log(1 / 3)]], dtype=F64)
    one, y = torch.ones(1, 1, dtype=torch.bool), torch.tensor([1])
    full = rlo.token_log_probs(logits, y).reshape(1, 1)
    same = rlo.token_log_probs(logits, y, kept_ids=torch.tensor([[0, 1, -1]])).reshape(1, 1)
    assert_close(rlo.rollout_correction(full, rollout, one).weights, torch.full((1, 1), 0.75))
    assert_close(rlo.rollout_correction(same, rollout, one).weights, torch.ones(1, 1))
    # Random rows, tokens drawn from the top-p = 0.8 nucleus at tau = 0.9 (built here by sorting:
    # the smallest descending prefix of mass >= p): the full-vocabulary ratio of every token is
    # its row's kept mass S_t; with the sampler's set given any of three ways it is 1.
    generator = torch.Generator().manual_seed(25)
    logits = torch.randn(2, 40, 50, generator=generator, dtype=F64) * 3
    x = logits / 0.9
    order = x.sort(dim=-1, descending=True)
    mass = order.values.softmax(-1)
    kept_sorted = mass.cumsum(-1) - mass < 0.8
    kept = torch.zeros_like(kept_sorted).scatter(-1, order.indices, kept_sorted)
    sampler = torch.where(kept, x, -INF).softmax(-1)
    tokens = torch.multinomial(sampler.reshape(-1, 50), 1, generator=generator).reshape(2, 40)
    rollout = sampler.gather(-1, tokens[..., None]).squeeze(-1).log()
    kept_mass = torch.where(kept, x.softmax(-1), 0.0).sum(-1)
    ids = torch.where(kept, torch.arange(50), -1).sort(dim=-1, descending=True).values
    mask = torch.ones(2, 40, dtype=torch.bool)
    full = rlo.token_log_probs(logits, tokens, temperature=0.9)
    biased = rlo.rollout_correction(full, rollout, mask, upper=None)
    assert_close(biased.weights, kept_mass)
    assert_close(biased.metrics.ratio_mean, kept_mass.mean())
    for options in ({"kept_mask": kept}, {"kept_ids": ids}, {"top_p": 0.8}):
        trainer = rlo.token_log_probs(logits, tokens, temperature=0.9, **options)
        corrected = rlo.rollout_correction(trainer, rollout, mask, upper=None)
        assert_close(corrected.weights, torch.ones(2, 40, dtype=F64))
        assert abs(float(corrected.metrics.kl_k1)) < 1e-12


# --- the peers' kept sets and values -------------------------------------------------------------


def _peers() -> dict[str, Any]:
    data: dict[str, Any] = torch.load(PEERS, weights_only=True)
    return data


def _setting(key: str) -> tuple[float, int | None, float | None]:
    fields = dict(part.split("=") for part in key.strip("[]").split(","))
    top_k = None if fields["top_k"] == "None" else int(fields["top_k"])
    top_p = None if fields["top_p"] == "None" else float(fields["top_p"])
    return float(fields["tau"]), top_k, top_p


def _membership(logits: torch.Tensor, **options: Any) -> torch.Tensor:
    """``(N, V)``: whether token v is in row n's kept set, read from the public log-probs."""
    rows, vocab = logits.shape
    every = logits.repeat_interleave(vocab, dim=0)  # (N V, V), row n v = row n
    tokens = torch.arange(vocab).repeat(rows)
    return torch.isfinite(rlo.token_log_probs(every, tokens, **options)).reshape(rows, vocab)


@pytest.mark.parametrize(
    "key",
    [
        "[tau=1.0,top_k=None,top_p=0.8]",
        "[tau=1.0,top_k=10,top_p=None]",
        "[tau=1.0,top_k=10,top_p=0.9]",
        "[tau=1.0,top_k=5,top_p=0.5]",
        "[tau=1.0,top_k=None,top_p=0.95]",
        "[tau=0.7,top_k=None,top_p=0.8]",
        "[tau=0.7,top_k=10,top_p=None]",
        "[tau=0.7,top_k=10,top_p=0.9]",
        "[tau=0.7,top_k=5,top_p=0.5]",
        "[tau=0.7,top_k=None,top_p=0.95]",
    ],
)
def test_rule_equals_vllm_and_nemo_rl(key: str) -> None:
    peers = _peers()
    tau, top_k, top_p = _setting(key)
    logits = peers["logits"]
    expected = peers["masks"][key]  # vLLM apply_top_k_top_p_pytorch (= NeMo-RL apply_top_k_top_p)
    options = {"temperature": tau, "top_k": top_k, "top_p": top_p}
    assert torch.equal(_membership(logits, **options), expected)
    # the values are the log-softmax of the peers' masked logits (their renormalised sampler)
    tokens = peers["tokens"]
    masked = torch.where(expected, logits / tau, -INF)
    want = torch.log_softmax(masked, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert_close(rlo.token_log_probs(logits, tokens, **options), want)


def test_kept_ids_and_mask_and_slime() -> None:
    peers = _peers()
    logits, tokens, ids, tau = (peers[k] for k in ("logits", "tokens", "kept_ids", "temperature"))
    leaf = logits.clone().requires_grad_()
    by_ids = rlo.token_log_probs(leaf, tokens, kept_ids=ids, temperature=tau)
    # three sampled tokens are outside their recorded set: -inf, never NaN
    assert torch.isinf(by_ids).nonzero().flatten().tolist() == [3, 11, 29]
    one_hot = torch.nn.functional.one_hot(ids.clamp(min=0), logits.shape[1]).bool()
    mask = (one_hot & (ids >= 0)[..., None]).any(dim=1)  # (N, V) the recorded sets
    by_mask = rlo.token_log_probs(logits, tokens, kept_mask=mask, temperature=tau)
    assert torch.equal(by_ids, by_mask)
    # slime puts the sampled token back into the set: kept_ids with the token appended
    appended = torch.cat([ids, tokens[:, None]], dim=1)
    assert_close(
        rlo.token_log_probs(logits, tokens, kept_ids=appended, temperature=tau),
        peers["slime_log_probs"],
    )
    # slime's entropy stays full-vocabulary; ours is over the set, the full one without it
    assert_close(rlo.token_entropy(logits, temperature=tau), peers["slime_entropy"])
    # the kept mass S_n: pi(y) / q_K(y) = S for y in K (the bias of the untruncated ratio)
    full = rlo.token_log_probs(logits, tokens, temperature=tau)
    inside = torch.isfinite(by_ids)
    assert_close((full - by_ids)[inside].exp(), peers["kept_mass"][inside])


# --- reference comparisons (hypothesis) ---------------------------------------------------------


KINDS = ("ids", "mask", "top_k", "top_p", "top_k+top_p")


def _kept(kind: str, generator: torch.Generator, shape: tuple[int, ...], vocab: int,
          tokens: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """Kept-set arguments of ``kind``: ids with padding, duplicates, rows without a set and
    out-of-range ids; masks with empty rows; a rule with k below and above V."""
    if kind == "ids":
        width = 4
        ids = torch.randint(-1, vocab + 2, (*shape, width), generator=generator)
        keep_token = torch.rand(shape, generator=generator) < 0.8
        ids[..., 0] = torch.where(keep_token, tokens, ids[..., 0])
        ids[..., 1] = ids[..., 0]  # a duplicate counts once
        return {"kept_ids": ids}
    if kind == "mask":
        mask = torch.rand((*shape, vocab), generator=generator) < 0.4
        mask.reshape(-1, vocab)[::3] = False  # rows without a recorded set: every token
        return {"kept_mask": mask}
    k = int(torch.randint(1, vocab + 2, (1,), generator=generator))
    p = float(torch.rand(1, generator=generator)) * 0.9 + 0.05
    return {
        "top_k": {"top_k": k},
        "top_p": {"top_p": p},
        "top_k+top_p": {"top_k": k, "top_p": p},
    }[kind]


cases = st.tuples(
    st.integers(0, 2**16),  # seed
    st.integers(1, 3),  # B
    st.integers(1, 5),  # T
    st.integers(1, 9),  # V
    st.sampled_from([None, 1, 3]),  # chunk_size
    st.booleans(),  # (B, T, V) or (N, V)
    st.sampled_from([1.0, 0.7]),  # temperature
    st.sampled_from(KINDS),
)


@settings(max_examples=30)
@given(cases, st.sampled_from([F64, torch.float32]))
def test_log_probs_and_entropy_match_reference(case: tuple[Any, ...], dtype: torch.dtype) -> None:
    seed, batch, steps, vocab, chunk, three_d, tau, kind = case
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, steps) if three_d else (batch * steps,)
    logits = (3 * torch.randn(*shape, vocab, generator=generator, dtype=F64)).to(dtype)
    tokens = torch.randint(0, vocab, shape, generator=generator)
    mask = torch.rand(shape, generator=generator) < 0.8
    kept = _kept(kind, generator, shape, vocab, tokens)
    weights = torch.randn(shape, generator=generator, dtype=F64)
    leaf = logits.clone().requires_grad_()
    base = leaf.detach().double().requires_grad_()
    options = {"mask": mask, "temperature": tau, **kept}
    out = rlo.token_log_probs(leaf, tokens, chunk_size=chunk, **options)
    want, want_entropy = reference.truncated_log_probs(base, tokens, **options)
    assert out.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.equal(torch.isinf(out), torch.isinf(want))  # -inf exactly where y is not in K
    assert not torch.isnan(out).any()
    assert_close(torch.where(torch.isfinite(want), out, 0.0), want.nan_to_num(neginf=0.0), dtype)
    assert_close(_grad(out, leaf, weights), _grad(want, base, weights), dtype)
    entropy = rlo.token_entropy(leaf, chunk_size=chunk, **options)
    assert_close(entropy, want_entropy, dtype)
    assert_close(_grad(entropy, leaf, weights), _grad(want_entropy, base, weights), dtype)


hidden_cases = st.tuples(
    st.integers(0, 2**16),  # seed
    st.integers(1, 3),  # B
    st.integers(1, 4),  # T
    st.integers(1, 4),  # H
    st.integers(2, 9),  # V
    st.sampled_from([None, 1, 3]),  # chunk_size
    st.booleans(),  # bias
    st.sampled_from(KINDS),
)


@settings(max_examples=25)
@given(hidden_cases)
def test_from_hidden_matches_reference(case: tuple[Any, ...]) -> None:
    seed, batch, steps, width, vocab, chunk, with_bias, kind = case
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, steps, width, generator=generator, dtype=F64)
    weight = torch.randn(vocab, width, generator=generator, dtype=F64)
    bias = torch.randn(vocab, generator=generator, dtype=F64) if with_bias else None
    tokens = torch.randint(0, vocab, (batch, steps), generator=generator)
    mask = torch.rand((batch, steps), generator=generator) < 0.8
    hidden = torch.where(mask[..., None], hidden, math.nan)  # unselected rows are never read
    kept = _kept(kind, generator, (batch, steps), vocab, tokens)
    inputs = [hidden, weight] + ([] if bias is None else [bias])
    leaves = [t.clone().requires_grad_() for t in inputs]
    options = {"mask": mask, "temperature": 0.7, **kept}
    out = rlo.token_log_probs_from_hidden(
        leaves[0], leaves[1], tokens, bias=leaves[2] if bias is not None else None,
        chunk_size=chunk, return_entropy=True, **options,
    )  # fmt: skip
    want, want_entropy = reference.truncated_log_probs_from_hidden(
        torch.where(mask[..., None], hidden, 0.0), weight, tokens, bias=bias, **options
    )
    assert torch.equal(torch.isinf(out.log_probs), torch.isinf(want))
    assert_close(out.log_probs.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0))
    assert_close(out.entropy, want_entropy)
    # gradients of sum(w_lp * lp) + sum(w_h * H) against the reference's, through autograd
    w_lp = torch.randn(batch, steps, generator=generator, dtype=F64)
    w_h = torch.randn(batch, steps, generator=generator, dtype=F64)
    finite = torch.isfinite(want)
    total = (torch.where(finite, out.log_probs, 0.0) * w_lp).sum() + (out.entropy * w_h).sum()
    got = _grads(total, leaves)
    base = [torch.where(mask[..., None], hidden, 0.0), weight] + ([] if bias is None else [bias])
    base = [t.clone().requires_grad_() for t in base]
    lp, ent = reference.truncated_log_probs_from_hidden(
        base[0], base[1], tokens, bias=base[2] if bias is not None else None, **options
    )
    expected_total = (torch.where(finite, lp, 0.0) * w_lp).sum() + (ent * w_h).sum()
    expected = _grads(expected_total, base)
    for actual, wanted in zip(got, expected, strict=True):
        assert_close(actual, wanted)


def _grads(total: torch.Tensor, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Gradients of ``total``; zeros when nothing is selected (``total`` is a constant)."""
    if not total.requires_grad:
        return tuple(torch.zeros_like(leaf) for leaf in leaves)
    return torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)


@settings(max_examples=20)
@given(hidden_cases, st.sampled_from([0.0, 0.1]))
def test_fused_loss_equals_the_composition(case: tuple[Any, ...], entropy_coef: float) -> None:
    # The fused chunk loop on the kept set: value and gradients of composing the truncated
    # log-probabilities (and entropies) with policy_loss, tokens outside the set included.
    seed, batch, steps, width, vocab, chunk, _, kind = case
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, steps, width, generator=generator, dtype=F64)
    weight = torch.randn(vocab, width, generator=generator, dtype=F64)
    tokens = torch.randint(0, vocab, (batch, steps), generator=generator)
    mask = torch.rand((batch, steps), generator=generator) < 0.8
    old = -1.5 + 0.5 * torch.randn(batch, steps, generator=generator, dtype=F64)
    advantages = torch.randn(batch, generator=generator, dtype=F64)
    kept = _kept(kind, generator, (batch, steps), vocab, tokens)
    fused_leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    out = rlo.fused_policy_loss_from_hidden(
        *fused_leaves, tokens, old, advantages, mask, chunk_size=chunk, temperature=0.7,
        entropy_coef=entropy_coef, **kept,
    )  # fmt: skip
    got = torch.autograd.grad(out.loss, fused_leaves)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    parts = rlo.token_log_probs_from_hidden(
        *leaves, tokens, mask=mask, temperature=0.7, return_entropy=True, **kept
    )
    composed = rlo.policy_loss(
        parts.log_probs, old, advantages, mask, entropy=parts.entropy, entropy_coef=entropy_coef
    )
    expected = torch.autograd.grad(composed.loss, leaves)
    assert_close(out.loss, composed.loss)
    for actual, wanted in zip(got, expected, strict=True):
        assert torch.isfinite(actual).all()
        assert_close(actual, wanted)


@settings(max_examples=20)
@given(st.integers(0, 2**16), st.sampled_from(("ids", "mask", "top_k+top_p")))
def test_response_log_probs_kept_set_is_aligned_with_the_response(seed: int, kind: str) -> None:
    # Row t of the set belongs to the response token at t (the logits row before it).
    generator = torch.Generator().manual_seed(seed)
    batch, length, vocab, response = 3, 6, 7, 4
    logits = torch.randn(batch, length, vocab, generator=generator, dtype=F64)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    prompts = torch.tensor([1, 2, 3])
    attention = torch.ones(batch, length, dtype=torch.bool)
    attention[0, 4:] = False
    alignment = rlo.response_alignment(ids, prompts, attention, response_length=response)
    kept = _kept(kind, generator, (batch, response), vocab, alignment.tokens)
    out = rlo.response_log_probs(logits, ids, prompts, attention, response_length=response, **kept)
    rows = logits.gather(1, alignment.positions[..., None].expand(-1, -1, vocab))  # (B, R, V)
    want, _ = reference.truncated_log_probs(rows, alignment.tokens, alignment.mask, **kept)
    assert torch.equal(out.mask, alignment.mask)
    assert torch.equal(torch.isinf(out.log_probs), torch.isinf(want))
    assert_close(out.log_probs.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0))
    packed = rlo.pack(ids, attention)
    flat_logits = rlo.pack(logits, attention).values
    flat_kept = {
        name: torch.zeros((ids.numel(), value.shape[-1]), dtype=value.dtype)
        for name, value in kept.items()
        if isinstance(value, torch.Tensor)
    }  # the set of each input token (rows of non-response tokens are never read)
    for name, value in kept.items():
        if isinstance(value, torch.Tensor):
            full = torch.zeros((batch, length + 1, value.shape[-1]), dtype=value.dtype)
            where = torch.where(alignment.mask, alignment.positions + 1, length)  # spare: L
            full.scatter_(1, where[..., None].expand_as(value), value)
            flat_kept[name] = rlo.pack(full[:, :length], attention).values
    options = {**kept, **flat_kept}
    starts = torch.tensor([0, 4, 10])[:batch] + prompts
    packed_out = rlo.response_log_probs(
        flat_logits, packed.values, None, None, response_start=starts,
        cu_seqlens=packed.cu_seqlens, **options,
    )  # fmt: skip
    assert_close(
        packed_out.log_probs[packed_out.mask].nan_to_num(neginf=0.0),
        out.log_probs[out.mask].nan_to_num(neginf=0.0),
    )


# --- contract -----------------------------------------------------------------------------------


def test_no_op_settings_are_exact() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, generator=generator, dtype=F64)
    tokens = torch.randint(0, 6, (5,), generator=generator)
    plain = rlo.token_log_probs(logits, tokens)
    for options in (
        {"top_k": 6},
        {"top_k": 100},
        {"top_p": 1.0},
        {"kept_ids": torch.full((5, 2), -1)},  # no recorded set: every token
        {"kept_ids": torch.full((5, 2), 9), "kept_pad": 9},
        {"kept_mask": torch.zeros(5, 6, dtype=torch.bool)},
        {"kept_ids": torch.arange(6).expand(5, 6)},  # the whole vocabulary listed
    ):
        assert_close(rlo.token_log_probs(logits, tokens, **options), plain)


def test_duplicate_and_out_of_range_ids() -> None:
    # [0, 0, 1] keeps {0, 1} once; 7 and -5 are outside [0, V) and not the pad: ignored.
    logits = torch.zeros(1, 4, dtype=F64)
    once = rlo.token_log_probs(logits, torch.tensor([0]), kept_ids=torch.tensor([[0, 0, 1, 7, -5]]))
    assert_close(once, [math.log(0.5)])


def test_outside_the_set_reaches_policy_loss_without_nan() -> None:
    # A recomputed top-k that drops the sampled token: -inf log-prob; policy_loss clamps the
    # log-ratio at -20 (ratio e^-20): the clipped surrogate gives ~0 for A > 0, the constant
    # (1 - 0.2)|A| for A < 0, and exactly zero gradient for the row; no NaN anywhere.
    logits = torch.tensor([[3.0, 0.0, -1.0], [3.0, 0.0, -1.0], [0.0, 1.0, 2.0]], dtype=F64)
    leaf = logits.clone().requires_grad_()
    log_probs = rlo.token_log_probs(leaf, torch.tensor([2, 2, 2]), top_k=1)
    assert log_probs[:2].isinf().all() and log_probs[2].item() == 0.0
    old = torch.full((1, 3), -1.0, dtype=F64)
    for advantage, per_token in ((1.0, 1.0 * math.exp(-19)), (-1.0, 0.8)):
        leaf.grad = None
        out = rlo.policy_loss(
            log_probs.reshape(1, 3), old, torch.tensor([advantage], dtype=F64),
            torch.tensor([[True, False, False]]), return_per_token=True,
        )  # fmt: skip
        assert torch.isfinite(out.loss)
        assert_close(out.per_token_loss[0, 0].abs(), per_token)
        out.loss.backward(retain_graph=True)
        assert leaf.grad is not None and torch.equal(leaf.grad, torch.zeros_like(leaf))
    corrected = rlo.rollout_correction(log_probs.detach().reshape(1, 3), old, torch.ones(1, 3))
    assert torch.isfinite(corrected.weights).all()


def test_backward_replays_the_saved_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    # top-k / top-p are decided once, in forward; backward compares with the saved thresholds.
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 3, generator=generator, dtype=F64, requires_grad=True)
    weight = torch.randn(11, 3, generator=generator, dtype=F64, requires_grad=True)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 5), generator=generator)
    options = {"top_k": 4, "top_p": 0.7}
    outs = [
        rlo.token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=3, **options),
        rlo.token_log_probs(logits, tokens, chunk_size=3, **options),
        rlo.token_entropy(logits, chunk_size=3, **options),
    ]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("sorted in backward")

    monkeypatch.setattr(torch.Tensor, "topk", refuse)
    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    for out in outs:
        out.where(torch.isfinite(out), 0.0).sum().backward()
    assert hidden.grad is not None and logits.grad is not None


class _LargeAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts fresh op results of at least ``numel`` elements (not views, in-place or out=)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        storages = {
            t.untyped_storage().data_ptr()
            for t in [*args, *(kwargs or {}).values()]
            if isinstance(t, torch.Tensor)
        }
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.numel:
                self.count += tensor.untyped_storage().data_ptr() not in storages
        return out


@pytest.mark.parametrize("kind", ["ids", "top_k+top_p"])
def test_from_hidden_never_forms_the_full_logits(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # N = 96 rows in chunks of 32 at V = 4096: nothing of half the (N, V) logits is allocated
    # once no logits are kept for the backward pass (SAVED_LOGITS = 0: every chunk recomputed).
    monkeypatch.setattr(saved_logits, "SAVED_LOGITS", 0)
    rows, vocab, width = 96, 4096, 8
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, rows // 2, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    tokens = torch.randint(0, vocab, (2, rows // 2), generator=generator)
    kept = _kept(kind, generator, (2, rows // 2), vocab, tokens)
    advantages = torch.randn(2, generator=generator)
    with _LargeAllocations(rows * vocab // 2) as counter:
        out = rlo.token_log_probs_from_hidden(
            hidden, weight, tokens, chunk_size=32, return_entropy=True, **kept
        )
        (out.log_probs.nan_to_num(neginf=0.0).sum() + out.entropy.sum()).backward()
        loss = rlo.fused_policy_loss_from_hidden(
            hidden, weight, tokens, torch.full((2, rows // 2), -8.0), advantages,
            torch.ones(2, rows // 2, dtype=torch.bool), chunk_size=32, entropy_coef=0.1, **kept,
        )  # fmt: skip
        loss.loss.backward()
    assert counter.count == 0


def test_float32_and_bfloat16_compute_in_float32() -> None:
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 6, 50, generator=generator)
    tokens = torch.randint(0, 50, (4, 6), generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        rounded = logits.to(dtype)
        out = rlo.token_log_probs(rounded, tokens, top_k=20, temperature=0.7)
        want, _ = reference.truncated_log_probs(rounded.double(), tokens, None, 0.7, top_k=20)
        assert out.dtype == torch.float32
        torch.testing.assert_close(
            out.double().nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0),
            **tolerance(torch.float32),
        )  # fmt: skip


def test_the_kernels_backend_refuses_kept_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Triton LM head takes no kept set: an explicit request for the kernels raises (never
    # a silent fallback), and the torch backend gives the same values as the default.
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(2, 3, 4, generator=generator)
    weight = torch.randn(9, 4, generator=generator)
    tokens = torch.randint(0, 9, (2, 3), generator=generator)
    want = rlo.token_log_probs_from_hidden(hidden, weight, tokens, top_k=3)
    with rlo.use_backend("torch"):
        assert torch.equal(rlo.token_log_probs_from_hidden(hidden, weight, tokens, top_k=3), want)
    monkeypatch.setenv("RLOBJECTIVES_KERNELS", "triton")
    with pytest.raises(ValueError, match="kept set"):
        rlo.token_log_probs_from_hidden(hidden, weight, tokens, top_k=3)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="kept set"):
        warnings.simplefilter("ignore")
        rlo.fused_policy_loss_from_hidden(
            hidden, weight, tokens, torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), top_k=3
        )


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"top_k": 0}, ValueError, r"^top_k must be >= 1, got 0; pass top_k=None"),
        ({"top_k": -1}, ValueError, r"^top_k must be >= 1, got -1; pass top_k=None .*-1"),
        ({"top_k": 2.0}, TypeError, r"^top_k must be a positive int"),
        ({"top_k": True}, TypeError, r"^top_k must be a positive int"),
        ({"top_p": 0.0}, ValueError, r"^top_p must be > 0"),
        ({"top_p": 1.5}, ValueError, r"^top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, ValueError, r"^top_p must be finite"),
        ({"top_p": "0.9"}, TypeError, r"^top_p"),
        ({"kept_ids": torch.zeros(3, 2)}, TypeError, r"^kept_ids must be an integer"),
        ({"kept_ids": torch.zeros(3, 2, dtype=torch.long), "top_k": 1}, ValueError,
         r"^kept_ids and top_k are alternatives"),
        ({"kept_mask": torch.ones(3, 4, dtype=torch.bool), "kept_ids": torch.zeros(3, 1,
          dtype=torch.long)}, ValueError, r"^kept_ids and kept_mask are alternatives"),
        ({"kept_ids": torch.zeros(2, 2, dtype=torch.long)}, ValueError,
         r"^kept_ids must have shape \(3,\) \+ \(K,\)"),
        ({"kept_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError,
         r"^kept_mask must have V = 4"),
        ({"kept_pad": 0.5}, TypeError, r"^kept_pad must be an int"),
        ({"vocab_group": "tp"}, TypeError, r"^vocab_group must be a torch.distributed"),
    ],
)  # fmt: skip
def test_errors_name_the_argument(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        rlo.token_log_probs(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), **options)


@pytest.mark.compile
def test_kept_sets_trace_under_torch_compile() -> None:
    generator = torch.Generator().manual_seed(10)
    logits = torch.randn(6, 12, generator=generator)
    tokens = torch.randint(0, 12, (6,), generator=generator)
    ids = torch.randint(-1, 12, (6, 3), generator=generator)

    def call(x: torch.Tensor) -> torch.Tensor:
        return rlo.token_log_probs(x, tokens, kept_ids=ids) + rlo.token_entropy(x, top_k=5)

    compiled = torch.compile(call, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(logits), call(logits))


def test_unselected_rows_with_an_empty_set_reach_nothing() -> None:
    # A masked row whose recorded ids are all outside [0, V) (an empty set: no finite logit) is
    # recomputed from a zero hidden row; it must not turn into NaN in any gradient.
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, 4, 3, generator=generator, dtype=F64)
    weight = torch.randn(6, 3, generator=generator, dtype=F64)
    tokens = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[True, False, True, False]])
    kept = torch.tensor([[[1, 2, -1], [9, 9, 9], [3, 0, -1], [7, -1, -1]]])
    poisoned = torch.where(mask[..., None], hidden, math.nan)
    for fn in ("log_probs", "fused"):
        results = []
        for source in (hidden, poisoned):
            leaves = [source.clone().requires_grad_(), weight.clone().requires_grad_()]
            if fn == "log_probs":
                out = rlo.token_log_probs_from_hidden(
                    *leaves, tokens, mask=mask, kept_ids=kept, return_entropy=True
                )
                total = out.log_probs.sum() + out.entropy.sum()
            else:
                total = rlo.fused_policy_loss_from_hidden(
                    *leaves, tokens, torch.full((1, 4), -1.0, dtype=F64),
                    torch.ones(1, dtype=F64), mask, kept_ids=kept, entropy_coef=0.1,
                ).loss  # fmt: skip
            results.append(torch.autograd.grad(total, leaves))
        for clean, dirty in zip(*results, strict=True):
            assert torch.isfinite(dirty).all()
            assert torch.equal(clean, dirty)
