"""Caching a row's full blocks under one block size, and the sources the pool keys them by.

``cache_uniform`` enters a row's newly full blocks into the prefix cache (``cache_blocks``,
and the caching part of ``allocate_slots``) when every group has the scheduler's block size,
which is the hash block size: a block at position p of any group is keyed by hash p.
``cache_busy`` does it for the busy requests of a whole step (``hybridkv.optimized.batch``).
Layouts of several block sizes or with a Mamba ``"align"`` group cache through
``hybridkv.optimized.general_caching``, which uses ``store_full_blocks`` and ``source_of`` from
here.

Data layout
-----------
A row's cached positions per group are ``RowTables.cached`` (``kept``: one past the last
position a retention mask kept). The entries a call caches are (block, group, position)
triples in group-then-position order, the reference's order; from ``INSERT_MIN`` of them they
go to the pool as numpy columns. A row caches under one pool source (``state.row_src[row]``:
the request's token and hash lists, shared by all its blocks' keys), created on its first
cached block and refreshed when the request's lists outgrow it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.optimized.state import ManagerState
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.single_type_managers import prompt_tokens
from hybridkv.spec import SlidingWindowSpec, rules

Ints = npt.NDArray[np.int64]


def source_of(
    s: ManagerState, request: RequestLike, row: int, num_hashes: int, num_tokens: int
) -> int:
    """The row's source, created on its first cached block and kept current (it must have
    ``num_hashes`` hashes and ``num_tokens`` tokens, lookahead tokens besides)."""
    pool = s.pool
    src = s.row_src[row]
    if src >= 0:
        source = pool.sources[src]
        if (
            source is not None
            and len(source.tokens) >= num_tokens + s.layout.lookahead
            and len(source.hashes) >= num_hashes
        ):
            return src  # current already (a request's own lists grow with it)
    tokens, hashes = request.all_token_ids, request.block_hashes
    if src < 0:
        src = pool.new_source(
            tokens,
            hashes,
            request.cache_salt,
            request.packed_token_ids if isinstance(request, Request) else None,
        )
        pool.source(src).row_refs += 1
        s.row_src[row] = src
        if hashed_by_memo(s, request):
            pool.memo_srcs.add(src)
        return src
    source = pool.source(src)
    if len(source.tokens) < num_tokens + s.layout.lookahead:
        source.tokens = tokens
        source.packed = request.packed_token_ids if isinstance(request, Request) else None
    if len(source.hashes) < num_hashes:
        source.hashes = hashes
    return src


def hashed_by_memo(s: ManagerState, request: RequestLike) -> bool:
    """Whether the request's hashes are ``block_hasher``'s (so the memo may keep them)."""
    return (
        isinstance(request, Request)
        and request.block_hasher is s.block_hasher
        and request.request_keys is None  # keyed hashes are not the tokens' alone
        and not s.layout.lookahead
        and not request.num_hash_lookahead_tokens
        and request.hash_block_size == s.layout.hash_block_size
    )


def cache_uniform(
    s: ManagerState, request: RequestLike, row: int, num_tokens: int, defer: bool = False
) -> None:
    """Enter the row's full blocks covered by ``num_tokens`` into the prefix cache (with
    ``defer``, a running step's: into the pool's pending work); one block size only."""
    pool = s.pool
    b, g_count = s.layout.block_size, s.layout.num_groups
    hashes = request.block_hashes
    num_full = min(num_tokens // b, len(hashes))
    tab, cached, at = s.tab.a, s.rows.cached, row * g_count
    row_base, bases = row * s.layout.max_blocks_per_req, s.layout.group_bases
    entries: list[tuple[int, int, int]] = []  # (block, group, position)
    src = -1
    # Sparse retention and events need each group's stored positions; otherwise a group's
    # new full blocks are its table's slice.
    plain = not s.layout.columns.sparse_groups and pool.event_builder is None
    if defer and plain and num_full > 0:
        last = num_full - 1
        row_blocks = s.tables.across(0, g_count, row, last)
        if min(cached[at : at + g_count]) == last == max(cached[at : at + g_count]) and min(
            row_blocks
        ):
            # A decode step: one newly full block in every group.
            src = source_of(s, request, row, num_full, num_full * b)
            pool.defer_row(row_blocks, last, hashes[last], src, s.layout.columns.group_ids)
            cached[at : at + g_count] = array("q", (num_full,)) * g_count
            return
    start = cached[at]
    if (
        plain
        and not defer
        and num_full - start >= max(1, pool.insert_min // g_count)
        and min(cached[at : at + g_count]) == start == max(cached[at : at + g_count])
    ):
        cache_columns(s, request, row, start, num_full)
        return
    boundaries: list[int] | None = None
    for g in range(g_count):
        start = cached[at + g]
        if start >= num_full:
            continue
        if src < 0:
            src = source_of(s, request, row, num_full, num_full * b)
        base = bases[g] + row_base
        cached[at + g] = num_full
        if plain:
            if num_full - start == 1:  # a decode step's newly full block
                block = tab[base + start]
                if block:
                    entries.append((block, g, start))
            else:
                for pos, block in enumerate(tab[base + start : base + num_full], start):
                    if block:
                        entries.append((block, g, pos))
            continue
        boundaries = _store_masked(s, request, row, g, start, num_full, entries, boundaries)
    if entries:
        _insert(s, entries, hashes, src, defer)


def cache_columns(
    s: ManagerState, request: RequestLike, row: int, start: int, num_full: int
) -> None:
    """``_cache`` of positions ``start … num_full − 1`` in every group of a row that has
    cached as far in each (a prompt's blocks), in numpy calls: the same entries in the same
    order (group by group, position by position, the null ones left out)."""
    g_count, b = s.layout.num_groups, s.layout.block_size
    src = source_of(s, request, row, num_full, num_full * b)
    positions = np.arange(start, num_full, dtype=np.int64)
    flat = s.layout.group_base_column + row * s.layout.max_blocks_per_req + positions
    blocks = s.tab.n[flat].astype(np.int64).ravel()
    count = positions.shape[0]
    # Group-major columns (group by group, position by position), each made in C calls.
    groups = np.repeat(np.arange(g_count, dtype=np.int64), count)
    by_group = np.empty((2, g_count, count), dtype=np.int64)
    by_group[0] = positions
    by_group[1] = s.pool.keys_of(request.block_hashes[start:num_full])
    every, keys = by_group[0].ravel(), by_group[1].ravel()
    real = blocks != 0
    if not real.all():
        blocks, groups, every, keys = blocks[real], groups[real], every[real], keys[real]
    s.pool.insert_array(blocks, groups, every, keys, src)
    cached, at = s.rows.cached, row * g_count
    for i in range(at, at + g_count):
        cached[i] = num_full


def store_full_blocks(
    s: ManagerState,
    request: RequestLike,
    row: int,
    g: int,
    start: int,
    num_full: int,
    mask: Sequence[bool] | None,
    src: int,
) -> None:
    """Key positions ``start … num_full − 1`` of group ``g``'s row (those ``mask`` keeps) by
    the hash at each block's last hash boundary, as ``BlockPool.cache_full_blocks`` does;
    record ``num_full`` as cached and emit one ``BlockStored`` for the blocks stored."""
    pool = s.pool
    b = s.layout.rules[g].block_size
    scale = b // s.layout.hash_block_size
    hashes = request.block_hashes
    view = hashes[scale - 1 :: scale] if scale > 1 else hashes
    tab, base = s.tab.a, s.tables.base(g, row)
    positions = []
    kept = 0
    for pos in range(start, num_full):
        block = tab[base + pos]
        if not block or (mask is not None and not mask[pos - start]):
            continue
        pool.remove_keys(block)
        hidx = (pos + 1) * scale - 1
        pool.insert(block, hashes[hidx], g, hidx, src)
        positions.append(pos)
        kept = pos + 1
    i = s.rows.index(row, g)
    s.rows.cached[i] = num_full
    if mask is not None and kept:
        s.rows.kept[i] = kept
    s.mamba.running.add((row, g))
    if pool.event_builder is not None:
        parent = view[start - 1] if start else None
        pool.events.append(
            pool.event_builder.stored(
                request,
                [view[p] for p in positions],
                positions,
                parent,
                start * b,
                num_full * b,
                b,
                g,
            )
        )


def reachable_boundaries(s: ManagerState, request: RequestLike) -> list[int]:
    """Where a later request can resume (``KVCacheCoordinator.cache_blocks``): a resend of
    the prompt, and the shared-prefix boundary the scheduler stored on the request."""
    eagle = bool(s.layout.eagle_groups)
    boundaries = list(rules.replay_boundaries(prompt_tokens(request), s.layout.block_size, eagle))
    shared = request.shared_prefix_boundary
    if shared:
        boundaries.append(shared)
    return boundaries


def retention_mask(
    s: ManagerState, request: RequestLike, g: int, start: int, end: int, boundaries: Sequence[int]
) -> Sequence[bool] | None:
    """Which of positions ``start … end − 1`` a sliding-window group caches."""
    spec = s.layout.config.groups[g].spec
    assert isinstance(spec, SlidingWindowSpec)
    b = spec.block_size
    eagle = s.layout.group_eagle[g]
    shared = request.shared_prefix_boundary
    if eagle and shared:
        # A sibling diverging right after the junction cannot peek past it.
        boundaries = [*boundaries, shared - b]
    return rules.sliding_window_retention_mask(
        start,
        end,
        alignment_tokens=s.layout.block_size,
        block_size=b,
        contiguous_blocks=rules.sliding_window_contiguous_blocks(spec.sliding_window, b, eagle),
        use_eagle=eagle,
        retention_interval=s.layout.retention_interval,
        reachable_boundaries=boundaries,
    )


def _store_masked(
    s: ManagerState,
    request: RequestLike,
    row: int,
    g: int,
    start: int,
    num_full: int,
    entries: list[tuple[int, int, int]],
    boundaries: list[int] | None,
) -> list[int] | None:
    """``cache_uniform`` of group ``g`` where sparse retention or events need its stored
    positions: its entries appended to ``entries``, its ``BlockStored`` event emitted; the
    reachable boundaries, computed once the first sparse group needs them."""
    pool, b = s.pool, s.layout.block_size
    hashes = request.block_hashes
    base = s.tables.base(g, row)
    stored = []
    mask: Sequence[bool] | None = None
    if g in s.layout.columns.sparse_groups:
        if boundaries is None:
            boundaries = reachable_boundaries(s, request)
        mask = retention_mask(s, request, g, start, num_full, boundaries)
    for pos, block in enumerate(s.tab.a[base + start : base + num_full], start):
        if block and (mask is None or mask[pos - start]):
            entries.append((block, g, pos))
            stored.append(pos)
    if mask is not None and stored:
        s.rows.kept[s.rows.index(row, g)] = stored[-1] + 1
    if pool.event_builder is not None:
        parent = hashes[start - 1] if start else None
        pool.events.append(
            pool.event_builder.stored(
                request, [hashes[p] for p in stored], stored, parent, start * b, num_full * b, b, g
            )
        )
    return boundaries


def _insert(
    s: ManagerState,
    entries: list[tuple[int, int, int]],
    hashes: Sequence[BlockHash],
    src: int,
    defer: bool,
) -> None:
    """Enter ``entries`` (block, group, position) into the prefix cache, keyed by the hash at
    each position: into the pending work with ``defer``, else one by one or in numpy calls."""
    pool = s.pool
    if defer:
        pool.defer_entries(entries, hashes, src)
        return
    if len(entries) < pool.insert_min:
        pool.insert_entries(entries, hashes, src)
        return
    blocks, groups, positions = (
        np.array(column, dtype=np.int64) for column in zip(*entries, strict=True)
    )
    keys = pool.keys_of([hashes[p] for _, _, p in entries])
    pool.insert_array(blocks, groups, positions, keys, src)


def cache_busy(
    s: ManagerState,
    requests: Sequence[RequestLike],
    rows: Ints,
    pair_index: Ints,
    table_base: Ints,
    cached: Ints,
    to_cache: Ints,
) -> None:
    """``cache_uniform`` for the busy requests of a whole step (``hybridkv.optimized.batch``)
    that fill blocks, in their order: a request
    that fills one block in every group (a decode step's) in a few operations, another by its
    single-request path."""
    g_count = s.layout.num_groups
    b = s.layout.block_size
    active = np.flatnonzero(to_cache.sum(1))
    starts = cached[active]
    # A decode step's request fills one block in every group, all at the same position, and
    # every one of them is real (a window smaller than a block may have let one go already).
    positions = starts[:, 0]
    flat = table_base.reshape(-1, g_count)[active] + positions[:, None]
    found = s.tables.host.n[flat]
    decode = (to_cache[active] == 1).all(1) & (starts == positions[:, None]).all(1)
    decode &= (found != 0).all(1)
    if not s.layout.columns.defers:
        decode[:] = False
    starts_at = positions.tolist()
    run: list[int] = []  # the decode rows not deferred yet (indices into ``active``)
    hashes: list[BlockHash] = []
    srcs: list[int] = []
    for k, (i, row, pos, plain) in enumerate(
        zip(active.tolist(), rows[active].tolist(), starts_at, decode.tolist(), strict=True)
    ):
        request = requests[i]
        if plain:
            srcs.append(source_of(s, request, row, pos + 1, (pos + 1) * b))
            hashes.append(request.block_hashes[pos])
            run.append(k)
        else:
            if run:  # the rows before this request's first: inserts keep their order
                _defer_run(s, found, starts_at, run, hashes, srcs)
                run, hashes, srcs = [], [], []
            num_full = int((cached[i] + to_cache[i]).max())
            cache_uniform(s, request, int(row), num_full * b, defer=s.layout.columns.defers)
    if run:
        _defer_run(s, found, starts_at, run, hashes, srcs)
    done = active[decode]
    s.rows.columns[2][pair_index[done]] = (positions[decode] + 1)[:, None]


def _defer_run(
    s: ManagerState,
    found: Ints,
    positions: list[int],
    run: list[int],
    hashes: list[BlockHash],
    srcs: list[int],
) -> None:
    """Defer ``cache_busy``'s decode rows ``run`` (indices into ``found``'s rows and
    ``positions``; ``hashes`` and ``srcs`` are theirs) at once (``defer_rows`` of an array)."""
    if len(run) == len(positions):  # every row (a decode step's): no copies
        s.pool.defer_rows(found, positions, hashes, srcs, s.layout.columns.group_ids)
    else:
        at = [positions[k] for k in run]
        s.pool.defer_rows(found[run], at, hashes, srcs, s.layout.columns.group_ids)
