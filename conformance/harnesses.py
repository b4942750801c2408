"""CrossHair harnesses: contracts whose precondition is a bounded domain and whose postcondition
is a property of whole algorithms, checked by name from the manifest.

* Equivalence: ``post: __return__`` where the harness returns ``reference(...) == fast(...)``
  (``crosshair diffbehavior`` ignores preconditions, so it cannot check a twin on its domain).
* Oracles: the hybrid fixed point equals the brute-force longest hit on small cache states.
* State: a short list of small-int operations applied to a fresh ``BlockPool``, whose own
  invariant check runs after each (CrossHair explores a class only in states its constructor
  builds, so the harness builds the states).

Every function here is pure and bounded; CrossHair searches all paths up to its budget. A
confirmed harness is a bounded search, not a proof for unbounded inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.conformance.oracle_longest_hit import (
    GroupCacheState,
    brute_force_hit_blocks,
    hybrid_hit_tokens,
)
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.spec import rules


def sliding_window_scan_equivalence(cached: list[bool], needed: int) -> bool:
    """The skip-ahead scan returns exactly the reference scan's hit.

    pre: len(cached) <= 8
    pre: 0 <= needed <= 8
    post: __return__
    """
    fast = rules.sliding_window_hit_blocks_skip(cached, needed)
    return rules.sliding_window_hit_blocks(cached, needed) == fast


def full_window_chunk(
    full: list[bool],
    window: list[bool],
    chunk: list[bool],
    sliding_window: int,
    attention_chunk_size: int,
) -> list[GroupCacheState]:
    """Three groups, one of each attention type that caches, with these cached-block flags."""
    return [
        GroupCacheState("full", 0, tuple(full)),
        GroupCacheState("sliding_window", sliding_window, tuple(window)),
        GroupCacheState("chunked_local", attention_chunk_size, tuple(chunk)),
    ]


def hit_is_brute_force(
    groups: Sequence[GroupCacheState], num_tokens: int, block_size: int, iterate: bool = True
) -> bool:
    """The coordinator's hit (its fixed point, or one pass) is the brute-force longest hit."""
    hit = hybrid_hit_tokens(groups, num_tokens, block_size, iterate=iterate)
    return hit == block_size * brute_force_hit_blocks(groups, num_tokens, block_size)


def hybrid_hit_is_longest_accepted(
    full: list[bool],
    window: list[bool],
    chunk: list[bool],
    block_size: int,
    sliding_window: int,
    attention_chunk_size: int,
    num_tokens: int,
) -> bool:
    """Full + sliding window + chunked local: the fixed point is the longest accepted hit.

    pre: 1 <= block_size <= 2
    pre: 2 <= sliding_window <= 5
    pre: 1 <= attention_chunk_size <= 5
    pre: 1 <= num_tokens <= 6
    pre: len(full) == len(window) == len(chunk) == num_tokens // block_size
    post: __return__
    """
    groups = full_window_chunk(full, window, chunk, sliding_window, attention_chunk_size)
    return hit_is_brute_force(groups, num_tokens, block_size)


def hybrid_hit_without_full_attention(
    window_a: list[bool],
    window_b: list[bool],
    chunk: list[bool],
    block_size: int,
    window_size_a: int,
    window_size_b: int,
    attention_chunk_size: int,
    num_tokens: int,
) -> bool:
    """Two sliding windows + chunked local, no full attention: still the longest accepted hit.

    pre: 1 <= block_size <= 2
    pre: 2 <= window_size_a <= 5
    pre: 2 <= window_size_b <= 5
    pre: 1 <= attention_chunk_size <= 5
    pre: 1 <= num_tokens <= 6
    pre: len(window_a) == len(window_b) == len(chunk) == num_tokens // block_size
    post: __return__
    """
    groups = [
        GroupCacheState("sliding_window", window_size_a, tuple(window_a)),
        GroupCacheState("sliding_window", window_size_b, tuple(window_b)),
        GroupCacheState("chunked_local", attention_chunk_size, tuple(chunk)),
    ]
    return hit_is_brute_force(groups, num_tokens, block_size)


@dataclass(frozen=True)
class _HashedBlocks:
    """The two fields of a request that ``BlockPool.cache_full_blocks`` reads (the others
    at their defaults)."""

    block_hashes: Sequence[BlockHash]
    request_id: str = "harness"
    num_tokens: int = 1
    num_computed_tokens: int = 0
    all_token_ids: Sequence[int] = (0,)
    # The engine attributes of a ``RequestLike``, at their defaults.
    num_prompt_tokens: int = 1
    num_in_flight_tokens: int = 0
    shared_prefix_boundary: int = 0
    skip_reading_prefix_cache: bool = False
    cache_salt: str | None = None
    session_id: str | None = None
    num_preemptions: int = 0


def block_pool_operations_keep_invariants(ops: list[int]) -> bool:
    """Allocate, cache, hit and release on a 5-block pool; its invariants hold after each step.

    Each op is ``kind * 8 + arg``: take ``arg % 3 + 1`` new blocks; release the ``arg``-th
    held block; cache the ``arg``-th held block under hash ``arg % 2``; touch (hit) the first
    cached block of hash ``arg % 2``. Held blocks are released to the queue's head or tail as
    they hold a hash or not.

    pre: len(ops) <= 4
    pre: all(0 <= op < 32 for op in ops)
    post: __return__
    """
    pool = BlockPool(5, enable_caching=True)
    held: list[KVCacheBlock] = []
    for op in ops:
        kind, arg = divmod(op, 8)
        if kind == 0:
            n = arg % 3 + 1
            if n <= pool.num_free_blocks:
                held.extend(pool.get_new_blocks(n))
        elif kind == 1 and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif kind == 2 and held:
            block = held[arg % len(held)]
            if block.block_hash is None:
                request = _HashedBlocks((BlockHash(bytes([arg % 2])),))
                pool.cache_full_blocks(
                    request,
                    [block],
                    num_cached_blocks=0,
                    num_full_blocks=1,
                    block_size=1,
                    group_id=0,
                )
        elif kind == 3:
            found = pool.get_cached_block(BlockHash(bytes([arg % 2])), [0])
            if found is not None:
                pool.touch(found)
                held.extend(found)
        pool.check_invariants()
        if pool.num_free_blocks + len({b.block_id for b in held}) != 4:
            return False
        if any(b.ref_cnt != sum(1 for h in held if h is b) for b in pool.blocks[1:]):
            return False
    return True


# --- Engine rules: lcm alignment, replay boundaries, Mamba retention ------------------------


def scheduler_block_size_is_lcm(a: int, b: int) -> bool:
    """The scheduler block of two block sizes is their least common multiple (not merely a
    common multiple): ``lcm · gcd = a · b``.

    pre: 0 < a <= 64
    pre: 0 < b <= 64
    post: __return__
    """
    return rules.scheduler_block_size([a, b]) * math.gcd(a, b) == a * b


def replay_boundaries_leave_the_dropped_block(
    num_prompt_tokens: int, scheduler_block_size: int
) -> bool:
    """With the EAGLE drop, a replay resumes one scheduler block below what the prompt covers:
    every boundary leaves at least one whole block before the prompt's end (or is 0).

    pre: 0 <= num_prompt_tokens <= 1000
    pre: 0 < scheduler_block_size <= 64
    post: __return__
    """
    boundaries = rules.replay_boundaries(num_prompt_tokens, scheduler_block_size, True)
    return all(b == 0 or b + scheduler_block_size <= num_prompt_tokens for b in boundaries)


def mamba_retention_keeps_reachable_states(
    start_block: int, end_block: int, block_size: int, retention_interval: int, boundary: int
) -> bool:
    """Sparse Mamba retention keeps the state at a reachable boundary (a replay, a shared
    prefix) whenever that state is among the positions being cached.

    pre: 0 <= start_block <= end_block <= 12
    pre: 0 < block_size <= 8
    pre: 0 <= retention_interval <= 64 and retention_interval % block_size == 0
    pre: 0 <= boundary <= 100
    post: __return__
    """
    mask = rules.mamba_retention_mask(
        start_block,
        end_block,
        alignment_tokens=block_size,
        block_size=block_size,
        retention_interval=retention_interval,
        reachable_boundaries=(boundary,),
    )
    position = boundary // block_size - 1
    return mask is None or not start_block <= position < end_block or mask[position - start_block]
