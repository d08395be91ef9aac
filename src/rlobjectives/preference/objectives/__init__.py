"""The preference objects: one frozen dataclass per objective, each one formula."""

from .anchored import BCO, NCA, APODown, APOZero, SPPOHard
from .aot import AOT
from .base import Combination, PairQuantities, PreferenceObjective
from .margin import DPO, EXO, IPO, DiscoPOP, Hinge, RobustDPO
from .reference_free import CPO, ORPO, SFT, SimPO

__all__ = [
    "AOT",
    "BCO",
    "CPO",
    "DPO",
    "EXO",
    "IPO",
    "NCA",
    "ORPO",
    "SFT",
    "APODown",
    "APOZero",
    "Combination",
    "DiscoPOP",
    "Hinge",
    "PairQuantities",
    "PreferenceObjective",
    "RobustDPO",
    "SPPOHard",
    "SimPO",
]
