"""The prefix cache's hash table: chains through the block ids, and their duplicate entries.

A chained hash table whose entries are the blocks themselves (a block's *primary* key, so no
separate entry storage is needed). ``N`` is ``num_blocks``, ``G`` the number of groups::

    heads[M]                first block of each bucket's chain, N if empty; M is the smallest
                            power of two >= N / 2 (at least ``MIN_BUCKETS``, 16): a full
                            cache's chains average one or two blocks, for 2–4 bytes a block
    hnext[N + 1]            next block in the same chain; N ends a chain (and hnext[N] = N)
    hk[N + 1]               int64: (first 4 bytes of the cached hash, little endian, signed)
                            << 32 | (hash index × G + group id); hk[N] = -1 matches nothing
    src[N + 1]              the source the block was cached from; -1 if the block holds no
                            hash (src[N] = -1: the chain end holds none)

``hnext`` and ``src`` are fields of the pool's per-block records
(``hybridkv.optimized._buffers.BlockRecords``, beside the free queue's); ``heads`` and ``hk``
are buffers of their own.

A bucket is ``(key + group × 0x9E3779B1) mod M``. Chains are in reverse insertion order (a new
entry goes to the head), so among blocks cached under the same (hash, group) the *last* match on
a chain is the first-inserted one, which is the block a lookup returns (as in the reference).
A lookup compares one int64 per chain entry: key, position and group at once.

Duplicates: the blocks cached while an entry with the same key, position and group was cached
are marked in ``dups`` (a set, rarely non-empty: a prompt computed twice at once), the only
ones a lookup's run of a source's blocks must not trust. Finding them takes a walk of the
chain behind each new entry (none for an entry that became the head of an empty chain, most
of them); it is done for all the blocks cached since the last time (``unsettled``, one by one,
and ``unsettled_many``, numpy arrays) in one vectorised walk when a lookup first needs it
(``settle_duplicates``), or every ``SETTLE_MAX`` blocks, instead of one walk per cached block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.optimized._buffers import BlockRecords, IntBuffer
from hybridkv.optimized.sources import GROUP_MIX, Source
from hybridkv.optimized.thresholds import (
    MIN_BUCKETS,
    REACH_SCALAR_MAX,
    SETTLE_SCALAR_MAX,
    TAIL_MAX,
)
from hybridkv.spec.errors import InvariantError, require


class CacheChains:
    """The hash table's buffers and its duplicate marks (see the module docstring)."""

    def __init__(self, num_blocks: int, num_groups: int, records: BlockRecords) -> None:
        n = num_blocks
        self.num_groups = num_groups
        size = MIN_BUCKETS
        while 2 * size < n:
            size *= 2
        self.mask = size - 1
        self.end = n  # ends every chain
        self.heads = IntBuffer(size, n)
        self.hnext, self.src = records.hnext, records.src
        self.hk = IntBuffer(n + 1, -1, typecode="q")
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
        # Passes of ``settle_duplicates`` made; a source whose ``waiting`` equals it has
        # entries among the unsettled ones, and so may any source while ``unsettled_mixed``
        # (entries of many sources linked at once, not marked per source).
        self.settles = 0
        self.unsettled_mixed = False

    def clear_chains(self) -> None:
        """Empty the table: no block holds a hash."""
        self.heads.t.fill_(self.end)
        self.hnext.t.fill_(self.end)
        self.hk.t.fill_(-1)
        self.src.t.fill_(-1)
        self.dups = set()
        self.unsettled, self.unsettled_many = [], []
        self.settles += 1
        self.unsettled_mixed = False

    def bucket(self, key: int, group_id: int) -> int:
        return (key + group_id * GROUP_MIX) & self.mask

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

    def settle_duplicates(self) -> None:
        """Mark the blocks cached since the last call that have an older entry of the same
        key, position and group on their chain (``dups``): one walk of their chains when a
        lookup needs it, instead of one walk per cached block; one by one on the array views
        for up to ``SETTLE_SCALAR_MAX`` blocks, else in numpy calls on the buffers' views, a
        chain step for all of them at once."""
        if not self.unsettled and not self.unsettled_many:
            return
        self.settles += 1
        self.unsettled_mixed = False
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
            require(steps <= self.end, "a prefix-cache chain loops")
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

    def settle_for(self, source: Source) -> None:
        """``settle_duplicates`` unless none of the waiting entries is ``source``'s: a lookup
        that reads only that source's blocks needs only their marks, final once they are
        settled (a later entry of the same key is the newer twin, never they)."""
        if self.unsettled_mixed or source.waiting == self.settles:
            self.settle_duplicates()

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
                require(length <= self.end, "a prefix-cache chain loops")

    # --- Invariants -------------------------------------------------------------------------

    def chains(self) -> list[list[int]]:
        """Each bucket's chain, head first; ``InvariantError`` if one is not sound (a block on
        two chains or on another bucket's, an uncached block on one, a loop). A walk block by
        block: ``check_chains`` decides in numpy calls, and calls this to name the offender."""
        n, src, hk, hnext, end = self.end, self.src.a, self.hk.a, self.hnext.a, self.end
        require(hnext[end] == end and hk[end] == -1, "the chain end was written")
        seen: set[int] = set()
        heads = self.heads.a
        out: list[list[int]] = []
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
                block = hnext[block]
            out.append(chain)
        cached = {b for b in range(n) if src[b] >= 0}
        require(seen == cached, f"{len(cached)} blocks hold a hash but {len(seen)} are cached")
        require(all((hk[b] == -1) == (src[b] < 0) for b in range(n)), "src and hk disagree")
        return out

    def check_chains(self) -> npt.NDArray[np.int64]:
        """``chains``' checks in a few numpy calls; the cached blocks (ascending). Every bucket's
        head and every cached block's link leads to a cached block of that bucket or ends the
        chain, each cached block is led to exactly once, and the chains from the heads reach
        them all (so none loops): then the chains hold each cached block once, as ``chains``
        requires. When one of these fails, ``chains`` walks them to name the first offender."""
        n = end = self.end
        hk, hnext = self.hk.n, self.hnext.n
        require(hnext[end] == end and hk[end] == -1, "the chain end was written")
        held = self.src.n[:n] >= 0
        cached = held.nonzero()[0]
        if not self._chains_sound(held, cached):
            self.chains()  # raises, naming the first offender
            raise InvariantError("the prefix-cache chains are broken")
        require(bool(((hk[:n] != -1) == held).all()), "src and hk disagree")
        return cached

    def _chains_sound(self, held: npt.NDArray[np.bool_], cached: npt.NDArray[np.int64]) -> bool:
        """Whether the chains hold exactly the ``cached`` blocks (``held``: whether each block
        holds a hash), each once, each on its bucket's chain."""
        n = end = self.end
        heads, hnext = self.heads.n, self.hnext.n
        used = (heads != end).nonzero()[0]
        firsts, links = heads[used], hnext[cached]
        linked = links != end
        targets = np.concatenate((firsts, links[linked]))
        try:
            arrows = np.bincount(targets, minlength=n)
        except ValueError:
            return False  # a link to a negative id
        # One arrow into each cached block, none into another (nor past the blocks).
        if arrows.shape[0] != n or (arrows != held).any():
            return False
        keys = self.hk.n[cached]
        bucket = np.empty(n + 1, dtype=np.int64)
        mixed = (keys >> 32) + (keys & 0xFFFFFFFF) % self.num_groups * GROUP_MIX
        bucket[cached] = mixed & self.mask
        if (bucket[targets] != np.concatenate((used, bucket[cached[linked]]))).any():
            return False
        count = int(cached.shape[0])
        return self._reach(firsts, count) == count

    def _reach(self, firsts: npt.NDArray[Any], limit: int) -> int:
        """How many blocks the chains from ``firsts`` reach (more than ``limit``: stopped). With
        one arrow into each block, no two chains meet: a loop cut off from every head is the
        only way to reach fewer. One chain step for all chains at once while many are left,
        then one block at a time along the few long ones."""
        end, hnext = self.end, self.hnext.n
        frontier = firsts
        reached = int(frontier.shape[0])
        while frontier.shape[0] > REACH_SCALAR_MAX and reached <= limit:
            following = hnext[frontier]
            frontier = following[following != end]
            reached += int(frontier.shape[0])
        step = self.hnext.a
        for block in frontier.tolist():
            block = step[block]
            while block != end and reached <= limit:
                reached += 1
                block = step[block]
        return reached

    def check_duplicates(self, cached: npt.NDArray[np.int64]) -> None:
        """Raise ``InvariantError`` unless every entry with an older entry of its key, position
        and group further down its chain is marked a duplicate (once the blocks cached since
        the last lookup are settled), and every mark is of a cached block. Only the chains of
        keys held by more than one entry are walked (a key's entries share a chain)."""
        hk, src = self.hk.n, self.src.a
        keys = np.sort(hk[cached])
        twins = keys[1:][keys[1:] == keys[:-1]]
        later: set[int] = set()
        if twins.shape[0]:
            tags = twins & 0xFFFFFFFF
            buckets = ((twins >> 32) + tags % self.num_groups * GROUP_MIX) & self.mask
            later = self._later_entries(set(buckets.tolist()))
        hidden = self.hidden_waiting(later - self.dups)
        self.settle_duplicates()
        if not later <= self.dups:
            raise InvariantError(f"duplicate entries {sorted(later - self.dups)} unmarked")
        require(not hidden, f"duplicate entries {sorted(hidden)} waited, their sources unmarked")
        require(all(src[b] >= 0 for b in self.dups), "an uncached block is marked duplicate")

    def hidden_waiting(self, unmarked: set[int]) -> set[int]:
        """Of these twins not marked yet, those ``settle_for`` would let a lookup read
        unmarked (their sources not marked waiting): the pool reads their sources."""
        return set()

    def _later_entries(self, buckets: set[int]) -> set[int]:
        """The entries of these buckets' (sound) chains with an older entry of their key."""
        hk, hnext, heads, end = self.hk.a, self.hnext.a, self.heads.a, self.end
        later: set[int] = set()
        for bucket in buckets:
            chain: list[int] = []
            block = heads[bucket]
            while block != end:
                chain.append(block)
                block = hnext[block]
            older: set[int] = set()
            for block in reversed(chain):  # first inserted first
                if hk[block] in older:
                    later.add(block)
                older.add(hk[block])
        return later
