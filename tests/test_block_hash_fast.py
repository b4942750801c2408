"""The fast block hashing path is byte-identical to the definition.

``hash_full_blocks`` (used by ``Request``) encodes the CBOR of many blocks at once; it must give
exactly the hashes of SHA-256 over ``cbor2.dumps([parent, token_ids, extra_keys],
canonical=True)``, block by block, for any token ids, block size, salt and parent.
"""

from __future__ import annotations

import hashlib

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.reference import block_hash
from hybridkv.reference.block_hash import (
    NONE_HASH,
    BlockHash,
    cbor_head,
    encode_token_id,
    hash_full_blocks,
    hash_full_blocks_cbor2,
)
from hybridkv.reference.request import Request

# Every CBOR integer size class and its boundaries, bignums included.
BOUNDARIES = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, 2**70]
token_ids = st.one_of(
    st.sampled_from(BOUNDARIES),
    st.integers(0, 300),
    st.integers(0, 2**18 + 5),
    st.integers(0, 2**66),
)


def by_definition(
    token_ids: list[int], block_size: int, parent: bytes | None, salt: str | None, start: int
) -> list[bytes]:
    """SHA-256 of canonical CBOR, one block at a time, written out without the library code."""
    out: list[bytes] = []
    for index in range(start, len(token_ids) // block_size):
        extra = [["cache_salt", salt]] if index == 0 and salt else None  # "" is no salt
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        value = [NONE_HASH if parent is None else parent, tokens, extra]
        parent = hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
        out.append(parent)
    return out


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(token_ids, max_size=80),
    block_size=st.sampled_from([1, 2, 3, 4, 16, 23, 24, 32]),
    salt=st.one_of(st.none(), st.text(max_size=40)),
    parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32), st.binary(max_size=40)),
    start=st.integers(0, 3),
)
def test_fast_hashes_equal_the_definition(
    tokens: list[int], block_size: int, salt: str | None, parent: bytes | None, start: int
) -> None:
    expected = by_definition(tokens, block_size, parent, salt, start)
    for hash_blocks in (hash_full_blocks, hash_full_blocks_cbor2):
        got = hash_blocks(
            tokens,
            block_size,
            start_block=start,
            parent_hash=None if parent is None else BlockHash(parent),
            cache_salt=salt,
        )
        assert got == expected


@given(st.one_of(token_ids, st.integers(0, 2**80)))
def test_one_token_id_encodes_as_cbor2_does(token_id: int) -> None:
    assert encode_token_id(token_id) == cbor2.dumps(token_id, canonical=True)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(token_ids, max_size=40),
    outputs=st.lists(st.lists(token_ids, max_size=5), max_size=8),
    salt=st.one_of(st.none(), st.text(max_size=8)),
)
def test_a_growing_request_hashes_as_if_hashed_at_once(
    prompt: list[int], outputs: list[list[int]], salt: str | None
) -> None:
    request = Request("r", prompt, hash_block_size=4, cache_salt=salt)
    for tokens in outputs:
        request.append_output_token_ids(tokens)
    everything = prompt + [t for tokens in outputs for t in tokens]
    assert list(request.block_hashes) == by_definition(everything, 4, None, salt, 0)


def test_token_ids_outside_the_table_and_negative_ids_still_match() -> None:
    """Ids past the lookup table and (invalid, but encodable) negative ids take checked paths."""
    for tokens in ([2**19, 5, 2**40, 7], [-1, 3, -(2**20), 9], [2**18 - 1, 2**18, 0, 1]):
        fast = hash_full_blocks(tokens, 2, start_block=0, parent_hash=None, cache_salt=None)
        slow = hash_full_blocks_cbor2(tokens, 2, start_block=0, parent_hash=None, cache_salt=None)
        assert fast == slow == by_definition(tokens, 2, None, None, 0)


def test_a_fallback_past_the_first_block_chains_from_its_parent() -> None:
    """An id the fast path cannot encode sends the rest of the chain to the definition, which
    must go on from the hash of the block before it (the caller's parent, or the salted
    first block's hash)."""
    parent = BlockHash(hashlib.sha256(b"parent").digest())
    tokens = [1, 2, -3, 4, 5, 6]
    got = hash_full_blocks(tokens, 2, start_block=0, parent_hash=parent, cache_salt=None)
    assert got == by_definition(tokens, 2, parent, None, 0)
    got = hash_full_blocks(tokens, 2, start_block=0, parent_hash=None, cache_salt="salt")
    assert got == by_definition(tokens, 2, None, "salt", 0)
    got = hash_full_blocks(tokens, 2, start_block=1, parent_hash=parent, cache_salt="salt")
    assert got == by_definition(tokens, 2, parent, "salt", 1)


def test_ordinary_token_ids_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-negative ids below 2**64, zero and ids past the table included, never reach the
    one-block-at-a-time definition (it would give the same hashes, many times slower)."""
    cases = [
        [0, 1, 2, 3],
        [5, 0, 255, 256],
        [2**18 - 1, 0, 2**18, 2**40],
        [2**64 - 1, 7, 0, 0],
    ]
    expected = [by_definition(tokens, 2, None, None, 0) for tokens in cases]

    def definition(*args: object, **kwargs: object) -> list[BlockHash]:
        raise AssertionError("the definition was called")

    monkeypatch.setattr(block_hash, "hash_full_blocks_cbor2", definition)
    monkeypatch.setattr(block_hash, "hash_block_tokens", definition)
    for tokens, hashes in zip(cases, expected, strict=True):
        got = hash_full_blocks(tokens, 2, start_block=0, parent_hash=None, cache_salt=None)
        assert got == hashes


def test_the_encoding_table_grows_to_the_power_of_two_above_the_largest_id() -> None:
    """Tables are built for ids below 256, 512, … 2**18 only as the largest id needs them;
    ids from 2**18 on are encoded one by one rather than growing the table further."""

    def tables_built_for(largest: int) -> int:
        block_hash._token_table.cache_clear()
        hash_full_blocks([0, largest], 2, start_block=0, parent_hash=None, cache_salt=None)
        return block_hash._token_table.cache_info().currsize

    assert tables_built_for(255) == 1
    assert tables_built_for(256) == 2
    assert tables_built_for(2**18 - 1) == 11
    assert tables_built_for(2**18) == 0


@given(st.one_of(st.sampled_from(BOUNDARIES[:-2]), st.integers(0, 2**64 - 1)))
def test_the_cbor_head_of_every_size_class_is_cbor2s(value: int) -> None:
    """Major type 0 (an unsigned int) and 1 (a negative int, ``-1 - value``): the head is the
    whole encoding, in each of the five size classes."""
    assert cbor_head(0, value) == cbor2.dumps(value, canonical=True)
    assert cbor_head(1, value) == cbor2.dumps(-1 - value, canonical=True)


@pytest.mark.parametrize("block_size", [1, 23, 24, 255, 256, 528, 65535, 65536])
def test_blocks_of_any_size_hash_as_the_definition(block_size: int) -> None:
    """The array header of a block (major type 4) in every size class a block size reaches,
    Mamba's raised block sizes (hundreds of tokens) included."""
    tokens = [i % 300 for i in range(2 * block_size + 1)]
    got = hash_full_blocks(tokens, block_size, start_block=0, parent_hash=None, cache_salt=None)
    assert got == by_definition(tokens, block_size, None, None, 0)


def test_an_empty_cache_salt_is_no_salt() -> None:
    """vLLM salts a request's first block only when its salt is truthy: ``cache_salt=""``
    hashes (and shares cached blocks) as an unsalted request does."""
    tokens = list(range(12))
    empty = Request("e", tokens, hash_block_size=4, cache_salt="")
    plain = Request("p", tokens, hash_block_size=4)
    salted = Request("s", tokens, hash_block_size=4, cache_salt="x")
    assert empty.cache_salt is None
    assert list(empty.block_hashes) == list(plain.block_hashes)
    assert empty.block_hashes[0] != salted.block_hashes[0]
    assert block_hash.extra_keys_for_block(0, "") is None
    assert block_hash.extra_keys_for_block(0, "x") == (("cache_salt", "x"),)
