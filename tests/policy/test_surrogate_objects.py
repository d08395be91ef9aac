"""The surrogate objects (issue 21): frozen values, self-validating, one wrong combination each.

Every combination of a surrogate with an option that does not belong to it is impossible to
write (``TypeError`` from the object's constructor or from ``policy_loss``'s signature, naming
the option) or raises a ``ValueError`` naming it: this file enumerates them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

import rlobjectives as rlo
from rlobjectives import (
    CISPO,
    DPPO,
    DRO,
    FIPO,
    GMPO,
    M2PO,
    REAL,
    SAPO,
    TOPR,
    VESPO,
    Clip,
    ClipCov,
    KLCov,
    ProbabilityBand,
    Surrogate,
)
from rlobjectives.presets import trl_grpo_loss
from tolerances import assert_close

CLASSES: tuple[type[Surrogate], ...] = (
    Clip, CISPO, SAPO, GMPO, VESPO, DPPO, DRO, M2PO, ClipCov, KLCov, ProbabilityBand, TOPR, REAL,
    FIPO,
)  # fmt: skip
NAMES = {
    "clip": Clip, "cispo": CISPO, "sapo": SAPO, "gmpo": GMPO, "vespo": VESPO, "dppo": DPPO,
    "m2po": M2PO, "clip_cov": ClipCov, "kl_cov": KLCov, "probability_band": ProbabilityBand,
    "real": REAL,
}  # fmt: skip
# The prompt groups a group-level objective (REAL) needs from the call, for a batch of B rows.
GROUPED = ("real",)
# The fields without a default (DRO's beta: verl's dro_beta has none; TOPR's rewards, one per
# sequence of the call: _batch()'s three).
REQUIRED: dict[type, dict[str, Any]] = {
    DRO: {"beta": 0.5}, TOPR: {"rewards": [1.0, 0.0, -1.0]}, FIPO: {"gamma": 0.9, "cap": 0.2},
}  # fmt: skip
# The objects that take GSPO's sequence ratio (the others: ratio_level="token" only).
SEQUENCE_RATIO = (Clip, CISPO, SAPO, TOPR)
# The flat keywords of 0.2 that moved into the objects (issue 21).
FLAT_KEYWORDS = (
    "clip_low", "clip_high", "dual_clip", "delta", "cispo_cap", "sapo_temperature_pos",
    "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
)  # fmt: skip
VALUES = {  # a valid value of each field (for the field's own class)
    "low": 0.1, "high": 0.3, "dual": 3.0, "delta": 1.5, "cap": 5.0, "temperature_pos": 2.0,
    "temperature_neg": 2.0, "k_pos": 1.0, "lambda_pos": 1.0, "k_neg": 1.0, "lambda_neg": 1.0,
    "divergence": "kl", "ratio_cap": 3.0, "beta": 0.5, "threshold": 0.04, "ratio": 0.1,
    "cov_lb": 1.0, "cov_ub": 5.0, "generator": None, "selection": None, "coef": 1.0,
    "tau": 0.1, "kappa": 0.01, "rewards": [1.0], "positive_weight": 1.0, "negative_weight": 1.0,
    "gamma": 0.9, "cap_high_only": False, "safety_threshold": 4.0,
}  # fmt: skip


def _fields(cls: type) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def _batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    log_probs = old + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=generator) > 0.3
    return log_probs, old, torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64), mask


def _hidden_batch() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    return {
        "hidden": torch.randn(2, 3, 4, generator=generator),
        "weight": torch.randn(5, 4, generator=generator),
        "tokens": torch.randint(0, 5, (2, 3), generator=generator),
        "old_log_probs": -torch.rand(2, 3, generator=generator) - 1.0,
        "advantages": torch.tensor([1.0, -1.0]),
        "mask": torch.ones(2, 3, dtype=torch.bool),
    }


def test_objects_are_exported_frozen_and_documented() -> None:
    for cls in CLASSES:
        assert cls.__name__ in rlo.__all__ and getattr(rlo, cls.__name__) is cls
        assert issubclass(cls, Surrogate)
        assert dataclasses.is_dataclass(cls)
        instance = cls(**REQUIRED.get(cls, {}))
        with pytest.raises(dataclasses.FrozenInstanceError):
            instance.__setattr__(_fields(cls)[0], 0.1)
        doc = inspect.getdoc(cls) or ""
        for part in ("Attributes:", "Raises:", "References:", "Peer options"):
            assert part in doc, (cls.__name__, part)
        # one formula: the class writes its token formula or its terms, nothing else
        written = {"surrogate", "terms"} & set(vars(cls))
        assert len(written) == 1, (cls.__name__, written)
        assert not {"stage", "formula", "kernel_flags"} & set(vars(cls)), cls.__name__


def test_signatures() -> None:
    policy = inspect.signature(rlo.policy_loss).parameters
    fused = inspect.signature(rlo.fused_policy_loss_from_hidden).parameters
    # The process-group keywords of issue 23 and the sampler's kept set of issue 25 (inputs the
    # engine hands over, named by that issue) are not options of the loss: not counted.
    groups = {"context_group", "vocab_group"}
    # the prompt groups of issue 35 (prompt_mean, REAL): inputs of the batch, not loss options
    groups |= {"group_size", "group_ids"}
    kept = {"kept_ids", "kept_pad", "kept_mask", "top_k", "top_p", "min_p"}
    # the model's LM head as issue 33 names it (the head's transform and precision): inputs
    # describing the model, not options of the loss
    head = {"final_logit_softcapping", "logit_scale", "fp32_head"}
    assert kept | head <= set(fused)
    assert len(set(policy) - groups) <= 16 and len(set(fused) - groups - kept - head) <= 23
    assert policy["surrogate"].default == "clip" and fused["surrogate"].default == "clip"
    for name in ("ratio_level", "log_ratio_bound"):  # across surrogates: stay keywords
        assert name in policy and name in fused
    assert [f.name for f in dataclasses.fields(Clip)] == ["low", "high", "dual", "delta"]
    assert [f.name for f in dataclasses.fields(CISPO)] == ["cap", "low", "high"]
    assert [f.name for f in dataclasses.fields(SAPO)] == ["temperature_pos", "temperature_neg"]
    assert [f.name for f in dataclasses.fields(GMPO)] == ["low", "high"]
    assert _fields(VESPO) == ["k_pos", "lambda_pos", "k_neg", "lambda_neg"]
    assert _fields(DPPO) == ["divergence", "low", "high", "ratio_cap"]
    assert _fields(DRO) == ["beta"]
    assert _fields(M2PO) == ["threshold", "low", "high"]
    assert _fields(ClipCov) == [
        "ratio",
        "low",
        "high",
        "cov_lb",
        "cov_ub",
        "generator",
        "selection",
    ]
    assert _fields(KLCov) == ["ratio", "coef", "selection"]
    assert _fields(ProbabilityBand) == ["tau", "kappa"]
    assert _fields(TOPR) == ["rewards", "positive_weight", "negative_weight"]
    assert _fields(REAL) == ["tau"]
    assert _fields(FIPO) == [
        "gamma", "cap", "low", "high", "delta", "cap_high_only", "safety_threshold",
    ]  # fmt: skip
    assert FIPO(0.9, 0.2) == FIPO(gamma=0.9, cap=0.2, low=0.2, high=None, delta=None,
                                  cap_high_only=True, safety_threshold=None)  # fmt: skip
    assert REAL() == REAL(tau=0.5)  # ms-swift's real_tau
    # the defaults: DPPO's per divergence (SkyRL's 0.2 for TV, 0.05 for KL; the paper's cap 20),
    # M2PO's the paper's threshold, the Cov objects' verl's config values
    assert DPPO() == DPPO(divergence="tv", low=0.2, high=0.2, ratio_cap=20.0)
    assert DPPO("kl") == DPPO(divergence="kl", low=0.05, high=0.05, ratio_cap=20.0)
    assert DPPO(low=0.1).high == 0.1 and DPPO(low=0.1, high=0.3).high == 0.3
    assert M2PO() == M2PO(threshold=0.04, low=None, high=None)
    assert ClipCov() == ClipCov(ratio=0.0002, low=0.2, high=None, cov_lb=1.0, cov_ub=5.0)
    assert KLCov() == KLCov(ratio=0.0002, coef=0.1)
    assert Clip() == Clip(low=0.2, high=None, dual=None, delta=None)
    assert CISPO() == CISPO(cap=None, low=0.2, high=None)
    assert SAPO() == SAPO(temperature_pos=1.0, temperature_neg=1.05)
    assert GMPO() == GMPO(low=0.2, high=None)
    assert VESPO() == VESPO(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert ProbabilityBand() == ProbabilityBand(tau=0.1, kappa=1e-3)  # prime-rl's defaults


@pytest.mark.parametrize("owner", CLASSES, ids=lambda c: c.__name__)
def test_a_field_of_another_surrogate_cannot_be_written(owner: type) -> None:
    """Each field of each other object, given to this one: a TypeError naming it."""
    foreign = {name for cls in CLASSES for name in _fields(cls)} - set(_fields(owner))
    assert foreign
    for name in sorted(foreign):
        with pytest.raises(TypeError, match=rf"\b{name}\b"):
            owner(**{**REQUIRED.get(owner, {}), name: VALUES[name]})


@pytest.mark.parametrize("keyword", FLAT_KEYWORDS)
def test_the_flat_keywords_left_the_signatures(keyword: str) -> None:
    log_probs, old, advantages, mask = _batch()
    for surrogate in ("clip", *CLASSES):
        with pytest.raises(TypeError, match=rf"\b{keyword}\b"):
            rlo.policy_loss(log_probs, old, advantages, mask, surrogate=surrogate, **{keyword: 1.5})
    with pytest.raises(TypeError, match=rf"\b{keyword}\b"):
        rlo.fused_policy_loss_from_hidden(**_hidden_batch(), **{keyword: 1.5})
    with pytest.raises(TypeError, match=rf"\b{keyword}\b"):
        rlo.policy_loss(log_probs, old, advantages, mask, **{keyword: None})


@pytest.mark.parametrize(
    "cls", [c for c in CLASSES if c not in SEQUENCE_RATIO], ids=lambda c: c.__name__
)
def test_surrogates_without_a_sequence_ratio_take_token_ratios_only(cls: type) -> None:
    log_probs, old, advantages, mask = _batch()
    names = () if cls in REQUIRED else (cls.name,)  # type: ignore[attr-defined]
    for surrogate in (cls(**REQUIRED.get(cls, {})), *names):
        with pytest.raises(ValueError, match=r"ratio_level must be 'token'"):
            rlo.policy_loss(
                log_probs, old, advantages, mask, surrogate=surrogate, ratio_level="sequence"
            )
        with pytest.raises(ValueError, match=r"ratio_level must be 'token'"):
            rlo.fused_policy_loss_from_hidden(
                **_hidden_batch(), surrogate=surrogate, ratio_level="sequence"
            )


@pytest.mark.parametrize("cls", SEQUENCE_RATIO, ids=lambda c: c.__name__)
def test_token_local_surrogates_take_sequence_ratios(cls: type) -> None:
    log_probs, old, advantages, mask = _batch()
    surrogate = cls(**REQUIRED.get(cls, {}))
    out = rlo.policy_loss(
        log_probs, old, advantages, mask, surrogate=surrogate, ratio_level="sequence"
    )
    assert torch.isfinite(out.loss)


WRONG_COMBINATIONS: list[tuple[type, dict[str, Any], str]] = [
    (CISPO, {"cap": 5.0, "low": 0.2}, r"^CISPO.low does not apply with CISPO.cap"),
    (CISPO, {"cap": 5.0, "high": 0.28}, r"^CISPO.high does not apply with CISPO.cap"),
    (CISPO, {"cap": 5.0, "low": 0.1, "high": 0.2}, r"^CISPO.low does not apply"),
    (CISPO, {"low": None, "high": 0.28}, r"^CISPO.high requires CISPO.low"),
    (Clip, {"low": None, "high": 0.28}, r"^Clip.high requires Clip.low"),
    (GMPO, {"low": None, "high": 0.28}, r"^GMPO.high requires GMPO.low"),
    (M2PO, {"low": None, "high": 0.28}, r"^M2PO.high requires M2PO.low"),
    (FIPO, {"gamma": 0.9, "cap": 0.2, "low": None, "high": 0.28}, r"^FIPO.high requires FIPO.low"),
    (FIPO, {"gamma": 1.5, "cap": 0.2}, r"^FIPO.gamma must be <= 1"),
    (DPPO, {"divergence": "tv", "low": 1.5}, r"^DPPO.low must be <= 1 for divergence='tv'"),
    (DPPO, {"high": 1.2}, r"^DPPO.high must be <= 1 for divergence='tv'"),
    (ClipCov, {"cov_lb": 5.0, "cov_ub": 1.0}, r"^ClipCov.cov_lb must be < ClipCov.cov_ub"),
    (ClipCov, {"cov_lb": 5.0}, r"^ClipCov.cov_lb must be < ClipCov.cov_ub"),  # default ub 5
]


@pytest.mark.parametrize(("cls", "fields", "match"), WRONG_COMBINATIONS)
def test_wrong_combinations_raise_naming_the_option(
    cls: type, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**fields)


def test_cispo_cap_has_no_band() -> None:
    capped = CISPO(cap=5.0)
    assert capped.low is None and capped.high is None
    assert CISPO(cap=5.0, low=None) == capped  # None is no band: not a wrong combination
    assert dataclasses.replace(capped, cap=3.0) == CISPO(cap=3.0)  # replace() round-trips
    assert CISPO().low == 0.2 and CISPO(low=None).low is None


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_name_means_the_object_with_its_defaults(name: str) -> None:
    log_probs, old, advantages, mask = _batch()
    groups = {"group_ids": torch.tensor([0, 0, 1])} if name in GROUPED else {}
    torch.manual_seed(0)  # Clip-Cov draws from the default generator: the same draw for both
    by_name = rlo.policy_loss(log_probs, old, advantages, mask, surrogate=name, **groups)
    torch.manual_seed(0)
    by_object = rlo.policy_loss(log_probs, old, advantages, mask, surrogate=NAMES[name](), **groups)
    assert_close(by_name.loss, by_object.loss)
    for a, b in zip(by_name.diagnostics, by_object.diagnostics, strict=True):
        assert_close(a, b)
    groups = {"group_size": 2} if name in GROUPED else {}
    torch.manual_seed(0)
    hidden_name = rlo.fused_policy_loss_from_hidden(**_hidden_batch(), surrogate=name, **groups)
    torch.manual_seed(0)
    hidden_object = rlo.fused_policy_loss_from_hidden(
        **_hidden_batch(), surrogate=NAMES[name](), **groups
    )
    assert_close(hidden_name.loss, hidden_object.loss)


def test_topr_has_no_defaults() -> None:
    """TOPR's rewards belong to the call's responses: the name asks for the object."""
    log_probs, old, advantages, mask = _batch()
    with pytest.raises(ValueError, match=r"^surrogate='topr' has no defaults: .*TOPR\(rewards"):
        rlo.policy_loss(log_probs, old, advantages, mask, surrogate="topr")
    with pytest.raises(TypeError, match=r"\brewards\b"):
        TOPR()  # type: ignore[call-arg]
    assert TOPR([1.0, 2.0]) == TOPR([3.0])  # the rewards are data, not compared


def test_dro_has_no_defaults() -> None:
    """verl's dro_beta has no default (it raises): the name asks for the object."""
    log_probs, old, advantages, mask = _batch()
    with pytest.raises(ValueError, match=r"^surrogate='dro' has no defaults: pass the object, DRO"):
        rlo.policy_loss(log_probs, old, advantages, mask, surrogate="dro")
    with pytest.raises(TypeError, match=r"\bbeta\b"):
        DRO()  # type: ignore[call-arg]


def test_surrogate_is_a_name_or_an_object() -> None:
    log_probs, old, advantages, mask = _batch()
    with pytest.raises(ValueError, match=r"^surrogate must be one of \['clip'"):
        rlo.policy_loss(log_probs, old, advantages, mask, surrogate="ppo")
    for wrong in (Clip, {"low": 0.2}, 3, None):
        with pytest.raises(TypeError, match=r"^surrogate must be one of .* or a surrogate object"):
            rlo.policy_loss(log_probs, old, advantages, mask, surrogate=wrong)  # type: ignore[arg-type]


def test_fields_accept_zero_d_tensors_and_a_learnable_one_takes_autograd() -> None:
    log_probs, old, advantages, mask = _batch()
    number = rlo.policy_loss(log_probs, old, advantages, mask, surrogate=Clip(low=0.1, dual=2.0))
    low = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    tensor = rlo.policy_loss(
        log_probs, old, advantages, mask, surrogate=Clip(low=low, dual=torch.tensor(2.0))
    )
    assert_close(tensor.loss, number.loss)
    assert "ClippedSurrogate" not in type(tensor.loss.grad_fn).__name__  # the autograd path
    (grad,) = torch.autograd.grad(tensor.loss, [low])
    assert torch.isfinite(grad)
    for bad in (torch.tensor([0.1]), torch.tensor(True)):
        with pytest.raises(TypeError, match=r"^Clip.low must be a real number"):
            Clip(low=bad)


def test_presets_build_the_objects() -> None:
    """The presets keep their peers' option names and hand objects to policy_loss."""
    with pytest.raises(ValueError, match=r"^sapo_temperature_neg must be > 0"):
        trl_grpo_loss(loss_type="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match=r"^delta must be > 1"):
        trl_grpo_loss(loss_type="grpo", delta=1.0)
