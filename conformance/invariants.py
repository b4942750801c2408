"""Invariants any implementation must satisfy, computed from what it shows (its snapshot, its
block tables, its counts), whatever its internals: ``check_observable_invariants`` after every
step, ``check_failed_allocation`` after an ``allocate_slots`` that returned ``None``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from hybridkv.conformance.adapters import BlockIds, Snapshot
from hybridkv.conformance.strategies import Layout
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    rules,
    spec_kind,
)


class ConformanceError(AssertionError):
    """An implementation differs from the model, or breaks an invariant."""


def skipped_block_count(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Positions before the window (or chunk) of the next token: the most nulls a table has.

    One exception, inherited from vLLM and pinned by the golden traces (docs/checks.md, "A
    limitation inherited from vLLM"): with a chunk that is not a multiple of the block size, a
    single-pass lookup can return a hit whose chunk starts before its null positions end, and
    admission adopts those nulls. They still never reach past the hit's last block, so the bound
    there is every position the computed tokens fill.
    """
    if isinstance(spec, ChunkedLocalAttentionSpec) and spec.attention_chunk_size % spec.block_size:
        return rules.cdiv(num_computed_tokens, spec.block_size)
    return rules.skipped_block_positions(spec.skipped_tokens(num_computed_tokens), spec.block_size)


def check_observable_invariants(
    layout: Layout,
    snapshot: Snapshot,
    num_free_blocks: int,
    usage: float,
    tables: Mapping[str, BlockIds],
    computed: Mapping[str, int],
) -> None:
    """Raise ``ConformanceError`` unless the shown state is consistent.

    * reference count of every block = number of live table positions holding it;
    * the free queue holds exactly the blocks with count 0, once each, never the null block;
    * usage = 1 − free / (num_blocks − 1), in [0, 1];
    * no block in two groups (tables or cache), nor twice in one table; a block in the tables of
      two requests of one group is shared through the prefix cache (it is a cached block);
    * full-attention tables hold no null; sliding-window, chunked-local and ``"none"`` Mamba
      tables hold nulls only as a prefix, and only before the window (or chunk, or state) of the
      computed tokens; an ``"align"`` Mamba table holds at most its state, the previous one, a
      prefill checkpoint and its speculative blocks.
    """
    holders: Counter[int] = Counter()
    group_of: dict[int, int] = {}
    tables_of: dict[tuple[int, int], int] = Counter()
    for rid, table in tables.items():
        for gid, (spec, ids) in enumerate(zip(layout.specs, table, strict=True)):
            where = f"{rid} g{gid}"
            _check_nulls(where, spec, ids, computed[rid])
            real = [block for block in ids if block != 0]
            require(len(real) == len(set(real)), f"{where}: a block twice in one table")
            for block in real:
                holders[block] += 1
                tables_of[(gid, block)] += 1
                require(
                    group_of.setdefault(block, gid) == gid,
                    f"block {block} in groups {group_of[block]} and {gid}",
                )
    _check_free_queue(layout, snapshot, num_free_blocks, usage, holders)
    _check_cached(snapshot, tables_of)
    if not layout.enable_caching:
        require(snapshot.num_cached_keys == 0, "a cache key with caching disabled")


def _check_nulls(where: str, spec: KVCacheSpec, ids: Sequence[int], computed: int) -> None:
    """One table's nulls as its type allows them (see ``check_observable_invariants``), and
    room for the computed tokens."""
    nulls = [i for i, block in enumerate(ids) if block == 0]
    live = spec.max_live_blocks
    if live is not None:
        # Mamba "align": the state, the previous one, a checkpoint, speculative blocks.
        require(
            len(ids) - len(nulls) <= live,
            f"{where}: a {spec.title} table of {len(ids) - len(nulls)} blocks (> {live})",
        )
    elif spec.null_positions == "leading":
        require(nulls == list(range(len(nulls))), f"{where}: nulls {nulls} not a prefix")
        limit = skipped_block_count(spec, computed)
        require(
            len(nulls) <= limit,
            f"{where}: {len(nulls)} nulls but only {limit} positions out of window",
        )
    else:
        require(not nulls, f"{where}: a {spec_kind(spec)} table holds a null block")
    require(
        len(ids) * spec.block_size >= computed,
        f"{where}: {len(ids)} blocks cannot hold {computed} computed tokens",
    )


def _check_free_queue(
    layout: Layout, snapshot: Snapshot, num_free_blocks: int, usage: float, holders: Counter[int]
) -> None:
    """Reference counts equal the tables' holders; the free queue holds exactly the blocks no
    table holds, once each, never the null block; its length and the usage agree with it."""
    ref_counts = dict(snapshot.ref_counts)
    require(ref_counts == dict(holders), f"ref counts {ref_counts} != holders {dict(holders)}")
    free = snapshot.free_block_ids
    require(len(free) == len(set(free)), f"free queue holds a block twice: {free}")
    require(0 not in free, "the null block is in the free queue")
    everything = set(range(1, layout.num_blocks))
    require(
        set(free) == everything - set(holders),
        f"free queue {sorted(free)} != blocks with count 0 {sorted(everything - set(holders))}",
    )
    require(num_free_blocks == len(free), f"num_free_blocks {num_free_blocks} != {len(free)}")
    expected_usage = 1.0 - num_free_blocks / (layout.num_blocks - 1)
    require(0.0 <= usage <= 1.0, f"usage {usage} outside [0, 1]")
    require(
        math.isclose(usage, expected_usage, abs_tol=1e-12), f"usage {usage} != {expected_usage}"
    )


def _check_cached(snapshot: Snapshot, tables_of: Mapping[tuple[int, int], int]) -> None:
    """No cached null block, no block cached in two groups, and a block in several tables of
    one group is in that group's prefix cache (shared only through a cache hit)."""
    cached_in: dict[int, int] = {}
    for gid, ids in enumerate(snapshot.cached_block_ids):
        for block in ids:
            require(block != 0, "the null block is cached")
            require(cached_in.setdefault(block, gid) == gid, f"block {block} cached in two groups")
    for (gid, block), count in tables_of.items():
        if count > 1:
            require(
                cached_in.get(block) == gid,
                f"block {block} is in {count} tables of group {gid} but not in its prefix cache",
            )


def check_failed_allocation(
    layout: Layout,
    rid: str,
    before: Snapshot,
    after: Snapshot,
    tables_before: Mapping[str, BlockIds],
    tables_after: Mapping[str, BlockIds],
) -> None:
    """A failed allocation changes nothing but the window releases of the request.

    The request's sliding-window, chunked-local and Mamba positions may have turned null (their
    blocks released, in either end of the queue); nothing else may differ: other tables, other
    counts, the relative order of the blocks already free, the prefix cache.
    """
    for other, table in tables_before.items():
        if other != rid:
            require(tables_after[other] == table, f"failed allocation changed {other}'s table")
    released: Counter[int] = Counter()
    for gid, (old, new) in enumerate(zip(tables_before[rid], tables_after[rid], strict=True)):
        require(len(old) == len(new), f"failed allocation resized {rid}'s table of group {gid}")
        for position, (a, b) in enumerate(zip(old, new, strict=True)):
            if a == b:
                continue
            spec = layout.specs[gid]
            require(
                b == 0 and spec.null_positions != "none",
                f"failed allocation changed {rid} g{gid} position {position}: {a} -> {b}",
            )
            released[a] += 1
    counts = Counter(dict(before.ref_counts))
    counts.subtract(released)
    expected = {block: n for block, n in counts.items() if n > 0}
    require(dict(after.ref_counts) == expected, "failed allocation changed reference counts")
    newly_free = {block for block in released if block not in expected}
    require(
        set(after.free_block_ids) == set(before.free_block_ids) | newly_free,
        "failed allocation changed the free blocks beyond the window releases",
    )
    kept_order = tuple(b for b in after.free_block_ids if b not in newly_free)
    require(kept_order == before.free_block_ids, "failed allocation reordered the free queue")
    require(
        after.cached_block_ids == before.cached_block_ids
        and after.num_cached_keys == before.num_cached_keys,
        "failed allocation changed the prefix cache",
    )


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)
