"""``KVCacheBlocks`` has vLLM's surface; the manager takes vLLM's extra allocation settings."""

from __future__ import annotations

import pytest

from hybridkv.reference import KVCacheBlocks, KVCacheManager, Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4)
SLIDING = SlidingWindowSpec(
    block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4, sliding_window=8
)
CONFIG = KVCacheConfig(12, (KVCacheGroup(("full",), FULL), KVCacheGroup(("sw",), SLIDING)))


def test_get_block_ids_selects_groups_and_allows_none() -> None:
    blocks = KVCacheBlocks(((1, 2), ()))
    assert blocks.get_block_ids() == ([1, 2], [])
    assert blocks.get_block_ids(group_ids=[1]) == ([],)
    assert blocks.get_block_ids(allow_none=True, group_ids=[1]) is None
    assert blocks.get_block_ids(allow_none=True) == ([1, 2], [])
    assert (blocks + KVCacheBlocks(((3,), (4,)))).block_ids == ((1, 2, 3), (4,))
    assert blocks.new_empty() == KVCacheBlocks.empty(2)


def test_reserved_and_watermark_blocks_gate_the_allocation() -> None:
    manager = KVCacheManager(CONFIG, 64)
    request = Request("r", list(range(16)), hash_block_size=4)
    # 16 tokens: 4 full-attention blocks + 4 sliding-window blocks; 11 are free.
    assert manager.allocate_slots(request, 16, reserved_blocks=4) is None
    assert manager.allocate_slots(request, 16, watermark_blocks=4) is None
    assert manager.num_free_blocks == 11
    assert manager.allocate_slots(request, 16, reserved_blocks=2, watermark_blocks=1) is not None
    with pytest.raises(ValueError, match="reserved_blocks"):
        manager.allocate_slots(request, 1, reserved_blocks=-1)


def test_max_cache_hit_length_and_estimate_cached_tokens() -> None:
    manager = KVCacheManager(CONFIG, 64)
    first = Request("a", list(range(16)), hash_block_size=4)
    manager.allocate_slots(first, 16)
    assert manager.estimate_cached_tokens("a") == 16
    manager.free(first)
    second = Request("b", list(range(16)), hash_block_size=4)
    _, hit, _ = manager.get_computed_blocks(second)
    assert hit == 12
    _, capped, _ = manager.get_computed_blocks(second, max_cache_hit_length=8)
    assert capped == 8
    assert manager.estimate_cached_tokens("unknown") == 0


def test_without_prefix_caching_the_coordinator_finds_no_hit() -> None:
    manager = KVCacheManager(CONFIG, 64, enable_caching=False)
    request = Request("r", list(range(16)), hash_block_size=4)
    assert manager.coordinator.find_longest_cache_hit(request.block_hashes, 16) == (([], []), 0, 0)
    assert manager.get_computed_blocks(request) == (KVCacheBlocks.empty(2), 0, 0)
