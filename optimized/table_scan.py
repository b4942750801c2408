"""Every live block table at once: the whole-table half of ``check_invariants``, in numpy calls.

Tests call ``TorchKVCacheManager.check_invariants`` after every step of the golden replays and
of the state machines, so the checks that read every table position gather them in one pass
(``scan_tables``) and decide each rule with a few array operations over all rows and groups;
only a failed check walks its offenders, to name the first one (in row order, then group, then
position: the order the tables are listed in) in its message.

Data layout
-----------
Read only: the state's flat host tables (position p of row r of group g at ``(g × R + r) × W
+ p``), the row counters (``RowTables.columns``, row r, group g at ``r × G + g``), the pool's
``ref[N]``, ``src[N + 1]`` and ``hk[N + 1]`` (numpy views). A ``TableScan`` holds, for the n
rows in use (in ``RowTables.items`` order) and their ``n × G`` *pairs* (pair ``i × G + g``:
row i of the scan, group g)::

    request_ids[n], rows[n]   the requests and their rows (``row_list``: the rows as a list)
    lengths[n, G], nulls[n, G] each pair's table length and leading nulls
    blocks[E]                 int32: every table entry, pair after pair, position order
    pair[E], pos[E]           each entry's pair and table position
    flat[E]                   each entry's index into the flat tables
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.optimized.group_rules import MAMBA, GroupRule
from hybridkv.optimized.state import ManagerState
from hybridkv.spec import rules
from hybridkv.spec.errors import InvariantError, require

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class TableScan:
    """The entries of every table in use (see the module docstring)."""

    request_ids: list[str]
    row_list: list[int]
    rows: Ints
    lengths: Ints
    nulls: Ints
    blocks: npt.NDArray[np.int32]
    pair: Ints
    pos: Ints
    flat: Ints

    def request_of(self, pair: int, num_groups: int) -> str:
        return self.request_ids[pair // num_groups]


def scan_tables(s: ManagerState) -> TableScan:
    """Gather every position of every table in use (a table longer than its row is an
    error: the positions past ``W`` are another table's)."""
    g_count, r_count, width = s.layout.num_groups, s.layout.max_num_reqs, s.tables.width
    items = s.rows.items()
    request_ids = [request_id for request_id, _ in items]
    row_list = [row for _, row in items]
    rows = np.array(row_list, dtype=np.int64)
    garange = np.arange(g_count, dtype=np.int64)
    index = rows[:, None] * g_count + garange
    lengths, nulls = s.rows.columns[:2, index]
    if lengths.size and (lengths.max() > width or lengths.min() < 0):
        at = int(((lengths > width) | (lengths < 0)).ravel().nonzero()[0][0])
        raise InvariantError(
            f"request {request_ids[at // g_count]!r} group {at % g_count} has a table of "
            f"{int(lengths.ravel()[at])} positions, beyond its row's {width}"
        )
    counts = lengths.ravel()
    ends = counts.cumsum()
    starts = ends - counts
    total = int(ends[-1]) if ends.shape[0] else 0
    pair = np.arange(counts.shape[0], dtype=np.int64).repeat(counts)
    pos = np.arange(total, dtype=np.int64) - starts[pair]
    bases = ((garange * r_count)[None, :] + rows[:, None]) * width
    flat = bases.ravel()[pair] + pos
    blocks = s.tab.n[flat]
    return TableScan(request_ids, row_list, rows, lengths, nulls, blocks, pair, pos, flat)


def check_lengths(s: ManagerState, scan: TableScan) -> None:
    """A row's tables equally long where every allocation extends them all."""
    if s.layout.uniform_columns and scan.lengths.size:
        uneven = (scan.lengths != scan.lengths[:, :1]).any(axis=1).nonzero()[0]
        if uneven.shape[0]:
            request_id = scan.request_ids[int(uneven[0])]
            raise InvariantError(f"request {request_id!r}'s tables differ in length")


def _group_masks(group_rules: tuple[GroupRule, ...]) -> tuple[Bools, Bools]:
    """Per group: whether it is an attention group (its nulls are leading ones), and whether
    it may hold no null at all (full attention)."""
    attention = np.array([rule.kind != MAMBA for rule in group_rules], dtype=bool)
    releases = np.array([rule.releases for rule in group_rules], dtype=bool)
    return attention, attention & ~releases


def check_nulls(s: ManagerState, scan: TableScan) -> None:
    """Nulls where each group's rule allows them: a window or chunk's leading ones only, none
    in a full-attention table; an ``"align"`` Mamba table's anywhere, but few real blocks."""
    g_count = s.layout.num_groups
    attention, fixed = _group_masks(s.layout.rules)
    nulls = scan.nulls.ravel()
    wrong = (scan.blocks == 0) != (scan.pos < nulls[scan.pair])
    if s.layout.has_align:
        wrong &= attention[scan.pair % g_count]
    if wrong.any():
        at = int(scan.pair[wrong.nonzero()[0][0]])
        raise InvariantError(
            f"request {scan.request_of(at, g_count)!r} group {at % g_count} has nulls outside "
            f"positions 0 … {int(nulls[at]) - 1}"
        )
    full = (scan.nulls > 0) & fixed
    if full.any():
        at = int(full.ravel().nonzero()[0][0])
        raise InvariantError(
            f"request {scan.request_of(at, g_count)!r} of a full-attention group holds null blocks"
        )
    if s.layout.has_align:
        _check_mamba_blocks(s, scan)


def _check_mamba_blocks(s: ManagerState, scan: TableScan) -> None:
    """At most the state, the previous one, a checkpoint, the speculative blocks and those of
    the tokens in flight in each ``"align"`` Mamba table (``_check_null_positions``)."""
    g_count = s.layout.num_groups
    real = np.bincount(scan.pair[scan.blocks != 0], minlength=scan.lengths.size).tolist()
    for i, request_id in enumerate(scan.request_ids):
        in_flight = s.mamba.in_flight.get(request_id, 0)
        for g, rule in enumerate(s.layout.rules):
            if rule.kind != MAMBA:
                continue
            held = real[i * g_count + g]
            limit = 3 + rule.spec_blocks + rules.cdiv(in_flight, rule.block_size)
            require(held <= limit, f"request {request_id!r} holds {held} Mamba blocks")


def check_holders(s: ManagerState, scan: TableScan) -> None:
    """Each real block in one group's tables only, each a block of the pool, and its reference
    count its holders (one per table position holding it)."""
    n, g_count = s.layout.config.num_blocks, s.layout.num_groups
    real = (scan.blocks != 0).nonzero()[0]
    held = scan.blocks[real]
    if held.size and (held.min() < 0 or held.max() >= n):
        at = int(real[((held < 0) | (held >= n)).nonzero()[0][0]])
        pair = int(scan.pair[at])
        raise InvariantError(
            f"request {scan.request_of(pair, g_count)!r} group {pair % g_count} holds block "
            f"{int(scan.blocks[at])}, which is not a block of the pool"
        )
    group = scan.pair[real] % g_count
    # The group of each block's first entry, then every entry against it.
    first = np.full(n, held.shape[0], dtype=np.int64)
    np.minimum.at(first, held, np.arange(held.shape[0], dtype=np.int64))
    owner = group[first[held]]
    split = (owner != group).nonzero()[0]
    if split.shape[0]:
        at = int(split[0])
        raise InvariantError(f"block {held[at]} is in groups {owner[at]} and {group[at]}")
    holders = np.bincount(held, minlength=n)
    for block, count in s.deferred.items():  # handed out by ``pop_blocks_for_free``
        holders[block] += count
    ref = s.pool.ref.n
    wrong = (ref[1:] != holders[1:]).nonzero()[0]
    if wrong.shape[0]:
        block = int(wrong[0]) + 1
        raise InvariantError(f"block {block} has ref_cnt {ref[block]} but {holders[block]} holders")


def check_device(s: ManagerState, scan: TableScan) -> None:
    """A mirrored table's device copy equals the host's at every position in use (one gather
    on the device, one copy back)."""
    if not s.tables.mirrored or scan.flat.shape[0] == 0:
        return
    device = s.tables.on_device
    index = torch.from_numpy(scan.flat).to(device)
    copied = device.reshape(-1)[index].cpu().numpy().astype(np.int64)
    stale = (copied != scan.blocks).nonzero()[0]
    if stale.shape[0]:
        at = int(scan.pair[stale[0]])
        raise InvariantError(
            f"device table of {scan.request_of(at, s.layout.num_groups)!r} is stale"
        )


def check_rows(s: ManagerState, scan: TableScan) -> None:
    """A row's thresholds as its counters give them, and each source's count of the rows
    naming it."""
    thresholds = s.rows.thresholds
    stored = thresholds[:, scan.rows]  # a copy
    for row in scan.row_list:
        s.thresholds.refresh(row)
    changed = stored != thresholds[:, scan.rows]
    if changed.any():
        stale = int(changed.any(axis=0).nonzero()[0][0])
        raise InvariantError(f"thresholds of {scan.request_ids[stale]!r} are stale")
    named = Counter(src for src in map(s.row_src.__getitem__, scan.row_list) if src >= 0)
    wrong = [
        index
        for index, source in enumerate(s.pool.sources)
        if source is not None and source.row_refs != named.get(index, 0)
    ]
    if wrong:
        raise InvariantError(f"source {wrong[0]} has a wrong row count")


def estimates_by_scan(s: ManagerState, scan: TableScan) -> list[int]:
    """``estimate_by_scan`` of every request of the scan, in its order: per pair the largest
    hash index of a cached entry, per row the least over its groups."""
    pool, g_count = s.pool, s.layout.num_groups
    held = pool.src.n[scan.blocks] >= 0
    cached, pair = scan.blocks[held], scan.pair[held]
    longest = np.full(scan.lengths.size, -1, dtype=np.int64)
    np.maximum.at(longest, pair, (pool.hk.n[cached] & 0xFFFFFFFF) // g_count)
    tokens = (longest.reshape(scan.lengths.shape).min(axis=1) + 1) * s.layout.hash_block_size
    estimates: list[int] = tokens.tolist()
    return estimates
