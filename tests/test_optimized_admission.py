"""Admission into the optimized manager: a lookup's own result is adopted without rechecking
each id, while any other hit is still checked id by id."""

from __future__ import annotations

import pytest

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

SIZES = {"block_size": 4, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}


def manager() -> TorchKVCacheManager:
    config = KVCacheConfig(32, (KVCacheGroup(("full",), FullAttentionSpec(**SIZES)),))
    return TorchKVCacheManager(config, 64)


def test_a_lookup_result_handed_back_is_adopted() -> None:
    m = manager()
    first = Request("a", list(range(12)), hash_block_size=4)
    assert m.allocate_slots(first, 12) == KVCacheBlocks(((1, 2, 3),))
    second = Request("b", list(range(12)), hash_block_size=4)
    hits, hit, _ = m.get_computed_blocks(second)
    assert (hits, hit) == (KVCacheBlocks(((1, 2),)), 8)
    assert m.allocate_slots(second, 4, hit, hits) == KVCacheBlocks(((4,),))
    assert m.get_block_ids("b") == ([1, 2, 4],)


@pytest.mark.parametrize("bad", [-1, 32])
def test_a_hit_the_manager_did_not_return_is_still_checked_id_by_id(bad: int) -> None:
    m = manager()
    first = Request("a", list(range(12)), hash_block_size=4)
    m.allocate_slots(first, 12)
    second = Request("b", list(range(12)), hash_block_size=4)
    hits, hit, _ = m.get_computed_blocks(second)
    forged = KVCacheBlocks(((hits.block_ids[0][0], bad),))
    with pytest.raises(ValueError, match=r"new_computed_blocks group 0 has invalid ids"):
        m.allocate_slots(second, 4, hit, forged)
    assert m.row_of("b") is None
    assert m.num_free_blocks == 28
