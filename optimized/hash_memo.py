"""The hashes of the blocks in the prefix cache, remembered for the requests that follow.

A ``HashMemo`` is the block hasher a ``TorchKVCacheManager`` offers for its requests
(``manager.block_hasher``; pass it as ``Request(..., block_hasher=manager.block_hasher)``). It
has the signature of ``hybridkv.reference.block_hash.hash_full_blocks`` and returns byte for
byte the hashes of ``hybridkv.optimized.hashing.hash_full_blocks_torch``: it memoises that
deterministic function for the blocks the prefix cache holds, so a request whose prompt starts
with a cached prefix adopts that prefix's hashes and SHA-hashes only the rest.

Data layout
-----------
One dict, ``entries``::

    (parent hash or None, block token bytes, cache salt or None) -> (block hash, count)

- the parent is the hash of the block before (``None`` for block 0, as the request's hasher
  is called);
- the token bytes are the block's token ids packed as ``array('I')`` (4 bytes per id, so a
  block's bytes have one length and the key is exact); ids outside ``[0, 2**32)`` are never
  remembered and a call with such ids hashes from scratch;
- the salt is the cache salt for block 0 only (later blocks are salted through their parent,
  as in ``extra_keys_for_block``).

``count`` is the number of primary prefix-cache entries (block, group) that name the key: the
pool (``hybridkv.optimized.block_pool``) adds one when it caches a block from a *memo source*
(a request hashed by this memo, without lookahead, at the manager's hash block size) and takes
one away when it evicts that block, and the key is dropped at zero; ``clear`` empties the memo
when the prefix cache is reset. So the memo never holds more keys than there are cached blocks.

A call packs the ids of the blocks to hash once (``array('I', ids).tobytes()``), then probes
the dict once per block with a ``bytes`` slice, following the chain of parents, and hands the
blocks from the first miss on to ``hash_full_blocks_torch``. The hashed function depends on the
ids' integer values only (``bool`` and ``int`` subclasses hash as their value), which is what
the packed bytes hold; ids ``array`` refuses (not integers) take the function directly.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import BlockHasher

MemoKey = tuple[BlockHash | None, bytes, str | None]


def pack_tokens(token_ids: Sequence[int]) -> bytes | None:
    """The ids as 4-byte unsigned ints, or ``None`` when one is not an int in ``[0, 2**32)``."""
    try:
        return array("I", token_ids).tobytes()
    except (TypeError, OverflowError):
        return None


class HashMemo:
    """A block hasher that remembers the hashes of cached blocks (see the module docstring)."""

    def __init__(self, block_size: int, hasher: BlockHasher = hash_full_blocks_torch) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.entries: dict[MemoKey, tuple[BlockHash, int]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __call__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]:
        """``hash_full_blocks``: the hashes of the full blocks from ``start_block`` on."""
        num_full = len(token_ids) // block_size
        entries = self.entries
        packed = None
        if entries and block_size == self.block_size and start_block < num_full:
            packed = pack_tokens(token_ids[start_block * block_size : num_full * block_size])
        if packed is None:
            return self.hasher(
                token_ids,
                block_size,
                start_block=start_block,
                parent_hash=parent_hash,
                cache_salt=cache_salt,
            )
        width = 4 * block_size
        hashes: list[BlockHash] = []
        parent = parent_hash
        index = start_block
        get = entries.get
        if index == 0:
            entry = get((parent, packed[:width], cache_salt))
            if entry is not None:
                parent = entry[0]
                hashes.append(parent)
                index = 1
        if index > 0:
            offset = (index - start_block) * width
            append = hashes.append
            while index < num_full:
                entry = get((parent, packed[offset : offset + width], None))
                if entry is None:
                    break
                parent = entry[0]
                append(parent)
                index += 1
                offset += width
        if index < num_full:
            hashes.extend(
                self.hasher(
                    token_ids,
                    block_size,
                    start_block=index,
                    parent_hash=parent,
                    cache_salt=cache_salt,
                )
            )
        return hashes

    # --- Filled and emptied by the pool ------------------------------------------------------

    def key(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash], salt: object, index: int
    ) -> MemoKey | None:
        """The key of hash ``index`` of a source (``None`` if its ids cannot be packed)."""
        b = self.block_size
        packed = pack_tokens(tokens[index * b : (index + 1) * b])
        if packed is None or len(packed) != 4 * b:
            return None
        if index == 0:
            return (None, packed, salt if isinstance(salt, str) else None)
        return (hashes[index - 1], packed, None)

    def remember(
        self,
        tokens: Sequence[int],
        hashes: Sequence[BlockHash],
        salt: object,
        index: int,
        count: int = 1,
    ) -> None:
        """``count`` more cached entries name hash ``index`` of the source."""
        key = self.key(tokens, hashes, salt, index)
        if key is None:
            return
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = (hashes[index], count)
        else:
            self.entries[key] = (entry[0], entry[1] + count)

    def forget(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash], salt: object, index: int
    ) -> None:
        """One cached entry naming hash ``index`` of the source was evicted."""
        key = self.key(tokens, hashes, salt, index)
        if key is None:
            return
        entry = self.entries.get(key)
        if entry is None:
            return
        if entry[1] <= 1:
            del self.entries[key]
        else:
            self.entries[key] = (entry[0], entry[1] - 1)

    def clear(self) -> None:
        self.entries.clear()
