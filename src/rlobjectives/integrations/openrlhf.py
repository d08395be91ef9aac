r"""OpenRLHF: the preset built where OpenRLHF's actor builds its ``PolicyLoss``.

:func:`install_policy_loss` makes ``ActorPPOTrainer`` (``openrlhf/trainer/ray/ppo_actor.py``)
construct :func:`rlobjectives.presets.openrlhf_policy_loss` from the same CLI-derived keyword
arguments it passes to ``PolicyLoss`` (``clip_eps_low``, ``clip_eps_high``, ``dual_clip``,
``token_level_loss``, ``policy_loss_type``, ``is_correction_level``, ``_mode``, ``_gating``,
``_threshold``); ``training_step`` then calls the preset with ``forward``'s arguments and
unpacks its five results. The real class stays in ``openrlhf.models.loss``;
:func:`restore_policy_loss` puts it back.

OpenRLHF trains in Ray actors, so the replacement must happen in every worker process: give
it to Ray as the worker set-up hook, e.g. with ``ray job submit --runtime-env-json
'{"worker_process_setup_hook": "rlobjectives.integrations.openrlhf.install_policy_loss"}'``
or ``ray.init(runtime_env={"worker_process_setup_hook": "rlobjectives.integrations.openrlhf.
install_policy_loss"})`` before ``openrlhf.cli.train_ppo_ray`` runs (it reuses an initialised
Ray). Tested inside OpenRLHF 0.11.2's real ``ActorPPOTrainer.training_step``, with a plain
strategy and a real DeepSpeed engine (``tests/integrations/test_openrlhf_integration.py``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from ..presets import openrlhf_policy_loss

__all__ = ["install_policy_loss", "restore_policy_loss"]

#: The modules whose ``PolicyLoss`` name the actor resolves: the package it imports the name
#: from, and the actor module itself once it is imported.
_MODULES = ("openrlhf.models", "openrlhf.trainer.ray.ppo_actor")


def install_policy_loss(factory: Callable[..., Any] = openrlhf_policy_loss) -> None:
    """Make OpenRLHF's actor build ``factory(**PolicyLoss kwargs)`` instead of ``PolicyLoss``.

    Replaces the name ``PolicyLoss`` in ``openrlhf.models`` (``ppo_actor`` imports it from
    there) and, if it is already imported, in ``openrlhf.trainer.ray.ppo_actor``; the actor
    resolves the name when ``ActorPPOTrainer`` is constructed. Idempotent.

    Args:
        factory: a callable taking ``PolicyLoss``'s keyword arguments and returning a function
            with ``PolicyLoss.forward``'s signature and its five results; by default
            :func:`rlobjectives.presets.openrlhf_policy_loss`.

    Raises:
        ImportError: if OpenRLHF is not installed.
    """
    try:
        importlib.import_module("openrlhf.models")
    except ImportError as error:  # pragma: no cover - exercised only without OpenRLHF
        raise ImportError(
            "rlobjectives.integrations.openrlhf needs OpenRLHF (tested with 0.11.2)"
        ) from error
    for name in _MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module.PolicyLoss = factory  # type: ignore[attr-defined]


def restore_policy_loss() -> None:
    """Put OpenRLHF's own ``PolicyLoss`` (``openrlhf.models.loss.PolicyLoss``) back."""
    loss = sys.modules.get("openrlhf.models.loss")
    if loss is None:
        return
    for name in _MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module.PolicyLoss = loss.PolicyLoss  # type: ignore[attr-defined]
