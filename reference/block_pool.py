"""The block pool: every block of the single memory pool, the free queue and the prefix cache.

The design document (Allocation, "High level idea") uses one pool of equally sized pages for all
attention types; KV cache groups differ only in how many blocks they take. The prefix cache is
one mapping ``(block hash, group id) -> blocks`` (Prefix caching, "High level idea"), so the same
tokens are cached, found and evicted independently per group, and one LRU free queue serves
every group (Prefix caching, Case 2: "one LRU queue for all KV cache groups").

Blocks are cached lazily: a released block keeps its hash while it waits in the free queue, and
loses it only when it is taken for new tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.policies.guard import GuardedPolicy
from hybridkv.policies.protocol import EvictionPolicy
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.reference.free_queue import FreeKVCacheBlockQueue
from hybridkv.reference.kv_cache_block import BlockHashWithGroupId, KVCacheBlock
from hybridkv.reference.request import RequestLike
from hybridkv.spec import KVCacheSpec
from hybridkv.spec.errors import InvariantError, require


def hashes_at_block_size(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """The request's hashes viewed at ``block_size``: every hash chains over its whole prefix,
    so a larger block's key is the hash at its last hash boundary (hash block 16, block 32:
    hashes 1, 3, 5, …)."""
    if block_size == hash_block_size:
        return block_hashes
    scale = block_size // hash_block_size
    return block_hashes[scale - 1 :: scale]


class BlockPool:
    """Blocks ``0 … num_blocks − 1``; block 0 is the null block and is never free.

    With ``enable_kv_cache_events``, ``event_builder`` (required then) builds the events in
    vLLM's schema from the groups' specs and the lookahead setting.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        hash_block_size: int = 1,
        num_hash_lookahead_tokens: int = 0,
        event_builder: EventBuilder | None = None,
        eviction_policy: EvictionPolicy | None = None,
        group_specs: Sequence[KVCacheSpec] = (),
    ) -> None:
        if enable_kv_cache_events and event_builder is None:
            raise ValueError("enable_kv_cache_events needs an event_builder (the groups' specs)")
        self.num_blocks = num_blocks
        # Tokens per block hash, and the tokens after a block that its hash also covers.
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.event_builder = event_builder
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Insertion-ordered: a lookup returns the first block cached under a key.
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        # Keys of a block beside its primary one (a partial entry next to a full-block key).
        self.extra_keys_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self.events: list[KVCacheEvent] = []
        # ``None``: vLLM's order, kept by the free queue itself. A policy chooses the victims;
        # the queue still holds the free set (O(1) membership and removal).
        self.policy = (
            None if eviction_policy is None else GuardedPolicy(eviction_policy, group_specs)
        )
        if self.policy is not None:
            self.policy.released([block.block_id for block in self.blocks[1:]], [])

    # --- Free blocks ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of the blocks that can ever be used (all but the null block) in use."""
        return 1.0 - (self.num_free_blocks / (self.num_blocks - 1))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue (or the policy's choice),
        evicting their cached hashes."""
        if self.policy is None:
            blocks = self.free_block_queue.popleft_n(num_blocks)
        else:
            blocks = self._policy_victims(num_blocks)
        for block in blocks:
            self._remove_cached_block_hashes(block)
            block.ref_cnt += 1
        return blocks

    def _policy_victims(self, num_blocks: int) -> list[KVCacheBlock]:
        """The policy's victims, checked before any leaves the free queue."""
        assert self.policy is not None
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot take {num_blocks} blocks from a free queue of {self.num_free_blocks}"
            )

        def is_free(block_id: int) -> bool:
            return 0 < block_id < self.num_blocks and self.blocks[block_id].ref_cnt == 0

        blocks = [self.blocks[i] for i in self.policy.choose(num_blocks, is_free)]
        for block in blocks:
            self.free_block_queue.remove(block)
        self.policy.taken([block.block_id for block in blocks])
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A cache hit adopts ``blocks``: one more holder each; evictable ones leave the queue."""
        touched: list[int] = []
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            touched.append(block.block_id)
        if self.policy is not None:
            self.policy.touched(touched)

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one holder of each block, walked in eviction order.

        Blocks left with no holder join the free queue: those holding a cached hash at the tail
        in walk order (kept as long as possible, least recently released evicted first), the
        others at the head keeping walk order (nothing to lose by reusing them first).
        """
        keep: list[KVCacheBlock] = []
        reuse_first: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                cached = block.block_hash is not None and self.enable_caching
                (keep if cached else reuse_first).append(block)
        self.free_block_queue.prepend_n(reuse_first)
        self.free_block_queue.append_n(keep)
        if self.policy is not None:
            self.policy.released(
                [block.block_id for block in reuse_first], [block.block_id for block in keep]
            )

    # --- Prefix cache -----------------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in each group, or ``None`` if any group misses.

        Groups with equal specs are looked up together: a position is a hit only if every one
        of them still holds it.
        """
        found: list[KVCacheBlock] = []
        for group_id in group_ids:
            blocks = self.cached_block_hash_to_block.get((block_hash, group_id))
            if not blocks:
                return None
            found.append(next(iter(blocks.values())))
        return found

    def cache_full_blocks(
        self,
        request: RequestLike,
        blocks: Sequence[KVCacheBlock],
        *,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Enter positions ``num_cached_blocks … num_full_blocks − 1`` of a table into the cache.

        Null positions are skipped: they hold no KV; so are positions ``block_mask`` rules out
        (blocks no cache hit can ever use, under sparse retention). A block whose tokens are
        already cached under another block is cached too; lookups keep returning the first. A
        block that already holds a partial entry (a hash boundary inside it) trades it for its
        full-block key.
        """
        hashes = hashes_at_block_size(request.block_hashes, self.hash_block_size, block_size)
        new_hashes: list[BlockHash] = []
        positions: list[int] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null or (
                block_mask is not None and not block_mask[index - num_cached_blocks]
            ):
                continue
            if block.block_hash is not None:
                self._trade_keys(block)
            self._insert_block_hash((hashes[index], group_id), block, (index + 1) * block_size)
            new_hashes.append(hashes[index])
            positions.append(index)
            if self.policy is not None:
                parent_hash = hashes[index - 1] if index else None
                self.policy.cached(
                    block.block_id, hashes[index], group_id, parent_hash, (index + 1) * block_size
                )
        if self.event_builder is not None and self.enable_kv_cache_events:
            parent = hashes[num_cached_blocks - 1] if num_cached_blocks else None
            self.events.append(
                self.event_builder.stored(
                    request,
                    new_hashes,
                    positions,
                    parent,
                    num_cached_blocks * block_size,
                    num_full_blocks * block_size,
                    block_size,
                    group_id,
                )
            )

    def cache_partial_block(
        self,
        request: RequestLike,
        block: KVCacheBlock,
        *,
        num_tokens: int,
        group_id: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make ``block`` reachable from the hash boundary at ``num_tokens`` inside it.

        The key is the request's hash at that boundary (every hash chains over its whole
        prefix). A block holding a shorter entry trades it for this one; with
        ``replace_existing_hashes`` (its contents were replaced) it drops every entry first.
        Returns the key, or ``None`` for the null block.
        """
        if block.is_null:
            return None
        key = (request.block_hashes[num_tokens // self.hash_block_size - 1], group_id)
        entry = self.cached_block_hash_to_block.get(key, {})
        already = block.block_hash == key or block.block_id in entry
        if replace_existing_hashes:
            self._trade_keys(block)
            already = False
        elif (
            not already
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_tokens
        ):
            self._trade_keys(block)
        self._insert_block_hash(key, block, num_tokens)
        if self.policy is not None and not already:
            index = num_tokens // self.hash_block_size - 1
            parent_hash = request.block_hashes[index - 1] if index else None
            self.policy.cached(block.block_id, key[0], group_id, parent_hash, num_tokens)
        if self.event_builder is not None and self.enable_kv_cache_events and not already:
            hbs = self.hash_block_size
            start = num_tokens - hbs
            parent = request.block_hashes[start // hbs - 1] if start else None
            self.events.append(
                self.event_builder.stored(
                    request, (key[0],), (start // hbs,), parent, start, num_tokens, hbs, group_id
                )
            )
        return key

    def _insert_block_hash(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int
    ) -> None:
        """Enter ``key → block``: as the block's primary key if it has none, else beside it."""
        if block.block_hash == key:
            return
        entry = self.cached_block_hash_to_block.setdefault(key, {})
        if block.block_id in entry:
            return
        if block.block_hash is None:
            block.block_hash = key
            block.block_hash_num_tokens = num_tokens
        else:
            self.extra_keys_by_block.setdefault(block.block_id, set()).add(key)
        entry[block.block_id] = block

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """Drop every key of ``block`` from the cache (announcing each); return them."""
        keys: list[BlockHashWithGroupId] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        keys.extend(self.extra_keys_by_block.pop(block.block_id, ()))
        removed: list[BlockHashWithGroupId] = []
        for key in keys:
            entry = self.cached_block_hash_to_block.get(key)
            if entry is None or entry.pop(block.block_id, None) is None:
                continue
            if not entry:
                del self.cached_block_hash_to_block[key]
            removed.append(key)
        block.block_hash = None
        block.block_hash_num_tokens = None
        builder = self.event_builder
        if self.enable_kv_cache_events and builder is not None:
            self.events.extend(builder.removed(key[0], key[1]) for key in removed)
        return removed

    def _trade_keys(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s keys before it takes another (a partial entry traded for a full
        one, a Mamba checkpoint replaced): the policy hears that the old keys are gone."""
        if self._remove_cached_block_hashes(block) and self.policy is not None:
            self.policy.uncached(block.block_id)

    def maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Forget every cached key of ``block`` (this block only); whether it held any."""
        removed = bool(self._remove_cached_block_hashes(block))
        if removed and self.policy is not None:
            self.policy.uncached(block.block_id)
        return removed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no request holds a block; keep the queue order."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        self.extra_keys_by_block = {}
        for block in self.blocks:
            block.block_hash = None
            block.block_hash_num_tokens = None
        if self.enable_kv_cache_events and self.event_builder is not None:
            self.events.append(self.event_builder.cleared())
        if self.policy is not None:
            self.policy.reset()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    # --- Invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool's own bookkeeping is inconsistent.

        Tests call it after every step, so each check gathers its offenders with one
        comprehension or set comparison and formats a message only when it fails.
        """
        self._check_free_queue()
        self._check_cache_entries()
        require(self.null_block.block_hash is None, "the null block holds a hash")

    def _check_free_queue(self) -> None:
        """The free queue holds each block of reference count 0 once and nothing else (never
        the null block); no count is negative."""
        free = [block.block_id for block in self.free_block_queue]
        free_set = set(free)
        if len(free_set) != len(free):
            raise InvariantError(f"free queue holds a block twice: {free}")
        require(0 not in free_set, "the null block is in the free queue")
        blocks = self.blocks[1:]
        zero = {block.block_id for block in blocks if block.ref_cnt == 0}
        if free_set != zero:
            raise InvariantError(f"free queue {sorted(free)} != count-0 blocks {sorted(zero)}")
        require(
            min([block.ref_cnt for block in blocks], default=0) >= 0, "a negative reference count"
        )

    def _check_cache_entries(self) -> None:
        """Every cache entry is non-empty and points at blocks that hold its key (as their
        primary key or beside it), and every key a block holds has its entry (counted)."""
        entries = self.cached_block_hash_to_block
        empty = [key for key, blocks in entries.items() if not blocks]
        if empty:
            raise InvariantError(f"an empty cache entry for group {empty[0][1]}")
        extra = self.extra_keys_by_block
        stray = [
            (key, block_id)
            for key, blocks in entries.items()
            for block_id, block in blocks.items()
            if block.block_id != block_id
            or (block.block_hash != key and key not in extra.get(block_id, ()))
        ]
        if stray:
            (_, group_id), block_id = stray[0]
            raise InvariantError(
                f"cache entry of group {group_id} points at block {block_id} holding another key"
            )
        cached = sum(map(len, entries.values()))
        hashed = len([block for block in self.blocks if block.block_hash is not None])
        hashed += sum(map(len, extra.values()))
        require(hashed == cached, f"{hashed} blocks hold a hash but {cached} are in the cache")
