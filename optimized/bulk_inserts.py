"""The prefix cache's inserts of many blocks at once: in numpy calls, or left pending.

An admission caches a prompt's blocks in every group, and a batch of running requests' steps
caches a block per request: one Python ``insert`` per block would cost more than the rest of
the step. ``insert_array`` takes int64 columns (blocks, groups, positions, keys; one source)
and makes the hash table's links in a few numpy calls (``chain_entries``: entries sorted by
bucket, each linked to the one inserted before it in its bucket, the last made the head: the
chains one insert after another would build), then records the blocks in their source.

Pending work: a running request's step may leave its releases and inserts to ``pending``
(``hybridkv.optimized.pending``, ``defer_rows``/``defer_entries``), which ``apply_pending``
makes in one numpy pass (``release_cached``, ``chain_entries``); the source records and counts
such blocks, and the memo registers it, at once. The manager applies it before anything reads
what it changes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import islice
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized._buffers import BlockRecords
from hybridkv.optimized.extra_keys import ExtraKeys
from hybridkv.optimized.path_counts import PathCounts
from hybridkv.optimized.pending import PendingInserts, PendingWork
from hybridkv.optimized.sources import GROUP_MIX, hash_key, keys_of
from hybridkv.optimized.thresholds import INSERT_MIN, SETTLE_MAX
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import EventBuilder


class BulkInserts(ExtraKeys):
    """The prefix cache with vectorised and deferred inserts (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        enable_kv_cache_events: bool,
        event_builder: EventBuilder | None,
        records: BlockRecords,
    ) -> None:
        super().__init__(num_blocks, num_groups, enable_kv_cache_events, event_builder, records)
        self.paths = PathCounts()
        """How often each fast path ran (``hybridkv.optimized.path_counts``), for the whole
        pool: every phase reaches it."""
        # Running requests' releases and inserts not made yet (``PendingWork``): the manager
        # applies them before anything reads what they change.
        self.pending = PendingWork()
        self.group_mix = np.arange(num_groups, dtype=np.int64)[:, None] * GROUP_MIX
        """Each group's spread of a key over the buckets, an int64 ``[G, 1]`` column."""

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
        source = self.source(src)
        if self._chain(blocks, groups, positions, src, keys):
            source.waiting = self.settles
        source.record_array(positions * self.num_groups + groups, blocks, self.end)
        self._count_cached(src, source, count)
        if self.policy is not None:
            steps = self.policy_steps
            for block, group_id, pos in zip(
                blocks.tolist(), groups.tolist(), positions.tolist(), strict=True
            ):
                self.heard_cached(block, group_id, pos, src, steps[group_id])

    def insert_matrix(
        self, blocks: npt.NDArray[np.int64], start: int, keys: npt.NDArray[np.int64], src: int
    ) -> None:
        """``insert_array`` of a ``[G, n]`` matrix of blocks, row g group g's blocks at
        positions ``start`` … ``start + n − 1`` (``keys``: those positions' table keys), in
        group-then-position order (an admission's new blocks): their tags are the positions
        × G + the groups, the source's record a slice of ``n × G`` entries. For a pool
        without an eviction policy (one hears each insert: ``insert_array``)."""
        assert self.policy is None
        g_count, count = blocks.shape
        if count == 0:
            return
        # Position p's tag in group g is p × G + g: consecutive, position-major.
        tags = np.arange(start * g_count, (start + count) * g_count).reshape(count, g_count).T
        buckets = (keys + self.group_mix[:g_count]) & self.mask
        source = self.source(src)
        if self._link(blocks.ravel(), buckets.ravel(), (keys << 32 | tags).ravel(), src):
            source.waiting = self.settles
        source.record_positions(start, blocks, self.end)
        self._count_cached(src, source, g_count * count)

    def chain_entries(
        self,
        blocks: npt.NDArray[np.int64],
        groups: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        srcs: npt.NDArray[np.int64],
        keys: npt.NDArray[np.int64],
    ) -> None:
        """The hash table's part of ``insert`` for entries whose sources already record and
        count them (``defer_rows``), in order, in a few numpy calls."""
        if self._chain(blocks, groups, positions, srcs, keys):
            self.unsettled_mixed = True  # entries of many sources: not marked one by one

    def _chain(
        self,
        blocks: npt.NDArray[np.int64],
        groups: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        srcs: npt.NDArray[np.int64] | int,
        keys: npt.NDArray[np.int64],
    ) -> bool:
        """``_link`` of entries given by group and position (their buckets and tags computed
        here); whether one joined the unsettled ones."""
        buckets = (keys + groups * GROUP_MIX) & self.mask
        tags = positions * self.num_groups + groups
        return self._link(blocks, buckets, keys << 32 | tags, srcs)

    def _link(
        self,
        blocks: npt.NDArray[np.int64],
        buckets: npt.NDArray[np.int64],
        hk: npt.NDArray[np.int64],
        srcs: npt.NDArray[np.int64] | int,
    ) -> bool:
        """``chain_entries`` given each entry's bucket and ``hk`` value (key and tag); whether
        an entry joined the unsettled ones (its chain held another: the caller marks whose)."""
        heads = self.heads.n
        old_heads = heads[buckets]
        heads[buckets] = blocks
        # Of entries sharing a bucket, the last one written is its head: every entry reads
        # back as its bucket's head exactly when each is alone in its bucket.
        if bool((heads[buckets] == blocks).all()):
            # Each entry alone in its bucket (the common case): it links to the old head and
            # is the head.
            self.paths.ran(paths.LINKS_APART)
            self.hnext.n[blocks] = old_heads
            behind = blocks[old_heads != self.end]
        else:
            heads[buckets] = old_heads  # entries sharing a bucket read the same old head
            self.paths.ran(paths.LINKS_SHARED)
            behind = self._chain_sharing(blocks, buckets, heads)
        self.hk.n[blocks] = hk
        self.src.n[blocks] = srcs
        if not behind.shape[0]:
            return False
        self.unsettled_many.append(behind)
        if len(self.unsettled_many) >= SETTLE_MAX // INSERT_MIN:
            self.settle_duplicates()  # long without a lookup: bounded memory
        return True

    def _chain_sharing(
        self,
        blocks: npt.NDArray[np.int64],
        buckets: npt.NDArray[np.int64],
        heads: npt.NDArray[np.int32],
    ) -> npt.NDArray[np.int64]:
        """``chain_entries``' links where some entries share a bucket: sorted by bucket (stable),
        each entry links to the one inserted before it in its bucket, the first to the old
        head, and the last becomes the head (as one insert after another). Returns the entries
        with another behind them on their chain (only those can have an older twin)."""
        count = blocks.shape[0]
        order = np.argsort(buckets, kind="stable")
        sorted_buckets = buckets[order]
        chained = blocks[order]
        first = np.ones(count, dtype=bool)
        first[1:] = sorted_buckets[1:] != sorted_buckets[:-1]
        last = np.ones(count, dtype=bool)
        last[:-1] = first[1:]
        old_heads = heads[sorted_buckets]
        before = np.empty_like(chained)
        before[0] = -1  # the first entry is always a bucket's first
        before[1:] = chained[:-1]
        self.hnext.n[chained] = np.where(first, old_heads, before)
        heads[sorted_buckets[last]] = chained[last]
        behind: npt.NDArray[np.int64] = chained[~first | (old_heads != self.end)]
        return behind

    def chain_records(self, inserts: PendingInserts) -> None:
        """``chain_entries`` of pending inserts, one entry at a time (for few entries, where
        numpy's calls cost more than the links): each entry becomes its bucket's head, linked
        to the one before, as ``insert`` makes it."""
        heads, hnext, hk, srcs = self.heads.a, self.hnext.a, self.hk.a, self.src.a
        mask, num_groups, end, unsettled = self.mask, self.num_groups, self.end, self.unsettled
        waiting = len(unsettled)
        entries = zip(inserts.blocks, inserts.groups, strict=True)
        records = zip(
            inserts.sources, inserts.positions, inserts.hashes, inserts.counts, strict=True
        )
        for src, pos, block_hash, count in records:
            key = hash_key(block_hash)
            high, base = key << 32, pos * num_groups
            for block, group_id in islice(entries, count):
                bucket = (key + group_id * GROUP_MIX) & mask
                behind = heads[bucket]
                hnext[block] = behind
                if behind != end:  # only then can an older twin sit behind it
                    unsettled.append(block)
                heads[bucket] = block
                hk[block] = high | (base + group_id)
                srcs[block] = src
        if len(unsettled) > waiting:
            self.unsettled_mixed = True  # entries of many sources: not marked one by one
        if len(unsettled) >= SETTLE_MAX:
            self.settle_duplicates()  # long without a lookup: bounded memory

    def keys_of(self, hashes: Sequence[BlockHash]) -> npt.NDArray[np.int64]:
        """The 4-byte table keys of block hashes (``hash_key`` of each), as int64."""
        return keys_of(hashes)

    def defer_rows(
        self,
        rows: npt.NDArray[Any],
        positions: list[int],
        hashes: list[BlockHash],
        srcs: list[int],
        group_ids: array[int],
    ) -> None:
        """``insert`` of each row's blocks (``[m, G]``, any integer dtype), one per group in
        ``group_ids`` order (a batched step's newly full block in every group), at
        ``positions[k]`` under ``hashes[k]`` from ``srcs[k]``, with the hash table's part left
        pending (``PendingWork``, the rows at once): each source records its blocks and counts
        them, and the memo registers it, at once."""
        self.pending.inserts.add_rows(rows, group_ids, positions, hashes, srcs)
        for blocks, pos, src in zip(rows.tolist(), positions, srcs, strict=True):
            self._record_row(blocks, pos, src)

    def defer_row(
        self, blocks: list[int], pos: int, block_hash: BlockHash, src: int, group_ids: array[int]
    ) -> None:
        """``defer_rows`` of one row (a running request's crossing call: its newly full block
        in every group), without building the arrays of a batch."""
        self.pending.inserts.add(blocks, group_ids, pos, block_hash, src)
        self._record_row(blocks, pos, src)

    def _record_row(self, blocks: list[int], pos: int, src: int) -> None:
        """Source ``src`` records ``blocks`` at ``pos`` (one per group) and counts them."""
        source = self.sources[src]
        assert source is not None
        num_groups = self.num_groups
        first = pos * num_groups
        if first + num_groups > len(source.blocks):
            source.reserve(first + num_groups, self.end)
        source.blocks[first : first + num_groups] = array("i", blocks)
        self._count_cached(src, source, num_groups)

    def defer_entries(
        self, entries: Sequence[tuple[int, int, int]], hashes: Sequence[BlockHash], src: int
    ) -> None:
        """``defer_rows`` for any ``(block, group id, position)`` entries, each keyed by
        ``hashes[position]``."""
        self.pending.insert(entries, hashes, src)
        source = self.sources[src]
        assert source is not None
        end, num_groups = self.end, self.num_groups
        for block, group_id, pos in entries:
            source.record(pos * num_groups + group_id, block, end)
        self._count_cached(src, source, len(entries))
