"""One manager per KV cache group, with the logic of its attention type (Implementation).

The layer below the coordinator, as the design document draws it: ``SingleTypeKVCacheManager``
(``single_type_base``: the life cycle every type shares, and the hooks a type overrides), the
attention types' managers (``attention_managers``: full attention, sliding window, chunked
local, cross-attention) and Mamba's (``mamba_manager``, its caching half in ``mamba_caching``).
``MANAGERS`` maps a spec's ``kind`` to its manager; this module re-exports the layer's names.
"""

from __future__ import annotations

from hybridkv.reference.attention_managers import (
    CachedFlags,
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from hybridkv.reference.mamba_manager import MambaManager
from hybridkv.reference.single_type_base import (
    SKIPPED_TOKENS,
    BlocksPerGroup,
    SingleTypeKVCacheManager,
    prompt_tokens,
    shared_prefix_boundary,
)
from hybridkv.spec import KVCacheSpec

__all__ = [
    "MANAGERS",
    "SKIPPED_TOKENS",
    "BlocksPerGroup",
    "CachedFlags",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "manager_class",
    "prompt_tokens",
    "shared_prefix_boundary",
]

MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {
    "full": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalAttentionManager,
    "cross_attention": CrossAttentionManager,
    "mamba": MambaManager,
}
"""The manager of each attention type, by ``spec.kind``."""


def manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager of a spec's attention type."""
    return MANAGERS[spec.kind]
