"""Coordinators: one request's allocation across every KV cache group (Implementation).

A coordinator owns the block pool and one single-type manager per group, and combines their
results. Which coordinator runs depends on the configuration:

- ``NoPrefixCacheCoordinator``: prefix caching is off; lookups return nothing.
- ``UnitaryCoordinator``: one group; its longest hit is the request's.
- ``HybridCoordinator``: several groups, any mix of types, with or without full attention. A hit
  must be valid for every type, so the groups' hits are intersected (Prefix caching, Case 2).

Groups may have different block sizes: block hashes are computed every ``hash_block_size``
tokens (their gcd) and hits land on multiples of the ``scheduler_block_size`` (their lcm), the
boundaries every group can stop at.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.policies.protocol import EvictionPolicy
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.engine_settings import EngineSettings
from hybridkv.reference.events import EventBuilder
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_managers import (
    BlocksPerGroup,
    CrossAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    manager_class,
    prompt_tokens,
)
from hybridkv.spec import (
    KVCacheConfig,
    KVCacheSpec,
    rules,
)


class KVCacheCoordinator(ABC):
    """Operations applied to every group in group order (group 0 first)."""

    def __init__(
        self,
        config: KVCacheConfig,
        settings: EngineSettings,
        *,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        event_builder_class: type[EventBuilder] = EventBuilder,
        eviction_policy: EvictionPolicy | None = None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.scheduler_block_size = settings.scheduler_block_size
        self.retention_interval = config.prefix_cache_retention_interval
        self.block_pool = BlockPool(
            config.num_blocks,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            hash_block_size=settings.hash_block_size,
            num_hash_lookahead_tokens=settings.num_hash_lookahead_tokens,
            event_builder=(
                event_builder_class.of(config, settings.num_hash_lookahead_tokens)
                if enable_kv_cache_events
                else None
            ),
            eviction_policy=eviction_policy,
            group_specs=[group.spec for group in config.groups],
        )
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class(group.spec)(
                group.spec,
                self.block_pool,
                group_id,
                scheduler_block_size=settings.scheduler_block_size,
                enable_caching=enable_caching,
                max_admission_blocks=group.spec.admission_cap(
                    settings.max_model_len, settings.max_in_flight_tokens
                ),
            )
            for group_id, group in enumerate(config.groups)
        ]
        # Groups whose hits take the EAGLE last-block drop: the flagged drafter groups, or every
        # group when none is flagged.
        eagle_ids = {i for i, group in enumerate(config.groups) if group.is_eagle_group}
        if settings.use_eagle and not eagle_ids:
            eagle_ids = set(range(len(config.groups)))
        self.drop_eagle_group_ids = eagle_ids if settings.use_eagle else set()
        if settings.use_eagle:
            for manager in self.managers:
                if isinstance(manager, MambaManager):
                    manager.drop_eagle_checkpoint_block = True
        self._configure()

    def _configure(self) -> None:  # noqa: B027 (a hook: only some coordinators set anything up)
        """What a coordinator sets up beyond the groups (its types, which groups drop EAGLE)."""

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        """The blocks per group and the length (tokens) of the request's longest cache hit, and
        how far beyond it some type alone found the prefix cached (0 unless hybrid)."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlocksPerGroup,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        *,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
        num_external_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
    ) -> int:
        """Free blocks the allocation would consume, summed over groups (all checked together).

        Only under the engine's sparse retention (interval 0) does Mamba reserve its prefill
        checkpoint on the prefill's last chunk alone; otherwise every chunk publishes a state.
        ``total_computed_tokens`` includes the ``num_external_computed_tokens`` a KV
        connector supplies at admission. A cross-attention group counts the
        ``num_encoder_tokens`` alone, with nothing computed (vLLM's single static allocation).
        """
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for manager, blocks in zip(self.managers, new_computed_blocks, strict=True):
            encoder = isinstance(manager, CrossAttentionManager)
            total += manager.get_num_blocks_to_allocate(
                request_id,
                num_encoder_tokens if encoder else num_tokens,
                blocks,
                0 if encoder else total_computed_tokens,
                num_encoder_tokens if encoder else num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                prefill_end=prefill_end,
                num_external_computed_tokens=num_external_computed_tokens,
            )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: BlocksPerGroup,
        num_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> BlocksPerGroup:
        """Adopt an admitted request's hit in every group (a running request adopts none), then
        take blocks for the tokens a KV connector supplies, in a second pass: every group's hit
        is touched before any group takes a block, so no group evicts another's hit. Returns
        the blocks taken for the external tokens, per group."""
        if any(request_id in manager.num_cached_block for manager in self.managers):
            return tuple([] for _ in self.managers)
        for manager, blocks in zip(self.managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(
                request_id, blocks, num_computed_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return tuple([] for _ in self.managers)
        return tuple(
            manager.allocate_external_computed_blocks(
                request_id, num_computed_tokens, num_external_computed_tokens
            )
            for manager in self.managers
        )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> BlocksPerGroup:
        """Each group's new blocks, group 0 first; a cross-attention group's for the
        ``num_encoder_tokens``."""
        return tuple(
            manager.allocate_new_blocks(request_id, num_encoder_tokens, num_encoder_tokens)
            if isinstance(manager, CrossAttentionManager)
            else manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for manager in self.managers
        )

    def num_cacheable_tokens(self, num_tokens: int, manager: SingleTypeKVCacheManager) -> int:
        """Tokens of ``num_tokens`` worth caching in this group: all but those multi-module
        MTP may prefill again (one group)."""
        return max(0, num_tokens - self.settings.num_reprefillable_tokens)

    def cache_blocks(self, request: RequestLike, num_tokens: int) -> None:
        """Each caching group caches its blocks; sparse groups keep the replay boundaries."""
        boundaries = rules.replay_boundaries(
            prompt_tokens(request), self.scheduler_block_size, bool(self.drop_eagle_group_ids)
        )
        for manager in self.managers:
            if manager.enable_caching:
                manager.cache_blocks(
                    request,
                    self.num_cacheable_tokens(num_tokens, manager),
                    self.retention_interval,
                    boundaries,
                )

    def free(self, request_id: str) -> None:
        """Each group releases its table as one batch, groups in order."""
        for manager in self.managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return tuple(manager.get_blocks(request_id) for manager in self.managers)

    def new_step_starts(self) -> None:
        for manager in self.managers:
            manager.new_step_starts()


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching disabled: no request ever hits."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        return tuple([] for _ in self.managers), 0, 0


class UnitaryCoordinator(KVCacheCoordinator):
    """A single KV cache group: no intersection needed."""

    def _configure(self) -> None:
        self.managers[0].use_eagle = 0 in self.drop_eagle_group_ids

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        manager = self.managers[0]
        hits, hit_length = manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            [0],
            drop_eagle_block=manager.use_eagle,
            alignment_tokens=manager.block_size,
        )
        return hits, hit_length, 0


@dataclass(frozen=True)
class AttentionType:
    """Groups with one spec, looked up jointly (Prefix caching, Case 2)."""

    spec: KVCacheSpec
    group_ids: tuple[int, ...]
    use_eagle: bool

    @property
    def is_full_attention(self) -> bool:
        """Whether the type's hit is a prefix, as full attention's is (it goes first)."""
        return self.spec.hit_is_prefix


class HybridCoordinator(KVCacheCoordinator):
    """Several groups: the longest hit length that every attention type accepts.

    Groups with equal specs form one attention type and are looked up jointly. Full attention
    goes first: its hit is a prefix, so every shorter length is a hit too, and the other types
    then search only within it (Prefix caching, Case 2). With more types, or none of them full
    attention, the lookup repeats at the lowered length until no type lowers it further.
    """

    def _configure(self) -> None:
        self.hash_block_size = self.settings.hash_block_size
        self.attention_types = self._split_attention_types(self.config)
        for attention_type in self.attention_types:
            for group_id in attention_type.group_ids:
                self.managers[group_id].use_eagle = attention_type.use_eagle

    def _split_attention_types(self, config: KVCacheConfig) -> list[AttentionType]:
        """One ``AttentionType`` per distinct spec, full attention first, else first appearance."""
        return [
            AttentionType(spec, tuple(ids), any(i in self.drop_eagle_group_ids for i in ids))
            for spec, ids in config.attention_types()
        ]

    def num_cacheable_tokens(self, num_tokens: int, manager: SingleTypeKVCacheManager) -> int:
        """Hits land on scheduler blocks, so cache up to the last one; an EAGLE group also one
        block past it (it matches that block, then drops it)."""
        block = self.scheduler_block_size
        aligned = num_tokens // block * block
        if manager.use_eagle and aligned > 0:
            final = max(0, num_tokens - self.settings.num_reprefillable_tokens)
            return min(final, final // block * block + manager.block_size)
        return aligned

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int, int]:
        """``rules.hybrid_hit_length`` over the attention types; each type's lookup keeps its
        blocks, and full attention is cut to the final length."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]

        def lookup(index: int, length: int, drop: bool) -> int:
            return self._type_hit(hits, block_hashes, index, length, drop)

        hit_length, longest = rules.hybrid_hit_length(
            lookup,
            [t.is_full_attention for t in self.attention_types],
            [t.use_eagle for t in self.attention_types],
            max_cache_hit_length,
        )
        for attention_type in self.attention_types:
            if attention_type.is_full_attention:
                block_size = self.managers[attention_type.group_ids[0]].block_size
                for group_id in attention_type.group_ids:
                    del hits[group_id][rules.cdiv(hit_length, block_size) :]
        return tuple(hits), hit_length, longest - hit_length

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, tuple[int, ...]]:
        """Each attention type's own longest hit, not intersected: the blocks and the hit
        length per group (a KV connector's lookup, which may supply what a lagging type lacks,
        as vLLM's ``find_longest_cache_hit_per_group``)."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        lengths = [0] * len(self.managers)
        for index, attention_type in enumerate(self.attention_types):
            length = self._type_hit(
                hits, block_hashes, index, max_cache_hit_length, attention_type.use_eagle
            )
            for group_id in attention_type.group_ids:
                lengths[group_id] = length
        return tuple(hits), tuple(lengths)

    def _type_hit(
        self,
        hits: list[list[KVCacheBlock]],
        block_hashes: Sequence[BlockHash],
        index: int,
        length: int,
        drop: bool,
    ) -> int:
        """One attention type's longest hit of at most ``length`` tokens, its blocks written
        into ``hits``; with ``drop`` (EAGLE) one block shorter."""
        attention_type = self.attention_types[index]
        manager = self.managers[attention_type.group_ids[0]]
        max_length = length
        if drop and not attention_type.spec.holds_state:
            # Match one block beyond the candidate, then drop it (a state type drops its
            # checkpoint instead).
            max_length = min(length + manager.block_size, len(block_hashes) * self.hash_block_size)
        found, found_length = manager.find_longest_cache_hit(
            block_hashes,
            max_length,
            attention_type.group_ids,
            drop_eagle_block=drop,
            alignment_tokens=self.scheduler_block_size,
        )
        for group_id, blocks in zip(attention_type.group_ids, found, strict=True):
            hits[group_id] = blocks
        return found_length


def make_coordinator(
    config: KVCacheConfig,
    settings: EngineSettings,
    *,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    event_builder_class: type[EventBuilder] = EventBuilder,
    eviction_policy: EvictionPolicy | None = None,
) -> KVCacheCoordinator:
    """The coordinator the document prescribes for this configuration (``eviction_policy``:
    ``None`` for vLLM's free-queue order)."""
    if not enable_caching:
        cls: type[KVCacheCoordinator] = NoPrefixCacheCoordinator
    elif len(config.groups) == 1:
        cls = UnitaryCoordinator
    else:
        cls = HybridCoordinator
    return cls(
        config,
        settings,
        enable_caching=enable_caching,
        enable_kv_cache_events=enable_kv_cache_events,
        event_builder_class=event_builder_class,
        eviction_policy=eviction_policy,
    )
