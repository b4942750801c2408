"""``lru``: vLLM 0.33's eviction order, written as a policy.

Rule (vLLM's ``FreeKVCacheBlockQueue``, ``vllm/v1/core/kv_cache_utils.py``): a block with no
holder left joins the free queue at the tail if it keeps a cached key (least recently released
is evicted first) and at the head if it does not (nothing is lost by reusing it first), a batch
at the head keeping its walk order; new blocks come from the head; a cache hit takes a block
out wherever it is.

The manager's default ``eviction_policy="lru"`` does not go through this class: the pool's own
free queue already keeps this order, at no cost. ``LRUPolicy`` exists to prove the seam: a
manager given ``LRUPolicy()`` must hand out exactly the block ids, hits and events of the
default (``tests/test_eviction_seam.py`` replays every golden trace so).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from hybridkv.policies.protocol import CachedBlock


class LRUPolicy:
    """vLLM's LRU free queue as an ordered dict of free block ids (head = reused first)."""

    name = "lru"

    def __init__(self) -> None:
        # A linked list (O(1) to prepend, remove, and reach the head): the free queue's order.
        self._free: OrderedDict[int, None] = OrderedDict()

    def cached(self, block: CachedBlock) -> None:
        """Order does not depend on keys until a block is released."""

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        for block_id in reversed(without_hash):
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        self._free.update(dict.fromkeys(with_hash))

    def touched(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._free.pop(block_id, None)

    def choose(self, n: int) -> Sequence[int]:
        return list(islice(self._free, n))

    def taken(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            del self._free[block_id]

    def uncached(self, block_id: int) -> None:
        """A block that loses its key keeps its place, as in vLLM's queue."""

    def reset(self) -> None:
        """vLLM keeps the queue's order across a reset."""
