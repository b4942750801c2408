"""The admission floor: the least work the benchmark's admission scenario does, timed in the
benchmark's own loop beside the backends.

A missed speed target may stay missed only where the path is within 20 % of its floor: the
cost of the Python operations it cannot avoid. ``AdmissionFloor`` is that floor for the
admission scenario (``bench_scenarios.admission``: a prompt whose first ``shared`` ids a cached
request holds, then ids of its own), on buffers of the benchmark's sizes, with no checks, no
thresholds, no events and no function layers. Each ``admit``:

1. validates and packs the prompt (``pack_token_ids``, the request's own check);
2. compares the shared prefix's packed ids with the cached request's (one numpy comparison),
   adopts its hashes of those blocks and hashes the rest (the backend's hash function: the
   hash is vLLM's, fixed);
3. reads the hit from the cached request's record (the full-attention group's blocks, each
   window group's last ``window_blocks``), checks in one gather that each still holds its key,
   and holds them;
4. takes one block per new position and group from a linked free queue (its next blocks found
   as one run of consecutive ids by one comparison of their links, else walked in Python;
   unlinked in numpy calls);
5. writes the row's tables and keys the new blocks in a hash table of chained buckets (numpy
   calls, no two in a bucket);
6. returns the new blocks as the tuples ``KVCacheBlocks`` holds.

The benchmark times it right after an untimed admission of the same prompt by vLLM's manager,
as the optimized backend's admission follows vLLM's, so that both start as cold;
``scripts/bench_bounds.py`` times it alone, after other work and after vLLM's admissions.

Data layout (G groups, N = full blocks of a prompt, S = of the shared prefix)
----------------------------------------------------------------------------
::

    record   int32 [G, N]   the cached request's blocks by group and position (row 0 of the
                            tables); group 0 is full attention, the others windows
    hk       int64 [blocks] a cached block's key (a hash's first 4 bytes) << 32 | its group
    ref      int32 [blocks] holders of each block
    nxt/prv  int32 [blocks] the free queue's links (``head``: its sentinel)
    heads    int32 [buckets], hnext int32 [blocks]: the hash table's chains
    tab      int32 [G, rows, N + 1] the block tables, one row per admitted request
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.bench_backends import BLOCK, GROUPS, WINDOW
from hybridkv.optimized.hashing import hash_packed_blocks
from hybridkv.optimized.sources import GROUP_MIX, keys_of
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import pack_token_ids

__all__ = ["AdmissionFloor"]


class AdmissionFloor:
    """The admission scenario's floor (see the module docstring): ``cached_prompt`` is the
    cached request's prompt, whose first ``shared`` ids every admitted prompt repeats; room
    for ``admissions`` admissions of prompts of its length."""

    def __init__(
        self,
        cached_prompt: Sequence[int],
        shared: int,
        admissions: int,
        *,
        groups: int = GROUPS,
        block_size: int = BLOCK,
        window_blocks: int = WINDOW // BLOCK,
    ) -> None:
        if shared <= 0 or shared % block_size or shared >= len(cached_prompt):
            raise ValueError(
                f"shared must be a positive multiple of block_size {block_size} below the "
                f"cached prompt's {len(cached_prompt)} ids, got {shared}"
            )
        if window_blocks <= 0:
            raise ValueError(f"window_blocks must be positive, got {window_blocks}")
        ids, packed = pack_token_ids("cached_prompt", cached_prompt)
        if packed is None:
            raise ValueError("cached_prompt: an id does not fit in 64 bits")
        self.groups, self.block_size = groups, block_size
        self.shared, self.length = shared, len(ids)
        self.num_shared, self.num_full = shared // block_size, len(ids) // block_size
        self.window = min(window_blocks, self.num_shared)  # a window's hit: its last blocks
        width = self.num_full + 1
        blocks = (admissions + 2) * groups * width
        self.cached_hashes = hash_packed_blocks(
            ids, packed, block_size, start_block=0, parent_hash=None, cache_salt=None
        )
        self.cached_view = np.frombuffer(packed, dtype=np.uint64)[:shared]
        self.record = np.arange(1, 1 + groups * self.num_full, dtype=np.int32).reshape(
            groups, self.num_full
        )
        self.keys = keys_of(self.cached_hashes)
        self.hk = np.full(blocks + 1, -1, dtype=np.int64)
        self.hk[self.record] = self.keys[None, :] << 32 | np.arange(groups)[:, None]
        self.ref = np.zeros(blocks + 1, dtype=np.int32)
        self.ref[self.record] = 1
        self.nxt_n = np.arange(1, blocks + 2, dtype=np.int32)
        self.prv_n = np.arange(-1, blocks, dtype=np.int32)
        self.nxt = self.nxt_n.data.cast("B").cast("i")  # scalar reads and writes, no numpy call
        self.head = groups * self.num_full  # the queue's sentinel: the blocks after it are free
        self.mask = (1 << (blocks // 2).bit_length()) - 1
        self.heads = np.full(self.mask + 1, blocks, dtype=np.int32)
        self.hnext = np.full(blocks + 1, blocks, dtype=np.int32)
        self.tab = np.zeros((groups, admissions + 2, width), dtype=np.int32)
        # The backend's spread of a group's keys over the buckets.
        self.mix = np.arange(groups, dtype=np.int64)[:, None] * GROUP_MIX
        self.group_ids = np.arange(groups, dtype=np.int64)[:, None]
        self.rows, self.admissions = 0, admissions
        self.last_hashes: list[BlockHash] = []
        """The block hashes of the last admitted prompt (for a check that the floor hashes as
        the backends do)."""

    def admit(self, prompt: list[int]) -> tuple[tuple[int, ...], ...]:
        """Admit ``prompt`` (see the module docstring): its new blocks, one tuple per group."""
        if len(prompt) != self.length or self.rows == self.admissions:
            raise ValueError(
                f"prompt: the floor admits {self.admissions} prompts of {self.length} ids, got "
                f"one of {len(prompt)} after {self.rows}"
            )
        self.rows += 1
        row, s, n = self.rows, self.num_shared, self.num_full
        ids, packed = pack_token_ids("prompt_token_ids", prompt)
        assert packed is not None
        ours = np.frombuffer(packed, dtype=np.uint64)[: self.shared]
        if not np.array_equal(ours, self.cached_view):
            raise ValueError("prompt: its shared prefix differs from the cached prompt's")
        hashes = self.cached_hashes[:s]
        hashes += hash_packed_blocks(
            ids, packed, self.block_size, start_block=s, parent_hash=hashes[-1], cache_salt=None
        )
        full = self.record[0, :s]
        windows = self.record[1:, s - self.window : s]
        if not (self.hk[full] >> 32 == self.keys[:s]).all():
            raise RuntimeError("a hit block lost its key")
        self.ref[full] += 1
        self.ref[windows] += 1
        # Take: the queue's first blocks, unlinked and held once.
        count, nxt, head = self.groups * (n - s), self.nxt, self.head
        first = nxt[head]
        new = np.arange(first, first + count, dtype=np.int64)
        if (self.nxt_n[first : first + count - 1] == new[1:]).all():
            block = nxt[first + count - 1]
        else:
            walked = [0] * count
            block = first
            for index in range(count):
                walked[index] = block
                block = nxt[block]
            new = np.array(walked, dtype=np.int64)
        nxt[head] = block
        self.prv_n[block] = head
        self.nxt_n[new] = self.prv_n[new] = -1
        self.ref[new] = 1
        taken = new.reshape(self.groups, -1)
        self.tab[0, row, :s] = full
        self.tab[1:, row, s - self.window : s] = windows
        self.tab[:, row, s:n] = taken
        new_keys = np.frombuffer(b"".join(hashes[s:]), dtype="<i4")[::8]
        buckets = (new_keys + self.mix) & self.mask
        self.hnext[taken] = self.heads[buckets]
        self.heads[buckets] = taken
        self.hk[taken] = new_keys.astype(np.int64) << 32 | self.group_ids
        self.last_hashes = hashes
        return tuple(map(tuple, taken.tolist()))
