"""The optimized block pool: reference counts, the free queue and the prefix cache, as arrays.

Same rules as ``hybridkv.reference.block_pool`` (read that first); only the representation
differs. ``N`` is ``num_blocks`` (block 0 is the null block), ``G`` the number of KV cache groups.

Data layout (every array is an ``IntBuffer``: a numpy array with memoryview and tensor views)
--------------------------------------------------------------------------------------------
Reference counts and the free queue::

    ref[N]                  holders of each block
    prev[N + 2], next[N + 2] the free queue, an intrusive doubly linked list through the block
                            ids; N is the head sentinel, N + 1 the tail sentinel. A block is in
                            the queue iff prev[b] != -1.

The prefix cache, a chained hash table whose entries are the blocks themselves (a block's
*primary* key, so no separate entry storage is needed)::

    heads[M]                first block of each bucket's chain, N if empty; M is the smallest
                            power of two >= N / 2 (at least ``MIN_BUCKETS``, 16): a full
                            cache's chains average one or two blocks, for 2–4 bytes a block
    hnext[N + 1]            next block in the same chain; N ends a chain (and hnext[N] = N)
    hk[N + 1]               int64: (first 4 bytes of the cached hash, little endian, signed)
                            << 32 | (hash index × G + group id); hk[N] = -1 matches nothing
    src[N + 1]              the source the block was cached from (below); -1 if the block holds
                            no hash (src[N] = -1: the chain end holds none)

The hash index is the key's position in its source's hash list: a block's table position when
its group's block is the hash block, else the hash at the block's last hash boundary (``(pos +
1) × block_size / hash_block_size − 1``), or the boundary of a partial entry. A block may also
carry *extra* keys (a prompt-tail partial entry beside its full-block key, as the reference's
``extra_keys_by_block``): rare, so they live in two Python dicts (``extras`` per block,
``extra_index`` per key) with their insertion order among extras and the primary holders of the
key that were cached before them; while any exists, lookups probe one by one and return the
first-inserted verified block among the primary and extra entries of a key.

A bucket is ``(key + group × 0x9E3779B1) mod M``. Chains are in reverse insertion order (a new
entry goes to the head), so among blocks cached under the same (hash, group) the *last* match on
a chain is the first-inserted one, which is the block a lookup returns (as in the reference).
A lookup compares one int64 per chain entry: key, position and group at once.

Sources: collision safety
-------------------------
A cache hit is never trusted on the hash alone. Every cached block records its *source*: the
request that computed it (its token list, its block hashes and its cache salt, all by reference,
never copied). A lookup accepts a block at position ``p`` only if that source's hash at ``p``
equals the request's, its salt is the request's, and its first ``(p + 1) × block_size`` tokens
are the request's: the block's whole prefix, so even a forced hash collision, or one of the
4-byte keys above, cannot return another prompt's blocks. Sources live in a Python list indexed
by ``src``, one per request that cached blocks (not per block), with a count of the blocks that
name them; a source is dropped when its last block is evicted.

Runs: a source also records, per tag (hash index × G + group), the block it cached there
(``Source.blocks``, an int32 array grown as it caches: 4 bytes per position and group of the
sources alive, nothing per block of the pool), so that a lookup reads a long hit as runs of a
source's blocks at once. Evicting a block clears its entry (``_evict_primary``), so a recorded
block is always cached from its source under its tag (``check_invariants`` checks it), and a
run needs no look at ``hk`` or ``src``. Such a block is the one a probe would find only if it
is the first-inserted entry of its key: the blocks cached while an
entry with the same key, position and group was cached are marked in ``dups`` (a set, rarely
non-empty: a prompt computed twice at once). Finding them takes a walk of the chain behind each
new entry (none for an entry that became the head of an empty chain, most of them); it is done
for all the blocks cached since the last time (``unsettled``) in one vectorised walk (numpy
calls on the views) when a lookup first needs it (``settle_duplicates``), or every
``SETTLE_MAX`` blocks, instead of one walk per cached block.

Pending work: a running request's step may leave its releases and inserts to ``pending``
(``hybridkv.optimized.pending``, ``defer_row``/``defer_entries``), which ``apply_pending``
makes in one numpy pass (``release_cached``, ``chain_entries``); the source records and counts
such blocks, and the memo registers it, at once. The manager applies it before anything reads
what it changes.

The hash memo
-------------
With the manager's ``HashMemo`` attached (``memo``), the sources of requests hashed by it are
listed in ``memo_srcs``; ``insert``/``insert_array`` register such a source with the memo when
they cache a block of it (once: later calls find it registered), ``maybe_drop_source``
unregisters it once no cached block names it (so the memo holds no more sources than there are
cached blocks), and ``reset_prefix_cache`` empties it (``hybridkv.optimized.hash_memo``).

Per block this is 5 int32 values and one int64 (28 bytes) plus the bucket heads (2 to 4 bytes,
as the table size rounds up to a power of two: 2.1 for a million blocks), and no Python object
per block (the sources' run arrays add 4 bytes per cached position and group of the requests
that cached them).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.optimized._buffers import IntBuffer
from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.optimized.pending import PendingWork
from hybridkv.optimized.thresholds import (
    INSERT_MIN,
    MIN_BUCKETS,
    SETTLE_MAX,
    SETTLE_SCALAR_MAX,
    TAIL_MAX,
)
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.spec.errors import require

GROUP_MIX = 0x9E3779B1
"""Spreads the same hash of different groups over different buckets."""

_KEY = struct.Struct("<i")


def hash_key(block_hash: bytes) -> int:
    """The 4-byte table key of a block hash (any length; short ones are zero-padded)."""
    if len(block_hash) >= 4:
        key: int = _KEY.unpack_from(block_hash)[0]
        return key
    return int(_KEY.unpack(block_hash.ljust(4, b"\0"))[0])


class Source:
    """The token ids, block hashes and cache salt of a request that cached blocks.

    ``packed`` is the request's ``packed_token_ids`` when it keeps one (``Request`` does): the
    same tokens as one array, so that verification compares memory instead of ints. ``blocks``
    maps a tag (hash index × G + group id, the low half of ``hk``) to the block cached from
    this source under it (the pool's chain end where none: evicting a block clears its entry),
    so that a lookup reads a whole run of a prompt's blocks from it at once instead of walking
    a chain per position."""

    __slots__ = ("blocks", "hashes", "packed", "refs", "row_refs", "salt", "tokens")

    def __init__(
        self,
        tokens: Sequence[int],
        hashes: Sequence[BlockHash],
        salt: object,
        packed: array[int] | None = None,
    ) -> None:
        self.tokens = tokens
        self.hashes = hashes
        self.salt = salt
        self.packed = packed
        self.blocks = array("i")
        self.refs = 0  # cached blocks naming this source
        self.row_refs = 0  # live block-table rows naming it (the request may cache more)

    def record(self, tag: int, block: int, end: int) -> None:
        """Remember that ``block`` was cached from this source under ``tag`` (``end``, the
        pool's chain end, which holds no key, stands for none)."""
        if tag >= len(self.blocks):
            self.reserve(tag + 1, end)
        self.blocks[tag] = block

    def reserve(self, size: int, end: int) -> None:
        """Make room for ``size`` tags (doubling, so that a growing request's records grow in
        a few steps), the new ones ``end`` (none)."""
        blocks = self.blocks
        if size > len(blocks):
            blocks.extend(array("i", [end]) * (max(size, 2 * len(blocks)) - len(blocks)))

    def record_array(
        self, tags: npt.NDArray[np.int64], blocks: npt.NDArray[np.int64], end: int
    ) -> None:
        """``record`` for int64 arrays of tags and blocks (distinct tags)."""
        top = int(tags.max()) + 1
        if top > len(self.blocks):
            self.reserve(top + top // 4, end)  # a prompt's records: room for its decode too
        # A view for this call only: the array must stay resizable for a later record.
        view = np.frombuffer(self.blocks, dtype=np.int32)
        view[tags] = blocks
        del view


class TorchBlockPool:
    """Blocks ``0 … N − 1`` with block 0 the null block; see the module docstring."""

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        *,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        event_builder: EventBuilder | None = None,
    ) -> None:
        if enable_kv_cache_events and event_builder is None:
            raise ValueError("enable_kv_cache_events needs an event_builder (the groups' specs)")
        n = num_blocks
        self.num_blocks = n
        self.num_groups = num_groups
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        # Builds the events in vLLM's schema (set with events on; see ``EventBuilder``).
        self.event_builder = event_builder
        self.head = n
        self.tail = n + 1
        self.ref = IntBuffer(n)
        self.prev = IntBuffer(n + 2, -1)
        self.next = IntBuffer(n + 2, -1)
        # Free queue 1 … N − 1 in id order.
        ids = torch.arange(n + 2, dtype=torch.int32)
        self.next.t[1 : n - 1] = ids[2:n]
        self.prev.t[2:n] = ids[1 : n - 1]
        self.next.a[self.head] = 1
        self.prev.a[1] = self.head
        self.next.a[n - 1] = self.tail
        self.prev.a[self.tail] = n - 1
        self.num_free_blocks = n - 1
        # Prefix cache.
        size = MIN_BUCKETS
        while 2 * size < n:
            size *= 2
        self.mask = size - 1
        self.end = n  # ends every chain
        self.heads = IntBuffer(size, n)
        self.hnext = IntBuffer(n + 1, n)
        self.hk = IntBuffer(n + 1, -1, typecode="q")
        self.src = IntBuffer(n + 1, -1)
        # Extra keys: a block keeps one primary entry in the chains and, beside it, rare extra
        # keys (a prompt-tail partial entry next to a full-block key): per block its extras in
        # insertion order as (key, group, hash index) -> source, and per key the blocks holding
        # it as an extra -> (insertion counter, the primary holders of the key cached before
        # it and still cached since). A lookup returns the first inserted block of a key,
        # primary or extra: an extra comes right after the primaries cached before it.
        self.extras: dict[int, dict[tuple[int, int, int], int]] = {}
        self.extra_index: dict[tuple[int, int, int], dict[int, tuple[int, set[int]]]] = {}
        self._extra_count = 0
        # Blocks cached while another entry with the same key, position and group was cached
        # (found by ``settle_duplicates`` before a lookup reads runs): the only ones that may
        # not be the first-inserted block of their key (a lookup reads runs of blocks from a
        # source only where none of them is here). A block leaves it when evicted; it stays
        # while the entry before it goes, so the set may say too much, never too little.
        self.dups: set[int] = set()
        # Blocks cached since ``settle_duplicates`` last ran behind another entry of their
        # chain (an entry at the head of an empty chain has no older twin): one by one, and in
        # numpy arrays.
        self.unsettled: list[int] = []
        self.unsettled_many: list[npt.NDArray[np.int64]] = []
        self.sources: list[Source | None] = []
        self._free_sources: list[int] = []
        self.events: list[KVCacheEvent] = []
        # The manager's hash memo (``hybridkv.optimized.hash_memo``) and the sources hashed by
        # it: caching a block of such a source registers it, evicting its last one unregisters it.
        self.memo: HashMemo | None = None
        self.memo_srcs: set[int] = set()
        # Running requests' releases and inserts not made yet (``PendingWork``): the manager
        # applies them before anything reads what they change.
        self.pending = PendingWork()

    # --- Memory -----------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the per-block buffers (the pool's host memory apart from its sources)."""
        buffers = (
            self.ref, self.prev, self.next, self.heads, self.hnext, self.hk, self.src
        )  # fmt: skip
        return sum(b.nbytes for b in buffers)

    @property
    def usage(self) -> float:
        return 1.0 - (self.num_free_blocks / (self.num_blocks - 1))

    # --- Free queue -------------------------------------------------------------------------

    def pop_n(self, count: int, sink: list[tuple[int, KVCacheEvent]] | None = None) -> list[int]:
        """Take ``count`` blocks from the head, evicting their cached hashes; each gets ref 1.

        With a ``sink``, eviction events go there as (index of the popped block, event) instead
        of to the event list (a batch interleaves them with other requests' events).
        """
        if count > self.num_free_blocks:
            raise ValueError(
                f"cannot take {count} blocks from a free queue of {self.num_free_blocks}"
            )
        if count <= 0:
            return []
        nxt, prv, ref, src = self.next.a, self.prev.a, self.ref.a, self.src.a
        if count >= INSERT_MIN and sink is None:
            # Walk the queue for the ids, then unlink and hold them all in numpy calls, then
            # evict the cached ones in the order taken (eviction reads none of what changed).
            walked = [0] * count
            block = nxt[self.head]
            for index in range(count):
                walked[index] = block
                block = nxt[block]
            nxt[self.head] = block
            prv[block] = self.head
            self.num_free_blocks -= count
            ids = np.array(walked, dtype=np.int64)
            self.prev.n[ids] = -1
            self.next.n[ids] = -1
            self.ref.n[ids] = 1
            for cached in ids[self.src.n[ids] >= 0].tolist():
                self.evict(cached)
            return walked
        taken: list[int] = []
        block = nxt[self.head]
        for index in range(count):
            taken.append(block)
            following = nxt[block]
            prv[block] = nxt[block] = -1
            ref[block] = 1
            if src[block] >= 0:
                if sink is None:
                    self.evict(block)
                else:
                    removed: list[KVCacheEvent] = []
                    self.evict(block, removed)
                    sink.extend((index, event) for event in removed)
            block = following
        nxt[self.head] = block
        prv[block] = self.head
        self.num_free_blocks -= count
        return taken

    def remove(self, block: int) -> None:
        """Unlink one block from the free queue."""
        nxt, prv = self.next.a, self.prev.a
        before, after = prv[block], nxt[block]
        nxt[before] = after
        prv[after] = before
        prv[block] = nxt[block] = -1
        self.num_free_blocks -= 1

    def touch(self, blocks: Iterable[int]) -> None:
        """A cache hit adopts ``blocks``: one more holder each; evictable ones leave the queue."""
        ref = self.ref.a
        for block in blocks:
            if block == 0:
                continue
            if ref[block] == 0:
                self.remove(block)
            ref[block] += 1

    def touch_array(self, blocks: npt.NDArray[Any]) -> None:
        """``touch`` for a numpy array of distinct non-null blocks (order does not matter: a
        block leaves the queue wherever it is)."""
        if blocks.shape[0] < INSERT_MIN:
            self.touch(blocks.tolist())
            return
        ref = self.ref.n
        for block in blocks[ref[blocks] == 0].tolist():
            self.remove(block)
        ref[blocks] += 1

    def free_blocks(self, walk: Sequence[int]) -> None:
        """Drop one holder of each block (walk order); see ``BlockPool.free_blocks``."""
        self.free_walks((walk,))

    def free_walks(self, walks: Sequence[Sequence[int]]) -> None:
        """``free_blocks`` of each walk in turn, in one pass: the blocks that become free
        uncached go after the head, the later walks' first (as each call puts its own there),
        the cached ones before the tail in walk order."""
        ref, src = self.ref.a, self.src.a
        keep: list[int] = []
        reuses: list[list[int]] = []
        for walk in walks:
            reuse: list[int] = []
            for block in walk:
                if block == 0:
                    continue
                count = ref[block] - 1
                ref[block] = count
                if count == 0:
                    (keep if src[block] >= 0 else reuse).append(block)
            if reuse:
                reuses.append(reuse)
        if reuses:
            reuses.reverse()
            self.link_after(self.head, [block for reuse in reuses for block in reuse])
        if keep:
            self.link_after(self.prev.a[self.tail], keep)

    def link_after(self, node: int, blocks: Sequence[int]) -> None:
        """Insert ``blocks``, in order, right after ``node`` (a sentinel or a queued block)."""
        nxt, prv = self.next.a, self.prev.a
        after = nxt[node]
        before = node
        for block in blocks:
            nxt[before] = block
            prv[block] = before
            before = block
        nxt[before] = after
        prv[after] = before
        self.num_free_blocks += len(blocks)

    def release_cached(self, blocks: npt.NDArray[np.int64]) -> None:
        """``free_walks`` of blocks that all hold a cached hash, in walk order: each drops a
        holder, and those left with none go before the tail in the order of their last release
        (the deferred releases of ``PendingWork``)."""
        count = blocks.shape[0]
        if count < INSERT_MIN:
            counts = self.ref.a
            keep: list[int] = []
            for block in blocks.tolist():
                left = counts[block] - 1
                counts[block] = left
                if left == 0:
                    keep.append(block)
            if keep:
                self.link_after(self.prev.a[self.tail], keep)
            return
        ref = self.ref.n
        held = ref[blocks]
        if (held == 1).all():
            # Each block's last holder lets it go (a block listed twice would hold two): all
            # become free, in walk order.
            ref[blocks] = 0
            self.link_after_array(self.prev.a[self.tail], blocks)
            return
        unique, inverse, repeats = np.unique(blocks, return_inverse=True, return_counts=True)
        final = ref[unique] - repeats
        ref[unique] = final
        zero = final == 0
        if not zero.any():
            return
        if unique.shape[0] == count:
            freed = blocks[ref[blocks] == 0]  # each released once: walk order
        else:
            last = np.zeros(unique.shape[0], dtype=np.int64)
            np.maximum.at(last, inverse, np.arange(count))
            freed = unique[zero][np.argsort(last[zero])]
        self.link_after_array(self.prev.a[self.tail], freed)

    def link_after_array(self, node: int, blocks: npt.NDArray[np.int64]) -> None:
        """``link_after`` for a numpy array of distinct blocks, in a few numpy calls."""
        count = blocks.shape[0]
        if count == 0:
            return
        chain = np.empty(count + 2, dtype=np.int64)
        chain[0] = node
        chain[1:-1] = blocks
        chain[-1] = self.next.a[node]
        self.next.n[chain[:-1]] = chain[1:]
        self.prev.n[chain[1:]] = chain[:-1]
        self.num_free_blocks += count

    def free_queue(self) -> list[int]:
        """The queued blocks, head first."""
        nxt = self.next.a
        out: list[int] = []
        block = nxt[self.head]
        while block != self.tail:
            out.append(block)
            block = nxt[block]
        return out

    # --- Prefix cache -----------------------------------------------------------------------

    def bucket(self, key: int, group_id: int) -> int:
        return (key + group_id * GROUP_MIX) & self.mask

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

    def insert(self, block: int, block_hash: bytes, group_id: int, pos: int, src: int) -> None:
        """Cache ``block`` under (hash, group) at table position ``pos``, from source ``src``."""
        key = hash_key(block_hash)
        bucket = (key + group_id * GROUP_MIX) & self.mask
        heads, hnext, hk, end = self.heads.a, self.hnext.a, self.hk.a, self.end
        tag = pos * self.num_groups + group_id
        target = key << 32 | tag
        behind = heads[bucket]
        hnext[block] = behind
        if behind != end:  # only then can an older twin sit behind it
            self.unsettled.append(block)
        heads[bucket] = block
        hk[block] = target
        self.src.a[block] = src
        source = self.sources[src]
        assert source is not None
        source.refs += 1
        recorded = source.blocks
        if tag < len(recorded):
            recorded[tag] = block
        else:
            source.record(tag, block, end)
        if src in self.memo_srcs and self.memo is not None:
            self.memo.remember(src, source)
        if len(self.unsettled) >= SETTLE_MAX:
            self.settle_duplicates()  # long without a lookup: bounded memory

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
        source.refs += len(entries)
        if src in self.memo_srcs and self.memo is not None:
            self.memo.remember(src, source)
        if len(self.unsettled) >= SETTLE_MAX:
            self.settle_duplicates()  # long without a lookup: bounded memory

    def defer_row(
        self,
        blocks: Sequence[int],
        group_ids: array[int],
        pos: int,
        block_hash: BlockHash,
        src: int,
    ) -> None:
        """``insert`` of ``blocks[i]`` in group ``group_ids[i]`` at position ``pos``, all under
        ``block_hash`` from source ``src``, with the hash table's part left pending
        (``PendingWork``): the source records the blocks and counts them, and the memo
        registers the source, at once."""
        self.pending.insert_row(blocks, group_ids, pos, block_hash, src)
        source = self.sources[src]
        assert source is not None
        num_groups = self.num_groups
        first = pos * num_groups
        if len(group_ids) == num_groups:
            if first + num_groups > len(source.blocks):
                source.reserve(first + num_groups, self.end)
            source.blocks[first : first + num_groups] = array("i", blocks)
        else:
            for block, group_id in zip(blocks, group_ids, strict=True):
                source.record(first + group_id, block, self.end)
        source.refs += len(blocks)
        if src in self.memo_srcs and self.memo is not None:
            self.memo.remember(src, source)

    def defer_entries(
        self, entries: Sequence[tuple[int, int, int]], hashes: Sequence[BlockHash], src: int
    ) -> None:
        """``defer_row`` for any ``(block, group id, position)`` entries, each keyed by
        ``hashes[position]``."""
        self.pending.insert(entries, hashes, src)
        source = self.sources[src]
        assert source is not None
        end, num_groups = self.end, self.num_groups
        for block, group_id, pos in entries:
            source.record(pos * num_groups + group_id, block, end)
        source.refs += len(entries)
        if src in self.memo_srcs and self.memo is not None:
            self.memo.remember(src, source)

    def keys_of(self, hashes: Sequence[BlockHash]) -> npt.NDArray[np.int64]:
        """The 4-byte table keys of block hashes (``hash_key`` of each), as int64."""
        joined = b"".join(hashes)
        if len(joined) == 32 * len(hashes):
            return np.frombuffer(joined, dtype="<i4")[::8].astype(np.int64)
        return np.fromiter((hash_key(h) for h in hashes), dtype=np.int64, count=len(hashes))

    def chain_entries(
        self,
        blocks: npt.NDArray[np.int64],
        groups: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        srcs: npt.NDArray[np.int64],
        keys: npt.NDArray[np.int64],
    ) -> None:
        """The hash table's part of ``insert`` for entries whose sources already record and
        count them (``defer_row``), in order, in a few numpy calls."""
        count = blocks.shape[0]
        buckets = (keys + groups * GROUP_MIX) & self.mask
        order = np.argsort(buckets, kind="stable")
        sorted_buckets = buckets[order]
        chained = blocks[order]
        first = np.ones(count, dtype=bool)
        first[1:] = sorted_buckets[1:] != sorted_buckets[:-1]
        last = np.ones(count, dtype=bool)
        last[:-1] = first[1:]
        heads = self.heads.n
        old_heads = heads[sorted_buckets]
        # Within a bucket each entry links to the one inserted before it, the first to the old
        # head, and the last becomes the head (as one insert after another).
        before = np.empty_like(chained)
        before[0] = -1  # the first entry is always a bucket's first
        before[1:] = chained[:-1]
        self.hnext.n[chained] = np.where(first, old_heads, before)
        heads[sorted_buckets[last]] = chained[last]
        self.hk.n[blocks] = keys << 32 | (positions * self.num_groups + groups)
        self.src.n[blocks] = srcs
        # Only an entry with another behind it on its chain can have an older twin to find.
        behind = chained[~first | (old_heads != self.end)]
        if behind.shape[0]:
            self.unsettled_many.append(behind)
        if len(self.unsettled_many) >= SETTLE_MAX // INSERT_MIN:
            self.settle_duplicates()  # long without a lookup: bounded memory

    def apply_pending(self) -> None:
        """Make the running requests' deferred releases and inserts (``PendingWork``)."""
        self.pending.apply(self)

    def insert_array(
        self,
        blocks: npt.NDArray[np.int64],
        groups: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        keys: npt.NDArray[np.int64],
        src: int,
    ) -> None:
        """``insert`` of many blocks from one source ``src`` (int64 arrays, in insertion order,
        each block once), in numpy calls: equal to inserting them one by one."""
        count = blocks.shape[0]
        if count == 0:
            return
        self.chain_entries(blocks, groups, positions, np.full(count, src, dtype=np.int64), keys)
        source = self.source(src)
        source.record_array(positions * self.num_groups + groups, blocks, self.end)
        source.refs += count
        if src in self.memo_srcs and self.memo is not None:
            self.memo.remember(src, source)

    def settle_duplicates(self) -> None:
        """Mark the blocks cached since the last call that have an older entry of the same
        key, position and group on their chain (``dups``): one walk of their chains when a
        lookup needs it, instead of one walk per cached block; one by one on the array views
        for up to ``SETTLE_SCALAR_MAX`` blocks, else in numpy calls on the buffers' views, a
        chain step for all of them at once."""
        if not self.unsettled and not self.unsettled_many:
            return
        waiting = len(self.unsettled) + sum(blocks.shape[0] for blocks in self.unsettled_many)
        if waiting <= SETTLE_SCALAR_MAX:
            # Few (an admission's entries): one by one on the array views.
            fresh = self.unsettled
            for many in self.unsettled_many:
                fresh.extend(many.tolist())
            self.unsettled, self.unsettled_many = [], []
            hnext_a = self.hnext.a
            self._walk_for_duplicates(fresh, [hnext_a[block] for block in fresh])
            return
        parts = list(self.unsettled_many)
        if self.unsettled:
            parts.append(np.array(self.unsettled, dtype=np.int64))
        blocks = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.unsettled, self.unsettled_many = [], []
        hk, hnext, end = self.hk.n, self.hnext.n, self.end
        # Older entries follow on the chain; most new entries end theirs (an evicted block's
        # chain link is the end too).
        current = hnext[blocks]
        ahead = np.flatnonzero(current != end)
        if ahead.shape[0] == 0:
            return
        blocks, current = blocks[ahead], current[ahead]
        flagged: list[int] = []
        targets = hk[blocks] if blocks.shape[0] > TAIL_MAX else None
        steps = 0
        while targets is not None:
            steps += 1
            require(steps <= self.num_blocks, "a prefix-cache chain loops")
            found = hk[current] == targets
            if bool(found.any()):
                flagged.extend(blocks[found].tolist())
                found |= hnext[current] == end
            else:
                found = hnext[current] == end
            # Lanes that found their duplicate or reached their chain's end stop.
            walking = np.flatnonzero(~found)
            blocks, targets = blocks[walking], targets[walking]
            current = hnext[current[walking]]
            if blocks.shape[0] <= TAIL_MAX:
                break
        self.dups.update(flagged)
        # The few chains left: walked on the array views.
        self._walk_for_duplicates(blocks.tolist(), current.tolist())

    def _walk_for_duplicates(self, blocks: list[int], nodes: list[int]) -> None:
        """Mark each of ``blocks`` that has an entry of its key, position and group on its
        chain from ``nodes`` on (the entries after it: older ones)."""
        hk, hnext, end, dups = self.hk.a, self.hnext.a, self.end, self.dups
        for block, node in zip(blocks, nodes, strict=True):
            target = hk[block]
            length = 0
            while node != end:
                if hk[node] == target:
                    dups.add(block)
                    break
                node = hnext[node]
                length += 1
                require(length <= self.num_blocks, "a prefix-cache chain loops")

    def block_hash(self, block: int) -> BlockHash:
        """The hash a cached block is cached under."""
        tag = self.hk.a[block] & 0xFFFFFFFF
        return self.source(self.src.a[block]).hashes[tag // self.num_groups]

    # --- Keys beyond one per block (hash views, partial entries) ----------------------------

    def hash_index(self, block: int) -> int:
        """The hash index (position in its source's hash list) of the block's primary key."""
        return (self.hk.a[block] & 0xFFFFFFFF) // self.num_groups

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
            self.insert(block, block_hash, group_id, hidx, src)
            return
        key = (hash_key(block_hash), group_id, hidx)
        before = set(self.candidates(*key))
        self.extras.setdefault(block, {})[key] = src
        self.extra_index.setdefault(key, {})[block] = (self._extra_count, before)
        self._extra_count += 1
        self.source(src).refs += 1

    def remove_keys(self, block: int, events: list[KVCacheEvent] | None = None) -> bool:
        """Forget every key of the block (primary first, then extras in insertion order);
        whether it held any."""
        if self.src.a[block] < 0:
            return False
        self.evict(block, events)
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
        self._evict_primary(block, events)
        if self.extras:
            self._drop_extras(block, events)

    def _evict_primary(self, block: int, events: list[KVCacheEvent] | None = None) -> None:
        hk = self.hk.a[block]
        if self.extra_index:
            # A primary entry made again later comes after the extras of its key.
            tag = hk & 0xFFFFFFFF
            key = (hk >> 32, tag % self.num_groups, tag // self.num_groups)
            for _, before in self.extra_index.get(key, {}).values():
                before.discard(block)
        tag = hk & 0xFFFFFFFF
        group_id = tag % self.num_groups
        src = self.src.a[block]
        source = self.source(src)
        if self.event_builder is not None and self.enable_kv_cache_events:
            removed = self.event_builder.removed(source.hashes[tag // self.num_groups], group_id)
            (self.events if events is None else events).append(removed)
        heads, hnext = self.heads.a, self.hnext.a
        bucket = ((hk >> 32) + group_id * GROUP_MIX) & self.mask
        node = heads[bucket]
        if node == block:
            heads[bucket] = hnext[block]
        else:
            while hnext[node] != block:
                node = hnext[node]
            hnext[node] = hnext[block]
        hnext[block] = self.end
        self.hk.a[block] = -1
        self.src.a[block] = -1
        recorded = source.blocks
        if tag < len(recorded) and recorded[tag] == block:
            # The source's record holds only its blocks still cached under their tags.
            recorded[tag] = self.end
        if self.dups:
            self.dups.discard(block)
        source.refs -= 1
        self.maybe_drop_source(src)

    def maybe_drop_source(self, index: int) -> None:
        """Forget a source that no cached block and no live row names any more."""
        source = self.source(index)
        if source.refs == 0 and self.memo is not None and index in self.memo_srcs:
            self.memo.forget(index)  # no cached block names it: it leaves the memo
        if source.refs == 0 and source.row_refs == 0:
            self.sources[index] = None
            self._free_sources.append(index)
            self.memo_srcs.discard(index)

    def candidates(self, key: int, group_id: int, pos: int) -> list[int]:
        """Blocks cached under this key, group and position, first-inserted first."""
        target = key << 32 | (pos * self.num_groups + group_id)
        hnext, hk, end = self.hnext.a, self.hk.a, self.end
        found: list[int] = []
        block = self.heads.a[(key + group_id * GROUP_MIX) & self.mask]
        while block != end:
            if hk[block] == target:
                found.append(block)
            block = hnext[block]
        found.reverse()
        return found

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no block is held; keep the queue order."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.heads.t.fill_(self.end)
        self.hnext.t.fill_(self.end)
        self.hk.t.fill_(-1)
        self.src.t.fill_(-1)
        self.extras = {}
        self.extra_index = {}
        self.dups = set()
        self.unsettled, self.unsettled_many = [], []
        self.sources = []
        self._free_sources = []
        self.memo_srcs = set()
        if self.memo is not None:
            self.memo.clear()
        if self.event_builder is not None and self.enable_kv_cache_events:
            self.events.append(self.event_builder.cleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def cached_blocks(self) -> list[list[int]]:
        """Blocks holding a cached hash, per group, sorted."""
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        blocks = torch.nonzero(self.src.t >= 0).flatten()
        for block, hk in zip(blocks.tolist(), self.hk.t[blocks].tolist(), strict=True):
            out[(hk & 0xFFFFFFFF) % self.num_groups].append(block)
        return out

    def num_cached_keys(self) -> int:
        keys: set[tuple[bytes, int]] = set()
        for group_id, blocks in enumerate(self.cached_blocks()):
            keys.update((self.block_hash(b), group_id) for b in blocks)
        for extras in self.extras.values():
            for (_, g, h), src in extras.items():
                keys.add((self.source(src).hashes[h], g))
        return len(keys)

    # --- Invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool's own bookkeeping is inconsistent."""
        n = self.num_blocks
        ref, prv, nxt = self.ref.a, self.prev.a, self.next.a
        free = self.free_queue()
        require(len(free) == self.num_free_blocks, "free queue length != num_free_blocks")
        require(len(free) == len(set(free)), f"free queue holds a block twice: {free}")
        require(0 not in free, "the null block is in the free queue")
        previous = self.head
        for block in free:
            require(prv[block] == previous, f"free queue back link of block {block} is broken")
            previous = block
        require(prv[self.tail] == previous, "free queue tail link is broken")
        zero = {b for b in range(1, n) if ref[b] == 0}
        require(set(free) == zero, f"free queue {sorted(free)} != count-0 blocks {sorted(zero)}")
        require(bool((self.ref.t >= 0).all()), "a negative reference count")
        require(ref[0] == 0 and prv[0] == -1 and nxt[0] == -1, "the null block was used")
        for block in range(1, n):
            if ref[block] > 0:
                require(prv[block] == -1 and nxt[block] == -1, f"held block {block} is linked")
        # Every cached block sits on exactly the chain of its bucket, with its source's key.
        src, hk, hnext, end = self.src.a, self.hk.a, self.hnext.a, self.end
        require(hnext[end] == end and hk[end] == -1, "the chain end was written")
        seen: set[int] = set()
        refs: dict[int, int] = {}
        heads = self.heads.a
        # Entries with an older entry of the same key, position and group further down their
        # chain: each must be marked a duplicate (checked below, once the chains are sound).
        later: set[int] = set()
        for bucket in range(self.mask + 1):
            block = heads[bucket]
            chain: list[int] = []
            while block != end:
                chain.append(block)
                require(block not in seen, f"block {block} is on two cache chains")
                require(0 < block < n and src[block] >= 0, f"chain holds uncached block {block}")
                seen.add(block)
                tag = hk[block] & 0xFFFFFFFF
                require(
                    self.bucket(hk[block] >> 32, tag % self.num_groups) == bucket,
                    f"block {block} is on the chain of another bucket",
                )
                source = self.sources[src[block]]
                require(source is not None, f"cached block {block} has no source")
                assert source is not None
                require(
                    hash_key(source.hashes[tag // self.num_groups]) == hk[block] >> 32,
                    f"cached block {block} has a key its source does not give",
                )
                refs[src[block]] = refs.get(src[block], 0) + 1
                block = hnext[block]
            older: set[int] = set()
            for block in reversed(chain):  # first inserted first
                if hk[block] in older:
                    later.add(block)
                older.add(hk[block])
        for block, extras in self.extras.items():
            require(bool(extras) and src[block] >= 0, f"block {block} has extras but no key")
            for key, s in extras.items():
                require(block in self.extra_index.get(key, {}), "extra index is stale")
                refs[s] = refs.get(s, 0) + 1
        require(
            sum(map(len, self.extra_index.values())) == sum(map(len, self.extras.values())),
            "extra index is stale",
        )
        # The blocks cached since the last lookup are marked once the chains, checked above,
        # are walked for them.
        self.settle_duplicates()
        require(later <= self.dups, f"duplicate entries {sorted(later - self.dups)} unmarked")
        require(all(src[b] >= 0 for b in self.dups), "an uncached block is marked duplicate")
        cached = {b for b in range(n) if src[b] >= 0}
        require(seen == cached, f"{len(cached)} blocks hold a hash but {len(seen)} are cached")
        require(all((hk[b] == -1) == (src[b] < 0) for b in range(n)), "src and hk disagree")
        for index, source in enumerate(self.sources):
            if source is None:
                require(index in self._free_sources, f"source {index} is lost")
            else:
                for tag, block in enumerate(source.blocks):
                    require(
                        block == end or (src[block] == index and hk[block] & 0xFFFFFFFF == tag),
                        f"source {index} records block {block} under tag {tag}, which it does "
                        "not hold there",
                    )
                require(source.refs == refs.get(index, 0), f"source {index} has a wrong count")
                require(source.refs + source.row_refs > 0, f"source {index} is kept for nothing")
        memo = self.memo
        if memo is not None:
            # The memo registers only memo sources with a cached block, as the pool holds them.
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
