r"""OpenRLHF's ``PolicyLoss`` (``openrlhf/models/loss.py``, OpenRLHF 3c3be62) as library calls.

:func:`openrlhf_policy_loss` takes ``PolicyLoss``'s constructor options and returns a function
with ``PolicyLoss.forward``'s signature and results ``(loss, clip_ratio, ppo_kl, vllm_kl)``.

- ``policy_loss_type="ppo"``: ``policy_loss(surrogate=Clip(low=clip_eps_low, high=clip_eps_high,
  dual=dual_clip), log_ratio_bound=20)``; with ``enable_vllm_is_correction`` the loss of
  each token is multiplied by a constant weight of :math:`\rho = \exp(\ell_{old} -
  \ell_{rollout})` (``policy_loss(importance_weights=)``, the denominators keep
  ``action_mask``), one row per ``vllm_is_correction_type`` in :data:`OPENRLHF_IS_CORRECTIONS`,
  from :func:`rlobjectives.rollout_correction` with ``[low, high]`` =
  ``vllm_is_truncated_threshold`` (inclusive): ``"tis"`` = ``mode="truncate"``
  (:math:`\mathrm{clip}(\rho, low, high)`), ``"icepop"`` = ``mode="mask"``
  (:math:`\rho\,\mathbb 1[low \le \rho \le high]`), ``"seq-mask-tis"`` = the untruncated
  :math:`\rho` of the sequences whose geometric-mean ratio is in the band
  (``level="geometric", mode="reject"``), 0 elsewhere;
- ``policy_loss_type="gspo"``: ``ratio_level="sequence"`` without a bound, in sample mode
  (OpenRLHF forces ``token_level_loss=False``); with ``enable_vllm_is_correction`` the
  sequence ratio is taken against ``rollout_log_probs`` and no weight applies (as OpenRLHF).
  OpenRLHF's GSPO gives every token of a sequence the gradient of the sequence ratio times the
  token's advantage averaged over the sequence; the library's GSPO-token form gives each token
  its own advantage: the two are equal when the advantages are constant along each sequence
  (every OpenRLHF estimator except GAE and KL-in-reward shaping).

Aggregation (``aggregate_loss``): ``token_level_loss=True`` = ``token_mean`` with
``normalizer = batch_num_tokens / dp_size`` (the global token count of the optimizer step,
times ``dp_size``; local count when None); ``False`` = ``sequence_mean`` with
``normalizer = global_batch_size / dp_size`` (local: the non-empty rows). OpenRLHF divides a
row by :math:`n_i + 10^{-8}` in sample mode; an empty local batch gives 0 here, NaN there.
``rollout_correction`` clamps the log-ratio to :math:`\pm 20` before ``exp`` (OpenRLHF does
not): the weights differ only where :math:`|\ell_{old} - \ell_{rollout}| > 20`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._core.reduction import masked_mean
from .._core.validation import checks_environment, validate_choice
from ..policy.surrogates import Clip
from ..rollout.correction import RolloutCorrection, rollout_correction
from ._common import (
    ReductionArgs,
    check_options,
    float64_if_any,
    preset_count,
    preset_flag,
    preset_number,
    promote,
    weighted_policy_loss,
)

__all__ = ["OPENRLHF_IS_CORRECTIONS", "OPENRLHF_POLICY_LOSS_TYPES", "OpenRLHFPolicyLoss"]
__all__ += ["OpenRLHFPolicyLossOutput", "openrlhf_policy_loss"]


class OpenRLHFPolicyLossOutput(NamedTuple):
    """``PolicyLoss.forward``'s ``(loss, clip_ratio, ppo_kl, vllm_kl)``, 0-d tensors.

    ``clip_ratio``: fraction of selected tokens whose clip binds (``surr2 < surr1``);
    ``ppo_kl``: mean of ``old_log_probs - log_probs`` (k1 of KL(old‖new)); ``vllm_kl``: mean of
    ``rollout_log_probs - old_log_probs`` with the ppo vLLM IS correction, else None.
    """

    loss: torch.Tensor
    clip_ratio: torch.Tensor
    ppo_kl: torch.Tensor
    vllm_kl: torch.Tensor | None


class _Type(NamedTuple):
    """One ``policy_loss_type``: the surrogate options, sample mode, and the IS correction.

    ``against_sampler``: with ``enable_vllm_is_correction`` the ratio is taken against the
    rollout log-probs (gspo) instead of weighting the loss (ppo).
    """

    options: Callable[[OpenRLHFPolicyLoss], dict[str, Any]]
    token_level_loss: bool | None  # None: the constructor's
    against_sampler: bool


def _ppo(loss: OpenRLHFPolicyLoss) -> dict[str, Any]:
    return {**loss.clip_options(), "log_ratio_bound": 20.0}


def _gspo(loss: OpenRLHFPolicyLoss) -> dict[str, Any]:
    return {**loss.clip_options(), "ratio_level": "sequence", "log_ratio_bound": None}


#: OpenRLHF ``policy_loss_type`` -> library options.
OPENRLHF_POLICY_LOSS_TYPES: dict[str, _Type] = {
    "ppo": _Type(_ppo, None, against_sampler=False),
    "gspo": _Type(_gspo, False, against_sampler=True),
}


class _Correction(NamedTuple):
    """The trainer/sampler log-probabilities and the band of OpenRLHF's vLLM IS correction."""

    old_log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor
    mask: torch.Tensor
    low: float
    high: float

    def correct(self, **options: Any) -> RolloutCorrection:
        """:func:`rlobjectives.rollout_correction` of ``old_log_probs`` against the sampler."""
        return rollout_correction(self.old_log_probs, self.rollout_log_probs, self.mask, **options)


def _tis(ratios: _Correction) -> torch.Tensor:
    """``clamp(ρ, low, high)``: truncated importance sampling."""
    return ratios.correct(mode="truncate", lower=ratios.low, upper=ratios.high).weights


def _icepop(ratios: _Correction) -> torch.Tensor:
    """``ρ · 1[low <= ρ <= high]``: IcePop (zero outside the band, the raw ratio inside)."""
    return ratios.correct(mode="mask", lower=ratios.low, upper=ratios.high).weights


def _seq_mask_tis(ratios: _Correction) -> torch.Tensor:
    """``1[low <= exp(mean_t log ρ) <= high] · ρ``: the untruncated ratio of the kept rows."""
    band = {"lower": ratios.low, "upper": ratios.high}
    kept = ratios.correct(level="geometric", mode="reject", **band).weights  # 1 kept, 0 not
    return ratios.correct(mode="truncate", upper=None).weights * kept


#: ``vllm_is_correction_type`` (ppo) -> the constant per-token weight that multiplies the
#: (clipped, dual-clipped) loss; the denominators keep ``action_mask``.
OPENRLHF_IS_CORRECTIONS: dict[str, Callable[[_Correction], torch.Tensor]] = {
    "tis": _tis,
    "icepop": _icepop,
    "seq-mask-tis": _seq_mask_tis,
}


class _Behaviour(NamedTuple):
    """The log-probabilities the ratio is taken against, the loss weights and ``vllm_kl``."""

    log_probs: torch.Tensor
    weights: torch.Tensor | None
    vllm_kl: torch.Tensor | None


@dataclass(frozen=True)
class OpenRLHFPolicyLoss:
    """OpenRLHF's ``PolicyLoss`` for fixed options (built by :func:`openrlhf_policy_loss`)."""

    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None
    token_level_loss: bool
    policy_loss_type: str
    enable_vllm_is_correction: bool
    vllm_is_truncated_threshold: tuple[float, float] = (0.5, 5.0)
    vllm_is_correction_type: str = "tis"

    def clip_options(self) -> dict[str, Any]:
        """The clip band and dual clip as ``policy_loss``'s surrogate."""
        clip = Clip(low=self.clip_eps_low, high=self.clip_eps_high, dual=self.dual_clip)
        return {"surrogate": clip}

    @checks_environment
    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: Any = None,
        global_batch_size: Any = None,
    ) -> OpenRLHFPolicyLossOutput:
        """``PolicyLoss.forward`` for these tensors (see :func:`openrlhf_policy_loss`)."""
        row = OPENRLHF_POLICY_LOSS_TYPES[self.policy_loss_type]
        dp_size = preset_count(dp_size, "dp_size")
        wide = float64_if_any(log_probs, old_log_probs, advantages, rollout_log_probs)
        log_probs, old_log_probs, advantages = (
            promote(t, wide) for t in (log_probs, old_log_probs, advantages)
        )
        rollout_log_probs = promote(rollout_log_probs, wide)
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
        token_level = row.token_level_loss
        token_level = self.token_level_loss if token_level is None else token_level
        count = batch_num_tokens if token_level else global_batch_size
        args = ReductionArgs(
            "token_mean" if token_level else "sequence_mean",
            normalizer=None if count is None else count / dp_size,
        )
        behaviour = self._behaviour(row, old_log_probs, rollout_log_probs, mask)
        term = weighted_policy_loss(
            log_probs, behaviour.log_probs, advantages, mask, options=row.options(self),
            args=args, weights=behaviour.weights,
        )  # fmt: skip
        diagnostics = term.diagnostics
        clip_ratio = diagnostics.clip_fraction_low + diagnostics.clip_fraction_high
        ppo_kl = diagnostics.approx_kl_k1
        if self.enable_vllm_is_correction:  # ppo_kl stays against old_log_probs in OpenRLHF
            ppo_kl = masked_mean(old_log_probs - log_probs.detach(), mask)
        return OpenRLHFPolicyLossOutput(term.loss, clip_ratio, ppo_kl, behaviour.vllm_kl)

    def _behaviour(
        self,
        row: _Type,
        old_log_probs: torch.Tensor,
        rollout_log_probs: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> _Behaviour:
        if not self.enable_vllm_is_correction:
            return _Behaviour(old_log_probs, None, None)
        if rollout_log_probs is None:
            raise ValueError(
                "enable_vllm_is_correction needs rollout_log_probs (the sampler's log-probs)"
            )
        if row.against_sampler:  # gspo: the ratio against the sampler, no weight
            return _Behaviour(rollout_log_probs, None, None)
        low, high = self.vllm_is_truncated_threshold
        ratios = _Correction(old_log_probs.detach(), rollout_log_probs, mask, low, high)
        weights = OPENRLHF_IS_CORRECTIONS[self.vllm_is_correction_type](ratios)
        vllm_kl = masked_mean(rollout_log_probs - old_log_probs.detach(), mask)
        return _Behaviour(old_log_probs, weights, vllm_kl)


@checks_environment
def openrlhf_policy_loss(
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_level_loss: bool = True,
    policy_loss_type: str = "ppo",
    enable_vllm_is_correction: bool = False,
    vllm_is_truncated_threshold: Sequence[float] | None = None,
    vllm_is_correction_type: str = "tis",
) -> OpenRLHFPolicyLoss:
    r"""OpenRLHF's ``PolicyLoss(...)`` with these options, built from library calls.

    The arguments are ``PolicyLoss.__init__``'s (CLI: ``--actor.eps_clip_low_high LOW HIGH``,
    ``--actor.dual_clip``, ``--actor.policy_loss_type``, ``--algo.advantage.is_correction_*``).
    The returned function takes ``forward``'s arguments ``(log_probs, old_log_probs,
    advantages, action_mask=None, rollout_log_probs=None, dp_size=1, batch_num_tokens=None,
    global_batch_size=None)`` and returns :class:`OpenRLHFPolicyLossOutput`
    ``(loss, clip_ratio, ppo_kl, vllm_kl)``. See the module docstring for the mapping.

    Args:
        clip_eps_low: :math:`\epsilon_{low}`, in ``[0, 1)``.
        clip_eps_high: :math:`\epsilon_{high}`.
        dual_clip: :math:`c > 1` (for :math:`A < 0`), or None.
        token_level_loss: token mean (True) or mean of per-sequence means (False); ``"gspo"``
            forces False.
        policy_loss_type: ``"ppo"`` or ``"gspo"``.
        enable_vllm_is_correction: the vLLM IS correction (needs ``rollout_log_probs`` at call
            time): ``"ppo"`` weights the loss by ``vllm_is_correction_type``; ``"gspo"`` takes
            its ratio against ``rollout_log_probs``.
        vllm_is_truncated_threshold: ``[low, high]`` of the IS correction, ``0 <= low <= high``,
            ``high > 0``; None = ``[0.5, 5.0]`` (the CLI's
            ``--algo.advantage.is_correction_threshold`` default).
        vllm_is_correction_type: ``"tis"``, ``"icepop"`` or ``"seq-mask-tis"``.

    Returns:
        An :class:`OpenRLHFPolicyLoss`.

    Raises:
        ValueError: naming the option, when the preset is built: ``dual_clip <= 1``, an unknown
            ``policy_loss_type`` or ``vllm_is_correction_type`` (as OpenRLHF), ``clip_eps_low``
            outside ``[0, 1)``, a negative ``clip_eps_high``, a non-finite coefficient (NaN,
            inf), a threshold that is not a ``[low, high]`` band; at call time, the correction
            without ``rollout_log_probs``, a ``dp_size`` that is not a positive whole number.
        TypeError: naming the option: a non-number clip value, a non-bool
            ``token_level_loss`` or ``enable_vllm_is_correction``.

    Examples:
        >>> import torch
        >>> loss_fn = openrlhf_policy_loss(dual_clip=3.0)
        >>> log_probs = torch.zeros(1, 2, requires_grad=True)
        >>> out = loss_fn(log_probs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
        >>> out.loss, out.clip_ratio
        (tensor(-1., grad_fn=<...>), tensor(0.))
    """
    validate_choice(policy_loss_type, "policy_loss_type", tuple(OPENRLHF_POLICY_LOSS_TYPES))
    choices = tuple(OPENRLHF_IS_CORRECTIONS)
    validate_choice(vllm_is_correction_type, "vllm_is_correction_type", choices)
    # Every coefficient and threshold under its PolicyLoss name, as the library checks its own
    # hyperparameters (finite, in range, a number), when the preset is built.
    dual = (
        None
        if dual_clip is None
        else preset_number(dual_clip, "dual_clip", minimum=1.0, strict=True)
    )
    loss = OpenRLHFPolicyLoss(
        preset_number(clip_eps_low, "clip_eps_low", maximum=1.0),
        preset_number(clip_eps_high, "clip_eps_high"), dual,
        preset_flag(token_level_loss, "token_level_loss"), policy_loss_type,
        preset_flag(enable_vllm_is_correction, "enable_vllm_is_correction"),
        _threshold(vllm_is_truncated_threshold), vllm_is_correction_type,
    )  # fmt: skip
    check_options(OPENRLHF_POLICY_LOSS_TYPES[policy_loss_type].options(loss))
    return loss


def _threshold(value: Sequence[float] | None) -> tuple[float, float]:
    """``vllm_is_truncated_threshold`` as ``(low, high)``: finite, ``0 <= low <= high``."""
    if value is None:
        return (0.5, 5.0)
    band = tuple(value)
    if len(band) != 2 or not all(isinstance(v, (int, float)) for v in band):
        raise ValueError(
            f"vllm_is_truncated_threshold must be [low, high] (two numbers), got {value!r}"
        )
    low, high = float(band[0]), float(band[1])
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high and high > 0.0):
        raise ValueError(
            f"vllm_is_truncated_threshold must be finite with 0 <= low <= high and high > 0, "
            f"got {value!r}"
        )
    return (low, high)
