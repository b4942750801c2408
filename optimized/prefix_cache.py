"""The prefix cache's entries: blocks cached under a source's hash, their sources and events.

``PrefixCache`` extends the hash table (``hybridkv.optimized.cache_chains``) with what its
entries name: the pool's list of sources (``hybridkv.optimized.sources.Source``: a Python list
indexed by a block's ``src``, one per request that cached blocks, with a free list of indices
to reuse), the events of the entries made and removed, and the hash memo's registrations.

The hash index of an entry is the key's position in its source's hash list: a block's table
position when its group's block is the hash block, else the hash at the block's last hash
boundary (``(pos + 1) × block_size / hash_block_size − 1``), or the boundary of a partial
entry. ``insert`` and ``insert_entries`` link a block at the head of its bucket's chain, record
it in its source's ``blocks`` and count it there; ``evict_primary`` undoes all three, so a
recorded block is always cached from its source under its tag. A block may also carry *extra*
keys (``extras``, ``extra_index``: ``hybridkv.optimized.extra_keys``); this layer keeps them so
that evicting a primary entry can keep their insertion order.

The hash memo: with the manager's ``HashMemo`` attached (``memo``), the sources of requests
hashed by it are listed in ``memo_srcs``; caching a block of such a source registers it with
the memo (once: later calls find it registered), ``maybe_drop_source`` unregisters it once no
cached block names it (so the memo holds no more sources than there are cached blocks), and
``clear_entries`` empties it (``hybridkv.optimized.hash_memo``).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.optimized._buffers import BlockRecords
from hybridkv.optimized.cache_chains import CacheChains
from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.optimized.policy_seam import HeardPolicy
from hybridkv.optimized.sources import GROUP_MIX, Source, hash_key, keys_of
from hybridkv.optimized.thresholds import SETTLE_MAX
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.spec.errors import InvariantError, require


class PrefixCache(CacheChains):
    """The hash table with its entries' sources, events and memo (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        enable_kv_cache_events: bool,
        event_builder: EventBuilder | None,
        records: BlockRecords,
    ) -> None:
        super().__init__(num_blocks, num_groups, records)
        self.enable_kv_cache_events = enable_kv_cache_events
        # Builds the events in vLLM's schema (set with events on; see ``EventBuilder``).
        self.event_builder = event_builder
        self.events: list[KVCacheEvent] = []
        # Extra keys: a block keeps one primary entry in the chains and, beside it, rare extra
        # keys (a prompt-tail partial entry next to a full-block key): per block its extras in
        # insertion order as (key, group, hash index) -> source, and per key the blocks holding
        # it as an extra -> (insertion counter, the primary holders of the key cached before
        # it and still cached since). A lookup returns the first inserted block of a key,
        # primary or extra: an extra comes right after the primaries cached before it.
        self.extras: dict[int, dict[tuple[int, int, int], int]] = {}
        self.extra_index: dict[tuple[int, int, int], dict[int, tuple[int, set[int]]]] = {}
        self.sources: list[Source | None] = []
        self._free_sources: list[int] = []
        # The manager's hash memo (``hybridkv.optimized.hash_memo``) and the sources hashed by
        # it: caching a block of such a source registers it, evicting its last one unregisters it.
        self.memo: HashMemo | None = None
        self.memo_srcs: set[int] = set()
        # The eviction policy and what its ``cached`` calls need (``TorchBlockPool.
        # attach_policy``): tokens per hash, and per group the hashes per block (the step back
        # from a full block's hash to its parent's).
        self.policy: HeardPolicy | None = None
        self.policy_hash_block_size = 1
        self.policy_steps: tuple[int, ...] = ()

    # --- Sources ----------------------------------------------------------------------------

    def new_source(
        self,
        tokens: Sequence[int],
        hashes: Sequence[BlockHash],
        salt: object,
        packed: array[int] | None = None,
    ) -> int:
        source = Source(tokens, hashes, salt, packed)
        if self._free_sources:
            index = self._free_sources.pop()
            self.sources[index] = source
            return index
        self.sources.append(source)
        return len(self.sources) - 1

    def source(self, index: int) -> Source:
        source = self.sources[index]
        assert source is not None
        return source

    def hidden_waiting(self, unmarked: set[int]) -> set[int]:
        """Of these twins not marked yet, those whose source is not marked waiting while the
        unsettled entries are not mixed: ``settle_for`` would not settle before reading them."""
        if self.unsettled_mixed:
            return set()
        src = self.src.a
        return {b for b in unmarked if self.source(src[b]).waiting != self.settles}

    def maybe_drop_source(self, index: int) -> None:
        """Forget a source that no cached block and no live row names any more."""
        source = self.source(index)
        if source.refs == 0 and self.memo is not None and index in self.memo_srcs:
            self.memo.forget(index)  # no cached block names it: it leaves the memo
        if source.refs == 0 and source.row_refs == 0:
            self.sources[index] = None
            self._free_sources.append(index)
            self.memo_srcs.discard(index)

    # --- Entries ----------------------------------------------------------------------------

    def insert(
        self, block: int, block_hash: bytes, group_id: int, pos: int, src: int, step: int = 0
    ) -> None:
        """Cache ``block`` under (hash, group) at table position ``pos``, from source ``src``
        (a policy hears it with the parent ``step`` hashes back: by default a full block's)."""
        key = hash_key(block_hash)
        bucket = (key + group_id * GROUP_MIX) & self.mask
        heads, hnext, hk, end = self.heads.a, self.hnext.a, self.hk.a, self.end
        tag = pos * self.num_groups + group_id
        target = key << 32 | tag
        behind = heads[bucket]
        hnext[block] = behind
        heads[bucket] = block
        hk[block] = target
        self.src.a[block] = src
        source = self.sources[src]
        assert source is not None
        if behind != end:  # only then can an older twin sit behind it
            self.unsettled.append(block)
            source.waiting = self.settles
        recorded = source.blocks
        if tag < len(recorded):
            recorded[tag] = block
        else:
            source.record(tag, block, end)
        self._count_cached(src, source, 1)
        if len(self.unsettled) >= SETTLE_MAX:
            self.settle_duplicates()  # long without a lookup: bounded memory
        if self.policy is not None:
            self.heard_cached(block, group_id, pos, src, step or self.policy_steps[group_id])

    def _count_cached(self, src: int, source: Source, count: int) -> None:
        """Source ``src`` has ``count`` more cached blocks (recorded already); a memo source's
        first ones register it with the memo (one with a cached block is in it already, as
        ``check_memo`` checks; it leaves with its last one)."""
        if not source.refs and self.memo is not None and src in self.memo_srcs:
            self.memo.remember(src, source)
        source.refs += count

    def heard_cached(self, block: int, group_id: int, hidx: int, src: int, step: int) -> None:
        """Tell the policy ``block`` holds the key at hash index ``hidx`` of source ``src``:
        as ``BlockPool`` does, its parent is the hash ``step`` back (one block of its group
        for a full block, one hash block for a partial entry) and its prefix ends there."""
        assert self.policy is not None
        hashes = self.source(src).hashes
        parent = hashes[hidx - step] if hidx >= step else None
        tokens = (hidx + 1) * self.policy_hash_block_size
        self.policy.cached(block, hashes[hidx], group_id, parent, tokens)

    def insert_entries(
        self, entries: Sequence[tuple[int, int, int]], hashes: Sequence[BlockHash], src: int
    ) -> None:
        """``insert`` of each ``(block, group id, position)`` in turn, every block from source
        ``src`` keyed by ``hashes[position]``: a position's key is computed once for all the
        groups that cache it (a decode step caches one position in every group)."""
        heads, hnext, hk, srcs = self.heads.a, self.hnext.a, self.hk.a, self.src.a
        mask, num_groups, end = self.mask, self.num_groups, self.end
        source = self.sources[src]
        assert source is not None
        recorded = source.blocks
        size = len(recorded)
        unsettled = self.unsettled
        last = key = high = -1
        for block, group_id, pos in entries:
            if pos != last:
                key, last = hash_key(hashes[pos]), pos
                high = key << 32
            bucket = (key + group_id * GROUP_MIX) & mask
            behind = heads[bucket]
            hnext[block] = behind
            if behind != end:  # only then can an older twin sit behind it
                unsettled.append(block)
                source.waiting = self.settles
            heads[bucket] = block
            tag = pos * num_groups + group_id
            hk[block] = high | tag
            srcs[block] = src
            if tag < size:
                recorded[tag] = block
            else:
                source.record(tag, block, end)
                recorded = source.blocks
                size = len(recorded)
        self._count_cached(src, source, len(entries))
        if len(self.unsettled) >= SETTLE_MAX:
            self.settle_duplicates()  # long without a lookup: bounded memory
        if self.policy is not None:
            for block, group_id, pos in entries:
                self.heard_cached(block, group_id, pos, src, self.policy_steps[group_id])

    def evict_primary(self, block: int, events: list[KVCacheEvent] | None = None) -> None:
        """Forget the block's primary entry (this block only; its extras stay)."""
        self.evict_primaries((block,), events)

    def evict_primaries(
        self, blocks: Iterable[int], events: list[KVCacheEvent] | None = None
    ) -> None:
        """``evict_primary`` of each block in turn, the buffers bound once for all of them (a
        take of several cached blocks evicts them one after another)."""
        hk_a, src_a, num_groups, mask = self.hk.a, self.src.a, self.num_groups, self.mask
        heads, hnext, end, sources = self.heads.a, self.hnext.a, self.end, self.sources
        stored = self.event_builder is not None and self.enable_kv_cache_events
        extra_index, dups = self.extra_index, self.dups
        for block in blocks:
            hk = hk_a[block]
            tag = hk & 0xFFFFFFFF
            if extra_index:
                # A primary entry made again later comes after the extras of its key.
                key = (hk >> 32, tag % num_groups, tag // num_groups)
                for _, before in extra_index.get(key, {}).values():
                    before.discard(block)
            group_id = tag % num_groups
            src = src_a[block]
            source = sources[src]
            assert source is not None
            if stored:
                assert self.event_builder is not None
                removed = self.event_builder.removed(source.hashes[tag // num_groups], group_id)
                (self.events if events is None else events).append(removed)
            bucket = ((hk >> 32) + group_id * GROUP_MIX) & mask
            node = heads[bucket]
            if node == block:
                heads[bucket] = hnext[block]
            else:
                while hnext[node] != block:
                    node = hnext[node]
                hnext[node] = hnext[block]
            hnext[block] = end
            hk_a[block] = -1
            src_a[block] = -1
            recorded = source.blocks
            if tag < len(recorded) and recorded[tag] == block:
                # The source's record holds only its blocks still cached under their tags.
                recorded[tag] = end
            if dups:
                dups.discard(block)
            source.refs -= 1
            if not source.refs:
                self.maybe_drop_source(src)  # (a source with a cached block stays)

    def block_hash(self, block: int) -> BlockHash:
        """The hash a cached block is cached under."""
        tag = self.hk.a[block] & 0xFFFFFFFF
        return self.source(self.src.a[block]).hashes[tag // self.num_groups]

    # --- Keys beyond one per block (hash views, partial entries) ----------------------------

    def hash_index(self, block: int) -> int:
        """The hash index (position in its source's hash list) of the block's primary key."""
        return (self.hk.a[block] & 0xFFFFFFFF) // self.num_groups

    def cached_blocks(self) -> list[list[int]]:
        """Blocks holding a cached hash, per group, sorted."""
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        blocks = torch.nonzero(self.src.t >= 0).flatten()
        for block, hk in zip(blocks.tolist(), self.hk.t[blocks].tolist(), strict=True):
            out[(hk & 0xFFFFFFFF) % self.num_groups].append(block)
        return out

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def clear_entries(self) -> None:
        """Forget every entry's source, extra key and memo registration (the table itself is
        ``clear_chains``'), and record that the cache was cleared."""
        self.extras = {}
        self.extra_index = {}
        self.sources = []
        self._free_sources = []
        self.memo_srcs = set()
        if self.memo is not None:
            self.memo.clear()
        if self.event_builder is not None and self.enable_kv_cache_events:
            self.events.append(self.event_builder.cleared())

    # --- Invariants -------------------------------------------------------------------------

    def check_keys(self, cached: npt.NDArray[np.int64]) -> dict[int, int]:
        """Raise ``InvariantError`` unless every ``cached`` block (on sound chains) has a source
        that gives its key; the number of entries naming each source. The hashes are gathered
        in one pass and their keys compared in one numpy call; the blocks are walked one by
        one only to name the first that fails."""
        named = self.src.n[cached].tolist()
        tags = self.hk.n[cached]
        indices = ((tags & 0xFFFFFFFF) // self.num_groups).tolist()
        sources = self.sources
        try:
            pairs = zip(named, indices, strict=True)
            hashes = [sources[s].hashes[i] for s, i in pairs]
        except (AttributeError, IndexError):  # no source, or not that hash: named below
            hashes = []
        keys = keys_of(hashes) if len(hashes) == len(named) else None
        if keys is None or bool((keys != tags >> 32).any()):
            self._name_wrong_key(cached.tolist(), named, indices)
        return dict(Counter(named))

    def _name_wrong_key(self, blocks: list[int], named: list[int], indices: list[int]) -> None:
        """Raise for the first of ``blocks`` (sources ``named``, hash ``indices``) without a
        source or whose source gives another key."""
        hk, sources = self.hk.a, self.sources
        for block, index, at in zip(blocks, named, indices, strict=True):
            source = sources[index] if index < len(sources) else None
            require(source is not None, f"cached block {block} has no source")
            assert source is not None
            require(
                at < len(source.hashes) and hash_key(source.hashes[at]) == hk[block] >> 32,
                f"cached block {block} has a key its source does not give",
            )
        raise InvariantError("a cached block has a key its source does not give")

    def check_sources(self, refs: dict[int, int]) -> None:
        """Raise ``InvariantError`` unless each source is kept for a block or a row, counts the
        entries naming it (``refs``), and records only blocks cached from it under their tags
        (each condition gathered over all the sources, its message made only when it fails)."""
        free = set(self._free_sources)
        lost = [i for i, source in enumerate(self.sources) if source is None and i not in free]
        if lost:
            raise InvariantError(f"source {lost[0]} is lost")
        live = [(i, source) for i, source in enumerate(self.sources) if source is not None]
        self._check_records(live)
        wrong = [i for i, source in live if source.refs != refs.get(i, 0)]
        if wrong:
            raise InvariantError(f"source {wrong[0]} has a wrong count")
        idle = [i for i, source in live if source.refs + source.row_refs <= 0]
        if idle:
            raise InvariantError(f"source {idle[0]} is kept for nothing")

    def _check_records(self, live: list[tuple[int, Source]]) -> None:
        """Each recorded block (a source's ``blocks``: by tag) is cached from that source
        under that tag (one pass over the records without a call per entry: the message is
        made only for the first that fails)."""
        src, hk, end = self.src.a, self.hk.a, self.end
        for index, source in live:
            wrong = [
                (tag, block)
                for tag, block in enumerate(source.blocks)
                if block != end
                and not (0 <= block < end and src[block] == index and hk[block] & 0xFFFFFFFF == tag)
            ]
            if wrong:
                tag, block = wrong[0]
                raise InvariantError(
                    f"source {index} records block {block} under tag {tag}, which it does not "
                    "hold there"
                )

    def check_memo(self) -> None:
        """Raise ``InvariantError`` unless the memo registers exactly the memo sources with a
        cached block, as the pool holds them (and its own tree is sound)."""
        memo = self.memo
        if memo is None:
            return
        for index in self.memo_srcs:
            held = self.sources[index] if index < len(self.sources) else None
            if held is not None and held.refs > 0:
                entry = memo.registered.get(index)
                require(
                    entry is not None and entry[0] is held,
                    f"the hash memo misses source {index}, which has a cached block",
                )
        for index, (registered, _) in memo.registered.items():
            held = self.sources[index] if index < len(self.sources) else None
            require(
                index in self.memo_srcs
                and held is registered
                and held is not None
                and held.refs > 0,
                f"the hash memo registers source {index} without a cached block",
            )
        memo.check_invariants()
