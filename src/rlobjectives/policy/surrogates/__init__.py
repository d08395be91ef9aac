"""The surrogate objects of :func:`rlobjectives.policy_loss`, one module each.

Each module holds one surrogate's object (a frozen dataclass that validates its fields), its
formula (the readable autograd specification), its fused stage (value and closed-form
derivative, for the token-local ones) and its kernel setup; :mod:`.base` holds the contracts
and :mod:`.selection` the batch-level token selections of M2PO, Clip-Cov and KL-Cov.
:data:`SURROGATES` maps the strings ``policy_loss(surrogate=...)`` accepts to the objects.
Adding a surrogate: a module here, a row of :data:`SURROGATES`, an export from
``rlobjectives`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

from .base import SurrogateObjective
from .cispo import CISPO
from .clip import Clip
from .cov import ClipCov, KLCov
from .dppo import DPPO
from .dro import DRO
from .gmpo import GMPO
from .m2po import M2PO
from .sapo import SAPO
from .vespo import VESPO

__all__ = [
    "CISPO",
    "DPPO",
    "DRO",
    "GMPO",
    "M2PO",
    "SAPO",
    "SURROGATES",
    "VESPO",
    "Clip",
    "ClipCov",
    "KLCov",
    "SurrogateObjective",
]

#: The surrogate each string of ``policy_loss(surrogate=...)`` means (with its defaults; DRO
#: has none: its name asks for ``DRO(beta=...)``).
SURROGATES: dict[str, type[SurrogateObjective]] = {
    cls.name: cls for cls in (Clip, CISPO, SAPO, GMPO, VESPO, DPPO, DRO, M2PO, ClipCov, KLCov)
}
