"""A prompt's cache hit read from the run of the cached request whose hashes it adopted.

When the hash memo (``hybridkv.optimized.hash_memo``) hashes a prompt, it compares the prompt's
ids with a cached request's, block by block, and adopts that request's own hashes for the
leading blocks that agree. The pool's source of that request (``Source``) records, per
position and group, the block cached from it under exactly that key (an evicted block's entry
is cleared). On a layout of one full-attention type and sliding windows of the hash block size
(``GroupLayout.memo_run``), the longest hit is then read from that record in a few numpy calls,
where the general lookup (``hybridkv.optimized.hits``) would probe the table, read and check a
run and verify it against the prompt: an admission of a request sharing a cached system prompt,
the most common lookup, takes this path.

The record answers alone when the full-attention groups' leading run of recorded blocks ends
where the table holds no entry for the next position (``candidates``, unverified: any entry
there sends the lookup to the general path), every window's last blocks before the run's end are
recorded too (as the window rule asks: ``rules.sliding_window_contiguous_blocks``, all of
them when the run is shorter), and none of the blocks read is a newer twin of another entry of
its key (``dups``, which the lookup's probes would skip). Then the hit is the run: full
attention's prefix rule and every window's agree at its end, so the hybrid rule
(``rules.hybrid_hit_length``) returns it at once. Anything else returns ``None`` and the
general lookup answers, with the same result it would have given.

Data layout
-----------
The record (``Source.blocks``) is an int32 array indexed by tag, position × G + group, holding
the block or the pool's chain end; its first ``length × G`` entries viewed as ``[length, G]``
give each position's blocks in every group (a view for this call only: the array grows). The
hit is one ``GroupHit`` per group, a copy of its column from the first block it keeps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.hit_blocks import NO_HIT, GroupHit
from hybridkv.optimized.sources import Source, hash_key
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.request import Request, RequestLike


def memo_hit(
    s: ManagerState, request: RequestLike, max_length: int
) -> tuple[list[GroupHit], int] | None:
    """The request's longest hit of at most ``max_length`` tokens (its blocks per group, its
    length) read from the memo's run, or ``None`` when the run does not answer alone."""
    pool, run_groups = s.pool, s.layout.memo_run
    memo = pool.memo
    if (
        run_groups is None
        or memo is None
        or pool.extras
        or not s.tuning.memo_hits
        or not isinstance(request, Request)
    ):
        return None
    agreement = memo.last_agreement(request.packed_token_ids)
    if agreement is None:
        return None
    source, agreed = agreement
    if not isinstance(source, Source):
        return None
    g_count, b, end = s.layout.num_groups, s.layout.block_size, pool.end
    hashes = request.block_hashes
    scan = min(max_length // b, len(hashes))
    length = min(scan, agreed, len(source.blocks) // g_count)
    if length <= 0:
        return None
    pool.settle_for(source)  # this source's twins marked before its blocks are read
    record = np.frombuffer(source.blocks, np.int32, length * g_count).reshape(length, g_count)
    full, windows = run_groups
    # Full attention's columns copied once (each group's hit is its column's leading run; the
    # record may grow after the call), their held entries checked on the copies.
    full_columns = [record[:, g].copy() for g in full]
    held = full_columns[0] != end
    for column in full_columns[1:]:
        held &= column != end
    num = length if held.all() else int(held.argmin())
    # Any entry under the next position's key (verified or not) may continue the hit.
    if num == 0 or (num < scan and pool.candidates(hash_key(hashes[num]), full[0], num)):
        return None
    hits = [NO_HIT] * g_count  # every group is full attention or a window (``memo_run``)
    for g, column in zip(full, full_columns, strict=True):
        hits[g] = GroupHit(0, column[:num])
    for group_ids, needed, columns in windows:
        first = max(num - needed, 0)
        tail = record[first:num, columns]
        if not bool((tail != end).all()):
            return None
        kept = tail.T.copy()  # each group's blocks a row (the record may grow after the call)
        for g, ids in zip(group_ids, kept, strict=True):
            hits[g] = GroupHit(first, ids)
    if pool.dups and _any_twin(pool.dups, hits):
        return None
    pool.paths.ran(paths.LOOKUP_MEMO_RUN)
    return hits, num * b


def _any_twin(dups: set[int], hits: list[GroupHit]) -> bool:
    """Whether a block of ``hits`` has an older entry of its key (in ``dups``)."""
    ids: npt.NDArray[Any] = np.concatenate([hit.ids for hit in hits])
    return not dups.isdisjoint(ids.tolist())
