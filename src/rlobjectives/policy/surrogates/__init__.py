"""The surrogate objects of :func:`rlobjectives.policy_loss`, one module each.

Each module holds one surrogate's object (a frozen dataclass that validates its fields), its
formula (the readable autograd specification), its fused stage (value and closed-form
derivative, for the token-local ones) and its kernel setup; :mod:`.base` holds the contracts.
:data:`SURROGATES` maps the strings ``policy_loss(surrogate=...)`` accepts to the objects.
Adding a surrogate: a module here, a row of :data:`SURROGATES`, an export from
``rlobjectives`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

from .base import SurrogateObjective
from .cispo import CISPO
from .clip import Clip
from .gmpo import GMPO
from .sapo import SAPO
from .vespo import VESPO

__all__ = ["CISPO", "GMPO", "SAPO", "SURROGATES", "VESPO", "Clip", "SurrogateObjective"]

#: The surrogate each string of ``policy_loss(surrogate=...)`` means (with its defaults).
SURROGATES: dict[str, type[SurrogateObjective]] = {
    cls.name: cls for cls in (Clip, CISPO, SAPO, GMPO, VESPO)
}
