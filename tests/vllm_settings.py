"""The manager settings the tests comparing hybridkv with vLLM's own manager share: 16-token
hash and scheduler blocks, 512-token sequences, KV events on (read only: copy to change)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

SETTINGS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "enable_kv_cache_events": True,
    }
)
