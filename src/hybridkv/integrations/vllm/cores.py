"""The hybridkv manager behind the vLLM integration: the reference or the optimized backend,
built with the settings vLLM's scheduler gives its own manager.

``make_core`` turns vLLM's manager settings into a core manager: a setting a backend does not
take is refused by name (``UnsupportedSetting``) unless it holds its default, the eviction
policy comes from ``HYBRIDKV_EVICTION`` when not given, and KV events are built as vLLM's own
structs (``vllm_event_builder_class``). The optimized core trusts vLLM's requests' hash counts
(``TorchKVCacheManager.trust_hash_counts``): vLLM's scheduler hashes them at the hash block
size it gives the manager.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any, Literal

from hybridkv.integrations.vllm.errors import UnsupportedSetting, refuse
from hybridkv.integrations.vllm.events import vllm_event_builder_class
from hybridkv.policies import EvictionPolicy
from hybridkv.spec import KVCacheConfig

Backend = Literal["reference", "optimized"]
BACKENDS: tuple[Backend, ...] = ("reference", "optimized")


def make_core(
    backend: str,
    config: KVCacheConfig,
    max_model_len: int,
    *,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    hash_block_size: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    num_hash_lookahead_tokens: int,
    device: str | None,
    max_num_reqs: int | None = None,
    log_stats: bool = True,
    eviction_policy: str | EvictionPolicy | None = None,
    num_prefill_lookahead: int = 0,
    event_metadata: Sequence[tuple[str, int | None]] | None = None,
) -> Any:
    """The core manager of ``backend`` with vLLM's settings and events' group metadata, under
    ``eviction_policy`` (``None``: ``HYBRIDKV_EVICTION``'s; ``lru``, vLLM's order, if unset)."""
    settings: dict[str, Any] = {
        "hash_block_size": hash_block_size,
        "max_in_flight_tokens": max_in_flight_tokens,
        "use_eagle": use_eagle,
        "num_hash_lookahead_tokens": num_hash_lookahead_tokens,
        "log_stats": log_stats,
        "event_builder_class": vllm_event_builder_class(event_metadata),
        "num_prefill_lookahead": num_prefill_lookahead,
    }
    eviction = eviction_policy or os.environ.get("HYBRIDKV_EVICTION", "lru")
    if eviction != "lru":
        settings["eviction_policy"] = eviction
    if backend == "reference":
        refuse(device is not None, "device= with backend='reference'", "it runs on the CPU")
        del max_num_reqs  # the reference's tables grow as needed
        from hybridkv.reference import KVCacheManager as ReferenceManager

        return ReferenceManager(
            config, max_model_len, enable_caching, enable_kv_cache_events, **settings
        )
    if backend == "optimized":
        return _optimized_core(
            config, max_model_len, enable_caching, enable_kv_cache_events, settings, device,
            max_num_reqs,
        )  # fmt: skip
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _optimized_core(
    config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    settings: dict[str, Any],
    device: str | None,
    max_num_reqs: int | None,
) -> Any:
    """``make_core`` of the optimized backend: a setting it does not take is refused unless
    it holds its default; it trusts vLLM's requests' hash counts."""
    from vllm.v1.request import Request as VllmRequest

    from hybridkv.optimized import TorchKVCacheManager

    parameters = inspect.signature(TorchKVCacheManager.__init__).parameters
    for name, value in settings.items():
        default = {"hash_block_size": None, "max_in_flight_tokens": None}.get(name)
        if name not in parameters and value not in (default, False, 0):
            raise UnsupportedSetting(
                f"{name}={value!r} with backend='optimized'",
                "the optimized backend does not take it yet",
            )
    kwargs = {name: value for name, value in settings.items() if name in parameters}
    if device is not None:
        kwargs["device"] = device
    if max_num_reqs is not None:
        kwargs["max_num_reqs"] = max_num_reqs
    core = TorchKVCacheManager(
        config, max_model_len, enable_caching, enable_kv_cache_events, **kwargs
    )
    # vLLM's scheduler hashes its requests at the hash block size it gives the manager.
    core.trust_hash_counts(VllmRequest)
    return core
