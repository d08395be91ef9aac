r"""The peers' preference and reward-model losses as tables onto the preference calls.

- :func:`trl_dpo_loss`: TRL 1.16 ``DPOTrainer._compute_loss`` for every ``DPOConfig.loss_type``
  (a list, weighted by ``loss_weights``) and option (``beta``, ``label_smoothing``,
  ``f_divergence_type`` with ``f_alpha_divergence_coef``, ``ld_alpha``, ``use_weighting``,
  ``discopop_tau``), with TRL's logged ``rewards/*`` and ``logps/*`` metrics; the option
  combinations TRL refuses are refused with TRL's reason.
- :func:`trl_reward_loss`: TRL's ``RewardTrainer.compute_loss`` (margin,
  ``center_rewards_coefficient``) and its metrics.
- :func:`openrlhf_dpo_loss`, :func:`openrlhf_pairwise_loss`, :func:`openrlhf_log_exp_loss`:
  OpenRLHF 0.11.2's ``DPOLoss`` (cDPO ``label_smoothing``, ``ipo`` on raw sums),
  ``PairWiseLoss`` and ``LogExpLoss`` (which ignores its margin), with their return values.

Each TRL loss type is one row of :data:`TRL_DPO_LOSS_TYPES`: a function of the options to a
preference object. TRL's loss is :math:`\sum_k w_k \frac{1}{B}\sum_i L^{(k)}_i` over the
micro-batch's ``B`` pairs, i.e. ``preference_loss`` with the combination
:math:`\sum_k w_k L^{(k)}` and the default normaliser (every pair of TRL's batch has both
responses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._core.validation import ArrayLike, checks_environment, validate_choice
from ..preference import (
    AOT,
    BCO,
    DPO,
    EXO,
    IPO,
    NCA,
    SFT,
    APODown,
    APOZero,
    DiscoPOP,
    Hinge,
    PreferenceObjective,
    RobustDPO,
    SPPOHard,
    preference_loss,
)
from ..preference.reward import reward_model_loss
from ._common import preset_flag, preset_number

__all__ = [
    "OpenRLHFDPOLoss",
    "OpenRLHFPairwiseLoss",
    "TRLDPOLoss",
    "TRLRewardLoss",
    "TRL_DPO_LOSS_TYPES",
    "TRLPreferenceOutput",
    "openrlhf_dpo_loss",
    "openrlhf_log_exp_loss",
    "openrlhf_pairwise_loss",
    "trl_dpo_loss",
    "trl_reward_loss",
]


class _Options(NamedTuple):
    beta: float
    label_smoothing: float
    f_divergence: str
    alpha: float
    tau: float


#: TRL's ``loss_type`` -> the preference object of the options (TRL's own formulas: ``sigmoid``
#: ignores ``label_smoothing``; ``exo_pair`` reads it as EXO's epsilon, ``robust`` as the flip
#: rate, ``aot`` / ``aot_unpaired`` as conservative smoothing).
TRL_DPO_LOSS_TYPES: dict[str, Callable[[_Options], PreferenceObjective]] = {
    "sigmoid": lambda o: DPO(beta=o.beta, f_divergence=o.f_divergence, alpha=o.alpha),
    "hinge": lambda o: Hinge(beta=o.beta, f_divergence=o.f_divergence, alpha=o.alpha),
    "ipo": lambda o: IPO(beta=o.beta, f_divergence=o.f_divergence, alpha=o.alpha),
    "exo_pair": lambda o: EXO(
        beta=o.beta, epsilon=o.label_smoothing, f_divergence=o.f_divergence, alpha=o.alpha
    ),
    "nca_pair": lambda o: NCA(beta=o.beta),
    "robust": lambda o: RobustDPO(
        beta=o.beta, label_smoothing=o.label_smoothing, f_divergence=o.f_divergence, alpha=o.alpha
    ),
    "bco_pair": lambda o: BCO(beta=o.beta),
    "sppo_hard": lambda o: SPPOHard(beta=o.beta),
    "aot": lambda o: AOT(beta=o.beta, label_smoothing=o.label_smoothing),
    "aot_unpaired": lambda o: AOT(beta=o.beta, label_smoothing=o.label_smoothing, unpaired=True),
    "apo_zero": lambda o: APOZero(beta=o.beta),
    "apo_down": lambda o: APODown(beta=o.beta),
    "discopop": lambda o: DiscoPOP(
        beta=o.beta, tau=o.tau, f_divergence=o.f_divergence, alpha=o.alpha
    ),
    "sft": lambda o: SFT(),
    "sigmoid_norm": lambda o: DPO(
        beta=o.beta, f_divergence=o.f_divergence, alpha=o.alpha, length_normalized=True
    ),
}

#: TRL's loss types that accept a non-default ``f_divergence_type`` (its own set).
_F_DIVERGENCE_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop",
                       "sft"}  # fmt: skip


class TRLPreferenceOutput(NamedTuple):
    """``(loss, metrics)``: the peer's loss and its metrics under the peer's names.

    ``metrics``: detached 0-d float32 tensors of this call's batch (TRL averages them over the
    processes before logging): ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (DPO);
    ``min_reward``, ``mean_reward``, ``max_reward``, ``accuracy``, ``margin`` (reward model).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass(frozen=True)
class TRLDPOLoss:
    """TRL's DPO loss for fixed ``DPOConfig`` options (built by :func:`trl_dpo_loss`)."""

    objective: PreferenceObjective
    beta: float
    ld_alpha: float | None
    use_weighting: bool

    @checks_environment
    def __call__(
        self,
        chosen_log_probs: torch.Tensor,
        rejected_log_probs: torch.Tensor,
        chosen_mask: torch.Tensor,
        rejected_mask: torch.Tensor,
        *,
        ref_chosen_log_probs: ArrayLike,
        ref_rejected_log_probs: ArrayLike,
        chosen_log_sum_sq_probs: torch.Tensor | None = None,
        rejected_log_sum_sq_probs: torch.Tensor | None = None,
    ) -> TRLPreferenceOutput:
        r"""The loss ``DPOTrainer._compute_loss`` returns for these tensors, and its metrics.

        Args:
            chosen_log_probs: ``(B, T)`` TRL's ``per_token_logps`` of the chosen half (with
                gradient), or packed as :func:`rlobjectives.preference_loss` takes them.
            rejected_log_probs: the rejected half.
            chosen_mask: the chosen half of TRL's ``shift_completion_mask``.
            rejected_mask: the rejected half.
            ref_chosen_log_probs: the reference's per-token log-probabilities (TRL's reference
                model) or the per-sequence sums (TRL's ``precompute_ref_log_probs``: already
                LD-weighted).
            ref_rejected_log_probs: the same for the rejected half.
            chosen_log_sum_sq_probs: TRL's ``log_sum_sq_probs`` of the chosen half (required
                with ``use_weighting``: :math:`\log\sum_v \pi_v^2` per token).
            rejected_log_sum_sq_probs: the same for the rejected half.

        Returns:
            :class:`TRLPreferenceOutput` ``(loss, metrics)``.

        Raises:
            ValueError: ``use_weighting`` without the ``log_sum_sq_probs``; as
                :func:`rlobjectives.preference_loss`.
        """
        if self.use_weighting and (
            chosen_log_sum_sq_probs is None or rejected_log_sum_sq_probs is None
        ):
            raise ValueError(
                "use_weighting=True needs chosen_log_sum_sq_probs and rejected_log_sum_sq_probs "
                "(TRL's log_sum_sq_probs, log sum_v pi_v^2 per token), got None"
            )
        uses_reference = self.objective.needs_reference
        weighted = self.use_weighting
        out = preference_loss(
            chosen_log_probs, rejected_log_probs, chosen_mask, rejected_mask,
            ref_chosen_log_probs=ref_chosen_log_probs if uses_reference else None,
            ref_rejected_log_probs=ref_rejected_log_probs if uses_reference else None,
            objective=self.objective, ld_alpha=self.ld_alpha,
            chosen_log_sum_sq_probs=chosen_log_sum_sq_probs if weighted else None,
            rejected_log_sum_sq_probs=rejected_log_sum_sq_probs if weighted else None,
        )  # fmt: skip
        with torch.no_grad():  # TRL logs beta times the log-ratios, whatever the loss types
            logged = preference_loss(
                chosen_log_probs.detach(), rejected_log_probs.detach(), chosen_mask,
                rejected_mask, ref_chosen_log_probs=ref_chosen_log_probs,
                ref_rejected_log_probs=ref_rejected_log_probs, objective=DPO(beta=self.beta),
                ld_alpha=self.ld_alpha,
            )  # fmt: skip
        metrics = {
            "rewards/chosen": logged.chosen_rewards.mean(),
            "rewards/rejected": logged.rejected_rewards.mean(),
            "rewards/accuracies": logged.accuracy.mean(),
            "rewards/margins": logged.margins.mean(),
            "logps/chosen": logged.chosen_log_probs.mean(),
            "logps/rejected": logged.rejected_log_probs.mean(),
        }
        return TRLPreferenceOutput(out.loss, {k: v.float() for k, v in metrics.items()})


def _loss_types(loss_type: object) -> list[str]:
    names = [loss_type] if isinstance(loss_type, str) else loss_type
    if not isinstance(names, Sequence) or not names:
        raise ValueError(
            f"loss_type must be a loss type or a non-empty list of them, got {names!r}"
        )
    for name in names:
        validate_choice(name, "loss_type", tuple(TRL_DPO_LOSS_TYPES))
    return [str(name) for name in names]


@checks_environment
def trl_dpo_loss(
    *,
    loss_type: str | Sequence[str] = ("sigmoid",),
    loss_weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    ld_alpha: float | None = None,
    use_weighting: bool = False,
    discopop_tau: float = 0.05,
) -> TRLDPOLoss:
    r"""TRL's DPO loss (``DPOTrainer._compute_loss``, TRL 1.16) for these ``DPOConfig`` options.

    Returns a callable ``loss_fn(chosen_log_probs, rejected_log_probs, chosen_mask,
    rejected_mask, *, ref_chosen_log_probs, ref_rejected_log_probs, chosen_log_sum_sq_probs=None,
    rejected_log_sum_sq_probs=None) -> (loss, metrics)`` equal to TRL's, value and gradient:
    :math:`\sum_k w_k \frac1B\sum_i L^{(k)}_i` with the rows of :data:`TRL_DPO_LOSS_TYPES`
    (``preference_loss`` of their weighted combination), ``ld_alpha`` as LD-DPO's token
    weights, ``use_weighting`` as WPO's pair weights (from TRL's ``log_sum_sq_probs``).

    Args:
        loss_type: one of ``sigmoid``, ``hinge``, ``ipo``, ``exo_pair``, ``nca_pair``,
            ``robust``, ``bco_pair``, ``sppo_hard``, ``aot``, ``aot_unpaired``, ``apo_zero``,
            ``apo_down``, ``discopop``, ``sft``, ``sigmoid_norm``, or a list of them.
        loss_weights: one weight per loss type (None: 1 each).
        beta: :math:`\beta > 0`.
        label_smoothing: ``robust``'s flip rate, ``exo_pair``'s epsilon, ``aot``'s smoothing.
        f_divergence_type: ``reverse_kl``, ``forward_kl``, ``js_divergence``,
            ``alpha_divergence``.
        f_alpha_divergence_coef: the alpha of ``alpha_divergence``.
        ld_alpha: LD-DPO's alpha in ``[0, 1]``, or None.
        use_weighting: WPO's weights (needs the ``log_sum_sq_probs`` at each call).
        discopop_tau: DiscoPOP's temperature.

    Returns:
        A :class:`TRLDPOLoss` (callable, immutable).

    Raises:
        ValueError: naming the option, as TRL refuses it: ``loss_weights`` of another length
            than ``loss_type``; a non-default ``f_divergence_type`` with a loss type outside
            TRL's f-divergence set; ``exo_pair`` with ``label_smoothing = 0``; ``use_weighting``
            with ``aot`` / ``aot_unpaired`` (TRL: those losses sort the samples, which would
            misalign the pair weights) or with ``sft`` (TRL 1.16 fails there with a
            ``RuntimeError``: it scales the expanded SFT loss in place); and where the library's
            objects are stricter than TRL's warning: ``robust`` / ``aot`` with
            ``label_smoothing`` outside ``[0, 0.5)``.
        TypeError: a non-number option.

    Examples:
        >>> import torch
        >>> loss_fn = trl_dpo_loss(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
        >>> lp = torch.tensor([[-1.0, -2.0]])
        >>> loss_fn(lp, lp, torch.ones(1, 2), torch.ones(1, 2), ref_chosen_log_probs=lp,
        ...         ref_rejected_log_probs=lp).loss  # log 2 + 0.5 * 1.5
        tensor(1.4431)
    """
    names = _loss_types(loss_type)
    weights = [1.0] * len(names) if loss_weights is None else list(loss_weights)
    if len(weights) != len(names):
        raise ValueError(
            "loss_weights must have the same length as loss_type when combining multiple losses "
            f"(TRL's DPOConfig). Got {len(weights)} weights for {len(names)} loss types."
        )
    weights = [preset_number(w, "loss_weights", minimum=None) for w in weights]
    validate_choice(
        f_divergence_type, "f_divergence_type",
        ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"),
    )  # fmt: skip
    if f_divergence_type != "reverse_kl" and not set(names) <= _F_DIVERGENCE_TYPES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} is only supported for the loss types "
            f"{sorted(_F_DIVERGENCE_TYPES)} (TRL: the f-DPO reparameterization leaves a "
            "beta log Z(x) term that only cancels in the chosen-rejected reward difference); "
            f"got {names}"
        )
    smoothing = preset_number(label_smoothing, "label_smoothing", minimum=None)
    if "exo_pair" in names and smoothing == 0.0:
        raise ValueError(
            "label_smoothing must be greater than 0.0 when using 'exo_pair' loss (TRL). The EXO "
            "paper recommends a value of 1e-3."
        )
    flag = preset_flag(use_weighting, "use_weighting")
    if flag and {"aot", "aot_unpaired"} & set(names):
        raise ValueError(
            "use_weighting=True (WPO-style weighting) is not implemented for 'aot' or "
            "'aot_unpaired' (TRL): those losses sort samples, which would misalign per-pair "
            "weights"
        )
    if flag and "sft" in names:
        raise ValueError(
            "use_weighting=True with loss_type 'sft': TRL 1.16 fails there (a RuntimeError: it "
            "scales the SFT loss, expanded to one value per pair, in place)"
        )
    options = _Options(
        preset_number(beta, "beta", strict=True), smoothing, f_divergence_type,
        preset_number(f_alpha_divergence_coef, "f_alpha_divergence_coef", minimum=None),
        preset_number(discopop_tau, "discopop_tau", strict=True),
    )  # fmt: skip
    alpha = None if ld_alpha is None else preset_number(ld_alpha, "ld_alpha")
    if alpha is not None and alpha > 1.0:
        raise ValueError(f"ld_alpha must be in [0.0, 1.0] (TRL's DPOConfig), got {alpha}")
    objective: PreferenceObjective | None = None
    for name, weight in zip(names, weights, strict=True):
        try:
            term = weight * TRL_DPO_LOSS_TYPES[name](options)
        except ValueError as error:
            raise ValueError(
                f"label_smoothing={smoothing} with loss_type {name!r}: {error}"
            ) from None
        objective = term if objective is None else objective + term
    assert objective is not None
    return TRLDPOLoss(objective, options.beta, alpha, flag)


@dataclass(frozen=True)
class TRLRewardLoss:
    """TRL's reward-model loss for a ``RewardConfig`` (built by :func:`trl_reward_loss`)."""

    center_rewards_coefficient: float | None

    @checks_environment
    def __call__(
        self,
        rewards_chosen: torch.Tensor,
        rewards_rejected: torch.Tensor,
        margin: torch.Tensor | None = None,
    ) -> TRLPreferenceOutput:
        """``RewardTrainer.compute_loss``'s loss and metrics for these scores.

        Args:
            rewards_chosen: ``(B,)`` or ``(B, 1)`` scores of the chosen responses.
            rewards_rejected: the rejected responses' scores.
            margin: the dataset's ``margin`` column, or None.

        Returns:
            :class:`TRLPreferenceOutput` ``(loss, metrics)``.
        """
        coefficient = self.center_rewards_coefficient or 0.0
        out = reward_model_loss(
            rewards_chosen, rewards_rejected, margin=margin, center_coefficient=coefficient
        )
        both = torch.cat([rewards_chosen.reshape(-1), rewards_rejected.reshape(-1)]).detach()
        metrics = {
            "min_reward": both.min(),
            "mean_reward": both.mean(),
            "max_reward": both.max(),
            "accuracy": out.accuracy.mean(),
            "margin": out.margins.mean(),
        }
        return TRLPreferenceOutput(out.loss, {k: v.float() for k, v in metrics.items()})


@checks_environment
def trl_reward_loss(*, center_rewards_coefficient: float | None = None) -> TRLRewardLoss:
    r"""TRL's ``RewardTrainer`` loss (TRL 1.16): :math:`-\log\sigma(r_c - r_r - m)`, centred.

    The mean over the pairs of ``-logsigmoid(rewards_chosen - rewards_rejected - margin)`` plus
    ``center_rewards_coefficient * mean((rewards_chosen + rewards_rejected) ** 2)``:
    :func:`rlobjectives.reward_model_loss` (``"bradley_terry"``). Its metrics are TRL's
    ``min_reward``, ``mean_reward``, ``max_reward`` (over both halves), ``accuracy`` and
    ``margin``.

    Args:
        center_rewards_coefficient: TRL's ``RewardConfig.center_rewards_coefficient`` (None: 0).

    Returns:
        A :class:`TRLRewardLoss` (callable ``(rewards_chosen, rewards_rejected, margin=None)``).

    Raises:
        ValueError: a negative or non-finite coefficient.

    Examples:
        >>> import torch
        >>> trl_reward_loss()(torch.tensor([0.0]), torch.tensor([0.0])).loss
        tensor(0.6931)
    """
    coefficient = center_rewards_coefficient
    if coefficient is not None:
        coefficient = preset_number(coefficient, "center_rewards_coefficient")
    return TRLRewardLoss(coefficient)


@dataclass(frozen=True)
class OpenRLHFDPOLoss:
    """OpenRLHF's ``DPOLoss(beta, label_smoothing, ipo)`` (built by :func:`openrlhf_dpo_loss`)."""

    objective: PreferenceObjective

    @checks_environment
    def __call__(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        reference_chosen_logps: torch.Tensor,
        reference_rejected_logps: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""``(loss, chosen_rewards, rejected_rewards)`` of ``DPOLoss.forward``.

        Args:
            policy_chosen_logps: ``(B,)`` the summed log-probabilities of the chosen responses.
            policy_rejected_logps: ``(B,)`` of the rejected ones.
            reference_chosen_logps: ``(B,)`` the reference's.
            reference_rejected_logps: ``(B,)``.

        Returns:
            The mean loss and the detached :math:`\beta x` rewards, as OpenRLHF.
        """
        ones = torch.ones(policy_chosen_logps.shape[0], 1, dtype=torch.bool)
        ones = ones.to(policy_chosen_logps.device)
        out = preference_loss(
            policy_chosen_logps.reshape(-1, 1), policy_rejected_logps.reshape(-1, 1), ones, ones,
            ref_chosen_log_probs=reference_chosen_logps,
            ref_rejected_log_probs=reference_rejected_logps, objective=self.objective,
        )  # fmt: skip
        return out.loss, out.chosen_rewards, out.rejected_rewards


@checks_environment
def openrlhf_dpo_loss(
    *, beta: float, label_smoothing: float = 0.0, ipo: bool = False
) -> OpenRLHFDPOLoss:
    r"""OpenRLHF 0.11.2's ``DPOLoss``: cDPO on summed log-probabilities, or IPO on raw sums.

    ``DPO(beta, label_smoothing)`` (conservative DPO), or with ``ipo=True``
    ``IPO(beta, length_normalized=False)`` (OpenRLHF ignores ``label_smoothing`` there), on
    per-sequence sums (OpenRLHF's trainer sums each response's log-probabilities first), mean
    over the pairs.

    Args:
        beta: :math:`\beta > 0` (``--beta``).
        label_smoothing: cDPO's :math:`\epsilon \in [0, 0.5)` (``--label_smoothing``).
        ipo: IPO's squared loss (``--ipo``).

    Returns:
        An :class:`OpenRLHFDPOLoss` (callable as ``DPOLoss.forward``).

    Raises:
        ValueError: ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5)``.

    Examples:
        >>> import torch
        >>> zero = torch.zeros(2)
        >>> openrlhf_dpo_loss(beta=0.1)(zero, zero, zero, zero)[0]
        tensor(0.6931)
    """
    beta_value = preset_number(beta, "beta", strict=True)
    smoothing = preset_number(label_smoothing, "label_smoothing", maximum=0.5)
    if preset_flag(ipo, "ipo"):
        return OpenRLHFDPOLoss(IPO(beta=beta_value, length_normalized=False))
    return OpenRLHFDPOLoss(DPO(beta=beta_value, label_smoothing=smoothing))


@dataclass(frozen=True)
class OpenRLHFPairwiseLoss:
    """OpenRLHF's ``PairWiseLoss`` / ``LogExpLoss`` (built by the two presets)."""

    kind: str

    @checks_environment
    def __call__(
        self,
        chosen_reward: torch.Tensor,
        reject_reward: torch.Tensor,
        margin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean pairwise loss, as the class's ``forward`` returns it.

        Args:
            chosen_reward: ``(B,)`` scores of the chosen responses.
            reject_reward: ``(B,)`` scores of the rejected responses.
            margin: ``(B,)`` margins (``PairWiseLoss``); ``LogExpLoss`` ignores it, as OpenRLHF.

        Returns:
            The scalar loss.
        """
        if self.kind == "bradley_terry":
            return reward_model_loss(chosen_reward, reject_reward, margin=margin).loss
        return reward_model_loss(chosen_reward, reject_reward, kind="log_exp").loss


@checks_environment
def openrlhf_pairwise_loss() -> OpenRLHFPairwiseLoss:
    r"""OpenRLHF 0.11.2's ``PairWiseLoss``: :math:`-\log\sigma(r_c - r_r - m)`, mean.

    Returns:
        An :class:`OpenRLHFPairwiseLoss` (``(chosen_reward, reject_reward, margin=None)``).

    Examples:
        >>> import torch
        >>> openrlhf_pairwise_loss()(torch.tensor([1.0]), torch.tensor([1.0]))
        tensor(0.6931)
    """
    return OpenRLHFPairwiseLoss("bradley_terry")


@checks_environment
def openrlhf_log_exp_loss() -> OpenRLHFPairwiseLoss:
    r"""OpenRLHF 0.11.2's ``LogExpLoss``: :math:`\log(1 + e^{r_r - r_c})`, mean (no margin).

    OpenRLHF accepts a ``margin`` argument and does not use it; so does this preset
    (:func:`rlobjectives.reward_model_loss` with ``kind="log_exp"`` would use it). Evaluated as
    a softplus: equal to OpenRLHF's ``log(1 + exp(x))`` wherever that is finite (it overflows to
    ``inf`` for :math:`r_r - r_c > 88` in float32).

    Returns:
        An :class:`OpenRLHFPairwiseLoss` (``(chosen_reward, reject_reward, margin=None)``).

    Examples:
        >>> import torch
        >>> openrlhf_log_exp_loss()(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([5.0]))
        tensor(0.6931)
    """
    return OpenRLHFPairwiseLoss("log_exp")
