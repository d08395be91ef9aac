"""The verl preset inside verl 0.9.1's real actor training step (skipped without verl).

What runs is verl's own code: a 2-layer Qwen2 built from a config (no download, no tokenizer),
loaded by verl's ``HFModelConfig`` and trained by ``TrainingWorker.train_mini_batch`` (the call
``ActorRolloutRefWorker.update_actor`` makes) on verl's ``FSDPEngineWithLMHead`` (FSDP2 over
gloo, world size 1, float32, SGD), with ``verl.workers.utils.losses.ppo_loss`` as the loss of
each micro-batch. The batch is built the way ``RayPPOTrainer._update_actor`` builds it
(``DataProto`` -> ``to_tensordict`` -> ``left_right_2_no_padding``, then
``global_batch_size = mini_batch_size``, epochs, seed): 8 sequences = two mini-batches of four
= two optimizer steps, each of two micro-batches of two.

Each case trains twice from the same weights: once with verl's built-in ``loss_mode`` and once
with ``loss_mode="rlo_<mode>"``, the preset registered by ``rlobjectives.integrations.verl``
through verl's ``register_policy_loss``. The gradients of both optimizer steps, the parameters
after them and every metric verl returns (same keys) agree to float32 rounding. The cases cover
every mode of the preset, two aggregations each (gspo: all five), with and without
``rollout_is_weights``; each reference run is checked to exercise its branches (clip fractions
nonzero where the mode clips, parameters moved).

One engine for the module (weights restored in place between runs), one gloo group, one thread.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any, NamedTuple

import _trainer_shims as shims  # before the peers: it sets the offline environment
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore:.* engine is not available:UserWarning",  # verl's optional engines (Megatron, ...)
)

VOCAB, BATCH, PROMPT, RESPONSE = 32, 8, 4, 6
MINI_BATCH, MICRO_BATCH = 4, 2
#: float32 rounding of two optimizer steps: the two losses order their float32 sums
#: differently (the library's fused stage, verl's eager ops); measured differences are below
#: 1e-6 relative (token-sum losses of O(10), parameters that moved by O(1)).
TRAINER = {"rtol": 1e-5, "atol": 1e-6}


class Case(NamedTuple):
    mode: str
    aggregation: str
    weights: bool

    def __str__(self) -> str:
        return f"{self.mode}-{self.aggregation}-{'w' if self.weights else 'no_w'}"


class Mode(NamedTuple):
    """A case's verl ``loss_mode``, aggregations, extra actor config and live metrics."""

    loss_mode: str
    aggregations: tuple[str, ...]
    extra: dict[str, Any]
    live: tuple[str, ...]  # metrics that must be nonzero in verl's own run


ALL_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                    "seq-mean-token-sum-norm")  # fmt: skip
#: label -> mode. vanilla: clip_ratio_c just above 1 + clip_ratio so that the dual clip binds;
#: bypass_mode: rollout_correction as a dict (RolloutCorrectionConfig(**it) at run time).
MODES: dict[str, Mode] = {
    "vanilla": Mode(
        "vanilla", ("token-mean", "seq-mean-token-sum"), {"clip_ratio_c": 1.15},
        ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"),
    ),
    "gspo": Mode(
        "gspo", ALL_AGGREGATIONS, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05},
        ("actor/pg_clipfrac",),
    ),
    "cispo": Mode("cispo", ("token-mean", "seq-mean-token-sum-norm"), {}, ("actor/pg_clipfrac",)),
    "sapo": Mode("sapo", ("token-mean", "token-sum"), {"tau_pos": 1.0, "tau_neg": 1.05}, ()),
    "geo_mean": Mode(
        "geo_mean", ("token-mean", "seq-mean-token-mean"), {}, ("actor/pg_clipfrac",)
    ),
    "gpg": Mode("gpg", ("token-mean", "seq-mean-token-mean"), {}, ()),
    # DPPO: thresholds on the probabilities of a tiny model's tokens (p ~ 1/32: small moves),
    # clip_ratio_c just above 1 so that the ratio cap binds (verl's pg_clipfrac_lower)
    "dppo_tv": Mode(
        "dppo_tv", ("token-mean", "seq-mean-token-sum"),
        {"clip_ratio_low": 0.01, "clip_ratio_high": 0.006, "clip_ratio_c": 1.2},
        ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"),
    ),
    "dppo_kl": Mode(
        "dppo_kl", ("token-mean", "seq-mean-token-mean"),
        {"clip_ratio_low": 1e-3, "clip_ratio_high": 5e-4, "clip_ratio_c": 1.2},
        ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"),
    ),
    # Clip-Cov: a fifth of the tokens, every positive covariance a candidate (verl's randperm
    # draw from the global generator, seeded alike for both runs)
    "clip_cov": Mode(
        "clip_cov", ("token-mean", "seq-mean-token-sum-norm"),
        {"policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}},
        ("actor/pg_clipfrac",),
    ),
    "kl_cov": Mode(
        "kl_cov", ("token-mean", "token-sum"),
        {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}}, ("actor/ppo_kl",),
    ),
    "dro": Mode("dro", ("token-mean", "seq-mean-token-mean"), {"policy_loss": {"dro_beta": 0.5}},
                ()),
    # PPO clip against the sampler, token IcePop weights (metrics only) and a sequence k3 gate
    "bypass_ppo": Mode(
        "bypass_mode", ("token-mean", "seq-mean-token-sum"),
        {"policy_loss": {"rollout_correction": {
            "rollout_is": "token", "rollout_is_threshold": "0.5_2.0", "rollout_rs": "seq_mean_k3",
            "rollout_rs_threshold": 0.05, "bypass_mode": True, "loss_type": "ppo_clip"}}},
        ("actor/pg_clipfrac", "rollout_corr/rollout_rs_masked_fraction",
         "rollout_corr/rollout_is_oob_ratio"),
    ),
    # REINFORCE with sequence TIS weights normalised over the batch, a token k1 gate and a
    # sequence k2 gate together
    "bypass_reinforce": Mode(
        "bypass_mode", ("token-mean", "seq-mean-token-mean"),
        {"policy_loss": {"rollout_correction": {
            "rollout_is": "sequence", "rollout_is_threshold": 2.0,
            "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.7_1.4,0.08",
            "rollout_is_batch_normalize": True, "bypass_mode": True, "loss_type": "reinforce"}}},
        ("rollout_corr/rollout_rs_token_k1_masked_fraction",
         "rollout_corr/rollout_rs_seq_max_k2_masked_fraction",
         "rollout_corr/rollout_is_ratio_fraction_high"),
    ),
}  # fmt: skip
CASES = [
    Case(label, aggregation, weights)
    for label, mode in MODES.items()
    for aggregation in mode.aggregations
    for weights in (False, True)
]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient of the FSDP2 module as a plain tensor (DTensor at world size 1)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _batch_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses, old log-probs off the current ones."""
    generator = torch.Generator().manual_seed(1)
    prompt_len = torch.randint(1, PROMPT + 1, (BATCH,), generator=generator)
    response_len = torch.randint(1, RESPONSE + 1, (BATCH,), generator=generator)
    response_len[3] = RESPONSE  # one full-length response
    prompts = torch.zeros(BATCH, PROMPT, dtype=torch.long)
    responses = torch.zeros(BATCH, RESPONSE, dtype=torch.long)
    attention_mask = torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.long)
    for i in range(BATCH):
        p, r = int(prompt_len[i]), int(response_len[i])
        prompts[i, PROMPT - p :] = torch.randint(1, VOCAB, (p,), generator=generator)
        responses[i, :r] = torch.randint(1, VOCAB, (r,), generator=generator)
        attention_mask[i, PROMPT - p : PROMPT + r] = 1
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, PROMPT:]
    with torch.no_grad():  # the current policy's log-probs, as compute_log_prob gives them
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids).logits  # fmt: skip
        log_probs = torch.log_softmax(logits[:, PROMPT - 1 : -1].float(), -1)
        current = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    selected = response_mask.bool()
    noise = 0.3 * torch.randn(BATCH, RESPONSE, generator=generator)
    advantages = torch.randn(BATCH, 1, generator=generator).expand(BATCH, RESPONSE)
    weights = 0.5 + 1.5 * torch.rand(BATCH, RESPONSE, generator=generator)
    return {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "old_log_probs": torch.where(selected, current + noise, 0.0),
        "advantages": torch.where(selected, advantages, 0.0).contiguous(),
        "rollout_is_weights": torch.where(selected, weights, 0.0),
    }  # fmt: skip


@pytest.fixture(scope="module")
def verl_step() -> Iterator[SimpleNamespace]:
    """verl's TrainingWorker on a tiny Qwen2, and a function that trains one case from scratch."""
    with (
        shims.one_thread(),
        shims.single_process_group(check_released=False),
        shims.environment(VERL_ENGINE_DEVICE="cuda"),  # verl registers its FSDP engine for cuda
        tempfile.TemporaryDirectory(prefix="rlo_verl_qwen2_") as model_dir,
    ):
        shims.register_cpu_platform()  # before verl.workers.engine is imported
        shims.disable_verl_trl_value_head_patch()
        from verl import DataProto
        from verl.trainer.config import CheckpointConfig, RolloutCorrectionConfig
        from verl.utils import tensordict_utils as tu
        from verl.workers.config import (
            FSDPActorConfig,
            FSDPEngineConfig,
            HFModelConfig,
            PolicyLossConfig,
            TrainingWorkerConfig,
        )
        from verl.workers.config.optimizer import FSDPOptimizerConfig
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import left_right_2_no_padding

        import rlobjectives.integrations.verl  # noqa: F401  (registers rlo_<mode>)

        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
            tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
            initializer_range=0.2,  # spread-out token probabilities (DPPO's masks differ)
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
        model.save_pretrained(model_dir)
        tensors = _batch_tensors(model)
        del model

        worker = TrainingWorker(
            config=TrainingWorkerConfig(
                model_type="language_model",
                model_config=HFModelConfig(
                    path=model_dir,
                    load_tokenizer=False,
                    use_remove_padding=False,
                    override_config={"attn_implementation": "eager"},
                    enable_gradient_checkpointing=False,
                ),
                engine_config=FSDPEngineConfig(
                    strategy="fsdp2",
                    use_torch_compile=False,
                    use_dynamic_bsz=False,
                    micro_batch_size_per_gpu=MICRO_BATCH,
                    use_remove_padding=False,
                    mixed_precision={
                        "param_dtype": "fp32",
                        "reduce_dtype": "fp32",
                        "buffer_dtype": "fp32",
                    },
                ),
                optimizer_config=FSDPOptimizerConfig(
                    optimizer="SGD",
                    lr=0.2,
                    weight_decay=0.0,
                    clip_grad=1e9,
                    total_training_steps=100,
                ),
                checkpoint_config=CheckpointConfig(),
            )  # fmt: skip
        )
        worker.reset()
        # everything that references the FSDP module lives in ``state``, cleared at teardown so
        # that the process group can really be destroyed (closures keep their cells)
        state: dict[str, Any] = {"worker": worker, "engine": worker.engine}
        del worker
        parameters = state["engine"].module.named_parameters()
        state["initial"] = {n: p.detach().clone() for n, p in parameters}
        state["optimizer_step"] = state["engine"].optimizer_step
        gradients: list[dict[str, torch.Tensor]] = []

        def recording_step() -> Any:  # instrumentation: each step's gradients, then verl's step
            module = state["engine"].module
            gradients.append({n: _full(p.grad).clone() for n, p in module.named_parameters()})
            return state["optimizer_step"]()

        state["engine"].optimizer_step = recording_step

        def train(loss_mode: str, case: Case) -> dict[str, Any]:
            """Two optimizer steps from the initial weights with ``loss_mode``."""
            engine, worker = state["engine"], state["worker"]
            with torch.no_grad():
                for name, param in engine.module.named_parameters():
                    param.copy_(state["initial"][name])
            engine.optimizer.zero_grad(set_to_none=True)
            gradients.clear()
            extra = MODES[case.mode].extra
            policy_options = dict(extra.get("policy_loss", {}))
            if "rollout_correction" in policy_options:
                correction = RolloutCorrectionConfig(**policy_options["rollout_correction"])
                policy_options["rollout_correction"] = correction
            policy = PolicyLossConfig(loss_mode=loss_mode, **policy_options)
            actor = FSDPActorConfig(
                strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=MINI_BATCH,
                ppo_micro_batch_size_per_gpu=MICRO_BATCH, use_torch_compile=False,
                loss_agg_mode=case.aggregation, policy_loss=policy,
                **{k: v for k, v in extra.items() if k != "policy_loss"},
            )  # fmt: skip
            worker.set_loss_fn(partial(ppo_loss, config=actor))  # as ActorRolloutRefWorker
            batch = {k: v.clone() for k, v in tensors.items()}
            if not case.weights:
                del batch["rollout_is_weights"]
            proto = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})
            data = left_right_2_no_padding(proto.to_tensordict())
            tu.assign_non_tensor(
                data, calculate_entropy=False, distillation_use_topk=False,
                distillation_only=False, global_batch_size=MINI_BATCH, mini_batch_size=MINI_BATCH,
                epochs=1, seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True,
            )  # fmt: skip
            torch.manual_seed(1234)  # clip_cov draws from the global generator (torch.randperm)
            metrics = dict(tu.get(worker.train_mini_batch(data), "metrics"))
            return {
                "gradients": [dict(g) for g in gradients],
                "parameters": {n: _full(p.detach()).clone()
                               for n, p in engine.module.named_parameters()},
                "metrics": {k: torch.as_tensor(v, dtype=torch.float64) for k, v in metrics.items()
                            if not k.startswith(("perf/", "mfu", "lr", "actor/lr"))},
            }  # fmt: skip

        initial = {n: _full(p).clone() for n, p in state["initial"].items()}
        try:
            yield SimpleNamespace(train=train, initial=initial)
        finally:
            state.clear()


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        message = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(actual[name], value, msg=message, **TRAINER)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_registered_preset_trains_like_the_built_in_mode(verl_step: Any, case: Case) -> None:
    loss_mode = MODES[case.mode].loss_mode
    reference = verl_step.train(loss_mode, case)
    preset = verl_step.train(f"rlo_{loss_mode}", case)

    # the reference run exercises the mode: two steps, the parameters moved, its branches bind
    assert len(reference["gradients"]) == 2
    moved = max((reference["parameters"][n] - p).abs().max() for n, p in verl_step.initial.items())
    assert moved > 1e-3
    for key in MODES[case.mode].live:
        assert reference["metrics"][key].max() > 0, f"{key} is 0 in verl's own run: not exercised"

    for step in range(2):
        _assert_same(preset["gradients"][step], reference["gradients"][step])
    _assert_same(preset["parameters"], reference["parameters"])
    _assert_same(preset["metrics"], reference["metrics"])


def test_the_registered_functions_are_the_presets(verl_step: Any) -> None:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from rlobjectives.integrations.verl import register_policy_losses
    from rlobjectives.presets import VerlPolicyLoss

    for mode in {mode.loss_mode for mode in MODES.values()}:
        registered = get_policy_loss_fn(f"rlo_{mode}")
        assert isinstance(registered, VerlPolicyLoss) and registered.loss_mode == mode
    assert get_policy_loss_fn("vanilla").__module__.startswith("verl.")  # verl's own untouched
    names = register_policy_losses("rlo_test_", modes=["gpg"])
    assert (
        list(names) == ["rlo_test_gpg"]
        and get_policy_loss_fn("rlo_test_gpg") is names["rlo_test_gpg"]
    )
    with pytest.raises(ValueError, match="prefix"):
        register_policy_losses("")
    with pytest.raises(ValueError, match="loss_mode"):
        register_policy_losses(modes=["no_such_mode"])
    assert os.environ.get("VERL_ENGINE_DEVICE") == "cuda"  # the module's set-up is in place


# ---------------------------------------------------------------------------------------------
# The same modes against verl's registered functions themselves (no trainer), float64, every
# aggregation, with and without rollout_is_weights, with the engine's global_batch_info and the
# local fallbacks, per-token advantages, an empty row: loss, gradient, metric keys and values.


@pytest.fixture(scope="module")
def core_algos() -> Any:
    shims.register_cpu_platform()
    from verl.trainer.ppo import core_algos

    return core_algos


def _actor_config(mode: Mode, aggregation: str, info: dict[str, Any]) -> Any:
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    policy_options = dict(mode.extra.get("policy_loss", {}))
    if "rollout_correction" in policy_options:
        policy_options["rollout_correction"] = RolloutCorrectionConfig(
            **policy_options["rollout_correction"]
        )
    config = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=MINI_BATCH,
        ppo_micro_batch_size_per_gpu=MICRO_BATCH, use_torch_compile=False,
        loss_agg_mode=aggregation,
        policy_loss=PolicyLossConfig(loss_mode=mode.loss_mode, **policy_options),
        **{k: v for k, v in mode.extra.items() if k != "policy_loss"},
    )  # fmt: skip
    config.global_batch_info.update(info)
    return config


def _function_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    rows, tokens = 6, 7
    lengths = torch.tensor([7, 0, 3, 5, 1, 6])  # an empty row
    mask = torch.arange(tokens) < lengths[:, None]
    log_prob = -2.0 * torch.rand(rows, tokens, generator=generator, dtype=torch.float64)
    old = log_prob + 0.3 * torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    weights = 0.5 + 1.5 * torch.rand(rows, tokens, generator=generator, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    return {
        "old": torch.where(mask, old, zero), "log_prob": torch.where(mask, log_prob, zero),
        "advantages": torch.where(mask, advantages, zero), "mask": mask,
        "weights": torch.where(mask, weights, zero),
    }  # fmt: skip


@pytest.mark.parametrize("label", list(MODES))
def test_preset_equals_verl_function(core_algos: Any, label: str) -> None:
    from rlobjectives.presets import verl_policy_loss

    mode = MODES[label]
    theirs_fn = core_algos.get_policy_loss_fn(mode.loss_mode)
    ours_fn = verl_policy_loss(mode.loss_mode)
    batch = _function_batch()
    engine = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 9,
              "loss_scale_factor": None}  # fmt: skip
    # the mode's branches bind in verl's own calls (the actor/ keys: the bypass gates are
    # exercised by the trainer's batch)
    expected_live = {key for key in mode.live if key.startswith("actor/")}
    live: set[str] = set()
    for aggregation in ALL_AGGREGATIONS:
        for info in ({}, engine):
            for weights in (None, batch["weights"]):
                config = _actor_config(mode, aggregation, info)
                inputs = [batch["log_prob"].clone().requires_grad_(True) for _ in range(2)]
                torch.manual_seed(7)  # clip_cov draws from the global generator: the same draw
                ours = ours_fn(batch["old"], inputs[0], batch["advantages"], batch["mask"],
                               aggregation, config, weights)  # fmt: skip
                torch.manual_seed(7)
                theirs = theirs_fn(batch["old"], inputs[1], batch["advantages"], batch["mask"],
                                   aggregation, config, weights)  # fmt: skip
                what = f"{label} {aggregation} info={bool(info)} weights={weights is not None}"
                torch.testing.assert_close(
                    ours[0], theirs[0].detach(), msg=lambda m, w=what: f"{w}: {m}"
                )
                ours[0].backward()
                theirs[0].backward()
                assert inputs[0].grad is not None and inputs[1].grad is not None
                torch.testing.assert_close(
                    inputs[0].grad, inputs[1].grad, msg=lambda m, w=what: f"{w}: {m}"
                )
                assert set(ours[1]) == set(theirs[1]), what
                live.update(k for k in expected_live if float(theirs[1][k]) > 0)
                for key, value in theirs[1].items():
                    torch.testing.assert_close(
                        ours[1][key],
                        torch.tensor(float(value), dtype=torch.float64),
                        msg=lambda m, k=key, w=what: f"{w} {k}: {m}",
                    )
    assert live == expected_live, f"{label}: {expected_live - live} never nonzero in verl's calls"


def test_the_migration_page_gmpo_equals_verl_geo_mean_on_one_micro_batch(core_algos: Any) -> None:
    # docs/migration/verl.md registers a GMPO reduced by the mini-batch's global row count; on
    # a mini-batch of one micro-batch (global_batch_size = B, dp_size = 1) that is verl's
    # geo_mean (its torch.mean over the rows), value and gradient
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "migration" / "verl.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    exec(compile(block, str(page), "exec"), {})
    batch = _function_batch()
    mode = Mode("geo_mean", (), {}, ())
    info = {"dp_size": 1, "batch_num_tokens": int(batch["mask"].sum()),
            "global_batch_size": batch["mask"].shape[0], "loss_scale_factor": None}  # fmt: skip
    config = _actor_config(mode, "token-mean", info)
    inputs = [batch["log_prob"].clone().requires_grad_(True) for _ in range(2)]
    tensors = (batch["advantages"], batch["mask"], "token-mean", config, batch["weights"])
    ours, metrics = core_algos.get_policy_loss_fn("rlo_gmpo_global")(
        batch["old"], inputs[0], *tensors
    )
    theirs, _ = core_algos.get_policy_loss_fn("geo_mean")(batch["old"], inputs[1], *tensors)
    torch.testing.assert_close(ours, theirs.detach())
    (ours + theirs).backward()
    assert inputs[0].grad is not None and inputs[1].grad is not None
    torch.testing.assert_close(inputs[0].grad, inputs[1].grad)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl"}
