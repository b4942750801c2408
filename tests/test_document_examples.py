"""The design document's worked examples for the manager, each with its exact values.

The document numbers blocks from 0; here block 0 is the null block, so real blocks start at 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.single_type_managers import SlidingWindowManager
from hybridkv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
    rules,
)

HEADS = {"num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **HEADS)


def sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=window, **HEADS)


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    groups = tuple(KVCacheGroup((f"layer{i}",), spec) for i, spec in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def cache_positions(
    pool: BlockPool, request: Request, positions: Sequence[int], group_id: int
) -> None:
    """Put the request's blocks at ``positions`` (and no others) into the prefix cache."""
    num_full = len(request.block_hashes)
    blocks: list[KVCacheBlock] = [pool.null_block] * num_full
    for position, block in zip(positions, pool.get_new_blocks(len(positions)), strict=True):
        blocks[position] = block
    pool.cache_full_blocks(
        request,
        blocks,
        num_cached_blocks=0,
        num_full_blocks=num_full,
        block_size=request.hash_block_size,
        group_id=group_id,
    )
    pool.free_blocks([b for b in blocks if not b.is_null])


def test_case2_a_112_token_request_holds_11_blocks() -> None:
    """Allocation, Case 2: 10 full + 20 sliding layers in 3 groups, block 16, window 32: a
    request of length 112 needs blocks 0–6 for full attention and two blocks per sliding group.

    The first request computes 113 tokens; a second request with the same prompt adopts the
    112-token hit, which is exactly the state of a request of length 112.
    """
    m = KVCacheManager(config(100, full(16), sliding(16, 32), sliding(16, 32)), max_model_len=1024)
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
    hit, num_hit_tokens = m.get_computed_blocks(second)
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


def test_prefix_case0_full_attention_hits_the_first_7_tokens() -> None:
    """Prefix caching, Case 0 (block size 1): tokens 0–6 are cached, token 7 is not, so the
    longest hit is 7 tokens even though later blocks may be cached too."""
    m = KVCacheManager(config(40, full(1)), max_model_len=64)
    cached = Request("cached", [10, 11, 12, 13, 14, 15, 16, 99, 18, 19, 20], hash_block_size=1)
    assert m.allocate_slots(cached, 11) is not None
    m.free(cached)

    new = Request("new", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], hash_block_size=1)
    hit, num_hit_tokens = m.get_computed_blocks(new)
    assert num_hit_tokens == 7
    assert hit.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7],)


def sliding_window_example() -> tuple[BlockPool, SlidingWindowManager, Request]:
    """Prefix caching, Case 1: window 4, block size 1, a 15-token prompt whose blocks 2–5
    and 11–13 are cached."""
    pool = BlockPool(32, enable_caching=True)
    manager = SlidingWindowManager(sliding(1, 4), pool, group_id=0)
    request = Request("r", list(range(100, 115)), hash_block_size=1)
    cache_positions(pool, request, [2, 3, 4, 5, 11, 12, 13], group_id=0)
    return pool, manager, request


def test_prefix_case1_sliding_window_has_three_valid_hits() -> None:
    """The three hits the document lists — 5, 6 and 14 tokens — and no others (0 is trivial)."""
    pool, _, request = sliding_window_example()
    cached = [pool.get_cached_block(h, [0]) is not None for h in request.block_hashes]
    needed = rules.sliding_window_hit_blocks_needed(4, 1)
    valid = [j for j in range(1, 15) if rules.window_hit_is_valid(cached, needed, j)]
    assert needed == 3
    assert valid == [5, 6, 14]


def test_prefix_case1_sliding_window_picks_the_longest_hit_14() -> None:
    """Scanning right to left stops at the first valid hit: 14, computing only token 14."""
    _, manager, request = sliding_window_example()
    (hit,) = manager.find_longest_cache_hit(request.block_hashes, 14, [0])
    assert len(hit) == 14
    assert [block.is_null for block in hit] == [True] * 11 + [False] * 3


def test_prefix_case2_full_and_sliding_hits_are_intersected() -> None:
    """Prefix caching, Case 2: full attention hits 10 tokens; the sliding window (4) then
    searches within those 10 and finds 6 ([3, 4, 5]); the full-attention hit is cut to 6."""
    m = KVCacheManager(config(64, full(1), sliding(1, 4)), max_model_len=64)
    request = Request("r", list(range(100, 115)), hash_block_size=1)
    cache_positions(m.block_pool, request, list(range(10)), group_id=0)
    cache_positions(m.block_pool, request, [2, 3, 4, 5, 11, 12, 13], group_id=1)

    hit, num_hit_tokens = m.get_computed_blocks(request)
    assert num_hit_tokens == 6
    full_ids, sliding_ids = hit.get_block_ids()
    assert full_ids == [1, 2, 3, 4, 5, 6]
    assert sliding_ids[:3] == [0, 0, 0]
    assert all(sliding_ids[3:])
