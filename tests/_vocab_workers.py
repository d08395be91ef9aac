"""Vocabulary-parallel cases and their launcher (tests/logprobs/test_vocab_parallel.py).

Every case is written once: :func:`run_case` computes it either on one process (``rank`` None:
the whole vocabulary) or on one rank of a gloo group holding the contiguous vocabulary slice
:data:`SIZES` gives it (``logits[..., slice]``, ``weight[slice]``, ``bias[slice]``, ``kept_mask``
likewise; token ids and kept ids global). The result names the gradients by leaf and says which
leaves are split by vocabulary (their slice is compared) and which are replicated (``hidden``:
partial sums or reduced). Spawned ranks import this module by name; the group is created with a
file store (no port to choose, so nothing to race for), a timeout, and torn down with a barrier
first.
"""

from __future__ import annotations

import datetime
import importlib
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import rlobjectives as rlo
from _spawn import spawn_ranks
from custom_surrogate import TanhSurrogate

VOCAB, HIDDEN, BATCH, STEPS = 11, 4, 2, 5
SIZES: dict[int, tuple[int, ...]] = {2: (6, 5), 3: (4, 4, 3)}  # uneven: 11 = 6 + 5 = 4 + 4 + 3
TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 240.0
F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def problem() -> dict[str, torch.Tensor]:
    """The batch every process builds identically (float64)."""
    generator = torch.Generator().manual_seed(2323)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=F64)

    shape = (BATCH, STEPS)
    mask = torch.rand(shape, generator=generator) < 0.75
    mask[0, 0] = True
    logits = 3 * randn(*shape, VOCAB)
    logits[0, 0, 9] = -INF  # a banned token in a selected row (the last slice holds it)
    logits = torch.where(mask[..., None], logits, NAN)  # unselected rows: never read
    tokens = torch.randint(0, VOCAB, shape, generator=generator)
    tokens = torch.where(mask, tokens, -100)
    tokens[0, 0] = 2
    kept_ids = torch.randint(-1, VOCAB, (*shape, 4), generator=generator)
    kept_ids[..., 0] = tokens.clamp(min=0)
    kept_ids[1, 0] = -1  # a row without a recorded set
    hidden = torch.where(mask[..., None], randn(*shape, HIDDEN), NAN)
    bias = randn(VOCAB)
    bias[9] = -INF
    log_probs = torch.log_softmax(torch.nan_to_num(logits, nan=0.0), -1)
    old = log_probs.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)
    return {
        "logits": logits,
        "ref_logits": torch.where(mask[..., None], 3 * randn(*shape, VOCAB), NAN),
        "tokens": tokens,
        "mask": mask,
        "kept_ids": kept_ids,
        "kept_mask": torch.rand((*shape, VOCAB), generator=generator) < 0.5,
        "hidden": hidden,
        "weight": randn(VOCAB, HIDDEN),
        "bias": bias,
        "old_log_probs": torch.where(mask, old + 0.3 * randn(*shape), NAN),
        "ref_log_probs": torch.where(mask, old + 0.2 * randn(*shape), INF),
        "advantages": randn(BATCH),
        "input_ids": torch.randint(0, VOCAB, shape, generator=generator),
        "cu_seqlens": torch.tensor([0, 3, 3, 10]),
    }


def vocab_slice(world: int | None, rank: int | None) -> slice:
    if world is None or rank is None:
        return slice(0, VOCAB)
    start = sum(SIZES[world][:rank])
    return slice(start, start + SIZES[world][rank])


# Leaves split by vocabulary (their gradient is the slice of the unsharded one) and replicated.
SPLIT = ("logits", "ref_logits", "weight", "bias")


def _leaves(data: dict[str, torch.Tensor], names: tuple[str, ...], part: slice,
            dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    leaves = {}
    for name in names:
        value = data[name]
        if name in ("logits", "ref_logits"):
            value = value[..., part]
        elif name in ("weight", "bias"):
            value = value[part]
        leaves[name] = value.to(dtype).clone().requires_grad_(True)
    return leaves


def _projection(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A fixed random weighting of the finite outputs (the same on every rank)."""
    generator = torch.Generator().manual_seed(77)
    total = torch.zeros((), dtype=F64)
    for output in outputs:
        if output.requires_grad:
            weights = torch.randn(output.shape, generator=generator, dtype=F64)
            total = total + (torch.where(torch.isfinite(output), output, 0.0) * weights).sum()
    return total


Case = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, slice], list[torch.Tensor]]


def _kept(
    data: dict[str, torch.Tensor], kind: str, part: slice, flat: bool = False
) -> dict[str, Any]:
    """The kept-set arguments of ``kind`` (the mask sliced like the logits; ``flat``: packed)."""
    ids, mask = data["kept_ids"], data["kept_mask"][..., part]
    if flat:
        ids, mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1])
    return {
        "none": {},
        "ids": {"kept_ids": ids},
        "mask": {"kept_mask": mask},
        "top_k": {"top_k": 3},
        "top_k+top_p": {"top_k": 5, "top_p": 0.7},  # k = 5 exceeds the 3-rank slices (4, 4, 3)
    }[kind]


def _logits_case(kind: str) -> Case:
    def run(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
            part: slice) -> list[torch.Tensor]:  # fmt: skip
        options = {"mask": data["mask"], "temperature": 0.7, "chunk_size": 3, "vocab_group": group}
        options |= _kept(data, kind, part)
        return [
            rlo.token_log_probs(leaves["logits"], data["tokens"], **options),
            rlo.token_entropy(leaves["logits"], **options),
        ]

    return run


STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _head_options(data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The logit transform with one temperature per token (issue 33)."""
    generator = torch.Generator().manual_seed(33)
    temperature = 0.5 + torch.rand(data["mask"].shape, generator=generator, dtype=F64)
    return {"temperature": temperature, "final_logit_softcapping": 4.0, "logit_scale": 0.8}


def _statistics_case(kind: str) -> Case:
    def run(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
            part: slice) -> list[torch.Tensor]:  # fmt: skip
        options: dict[str, Any] = {"mask": data["mask"], "chunk_size": 3, "vocab_group": group}
        options |= _head_options(data)
        options |= {"min_p": {"min_p": 0.05}, "min_p+top_k": {"min_p": 0.05, "top_k": 5}}.get(
            kind, {}) if kind.startswith("min_p") else _kept(data, kind, part)  # fmt: skip
        out = rlo.token_log_probs(leaves["logits"], data["tokens"], statistics=STATS, **options)
        return [out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits, out.is_top1]

    return run


def _hidden_statistics(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
                       part: slice) -> list[torch.Tensor]:  # fmt: skip
    options = _head_options(data)
    out = rlo.token_log_probs_from_hidden(
        leaves["hidden"], leaves["weight"], data["tokens"], bias=leaves["bias"], mask=data["mask"],
        chunk_size=3, vocab_group=group, statistics=STATS, min_p=0.05, top_k=4, **options,
    )  # fmt: skip
    return [out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits, out.is_top1]


def _response_statistics(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor],
                         group: Any, part: slice) -> list[torch.Tensor]:  # fmt: skip
    logits = torch.nan_to_num(leaves["logits"], nan=0.0)
    out = rlo.response_log_probs(
        logits, data["input_ids"], torch.tensor([1, 2]), torch.ones(BATCH, STEPS),
        response_length=4, temperature=0.7, vocab_group=group, final_logit_softcapping=3.0,
        statistics=STATS,
    )  # fmt: skip
    return [out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits, out.is_top1]


def _kl(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
        part: slice) -> list[torch.Tensor]:  # fmt: skip
    packed = {name: leaves[name].reshape(-1, leaves[name].shape[-1]) for name in leaves}
    return [
        rlo.full_vocab_kl(leaves["logits"], leaves["ref_logits"], mask=data["mask"],
                          temperature=0.7, chunk_size=2, vocab_group=group),
        rlo.full_vocab_kl_loss(packed["logits"], packed["ref_logits"], data["mask"].reshape(-1),
                               reduction="sequence_mean", cu_seqlens=data["cu_seqlens"],
                               vocab_group=group),
    ]  # fmt: skip


def _response(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
              part: slice) -> list[torch.Tensor]:  # fmt: skip
    logits = torch.nan_to_num(leaves["logits"], nan=0.0)
    out = rlo.response_log_probs(
        logits, data["input_ids"], torch.tensor([1, 2]), torch.ones(BATCH, STEPS),
        response_length=4, temperature=0.7, vocab_group=group, top_k=4,
    )  # fmt: skip
    return [out.log_probs]


def _hidden_case(kind: str, hidden_grad: str) -> Case:
    def run(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
            part: slice) -> list[torch.Tensor]:  # fmt: skip
        vocab_group = None if group is None else rlo.VocabParallel(group, hidden_grad=hidden_grad)
        # packed: (N, H) rows of 3 sequences
        out = rlo.token_log_probs_from_hidden(
            leaves["hidden"].reshape(-1, HIDDEN), leaves["weight"], data["tokens"].reshape(-1),
            bias=leaves["bias"], mask=data["mask"].reshape(-1), temperature=0.7, chunk_size=3,
            return_entropy=True, cu_seqlens=data["cu_seqlens"], vocab_group=vocab_group,
            **_kept(data, kind, part, flat=True),
        )  # fmt: skip
        return [out.log_probs, out.entropy]

    return run


def _fused_case(kind: str, hidden_grad: str, surrogate: Any = "clip") -> Case:
    def run(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
            part: slice) -> list[torch.Tensor]:  # fmt: skip
        vocab_group = None if group is None else rlo.VocabParallel(group, hidden_grad=hidden_grad)
        dtype = leaves["hidden"].dtype  # float32 on the kernels: every input in their dtype
        out = rlo.fused_policy_loss_from_hidden(
            leaves["hidden"], leaves["weight"], data["tokens"], data["old_log_probs"].to(dtype),
            data["advantages"].to(dtype), data["mask"], bias=leaves["bias"], temperature=0.7,
            entropy_coef=0.05, ref_log_probs=data["ref_log_probs"].to(dtype), kl_coef=0.1,
            kl_estimator="k2", surrogate=surrogate,
            reduction="sequence_mean", vocab_group=vocab_group, **_kept(data, kind, part),
        )  # fmt: skip
        return [out.loss, out.policy_loss, out.kl_loss, out.entropy_loss, out.log_probs,
                *out.diagnostics]  # fmt: skip

    return run


def _preference_case(hidden_grad: str) -> Case:
    """Issue 34: the preference and KTO losses from hidden states (one pair: rows 0 and 1)."""

    def run(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
            part: slice) -> list[torch.Tensor]:  # fmt: skip
        vocab_group = None if group is None else rlo.VocabParallel(group, hidden_grad=hidden_grad)
        head = {"bias": leaves["bias"], "temperature": 0.7, "chunk_size": 3,
                "vocab_group": vocab_group, "final_logit_softcapping": 2.0,
                "logit_scale": 0.8}  # fmt: skip
        out = rlo.preference_loss_from_hidden(
            leaves["hidden"], leaves["weight"], data["tokens"], data["mask"],
            objective=0.7 * rlo.DPO(beta=0.5) + 0.3 * rlo.SFT(),
            ref_log_probs=data["ref_log_probs"], **head,
        )  # fmt: skip
        kto = rlo.kto_loss_from_hidden(
            leaves["hidden"], leaves["weight"], data["tokens"], data["mask"],
            torch.tensor([True, False]), ref_log_probs=data["ref_log_probs"], kl=0.1, **head,
        )  # fmt: skip
        return [out.loss, out.chosen_rewards, out.rejected_rewards, kto.loss, kto.rewards]

    return run


def _with_kernels(case: Case) -> Case:
    def run(data: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], group: Any,
            part: slice) -> list[torch.Tensor]:  # fmt: skip
        previous = os.environ.get("RLOBJECTIVES_KERNELS")
        os.environ["RLOBJECTIVES_KERNELS"] = "triton"
        try:
            return case(data, leaves, group, part)
        finally:
            if previous is None:
                del os.environ["RLOBJECTIVES_KERNELS"]
            else:
                os.environ["RLOBJECTIVES_KERNELS"] = previous

    return run


LOGITS = ("logits",)
HEAD = ("hidden", "weight", "bias")
# name -> (case, leaves, dtype, on the Triton kernels)
CASES: dict[str, tuple[Case, tuple[str, ...], torch.dtype]] = {
    **{f"logits-{kind}": (_logits_case(kind), LOGITS, F64) for kind in
       ("none", "ids", "mask", "top_k", "top_k+top_p")},
    "full_vocab_kl": (_kl, ("logits", "ref_logits"), F64),
    "response_log_probs-top_k": (_response, LOGITS, F64),
    **{f"hidden-{kind}-{grad}": (_hidden_case(kind, grad), HEAD, F64)
       for kind in ("none", "top_k+top_p") for grad in ("partial", "reduced")},
    "hidden-ids-partial": (_hidden_case("ids", "partial"), HEAD, F64),
    **{f"statistics-{kind}": (_statistics_case(kind), LOGITS, F64)
       for kind in ("none", "mask", "top_k+top_p", "min_p", "min_p+top_k")},
    "hidden-statistics-partial": (_hidden_statistics, HEAD, F64),
    "response_log_probs-statistics": (_response_statistics, LOGITS, F64),
    **{f"fused-{kind}-{grad}": (_fused_case(kind, grad), HEAD, F64)
       for kind, grad in (("none", "partial"), ("none", "reduced"), ("ids", "partial"))},
    # a user's own surrogate, written outside the library (tests/custom_surrogate.py)
    "fused-custom-ids-partial": (_fused_case("ids", "partial", TanhSurrogate()), HEAD, F64),
    **{f"preference-{grad}": (_preference_case(grad), HEAD, F64)
       for grad in ("partial", "reduced")},
}  # fmt: skip
# Through the Triton interpreter (float32, the 2-rank run only: the interpreter is slow).
KERNEL_CASES: dict[str, tuple[Case, tuple[str, ...], torch.dtype]] = {
    "kernels-hidden-none-partial": (_with_kernels(_hidden_case("none", "partial")), HEAD,
                                    torch.float32),
    "kernels-fused-none-reduced": (_with_kernels(_fused_case("none", "reduced")), HEAD,
                                   torch.float32),
}  # fmt: skip


def run_case(name: str, world: int | None = None, rank: int | None = None,
             group: Any = None) -> dict[str, Any]:  # fmt: skip
    """``{"outputs": [...], "grads": {leaf: tensor}}`` of case ``name`` on one rank (or alone)."""
    case, names, dtype = {**CASES, **KERNEL_CASES}[name]
    data = problem()
    part = vocab_slice(world, rank)
    leaves = _leaves(data, names, part, dtype)
    outputs = case(data, leaves, group, part)
    total = _projection([o.double() for o in outputs])
    grads = {}
    if total.requires_grad:
        values = torch.autograd.grad(total, list(leaves.values()), allow_unused=True,
                                     materialize_grads=True)  # fmt: skip
        grads = dict(zip(leaves, values, strict=True))
    return {"outputs": [o.detach() for o in outputs], "grads": grads}


def _errors(group: Any) -> dict[str, str]:
    """The messages of the calls that must be refused under vocabulary parallelism."""
    data = problem()
    logits = torch.nan_to_num(data["logits"][..., :3])
    messages = {}
    for label, call in (
        ("top_p-alone", lambda: rlo.token_log_probs(logits, data["tokens"].clamp(min=0),
                                                    vocab_group=group, top_p=0.9)),
        ("sizes", lambda: rlo.token_entropy(logits, vocab_group=rlo.VocabParallel(
            group, vocab_sizes=(3,) * (dist.get_world_size(group) + 1)))),
    ):  # fmt: skip
        try:
            call()
            messages[label] = ""
        except ValueError as error:
            messages[label] = str(error)
    return messages


def hostile(group: Any, world: int | None = None, rank: int | None = None) -> dict[str, Any]:
    """Issue 31's hostile ids under vocabulary parallelism (``group`` None: one process).

    ``kept-outside``: every kept id outside ``[0, V)`` (ignored, like the pad), so every row
    keeps the whole vocabulary; ``token-outside-*``: the error a selected token id outside
    ``[0, V)`` raises (the name of its class, "" when the call returns).
    """
    data = problem()
    logits = torch.nan_to_num(data["logits"][..., vocab_slice(world, rank)])
    tokens = data["tokens"].clamp(min=0)
    outside = torch.tensor([VOCAB, VOCAB + 3, -5, -7]).expand(*tokens.shape, 4)
    results: dict[str, Any] = {
        "kept-outside": rlo.token_log_probs(logits, tokens, vocab_group=group, kept_ids=outside)
    }
    weight = data["weight"][vocab_slice(world, rank)]
    hidden = torch.nan_to_num(data["hidden"])
    for label, bad in (("above", VOCAB), ("negative", -5)):
        wrong = tokens.clone()
        wrong[0, 1] = bad
        calls = {
            "logits": lambda ids=wrong: rlo.token_log_probs(logits, ids, vocab_group=group),
            "hidden": lambda ids=wrong: rlo.token_log_probs_from_hidden(
                hidden, weight, ids, vocab_group=group
            ),
        }
        for path, call in calls.items():
            try:
                call()
                results[f"token-outside-{label}-{path}"] = ""
            except (RuntimeError, IndexError, ValueError) as error:
                results[f"token-outside-{label}-{path}"] = type(error).__name__
    return results


def _verl_sum_pi_squared(world: int, rank: int, group: Any) -> torch.Tensor:
    """verl 0.9.1's ``vocab_parallel_sum_pi_squared`` on this rank's slice of the logits.

    verl reads the tensor-parallel group from Megatron's ``parallel_state``; Megatron is not
    installed, so a module standing in for ``megatron.core.parallel_state`` gives it ours.
    """
    import sys
    import types

    state = types.ModuleType("megatron.core.parallel_state")
    state.get_tensor_model_parallel_group = lambda: group  # type: ignore[attr-defined]
    core = types.ModuleType("megatron.core")
    core.parallel_state = state  # type: ignore[attr-defined]
    core.ModelParallelConfig = object  # type: ignore[attr-defined]
    sys.modules.setdefault("megatron", types.ModuleType("megatron"))
    sys.modules.setdefault("megatron.core", core)
    sys.modules.setdefault("megatron.core.parallel_state", state)
    from verl.utils.megatron.tensor_parallel import vocab_parallel_sum_pi_squared

    logits = torch.nan_to_num(problem()["logits"], nan=0.0)[..., vocab_slice(world, rank)]
    return vocab_parallel_sum_pi_squared(logits.contiguous())


def _statistics_bytes(world: int, rank: int, group: Any) -> dict[str, int]:
    """Bytes this rank contributes to collectives in one call, without and with statistics."""
    counted = {"bytes": 0}
    reduce, gather = dist.all_reduce, dist.all_gather

    def counting_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return reduce(tensor, *args, **kwargs)

    def counting_gather(parts: list[torch.Tensor], tensor: torch.Tensor, *args: Any,
                        **kwargs: Any) -> Any:  # fmt: skip
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return gather(parts, tensor, *args, **kwargs)

    logits = torch.nan_to_num(problem()["logits"], nan=0.0)[..., vocab_slice(world, rank)]
    tokens = problem()["tokens"].clamp(min=0)
    sizes = rlo.VocabParallel(group, vocab_sizes=SIZES[world])
    out: dict[str, int] = {}
    dist.all_reduce, dist.all_gather = counting_reduce, counting_gather  # type: ignore[assignment]
    try:
        for label, statistics in (("log_probs", None), ("entropy", ("entropy",)),
                                  ("all", STATS)):  # fmt: skip
            counted["bytes"] = 0
            rlo.token_log_probs(logits, tokens, vocab_group=sizes, statistics=statistics)
            out[label] = counted["bytes"]
    finally:
        dist.all_reduce, dist.all_gather = reduce, gather  # type: ignore[assignment]
    return out


def worker(rank: int, world: int, store: str, out_dir: str, kernels: bool) -> None:
    """A spawned rank: every case, saved to ``rank{r}.pt``; a traceback to ``rank{r}.err``."""
    torch.set_num_threads(1)
    try:
        importlib.import_module("torch._dynamo")  # before the group (demo/_process_group.py)
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )  # fmt: skip
        group = dist.group.WORLD
        names = list(CASES) + (list(KERNEL_CASES) if kernels else [])
        results: dict[str, Any] = {name: run_case(name, world, rank, group) for name in names}
        sizes = rlo.VocabParallel(group, vocab_sizes=SIZES[world])  # given: no all-gather
        results["given-sizes"] = rlo.token_log_probs(
            torch.nan_to_num(problem()["logits"][..., vocab_slice(world, rank)]),
            problem()["tokens"].clamp(min=0), vocab_group=sizes,
        )  # fmt: skip
        results["errors"] = _errors(group)
        results["hostile"] = hostile(group, world, rank)
        results["verl-sum-pi-squared"] = _verl_sum_pi_squared(world, rank, group)
        results["statistics-bytes"] = _statistics_bytes(world, rank, group)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def launch(world: int, out_dir: str, *, kernels: bool) -> list[dict[str, Any]]:
    """Run :func:`worker` on ``world`` spawned ranks; every rank's results, or raise.

    Bounded in time, stopped at the first failed rank, the ranks' tracebacks in the error
    (:func:`_spawn.spawn_ranks`).
    """
    store = str(Path(out_dir) / "store")
    return spawn_ranks(
        worker, lambda rank: (rank, world, store, out_dir, kernels), world, out_dir, JOIN_TIMEOUT_S
    )
