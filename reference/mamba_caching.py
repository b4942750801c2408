"""Which of a Mamba group's states become prefix-cache entries (Prefix caching, Case 3).

In ``"align"`` mode the states at block boundaries an allocation covers are cached, and two
partial ones: the prefill checkpoint a chunk reserved a block for (cached only where a later
request can reach it: the prompt's checkpoint, a retained one, the shared prefix) and the state
at the prompt's last hash boundary. Every state cached is remembered for the same-step rule
(``cached_blocks_this_step``: a state this step writes cannot be adopted before the next).

``MambaStateCaching`` is the caching half of ``mamba_manager.MambaManager``, which owns the
state it reads (and sets it in its ``__init__``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.reference.kv_cache_block import BlockHashWithGroupId, KVCacheBlock
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_base import (
    SingleTypeKVCacheManager,
    prompt_tokens,
    shared_prefix_boundary,
)
from hybridkv.spec import MambaSpec, rules


class MambaStateCaching(SingleTypeKVCacheManager):
    """The caching hooks of ``MambaManager`` (see the module's docstring)."""

    spec: MambaSpec
    align: bool
    drop_eagle_checkpoint_block: bool
    cached_blocks_this_step: set[BlockHashWithGroupId]
    checkpoints: dict[str, tuple[int, int]]
    boundary_offloads: list[tuple[str, int, int]]

    # --- Caching ----------------------------------------------------------------------------

    def cache_blocks(
        self,
        request: RequestLike,
        num_tokens: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> None:
        """Cache the states at block boundaries this allocation covers (and its checkpoint),
        remembering them as cached in this step."""
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval, reachable_boundaries)
        after = self.num_cached_block.get(request_id, 0)
        if self.align:
            key = self._cache_partial_tail(request, num_tokens, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        table = self.req_to_blocks.get(request_id, [])
        for block in table[before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_blocks_this_step.add(block.block_hash)
                if self.align:
                    # Offered to a KV connector, which may offload it for later hits.
                    tokens = block.block_hash_num_tokens or 0
                    self.boundary_offloads.append((request_id, block.block_id, tokens))

    def _cache_partial_tail(
        self, request: RequestLike, num_tokens: int, retention_interval: int | None
    ) -> BlockHashWithGroupId | None:
        """Key the reserved checkpoint block at its boundary, or the state at the prompt's last
        hash boundary; ``None`` when nothing new is cached."""
        table = self.req_to_blocks[request.request_id]
        checkpoint = self.checkpoints.get(request.request_id)
        if checkpoint is not None:
            if checkpoint[1] >= len(table):
                # Reserved by an allocation that then failed, and cached later (delayed
                # caching): no block was taken for it, so nothing is cached (vLLM asserts).
                return None
            return self._cache_checkpoint(request, table, *checkpoint, retention_interval)
        hash_block_size = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hash_block_size:
            return None
        boundary = rules.mamba_prefill_checkpoint_position(
            prompt_tokens(request),
            hash_block_size,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        if num_tokens != boundary or num_tokens > len(request.block_hashes) * hash_block_size:
            # Not the prompt's boundary, or its hash lags behind (lookahead hashes in flight):
            # no key yet, nothing cached (as for a checkpoint past the hashes).
            return None
        index = rules.cdiv(num_tokens, self.block_size) - 1
        if index >= len(table) or table[index].is_null:
            return None
        if table[index].block_hash_num_tokens == num_tokens:
            return None
        return self.block_pool.cache_partial_block(
            request, table[index], num_tokens=num_tokens, group_id=self.group_id
        )

    def _cache_checkpoint(
        self,
        request: RequestLike,
        table: list[KVCacheBlock],
        position: int,
        index: int,
        retention_interval: int | None,
    ) -> BlockHashWithGroupId | None:
        """The checkpoint block receives the state at ``position``: cache it when a later
        request can reach it (the prompt's checkpoint, a retained one, the shared prefix);
        otherwise the slot is transient and loses any key it got in this step."""
        block = table[index]
        is_prompt_checkpoint = position == rules.mamba_prefill_checkpoint_position(
            prompt_tokens(request),
            self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        is_retained = False
        if position % self.block_size == 0:
            state_index = position // self.block_size - 1
            mask = self.reachable_block_mask(state_index, state_index + 1, retention_interval, ())
            is_retained = mask is None or mask[0]
        # A checkpoint past the request's hashes (a speculative step's drafts reach beyond its
        # known tokens) has no key yet: it is transient (vLLM would fail an assertion here).
        hashed = position <= len(request.block_hashes) * self.block_pool.hash_block_size
        reachable = (
            is_prompt_checkpoint or is_retained or position == shared_prefix_boundary(request)
        )
        if not (hashed and reachable):
            self.block_pool.maybe_evict_cached_block(block)
            return None
        if block.block_hash_num_tokens == position:
            return None
        return self.block_pool.cache_partial_block(
            request,
            block,
            num_tokens=position,
            group_id=self.group_id,
            replace_existing_hashes=True,
        )
