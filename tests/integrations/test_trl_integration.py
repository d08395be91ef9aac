"""The TRL integration against the real TRL ``GRPOTrainer`` (skipped without the ``trl`` extra).

A 1-layer Llama built from a config (no download), a word-level tokenizer built in memory and a
toy reward. For each loss type (and the entropy mask, entropy bonus and off-policy mask
together), TRL's own trainer and ``rlobjectives.integrations.trl``'s run
the same 5 optimizer steps from the same weights and seed (gradient accumulation 2, two
iterations per generation so the ratios move off 1 and the clip binds): the losses of the first
step's micro-batches and its gradients agree to float32 rounding, and the parameters after 5
steps agree to tolerance (SGD, so a gradient difference is not amplified by Adam's
normalisation).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from rlobjectives.integrations.trl import GRPOTrainer  # noqa: E402

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
os.environ.update(HF_HUB_DISABLE_TELEMETRY="1", TRL_EXPERIMENTAL_SILENCE="1")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames

WORDS = "a b c d e f g h i j k l m n o p".split()
STEPS = 5


def _tokenizer() -> Any:
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the model is tiny, a second thread only adds contention."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def model_dir() -> Iterator[str]:
    """A tiny random Llama saved to disk (TRL reloads the reference model from its path)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4 + len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        yield directory


def _reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward: the number of vowels written (varies within a group, so A != 0)."""
    return [float(sum(c in "aeio" for c in completion.split())) for completion in completions]


class _Recorded:
    """Records each micro-batch's loss and inputs, and the gradients of the first step."""

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        loss = super()._compute_loss(model, inputs)  # type: ignore[misc]
        self.__dict__.setdefault("losses", []).append(loss.detach().clone())
        self.__dict__.setdefault("batches", []).append(
            (inputs["completion_ids"].clone(), inputs["advantages"].clone())
        )
        return loss  # type: ignore[no-any-return]


class _TRLTrainer(_Recorded, trl.GRPOTrainer):
    pass


class _OurTrainer(_Recorded, GRPOTrainer):
    pass


class _FirstGradients(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.gradients: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            model = kwargs["model"]
            self.gradients = {n: p.grad.clone() for n, p in model.named_parameters()}


def _train(
    trainer_class: type, model_dir: str, options: dict[str, Any]
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    transformers.set_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = _FirstGradients()
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=2,
        num_iterations=2, max_completion_length=5, max_steps=STEPS, learning_rate=0.3,
        optim="sgd", report_to="none", logging_steps=1, save_strategy="no", seed=0,
        disable_dropout=True, use_vllm=False, **options,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l"] * 4})
    trainer = trainer_class(
        model=model, reward_funcs=_reward, args=args, train_dataset=dataset,
        processing_class=_tokenizer(), callbacks=[callback],
    )  # fmt: skip
    transformers.set_seed(0)
    trainer.train()
    final = {n: p.detach() for n, p in trainer.model.named_parameters()}
    changes = {n: final[n] - initial[n] for n in initial}
    return trainer, callback.gradients, changes


CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
         "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip

#: case -> (GRPOConfig options, the metrics TRL logs besides loss and entropy, one that must
#: move off 0 in 5 steps (the ratios left 1: the clip, cap or mask binds), or None)
CASES: dict[str, tuple[dict[str, Any], tuple[str, ...], str | None]] = {
    "grpo": ({"loss_type": "grpo", "beta": 0.04}, CLIPS, "clip_ratio/region_mean"),  # + KL
    "bnpo": ({"loss_type": "bnpo", "epsilon_high": 0.28}, CLIPS, "clip_ratio/region_mean"),
    "dr_grpo": ({"loss_type": "dr_grpo"}, CLIPS, "clip_ratio/region_mean"),
    "dapo": ({"loss_type": "dapo", "delta": 1.5}, CLIPS, "clip_ratio/region_mean"),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, CLIPS, None),
    "cispo": (
        {"loss_type": "cispo", "epsilon_high": 1.05},
        ("cispo_clip_ratio",),
        "cispo_clip_ratio",
    ),  # fmt: skip
    "sapo": ({"loss_type": "sapo", "sapo_temperature_neg": 1.5}, (), None),
    "vespo": ({"loss_type": "vespo"}, ("vespo/phi_seq_mean",), None),
    # the entropy mask, the entropy bonus and the off-policy mask together
    "masks": (
        {
            "loss_type": "dapo",
            "top_entropy_quantile": 0.5,
            "entropy_coef": 0.05,
            "off_policy_mask_threshold": 0.0,
        },
        (*CLIPS, "policy_loss", "entropy_coef"),
        "clip_ratio/region_mean",
    ),  # fmt: skip
    # TRL's adaptive entropy controller (coefficient 0 until the first window is measured)
    "adaptive": (
        {
            "loss_type": "grpo",
            "use_adaptive_entropy": True,
            "entropy_coef": 0.05,
            "entropy_target": 10.0,
            "entropy_coef_delta": 0.02,
            "top_entropy_quantile": 0.5,
        },
        (*CLIPS, "policy_loss", "entropy_coef"),
        "entropy_coef",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_trl(case: str, model_dir: str) -> None:
    options, metric_names, moving = CASES[case]
    theirs, their_gradients, their_changes = _train(_TRLTrainer, model_dir, options)
    ours, our_gradients, our_changes = _train(_OurTrainer, model_dir, options)
    # The same batches (same weights and seed -> same generations and advantages) ...
    for (ids, advantages), (our_ids, our_advantages) in zip(
        theirs.batches, ours.batches, strict=True
    ):
        assert torch.equal(ids, our_ids)
        torch.testing.assert_close(our_advantages, advantages, rtol=0, atol=0)
    # ... the first step's micro-batch losses and gradients agree to float32 rounding ...
    torch.testing.assert_close(ours.losses[0], theirs.losses[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours.losses[1], theirs.losses[1], rtol=1e-5, atol=1e-7)
    assert set(our_gradients) == set(their_gradients) and their_gradients
    for name, gradient in their_gradients.items():
        torch.testing.assert_close(our_gradients[name], gradient, rtol=1e-4, atol=1e-7)
    # ... and 5 steps of training change the parameters identically (to tolerance).
    moved = max(change.abs().max().item() for change in their_changes.values())
    assert moved > 1e-3, "the run must actually train"
    for name, change in their_changes.items():
        torch.testing.assert_close(our_changes[name], change, rtol=1e-4, atol=1e-6)
    # The logged metrics agree step by step (the same names, the same values).
    names = ("loss", "entropy", *metric_names)
    logs = [h for h in theirs.state.log_history if "entropy" in h]
    our_logs = [h for h in ours.state.log_history if "entropy" in h]
    assert len(logs) == len(our_logs) == STEPS
    for log, our_log in zip(logs, our_logs, strict=True):
        assert set(our_log) == set(log)
        for name in names:
            assert our_log[name] == pytest.approx(log[name], rel=1e-4, abs=1e-6), name
    if moving is not None:
        assert max(log[moving] for log in logs) > 0


def test_rejected_option_is_named(model_dir: str) -> None:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, per_device_train_batch_size=2,
        num_generations=2, max_completion_length=3, report_to="none", loss_type="dapo",
        delta=0.9, use_vllm=False,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"prompt": ["a b", "c d"]})
    with pytest.raises(ValueError, match="delta must be > 1"):  # TRL accepts it silently
        GRPOTrainer(
            model=model, reward_funcs=_reward, args=args, train_dataset=dataset,
            processing_class=_tokenizer(),
        )  # fmt: skip
