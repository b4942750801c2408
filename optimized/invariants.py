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

from hybridkv.optimized import table_scan
from hybridkv.optimized.group_rules import MAMBA
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.snapshot import PoolSnapshot
from hybridkv.spec.errors import InvariantError


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


def cached_block_counts(s: ManagerState) -> dict[str, tuple[int, ...]]:
    """Per request holding blocks, per group the positions its row entered into the prefix
    cache (``rows.cached``; the reference's ``num_cached_block``)."""
    s.settle()
    rows, groups = s.rows, range(s.layout.num_groups)
    counts: dict[str, tuple[int, ...]] = {}
    for rid, row in rows.items():
        pairs = [rows.index(row, g) for g in groups]
        if any(rows.length[i] for i in pairs):
            counts[rid] = tuple(int(rows.cached[i]) for i in pairs)
    return counts


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
    estimate of its cached tokens differs from the scan of its tables. The tables are read
    in one pass and checked in numpy calls (``hybridkv.optimized.table_scan``)."""
    s.settle()
    s.pool.check_invariants()
    s.rows.check_invariants()
    scan = table_scan.scan_tables(s)
    table_scan.check_lengths(s, scan)
    table_scan.check_nulls(s, scan)
    table_scan.check_holders(s, scan)
    table_scan.check_device(s, scan)
    table_scan.check_rows(s, scan)
    check_estimates(s, scan)


def check_estimates(s: ManagerState, scan: table_scan.TableScan) -> None:
    """Each request's ``estimate_cached_tokens`` equals vLLM's scan of its tables (checked
    last: it reads the tables the other checks vouch for)."""
    scans = table_scan.estimates_by_scan(s, scan)
    for request_id, by_scan in zip(scan.request_ids, scans, strict=True):
        estimate = estimate_cached_tokens(s, request_id)
        if estimate != by_scan:
            raise InvariantError(
                f"request {request_id!r}: estimate_cached_tokens {estimate} but its tables "
                f"hold a prefix of {by_scan} cached tokens"
            )
