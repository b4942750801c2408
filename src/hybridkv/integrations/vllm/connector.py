"""What a KV connector asks of vLLM's manager, beyond ``allocate_slots``'s keywords, over a
hybridkv core (mixed into ``hybridkv.integrations.vllm.KVCacheManager``).

A KV connector (vLLM's offloading connector, NIXL, Mooncake, …) loads part of a request's KV
from outside the pool: the scheduler asks the manager for the local hit
(``get_computed_blocks_for_connector``), cuts it where a longer external hit takes over
(``truncate_computed_blocks``), admits the request with ``num_external_computed_tokens``
(the core takes blocks for them), caches them when the load is done, and on a failure zeroes
(``record_blocks_for_zeroing``) or forgets (``evict_blocks``) what the load left unwritten. A
finished request's table goes to the connector clipped to its computed tokens
(``get_block_ids_for_computed_tokens``), after its out-of-window blocks are released
(``remove_skipped_blocks``); when a connector may still be writing them, its blocks leave the
tables now (``pop_blocks_for_free``) and return to the pool later (``block_pool.free_blocks``).

The zeroing list (``take_new_block_ids``) lives here: the attention groups' new blocks of a
Mamba hybrid, group by group as vLLM's managers hand them over, external blocks included
unless the load writes their group (``skip_zeroing_group_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.integrations.vllm.views import BlockPoolView, BlockView, BlockViews
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.spec import CrossAttentionSpec, KVCacheConfig, rules


class ConnectorCalls:
    """vLLM's KV connector calls of its ``KVCacheManager``, over ``core``."""

    core: Any
    config: KVCacheConfig
    block_pool: BlockPoolView
    empty_kv_cache_blocks: BlockViews

    def init_connector_calls(self, config: KVCacheConfig, zeroing: bool) -> None:
        """Set up for ``config``; ``zeroing``: the worker zeroes new attention blocks (vLLM's
        ``needs_kv_cache_zeroing``, Mamba hybrids)."""
        self._zeroed_groups = tuple(
            i for i, group in enumerate(config.groups) if zeroing and not group.spec.holds_state
        )
        self._new_block_ids: dict[int, list[int]] = {i: [] for i in self._zeroed_groups}
        self._block_sizes = tuple(group.spec.block_size for group in config.groups)
        # Groups holding states (Mamba): left whole when a table is clipped to its computed
        # tokens, cut at a whole state when a lookup result is.
        self._state_groups = frozenset(
            i for i, group in enumerate(config.groups) if group.spec.holds_state
        )
        # Left whole too: cross-attention groups, whose tables hold encoder tokens (vLLM's).
        self._whole_groups = self._state_groups | {
            i for i, group in enumerate(config.groups) if isinstance(group.spec, CrossAttentionSpec)
        }
        # vLLM's per-group lookup for a connector: Mamba hybrids whose first attention type
        # is full attention (its group is the reference the other groups' hits are read by).
        types = config.attention_types()
        self._full_attention_group: int | None = None
        if self._state_groups and len(config.groups) > 1 and types[0][0].hit_is_prefix:
            self._full_attention_group = types[0][1][0]

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(group) for group in self.core.get_block_ids(request_id))

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        raise NotImplementedError  # the manager's

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local hit for a request scheduled with a KV connector that can supply a lagging
        group's state, and whether one group's hit ran deeper than another's. On a Mamba
        hybrid with full attention, full attention's own hit is the local prefix (the
        connector loads the rest, the Mamba state included); a group hitting deeper than full
        attention means its blocks were evicted, and the agreed hit is taken instead."""
        if self._full_attention_group is None:
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        if not self.core.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        blocks, lengths = self.core.get_computed_blocks_per_group(request, max_cache_hit_length)
        num_local = lengths[self._full_attention_group]
        if any(length > num_local for length in lengths):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        return self._blocks(blocks), num_local, 0, min(lengths) < num_local

    def vllm_block_hashes(self, block_ids: list[int]) -> list[bytes | None]:
        """Each block's ``block_hash`` as vLLM's ``KVCacheBlock`` holds it: its cache key's hash
        and group id packed (``make_block_hash_with_group_id``), ``None`` while not cached."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        return [
            None if key is None else make_block_hash_with_group_id(key[0], key[1])
            for key in self.core.block_cache_keys(block_ids)
        ]

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result cut at ``num_computed_tokens`` (a multiple of every group's block
        size; a Mamba group keeps at most what it has): pure slicing, no reference counts."""
        groups: list[tuple[int, ...]] = []
        for group_id, ids in enumerate(blocks.block_ids):
            block_size = self._block_sizes[group_id]
            if num_computed_tokens % block_size:
                raise ValueError(
                    f"num_computed_tokens={num_computed_tokens} is not a multiple of group "
                    f"{group_id}'s block size {block_size}"
                )
            count = num_computed_tokens // block_size
            if group_id in self._state_groups:
                count = min(count, len(ids))
            elif count > len(ids):
                raise ValueError(
                    f"num_computed_tokens={num_computed_tokens} needs {count} blocks of group "
                    f"{group_id}, the lookup result holds {len(ids)}"
                )
            groups.append(tuple(ids[:count]))
        return self._blocks(KVCacheBlocks(tuple(groups)))

    def _record_new_blocks(
        self,
        request_id: str,
        new: KVCacheBlocks,
        hit: KVCacheBlocks | None,
        skipped_groups: Sequence[int],
    ) -> None:
        """The zeroed groups' new blocks, for ``take_new_block_ids``; with external tokens
        (``hit`` given, possibly ``None`` for none) first the blocks taken for them, unless the
        load writes that group (``skipped_groups``): the table's blocks that are neither the
        hit's nor new."""
        tables = self.core.get_block_ids(request_id) if hit is not None or skipped_groups else ()
        for group_id in self._zeroed_groups:
            ids = self._new_block_ids[group_id]
            fresh = new.block_ids[group_id]
            if tables and group_id not in skipped_groups:
                known = {0, *fresh, *(hit.block_ids[group_id] if hit is not None else ())}
                ids.extend(b for b in tables[group_id] if b not in known)
            ids.extend(fresh)

    def take_new_block_ids(self) -> list[int]:
        """The zeroed groups' new blocks since the last call, group after group."""
        ids: list[int] = []
        for group_ids in self._new_block_ids.values():
            ids.extend(group_ids)
            group_ids.clear()
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zero the request's blocks from ``start_token`` on again (a failed load left them
        unwritten); ``start_token`` a multiple of each zeroed group's block size."""
        tables = self.core.get_block_ids(request_id)
        for group_id in self._zeroed_groups:
            block_size = self._block_sizes[group_id]
            if start_token % block_size:
                raise ValueError(
                    f"start_token={start_token} is not a multiple of group {group_id}'s "
                    f"block size {block_size}"
                )
            self._new_block_ids[group_id].extend(tables[group_id][start_token // block_size :])

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """The request's tables, each attention group's clipped to the blocks of its
        ``num_computed_tokens`` (a Mamba or cross-attention group's whole): what a finished
        request hands over."""
        tables = self.get_block_ids(request_id)
        return tuple(
            ids if g in self._whole_groups else ids[: rules.cdiv(num_computed_tokens, size)]
            for g, (ids, size) in enumerate(zip(tables, self._block_sizes, strict=True))
        )

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Release what no group reads after ``processed_computed_tokens`` (the core's)."""
        del num_prompt_tokens  # only vLLM's R-SWA reads it; hybridkv has no R-SWA
        self.core.remove_skipped_blocks(request_id, processed_computed_tokens)

    def pop_blocks_for_free(self, request: Any) -> list[BlockView]:
        """The request leaves the tables, its blocks stay held until the scheduler hands them
        to ``block_pool.free_blocks`` (a connector may still be writing them)."""
        return [BlockView(i) for i in self.core.pop_blocks_for_free(request.request_id)]

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """Partial-tail states of Mamba ``"align"`` producers: none, as partial hash hits are
        refused at construction (they are what makes them)."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """No copy-on-write copies: partial Mamba hits are refused at construction."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The Mamba ``"align"`` states cached since the last call, per request as (group id,
        block id, tokens), for a connector to offload (the core's)."""
        offloads: dict[str, list[tuple[int, int, int]]] = self.core.take_boundary_state_offloads()
        return offloads

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Forget the cached keys of these blocks (``BlockPool.evict_blocks``): each keeps its
        references and its place in the free queue; a ``BlockRemoved`` event per key."""
        self.block_pool.evict_blocks(block_ids)

    def _new_blocks(
        self,
        request: Any,
        new_blocks: Any,
        new_computed_blocks: KVCacheBlocks | None,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...],
    ) -> KVCacheBlocks:
        """A core's new blocks as vLLM's scheduler reads them, recorded for zeroing where
        groups need it."""
        blocks = self._blocks(new_blocks)
        if self._zeroed_groups:
            self._record_new_blocks(
                request.request_id,
                blocks,
                new_computed_blocks if num_external_computed_tokens else None,
                skip_zeroing_group_ids,
            )
        return blocks

    def _blocks(self, blocks: Any) -> KVCacheBlocks:
        """A core result as ``KVCacheBlocks`` (the empty one shared, as vLLM's)."""
        ids = blocks.block_ids if isinstance(blocks, KVCacheBlocks) else blocks.get_block_ids()
        if not any(ids):
            return self.empty_kv_cache_blocks
        if isinstance(blocks, KVCacheBlocks):
            return blocks
        return KVCacheBlocks(tuple(tuple(group) for group in ids))
