"""A ``Request`` keeps its prompt, hands a packed-ids hasher its packed copy, and hashes as the
definition whichever kind of hasher it has."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from hybridkv.reference.block_hash import BlockHash, hash_full_blocks
from hybridkv.reference.request import Request


class RecordingHasher:
    """``hash_full_blocks`` with a ``hash_packed`` method; records which entry was called."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, list[int] | None]] = []

    def __call__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]:
        self.calls.append(("plain", start_block, None))
        return hash_full_blocks(
            token_ids,
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
        self.calls.append(("packed", start_block, packed.tolist()))
        return hash_full_blocks(
            token_ids,
            block_size,
            start_block=start_block,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )


def definition(tokens: Sequence[int], salt: str | None = None) -> list[BlockHash]:
    return hash_full_blocks(tokens, 2, start_block=0, parent_hash=None, cache_salt=salt)


def test_a_hasher_with_hash_packed_gets_the_packed_copy() -> None:
    hasher = RecordingHasher()
    request = Request("r", [5, 6, 7, 8, 9], hash_block_size=2, block_hasher=hasher)
    request.append_output_token_ids([10, 11])
    assert hasher.calls == [("packed", 0, [5, 6, 7, 8, 9]), ("packed", 2, [5, 6, 7, 8, 9, 10, 11])]
    assert list(request.block_hashes) == definition([5, 6, 7, 8, 9, 10, 11])


def test_without_a_packed_copy_the_hasher_is_called_as_hash_full_blocks() -> None:
    hasher = RecordingHasher()
    request = Request("r", [5, 2**64, 7], hash_block_size=2, block_hasher=hasher)
    request.append_output_token_ids(8)
    assert request.packed_token_ids is None
    assert hasher.calls == [("plain", 0, None), ("plain", 1, None)]
    assert list(request.block_hashes) == definition([5, 2**64, 7, 8])


def test_the_prompt_is_a_tuple_of_the_first_tokens_whatever_was_appended() -> None:
    prompt = [3, 1, 4, 1, 5]
    request = Request("r", prompt, hash_block_size=2)
    prompt.append(9)  # the request keeps its own copy
    request.append_output_token_ids([2, 6])
    assert request.prompt_token_ids == (3, 1, 4, 1, 5)
    assert type(request.prompt_token_ids) is tuple
    assert request.prompt_token_ids is request.prompt_token_ids  # made once
    assert request.num_prompt_tokens == 5
    assert list(request.all_token_ids) == [3, 1, 4, 1, 5, 2, 6]


def test_a_named_hasher_hashes_the_prompt_at_once() -> None:
    hasher = RecordingHasher()
    Request("r", [5, 6, 7, 8], hash_block_size=2, block_hasher=hasher)
    assert hasher.calls == [("packed", 0, [5, 6, 7, 8])]


def test_without_a_named_hasher_the_first_offer_before_any_read_is_taken() -> None:
    """The hasher stays open until the hashes are needed: output tokens appended before that
    are hashed with the prompt, in one call of the offered hasher."""
    hasher = RecordingHasher()
    request = Request("r", [5, 6, 7], hash_block_size=2)
    request.append_output_token_ids([8, 9])
    assert request.block_hasher is hash_full_blocks
    request.offer_block_hasher(hasher)
    assert request.block_hasher is hasher
    assert hasher.calls == [("packed", 0, [5, 6, 7, 8, 9])]
    request.offer_block_hasher(RecordingHasher())  # a second offer is not taken
    assert request.block_hasher is hasher
    request.append_output_token_ids(10)
    assert hasher.calls[-1] == ("packed", 2, [5, 6, 7, 8, 9, 10])
    assert list(request.block_hashes) == definition([5, 6, 7, 8, 9, 10])


def test_once_the_hashes_are_read_an_offer_changes_nothing() -> None:
    request = Request("r", [5, 6, 7, 8, 9], hash_block_size=2, cache_salt="s")
    assert list(request.block_hashes) == definition([5, 6, 7, 8], salt="s")
    hasher = RecordingHasher()
    request.offer_block_hasher(hasher)
    assert request.block_hasher is hash_full_blocks
    assert hasher.calls == []
