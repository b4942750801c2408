"""Coordinators: one request's allocation across every KV cache group (Implementation).

A coordinator owns the block pool and one single-type manager per group, and combines their
results. Which coordinator runs depends on the configuration:

- ``NoPrefixCacheCoordinator``: prefix caching is off; lookups return nothing.
- ``UnitaryCoordinator``: one group; its longest hit is the request's.
- ``HybridCoordinator``: several groups, any mix of types, with or without full attention. A hit
  must be valid for every type, so the groups' hits are intersected (Prefix caching, Case 2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_managers import SingleTypeKVCacheManager, manager_class
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator(ABC):
    """Operations applied to every group in group order (group 0 first)."""

    def __init__(
        self, config: KVCacheConfig, *, enable_caching: bool, enable_kv_cache_events: bool
    ) -> None:
        self.config = config
        self.block_pool = BlockPool(
            config.num_blocks,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class(group.spec)(group.spec, self.block_pool, group_id)
            for group_id, group in enumerate(config.groups)
        ]

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        """The blocks per group and the length (tokens) of the request's longest cache hit."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlocksPerGroup,
        num_computed_tokens: int,
    ) -> int:
        """Free blocks the allocation would consume, summed over groups (all checked together)."""
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, blocks, num_computed_tokens)
            for manager, blocks in zip(self.managers, new_computed_blocks, strict=True)
        )

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: BlocksPerGroup, num_computed_tokens: int
    ) -> None:
        for manager, blocks in zip(self.managers, new_computed_blocks, strict=True):
            manager.allocate_new_computed_blocks(request_id, blocks, num_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> BlocksPerGroup:
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens) for manager in self.managers
        )

    def cache_blocks(self, request: RequestLike, num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        """Each group releases its table as one batch, groups in order."""
        for manager in self.managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return tuple(manager.get_blocks(request_id) for manager in self.managers)


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching disabled: no request ever hits."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        return tuple([] for _ in self.managers), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """A single KV cache group: no intersection needed."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        manager = self.managers[0]
        hits = manager.find_longest_cache_hit(block_hashes, max_cache_hit_length, [0])
        return hits, len(hits[0]) * manager.block_size


class HybridCoordinator(KVCacheCoordinator):
    """Several groups: the longest hit length that every attention type accepts.

    Groups with equal specs form one attention type and are looked up jointly. Full attention
    goes first: its hit is a prefix, so every shorter length is a hit too, and the other types
    then search only within it (Prefix caching, Case 2). With more types, or none of them full
    attention, the lookup repeats at the lowered length until no type lowers it further.
    """

    def __init__(
        self, config: KVCacheConfig, *, enable_caching: bool, enable_kv_cache_events: bool
    ) -> None:
        super().__init__(
            config, enable_caching=enable_caching, enable_kv_cache_events=enable_kv_cache_events
        )
        self.attention_types = self._split_attention_types(config)

    @staticmethod
    def _split_attention_types(config: KVCacheConfig) -> list[tuple[KVCacheSpec, list[int]]]:
        """(spec, group ids) per distinct spec, full attention first, else first appearance."""
        types: dict[KVCacheSpec, list[int]] = {}
        for group_id, group in enumerate(config.groups):
            types.setdefault(group.spec, []).append(group_id)
        ordered = list(types.items())
        ordered.sort(key=lambda item: not isinstance(item[0], FullAttentionSpec))
        return ordered

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        hit_length = max_cache_hit_length
        simple_hybrid = len(self.attention_types) == 2 and isinstance(
            self.attention_types[0][0], FullAttentionSpec
        )
        looked_up: set[int] = set()
        while True:
            length = hit_length
            for spec, group_ids in self.attention_types:
                if isinstance(spec, FullAttentionSpec) and group_ids[0] in looked_up:
                    # A full-attention hit is a prefix: a shorter length keeps its first blocks.
                    num_blocks = length // spec.block_size
                    length = num_blocks * spec.block_size
                    for group_id in group_ids:
                        del hits[group_id][num_blocks:]
                    continue
                manager = self.managers[group_ids[0]]
                found = manager.find_longest_cache_hit(block_hashes, length, group_ids)
                length = len(found[0]) * spec.block_size
                for group_id, blocks in zip(group_ids, found, strict=True):
                    hits[group_id] = blocks
                    looked_up.add(group_id)
            if length >= hit_length:
                break
            hit_length = length
            if simple_hybrid:
                break
        self._truncate_full_attention(hits, hit_length)
        return tuple(hits), hit_length

    def _truncate_full_attention(self, hits: list[list[KVCacheBlock]], hit_length: int) -> None:
        for spec, group_ids in self.attention_types:
            if isinstance(spec, FullAttentionSpec):
                for group_id in group_ids:
                    del hits[group_id][hit_length // spec.block_size :]


def make_coordinator(
    config: KVCacheConfig, *, enable_caching: bool, enable_kv_cache_events: bool
) -> KVCacheCoordinator:
    """The coordinator the document prescribes for this configuration."""
    if not enable_caching:
        cls: type[KVCacheCoordinator] = NoPrefixCacheCoordinator
    elif len(config.groups) == 1:
        cls = UnitaryCoordinator
    else:
        cls = HybridCoordinator
    return cls(config, enable_caching=enable_caching, enable_kv_cache_events=enable_kv_cache_events)
