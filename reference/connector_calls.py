"""What a KV connector asks of the manager beyond ``allocate_slots`` (vLLM 0.33's names).

A KV connector (offloading to host memory, prefill/decode disaggregation) loads some of a
request's KV from outside the pool and writes it into blocks the manager hands out: at
admission ``allocate_slots(num_external_computed_tokens=…)`` takes those blocks, and when a
load is done ``cache_blocks`` enters them into the prefix cache. Three more calls serve it:

- ``pop_blocks_for_free`` / ``free_blocks``: a finished request whose blocks a connector may
  still be writing leaves the tables now and releases its blocks later (deferred free);
- ``get_num_blocks_to_allocate``: the blocks a request waiting for a load still needs for its
  whole sequence, which the scheduler keeps free for it;
- ``remove_skipped_blocks``: release what left a window before the table goes to the connector;
- ``evict_blocks``: forget the keys of blocks a failed load left unwritten;
- ``get_cached_block_ids``: what vLLM's aux-output connector reads of the prefix cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.coordinator import HybridCoordinator, KVCacheCoordinator
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.reference.validation import (
    check_block_hashes,
    check_block_ids,
    check_group_ids,
    hit_length_limit,
)
from hybridkv.spec.errors import check_non_negative


class ConnectorCalls:
    """The manager's calls for KV connectors (mixed into ``KVCacheManager``)."""

    coordinator: KVCacheCoordinator
    block_pool: BlockPool
    in_flight_tokens: dict[str, int]
    deferred_holders: Counter[int]
    num_groups: int
    # The manager's own calls, which these build on.
    get_computed_blocks: Callable[..., tuple[KVCacheBlocks, int, int]]
    prefix_cache_lookup_enabled: Callable[[RequestLike], bool]

    def get_computed_blocks_per_group(
        self, request: RequestLike, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, tuple[int, ...]]:
        """Each attention type's own longest hit, not intersected: the blocks and the hit
        length per group. A KV connector that can supply a lagging type's state (a Mamba
        group's, say) reads it to load only what is missing; with one group it is the hit."""
        coordinator = self.coordinator
        if not isinstance(coordinator, HybridCoordinator):
            blocks, hit, _ = self.get_computed_blocks(request, max_cache_hit_length)
            return blocks, (hit,) * self.num_groups
        if not self.prefix_cache_lookup_enabled(request):
            return KVCacheBlocks.empty(self.num_groups), (0,) * self.num_groups
        lookahead = coordinator.settings.num_hash_lookahead_tokens
        check_block_hashes(request, coordinator.hash_block_size, lookahead, allow_fewer=True)
        hits, lengths = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, hit_length_limit(request, max_cache_hit_length)
        )
        return KVCacheBlocks(tuple(tuple(b.block_id for b in blocks) for blocks in hits)), lengths

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forget the request without releasing its blocks: its blocks, every group's table in
        group order without its leading nulls, for ``free_blocks`` later (last first). Until
        then each counts as a holder of its block (``deferred_holders``): nothing is lost."""
        self.in_flight_tokens.pop(request_id, None)
        ids = [
            block.block_id
            for manager in self.coordinator.managers
            for block in manager.pop_blocks_for_free(request_id)
        ]
        self.deferred_holders.update(ids)
        return ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block, in eviction order (``BlockPool.free_blocks``): the
        blocks of a deferred free. Every id must be one ``pop_blocks_for_free`` handed out, or
        nothing is released."""
        ids = check_deferred_blocks(block_ids, self.block_pool.num_blocks, self.deferred_holders)
        self.deferred_holders.subtract(ids)
        self.deferred_holders = +self.deferred_holders  # drop the zero counts
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks([blocks[block_id] for block_id in ids])

    def block_cache_keys(self, block_ids: Iterable[int]) -> list[tuple[bytes, int] | None]:
        """Each block's prefix-cache key, (hash, group id), or ``None`` while it is not cached
        (vLLM's ``KVCacheBlock.block_hash``, which a KV connector reads of a request's blocks)."""
        blocks = self.block_pool.blocks
        return [
            blocks[i].block_hash for i in check_block_ids(block_ids, self.block_pool.num_blocks)
        ]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The Mamba ``"align"`` states cached since the last call, per request as (group id,
        block id, tokens): a KV connector offloads them so a later request can hit there."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.managers:
            for request_id, block_id, tokens in manager.take_boundary_state_offloads():
                offloads.setdefault(request_id, []).append((manager.group_id, block_id, tokens))
        return offloads

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        *,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
        num_encoder_tokens: int = 0,
    ) -> int:
        """Free blocks the request would consume to hold ``num_tokens`` tokens (a
        cross-attention group: ``num_encoder_tokens``), with no hit to adopt (the
        coordinator's count, as ``allocate_slots`` makes it)."""
        check_non_negative("num_tokens", num_tokens)
        check_non_negative("total_computed_tokens", total_computed_tokens)
        check_non_negative("num_encoder_tokens", num_encoder_tokens)
        return self.coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            tuple([] for _ in self.coordinator.managers),
            total_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
            num_encoder_tokens=num_encoder_tokens,
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks of tokens no group reads any more after ``num_computed_tokens``
        processed tokens (as ``allocate_slots`` does before it takes blocks)."""
        check_non_negative("num_computed_tokens", num_computed_tokens)
        self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_cached_block_ids(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[int] | None:
        """The first block cached under ``block_hash`` in each group, or ``None`` if any group
        has none (vLLM's ``BlockPool.get_cached_block``, which its aux-output connector reads)."""
        groups = check_group_ids(group_ids, self.num_groups)
        found = self.block_pool.get_cached_block(block_hash, groups)
        return None if found is None else [block.block_id for block in found]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget every cached key of each named block (held ones stay held, free ones keep
        their place): vLLM's ``BlockPool.evict_blocks``, a KV connector's after a failed load."""
        for block_id in check_block_ids(block_ids, self.block_pool.num_blocks):
            self.block_pool.maybe_evict_cached_block(self.block_pool.blocks[block_id])


def check_deferred_blocks(
    block_ids: Iterable[object], num_blocks: int, handed_out: Mapping[int, int]
) -> list[int]:
    """``block_ids`` of a deferred free (``free_blocks``): block ids, each freed no more often
    than ``pop_blocks_for_free`` handed it out (``handed_out``: block id → times)."""
    ids = check_block_ids(block_ids, num_blocks)
    freed: dict[int, int] = {}
    for block_id in ids:
        freed[block_id] = freed.get(block_id, 0) + 1
        if freed[block_id] > handed_out.get(block_id, 0):
            raise ValueError(
                f"block_ids: block {block_id} is freed {freed[block_id]} times but "
                f"pop_blocks_for_free handed it out {handed_out.get(block_id, 0)} times"
            )
    return ids
