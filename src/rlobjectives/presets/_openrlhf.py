r"""OpenRLHF's ``PolicyLoss`` (``openrlhf/models/loss.py``, OpenRLHF 3c3be62) as library calls.

:func:`openrlhf_policy_loss` takes ``PolicyLoss``'s constructor options and returns a function
with ``PolicyLoss.forward``'s signature and results ``(loss, clip_ratio, ppo_kl, vllm_kl)``.

- ``policy_loss_type="ppo"``: ``policy_loss(clip_low=clip_eps_low, clip_high=clip_eps_high,
  dual_clip=dual_clip, log_ratio_bound=20)``;
- ``policy_loss_type="gspo"``: ``ratio_level="sequence"`` without a bound, in sample mode
  (OpenRLHF forces ``token_level_loss=False``); with ``enable_vllm_is_correction`` the
  sequence ratio is taken against ``rollout_log_probs`` (as OpenRLHF). OpenRLHF's GSPO gives
  every token of a sequence the gradient of the sequence ratio times the token's advantage
  averaged over the sequence; the library's GSPO-token form gives each token its own advantage:
  the two are equal when the advantages are constant along each sequence (every OpenRLHF
  estimator except GAE and KL-in-reward shaping).

Aggregation (``aggregate_loss``): ``token_level_loss=True`` = ``token_mean`` with
``normalizer = batch_num_tokens / dp_size`` (the global token count of the optimizer step,
times ``dp_size``; local count when None); ``False`` = ``sequence_mean`` with
``normalizer = global_batch_size / dp_size`` (local: the non-empty rows). OpenRLHF divides a
row by :math:`n_i + 10^{-8}` in sample mode; an empty local batch gives 0 here, NaN there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._masking import masked_mean
from .._validation import validate_choice
from ._common import ReductionArgs, not_yet, weighted_policy_loss

__all__ = ["OPENRLHF_PENDING", "OPENRLHF_POLICY_LOSS_TYPES", "OpenRLHFPolicyLoss"]
__all__ += ["OpenRLHFPolicyLossOutput", "openrlhf_policy_loss"]


class OpenRLHFPolicyLossOutput(NamedTuple):
    """``PolicyLoss.forward``'s ``(loss, clip_ratio, ppo_kl, vllm_kl)``, 0-d tensors.

    ``clip_ratio``: fraction of selected tokens whose clip binds (``surr2 < surr1``);
    ``ppo_kl``: mean of ``old_log_probs - log_probs`` (k1 of KL(old‖new)); ``vllm_kl``: None
    (it is only set by the ppo vLLM IS correction, not supported yet).
    """

    loss: torch.Tensor
    clip_ratio: torch.Tensor
    ppo_kl: torch.Tensor
    vllm_kl: torch.Tensor | None


class _Type(NamedTuple):
    """One ``policy_loss_type``: the surrogate options and whether it forces sample mode."""

    options: Callable[[OpenRLHFPolicyLoss], dict[str, Any]]
    token_level_loss: bool | None  # None: the constructor's


def _ppo(loss: OpenRLHFPolicyLoss) -> dict[str, Any]:
    return {**loss.clip_options(), "log_ratio_bound": 20.0}


def _gspo(loss: OpenRLHFPolicyLoss) -> dict[str, Any]:
    return {**loss.clip_options(), "ratio_level": "sequence", "log_ratio_bound": None}


#: OpenRLHF ``policy_loss_type`` -> library options.
OPENRLHF_POLICY_LOSS_TYPES: dict[str, _Type] = {
    "ppo": _Type(_ppo, None),
    "gspo": _Type(_gspo, False),
}

#: ``vllm_is_correction_type`` (ppo) -> what it needs. Each is one row once
#: ``rollout_correction`` and ``policy_loss(importance_weights=)`` exist (issue 12): tis =
#: mode="truncate" with [low, high], icepop = mode="mask", seq-mask-tis = the geometric level as
#: a filter times the untruncated token ratio.
OPENRLHF_PENDING: dict[str, str] = {
    kind: "rollout_correction and policy_loss(importance_weights=) (issue 12)"
    for kind in ("tis", "icepop", "seq-mask-tis")
}


@dataclass(frozen=True)
class OpenRLHFPolicyLoss:
    """OpenRLHF's ``PolicyLoss`` for fixed options (built by :func:`openrlhf_policy_loss`)."""

    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None
    token_level_loss: bool
    policy_loss_type: str
    enable_vllm_is_correction: bool

    def clip_options(self) -> dict[str, Any]:
        """The clip band and dual clip as ``policy_loss`` keywords."""
        return {
            "clip_low": self.clip_eps_low,
            "clip_high": self.clip_eps_high,
            "dual_clip": self.dual_clip,
        }

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
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
        token_level = row.token_level_loss
        token_level = self.token_level_loss if token_level is None else token_level
        count = batch_num_tokens if token_level else global_batch_size
        args = ReductionArgs(
            "token_mean" if token_level else "sequence_mean",
            normalizer=None if count is None else count / dp_size,
        )
        behaviour = old_log_probs
        if self.enable_vllm_is_correction:  # gspo: the ratio against the sampler (as OpenRLHF)
            if rollout_log_probs is None:
                raise ValueError("enable_vllm_is_correction needs rollout_log_probs")
            behaviour = rollout_log_probs
        term = weighted_policy_loss(
            log_probs, behaviour, advantages, mask, options=row.options(self), args=args
        )
        diagnostics = term.diagnostics
        clip_ratio = diagnostics.clip_fraction_low + diagnostics.clip_fraction_high
        ppo_kl = diagnostics.approx_kl_k1
        if self.enable_vllm_is_correction:  # ppo_kl stays against old_log_probs in OpenRLHF
            ppo_kl = masked_mean(old_log_probs - log_probs.detach(), mask)
        return OpenRLHFPolicyLossOutput(term.loss, clip_ratio, ppo_kl, None)


def openrlhf_policy_loss(
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_level_loss: bool = True,
    policy_loss_type: str = "ppo",
    enable_vllm_is_correction: bool = False,
    vllm_is_truncated_threshold: tuple[float, float] | list[float] | None = None,
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
        enable_vllm_is_correction: for ``"gspo"``: the ratio against ``rollout_log_probs``;
            for ``"ppo"``: raises ``NotImplementedError`` (needs ``rollout_correction``).
        vllm_is_truncated_threshold: ``[low, high]`` of the IS correction.
        vllm_is_correction_type: ``"tis"``, ``"icepop"`` or ``"seq-mask-tis"``.

    Returns:
        An :class:`OpenRLHFPolicyLoss`.

    Raises:
        ValueError: ``dual_clip <= 1``, an unknown ``policy_loss_type`` or
            ``vllm_is_correction_type`` (as OpenRLHF).
        NotImplementedError: the ppo vLLM IS correction (see :data:`OPENRLHF_PENDING`).

    Examples:
        >>> import torch
        >>> loss_fn = openrlhf_policy_loss(dual_clip=3.0)
        >>> log_probs = torch.zeros(1, 2, requires_grad=True)
        >>> out = loss_fn(log_probs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
        >>> out.loss, out.clip_ratio
        (tensor(-1., grad_fn=<...>), tensor(0.))
    """
    validate_choice(policy_loss_type, "policy_loss_type", tuple(OPENRLHF_POLICY_LOSS_TYPES))
    validate_choice(vllm_is_correction_type, "vllm_is_correction_type", tuple(OPENRLHF_PENDING))
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    if enable_vllm_is_correction and policy_loss_type == "ppo":
        raise not_yet(
            f"OpenRLHF vllm_is_correction_type={vllm_is_correction_type!r}",
            OPENRLHF_PENDING[vllm_is_correction_type],
        )
    del vllm_is_truncated_threshold  # used by the ppo IS correction rows (issue 12)
    return OpenRLHFPolicyLoss(
        float(clip_eps_low), float(clip_eps_high), None if dual_clip is None else float(dual_clip),
        token_level_loss, policy_loss_type, enable_vllm_is_correction,
    )  # fmt: skip
