"""The surrogate objects of :func:`rlobjectives.policy_loss`, one module each.

Each module holds one surrogate's object: a frozen dataclass that validates its fields and
whose one method is its formula (:mod:`.base` holds the contract, :class:`.base.Surrogate`);
:mod:`.selection` holds the batch-level token selections of M2PO, Clip-Cov and KL-Cov.
:data:`SURROGATES` maps the strings ``policy_loss(surrogate=...)`` accepts to the objects.
Adding a surrogate: a module here, a row of :data:`SURROGATES`, an export from
``rlobjectives`` (``docs/objectives/custom.md``; a user's own needs none of them).
"""

from __future__ import annotations

from .base import PolicyTokens, Surrogate, SurrogateTerms
from .cispo import CISPO
from .clip import Clip
from .cov import ClipCov, KLCov
from .dppo import DPPO
from .dro import DRO
from .fipo import FIPO
from .gmpo import GMPO
from .m2po import M2PO
from .probability_band import ProbabilityBand
from .real import REAL
from .sapo import SAPO
from .topr import TOPR
from .vespo import VESPO

__all__ = [
    "CISPO",
    "DPPO",
    "DRO",
    "FIPO",
    "GMPO",
    "M2PO",
    "REAL",
    "SAPO",
    "SURROGATES",
    "TOPR",
    "VESPO",
    "Clip",
    "ClipCov",
    "KLCov",
    "PolicyTokens",
    "ProbabilityBand",
    "Surrogate",
    "SurrogateTerms",
]

#: The surrogate each string of ``policy_loss(surrogate=...)`` means (with its defaults; DRO,
#: TOPR and FIPO have none: their names ask for the object, ``DRO(beta=...)``, ...).
SURROGATES: dict[str, type[Surrogate]] = {
    cls.name: cls
    for cls in (
        Clip, CISPO, SAPO, GMPO, VESPO, DPPO, DRO, M2PO, ClipCov, KLCov, ProbabilityBand,
        TOPR, REAL, FIPO,
    )
}  # fmt: skip
