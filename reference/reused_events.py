"""``kv_cache_report_mode="full"``: ``BlockStored`` events for the blocks a lookup reuses.

A request may ask for its whole cached prefix to be reported, not only the blocks it stores
itself, so that an external index (a KV-aware gateway) learns which prefix it reused. vLLM 0.33
does it in ``KVCacheManager.get_computed_blocks`` (``KVCacheCoordinator.emit_cached_block_events``
→ ``BlockPool.emit_cached_block_events``), when events are on and the hit is not empty: one
event per group whose hit holds positions, over all ``n`` of them (a sliding window's or a Mamba
group's null positions included: vLLM counts ``len(group_blocks)``), their hashes at the group's
block size, parent ``None`` (a hit starts at block 0), the tokens ``0 … n·block_size − 1``, and
every other field as the pool's newly stored blocks have it: the same ``EventBuilder.stored``
builds both, as vLLM's ``_build_block_stored_event`` does. Nothing in the pool changes.

Both backends' ``get_computed_blocks(…, report_reused_blocks=True)`` call ``reused_block_events``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.reference.block_pool import hashes_at_block_size
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.reference.request import RequestLike
from hybridkv.spec import KVCacheConfig


def reused_block_events(
    builder: EventBuilder | None,
    request: RequestLike,
    hit_sizes: Sequence[int],
    config: KVCacheConfig,
    hash_block_size: int,
) -> list[KVCacheEvent]:
    """The ``BlockStored`` events of a hit of ``hit_sizes[g]`` positions in each group ``g`` of
    ``config`` (none with events off: ``builder`` is ``None``), in group order."""
    if builder is None:
        return []
    events: list[KVCacheEvent] = []
    for group_idx, (num_blocks, group) in enumerate(zip(hit_sizes, config.groups, strict=True)):
        if not num_blocks:
            continue
        block_size = group.spec.block_size
        hashes = hashes_at_block_size(request.block_hashes, hash_block_size, block_size)
        positions = range(num_blocks)
        events.append(
            builder.stored(
                request,
                [hashes[p] for p in positions],
                positions,
                None,
                0,
                num_blocks * block_size,
                block_size,
                group_idx,
            )
        )
    return events
