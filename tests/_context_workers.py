"""Multi-process harness of tests/distributed/test_context_parallel.py (context parallelism).

Spawned children import this module by name, so it holds what both sides need: the problems
(float64, NaN/inf at every unselected position), how a problem's tokens are split over the ranks
of a context group, the calls of each function (the same code runs on a rank's share with
``context_group`` and, in the parent, on the whole problem without it), and the worker.

A case is a :class:`Case`: a function, its options, a layout (``padded`` / ``packed``), a split
and a group. Every rank of the case's group builds the same whole problem from the case's seed,
keeps its tokens, calls the function with ``context_group``, and differentiates one objective
(:func:`objective`): the replicated outputs (a loss, per-sequence values, identical on every
rank) weighted by fixed coefficients, plus its own tokens of the per-token outputs weighted by
the whole problem's coefficients at those tokens. The parent computes the same objective on the
whole problem in one process (the replicated part once, the per-token part over all tokens) and
checks each rank's outputs and gradients at its tokens against it.

Splits (per sequence, over the ``W`` ranks in group order):

- ``chunks``: contiguous chunks with random cut points per sequence (one rank holds no token of
  sequence 0; padded rows padded to the rank's longest chunk);
- ``slices``: the same cut points for every row (each rank's rows are exact slices of the padded
  rows, Megatron CP's split; needed by ``gae(holes="zero")`` and the default Dr. GRPO constant);
- ``scatter``: every token on a random rank (any subset; not for the reverse scans).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import rlobjectives as rlo
from _spawn import spawn_ranks
from custom_surrogate import TanhSurrogate
from rlobjectives._core.backend import triton_available
from rlobjectives.distributed import global_normalizers, normalizer_for_reduction

WORLD_SIZE = 4  # one launch: pairs {0, 1} and {2, 3}, the trio {0, 1, 2}, DP pairs {0, 2}, {1, 3}
GROUPS: dict[str, tuple[int, ...]] = {"pair": (0, 1), "pair_b": (2, 3), "trio": (0, 1, 2)}
SEQUENCES, WIDTH, VOCAB, HIDDEN = 5, 9, 7, 3
LENGTHS = (9, 4, 0, 7, 2)  # sequence 2 selects no token
# The group's timeout (the rendezvous and every collective): a rank waits for the slowest one's
# imports (4 processes on 2 loaded cores: up to ~40 s measured) and cases (~4 s). Generous, so a
# slow CI never times out; a rank that fails writes its traceback and ends the run at once.
COLLECTIVE_TIMEOUT_S = 180.0
JOIN_TIMEOUT_S = 300.0  # the whole launch
NAN, INF = float("nan"), float("inf")


class Case(NamedTuple):
    """One call: ``function`` (a key of :data:`CALLS`) with ``options`` on a split problem."""

    name: str
    function: str
    options: dict[str, Any]
    layout: str = "padded"  # or "packed"
    split: str = "chunks"  # "chunks", "slices" or "scatter"
    group: str = "pair"  # a key of GROUPS
    kernels: bool = False  # RLOBJECTIVES_KERNELS=triton through the interpreter
    seed: int = 0
    dtype: torch.dtype = torch.float64  # of the floating inputs (bf16: computed in float32)


# ------------------------------------------------------------------------------- problems
class Problem(NamedTuple):
    """A whole problem: per-token tensors ``(S, T)`` padded or ``(1, N)`` packed, and more."""

    tokens: dict[str, torch.Tensor]  # per-token floats (NaN/inf at unselected positions)
    mask: torch.Tensor  # bool, the selection
    ids: torch.Tensor  # int64 token ids (hidden-state calls)
    sequences: dict[str, torch.Tensor]  # (S,) per-sequence values
    cu_seqlens: torch.Tensor | None  # (S + 1,) packed boundaries
    positions: torch.Tensor  # per-token index within its sequence (for the splits)
    sequence_of: torch.Tensor  # per-token sequence index
    weights: dict[str, torch.Tensor]  # objective coefficients: per-token and per-sequence


def make_problem(case: Case) -> Problem:
    """The whole problem of ``case`` (the same in every process)."""
    generator = torch.Generator().manual_seed(1000 + case.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    shape = (SEQUENCES, WIDTH)
    positions = torch.arange(WIDTH).expand(shape)
    mask = positions < torch.tensor(LENGTHS).unsqueeze(1)
    mask[0, 3] = False  # a hole inside a response
    mask[3, 5] = False
    log_probs = -randn(*shape).abs() - 0.1
    old = log_probs + 0.35 * randn(*shape)  # far enough from log_probs for the clips to bind
    floats = {
        "log_probs": log_probs,
        "old_log_probs": old,
        "ref_log_probs": log_probs + 0.3 * randn(*shape),
        "entropy": 2.0 * torch.rand(shape, generator=generator, dtype=torch.float64),
        "values": randn(*shape),
        "old_values": randn(*shape),
        "returns": randn(*shape),
        "rewards": randn(*shape),
        "token_advantages": randn(*shape),
    }
    floats["entropy"] = (floats["entropy"] * 8).round() / 8  # ties for the quantile
    poison = {"log_probs": NAN, "old_log_probs": INF, "ref_log_probs": -INF, "entropy": NAN}
    tokens = {
        name: torch.where(mask, value, poison.get(name, NAN)) for name, value in floats.items()
    }
    ids = torch.randint(0, VOCAB, shape, generator=generator)
    sequences = {
        "advantages": randn(SEQUENCES),
        "scores": randn(SEQUENCES),
        "importance_weights": 0.5 + torch.rand(SEQUENCES, generator=generator, dtype=torch.float64),
    }
    weights = {
        "tokens": randn(*shape),
        "sequences": randn(SEQUENCES),
        "scalar": torch.tensor(1.0, dtype=torch.float64),
    }
    sequence_of = torch.arange(SEQUENCES).unsqueeze(1).expand(shape)
    dtype = torch.float32 if case.kernels else case.dtype  # the kernels compute in float32
    if dtype != torch.float64:  # (float64 takes the PyTorch path)
        tokens = {name: value.to(dtype) for name, value in tokens.items()}
        sequences = {name: value.to(dtype) for name, value in sequences.items()}
    problem = Problem(tokens, mask, ids, sequences, None, positions, sequence_of, weights)
    return problem if case.layout == "padded" else _packed(problem)


def _packed(problem: Problem) -> Problem:
    """The packed problem: each sequence's first ``LENGTHS[i]`` positions, concatenated."""
    keep = problem.positions < torch.tensor(LENGTHS).unsqueeze(1)  # (S, T)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[keep].unsqueeze(0)  # (1, N)

    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return Problem(
        {name: pack(value) for name, value in problem.tokens.items()},
        pack(problem.mask),
        pack(problem.ids),
        problem.sequences,
        cu,
        pack(problem.positions),
        pack(problem.sequence_of),
        {**problem.weights, "tokens": pack(problem.weights["tokens"])},
    )


# --------------------------------------------------------------------------------- splits
def owners(case: Case, problem: Problem, world: int) -> torch.Tensor:
    """The rank (in group order) holding each token of ``problem``, the shape of its mask."""
    generator = torch.Generator().manual_seed(2000 + case.seed)
    if case.split == "scatter":
        owner = torch.randint(0, world, problem.mask.shape, generator=generator)
        owner[problem.sequence_of == 1] = 0  # rank 1 holds no token of sequence 1
        return owner
    length = WIDTH if case.layout == "padded" else max(LENGTHS)
    if case.split == "slices":
        cuts = torch.sort(torch.randint(0, length + 1, (world - 1,), generator=generator)).values
        cuts = cuts.expand(SEQUENCES, world - 1)
    else:
        cuts = torch.sort(
            torch.randint(0, length + 1, (SEQUENCES, world - 1), generator=generator), dim=-1
        ).values
        if world == 2:
            cuts[0] = length  # rank 1 holds no token of sequence 0
        else:
            cuts[0] = 2  # rank 1 (of 3) holds no token of sequence 0
        cuts[1, 0] = 0  # rank 0 holds no token of sequence 1
    cut = cuts[problem.sequence_of]  # (..., W - 1) per token
    return (problem.positions.unsqueeze(-1) >= cut).sum(-1)  # chunks in rank order


class Share(NamedTuple):
    """A rank's share: the local tensors and where each local token sits in the whole."""

    problem: Problem  # local per-token tensors; per-sequence values unchanged
    index: torch.Tensor  # flat index of each local token in the whole problem, -1 at padding


def share(problem: Problem, owner: torch.Tensor, rank: int) -> Share:
    """This rank's tokens: padded rows re-padded to the longest local row, or packed segments."""
    flat_index = torch.arange(problem.mask.numel()).reshape(problem.mask.shape)
    mine = owner == rank
    if problem.cu_seqlens is None:
        rows = [flat_index[i][mine[i]] for i in range(SEQUENCES)]
        width = max(len(row) for row in rows)
        index = torch.full((SEQUENCES, width), -1, dtype=torch.int64)
        for i, row in enumerate(rows):
            index[i, : len(row)] = row
        cu = None
    else:
        sequence = problem.sequence_of.reshape(-1)
        picked = flat_index.reshape(-1)[mine.reshape(-1)]
        index = picked.unsqueeze(0)
        counts = torch.bincount(sequence[picked], minlength=SEQUENCES)
        cu = torch.tensor([0, *counts.cumsum(0).tolist()])

    def local(tensor: torch.Tensor, fill: float | bool | int) -> torch.Tensor:
        flat = torch.cat([tensor.reshape(-1), torch.full((1,), fill, dtype=tensor.dtype)])
        return flat[index.clamp(min=-1) % (tensor.numel() + 1)].reshape(index.shape)

    tokens = {name: local(value, NAN) for name, value in problem.tokens.items()}
    local_problem = Problem(
        tokens,
        local(problem.mask, False),
        local(problem.ids, 0),
        problem.sequences,
        cu,
        local(problem.positions, 0),
        local(problem.sequence_of, 0),
        {**problem.weights, "tokens": local(problem.weights["tokens"], NAN)},
    )
    return Share(local_problem, index)


# ---------------------------------------------------------------------------------- calls
# A call: (problem, leaves, group, options) -> (replicated outputs, per-token outputs).
Outputs = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
Call = Callable[[Problem, dict[str, torch.Tensor], Any, dict[str, Any]], Outputs]


def _packing(problem: Problem) -> dict[str, Any]:
    return {} if problem.cu_seqlens is None else {"cu_seqlens": problem.cu_seqlens}


def _call_policy(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    options = dict(o)
    if options.pop("entropy", False):
        options["entropy"] = leaves["entropy"]
    if options.pop("per_sequence_weights", False):
        options["importance_weights"] = p.sequences["importance_weights"]
    if options.pop("normalizers", False):  # counted over the group (the whole sequences)
        masks = [p.mask]
        cu = None if p.cu_seqlens is None else [p.cu_seqlens]
        dp = None if group is None else o_dp_group()
        counts = global_normalizers(masks, cu_seqlens=cu, group=dp, context_group=group)
        options["normalizer"] = normalizer_for_reduction(counts, reduction=options["reduction"])
        options["diagnostics_normalizer"] = counts.tokens
    advantages = (
        p.tokens["token_advantages"]
        if options.pop("token_advantages", False)
        else (p.sequences["advantages"])
    )
    out = rlo.policy_loss(
        leaves["log_probs"],
        p.tokens["old_log_probs"],
        advantages,
        p.mask,
        **options,
        **_packing(p),
        context_group=group,
    )
    diagnostics = {f"diag_{k}": v for k, v in out.diagnostics._asdict().items()}
    if out.loss.ndim == 0:
        sharded = {} if out.per_token_loss is None else {"per_token_loss": out.per_token_loss}
        return {"loss": out.loss, **diagnostics}, sharded
    return diagnostics, {"loss": out.loss}


_DP_GROUP: list[Any] = [None]


def o_dp_group() -> Any:
    """The data-parallel group of this rank (set by the worker; None in the parent)."""
    return _DP_GROUP[0]


def _call_aggregate(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.aggregate(leaves["values"], p.mask, **o, **_packing(p), context_group=group)
    return ({"loss": out}, {}) if out.ndim == 0 else ({}, {"loss": out})


def _call_nll(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.nll_loss(leaves["log_probs"], p.mask, **o, **_packing(p), context_group=group)
    return ({"loss": out}, {}) if out.ndim == 0 else ({}, {"loss": out})


def _call_dft(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.dft_loss(leaves["log_probs"], p.mask, **o, **_packing(p), context_group=group)
    return ({"loss": out}, {}) if out.ndim == 0 else ({}, {"loss": out})


def _call_kl_loss(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.kl_loss(
        leaves["log_probs"],
        p.tokens["ref_log_probs"],
        p.mask,
        **o,
        **_packing(p),
        context_group=group,
    )
    return ({"loss": out}, {}) if out.ndim == 0 else ({}, {"loss": out})


def _call_kl_rewards(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.kl_penalized_rewards(
        leaves["log_probs"],
        p.tokens["ref_log_probs"],
        p.sequences["scores"],
        p.mask,
        0.3,
        **_packing(p),
        context_group=group,
    )
    return dict(out), {}


def _call_kl_token_rewards(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.kl_penalized_token_rewards(
        p.tokens["log_probs"],
        p.tokens["ref_log_probs"],
        p.sequences["scores"],
        p.mask,
        kl_coef=0.2,
        **o,
        **_packing(p),
        context_group=group,
    )
    return {}, {"rewards": out}


def _call_value(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.value_loss(
        leaves["values"],
        p.tokens["old_values"],
        p.tokens["returns"],
        p.mask,
        **o,
        **_packing(p),
        context_group=group,
    )
    replicated = {f"diag_{k}": v for k, v in out.diagnostics._asdict().items()}
    if out.loss.ndim == 0:
        return {"loss": out.loss, **replicated}, {}
    return replicated, {"loss": out.loss}


def _call_rollout(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.rollout_correction(
        p.tokens["log_probs"],
        p.tokens["old_log_probs"],
        p.mask,
        **o,
        **_packing(p),
        context_group=group,
    )
    metrics = {f"metric_{k}": v for k, v in out.metrics._asdict().items()}
    return metrics, {"weights": out.weights, "mask": out.mask.double()}


def _call_off_policy(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.off_policy_sequence_mask(
        p.tokens["log_probs"],
        p.tokens["old_log_probs"],
        p.sequences["advantages"],
        p.mask,
        threshold=0.05,
        **_packing(p),
        context_group=group,
    )
    return {}, {"mask": out.double()}


def _call_rejection(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.rejection_mask(
        p.tokens["log_probs"], p.tokens["old_log_probs"], p.mask, **o, **_packing(p),
        context_group=group,
    )  # fmt: skip
    return {}, {"mask": out.double()}


def _call_entropy_mask(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    out = rlo.top_entropy_mask(p.tokens["entropy"], p.mask, **o, context_group=group)
    return {}, {"mask": out.double()}


def _call_gae(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    options = dict(o)
    if options.pop("per_sequence_lam", False):  # VAPO: a lambda per sequence, the critic's own
        sequences = p.sequences["scores"].shape[0]
        options["lam"] = torch.linspace(0.5, 0.95, sequences, dtype=torch.float64)
        options["value_lam"] = torch.linspace(1.0, 0.6, sequences, dtype=torch.float64)
    out = rlo.gae(
        leaves["rewards"], leaves["values"], p.mask, **options, **_packing(p), context_group=group
    )
    return {}, {"advantages": out.advantages, "returns": out.returns}


def _call_reinforce(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    options = dict(o)
    if options.pop("token_rewards", False):
        options["token_rewards"] = leaves["rewards"]
    out = rlo.reinforce_plus_plus_advantages(
        p.sequences["scores"], p.mask, **options, **_packing(p), context_group=group
    )
    return {}, {"advantages": out}


def _call_fused(
    p: Problem, leaves: dict[str, torch.Tensor], group: Any, o: dict[str, Any]
) -> Outputs:
    options = dict(o)
    if options.pop("kl", False):
        options.update(ref_log_probs=p.tokens["ref_log_probs"], kl_coef=0.1, kl_estimator="k2")
    out = rlo.fused_policy_loss_from_hidden(
        leaves["hidden"],
        leaves["weight"],
        p.ids,
        p.tokens["old_log_probs"],
        p.sequences["advantages"],
        p.mask,
        bias=leaves["bias"],
        **options,
        **_packing(p),
        context_group=group,
    )
    diagnostics = {f"diag_{k}": v for k, v in out.diagnostics._asdict().items()}
    replicated = {
        "loss": out.loss,
        "policy_loss": out.policy_loss,
        "kl_loss": out.kl_loss,
        "entropy_loss": out.entropy_loss,
        **diagnostics,
    }
    return replicated, {"log_probs": out.log_probs}


CALLS: dict[str, Call] = {
    "policy_loss": _call_policy,
    "aggregate": _call_aggregate,
    "nll_loss": _call_nll,
    "dft_loss": _call_dft,
    "kl_loss": _call_kl_loss,
    "kl_penalized_rewards": _call_kl_rewards,
    "kl_penalized_token_rewards": _call_kl_token_rewards,
    "value_loss": _call_value,
    "rollout_correction": _call_rollout,
    "off_policy_sequence_mask": _call_off_policy,
    "rejection_mask": _call_rejection,
    "top_entropy_mask": _call_entropy_mask,
    "gae": _call_gae,
    "reinforce_plus_plus_advantages": _call_reinforce,
    "fused_policy_loss_from_hidden": _call_fused,
}

# The differentiable inputs of each function (leaves; the hidden-state ones are made below).
LEAVES: dict[str, tuple[str, ...]] = {
    "policy_loss": ("log_probs", "entropy"),
    "aggregate": ("values",),
    "nll_loss": ("log_probs",),
    "dft_loss": ("log_probs",),
    "kl_loss": ("log_probs",),
    "kl_penalized_rewards": ("log_probs",),
    "kl_penalized_token_rewards": (),
    "value_loss": ("values",),
    "rollout_correction": (),
    "off_policy_sequence_mask": (),
    "rejection_mask": (),
    "top_entropy_mask": (),
    "gae": ("rewards", "values"),
    "reinforce_plus_plus_advantages": ("rewards",),
    "fused_policy_loss_from_hidden": ("hidden", "weight", "bias"),
}


def head_parameters(problem: Problem, seed: int) -> dict[str, torch.Tensor]:
    """The LM head of the hidden-state cases: per-token ``hidden`` and the shared weight, bias."""
    generator = torch.Generator().manual_seed(3000 + seed)
    shape = (*problem.mask.shape, HIDDEN)
    dtype = problem.tokens["log_probs"].dtype
    return {
        "hidden": torch.randn(shape, generator=generator, dtype=dtype),
        "weight": torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype),
        "bias": torch.randn(VOCAB, generator=generator, dtype=dtype),
    }


def leaves_of(
    case: Case, whole: Problem, local: Problem, index: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The differentiable inputs: this rank's tokens (``index``), or the whole problem's."""
    leaves: dict[str, torch.Tensor] = {}
    names = LEAVES[case.function]
    if case.function == "fused_policy_loss_from_hidden":
        head = head_parameters(whole, case.seed)
        hidden = head["hidden"]
        if index is not None:
            flat = torch.cat(
                [hidden.reshape(-1, HIDDEN), torch.full((1, HIDDEN), NAN, dtype=hidden.dtype)]
            )
            hidden = flat[index % (flat.shape[0])].reshape(*index.shape, HIDDEN)
        head["hidden"] = hidden
        return {name: value.clone().requires_grad_(True) for name, value in head.items()}
    for name in names:
        leaves[name] = local.tokens[name].clone().requires_grad_(True)
    return leaves


def objective(
    replicated: dict[str, torch.Tensor],
    sharded: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The differentiated scalar: fixed weights times the replicated and the per-token outputs.

    NaN-safe: per-token weights are NaN only where the output is a padding or unselected zero,
    and those are selected away.
    """
    total = torch.zeros((), dtype=torch.float64)
    for key, value in sorted(replicated.items()):
        if not value.requires_grad or key.startswith(("diag_", "metric_")):
            continue
        weight = weights["scalar"] if value.ndim == 0 else weights["sequences"]
        total = total + (weight * value.double()).sum()
    for _, value in sorted(sharded.items()):
        if not value.requires_grad:
            continue
        w = weights["tokens"].reshape(value.shape)
        w = torch.where(torch.isnan(w), 0.0, w)  # 0 at padding (before the product: NaN-safe)
        total = total + (w * value.double()).sum()
    return total


def evaluate(
    case: Case, local: Problem, leaves: dict[str, torch.Tensor], group: Any
) -> dict[str, Any]:
    """Call, differentiate the objective, return the outputs and the leaves' gradients."""
    replicated, sharded = CALLS[case.function](local, leaves, group, dict(case.options))
    total = objective(replicated, sharded, local.weights)
    grads: dict[str, torch.Tensor] = {}
    if total.requires_grad:
        total.backward()
        grads = {n: v.grad.detach().clone() for n, v in leaves.items() if v.grad is not None}
    detach = lambda d: {k: v.detach().clone() for k, v in d.items()}  # noqa: E731
    return {"replicated": detach(replicated), "sharded": detach(sharded), "grads": grads}


# -------------------------------------------------------------------------------- the cases
def _policy_cases() -> list[Case]:
    cases = []
    reductions = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted")
    surrogates = {
        "clip": rlo.Clip(low=0.2, high=0.28, dual=3.0),
        "cispo": rlo.CISPO(cap=1.2),
        "sapo": rlo.SAPO(),
        "gmpo": rlo.GMPO(low=0.2),
        "vespo": rlo.VESPO(),
        "custom": TanhSurrogate(),  # a user's own, written outside the library
        # one reward per sequence (the same on every rank): a token reads its response's sign
        "topr": rlo.TOPR(torch.tensor([1.0, 0.0, -1.0, 2.0, -0.5]), negative_weight=0.5),
    }
    seed = 0
    for layout in ("padded", "packed"):
        for name, surrogate in surrogates.items():
            for reduction in reductions:
                seed += 1
                options: dict[str, Any] = {"surrogate": surrogate, "reduction": reduction}
                if reduction == "sequence_sum_normalized":
                    options["max_response_length"] = 11
                group = "trio" if seed % 3 == 0 else "pair"
                cases.append(
                    Case(
                        f"policy-{layout}-{name}-{reduction}",
                        "policy_loss",
                        options,
                        layout,
                        "scatter" if seed % 4 == 0 else "chunks",
                        group,
                        seed=seed,
                    )
                )
        extra: list[tuple[str, dict[str, Any], str]] = [
            (
                "gspo-seqmean",
                {"surrogate": "clip", "ratio_level": "sequence", "reduction": "sequence_mean"},
                "chunks",
            ),
            ("gspo-token", {"surrogate": rlo.CISPO(cap=1.5), "ratio_level": "sequence"}, "trio"),
            (
                "entropy-none",
                {"entropy": True, "entropy_coef": 0.05, "reduction": "none"},
                "chunks",
            ),
            (
                "entropy-seqmean",
                {
                    "entropy": True,
                    "entropy_coef": 0.05,
                    "reduction": "sequence_mean",
                    "return_per_token": True,
                },
                "chunks",
            ),
            ("drgrpo-default-c", {"reduction": "sequence_sum_normalized"}, "slices"),
            ("vespo-seq-weights", {"surrogate": "vespo", "per_sequence_weights": True}, "chunks"),
            (
                "token-advantages",
                {
                    "token_advantages": True,
                    "reduction": "sequence_mean",
                    "per_sequence_weights": True,
                },
                "scatter",
            ),
            ("normalizers", {"normalizers": True, "reduction": "sequence_mean"}, "chunks"),
        ]
        for name, options, split in extra:
            seed += 1
            group = "trio" if split == "trio" else "pair"
            split = "chunks" if split == "trio" else split
            cases.append(
                Case(
                    f"policy-{layout}-{name}",
                    "policy_loss",
                    options,
                    layout,
                    split,
                    group,
                    seed=seed,
                )
            )
    return cases


def _other_cases() -> list[Case]:
    cases: list[Case] = []
    seed = 100
    rows: list[tuple[str, str, dict[str, Any], str, str]] = [
        ("aggregate", "token", {"reduction": "token_mean"}, "scatter", "pair"),
        ("aggregate", "seqmean", {"reduction": "sequence_mean"}, "chunks", "trio"),
        ("aggregate", "drgrpo", {"reduction": "sequence_sum_normalized"}, "slices", "trio"),
        ("aggregate", "none", {"reduction": "none"}, "chunks", "pair"),
        ("nll_loss", "token", {"reduction": "token_mean"}, "scatter", "trio"),
        ("nll_loss", "seqmean", {"reduction": "sequence_mean"}, "chunks", "pair"),
        (
            "kl_loss",
            "k2-seqmean",
            {"estimator": "k2", "reduction": "sequence_mean"},
            "chunks",
            "trio",
        ),
        ("kl_loss", "k3-token", {"estimator": "k3", "straight_through": True}, "scatter", "pair"),
        ("kl_penalized_rewards", "d", {}, "chunks", "trio"),
        ("kl_penalized_token_rewards", "k1", {}, "chunks", "trio"),
        ("kl_penalized_token_rewards", "k3", {"estimator": "k3"}, "chunks", "pair"),
        ("value_loss", "token", {"clip": 0.2}, "chunks", "pair"),
        ("value_loss", "seqmean", {"clip": 0.3, "reduction": "sequence_mean"}, "chunks", "trio"),
        (
            "rollout_correction",
            "sequence-truncate",
            {"level": "sequence", "upper": 1.5},
            "chunks",
            "trio",
        ),
        (
            "rollout_correction",
            "geometric-reject",
            {"level": "geometric", "mode": "reject", "lower": 0.9, "upper": 1.1},
            "chunks",
            "pair",
        ),
        (
            "rollout_correction",
            "token-mask-veto",
            {"mode": "mask", "lower": 0.6, "upper": 1.6, "veto": 0.5},
            "scatter",
            "pair",
        ),
        (
            "rollout_correction",
            "sequence-mask-veto",
            {"level": "sequence", "mode": "mask", "upper": 3.0, "veto": 0.3},
            "chunks",
            "trio",
        ),
        ("off_policy_sequence_mask", "opsm", {}, "chunks", "trio"),
        ("reinforce_plus_plus_advantages", "plain", {}, "chunks", "trio"),
        (
            "reinforce_plus_plus_advantages",
            "discounted",
            {"token_rewards": True, "gamma": 0.9, "unbiased": True},
            "chunks",
            "pair",
        ),
        (
            "reinforce_plus_plus_advantages",
            "zero-holes",
            {"token_rewards": True, "gamma": 0.8, "holes": "zero"},
            "slices",
            "trio",
        ),
        ("gae", "skip", {"gamma": 0.95, "lam": 0.9}, "chunks", "trio"),
        ("gae", "skip-whiten", {"gamma": 1.0, "lam": 0.7, "whiten": True}, "chunks", "pair"),
        ("gae", "zero", {"gamma": 0.9, "lam": 0.8, "holes": "zero"}, "slices", "trio"),
        ("gae", "per-sequence-lam", {"gamma": 0.97, "per_sequence_lam": True}, "chunks", "trio"),
        (
            "fused_policy_loss_from_hidden",
            "clip-token",
            {"entropy_coef": 0.01, "kl": True},
            "chunks",
            "trio",
        ),
        (
            "fused_policy_loss_from_hidden",
            "clip-seqmean",
            {"reduction": "sequence_mean", "temperature": 0.7},
            "scatter",
            "pair",
        ),
        (
            "fused_policy_loss_from_hidden",
            "gspo",
            {"ratio_level": "sequence", "reduction": "sequence_mean", "kl": True},
            "chunks",
            "pair",
        ),
        ("fused_policy_loss_from_hidden", "gmpo", {"surrogate": "gmpo"}, "chunks", "trio"),
        # "prompt_mean": prompts {0, 2 (empty)}, {1, 4}, {3} by label; contiguous pairs can't
        # split 5 sequences, so the labels everywhere
        (
            "aggregate",
            "prompt",
            {"reduction": "prompt_mean", "group_ids": [7, 8, 7, 9, 8]},
            "chunks",
            "trio",
        ),
        (
            "nll_loss",
            "prompt",
            {"reduction": "prompt_mean", "group_ids": [0, 1, 0, 2, 1], "normalizer": 5.0},
            "scatter",
            "pair",
        ),
        (
            "dft_loss",
            "prompt",
            {"reduction": "prompt_mean", "group_ids": [0, 0, 1, 1, 1]},
            "slices",
            "trio",
        ),
        ("dft_loss", "token", {"reduction": "token_mean"}, "chunks", "pair"),
        (
            "rejection_mask",
            "sum",
            {"upper": 2.0, "level": "sequence", "aggregate": "sum"},
            "chunks",
            "trio",
        ),
        (
            "rejection_mask",
            "max-k2",
            {"upper": 0.08, "level": "sequence", "aggregate": "max", "estimator": "k2"},
            "scatter",
            "pair",
        ),
        (
            "rejection_mask",
            "mean-binary",
            {"upper": 0.02, "level": "sequence", "symmetric": True},
            "slices",
            "trio",
        ),
    ]
    for layout in ("padded", "packed"):
        for function, name, options, split, group in rows:
            seed += 1
            cases.append(
                Case(
                    f"{function}-{layout}-{name}",
                    function,
                    options,
                    layout,
                    split,
                    group,
                    seed=seed,
                )
            )
    for quantile in (0.0, 0.4, 1.0):  # padded only (top_entropy_mask has no cu_seqlens)
        seed += 1
        cases.append(
            Case(
                f"top_entropy_mask-{quantile}",
                "top_entropy_mask",
                {"quantile": quantile},
                "padded",
                "scatter",
                "trio",
                seed=seed,
            )
        )
    return cases


def _kernel_cases() -> list[Case]:
    """The paths with Triton kernels, through the interpreter (few and small)."""
    rows: list[tuple[str, str, dict[str, Any], str]] = [
        ("policy_loss", "clip-seqmean", {"reduction": "sequence_mean"}, "padded"),
        (
            "policy_loss",
            "gspo",
            {"ratio_level": "sequence", "entropy": True, "entropy_coef": 0.02},
            "packed",
        ),
        ("policy_loss", "sapo-none", {"surrogate": "sapo", "reduction": "none"}, "padded"),
        ("kl_loss", "k3-seqmean", {"reduction": "sequence_mean"}, "packed"),
        ("kl_penalized_rewards", "d", {}, "padded"),
        ("fused_policy_loss_from_hidden", "clip", {"kl": True, "entropy_coef": 0.01}, "padded"),
    ]
    return [
        Case(
            f"triton-{function}-{name}",
            function,
            options,
            layout,
            "chunks",
            "pair",
            True,
            seed=500 + k,
        )
        for k, (function, name, options, layout) in enumerate(rows)
    ]


def _surrogate35_cases() -> list[Case]:
    """REAL: the group-level objective over the whole sequences of the ranks (the seeds give
    groups with both labels, and one without: its L_g = 0). FIPO: the future sums carried from
    the later ranks' chunks (padded: the ranks' rows exact slices of the padded rows)."""
    ids = torch.tensor([0, 0, 1, 1, 1])  # sequence 2 (no selected token) takes no part
    real = {"surrogate": rlo.REAL(tau=0.7), "group_ids": ids}
    fipo = {
        "surrogate": rlo.FIPO(
            gamma=0.7, cap=0.8, cap_high_only=False, delta=1.5, safety_threshold=1.2
        )
    }
    free = {"surrogate": rlo.FIPO(gamma=0.8, cap=None)}  # every influence weight e^F
    rows = [
        ("padded", "real-prompt_mean", real, "prompt_mean", "chunks", "pair", 49),
        ("packed", "real-prompt_mean", real, "prompt_mean", "chunks", "trio", 53),
        ("padded", "real-token_mean", real, "token_mean", "scatter", "trio", 55),
        ("packed", "real-sequence_mean", real, "sequence_mean", "scatter", "pair", 43),
        ("padded", "fipo-token_mean", free, "token_mean", "slices", "pair", 61),
        ("padded", "fipo-sequence_mean", fipo, "sequence_mean", "slices", "trio", 62),
        ("packed", "fipo-token_mean", free, "token_mean", "chunks", "pair", 63),
        ("packed", "fipo-length_weighted", fipo, "length_weighted", "chunks", "trio", 64),
    ]
    return [
        Case(f"policy-{layout}-{name}", "policy_loss", {**options, "reduction": reduction},
             layout, split, group, seed=seed)
        for layout, name, options, reduction, split, group, seed in rows
    ]  # fmt: skip


def _bfloat16_cases() -> list[Case]:
    """bf16 inputs, computed in float32: the sums cross the ranks in float64 buffers."""
    bf16 = torch.bfloat16
    return [
        Case(
            "bf16-policy-gspo-seqmean",
            "policy_loss",
            {"ratio_level": "sequence", "reduction": "sequence_mean"},
            seed=600,
            dtype=bf16,
        ),
        Case(
            "bf16-policy-vespo-packed",
            "policy_loss",
            {"surrogate": "vespo"},
            "packed",
            group="trio",
            seed=601,
            dtype=bf16,
        ),
        Case(
            "bf16-kl_loss-seqmean",
            "kl_loss",
            {"estimator": "k2", "reduction": "sequence_mean"},
            seed=602,
            dtype=bf16,
        ),
    ]


CASES: list[Case] = [
    *_policy_cases(),
    *_surrogate35_cases(),
    *_other_cases(),
    *_bfloat16_cases(),
    *(_kernel_cases() if triton_available() else []),
]


# ---------------------------------------------------------------------------------- worker
def run_cases(rank: int, groups: dict[str, Any]) -> dict[str, Any]:
    """Every case whose group holds this rank: its outputs, gradients and token index."""
    results: dict[str, Any] = {}
    for case in CASES:
        members = GROUPS[case.group]
        if rank not in members:
            continue
        position = members.index(rank)
        if os.environ.get("CONTEXT_DEBUG"):
            print(f"rank {rank}: {case.name}", flush=True)
        os.environ["RLOBJECTIVES_KERNELS"] = "triton" if case.kernels else "torch"
        whole = make_problem(case)
        piece = share(whole, owners(case, whole, len(members)), position)
        leaves = leaves_of(case, whole, piece.problem, piece.index)
        result = evaluate(case, piece.problem, leaves, groups[case.group])
        result["index"] = piece.index
        results[case.name] = result
    os.environ["RLOBJECTIVES_KERNELS"] = "torch"
    return results


def data_parallel_results(rank: int, context: Any, data: Any) -> dict[str, Any]:
    """DP x CP (2 x 2): each DP replica a different problem, split over its CP pair.

    The normalisers are counted over both groups; every rank returns its CP pair's loss (the
    share of the whole step) and its tokens' gradient.
    """
    replica = rank // 2  # ranks {0, 1} hold problem A, {2, 3} problem B
    out: dict[str, Any] = {}
    for reduction in ("token_mean", "sequence_mean", "sequence_sum_normalized"):
        case = Case(f"dp-{reduction}", "policy_loss", {"reduction": reduction}, seed=700 + replica)
        whole = make_problem(case)
        piece = share(whole, owners(case, whole, 2), rank % 2)
        local = piece.problem
        counts = global_normalizers([local.mask], group=data, context_group=context)
        log_probs = local.tokens["log_probs"].clone().requires_grad_(True)
        loss = rlo.policy_loss(
            log_probs,
            local.tokens["old_log_probs"],
            local.sequences["advantages"],
            local.mask,
            reduction=reduction,
            normalizer=normalizer_for_reduction(counts, reduction=reduction),
            max_response_length=WIDTH,
            diagnostics_normalizer=counts.tokens,
            context_group=context,
        )
        loss.loss.backward()
        out[reduction] = {
            "loss": loss.loss.detach(),
            "grad": log_probs.grad.detach().clone(),
            "index": piece.index,
            "counts": [int(c) for c in counts],
            "diagnostics": loss.diagnostics.clipped_fraction.detach(),
        }
    return out


class Traffic:
    """Counts the collectives a call makes and the bytes of their payloads (a wrapper)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __enter__(self) -> Traffic:
        self.saved = (dist.all_reduce, dist.all_gather)
        reduce_, gather = self.saved

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
            return reduce_(tensor, *args, **kwargs)

        def all_gather(
            outputs: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            self.calls.append(("all_gather", tensor.numel() * tensor.element_size()))
            return gather(outputs, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather = self.saved  # type: ignore[assignment]


def traffic_results(rank: int, group: Any, data: Any) -> dict[str, Any]:
    """The collectives (kind, payload bytes) of one forward of representative calls (pair)."""
    case = Case("traffic", "policy_loss", {}, seed=800)
    whole = make_problem(case)
    local = share(whole, owners(case, whole, 2), rank).problem
    t, m, a = local.tokens, local.mask, local.sequences["advantages"]
    calls: dict[str, Callable[[], Any]] = {
        "policy_loss token_mean": lambda: rlo.policy_loss(
            t["log_probs"], t["old_log_probs"], a, m, context_group=group
        ),
        "policy_loss sequence_mean": lambda: rlo.policy_loss(
            t["log_probs"],
            t["old_log_probs"],
            a,
            m,
            reduction="sequence_mean",
            context_group=group,
        ),
        "policy_loss GSPO sequence_mean": lambda: rlo.policy_loss(
            t["log_probs"],
            t["old_log_probs"],
            a,
            m,
            ratio_level="sequence",
            reduction="sequence_mean",
            context_group=group,
        ),
        "kl_loss sequence_mean": lambda: rlo.kl_loss(
            t["log_probs"],
            t["ref_log_probs"],
            m,
            estimator="k2",
            reduction="sequence_mean",
            context_group=group,
        ),
        "kl_penalized_rewards": lambda: rlo.kl_penalized_rewards(
            t["log_probs"],
            t["ref_log_probs"],
            local.sequences["scores"],
            m,
            0.1,
            context_group=group,
        ),
        "gae": lambda: rlo.gae(
            t["rewards"], t["values"], m, gamma=0.9, lam=0.9, context_group=group
        ),
        "global_normalizers": lambda: global_normalizers([m, m], group=data, context_group=group),
        "value_loss clip sequence_mean": lambda: rlo.value_loss(
            t["values"],
            t["old_values"],
            t["returns"],
            m,
            clip=0.2,
            reduction="sequence_mean",
            context_group=group,
        ),
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        with Traffic() as traffic:
            call()
        out[name] = traffic.calls
    return out


def error_results(rank: int, groups: dict[str, Any], data: Any) -> dict[str, str]:
    """The messages of the errors only real process groups can raise."""
    out: dict[str, str] = {}
    mask = torch.ones(2, 3, dtype=torch.bool)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    attempts: dict[str, Callable[[], Any]] = {
        "outside": lambda: rlo.policy_loss(
            zeros, zeros, torch.zeros(2), mask, context_group=groups["outside"]
        ),
        "overlap": lambda: global_normalizers([mask], context_group=groups["pair"]),
        # a selection of the whole batch cannot be taken on this rank's part of it
        "m2po": lambda: rlo.policy_loss(
            zeros, zeros, torch.zeros(2), mask, surrogate=rlo.M2PO(), context_group=groups["pair"]
        ),
        "kl_cov": lambda: rlo.policy_loss(
            zeros, zeros, torch.zeros(2), mask, surrogate="kl_cov", context_group=groups["pair"]
        ),
    }
    for name, attempt in attempts.items():
        if name == "outside" and rank != 3 or name in ("m2po", "kl_cov") and rank > 1:
            continue
        try:
            attempt()
        except (TypeError, ValueError) as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """Entry point of a spawned rank: results to ``rank{r}.pt``, traceback to ``rank{r}.err``."""
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        groups = {name: dist.new_group(list(ranks)) for name, ranks in GROUPS.items()}
        groups["pair_rank"] = groups["pair"] if rank < 2 else groups["pair_b"]
        data = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        singles = [dist.new_group([member]) for member in range(world_size)]
        _DP_GROUP[0] = singles[rank]  # CP alone: the data-parallel group of a rank is itself
        own = {name: groups[name] for name in ("pair", "trio")}
        start = time.monotonic()
        results = run_cases(rank, own) if rank < 3 else {}
        results["_dp"] = data_parallel_results(rank, groups["pair_rank"], data)
        results["_traffic"] = traffic_results(rank % 2, groups["pair_rank"], data)
        results["_errors"] = error_results(
            rank, {"outside": groups["pair"], "pair": groups["pair_rank"]}, data
        )
        results["_seconds"] = time.monotonic() - start
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def launch(
    out_dir: str, *, world_size: int = WORLD_SIZE, timeout_s: float = JOIN_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Run :func:`worker` on ``world_size`` spawned processes (a file store: no port to pick)."""
    store_path = str(Path(out_dir) / "store")
    return spawn_ranks(
        worker,
        lambda rank: (rank, world_size, store_path, out_dir),
        world_size,
        out_dir,
        timeout_s,
        weights_only=False,
    )


# ------------------------------------------------------------------------ the reference side
def reference(case: Case) -> dict[str, Any]:
    """The unsplit call of ``case`` in this process (no group), differentiated the same way."""
    os.environ["RLOBJECTIVES_KERNELS"] = "triton" if case.kernels else "torch"
    try:
        whole = make_problem(case)
        leaves = leaves_of(case, whole, whole, None)
        return evaluate(case, whole, leaves, None)
    finally:
        os.environ["RLOBJECTIVES_KERNELS"] = "torch"
