"""The peers' spellings the public functions recognise, and the arguments they mean here.

A peer's reduction name with exactly the library's meaning is an alias
(:data:`REDUCTION_ALIASES`, rewritten by
:func:`~rlobjectives._core.validation.canonical_reduction`); a peer's reduction or KL
estimator name that needs more than a name is a "did you mean" ``ValueError`` with the exact
arguments (:data:`REDUCTION_HINTS`, :data:`ESTIMATOR_HINTS`, read by ``canonical_reduction`` and
:func:`~rlobjectives._core.validation.check_estimator_spelling`); a flat surrogate keyword is a
``TypeError`` naming the object field that holds it (:data:`SURROGATE_FIELDS`,
:func:`check_surrogate_keywords`, run by
:func:`~rlobjectives._core.validation.checks_environment` when a function with a ``surrogate``
parameter is called with keywords). Tables and that one check only: a call without keywords runs
nothing of this module.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ESTIMATOR_HINTS",
    "PRESET_TRL",
    "PRESET_VERL",
    "REDUCTION_ALIASES",
    "REDUCTION_HINTS",
    "SURROGATE_FIELDS",
    "check_surrogate_keywords",
]


#: Flat surrogate keywords (an option spelt as a keyword of the call) -> the ``(object, field)``
#: that holds the option.
#: ``clip_low`` / ``clip_high`` are the band of the named surrogate (``Clip`` unless ``"cispo"``
#: or ``"gmpo"``).
SURROGATE_FIELDS: dict[str, tuple[str | None, str]] = {
    "clip_low": (None, "low"),
    "clip_high": (None, "high"),
    "dual_clip": ("Clip", "dual"),
    "delta": ("Clip", "delta"),
    "cispo_cap": ("CISPO", "cap"),
    "sapo_temperature_pos": ("SAPO", "temperature_pos"),
    "sapo_temperature_neg": ("SAPO", "temperature_neg"),
    "vespo_k_pos": ("VESPO", "k_pos"),
    "vespo_lambda_pos": ("VESPO", "lambda_pos"),
    "vespo_k_neg": ("VESPO", "k_neg"),
    "vespo_lambda_neg": ("VESPO", "lambda_neg"),
}
_BANDS = {"cispo": "CISPO", "gmpo": "GMPO"}


def check_surrogate_keywords(
    function: str, parameters: frozenset[str], kwargs: dict[str, Any]
) -> None:
    """Raise a ``TypeError`` with the new spelling for a flat surrogate keyword.

    ``parameters``: the keywords ``function`` takes (with a ``surrogate`` parameter). A keyword
    it does not take that is a surrogate's field (:data:`SURROGATE_FIELDS`) names the object
    that holds it; any other unknown keyword is left to Python's own error.

    Raises:
        TypeError: ``policy_loss(..., clip_low=0.2)`` -> ``surrogate=Clip(low=0.2)``, ...
    """
    for name, value in kwargs.items():
        if name in parameters or name not in SURROGATE_FIELDS:
            continue
        owner, field = SURROGATE_FIELDS[name]
        surrogate = kwargs.get("surrogate")
        if owner is None:
            owner = _BANDS.get(surrogate, "Clip") if isinstance(surrogate, str) else "Clip"
        raise TypeError(
            f"{function}() got an unexpected keyword argument {name!r}: a surrogate's options "
            f"are the fields of its object; did you mean surrogate={owner}({field}={value!r})?"
        )


#: Peer names with exactly the library's meaning (verl ``loss_agg_mode``): local counts by
#: default, the global count as ``normalizer`` (verl's ``batch_num_tokens`` /
#: ``global_batch_size`` divided by ``dp_size``).
REDUCTION_ALIASES: dict[str, str] = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
}


PRESET_TRL = "or rlobjectives.presets.trl_grpo_loss(loss_type={name!r}) for TRL's whole loss"


PRESET_VERL = "or rlobjectives.presets.verl_policy_loss() with loss_agg_mode={name!r}"


#: Peer names that need more than a reduction name -> the exact arguments.
REDUCTION_HINTS: dict[str, str] = {
    # verl loss_agg_mode
    "token-sum": "reduction='token_mean', normalizer=1 (times dp_size: verl multiplies by it)",
    "seq-mean-token-sum": (
        "reduction='sequence_sum_normalized', max_response_length=1, normalizer=S, with S the "
        "number of non-empty sequences (verl's local default; its engine passes "
        "global_batch_size / dp_size)"
    ),
    "seq-mean-token-sum-norm": (
        "reduction='sequence_sum_normalized', max_response_length=loss_scale_factor (verl's "
        "default: the padded T), normalizer=S, with S the number of non-empty sequences "
        "(verl's local default; its engine passes global_batch_size / dp_size)"
    ),
    # TRL loss_type (a loss type fixes the surrogate and the normaliser, not only a reduction)
    "grpo": "reduction='sequence_mean', normalizer=B * gradient_accumulation_steps (TRL counts "
    "empty rows)",
    "sapo": "surrogate='sapo', reduction='sequence_mean', normalizer=B * "
    "gradient_accumulation_steps",
    "bnpo": "reduction='token_mean', then divide by gradient_accumulation_steps",
    "dr_grpo": "reduction='sequence_sum_normalized', max_response_length=max_completion_length, "
    "normalizer=B * gradient_accumulation_steps",
    "dapo": "reduction='token_mean', normalizer=num_items_in_batch / num_processes * "
    "gradient_accumulation_steps / steps_per_generation",
    "cispo": "surrogate='cispo', cispo_cap=epsilon_high, reduction='token_mean' with dapo's "
    "normalizer",
    "vespo": "surrogate='vespo', reduction='token_mean' with dapo's normalizer",
    "luspo": "reduction='length_weighted', normalizer=B * gradient_accumulation_steps",
}


#: Peer KL estimator names -> the exact arguments (verl ``kl_loss_type`` / ``kl_penalty``).
ESTIMATOR_HINTS: dict[str, str] = {
    "kl": "estimator='k1'",
    "mse": "estimator='k2'",
    "low_var_kl": "estimator='k3', log_ratio_bound=20 (verl also clamps the estimate to "
    "[-10, 10]; the library does not)",
    "k1+": "estimator='k1', straight_through=True",
    "kl+": "estimator='k1', straight_through=True",
    "k2+": "estimator='k2' (its straight-through form is k2 itself)",
    "mse+": "estimator='k2' (its straight-through form is k2 itself)",
    "k3+": "estimator='k3', straight_through=True",
    "low_var_kl+": "estimator='k3', straight_through=True (verl also clamps the value to "
    "[-10, 10])",
    "abs+": "estimator='k2' (the straight-through gradient of any verl estimator is k2's)",
    "full": "full_vocab_kl_loss(logits, ref_logits, mask) (the exact KL over the vocabulary)",
}
