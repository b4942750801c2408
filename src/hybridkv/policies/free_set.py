"""The free blocks of a scored policy: smallest sort key reused first, in O(log n).

A policy that ranks free blocks by a key (a tier, a score, a release stamp) keeps them in a
binary heap with lazy deletion: a block that leaves the free set, or whose key changes, leaves
its old entry behind; an entry counts only while it equals the block's current key. The heap
is rebuilt when stale entries outnumber live ones (amortised O(1) per operation). Keys end in
the block id, so no two entries tie and the order is deterministic.

``ReleaseClock`` hands out the release stamps of vLLM's free queue: blocks released with a key
join at the tail (stamps count up), blocks without one at the head (stamps count down), a batch
keeping its walk order either way.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Key = tuple[float, ...]


class ReleaseClock:
    """Stamps ordering free blocks as vLLM's LRU free queue would (smallest reused first)."""

    def __init__(self) -> None:
        self._tail = 0
        self._head = 0

    def at_head(self, block_ids: Sequence[int]) -> list[int]:
        """Stamps before every earlier one, in walk order."""
        self._head -= len(block_ids)
        return list(range(self._head, self._head + len(block_ids)))

    def at_tail(self, block_ids: Sequence[int]) -> list[int]:
        """Stamps after every earlier one, in walk order."""
        start = self._tail
        self._tail += len(block_ids)
        return list(range(start, self._tail))


class ScoredFreeSet:
    """Free block ids by key, smallest first; ``smallest`` leaves the set as it was."""

    def __init__(self) -> None:
        self._heap: list[tuple[Key, int]] = []
        self._key: dict[int, Key] = {}

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._key

    def key(self, block_id: int) -> Key:
        return self._key[block_id]

    def put(self, block_id: int, key: Key) -> None:
        """Add ``block_id`` with ``key``, or move it to ``key`` if it is already free."""
        if self._key.get(block_id) == key:
            return
        self._key[block_id] = key
        heapq.heappush(self._heap, (key, block_id))
        if len(self._heap) > 2 * len(self._key) + 64:
            self._heap = [(k, b) for b, k in self._key.items()]
            heapq.heapify(self._heap)

    def discard(self, block_id: int) -> None:
        self._key.pop(block_id, None)

    def clear(self) -> None:
        self._heap = []
        self._key = {}

    def smallest(self, n: int) -> list[int]:
        """The ``n`` free blocks of least key, least first (fewer if fewer are free)."""
        live: list[tuple[Key, int]] = []
        seen: set[int] = set()
        while self._heap and len(live) < n:
            key, block_id = heapq.heappop(self._heap)
            if self._key.get(block_id) == key and block_id not in seen:
                seen.add(block_id)
                live.append((key, block_id))
        for entry in live:
            heapq.heappush(self._heap, entry)
        return [block_id for _, block_id in live]
