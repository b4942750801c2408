"""Whole-step calls: ``allocate_slots_batch`` and ``free_batch``, vectorised across requests.

Each is exactly the single-request call applied to each request in order (same results, same
``None``s, same free-queue order, events and statistics).

``allocate_slots_batch`` (running requests, no new cache hits) works in three stages:

1. Read every request's row and computed tokens (C-level ``map`` calls) and compare them with
   its row's ``quiet_below`` (``RowTables``, ``hybridkv.optimized.rows``): a request whose
   computed, new and lookahead tokens stay below it needs no new block, releases nothing from
   a window or chunk and fills no block; it would change nothing and gets no blocks, so it is
   not looked at again. In a decode step that is most of them. (The comparison errs only
   towards work: a window releases on the computed tokens less those in flight, and a block
   fills only up to the request's tokens; the tokens, hashes and tokens in flight of the
   requests found busy are read for the exact step.) With caching on, the requests' hash
   counts are checked too (``check_block_hashes``), where they are not sound by construction.
2. The requests left ("busy") are served by the single-request call, one by one, if they are
   fewer than ``busy_batch_min`` (with reserved or watermark blocks, every request is: a
   request needing no block fails too when too few are free).
3. Otherwise by the vectorised step, which needs: every request running and listed once, valid
   arguments, enough free blocks for the whole step and the reserved and watermark blocks
   (then no request can fail and every block it takes comes from the head of the queue as it
   was), every block released from a window or chunk holding a cached hash (then each release
   is an append at the tail, whatever the interleaving with the takes), no KV events, and no
   sparse retention group caching. Where that does not hold, the busy requests are served one
   by one, before anything has changed. Its releases and inserts go to the pool's pending work
   where the manager defers a running step's (``hybridkv.optimized.pending``), else to the pool
   at once.

``free_batch`` is always vectorised (for ``batch_min`` requests or more): the release order of
sequential calls is a function of the batch (tail appends in walk order of each block's last
release; head inserts batch by batch, the last batch first).

Data layout
-----------
Per call, everything is an ``[n, G]`` int64 numpy array (n requests, G groups; request-major, so
that flattening gives the order of sequential calls) gathered from the row counters
(``RowTables.gather``: one fancy index at ``row × G + g``): table lengths, leading nulls,
cached positions, released positions, new blocks, blocks to cache. Released and new positions
are enumerated with ``repeat`` over those counts and become flat indices
``(g × R + row) × W + pos`` into the host tables. Only the blocks taken from the free queue (a
linked-list walk), the requests' hashes and sources (Python objects owned by the requests) and
the results are touched one request at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import attrgetter, countOf
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hybridkv.optimized.thresholds import INSERT_MIN
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.spec.errors import check_non_negative

if TYPE_CHECKING:
    from hybridkv.optimized.manager import TorchKVCacheManager

Ints = npt.NDArray[np.int64]

_ID = attrgetter("request_id")
_COMPUTED = attrgetter("num_computed_tokens")
_NUM_TOKENS = attrgetter("num_tokens")
_HASHES = attrgetter("block_hashes")
_TOKEN_LIST = attrgetter("_all_token_ids")
_HASH_LIST = attrgetter("_block_hashes")
_HASH_BLOCK_SIZE = attrgetter("hash_block_size")
_HASH_LOOKAHEAD = attrgetter("num_hash_lookahead_tokens")


def _expand(counts: Ints) -> tuple[Ints, Ints]:
    """For per-pair counts: each element's pair, and its rank within its pair."""
    total = int(counts.sum())
    pair = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    rank: Ints = np.arange(total, dtype=np.int64) - starts[pair]
    return pair, rank


def allocate_slots_batch(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    num_new_tokens: Sequence[int] | int,
    num_lookahead_tokens: int = 0,
    delay_cache_blocks: bool = False,
    reserved_blocks: int = 0,
    watermark_blocks: int = 0,
) -> list[KVCacheBlocks | None]:
    """``[m.allocate_slots(r, n, num_lookahead_tokens=…, delay_cache_blocks=…,
    reserved_blocks=…, watermark_blocks=…) for r, n]``."""
    n = len(requests)
    counts: Sequence[int] = (
        [num_new_tokens] * n if isinstance(num_new_tokens, int) else num_new_tokens
    )
    if len(counts) != n:
        raise ValueError(f"num_new_tokens must give one count per request ({n}), got {len(counts)}")
    # The single calls made here (a small batch, the few busy requests of a step) leave their
    # table changes to one flush at the end: one host→device copy per step.
    with m.tables.one_copy():
        if (
            n >= m.batch_min
            and m.columns.vectorisable
            and _kept_free(reserved_blocks, watermark_blocks)
        ):
            done = _allocate_vectorised(
                m,
                requests,
                num_new_tokens,
                num_lookahead_tokens,
                delay_cache_blocks,
                kept_free=reserved_blocks + watermark_blocks,
            )
            if done is not None:
                return done
        return [
            m.allocate_slots(
                r,
                c,
                num_lookahead_tokens=num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks,
                reserved_blocks=reserved_blocks,
                watermark_blocks=watermark_blocks,
            )
            for r, c in zip(requests, counts, strict=True)
        ]


def _kept_free(reserved_blocks: int, watermark_blocks: int) -> bool:
    """Whether both are valid counts (otherwise the single calls raise, in their order)."""
    return all(type(value) is int and value >= 0 for value in (reserved_blocks, watermark_blocks))


def _step_fields(
    m: TorchKVCacheManager, requests: Sequence[RequestLike]
) -> tuple[Ints, Ints] | None:
    """Rows and computed tokens per request, each an int64 array; ``None`` unless every
    request is running, listed once and hashed soundly (with caching)."""
    found = m.rows.rows_of(map(_ID, requests))
    if None in found:
        return None
    rows = np.array(found, dtype=np.int64)
    if np.bincount(rows, minlength=1).max() > 1:
        return None  # a request listed twice
    if m.enable_caching and not _hashed_soundly(m, requests):
        return None  # a request hashed at another block size: the single calls raise
    computed = array("q")
    computed.extend(map(_COMPUTED, requests))
    return rows, np.frombuffer(computed, dtype=np.int64)


def _hashed_soundly(m: TorchKVCacheManager, requests: Sequence[RequestLike]) -> bool:
    """Whether no request has more block hashes than full blocks (``check_block_hashes``). A
    ``Request`` hashed at the manager's block size, with at least its lookahead, has none by
    construction; other requests are counted."""
    n = len(requests)
    if (
        countOf(map(type, requests), Request) == n
        and countOf(map(_HASH_BLOCK_SIZE, requests), m.hash_block_size) == n
        and min(map(_HASH_LOOKAHEAD, requests)) >= m.lookahead
    ):
        return True
    num_tokens = np.fromiter(map(_NUM_TOKENS, requests), np.int64, n)
    num_hashes = np.fromiter(map(len, map(_HASHES, requests)), np.int64, n)
    limit = np.maximum(num_tokens - m.lookahead, 0) // m.hash_block_size
    return not bool((num_hashes > limit).any())


def _allocate_vectorised(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    num_new_tokens: Sequence[int] | int,
    lookahead: int,
    delay: bool,
    kept_free: int = 0,
) -> list[KVCacheBlocks | None] | None:
    """The vectorised step, or ``None`` (nothing changed) when it does not apply.

    A request whose computed, new and lookahead tokens stay below its row's ``quiet_below``
    would take no block, release none and cache none: its call would return no blocks and
    change nothing, so only the others are worked on, one by one if they are few.

    ``kept_free`` blocks (reserved and watermark) must stay free after each request's take.
    The step applies only when they stay free after all of them: then every request's own
    check passes too (the free count never drops below its start less the blocks taken so
    far), also that of a request needing no block, which fails only below ``kept_free``. Busy
    requests served one by one would leave the others' checks unmade: with ``kept_free`` the
    whole batch goes to the single calls instead.
    """
    n = len(requests)
    if n == 0:
        return []
    pool = m.pool
    if pool.event_builder is not None:
        return None  # events interleave with each request's takes: one by one
    m._settle()
    if kept_free > pool.num_free_blocks:
        return None  # a request may fail even without taking a block: the single calls say
    check_non_negative("num_lookahead_tokens", lookahead)
    if isinstance(num_new_tokens, int):
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            return None
    elif countOf(map(type, num_new_tokens), int) != n or min(num_new_tokens) < 1:
        return None
    fields = _step_fields(m, requests)
    if fields is None:
        return None
    rows, comp = fields
    new_tokens: Ints | int = (
        num_new_tokens
        if isinstance(num_new_tokens, int)
        else np.array(num_new_tokens, dtype=np.int64)
    )
    busy = comp + new_tokens + lookahead >= m.rows.thresholds[3, rows]
    chosen = np.flatnonzero(busy)
    out: list[KVCacheBlocks | None] = [KVCacheBlocks(((),) * m.num_groups)] * n
    if chosen.shape[0] == 0:
        return out
    picked = chosen.tolist()
    each = (
        [num_new_tokens] * len(picked)
        if isinstance(num_new_tokens, int)
        else [num_new_tokens[i] for i in picked]
    )
    if len(picked) < m.busy_batch_min:
        if kept_free:
            return None
        for i, count in zip(picked, each, strict=True):
            out[i] = m.allocate_slots(
                requests[i], count, num_lookahead_tokens=lookahead, delay_cache_blocks=delay
            )
        return out
    busy_requests = [requests[i] for i in picked]
    caching = m.enable_caching and not delay
    comp = np.minimum(comp[chosen], m.max_model_len)
    added = np.array(each, dtype=np.int64)
    need = np.minimum(comp + added + lookahead, m.max_model_len)
    cache_tokens = num_hashes = None
    if caching:
        own = countOf(map(type, busy_requests), Request) == len(busy_requests)
        count = len(picked)
        tokens = (
            map(len, map(_TOKEN_LIST, busy_requests)) if own else map(_NUM_TOKENS, busy_requests)
        )
        cache_tokens = np.minimum(comp + added, np.fromiter(tokens, np.int64, count))
        hashes = map(_HASH_LIST, busy_requests) if own else map(_HASHES, busy_requests)
        num_hashes = np.fromiter(map(len, hashes), np.int64, count)
    done = _step_busy(
        m, busy_requests, rows[chosen], comp, need, cache_tokens, num_hashes, kept_free
    )
    if done is None:
        return None
    for i, result in zip(picked, done, strict=True):
        out[i] = result
    return out


def _step_busy(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    rows: Ints,
    comp: Ints,
    need: Ints,
    cache_tokens: Ints | None,
    num_hashes: Ints | None,
    kept_free: int,
) -> list[KVCacheBlocks | None] | None:
    """The vectorised step of the busy requests (``None``, nothing changed, where it does not
    apply): their releases, takes and inserts in the order of their single calls."""
    pool, b, w = m.pool, m.block_size, m.max_blocks_per_req
    in_flight = np.fromiter(
        (getattr(r, "num_in_flight_tokens", 0) for r in requests), np.int64, len(requests)
    )
    # A step still in flight reads the window's blocks: windows release on the processed count.
    processed = np.maximum(comp - in_flight, 0)
    pair_index = m.rows.pair_index(rows)  # [n, G]: request-major pairs
    length, nulls, cached = m.rows.gather(pair_index)
    columns = m.columns
    if columns.releases:
        tokens = np.maximum(processed[:, None] - columns.window_less_one, 0)
        if columns.chunk is not None:
            tokens = np.where(
                columns.chunk > 0,
                processed[:, None] // columns.chunk_or_one * columns.chunk,
                tokens,
            )
        skipped = np.minimum(tokens // b, length)
        released = np.maximum(skipped - nulls, 0)
    else:
        skipped = nulls
        released = np.zeros_like(nulls)
    new = np.maximum((need + (b - 1))[:, None] // b - length, 0)
    to_cache = None
    if cache_tokens is not None:
        num_full = cache_tokens // b
        if num_hashes is not None:
            num_full = np.minimum(num_full, num_hashes)  # the hashed blocks only
        to_cache = np.maximum(num_full[:, None] - cached, 0)
        if columns.sparse_groups and bool(to_cache[:, columns.sparse_groups].any()):
            return None  # sparse retention masks what a group caches: one by one
    total_new = int(new.sum())
    if total_new + kept_free > pool.num_free_blocks:
        return None
    # [n·G] flat index of position 0 of each pair's table
    table_base = ((rows[:, None] + columns.table_rows) * w).ravel()
    tab = m.tables.host.n
    num_released = int(released.sum())
    if num_released:
        # Released positions in sequential order: request, group, position high to low.
        per_pair = released.ravel()
        pair, rank = _expand(per_pair)
        release_flat = (table_base + skipped.ravel() - 1)[pair] - rank
        blocks = tab[release_flat].astype(np.int64)
        if not bool((pool.src.n[blocks] >= 0).all()):
            return None  # a block without a hash would go to the head: one by one
    # Nothing has changed so far; from here on the step cannot fail.
    tables = m.tables
    if num_released:
        tab[release_flat] = 0
        m.rows.columns[1][pair_index] = np.maximum(nulls, skipped)
        if m.columns.defers:
            pool.pending.release(blocks.tolist())
        else:
            pool.release_cached(blocks)
        tables.touched_at(release_flat)
    popped = pool.pop_n(total_new)
    active: list[int] = []
    if total_new:
        per_pair = new.ravel()
        pair, rank = _expand(per_pair)
        flat = (table_base + length.ravel())[pair] + rank
        tab[flat] = popped
        m.rows.columns[0][pair_index] = length + new
        tables.touched_at(flat)
        active = np.flatnonzero(new.sum(1)).tolist()
    if to_cache is not None and bool(to_cache.any()):
        _cache_busy(m, requests, rows, pair_index, table_base, cached, to_cache)
    m.thresholds.refresh_rows(rows)
    out: list[KVCacheBlocks | None] = [KVCacheBlocks(((),) * m.num_groups)] * len(requests)
    if active:
        g_count = m.num_groups
        at = 0
        for i, per_group in zip(active, new[active].tolist(), strict=True):
            if per_group.count(1) == g_count:  # a decode step's one block per group
                out[i] = KVCacheBlocks(tuple(zip(popped[at : at + g_count])))
                at += g_count
                continue
            groups = []
            for count in per_group:
                groups.append(tuple(popped[at : at + count]))
                at += count
            out[i] = KVCacheBlocks(tuple(groups))
    return out


def _cache_busy(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    rows: Ints,
    pair_index: Ints,
    table_base: Ints,
    cached: Ints,
    to_cache: Ints,
) -> None:
    """``_cache`` for the busy requests of a step that fill blocks, in their order: a request
    that fills one block in every group (a decode step's) in a few operations, another by its
    single-request path."""
    g_count = m.num_groups
    b = m.block_size
    active = np.flatnonzero(to_cache.sum(1))
    starts = cached[active]
    # A decode step's request fills one block in every group, all at the same position, and
    # every one of them is real (a window smaller than a block may have let one go already).
    positions = starts[:, 0]
    flat = table_base.reshape(-1, g_count)[active] + positions[:, None]
    found = m.tables.host.n[flat]
    decode = (to_cache[active] == 1).all(1) & (starts == positions[:, None]).all(1)
    decode &= (found != 0).all(1)
    if not m.columns.defers:
        decode[:] = False
    row_blocks = found.tolist()
    group_ids = m.columns.group_ids
    defer_row, source_of = m.pool.defer_row, m._source_of
    for i, row, pos, blocks, plain in zip(
        active.tolist(),
        rows[active].tolist(),
        positions.tolist(),
        row_blocks,
        decode.tolist(),
        strict=True,
    ):
        request = requests[i]
        if plain:
            src = source_of(request, row, pos + 1, (pos + 1) * b)
            defer_row(blocks, group_ids, pos, request.block_hashes[pos], src)
        else:
            num_full = int((cached[i] + to_cache[i]).max())
            m._cache(request, int(row), num_full * b, defer=m.columns.defers)
    done = active[decode]
    m.rows.columns[2][pair_index[done]] = (positions[decode] + 1)[:, None]


def free_batch(m: TorchKVCacheManager, requests: Sequence[RequestLike]) -> None:
    """``for r in requests: m.free(r)``, vectorised."""
    pool = m.pool
    seen: set[str] = set()
    order: list[tuple[str, int]] = []
    for r in requests:
        rid = r.request_id
        row = m.rows.row_of(rid)
        if row is not None and rid not in seen:
            seen.add(rid)
            order.append((rid, row))
    if len(order) < m.batch_min or m.columns.mamba_align:
        for r in requests:
            m.free(r)
        return
    w = m.max_blocks_per_req
    rows = np.array([row for _, row in order], dtype=np.int64)
    length, nulls, _ = m.rows.gather(m.rows.pair_index(rows))
    real = (length - nulls).ravel()  # one release batch per (request, group): its real blocks
    total = int(real.sum())
    if total:
        pair, rank = _expand(real)
        table_base = ((rows[:, None] + m.columns.table_rows) * w).ravel()
        blocks = m.tables.host.n[(table_base + length.ravel() - 1)[pair] - rank].astype(np.int64)
        unique, inverse, repeats = np.unique(blocks, return_inverse=True, return_counts=True)
        ref = pool.ref.n
        final = ref[unique] - repeats
        ref[unique] = final
        zero = final == 0
        if bool(zero.any()):
            last = np.zeros(unique.shape[0], dtype=np.int64)
            np.maximum.at(last, inverse, np.arange(total))
            freed, freed_last = unique[zero], last[zero]
            hashed = pool.src.n[freed] >= 0
            tail = freed[hashed][np.argsort(freed_last[hashed])]
            # Head inserts: the last batch ends up first; within a batch, walk order.
            head_last = freed_last[~hashed]
            key = -pair[head_last] * (total + 1) + head_last
            head = freed[~hashed][np.argsort(key)]
            for part, at_head in ((head, True), (tail, False)):
                if part.shape[0] == 0:
                    continue
                node = pool.head if at_head else pool.prev.a[pool.tail]
                if part.shape[0] >= INSERT_MIN:
                    pool.link_after_array(node, part)
                else:
                    pool.link_after(node, part.tolist())
    for rid, row in order:
        m._release_row(rid, row)
