"""``PendingWork``: the pool's share of running requests' steps, written back in one pass.

A running request's step (``allocate_slots`` of a request that holds a row) may release blocks
that left its windows and cache blocks that became full. Both change pool state that no step of
another running request reads: reference counts and the free queue's tail (a step takes new
blocks from the head), and the prefix-cache hash table (only lookups read it). So the pool
records them here, in call order, and applies them all at once (``apply``) before anything reads
what they change: every manager call but a running step's, and a running step that needs what
they give (more free blocks than the queue holds without them). The scheduler's
``new_step_starts`` applies them too, so in a scheduler's loop they wait one step at most.
What a cached block's source records (its run array, its count of cached blocks) and the hash
memo are written at once: only lookups read them, after applying this.

Why the result is the sequential one
------------------------------------
- A deferred release is of a block that holds a cached hash (the manager releases one that
  does not at once, after applying what waits): its holder count drops by one and, if that was
  its last holder, it goes before the tail. Takes happen at the head, so taking ``k`` blocks
  from a queue of at least ``k`` gives the same blocks whether the appends were made first or
  not; a block released twice goes to the tail at its last release, as in call order.
- A deferred insert is of a block a running request holds (its newly full block): no take can
  evict it, and no release precedes its insert (its release would find it uncached and apply
  this first). Inserts keep their order, which decides which of two blocks cached under one
  key a lookup returns (the first inserted); releases touch other blocks, so making all
  releases before all inserts changes nothing.
- A take that evicts a cached block unlinks it from its chain: that involves no waiting insert
  (those blocks are held), and the evicted block's source is not dropped while a row names it.

Data layout
-----------
::

    released   array('q'): the blocks of deferred releases, in walk order
    inserts    ``PendingInserts``, columns in call order:
      blocks, groups               array('q'), one value per entry (a block and its group)
      positions, sources, counts   array('q'), one value per record: the entries one call
                                   caches at one position, consecutive in ``blocks``, all
                                   keyed by one hash (a decode step's: one block per group)
      hashes                       list of the records' block hashes

The columns are written as the steps defer (a few appends, where the step's values are at
hand), so that ``apply`` reads them as numpy views: no pass over Python objects made a whole
step before and cold by then. It turns the hashes into 4-byte keys with one join; below
``pending_min`` entries (releases and inserts together) it releases and links one by one.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from hybridkv.optimized.sources import keys_of
from hybridkv.reference.block_hash import BlockHash


class PendingInserts:
    """Deferred inserts as columns (see the module docstring)."""

    __slots__ = ("blocks", "counts", "groups", "hashes", "positions", "sources")

    def __init__(self) -> None:
        self.blocks = array("q")
        self.groups = array("q")
        self.positions = array("q")
        self.sources = array("q")
        self.counts = array("q")
        self.hashes: list[BlockHash] = []

    def __len__(self) -> int:
        """Entries (blocks) waiting."""
        return len(self.blocks)

    def add(
        self,
        blocks: Sequence[int],
        group_ids: Sequence[int],
        pos: int,
        block_hash: BlockHash,
        src: int,
    ) -> None:
        """Defer caching ``blocks[i]`` of group ``group_ids[i]`` at ``pos``, all under
        ``block_hash`` from source ``src``: one record (a decode step's newly full block in
        every group). Each of ``blocks`` and ``group_ids`` is a list or an ``array('q')`` (what
        ``array.extend`` takes for the columns)."""
        self.blocks.extend(blocks)
        self.groups.extend(group_ids)
        self.positions.append(pos)
        self.sources.append(src)
        self.counts.append(len(blocks))
        self.hashes.append(block_hash)

    def add_rows(
        self,
        blocks: npt.NDArray[Any],
        group_ids: array[int],
        positions: list[int],
        hashes: list[BlockHash],
        srcs: list[int],
    ) -> None:
        """``add`` of each row of ``blocks`` (``[m, G]``, any integer dtype: row ``k`` holds one
        block per group, in ``group_ids`` order, cached at ``positions[k]`` under ``hashes[k]``
        from ``srcs[k]``): a whole step's decode rows in one append per column."""
        count, per_row = blocks.shape
        self.blocks.frombytes(np.ascontiguousarray(blocks, dtype=np.int64).tobytes())
        self.groups.extend(group_ids * count)
        self.positions.fromlist(positions)
        self.sources.fromlist(srcs)
        self.counts.extend(array("q", (per_row,)) * count)
        self.hashes.extend(hashes)


class PendingTarget(Protocol):
    """What ``apply`` writes back into: the block pool's release and chain passes (in numpy
    calls from its ``pending_min`` entries, else one entry at a time)."""

    pending_min: int

    def release_cached(self, blocks: npt.NDArray[np.int64]) -> None: ...

    def release_cached_each(self, blocks: Sequence[int]) -> None: ...

    def chain_records(self, inserts: PendingInserts) -> None: ...

    def chain_entries(
        self,
        blocks: npt.NDArray[np.int64],
        groups: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        srcs: npt.NDArray[np.int64],
        keys: npt.NDArray[np.int64],
    ) -> None: ...


class PendingWork:
    """Deferred releases and inserts of running requests' steps (see the module docstring)."""

    __slots__ = ("inserts", "released")

    def __init__(self) -> None:
        self.released = array("q")
        self.inserts = PendingInserts()

    def __bool__(self) -> bool:
        return bool(self.released) or bool(self.inserts.counts)

    def __len__(self) -> int:
        """Deferred releases and inserts together."""
        return len(self.released) + len(self.inserts.blocks)

    def release(self, blocks: list[int]) -> None:
        """Defer dropping one holder of each block (cached blocks only), in walk order."""
        self.released.fromlist(blocks)  # a list's items read in place

    def release_array(self, blocks: npt.NDArray[np.int64]) -> None:
        """``release`` of an int64 array of blocks (a whole step's), copied as bytes."""
        self.released.frombytes(blocks.tobytes())

    def insert(
        self, entries: Sequence[tuple[int, int, int]], hashes: Sequence[BlockHash], src: int
    ) -> None:
        """Defer caching each ``(block, group id, position)`` under ``hashes[position]``, from
        source ``src`` (one record per position: the order of two entries matters only when
        they share a key, position and group, which one call's entries never do)."""
        by_position: dict[int, tuple[list[int], list[int]]] = {}
        for block, group_id, pos in entries:
            blocks, group_ids = by_position.setdefault(pos, ([], []))
            blocks.append(block)
            group_ids.append(group_id)
        for pos, (blocks, group_ids) in by_position.items():
            self.inserts.add(blocks, group_ids, pos, hashes[pos], src)

    def apply(self, pool: PendingTarget) -> None:
        """Make the deferred releases, then the deferred inserts, and forget them: one entry
        at a time below the pool's ``pending_min`` entries in all, else in numpy calls (made
        at the start of the next step, they run cold: ``thresholds.PENDING_MIN``)."""
        vector = len(self) >= pool.pending_min
        if self.released:
            released, self.released = self.released, array("q")
            if vector:
                # The numpy view keeps the array alive; a fresh one takes the next releases.
                pool.release_cached(np.frombuffer(released, dtype=np.int64))
            else:
                pool.release_cached_each(released)
        if self.inserts.counts:
            inserts, self.inserts = self.inserts, PendingInserts()
            if not vector:
                pool.chain_records(inserts)
                return
            # Views of the columns (each keeps its array alive; fresh ones take the next).
            counts = np.frombuffer(inserts.counts, dtype=np.int64)
            positions = np.repeat(np.frombuffer(inserts.positions, dtype=np.int64), counts)
            srcs = np.repeat(np.frombuffer(inserts.sources, dtype=np.int64), counts)
            keys = np.repeat(keys_of(inserts.hashes), counts)
            blocks = np.frombuffer(inserts.blocks, dtype=np.int64)
            groups = np.frombuffer(inserts.groups, dtype=np.int64)
            pool.chain_entries(blocks, groups, positions, srcs, keys)
