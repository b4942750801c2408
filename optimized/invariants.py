"""Observation and self-checks: the pool snapshot, the cached-token estimate, the invariants.

``estimate_cached_tokens`` reads, per group, the blocks at a few table positions
(``prefix_positions``) for the longest prefix one of them is cached under; ``estimate_by_scan``
is vLLM 0.33's scan of every block of every table, which ``check_invariants`` compares it
with, after checking that the pool, the rows, the tables and the row thresholds agree.

Data layout
-----------
Read only (but a row's thresholds, recomputed to compare): the state's flat host tables, the
row counters at ``row × G + g``, the pool's per-block ``src`` (-1: not cached) and ``hk`` (the
primary key's hash index × G + group, in the low 32 bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.optimized.group_rules import MAMBA
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.snapshot import PoolSnapshot
from hybridkv.spec import rules
from hybridkv.spec.errors import require


def estimate_cached_tokens(s: ManagerState, request_id: str) -> int:
    """Tokens of the request that are in the prefix cache: per group the longest prefix one
    of its blocks is cached under (``block_hash_num_tokens``: the primary key's hash index
    plus one, in hash blocks), the minimum over the groups; 0 for an unknown request
    (``KVCacheManager.estimate_cached_tokens``). Each group reads the blocks at a few
    positions (``_prefix_positions``): O(groups), whatever the request's length."""
    row = s.rows.row_of(request_id)
    if row is None:
        return 0
    s.settle()
    cached: int | None = None
    for g in range(s.layout.num_groups):
        longest = cached_prefix_tokens(s, request_id, row, g)
        cached = longest if cached is None else min(cached, longest)
    return cached or 0


def snapshot(s: ManagerState) -> PoolSnapshot:
    """The pool's observable state (``KVCacheManager.snapshot``), pending work made first."""
    s.settle()
    pool = s.pool
    ref = pool.ref.t
    held = torch.nonzero(ref[1:] > 0).flatten() + 1
    return PoolSnapshot(
        free_block_ids=tuple(pool.free_queue()),
        ref_counts=dict(zip(held.tolist(), ref[held].tolist(), strict=True)),
        cached_block_ids=tuple(tuple(ids) for ids in pool.cached_blocks()),
        num_cached_keys=pool.num_cached_keys(),
    )


def prefix_positions(s: ManagerState, request_id: str, row: int, g: int) -> Sequence[int]:
    """Table positions among which the longest cached prefix of group ``g``'s table sits
    (``SingleTypeKVCacheManager.prefix_positions`` says why): for an attention group the
    last position adopted or kept under a retention mask, the last cached one and the
    first not cached (a prompt-tail entry); for a Mamba ``"align"`` group its real
    blocks."""
    if s.layout.rules[g].kind == MAMBA:
        return s.mamba.positions.get((request_id, g), ())
    i = s.rows.index(row, g)
    cached = s.rows.cached[i]
    return s.rows.kept[i] - 1, cached - 1, cached


def cached_prefix_tokens(s: ManagerState, request_id: str, row: int, g: int) -> int:
    """The largest ``block_hash_num_tokens`` of group ``g``'s table (0 when no block is
    cached), read at ``_prefix_positions``."""
    pool, tab, base = s.pool, s.tab.a, s.tables.base(g, row)
    length = s.rows.length[s.rows.index(row, g)]
    longest = -1
    for pos in prefix_positions(s, request_id, row, g):
        if 0 <= pos < length:
            block = tab[base + pos]
            if block and pool.src.a[block] >= 0:
                longest = max(longest, pool.hash_index(block))
    return (longest + 1) * s.layout.hash_block_size


def estimate_by_scan(s: ManagerState, request_id: str) -> int:
    """``estimate_cached_tokens`` as vLLM 0.33 computes it, over every block of every table
    (``check_invariants`` compares the two)."""
    row = s.rows.row_of(request_id)
    if row is None:
        return 0
    pool, g_count = s.pool, s.layout.num_groups
    cached: int | None = None
    for g in range(g_count):
        base = s.tables.base(g, row)
        length = s.rows.length[s.rows.index(row, g)]
        table = s.tab.t[base : base + length].to(torch.int64)
        held = table[pool.src.t[table] >= 0]
        longest = 0
        if held.numel():
            index = int(((pool.hk.t[held] & 0xFFFFFFFF) // g_count).max())
            longest = (index + 1) * s.layout.hash_block_size
        cached = longest if cached is None else min(cached, longest)
    return cached or 0


def check_invariants(s: ManagerState) -> None:
    """Raise ``InvariantError`` if the pool, the rows and the tables disagree, or a request's
    estimate of its cached tokens differs from the scan of its tables."""
    s.settle()
    pool = s.pool
    pool.check_invariants()
    rows = s.rows
    rows.check_invariants()
    holders = [0] * s.layout.config.num_blocks
    owner: dict[int, int] = {}
    row_sources: dict[int, int] = {}
    for request_id, row in rows.items():
        for g in range(s.layout.num_groups):
            _check_table(s, request_id, row, g, holders, owner)
        if s.layout.uniform_columns:
            at = row * s.layout.num_groups
            lengths = set(rows.length[at : at + s.layout.num_groups])
            require(len(lengths) == 1, f"request {request_id!r}'s tables differ in length")
        src = s.row_src[row]
        if src >= 0:
            row_sources[src] = row_sources.get(src, 0) + 1
        stored = rows.thresholds[:, row].tolist()
        s.thresholds.refresh(row)
        require(
            stored == rows.thresholds[:, row].tolist(),
            f"thresholds of {request_id!r} are stale",
        )
    for block in range(1, s.layout.config.num_blocks):
        require(
            pool.ref.a[block] == holders[block],
            f"block {block} has ref_cnt {pool.ref.a[block]} but {holders[block]} holders",
        )
    for index, source in enumerate(pool.sources):
        if source is not None:
            require(
                source.row_refs == row_sources.get(index, 0),
                f"source {index} has a wrong row count",
            )
    check_estimates(s)


def _check_table(
    s: ManagerState,
    request_id: str,
    row: int,
    g: int,
    holders: list[int],
    owner: dict[int, int],
) -> None:
    """Group ``g``'s table of the row: its nulls where its rule allows them, each real block
    in one group only (counted in ``holders``), its device copy current."""
    rows, rule = s.rows, s.layout.rules[g]
    table = s.table(g, row)
    nulls = rows.nulls[rows.index(row, g)]
    if rule.kind == MAMBA:
        # Nulls anywhere, but few real blocks (``_check_null_positions``).
        real = sum(1 for b in table if b)
        in_flight = s.mamba.in_flight.get(request_id, 0)
        limit = 3 + rule.spec_blocks + rules.cdiv(in_flight, rule.block_size)
        require(real <= limit, f"request {request_id!r} holds {real} Mamba blocks")
    else:
        require(
            all(b == 0 for b in table[:nulls]) and all(b != 0 for b in table[nulls:]),
            f"request {request_id!r} group {g} has nulls outside positions 0 … {nulls - 1}",
        )
        require(
            nulls == 0 or rule.releases,
            f"request {request_id!r} of a full-attention group holds null blocks",
        )
    for block in table:
        if block == 0:
            continue
        holders[block] += 1
        group = owner.setdefault(block, g)
        require(group == g, f"block {block} is in groups {group} and {g}")
    if s.tables.mirrored:
        on_device = s.tables.on_device[g, row, : len(table)].cpu().tolist()
        require(on_device == table, f"device table of {request_id!r} is stale")


def check_estimates(s: ManagerState) -> None:
    """Each request's ``estimate_cached_tokens`` equals vLLM's scan of its tables (checked
    last: it reads the tables the other checks vouch for)."""
    for request_id, _ in s.rows.items():
        estimate = estimate_cached_tokens(s, request_id)
        scan = estimate_by_scan(s, request_id)
        require(
            estimate == scan,
            f"request {request_id!r}: estimate_cached_tokens {estimate} but its tables hold "
            f"a prefix of {scan} cached tokens",
        )
