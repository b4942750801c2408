"""The memo's run (``hybridkv.optimized.memo_hit``): a hit read from the record of the cached
request whose hashes a prompt adopted, pinned to the reference's hits and to the general
lookup's (``Tuning(memo_hits=False)``), with when it answers and when it gives way."""

from __future__ import annotations

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
from hybridkv.reference.block_hash import hash_full_blocks
from hybridkv.reference.request import Request
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
)

MEMO_RUN = path_counts.LOOKUP_MEMO_RUN

Ids = tuple[tuple[int, ...], ...]


def managers(
    num_blocks: int, groups: tuple[KVCacheGroup, ...] = (FULL, *WINDOWS)
) -> tuple[TorchKVCacheManager, TorchKVCacheManager, KVCacheManager]:
    """The optimized manager with the memo's run, without it, and the reference."""
    return managers_beside(num_blocks, Tuning(memo_hits=False), groups)


def admit(manager: TorchKVCacheManager | KVCacheManager, rid: str, tokens: list[int]) -> Ids:
    """Look the prompt up and admit it whole (a request built without a hasher: the optimized
    manager offers its memo); the hit's ids, its length apart."""
    request = Request(rid, tokens, hash_block_size=4)
    hit, length, _ = manager.get_computed_blocks(request)
    found = tuple(tuple(group) for group in hit.get_block_ids())
    assert manager.allocate_slots(request, len(tokens) - length, length, hit) is not None
    return (*found, (length,))


def test_an_admission_sharing_a_cached_system_prompt_reads_its_hit_from_the_memos_run() -> None:
    """The design's common admission: a 160-token system prompt cached with one request's own
    tokens, then a request of the same system prompt and tokens of its own. Its hashes of the
    40 shared blocks are the first request's (the memo adopted them), so the hit is those 40
    blocks of full attention and each window's last two, read from that request's record."""
    opt, general, ref = managers(400)
    system = prompt(1, 160)
    for manager in (opt, general, ref):
        admit(manager, "a", [*system, *prompt(2, 41)])
    before = opt.fast_paths[MEMO_RUN]
    got = admit(opt, "b", [*system, *prompt(3, 41)])
    assert opt.fast_paths[MEMO_RUN] == before + 1
    assert got == admit(ref, "b", [*system, *prompt(3, 41)])
    assert got == admit(general, "b", [*system, *prompt(3, 41)])
    assert got[-1] == (160,)
    first = opt.get_block_ids("a")
    assert got[0] == tuple(first[0][:40])  # the first request's blocks, in order
    for g in (1, 2):  # each window: nulls, then the first request's blocks 38 and 39
        assert got[g] == (0,) * 38 + tuple(first[g][38:40])
    assert general.fast_paths[MEMO_RUN] == 0
    opt.check_invariants()


def test_window_groups_apart_read_their_hit_from_the_memos_run_too() -> None:
    """Window groups that are not consecutive (a window, full attention, a window) index the
    record's columns by their ids (a gather) where consecutive ones take a slice (a view):
    the same hit as the reference's, each window's last two blocks after its nulls."""
    groups = (WINDOWS[0], FULL, WINDOWS[1])
    opt, general, ref = managers(400, groups)
    assert opt.state.layout.memo_run == ((1,), (((0, 2), 2, (0, 2)),))
    system = prompt(1, 160)
    for manager in (opt, general, ref):
        admit(manager, "a", [*system, *prompt(2, 41)])
    got = admit(opt, "b", [*system, *prompt(3, 41)])
    assert opt.fast_paths[MEMO_RUN] == 1
    assert got == admit(ref, "b", [*system, *prompt(3, 41)])
    assert got == admit(general, "b", [*system, *prompt(3, 41)])
    first = opt.get_block_ids("a")
    for g in (0, 2):
        assert got[g] == (0,) * 38 + tuple(first[g][38:40])
    opt.check_invariants()


def test_the_run_gives_way_where_another_request_cached_the_next_block() -> None:
    """Request ``b`` shares 40 blocks with ``a`` and 10 more with ``c``: the memo adopts ``a``'s
    hashes for the 40, then ``c``'s; ``a``'s record ends at 40 while the table holds ``c``'s
    block 40, so the general lookup answers, with the reference's 50-block hit."""
    opt, general, ref = managers(600)
    system, more = prompt(1, 160), prompt(4, 40)
    for manager in (opt, general, ref):
        admit(manager, "a", [*system, *prompt(2, 41)])
        admit(manager, "c", [*system, *more, *prompt(5, 9)])
    before = opt.fast_paths[MEMO_RUN]
    tokens = [*system, *more, *prompt(6, 21)]
    got = admit(opt, "b", tokens)
    assert opt.fast_paths[MEMO_RUN] == before
    assert got == admit(ref, "b", tokens) == admit(general, "b", tokens)
    assert got[-1] == (200,)


def test_the_run_gives_way_where_its_blocks_are_newer_twins_of_another_requests() -> None:
    """``c`` (hashed by ``hash_full_blocks``, named: the memo never holds it) and ``a`` compute
    one system prompt in the same step, neither hitting the other; ``c``'s blocks are cached
    first. The memo's branch is ``a``'s, whose blocks are newer twins of ``c``'s, so a later
    request of that prompt must hit ``c``'s blocks (the first inserted, as vLLM's pool
    returns): the general lookup answers."""
    opt, general, ref = managers(600)
    system = prompt(1, 160)
    three: tuple[TorchKVCacheManager | KVCacheManager, ...] = (opt, general, ref)
    for manager in three:
        c = Request(
            "c", [*system, *prompt(2, 41)], hash_block_size=4, block_hasher=hash_full_blocks
        )
        a = Request("a", [*system, *prompt(3, 41)], hash_block_size=4)
        for r in (c, a):
            assert manager.get_computed_blocks(r)[1] == 0
            assert manager.allocate_slots(r, r.num_tokens, delay_cache_blocks=True) is not None
        for r in (c, a):
            manager.cache_blocks(r, r.num_tokens)
    before = opt.fast_paths[MEMO_RUN]
    tokens = [*system, *prompt(4, 41)]
    got = admit(opt, "b", tokens)
    assert opt.fast_paths[MEMO_RUN] == before
    assert got == admit(ref, "b", tokens) == admit(general, "b", tokens)
    assert got[0] == tuple(opt.get_block_ids("c")[0][:40])


def test_the_run_settles_no_twins_when_none_of_its_sources_entries_waits() -> None:
    """Twins are marked (``settle_duplicates``) before a lookup trusts a run of blocks; the
    memo's run reads only its source's blocks, so it settles only where an entry of that
    source waits (``settle_for``). After ``a`` and then ``b`` are admitted, some of ``b``'s new
    entries wait behind others on their chains; ``c``'s run reads ``a``'s blocks, settled
    since, and leaves ``b``'s waiting: the hit is still the reference's and the general
    lookup's, and the invariants (which settle them) hold."""
    opt, general, ref = managers(600)
    pool = opt.pool
    system = prompt(1, 160)
    for rid, own in (("a", 2), ("b", 3)):
        for manager in (opt, general, ref):
            admit(manager, rid, [*system, *prompt(own, 41)])
    waiting = (list(pool.unsettled), [blocks.tolist() for blocks in pool.unsettled_many])
    assert waiting != ([], [])  # (these prompts leave some of b's entries behind others)
    settles, before = pool.settles, opt.fast_paths[MEMO_RUN]
    tokens = [*system, *prompt(4, 41)]
    got = admit(opt, "c", tokens)
    assert opt.fast_paths[MEMO_RUN] == before + 1
    assert pool.settles == settles  # nothing settled: b's entries still wait
    kept = [blocks.tolist() for blocks in pool.unsettled_many[: len(waiting[1])]]
    assert (pool.unsettled[: len(waiting[0])], kept) == waiting
    assert got == admit(ref, "c", tokens) == admit(general, "c", tokens)
    opt.check_invariants()
    assert pool.settles == settles + 1
    assert not pool.unsettled_many


def test_a_layout_with_a_chunked_group_takes_the_general_lookup() -> None:
    """Only full attention and sliding windows read the memo's run: a chunked-local group's
    hit is not its prefix (``GroupLayout.memo_run`` is ``None``)."""
    chunked = KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(attention_chunk_size=8, **SIZES))
    opt, _, ref = managers(400, (FULL, chunked))
    assert opt.state.layout.memo_run is None
    system = prompt(1, 160)
    for manager in (opt, ref):
        admit(manager, "a", [*system, *prompt(2, 41)])
    assert admit(opt, "b", [*system, *prompt(3, 9)]) == admit(ref, "b", [*system, *prompt(3, 9)])
    assert opt.fast_paths[MEMO_RUN] == 0


def test_a_layout_with_two_full_attention_types_takes_the_general_lookup() -> None:
    """Two full-attention types (other head sizes) may each find a run of another length,
    the longer one being the shared-prefix boundary: the general lookup reports it."""
    wide = KVCacheGroup(("wide",), FullAttentionSpec(**{**SIZES, "head_size": 2}))
    opt, _, ref = managers(400, (FULL, wide, *WINDOWS))
    assert opt.state.layout.memo_run is None
    assert managers(400)[0].state.layout.memo_run == ((0,), (((1, 2), 2, slice(1, 3)),))
    system = prompt(1, 160)
    for manager in (opt, ref):
        admit(manager, "a", [*system, *prompt(2, 41)])
    tokens = [*system, *prompt(3, 9)]
    got = opt.get_computed_blocks(Request("b", tokens, hash_block_size=4))
    want = ref.get_computed_blocks(Request("b", tokens, hash_block_size=4))
    assert (got[0].get_block_ids(), *got[1:]) == (want[0].get_block_ids(), *want[1:])
    assert got[1] == 160
    assert opt.fast_paths[MEMO_RUN] == 0


@settings(max_examples=40, deadline=None)
@given(
    ADMISSIONS,
    st.integers(60, 140),
)
def test_any_run_of_admissions_hits_as_the_general_lookup_and_the_reference(
    admissions: list[tuple[int, int, int, bool]], num_blocks: int
) -> None:
    """Prompts of one of four shared prefixes, cut anywhere, with tokens of their own, admitted
    and freed in any order into a small pool (so that blocks of a run are evicted and cached
    again by others): every hit equals the general lookup's and the reference's, the state
    stays sound, and a request that does not fit fails alike in all three."""
    opt, general, ref = managers(num_blocks)
    three: tuple[TorchKVCacheManager | KVCacheManager, ...] = (opt, general, ref)
    live: list[list[Request]] = []
    for i, tokens, free_one in admission_prompts(admissions):
        requests = [Request(f"r{i}", tokens, hash_block_size=4) for _ in range(3)]
        results = []
        for manager, request in zip(three, requests, strict=True):
            hit, length, _ = manager.get_computed_blocks(request)
            out = manager.allocate_slots(request, len(tokens) - length, length, hit)
            ids = tuple(tuple(group) for group in hit.get_block_ids())
            results.append((ids, length, out is None))
        assert results[0] == results[1] == results[2]
        if not results[0][2]:
            live.append(requests)
        if free_one and live:
            free_oldest(three, live)
        opt.check_invariants()
