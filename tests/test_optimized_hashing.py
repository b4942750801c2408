"""The optimized backend's tensor-encoded block hashing is byte-identical to the definition.

``hash_full_blocks_torch`` (``hybridkv.optimized.hashing``) must return exactly the hashes of
``hash_full_blocks_cbor2`` (SHA-256 of ``cbor2.dumps([parent, token_ids, extra_keys],
canonical=True)``, one block at a time) for any token ids, block size, salt, parent and start
block, and a ``Request`` built with it must carry the same hashes as one built with the default.
So must ``hash_packed_blocks``, which reads the ids packed.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import hashing
from hybridkv.optimized.hashing import (
    encode_bodies,
    encode_tails,
    hash_full_blocks_torch,
    hash_packed_blocks,
)
from hybridkv.reference.block_hash import NONE_HASH, BlockHash, cbor_head, hash_full_blocks_cbor2
from hybridkv.reference.request import Request

# Every CBOR integer size class and its boundaries, past the tensor path's 2**32 limit too.
BOUNDARIES = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, 2**70]
token_ids = st.one_of(
    st.sampled_from(BOUNDARIES),
    st.integers(0, 300),
    st.integers(0, 2**18 + 5),
    st.integers(0, 2**32 + 5),
)
# Mostly ids the tensor path encodes, so that it is exercised and not only its fallback.
encodable = st.one_of(
    st.sampled_from([b for b in BOUNDARIES if b < 2**32]),
    st.integers(0, 300),
    st.integers(0, 2**32 - 1),
)


@contextmanager
def always_vectorised() -> Iterator[None]:
    """Send inputs of any length through the tensor path."""
    with mock.patch.object(hashing, "VECTOR_MIN_TOKENS", 0):
        yield


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.one_of(st.lists(encodable, max_size=300), st.lists(token_ids, max_size=80)),
    block_size=st.sampled_from([1, 2, 3, 4, 16, 23, 24, 25, 255, 256]),
    salt=st.one_of(st.none(), st.text(max_size=40)),
    parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32), st.binary(max_size=40)),
    start=st.integers(0, 3),
)
def test_torch_hashes_equal_the_definition(
    tokens: list[int], block_size: int, salt: str | None, parent: bytes | None, start: int
) -> None:
    parent_hash = None if parent is None else BlockHash(parent)
    expected = hash_full_blocks_cbor2(
        tokens, block_size, start_block=start, parent_hash=parent_hash, cache_salt=salt
    )
    with always_vectorised():
        got = hash_full_blocks_torch(
            tokens, block_size, start_block=start, parent_hash=parent_hash, cache_salt=salt
        )
    assert got == expected


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(encodable, min_size=1, max_size=200),
    block_size=st.sampled_from([1, 2, 16, 23, 24, 256]),
)
def test_each_block_tail_is_the_cbor_after_the_parent(tokens: list[int], block_size: int) -> None:
    """The encoded tails are exactly ``cbor2``'s bytes after ``0x83 0x58 0x20 parent``."""
    whole = len(tokens) // block_size * block_size
    encoded = encode_tails(tokens[:whole], block_size)
    assert encoded is not None
    buffer, offsets = encoded
    assert len(offsets) == whole // block_size + 1
    for index, (start, end) in enumerate(itertools.pairwise(offsets)):
        block = tokens[index * block_size : (index + 1) * block_size]
        cbor = cbor2.dumps([NONE_HASH, block, None], canonical=True)
        assert cbor[:35] == b"\x83\x58\x20" + NONE_HASH
        assert bytes(buffer[start:end]) == cbor[35:]


@pytest.mark.parametrize("bad", [-1, 2**32, 2**63, 2**64, 1.0, "7"])
def test_ids_the_tensor_path_cannot_encode_are_refused(bad: object) -> None:
    assert encode_tails([1, 2, bad, 3], 2) is None  # type: ignore[list-item]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(token_ids, max_size=60),
    outputs=st.lists(st.lists(token_ids, max_size=9), max_size=8),
    block_size=st.sampled_from([1, 2, 3, 16]),
    salt=st.one_of(st.none(), st.text(max_size=10)),
)
def test_a_growing_request_hashes_as_the_default(
    prompt: list[int], outputs: list[list[int]], block_size: int, salt: str | None
) -> None:
    with always_vectorised():
        fast = Request(
            "r",
            prompt,
            hash_block_size=block_size,
            cache_salt=salt,
            block_hasher=hash_full_blocks_torch,
        )
        plain = Request("r", prompt, hash_block_size=block_size, cache_salt=salt)
        for chunk in outputs:
            fast.append_output_token_ids(chunk)
            plain.append_output_token_ids(chunk)
            expected = hash_full_blocks_cbor2(
                list(plain.all_token_ids),
                block_size,
                start_block=0,
                parent_hash=None,
                cache_salt=salt,
            )
            assert list(fast.block_hashes) == list(plain.block_hashes) == expected


@pytest.mark.parametrize("block_size", [16, 24, 256])
@pytest.mark.parametrize("salt", [None, "s"])
def test_long_prompts_take_the_tensor_path_and_agree(block_size: int, salt: str | None) -> None:
    rng = random.Random(block_size)
    tokens = [rng.choice([5, 23, 24, 200, 255, 256, 4000, 65535, 65536, 2**31, 2**32 - 1])]
    tokens += [int(262_144 * rng.random() ** 3) for _ in range(8 * 1024)]
    tokens += [2**32 - 1, 0, 24]
    assert encode_tails(tokens[: len(tokens) // block_size * block_size], block_size) is not None
    expected = hash_full_blocks_cbor2(
        tokens, block_size, start_block=0, parent_hash=None, cache_salt=salt
    )
    assert (
        hash_full_blocks_torch(tokens, block_size, start_block=0, parent_hash=None, cache_salt=salt)
        == expected
    )
    # Resuming from a later block with its parent gives the rest of the chain.
    assert (
        hash_full_blocks_torch(
            tokens, block_size, start_block=3, parent_hash=expected[2], cache_salt=salt
        )
        == expected[3:]
    )


# --- From the packed ids ----------------------------------------------------------------------

packable = st.one_of(
    st.sampled_from([b for b in BOUNDARIES if b < 2**64]),
    st.integers(0, 300),
    st.integers(0, 2**32 - 1),
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.one_of(st.lists(encodable, max_size=300), st.lists(packable, max_size=80)),
    block_size=st.sampled_from([1, 2, 3, 4, 16, 23, 24, 63, 64, 65, 256]),
    salt=st.one_of(st.none(), st.text(max_size=40)),
    parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32), st.binary(max_size=40)),
    start=st.integers(0, 3),
    vectorised=st.booleans(),
    few=st.sampled_from([0, 24, 1 << 20]),
)
def test_hashes_from_the_packed_ids_equal_the_definition(
    tokens: list[int],
    block_size: int,
    salt: str | None,
    parent: bytes | None,
    start: int,
    vectorised: bool,
    few: int,
) -> None:
    """Every path (the packed tails, ``encode_bodies``, one ``cbor2`` call per block: ``few``
    blocks at most) gives the definition's hashes."""
    parent_hash = None if parent is None else BlockHash(parent)
    expected = hash_full_blocks_cbor2(
        tokens, block_size, start_block=start, parent_hash=parent_hash, cache_salt=salt
    )
    vector_min = 0 if vectorised else 1 << 20
    with (
        mock.patch.object(hashing, "VECTOR_MIN_TOKENS", vector_min),
        mock.patch.object(hashing, "FEW_BLOCKS_MAX", few),
    ):
        got = hash_packed_blocks(
            tokens,
            array("Q", tokens),
            block_size,
            start_block=start,
            parent_hash=parent_hash,
            cache_salt=salt,
        )
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(encodable, min_size=1, max_size=300),
    block_size=st.sampled_from([1, 2, 16, 23, 24, 63, 64, 65, 256]),
)
def test_each_block_body_is_the_cbor_between_header_and_null(
    tokens: list[int], block_size: int
) -> None:
    """``encode_bodies`` gives exactly ``cbor2``'s bytes of each block's ids, and offsets."""
    whole = len(tokens) // block_size * block_size
    encoded = encode_bodies(array("Q", tokens), block_size)
    assert encoded is not None
    joined, offsets = encoded
    assert len(offsets) == whole // block_size + 1
    assert offsets[-1] == len(joined)
    header = cbor_head(4, block_size)
    for index, (start, end) in enumerate(itertools.pairwise(offsets)):
        block = tokens[index * block_size : (index + 1) * block_size]
        assert header + joined[start:end] == cbor2.dumps(block, canonical=True)


@pytest.mark.parametrize("bad", [2**32, 2**63, 2**64 - 1])
def test_ids_from_2_32_are_refused_by_the_packed_encoder(bad: int) -> None:
    assert encode_bodies(array("Q", [1, 2, bad, 3]), 2) is None


def test_a_packed_copy_shorter_than_the_full_blocks_is_not_read() -> None:
    tokens = list(range(100, 140))
    expected = hash_full_blocks_cbor2(tokens, 8, start_block=0, parent_hash=None, cache_salt=None)
    short = array("Q", [7] * 30)  # wrong ids, and too few: the list is hashed instead
    got = hash_packed_blocks(tokens, short, 8, start_block=0, parent_hash=None, cache_salt=None)
    assert got == expected
