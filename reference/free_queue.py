"""The free queue: blocks with no holder, in eviction order (head = reused first).

A doubly linked list through the blocks themselves, with two sentinels, so that every operation
the block pool needs is O(1) per block: pop from the head (allocation), append at the tail
(a released block that keeps its cached hash: least recently released is evicted first),
insert a batch at the head (a released block with nothing worth keeping is reused first),
and remove from the middle (a cache hit takes an evictable block back).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from hybridkv.reference.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Blocks with reference count 0, head first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._length = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first ``n`` blocks (the caller checked that there are enough)."""
        if n > self._length:
            raise ValueError(f"cannot take {n} blocks from a free queue of {self._length}")
        taken: list[KVCacheBlock] = []
        for _ in range(n):
            block = self._head.next_free
            assert block is not None
            self.remove(block)
            taken.append(block)
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (a cache hit on an evictable block, or an allocation)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._length -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append at the tail, in order: these are evicted last."""
        for block in blocks:
            self._link_before(self._tail, block)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Insert at the head, keeping their order: these are reused first."""
        first = self._head.next_free
        assert first is not None
        for block in blocks:
            self._link_before(first, block)

    def _link_before(self, node: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        prev = node.prev_free
        assert prev is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = node
        node.prev_free = block
        self._length += 1
