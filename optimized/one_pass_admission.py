"""One-pass admission: a request's first allocation with every group's table written as one.

``admission.allocate`` admits a request group by group: it adopts each group's hit (one slice
write and four counters per group), takes the new blocks and splits them group by group, then
caches the prompt's new full blocks (``caching.cache_columns``). On a plain layout — one block
size that is the hash block size, caching on without events, sparse retention or a policy that
hears each call (``GroupColumns.defers``) — an admission whose hit reaches one length S in
every group (each group's skipped positions, then its adopted blocks: a lookup's hit always
does, as does no hit) grows every table to one length R too. Then the row is one ``[G, R]``
strided view of the host tables (nulls, the hit, R − S new blocks) written in place (the
nulls in one assignment, each group's hit in one, the new blocks in one), its counters four
slice writes, the new blocks one take reshaped, and the cached entries columns of those new
blocks: ``admit`` does the same work as ``admission.allocate`` in a fixed number of numpy
calls instead of some per group, with the same result (the reference's: the same blocks in
the same tables, taken in the same order, cached in the same order). Anything else
(``admit`` returns ``NOT_PLAIN``) takes ``admission.allocate``.

Data layout (G groups, R rows, W = ``max_blocks_per_req`` positions)
----------------------------------------------------------------
The host tables are one flat int32 buffer, group g's row r at ``(g × R + r) × W``
(``GroupLayout.group_bases``): viewed as ``[G, R, W]``, ``[:, row, :]`` is the row's tables,
a strided ``[G, W]`` view written in place. The free queue hands out blocks in
group order (group 0's first, as ``step.extend`` splits one take), so the take as a
``[G, R − S]`` array is each group's new blocks; positions S … F − 1 of it (F: the full blocks
``allocate_slots`` caches) are the entries to cache, group by group, position by position,
as ``cache_columns`` enters them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.caching import source_of
from hybridkv.optimized.hit_blocks import GroupHit, ids_past
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.spec import rules


class NotPlain:
    """``admit``'s answer when the admission is not plain (the general path serves it)."""


NOT_PLAIN: Final = NotPlain()


def admit(
    s: ManagerState,
    request: RequestLike,
    skipped: list[int],
    need: int,
    cache_up_to: int,
    hits: Sequence[GroupHit],
    kept_free: int,
) -> KVCacheBlocks | NotPlain | None:
    """Admit a request whose groups skip ``skipped`` positions (its computed tokens' windows
    and chunks), needing ``need`` tokens' positions, caching up to ``cache_up_to`` tokens
    (``-1``: none), on a plain layout (see the module docstring): its new blocks, ``None`` when
    they do not fit with ``kept_free`` blocks kept free (nothing changed), or ``NOT_PLAIN``."""
    layout, pool = s.layout, s.pool
    g_count = layout.num_groups
    length = max(skipped[0], hits[0].size)
    for hit, skip in zip(hits, skipped, strict=True):
        if not hit.dense or max(skip, hit.size) != length:
            return NOT_PLAIN  # a hit cut short in some group, or one a scheduler built
    width = rules.cdiv(need, layout.block_size)
    if width < length:
        return NOT_PLAIN  # a hit longer than the tokens it counts
    parts = ids_past(hits, skipped)  # dense: every id a block
    adopted = np.concatenate(parts)
    new_count = g_count * (width - length)
    refs = pool.ref.n[adopted]
    # Hits in the free queue leave it, so they count against the free blocks: at most all of
    # them, which is counted exactly only where that bound does not fit already.
    if adopted.shape[0] + new_count + kept_free > pool.num_free_blocks:
        queued = int(np.count_nonzero(refs == 0))
        if queued + new_count + kept_free > pool.num_free_blocks:
            return None
    pool.paths.ran(paths.ADMISSION_ONE_PASS)
    row = s.rows.take(request.request_id)
    if pool.touch_array(adopted, refs):
        pool.paths.ran(paths.TOUCH_VECTORISED)
    new = pool.pop_array(new_count).reshape(g_count, width - length)
    write_row(s, row, parts, new, length)
    cached = length
    if cache_up_to >= 0:
        cached = max(min(cache_up_to // layout.block_size, len(request.block_hashes)), length)
    counters, at = s.rows, row * g_count
    counters.kept[at : at + g_count] = array("q", (length,)) * g_count
    counters.cached[at : at + g_count] = array("q", (cached,)) * g_count
    if cached > length:
        enter(s, request, row, new[:, : cached - length], length)
    s.thresholds.refresh(row)
    return KVCacheBlocks(tuple(map(tuple, new.tolist())))


def write_row(
    s: ManagerState,
    row: int,
    parts: Sequence[npt.NDArray[Any]],
    new: npt.NDArray[Any],
    length: int,
) -> None:
    """Write the row's tables in place (a strided ``[G, n]`` view of the host tables): each
    group's first ``length`` positions its leading nulls then its hit (``parts[g]``, ending at
    ``length``), the rest its new blocks (``new``, ``[G, n − length]``); then its length n and
    each group's leading nulls."""
    layout = s.layout
    g_count, added = new.shape
    width = length + added
    flat = s.tab.n.reshape(g_count, layout.max_num_reqs, layout.max_blocks_per_req)
    tables = flat[:, row, :width]
    nulls = [length - part.shape[0] for part in parts]
    if any(nulls):
        tables[:, :length] = 0
    for g, part in enumerate(parts):
        tables[g, nulls[g] : length] = part
    tables[:, length:] = new
    counters, at = s.rows, row * g_count
    counters.length[at : at + g_count] = array("q", (width,)) * g_count
    counters.nulls[at : at + g_count] = array("q", nulls)
    if s.tables.mirrored:
        for g in range(g_count):
            s.tables.touched(g, row, 0, width)


def enter(
    s: ManagerState, request: RequestLike, row: int, blocks: npt.NDArray[Any], start: int
) -> None:
    """Cache the row's new ``blocks`` (``[G, n]``, positions ``start`` … ``start + n − 1``),
    group by group, position by position, as ``cache_columns`` does."""
    cached = start + blocks.shape[1]
    src = source_of(s, request, row, cached, cached * s.layout.block_size)
    keys = s.pool.keys_of(request.block_hashes[start:cached])
    s.pool.insert_matrix(blocks.astype(np.int64, copy=False), start, keys, src)
