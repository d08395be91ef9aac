"""The peers' spellings of reductions and KL estimators: accepted aliases and "did you mean".

A name that means exactly what a library name means is accepted and rewritten to it
(:data:`REDUCTION_ALIASES`); a peer name whose meaning needs other arguments too is rejected
with the exact call that reproduces it (:data:`REDUCTION_HINTS`, :data:`ESTIMATOR_HINTS`).
The validators call :func:`canonical_reduction` / :func:`check_estimator_spelling` once, before
their own check, so a name that is already canonical never reaches these tables.
"""

from __future__ import annotations

__all__ = [
    "ESTIMATOR_HINTS",
    "REDUCTION_ALIASES",
    "REDUCTION_HINTS",
    "canonical_reduction",
    "check_estimator_spelling",
]

#: Peer names with exactly the library's meaning (verl ``loss_agg_mode``): local counts by
#: default, the global count as ``normalizer`` (verl's ``batch_num_tokens`` /
#: ``global_batch_size`` divided by ``dp_size``).
REDUCTION_ALIASES: dict[str, str] = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
}

_PRESET_TRL = "or rlobjectives.presets.trl_grpo_loss(loss_type={name!r}) for TRL's whole loss"
_PRESET_VERL = "or rlobjectives.presets.verl_policy_loss() with loss_agg_mode={name!r}"

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


def canonical_reduction(reduction: object) -> object:
    """``reduction`` with an accepted peer alias rewritten; a hinted peer name raises.

    Raises:
        ValueError: for a peer name of :data:`REDUCTION_HINTS`, with the exact arguments.
    """
    if not isinstance(reduction, str):
        return reduction
    if reduction in REDUCTION_HINTS:
        preset = _PRESET_TRL if "-" not in reduction else _PRESET_VERL
        raise ValueError(
            f"reduction={reduction!r} is a peer option, not a reduction name; did you mean "
            f"{REDUCTION_HINTS[reduction]}? ({preset.format(name=reduction)})"
        )
    return REDUCTION_ALIASES.get(reduction, reduction)


def check_estimator_spelling(
    estimator: object, known: tuple[str, ...], *, prefix: str = ""
) -> None:
    """Raise a "did you mean" ``ValueError`` for a peer KL estimator name not in ``known``.

    ``prefix`` names the keywords of the caller (``"kl_"`` for ``kl_estimator`` /
    ``kl_straight_through``).

    Raises:
        ValueError: for a name of :data:`ESTIMATOR_HINTS`, with the exact arguments.
    """
    if isinstance(estimator, str) and estimator not in known and estimator in ESTIMATOR_HINTS:
        hint = ESTIMATOR_HINTS[estimator].replace("estimator=", f"{prefix}estimator=")
        hint = hint.replace("straight_through=", f"{prefix}straight_through=")
        raise ValueError(
            f"{prefix}estimator={estimator!r} is verl's spelling; did you mean {hint}?"
        )
