r"""The LM head's logit transform of a Hugging Face model, read from its config as TRL reads it.

:func:`head_options` returns the keywords ``final_logit_softcapping`` and ``logit_scale`` of
:func:`rlobjectives.token_log_probs_from_hidden`,
:func:`rlobjectives.fused_policy_loss_from_hidden`, :func:`rlobjectives.token_log_probs` and the
distillation functions from hidden states, so that
their log-probabilities are the model's own (Gemma 2/3 cap the logits, Cohere scales them,
Granite and MiniCPM3 divide them)::

    options = head_options(model.config)
    out = fused_policy_loss_from_hidden(hidden, model.lm_head.weight, tokens, ..., **options)

It reads the config by duck typing (``get_text_config()``, then attributes): this module imports
no ``transformers``.
"""

from __future__ import annotations

import numbers

from .._core.validation import checks_environment, describe

__all__ = ["head_options"]


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"config.{name} must be a real number or None, got {describe(value)}")
    return float(value)


@checks_environment
def head_options(config: object) -> dict[str, float | None]:
    r"""``{"final_logit_softcapping": c, "logit_scale": s}`` of a model config, as TRL reads it.

    TRL 1.16's ``trl.trainer.utils.add_fused_lm_head`` (and the ``DistillationTrainer``) read,
    on ``config.get_text_config()`` (a vision-language model's text config):

    - ``final_logit_softcapping`` (Gemma 2, Gemma 3 when set, Muse Glimmer): :math:`c`, or None;
    - the scale :math:`s`, the first of: ``logit_scale`` (Cohere; None on models that do not
      scale, e.g. MPT, read as absent; a real 0.0 is kept), ``output_multiplier`` (Muse
      Glimmer), ``lm_head_multiplier`` (Falcon-H1), then ``logits_scaling``: :math:`1 /`
      ``logits_scaling`` (Granite, MiniCPM3 divide by it), or ``logits_scaling`` itself for
      ``model_type == "hyperclovax"`` (HyperCLOVA X multiplies by it); 1.0 when none is set.

    The functions then form :math:`c \tanh(s z / c) / \tau` (scale, then softcap, then
    temperature), TRL's ``_transform``.

    Args:
        config: a ``transformers.PretrainedConfig`` (anything with ``get_text_config()``).

    Returns:
        ``dict`` with ``final_logit_softcapping`` (a float or None) and ``logit_scale`` (a float).

    Raises:
        TypeError: ``config`` has no ``get_text_config()``, or a field is not a real number.

    References:
        TRL 1.16 ``trl/trainer/utils.py`` ``add_fused_lm_head`` and
        ``trl/trainer/distillation_trainer.py``; Gemma Team 2024, Gemma 2, arXiv:2408.00118
        Sec. 2 (logit soft-capping).

    Examples:
        >>> from types import SimpleNamespace
        >>> config = SimpleNamespace(final_logit_softcapping=30.0, model_type="gemma2")
        >>> config.get_text_config = lambda: config
        >>> head_options(config)
        {'final_logit_softcapping': 30.0, 'logit_scale': 1.0}

    .. versionadded:: 0.4.0
    """
    text = getattr(config, "get_text_config", None)
    if not callable(text):
        raise TypeError(
            "config must be a Hugging Face model config (with get_text_config()), got "
            f"{describe(config)}"
        )
    text_config = text()
    cap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    scaling = getattr(text_config, "logits_scaling", None)
    if scale is None and scaling is not None:
        value = _number(scaling, "logits_scaling")
        scale = value if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / value
    return {
        "final_logit_softcapping": None if cap is None else _number(cap, "final_logit_softcapping"),
        "logit_scale": 1.0 if scale is None else _number(scale, "logit_scale"),
    }
