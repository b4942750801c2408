"""The longest-hit oracle with the engine's layouts: Mamba ``"align"`` groups and groups of
different block sizes on their lcm (the scheduler block). ``brute_force_engine_hit`` tries every
multiple of the scheduler block against each group's rule (``engine_group_accepts``, written
from the README's words); ``reference_engine_hit`` builds the state in a reference
``KVCacheManager`` and looks it up; ``run_engine_hit_oracle`` compares the two on random states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridkv.conformance.oracle_longest_hit import GroupCacheState
from hybridkv.conformance.oracle_reference_hit import ManagerHit, spec_of
from hybridkv.spec import KVCacheConfig, KVCacheGroup, KVCacheSpec, MambaSpec, rules

EngineKind = Literal["full", "sliding_window", "chunked_local", "mamba"]


@dataclass(frozen=True)
class EngineGroupState:
    """One group of an engine layout: its type, parameter, own block size, and which of its
    blocks it has cached (``cached[i]``: the block of tokens ``[i·B, (i+1)·B)``; for Mamba the
    state after ``(i + 1)·B`` tokens)."""

    kind: EngineKind
    param: int
    block_size: int
    cached: tuple[bool, ...]


def engine_group_accepts(group: EngineGroupState, hit_tokens: int) -> bool:
    """Whether one group's rule accepts a hit of ``hit_tokens`` (a multiple of its block size),
    written from the README's words, not from the scans:

    * full attention: every block before the hit is cached;
    * sliding window: the last ``cdiv(window − 1, B)`` blocks before the hit (or all from 0);
    * chunked local: the blocks of the hit's own chunk;
    * Mamba ``"align"``: the state at exactly that boundary is cached (nothing else is read).
    """
    size = group.block_size
    if hit_tokens % size:
        return False
    k = hit_tokens // size
    if k > len(group.cached):
        return False
    if k == 0:
        return True
    if group.kind == "mamba":
        return group.cached[k - 1]
    return all(group.cached[i] for i in range(engine_first_needed_block(group, k), k))


def engine_first_needed_block(group: EngineGroupState, num_blocks: int) -> int:
    """The first block of ``group`` a hit of ``num_blocks`` of its blocks reads."""
    size = group.block_size
    if group.kind == "full":
        return 0
    if group.kind == "sliding_window":
        return max(0, num_blocks - -(-(group.param - 1) // size))
    if group.kind == "mamba":
        return max(0, num_blocks - 1)
    hit_tokens = num_blocks * size
    return (hit_tokens - hit_tokens % group.param) // size


def brute_force_engine_hit(groups: Sequence[EngineGroupState], num_tokens: int) -> int:
    """The longest hit in tokens: a multiple of the scheduler block (the lcm of the block
    sizes), at most ``num_tokens − 1``, that every group accepts; every candidate tried."""
    scheduler_block = rules.scheduler_block_size([g.block_size for g in groups])
    top = max(num_tokens - 1, 0) // scheduler_block
    return max(
        k * scheduler_block
        for k in range(top + 1)
        if all(engine_group_accepts(g, k * scheduler_block) for g in groups)
    )


def engine_spec_of(state: EngineGroupState) -> KVCacheSpec:
    """The layer spec of an engine cache-state group."""
    if state.kind == "mamba":
        return MambaSpec(block_size=state.block_size, state_bytes=16, mamba_cache_mode="align")
    return spec_of(GroupCacheState(state.kind, state.param, ()), state.block_size)


def reference_engine_hit(
    groups: Sequence[EngineGroupState], prompt: Sequence[int], manager_class: Any = None
) -> ManagerHit:
    """Build exactly this cache state in a reference ``KVCacheManager`` (hashes at the gcd of
    the block sizes, each group caching its own blocks under the last hash each one spans) and
    look ``prompt`` up; the expected blocks are those at the brute-force length (nulls before
    the rule's first needed block; a Mamba group: nulls, then the one state)."""
    from hybridkv.reference import KVCacheManager, Request

    manager_class = KVCacheManager if manager_class is None else manager_class
    config = KVCacheConfig(
        num_blocks=2 + sum(len(g.cached) for g in groups),
        groups=tuple(
            KVCacheGroup((f"layer{gid}",), engine_spec_of(g)) for gid, g in enumerate(groups)
        ),
    )
    manager = manager_class(config, max(len(prompt), 1), enable_caching=True)
    request = Request("probe", prompt, hash_block_size=manager.hash_block_size)
    pool = manager.block_pool
    position_block: list[dict[int, int]] = []
    for gid, group in enumerate(groups):
        assert len(group.cached) == len(prompt) // group.block_size
        table = [pool.get_new_blocks(1)[0] if flag else pool.null_block for flag in group.cached]
        pool.cache_full_blocks(
            request,
            table,
            num_cached_blocks=0,
            num_full_blocks=len(table),
            block_size=group.block_size,
            group_id=gid,
        )
        position_block.append({i: b.block_id for i, b in enumerate(table) if not b.is_null})
        pool.free_blocks(table[::-1])
    blocks, hit_tokens, _ = manager.get_computed_blocks(request)
    best = brute_force_engine_hit(groups, len(prompt))
    expected = []
    for gid, group in enumerate(groups):
        k = best // group.block_size
        first = engine_first_needed_block(group, k)
        expected.append((0,) * first + tuple(position_block[gid][i] for i in range(first, k)))
    return ManagerHit(
        hit_tokens,
        best,
        tuple(tuple(ids) for ids in blocks.get_block_ids()),
        tuple(expected),
    )


def random_engine_cache_state(
    rng: Any,
) -> tuple[list[EngineGroupState], list[int]]:
    """An engine layout the reference accepts with caching on, random cached flags, a prompt:
    either Mamba ``"align"`` groups (one block size, among full, sliding-window and
    chunked-local groups) or full and sliding-window groups of block sizes b, 2b, 4b."""
    b = rng.choice([1, 2, 3, 4])
    num_tokens = rng.randint(1, 48)
    groups: list[EngineGroupState] = []

    def group(kind: EngineKind, param: int, size: int) -> EngineGroupState:
        density = rng.random()
        cached = tuple(rng.random() < density for _ in range(num_tokens // size))
        return EngineGroupState(kind, param, size, cached)

    if rng.random() < 0.5:
        for _ in range(rng.choice([1, 1, 2])):
            groups.append(group("mamba", 0, b))
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice(["full", "sliding_window", "chunked_local"])
            param = b * rng.choice([1, 2, 3]) if kind == "chunked_local" else rng.randint(2, 12)
            groups.append(group(kind, param, b))
    else:
        sizes = [b, 2 * b, 4 * b]
        for size in [rng.choice(sizes), *rng.sample(sizes, rng.randint(1, 3))]:
            kind = rng.choice(["full", "sliding_window"])
            groups.append(group(kind, rng.randint(2, 2 * size + 2), size))
    rng.shuffle(groups)
    prompt = [rng.randint(0, 100) for _ in range(num_tokens)]
    return groups, prompt


@dataclass
class EngineOracleStats:
    """What the engine longest-hit oracle checked."""

    states: int = 0
    with_mamba: int = 0
    mixed_block_sizes: int = 0
    hits: int = 0
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"  longest hit (engine layouts): {self.states - len(self.failures)} of "
            f"{self.states} cache states equal to brute force "
            f"({self.with_mamba} with Mamba 'align', {self.mixed_block_sizes} with block sizes "
            f"b/2b/4b on the lcm, {self.hits} with a hit)"
        ]


def run_engine_hit_oracle(
    num_states: int, seed: int = 0, manager_class: Any = None
) -> EngineOracleStats:
    """The reference's longest hit against brute force on random built engine cache states."""
    import random

    rng = random.Random(seed)
    stats = EngineOracleStats()
    for _ in range(num_states):
        groups, prompt = random_engine_cache_state(rng)
        hit = reference_engine_hit(groups, prompt, manager_class)
        stats.states += 1
        stats.with_mamba += any(g.kind == "mamba" for g in groups)
        stats.mixed_block_sizes += len({g.block_size for g in groups}) > 1
        stats.hits += hit.brute_force_tokens > 0
        if (hit.hit_tokens, hit.block_ids) != (hit.brute_force_tokens, hit.expected_block_ids):
            stats.failures.append(f"engine longest hit differs from brute force: {groups} {hit}")
    return stats
