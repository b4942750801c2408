"""The free queue's order: hashed blocks to the tail (LRU), unhashed ones to the head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from hybridkv.reference import Request
from hybridkv.reference.free_queue import FreeKVCacheBlockQueue
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

if TYPE_CHECKING:
    from conftest import ManagerFactory

SPEC = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype_bytes=4)


def test_released_blocks_go_to_the_tail_if_hashed_else_to_the_head(
    make_manager: ManagerFactory,
) -> None:
    """Freeing [1,2,3,4] (4 unhashed), then [1,2,3,5] (5 unhashed), from a queue [6 … 10]
    gives [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]."""
    m = make_manager(KVCacheConfig(11, (KVCacheGroup(("l0",), SPEC),)), max_model_len=64)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], hash_block_size=2)
    assert m.allocate_slots(a, 7) is not None
    b = Request("b", [1, 2, 3, 4, 5, 6, 8], hash_block_size=2)
    hit, num_hit, _ = m.get_computed_blocks(b)
    assert (hit.get_block_ids(), num_hit) == (([1, 2, 3],), 6)
    assert m.allocate_slots(b, 1, num_hit, hit) is not None
    assert m.get_block_ids("a") == ([1, 2, 3, 4],)
    assert m.get_block_ids("b") == ([1, 2, 3, 5],)
    assert m.snapshot().free_block_ids == (6, 7, 8, 9, 10)

    m.free(a)
    assert m.snapshot().free_block_ids == (4, 6, 7, 8, 9, 10)
    m.free(b)
    assert m.snapshot().free_block_ids == (5, 4, 6, 7, 8, 9, 10, 3, 2, 1)
    m.check_invariants()


def test_prepend_keeps_the_batch_order_and_remove_is_anywhere() -> None:
    """Reference only: the reference's linked list itself (the optimized backend keeps its
    queue in tensors; the test above pins the order the two share)."""
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks[1:3])
    queue.prepend_n([blocks[4], blocks[3]])
    queue.append_n([blocks[5]])
    assert [b.block_id for b in queue] == [4, 3, 1, 2, 5]
    queue.remove(blocks[1])
    assert [b.block_id for b in queue.popleft_n(2)] == [4, 3]
    assert [b.block_id for b in queue] == [2, 5]
    assert len(queue) == 2


def _queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_an_empty_free_queue_takes_blocks_at_either_end() -> None:
    """The two sentinels make the empty queue an ordinary one: prepend and append both work."""
    queue = FreeKVCacheBlockQueue([])
    assert (len(queue), _queue_ids(queue)) == (0, [])
    blocks = [KVCacheBlock(i) for i in range(1, 5)]
    queue.prepend_n(blocks[:2])
    queue.append_n(blocks[2:3])
    queue.prepend_n(blocks[3:])
    assert (len(queue), _queue_ids(queue)) == (4, [4, 1, 2, 3])


def test_taking_more_blocks_than_the_free_queue_holds_is_refused_and_changes_nothing() -> None:
    blocks = [KVCacheBlock(i) for i in range(1, 4)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match=r"^cannot take 4 blocks from a free queue of 3$"):
        queue.popleft_n(4)
    assert (len(queue), _queue_ids(queue)) == (3, [1, 2, 3])
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 2, 3]
    assert (len(queue), _queue_ids(queue)) == (0, [])


def test_removing_a_block_that_is_not_free_is_refused() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(1)])
    with pytest.raises(ValueError, match=r"^block 7 is not in the free queue$"):
        queue.remove(KVCacheBlock(7))
    assert (len(queue), _queue_ids(queue)) == (1, [1])


def test_a_block_cannot_be_in_the_free_queue_twice() -> None:
    block = KVCacheBlock(3)
    queue = FreeKVCacheBlockQueue([KVCacheBlock(1), block])
    for insert in (queue.append_n, queue.prepend_n):
        with pytest.raises(ValueError, match=r"^block 3 is already in the free queue$"):
            insert([block])
    assert (len(queue), _queue_ids(queue)) == (2, [1, 3])
