"""vLLM's own ``Scheduler`` and ``AsyncScheduler`` with a hybridkv manager (imports vLLM).

Select them with ``--scheduler-cls hybridkv.integrations.vllm.HybridKVScheduler`` (or
``HybridKVAsyncScheduler`` with async scheduling); ``HYBRIDKV_BACKEND`` (``reference`` by
default, or ``optimized``) and ``HYBRIDKV_DEVICE`` pick the backend.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from hybridkv.integrations.vllm.cores import BACKENDS
from hybridkv.integrations.vllm.manager import KVCacheManager

_LOCK = threading.RLock()


@contextlib.contextmanager
def install(
    backend: str = "reference",
    device: str | None = None,
    max_num_reqs: int | None = None,
    *,
    eviction_policy: str | None = None,
) -> Iterator[None]:
    """Within the block, every vLLM ``Scheduler`` (and ``AsyncScheduler``) built gets a hybridkv
    manager of ``backend`` instead of vLLM's own. ``max_num_reqs`` sizes the optimized backend's
    tables (requests holding blocks at once; its default is 256); ``eviction_policy`` names the
    managers' policy (``None``: ``HYBRIDKV_EVICTION``'s, else ``lru``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    with _LOCK:
        original = scheduler_module.KVCacheManager
        scheduler_module.KVCacheManager = functools.partial(
            KVCacheManager,
            backend=backend,
            device=device,
            max_num_reqs=max_num_reqs,
            eviction_policy=eviction_policy,
        )
        try:
            yield
        finally:
            scheduler_module.KVCacheManager = original


def _max_num_reqs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The scheduler's ``max_num_seqs`` (or ``max_num_active_seqs``): at most that many
    requests hold blocks at once."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    config = getattr(vllm_config, "scheduler_config", None)
    counts = [getattr(config, "max_num_seqs", None), getattr(config, "max_num_active_seqs", None)]
    known = [count for count in counts if isinstance(count, int)]
    return max(known) if known else None


def _env_backend() -> tuple[str, str | None]:
    return os.environ.get("HYBRIDKV_BACKEND", "reference"), os.environ.get("HYBRIDKV_DEVICE")


class HybridKVScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's ``Scheduler`` whose KV cache manager is hybridkv's (``HYBRIDKV_BACKEND``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        backend, device = _env_backend()
        with install(backend, device, _max_num_reqs(args, kwargs)):
            super().__init__(*args, **kwargs)


class HybridKVAsyncScheduler(AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` whose KV cache manager is hybridkv's (``HYBRIDKV_BACKEND``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        backend, device = _env_backend()
        with install(backend, device, _max_num_reqs(args, kwargs)):
            super().__init__(*args, **kwargs)
