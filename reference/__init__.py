"""The readable reference implementation: the planner and the KV cache manager.

Layers, as the design document names them: ``KVCacheManager`` (the scheduler's interface) →
a coordinator (no prefix cache / unitary / hybrid) → one single-type manager per KV cache group
(full attention, sliding window, chunked local, Mamba) → one ``BlockPool``.
"""

from hybridkv.reference.block_hash import BlockHash, hash_block_tokens
from hybridkv.reference.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    PrefixCacheStats,
)
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.kv_cache_manager import KVCacheManager
from hybridkv.reference.plan_report import GroupPlan, PlanReport, plan_report
from hybridkv.reference.planner import plan_groups, plan_kv_cache
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.request_keys import LoRA, MultiModalFeature, PromptEmbeds
from hybridkv.reference.snapshot import PoolSnapshot

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "GroupPlan",
    "KVCacheBlocks",
    "KVCacheEvent",
    "KVCacheManager",
    "LoRA",
    "MultiModalFeature",
    "PlanReport",
    "PoolSnapshot",
    "PrefixCacheStats",
    "PromptEmbeds",
    "Request",
    "RequestLike",
    "hash_block_tokens",
    "plan_groups",
    "plan_kv_cache",
    "plan_report",
]
