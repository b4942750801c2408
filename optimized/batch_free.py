"""``free_batch``: ``for r in requests: free(r)`` in numpy calls across the requests.

The release order of sequential frees is a function of the batch: each group's table is
released last block first, request after request; a block whose last holder lets it go is
appended at the free queue's tail in walk order of that last release if it holds a cached hash,
else inserted at the head batch by batch, the last batch first. So one pass computes every
block's final reference count and, for those that reach 0, their place.

Data layout
-----------
Per call, ``[n, G]`` int64 arrays (n requests, G groups, request-major) of table lengths and
leading nulls gathered from the row counters (``RowTables.gather``); each (request, group)
pair's real blocks are enumerated with ``repeat`` (``batch.expand``) into one array in walk
order, read from the host tables at ``(g × R + row) × W + pos``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.batch import expand
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.request import RequestLike


def free_batch(s: ManagerState, requests: Sequence[RequestLike]) -> bool:
    """``for r in requests: free(r)``, vectorised; ``False`` (nothing changed) where the
    single calls are to be made instead (a small batch, a Mamba ``"align"`` group, an eviction
    policy: it hears each request's releases as ``free`` makes them)."""
    pool = s.pool
    seen: set[str] = set()
    order: list[tuple[str, int]] = []
    for r in requests:
        rid = r.request_id
        row = s.rows.row_of(rid)
        if row is not None and rid not in seen:
            seen.add(rid)
            order.append((rid, row))
    if len(order) < s.tuning.free_batch_min or s.layout.columns.mamba_align or s.pool.policy:
        return False
    pool.paths.ran(paths.FREE_BATCH)
    w = s.layout.max_blocks_per_req
    rows = np.array([row for _, row in order], dtype=np.int64)
    length, nulls, _ = s.rows.gather(s.rows.pair_index(rows))
    real = (length - nulls).ravel()  # one release batch per (request, group): its real blocks
    total = int(real.sum())
    if total:
        pair, rank = expand(real)
        table_base = ((rows[:, None] + s.layout.columns.table_rows) * w).ravel()
        blocks = s.tables.host.n[(table_base + length.ravel() - 1)[pair] - rank].astype(np.int64)
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
                if part.shape[0] >= pool.insert_min:
                    pool.link_after_array(node, part)
                else:
                    pool.link_after(node, part.tolist())
    for rid, row in order:
        s.release_row(rid, row)
    return True
