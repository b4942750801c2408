"""The design document's worked examples for the manager, each with its exact values, on both
backends; every cache state is built through the scheduler API.

The document numbers blocks from 0; here block 0 is the null block, so real blocks start at 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridkv.reference import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    Request,
)
from hybridkv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
    rules,
)

if TYPE_CHECKING:
    from conftest import BackendManager, ManagerFactory

HEADS = {"num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **HEADS)


def sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=window, **HEADS)


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    groups = tuple(KVCacheGroup((f"layer{i}",), spec) for i, spec in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


PROMPT = list(range(100, 115))
"""The 15-token prompt of Prefix caching, Cases 1 and 2 (block size 1: one token a block)."""


def cached_positions(events: Sequence[KVCacheEvent], request: Request, group_id: int) -> list[int]:
    """The positions of ``request`` whose block hash group ``group_id`` holds in the prefix
    cache, replayed from the manager's KV cache events (blocks stored minus blocks removed)."""
    held: Counter[BlockHash] = Counter()
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored) and event.group_idx == group_id:
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.group_idx == group_id:
            held.subtract(event.block_hashes)
    return [i for i, block_hash in enumerate(request.block_hashes) if held[block_hash] > 0]


def cache_window_example(m: BackendManager) -> Request:
    """Cache the sliding window's positions 2–5 and 11–13 of ``PROMPT`` (window 4, block
    size 1), through the scheduler API only; full-attention groups cache positions 0–13.

    A window releases the blocks of the tokens it no longer needs (at 5 computed tokens,
    positions 0–1; at 14, positions 0–10) at the request's next ``allocate_slots``, and only
    blocks still held get cached, so computing without caching (``delay_cache_blocks``) and
    caching after a release leaves the released positions uncached:

    1. ``f`` (the first 6 tokens) gets slots for positions 0–5 and caches nothing; its next
       step, at 5 computed tokens, releases positions 0–1 and then caches positions 0–5.
    2. ``g`` (the whole prompt) adopts that 6-token hit, computes positions 6–13 without
       caching, releases positions 3–10 at 14 computed tokens, then caches positions 6–13.

    ``g`` is freed; ``f`` is returned still running (holding positions 0–5, the window 2–5).
    """
    f = Request("f", PROMPT[:6], hash_block_size=1)
    assert m.allocate_slots(f, 5, num_lookahead_tokens=1, delay_cache_blocks=True) is not None
    f.num_computed_tokens = 5
    assert m.allocate_slots(f, 1) is not None
    f.num_computed_tokens = 6

    g = Request("g", PROMPT, hash_block_size=1)
    hit, num_hit_tokens, _ = m.get_computed_blocks(g)
    assert num_hit_tokens == 6
    assert m.allocate_slots(g, 8, num_hit_tokens, hit, delay_cache_blocks=True) is not None
    g.num_computed_tokens = 14
    assert m.allocate_slots(g, 1, delay_cache_blocks=True) is not None
    g.num_computed_tokens = 15
    m.cache_blocks(g, 14)
    m.free(g)
    return f


def test_case2_a_112_token_request_holds_11_blocks(make_manager: ManagerFactory) -> None:
    """Allocation, Case 2: 10 full + 20 sliding layers in 3 groups, block 16, window 32: a
    request of length 112 needs blocks 0–6 for full attention and two blocks per sliding group.

    The first request computes 113 tokens; a second request with the same prompt adopts the
    112-token hit, which is exactly the state of a request of length 112.
    """
    m = make_manager(config(100, full(16), sliding(16, 32), sliding(16, 32)), max_model_len=1024)
    prompt = list(range(1000, 1113))
    first = Request("first", prompt, hash_block_size=16)
    assert m.allocate_slots(first, 113) is not None
    assert m.get_block_ids("first") == (
        [1, 2, 3, 4, 5, 6, 7, 8],
        [9, 10, 11, 12, 13, 14, 15, 16],
        [17, 18, 19, 20, 21, 22, 23, 24],
    )
    m.free(first)

    second = Request("second", prompt, hash_block_size=16)
    hit, num_hit_tokens, _ = m.get_computed_blocks(second)
    assert num_hit_tokens == 112
    assert m.allocate_slots(second, 0, num_hit_tokens, hit) is not None
    table = m.get_block_ids("second")
    assert table == (
        [1, 2, 3, 4, 5, 6, 7],
        [0, 0, 0, 0, 0, 14, 15],
        [0, 0, 0, 0, 0, 22, 23],
    )
    assert sum(1 for group in table for block_id in group if block_id) == 11


def test_case2_block_counts_follow_the_rules() -> None:
    """The same 11 blocks from the per-type rules: 7 positions, 5 of them skipped per window."""
    positions = rules.attention_blocks_for_tokens(112, 16)
    skipped = rules.skipped_block_positions(rules.sliding_window_skipped_tokens(112, 32), 16)
    assert (positions, skipped) == (7, 5)
    assert positions + 2 * (positions - skipped) == 11


def test_prefix_case0_full_attention_hits_the_first_7_tokens(
    make_manager: ManagerFactory,
) -> None:
    """Prefix caching, Case 0 (block size 1): tokens 0–6 are cached, token 7 is not, so the
    longest hit is 7 tokens even though later blocks may be cached too."""
    m = make_manager(config(40, full(1)), max_model_len=64)
    cached = Request("cached", [10, 11, 12, 13, 14, 15, 16, 99, 18, 19, 20], hash_block_size=1)
    assert m.allocate_slots(cached, 11) is not None
    m.free(cached)

    new = Request("new", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], hash_block_size=1)
    hit, num_hit_tokens, _ = m.get_computed_blocks(new)
    assert num_hit_tokens == 7
    assert hit.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7],)


def sliding_window_example(make_manager: ManagerFactory) -> tuple[BackendManager, list[bool]]:
    """Prefix caching, Case 1: window 4, block size 1, a 15-token prompt whose blocks 2–5
    and 11–13 are cached (and no others). Returns the manager and, per position, whether the
    prompt's block there is cached."""
    m = make_manager(config(32, sliding(1, 4)), max_model_len=64, enable_kv_cache_events=True)
    m.free(cache_window_example(m))
    request = Request("r", PROMPT, hash_block_size=1)
    positions = cached_positions(m.take_events(), request, group_id=0)
    assert positions == [2, 3, 4, 5, 11, 12, 13]
    assert m.snapshot().num_cached_keys == 7
    return m, [i in positions for i in range(len(request.block_hashes))]


def test_prefix_case1_sliding_window_has_three_valid_hits(make_manager: ManagerFactory) -> None:
    """The three hits the document lists — 5, 6 and 14 tokens — and no others (0 is trivial)."""
    _, cached = sliding_window_example(make_manager)
    needed = rules.sliding_window_hit_blocks_needed(4, 1)
    valid = [j for j in range(1, 15) if rules.window_hit_is_valid(cached, needed, j)]
    assert needed == 3
    assert valid == [5, 6, 14]


def test_prefix_case1_sliding_window_picks_the_longest_hit_14(
    make_manager: ManagerFactory,
) -> None:
    """Scanning right to left stops at the first valid hit: 14, computing only token 14."""
    m, _ = sliding_window_example(make_manager)
    hit, num_hit_tokens, _ = m.get_computed_blocks(Request("r", PROMPT, hash_block_size=1))
    (hit_ids,) = hit.get_block_ids()
    assert num_hit_tokens == 14
    assert len(hit_ids) == 14
    assert [block_id == 0 for block_id in hit_ids] == [True] * 11 + [False] * 3


def test_prefix_case1_adopting_the_hit_holds_the_three_blocks_past_the_nulls(
    make_manager: ManagerFactory,
) -> None:
    """Admission adopts the 14-token hit: its 11 null positions hold nothing, its three blocks
    (tokens 11–13) gain a holder and leave the free queue; freeing returns them to it."""
    m, _ = sliding_window_example(make_manager)
    request = Request("r", PROMPT, hash_block_size=1)
    hit, num_hit_tokens, _ = m.get_computed_blocks(request)
    (hit_ids,) = hit.get_block_ids()
    held = hit_ids[11:]
    free_before = m.num_free_blocks
    assert m.allocate_slots(request, len(PROMPT) - 14, num_hit_tokens, hit) is not None
    m.check_invariants()
    assert m.get_block_ids("r")[0][11:14] == held
    assert not set(held) & set(m.snapshot().free_block_ids)
    assert m.num_free_blocks == free_before - len(held) - (len(PROMPT) - 14)
    m.free(request)
    m.check_invariants()
    assert m.num_free_blocks == free_before
    assert set(held) <= set(m.snapshot().free_block_ids)


def test_prefix_case2_full_and_sliding_hits_are_intersected(make_manager: ManagerFactory) -> None:
    """Prefix caching, Case 2: full attention hits 10 tokens; the sliding window (4) then
    searches within those 10 and finds 6 ([3, 4, 5]); the full-attention hit is cut to 6.

    The cache state: full attention holds positions 0–9, the window 2–5 and 11–13. After
    ``cache_window_example`` full attention also holds 10–13, at the free queue's tail
    before 6–9 and the window's 11–13 (``g`` released its tables last position first, groups
    in order) and ``f`` holds 0–5 (window 2–5); ``e`` takes every free block but those last 7
    (one block per group a token, caching nothing), evicting full attention's 10–13.
    """
    m = make_manager(
        config(64, full(1), sliding(1, 4)), max_model_len=64, enable_kv_cache_events=True
    )
    f = cache_window_example(m)
    e = Request("e", [999], hash_block_size=1)
    num_slots = (m.num_free_blocks - 7) // 2
    new = m.allocate_slots(e, 1, num_lookahead_tokens=num_slots - 1, delay_cache_blocks=True)
    assert new is not None
    m.free(e)
    m.free(f)
    request = Request("r", PROMPT, hash_block_size=1)
    events = m.take_events()
    assert cached_positions(events, request, group_id=0) == list(range(10))
    assert cached_positions(events, request, group_id=1) == [2, 3, 4, 5, 11, 12, 13]
    assert m.snapshot().num_cached_keys == 17

    hit, num_hit_tokens, _ = m.get_computed_blocks(request)
    assert num_hit_tokens == 6
    full_ids, sliding_ids = hit.get_block_ids()
    assert full_ids == [1, 2, 3, 4, 5, 6]
    assert sliding_ids[:3] == [0, 0, 0]
    assert all(sliding_ids[3:])
