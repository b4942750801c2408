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

    released                      array('q'): the blocks of deferred releases, in walk order
    blocks, groups, positions,    array('q') each: one deferred insert per index, in call
    srcs                          order (block, group id, table position, source)
    hashes                        list[bytes]: the hash each insert is keyed by

``apply`` reads the arrays through numpy views and turns the hashes into 4-byte keys with one
join.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.reference.block_hash import BlockHash

if TYPE_CHECKING:
    from hybridkv.optimized.block_pool import TorchBlockPool


class PendingWork:
    """Deferred releases and inserts of running requests' steps (see the module docstring)."""

    __slots__ = ("blocks", "groups", "hashes", "positions", "released", "srcs")

    def __init__(self) -> None:
        self.released = array("q")
        self.blocks = array("q")
        self.groups = array("q")
        self.positions = array("q")
        self.srcs = array("q")
        self.hashes: list[BlockHash] = []

    def __bool__(self) -> bool:
        return bool(self.released) or bool(self.hashes)

    def __len__(self) -> int:
        """Deferred releases and inserts together."""
        return len(self.released) + len(self.hashes)

    def release(self, blocks: Sequence[int]) -> None:
        """Defer dropping one holder of each block (cached blocks only), in walk order."""
        self.released.extend(blocks)

    def insert_row(
        self,
        blocks: Sequence[int],
        group_ids: array[int],
        pos: int,
        block_hash: BlockHash,
        src: int,
    ) -> None:
        """Defer caching ``blocks[i]`` of group ``group_ids[i]`` at position ``pos``, all under
        ``block_hash`` from source ``src`` (a decode step's newly full block in every group)."""
        count = len(blocks)
        self.blocks.extend(blocks)
        self.groups.extend(group_ids)
        self.positions.extend(array("q", (pos,)) * count)
        self.srcs.extend(array("q", (src,)) * count)
        self.hashes.extend([block_hash] * count)

    def insert(
        self, entries: Sequence[tuple[int, int, int]], hashes: Sequence[BlockHash], src: int
    ) -> None:
        """Defer caching each ``(block, group id, position)`` under ``hashes[position]``, from
        source ``src``."""
        for block, group_id, pos in entries:
            self.blocks.append(block)
            self.groups.append(group_id)
            self.positions.append(pos)
            self.srcs.append(src)
            self.hashes.append(hashes[pos])

    def apply(self, pool: TorchBlockPool) -> None:
        """Make the deferred releases, then the deferred inserts, and forget them."""
        if self.released:
            # The numpy view keeps the array alive; a fresh one takes the next releases.
            released = np.frombuffer(self.released, dtype=np.int64)
            self.released = array("q")
            pool.release_cached(released)
        if self.hashes:
            blocks, groups, positions, srcs = (
                np.frombuffer(values, dtype=np.int64)
                for values in (self.blocks, self.groups, self.positions, self.srcs)
            )
            hashes = self.hashes
            self.blocks, self.groups, self.positions, self.srcs = (array("q") for _ in range(4))
            self.hashes = []
            pool.chain_entries(blocks, groups, positions, srcs, hashes)
