"""``rlobjectives.integrations.trl.DPOTrainer`` against TRL 1.16's own ``DPOTrainer`` (issue 34).

A 1-layer Llama built from a config (no download), a word-level tokenizer built in memory and a
small preference dataset. For several ``DPOConfig`` loss settings (a single loss type, MPO's
weighted list, IPO with LD-DPO's ``ld_alpha``, WPO's ``use_weighting``, an f-divergence, AOT,
precomputed reference log-probabilities) TRL's trainer and ours train the same 2 optimizer
steps from the same weights and seed (gradient accumulation 2, SGD): the first step's
gradients and the parameters after 2 steps agree to float32 rounding, and so does every logged
metric, step by step.
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

from rlobjectives.integrations.trl import DPOTrainer  # noqa: E402

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
os.environ.update(HF_HUB_DISABLE_TELEMETRY="1", TRL_EXPERIMENTAL_SILENCE="1")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

WORDS = "a b c d e f g h i j k l m n o p".split()
STEPS = 2


def _tokenizer() -> Any:
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
        eos_token="[EOS]",
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def model_dir() -> Iterator[str]:
    """A tiny random Llama saved to disk (TRL builds the reference model from its path)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4 + len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        yield directory


def _dataset() -> Any:
    rows = {
        "prompt": ["a b c", "d e", "f g h i", "j k"] * 2,
        "chosen": [" d e", " f", " j k l", " l m n o"] * 2,
        "rejected": [" p", " o n m", " e", " a b"] * 2,
    }
    return datasets.Dataset.from_dict(rows)


class _FirstGradients(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.gradients: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            self.gradients = {n: p.grad.clone() for n, p in kwargs["model"].named_parameters()}


def _train(trainer_class: type, model_dir: str, options: dict[str, Any]) -> tuple[Any, ...]:
    transformers.set_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = _FirstGradients()
    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=0.5, optim="sgd", report_to="none", logging_steps=1, save_strategy="no",
        seed=0, disable_dropout=True, dataset_num_proc=None, **options,
    )  # fmt: skip
    trainer = trainer_class(
        model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer(),
        callbacks=[callback],
    )  # fmt: skip
    transformers.set_seed(0)
    trainer.train()
    changes = {n: p.detach() - initial[n] for n, p in trainer.model.named_parameters()}
    return trainer, callback.gradients, changes


CASES: dict[str, dict[str, Any]] = {
    "sigmoid": {"loss_type": ["sigmoid"], "beta": 0.5},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "ipo-ld": {"loss_type": ["ipo"], "beta": 0.3, "ld_alpha": 0.5},
    "wpo": {"loss_type": ["sigmoid", "nca_pair"], "use_weighting": True, "beta": 0.4},
    "f-divergence": {
        "loss_type": ["hinge", "robust"],
        "f_divergence_type": "js_divergence",
        "label_smoothing": 0.1,
        "beta": 0.3,
    },  # fmt: skip
    "aot-precomputed": {"loss_type": ["aot"], "precompute_ref_log_probs": True, "beta": 0.2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_trainer_matches_trl(case: str, model_dir: str) -> None:
    options = CASES[case]
    theirs, their_gradients, their_changes = _train(trl.DPOTrainer, model_dir, options)
    ours, our_gradients, our_changes = _train(DPOTrainer, model_dir, options)
    assert set(our_gradients) == set(their_gradients) and their_gradients
    for name, gradient in their_gradients.items():
        torch.testing.assert_close(our_gradients[name], gradient, rtol=1e-4, atol=1e-7)
    moved = max(change.abs().max().item() for change in their_changes.values())
    assert moved > 1e-3, "the run must actually train"
    for name, change in their_changes.items():
        torch.testing.assert_close(our_changes[name], change, rtol=1e-4, atol=1e-6)
    logs = [h for h in theirs.state.log_history if "rewards/chosen" in h]
    our_logs = [h for h in ours.state.log_history if "rewards/chosen" in h]
    assert len(logs) == len(our_logs) == STEPS
    for log, our_log in zip(logs, our_logs, strict=True):
        assert set(our_log) == set(log)
        for name, value in log.items():
            if isinstance(value, float) and name not in ("epoch", "learning_rate"):
                assert our_log[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def test_refused_options_carry_trls_reason(model_dir: str) -> None:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    args = trl.DPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False,
                         report_to="none", loss_type=["sft"], use_weighting=True)  # fmt: skip
    with pytest.raises(ValueError, match="use_weighting=True with loss_type 'sft'"):
        DPOTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer())
