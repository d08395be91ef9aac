"""Start and tear down the demo's Gloo process group under ``torchrun`` without a crash at exit.

Why a teardown needs care (it crashed one run in four, "terminate called without an active
exception", SIGABRT, always on the rank that leaves first):

* A Gloo worker thread (``pt_gloo_runloop``) drops its references to a collective's tensors a
  moment *after* the collective has completed for the caller. For a tensor that has a Python
  object, that drop takes the GIL (PyTorch keeps the Python object alive while C++ holds extra
  references).
* A rank with nothing left to do (every rank but 0, which writes the outputs) went from its last
  collective to interpreter shutdown in about a millisecond, less than the GIL switch interval.
  A worker still waiting for the GIL then is ended by CPython with ``pthread_exit`` inside a
  ``noexcept`` C++ frame: ``std::terminate``, SIGABRT.
* ``dist.destroy_process_group()`` should have prevented it: the Gloo backend's destructor joins
  its worker threads, with the GIL released. It never ran, because the process group stayed
  referenced: ``DistributedDataParallel``'s constructor imports ``torch._dynamo``, which imports
  ``torch.distributed`` modules whose default arguments capture ``group.WORLD`` at import time
  (e.g. ``ShardedGradScaler(process_group=dist.group.WORLD)``, ``torch.distributed.nn.functional``).
  Imported after ``init_process_group``, those defaults hold the group for the life of the
  process.

* FSDP2 (``fully_shard``, ``--fsdp``) holds the group the same way after the model is gone:
  DTensor's sharding-propagation and redistribution caches (``functools.lru_cache`` tables of
  ``torch.distributed.tensor`` and a C++ fast-path cache) keep the specs of every operation
  they saw, each with its ``DeviceMesh``, and the mesh holds the group.

So :func:`setup` imports ``torch._dynamo`` (and, for FSDP2, ``torch.distributed.fsdp``) *before*
creating the group, and :func:`shutdown` waits for every rank (a barrier after rank 0 wrote its
outputs, so no rank tears down while another still works), clears DTensor's caches, destroys the
group once the caller dropped its model wrapper, and checks that the group is really gone, i.e.
that its worker threads were joined.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import os
import sys
import warnings
import weakref

import torch.distributed as dist

__all__ = ["LEAKED_GROUP_WARNING", "release_sharding_caches", "setup", "shutdown"]

LEAKED_GROUP_WARNING = (
    "rlobjectives demo: the process group is still referenced after destroy_process_group(); "
    "its Gloo worker threads may outlive the interpreter and abort the process at exit"
)


def setup(*, fsdp: bool = False) -> bool:
    """Create the Gloo process group when ``torchrun`` started several ranks.

    Args:
        fsdp: the run shards with FSDP2: its modules are imported before the group too.

    Returns:
        True if this call created the group (then :func:`shutdown` destroys it), False when the
        run is single-process or the caller had already initialised ``torch.distributed``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    # Before the group exists, so that import-time defaults capture None, not the group.
    importlib.import_module("torch._dynamo")
    if fsdp:
        importlib.import_module("torch.distributed.fsdp")
    dist.init_process_group("gloo")
    return True


def release_sharding_caches() -> None:
    """Empty DTensor's caches, which hold ``DeviceMesh`` objects and through them the group.

    Every ``functools.lru_cache`` of the loaded ``torch.distributed`` modules (functions,
    static and plain methods of their classes), the redistribution planner's cache and the C++
    fast path of the sharding propagation. Nothing to do when DTensor was never imported.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    with warnings.catch_warnings():  # reading deprecated attributes (reduce_op) warns
        warnings.simplefilter("ignore")
        _clear_lru_caches()
    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor import debug

        debug._clear_sharding_prop_cache()  # type: ignore[no-untyped-call]  # Python and C++
    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

        clear_redistribute_planner_cache()


def _clear_lru_caches() -> None:
    """Clear every ``functools.lru_cache`` of the loaded ``torch.distributed`` modules."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            candidates = [value]
            if inspect.isclass(value) and value.__module__ == name:
                candidates += list(vars(value).values())
            for candidate in candidates:
                if isinstance(candidate, staticmethod):
                    candidate = candidate.__func__
                if isinstance(candidate, functools._lru_cache_wrapper):
                    candidate.cache_clear()


def shutdown(*, created: bool) -> None:
    """Wait for all ranks; destroy the group if :func:`setup` created it, joining its threads.

    Call it on every rank, after the last collective and after rank 0 wrote its outputs, once the
    ``DistributedDataParallel`` or FSDP2 model (which references the group) has been dropped.

    Args:
        created: what :func:`setup` returned; a group the caller created is left to the caller.
    """
    dist.barrier()  # every rank has finished its collectives and rank 0 its outputs
    if not created:
        return
    release_sharding_caches()
    group = dist.group.WORLD
    alive = weakref.ref(group) if group is not None else None
    del group
    dist.destroy_process_group()
    gc.collect()  # reference cycles through the model wrapper, if any, release the group too
    if alive is not None and alive() is not None:
        warnings.warn(LEAKED_GROUP_WARNING, RuntimeWarning, stacklevel=2)
