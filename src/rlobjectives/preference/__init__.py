"""Preference and reward-model objectives: the DPO family, SimPO / ORPO / CPO, KTO, reward models.

Folders per concern: ``objectives/`` (one frozen dataclass per formula), ``inputs`` (the
validated call, the per-pair quantities, the reduction), ``loss`` (:func:`preference_loss`),
``kto`` (:func:`kto_loss`), ``reward`` (:func:`reward_model_loss`), ``hidden/`` (the same losses
from hidden states and the LM head, without the ``(N, V)`` logits).
"""

from .inputs import PreferenceLossOutput
from .loss import preference_loss
from .objectives import (
    AOT,
    BCO,
    CPO,
    DPO,
    EXO,
    IPO,
    NCA,
    ORPO,
    SFT,
    APODown,
    APOZero,
    Combination,
    DiscoPOP,
    Hinge,
    PreferenceObjective,
    RobustDPO,
    SimPO,
    SPPOHard,
)

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
    "PreferenceLossOutput",
    "PreferenceObjective",
    "RobustDPO",
    "SPPOHard",
    "SimPO",
    "preference_loss",
]
