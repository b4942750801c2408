"""What a KV connector asks of the manager beyond ``allocate_slots``, on the flat state.

The reference's ``hybridkv.reference.connector_calls`` says what each call is for; these are
the same calls over one ``ManagerState``: a deferred free takes the request's row back without
releasing its blocks (``pop_blocks_for_free``) and releases them later in one walk of the
pool (``free_blocks``); the count a waiting load reserves is admission's (or the Mamba
``"align"`` path's) count with no hit; a window's release is the step's.

Data layout: the blocks handed out and not yet freed are ``ManagerState.deferred`` (block id →
times), each a holder of its block for the invariants; a row's tables are read from the host
tables (``table``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hybridkv.optimized import admission, cached_keys, hits, mamba, step
from hybridkv.optimized.general_caching import primary_key
from hybridkv.optimized.lookup import HitBlocks
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.step_columns import ColumnRequest
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.connector_calls import check_deferred_blocks
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.validation import check_block_hashes, check_block_ids, hit_length_limit
from hybridkv.spec.errors import check_non_negative


class ConnectorCalls:
    """The manager's calls for KV connectors (mixed into ``TorchKVCacheManager``)."""

    # The manager's own, which these build on.
    get_computed_blocks: Callable[..., tuple[KVCacheBlocks, int, int]]
    prefix_cache_lookup_enabled: Callable[[RequestLike], bool]

    @property
    def state(self) -> ManagerState:
        raise NotImplementedError  # the manager's

    def get_computed_blocks_per_group(
        self, request: RequestLike, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, tuple[int, ...]]:
        """The reference's: each attention type's own longest hit, not intersected, and the
        hit length per group (``hits.hit_per_group``)."""
        s = self.state
        g_count = s.layout.num_groups
        if g_count == 1 or not s.layout.caching:
            blocks, hit, _ = self.get_computed_blocks(request, max_cache_hit_length)
            return blocks, (hit,) * g_count
        if type(request) is Request or type(request) is ColumnRequest:
            request.offer_block_hasher(s.block_hasher)
        if not self.prefix_cache_lookup_enabled(request):
            return KVCacheBlocks.empty(g_count), (0,) * g_count
        s.settle()
        check_block_hashes(request, s.layout.hash_block_size, s.layout.lookahead, allow_fewer=True)
        found, lengths = hits.hit_per_group(
            s, request, hit_length_limit(request, max_cache_hit_length)
        )
        return HitBlocks(found), lengths

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """The reference's: the request leaves its row, its blocks stay held; returns them,
        every group's table in group order without its leading nulls."""
        s = self.state
        s.settle()
        if s.layout.has_align:
            s.mamba.forget(request_id, range(s.layout.num_groups))
        row = s.rows.row_of(request_id)
        if row is None:
            return []
        blocks: list[int] = []
        for g in range(s.layout.num_groups):
            table = s.table(g, row)
            first = next((i for i, block in enumerate(table) if block), len(table))
            blocks.extend(table[first:])
        s.release_row(request_id, row)
        s.deferred.update(blocks)
        return blocks

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """The reference's: one holder of each block dropped, in eviction order; every id must
        be one ``pop_blocks_for_free`` handed out (``ManagerState.deferred``), or nothing is
        released."""
        s = self.state
        s.settle()
        ids = check_deferred_blocks(block_ids, s.pool.num_blocks, s.deferred)
        s.deferred.subtract(ids)
        s.deferred = +s.deferred  # drop the zero counts
        s.pool.free_blocks(ids)
        s.raise_policy_error()

    def block_cache_keys(self, block_ids: Iterable[int]) -> list[tuple[bytes, int] | None]:
        """The reference's: each block's prefix-cache key, or ``None`` while not cached."""
        s = self.state
        s.settle()
        ids = check_block_ids(block_ids, s.pool.num_blocks)
        return [primary_key(s, block) for block in ids]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The reference's: Mamba ``"align"`` states cached since the last call, per request
        as (group id, block id, tokens), group after group."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        pending = self.state.mamba.offloads
        for g in sorted(pending):
            for request_id, block_id, tokens in pending[g]:
                offloads.setdefault(request_id, []).append((g, block_id, tokens))
        pending.clear()
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
        """The reference's: free blocks the request would consume, with no hit to adopt (a
        cross-attention group: those of ``num_encoder_tokens``)."""
        check_non_negative("num_tokens", num_tokens)
        check_non_negative("total_computed_tokens", total_computed_tokens)
        check_non_negative("num_encoder_tokens", num_encoder_tokens)
        s = self.state
        s.settle()
        if s.layout.has_align:
            return mamba.num_blocks_to_allocate(
                s,
                request_id,
                num_tokens,
                s.layout.no_hits,
                total_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
                prefill_end,
            )
        return admission.blocks_to_allocate(
            s,
            request_id,
            num_tokens,
            total_computed_tokens,
            apply_admission_cap,
            num_encoder_tokens,
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The reference's: release what no group reads after ``num_computed_tokens``."""
        check_non_negative("num_computed_tokens", num_computed_tokens)
        s = self.state
        s.settle()
        row = s.rows.row_of(request_id)
        if row is None:
            return
        if s.layout.has_align:
            mamba.remove_skipped(s, request_id, row, num_computed_tokens)
        else:
            step.release_skipped(s, row, num_computed_tokens)
        s.thresholds.refresh(row)
        s.raise_policy_error()

    def get_cached_block_ids(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[int] | None:
        """The reference's (vLLM's ``BlockPool.get_cached_block``; ``optimized.cached_keys``)."""
        return cached_keys.get_cached_block_ids(self.state, block_hash, group_ids)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """The reference's (vLLM's ``BlockPool.evict_blocks``; ``optimized.cached_keys``)."""
        cached_keys.evict_blocks(self.state, block_ids)
