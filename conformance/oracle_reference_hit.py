"""The longest-hit oracle on the real reference manager: exactly a drawn cache state built
inside a reference ``KVCacheManager``'s block pool, looked up, and compared with brute force
(``oracle_longest_hit``): the hit's length and every group's blocks. ``run_hit_oracle`` runs it
on random states for the report (``OracleStats``, which the planner oracle also counts into).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.conformance.oracle_longest_hit import (
    GroupCacheState,
    brute_force_hit_blocks,
    first_needed_block,
    random_cache_state,
)
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)


@dataclass(frozen=True)
class ManagerHit:
    """What the reference manager returned for a built cache state, and what brute force says."""

    hit_tokens: int
    brute_force_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    expected_block_ids: tuple[tuple[int, ...], ...]


def spec_of(state: GroupCacheState, block_size: int) -> KVCacheSpec:
    """The layer spec of a cache-state group (1 KV head × size 1 × 4 bytes: sizes do not matter)."""
    sizes = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    if state.kind == "sliding_window":
        return SlidingWindowSpec(sliding_window=state.param, **sizes)
    if state.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(attention_chunk_size=state.param, **sizes)
    return FullAttentionSpec(**sizes)


def reference_hit(
    groups: Sequence[GroupCacheState],
    prompt: Sequence[int],
    block_size: int,
    manager_class: Any = None,
) -> ManagerHit:
    """Build exactly this cache state in a reference ``KVCacheManager`` and look ``prompt`` up.

    Group ``g`` caches the request's block ``i`` iff ``groups[g].cached[i]`` (each cached block
    is its own pool block, released so that it sits evictable in the free queue, as after a
    finished request). ``manager_class`` defaults to the reference's ``KVCacheManager``; a
    variant with the same block pool (a mutant) may be given. The expected blocks per group are
    those of a lookup at the brute-force length: null positions before the rule's first needed
    block, then the cached blocks.
    """
    from hybridkv.reference import KVCacheManager, Request

    manager_class = KVCacheManager if manager_class is None else manager_class
    num_full = len(prompt) // block_size
    config = KVCacheConfig(
        num_blocks=1 + len(groups) * num_full + 1,
        groups=tuple(
            KVCacheGroup((f"layer{gid}",), spec_of(g, block_size)) for gid, g in enumerate(groups)
        ),
    )
    manager = manager_class(config, max(len(prompt), 1), enable_caching=True)
    request = Request("probe", prompt, hash_block_size=block_size)
    pool = manager.block_pool
    position_block: list[dict[int, int]] = []
    for gid, group in enumerate(groups):
        assert len(group.cached) == num_full
        table = [pool.get_new_blocks(1)[0] if flag else pool.null_block for flag in group.cached]
        pool.cache_full_blocks(
            request,
            table,
            num_cached_blocks=0,
            num_full_blocks=num_full,
            block_size=block_size,
            group_id=gid,
        )
        position_block.append({i: b.block_id for i, b in enumerate(table) if not b.is_null})
        pool.free_blocks(table[::-1])
    blocks, hit_tokens, _ = manager.get_computed_blocks(request)
    best = brute_force_hit_blocks(groups, len(prompt), block_size)
    expected = []
    for gid, group in enumerate(groups):
        first = first_needed_block(group, best, block_size)
        expected.append((0,) * first + tuple(position_block[gid][i] for i in range(first, best)))
    return ManagerHit(
        hit_tokens,
        best * block_size,
        tuple(tuple(ids) for ids in blocks.get_block_ids()),
        tuple(expected),
    )


@dataclass
class OracleStats:
    """What the oracle runs checked."""

    hit_states: int = 0
    hit_states_three_types: int = 0
    hit_states_without_full: int = 0
    nonaligned_states: int = 0
    nonaligned_longer: int = 0
    planner_models: int = 0
    failures: list[str] | None = None

    def lines(self) -> list[str]:
        return [
            f"  longest hit: {self.hit_states} cache states equal to brute force "
            f"({self.hit_states_three_types} with ≥ 3 types, {self.hit_states_without_full} "
            "without full attention)",
            f"  chunk sizes not a multiple of the block size: {self.nonaligned_states} states, "
            f"{self.nonaligned_longer} hits longer than every group accepts (vLLM's behaviour, "
            "pinned by the golden traces: unitary and full + one other type stop after one pass)",
            f"  planner: {self.planner_models} models obey Cases 1–5, memory layout and padding",
        ]


def run_hit_oracle(num_states: int, seed: int = 0) -> OracleStats:
    """The reference's longest hit against brute force on random built cache states."""
    import random

    rng = random.Random(seed)
    stats = OracleStats(failures=[])
    assert stats.failures is not None
    for index in range(num_states):
        aligned = index % 4 != 3
        groups, prompt, block_size = random_cache_state(rng, aligned=aligned)
        hit = reference_hit(groups, prompt, block_size)
        exact = (hit.hit_tokens, hit.block_ids) == (hit.brute_force_tokens, hit.expected_block_ids)
        chunked = [g for g in groups if g.kind == "chunked_local"]
        if any(g.param % block_size for g in chunked):
            stats.nonaligned_states += 1
            stats.nonaligned_longer += not exact
            if hit.hit_tokens < hit.brute_force_tokens:
                stats.failures.append(f"missed a hit every group accepts: {groups} {hit}")
            continue
        stats.hit_states += 1
        types = {g.type_key for g in groups}
        stats.hit_states_three_types += len(types) >= 3
        stats.hit_states_without_full += all(g.kind != "full" for g in groups)
        if not exact:
            stats.failures.append(f"longest hit differs from brute force: {groups} {hit}")
    return stats
