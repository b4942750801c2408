"""Whole-step calls: ``allocate_slots_batch`` and ``free_batch``, vectorised across requests.

Each is exactly the single-request call applied to each request in order (same results, same
``None``s, same free-queue order, events and statistics).

``allocate_slots_batch`` (running requests, no new cache hits) works in three stages:

1. Read every request's row and computed tokens (``hybridkv.optimized.batch_fields``: the last
   batch's rows remembered, column requests' counts one gather) and compare them with
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

``free_batch`` lives in ``hybridkv.optimized.batch_free``. The single calls a step leaves
(all of them, or the few busy requests) are made by the manager (``TorchKVCacheManager``).

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

from collections.abc import Sequence
from operator import attrgetter, countOf

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.batch_fields import step_fields
from hybridkv.optimized.caching import cache_busy
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.spec.errors import check_non_negative

Ints = npt.NDArray[np.int64]

_NUM_TOKENS = attrgetter("num_tokens")
_HASHES = attrgetter("block_hashes")
_TOKEN_LIST = attrgetter("_all_token_ids")
_HASH_LIST = attrgetter("_block_hashes")


def expand(counts: Ints, total: int | None = None) -> tuple[Ints, Ints]:
    """For per-pair counts (adding up to ``total`` where the caller knows it): each element's
    pair, and its rank within its pair."""
    if total is None:
        total = int(counts.sum())
    else:
        pair = np.flatnonzero(counts)
        if pair.shape[0] == total:  # every count 0 or 1 (a decode step's): all rank 0
            return pair, np.zeros(total, dtype=np.int64)
    pair = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    rank: Ints = np.arange(total, dtype=np.int64) - starts[pair]
    return pair, rank


Served = tuple[list[KVCacheBlocks | None], list[tuple[int, int, int]]]
"""A step's results, and the (index, new tokens, row) of the few busy requests it leaves to
the single-request calls (to be made in that order)."""


def counts_of(
    requests: Sequence[RequestLike], num_new_tokens: Sequence[int] | int
) -> Sequence[int]:
    """Each request's new tokens; ``ValueError`` unless there is one count per request."""
    n = len(requests)
    counts = [num_new_tokens] * n if isinstance(num_new_tokens, int) else num_new_tokens
    if len(counts) != n:
        raise ValueError(f"num_new_tokens must give one count per request ({n}), got {len(counts)}")
    return counts


def allocate_slots_batch(
    s: ManagerState,
    requests: Sequence[RequestLike],
    num_new_tokens: Sequence[int] | int,
    num_lookahead_tokens: int = 0,
    delay_cache_blocks: bool = False,
    reserved_blocks: int = 0,
    watermark_blocks: int = 0,
) -> Served | None:
    """The vectorised step of ``allocate_slots_batch``, or ``None`` (nothing changed) where it
    does not apply and every request takes the single-request call."""
    if (
        len(requests) >= s.tuning.batch_min
        and s.layout.columns.vectorisable
        and _kept_free(reserved_blocks, watermark_blocks)
    ):
        return _allocate_vectorised(
            s,
            requests,
            num_new_tokens,
            num_lookahead_tokens,
            delay_cache_blocks,
            kept_free=reserved_blocks + watermark_blocks,
        )
    return None


def _kept_free(reserved_blocks: int, watermark_blocks: int) -> bool:
    """Whether both are valid counts (otherwise the single calls raise, in their order)."""
    return all(type(value) is int and value >= 0 for value in (reserved_blocks, watermark_blocks))


def _allocate_vectorised(
    s: ManagerState,
    requests: Sequence[RequestLike],
    num_new_tokens: Sequence[int] | int,
    lookahead: int,
    delay: bool,
    kept_free: int = 0,
) -> Served | None:
    """The vectorised step, or ``None`` (nothing changed) when it does not apply. A request
    below its row's ``quiet_below`` would change nothing: only the others are worked on.

    ``kept_free`` blocks (reserved and watermark) must stay free after each request's take:
    the step applies only when they stay free after all of them (then every request's own
    check passes too, also that of a request needing no block). With ``kept_free``, busy
    requests served one by one would leave the others' checks unmade: all go to the single
    calls instead."""
    n = len(requests)
    if n == 0:
        return [], []
    if not _applies(s, n, num_new_tokens, lookahead, kept_free):
        return None
    fields = step_fields(s, requests)
    if fields is None:
        return None
    rows, comp = fields
    new_tokens = (
        num_new_tokens if isinstance(num_new_tokens, int) else np.array(num_new_tokens, np.int64)
    )
    busy = comp + new_tokens + lookahead >= s.rows.thresholds[3, rows]
    chosen = np.flatnonzero(busy)
    out: list[KVCacheBlocks | None] = [KVCacheBlocks(((),) * s.layout.num_groups)] * n
    s.pool.paths.ran(paths.BATCH_QUIET, n - chosen.shape[0])
    if chosen.shape[0] == 0:
        return out, []
    picked = chosen.tolist()
    each = (
        [num_new_tokens] * len(picked)
        if isinstance(num_new_tokens, int)
        else [num_new_tokens[i] for i in picked]
    )
    if len(picked) < s.tuning.busy_batch_min:
        if kept_free:
            return None
        s.pool.paths.ran(paths.BATCH_ONE_BY_ONE)
        return out, list(zip(picked, each, rows[chosen].tolist(), strict=True))
    busy_requests = [requests[i] for i in picked]
    caching = s.layout.caching and not delay
    comp = np.minimum(comp[chosen], s.layout.max_model_len)
    added = np.array(each, dtype=np.int64)
    need = np.minimum(comp + added + lookahead, s.layout.max_model_len)
    cache_tokens = num_hashes = None
    if caching:
        cache_tokens, num_hashes = _cache_counts(busy_requests, comp + added)
    done = _step_busy(
        s, busy_requests, rows[chosen], comp, need, cache_tokens, num_hashes, kept_free
    )
    if done is None:
        return None
    for i, result in zip(picked, done, strict=True):
        out[i] = result
    return out, []


def _applies(
    s: ManagerState, n: int, num_new_tokens: Sequence[int] | int, lookahead: int, kept_free: int
) -> bool:
    """Whether the vectorised step may apply to ``n`` requests (the pool settled first): no
    events, the kept free blocks free, valid counts (else the single calls raise)."""
    pool = s.pool
    if pool.event_builder is not None:
        return False  # events interleave with each request's takes: one by one
    s.settle()
    if kept_free > pool.num_free_blocks:
        return False  # a request may fail even without taking a block: the single calls say
    check_non_negative("num_lookahead_tokens", lookahead)
    if isinstance(num_new_tokens, int):
        return type(num_new_tokens) is int and num_new_tokens >= 1
    return countOf(map(type, num_new_tokens), int) == n and min(num_new_tokens) >= 1


def _cache_counts(requests: Sequence[RequestLike], limit: Ints) -> tuple[Ints, Ints]:
    """Per busy request, the tokens its blocks fill (at most ``limit``) and its hash count."""
    own = countOf(map(type, requests), Request) == len(requests)
    count = len(requests)
    tokens = map(len, map(_TOKEN_LIST, requests)) if own else map(_NUM_TOKENS, requests)
    cache_tokens = np.minimum(limit, np.fromiter(tokens, np.int64, count))
    hashes = map(_HASH_LIST, requests) if own else map(_HASHES, requests)
    return cache_tokens, np.fromiter(map(len, hashes), np.int64, count)


def _step_busy(
    s: ManagerState,
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
    pool, b, w = s.pool, s.layout.block_size, s.layout.max_blocks_per_req
    in_flight = np.array([r.num_in_flight_tokens for r in requests], dtype=np.int64)
    # A step still in flight reads the window's blocks: windows release on the processed count.
    processed = np.maximum(comp - in_flight, 0)
    pair_index = s.rows.pair_index(rows)  # [n, G]: request-major pairs
    length, nulls, cached = s.rows.gather(pair_index)
    columns = s.layout.columns
    skipped, released = _released(s, processed, length, nulls)
    new = np.maximum((need + (b - 1))[:, None] // b - length, 0)
    to_cache = None
    if cache_tokens is not None:
        to_cache = _to_cache(b, cache_tokens, num_hashes, cached)
        if columns.sparse_groups and bool(to_cache[:, columns.sparse_groups].any()):
            return None  # sparse retention masks what a group caches: one by one
    total_new = int(new.sum())
    if total_new + kept_free > pool.num_free_blocks:
        return None
    table_base = ((rows[:, None] + columns.table_rows) * w).ravel()  # [n·G]: each's position 0
    tab = s.tables.host.n
    num_released = int(released.sum())
    if num_released:
        # Released positions in sequential order: request, group, position high to low.
        per_pair = released.ravel()
        pair, rank = expand(per_pair, num_released)
        release_flat = (table_base + skipped.ravel() - 1)[pair] - rank
        blocks = tab[release_flat].astype(np.int64)
        if not bool((pool.src.n[blocks] >= 0).all()):
            return None  # a block without a hash would go to the head: one by one
    # Nothing has changed so far; from here on the step cannot fail.
    pool.paths.ran(paths.BATCH_RELEASES if num_released else paths.BATCH_VECTORISED)
    if num_released:
        _release(s, release_flat, blocks)
        s.rows.columns[1][pair_index] = nulls = np.maximum(nulls, skipped)
    taken = pool.pop_array(total_new)
    active: list[int] = []
    if total_new:
        per_pair = new.ravel()
        pair, rank = expand(per_pair, total_new)
        flat = (table_base + length.ravel())[pair] + rank
        tab[flat] = taken
        s.rows.columns[0][pair_index] = length = length + new
        s.tables.touched_at(flat)
        active = np.flatnonzero(new.sum(1)).tolist()
    if to_cache is not None and bool(to_cache.any()):
        cache_busy(s, requests, rows, pair_index, table_base, cached, to_cache)
        cached = s.rows.columns[2][pair_index]
    s.thresholds.refresh_rows(rows, length, nulls, cached)
    return _results(s.layout.num_groups, len(requests), active, new, taken.tolist())


def _to_cache(b: int, cache_tokens: Ints, num_hashes: Ints | None, cached: Ints) -> Ints:
    """``[n, G]``: the blocks each busy pair fills, up to its tokens and its hashed blocks."""
    num_full = cache_tokens // b
    if num_hashes is not None:
        num_full = np.minimum(num_full, num_hashes)  # the hashed blocks only
    filled: Ints = np.maximum(num_full[:, None] - cached, 0)
    return filled


def _release(s: ManagerState, flat: Ints, blocks: Ints) -> None:
    """Null the released positions (``flat`` in the host tables, holding ``blocks``) and
    release their blocks, all cached: to the pending work where the layout defers."""
    s.tables.host.n[flat] = 0
    if s.layout.columns.defers:
        s.pool.pending.release_array(blocks)
    else:
        s.pool.release_cached(blocks)
    s.tables.touched_at(flat)


def _released(s: ManagerState, processed: Ints, length: Ints, nulls: Ints) -> tuple[Ints, Ints]:
    """``[n, G]``: the positions each busy pair's window or chunk skips after the step, and
    how many of them it releases now."""
    columns, b = s.layout.columns, s.layout.block_size
    if not columns.releases:
        return nulls, np.zeros_like(nulls)
    tokens = np.maximum(processed[:, None] - columns.window_less_one, 0)
    if columns.chunk is not None:
        tokens = np.where(
            columns.chunk > 0,
            processed[:, None] // columns.chunk_or_one * columns.chunk,
            tokens,
        )
    skipped = np.minimum(tokens // b, length)
    return skipped, np.maximum(skipped - nulls, 0)


def _results(
    g_count: int, n: int, active: list[int], new: Ints, popped: list[int]
) -> list[KVCacheBlocks | None]:
    """Each busy request's new blocks per group, cut from ``popped`` in request-major order
    (``active``: the requests that took any)."""
    out: list[KVCacheBlocks | None] = [KVCacheBlocks(((),) * g_count)] * n
    counts = new[active]
    if bool((counts == 1).all()):
        # A decode step's one block per group each: its groups are G consecutive 1-tuples.
        each = zip(*[iter(zip(popped))] * g_count, strict=True)
        for i, blocks in zip(active, map(KVCacheBlocks, each), strict=True):
            out[i] = blocks
        return out
    at = 0
    for i, per_group in zip(active, counts.tolist(), strict=True):
        groups = []
        for count in per_group:
            groups.append(tuple(popped[at : at + count]))
            at += count
        out[i] = KVCacheBlocks(tuple(groups))
    return out
