"""The block pool's reference counts and free queue, as arrays.

Same rules as ``hybridkv.reference.block_pool``'s ``FreeKVCacheBlockQueue`` and ``ref_cnt``;
only the representation differs. ``N`` is ``num_blocks`` (block 0 is the null block).

Data layout (``IntBuffer``: a numpy array with memoryview and tensor views; the three are fields
of the pool's per-block records, ``hybridkv.optimized._buffers.BlockRecords``)::

    ref[N]                  holders of each block
    prev[N + 2], next[N + 2] the free queue, an intrusive doubly linked list through the block
                            ids; N is the head sentinel, N + 1 the tail sentinel. A block is in
                            the queue iff prev[b] != -1.

A linked list through the ids, not a deque of objects: 12 bytes a block, no Python object per
block, and unlinking a block a cache hit adopts is two writes. Releases that free uncached
blocks link them after the head (reused first), cached ones before the tail (evicted last), in
the reference's order; the numpy paths (``touch_array``, ``release_cached``,
``link_after_array``) make the same links in a few calls for ``INSERT_MIN`` blocks or more.
Taking blocks (``TorchBlockPool.pop_n``) evicts their cached hashes, and releasing them
(``free_walks``) sends a block to one end or the other by whether it holds one, so those two
live with the pool, where the queue and the prefix cache meet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.optimized._buffers import BlockRecords
from hybridkv.optimized.policy_seam import HeardPolicy
from hybridkv.optimized.thresholds import INSERT_MIN, PENDING_MIN
from hybridkv.spec.errors import InvariantError, require


class FreeQueue:
    """Reference counts and the free queue of blocks ``0 … N − 1`` (see the module docstring)."""

    def __init__(self, num_blocks: int, records: BlockRecords) -> None:
        n = num_blocks
        self.num_blocks = n
        self.insert_min = INSERT_MIN
        """From this many blocks, the numpy paths (``Tuning.insert_min``; a test lowers it)."""
        self.pending_min = PENDING_MIN
        """From this many entries, the pending work's numpy paths (``Tuning.pending_min``)."""
        self.head = n
        self.tail = n + 1
        self.ref, self.prev, self.next = records.ref, records.prev, records.next
        # Free queue 1 … N − 1 in id order.
        ids = torch.arange(n + 2, dtype=torch.int32)
        self.next.t[1 : n - 1] = ids[2:n]
        self.prev.t[2:n] = ids[1 : n - 1]
        self.next.a[self.head] = 1
        self.prev.a[1] = self.head
        self.next.a[n - 1] = self.tail
        self.prev.a[self.tail] = n - 1
        self.num_free_blocks = n - 1
        # The eviction policy (``TorchBlockPool.attach_policy``); ``None``: vLLM's own order.
        self.policy: HeardPolicy | None = None

    @property
    def usage(self) -> float:
        return 1.0 - (self.num_free_blocks / (self.num_blocks - 1))

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
        if self.policy is not None:
            self.touch_heard(blocks)
            return
        ref = self.ref.a
        for block in blocks:
            if block == 0:
                continue
            if ref[block] == 0:
                self.remove(block)
            ref[block] += 1

    def touch_heard(self, blocks: Iterable[int]) -> None:
        """``touch`` under a policy: the policy hears the adopted blocks, in order."""
        assert self.policy is not None
        ref = self.ref.a
        touched: list[int] = []
        for block in blocks:
            if block == 0:
                continue
            if not ref[block]:
                self.remove(block)  # it was free
            ref[block] += 1
            touched.append(block)
        self.policy.touched(touched)

    def touch_array(self, blocks: npt.NDArray[Any], refs: npt.NDArray[Any] | None = None) -> bool:
        """``touch`` for a numpy array of distinct non-null blocks (order does not matter: a
        block leaves the queue wherever it is; under a policy, which hears the order, it is
        the array's); whether the references were counted as one array. ``refs``: the
        blocks' reference counts, when the caller read them already."""
        if blocks.shape[0] < self.insert_min or self.policy is not None:
            self.touch(blocks.tolist())
            return False
        ref = self.ref.n
        if refs is None:
            refs = ref[blocks]
        for block in blocks[refs == 0].tolist():
            self.remove(block)
        ref[blocks] = refs + 1
        return True

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
        if count < self.insert_min:
            self.release_cached_each(blocks.tolist())
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

    def release_cached_each(self, blocks: Sequence[int]) -> None:
        """``release_cached`` one block at a time on the array views (few blocks: numpy's
        calls would cost more)."""
        counts = self.ref.a
        keep: list[int] = []
        for block in blocks:
            left = counts[block] - 1
            counts[block] = left
            if left == 0:
                keep.append(block)
        if keep:
            self.link_after(self.prev.a[self.tail], keep)

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

    def check_free_queue(self) -> None:
        """Raise ``InvariantError`` if the queue and the reference counts disagree: one walk of
        the queue (at most ``N`` steps: a loop lists a block twice), set and list comparisons
        of what it found, numpy calls over the whole arrays; a message lists its offenders
        only when its check fails."""
        n = self.num_blocks
        ref, prv, nxt = self.ref.n, self.prev.n, self.next.n
        free = self.walk_free(n)
        require(len(free) == self.num_free_blocks, "free queue length != num_free_blocks")
        queued = set(free)
        if len(queued) != len(free):
            raise InvariantError(f"free queue holds a block twice: {free}")
        require(0 not in queued, "the null block is in the free queue")
        # Before the links are read: the queue holds exactly the blocks held by none.
        zero = set(((ref[1:] == 0).nonzero()[0] + 1).tolist())
        if queued != zero:
            raise InvariantError(f"free queue {sorted(free)} != count-0 blocks {sorted(zero)}")
        back = self.prev.a
        behind = [self.head, *free]
        if [back[block] for block in free] != behind[:-1]:
            block = next(b for b, ahead in zip(free, behind[:-1], strict=True) if back[b] != ahead)
            raise InvariantError(f"free queue back link of block {block} is broken")
        require(back[self.tail] == behind[-1], "free queue tail link is broken")
        require(int(ref.min()) >= 0, "a negative reference count")
        require(ref[0] == 0 and prv[0] == -1 and nxt[0] == -1, "the null block was used")
        # The queued blocks are linked (above), and are the blocks held by none: no other
        # block may be.
        if int(np.count_nonzero(prv[1:n] != -1)) != len(free) or int(
            np.count_nonzero(nxt[1:n] != -1)
        ) != len(free):
            linked = ((ref[1:] > 0) & ((prv[1:n] != -1) | (nxt[1:n] != -1))).nonzero()[0]
            raise InvariantError(f"held block {int(linked[0]) + 1} is linked")

    def walk_free(self, limit: int) -> list[int]:
        """The first ``limit`` queued blocks (``free_queue`` of a queue that may be broken: a
        loop lists its blocks again until the limit, a link to no block ends the walk)."""
        nxt, tail = self.next.a, self.tail
        out: list[int] = []
        append = out.append
        block = nxt[self.head]
        try:
            for _ in range(limit):
                if block == tail:
                    break
                append(block)
                block = nxt[block]
        except IndexError:
            pass  # listed: the check names it
        return out
