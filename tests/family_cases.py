"""Option rows of the policy-loss family (issue 13), shared by the option tables of the tests.

Each row is a set of keyword arguments of ``policy_loss`` / ``fused_policy_loss_from_hidden``
chosen so that the branch it names is taken on the random batches of the tests (ratios spread
around the clip band, some clipped, some not).
"""

from __future__ import annotations

from typing import Any

import reference
from rlobjectives import (
    CISPO,
    DPPO,
    DRO,
    FIPO,
    GMPO,
    M2PO,
    SAPO,
    VESPO,
    Clip,
    ClipCov,
    KLCov,
    ProbabilityBand,
)

# TRL's delta, CISPO, SAPO, GMPO, VESPO.
FAMILY_OPTION_SETS: list[dict[str, Any]] = [
    {"surrogate": Clip(delta=1.1)},  # delta below 1 + eps_high: caps A > 0 tokens too
    {"surrogate": Clip(low=0.2, high=0.28, delta=1.5)},  # TRL's two-sided clip above the band
    {"surrogate": Clip(low=0.1, dual=1.3, delta=1.6)},  # delta and dual clip together
    {"surrogate": Clip(low=None, delta=1.3)},
    {"surrogate": "cispo"},  # verl: the band [0.8, 1.2]
    {"surrogate": CISPO(cap=1.3)},  # TRL: the absolute cap
    {"surrogate": CISPO(low=None), "log_ratio_bound": 0.3},
    {"surrogate": CISPO(cap=1.1), "ratio_level": "sequence"},
    {"surrogate": "sapo"},
    {"surrogate": SAPO(temperature_pos=5.0, temperature_neg=8.0), "log_ratio_bound": 0.3},
    {"surrogate": "sapo", "ratio_level": "sequence"},
    {"surrogate": "gmpo"},
    {"surrogate": GMPO(low=0.1, high=0.3), "log_ratio_bound": 0.5},
    {"surrogate": GMPO(low=None)},
    {"surrogate": "vespo"},
    {
        "surrogate": VESPO(k_pos=1.0, lambda_pos=0.5, k_neg=0.0, lambda_neg=4.0),
        "log_ratio_bound": None,
    },
    # Issue 24: DPPO (both divergences, verl's capped value form and prime-rl's r A), DRO,
    # M2PO (unclipped and with AReaL's band), KL-Cov (top-k) and Clip-Cov (ratio 1: every
    # candidate is detached, whatever the draw; the random draw has its own tests).
    {"surrogate": DPPO()},
    {"surrogate": "dppo"},
    {"surrogate": DPPO("kl")},
    {"surrogate": DPPO("tv", low=0.1, high=0.3, ratio_cap=1.3)},  # the cap binds often
    {"surrogate": DPPO("kl", low=0.02, high=0.08, ratio_cap=None), "log_ratio_bound": 0.3},
    {"surrogate": DRO(beta=0.5)},
    {"surrogate": DRO(beta=2.0), "log_ratio_bound": None},
    {"surrogate": M2PO(threshold=0.12)},
    {"surrogate": M2PO(threshold=0.08, low=0.2, high=0.28)},
    {"surrogate": KLCov(ratio=0.3, coef=1.0)},
    {"surrogate": KLCov(ratio=0.05, coef=0.5), "log_ratio_bound": 0.3},
    {"surrogate": ClipCov(ratio=1.0, cov_lb=0.0, cov_ub=1.0)},
    # Issue 35: the probability band (prime-rl ipo; the band binds on some tokens of the batches)
    {"surrogate": ProbabilityBand()},
    {"surrogate": ProbabilityBand(tau=0.05, kappa=0.5), "log_ratio_bound": 0.3},
    {"surrogate": ProbabilityBand(tau=0.2, kappa=0.0), "log_ratio_bound": None},
    # FIPO (ms-swift): the clipped surrogate times the influence of the future log-ratio
    {"surrogate": FIPO(gamma=0.9, cap=0.2)},
    {
        "surrogate": FIPO(
            gamma=0.6,
            cap=0.1,
            low=0.1,
            high=0.3,
            delta=1.3,
            cap_high_only=False,
            safety_threshold=1.1,
        ),
        "log_ratio_bound": 0.5,
    },  # fmt: skip
]
# The token-local ones (fused path and fused hidden-state path).
TOKEN_LOCAL_FAMILY = [
    row
    for row in FAMILY_OPTION_SETS
    if reference.surrogate_name(row.get("surrogate", "clip"))
    in ("clip", "cispo", "sapo", "dppo", "dro", "probability_band")
    and row.get("ratio_level", "token") == "token"
]
