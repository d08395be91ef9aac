r"""OpenRLHF 0.11.2's ``PolicyLoss`` (``openrlhf/models/loss.py``) as library calls.

:func:`openrlhf_policy_loss` takes ``PolicyLoss``'s constructor options and returns a function
with ``PolicyLoss.forward``'s signature and its five results ``(loss, clip_ratio, ppo_kl,
vllm_kl, is_filter_ratio)`` (``ActorPPOTrainer.training_step`` unpacks five).

- ``policy_loss_type="ppo"``: ``policy_loss(surrogate=Clip(low=clip_eps_low,
  high=clip_eps_high, dual=dual_clip), log_ratio_bound=20)``.
- ``policy_loss_type="gspo"``: ``ratio_level="sequence"`` without a bound, in sample mode
  (OpenRLHF forces ``token_level_loss=False``), the same ``Clip`` (dual clip included).
  OpenRLHF differentiates the sequence ratio :math:`s_i = \exp(\frac{1}{n_i}\sum_t \lambda_t)`
  itself, so every token of a sequence receives the sequence's mean of the per-token
  derivatives; the library's GSPO-token form gives each token its own. The preset feeds the
  log-probabilities as :math:`\tilde\ell_t = \mathrm{sg}(\ell_t) + \bar\ell_i -
  \mathrm{sg}(\bar\ell_i)` (:math:`\bar\ell_i` the sequence's mean): the value is
  :math:`\ell_t` and the gradient of each token is the sequence mean, OpenRLHF's, also for
  per-token advantages (GAE, KL in the reward). With ``is_correction_level != "off"`` the
  ratio is taken against ``rollout_log_probs`` and no weight applies (as OpenRLHF).

The train/rollout IS correction (``ppo`` with ``is_correction_level`` ``"token"`` or
``"seq"``) multiplies the per-token loss by a constant coefficient (``policy_loss(
importance_weights=)``; the denominators keep ``action_mask``), with :math:`\rho =
\exp(\ell_{old} - \ell_{rollout})` and a gate that reads one statistic per unit (a token, or
the sequence's mean at ``"seq"``) against ``is_correction_threshold`` ``[low, high]``:

- ``is_correction_gating`` (:data:`OPENRLHF_GATINGS`): ``"ratio"`` the ratio itself
  (:math:`\rho`; per sequence the geometric mean :math:`\exp(\mathrm{mean}_t \log\rho)`),
  ``"binary_kl"`` :math:`p\log\frac{p}{q} + (1-p)\log\frac{1-p}{1-q}` and ``"tv"``
  :math:`|p - q|` of the sampled token's probabilities :math:`p = e^{\ell_{rollout}}`,
  :math:`q = e^{\ell_{old}}`, both clamped to :math:`[10^{-6}, 1 - 10^{-6}]` (per sequence
  the plain mean);
- ``is_correction_mode`` (:data:`OPENRLHF_MODES`): ``"mask"`` keeps the units with
  :math:`low \le stat \le high` at their token ratio :math:`\rho`, 0 elsewhere; ``"clip"``
  (token level, ratio gating only) :math:`\mathrm{clip}(\rho, low, high)`;
- ``is_filter_ratio``: the fraction of the units out of the band (tokens: over the selected
  tokens; sequences: over all B rows, an empty row counting as filtered, as OpenRLHF's NaN
  mean does); ``vllm_kl``: the mean of :math:`\ell_{rollout} - \ell_{old}`.

The named schemes of OpenRLHF 0.10 map exactly: ``tis`` = ``("token", "clip", "ratio")``,
``icepop`` = ``("token", "mask", "ratio")``, ``seq-mask-tis`` = ``("seq", "mask", "ratio")``;
FlashREINFORCE's trust region is ``("seq", "mask", "binary_kl")`` with ``[0, δ]``.

Aggregation (``aggregate_loss``): ``token_level_loss=True`` = ``token_mean`` with
``normalizer = batch_num_tokens / dp_size`` (the global token count of the optimizer step,
times ``dp_size``; the local count when None); ``False`` = ``sequence_mean`` with
``normalizer = global_batch_size / dp_size`` (local: the non-empty rows). OpenRLHF divides a
row by :math:`n_i + 10^{-8}` in sample mode (relative :math:`10^{-8}`); its masked means
multiply by the mask (NaN/inf at masked positions reach its loss, never the preset's); an
empty local batch gives 0 here, NaN there.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._core.masked import masked_mean
from .._core.reduction import mean_selected
from .._core.validation import checks_environment, compute_dtype, validate_choice, validate_scalar
from ..policy.surrogates import Clip
from ._common import (
    ReductionArgs,
    check_options,
    preset_count,
    preset_flag,
    preset_number,
    weighted_policy_loss,
)

__all__ = ["OPENRLHF_GATINGS", "OPENRLHF_LEVELS", "OPENRLHF_MODES"]
__all__ += ["OPENRLHF_POLICY_LOSS_TYPES", "OpenRLHFPolicyLoss", "OpenRLHFPolicyLossOutput"]
__all__ += ["openrlhf_policy_loss"]


class OpenRLHFPolicyLossOutput(NamedTuple):
    """``PolicyLoss.forward``'s ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``.

    0-d tensors: ``clip_ratio``, the fraction of selected tokens whose clip binds
    (``surr2 < surr1``); ``ppo_kl``, the mean of ``old_log_probs - log_probs`` (k1 of
    KL(old‖new), against ``old_log_probs`` also for gspo against the sampler); ``vllm_kl``, the
    mean of ``rollout_log_probs - old_log_probs``, and ``is_filter_ratio``, the fraction of
    units the gate drops, with the ppo IS correction on (None otherwise, as OpenRLHF).
    """

    loss: torch.Tensor
    clip_ratio: torch.Tensor
    ppo_kl: torch.Tensor
    vllm_kl: torch.Tensor | None
    is_filter_ratio: torch.Tensor | None


class _Type(NamedTuple):
    """One ``policy_loss_type``: its surrogate options and whether it forces sample mode."""

    options: Callable[[OpenRLHFPolicyLoss], dict[str, Any]]
    sample_mode: bool  # gspo: token_level_loss=False whatever the constructor said


def _ppo(loss: OpenRLHFPolicyLoss) -> dict[str, Any]:
    return {"surrogate": loss.clip(), "log_ratio_bound": 20.0}


def _gspo(loss: OpenRLHFPolicyLoss) -> dict[str, Any]:
    return {"surrogate": loss.clip(), "ratio_level": "sequence", "log_ratio_bound": None}


#: OpenRLHF ``policy_loss_type`` -> library options.
OPENRLHF_POLICY_LOSS_TYPES: dict[str, _Type] = {
    "ppo": _Type(_ppo, sample_mode=False),
    "gspo": _Type(_gspo, sample_mode=True),
}

#: ``is_correction_level``: ``"off"`` (no correction), per ``"token"``, per sequence (``"seq"``).
OPENRLHF_LEVELS: tuple[str, ...] = ("off", "token", "seq")


class _Rollout(NamedTuple):
    """The trainer's (old) and the sampler's log-probabilities of the IS correction, detached."""

    old_log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor
    mask: torch.Tensor  # (B, T) bool

    @property
    def log_ratio(self) -> torch.Tensor:
        r""":math:`\log\rho = \ell_{old} - \ell_{rollout}` (OpenRLHF's ``is_log_ratio``)."""
        return self.old_log_probs - self.rollout_log_probs

    def probabilities(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled token's rollout and trainer probabilities, clamped to [1e-6, 1 - 1e-6]."""
        p = self.rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
        q = self.old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
        return p, q


def _binary_kl(rollout: _Rollout) -> torch.Tensor:
    """KL(Bernoulli(p) ‖ Bernoulli(q)) of the sampled token, OpenRLHF's arithmetic."""
    p, q = rollout.probabilities()
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


def _total_variation(rollout: _Rollout) -> torch.Tensor:
    """``|p - q|`` of the sampled token."""
    p, q = rollout.probabilities()
    return (p - q).abs()


class _Gating(NamedTuple):
    """A gate's per-token statistic and what turns a sequence mean of it into the statistic."""

    per_token: Callable[[_Rollout], torch.Tensor]
    finish: Callable[[torch.Tensor], torch.Tensor]  # ratio: exp (of log ρ); divergences: as is


def _identity(values: torch.Tensor) -> torch.Tensor:
    return values


#: ``is_correction_gating`` -> the statistic the gate reads: the ratio ρ (per sequence its
#: geometric mean), or the sampled token's binary-KL / total-variation divergence (per
#: sequence the plain mean).
OPENRLHF_GATINGS: dict[str, _Gating] = {
    "ratio": _Gating(lambda rollout: rollout.log_ratio, torch.exp),
    "binary_kl": _Gating(_binary_kl, _identity),
    "tv": _Gating(_total_variation, _identity),
}


class _Gate(NamedTuple):
    """The gate's loss coefficient ``(B, T)`` and its filtered units (``(B, T)`` or ``(B, 1)``)."""

    coefficient: torch.Tensor
    filtered: torch.Tensor


def _mask_mode(statistic: torch.Tensor, ratio: torch.Tensor, low: float, high: float) -> _Gate:
    """Out-of-band units drop (coefficient 0); the kept tokens keep their ratio ρ."""
    keep = (statistic >= low) & (statistic <= high)
    return _Gate(
        torch.where(keep, ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device)), ~keep
    )


def _clip_mode(statistic: torch.Tensor, ratio: torch.Tensor, low: float, high: float) -> _Gate:
    """The token ratio clamped into the band (truncated IS); out-of-band tokens count filtered."""
    del ratio  # the statistic is the token ratio itself (token level, ratio gating)
    return _Gate(statistic.clamp(low, high), (statistic < low) | (statistic > high))


#: ``is_correction_mode`` -> (statistic, token ratio ρ, low, high) -> coefficient, filtered.
OPENRLHF_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, float, float], _Gate]] = {
    "mask": _mask_mode,
    "clip": _clip_mode,
}


class _Correction(NamedTuple):
    """What the IS correction adds: the loss weights and the two metrics."""

    weights: torch.Tensor | None
    vllm_kl: torch.Tensor | None
    is_filter_ratio: torch.Tensor | None


_NO_CORRECTION = _Correction(None, None, None)


@dataclass(frozen=True)
class OpenRLHFPolicyLoss:
    """OpenRLHF's ``PolicyLoss`` for fixed options (built by :func:`openrlhf_policy_loss`)."""

    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None
    token_level_loss: bool
    policy_loss_type: str
    is_correction_level: str = "off"
    is_correction_mode: str = "mask"
    is_correction_gating: str = "ratio"
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)

    def clip(self) -> Clip:
        """The clip band and dual clip as ``policy_loss``'s surrogate."""
        return Clip(low=self.clip_eps_low, high=self.clip_eps_high, dual=self.dual_clip)

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
        corrected = self.is_correction_level != "off"
        if corrected and rollout_log_probs is None:
            raise ValueError(
                f"is_correction_level={self.is_correction_level!r} needs rollout_log_probs "
                "(the sampler's log-probs), got None"
            )
        tensors = [log_probs, old_log_probs, advantages]
        dtype = compute_dtype(*(t for t in (*tensors, rollout_log_probs) if t is not None))
        log_probs, old_log_probs, advantages = (t.to(dtype) for t in tensors)  # differentiable
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
        mask = torch.as_tensor(mask, device=log_probs.device) != 0
        old_log_probs = old_log_probs.detach()
        rollout = None if rollout_log_probs is None else rollout_log_probs.detach().to(dtype)
        token_level = self.token_level_loss and not row.sample_mode
        count_name = "batch_num_tokens" if token_level else "global_batch_size"
        count = batch_num_tokens if token_level else global_batch_size
        if count is not None:  # checked under OpenRLHF's name where it is read
            count = validate_scalar(count, count_name, strict=True)
        args = ReductionArgs(
            "token_mean" if token_level else "sequence_mean",
            normalizer=None if count is None else count / dp_size,
        )
        correction = _NO_CORRECTION
        behaviour = old_log_probs
        if corrected and row.sample_mode:  # gspo: the ratio against the sampler, no weight
            assert rollout is not None
            behaviour = rollout
        elif corrected:
            assert rollout is not None
            correction = self._correction(_Rollout(old_log_probs, rollout, mask))
        if row.sample_mode:  # gspo: OpenRLHF differentiates the sequence ratio itself
            log_probs = _sequence_mean_gradient(log_probs, mask)
        term = weighted_policy_loss(
            log_probs, behaviour, advantages, mask, options=row.options(self), args=args,
            weights=correction.weights,
        )  # fmt: skip
        diagnostics = term.diagnostics
        clip_ratio = diagnostics.clip_fraction_low + diagnostics.clip_fraction_high
        ppo_kl = masked_mean(old_log_probs - log_probs.detach(), mask)
        return OpenRLHFPolicyLossOutput(
            term.loss, clip_ratio, ppo_kl, correction.vllm_kl, correction.is_filter_ratio
        )

    def _correction(self, rollout: _Rollout) -> _Correction:
        """The IS coefficient of every token, ``vllm_kl`` and ``is_filter_ratio`` (ppo)."""
        gating = OPENRLHF_GATINGS[self.is_correction_gating]
        per_token = gating.per_token(rollout)  # (B, T)
        sequence_level = self.is_correction_level == "seq"
        if sequence_level:
            statistic = gating.finish(mean_selected(per_token, rollout.mask, dim=-1))[:, None]
        else:
            statistic = gating.finish(per_token)
        low, high = self.is_correction_threshold
        gate = OPENRLHF_MODES[self.is_correction_mode](
            statistic, rollout.log_ratio.exp(), low, high
        )
        if sequence_level:  # over all B rows; an empty row's NaN mean is out of the band there
            empty = ~rollout.mask.any(dim=-1, keepdim=True)
            is_filter_ratio = (gate.filtered | empty).to(per_token.dtype).mean()
        else:
            is_filter_ratio = masked_mean(gate.filtered.to(per_token.dtype), rollout.mask)
        vllm_kl = masked_mean(rollout.rollout_log_probs - rollout.old_log_probs, rollout.mask)
        return _Correction(gate.coefficient, vllm_kl, is_filter_ratio)


def _sequence_mean_gradient(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r""":math:`\mathrm{sg}(\ell_t) + \bar\ell_i - \mathrm{sg}(\bar\ell_i)`: value :math:`\ell_t`.

    The gradient of every selected token of sequence :math:`i` is the sequence's mean of the
    gradients the tokens receive (:math:`\partial\tilde\ell_t/\partial\ell_u = 1/n_i`): the
    GSPO-token surrogate on these inputs has OpenRLHF's gradient of
    :math:`\exp(\mathrm{mean}_t\,\Delta_t)`.
    """
    row_mean = mean_selected(log_probs, mask, dim=-1)[:, None]  # (B, 1), NaN-safe
    return log_probs.detach() + (row_mean - row_mean.detach())


@checks_environment
def openrlhf_policy_loss(
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_level_loss: bool = True,
    policy_loss_type: str = "ppo",
    is_correction_level: str = "off",
    is_correction_mode: str = "mask",
    is_correction_gating: str = "ratio",
    is_correction_threshold: Sequence[float] | float = (0.5, 5.0),
) -> OpenRLHFPolicyLoss:
    r"""OpenRLHF 0.11.2's ``PolicyLoss(...)`` with these options, built from library calls.

    The arguments are ``PolicyLoss.__init__``'s, as ``ActorPPOTrainer`` passes them from the
    CLI (``--actor.eps_clip_low_high LOW HIGH``, ``--actor.dual_clip``,
    ``--actor.loss_agg_mode`` (``token_level_loss = loss_agg_mode == "token-mean"``),
    ``--actor.policy_loss_type``, ``--algo.advantage.is_correction_level`` / ``_mode`` /
    ``_gating`` / ``_threshold``). The returned function takes ``forward``'s arguments
    ``(log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
    dp_size=1, batch_num_tokens=None, global_batch_size=None)`` and returns
    :class:`OpenRLHFPolicyLossOutput` ``(loss, clip_ratio, ppo_kl, vllm_kl,
    is_filter_ratio)``. See the module docstring for the mapping.

    Args:
        clip_eps_low: :math:`\epsilon_{low}`, in ``[0, 1)``.
        clip_eps_high: :math:`\epsilon_{high}`.
        dual_clip: :math:`c > 1` (for :math:`A < 0`), or None.
        token_level_loss: token mean (True) or mean of per-sequence means (False); ``"gspo"``
            forces False.
        policy_loss_type: ``"ppo"`` or ``"gspo"``.
        is_correction_level: ``"off"``, ``"token"`` or ``"seq"``: the unit the IS gate reads
            (needs ``rollout_log_probs`` at call time unless ``"off"``); with ``"gspo"`` any
            level only takes the sequence ratio against ``rollout_log_probs``.
        is_correction_mode: ``"mask"`` (drop the units out of the band) or ``"clip"``
            (clamp the token ratio into it; token level and ratio gating only).
        is_correction_gating: ``"ratio"``, ``"binary_kl"`` or ``"tv"``: the statistic the gate
            reads (the divergences take an upper bound only: ``low`` must be 0).
        is_correction_threshold: ``[low, high]`` on the statistic, finite, ``0 <= low <=
            high``, ``high > 0``; one number ``H`` is ``[0, H]`` (the CLI's single-value form).

    Returns:
        An :class:`OpenRLHFPolicyLoss`.

    Raises:
        ValueError: naming the option, when the preset is built: ``dual_clip <= 1``, an unknown
            ``policy_loss_type``, level, mode or gating (as OpenRLHF), ``"clip"`` with the
            sequence level or a divergence gating, a divergence gating with ``low > 0`` (as
            OpenRLHF), ``clip_eps_low`` outside ``[0, 1)``, a negative ``clip_eps_high``, a
            non-finite coefficient, a threshold that is not a band; at call time, a correction
            without ``rollout_log_probs``, a ``dp_size`` that is not a positive whole number, a
            ``batch_num_tokens`` / ``global_batch_size`` that is not positive and finite.
        TypeError: naming the option: a non-number clip value, a non-bool
            ``token_level_loss``, an ``is_correction_threshold`` that is neither a number nor a
            sequence of numbers (None, a string, a tensor).

    Examples:
        >>> import torch
        >>> loss_fn = openrlhf_policy_loss(dual_clip=3.0)
        >>> log_probs = torch.zeros(1, 2, requires_grad=True)
        >>> out = loss_fn(log_probs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
        >>> out.loss, out.clip_ratio, out.is_filter_ratio
        (tensor(-1., grad_fn=<...>), tensor(0.), None)
    """
    validate_choice(policy_loss_type, "policy_loss_type", tuple(OPENRLHF_POLICY_LOSS_TYPES))
    validate_choice(is_correction_level, "is_correction_level", OPENRLHF_LEVELS)
    validate_choice(is_correction_mode, "is_correction_mode", tuple(OPENRLHF_MODES))
    validate_choice(is_correction_gating, "is_correction_gating", tuple(OPENRLHF_GATINGS))
    if is_correction_mode == "clip" and (
        is_correction_level == "seq" or is_correction_gating != "ratio"
    ):
        raise ValueError(
            "is_correction_mode='clip' requires is_correction_level='token' and "
            f"is_correction_gating='ratio', got level {is_correction_level!r}, gating "
            f"{is_correction_gating!r}"
        )
    threshold = _threshold(is_correction_threshold)
    if is_correction_gating != "ratio" and is_correction_level != "off" and threshold[0] > 0:
        raise ValueError(
            f"is_correction_gating={is_correction_gating!r} takes an upper bound only: "
            f"is_correction_threshold must be [0, delta], got {list(threshold)}"
        )
    dual = (
        None
        if dual_clip is None
        else preset_number(dual_clip, "dual_clip", minimum=1.0, strict=True)
    )
    loss = OpenRLHFPolicyLoss(
        preset_number(clip_eps_low, "clip_eps_low", maximum=1.0),
        preset_number(clip_eps_high, "clip_eps_high"), dual,
        preset_flag(token_level_loss, "token_level_loss"), policy_loss_type,
        is_correction_level, is_correction_mode, is_correction_gating, threshold,
    )  # fmt: skip
    check_options(OPENRLHF_POLICY_LOSS_TYPES[policy_loss_type].options(loss))
    return loss


def _is_number(value: object) -> bool:
    """A real number (Python or NumPy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _threshold(value: Sequence[float] | float) -> tuple[float, float]:
    """``is_correction_threshold`` as ``(low, high)``: finite, ``0 <= low <= high``, high > 0.

    One number (a Python or NumPy scalar) or a sequence of one or two (a list, a tuple, a NumPy
    array: what OpenRLHF's CLI and configs hold).
    """
    if _is_number(value):
        band: tuple[object, ...] = (0.0, value)
    elif isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise TypeError(
            "is_correction_threshold must be [low, high] or one upper bound (numbers), got "
            f"{type(value).__name__} ({value!r})"
        )
    else:
        band = tuple(value)
    if len(band) == 1:  # the CLI's single value: an upper bound
        band = (0.0, band[0])
    if not (len(band) == 2 and all(_is_number(v) for v in band)):
        raise ValueError(
            f"is_correction_threshold must be [low, high] or one upper bound, got {value!r}"
        )
    low, high = float(band[0]), float(band[1])  # type: ignore[arg-type]
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high and high > 0.0):
        raise ValueError(
            "is_correction_threshold must be finite with 0 <= low <= high and high > 0, "
            f"got {value!r}"
        )
    return (low, high)
