"""The prefix cache's sources: the requests that cached blocks, and the 4-byte table keys.

A cached block records the *source* it was cached from (``TorchBlockPool.src``): the request
that computed it, its token list, its block hashes and its cache salt, all by reference, never
copied, so that a lookup verifies a hit against the whole prefix instead of trusting a hash.
Sources live in the pool's Python list (one per request that cached blocks, not per block).

Data layout of a ``Source``: ``blocks``, an ``array('i')`` indexed by tag (hash index × G +
group id, the low half of the pool's ``hk``), holding the block cached from this source under
that tag, or the pool's chain end where none (evicting a block clears its entry): 4 bytes per
position and group of the sources alive, nothing per block of the pool, and a lookup reads a
long hit as runs of it (``hybridkv.optimized.source_runs``). ``refs`` counts the cached
blocks naming the source, ``row_refs`` the live block-table rows; the pool drops it when both
are 0.

A hash's table key is its first 4 bytes, little endian, signed (``hash_key``; ``keys_of`` for
many at once): the high half of ``hk``. ``GROUP_MIX`` spreads one key's groups over buckets.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.reference.block_hash import BlockHash

GROUP_MIX = 0x9E3779B1
"""Spreads the same hash of different groups over different buckets."""

_KEY = struct.Struct("<i")


def hash_key(block_hash: bytes) -> int:
    """The 4-byte table key of a block hash (any length; short ones are zero-padded)."""
    if len(block_hash) >= 4:
        key: int = _KEY.unpack_from(block_hash)[0]
        return key
    return int(_KEY.unpack(block_hash.ljust(4, b"\0"))[0])


def keys_of(hashes: Sequence[BlockHash]) -> npt.NDArray[np.int64]:
    """The 4-byte table keys of block hashes (``hash_key`` of each), as int64."""
    joined = b"".join(hashes)
    if len(joined) == 32 * len(hashes):
        return np.frombuffer(joined, dtype="<i4")[::8].astype(np.int64)
    return np.fromiter((hash_key(h) for h in hashes), dtype=np.int64, count=len(hashes))


class Source:
    """The token ids, block hashes and cache salt of a request that cached blocks.

    ``packed`` is the request's ``packed_token_ids`` when it keeps one (``Request`` does): the
    same tokens as one array, so that verification compares memory instead of ints. ``blocks``
    maps a tag (hash index × G + group id, the low half of ``hk``) to the block cached from
    this source under it (the pool's chain end where none: evicting a block clears its entry),
    so that a lookup reads a whole run of a prompt's blocks from it at once instead of walking
    a chain per position."""

    __slots__ = ("blocks", "hashes", "packed", "refs", "row_refs", "salt", "tokens", "waiting")

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
        # The pool's ``settles`` when an entry of this source last joined the unsettled
        # ones (``CacheChains.settle_for``): equal to it, some may still wait.
        self.waiting = -1

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

    def record_positions(self, start: int, blocks: npt.NDArray[np.int64], end: int) -> None:
        """``record`` of a ``[G, n]`` matrix of blocks at positions ``start`` … ``start + n −
        1`` of every group: tags ``start × G`` … ``(start + n) × G − 1``, one slice."""
        g_count, count = blocks.shape
        first, top = start * g_count, (start + count) * g_count
        if top > len(self.blocks):
            self.reserve(top + top // 4, end)  # a prompt's records: room for its decode too
        view = np.frombuffer(self.blocks, dtype=np.int32)  # for this call only (see below)
        view[first:top].reshape(count, g_count)[...] = blocks.T  # one strided copy
        del view

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
