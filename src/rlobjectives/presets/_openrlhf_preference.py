r"""OpenRLHF 0.11.2's preference and reward-model losses onto the preference calls.

:func:`openrlhf_dpo_loss` (``DPOLoss``: cDPO ``label_smoothing``, ``ipo`` on raw sums),
:func:`openrlhf_pairwise_loss` (``PairWiseLoss``) and :func:`openrlhf_log_exp_loss`
(``LogExpLoss``, which ignores its margin), with their return values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core.validation import checks_environment
from ..preference import DPO, IPO, PreferenceObjective, preference_loss
from ..preference.reward import reward_model_loss
from ._common import preset_flag, preset_number

__all__ = [
    "OpenRLHFDPOLoss",
    "OpenRLHFPairwiseLoss",
    "openrlhf_dpo_loss",
    "openrlhf_log_exp_loss",
    "openrlhf_pairwise_loss",
]


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
