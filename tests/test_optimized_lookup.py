"""The optimized lookup's paths, each pinned to exact values and to the reference's results.

``tests/test_optimized_source_runs.py`` reads hits from sources' runs; this file pins what the
lookup does around them: the hit it returns (``HitBlocks``, which builds its tuples on first
read, and must behave as the ``KVCacheBlocks`` of its ids), the lead run that reads every
attention type at once (``lead_run``), the sliding-window scan (``TypeProbe.window_hit``, the
rules' skip twin over the memo), the token comparison that finds where a source stops agreeing
(``first_difference``), sources' records cleared on eviction, and the duplicate-entry walk.
"""

from __future__ import annotations

import copy
import pickle
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lookup_layouts import FULL, SIZES, WINDOWS, prompt

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.block_pool import TorchBlockPool, hash_key
from hybridkv.optimized.lookup import (
    HIT,
    MISSED,
    GroupHit,
    HitBlocks,
    Lookup,
    TypeProbe,
    first_difference,
    lead_run,
)
from hybridkv.optimized.state import Tuning
from hybridkv.reference import KVCacheManager
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec, rules


def ids(*groups: tuple[int, ...]) -> KVCacheBlocks:
    return KVCacheBlocks(groups)


def hit_of(*groups: tuple[int, list[int]]) -> HitBlocks:
    """A ``HitBlocks`` of (nulls, block ids) per group."""
    return HitBlocks(
        [GroupHit(nulls, np.array(blocks, dtype=np.int32)) for nulls, blocks in groups]
    )


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, hash_block_size=4)


def managers(
    num_blocks: int, groups: tuple[KVCacheGroup, ...], *, memo_hits: bool = True
) -> tuple[TorchKVCacheManager, KVCacheManager]:
    config, tuning = KVCacheConfig(num_blocks, groups), Tuning(memo_hits=memo_hits)
    return TorchKVCacheManager(config, 4096, tuning=tuning), KVCacheManager(config, 4096)


def cache_and_free(opt: TorchKVCacheManager, ref: KVCacheManager, tokens: list[int]) -> None:
    for manager in (opt, ref):
        first = request("a", tokens)
        assert manager.allocate_slots(first, len(tokens)) is not None
        manager.free(first)


@contextmanager
def lead_counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[int]]]:
    """The per-type counts of every lead run while the block is active."""
    seen: list[list[int]] = []

    def spy(memos: list[TypeProbe]) -> list[int]:
        counts = lead_run(memos)
        seen.append(counts)
        return counts

    with monkeypatch.context() as patch:
        patch.setattr("hybridkv.optimized.hits.lead_run", spy)
        yield seen


@contextmanager
def probes_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """The (position, group) of every chain-walking probe while the block is active."""
    seen: list[tuple[int, int]] = []
    original = Lookup.probe

    def spy(self: Lookup, pos: int, group_id: int) -> int:
        seen.append((pos, group_id))
        return original(self, pos, group_id)

    with monkeypatch.context() as patch:
        patch.setattr(Lookup, "probe", spy)
        yield seen


# --- The hit: a KVCacheBlocks that builds its tuples on first read ---------------------------


def test_a_hit_equals_the_kv_cache_blocks_of_its_ids_both_ways_and_hashes_alike() -> None:
    hit = hit_of((0, [5, 6, 7]), (2, [9]))
    plain = ids((5, 6, 7), (0, 0, 9))
    assert hit == plain
    assert plain == hit
    assert not hit != plain  # noqa: SIM202 (the operator itself is under test)
    assert not plain != hit  # noqa: SIM202
    assert hash(hit) == hash(plain)
    assert hit != ids((5, 6, 7), (0, 9))
    assert ids((5, 6), (0, 0, 9)) != hit
    assert hit != ((5, 6, 7), (0, 0, 9))  # only KVCacheBlocks compare equal
    table: dict[KVCacheBlocks, str] = {hit: "x"}
    assert table[plain] == "x"
    assert repr(hit) == repr(plain) == "KVCacheBlocks(block_ids=((5, 6, 7), (0, 0, 9)))"
    assert isinstance(hit, KVCacheBlocks)


def test_a_hit_builds_its_tuples_once_on_first_read() -> None:
    hit = hit_of((1, [4, 3]), (0, []), (3, []))
    first = hit.block_ids
    assert first == ((0, 4, 3), (), (0, 0, 0))
    assert hit.block_ids is first
    assert all(type(block) is int for group in first for block in group)
    assert hit.num_groups == 3
    assert hit.get_block_ids() == ([0, 4, 3], [], [0, 0, 0])
    assert hit.get_block_ids(allow_none=True, group_ids=[1]) is None
    assert hit + ids((8,), (9,), ()) == ids((0, 4, 3, 8), (9,), (0, 0, 0))
    assert hit.new_empty() == ids((), (), ())


def test_a_hit_is_immutable() -> None:
    hit = hit_of((0, [5]))
    with pytest.raises(FrozenInstanceError):
        hit.block_ids = ((6,),)  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        hit.anything = 1
    with pytest.raises(FrozenInstanceError):
        del hit.block_ids
    assert hit.block_ids == ((5,),)


def test_a_copied_or_pickled_hit_is_a_plain_kv_cache_blocks_of_its_ids() -> None:
    hit = hit_of((1, [5, 6]))
    for twin in (copy.copy(hit), copy.deepcopy(hit), pickle.loads(pickle.dumps(hit))):
        assert type(twin) is KVCacheBlocks
        assert twin == hit
        assert twin.block_ids == ((0, 5, 6),)


def test_a_group_hit_cut_keeps_its_first_blocks() -> None:
    group = GroupHit(2, np.array([7, 8, 9], dtype=np.int32))
    assert len(group) == 5
    assert group.cut(9) is group
    assert group.cut(4).as_tuple() == (0, 0, 7, 8)
    assert group.cut(1).as_tuple() == (0,)
    assert group.cut(0).as_tuple() == ()


def test_allocate_slots_takes_a_hit_back_and_a_copy_of_it_too() -> None:
    """The lookup's own result skips the id checks (it is the manager's), a copy of it (a plain
    ``KVCacheBlocks``) takes them; both admit the request as the reference does."""
    tokens = prompt(1, 41)

    def same(hit: KVCacheBlocks) -> KVCacheBlocks:
        return hit

    adopts: list[Callable[[KVCacheBlocks], KVCacheBlocks]] = [same, copy.copy]
    for adopt in adopts:
        opt, ref = managers(64, (FULL, *WINDOWS))
        cache_and_free(opt, ref, tokens)
        got_hit, got_len, _ = opt.get_computed_blocks(request("b", tokens))
        want_hit, want_len, _ = ref.get_computed_blocks(request("b", tokens))
        assert isinstance(got_hit, HitBlocks)
        assert (got_hit, got_len) == (want_hit, want_len)
        assert got_len == 40
        got = opt.allocate_slots(request("b", tokens), 1, got_len, adopt(got_hit))
        want = ref.allocate_slots(request("b", tokens), 1, want_len, want_hit)
        assert got == want
        assert opt.get_block_ids("b") == ref.get_block_ids("b")
        opt.check_invariants()


# --- Reading every type at once, and the scans ------------------------------------------------


def test_a_lead_run_reads_every_type_of_a_prompt_cached_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt, ref = managers(400, (FULL, *WINDOWS), memo_hits=False)
    tokens = prompt(2, 401)
    cache_and_free(opt, ref, tokens)
    with lead_counts(monkeypatch) as counts, probes_made(monkeypatch) as probes:
        got = opt.get_computed_blocks(request("b", tokens))
    assert got == ref.get_computed_blocks(request("b", tokens))
    assert got[1] == 400
    assert counts == [[100, 100]]
    assert probes == []  # the run's seed is its first-inserted candidate, verified with it


def test_a_lead_run_stops_each_type_where_its_groups_lose_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The windows first in the layout: their tails are evicted first, the full group keeps
    every block; the lead run reads 100 positions of the full type and 96 of the windows'."""
    opt, ref = managers(330, (*WINDOWS, FULL))
    tokens = prompt(6, 401)
    cache_and_free(opt, ref, tokens)
    for manager in (opt, ref):
        assert manager.allocate_slots(request("x", prompt(44, 44)), 44) is not None
    with lead_counts(monkeypatch) as counts:
        got = opt.get_computed_blocks(request("b", tokens))
    assert got == ref.get_computed_blocks(request("b", tokens))
    assert got[1:] == (384, 400)
    assert counts == [[100, 96]]
    opt.check_invariants()


def test_the_end_of_a_cached_prefix_costs_one_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt whose first 40 of 50 blocks are cached (an admission): the lead run reads them,
    one probe of position 40 settles the full-attention scan, the windows need nothing more."""
    opt, ref = managers(400, (FULL, *WINDOWS), memo_hits=False)
    shared = prompt(3, 160)
    cache_and_free(opt, ref, [*shared, *prompt(4, 41)])
    tokens = [*shared, *prompt(5, 41)]
    with lead_counts(monkeypatch) as counts, probes_made(monkeypatch) as probes:
        got = opt.get_computed_blocks(request("b", tokens))
    assert got == ref.get_computed_blocks(request("b", tokens))
    assert got[1] == 160
    assert counts == [[40, 40]]
    assert probes == [(40, 0)]


def test_a_window_type_reads_its_run_from_the_full_runs_source_without_a_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beyond ``LEAD_RUN_MAX`` each type reads its own run; the window type's (positions 75 …
    99) comes from the source of the full type's run (``hint``), so the lookup walks one
    chain, at position 0."""
    monkeypatch.setattr("hybridkv.optimized.type_probe.LEAD_RUN_MAX", 0)
    # Windows of 25 blocks: a candidate window is 50 (position, group) pairs, read as a run.
    wide = tuple(
        KVCacheGroup((f"sw.{i}",), SlidingWindowSpec(sliding_window=100, **SIZES)) for i in (0, 1)
    )
    opt, ref = managers(400, (FULL, *wide), memo_hits=False)
    tokens = prompt(7, 401)
    cache_and_free(opt, ref, tokens)
    with lead_counts(monkeypatch) as counts, probes_made(monkeypatch) as probes:
        got = opt.get_computed_blocks(request("b", tokens))
    assert got == ref.get_computed_blocks(request("b", tokens))
    assert got[1] == 400
    assert counts == [[0, 0]]
    assert probes == [(0, 0)]


def type_probe(flags: list[bool]) -> TypeProbe:
    """A memo whose every position is already probed (its lookup is never asked)."""
    pool = TorchBlockPool(16, 1, enable_caching=True)
    memo = TypeProbe(Lookup(pool, request("r", [1] * 4), 4), [0], len(flags))
    memo.flags[:] = bytes(HIT if flag else MISSED for flag in flags)
    return memo


@settings(max_examples=300, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=24), needed=st.integers(0, 10))
def test_the_window_scan_over_the_memo_is_the_rule(flags: list[bool], needed: int) -> None:
    assert type_probe(flags).window_hit(len(flags), needed) == rules.sliding_window_hit_blocks(
        flags, needed
    )


def test_the_window_scan_skips_to_each_miss() -> None:
    """Window 3 over H H H M H H M H H: the candidates ending at 9 and 6 hold a miss, the run
    from 0 is the hit."""
    flags = [True, True, True, False, True, True, False, True, True]
    assert type_probe(flags).window_hit(9, 3) == (3, 0)
    assert type_probe([*flags[:3], True, *flags[4:]]).window_hit(9, 3) == (6, 3)


def test_the_full_attention_scan_over_the_memo_stops_at_the_first_miss() -> None:
    assert type_probe([True] * 5 + [False, True]).leading_hits(7) == 5
    assert type_probe([True] * 7).leading_hits(7) == 7
    assert type_probe([False]).leading_hits(1) == 0


# --- Verification: where a source stops agreeing --------------------------------------------


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "lists"])
def test_first_difference_is_the_first_differing_token(packed: bool) -> None:
    ours = list(range(100))
    theirs = [*range(37), 999, *range(38, 100)]

    def seq(tokens: list[int]) -> list[int] | array[int]:
        return array("Q", tokens) if packed else tokens

    a, b = seq(ours), seq(theirs)
    assert first_difference(a, b, 0, 100) == 37
    assert first_difference(a, b, 0, 37) == 37
    assert first_difference(a, b, 10, 60) == 37
    assert first_difference(a, b, 38, 100) == 100
    assert first_difference(a, b, 40, 40) == 40
    assert first_difference(a, seq(ours), 0, 100) == 100


# --- The pool's side: records cleared on eviction, duplicate entries --------------------------


def test_evicting_a_block_clears_it_from_its_sources_record() -> None:
    pool = TorchBlockPool(16, 2, enable_caching=True)
    hashes = [BlockHash(bytes([i]) * 32) for i in (1, 2)]
    src = pool.new_source([1, 2, 3, 4, 5, 6, 7, 8], hashes, None)
    pool.insert(3, hashes[0], 0, 0, src)
    pool.insert(5, hashes[0], 1, 0, src)
    pool.insert(7, hashes[1], 0, 1, src)
    assert pool.source(src).blocks.tolist()[:3] == [3, 5, 7]
    pool.check_invariants()
    pool.evict(5)
    assert pool.source(src).blocks.tolist()[:3] == [3, pool.end, 7]
    pool.check_invariants()


def test_a_stale_record_fails_the_pools_invariants() -> None:
    pool = TorchBlockPool(16, 1, enable_caching=True)
    src = pool.new_source([1, 2, 3, 4], [BlockHash(b"\x01" * 32)], None)
    pool.insert(3, BlockHash(b"\x01" * 32), 0, 0, src)
    pool.source(src).blocks[0] = 4  # a block the source does not hold
    with pytest.raises(Exception, match="records block 4 under tag 0"):
        pool.check_invariants()


@pytest.mark.parametrize(
    ("scalar_max", "tail"),
    [(0, 0), (0, 1 << 20), (1 << 20, 0)],
    ids=["vector walk", "vector walk, array tail", "array walk"],
)
def test_duplicate_entries_are_found_by_either_walk(
    scalar_max: int, tail: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks 1 … 12 cached under four keys, three times each (by ``insert_array``): the later
    two of each key are duplicates, whichever walk finds them."""
    monkeypatch.setattr("hybridkv.optimized.cache_chains.SETTLE_SCALAR_MAX", scalar_max)
    monkeypatch.setattr("hybridkv.optimized.cache_chains.TAIL_MAX", tail)
    pool = TorchBlockPool(32, 1, enable_caching=True)
    hashes = [BlockHash(bytes([i + 1]) * 32) for i in range(4)]
    src = pool.new_source([0] * 16, hashes, None)
    blocks = np.arange(1, 13, dtype=np.int64)
    positions = np.arange(12, dtype=np.int64) % 4
    keys = np.array([hash_key(hashes[p]) for p in positions.tolist()], dtype=np.int64)
    pool.insert_array(blocks, np.zeros(12, dtype=np.int64), positions, keys, src)
    pool.settle_duplicates()
    assert pool.dups == set(range(5, 13))
    pool.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2])
def test_a_one_token_window_hits_only_up_to_a_cached_block_as_the_reference(
    block_size: int,
) -> None:
    """A window of one token needs no block before the hit, yet the scan (vLLM's and the
    reference's) ends only at a cached block, and such a window caches none: no hit at all,
    though the full-attention group holds the whole shared prefix."""
    sizes = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    config = KVCacheConfig(
        40,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=1, **sizes)),
        ),
    )
    prompt = [1, 2, 3, 4] * block_size
    longer = [*prompt, *[5, 1, 2] * block_size]
    found = []
    for manager in (KVCacheManager(config, 64), TorchKVCacheManager(config, 64)):
        first = Request("a", prompt, hash_block_size=block_size)
        manager.get_computed_blocks(first)
        assert manager.allocate_slots(first, len(prompt)) is not None
        blocks, hit, _ = manager.get_computed_blocks(
            Request("b", longer, hash_block_size=block_size)
        )
        found.append((hit, blocks.get_block_ids()))
    assert found[0] == found[1] == (0, ([], []))
