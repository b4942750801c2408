"""Prefix-cache entries by hash and by block id, as vLLM's block pool offers them.

``get_cached_block_ids`` (vLLM's ``BlockPool.get_cached_block``: the first block cached under a
hash in each group, ``None`` if any group misses) and ``evict_blocks`` (``BlockPool.evict_blocks``:
forget the keys of blocks named by id, each removal announced, nothing else changed) on both
backends, with the same answers and the same pool afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import KVCacheManager
from hybridkv.reference.events import BlockRemoved
from hybridkv.reference.request import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

B = 4
BACKENDS = ("reference", "optimized")


def config(num_blocks: int = 48) -> KVCacheConfig:
    sizes = {"block_size": B, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
    return KVCacheConfig(
        num_blocks,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=8, **sizes)),
        ),
    )


def manager(backend: str, num_blocks: int = 48) -> Any:
    if backend == "reference":
        return KVCacheManager(config(num_blocks), 256, enable_kv_cache_events=True)
    return TorchKVCacheManager(config(num_blocks), 256, enable_kv_cache_events=True)


def admit(m: Any, rid: str, tokens: list[int], look: bool = True) -> Request:
    request = Request(rid, tokens, hash_block_size=B)
    hits, hit = (m.get_computed_blocks(request)[:2]) if look else (None, 0)
    assert m.allocate_slots(request, request.num_tokens - hit, hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return request


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cached_hash_names_its_block_and_a_miss_in_any_group_is_none(backend: str) -> None:
    m = manager(backend)
    a = admit(m, "a", list(range(21)))
    full, window = m.get_block_ids("a")
    hashes = a.block_hashes
    assert [m.get_cached_block_ids(h, [0]) for h in hashes] == [[b] for b in full[:5]]
    # The window's last blocks are held; the first ones left the window but stay cached.
    assert m.get_cached_block_ids(hashes[4], [0, 1]) == [full[4], window[4]]
    assert m.get_cached_block_ids(b"\x07" * 32, [0]) is None
    assert m.get_cached_block_ids(hashes[0], []) == []
    m.free(a)
    assert m.get_cached_block_ids(hashes[2], [1, 0]) is not None  # free, still cached


@pytest.mark.parametrize("backend", BACKENDS)
def test_of_two_blocks_under_one_hash_the_first_cached_answers(backend: str) -> None:
    m = manager(backend)
    admit(m, "a", list(range(9)))
    admit(m, "b", list(range(9)), look=False)  # computed again, cached again
    first, second = m.get_block_ids("a")[0], m.get_block_ids("b")[0]
    assert first[:2] != second[:2]
    hashes = Request("x", list(range(9)), hash_block_size=B).block_hashes
    assert [m.get_cached_block_ids(h, [0]) for h in hashes] == [[first[0]], [first[1]]]
    m.evict_blocks({first[1]})
    assert m.get_cached_block_ids(hashes[1], [0]) == [second[1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_evicted_blocks_lose_their_keys_and_keep_their_place(backend: str) -> None:
    """A free block keeps its place in the free queue, a held one its references; each key
    removed is one ``BlockRemoved``; a later prompt hits up to the first evicted block."""
    m = manager(backend)
    a = admit(m, "a", list(range(21)))
    m.free(a)
    m.take_events()
    assert m.get_block_ids("a") == ([], [])
    blocks = []
    for block_hash in a.block_hashes:
        found = m.get_cached_block_ids(block_hash, [0])
        assert found is not None
        blocks.append(found[0])
    before = m.snapshot()
    m.evict_blocks({blocks[2], 0})  # the null block holds no key: left alone
    after = m.snapshot()
    assert after.free_block_ids == before.free_block_ids
    assert after.ref_counts == before.ref_counts
    assert after.cached_block_ids[0] == tuple(sorted(set(before.cached_block_ids[0]) - {blocks[2]}))
    events = m.take_events()
    assert [type(e) for e in events] == [BlockRemoved]
    assert list(events[0].block_hashes) == [a.block_hashes[2]]
    probe = Request("p", list(range(21)), hash_block_size=B)
    assert m.get_computed_blocks(probe)[1] == 2 * B
    held = admit(m, "h", list(range(30, 41)))
    held_block = m.get_block_ids("h")[0][0]
    m.evict_blocks([held_block])
    assert m.snapshot().ref_counts[held_block] == 1
    assert m.get_cached_block_ids(held.block_hashes[0], [0]) is None
    m.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_are_refused_by_name_and_change_nothing(backend: str) -> None:
    m = manager(backend)
    a = admit(m, "a", list(range(21)))
    before = m.snapshot()
    block = m.get_block_ids("a")[0][0]
    with pytest.raises(ValueError, match=r"block_ids: 48 is not a block id \(0 … 47\)"):
        m.evict_blocks([block, 48])
    with pytest.raises(ValueError, match="block_ids: '3' is not a block id"):
        m.evict_blocks(["3"])
    with pytest.raises(ValueError, match=r"kv_cache_group_ids: 2 is not a group id \(0 … 1\)"):
        m.get_cached_block_ids(a.block_hashes[0], [0, 2])
    assert m.snapshot() == before
    assert not any(isinstance(e, BlockRemoved) for e in m.take_events())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 24), st.lists(st.integers(1, 47), max_size=4)),
        min_size=1,
        max_size=10,
    )
)
def test_both_backends_answer_and_evict_alike(steps: list[tuple[int, int, list[int]]]) -> None:
    """Prompts from three shared prefixes, each admitted, freed, then blocks evicted by id: the
    same hits, answers by hash, events and pool on both backends."""
    managers = [manager(backend, 40) for backend in BACKENDS]
    seen: list[bytes] = []
    for i, (prefix, length, evict) in enumerate(steps):
        tokens = [prefix * 1000 + t for t in range(length)]
        hits = []
        for m in managers:
            request = admit(m, f"r{i}", tokens)
            hits.append(m.get_block_ids(f"r{i}"))
            m.free(request)
            m.evict_blocks({b for b in evict if b < 40})
        seen.extend(bytes(h) for h in request.block_hashes)
        assert hits[0] == hits[1]
        assert managers[0].snapshot() == managers[1].snapshot()
        assert managers[0].take_events() == managers[1].take_events()
        for h in seen:
            for groups in ([0], [1], [0, 1]):
                answers = [m.get_cached_block_ids(h, groups) for m in managers]
                assert answers[0] == answers[1]
    for m in managers:
        m.check_invariants()
