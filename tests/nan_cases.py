"""The NaN-property registry: one row per public function that takes a mask.

A row draws (with hypothesis) a batch, a mask and one combination of the function's options,
and says which entries of which arguments must not matter (the poison mask: tokens the mask
leaves out, logits/hidden rows of those tokens, per-sequence values of sequences with no
selected token where the function ignores them) and which arguments to differentiate.
``tests/test_nan_property.py`` fills those entries with NaN/+inf/-inf and checks that values
and gradients equal those of the same batch with finite fills. A new function is one row; a
new option is one more ``draw`` in its row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

import rlobjectives as rlo

Draw = Callable[[st.SearchStrategy[Any]], Any]
F64 = torch.float64
REDUCTIONS = ("token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none")


@dataclass
class Batch:
    """Arguments of one call, the entries that must not matter, what to differentiate."""

    arguments: dict[str, Any]
    poison: dict[str, torch.Tensor]  # argument -> bool tensor of its shape
    differentiate: tuple[str, ...]


@dataclass(frozen=True)
class NanCase:
    name: str
    function: Callable[..., Any]
    draw: Callable[[Draw], Batch]
    max_examples: int = 12


@dataclass(frozen=True)
class Exempt:
    """A public function with a mask argument but no floating per-token input to poison."""

    name: str
    reason: str


# --- drawing batches --------------------------------------------------------------------------


@dataclass
class Tokens:
    """A drawn ``(B, T)`` batch: generator, mask and the poison masks derived from it."""

    generator: torch.Generator
    mask: torch.Tensor  # (B, T) bool
    partial_rows: bool = field(default=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.mask.shape[0], self.mask.shape[1])

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=F64)

    def log_probs(self) -> torch.Tensor:
        return -2.0 * torch.rand(*self.shape, generator=self.generator, dtype=F64)

    @property
    def unselected(self) -> torch.Tensor:  # (B, T)
        return ~self.mask

    @property
    def empty_rows(self) -> torch.Tensor:  # (B,)
        return ~self.mask.any(-1)

    def unselected_rows(self, width: int) -> torch.Tensor:
        """Poison of a ``(B, T, width)`` tensor: rows (or some entries) of unselected tokens."""
        poison = self.unselected.unsqueeze(-1).expand(*self.shape, width)
        if self.partial_rows:
            poison = poison & (torch.rand(*self.shape, width, generator=self.generator) < 0.5)
        return poison.clone()


def draw_tokens(draw: Draw, *, batch_multiple: int = 1, max_batch: int = 4) -> Tokens:
    """A ``(B, T)`` mask with empty, full and ragged rows, and a seeded generator."""
    batch = batch_multiple * draw(st.integers(1, max(1, max_batch // batch_multiple)))
    tokens = draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    density = draw(st.sampled_from((0.0, 0.4, 0.8, 1.0)))
    mask = torch.rand(batch, tokens, generator=generator) < density
    if batch > 1 and draw(st.booleans()):
        mask[-1] = False  # a sequence with no selected token
    return Tokens(generator, mask, partial_rows=draw(st.booleans()))


def draw_reduction(draw: Draw, t: Tokens, *, none: bool = True) -> dict[str, Any]:
    reduction = draw(st.sampled_from(REDUCTIONS if none else REDUCTIONS[:-1]))
    options: dict[str, Any] = {"reduction": reduction}
    if reduction != "none" and draw(st.booleans()):
        options["normalizer"] = draw(st.sampled_from((0.5, 3.0, 7.0)))
    if reduction == "sequence_sum_normalized" and draw(st.booleans()):
        options["max_response_length"] = t.shape[1] + draw(st.integers(0, 3))
    return options


def draw_prompt_reduction(draw: Draw, t: Tokens) -> dict[str, Any]:
    """:func:`draw_reduction`, or ``"prompt_mean"`` with ``group_size`` / ``group_ids``."""
    options = draw_reduction(draw, t)
    if draw(st.booleans()):
        return options
    batch = t.shape[0]
    options["reduction"] = "prompt_mean"
    options.pop("max_response_length", None)
    if draw(st.booleans()):
        options["group_size"] = draw(st.sampled_from([g for g in (1, 2, 3, 4) if batch % g == 0]))
    else:
        options["group_ids"] = torch.randint(0, batch, (batch,), generator=t.generator)
    return options


def draw_advantages(draw: Draw, t: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence ``(B,)``/``(B, 1)`` or per-token advantages, and their poison."""
    batch, tokens = t.shape
    level = draw(st.sampled_from(("sequence", "sequence-column", "token")))
    if level == "token":
        return t.randn(batch, tokens), t.unselected.clone()
    advantages, poison = t.randn(batch), t.empty_rows.clone()
    if level == "sequence-column":
        return advantages.unsqueeze(-1), poison.unsqueeze(-1)
    return advantages, poison


def draw_policy_options(draw: Draw, t: Tokens) -> dict[str, Any]:
    """Every option of the policy loss: surrogate, clips, dual clip, delta, the CISPO cap, the
    SAPO temperatures, the VESPO shape, ratio level, bound, reductions."""
    options: dict[str, Any] = draw_reduction(draw, t)
    surrogate = draw(
        st.sampled_from(
            ("clip", "clip", "cispo", "sapo", "gmpo", "vespo", "dppo", "dro", "m2po", "cov")
        )
    )
    low = draw(st.sampled_from((None, 0.0, 0.2)))
    high = None if low is None else draw(st.sampled_from((None, 0.28)))
    if surrogate == "clip":
        dual = draw(st.sampled_from((None, 3.0)))
        delta = draw(st.sampled_from((None, 1.1, 2.0)))
        options["surrogate"] = rlo.Clip(low=low, high=high, dual=dual, delta=delta)
    elif surrogate == "cispo":
        cap = draw(st.sampled_from((None, 1.3)))
        options["surrogate"] = rlo.CISPO(low=low, high=high) if cap is None else rlo.CISPO(cap=cap)
    elif surrogate == "sapo":
        options["surrogate"] = rlo.SAPO(temperature_neg=draw(st.sampled_from((1.05, 6.0))))
    elif surrogate == "gmpo":
        options["surrogate"] = rlo.GMPO(low=low, high=high)
    elif surrogate == "vespo":
        options["surrogate"] = rlo.VESPO(k_neg=draw(st.sampled_from((3.0, 0.0))))
    elif surrogate == "dppo":
        divergence = draw(st.sampled_from(("tv", "kl")))
        cap = draw(st.sampled_from((None, 1.3, 20.0)))
        options["surrogate"] = rlo.DPPO(divergence, ratio_cap=cap)
    elif surrogate == "dro":
        options["surrogate"] = rlo.DRO(beta=draw(st.sampled_from((0.1, 2.0))))
    elif surrogate == "m2po":
        options["surrogate"] = rlo.M2PO(threshold=draw(st.sampled_from((0.05, 0.5))), low=low)
    else:  # the Cov selections (Clip-Cov with ratio 1: every candidate, whatever the draw)
        options["surrogate"] = draw(
            st.sampled_from((rlo.KLCov(ratio=0.3, coef=1.0), rlo.ClipCov(ratio=1.0, cov_lb=-1.0)))
        )
    token_only = ("gmpo", "vespo", "dppo", "dro", "m2po", "cov")
    levels = ("token",) if surrogate in token_only else ("token", "sequence")
    options["ratio_level"] = draw(st.sampled_from(levels))
    options["log_ratio_bound"] = draw(st.sampled_from((None, 20.0, 0.5)))
    if draw(st.booleans()):
        options["diagnostics_normalizer"] = draw(st.sampled_from((0.5, 9.0)))
    return options


def draw_importance_weights(
    draw: Draw, t: Tokens, arguments: dict[str, Any], poison: dict[str, torch.Tensor]
) -> None:
    """Optional constant importance weights, per token or per sequence, and their poison."""
    level = draw(st.sampled_from((None, "token", "sequence")))
    if level == "token":
        arguments["importance_weights"] = 2 * torch.rand(*t.shape, generator=t.generator)
        poison["importance_weights"] = t.unselected.clone()
    elif level == "sequence":
        arguments["importance_weights"] = 2 * torch.rand(t.shape[0], 1, generator=t.generator)
        poison["importance_weights"] = t.empty_rows.clone().unsqueeze(-1)


def draw_logits_options(
    draw: Draw,
    t: Tokens | None = None,
    poison: dict[str, torch.Tensor] | None = None,
    *,
    head: bool = False,
) -> dict[str, Any]:
    """The temperature (with ``t``: sometimes one per token, poisoned where unselected), the
    chunk size and, with ``head``, the logit scale and softcap."""
    options: dict[str, Any] = {
        "temperature": draw(st.sampled_from((1.0, 0.7))),
        "chunk_size": draw(st.sampled_from((None, 1, 2, 5))),
    }
    if t is not None and poison is not None and draw(st.booleans()):
        options["temperature"] = 0.5 + torch.rand(*t.shape, generator=t.generator, dtype=F64)
        poison["temperature"] = t.unselected.clone()
    if head:
        options["final_logit_softcapping"] = draw(st.sampled_from((None, 2.0)))
        options["logit_scale"] = draw(st.sampled_from((1.0, 0.7)))
    return options


def draw_statistics(draw: Draw) -> dict[str, Any]:
    """Sometimes ``statistics=``: a subset of the four names."""
    names = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    if not draw(st.booleans()):
        return {}
    return {"statistics": tuple(name for name in names if draw(st.booleans()))}


def draw_kept_options(
    draw: Draw,
    generator: torch.Generator,
    shape: tuple[int, ...],
    vocabulary: int,
    tokens: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The sampler's kept set, sometimes: ids (padded), a mask, or the top-k / top-p rule.

    With ``tokens`` the sets hold the sampled tokens (as an engine's do) and no rule is drawn:
    a loss of a token outside its set is not finite for every surrogate (CISPO: -sg(r) A log p).
    """
    rules = ("top_k", "rule", "min_p", "min_p+rule")
    kinds = ("none", "none", "ids", "mask") + (rules if tokens is None else ())
    kind = draw(st.sampled_from(kinds))
    if kind == "ids":
        ids = torch.randint(-1, vocabulary, (*shape, 3), generator=generator)
        if tokens is not None:
            ids[..., 0] = tokens
        return {"kept_ids": ids}
    if kind == "mask":
        mask = torch.rand((*shape, vocabulary), generator=generator) < 0.5
        if tokens is not None:
            mask.scatter_(-1, tokens.unsqueeze(-1), True)
        return {"kept_mask": mask}
    if kind == "top_k":
        return {"top_k": draw(st.integers(1, vocabulary))}
    if kind == "rule":
        return {"top_k": draw(st.integers(1, vocabulary)), "top_p": 0.7}
    if kind == "min_p":
        return {"min_p": draw(st.sampled_from((0.1, 0.5, 1.0)))}
    if kind == "min_p+rule":
        return {"min_p": 0.2, "top_k": draw(st.integers(1, vocabulary)), "top_p": 0.8}
    return {}


def draw_kl_options(draw: Draw, *, straight_through: bool = True) -> dict[str, Any]:
    options: dict[str, Any] = {
        "estimator": draw(st.sampled_from(("k1", "k2", "k3"))),
        "log_ratio_bound": draw(st.sampled_from((None, 20.0, 0.5))),
    }
    if straight_through:
        options["straight_through"] = draw(st.booleans())
    return options


# --- rows -------------------------------------------------------------------------------------


def _aggregate(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {"values": t.randn(*t.shape), "mask": t.mask, **draw_prompt_reduction(draw, t)},
        {"values": t.unselected},
        ("values",),
    )


def _pack(draw: Draw) -> Batch:
    # Positions outside the attention mask are dropped: never read into the packed values.
    t = draw_tokens(draw)
    return Batch(
        {"values": t.randn(*t.shape), "attention_mask": t.mask},
        {"values": t.unselected},
        ("values",),
    )


def _masked_reduction(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {
            "values": t.randn(*t.shape),
            "mask": t.mask,
            "dim": draw(st.sampled_from((None, 0, 1, -1))),
        },
        {"values": t.unselected},
        ("values",),
    )


def _policy_loss(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    advantages, advantages_poison = draw_advantages(draw, t)
    options = draw_policy_options(draw, t)
    options["return_per_token"] = draw(st.booleans())
    # Only log_probs requires grad: the fused path; old_log_probs/advantages too: autograd path.
    fused = draw(st.booleans())
    arguments = {
        "log_probs": t.log_probs(),
        "old_log_probs": t.log_probs(),
        "advantages": advantages,
        "mask": t.mask,
        **options,
    }
    poison = {
        "log_probs": t.unselected,
        "old_log_probs": t.unselected,
        "advantages": advantages_poison,
    }
    draw_importance_weights(draw, t, arguments, poison)
    entropy = draw(st.booleans())
    if entropy:  # the entropy bonus, differentiated too
        arguments.update(entropy=3 * torch.rand(*t.shape, generator=t.generator, dtype=F64))
        arguments["entropy_coef"] = draw(st.sampled_from((0.0, 0.1)))
        poison["entropy"] = t.unselected
    differentiate = ("log_probs",) if fused else ("log_probs", "old_log_probs", "advantages")
    return Batch(
        arguments,
        poison,
        differentiate + (("entropy",) if entropy else ()),
    )


def _grpo_clipped_surrogate(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    advantages, advantages_poison = draw_advantages(draw, t)
    return Batch(
        {
            "new_log_probs": t.log_probs(),
            "old_log_probs": t.log_probs(),
            "advantages": advantages,
            "token_mask": t.mask,
            "clip_epsilon": draw(st.sampled_from((0.0, 0.2, 10.0))),
        },
        {
            "new_log_probs": t.unselected,
            "old_log_probs": t.unselected,
            "advantages": advantages_poison,
        },
        ("new_log_probs",) if draw(st.booleans()) else ("new_log_probs", "old_log_probs"),
    )


def _kl(with_reduction: bool) -> Callable[[Draw], Batch]:
    def draw_batch(draw: Draw) -> Batch:
        t = draw_tokens(draw)
        options = draw_kl_options(draw)
        poison = {"log_probs": t.unselected, "ref_log_probs": t.unselected}
        differentiate: tuple[str, ...] = ("log_probs", "ref_log_probs")
        if with_reduction:
            options.update(draw_reduction(draw, t))
            if draw(st.booleans()):  # kl_loss(importance_weights=): (B, T), differentiable
                options["importance_weights"] = torch.rand(*t.shape, generator=t.generator)
                poison["importance_weights"] = t.unselected
                differentiate += ("importance_weights",)
        return Batch(
            {"log_probs": t.log_probs(), "ref_log_probs": t.log_probs(), "mask": t.mask, **options},
            poison,
            differentiate,
        )

    return draw_batch


def _rollout_correction(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    options = {
        "level": draw(st.sampled_from(("token", "sequence", "geometric"))),
        "mode": draw(st.sampled_from(("truncate", "mask", "reject"))),
        "upper": draw(st.sampled_from((None, 2.0, 1.1))),
        "lower": draw(st.sampled_from((None, 0.8))),
        "veto": draw(st.sampled_from((None, 0.5))),
    }
    return Batch(
        {"log_probs": t.log_probs(), "rollout_log_probs": t.log_probs(), "mask": t.mask, **options},
        {"log_probs": t.unselected, "rollout_log_probs": t.unselected},
        (),  # the weights carry no gradient
    )


def _off_policy_sequence_mask(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    advantages, advantages_poison = draw_advantages(draw, t)
    return Batch(
        {
            "log_probs": t.log_probs(),
            "sampling_log_probs": t.log_probs(),
            "advantages": advantages,
            "mask": t.mask,
            "threshold": draw(st.sampled_from((-0.1, 0.0, 0.3))),
        },
        {
            "log_probs": t.unselected,
            "sampling_log_probs": t.unselected,
            "advantages": advantages_poison,
        },
        (),
    )


def _rejection_mask(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    options = {
        "upper": draw(st.sampled_from((0.3, 2.0))),
        "level": draw(st.sampled_from(("token", "sequence"))),
        "estimator": draw(st.sampled_from(("ratio", "k1", "k2", "k3"))),
        "aggregate": draw(st.sampled_from(("sum", "mean", "max"))),
        "symmetric": draw(st.booleans()),
    }
    arguments = {
        "proximal_log_probs": t.log_probs(),
        "behavior_log_probs": t.log_probs(),
        "mask": t.mask,
        **options,
    }
    poison = {"proximal_log_probs": t.unselected, "behavior_log_probs": t.unselected}
    return Batch(arguments, poison, ())


def _iw_opd_advantages(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments = {
        "teacher_log_probs": t.log_probs(),
        "rollout_log_probs": t.log_probs(),
        "mask": t.mask,
        "gamma": draw(st.sampled_from((0.0, 0.5, 3.0))),
    }
    poison = {"teacher_log_probs": t.unselected, "rollout_log_probs": t.unselected}
    return Batch(arguments, poison, ())


def _kl_penalized_rewards(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {
            "policy_log_probs": t.log_probs(),
            "reference_log_probs": t.log_probs(),
            "rewards": t.randn(t.shape[0]),
            "response_mask": t.mask,
            "beta": draw(st.sampled_from((0.0, 0.1, 2.0))),
        },
        {"policy_log_probs": t.unselected, "reference_log_probs": t.unselected},
        ("policy_log_probs", "reference_log_probs"),
    )


def _kl_penalized_token_rewards(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {
            "log_probs": t.log_probs(),
            "ref_log_probs": t.log_probs(),
            "scores": t.randn(t.shape[0]),
            "mask": t.mask,
            "kl_coef": draw(st.sampled_from((0.0, 0.1))),
            **draw_kl_options(draw, straight_through=False),
        },
        {"log_probs": t.unselected, "ref_log_probs": t.unselected},
        ("log_probs", "ref_log_probs", "scores"),
    )


def _gae(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {
            "rewards": t.randn(*t.shape),
            "values": t.randn(*t.shape),
            "mask": t.mask,
            "gamma": draw(st.sampled_from((1.0, 0.9, 0.0))),
            "lam": draw(st.sampled_from((1.0, 0.95, 0.0))),
            "whiten": draw(st.booleans()),
            "holes": draw(st.sampled_from(("skip", "zero"))),
        },
        {"rewards": t.unselected, "values": t.unselected},
        ("rewards", "values"),
    )


def _reinforce_plus_plus(draw: Draw) -> Batch:
    group = draw(st.sampled_from((None, 1, 2)))
    t = draw_tokens(draw, batch_multiple=group or 1)
    arguments: dict[str, Any] = {
        "rewards": t.randn(t.shape[0]),
        "mask": t.mask,
        "gamma": draw(st.sampled_from((1.0, 0.9))),
        "group_size": group,
        "eps": draw(st.sampled_from((1e-8, 0.0))),
        "holes": draw(st.sampled_from(("skip", "zero"))),
    }
    poison: dict[str, torch.Tensor] = {}
    if draw(st.booleans()):
        arguments["token_rewards"] = t.randn(*t.shape)
        poison["token_rewards"] = t.unselected
    return Batch(arguments, poison, ("rewards", *poison))


def _value_loss(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {
            "values": t.randn(*t.shape),
            "old_values": t.randn(*t.shape),
            "returns": t.randn(*t.shape),
            "mask": t.mask,
            "clip": draw(st.sampled_from((None, 0.0, 0.2))),
            **draw_reduction(draw, t),
        },
        {"values": t.unselected, "old_values": t.unselected, "returns": t.unselected},
        ("values", "old_values", "returns"),
    )


def _whiten(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {
            "values": t.randn(*t.shape),
            "mask": t.mask,
            "shift_mean": draw(st.booleans()),
            "unbiased": draw(st.booleans()),
            "eps": draw(st.sampled_from((1e-8, 0.0, 1.0))),
        },
        {"values": t.unselected},
        ("values",),
    )


def _remax(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    return Batch(
        {"rewards": t.randn(*t.shape), "baseline_rewards": t.randn(t.shape[0]), "mask": t.mask},
        {"rewards": t.unselected},
        ("rewards", "baseline_rewards"),
    )


def _logits_case(kind: str) -> Callable[[Draw], Batch]:
    """token_log_probs, token_entropy, full_vocab_kl(_loss): poisoned logits rows."""

    def draw_batch(draw: Draw) -> Batch:
        t = draw_tokens(draw)
        vocabulary = draw(st.integers(2, 7))
        poison = {"logits": t.unselected_rows(vocabulary)}
        head = kind in ("token_log_probs", "token_entropy")
        arguments: dict[str, Any] = {
            "logits": t.randn(*t.shape, vocabulary) * 3,
            "mask": t.mask,
            **draw_logits_options(draw, t, poison, head=head),
        }
        if head:
            arguments.update(draw_kept_options(draw, t.generator, t.shape, vocabulary))
        if kind == "token_log_probs":
            arguments["tokens"] = torch.randint(0, vocabulary, t.shape, generator=t.generator)
            arguments.update(draw_statistics(draw))
        if kind.startswith("full_vocab_kl"):
            arguments["ref_logits"] = t.randn(*t.shape, vocabulary) * 3
            poison["ref_logits"] = t.unselected_rows(vocabulary)
        if kind == "full_vocab_kl_loss":
            arguments.update(draw_reduction(draw, t, none=False))
        return Batch(arguments, poison, tuple(poison))

    return draw_batch


def _hidden(draw: Draw, t: Tokens) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """hidden ``(B, T, H)`` (rows of unselected tokens poisoned), weight, bias, tokens."""
    width, vocabulary = draw(st.integers(1, 4)), draw(st.integers(2, 6))
    poison = {"hidden": t.unselected_rows(width)}
    arguments: dict[str, Any] = {
        "hidden": t.randn(*t.shape, width),
        "weight": t.randn(vocabulary, width),
        "tokens": torch.randint(0, vocabulary, t.shape, generator=t.generator),
        "bias": t.randn(vocabulary) if draw(st.booleans()) else None,
        **draw_logits_options(draw, t, poison, head=True),
    }
    return arguments, poison


def _token_log_probs_from_hidden(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments, poison = _hidden(draw, t)
    arguments.update(mask=t.mask, return_entropy=draw(st.booleans()), **draw_statistics(draw))
    vocabulary = arguments["weight"].shape[0]
    arguments.update(draw_kept_options(draw, t.generator, t.shape, vocabulary))
    differentiate = ("hidden", "weight") + (("bias",) if arguments["bias"] is not None else ())
    return Batch(arguments, poison, differentiate)


def _fused_policy_loss_from_hidden(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments, poison = _hidden(draw, t)
    advantages, advantages_poison = draw_advantages(draw, t)
    arguments.update(
        old_log_probs=t.log_probs(),
        advantages=advantages,
        mask=t.mask,
        **draw_policy_options(draw, t),
    )
    poison.update(old_log_probs=t.unselected, advantages=advantages_poison)
    draw_importance_weights(draw, t, arguments, poison)
    arguments["entropy_coef"] = draw(st.sampled_from((0.0, 0.0, 0.2)))
    vocabulary, tokens = arguments["weight"].shape[0], arguments["tokens"]
    arguments.update(draw_kept_options(draw, t.generator, t.shape, vocabulary, tokens))
    if draw(st.booleans()):  # with the KL term
        arguments.update(
            ref_log_probs=t.log_probs(),
            kl_coef=draw(st.sampled_from((0.0, 0.1))),
            kl_estimator=draw(st.sampled_from(("k1", "k2", "k3"))),
            kl_straight_through=draw(st.booleans()),
        )
        poison["ref_log_probs"] = t.unselected
    differentiate = ("hidden", "weight") + (("bias",) if arguments["bias"] is not None else ())
    return Batch(arguments, poison, differentiate)


def _response_log_probs(draw: Draw) -> Batch:
    """Right-padded ``[prompt, response, pad]`` rows; rows that score no response token poisoned."""
    t = draw_tokens(draw)  # only its generator and batch size are used
    batch, vocabulary = t.shape[0], draw(st.integers(2, 6))
    prompts = [draw(st.integers(1, 3)) for _ in range(batch)]
    responses = [draw(st.integers(0, 4)) for _ in range(batch)]
    length = max(p + r for p, r in zip(prompts, responses, strict=True)) + draw(st.integers(0, 2))
    attention = torch.zeros(batch, length, dtype=torch.bool)
    scoring = torch.zeros(batch, length, dtype=torch.bool)  # rows j that predict token j + 1
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        attention[b, : p + r] = True
        scoring[b, p - 1 : p + r - 1] = True
    arguments = {
        "logits": t.randn(batch, length, vocabulary) * 3,
        "input_ids": torch.randint(0, vocabulary, (batch, length), generator=t.generator),
        "prompt_lengths": torch.tensor(prompts),
        "attention_mask": attention,
        "response_length": max(1, *responses) + draw(st.integers(0, 1)),
        **draw_logits_options(draw, head=True),
        **draw_statistics(draw),
    }
    response = (batch, arguments["response_length"])
    arguments.update(draw_kept_options(draw, t.generator, response, vocabulary))
    poisons = {"logits": (~scoring).unsqueeze(-1).expand(batch, length, vocabulary).clone()}
    if draw(st.booleans()):  # one temperature per response token, poisoned past each response
        arguments["temperature"] = 0.5 + torch.rand(response, generator=t.generator, dtype=F64)
        columns = torch.arange(response[1])
        poisons["temperature"] = columns >= torch.tensor(responses).unsqueeze(1)
    return Batch(arguments, poisons, ("logits",))


def _entropy_mask(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments = {
        "entropy": 3 * torch.rand(*t.shape, generator=t.generator, dtype=F64),
        "mask": t.mask,
        "quantile": draw(st.sampled_from((0.0, 0.2, 0.5, 0.8, 1.0))),
    }
    return Batch(arguments, {"entropy": t.unselected}, ())


def _nll_loss(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments = {"log_probs": t.log_probs(), "mask": t.mask, **draw_prompt_reduction(draw, t)}
    return Batch(arguments, {"log_probs": t.unselected}, ("log_probs",))


def _m2po_mask(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments = {
        "log_ratio": 0.5 * t.randn(*t.shape),
        "mask": t.mask,
        "threshold": draw(st.sampled_from((0.01, 0.1, 1.0))),
    }
    return Batch(arguments, {"log_ratio": t.unselected}, ())


def _cov_selection(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    advantages, advantages_poison = draw_advantages(draw, t)
    log_probs = t.log_probs()
    arguments = {
        "log_probs": log_probs,
        "old_log_probs": log_probs + 0.3 * t.randn(*t.shape),
        "advantages": advantages,
        "mask": t.mask,
        "surrogate": draw(
            st.sampled_from((rlo.KLCov(ratio=0.3), rlo.ClipCov(ratio=1.0, cov_lb=-1.0)))
        ),
        "log_ratio_bound": draw(st.sampled_from((None, 20.0, 0.3))),
    }
    poison = {
        "log_probs": t.unselected,
        "old_log_probs": t.unselected,
        "advantages": advantages_poison,
    }
    return Batch(arguments, poison, ())


# --- issue 25: distillation losses ----------------------------------------------------------


def _teacher_slots(draw: Draw, t: Tokens, vocabulary: int) -> dict[str, torch.Tensor]:
    """The teacher's top-k log-probabilities (some slots padded with -inf) and ids."""
    slots = draw(st.integers(1, min(4, vocabulary)))
    teacher = torch.log_softmax(t.randn(*t.shape, vocabulary), -1)
    log_probs, ids = teacher.topk(slots, -1)
    padded = torch.rand(*t.shape, slots, generator=t.generator) < 0.2
    return {
        "teacher_log_probs": torch.where(padded, -torch.inf, log_probs),
        "teacher_ids": torch.where(padded, 0, ids),
    }


def _distillation(kind: str, hidden: bool) -> Callable[[Draw], Batch]:
    """topk_forward_kl, reverse_kl_loss, generalized_jsd_loss (and from hidden): poisoned rows
    of the student (logits or hidden states) and of the teacher at unselected tokens."""

    def draw_batch(draw: Draw) -> Batch:
        t = draw_tokens(draw)
        vocabulary = draw(st.integers(2, 6))
        poison: dict[str, torch.Tensor] = {}
        arguments: dict[str, Any] = {"mask": t.mask, **draw_reduction(draw, t)}
        arguments.update(draw_logits_options(draw, t, poison, head=hidden))
        if hidden:
            width = draw(st.integers(1, 3))
            arguments.update(hidden=t.randn(*t.shape, width), weight=t.randn(vocabulary, width),
                             bias=t.randn(vocabulary) if draw(st.booleans()) else None)  # fmt: skip
            poison["hidden"] = t.unselected_rows(width)
            differentiate: tuple[str, ...] = ("hidden", "weight")
            if arguments["bias"] is not None:
                differentiate += ("bias",)
        else:
            arguments["logits"] = t.randn(*t.shape, vocabulary) * 3
            poison["logits"] = t.unselected_rows(vocabulary)
            differentiate = ("logits",)
        if kind == "topk":
            arguments.update(_teacher_slots(draw, t, vocabulary))
            arguments["tail"] = draw(st.booleans())
            arguments["renormalize"] = draw(st.booleans())
            poison["teacher_log_probs"] = t.unselected_rows(arguments["teacher_ids"].shape[-1])
        elif kind == "reverse":
            arguments.update(tokens=torch.randint(0, vocabulary, t.shape, generator=t.generator),
                             teacher_log_probs=t.log_probs(), **draw_kl_options(draw))  # fmt: skip
            poison["teacher_log_probs"] = t.unselected
        elif hidden:  # the teacher's own head
            arguments.update(teacher_hidden=t.randn(*t.shape, 2),
                             teacher_weight=t.randn(vocabulary, 2),
                             beta=draw(st.sampled_from((0.0, 0.4, 1.0))))  # fmt: skip
            poison["teacher_hidden"] = t.unselected_rows(2)
        else:
            arguments.update(teacher_logits=t.randn(*t.shape, vocabulary) * 3,
                             beta=draw(st.sampled_from((0.0, 0.4, 1.0))))  # fmt: skip
            poison["teacher_logits"] = t.unselected_rows(vocabulary)
        return Batch(arguments, poison, differentiate)

    return draw_batch


def _optimal_token_baseline(draw: Draw) -> Batch:
    group = draw(st.sampled_from((1, 2)))
    t = draw_tokens(draw, batch_multiple=group)
    arguments: dict[str, Any] = {
        "rewards": t.randn(*t.shape),
        "mask": t.mask,
        "old_log_probs": t.log_probs(),
        "log_sum_sq_probs": t.log_probs(),
        "group_size": group,
        "alignment": draw(st.sampled_from(("position", "token"))),
        "handle_zero_tail": draw(st.booleans()),
    }
    poison = {name: t.unselected for name in ("rewards", "old_log_probs", "log_sum_sq_probs")}
    if draw(st.booleans()):
        arguments["importance_weights"] = torch.rand(*t.shape, generator=t.generator, dtype=F64)
        poison["importance_weights"] = t.unselected
    return Batch(arguments, poison, ())


def _reverse_kl_rewards(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    arguments = {
        "log_probs": t.log_probs(),
        "teacher_log_probs": t.log_probs(),
        "mask": t.mask,
        "coef": draw(st.sampled_from((0.0, 0.5, 2.0))),
        "estimator": draw(st.sampled_from(("k1", "k2", "k3", "abs"))),
        "log_ratio_bound": draw(st.sampled_from((None, 5.0))),
    }
    return Batch(arguments, {"log_probs": t.unselected, "teacher_log_probs": t.unselected}, ())


ISSUE25_NAN_CASES: tuple[NanCase, ...] = (
    NanCase("topk_forward_kl", rlo.topk_forward_kl, _distillation("topk", False), 16),
    NanCase("topk_forward_kl_from_hidden", rlo.topk_forward_kl_from_hidden,
            _distillation("topk", True), 16),
    NanCase("reverse_kl_loss", rlo.reverse_kl_loss, _distillation("reverse", False), 12),
    NanCase("reverse_kl_loss_from_hidden", rlo.reverse_kl_loss_from_hidden,
            _distillation("reverse", True), 12),
    NanCase("generalized_jsd_loss", rlo.generalized_jsd_loss, _distillation("jsd", False), 12),
    NanCase("generalized_jsd_loss_from_hidden", rlo.generalized_jsd_loss_from_hidden,
            _distillation("jsd", True), 12),
    NanCase("reverse_kl_rewards", rlo.reverse_kl_rewards, _reverse_kl_rewards, 8),
    NanCase("optimal_token_baseline_advantages", rlo.optimal_token_baseline_advantages,
            _optimal_token_baseline, 12),
)  # fmt: skip


# --- issue 34: the preference and KTO losses --------------------------------------------------


def _preference_objective(draw: Draw) -> Any:
    choices = [rlo.DPO(beta=0.5), rlo.IPO(beta=0.5), rlo.NCA(), rlo.AOT(beta=0.3),
               0.5 * rlo.DPO(f_divergence="js_divergence") + 0.5 * rlo.SFT(),
               rlo.ORPO(beta=0.2), rlo.CPO(beta=0.3, nll_coef=0.5),
               rlo.SimPO(beta=1.0)]  # fmt: skip
    return draw(st.sampled_from(choices))


def _preference_options(
    draw: Draw, t: Tokens, objective: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """``ld_alpha``, ``nll_mask``, normalisers; the chosen tokens a sum reads."""
    options: dict[str, Any] = {"objective": objective,
                               "ld_alpha": draw(st.sampled_from((None, 0.5)))}  # fmt: skip
    read = t.mask.clone()
    if objective.uses_nll and draw(st.booleans()):
        options["nll_mask"] = torch.rand(*t.shape, generator=t.generator) < 0.6
        read |= options["nll_mask"]
    if draw(st.booleans()):
        options |= {"normalizer": 3.0, "nll_normalizer": 5.0}
    return options, read


def _preference_loss(draw: Draw) -> Batch:
    t = draw_tokens(draw)
    batch = t.shape[0]
    rejected_mask = torch.rand(batch, draw(st.integers(1, 5)), generator=t.generator) < 0.7
    objective = _preference_objective(draw)
    options, read = _preference_options(draw, t, objective)
    rejected_shape = tuple(rejected_mask.shape)
    arguments: dict[str, Any] = {
        "chosen_log_probs": t.log_probs(), "chosen_mask": t.mask,
        "rejected_log_probs": -2 * torch.rand(rejected_shape, generator=t.generator, dtype=F64),
        "rejected_mask": rejected_mask, **options,
    }  # fmt: skip
    poison = {"chosen_log_probs": ~read, "rejected_log_probs": ~rejected_mask}
    if objective.needs_reference:
        arguments["ref_chosen_log_probs"] = t.log_probs()
        arguments["ref_rejected_log_probs"] = arguments["rejected_log_probs"] * 0.9
        poison |= {"ref_chosen_log_probs": t.unselected, "ref_rejected_log_probs": ~rejected_mask}
    if draw(st.booleans()):  # WPO
        arguments["chosen_log_sum_sq_probs"] = t.log_probs() - 1
        arguments["rejected_log_sum_sq_probs"] = arguments["rejected_log_probs"] - 1
        poison |= {"chosen_log_sum_sq_probs": t.unselected,
                   "rejected_log_sum_sq_probs": ~rejected_mask}  # fmt: skip
    return Batch(arguments, poison, ("chosen_log_probs", "rejected_log_probs"))


def _preference_loss_from_hidden(draw: Draw) -> Batch:
    t = draw_tokens(draw, batch_multiple=2)
    arguments, poison = _hidden(draw, t)
    objective = _preference_objective(draw)
    options, read = _preference_options(draw, t, objective)
    arguments |= {"mask": t.mask, **options}
    poison["hidden"] = poison["hidden"] & ~read.unsqueeze(-1)
    if objective.needs_reference:
        arguments["ref_log_probs"] = t.log_probs()
        poison["ref_log_probs"] = t.unselected
    differentiate = ("hidden", "weight") + (("bias",) if arguments["bias"] is not None else ())
    return Batch(arguments, poison, differentiate)


def _kto(hidden: bool) -> Callable[[Draw], Batch]:
    def draw_batch(draw: Draw) -> Batch:
        t = draw_tokens(draw)
        arguments: dict[str, Any] = {
            "mask": t.mask, "ref_log_probs": t.log_probs(),
            "desirable": torch.rand(t.shape[0], generator=t.generator) < 0.5,
            "kl": draw(st.sampled_from((None, 0.2, -0.1))),
            "kind": draw(st.sampled_from(("kto", "apo_zero_unpaired"))),
        }  # fmt: skip
        poison = {"ref_log_probs": t.unselected}
        if hidden:
            head, head_poison = _hidden(draw, t)
            arguments |= head
            poison |= head_poison
            differentiate = ("hidden", "weight") + (("bias",) if head["bias"] is not None else ())
        else:
            arguments["log_probs"] = t.log_probs()
            poison["log_probs"] = t.unselected
            differentiate = ("log_probs",)
        return Batch(arguments, poison, differentiate)

    return draw_batch


PREFERENCE_NAN_CASES: tuple[NanCase, ...] = (
    NanCase("preference_loss", rlo.preference_loss, _preference_loss, 16),
    NanCase("preference_loss_from_hidden", rlo.preference_loss_from_hidden,
            _preference_loss_from_hidden, 12),
    NanCase("kto_loss", rlo.kto_loss, _kto(False), 8),
    NanCase("kto_loss_from_hidden", rlo.kto_loss_from_hidden, _kto(True), 8),
)  # fmt: skip


NAN_CASES: tuple[NanCase, ...] = (
    NanCase("aggregate", rlo.aggregate, _aggregate),
    NanCase("masked_sum", rlo.masked_sum, _masked_reduction, max_examples=8),
    NanCase("masked_mean", rlo.masked_mean, _masked_reduction, max_examples=8),
    NanCase("policy_loss", rlo.policy_loss, _policy_loss, max_examples=40),
    NanCase("grpo_clipped_surrogate", rlo.grpo_clipped_surrogate, _grpo_clipped_surrogate),
    NanCase("kl_estimate", rlo.kl_estimate, _kl(with_reduction=False)),
    NanCase("kl_loss", rlo.kl_loss, _kl(with_reduction=True), max_examples=20),
    NanCase("kl_penalized_rewards", rlo.kl_penalized_rewards, _kl_penalized_rewards),
    NanCase("rejection_mask", rlo.rejection_mask, _rejection_mask, max_examples=16),
    NanCase("iw_opd_advantages", rlo.iw_opd_advantages, _iw_opd_advantages, max_examples=8),
    NanCase("rollout_correction", rlo.rollout_correction, _rollout_correction, max_examples=20),
    NanCase("off_policy_sequence_mask", rlo.off_policy_sequence_mask, _off_policy_sequence_mask, 8),
    NanCase(
        "kl_penalized_token_rewards", rlo.kl_penalized_token_rewards, _kl_penalized_token_rewards
    ),
    NanCase("gae", rlo.gae, _gae),
    NanCase(
        "reinforce_plus_plus_advantages", rlo.reinforce_plus_plus_advantages, _reinforce_plus_plus
    ),
    NanCase("token_log_probs", rlo.token_log_probs, _logits_case("token_log_probs")),
    NanCase("token_entropy", rlo.token_entropy, _logits_case("token_entropy")),
    NanCase("full_vocab_kl", rlo.full_vocab_kl, _logits_case("full_vocab_kl")),
    NanCase("full_vocab_kl_loss", rlo.full_vocab_kl_loss, _logits_case("full_vocab_kl_loss"), 16),
    NanCase(
        "token_log_probs_from_hidden",
        rlo.token_log_probs_from_hidden,
        _token_log_probs_from_hidden,
        16,
    ),
    NanCase(
        "fused_policy_loss_from_hidden",
        rlo.fused_policy_loss_from_hidden,
        _fused_policy_loss_from_hidden,
        40,
    ),
    NanCase("response_log_probs", rlo.response_log_probs, _response_log_probs),
    NanCase("value_loss", rlo.value_loss, _value_loss, max_examples=16),
    NanCase("masked_whiten", rlo.masked_whiten, _whiten),
    NanCase("global_masked_whiten", rlo.global_masked_whiten, _whiten, max_examples=6),
    NanCase("remax_advantages", rlo.remax_advantages, _remax, max_examples=8),
    NanCase("top_entropy_mask", rlo.top_entropy_mask, _entropy_mask),
    NanCase("global_top_entropy_mask", rlo.global_top_entropy_mask, _entropy_mask),
    NanCase("pack", rlo.pack, _pack, max_examples=8),
    NanCase("nll_loss", rlo.nll_loss, _nll_loss, max_examples=8),
    NanCase("dft_loss", rlo.dft_loss, _nll_loss, max_examples=8),
    NanCase("m2po_mask", rlo.m2po_mask, _m2po_mask, max_examples=8),
    NanCase("global_m2po_mask", rlo.global_m2po_mask, _m2po_mask, max_examples=4),
    NanCase("cov_selection", rlo.cov_selection, _cov_selection, max_examples=8),
    NanCase("global_cov_selection", rlo.global_cov_selection, _cov_selection, max_examples=4),
    *ISSUE25_NAN_CASES,
    *PREFERENCE_NAN_CASES,
)

EXEMPT: tuple[Exempt, ...] = (
    Exempt("global_normalizers", "counts selected tokens: masks only, no values"),
    Exempt("response_alignment", "integer token ids and positions only, no floating values"),
    Exempt("opo_advantages", "per-sequence rewards; the mask only gives the response lengths"),
)
