"""hybridkv as the KV cache manager of vLLM 0.33's own scheduler.

- ``KVCacheManager``: vLLM's manager API (its constructor's keyword arguments, plus
  ``backend="reference" | "optimized"`` and ``device=``) over a hybridkv backend.
- ``HybridKVScheduler`` / ``HybridKVAsyncScheduler``: vLLM's schedulers with that manager, for
  ``--scheduler-cls`` (``HYBRIDKV_BACKEND`` picks the backend).
- ``install(backend=…)``: a context manager that swaps the manager of every scheduler built in it.
- ``from_vllm_config``: vLLM's ``KVCacheConfig`` as hybridkv's; ``to_vllm_config`` the other way
  (attention layouts).

vLLM is imported only when these are used; hybridkv installs and imports without it.
"""

from __future__ import annotations

from typing import Any

from hybridkv.integrations.vllm.convert import from_vllm_config, to_vllm_config
from hybridkv.integrations.vllm.errors import UnsupportedSetting
from hybridkv.integrations.vllm.manager import KVCacheManager

__all__ = [
    "HybridKVAsyncScheduler",
    "HybridKVScheduler",
    "KVCacheManager",
    "UnsupportedSetting",
    "from_vllm_config",
    "install",
    "to_vllm_config",
]

_LAZY = {"HybridKVScheduler", "HybridKVAsyncScheduler", "install"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from hybridkv.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
