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

import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import NewType

import cbor2

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) naming a full block and, through its parent, its whole prefix."""

ExtraKeys = tuple[tuple[str, str], ...] | None


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``value``."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""The seed of ``NONE_HASH`` when ``PYTHONHASHSEED`` is not set."""


def none_hash_seed(environ: Mapping[str, str] = os.environ) -> str:
    """The seed ``NONE_HASH`` derives from: ``PYTHONHASHSEED`` when set, as an engine does, so
    that two processes started with the same seed share prefix-cache keys."""
    return environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


NONE_HASH = BlockHash(sha256_cbor(none_hash_seed()))
"""The parent hash of a request's first block: SHA-256 of the CBOR of the seed, read once when
the module is imported (an engine reads it once at start-up too)."""


def extra_keys_for_block(block_index: int, cache_salt: str | None) -> ExtraKeys:
    """The extra keys of block ``block_index``: the cache salt on the first block only (an
    empty salt is none, as vLLM's)."""
    if block_index == 0 and cache_salt:
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

    A request calls this as tokens arrive, passing the last hash it already holds. Byte for
    byte the hashes of ``hash_full_blocks_cbor2`` (the definition, one ``cbor2`` call per
    block), computed by encoding the CBOR of all blocks at once (see "The fast path" below).
    """
    num_full_blocks = len(token_ids) // block_size
    hashes = hash_leading_special_blocks(
        token_ids,
        block_size,
        start_block=start_block,
        parent_hash=parent_hash,
        cache_salt=cache_salt,
    )
    index = start_block + len(hashes)
    parent = hashes[-1] if hashes else parent_hash
    bodies = _block_bodies(token_ids[index * block_size : num_full_blocks * block_size], block_size)
    if bodies is None:
        # Only block 0 carries the salt, and it was hashed above if it is in range.
        hashes.extend(
            hash_full_blocks_cbor2(
                token_ids, block_size, start_block=index, parent_hash=parent, cache_salt=None
            )
        )
        return hashes
    digest = NONE_HASH if parent is None else parent
    sha256, join = hashlib.sha256, b"".join
    header = cbor_head(4, block_size)
    append = hashes.append
    prefix, null = CBOR_PREFIX, CBOR_NULL
    for body in bodies:
        digest = BlockHash(sha256(join((prefix, digest, header, body, null))).digest())
        append(digest)
    return hashes


def hash_leading_special_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int,
    parent_hash: BlockHash | None,
    cache_salt: str | None,
) -> list[BlockHash]:
    """The hash of block ``start_block`` by the definition if no fast path can take it, else none.

    The fast paths (here and in ``hybridkv.optimized.hashing``) encode ``[parent, tokens, None]``
    with a 32-byte parent. Only the start of a chain can break that: the salted first block has
    extra keys, and a caller's parent that is not a SHA-256 digest is not 32 bytes. Once one
    block is hashed its digest is the next parent, and only block 0 is salted, so at most one
    block needs this; the caller goes on from ``start_block + len(result)``.
    """
    if start_block >= len(token_ids) // block_size:
        return []
    extra_keys = extra_keys_for_block(start_block, cache_salt)
    if extra_keys is None and len(NONE_HASH if parent_hash is None else parent_hash) == 32:
        return []
    tokens = token_ids[start_block * block_size : (start_block + 1) * block_size]
    return [hash_block_tokens(parent_hash, tokens, extra_keys)]


def hash_full_blocks_lookahead(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int,
    parent_hash: BlockHash | None,
    cache_salt: str | None,
    num_lookahead_tokens: int,
) -> list[BlockHash]:
    """Hashes that also cover the ``num_lookahead_tokens`` tokens after each block (EAGLE/MTP
    drafting with lookahead block hashes).

    A drafter's KV at a block's last position depends on the tokens that follow it, so the hash
    of block ``i`` is that of ``[parent, tokens, [extra_keys, *next_tokens]]`` and exists only
    once those tokens do: a 48-token prompt with block size 16 and one lookahead token has two
    hashes, not three.
    """
    hashes: list[BlockHash] = []
    parent = parent_hash
    num_hashable = (len(token_ids) - num_lookahead_tokens) // block_size
    for index in range(start_block, max(num_hashable, start_block)):
        end = (index + 1) * block_size
        tokens = token_ids[end - block_size : end]
        extra = (
            extra_keys_for_block(index, cache_salt),
            *token_ids[end : end + num_lookahead_tokens],
        )
        parent = BlockHash(
            sha256_cbor((NONE_HASH if parent is None else parent, tuple(tokens), extra))
        )
        hashes.append(parent)
    return hashes


def hash_full_blocks_cbor2(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int,
    parent_hash: BlockHash | None,
    cache_salt: str | None,
) -> list[BlockHash]:
    """``hash_full_blocks`` by its definition: ``hash_block_tokens`` for one block at a time."""
    hashes: list[BlockHash] = []
    parent = parent_hash
    num_full_blocks = len(token_ids) // block_size
    for index in range(start_block, num_full_blocks):
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        parent = hash_block_tokens(parent, tokens, extra_keys_for_block(index, cache_salt))
        hashes.append(parent)
    return hashes


# --- The fast path ---------------------------------------------------------------------------
#
# Canonical CBOR of ``[parent, token_ids, None]`` with a 32-byte parent is
#
#     0x83 | 0x58 0x20 parent | array header of len(token_ids) | each token id | 0xf6
#
# (an array of 3; a byte string of 32; an array; each non-negative int in its shortest form:
# 1, 2, 3, 5 or 9 bytes; null). The token part depends on the block alone, so it is built for
# all blocks first with C-level bulk operations: the encoding of every token id is read from a
# table in one ``itemgetter`` call for the whole request, and ``map`` joins it block by block.
# Only SHA-256 runs once per block, as the chain requires.
#
# The table holds the encoding of every id below a power of two just above the request's largest
# id (at most ``_TABLE_LIMIT``, about 40 bytes per id); it is a memoised pure function, built once
# per size. A negative id, or anything that is not an int, takes the definition instead; ids
# past the limit are encoded one by one. ``bool`` is not a token id (``Request`` rejects it).

CBOR_PREFIX = b"\x83\x58\x20"
"""Canonical CBOR of a block up to its parent: an array of 3, then a byte string of 32."""
CBOR_NULL = b"\xf6"
"""Canonical CBOR of ``None``: a block's extra keys, after its token ids."""
_TABLE_MIN = 1 << 8
_TABLE_LIMIT = 1 << 18


def cbor_head(major: int, value: int) -> bytes:
    """The canonical CBOR head of a major type with argument ``value`` (0 <= value < 2**64)."""
    if value < 24:
        return bytes((major << 5 | value,))
    if value < 1 << 8:
        return bytes((major << 5 | 24, value))
    if value < 1 << 16:
        return bytes((major << 5 | 25,)) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes((major << 5 | 26,)) + value.to_bytes(4, "big")
    return bytes((major << 5 | 27,)) + value.to_bytes(8, "big")


def encode_token_id(token_id: int) -> bytes:
    """Canonical CBOR of one non-negative int (a bignum, as ``cbor2`` writes it, from 2**64)."""
    if token_id < 1 << 64:
        return cbor_head(0, token_id)
    return cbor2.dumps(token_id, canonical=True)


@functools.cache
def _token_table(size: int) -> tuple[bytes, ...]:
    """The encodings of token ids ``0 … size − 1``.

    A pure function of ``size`` (a power of two), memoised: each table is built once, from the
    next smaller one, and never changes.
    """
    half = size // 2
    known = _token_table(half)[:half] if half >= _TABLE_MIN else ()
    return known + tuple(cbor_head(0, t) for t in range(len(known), size))


def _join_blocks(encodings: Sequence[bytes], block_size: int) -> list[bytes]:
    """Each block's token encodings joined into one ``bytes``."""
    groups = zip(*[iter(encodings)] * block_size, strict=True)
    return list(map(b"".join, groups))


def _block_bodies(tokens: Sequence[int], block_size: int) -> list[bytes] | None:
    """Per full block of ``tokens``: the canonical CBOR of its token ids, concatenated.

    ``None`` if some token id is not a non-negative int (the caller then takes the definition,
    which raises or encodes exactly as ``cbor2`` does).
    """
    if not tokens:
        return []
    try:
        low: object = min(tokens)
        high: object = max(tokens)
    except TypeError:
        return None
    if not isinstance(low, int) or not isinstance(high, int) or low < 0:
        return None
    if high >= _TABLE_LIMIT:
        return _join_blocks([encode_token_id(t) for t in tokens], block_size)
    table = _token_table(max(_TABLE_MIN, 1 << high.bit_length()))
    found = itemgetter(*tokens)(table) if len(tokens) > 1 else (table[tokens[0]],)
    return _join_blocks(found, block_size)
