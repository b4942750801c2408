"""The hashes of the requests that fill the prefix cache, adopted by the requests that follow.

A ``HashMemo`` is the block hasher a ``TorchKVCacheManager`` offers for its requests
(``manager.block_hasher``; pass it as ``Request(..., block_hasher=manager.block_hasher)``). It
has the signature of ``hybridkv.reference.block_hash.hash_full_blocks`` and returns byte for
byte the hashes of ``hybridkv.optimized.hashing.hash_full_blocks_torch``: a request whose prompt
starts with the tokens of a cached request adopts that request's hashes for the common blocks
and SHA-hashes only the rest.

Why an adopted hash is exact
----------------------------
The hash of block ``i`` is a function of the hash of block ``i − 1`` and the block's token ids
(``G``), and that of block 0 a function of the block's ids and the cache salt (``G0``): the
hashes of a prompt are a deterministic function of its token values, its salt and the block
size (and ``NONE_HASH``, fixed for the process). The memo keeps *memo sources*: the pool's
sources (``hybridkv.optimized.sources.Source``) of requests hashed by this memo, at its block
size, without lookahead; their hash lists are those of their own tokens (by induction: every
hash this memo returns is one). So if a request's hash of block ``j − 1`` equals a source's
(or ``j`` is 0 and the salts are equal), and its blocks ``j … m − 1`` hold the source's token
values, its hashes of blocks ``j … m − 1`` are the source's: each follows from the one before
and the same tokens. The memo compares both (the parent hash as bytes, the tokens as packed
values), never trusting a hash alone, so a hash collision cannot mislead it.

The memo's index of those sources, its tree of branches, is ``hybridkv.optimized.memo_tree``
(``BranchTree``, which ``HashMemo`` extends with the hashing calls below).

Calls
-----
``hash_packed`` is the call a ``Request`` makes when it has its ids packed
(``Request.packed_token_ids``, a ``PackedBlockHasher``'s method): the memo reads the packed
copy, so no id is converted again, and with the default hasher the blocks it does not adopt
are hashed from it too (``hybridkv.optimized.hashing.hash_packed_blocks``). ``__call__`` (the
``hash_full_blocks`` signature) packs the ids itself. Only a request's first call adopts (from
block 0 with no parent: its prompt); later calls (blocks filled by output tokens, a block or
two), another block size and ids that do not pack (not ints, negative, from 2**64) go to the
hasher, as does everything when the memo is empty or the salt is not a ``str``. The hashed
function depends on the ids' integer values only (``bool`` and ``int`` subclasses hash as
their value), which is what the packed copy holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from hybridkv.optimized.hashing import hash_full_blocks_torch, hash_packed_blocks
from hybridkv.optimized.memo_tree import (
    Branch,
    BranchTree,
    MemoKey,
    MemoSource,
    agreeing_blocks,
    salt_key,
)
from hybridkv.optimized.path_counts import PathCounts
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import BlockHasher

__all__ = ["Branch", "HashMemo", "MemoKey", "MemoSource", "agreeing_blocks", "salt_key"]


class HashMemo(BranchTree):
    """A block hasher that adopts the hashes of cached requests (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        hasher: BlockHasher = hash_full_blocks_torch,
        paths: PathCounts | None = None,
    ) -> None:
        super().__init__(block_size, paths)
        self.hasher = hasher
        self.last_prompt: tuple[array[int], MemoSource, int] | None = None
        """The last prompt hashed from its packed ids with hashes adopted: those ids, the
        source its first adopted run came from and that run's length in blocks, whose ids
        the memo compared equal (``agreed_blocks``)."""

    def agreed_blocks(self, packed: object, source: object) -> int:
        """How many leading blocks of ``packed`` the last prompt walk compared equal to
        ``source``'s ids (0 unless ``packed`` is that prompt's ids and ``source`` its first
        run's source). Both id arrays only grow, so what was equal then is equal now: a
        lookup right after the walk need not compare those ids again."""
        agreement = self.last_agreement(packed)
        return agreement[1] if agreement is not None and agreement[0] is source else 0

    def last_agreement(self, packed: object) -> tuple[MemoSource, int] | None:
        """The source of the last prompt walk's first run and that run's length in blocks,
        when ``packed`` is that prompt's ids (``None`` otherwise): the prompt's hashes of those
        blocks are that source's own (``walk`` adopts them), and its ids equal the source's."""
        last = self.last_prompt
        if last is None or last[0] is not packed:
            return None
        return last[1], last[2]

    def clear(self) -> None:
        super().clear()
        self.last_prompt = None

    # --- Hashing ------------------------------------------------------------------------------

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
        packed = None
        if (
            self.branches
            and start_block == 0
            and parent_hash is None
            and block_size == self.block_size
        ):
            try:
                packed = array("Q", token_ids[: len(token_ids) // block_size * block_size])
            except (TypeError, OverflowError):
                packed = None
        if packed is None:
            return self.hasher(
                token_ids,
                block_size,
                start_block=start_block,
                parent_hash=parent_hash,
                cache_salt=cache_salt,
            )
        return self.hash_packed(
            token_ids,
            packed,
            block_size,
            start_block=start_block,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )

    def hash_packed(
        self,
        token_ids: Sequence[int],
        packed: array[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]:
        """``__call__`` given the ids also packed as unsigned 64-bit ints (``packed``, at least
        the ids of the full blocks: ``Request.packed_token_ids``)."""
        num_full = len(token_ids) // block_size
        if (
            start_block != 0
            or parent_hash is not None
            or block_size != self.block_size
            or len(packed) < num_full * block_size
        ):
            # Not a prompt (blocks filled by output tokens, a block or two): nothing to adopt.
            return self.hasher(
                token_ids,
                block_size,
                start_block=start_block,
                parent_hash=parent_hash,
                cache_salt=cache_salt,
            )
        keyable, salt = salt_key(cache_salt)
        hashes: list[BlockHash] = []
        self.last_prompt = None
        if self.branches and keyable and num_full > 0:
            hashes = self.walk_packed(packed, num_full, salt)[0]
            if self.first_agreement is not None:
                self.last_prompt = (packed, *self.first_agreement)
        index = len(hashes)
        if index < num_full:
            parent = hashes[-1] if hashes else None
            if self.hasher is hash_full_blocks_torch:  # the default: it reads the packed copy
                rest = hash_packed_blocks(
                    token_ids,
                    packed,
                    block_size,
                    start_block=index,
                    parent_hash=parent,
                    cache_salt=cache_salt,
                )
            else:
                rest = self.hasher(
                    token_ids,
                    block_size,
                    start_block=index,
                    parent_hash=parent,
                    cache_salt=cache_salt,
                )
            hashes.extend(rest)
        return hashes
