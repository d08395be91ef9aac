r"""verl: the presets registered as verl policy losses (``loss_mode="rlo_<mode>"``).

Importing this module registers every mode of :func:`rlobjectives.presets.verl_policy_loss`
with verl's ``register_policy_loss`` under the name ``rlo_<mode>`` (``rlo_vanilla``,
``rlo_gspo``, ...), so one line of verl's config both loads it in every worker and selects a
loss::

    actor_rollout_ref.model.external_lib=rlobjectives.integrations.verl
    actor_rollout_ref.actor.policy_loss.loss_mode=rlo_vanilla

verl imports ``external_lib`` wherever it builds the model config, in the driver and in each
worker process (``import_external_libs``); the environment variable
``VERL_USE_EXTERNAL_MODULES=rlobjectives.integrations.verl`` does the same at ``import verl``.
The registered functions are the presets themselves: verl calls them with its own arguments
(``loss_agg_mode``, the actor ``config`` with ``global_batch_info``, ``rollout_is_weights``)
and receives the same ``pg_loss`` and the same metric keys as from its built-in mode (tested
inside verl 0.9.1's real training step, ``tests/integrations/test_verl_integration.py``).

:func:`register_policy_losses` registers under another prefix (or a subset of the modes).
"""

from __future__ import annotations

from collections.abc import Iterable

try:
    from verl.trainer.ppo.core_algos import register_policy_loss
except ImportError as error:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "rlobjectives.integrations.verl needs verl (tested with verl 0.9.1)"
    ) from error

from ..presets import VerlPolicyLoss, verl_policy_loss
from ..presets._verl import VERL_LOSS_MODES

__all__ = ["PREFIX", "register_policy_losses"]

#: The prefix of the names the import registers: ``rlo_vanilla``, ``rlo_gspo``, ...
PREFIX = "rlo_"


def register_policy_losses(
    prefix: str = PREFIX, modes: Iterable[str] | None = None
) -> dict[str, VerlPolicyLoss]:
    """Register ``verl_policy_loss(mode)`` with verl as ``prefix + mode`` for each mode.

    Args:
        prefix: the prefix of the registered names (non-empty, so that verl's own modes are
            never replaced).
        modes: the verl ``loss_mode`` names to register; None: every mode the preset covers.

    Returns:
        The registered name -> the preset registered under it.

    Raises:
        ValueError: an empty ``prefix``, or a mode the preset does not cover.
    """
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    registered: dict[str, VerlPolicyLoss] = {}
    for mode in VERL_LOSS_MODES if modes is None else modes:
        loss = verl_policy_loss(mode)
        register_policy_loss(prefix + mode)(loss)
        registered[prefix + mode] = loss
    return registered


register_policy_losses()
