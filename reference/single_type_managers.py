"""One manager per KV cache group, with the logic of its attention type (Implementation).

Every type shares the same life cycle: adopt cache hits, take new blocks, cache full blocks,
release what is no longer needed, free everything when the request ends. The types differ only
in three hooks, each a rule of ``hybridkv.spec.rules``:

- ``skipped_tokens``: which leading tokens the next token no longer attends to;
- ``longest_hit``: which cache hits are valid (Prefix caching, Cases 0–2);
- ``blocks_for_tokens``: how many block-table positions ``n`` tokens need.

Tables are indexable by token position: position ``i`` covers tokens ``i × block_size …``;
positions whose tokens are no longer needed hold the null block instead of being removed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.lazy_flags import LazyFlags
from hybridkv.reference.request import RequestLike
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)


class CachedFlags(LazyFlags):
    """``cached[i]``: is block ``i`` of a request cached in every one of ``group_ids``?

    A lazy view, so that a scan that stops early (left to right for full attention, right to
    left for a sliding window) asks the pool only about the blocks it visits.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_hashes: Sequence[BlockHash],
        group_ids: Sequence[int],
        length: int,
    ) -> None:
        super().__init__(length)
        self._pool = pool
        self._hashes = block_hashes
        self._group_ids = group_ids

    def flag(self, index: int) -> bool:
        return self._pool.get_cached_block(self._hashes[index], self._group_ids) is not None


class SingleTypeKVCacheManager(ABC):
    """Allocation and prefix caching for one KV cache group (one attention type)."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Positions of each request's table already entered into the prefix cache.
        self.num_cached_block: dict[str, int] = {}

    # --- The three hooks --------------------------------------------------------------------

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token does not attend to (full attention: none)."""
        return rules.full_attention_skipped_tokens(num_computed_tokens)

    @abstractmethod
    def longest_hit(self, cached: Sequence[bool], max_length: int) -> tuple[int, int]:
        """``(hit blocks, first real block)`` of the longest valid hit of at most ``max_length``."""

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Table positions ``num_tokens`` tokens need."""
        return rules.attention_blocks_for_tokens(num_tokens, self.block_size)

    def skipped_positions(self, num_computed_tokens: int) -> int:
        """Leading table positions that need no block: whole blocks of skipped tokens."""
        skipped = self.skipped_tokens(num_computed_tokens)
        return rules.skipped_block_positions(skipped, self.block_size)

    # --- Cache hits -------------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest hit of at most ``max_length`` tokens, looked up jointly in ``group_ids``.

        Returns one list per group: null blocks for positions the hit needs no KV for, then
        the cached blocks.
        """
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        cached = CachedFlags(self.block_pool, block_hashes, group_ids, max_num_blocks)
        num_hit, first_real = self.longest_hit(cached, max_length)
        hits = tuple([self.block_pool.null_block] * first_real for _ in group_ids)
        for index in range(first_real, num_hit):
            found = self.block_pool.get_cached_block(block_hashes[index], group_ids)
            assert found is not None
            for group_hits, block in zip(hits, found, strict=True):
                group_hits.append(block)
        return hits

    # --- Allocation -------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> int:
        """Free blocks this group would consume to hold ``num_tokens`` tokens.

        A running request needs the positions its table lacks. A request being admitted sets
        aside its skipped positions (no block), adopts its hits, and needs the rest; a hit that
        sits in the free queue counts as consumed, since adopting it takes it out.
        """
        required = self.blocks_for_tokens(num_tokens)
        table = self.get_blocks(request_id)
        if table:
            return max(required - len(table), 0)
        skipped = self.skipped_positions(num_computed_tokens)
        num_new = max(required - max(skipped, len(new_computed_blocks)), 0)
        evictable = sum(
            1 for block in new_computed_blocks[skipped:] if block.ref_cnt == 0 and not block.is_null
        )
        return num_new + evictable

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> None:
        """Admit a request: null positions for its skipped tokens, then its adopted hits."""
        if request_id in self.req_to_blocks:
            return
        skipped = self.skipped_positions(num_computed_tokens)
        adopted = list(new_computed_blocks[skipped:])
        self.block_pool.touch(adopted)
        table = [self.block_pool.null_block] * skipped + adopted
        self.req_to_blocks[request_id] = table
        # Hits are cached already; nulls hold nothing to cache.
        self.num_cached_block[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extend the table with new blocks up to the positions ``num_tokens`` tokens need."""
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = self.blocks_for_tokens(num_tokens) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: RequestLike, num_tokens: int) -> None:
        """Enter the table's full blocks covered by ``num_tokens`` tokens into the prefix cache."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            block_size=self.block_size,
            group_id=self.group_id,
        )
        self.num_cached_block[request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks of tokens no longer needed; their positions become null.

        Walks from the last skipped position down and stops at the first null one: everything
        before it was released by an earlier call.
        """
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        skipped = min(self.skipped_positions(num_computed_tokens), len(table))
        released: list[KVCacheBlock] = []
        for index in range(skipped - 1, -1, -1):
            if table[index].is_null:
                break
            released.append(table[index])
            table[index] = self.block_pool.null_block
        self.block_pool.free_blocks(released)

    def free(self, request_id: str) -> None:
        """Release the whole table, last position first, so the tail is evicted first."""
        table = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(table[::-1])
        self.num_cached_block.pop(request_id, None)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every token is needed; a hit is a cached prefix (Prefix caching, Case 0)."""

    def longest_hit(self, cached: Sequence[bool], max_length: int) -> tuple[int, int]:
        return rules.full_attention_hit_blocks(cached, len(cached)), 0


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: tokens leave the window; a hit needs only the last ``window − 1`` tokens
    cached (Prefix caching, Case 1)."""

    spec: SlidingWindowSpec

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return rules.sliding_window_skipped_tokens(num_computed_tokens, self.spec.sliding_window)

    def longest_hit(self, cached: Sequence[bool], max_length: int) -> tuple[int, int]:
        needed = rules.sliding_window_hit_blocks_needed(self.spec.sliding_window, self.block_size)
        return rules.sliding_window_hit_blocks(cached, needed)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: only the current chunk is needed, for allocation and for hits."""

    spec: ChunkedLocalAttentionSpec

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.spec.attention_chunk_size
        return rules.chunked_local_skipped_tokens(num_computed_tokens, chunk)

    def longest_hit(self, cached: Sequence[bool], max_length: int) -> tuple[int, int]:
        chunk = self.spec.attention_chunk_size
        return rules.chunked_local_hit_blocks(cached, max_length, self.block_size, chunk)


class MambaManager(SingleTypeKVCacheManager):
    """Mamba: one state block per request, whatever its length (Allocation, Case 4).

    The state block is never released before the request ends, and it never hits: prefix
    caching with Mamba is not supported yet (Prefix caching, Case 3).
    """

    spec: MambaSpec

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return rules.mamba_skipped_tokens(num_computed_tokens)

    def skipped_positions(self, num_computed_tokens: int) -> int:
        # The one position holds the state itself, not the KV of skipped tokens.
        return 0

    def longest_hit(self, cached: Sequence[bool], max_length: int) -> tuple[int, int]:
        return 0, 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return rules.mamba_blocks_for_tokens(num_tokens)


def manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager of a spec's attention type."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, MambaSpec):
        return MambaManager
    assert isinstance(spec, FullAttentionSpec)
    return FullAttentionManager
