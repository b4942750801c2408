"""Whole-step calls: ``allocate_slots_batch`` and ``free_batch``, vectorised across requests.

Each is exactly the single-request call applied to each request in order (same results, same
``None``s, same free-queue order, events and statistics).

``allocate_slots_batch`` (running requests, no new cache hits) works in three stages:

1. Read every request once (row, computed tokens, tokens in flight, tokens, hashes: C-level
   ``map`` calls; windows and chunks release on the computed tokens less those in flight) and
   compare with its row's thresholds (``RowTables.thresholds``, ``hybridkv.optimized.rows``):
   a request that needs no new block, releases nothing from a window or chunk and fills no
   block would change nothing and gets no blocks, so it is not looked at again. In a decode
   step that is most of them.
2. The requests left ("busy") are served by the single-request call, one by one, if they are
   fewer than ``busy_batch_min`` (with reserved or watermark blocks, every request is: a
   request needing no block fails too when too few are free).
3. Otherwise by the vectorised step, which needs: every request running and listed once, valid
   arguments, enough free blocks for the whole step and the reserved and watermark blocks
   (then no request can fail and every block it takes comes from the head of the queue as it
   was), and every block released from a
   window or chunk still held or holding a cached hash (then each release is an append at the
   tail, whatever the interleaving with the takes). Where that does not hold (a short pool, a
   bad argument, an uncached released block), the busy requests are served one by one, before
   anything has changed.

``free_batch`` is always vectorised (for ``batch_min`` requests or more): the release order of
sequential calls is a function of the batch (tail appends in walk order of each block's last
release; head inserts batch by batch, the last batch first).

Data layout
-----------
Per call, everything is an ``[n, G]`` int64 tensor (n requests, G groups; request-major, so
that flattening gives the order of sequential calls) gathered from the row counters
(``RowTables.gather``: one ``index_select`` at ``row × G + g``): table lengths, leading nulls,
cached positions, blocks required, released positions, new blocks, blocks to cache. Released, new
and cached positions are enumerated with ``repeat_interleave`` over those counts and become
flat indices ``(g × R + row) × W + pos`` into the table tensor. Only the blocks taken from the
free queue (a linked-list walk) and the hashes of newly full blocks (Python ``bytes`` owned by
the requests) are touched one by one.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, cast

import torch

from hybridkv.optimized._buffers import int32_from_bytes, tensor_from_ints
from hybridkv.optimized.block_pool import hash_key
from hybridkv.optimized.thresholds import INSERT_MIN
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import KVCacheEvent
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.spec.errors import check_non_negative

if TYPE_CHECKING:
    from hybridkv.optimized.manager import TorchKVCacheManager

_ID = attrgetter("request_id")
_COMPUTED = attrgetter("num_computed_tokens")
_NUM_TOKENS = attrgetter("num_tokens")
_HASHES = attrgetter("block_hashes")
_TOKEN_LIST = attrgetter("_all_token_ids")
_HASH_LIST = attrgetter("_block_hashes")


def _expand(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For per-pair counts: each element's pair, and its pair's start in the element order."""
    pair = torch.repeat_interleave(counts)
    starts = torch.cumsum(counts, 0) - counts
    return pair, starts


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
    m._settle()
    n = len(requests)
    counts: Sequence[int] = (
        [num_new_tokens] * n if isinstance(num_new_tokens, int) else num_new_tokens
    )
    if len(counts) != n:
        raise ValueError(f"num_new_tokens must give one count per request ({n}), got {len(counts)}")
    # The single calls made here (a small batch, the few busy requests of a step) leave their
    # table changes to one flush at the end: one host→device copy per step.
    outer, m._defer_flush = m._defer_flush, True
    try:
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
    finally:
        m._defer_flush = outer
        if not outer:
            m._flush()


def _kept_free(reserved_blocks: int, watermark_blocks: int) -> bool:
    """Whether both are valid counts (otherwise the single calls raise, in their order)."""
    return all(type(value) is int and value >= 0 for value in (reserved_blocks, watermark_blocks))


def _step_fields(
    m: TorchKVCacheManager, requests: Sequence[RequestLike], counts: Sequence[int] | None
) -> tuple[list[int], torch.Tensor] | None:
    """Rows, then [row, computed, in flight, num_tokens, (counts), (number of hashes)] per
    request as one int64 ``[fields, n]`` tensor; ``None`` unless every request is running and
    listed once."""
    n = len(requests)
    ids = list(map(_ID, requests))
    found = m.rows.rows_of(ids)
    if None in found or len(set(ids)) != n:
        return None
    rows = cast(list[int], found)
    data = array("q", rows)
    data.extend(map(_COMPUTED, requests))
    data.extend(int(getattr(r, "num_in_flight_tokens", 0)) for r in requests)
    if set(map(type, requests)) == {Request}:
        # The project's own requests: their properties return these lists, read here directly.
        data.extend(map(len, map(_TOKEN_LIST, requests)))
        hashes = _HASH_LIST
    else:
        data.extend(map(_NUM_TOKENS, requests))
        hashes = _HASHES
    fields = 4
    if counts is not None:
        data.extend(counts)
        fields += 1
    if m.enable_caching:
        data.extend(map(len, map(hashes, requests)))
        fields += 1
    return rows, torch.frombuffer(data, dtype=torch.int64).view(fields, n)


def _allocate_vectorised(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    num_new_tokens: Sequence[int] | int,
    lookahead: int,
    delay: bool,
    busy_only: bool = False,
    kept_free: int = 0,
) -> list[KVCacheBlocks | None] | None:
    """The vectorised step, or ``None`` (nothing changed) when it does not apply.

    A request that crosses none of its row's thresholds (``next``) would take no block,
    release none and cache none: its call would return no blocks and change nothing, so only
    the others are worked on, one by one if they are few (``busy_only``: they all are).

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
    if kept_free > m.pool.num_free_blocks:
        return None  # a request may fail even without taking a block: the single calls say
    check_non_negative("num_lookahead_tokens", lookahead)
    if isinstance(num_new_tokens, int):
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            return None
    elif set(map(type, num_new_tokens)) != {int} or min(num_new_tokens) < 1:
        return None
    fields = _step_fields(m, requests, None if isinstance(num_new_tokens, int) else num_new_tokens)
    if fields is None:
        return None
    rows_list, values = fields
    b, w, pool = m.block_size, m.max_blocks_per_req, m.pool
    rows, comp, in_flight, ntok = values[0], values[1], values[2], values[3]
    new_tokens = num_new_tokens if isinstance(num_new_tokens, int) else values[4]
    if m.enable_caching and bool((values[-1] != (ntok - m.lookahead).clamp(min=0) // b).any()):
        return None  # a request hashed at another block size: the single calls raise
    comp.clamp_(max=m.max_model_len)
    need = (comp + new_tokens + lookahead).clamp_(max=m.max_model_len)
    caching = m.enable_caching and not delay
    if caching:
        cache_tokens = torch.minimum(comp + new_tokens, ntok)
    # From here on ``comp`` is the processed count, what windows and chunks release on: the
    # computed tokens less those in flight (async scheduling), which a step still reads.
    comp = (comp - in_flight).clamp_(min=0)
    if not busy_only:
        thresholds = m.rows.thresholds[:, rows]
        busy = need > thresholds[0]
        if m.columns.releases:
            busy |= comp >= thresholds[1]
        if caching:
            busy |= cache_tokens >= thresholds[2]
        subset = torch.nonzero(busy).view(-1).tolist()
        if len(subset) < n:
            chosen = [requests[i] for i in subset]
            each = (
                [num_new_tokens] * len(subset)
                if isinstance(num_new_tokens, int)
                else [num_new_tokens[i] for i in subset]
            )
            merged: list[KVCacheBlocks | None] = [m._no_blocks] * n
            done: list[KVCacheBlocks | None] | None
            if len(subset) >= m.busy_batch_min:
                done = _allocate_vectorised(
                    m, chosen, each, lookahead, delay, busy_only=True, kept_free=kept_free
                )
                if done is None:
                    return None
            elif kept_free:
                return None
            else:
                done = [
                    m.allocate_slots(r, c, num_lookahead_tokens=lookahead, delay_cache_blocks=delay)
                    for r, c in zip(chosen, each, strict=True)
                ]
            for i, result in zip(subset, done, strict=True):
                merged[i] = result
            return merged
    pair_index = m.rows.pair_index(rows)  # [n, G]: request-major pairs
    length, nulls, cached = m.rows.gather(pair_index)
    required = (need + (b - 1)) // b
    new = (required[:, None] - length).clamp_(min=0)
    if m.columns.releases:
        tokens = (comp[:, None] - m.columns.window_less_one).clamp_(min=0)
        if m.columns.chunk is not None:
            tokens = torch.where(
                m.columns.chunk > 0,
                comp[:, None] // m.columns.chunk_or_one * m.columns.chunk,
                tokens,
            )
        skipped = torch.minimum(tokens.floor_divide_(b), length)
        released = (skipped - nulls).clamp_(min=0)
    else:
        skipped = released = torch.zeros_like(new)
    if caching:
        num_full = cache_tokens.floor_divide_(b)
        if m.lookahead:
            num_full = torch.minimum(num_full, values[-1])  # the hashed blocks only
        to_cache = (num_full[:, None] - cached).clamp_(min=0)
    else:
        to_cache = torch.zeros_like(new)
    if caching and m.columns.sparse_groups and bool(to_cache[:, m.columns.sparse_groups].any()):
        return None  # sparse retention masks what a group caches: one by one
    total_new, num_released, num_to_cache = (
        torch.stack((new, released, to_cache)).sum((1, 2)).tolist()
    )
    if total_new + kept_free > pool.num_free_blocks:
        return None
    # [n·G] flat index of position 0
    table_base = ((rows[:, None] + m.columns.table_rows) * w).view(-1)
    release_flat = freed = final = blocks = None
    if num_released:
        # Released positions in sequential order: request, group, position high to low.
        per_pair = released.view(-1)
        starts = torch.cumsum(per_pair, 0) - per_pair
        top = table_base + skipped.view(-1) - 1 + starts
        release_flat = top[torch.repeat_interleave(per_pair)] - torch.arange(num_released)
        blocks = m._tab.t.index_select(0, release_flat)
        if torch.unique(blocks).shape[0] == num_released:
            final = pool.ref.t.index_select(0, blocks) - 1
            freed = blocks[final == 0]  # walk order is sequential order: append as they come
        else:  # a block released twice: it is freed (if at all) at its last release
            unique, inverse, repeats = torch.unique(blocks, return_inverse=True, return_counts=True)
            final = pool.ref.t.index_select(0, unique) - repeats
            blocks = unique
            zero = final == 0
            last = torch.zeros(unique.shape[0], dtype=torch.int64).scatter_reduce_(
                0, inverse, torch.arange(num_released), "amax"
            )
            freed = unique[zero][torch.argsort(last[zero])]
        if freed.shape[0] and not bool((pool.src.t.index_select(0, freed) >= 0).all()):
            return None  # a block without a hash would go to the head: one by one
    # Nothing has changed so far; from here on the step cannot fail.
    if release_flat is not None:
        assert blocks is not None
        assert final is not None
        assert freed is not None
        m._tab.t.index_fill_(0, release_flat, 0)
        m.rows.columns[1].index_copy_(
            0, pair_index.view(-1), torch.maximum(nulls, skipped).view(-1)
        )
        pool.ref.t.index_copy_(0, blocks.to(torch.int64), final.to(torch.int32))
        m._dirty_index.append(release_flat)
    sink: list[tuple[int, KVCacheEvent]] | None = [] if pool.enable_kv_cache_events else None
    popped = pool.pop_n(total_new, sink)
    if freed is not None and freed.shape[0]:
        if freed.shape[0] >= INSERT_MIN:
            pool.link_after_tensor(pool.prev.a[pool.tail], freed)
        else:
            pool.link_after(pool.prev.a[pool.tail], freed.tolist())
    active: list[int] = []
    if total_new:
        per_pair = new.view(-1)
        first = table_base + length.view(-1) - (torch.cumsum(per_pair, 0) - per_pair)
        flat = first[torch.repeat_interleave(per_pair)] + torch.arange(total_new)
        m._tab.t.index_copy_(0, flat, torch.frombuffer(array("i", popped), dtype=torch.int32))
        m.rows.columns[0].index_copy_(0, pair_index.view(-1), (length + new).view(-1))
        m._dirty_index.append(flat)
        active = torch.nonzero(new.sum(1)).view(-1).tolist()
    events: list[list[KVCacheEvent]] | None = None
    if sink is not None:
        events = [[] for _ in range(n)]
        ends = torch.cumsum(new.sum(1), 0).tolist()
        owner = 0
        for pop_index, event in sink:
            while pop_index >= ends[owner]:
                owner += 1
            events[owner].append(event)
    if num_to_cache:
        _cache_vectorised(
            m, requests, rows_list, pair_index, table_base, cached, num_full, to_cache,
            num_to_cache, events,
        )  # fmt: skip
    if events is not None:
        for request_events in events:
            pool.events.extend(request_events)
    m._refresh_rows(rows)
    out: list[KVCacheBlocks | None] = [m._no_blocks] * n
    if active:
        at = 0
        for i, per_group in zip(active, new[active].tolist(), strict=True):
            groups = []
            for c in per_group:
                groups.append(tuple(popped[at : at + c]))
                at += c
            out[i] = KVCacheBlocks(tuple(groups))
    return out


def _cache_vectorised(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    rows_list: list[int],
    pair_index: torch.Tensor,
    table_base: torch.Tensor,
    cached: torch.Tensor,
    num_full: torch.Tensor,
    count: torch.Tensor,
    total: int,
    events: list[list[KVCacheEvent]] | None,
) -> None:
    """``_cache`` for every request of a step: the new full blocks of every group."""
    pool = m.pool
    g_count = m.num_groups
    active = torch.nonzero(count.sum(1)).view(-1)
    hashes: list[BlockHash] = []
    srcs: list[int] = []
    for i, starts, hi in zip(
        active.tolist(), cached[active].tolist(), num_full[active].tolist(), strict=True
    ):
        request = requests[i]
        own = request.block_hashes
        src = m._source_of(request, rows_list[i], hi, hi * m.block_size)
        lo = min(starts)
        if lo == max(starts):
            chunk = own[lo:hi]
            hashes.extend(chunk)
            for _ in range(g_count - 1):
                hashes.extend(chunk)
            srcs.extend([src] * (len(chunk) * g_count))
        else:
            for start in starts:
                if start < hi:
                    hashes.extend(own[start:hi])
                    srcs.extend([src] * (hi - start))
    per_pair = count.view(-1)
    pair = torch.repeat_interleave(per_pair)
    starts_of = torch.cumsum(per_pair, 0) - per_pair - cached.view(-1)
    pos = torch.arange(total) - starts_of[pair]
    blocks = m._tab.t.index_select(0, table_base.index_select(0, pair) + pos).to(torch.int64)
    groups = pair % g_count
    if events is not None:
        _stored_events(m, requests, pair, pos, blocks, hashes, events)
    real = blocks != 0
    if not bool(real.all()):
        keep = real.tolist()
        hashes = [h for h, k in zip(hashes, keep, strict=True) if k]
        srcs = [s for s, k in zip(srcs, keep, strict=True) if k]
        blocks, groups, pos = blocks[real], groups[real], pos[real]
    if len(hashes) < INSERT_MIN:
        for blk, h, g, p, s in zip(
            blocks.tolist(), hashes, groups.tolist(), pos.tolist(), srcs, strict=True
        ):
            pool.insert(blk, h, g, p, s)
    else:
        joined = b"".join(hashes)
        if len(joined) == 32 * len(hashes):
            keys = int32_from_bytes(joined)[::8].to(torch.int64)
        else:
            keys = tensor_from_ints([hash_key(h) for h in hashes])
        src_tensor = torch.frombuffer(array("q", srcs), dtype=torch.int64)
        pool.insert_many(blocks, keys, groups, pos, src_tensor)
        for s, c in Counter(srcs).items():
            pool.source(s).refs += c
    m.rows.columns[2].index_copy_(
        0, pair_index.view(-1), torch.maximum(cached, num_full[:, None]).view(-1)
    )


def _stored_events(
    m: TorchKVCacheManager,
    requests: Sequence[RequestLike],
    pair: torch.Tensor,
    pos: torch.Tensor,
    blocks: torch.Tensor,
    hashes: list[BlockHash],
    events: list[list[KVCacheEvent]],
) -> None:
    """One ``BlockStored`` per (request, group) that cached, in sequential order."""
    g_count, b = m.num_groups, m.block_size
    builder = m.pool.event_builder
    assert builder is not None
    runs: dict[int, list[tuple[int, int, BlockHash]]] = {}
    for p, position, blk, h in zip(
        pair.tolist(), pos.tolist(), blocks.tolist(), hashes, strict=True
    ):
        runs.setdefault(p, []).append((position, blk, h))
    for p, run in runs.items():
        i, g = divmod(p, g_count)
        request = requests[i]
        lo, hi = run[0][0], run[-1][0] + 1
        parent = request.block_hashes[lo - 1] if lo else None
        kept = [(position, h) for position, blk, h in run if blk]
        events[i].append(
            builder.stored(
                request,
                [h for _, h in kept],
                [position for position, _ in kept],
                parent,
                lo * b,
                hi * b,
                b,
                g,
            )
        )


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
    if len(order) < m.batch_min or m._has_align:
        for r in requests:
            m.free(r)
        return
    w = m.max_blocks_per_req
    rows = torch.frombuffer(array("q", [row for _, row in order]), dtype=torch.int64)
    length, nulls, _ = m.rows.gather(m.rows.pair_index(rows))
    real = (length - nulls).view(-1)  # one release batch per (request, group): its real blocks
    total = int(real.sum())
    if total:
        pair, starts = _expand(real)
        table_base = (rows[:, None] + m.columns.table_rows) * w
        top = (table_base.view(-1) + length.view(-1) - 1 + starts)[pair]
        blocks = m._tab.t.index_select(0, top - torch.arange(total))  # last position first
        unique, inverse, repeats = torch.unique(blocks, return_inverse=True, return_counts=True)
        final = pool.ref.t.index_select(0, unique) - repeats
        pool.ref.t.index_copy_(0, unique.to(torch.int64), final.to(torch.int32))
        zero = final == 0
        if bool(zero.any()):
            last = torch.zeros(unique.shape[0], dtype=torch.int64).scatter_reduce_(
                0, inverse, torch.arange(total), "amax"
            )
            freed, freed_last = unique[zero], last[zero]
            hashed = pool.src.t.index_select(0, freed) >= 0
            tail = freed[hashed][torch.argsort(freed_last[hashed])]
            # Head inserts: the last batch ends up first; within a batch, walk order.
            head_last = freed_last[~hashed]
            key = -pair[head_last] * (total + 1) + head_last
            head = freed[~hashed][torch.argsort(key)]
            for part, at_head in ((head, True), (tail, False)):
                if part.shape[0] == 0:
                    continue
                node = pool.head if at_head else pool.prev.a[pool.tail]
                if part.shape[0] >= INSERT_MIN:
                    pool.link_after_tensor(node, part.to(torch.int64))
                else:
                    pool.link_after(node, part.tolist())
    for rid, row in order:
        m._release_row(rid, row)
