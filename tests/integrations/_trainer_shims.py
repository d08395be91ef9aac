"""What a CPU-only machine shared with TRL 1.16 lacks to run verl's and OpenRLHF's training steps.

Nothing here re-implements a peer's computation: each shim supplies a device platform, an
optional import, a package ``__init__`` that would pull in vLLM, a JIT build to skip, or two
CUDA queries made by constructors. The training steps themselves are the peers' own code.

verl 0.9.1
    * :func:`register_cpu_platform`: verl has CUDA / NPU / ROCm platforms only and falls back to
      CUDA; a ``cpu`` platform is registered with verl's own ``PlatformRegistry`` and made
      current with ``set_platform`` before ``verl.workers.engine`` is imported (its modules read
      the device name at import time).
    * :func:`disable_verl_trl_value_head_patch`: verl's ``apply_monkey_patch`` imports TRL 0.x's
      value-head class whenever ``trl`` is importable; TRL 1.16 has none.
    * not a shim: verl's own ``VERL_ENGINE_DEVICE=cuda`` lets ``TrainingWorker`` find the FSDP
      engine, which verl registers for cuda/npu only.

OpenRLHF 0.11.2 / DeepSpeed 0.19.6
    * :func:`flash_attn_stub`: ``openrlhf/models/ring_attn_utils.py`` imports ``flash_attn`` at
      import time (used only with sample packing / ring attention).
    * :func:`import_without_package_init`: ``openrlhf.trainer.ray.__init__`` imports vLLM.
    * :func:`avoid_deepspeed_jit`: DeepSpeed's CPU backend JIT-compiles its shared-memory op with
      g++ (about 40 s) when ``deepspeed.comm`` initialises.
    * :func:`cuda_device_queries_on_cpu`: ``ActorPPOTrainer.__init__`` (its replay buffer, its
      final barrier) calls ``torch.cuda.current_device()`` / ``torch.cuda.synchronize()``.

Offline: importing this module sets ``HF_HUB_OFFLINE`` and its siblings (:data:`OFFLINE_ENV`).

Process set-up shared by both: :func:`single_process_group` (a gloo group of one process on a
file store: no port to collide with another test run), :func:`one_thread`.
"""

from __future__ import annotations

import gc
import importlib
import importlib.machinery
import importlib.util
import os
import socket
import sys
import tempfile
import types
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

PROCESS_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
#: The trainer tests build their models from configs: no hub, dataset or telemetry request may
#: leave the machine (CI has no network beyond the package index; a request would hang on its
#: timeout, not fail). Set when this module is imported, before any peer is.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
for _name, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_name, _value)


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread: the models are tiny, a second thread only adds contention."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the duration, restoring the previous values after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def single_process_group(*, check_released: bool = True) -> Iterator[None]:
    """A gloo process group of one process (rank 0 of 1) on a file store, destroyed after.

    ``torch._dynamo`` is imported first, so that no import-time default captures the group
    (``rlobjectives/demo/_process_group.py``); the group is destroyed and, with
    ``check_released``, checked gone (a warning otherwise). verl's FSDP2 run leaves DTensor
    sharding specs in torch's caches whose device mesh keeps the group referenced from C++
    (``check_released=False`` there): its worker threads then stay idle until exit, their
    last collective long finished, which is not the situation of the exit crash that
    ``_process_group.py`` describes (a worker releasing tensors right after a collective).
    """
    importlib.import_module("torch._dynamo")
    if dist.is_initialized():  # pragma: no cover - a group left by another module
        raise RuntimeError("a torch.distributed process group is already initialised")
    with socket.socket() as probe:  # recorded by verl's Worker, never bound: the store is a file
        probe.bind(("127.0.0.1", 0))
        address = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(probe.getsockname()[1])}
    with (
        tempfile.TemporaryDirectory(prefix="rlo_gloo_") as directory,
        environment(**PROCESS_ENV, **address),
    ):
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            group = dist.group.WORLD
            alive = weakref.ref(group) if group is not None else None
            del group, store
            dist.destroy_process_group()
            gc.collect()
            if check_released and alive is not None and alive() is not None:
                warnings.warn("the gloo group is still referenced after destroy", stacklevel=2)


def _stub_module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__path__ = []  # a package: ``import name.sub`` fails cleanly
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


# --------------------------------------------------------------------------------------------
# verl


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the memory queries verl makes on its device module (zeros on CPU)."""

    def __init__(self) -> None:
        super().__init__("rlo_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def max_memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def manual_seed(seed: int) -> None:
        return None

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(*args: Any, **kwargs: Any) -> str:  # verl's FLOPs table has a CPU row
        return "CPU"


def register_cpu_platform() -> None:
    """Register a ``cpu`` platform with verl's ``PlatformRegistry`` and make it current.

    Must run before ``verl.workers.engine`` is imported. ``current_device()`` is ``"cpu"`` (verl
    moves tensors with ``.to(get_device_id())``) and the collectives are gloo's. Idempotent.
    """
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    current = platform_manager._current_platform
    if current is not None and current.device_name == "cpu":
        return  # registered by an earlier module
    device_module = _CPUDeviceModule()

    class PlatformCPU(PlatformBase):  # type: ignore[misc]
        """verl platform for a CPU-only process (gloo collectives, no device memory)."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device_module)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            return None

        def manual_seed_all(self, seed: int) -> None:
            return None

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    platform_manager.PlatformRegistry.register(platform="cpu")(PlatformCPU)
    platform_manager.set_platform(PlatformCPU())


def disable_verl_trl_value_head_patch() -> None:
    """Keep verl's ``apply_monkey_patch`` from importing TRL 0.x's value-head model.

    verl 0.9.1 (``verl/models/transformers/monkey_patch.py``) imports
    ``AutoModelForCausalLMWithValueHead`` from TRL whenever ``trl`` is importable, to patch
    its ``state_dict`` (critics built by TRL); TRL 1.16 has no such class, so building any FSDP
    model would raise ImportError. The actor never uses that wrapper.
    """
    from verl.models.transformers import monkey_patch

    monkey_patch.is_trl_available = lambda: False


# --------------------------------------------------------------------------------------------
# OpenRLHF and DeepSpeed


@contextmanager
def flash_attn_stub() -> Iterator[None]:
    """A ``flash_attn`` stub (``bert_padding``, ``utils.distributed``) while OpenRLHF imports.

    ``openrlhf/models/ring_attn_utils.py`` imports names from both at import time; they are
    called only with sample packing or ring attention, and the stubs raise if called. The
    entries leave ``sys.modules`` on exit (the importing modules keep their names), so no
    later test sees a ``flash_attn`` module; transformers reads flash-attn's availability from
    the installed distribution, which a stub does not create.
    """
    if importlib.util.find_spec("flash_attn") is not None:  # pragma: no cover - a GPU machine
        yield
        return

    def absent(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"flash_attn is not installed (stub {name} called)")

        return call

    padding = {n: absent(n) for n in ("index_first_axis", "pad_input", "rearrange", "unpad_input")}
    stubs = {
        "flash_attn": _stub_module("flash_attn"),
        "flash_attn.bert_padding": _stub_module("flash_attn.bert_padding", **padding),
        "flash_attn.utils": _stub_module("flash_attn.utils"),
        "flash_attn.utils.distributed": _stub_module(
            "flash_attn.utils.distributed", all_gather=absent("all_gather")
        ),
    }
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def import_without_package_init(module_name: str) -> types.ModuleType:
    """Import ``module_name`` without running its parent package's ``__init__``.

    ``openrlhf.trainer.ray.__init__`` imports vLLM. The parent is registered as an empty
    package whose ``__path__`` is the real directory, so the module and its relative imports
    load from their files.
    """
    parent_name, _, _ = module_name.rpartition(".")
    if parent_name not in sys.modules:
        grandparent, _, leaf = parent_name.rpartition(".")
        base = importlib.import_module(grandparent)
        directory = os.path.join(base.__path__[0], leaf)
        spec = importlib.machinery.ModuleSpec(parent_name, loader=None, is_package=True)
        spec.submodule_search_locations = [directory]
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [directory]
        sys.modules[parent_name] = package
        setattr(base, leaf, package)
    return importlib.import_module(module_name)


def avoid_deepspeed_jit() -> None:
    """Keep DeepSpeed's CPU backend from JIT-compiling its shared-memory op with g++.

    ``deepspeed.comm.torch.TorchBackend.__init__`` calls ``build_shm_op()``, which returns None
    when ``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]`` is False and otherwise
    JIT-builds the op (DeepSpeed was installed with ``DS_BUILD_OPS=0``; no environment variable
    switches the runtime build off). The collectives then go through torch.distributed (gloo).
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextmanager
def cuda_device_queries_on_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` is 0 and ``torch.cuda.synchronize()`` a no-op, briefly.

    For OpenRLHF constructors that only record a CUDA device (``NaiveReplayBuffer.__init__``,
    used by its ``sample()``, never by the training step) or synchronise
    (``torch_dist_barrier_and_cuda_sync`` at the end of ``ActorPPOTrainer.__init__``).
    Restored on exit; never active during a training step.
    """
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
