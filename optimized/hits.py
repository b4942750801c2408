"""Cache hits: the longest prefix of a request's blocks that every attention type accepts.

``longest_hit`` is ``get_computed_blocks`` after its checks: one ``Lookup`` per block size
reads the request's block hashes against the pool's prefix cache (``hybridkv.optimized.lookup``),
one ``TypeProbe`` per attention type (in ``layout.types`` order, full attention first) keeps
what it found, and each type's own rule (``TYPE_HITS``, ``hybridkv.optimized.type_hits``) says
its longest hit; a hybrid takes ``rules.hybrid_hit_length`` over the types, as the reference
coordinator does.

Data layout
-----------
A hit is one ``GroupHit`` per group: an int32 numpy array of block ids (nulls where a window or
a Mamba group needs no block) with its count of leading nulls; ``HitBlocks`` hands them to the
scheduler as ``KVCacheBlocks`` and back to ``allocate_slots`` as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.lookup import NO_HIT, GroupHit, HitBlocks, Lookup, TypeProbe, lead_run
from hybridkv.optimized.memo_hit import memo_hit
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.type_hits import TYPE_HITS, HitProbe, TypeHit
from hybridkv.reference.request import RequestLike
from hybridkv.reference.reused_events import reused_block_events
from hybridkv.spec import KVCacheSpec, rules


def longest_hit(
    s: ManagerState, request: RequestLike, max_length: int, report: bool = False
) -> tuple[HitBlocks, int, int]:
    """The request's longest hit of at most ``max_length`` tokens: its blocks per group, its
    length, and the shared-prefix boundary (the longest one type found alone, when longer);
    with ``report`` (``kv_cache_report_mode="full"``) and events on, a non-empty hit's blocks
    are reported as stored (``hybridkv.reference.reused_events``)."""
    if s.layout.mixes_full_with_more_types:
        s.pool.paths.ran(paths.HYBRID_WITH_FULL)
    if not report:
        read = memo_hit(s, request, max_length)
        if read is not None:
            return HitBlocks(read[0]), read[1], 0
    memos = type_probes(s, request, max_length)
    hits: Sequence[GroupHit]
    boundary = 0
    if s.layout.num_groups == 1:
        spec = s.layout.types[0][0]
        hits = type_hit(s, spec, memos[0], max_length, s.layout.type_eagle[0], spec.block_size)
        hit_length = len(hits[0]) * spec.block_size
    else:
        hits, hit_length, longest = hybrid_hit(s, memos, max_length)
        boundary = longest if longest > hit_length else 0
    if report and hit_length:
        pool, sizes = s.pool, [hit.size for hit in hits]
        pool.events += reused_block_events(
            pool.event_builder, request, sizes, s.layout.config, s.layout.hash_block_size
        )
    return HitBlocks(hits), hit_length, boundary


def type_probes(s: ManagerState, request: RequestLike, max_length: int) -> list[TypeProbe]:
    """One ``TypeProbe`` per attention type (``layout.types`` order), reading the request's
    hashes through one ``Lookup`` per block size."""
    hbs = s.layout.hash_block_size
    lookups: dict[int, Lookup] = {}
    memos: list[TypeProbe] = []
    for (spec, group_ids), eagle in zip(s.layout.types, s.layout.type_eagle, strict=True):
        b = spec.block_size
        lookup = lookups.get(b)
        if lookup is None:
            lookup = lookups[b] = Lookup(
                s.pool, request, b, s.tuning.vector_min, s.layout.lookahead, b // hbs
            )
        # An EAGLE type of a hybrid matches one block beyond the candidate, then drops it.
        extra = b if eagle and s.layout.num_groups > 1 and not spec.holds_state else 0
        limit = min((max_length + extra) // b, len(lookup.hashes))
        memos.append(TypeProbe(lookup, group_ids, limit))
    if len(memos) > 1 and len(lookups) == 1:
        lead_run(memos)
    return memos


def hit_per_group(
    s: ManagerState, request: RequestLike, max_length: int
) -> tuple[list[GroupHit], tuple[int, ...]]:
    """Each attention type's own longest hit, not intersected: the blocks and the hit length
    per group (``HybridCoordinator.find_longest_cache_hit_per_group`` of the reference)."""
    memos = type_probes(s, request, max_length)
    hits = [NO_HIT] * s.layout.num_groups
    lengths = [0] * s.layout.num_groups
    num_hashed = len(memos[0].lookup.request_hashes) * s.layout.hash_block_size
    types = zip(s.layout.types, s.layout.type_eagle, memos, strict=True)
    for (spec, group_ids), drop, memo in types:
        extend = drop and not spec.holds_state
        max_len = min(max_length + spec.block_size, num_hashed) if extend else max_length
        found = type_hit(s, spec, memo, max_len, drop, s.layout.block_size)
        for group_id, blocks in zip(group_ids, found, strict=True):
            hits[group_id] = blocks
            lengths[group_id] = len(found[0]) * spec.block_size
    return hits, tuple(lengths)


def type_hit(
    s: ManagerState,
    spec: KVCacheSpec,
    memo: TypeProbe,
    max_length: int,
    drop: bool = False,
    alignment: int = 0,
) -> TypeHit:
    """One type's longest hit of at most ``max_length`` tokens (the ``longest_hit`` hook,
    from ``TYPE_HITS``); with ``drop`` (EAGLE) one block shorter; its length a multiple of
    ``alignment`` (the scheduler block)."""
    probe = HitProbe(
        memo,
        max_length,
        min(max_length // spec.block_size, memo.length),
        alignment or s.layout.block_size,
        drop,
        s.tuning.vector_min,
    )
    return TYPE_HITS[spec.kind](spec, probe)


def hybrid_hit(
    s: ManagerState, memos: list[TypeProbe], max_length: int
) -> tuple[list[GroupHit], int, int]:
    """``rules.hybrid_hit_length`` over the attention types (as the reference coordinator
    calls it), each type probed through its memo; also the longest length one type found
    on its own."""
    hits = [NO_HIT] * s.layout.num_groups
    num_hashed = len(memos[0].lookup.request_hashes) * s.layout.hash_block_size

    def lookup(index: int, length: int, drop: bool) -> int:
        spec, group_ids = s.layout.types[index]
        extend = drop and not spec.holds_state
        max_len = min(length + spec.block_size, num_hashed) if extend else length
        found = type_hit(s, spec, memos[index], max_len, drop, s.layout.block_size)
        for group_id, blocks in zip(group_ids, found, strict=True):
            hits[group_id] = blocks
        return len(found[0]) * spec.block_size

    hit_length, longest = rules.hybrid_hit_length(
        lookup,
        [spec.hit_is_prefix for spec, _ in s.layout.types],
        s.layout.type_eagle,
        max_length,
    )
    for spec, group_ids in s.layout.types:
        if spec.hit_is_prefix:
            for group_id in group_ids:
                hits[group_id] = hits[group_id].cut(hit_length // spec.block_size)
    return hits, hit_length, longest
