"""The OpenRLHF preset inside OpenRLHF 0.11.2's real actor training step (skipped without it).

What runs is OpenRLHF's own code: a 2-layer Qwen2 built from a config (no download) loaded by
OpenRLHF's ``Actor`` (it loads bf16/fp16 only: loaded as bf16, then ``.float()``); the
experiences built as the experience maker and the replay buffer build them (one batched
``Experience`` -> ``NaiveReplayBuffer.append`` -> a ``DataLoader`` with its ``collate_fn``,
micro-batches of two) -> ``iter_grad_accum_global_norm`` (each optimizer step's global token
and sample counts, as ``ppo_train``) -> ``ActorPPOTrainer.training_step``: 8 sequences = two
optimizer steps of two micro-batches (gradient accumulation 2). ``ppo_train`` itself asks for
a CUDA device, so the test drives its loop. Two strategies: a plain one with DeepSpeed's
semantics (loss / accumulation steps, a step at each boundary) and OpenRLHF's own
``DeepspeedStrategy`` over a real DeepSpeed engine (ZeRO-0, float32, CPU, gloo; a torch SGD
client optimizer, since ``DeepspeedStrategy.prepare`` always builds AdamW = FusedAdam's JIT).

Each case trains twice from the same weights, the trainer building its loss from the same
CLI-derived arguments: once OpenRLHF's own ``PolicyLoss``, once the preset installed by
``rlobjectives.integrations.openrlhf.install_policy_loss`` (the name the actor constructs).
The gradients of both steps, the parameters after them, all five outputs of every
micro-batch and every ``training_step`` metric agree to float32 rounding, for ppo (token and
sample mode), the dual clip, gspo (also with per-token advantages and against the sampler) and
every valid IS-correction level x mode x gating, on both strategies.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import _trainer_shims as shims  # before the peers: it sets the offline environment
import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    # the gradient snapshot wraps optimizer.step after the LR scheduler wrapped it
    "ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning",
)

VOCAB, BATCH, PROMPT, RESPONSE = 32, 8, 4, 6
MICRO_BATCH, ACCUMULATION = 2, 2
LEARNING_RATE = 0.5
#: float32 rounding of two optimizer steps (the library's fused stage and OpenRLHF's eager
#: ops order their float32 sums differently); measured differences are below 1e-6 relative.
TRAINER = {"rtol": 1e-5, "atol": 1e-6}
OUTPUTS = ("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio")

#: case -> the CLI options it changes (``token_advantages``: per-token advantages, GAE-like).
CASES: dict[str, dict[str, Any]] = {
    "ppo": {},
    "ppo-seq-mean": {"loss_agg_mode": "seq-mean-token-mean", "eps_clip_low_high": (0.2, 0.28)},
    "ppo-dual-clip": {"dual_clip": 1.1},
    "gspo": {"policy_loss_type": "gspo", "eps_clip_low_high": (0.04, 0.04)},
    "gspo-token-advantages": {"policy_loss_type": "gspo", "eps_clip_low_high": (0.04, 0.04),
                              "token_advantages": True},
    "gspo-against-sampler": {"policy_loss_type": "gspo", "eps_clip_low_high": (0.04, 0.04),
                             "is_correction_level": "token"},
}  # fmt: skip
#: bands chosen from OpenRLHF's own runs so that every gate drops some units, not all
BANDS = {
    ("token", "ratio"): [0.8, 1.25], ("seq", "ratio"): [0.9, 1.12],
    ("token", "binary_kl"): [0.0, 0.002], ("seq", "binary_kl"): [0.0, 0.0006],
    ("token", "tv"): [0.0, 0.01], ("seq", "tv"): [0.0, 0.006],
}  # fmt: skip
for _level, _mode, _gating in [
    ("token", "mask", "ratio"), ("token", "clip", "ratio"), ("seq", "mask", "ratio"),
    ("token", "mask", "binary_kl"), ("seq", "mask", "binary_kl"),
    ("token", "mask", "tv"), ("seq", "mask", "tv"),
]:  # fmt: skip
    CASES[f"ppo-is-{_level}-{_mode}-{_gating}"] = {
        "is_correction_level": _level, "is_correction_mode": _mode,
        "is_correction_gating": _gating, "is_correction_threshold": BANDS[_level, _gating],
        "dual_clip": 3.0,
    }  # fmt: skip


def _cli_args(options: dict[str, Any]) -> SimpleNamespace:
    """The hierarchized CLI namespace: the fields ``ActorPPOTrainer`` and ``training_step`` read."""
    ns = SimpleNamespace
    correction: dict[str, Any] = {
        "is_correction_level": "off", "is_correction_mode": "mask",
        "is_correction_gating": "ratio", "is_correction_threshold": [0.5, 5.0],
    }  # fmt: skip
    correction.update({k: v for k, v in options.items() if k.startswith("is_correction")})
    return ns(
        local_rank=-1,
        actor=ns(
            eps_clip_low_high=options.get("eps_clip_low_high", (0.2, 0.2)),
            dual_clip=options.get("dual_clip"),
            loss_agg_mode=options.get("loss_agg_mode", "token-mean"),
            policy_loss_type=options.get("policy_loss_type", "ppo"),
            aux_loss_coef=0.0, entropy_coef=None,
        ),
        algo=ns(advantage=ns(**correction),
                kl=ns(use_loss=False, init_coef=0.0, estimator="k3", unbiased_gradient=False)),
        train=ns(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False,
                 micro_batch_size=MICRO_BATCH, batch_size=MICRO_BATCH * ACCUMULATION),
        ds=ns(packing_samples=False, param_dtype="fp32", zero_stage=0, adam_offload=False, zpg=1,
              tensor_parallel_size=1, ring_attn_size=1, use_universal_ckpt=False,
              grad_accum_dtype=None, overlap_comm=False, deepcompile=False),
        vllm=ns(sync_backend="gloo"),
    )  # fmt: skip


class PlainStrategy:
    """A minimal strategy with DeepSpeed's semantics: backward of loss / gas, a step every gas."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.args: Any = None
        self.accumulated_gradient = ACCUMULATION
        self.ring_attn_group = None
        self.optimizer = optimizer
        self.calls = 0

    def backward(self, loss: torch.Tensor, model: Any, optimizer: Any, **kwargs: Any) -> None:
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer: Any, model: Any, scheduler: Any, name: str = "") -> None:
        self.calls += 1
        if self.calls % self.accumulated_gradient == 0:
            self.optimizer.step()
            scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

    def get_grad_norm(self, model: Any) -> float:
        return 0.0

    def is_rank_0(self) -> bool:
        return True


@pytest.fixture(scope="module")
def openrlhf_step() -> Iterator[SimpleNamespace]:
    """OpenRLHF's actor on a tiny Qwen2, and a function that trains one case from scratch."""
    with (
        shims.one_thread(),
        shims.environment(DS_ACCELERATOR="cpu"),
        shims.single_process_group(),
        tempfile.TemporaryDirectory(prefix="rlo_openrlhf_qwen2_") as model_dir,
    ):
        with shims.flash_attn_stub():
            import deepspeed

            shims.avoid_deepspeed_jit()
            ppo_actor = shims.import_without_package_init("openrlhf.trainer.ray.ppo_actor")
            from openrlhf.models import Actor
            from openrlhf.trainer.ppo_utils import Experience, NaiveReplayBuffer  # noqa: F401
            from openrlhf.utils.deepspeed import DeepspeedStrategy
            from openrlhf.utils.loss_utils import iter_grad_accum_global_norm
        from torch.distributed.device_mesh import init_device_mesh
        from torch.utils.data import DataLoader

        from rlobjectives.integrations.openrlhf import install_policy_loss, restore_policy_loss

        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
            tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
        )  # fmt: skip
        transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir)
        actor = Actor(model_dir, attn_implementation="eager", param_dtype="bf16")
        actor.model.float()
        model = actor.model  # the HF module (DeepSpeed wraps it later)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}

        generator = torch.Generator().manual_seed(1)
        prompt_len = torch.randint(1, PROMPT + 1, (BATCH,), generator=generator)
        response_len = torch.randint(1, RESPONSE + 1, (BATCH,), generator=generator)
        response_len[3] = RESPONSE
        sequences = torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.long)
        attention_mask = torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.long)
        for i in range(BATCH):
            p, r = int(prompt_len[i]), int(response_len[i])
            sequences[i, PROMPT - p : PROMPT] = torch.randint(1, VOCAB, (p,), generator=generator)
            sequences[i, PROMPT : PROMPT + r] = torch.randint(1, VOCAB, (r,), generator=generator)
            attention_mask[i, PROMPT - p : PROMPT + r] = 1
        action_mask = attention_mask[:, PROMPT:].bool()
        with torch.no_grad():
            current = actor(sequences, action_mask, attention_mask=attention_mask)
        old = torch.where(
            action_mask, current + 0.3 * torch.randn(BATCH, RESPONSE, generator=generator), 0.0
        )
        rollout = torch.where(
            action_mask, old + 0.3 * torch.randn(BATCH, RESPONSE, generator=generator), 0.0
        )
        advantages = torch.where(
            action_mask, torch.randn(BATCH, 1, generator=generator).expand(BATCH, RESPONSE), 0.0
        )
        token_advantages = torch.where(
            action_mask, advantages + 0.7 * torch.randn(BATCH, RESPONSE, generator=generator), 0.0
        )

        gradients: list[dict[str, torch.Tensor]] = []

        def recording(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            step = optimizer.step

            def recording_step(*args: Any, **kwargs: Any) -> Any:  # instrumentation only
                gradients.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
                return step(*args, **kwargs)

            optimizer.step = recording_step  # type: ignore[method-assign]
            return optimizer

        def sgd() -> tuple[torch.optim.Optimizer, Any]:
            optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
            return recording(optimizer), scheduler  # after the scheduler wrapped step

        state: dict[str, Any] = {}

        def deepspeed_strategy() -> tuple[Any, Any, Any]:
            """OpenRLHF's DeepspeedStrategy around a real DeepSpeed engine (built once)."""
            if "engine" not in state:
                strategy = DeepspeedStrategy(
                    seed=42, max_norm=0.0, micro_train_batch_size=MICRO_BATCH,
                    train_batch_size=MICRO_BATCH * ACCUMULATION, zero_stage=0,
                    args=_cli_args({}),
                )  # fmt: skip
                # setup_distributed() without torch.cuda.set_device and its "cuda" device mesh
                deepspeed.init_distributed(dist_backend="gloo")
                strategy.world_size = 1
                strategy.ds_device_mesh = init_device_mesh(
                    "cpu", (1, 1, 1), mesh_dim_names=("dp", "sp", "tp")
                )
                strategy.setup_ring_attn(strategy.ds_device_mesh)
                strategy.accumulated_gradient = ACCUMULATION
                ds_config = strategy.get_ds_train_config(optim_dict=None, max_norm=0.0)
                ds_config["zero_optimization"] = {"stage": 0}
                ds_config["gradient_accumulation_steps"] = ACCUMULATION
                optimizer, scheduler = sgd()
                engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                    model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                    dist_init_required=False,
                )  # fmt: skip
                state.update(engine=engine, strategy=strategy, optimizer=ds_optimizer,
                             scheduler=ds_scheduler)  # fmt: skip
            actor.model = state["engine"]
            return state["strategy"], state["optimizer"], state["scheduler"]

        def train(strategy_name: str, case: str, preset: bool) -> dict[str, Any]:
            """Two optimizer steps x two micro-batches through ``training_step``."""
            options = CASES[case]
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(initial[name])
                    param.grad = None
            gradients.clear()
            if strategy_name == "deepspeed":
                strategy, optimizer, scheduler = deepspeed_strategy()
            else:
                optimizer, scheduler = sgd()
                strategy = PlainStrategy(optimizer)
                actor.model = model
            strategy.args = _cli_args(options)
            if preset:
                install_policy_loss()
            try:
                with shims.cuda_device_queries_on_cpu():  # replay buffer, final barrier
                    trainer = ppo_actor.ActorPPOTrainer(
                        strategy, actor, None, optimizer, scheduler,
                        micro_train_batch_size=MICRO_BATCH, buffer_limit=0,
                        buffer_cpu_offload=True, vllm_engines=None,
                    )  # fmt: skip
            finally:
                restore_policy_loss()
            outputs: list[tuple[Any, ...]] = []
            loss_fn = trainer.actor_loss_fn

            def recording_loss(*args: Any, **kwargs: Any) -> Any:
                out = loss_fn(*args, **kwargs)
                outputs.append(tuple(None if x is None else x.detach().clone() for x in out))
                return out

            trainer.actor_loss_fn = recording_loss
            adv = token_advantages if options.get("token_advantages") else advantages
            trainer.replay_buffer.append(
                Experience(
                    sequences=sequences.clone(),
                    attention_mask=attention_mask.clone(),
                    action_mask=action_mask.clone(),
                    action_log_probs=old.clone(),
                    rollout_log_probs=rollout.clone(),
                    advantages=adv.clone(),
                    returns=adv.clone(),
                    response_length=response_len.float(),
                    total_length=(prompt_len + response_len).float(),
                    info={"reward": advantages[:, 0].clone()},
                )  # fmt: skip
            )
            buffer = trainer.replay_buffer
            loader = DataLoader(buffer, batch_size=MICRO_BATCH, shuffle=False, drop_last=True,
                                collate_fn=buffer.collate_fn)  # fmt: skip
            metrics = []
            windows = iter_grad_accum_global_norm(
                loader, strategy, strategy.accumulated_gradient, lambda e: e.action_mask
            )
            for step, (experience, info) in enumerate(windows):
                experience.to_device("cpu")
                status = trainer.training_step(experience, 0.0, step, info)
                metrics.append({k: v for k, v in status["metrics"].items() if k != "actor_lr"})
            return {
                "loss_fn": loss_fn,
                "gradients": [dict(g) for g in gradients],
                "parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
                "outputs": outputs,
                "metrics": metrics,
            }

        try:
            yield SimpleNamespace(train=train, initial=initial)
        finally:
            actor.model = model
            state.clear()


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    if expected is None:
        assert actual is None, what
        return
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(actual_t, expected_t, msg=lambda m: f"{what}: {m}", **TRAINER)


REFERENCES: dict[tuple[str, str], dict[str, Any]] = {}


def _reference(openrlhf_step: Any, strategy: str, case: str) -> dict[str, Any]:
    if (strategy, case) not in REFERENCES:
        REFERENCES[strategy, case] = openrlhf_step.train(strategy, case, preset=False)
    return REFERENCES[strategy, case]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", ["plain", "deepspeed"])
def test_installed_preset_trains_like_policy_loss(
    openrlhf_step: Any, strategy: str, case: str
) -> None:
    from openrlhf.models.loss import PolicyLoss

    from rlobjectives.presets import OpenRLHFPolicyLoss

    reference = _reference(openrlhf_step, strategy, case)
    preset = openrlhf_step.train(strategy, case, preset=True)
    assert isinstance(reference["loss_fn"], PolicyLoss)
    assert isinstance(preset["loss_fn"], OpenRLHFPolicyLoss)  # the trainer built the preset

    # the reference run exercises the case: two steps, four micro-batches, its gates bind
    assert len(reference["gradients"]) == 2 and len(reference["outputs"]) == 4
    clip_ratios = torch.stack([out[1] for out in reference["outputs"]])
    assert clip_ratios.max() > 0, "no clip binds in OpenRLHF's own run"
    if CASES[case].get("is_correction_level") and CASES[case].get("policy_loss_type") != "gspo":
        filtered = torch.stack([out[4] for out in reference["outputs"]])
        assert filtered.max() > 0 and filtered.min() < 1, "the gate drops none or all"

    for step in range(2):
        for name, value in reference["gradients"][step].items():
            _assert_close(preset["gradients"][step][name], value, f"step {step} grad {name}")
    for name, value in reference["parameters"].items():
        _assert_close(preset["parameters"][name], value, f"parameter {name}")
    for call, (ours, theirs) in enumerate(
        zip(preset["outputs"], reference["outputs"], strict=True)
    ):
        assert len(ours) == len(theirs) == 5
        for index, output in enumerate(OUTPUTS):
            _assert_close(ours[index], theirs[index], f"micro-batch {call} {output}")
    for ours_step, theirs_step in zip(preset["metrics"], reference["metrics"], strict=True):
        assert ours_step.keys() == theirs_step.keys()
        for key, value in theirs_step.items():
            _assert_close(ours_step[key], value, f"training_step metric {key}")


def test_the_cases_are_distinct_and_the_engine_trains_like_the_plain_strategy(
    openrlhf_step: Any,
) -> None:
    def moved(case: str, strategy: str = "plain") -> dict[str, torch.Tensor]:
        return _reference(openrlhf_step, strategy, case)["parameters"]

    def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[n] - b[n]).abs().max()) for n in a)

    # the dual clip binds (it changes the training), so do per-token advantages in gspo
    assert differ(moved("ppo"), moved("ppo-dual-clip")) > 1e-4
    assert differ(moved("gspo"), moved("gspo-token-advantages")) > 1e-4
    assert differ(moved("gspo"), moved("gspo-against-sampler")) > 1e-4
    # DeepSpeed's 1/gas scaling and boundary step are the plain strategy's
    for case in ("ppo", "ppo-dual-clip", "gspo", "ppo-is-seq-mask-binary_kl"):
        assert differ(moved(case), moved(case, "deepspeed")) < 1e-6
    # and the parameters moved at all
    assert differ(moved("ppo"), openrlhf_step.initial) > 1e-3
