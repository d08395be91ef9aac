"""Random padded batches, their packed layout, and the registry of packed-layout cases.

A :class:`Batch` is ``S`` sequences of random lengths (0 and 1 included), right- or left-padded
to ``T``, with a loss mask that selects a random subset of each sequence's tokens (so some
sequences have no selected token). :class:`View` gives a function its inputs in one layout:
padded ``(S, T)`` tensors, or the same tensors packed with :func:`rlobjectives.pack` plus
``cu_seqlens``. A :class:`Case` is one call written once for both layouts; adding a function to
the packed-layout tests is one entry of :data:`CASES`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

import rlobjectives as rlo
from rlobjectives import CISPO, DPPO, DRO, FIPO, M2PO, Clip, ClipCov, KLCov, ProbabilityBand

VOCAB, HIDDEN = 7, 5
# Differentiable per-token inputs (S, T), per-token constants, per-sequence inputs (S,).
LEAVES = ("log_probs", "values", "token_rewards")
TOKEN_INPUTS = ("old_log_probs", "ref_log_probs", "token_advantages", "scores_per_token")
SEQUENCE_INPUTS = (
    "advantages", "rewards", "sequence_weights", "advantages_column", "sequence_weights_column",
    "rewards_column",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Batch:
    """``S`` padded sequences: where they are (``attention``) and what counts (``mask``)."""

    attention: torch.Tensor  # (S, T) bool, one run of ones per row
    mask: torch.Tensor  # (S, T) bool, a subset of attention
    seed: int

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return rlo.pack(self.mask, self.attention).cu_seqlens

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        return rlo.pack(values, self.attention).values


def make_batch(lengths: list[int], extra: int, side: str, seed: int) -> Batch:
    """Sequences of ``lengths`` tokens padded on ``side`` to ``max(lengths) + extra`` columns."""
    width = max(lengths, default=0) + extra
    columns = torch.arange(width)
    attention = torch.zeros((len(lengths), width), dtype=torch.bool)
    for row, length in enumerate(lengths):
        attention[row] = columns < length if side == "right" else columns >= width - length
    generator = torch.Generator().manual_seed(seed)
    mask = attention & (torch.rand(attention.shape, generator=generator) < 0.7)
    return Batch(attention=attention, mask=mask, seed=seed)


def make_tensors(
    batch: Batch, *, poison: bool, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """``dtype`` inputs (float64 by default); padding is NaN; with ``poison`` unselected tokens
    hold NaN/+-inf too.

    The differentiable inputs are leaves (``requires_grad``) in the padded layout; poisoning
    goes through ``torch.where``, so the gradient reaches the leaf at selected tokens only.
    """
    generator = torch.Generator().manual_seed(batch.seed + 1)
    sequences, width = batch.attention.shape

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

    specials = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    filler = specials[torch.arange(sequences * width) % 3].reshape(sequences, width)
    bad = ~batch.attention | (~batch.mask if poison else torch.zeros_like(batch.mask))

    def token(values: torch.Tensor) -> torch.Tensor:
        return torch.where(bad, filler, values)

    tensors: dict[str, torch.Tensor] = {}
    old = -1.0 - randn(sequences, width).abs()
    tensors["log_probs_leaf"] = (old + 0.3 * randn(sequences, width)).requires_grad_(True)
    tensors["values_leaf"] = randn(sequences, width).requires_grad_(True)
    tensors["token_rewards_leaf"] = randn(sequences, width).requires_grad_(True)
    hidden = randn(sequences, width, HIDDEN).requires_grad_(True)
    tensors["hidden_leaf"] = hidden
    tensors["weight"] = randn(VOCAB, HIDDEN).requires_grad_(True)
    for name in LEAVES:
        tensors[name] = token(tensors[f"{name}_leaf"])
    tensors["hidden"] = torch.where(bad.unsqueeze(-1), float("nan"), hidden)
    logits = randn(sequences, width, VOCAB).requires_grad_(True)
    tensors["logits_leaf"] = logits
    tensors["logits"] = torch.where(bad.unsqueeze(-1), float("nan"), logits)
    tensors["ref_logits"] = torch.where(bad.unsqueeze(-1), float("nan"), randn(*logits.shape))
    tensors["old_log_probs"] = token(old)
    tensors["ref_log_probs"] = token(old + 0.2 * randn(sequences, width))
    tensors["token_advantages"] = token(randn(sequences, width))
    tensors["scores_per_token"] = token(randn(sequences, width))
    tokens = torch.randint(0, VOCAB, (sequences, width), generator=generator)
    tensors["tokens"] = torch.where(bad, -100, tokens)
    tensors["advantages"] = randn(sequences)
    tensors["sequence_weights"] = randn(sequences).abs()
    tensors["token_weights"] = token(randn(sequences, width).abs())
    tensors["entropy"] = token(tensors["values_leaf"].abs())  # differentiable (values_leaf)
    tensors["rewards"] = randn(sequences)
    # issue 25: the teacher's top-k (a padded slot, garbage ids where unselected), its head
    teacher = torch.log_softmax(logits.detach() + randn(*logits.shape), -1)
    top, ids = teacher.topk(3, -1)
    top[..., -1] = torch.where(tensors["advantages"][:, None] > 0, top[..., -1], -float("inf"))
    tensors["teacher_top"] = torch.where(bad.unsqueeze(-1), float("nan"), top)
    tensors["teacher_ids"] = torch.where(bad.unsqueeze(-1), 10**6, ids)
    tensors["teacher_hidden"] = torch.where(
        bad.unsqueeze(-1), float("nan"), randn(sequences, width, 2)
    )
    tensors["teacher_weight"] = randn(VOCAB, 2)
    # The (S, 1) spellings of the per-sequence inputs (the padded layout's (B, 1)).
    tensors["advantages_column"] = tensors["advantages"][:, None]
    tensors["sequence_weights_column"] = tensors["sequence_weights"][:, None]
    tensors["rewards_column"] = tensors["rewards"][:, None]
    # the sampler's kept set of each position, holding the sampled token, padded with -1
    kept = torch.randint(-1, VOCAB, (sequences, width, 3), generator=generator)
    kept[..., 0] = torch.where(bad, kept[..., 0], tokens)
    tensors["kept_ids"] = kept
    # one sampling temperature per token (issue 33)
    tensors["token_temperature"] = token(0.5 + randn(sequences, width).abs())
    return tensors


class View:
    """The inputs of one call in one layout (padded ``(S, T)`` or packed ``(N,)``)."""

    def __init__(self, batch: Batch, tensors: dict[str, torch.Tensor], packed: bool) -> None:
        self.batch, self.tensors, self.packed = batch, tensors, packed
        self.cu_seqlens = batch.cu_seqlens if packed else None
        self.width = batch.attention.shape[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.batch.mask if name == "mask" else self.tensors[name]
        if not self.packed or name in SEQUENCE_INPUTS or name in ("weight", "teacher_weight"):
            return value
        return self.batch.pack(value)

    def row(self, name: str) -> torch.Tensor:
        """A per-token input as the packed ``(1, N)`` row (padded: ``(S, T)``).

        Per-token advantages take this form: a 1-D tensor of length ``S`` is per sequence, and
        ``N == S`` happens (e.g. lengths 0, 0, 2).
        """
        value = self[name]
        per_token = self.packed and name not in SEQUENCE_INPUTS
        return value.reshape(1, -1) if per_token else value

    def tokens(self, output: torch.Tensor) -> torch.Tensor:
        """A per-token output in the packed layout, whichever layout produced it."""
        return output.reshape(-1) if self.packed else self.batch.pack(output)

    @property
    def layout(self) -> dict[str, Any]:
        return {"cu_seqlens": self.cu_seqlens}


Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Case:
    """One call, written once for both layouts; ``leaves`` are the inputs differentiated."""

    name: str
    run: Callable[[View], Outputs]
    leaves: tuple[str, ...] = ("log_probs_leaf",)
    heavy: bool = False  # chunked vocabulary passes: fewer random examples
    kernels: bool = True  # also on the Triton backend (for the functions with kernels)


def _policy(fn: Callable[..., Any] = rlo.policy_loss, **options: Any) -> Callable[[View], Outputs]:
    advantages = options.pop("advantages", "advantages")
    tensors = {
        name: options.pop(name) for name in ("importance_weights", "entropy") if name in options
    }

    def run(v: View) -> Outputs:
        out = fn(
            v["log_probs"],
            v["old_log_probs"],
            v.row(advantages),
            v["mask"],
            return_per_token=True,
            **{name: v.row(source) for name, source in tensors.items()},
            **options,
            **v.layout,
        )
        per_token = out.per_token_loss
        loss = v.tokens(out.loss) if out.loss.ndim else out.loss
        return {"loss": loss, "per_token": v.tokens(per_token), **out.diagnostics._asdict()}

    return run


def _prompts(v: View, reduction: str) -> dict[str, Any]:
    """``"prompt_mean"``'s groups: sequences 0-1, 2-3, ... share a prompt (labels per sequence)."""
    if reduction != "prompt_mean":
        return {}
    return {"group_ids": torch.arange(v.batch.attention.shape[0]) // 2}


def _aggregate(
    reduction: str, function: Callable[..., Any] = rlo.aggregate
) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = function(
            v["log_probs"],
            v["mask"],
            reduction=reduction,
            max_response_length=9,
            **_prompts(v, reduction),
            **v.layout,
        )
        return {"loss": v.tokens(out) if out.ndim else out}

    return run


def _kl_loss(
    reduction: str, *, weights: str | None = None, **options: Any
) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        weighted = {} if weights is None else {"importance_weights": v.row(weights)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
            out = rlo.kl_loss(
                v["log_probs"],
                v["ref_log_probs"],
                v["mask"],
                reduction=reduction,
                max_response_length=9,
                **weighted,
                **options,
                **v.layout,
            )
        return {"loss": v.tokens(out) if out.ndim else out}

    return run


def _grpo(
    fn: Callable[..., dict[str, torch.Tensor]], advantages: str = "advantages"
) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        return fn(v["log_probs"], v["old_log_probs"], v.row(advantages), v["mask"], 0.2, **v.layout)

    return run


def _kl_rewards(rewards: str = "rewards") -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        return rlo.kl_penalized_rewards(
            v["log_probs"], v["ref_log_probs"], v[rewards], v["mask"], 0.3, **v.layout
        )

    return run


def _kl_token_rewards(scores: str = "rewards") -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = rlo.kl_penalized_token_rewards(
            v["log_probs"], v["ref_log_probs"], v[scores], v["mask"], kl_coef=0.3, **v.layout
        )
        return {"rewards": v.tokens(out)}

    return run


def _from_hidden(v: View, **kept: str) -> Outputs:
    out = rlo.token_log_probs_from_hidden(
        v["hidden"], v["weight"], v["tokens"], mask=v["mask"], return_entropy=True,
        **{name: v[source] for name, source in kept.items()}, **v.layout,
    )  # fmt: skip
    return {"log_probs": v.tokens(out.log_probs), "entropy": v.tokens(out.entropy)}


def _from_hidden_head(v: View) -> Outputs:
    """The logit transform with a per-token temperature, and every statistic."""
    out = rlo.token_log_probs_from_hidden(
        v["hidden"], v["weight"], v["tokens"], mask=v["mask"], temperature=v["token_temperature"],
        final_logit_softcapping=2.0, logit_scale=0.8,
        statistics=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), **v.layout,
    )  # fmt: skip
    return {name: v.tokens(value) for name, value in out._asdict().items()}


def _fused_hidden(
    advantages: str = "advantages",
    weights: str | None = None,
    kept: str | None = None,
    temperature: str | None = None,
    **options: Any,
) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        weighted = {} if weights is None else {"importance_weights": v.row(weights)}
        if kept is not None:
            weighted["kept_ids"] = v[kept]
        if temperature is not None:
            weighted["temperature"] = v[temperature]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rlo.BiasedGradientWarning)
            out = rlo.fused_policy_loss_from_hidden(
                v["hidden"],
                v["weight"],
                v["tokens"],
                v["old_log_probs"],
                v.row(advantages),
                v["mask"],
                **weighted,
                ref_log_probs=v["ref_log_probs"],
                kl_coef=0.1,
                chunk_size=5,
                **{"max_response_length": 9, **options},
                **v.layout,
            )
        loss = v.tokens(out.loss) if out.loss.ndim else out.loss
        return {"loss": loss, "log_probs": v.tokens(out.log_probs), "kl": out.kl_loss}

    return run


def _full_vocab_kl(reduction: str, temperature: str | None = None) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        options = {} if temperature is None else {"temperature": v[temperature]}
        out = rlo.full_vocab_kl_loss(
            v["logits"],
            v["ref_logits"],
            v["mask"],
            reduction=reduction,
            max_response_length=9,
            **options,
            **v.layout,
        )
        return {"loss": v.tokens(out) if out.ndim else out}

    return run


def _gae(**options: Any) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        arguments = dict(options)
        if isinstance(arguments.get("lam"), str):  # a per-sequence lambda from an (S,) input
            weights = v[arguments["lam"]]
            arguments["lam"] = weights / (1 + weights)  # in [0, 1)
        out = rlo.gae(v["token_rewards"], v["values"], v["mask"], **arguments, **v.layout)
        return {"advantages": v.tokens(out.advantages), "returns": v.tokens(out.returns)}

    return run


def _reinforce_plus_plus(
    *, baseline: bool = False, rewards: str = "rewards", **options: Any
) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        if baseline:  # two groups, interleaved: the group-mean baseline, unbiased whitening
            sequences = v["rewards"].shape[0]
            options.update(group_ids=torch.arange(sequences) % 2, unbiased=True)
        out = rlo.reinforce_plus_plus_advantages(
            v[rewards], v["mask"], token_rewards=v["token_rewards"], **options, **v.layout
        )
        return {"advantages": v.tokens(out)}

    return run


def _value_loss(reduction: str) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = rlo.value_loss(
            v["values"], v["old_log_probs"], v["token_rewards"], v["mask"], clip=0.3,
            reduction=reduction, max_response_length=9, **v.layout,
        )  # fmt: skip
        loss = v.tokens(out.loss) if out.loss.ndim else out.loss
        return {
            "loss": loss,
            "per_token": v.tokens(out.per_token_loss),
            **out.diagnostics._asdict(),
        }

    return run


def _opo(v: View) -> Outputs:
    groups = torch.arange(v["rewards"].shape[0]) % 2
    return {"advantages": rlo.opo_advantages(v["rewards"], v["mask"], group_ids=groups, **v.layout)}


def _remax(baseline: str = "rewards") -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = rlo.remax_advantages(v["token_rewards"], v[baseline], mask=v["mask"], **v.layout)
        return {"advantages": v.tokens(out)}

    return run


def _normalizers(v: View) -> Outputs:
    counts = rlo.global_normalizers(v["mask"], cu_seqlens=v.cu_seqlens)
    return {name: value.double() for name, value in counts._asdict().items()}


def _rollout(level: str, mode: str) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = rlo.rollout_correction(
            v["log_probs"], v["old_log_probs"], v["mask"], level=level, mode=mode, upper=1.5,
            lower=0.5, veto=0.1, **v.layout,
        )  # fmt: skip
        metrics = {f"metric_{k}": value.double() for k, value in out.metrics._asdict().items()}
        return {"weights": v.tokens(out.weights), "mask": v.tokens(out.mask.double()), **metrics}

    return run


def _off_policy(advantages: str = "advantages") -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = rlo.off_policy_sequence_mask(
            v["log_probs"], v["old_log_probs"], v.row(advantages), v["mask"], threshold=0.05,
            **v.layout,
        )  # fmt: skip
        return {"mask": v.tokens(out.double())}

    return run


def _rejection(**options: Any) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        out = rlo.rejection_mask(
            v["log_probs"], v["old_log_probs"], v["mask"], **options, **v.layout
        )
        return {"mask": v.tokens(out.double())}

    return run


def _clip_cov_drawn(**options: Any) -> Callable[[View], Outputs]:
    """Clip-Cov with a random draw: a fresh generator of one seed for every call (the draw is
    keyed by each token's ordinal among the selected tokens, the same in both layouts)."""

    def run(v: View) -> Outputs:
        surrogate = ClipCov(
            ratio=0.2, cov_lb=-1.0, cov_ub=2.0, generator=torch.Generator().manual_seed(7)
        )
        return _policy(surrogate=surrogate, **options)(v)

    return run


def _nll(reduction: str) -> Callable[[View], Outputs]:
    return _aggregate(reduction, rlo.nll_loss)


def _distillation(kind: str, hidden: bool, **options: Any) -> Callable[[View], Outputs]:
    """The issue-25 losses in both layouts (from logits or the LM head)."""

    def run(v: View) -> Outputs:
        student = (v["hidden"], v["weight"]) if hidden else (v["logits"],)
        common = {"max_response_length": 9, **options, **v.layout}
        if kind == "topk":
            fn = rlo.topk_forward_kl_from_hidden if hidden else rlo.topk_forward_kl
            out = fn(*student, v["teacher_top"], v["teacher_ids"], v["mask"], **common)
        elif kind == "reverse":
            fn = rlo.reverse_kl_loss_from_hidden if hidden else rlo.reverse_kl_loss
            out = fn(*student, v["tokens"], v["ref_log_probs"], v["mask"], estimator="k2",
                     **common)  # fmt: skip
        elif hidden:
            out = rlo.generalized_jsd_loss_from_hidden(
                *student, v["teacher_hidden"], v["teacher_weight"], v["mask"], **common
            )
        else:
            out = rlo.generalized_jsd_loss(v["logits"], v["ref_logits"], v["mask"], **common)
        return {"loss": v.tokens(out) if out.ndim else out}

    return run


def _m2po_mask(v: View) -> Outputs:
    log_ratio = v["log_probs"] - v["old_log_probs"]
    out = rlo.m2po_mask(log_ratio, v["mask"], threshold=0.05, **v.layout)
    return {"mask": v.tokens(out.double())}


def _cov_selection(surrogate: Any) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        objective = surrogate() if callable(surrogate) else surrogate
        out = rlo.cov_selection(
            v["log_probs"], v["old_log_probs"], v.row("advantages"), v["mask"],
            surrogate=objective, **v.layout,
        )  # fmt: skip
        return {name: v.tokens(getattr(out, name).double()) for name in ("selected", "candidates")}

    return run


def _reverse_rewards(v: View) -> Outputs:
    out = rlo.reverse_kl_rewards(
        v["log_probs"], v["ref_log_probs"], v["mask"], coef=0.5, **v.layout
    )
    return {"rewards": v.tokens(out)}


def _iw_opd(v: View) -> Outputs:
    out = rlo.iw_opd_advantages(v["ref_log_probs"], v["old_log_probs"], v["mask"], gamma=0.7,
                                **v.layout)  # fmt: skip
    return {"advantages": v.tokens(out)}


HIDDEN_LEAVES = ("hidden_leaf", "weight")
DR_GRPO = {"reduction": "sequence_sum_normalized", "max_response_length": 9}

# Every per-sequence argument (issue 27): advantages and importance weights as (S,) and (S, 1)
# on every surrogate and entry point that takes them, so that a per-sequence input enters each
# formula exactly as its padded (B,) counterpart (VESPO's sequence weight once per sequence,
# GMPO's mean advantage, the kernels' per-row operands); per token as (1, N) against them. A
# few of them also run on the Triton interpreter (kernels=False: PyTorch only, to keep it short).
SEQUENCE_ARGUMENT_CASES: list[Case] = [
    Case(
        "policy_loss-vespo-sequence-weights",
        _policy(surrogate="vespo", importance_weights="sequence_weights"),
    ),
    Case(
        "policy_loss-vespo-sequence-weights-column",
        _policy(
            surrogate="vespo",
            importance_weights="sequence_weights_column",
            advantages="advantages_column",
            reduction="sequence_mean",
        ),
    ),
    Case(
        "policy_loss-vespo-token-weights",
        _policy(surrogate="vespo", importance_weights="token_weights", **DR_GRPO),
    ),
    Case(
        "policy_loss-gmpo-sequence-weights",
        _policy(surrogate="gmpo", importance_weights="sequence_weights", reduction="sequence_mean"),
    ),
    Case(
        "policy_loss-gmpo-token-advantages",
        _policy(
            surrogate="gmpo", advantages="token_advantages", importance_weights="token_weights"
        ),
    ),
    Case(
        "policy_loss-sequence-weights-column",
        _policy(importance_weights="sequence_weights_column", advantages="advantages_column"),
    ),
    Case(
        "policy_loss-cispo-sequence-weights",
        _policy(
            surrogate="cispo", importance_weights="sequence_weights", reduction="sequence_mean"
        ),
        kernels=False,
    ),
    Case(
        "policy_loss-sapo-token-advantages-sequence-weights",
        _policy(
            surrogate="sapo", advantages="token_advantages", importance_weights="sequence_weights"
        ),
        kernels=False,
    ),
    Case(
        "policy_loss-gspo-token-advantages-weights",
        _policy(
            ratio_level="sequence",
            advantages="token_advantages",
            importance_weights="token_weights",
        ),
        kernels=False,
    ),
    Case(
        "grpo_clipped_surrogate-token-advantages",
        _grpo(rlo.grpo_clipped_surrogate, "token_advantages"),
    ),
    Case(
        "grpo_clipped_surrogate-advantages-column",
        _grpo(rlo.grpo_clipped_surrogate, "advantages_column"),
        kernels=False,
    ),
    Case(
        "kl_loss-k2-sequence-weights",
        _kl_loss("sequence_mean", weights="sequence_weights", estimator="k2"),
    ),
    Case(
        "kl_loss-k3-sequence-weights-column",
        _kl_loss("token_mean", weights="sequence_weights_column"),
        kernels=False,
    ),
    Case(
        "kl_loss-k1-token-weights-dr_grpo",
        _kl_loss("sequence_sum_normalized", weights="token_weights", estimator="k1"),
        kernels=False,
    ),
    Case("off_policy_sequence_mask-token-advantages", _off_policy("token_advantages"), ()),
    Case("kl_penalized_rewards-rewards-column", _kl_rewards("rewards_column"), kernels=False),
    Case(
        "kl_penalized_token_rewards-scores-column",
        _kl_token_rewards("rewards_column"),
        kernels=False,
    ),
    Case(
        "reinforce_plus_plus_advantages-rewards-column",
        _reinforce_plus_plus(gamma=0.9, rewards="rewards_column"),
        ("token_rewards_leaf",),
    ),
    Case("remax_advantages-baseline-column", _remax("rewards_column"), ("token_rewards_leaf",)),
    Case("off_policy_sequence_mask-advantages-column", _off_policy("advantages_column"), ()),
    Case(
        "fused_policy_loss_from_hidden-sequence-weights",
        _fused_hidden(weights="sequence_weights", reduction="sequence_mean"),
        HIDDEN_LEAVES,
        heavy=True,
    ),
    Case(
        "fused_policy_loss_from_hidden-token-advantages-weights",
        _fused_hidden(advantages="token_advantages", weights="token_weights", entropy_coef=0.01),
        HIDDEN_LEAVES,
        heavy=True,
        kernels=False,
    ),
    Case(
        "fused_policy_loss_from_hidden-vespo-sequence-weights",
        _fused_hidden(
            weights="sequence_weights_column",
            advantages="advantages_column",
            surrogate="vespo",
            entropy_coef=0.01,
        ),
        HIDDEN_LEAVES,
        heavy=True,
    ),
]

ISSUE25_CASES: list[Case] = [
    Case("topk_forward_kl-sequence_mean", _distillation("topk", False, reduction="sequence_mean"),
         ("logits_leaf",), heavy=True),
    Case("topk_forward_kl-none-renormalize",
         _distillation("topk", False, reduction="none", renormalize=True), ("logits_leaf",),
         heavy=True),
    Case("topk_forward_kl_from_hidden-dr_grpo",
         _distillation("topk", True, reduction="sequence_sum_normalized"), HIDDEN_LEAVES,
         heavy=True),
    Case("topk_forward_kl_from_hidden-none-head", _distillation("topk", True, reduction="none",
                                                                tail=False),
         HIDDEN_LEAVES, heavy=True),
    Case("reverse_kl_loss-sequence_mean",
         _distillation("reverse", False, reduction="sequence_mean"), ("logits_leaf",), heavy=True),
    Case("reverse_kl_loss_from_hidden", _distillation("reverse", True), HIDDEN_LEAVES, heavy=True),
    Case("generalized_jsd_loss-length_weighted",
         _distillation("jsd", False, reduction="length_weighted"), ("logits_leaf",), heavy=True),
    Case("generalized_jsd_loss_from_hidden-sequence_mean",
         _distillation("jsd", True, reduction="sequence_mean", beta=0.0), HIDDEN_LEAVES,
         heavy=True),
    Case("reverse_kl_rewards", _reverse_rewards, ()),
    Case("gae-per-sequence-lambda",
         _gae(gamma=0.9, lam="sequence_weights", value_lam=1.0),
         ("values_leaf", "token_rewards_leaf")),
]  # fmt: skip

# issue 34: the preference losses pair the first half of the sequences (chosen) with the second
# half (rejected); packed, each half is cut out of the row with its own boundaries.


def _halves(v: View, name: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(chosen, rejected, cu_seqlens pair or None)`` of a per-token input."""
    value, pairs = v.row(name), v.batch.attention.shape[0] // 2  # (1, N) packed: per token
    if not v.packed:
        return value[:pairs], value[pairs : 2 * pairs], None
    assert v.cu_seqlens is not None
    cu = v.cu_seqlens.tolist()
    chosen = torch.tensor(cu[: pairs + 1])
    rejected = torch.tensor([b - cu[pairs] for b in cu[pairs : 2 * pairs + 1]])
    return value[:, : cu[pairs]], value[:, cu[pairs] : cu[2 * pairs]], (chosen, rejected)


def _preference(objective: Any, **options: Any) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        lp_c, lp_r, cu = _halves(v, "log_probs")
        mask_c, mask_r, _ = _halves(v, "mask")
        ref_c, ref_r, _ = _halves(v, "ref_log_probs")
        refs = {"ref_chosen_log_probs": ref_c, "ref_rejected_log_probs": ref_r}
        out = rlo.preference_loss(lp_c, lp_r, mask_c, mask_r, objective=objective,
                                  **(refs if objective.needs_reference else {}), **options,
                                  cu_seqlens=cu)  # fmt: skip
        return {name: getattr(out, name) for name in ("loss", "pair_losses", "margins",
                                                      "chosen_log_probs")}  # fmt: skip

    return run


def _preference_hidden(objective: Any) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        pairs = v.batch.attention.shape[0] // 2
        arguments = {name: v[name] for name in ("hidden", "tokens", "mask")}
        arguments["ref_log_probs"] = v.row("ref_log_probs")  # (1, N) packed: per token
        if v.packed:
            assert v.cu_seqlens is not None
            end = int(v.cu_seqlens[2 * pairs])
            arguments = {name: value[:end] for name, value in arguments.items()}
            arguments["ref_log_probs"] = v.row("ref_log_probs")[:, :end]
            layout = {"cu_seqlens": v.cu_seqlens[: 2 * pairs + 1]}
        else:
            arguments = {name: value[: 2 * pairs] for name, value in arguments.items()}
            layout = {}
        ref = arguments.pop("ref_log_probs")
        refs = {"ref_log_probs": ref} if objective.needs_reference else {}
        tokens = torch.where(arguments["mask"], arguments.pop("tokens"), 0)
        out = rlo.preference_loss_from_hidden(
            arguments["hidden"], v["weight"], tokens, arguments["mask"], objective=objective,
            chunk_size=3, **refs, **layout,
        )  # fmt: skip
        return {"loss": out.loss, "pair_losses": out.pair_losses, "margins": out.margins}

    return run


def _kto(hidden: bool) -> Callable[[View], Outputs]:
    def run(v: View) -> Outputs:
        desirable = v["advantages"] > 0
        options = {"ref_log_probs": v.row("ref_log_probs"), "kl": 0.1, **v.layout}
        if hidden:
            tokens = torch.where(v["mask"], v["tokens"], 0)
            out = rlo.kto_loss_from_hidden(v["hidden"], v["weight"], tokens, v["mask"], desirable,
                                           chunk_size=2, **options)  # fmt: skip
        else:
            out = rlo.kto_loss(v["log_probs"], v["mask"], desirable, **options)
        return {"loss": out.loss, "example_losses": out.example_losses, "rewards": out.rewards}

    return run


PREFERENCE_CASES: list[Case] = [
    Case("preference_loss-dpo", _preference(rlo.DPO(beta=0.4), ld_alpha=0.5)),
    Case("preference_loss-mpo", _preference(0.8 * rlo.DPO() + 0.2 * rlo.BCO() + rlo.SFT(),
                                            normalizer=3.0)),
    Case("preference_loss-aot", _preference(rlo.AOT(beta=0.3, unpaired=True))),
    Case("preference_loss-orpo", _preference(rlo.ORPO(beta=0.2))),
    Case("preference_loss_from_hidden-dpo", _preference_hidden(rlo.DPO() + rlo.SFT()),
         HIDDEN_LEAVES, heavy=True, kernels=False),
    Case("preference_loss_from_hidden-simpo", _preference_hidden(rlo.SimPO()), HIDDEN_LEAVES,
         heavy=True, kernels=False),
    Case("kto_loss", _kto(False)),
    Case("kto_loss_from_hidden", _kto(True), HIDDEN_LEAVES, heavy=True, kernels=False),
]  # fmt: skip


CASES: list[Case] = [
    *(Case(f"aggregate-{r}", _aggregate(r)) for r in rlo.Reduction.__args__),  # type: ignore[attr-defined]
    Case("policy_loss-token_mean", _policy(surrogate=Clip(high=0.28, dual=3.0))),
    Case("policy_loss-sequence_mean", _policy(reduction="sequence_mean")),
    Case("policy_loss-dr_grpo", _policy(**DR_GRPO)),
    Case("policy_loss-none", _policy(reduction="none", surrogate=Clip(low=None))),
    Case("policy_loss-gspo", _policy(ratio_level="sequence", reduction="sequence_mean")),
    Case("policy_loss-gspo-token_mean", _policy(ratio_level="sequence", surrogate=Clip(dual=2.0))),
    Case("policy_loss-token-advantages", _policy(advantages="token_advantages")),
    Case("policy_loss-normalizer", _policy(normalizer=7.0, diagnostics_normalizer=11.0)),
    Case("policy_loss-cispo", _policy(surrogate=CISPO(high=0.28))),
    Case("policy_loss-sapo", _policy(surrogate="sapo", reduction="sequence_mean")),
    Case(
        "policy_loss-fipo",  # the future sums stop at each packed sequence's end
        _policy(surrogate=FIPO(gamma=0.8, cap=0.3, delta=1.5), reduction="length_weighted"),
    ),
    Case(
        "policy_loss-probability_band",
        _policy(surrogate=ProbabilityBand(tau=0.05, kappa=0.5), reduction="sequence_mean"),
    ),
    Case("policy_loss-gmpo", _policy(surrogate="gmpo", reduction="sequence_mean")),
    Case(
        "policy_loss-vespo",
        _policy(surrogate="vespo", reduction="sequence_sum_normalized", max_response_length=9),
    ),
    Case(
        "policy_loss-delta-length_weighted",
        _policy(surrogate=Clip(delta=1.5), reduction="length_weighted"),
    ),
    Case(
        "policy_loss-importance-weights",
        _policy(importance_weights="token_weights", reduction="sequence_mean"),
    ),
    Case(
        "policy_loss-sequence-importance-weights",
        _policy(importance_weights="sequence_weights", ratio_level="sequence"),
    ),
    Case(
        "policy_loss-entropy-bonus",
        _policy(entropy="entropy", entropy_coef=0.01),
        ("log_probs_leaf", "values_leaf"),
    ),
    Case("grpo_clipped_surrogate", _grpo(rlo.grpo_clipped_surrogate)),
    Case("kl_loss-k3-sequence_mean", _kl_loss("sequence_mean")),
    Case("kl_loss-k2-dr_grpo", _kl_loss("sequence_sum_normalized", estimator="k2")),
    Case("kl_loss-k3+-none", _kl_loss("none", straight_through=True)),
    Case("kl_penalized_rewards", _kl_rewards()),
    Case("kl_penalized_token_rewards", _kl_token_rewards()),
    Case("full_vocab_kl_loss", _full_vocab_kl("sequence_mean"), ("logits_leaf",), heavy=True),
    Case("token_log_probs_from_hidden", _from_hidden, HIDDEN_LEAVES, heavy=True),
    Case(
        "token_log_probs_from_hidden-head-statistics",
        _from_hidden_head,
        HIDDEN_LEAVES,
        heavy=True,
        kernels=False,  # the statistics run on PyTorch
    ),
    Case(
        "full_vocab_kl_loss-token-temperature",
        _full_vocab_kl("sequence_mean", "token_temperature"),
        ("logits_leaf",),
        heavy=True,
    ),
    Case(
        "fused_policy_loss_from_hidden-head",
        _fused_hidden(
            reduction="sequence_mean",
            temperature="token_temperature",
            final_logit_softcapping=2.0,
            logit_scale=0.8,
        ),  # fmt: skip
        HIDDEN_LEAVES,
        heavy=True,
    ),
    Case(
        "token_log_probs_from_hidden-kept_ids",
        lambda v: _from_hidden(v, kept_ids="kept_ids"),
        HIDDEN_LEAVES,
        heavy=True,
        kernels=False,  # a kept set runs on PyTorch on every backend
    ),
    Case(
        "fused_policy_loss_from_hidden-kept_ids",
        _fused_hidden(kept="kept_ids", reduction="sequence_mean"),
        HIDDEN_LEAVES,
        heavy=True,
        kernels=False,
    ),
    Case(
        "fused_policy_loss_from_hidden",
        _fused_hidden(reduction="sequence_mean"),
        HIDDEN_LEAVES,
        heavy=True,
    ),
    Case(
        "fused_policy_loss_from_hidden-dr_grpo", _fused_hidden(**DR_GRPO), HIDDEN_LEAVES, heavy=True
    ),
    Case(
        "fused_policy_loss_from_hidden-gspo",
        _fused_hidden(ratio_level="sequence"),
        HIDDEN_LEAVES,
        heavy=True,
    ),
    *SEQUENCE_ARGUMENT_CASES,
    # Issue 24: DPPO, DRO (token-local, on the kernels too), M2PO and the Cov selections (the
    # batch-level selections: the same tokens in both layouts), nll_loss and the selections.
    Case("policy_loss-dppo-tv", _policy(surrogate=DPPO(ratio_cap=1.5), reduction="sequence_mean")),
    Case(
        "policy_loss-dppo-kl-weights",
        _policy(surrogate=DPPO("kl", ratio_cap=None), importance_weights="sequence_weights"),
    ),
    Case("policy_loss-dro", _policy(surrogate=DRO(beta=0.5), importance_weights="token_weights")),
    Case("policy_loss-m2po", _policy(surrogate=M2PO(threshold=0.05), reduction="sequence_mean")),
    Case("policy_loss-m2po-clip", _policy(surrogate=M2PO(threshold=0.1, low=0.2), **DR_GRPO)),
    Case("policy_loss-kl_cov", _policy(surrogate=KLCov(ratio=0.3, coef=1.0), reduction="none")),
    Case("policy_loss-clip_cov-drawn", _clip_cov_drawn(reduction="sequence_mean")),
    Case(
        "policy_loss-clip_cov-entropy",
        _policy(surrogate=ClipCov(ratio=1.0, cov_lb=-1.0), entropy="entropy", entropy_coef=0.01),
        ("log_probs_leaf", "values_leaf"),
    ),
    *(Case(f"nll_loss-{r}", _nll(r)) for r in rlo.Reduction.__args__),  # type: ignore[attr-defined]
    *(Case(f"dft_loss-{r}", _aggregate(r, rlo.dft_loss)) for r in ("token_mean", "prompt_mean")),
    Case("m2po_mask", _m2po_mask, ()),
    Case("cov_selection-kl_cov", _cov_selection(KLCov(ratio=0.3)), ()),
    Case(
        "cov_selection-clip_cov",
        _cov_selection(
            lambda: ClipCov(ratio=0.2, cov_lb=-1.0, generator=torch.Generator().manual_seed(3))
        ),
        (),
    ),
    Case(
        "fused_policy_loss_from_hidden-dppo",
        _fused_hidden(surrogate=DPPO("kl"), reduction="sequence_mean", entropy_coef=0.01),
        HIDDEN_LEAVES,
        heavy=True,
    ),
    Case(
        "fused_policy_loss_from_hidden-m2po",
        _fused_hidden(surrogate=M2PO(threshold=0.1), entropy_coef=0.01),
        HIDDEN_LEAVES,
        heavy=True,
        kernels=False,
    ),
    Case("global_normalizers", _normalizers, ()),
    Case("rollout_correction-token-truncate", _rollout("token", "truncate"), ()),
    Case("rollout_correction-sequence-mask", _rollout("sequence", "mask"), ()),
    Case("rollout_correction-geometric-reject", _rollout("geometric", "reject"), ()),
    Case("off_policy_sequence_mask", _off_policy(), ()),
    Case("rejection_mask-token", _rejection(upper=1.3, lower=0.8), ()),
    Case("iw_opd_advantages", _iw_opd, ()),
    Case(
        "rejection_mask-sequence-max-k3",
        _rejection(upper=0.05, level="sequence", estimator="k3", aggregate="max"),
        (),
    ),
    Case(
        "rejection_mask-sequence-sum-binary",
        _rejection(upper=0.02, level="sequence", aggregate="sum", symmetric=True),
        (),
    ),
    Case("rejection_mask-sequence-mean", _rejection(upper=1.1, level="sequence"), ()),
    Case("value_loss-sequence_mean", _value_loss("sequence_mean"), ("values_leaf",)),
    Case("value_loss-none", _value_loss("none"), ("values_leaf",)),
    Case("opo_advantages", _opo, ()),
    Case("remax_advantages", _remax(), ("token_rewards_leaf",)),
    Case("gae", _gae(gamma=0.9, lam=0.8), ("values_leaf", "token_rewards_leaf")),
    Case(
        "gae-holes=zero-whiten",
        _gae(gamma=0.97, lam=0.9, holes="zero", whiten=True),
        ("values_leaf", "token_rewards_leaf"),
    ),
    Case("gae-gamma=lam=1", _gae(gamma=1.0, lam=1.0), ("values_leaf", "token_rewards_leaf")),
    Case(
        "reinforce_plus_plus_advantages", _reinforce_plus_plus(gamma=0.95), ("token_rewards_leaf",)
    ),
    Case(
        "reinforce_plus_plus_advantages-holes=zero",
        _reinforce_plus_plus(gamma=0.95, holes="zero"),
        ("token_rewards_leaf",),
    ),
    Case(
        "reinforce_plus_plus_advantages-baseline",
        _reinforce_plus_plus(baseline=True),
        ("token_rewards_leaf",),
    ),
    *ISSUE25_CASES,
    *PREFERENCE_CASES,
]
