r"""The reward model's pairwise loss: :func:`reward_model_loss`."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_per_sequence,
    check_same_device,
    checks_environment,
    compute_dtype,
    validate_choice,
    validate_scalar,
)

__all__ = ["RewardModelLossOutput", "reward_model_loss"]

RewardLossKind = Literal["bradley_terry", "log_exp"]
_KINDS = ("bradley_terry", "log_exp")


class RewardModelLossOutput(NamedTuple):
    """Result of :func:`rlobjectives.reward_model_loss`.

    Attributes:
        loss: the scalar loss, in the chosen rewards' dtype.
        pair_losses: ``(B,)`` :math:`L_i`.
        margins: ``(B,)`` :math:`r_c - r_r`, detached (TRL logs their mean as ``margin``).
        accuracy: ``(B,)`` 1.0 where :math:`r_c > r_r` (TRL's ``accuracy``).
    """

    loss: torch.Tensor
    pair_losses: torch.Tensor
    margins: torch.Tensor
    accuracy: torch.Tensor


@checks_environment
def reward_model_loss(
    chosen_rewards: ArrayLike,
    rejected_rewards: ArrayLike,
    *,
    margin: ArrayLike | None = None,
    kind: RewardLossKind = "bradley_terry",
    center_coefficient: Scalar = 0.0,
    normalizer: Scalar | None = None,
) -> RewardModelLossOutput:
    r"""The pairwise (Bradley-Terry) loss of a reward model's scores.

    .. math::

        L_i = -\log\sigma(r_{c,i} - r_{r,i} - m_i) + \eta\,(r_{c,i} + r_{r,i})^2, \qquad
        \mathcal{L} = \frac{1}{D}\sum_i L_i,

    with the margin :math:`m_i` (0 without ``margin``), the centring coefficient :math:`\eta`
    (TRL's ``center_rewards_coefficient``: keeps the rewards centred on 0) and :math:`D` =
    ``normalizer`` (default B). ``kind="log_exp"`` writes the first term
    :math:`\log(1 + e^{r_{r,i} - r_{c,i} + m_i})`, Anthropic's form: the same number
    (evaluated as a softplus, finite where :math:`e^{x}` overflows), with the margin entering
    the same way. (OpenRLHF's ``LogExpLoss`` ignores a margin it is given; its preset does too.)
    Computed in float32 (float64 for float64 inputs).

    Args:
        chosen_rewards: ``(B,)`` or ``(B, 1)`` scores of the chosen responses, with gradient.
        rejected_rewards: the same shape, of the rejected responses.
        margin: optional ``(B,)`` / ``(B, 1)`` margins (TRL's dataset ``margin`` column).
        kind: ``"bradley_terry"`` or ``"log_exp"``.
        center_coefficient: :math:`\eta \ge 0`.
        normalizer: :math:`D`, the global pair count for exact micro-batches.

    Returns:
        :class:`RewardModelLossOutput` ``(loss, pair_losses, margins, accuracy)``.

    Raises:
        ValueError: shapes or devices that differ, an unknown ``kind``, a negative
            ``center_coefficient`` or non-positive ``normalizer``; each naming the argument.
        TypeError: non-numeric inputs.

    References:
        Bradley & Terry 1952; Ouyang et al. 2022, arXiv:2203.02155 Eq. 1; Bai et al. 2022,
        arXiv:2204.05862 (the log-exp form); Llama 2, Touvron et al. 2023, arXiv:2307.09288
        Eq. 2 (the margin); Eisenstein et al. 2023, arXiv:2312.09244 (centring). Peers: TRL
        ``RewardTrainer``; OpenRLHF ``PairWiseLoss``, ``LogExpLoss``.

    Examples:
        >>> import torch
        >>> reward_model_loss(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])).loss
        tensor(0.6931)

    .. versionadded:: 0.3.0
    """
    chosen = as_float_tensor(chosen_rewards, "chosen_rewards")
    if chosen.ndim not in (1, 2):
        raise ValueError(
            "chosen_rewards must have shape (B,) or (B, 1) (one score per pair), got shape "
            f"{tuple(chosen.shape)}"
        )
    batch = chosen.shape[0]
    chosen = as_per_sequence(chosen, "chosen_rewards", batch, "chosen_rewards")
    rejected = as_float_tensor(rejected_rewards, "rejected_rewards", chosen.device)
    rejected = as_per_sequence(rejected, "rejected_rewards", batch, "chosen_rewards")
    tensors = {"chosen_rewards": chosen, "rejected_rewards": rejected}
    margin_t = None
    if margin is not None:
        margin_t = as_float_tensor(margin, "margin", chosen.device)
        margin_t = as_per_sequence(margin_t, "margin", batch, "chosen_rewards").detach()
        tensors["margin"] = margin_t
    check_same_device(tensors)
    validate_choice(kind, "kind", _KINDS)
    eta = validate_scalar(center_coefficient, "center_coefficient")
    dtype = compute_dtype(*tensors.values())
    c, r = chosen.to(dtype), rejected.to(dtype)
    shift = (
        torch.zeros((), dtype=dtype, device=c.device) if margin_t is None else margin_t.to(dtype)
    )
    if kind == "bradley_terry":
        losses = -F.logsigmoid(c - r - shift)
    else:
        losses = F.softplus(r - c + shift)
    losses = losses + eta * (c + r) ** 2
    if normalizer is None:
        denominator = torch.as_tensor(float(max(batch, 1)), dtype=dtype, device=c.device)
    else:
        value = validate_scalar(normalizer, "normalizer", minimum=0.0, strict=True)
        denominator = torch.as_tensor(value, dtype=dtype, device=c.device)
    with torch.no_grad():
        margins = (c - r).detach()
        accuracy = (c > r).to(dtype)
    loss = (losses.sum() / denominator).to(chosen.dtype)
    return RewardModelLossOutput(loss, losses, margins, accuracy)
