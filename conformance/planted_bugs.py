"""Planted bugs: wrong code under the right contract. CrossHair must report each one.

A checker that has never caught a planted bug proves nothing (CrossHair's own ``examples/``
tree keeps such a set). Each function here copies a rule of ``spec.rules`` or a harness of
``conformance.harnesses`` with its contract unchanged and one mistake in the body; the manifest
lists them with ``expect="counterexample"``, and the run fails if CrossHair stays silent.

Nothing imports these functions; they exist only to be checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.conformance.harnesses import full_window_chunk, hit_is_brute_force
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.spec import rules


def sliding_window_skipped_tokens_off_by_one(num_computed_tokens: int, sliding_window: int) -> int:
    """Bug: forgets the ``+ 1`` (keeps one token too many in the window).

    pre: 0 <= num_computed_tokens <= 10_000
    pre: 0 < sliding_window <= 1_000
    post: 0 <= __return__ <= num_computed_tokens
    post: num_computed_tokens - __return__ == min(num_computed_tokens, sliding_window - 1)
    """
    return max(0, num_computed_tokens - sliding_window)


def chunked_local_skipped_tokens_previous_chunk(
    num_computed_tokens: int, attention_chunk_size: int
) -> int:
    """Bug: keeps the previous chunk too.

    pre: 0 <= num_computed_tokens <= 10_000
    pre: 0 < attention_chunk_size <= 1_000
    post: __return__ % attention_chunk_size == 0
    post: 0 <= num_computed_tokens - __return__ < attention_chunk_size
    """
    return max(0, (num_computed_tokens // attention_chunk_size - 1) * attention_chunk_size)


def full_attention_hit_blocks_no_stop(cached: Sequence[bool], max_num_blocks: int) -> int:
    """Bug: counts every cached block instead of stopping at the first miss.

    pre: len(cached) <= 8
    pre: 0 <= max_num_blocks <= len(cached)
    post: 0 <= __return__ <= max_num_blocks
    post: all(cached[:__return__])
    post: __return__ == max_num_blocks or not cached[__return__]
    """
    return sum(1 for flag in cached[:max_num_blocks] if flag)


def sliding_window_hit_blocks_needed_whole_window(sliding_window: int, block_size: int) -> int:
    """Bug: asks for the whole window cached instead of the ``window − 1`` tokens before a hit.

    pre: 0 < sliding_window <= 1_000
    pre: 0 < block_size <= 64
    post: __return__ * block_size >= sliding_window - 1
    post: __return__ == 0 or (__return__ - 1) * block_size < sliding_window - 1
    """
    return rules.cdiv(sliding_window, block_size)


def chunked_local_hit_blocks_from_zero(
    cached: Sequence[bool], max_length: int, block_size: int, attention_chunk_size: int
) -> tuple[int, int]:
    """Bug: scans from block 0 instead of the current chunk's first block.

    pre: len(cached) <= 8
    pre: 0 < block_size <= 4
    pre: 0 < attention_chunk_size <= 16
    pre: 0 <= max_length <= len(cached) * block_size
    post: __return__[1] == max_length // attention_chunk_size * attention_chunk_size // block_size
    post: __return__[1] <= __return__[0] <= max_length // block_size
    post: all(cached[__return__[1]:__return__[0]])
    post: __return__[0] == max_length // block_size or not cached[__return__[0]]
    """
    num_hit = 0
    while num_hit < max_length // block_size and cached[num_hit]:
        num_hit += 1
    return num_hit, 0


def num_padding_slots_remainder(num_layers: int, layers_per_group: int) -> int:
    """Bug: the padding count is the remainder itself, not what completes the group.

    pre: 0 < num_layers <= 100
    pre: 0 < layers_per_group <= 100
    post: 0 <= __return__ < layers_per_group
    post: (num_layers + __return__) % layers_per_group == 0
    """
    return num_layers % layers_per_group


def sliding_window_hit_blocks_skip_too_far(cached: Sequence[bool], needed: int) -> tuple[int, int]:
    """Bug: on a miss at ``p`` the next candidate ends at ``p − 1``, skipping a valid one."""
    if needed == 0:
        return len(cached), len(cached)
    end = len(cached)
    while end >= needed:
        miss = end - 1
        while miss >= end - needed and cached[miss]:
            miss -= 1
        if miss < end - needed:
            return end, end - needed
        end = miss - 1
    run = 0
    while run < end and cached[run]:
        run += 1
    return run, 0


def sliding_window_scan_equivalence_skip_too_far(cached: list[bool], needed: int) -> bool:
    """The equivalence harness, run on a twin that skips one candidate too many.

    pre: len(cached) <= 8
    pre: 0 <= needed <= 8
    post: __return__
    """
    fast = sliding_window_hit_blocks_skip_too_far(cached, needed)
    return rules.sliding_window_hit_blocks(cached, needed) == fast


def hybrid_one_pass_is_longest_accepted(
    full: list[bool],
    window: list[bool],
    chunk: list[bool],
    block_size: int,
    sliding_window: int,
    attention_chunk_size: int,
    num_tokens: int,
) -> bool:
    """Bug: one pass over three types, no repeat, is not the fixed point.

    pre: block_size == 1
    pre: 2 <= sliding_window <= 3
    pre: 2 <= attention_chunk_size <= 3
    pre: 1 <= num_tokens <= 4
    pre: len(full) == len(window) == len(chunk) == num_tokens // block_size
    post: __return__
    """
    groups = full_window_chunk(full, window, chunk, sliding_window, attention_chunk_size)
    return hit_is_brute_force(groups, num_tokens, block_size, iterate=False)


class _TouchKeepsQueuedPool(BlockPool):
    """Bug: a cache hit on an evictable block leaves it in the free queue."""

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:  # type: ignore[override]
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1


def block_pool_touch_keeps_queued(ops: list[int]) -> bool:
    """The pool harness on a pool whose ``touch`` forgets to take the block out of the queue.

    pre: len(ops) <= 4
    pre: all(0 <= op < 4 for op in ops)
    post: __return__
    """
    pool = _TouchKeepsQueuedPool(3, enable_caching=True)
    held: list[KVCacheBlock] = []
    for op in ops:
        if op == 0 and pool.num_free_blocks:
            held.extend(pool.get_new_blocks(1))
        elif op == 1 and held:
            pool.free_blocks([held.pop()])
        elif op >= 2:
            block = pool.blocks[op - 1]
            if block.ref_cnt == 0:
                pool.touch([block])
                held.append(block)
        zero = {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        if {b.block_id for b in pool.free_block_queue} != zero:
            return False
    return True


# --- Engine rules ---------------------------------------------------------------------------


def mamba_prefill_checkpoint_position_forgets_logits_token(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool, num_hash_lookahead_tokens: int
) -> int:
    """Bug: the checkpoint may sit at the prefill's end (no token left for its logits).

    pre: 0 <= num_tokens <= 1000
    pre: 0 < hash_block_size <= 64
    pre: 0 <= num_hash_lookahead_tokens <= 4
    post: __return__ % hash_block_size == 0
    post: 0 <= __return__ < max(num_tokens, 1)
    """
    proof_limit = num_tokens if drop_eagle_block else num_tokens - num_hash_lookahead_tokens
    position = max(proof_limit, 0) // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def _scheduler_block_size_product(block_sizes: Sequence[int]) -> int:
    """Bug: the product of the block sizes, a common multiple but not the least."""
    product = 1
    for size in block_sizes:
        product *= size
    return product


def scheduler_block_size_is_lcm_as_product(a: int, b: int) -> bool:
    """The lcm harness on a scheduler block computed as a product.

    pre: 0 < a <= 64
    pre: 0 < b <= 64
    post: __return__
    """
    return _scheduler_block_size_product([a, b]) * math.gcd(a, b) == a * b


def _replay_boundaries_without_eagle_shift(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Bug: with the EAGLE drop the boundaries are not moved one block lower."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend, 0), max(extension, 0)}))


def replay_boundaries_without_eagle_shift(
    num_prompt_tokens: int, scheduler_block_size: int
) -> bool:
    """The dropped-block harness on replay boundaries that forget the EAGLE shift.

    pre: 0 <= num_prompt_tokens <= 1000
    pre: 0 < scheduler_block_size <= 64
    post: __return__
    """
    boundaries = _replay_boundaries_without_eagle_shift(
        num_prompt_tokens, scheduler_block_size, True
    )
    return all(b == 0 or b + scheduler_block_size <= num_prompt_tokens for b in boundaries)


def _mamba_retention_mask_without_boundaries(
    start_block: int, end_block: int, block_size: int, retention_interval: int
) -> tuple[bool, ...] | None:
    """Bug: sparse retention keeps the interval's states but drops the reachable boundaries
    (the replay boundary and the shared prefix)."""
    mask = [False] * (end_block - start_block)
    if retention_interval > 0:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        first_boundary = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first_boundary - start_block, len(mask), per_segment):
            mask[i] = True
    return tuple(mask)


def mamba_retention_drops_the_replay_boundary(
    start_block: int, end_block: int, block_size: int, retention_interval: int, boundary: int
) -> bool:
    """The reachable-states harness on a retention mask that ignores the boundaries.

    pre: 0 <= start_block <= end_block <= 12
    pre: 0 < block_size <= 8
    pre: 0 <= retention_interval <= 64 and retention_interval % block_size == 0
    pre: 0 <= boundary <= 100
    post: __return__
    """
    mask = _mamba_retention_mask_without_boundaries(
        start_block, end_block, block_size, retention_interval
    )
    position = boundary // block_size - 1
    return mask is None or not start_block <= position < end_block or mask[position - start_block]
