"""The optimized block pool: reference counts, the free queue and the prefix cache, as arrays.

Same rules as ``hybridkv.reference.block_pool`` (read that first); only the representation
differs. ``N`` is ``num_blocks`` (block 0 is the null block), ``G`` the number of KV cache groups.

Data layout (every array is an ``IntBuffer``: a numpy array with memoryview and tensor views)
--------------------------------------------------------------------------------------------
The int32 fields of a block (``ref``, ``prev``, ``next``, ``hnext``, ``src``) are one 20-byte
record per block (``hybridkv.optimized._buffers.BlockRecords``), each field a strided view:
taking, releasing or caching a block reads and writes one record, not five arrays.

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
source's blocks at once. Evicting a block clears its entry (``evict_primary``), so a recorded
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
(``hybridkv.optimized.pending``, ``defer_rows``/``defer_entries``), which ``apply_pending``
makes in one numpy pass (``release_cached``, ``chain_entries``); the source records and counts
such blocks, and the memo registers it, at once. The manager applies it before anything reads
what it changes.

An eviction policy (``policy``, ``attach_policy``; ``None`` for vLLM's own order): the pool
then takes the policy's victims (``pop_heard``, ``pop_groups``) and tells it each release,
touch and entry as ``BlockPool`` does; ``hybridkv.optimized.policy_seam`` says why such a pool
is used only on its immediate paths.

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

Modules
-------
The pool is one object (``TorchBlockPool``) over one state, its class built in layers, one
module each; each prefix-cache layer extends the one before, and the pool joins the last of
them with the free queue (methods found on the class itself: a call costs no indirection):

- ``free_queue``: ``FreeQueue``, the reference counts and the free queue;
- ``sources``: ``Source``, the table keys (``hash_key``, ``keys_of``) and ``GROUP_MIX``;
- ``cache_chains``: ``CacheChains``, the hash table's buffers and duplicate settling;
- ``prefix_cache``: ``PrefixCache(CacheChains)``, the entries' sources, events and memo
  registrations;
- ``extra_keys``: ``ExtraKeys(PrefixCache)``, keys beyond one per block, and ``evict``;
- ``bulk_inserts``: ``BulkInserts(ExtraKeys)``, inserts in numpy calls and deferred ones;
- ``pending``: ``PendingWork``, the deferred releases and inserts themselves;
- here: ``TorchBlockPool(BulkInserts, FreeQueue)``, where the queue and the cache meet
  (taking blocks evicts their hashes, releasing one sends it to the head or the tail by
  whether it holds one, pending work writes back into both, and the cache resets only while
  no block is held), and its invariant check, one check per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized._buffers import BlockRecords
from hybridkv.optimized.bulk_inserts import BulkInserts
from hybridkv.optimized.free_queue import FreeQueue
from hybridkv.optimized.policy_seam import HeardPolicy
from hybridkv.optimized.sources import GROUP_MIX, Source, hash_key, keys_of
from hybridkv.policies.protocol import EvictionPolicy, PolicyError
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.spec import KVCacheSpec

__all__ = ["GROUP_MIX", "Source", "TorchBlockPool", "hash_key", "keys_of"]


class TorchBlockPool(BulkInserts, FreeQueue):
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
        # One record per block for the free queue's and the hash table's int32 fields.
        records = BlockRecords(num_blocks)
        FreeQueue.__init__(self, num_blocks, records)
        BulkInserts.__init__(
            self, num_blocks, num_groups, enable_kv_cache_events, event_builder, records
        )
        self.enable_caching = enable_caching

    # --- Memory -----------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the per-block buffers (the pool's host memory apart from its sources)."""
        buffers = (
            self.ref, self.prev, self.next, self.heads, self.hnext, self.hk, self.src
        )  # fmt: skip
        return sum(b.nbytes for b in buffers)

    # --- Taking blocks ----------------------------------------------------------------------

    def pop_n(self, count: int, sink: list[tuple[int, KVCacheEvent]] | None = None) -> list[int]:
        """Take ``count`` blocks from the head, evicting their cached hashes; each gets ref 1.

        With a ``sink``, eviction events go there as (index of the popped block, event) instead
        of to the event list (a batch interleaves them with other requests' events).
        """
        if count > self.num_free_blocks:
            raise ValueError(
                f"cannot take {count} blocks from a free queue of {self.num_free_blocks}"
            )
        if self.policy is not None:
            return self.pop_heard(count, sink)
        if count <= 0:
            return []
        nxt, prv, ref, src = self.next.a, self.prev.a, self.ref.a, self.src.a
        if count >= self.insert_min and sink is None:
            # Walk the queue for the ids, then unlink and hold them all in numpy calls, then
            # evict the cached ones in the order taken (eviction reads none of what changed).
            walked = [0] * count
            block = nxt[self.head]
            for index in range(count):
                walked[index] = block
                block = nxt[block]
            self._hold(np.array(walked, dtype=np.int64), block)
            return walked
        taken: list[int] = []
        cached: list[int] = []  # evicted once all are taken (eviction reads no queue link)
        block = nxt[self.head]
        for index in range(count):
            taken.append(block)
            following = nxt[block]
            prv[block] = nxt[block] = -1
            ref[block] = 1
            if src[block] >= 0:
                if sink is None:
                    cached.append(block)
                else:
                    removed: list[KVCacheEvent] = []
                    self.evict(block, removed)
                    sink.extend((index, event) for event in removed)
            block = following
        nxt[self.head] = block
        prv[block] = self.head
        self.num_free_blocks -= count
        if cached:
            self.evict_each(cached)
        return taken

    def pop_array(self, count: int) -> npt.NDArray[np.int64]:
        """``pop_n`` as an int64 array. Where the queue's next ``count`` blocks are consecutive
        ids (a pool's queue before its blocks change places: each block's successor is the
        next id), one comparison of their links finds them, without the walk."""
        nxt = self.next.a
        first = nxt[self.head]
        last = first + count - 1
        if (
            self.policy is not None
            or count <= 0
            or count < self.insert_min
            or count > self.num_free_blocks
            or last >= self.num_blocks
        ):
            return np.array(self.pop_n(count), dtype=np.int64)
        ids = np.arange(first, last + 1, dtype=np.int64)
        if not bool((self.next.n[first:last] == ids[1:]).all()):
            return np.array(self.pop_n(count), dtype=np.int64)
        self.paths.ran(paths.TAKE_RUN)
        self._hold(ids, nxt[last])
        return ids

    def _hold(self, ids: npt.NDArray[np.int64], following: int) -> None:
        """Unlink ``ids``, the queue's first blocks in order (``following`` comes after them),
        hold each once, then evict the cached ones in the order taken (eviction reads none of
        what changed)."""
        self.next.a[self.head] = following
        self.prev.a[following] = self.head
        self.num_free_blocks -= ids.shape[0]
        self.prev.n[ids] = -1
        self.next.n[ids] = -1
        self.ref.n[ids] = 1
        self.evict_each(ids[self.src.n[ids] >= 0].tolist())

    # --- Under an eviction policy -----------------------------------------------------------

    def attach_policy(
        self, policy: EvictionPolicy, specs: Sequence[KVCacheSpec], hash_block_size: int
    ) -> None:
        """Let ``policy`` choose the blocks taken (``hybridkv.optimized.policy_seam``;
        ``specs[g]`` is group ``g``'s spec); it first hears every block free, as ``BlockPool``
        tells it."""
        guarded = HeardPolicy(policy, specs)
        self.policy = guarded
        self.policy_hash_block_size = hash_block_size
        self.policy_steps = tuple(max(1, spec.block_size // hash_block_size) for spec in specs)
        guarded.released(list(range(1, self.num_blocks)), [])

    def is_free(self, block: int) -> bool:
        """Whether ``block`` is a free block of this pool (what a policy may choose)."""
        return 0 < block < self.num_blocks and self.ref.a[block] == 0

    def pop_heard(
        self, count: int, sink: list[tuple[int, KVCacheEvent]] | None = None
    ) -> list[int]:
        """``pop_n`` under a policy, as ``BlockPool.get_new_blocks``: the policy's victims,
        checked before any leaves the queue, then their hashes evicted in that order."""
        assert self.policy is not None
        taken = self.policy.choose(count, self.is_free)
        for block in taken:
            self.remove(block)
        self.policy.taken(taken)
        ref, src = self.ref.a, self.src.a
        for index, block in enumerate(taken):
            ref[block] = 1
            if src[block] < 0:
                continue  # no hash to evict
            if sink is None:
                self.evict(block)
            else:
                removed: list[KVCacheEvent] = []
                self.evict(block, removed)
                sink.extend((index, event) for event in removed)
        return taken

    def pop_groups(self, counts: Sequence[int]) -> list[int]:
        """One ``pop_n`` per group's count, in group order, as the reference takes them (a
        policy is asked once per group). If the policy fails for a later group, the blocks
        the earlier ones took go back to the pool before the error propagates: nothing is
        lost."""
        total = sum(counts)
        if total > self.num_free_blocks:
            raise ValueError(
                f"cannot take {total} blocks from a free queue of {self.num_free_blocks}"
            )
        popped: list[int] = []
        try:
            for count in counts:
                popped.extend(self.pop_n(count))
        except PolicyError:
            self.free_blocks(popped)
            raise
        return popped

    # --- Releasing blocks ------------------------------------------------------------------

    def free_blocks(self, walk: Sequence[int]) -> None:
        """Drop one holder of each block (walk order); see ``BlockPool.free_blocks``."""
        self.free_walks((walk,))

    def free_walks(self, walks: Sequence[Sequence[int]]) -> None:
        """``free_blocks`` of each walk in turn, in one pass: the blocks that become free
        uncached go after the head, the later walks' first (as each call puts its own there),
        the cached ones before the tail in walk order."""
        if self.policy is not None:
            for walk in walks:
                self.free_heard(walk)
            return
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

    def free_heard(self, walk: Sequence[int]) -> None:
        """``free_blocks`` of one walk under a policy, which hears the blocks it freed."""
        assert self.policy is not None
        ref, src = self.ref.a, self.src.a
        keep: list[int] = []
        reuse: list[int] = []
        for block in walk:
            if block == 0:
                continue
            count = ref[block] - 1
            ref[block] = count
            if count == 0:
                (keep if src[block] >= 0 else reuse).append(block)
        if reuse:
            self.link_after(self.head, reuse)
        if keep:
            self.link_after(self.prev.a[self.tail], keep)
        self.policy.released(reuse, keep)

    def apply_pending(self) -> None:
        """Make the running requests' deferred releases and inserts (``PendingWork``)."""
        self.pending.apply(self)

    # --- Resetting -------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no block is held; keep the queue order."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.clear_chains()
        self.clear_entries()
        if self.policy is not None:
            self.policy.reset()
        return True

    # --- Invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool's own bookkeeping is inconsistent."""
        self.check_free_queue()
        # Every cached block sits on exactly the chain of its bucket, with its source's key.
        cached = self.check_chains()
        refs = self.check_keys(cached)
        self.check_extras(refs)
        self.check_duplicates(cached)
        self.check_sources(refs)
        self.check_memo()
