"""Keys beyond one per block: a block's extra prefix-cache entries (hash views, partial entries).

A block keeps one *primary* entry in the hash table's chains and, beside it, rare *extra* keys
(a prompt-tail partial entry next to a full-block key, as the reference's
``extra_keys_by_block``). Being rare, they live in two Python dicts kept by the prefix cache
(``hybridkv.optimized.prefix_cache``)::

    extras[block]       {(key, group, hash index): source}, in insertion order
    extra_index[key]    {block: (insertion counter, the primary holders of the key cached
                        before it and still cached since)}

so that a lookup, which probes one by one while any exists, returns the first-inserted
verified block among the primary and extra entries of a key: an extra comes right after the
primaries cached before it. ``evict`` forgets both kinds of a block's keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.optimized._buffers import BlockRecords
from hybridkv.optimized.prefix_cache import PrefixCache
from hybridkv.optimized.sources import hash_key
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.spec.errors import require


class ExtraKeys(PrefixCache):
    """The prefix cache with extra keys per block (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        enable_kv_cache_events: bool,
        event_builder: EventBuilder | None,
        records: BlockRecords,
    ) -> None:
        super().__init__(num_blocks, num_groups, enable_kv_cache_events, event_builder, records)
        self._extra_count = 0  # extras made: their insertion order

    def holds_key(self, block: int, src: int, hidx: int, group_id: int) -> bool:
        """Whether ``block`` is cached under the hash at ``hidx`` of source ``src`` (primary or
        extra key, compared by hash value)."""
        if self.src.a[block] < 0:
            return False
        block_hash = self.source(src).hashes[hidx]
        tag = self.hk.a[block] & 0xFFFFFFFF
        if tag % self.num_groups == group_id and self.block_hash(block) == block_hash:
            return True
        for (_, g, h), s in self.extras.get(block, {}).items():
            if g == group_id and self.source(s).hashes[h] == block_hash:
                return True
        return False

    def insert_key(self, block: int, src: int, hidx: int, group_id: int) -> None:
        """``BlockPool._insert_block_hash``: the block's primary key if it has none, else an
        extra one (nothing if it holds the key already)."""
        if self.holds_key(block, src, hidx, group_id):
            return
        block_hash = self.source(src).hashes[hidx]
        if self.src.a[block] < 0:
            self.insert(block, block_hash, group_id, hidx, src, 1)
            return
        key = (hash_key(block_hash), group_id, hidx)
        before = set(self.candidates(*key))
        self.extras.setdefault(block, {})[key] = src
        self.extra_index.setdefault(key, {})[block] = (self._extra_count, before)
        self._extra_count += 1
        self.source(src).refs += 1
        if self.policy is not None:
            self.heard_cached(block, group_id, hidx, src, 1)

    def remove_keys(self, block: int, events: list[KVCacheEvent] | None = None) -> bool:
        """Forget every key of the block (primary first, then extras in insertion order);
        whether it held any."""
        if self.src.a[block] < 0:
            return False
        self.evict(block, events)
        if self.policy is not None:
            self.policy.uncached(block)  # not reused: the policy hears the keys are gone
        return True

    def _drop_extras(self, block: int, events: list[KVCacheEvent] | None) -> None:
        extras = self.extras.pop(block, None)
        if not extras:
            return
        for key, src in extras.items():
            holders = self.extra_index[key]
            del holders[block]
            if not holders:
                del self.extra_index[key]
            source = self.source(src)
            if self.event_builder is not None and self.enable_kv_cache_events:
                removed = self.event_builder.removed(source.hashes[key[2]], key[1])
                (self.events if events is None else events).append(removed)
            source.refs -= 1
            self.maybe_drop_source(src)

    def evict(self, block: int, events: list[KVCacheEvent] | None = None) -> None:
        """Forget the block's cached hash (this block only), and its extra keys."""
        self.evict_primary(block, events)
        if self.extras:
            self._drop_extras(block, events)

    def evict_each(self, blocks: Sequence[int]) -> None:
        """``evict`` of each block in turn (their events to the event list): with no extra
        key anywhere (evicting makes none), the primary entries in one pass."""
        if not self.extras:
            self.evict_primaries(blocks)
            return
        for block in blocks:
            self.evict(block)

    def num_cached_keys(self) -> int:
        keys: set[tuple[bytes, int]] = set()
        for group_id, blocks in enumerate(self.cached_blocks()):
            keys.update((self.block_hash(b), group_id) for b in blocks)
        for extras in self.extras.values():
            for (_, g, h), src in extras.items():
                keys.add((self.source(src).hashes[h], g))
        return len(keys)

    def check_extras(self, refs: dict[int, int]) -> None:
        """Raise ``InvariantError`` unless every block with extras holds a primary key and the
        index lists exactly the extras; count the extras naming each source into ``refs``."""
        src = self.src.a
        for block, extras in self.extras.items():
            require(bool(extras) and src[block] >= 0, f"block {block} has extras but no key")
            for key, s in extras.items():
                require(block in self.extra_index.get(key, {}), "extra index is stale")
                refs[s] = refs.get(s, 0) + 1
        require(
            sum(map(len, self.extra_index.values())) == sum(map(len, self.extras.values())),
            "extra index is stale",
        )
