"""The one-pass admission (``hybridkv.optimized.one_pass_admission``): a plain admission's
tables written as one matrix, pinned to the group-by-group admission
(``Tuning(one_pass_admission=False)``) and to the reference: the same new blocks, the same
tables and the same pool (free queue order, references, cached blocks) after every call."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from lookup_layouts import (
    ADMISSIONS,
    FULL,
    SIZES,
    WINDOWS,
    admission_prompts,
    free_oldest,
    managers_beside,
    prompt,
)

from hybridkv.optimized import TorchKVCacheManager, path_counts
from hybridkv.optimized.state import Tuning
from hybridkv.reference import KVCacheManager
from hybridkv.reference.request import Request
from hybridkv.spec import ChunkedLocalAttentionSpec, KVCacheGroup

ONE_PASS = path_counts.ADMISSION_ONE_PASS

Manager = TorchKVCacheManager | KVCacheManager


def managers(
    num_blocks: int, groups: tuple[KVCacheGroup, ...] = (FULL, *WINDOWS)
) -> tuple[TorchKVCacheManager, TorchKVCacheManager, KVCacheManager]:
    """The optimized manager with the one-pass admission, without it, and the reference."""
    return managers_beside(num_blocks, Tuning(one_pass_admission=False), groups)


def admit(manager: Manager, request: Request, **keywords: bool) -> Any:
    """Look the request up and admit it whole: its hit length, new blocks (``None``: it did
    not fit) and tables."""
    hit, length, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - length, length, hit, **keywords)
    if new is None:
        return length, None
    tables = tuple(map(tuple, manager.get_block_ids(request.request_id)))
    return length, tuple(map(tuple, new.get_block_ids())), tables


def same_everywhere(
    three: tuple[Manager, ...], tokens: list[int], rid: str, live: list[list[Request]] | None = None
) -> Any:
    """The admission's result, equal in the three managers, with their pools equal after (an
    admitted request's three ``Request`` objects go to ``live``)."""
    requests = [Request(rid, tokens, hash_block_size=4) for _ in three]
    results = [admit(m, r) for m, r in zip(three, requests, strict=True)]
    assert results[0] == results[1] == results[2]
    assert three[0].snapshot() == three[1].snapshot() == three[2].snapshot()
    if live is not None and results[0][1] is not None:
        live.append(requests)
    return results[0]


def test_an_admission_sharing_a_system_prompt_writes_nulls_hit_and_new_blocks() -> None:
    """The design's admission: a 40-token system prompt cached by ``a`` (10 blocks), then ``b``
    of the same system prompt and 13 tokens of its own. Full attention adopts ``a``'s 10
    blocks; each 8-token window skips the positions its window left behind (nulls) and adopts
    ``a``'s blocks 8 and 9; every group then takes 4 new blocks (positions 10 … 13, the last
    one partly filled), in group order, of which positions 10 … 12 are cached."""
    opt, general, ref = managers(100)
    system = prompt(1, 40)
    three = (opt, general, ref)
    same_everywhere(three, [*system, *prompt(2, 5)], "a")
    before = opt.fast_paths[ONE_PASS]
    length, new, tables = same_everywhere(three, [*system, *prompt(3, 13)], "b")
    assert opt.fast_paths[ONE_PASS] == before + 1
    assert general.fast_paths[ONE_PASS] == 0
    a = opt.get_block_ids("a")
    assert length == 40
    assert tables[0][:10] == tuple(a[0][:10])
    for g in (1, 2):
        assert tables[g][:10] == (0,) * 8 + tuple(a[g][8:10])
    taken = [block for group in new for block in group]
    assert [len(group) for group in new] == [4, 4, 4]
    assert taken == sorted(taken)  # one take from the free queue's head, group 0 first
    for g in range(3):
        assert tables[g][10:] == new[g]
    assert opt.snapshot().num_cached_keys == general.snapshot().num_cached_keys
    opt.check_invariants()


def test_a_request_that_does_not_fit_changes_nothing() -> None:
    """The free blocks counted before anything changes: a prompt needing more blocks than the
    free queue holds (with the hits it would take out of the queue) gets ``None``, and the
    pool and the rows are as they were."""
    opt, general, ref = managers(20)
    three = (opt, general, ref)
    same_everywhere(three, prompt(1, 20), "a")  # 5 blocks in each of 3 groups
    before = opt.snapshot()
    assert same_everywhere(three, prompt(2, 24), "b") == (0, None)
    assert opt.snapshot() == before
    assert opt.get_block_ids("b") == ([], [], [])
    opt.check_invariants()


def test_a_hit_waiting_in_the_free_queue_counts_against_the_free_blocks() -> None:
    """``a`` caches 20 tokens (5 blocks a group) and is freed: its blocks wait in the free
    queue. ``b`` of the same 20 tokens and 12 of its own hits all 20: 5 full-attention blocks
    and each window's last 2, all 9 taken out of the queue, then 3 new blocks a group. It
    needs 18 of the free blocks: it fits 18 free blocks (and the null block), not 17."""
    tokens = prompt(1, 20)
    for num_blocks, fits in ((19, True), (18, False)):
        opt, general, ref = managers(num_blocks)
        three: tuple[Manager, ...] = (opt, general, ref)
        live: list[list[Request]] = []
        same_everywhere(three, tokens, "a", live)
        for manager, request in zip(three, live.pop(), strict=True):
            manager.free(request)
        assert opt.snapshot().num_cached_keys == 15
        length, *rest = same_everywhere(three, [*tokens, *prompt(2, 12)], "b")
        assert length == 20
        assert (rest[0] is not None) == fits
        opt.check_invariants()


def test_a_hit_another_request_holds_takes_no_free_block() -> None:
    """``a`` holds its 20 cached tokens (5 blocks a group, 15 in all). ``b`` of the same 20
    tokens and 12 of its own hits all 20 and takes its 9 hit blocks from ``a``, none from the
    free queue, then needs 3 new blocks a group: it fits 9 free blocks (fewer than its hit and
    new blocks together), not 8."""
    tokens = prompt(1, 20)
    for num_blocks, fits in ((25, True), (24, False)):
        opt, general, ref = managers(num_blocks)
        three: tuple[Manager, ...] = (opt, general, ref)
        same_everywhere(three, tokens, "a")
        assert opt.snapshot().num_free_blocks == num_blocks - 16
        before = opt.fast_paths[ONE_PASS]
        length, *rest = same_everywhere(three, [*tokens, *prompt(2, 12)], "b")
        assert length == 20
        assert (rest[0] is not None) == fits
        assert opt.fast_paths[ONE_PASS] == before + fits
        opt.check_invariants()


def test_delayed_caching_and_chunked_groups_take_their_own_paths() -> None:
    """``delay_cache_blocks`` caches nothing now (the counters stay at the hit); a layout with
    a chunked-local group is plain too (one block size): both admit in one pass and match the
    reference."""
    opt, general, ref = managers(100)
    tokens = prompt(1, 30)
    results = [
        admit(m, Request("a", tokens, hash_block_size=4), delay_cache_blocks=True)
        for m in (opt, general, ref)
    ]
    assert results[0] == results[1] == results[2]
    assert opt.snapshot() == ref.snapshot()
    assert opt.snapshot().num_cached_keys == 0
    chunked = KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(attention_chunk_size=8, **SIZES))
    opt, general, ref = managers(100, (FULL, chunked))
    system = prompt(1, 40)
    same_everywhere((opt, general, ref), [*system, *prompt(2, 5)], "a")
    same_everywhere((opt, general, ref), [*system, *prompt(3, 21)], "b")
    assert opt.fast_paths[ONE_PASS] == 2
    opt.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    ADMISSIONS,
    st.integers(30, 120),
)
def test_any_run_of_admissions_equals_the_group_by_group_path_and_the_reference(
    admissions: list[tuple[int, int, int, bool]], num_blocks: int
) -> None:
    """Prompts of one of four shared prefixes, cut anywhere, with tokens of their own, admitted
    and freed in any order into a small pool (so that hits come out of the free queue, taken
    blocks evict cached ones, and some requests do not fit): every result, table and pool
    equals the group-by-group admission's and the reference's."""
    opt, general, ref = managers(num_blocks)
    three: tuple[Manager, ...] = (opt, general, ref)
    live: list[list[Request]] = []
    for i, tokens, free_one in admission_prompts(admissions):
        same_everywhere(three, tokens, f"r{i}", live)
        if free_one and live:
            free_oldest(three, live)
        opt.check_invariants()
    assert general.fast_paths[ONE_PASS] == 0
