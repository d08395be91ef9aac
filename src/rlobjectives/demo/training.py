"""The training loop of ``rlobjectives demo``: warm start, reference, RL steps, outputs.

:func:`train` runs in three stages. **Setup** (:func:`_set_up`): the task, the model, its short
supervised warm start (the reference policy), the reference's held-out accuracy, the optimizer,
the random streams and the step function (:func:`rlobjectives.demo.grpo.grpo_step`, the PPO
step of :mod:`rlobjectives.demo.ppo`, or a caller's). **Loop** (:func:`_run_steps`): one step per
iteration, a held-out evaluation every ``eval_every`` steps, one line of ``metrics.jsonl`` per
step. **Finish**: the figure, ``summary.json`` and a summary line by rank 0, and the teardown of
the process group. Ctrl-C (SIGINT, SIGTERM) stops the loop and keeps what was measured.

Under ``torchrun`` the model is wrapped in ``DistributedDataParallel`` (gloo on CPU), or sharded
with FSDP2's ``fully_shard`` (``--fsdp``), every rank draws the same prompts and keeps its share,
and rank 0 writes the outputs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple, TextIO

import torch
from torch import nn

from . import _process_group
from .config import DemoConfig, DemoResult, Forward, Step
from .evaluation import evaluate, warm_start
from .grpo import grpo_step, unwrap
from .model import TinyTransformer
from .outputs import MetricsLog, metrics_entry, require_extras, write_outputs
from .ranks import is_distributed
from .ranks import rank_and_world_size as _rank_and_world_size
from .sampling import default_forward
from .task import DigitTask

__all__ = ["train"]

# ``grpo_step`` and ``_rank_and_world_size`` are read from this module when a run starts: tests
# replace them here (a step that raises KeyboardInterrupt, a pretended number of ranks).

_EVAL_SEED = 12345  # the held-out prompts are the same for every seed


@dataclasses.dataclass
class _Run:
    """One run's fixed settings and what it measured so far (kept when Ctrl-C stops it)."""

    config: DemoConfig
    forward: Forward
    world_size: int
    writer: bool  # rank 0: writes the outputs
    show: bool  # progress bars on
    stream: TextIO | None
    progress_bar: Callable[..., Any]  # tqdm.tqdm
    start: float = dataclasses.field(default_factory=time.perf_counter)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    reference_accuracy: float = math.nan
    final_accuracy: float | None = None
    steps_completed: int = 0

    def bar(self, total: int, desc: str) -> Any:
        """A progress bar (shown by rank 0 unless ``--no-progress``)."""
        return self.progress_bar(total=total, desc=desc, disable=not self.show, file=self.stream)


class _Session(NamedTuple):
    """Everything the loop needs, built by :func:`_set_up`."""

    task: DigitTask
    model: nn.Module  # the policy, or its DistributedDataParallel wrapper
    policy: nn.Module
    reference: nn.Module  # frozen copy of the warm-started policy
    optimizer: torch.optim.Optimizer
    eval_digits: torch.Tensor  # (eval_size, length) held-out prompts
    prompt_generator: torch.Generator  # same stream on every rank
    sample_generator: torch.Generator  # one stream per rank
    step_function: Step


class _Interrupt:
    """Turns SIGINT/SIGTERM into KeyboardInterrupt once, then ignores repeats while saving."""

    def __init__(self) -> None:
        self.fired = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.fired:
            return
        self.fired = True
        raise KeyboardInterrupt

    def install(self) -> dict[int, Any]:
        """Handle SIGINT and SIGTERM; returns the previous handlers (for :meth:`restore`)."""
        # Signal handlers can only be installed from the main thread (Ctrl-C reaches it there).
        in_main_thread = threading.current_thread() is threading.main_thread()
        signals = [signal.SIGINT, signal.SIGTERM] if in_main_thread else []
        return {sig: signal.signal(sig, self.handler) for sig in signals}

    @staticmethod
    def restore(previous: dict[int, Any]) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train(
    config: DemoConfig,
    *,
    model: nn.Module | None = None,
    forward: Forward = default_forward,
    stream: TextIO | None = None,
    custom_step: Step | None = None,
) -> DemoResult:
    """Run the demo: warm start, reference evaluation, GRPO, outputs in ``config.out``.

    Args:
        config: the settings.
        model: the policy to train (default: a fresh :class:`TinyTransformer`); it must map token
            ids of the task's vocabulary to logits through ``forward``.
        forward: ``(model, tokens, attention_mask) -> logits``.
        stream: where the progress bars and the summary go (default: standard error / output).
        custom_step: one training step with the signature and metrics of
            :func:`rlobjectives.demo.grpo.grpo_step`, in place of the configured algorithm's
            (``examples/grpo_transformers.py --packed`` passes a packed-sequence step).

    Returns:
        :class:`DemoResult`. On Ctrl-C the run stops after writing ``metrics.jsonl`` (flushed
        every step), the figure and ``summary.json`` with ``interrupted: true``.

    Raises:
        MissingExtraError: tqdm or matplotlib (the ``demo`` extra) is not installed.
        ValueError: ``prompts_per_step`` is not divisible by the number of ranks.
    """
    progress_bar, pyplot = require_extras()
    created_group = _process_group.setup(fsdp=config.fsdp)
    rank, world_size = _rank_and_world_size()
    if config.prompts_per_step % world_size:
        raise ValueError(
            f"prompts_per_step must be divisible by the number of ranks ({world_size}), got "
            f"{config.prompts_per_step}"
        )
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)  # restored at the end
    out = Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    interrupt = _Interrupt()
    previous_handlers = interrupt.install()
    run = _Run(
        config, forward, world_size, rank == 0, config.progress and rank == 0, stream, progress_bar
    )
    log = MetricsLog(out / "metrics.jsonl" if run.writer else None)
    session: _Session | None = None
    try:
        session = _set_up(run, model, custom_step, rank)
        _run_steps(run, session, log)
    except KeyboardInterrupt:
        interrupt.fired = True
    except RuntimeError:
        if not interrupt.fired:  # a peer rank stopped on Ctrl-C: its collectives fail here
            raise
    finally:
        interrupt.restore(previous_handlers)
        torch.set_num_threads(previous_threads)
        log.close()
    result = _result(run, interrupted=interrupt.fired)
    if config.fsdp and session is not None and not interrupt.fired:
        parameters = full_parameters(session.policy)  # every rank: the gather is a collective

        if run.writer:
            torch.save(parameters, out / "parameters.pt")
    if run.writer:
        write_outputs(pyplot, config, result, out, stream)
    if is_distributed() and not interrupt.fired:
        # After an interruption a peer may be gone: no more collectives then.
        session = None  # the DDP wrappers / FSDP2 modules reference the process group
        _process_group.shutdown(created=created_group)
    return result


def _set_up(run: _Run, model: nn.Module | None, custom_step: Step | None, rank: int) -> _Session:
    """Task, model, warm start, reference and its accuracy, optimizer, streams, step function."""
    config, forward = run.config, run.forward
    task = DigitTask(config.task, length=config.length)
    torch.manual_seed(config.seed)
    if model is None:
        model = TinyTransformer(
            task.vocab_size,
            task.context_length,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
        )
    data_generator = torch.Generator().manual_seed(config.seed)
    eval_digits = task.sample_digits(
        config.eval_size, torch.Generator().manual_seed(_EVAL_SEED), held_out=True
    )
    with run.bar(config.warmup_steps, "warm start (SFT)") as bar:
        warm_start(model, task, config, data_generator, forward=forward, progress=bar.update)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # the warm-started policy
    if run.world_size > 1 and config.fsdp:
        model = _fully_shard(model)  # every rank holds the same weights: sharded in place
    elif run.world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    policy = unwrap(model)
    # Before any forward: a forward without grad leaves FSDP2's root module unsharded, and an
    # optimizer built then would hold the unsharded tensors instead of the sharded parameters.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    run.reference_accuracy = evaluate(policy, task, eval_digits, forward=forward)
    # Prompts: same stream on every rank; sampling: one stream per rank (--fsdp: one stream
    # for the whole step on every rank, whose draws each rank reads at its rows).
    prompt_generator = torch.Generator().manual_seed(config.seed + 1)
    stream = 0 if config.fsdp else rank
    sample_generator = torch.Generator().manual_seed(config.seed * 1000 + 7 + stream)
    step_function = _step_function(config, policy, custom_step, run.world_size)
    return _Session(
        task,
        model,
        policy,
        reference,
        optimizer,
        eval_digits,
        prompt_generator,
        sample_generator,
        step_function,
    )


def _fully_shard(model: nn.Module) -> nn.Module:
    """FSDP2: each transformer block, then the whole model, sharded over all ranks (gloo, CPU).

    Parameters, gradients and the reduction in float32 (the default policy): the gradients
    are averaged over the ranks, which ``data_parallel_loss_scale`` undoes, as with DDP.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, world_size = _rank_and_world_size()
    # The root returns the head's logits, a view of its 2-D matrix product; FSDP2 warns at every
    # forward that an in-place op on a view would skip its pre-backward hook. The demo only
    # reads the logits (log-softmax, gathers), never writes them in place.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, whole (FSDP2's shards gathered: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }


def _step_function(
    config: DemoConfig, policy: nn.Module, custom_step: Step | None, world_size: int
) -> Step:
    """The caller's step, else the configured algorithm's (GRPO, or PPO with its critic)."""
    if custom_step is not None:
        return custom_step
    if config.algorithm == "ppo":  # actor-critic: the critic and KL controller live there
        from .ppo import PPOStep

        return PPOStep(policy, config, world_size=world_size)
    return grpo_step


def _run_steps(run: _Run, session: _Session, log: MetricsLog) -> None:
    """The RL steps, each with its metrics line; held-out evaluation every ``eval_every``."""
    config = run.config
    heldout_accuracy = run.reference_accuracy
    with run.bar(config.steps, config.algorithm.upper()) as bar:
        for step in range(1, config.steps + 1):
            metrics = session.step_function(
                session.model,
                session.reference,
                session.optimizer,
                session.task,
                config,
                session.sample_generator,
                session.prompt_generator,
                forward=run.forward,
            )
            evaluated = step % config.eval_every == 0 or step == config.steps
            if evaluated:
                heldout_accuracy = evaluate(
                    session.policy, session.task, session.eval_digits, forward=run.forward
                )
                run.final_accuracy = heldout_accuracy if step == config.steps else None
            entry = metrics_entry(
                step,
                metrics,
                heldout_accuracy if evaluated else None,
                time.perf_counter() - run.start,
            )
            run.history.append(entry)
            run.steps_completed = step
            log.write(entry)
            bar.set_postfix(
                reward=f"{metrics['reward']:.3f}",
                acc=f"{metrics['accuracy']:.2f}",
                heldout=f"{heldout_accuracy:.2f}",
                kl=f"{metrics['kl']:.3f}",
                clip=f"{metrics['clip_fraction']:.3f}",
                refresh=False,
            )
            bar.update(1)


def _result(run: _Run, *, interrupted: bool) -> DemoResult:
    """What the run measured, up to where it stopped."""
    return DemoResult(
        reference_accuracy=run.reference_accuracy,
        final_accuracy=run.final_accuracy,
        steps_completed=run.steps_completed,
        interrupted=interrupted,
        wall_time_s=round(time.perf_counter() - run.start, 3),
        world_size=run.world_size,
        history=run.history,
    )
