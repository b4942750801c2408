"""``KVCacheManager``: the scheduler's interface to the KV cache (Implementation, first layer).

The scheduler asks two questions per request and step: how much of this prompt is cached
(``get_computed_blocks``), and can the next tokens get slots (``allocate_slots``, ``None`` when
the pool is short). Everything else (groups, attention types, the block pool) stays behind the
coordinator.

Every call validates its input before it changes anything: a rejected call, like a failed
allocation, leaves the state as it was (a failed allocation still releases the blocks that left
a sliding window or chunk, exactly as a successful one would have).
"""

from __future__ import annotations

from collections import Counter

from hybridkv.reference.coordinator import BlocksPerGroup, make_coordinator
from hybridkv.reference.events import KVCacheEvent, PrefixCacheStats
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.reference.snapshot import PoolSnapshot
from hybridkv.reference.validation import (
    check_allocation,
    check_block_hashes,
    check_cache_blocks,
    validate_manager_config,
)
from hybridkv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, SlidingWindowSpec
from hybridkv.spec.errors import require


class KVCacheManager:
    """Allocation and prefix caching for every KV cache group of one model."""

    def __init__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        validate_manager_config(config, max_model_len, enable_caching)
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_size = config.groups[0].spec.block_size
        self.coordinator = make_coordinator(
            config, enable_caching=enable_caching, enable_kv_cache_events=enable_kv_cache_events
        )
        self.block_pool = self.coordinator.block_pool
        self.num_groups = len(config.groups)
        self._stats = PrefixCacheStats()

    # --- The scheduler's calls --------------------------------------------------------------

    def get_computed_blocks(self, request: RequestLike) -> tuple[KVCacheBlocks, int]:
        """The request's longest cache hit: its blocks per group and its length in tokens.

        The last token is always recomputed (its logits are needed), so a hit is at most
        ``num_tokens − 1`` tokens long.
        """
        if not self.enable_caching:
            return KVCacheBlocks.empty(self.num_groups), 0
        check_block_hashes(request, self.block_size)
        max_cache_hit_length = request.num_tokens - 1
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        self._stats = self._stats.record(request.num_tokens, num_hit_tokens)
        block_ids = tuple(tuple(block.block_id for block in blocks) for blocks in hits)
        return KVCacheBlocks(block_ids), num_hit_tokens

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (and lookahead), or ``None`` if they do not fit.

        ``num_new_computed_tokens`` and ``new_computed_blocks`` are a cache hit from
        ``get_computed_blocks`` that a request being admitted adopts. Returns the new blocks
        per group.
        """
        hits = self._validate_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
        )
        request_id = request.request_id
        num_computed_tokens = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        # Release out-of-window blocks first: they may be exactly what this step needs.
        self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hits, num_computed_tokens
        )
        if num_blocks_to_allocate > self.block_pool.num_free_blocks:
            return None
        self.coordinator.allocate_new_computed_blocks(request_id, hits, num_computed_tokens)
        new_blocks = self.coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks:
            # Lookahead slots hold tokens that may be rejected: cache only real tokens.
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(tuple(tuple(b.block_id for b in blocks) for blocks in new_blocks))

    def free(self, request: RequestLike) -> None:
        """Release every block of a finished, aborted or preempted request (a no-op if none)."""
        self.coordinator.free(request.request_id)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Enter the request's full blocks up to ``num_computed_tokens`` into the prefix cache
        (for callers that delayed caching, e.g. while KV arrives from another engine)."""
        check_cache_blocks(request, num_computed_tokens)
        if self.enable_caching:
            check_block_hashes(request, self.block_size)
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block table per group (empty lists for an unknown request)."""
        tables = self.coordinator.get_blocks(request_id)
        return tuple([block.block_id for block in table] for table in tables)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (``False``) while any request holds a block."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats = self._stats.after_reset()
        return True

    # --- Observation ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call (empty unless events are enabled)."""
        return self.block_pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookup statistics since the last call; the counters restart."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def snapshot(self) -> PoolSnapshot:
        """The pool's observable state as one comparable value."""
        pool = self.block_pool
        cached: list[list[int]] = [[] for _ in range(self.num_groups)]
        for (_, group_id), blocks in pool.cached_block_hash_to_block.items():
            cached[group_id].extend(blocks)
        return PoolSnapshot(
            free_block_ids=tuple(block.block_id for block in pool.free_block_queue),
            ref_counts={b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt > 0},
            cached_block_ids=tuple(tuple(sorted(ids)) for ids in cached),
            num_cached_keys=len(pool.cached_block_hash_to_block),
        )

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool and the managers disagree (tests call it after
        every step): reference counts equal holders, no block in two groups, nulls only where
        a window or chunk released them."""
        self.block_pool.check_invariants()
        holders: Counter[int] = Counter()
        owner_group: dict[int, int] = {}
        for manager in self.coordinator.managers:
            for request_id, table in manager.req_to_blocks.items():
                _check_null_prefix(manager.spec, request_id, [b.block_id for b in table])
                for block in table:
                    if block.is_null:
                        continue
                    holders[block.block_id] += 1
                    group = owner_group.setdefault(block.block_id, manager.group_id)
                    require(
                        group == manager.group_id,
                        f"block {block.block_id} is in groups {group} and {manager.group_id}",
                    )
        for block in self.block_pool.blocks[1:]:
            count = holders[block.block_id]
            require(
                block.ref_cnt == count,
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {count} holders",
            )

    # --- Validation (hybridkv.reference.validation) ------------------------------------------

    def _validate_allocation(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
    ) -> BlocksPerGroup:
        """Check every argument; return the adopted hits as blocks per group."""
        hit_ids = check_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            config=self.config,
            enable_caching=self.enable_caching,
            holds_blocks=lambda request_id: any(self.get_block_ids(request_id)),
        )
        blocks = self.block_pool.blocks
        return tuple([blocks[i] for i in ids] for ids in hit_ids)


def _check_null_prefix(spec: object, request_id: str, table: list[int]) -> None:
    """Null positions come first: a window or chunk releases from the front only."""
    nulls = [i for i, block_id in enumerate(table) if block_id == 0]
    if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
        require(
            nulls == list(range(len(nulls))),
            f"request {request_id!r} has null positions {nulls} after a real block",
        )
    else:
        require(not nulls, f"request {request_id!r} of a full/Mamba group holds null blocks")
