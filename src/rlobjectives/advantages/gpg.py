r"""GPG's corrected group advantage: the group-centred reward rescaled by the batch's signal.

:func:`gpg_advantages` (Group Policy Gradient, arXiv:2504.02546): the reward minus its group's
mean, multiplied by :math:`\alpha = B / \#\{i : r_i \ne 0\}` and divided by ``f_norm``, as
verl 0.9.1's ``compute_gpg_outcome_advantage`` computes it (``algorithm.adv_estimator="gpg"``).
"""

from __future__ import annotations

import torch

from .._core.validation import ArrayLike, Scalar, checks_environment, validate_scalar
from .groups import group_centered, grouped_rewards

__all__ = ["gpg_advantages"]


@checks_environment
def gpg_advantages(
    rewards: ArrayLike,
    group_size: int | None = None,
    *,
    group_ids: ArrayLike | None = None,
    f_norm: Scalar = 1.0,
) -> torch.Tensor:
    r"""GPG advantages: :math:`\alpha (r_i - \mu_g) / F_{norm}`, :math:`\alpha = B / \#\{r \ne 0\}`.

    .. math::

        A_i = \frac{\alpha\,(r_i - \mu_{g(i)})}{F_{norm}}, \qquad
        \alpha = \frac{B}{\max(1,\ \#\{j : r_j \ne 0\})},

    with :math:`\mu_g` the mean reward of the group of sequence :math:`i` and :math:`B` the
    sequences of the batch. :math:`\alpha` rescales the gradient of a batch in which few
    responses carry signal (GPG's gradient-estimation correction). It counts the **non-zero
    rewards**, as verl does; the paper counts instead the samples outside groups of identical
    rewards (which carry no gradient): the two differ, e.g. on a group whose rewards are all 1
    (signal for verl, none for the paper). A group of one sequence, or of identical
    rewards, gives exactly 0 (verl returns the group-of-one's raw :math:`\alpha r/F_{norm}`:
    its :math:`\mu = 0` convention, reproduced by ``presets.verl_gpg_advantages``). Call it on
    the whole batch (:math:`\alpha` reads every reward of it).

    Peer: verl 0.9.1 ``algorithm.adv_estimator="gpg"`` (``compute_gpg_outcome_advantage``,
    ``f_norm`` from the algorithm config, default 1; :math:`\alpha` formed in float32 there;
    with ``policy_loss.loss_mode="gpg"``: ``-A·ℓ``, see ``docs/objectives/advantages.md``).

    Args:
        rewards: ``(B,)`` outcome rewards, the groups' responses contiguous with ``group_size``.
        group_size: :math:`G`, the responses per prompt (``B`` divisible by it), or None with
            ``group_ids``.
        group_ids: ``(B,)`` one group label per sequence (verl's ``index``: ints or strings).
        f_norm: :math:`F_{norm} > 0` (a number or 0-d tensor).

    Returns:
        ``(B,)`` advantages, float32 (float64 for float64 rewards), differentiable w.r.t.
        ``rewards`` (:math:`\alpha` a constant of them).

    Raises:
        ValueError: ``rewards`` not 1-D, neither or both of ``group_size`` / ``group_ids``,
            ``B`` not divisible by ``group_size``, labels not one per reward, ``f_norm`` not
            positive and finite.
        TypeError: non-numeric inputs or labels, a non-int ``group_size``.

    References:
        Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
        Reasoning", arXiv:2504.02546 (the corrected advantage and its :math:`\alpha`).

    Examples:
        >>> gpg_advantages([1.0, 0.0, 0.0, 0.0], 2)  # alpha = 4 / 1; group means 0.5, 0
        tensor([ 2., -2.,  0.,  0.])

    .. versionadded:: 0.4.0
    """
    values, groups = grouped_rewards(rewards, group_size, group_ids)
    norm = validate_scalar(f_norm, "f_norm", minimum=0.0, strict=True)
    batch = values.shape[0]
    nonzero = (values != 0).sum().to(values.dtype).clamp(min=1)  # #{r != 0}, at least 1
    alpha = batch / nonzero  # () a constant of the rewards (a count)
    return alpha * group_centered(values, groups) / norm
