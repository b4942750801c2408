"""The optimized manager's block hasher remembers the hashes of cached blocks, exactly.

``TorchKVCacheManager.block_hasher`` (``hybridkv.optimized.hash_memo``) memoises
``hash_full_blocks_torch`` for the blocks in the prefix cache: a request built with it must
carry the hashes of one hashed from scratch (salts, evictions and resets included), the memo
must never hold more keys than there are cached blocks, and lookups with its hashes must still
be verified against the cached tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.reference import KVCacheManager
from hybridkv.reference.block_hash import hash_full_blocks
from hybridkv.reference.request import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

B = 4


def config(num_blocks: int = 64) -> KVCacheConfig:
    sizes = {"block_size": B, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
    return KVCacheConfig(
        num_blocks,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=8, **sizes)),
        ),
    )


def memo_request(
    manager: TorchKVCacheManager, rid: str, tokens: list[int], salt: str | None = None
) -> Request:
    return Request(
        rid, tokens, hash_block_size=B, cache_salt=salt, block_hasher=manager.block_hasher
    )


def plain_hashes(tokens: Sequence[int], salt: str | None = None) -> list[bytes]:
    return list(hash_full_blocks(tokens, B, start_block=0, parent_hash=None, cache_salt=salt))


def admit(manager: TorchKVCacheManager, request: Request) -> None:
    hits, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit, hits) is not None


def cached_blocks(manager: TorchKVCacheManager) -> int:
    return sum(map(len, manager.pool.cached_blocks()))


def cached_hashes(manager: TorchKVCacheManager) -> dict[bytes, int]:
    """Per hash in the prefix cache, how many cached blocks hold it."""
    counts: dict[bytes, int] = {}
    for blocks in manager.pool.cached_blocks():
        for block in blocks:
            block_hash = manager.pool.block_hash(block)
            counts[block_hash] = counts.get(block_hash, 0) + 1
    return counts


def test_a_request_built_with_the_memo_has_the_hashes_of_one_hashed_from_scratch() -> None:
    manager = TorchKVCacheManager(config(), 64)
    prompt = list(range(100, 122))  # 5 full blocks and 2 tokens
    first = memo_request(manager, "a", prompt)
    admit(manager, first)
    assert len(manager.block_hasher) == 5  # one key per cached hash (two groups share them)
    second = memo_request(manager, "b", [*prompt[:12], 7, 8, 9, 10, 11, 12, 13])
    assert list(second.block_hashes) == plain_hashes(second.all_token_ids)
    again = memo_request(manager, "c", prompt)
    assert list(again.block_hashes) == list(first.block_hashes) == plain_hashes(prompt)


def test_the_memo_adopts_the_cached_prefix_and_hashes_only_the_rest() -> None:
    calls: list[int] = []

    def counting(tokens, block_size, *, start_block, parent_hash, cache_salt):  # type: ignore[no-untyped-def]
        calls.append(start_block)
        return hash_full_blocks_torch(
            tokens, block_size, start_block=start_block, parent_hash=parent_hash,
            cache_salt=cache_salt,
        )  # fmt: skip

    manager = TorchKVCacheManager(config(), 64)
    manager.block_hasher.hasher = counting
    prompt = list(range(40))  # 10 blocks
    admit(manager, memo_request(manager, "a", prompt))
    assert calls == [0]
    follower = memo_request(manager, "b", prompt[:24] + [1] * 8)
    assert calls == [0, 6]  # blocks 0-5 adopted, 6 and 7 hashed
    assert list(follower.block_hashes) == plain_hashes(follower.all_token_ids)


def test_salted_requests_adopt_only_their_own_salts_hashes() -> None:
    manager = TorchKVCacheManager(config(), 64)
    prompt = list(range(16))
    admit(manager, memo_request(manager, "a", prompt, salt="s1"))
    for rid, salt in (("b", "s1"), ("c", "s2"), ("d", None)):
        request = memo_request(manager, rid, prompt, salt=salt)
        assert list(request.block_hashes) == plain_hashes(prompt, salt)


def test_evicted_blocks_leave_the_memo_and_hashes_stay_exact() -> None:
    manager = TorchKVCacheManager(config(num_blocks=17), 64)  # 16 usable blocks
    first = memo_request(manager, "a", list(range(32)))  # 8 blocks per group: all 16
    admit(manager, first)
    manager.free(first)
    assert len(manager.block_hasher) == 8
    other = memo_request(manager, "b", list(range(500, 516)))  # 4 blocks per group: evicts 8
    admit(manager, other)
    assert cached_blocks(manager) == 16
    assert len(manager.block_hasher) == len(cached_hashes(manager)) == 12
    assert set(manager.block_hasher.entries.values()) <= {
        (h, c) for h, c in cached_hashes(manager).items()
    }
    again = memo_request(manager, "c", list(range(32)))
    assert list(again.block_hashes) == plain_hashes(list(range(32)))


def test_a_reset_prefix_cache_empties_the_memo() -> None:
    manager = TorchKVCacheManager(config(), 64)
    first = memo_request(manager, "a", list(range(20)))
    admit(manager, first)
    manager.free(first)
    assert len(manager.block_hasher) == 5
    assert manager.reset_prefix_cache()
    assert len(manager.block_hasher) == 0
    again = memo_request(manager, "b", list(range(20)))
    assert list(again.block_hashes) == plain_hashes(list(range(20)))


def test_requests_hashed_by_another_function_never_fill_the_memo() -> None:
    manager = TorchKVCacheManager(config(), 64)
    admit(manager, Request("a", list(range(20)), hash_block_size=B))
    assert len(manager.block_hasher) == 0


def test_a_memo_request_still_misses_a_colliding_cached_prompt() -> None:
    """A prompt cached by a request whose hasher collides everything is not adopted by a memo
    request, and lookups with the memo's hashes are still verified against cached tokens."""

    def constant(tokens, block_size, *, start_block, parent_hash, cache_salt):  # type: ignore[no-untyped-def]
        return [b"\x01" * 32] * (len(tokens) // block_size - start_block)

    manager = TorchKVCacheManager(config(), 64)
    admit(manager, Request("a", list(range(20)), hash_block_size=B, block_hasher=constant))
    probe = memo_request(manager, "b", list(range(50, 70)))
    assert list(probe.block_hashes) == plain_hashes(list(range(50, 70)))
    _, hit, _ = manager.get_computed_blocks(probe)
    assert hit == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 30), st.sampled_from([None, "x"])),
        min_size=1,
        max_size=12,
    ),
)
def test_memo_hashes_equal_the_definition_and_the_memo_stays_bounded(
    seed: int, steps: list[tuple[int, int, str | None]]
) -> None:
    """Admissions, frees and evictions in a small pool: every request's hashes equal the
    definition's, results equal the reference's, and the memo never outgrows the cache."""
    rng = random.Random(seed)
    bases = [[rng.randrange(6) for _ in range(40)] for _ in range(4)]
    manager = TorchKVCacheManager(config(num_blocks=25), 64)
    reference = KVCacheManager(config(num_blocks=25), 64)
    live: list[tuple[Request, Request]] = []
    for index, (base, length, salt) in enumerate(steps):
        tokens = bases[base][:length]
        ours = memo_request(manager, f"r{index}", tokens, salt)
        theirs = Request(f"r{index}", tokens, hash_block_size=B, cache_salt=salt)
        assert list(ours.block_hashes) == list(theirs.block_hashes) == plain_hashes(tokens, salt)
        got = manager.get_computed_blocks(ours)
        want = reference.get_computed_blocks(theirs)
        assert got == want
        out = manager.allocate_slots(ours, ours.num_tokens - got[1], got[1], got[0])
        expected = reference.allocate_slots(theirs, theirs.num_tokens - want[1], want[1], want[0])
        assert out == expected
        if out is not None:
            live.append((ours, theirs))
        if len(live) > 2 or (live and rng.random() < 0.5):
            a, b = live.pop(0)
            manager.free(a)
            reference.free(b)
        assert len(manager.block_hasher) <= cached_blocks(manager)
        manager.check_invariants()


def test_the_memo_alone_hashes_as_the_torch_hasher() -> None:
    memo = HashMemo(B)
    tokens = [5, 2**32 + 1, 3, 4, 1, 2, 3, 4]
    got = memo(tokens, B, start_block=0, parent_hash=None, cache_salt=None)
    assert got == hash_full_blocks_torch(
        tokens, B, start_block=0, parent_hash=None, cache_salt=None
    )


@pytest.mark.parametrize("bad", [-1, 2**32, "7"])
def test_a_memo_request_with_ids_the_memo_cannot_pack_hashes_from_scratch(bad: object) -> None:
    manager = TorchKVCacheManager(config(), 64)
    admit(manager, memo_request(manager, "a", list(range(8))))
    tokens: list[object] = [0, 1, 2, 3, bad, 5, 6, 7]
    if bad == -1 or bad == "7":
        with pytest.raises(ValueError, match="prompt_token_ids"):
            memo_request(manager, "b", tokens)  # type: ignore[arg-type]
        return
    request = memo_request(manager, "b", tokens)  # type: ignore[arg-type]
    assert list(request.block_hashes) == plain_hashes(tokens)  # type: ignore[arg-type]
