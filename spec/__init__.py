"""The vocabulary of the hybrid KV cache manager and its documented rules as pure functions."""

from hybridkv.spec import rules
from hybridkv.spec.kv_cache_config import KVCacheConfig, KVCacheGroup, KVCacheTensor
from hybridkv.spec.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridkv.spec.spec_metadata import event_metadata, spec_kind

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheSpec",
    "KVCacheTensor",
    "MambaSpec",
    "SlidingWindowSpec",
    "event_metadata",
    "rules",
    "spec_kind",
]
