"""Block hashes: the keys of the prefix cache, byte-identical to vLLM's ``sha256_cbor`` scheme.

The hash of a full block is SHA-256 of the canonical CBOR encoding of
``[parent_hash, token_ids, extra_keys]``. Chaining the parent's hash makes a block's hash name
its whole prefix, so one dictionary lookup per block finds the longest cached prefix
(Prefix caching, "High level idea"). Only full blocks are hashed; a block's tokens never change
once it is full.

``extra_keys`` is null, except for the first block of a request with a cache salt:
``[["cache_salt", salt]]``. Salting only the first block is enough, because every later hash
chains through it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import cbor2

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) naming a full block and, through its parent, its whole prefix."""

ExtraKeys = tuple[tuple[str, str], ...] | None


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``value``."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


NONE_HASH = BlockHash(sha256_cbor("vllm-none-hash"))
"""The parent hash of a request's first block."""


def extra_keys_for_block(block_index: int, cache_salt: str | None) -> ExtraKeys:
    """The extra keys of block ``block_index``: the cache salt on the first block only."""
    if block_index == 0 and cache_salt is not None:
        return (("cache_salt", cache_salt),)
    return None


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None
) -> BlockHash:
    """The hash of one full block, given its parent's hash (``None`` for the first block)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    return BlockHash(sha256_cbor((parent, tuple(token_ids), extra_keys)))


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int,
    parent_hash: BlockHash | None,
    cache_salt: str | None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on, chained.

    A request calls this as tokens arrive, passing the last hash it already holds.
    """
    hashes: list[BlockHash] = []
    parent = parent_hash
    num_full_blocks = len(token_ids) // block_size
    for index in range(start_block, num_full_blocks):
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        parent = hash_block_tokens(parent, tokens, extra_keys_for_block(index, cache_salt))
        hashes.append(parent)
    return hashes
