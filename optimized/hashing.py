"""Block hashing with the CBOR of every block encoded at once by numpy operations.

``hash_full_blocks_torch`` has the signature of ``hybridkv.reference.block_hash.hash_full_blocks``
and returns byte for byte the same hashes (those of ``hash_full_blocks_cbor2``, the definition);
pass it to ``Request(..., block_hasher=hash_full_blocks_torch)``.

Data layout
-----------
Canonical CBOR of ``[parent, token_ids, None]`` with a 32-byte parent is
``0x83 0x58 0x20 parent | array header | each token id | 0xf6``; everything after the parent
(a block's "tail") depends on the block alone, so the tails of all blocks are built at once:

- The token ids go into an ``array('Q')`` (a ``Request``'s packed ids are read as they are),
  viewed without copying as ``uint64`` and narrowed to ``uint32`` once none is 2**32 or more.
- Each id's size class ``c`` (0: below 24, 1: below 2**8, 2: below 2**16, 3: below 2**32) gives
  its head byte (the id itself, or ``0x17 + c``) and its encoded size (1, 2, 3 or 5 bytes).
- Each id gets a 5-byte lane: the head byte, then the id's four bytes big-endian (written
  through a ``>u4`` view of the lanes, strided by 5 bytes: numpy swaps the bytes as it
  stores). Its encoding is the head and the last ``size − 1`` of those four bytes: ``keep``
  holds, per lane byte, whether the CBOR keeps it (the head always; ``b0`` from class 1, ``b1``
  from class 2, ``b3`` and ``b2`` in class 3), each of the five written as one column.
- ``out[blocks, h + 5 × block_size + 1]`` holds each block's array header (``h`` bytes), its
  ids' lanes and ``0xf6``, and ``keep`` of the same shape which of those bytes the CBOR holds;
  one ``np.compress`` of ``out`` by ``keep`` is every block's tail, back to back. A block's
  size is ``h + 1 + block_size`` plus its ids' payload bytes (``c``, and 1 more in class 3):
  one cumulative sum over the ids, read at every block's last id, gives their bounds. Every
  buffer holds at most five bytes per id: no index array per output byte is built.

Only SHA-256 then runs once per block, as the chain requires: a copy of the state after
``0x83 0x58 0x20``, updated with the parent digest and a memoryview slice of the block's tail.

The salted first block and a parent that is not 32 bytes take the definition; ids that are
negative, at least 2**32 or not ints take the reference's path, which encodes or raises exactly
as ``cbor2`` does. Short inputs (below ``VECTOR_MIN_TOKENS`` of ``hybridkv.optimized.thresholds``:
a decode step's new block) also take the reference's path, where the vector set-up would cost
more than it saves.

Packed ids
----------
``hash_packed_blocks`` returns the same hashes given the ids packed too (unsigned 64-bit, as
``Request.packed_token_ids``). Long inputs take ``encode_tails`` on the packed copy; up to
``FEW_BLOCKS_MAX`` blocks (a prompt's own blocks after an adopted prefix) take one ``cbor2``
call per block on the ids' list (``_chain_lists``: its bytes of the block's ids are the CBOR
between the array's header and ``0xf6``, as the definition's); the ones between
``encode_bodies``, which builds the CBOR of a few blocks from the packed bytes with bytes and
str operations (each one C loop over the ids, no Python call per id and no table to read):

- Strided slices of the packed bytes give each id's bytes ``b0 … b3`` (little endian; ids
  from 2**32 take the reference's path). From them, as 0/1 bytes per id: ``c3`` (the id is
  at least 2**16: ``b2`` or ``b3`` nonzero), ``c2`` (at least 2**8: also ``b1``), ``c1`` (at
  least 24: also ``b0 >= 24``), by ``translate`` and bitwise or of the byte strings read as
  ints (no carry: each byte is 0 or 1). ``c1 + c2 + c3`` is the size class.
- Each id becomes five UTF-16 code units ``head, b3, b2, b1, b0``; a unit's high byte is 1
  where the unit must go (``head`` of class 0, whose encoding is ``b0`` itself; ``b3`` and
  ``b2`` below class 3; ``b1`` below class 2), and the low byte of such a unit is zero, so
  every unit to drop is U+0100 and every other one a byte value (``head`` is ``0x17 +`` the
  class). Decoding the units and encoding them as Latin-1, dropping what it cannot encode,
  leaves the encoded ids of all blocks, in order.
- A block's length is its ids' count plus the sum of ``c1 + c2 + 2 c3`` over them: the sums
  of all blocks at once are digits of one product of ints (see ``encode_bodies``).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from codecs import latin_1_encode, utf_16_le_decode
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import cast

import cbor2
import numpy as np

from hybridkv.optimized.thresholds import FEW_BLOCKS_MAX, VECTOR_MIN_TOKENS
from hybridkv.reference.block_hash import (
    CBOR_NULL,
    CBOR_PREFIX,
    NONE_HASH,
    BlockHash,
    cbor_head,
    hash_full_blocks,
    hash_leading_special_blocks,
)

_WIDE = 1 << 32
_NONZERO = bytes([0] + [1] * 255)
_AT_LEAST_24 = bytes([0] * 24 + [1] * 232)
_NOT = bytes([1, 0] + [0] * 254)  # of a 0/1 byte
_HEAD = bytes([0, 0x18, 0x19, 0x1A] + [0] * 252)  # of a size class 1-3 (class 0: dropped)


def encode_tails(
    tokens: Sequence[int], block_size: int, start: int = 0, num_blocks: int | None = None
) -> tuple[memoryview, list[int]] | None:
    """Per whole block of ``tokens``: array header, the CBOR of each id, ``0xf6``; concatenated.

    This is each block's CBOR after its 35-byte prefix ``0x83 0x58 0x20 parent``. Returns the
    bytes and the byte offset of each block's start plus the end (``len + 1`` offsets), or
    ``None`` when some id is not an int in ``[0, 2**32)``. ``tokens`` may be packed already
    (an ``array('Q')``, as ``Request.packed_token_ids``): then it is read in place, from id
    ``start``, for ``num_blocks`` blocks (all its whole blocks by default).
    """
    if isinstance(tokens, array) and tokens.typecode == "Q":
        ids = tokens
    else:
        try:
            ids = array("Q", tokens[start:])  # unsigned: converts fast, refuses negative ids
        except (TypeError, OverflowError):
            return None
        start = 0
    if num_blocks is None:
        num_blocks = (len(ids) - start) // block_size
    if num_blocks <= 0:
        return memoryview(b""), [0]
    if sys.byteorder != "little":
        return None  # the lanes below are read as little-endian bytes
    count = num_blocks * block_size
    t = np.frombuffer(ids, dtype=np.uint64, count=count, offset=8 * start)
    if int(t.max()) >= _WIDE:
        return None
    ids32 = t.astype(np.uint32).reshape(num_blocks, block_size)
    # Size class 0-3 of every id (payload of 0, 1, 2 or 4 bytes).
    c = (ids32 >= 24).view(np.uint8) + (ids32 >= 1 << 8).view(np.uint8)
    wide = ids32 >= 1 << 16
    c += wide.view(np.uint8)
    frame = np.frombuffer(cbor_head(4, block_size), dtype=np.uint8)
    h = len(frame)
    width = h + 5 * block_size + 1
    out = np.empty((num_blocks, width), dtype=np.uint8)
    keep = np.empty(out.shape, dtype=np.bool_)
    out[:, :h] = frame
    out[:, -1] = CBOR_NULL[0]
    keep[:, :h] = keep[:, -1] = True
    # Each id's lane: head byte, then the id's 4 bytes big-endian.
    lanes = out[:, h:-1].reshape(num_blocks, block_size, 5)
    np.add(np.minimum(ids32, 23).astype(np.uint8), c, out=lanes[:, :, 0])
    big = np.ndarray(ids32.shape, dtype=">u4", buffer=out, offset=h + 1, strides=(width, 5))
    big[...] = ids32
    kept = keep[:, h:-1].reshape(num_blocks, block_size, 5)
    kept[:, :, 0] = True
    np.greater_equal(c, 1, out=kept[:, :, 4])
    np.greater_equal(c, 2, out=kept[:, :, 3])
    kept[:, :, 1] = kept[:, :, 2] = wide
    data = np.compress(keep.ravel(), out.ravel())
    payload = np.cumsum(c.ravel() + wide.ravel().view(np.uint8), dtype=np.int64)
    ends = np.arange(1, num_blocks + 1, dtype=np.int64) * (h + 1 + block_size)
    ends += payload[block_size - 1 :: block_size]
    return memoryview(data.data), [0, *ends.tolist()]


def hash_full_blocks_torch(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int,
    parent_hash: BlockHash | None,
    cache_salt: str | None,
) -> list[BlockHash]:
    """``hybridkv.reference.block_hash.hash_full_blocks``, encoding the CBOR with tensors."""
    num_full_blocks = len(token_ids) // block_size
    if (num_full_blocks - start_block) * block_size < VECTOR_MIN_TOKENS:
        return hash_full_blocks(
            token_ids,
            block_size,
            start_block=start_block,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )
    hashes = hash_leading_special_blocks(
        token_ids,
        block_size,
        start_block=start_block,
        parent_hash=parent_hash,
        cache_salt=cache_salt,
    )
    index = start_block + len(hashes)
    parent = hashes[-1] if hashes else parent_hash
    if index >= num_full_blocks:
        return hashes
    encoded = encode_tails(token_ids[index * block_size : num_full_blocks * block_size], block_size)
    if encoded is None:
        hashes.extend(
            hash_full_blocks(
                token_ids,
                block_size,
                start_block=index,
                parent_hash=parent,
                cache_salt=cache_salt,
            )
        )
        return hashes
    hashes.extend(_chain_tails(parent, *encoded))
    return hashes


def _chain_tails(
    parent: BlockHash | None, tails: memoryview, offsets: list[int]
) -> list[BlockHash]:
    """The chained hashes of the blocks whose CBOR tails ``encode_tails`` returned: per block
    a copy of the SHA-256 state after ``0x83 0x58 0x20``, updated with the parent digest and
    the block's slice of ``tails``."""
    digest: bytes = NONE_HASH if parent is None else parent
    copy = hashlib.sha256(CBOR_PREFIX).copy
    hashes: list[bytes] = []
    append = hashes.append
    start = offsets[0]
    for end in offsets[1:]:
        state = copy()
        state.update(digest)
        state.update(tails[start:end])
        digest = state.digest()
        append(digest)
        start = end
    return cast(list[BlockHash], hashes)  # ``BlockHash`` is bytes: no call per block


def encode_bodies(packed: array[int], block_size: int) -> tuple[bytes, list[int]] | None:
    """Per whole block of the packed ids: the canonical CBOR of each id, concatenated (the
    block's CBOR between its array header and ``0xf6``); all blocks' in one ``bytes``, with the
    offset of each block's start plus the end. ``None`` when some id is 2**32 or more, or the
    host is big-endian. See "Packed ids" in the module docstring."""
    n = len(packed) // block_size * block_size
    if n == 0 or sys.byteorder != "little":
        return None if n else (b"", [0])
    raw = packed[:n].tobytes()
    if raw[4::8] + raw[5::8] + raw[6::8] + raw[7::8] != bytes(4 * n):
        return None  # an id from 2**32
    b0, b1, b2, b3 = raw[0::8], raw[1::8], raw[2::8], raw[3::8]

    def flags(data: bytes, table: bytes) -> int:
        return int.from_bytes(data.translate(table), "little")

    c3 = flags(b2, _NONZERO) | flags(b3, _NONZERO)
    c2 = c3 | flags(b1, _NONZERO)
    c1 = c2 | flags(b0, _AT_LEAST_24)
    size_class = (c1 + c2 + c3).to_bytes(n, "little")
    below_3 = c3.to_bytes(n, "little").translate(_NOT)
    units = bytearray(10 * n)
    units[0::10] = size_class.translate(_HEAD)
    units[1::10] = size_class.translate(_NOT)
    units[2::10] = b3
    units[3::10] = below_3
    units[4::10] = b2
    units[5::10] = below_3
    units[6::10] = b1
    units[7::10] = c2.to_bytes(n, "little").translate(_NOT)
    units[8::10] = b0
    # Drops U+0100 (the codecs' functions called directly: no lookup of the codec by name,
    # which a cold call pays for).
    encoded = latin_1_encode(utf_16_le_decode(units)[0], "ignore")[0]
    # Each id's encoded size minus one, summed per block: the digits of ``extra × (1 + 256 +
    # … + 256**(block_size − 1))`` at every block's last id (no carry: a sum is at most 4 per
    # id and block sizes below 64 keep it under 256; larger blocks take the sums one by one).
    extra = c1 + c2 + 2 * c3
    if block_size < 64:
        spread = (extra * int.from_bytes(b"\x01" * block_size, "little")).to_bytes(
            n + block_size, "little"
        )
        sums: Sequence[int] = spread[block_size - 1 :: block_size][: n // block_size]
    else:
        digits = extra.to_bytes(n, "little")
        sums = [sum(digits[i : i + block_size]) for i in range(0, n, block_size)]
    offsets = list(accumulate(map(block_size.__add__, sums), initial=0))
    return encoded, offsets


def hash_packed_blocks(
    token_ids: Sequence[int],
    packed: array[int],
    block_size: int,
    *,
    start_block: int,
    parent_hash: BlockHash | None,
    cache_salt: str | None,
) -> list[BlockHash]:
    """``hash_full_blocks_torch`` given the ids packed too (``packed``, unsigned 64-bit: at
    least the ids of the full blocks, as ``Request.packed_token_ids``); see "Packed ids"."""
    num_full_blocks = len(token_ids) // block_size
    if len(packed) < num_full_blocks * block_size:
        return hash_full_blocks_torch(
            token_ids,
            block_size,
            start_block=start_block,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )
    hashes = hash_leading_special_blocks(
        token_ids,
        block_size,
        start_block=start_block,
        parent_hash=parent_hash,
        cache_salt=cache_salt,
    )
    index = start_block + len(hashes)
    if index >= num_full_blocks:
        return hashes
    parent = hashes[-1] if hashes else parent_hash
    if (num_full_blocks - index) * block_size >= VECTOR_MIN_TOKENS:
        encoded = encode_tails(packed, block_size, index * block_size, num_full_blocks - index)
        if encoded is not None:
            hashes.extend(_chain_tails(parent, *encoded))
            return hashes
    elif num_full_blocks - index <= FEW_BLOCKS_MAX and type(token_ids) is list:
        hashes.extend(_chain_lists(parent, token_ids, block_size, index, num_full_blocks))
        return hashes
    else:
        ids = packed[index * block_size : num_full_blocks * block_size]
        bodies = encode_bodies(ids, block_size)
        if bodies is not None:
            joined, ends = bodies
            view = memoryview(joined)
            header = cbor_head(4, block_size)
            hashes.extend(_chain(parent, [view[a:b] for a, b in pairwise(ends)], header, CBOR_NULL))
            return hashes
    hashes.extend(
        hash_full_blocks(
            token_ids, block_size, start_block=index, parent_hash=parent, cache_salt=cache_salt
        )
    )
    return hashes


def _chain_lists(
    parent: BlockHash | None, token_ids: list[int], block_size: int, start: int, stop: int
) -> list[BlockHash]:
    """The chained hashes of blocks ``start … stop − 1`` of ``token_ids``: ``_chain`` of
    ``cbor2``'s bytes of each block's ids (an array of ints, each in its shortest form, as the
    definition encodes them: the array's header and the ids)."""
    dumps = cbor2.dumps
    bodies = [
        dumps(token_ids[at : at + block_size])
        for at in range(start * block_size, stop * block_size, block_size)
    ]
    return _chain(parent, bodies, b"", CBOR_NULL)


def _chain(
    parent: BlockHash | None,
    bodies: Sequence[bytes | memoryview],
    header: bytes,
    null: bytes = b"",
) -> list[BlockHash]:
    """The chained hashes of blocks whose CBOR after the parent is ``header + body + null``."""
    digest: bytes = NONE_HASH if parent is None else parent
    copy, join = hashlib.sha256(CBOR_PREFIX).copy, b"".join  # a copied state: no new context
    hashes: list[bytes] = []
    append = hashes.append
    for body in bodies:
        state = copy()
        state.update(join((digest, header, body, null)))
        digest = state.digest()
        append(digest)
    return cast(list[BlockHash], hashes)
