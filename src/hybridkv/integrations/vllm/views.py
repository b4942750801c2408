"""The read-only views of vLLM's manager internals that vLLM's scheduler, its aux-output
connector and its tests read: the coordinator's ``single_type_managers``, the block pool and
its blocks. Each answers from the core manager's public API; any other name raises
``UnsupportedInternal`` (an ``AttributeError`` naming it).

- ``coordinator.single_type_managers[i]``: ``block_size``, ``kv_cache_spec``, ``block_pool``;
  ``req_to_blocks`` (request id → its table's blocks) and ``num_cached_block`` (request id →
  its blocks entered into the prefix cache), built per read from the core's
  ``cached_block_counts`` and ``get_block_ids``. A cross-attention group's view passes
  ``isinstance(view, CrossAttentionManager)`` (a virtual subclass of vLLM's class), the test
  vLLM's scheduler tests make to find that group. ``coordinator.get_num_blocks_to_allocate``,
  which the scheduler asks for requests waiting on a KV connector's load, is the core's.
- ``block_pool``: free blocks, usage, ``num_gpu_blocks``, ``hash_block_size``,
  ``get_cached_block``, ``evict_blocks``, ``free_blocks`` (a deferred free of the blocks
  ``pop_blocks_for_free`` handed out); ``free_block_queue.num_free_blocks`` and ``blocks``
  (each block's ``block_id``, ``ref_cnt`` and ``is_null``, from the core's ``snapshot``):
  what vLLM's memory-leak check reads. Views, not vLLM's objects: writes do not reach the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.integrations.vllm.errors import UnsupportedInternal, refuse
from hybridkv.integrations.vllm.metrics import report_evicted
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks


@dataclass(frozen=True)
class BlockView:
    """One block as vLLM's tests read a ``KVCacheBlock``: its id, holders and null flag."""

    block_id: int
    ref_cnt: int = 0
    is_null: bool = False


@dataclass(frozen=True)
class ConnectorBlockView:
    """A block of ``KVCacheBlocks.blocks`` as a KV connector reads it: its id, null flag and
    ``block_hash`` (vLLM's ``BlockHashWithGroupId`` bytes, ``None`` until cached)."""

    block_id: int
    is_null: bool
    block_hash: bytes | None = None


@dataclass(frozen=True)
class BlockViews(KVCacheBlocks):
    """``KVCacheBlocks`` with vLLM's ``blocks``: per group, its blocks as a connector reads
    them, their hashes read from the core when asked (``block_hashes``: block ids → vLLM's
    ``block_hash`` of each; the scheduler reads ``empty_kv_cache_blocks.blocks``)."""

    block_hashes: Callable[[list[int]], list[bytes | None]] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def blocks(self) -> tuple[list[ConnectorBlockView], ...]:
        ids = [i for group in self.block_ids for i in group]
        hashes = iter(self.block_hashes(ids) if self.block_hashes else [None] * len(ids))
        return tuple(
            [ConnectorBlockView(i, i == 0, next(hashes)) for i in group] for group in self.block_ids
        )


@dataclass(frozen=True)
class FreeQueueView:
    """``block_pool.free_block_queue``: only its length."""

    num_free_blocks: int


@dataclass(frozen=True)
class GroupView:
    """What the scheduler (and vLLM's aux-output connector and tests) read of a single-type
    manager: its block size, vLLM spec, the block pool, and its requests' tables."""

    kv_cache_group_id: int
    block_size: int
    kv_cache_spec: Any
    block_pool: BlockPoolView

    def __getattr__(self, name: str) -> Any:
        raise _internals("single_type_managers[i]", name)

    @property
    def req_to_blocks(self) -> dict[str, list[BlockView]]:
        """Each request holding blocks → its table in this group (the null block as one)."""
        return self.block_pool.request_tables(self.kv_cache_group_id)

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Each request holding blocks → how many of its blocks entered the prefix cache."""
        counts = self.block_pool.core.cached_block_counts()
        return {rid: count[self.kv_cache_group_id] for rid, count in counts.items()}


class CrossAttentionGroupView(GroupView):
    """A cross-attention group's ``GroupView``: registered with vLLM's
    ``CrossAttentionManager`` as a virtual subclass (``group_view``)."""


def group_view(group_id: int, spec: Any, block_pool: BlockPoolView) -> GroupView:
    """The view of group ``group_id`` of vLLM spec ``spec``."""
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    if not isinstance(spec, CrossAttentionSpec):
        return GroupView(group_id, spec.block_size, spec, block_pool)
    CrossAttentionManager.register(CrossAttentionGroupView)  # idempotent
    return CrossAttentionGroupView(group_id, spec.block_size, spec, block_pool)


@dataclass(frozen=True)
class CachedBlockView:
    """A block ``BlockPool.get_cached_block`` returns: its id and the hash it is cached under."""

    block_id: int
    block_hash: bytes
    is_null: bool = False


def _internals(owner: str, name: str) -> AttributeError:
    if name.startswith("__"):
        return AttributeError(name)
    return UnsupportedInternal(
        f"vLLM manager internals ({owner}.{name})",
        "hybridkv offers vLLM's manager API, not its coordinator, block pool or block objects "
        "(the aux-output connector and some of vLLM's tests read them)",
    )


class CoordinatorView:
    """The scheduler's read-only view of the coordinator (set-up arithmetic only)."""

    def __getattr__(self, name: str) -> Any:
        raise _internals("coordinator", name)

    enable_partial_hash_hits = False

    def __init__(self, core: Any, groups: Sequence[GroupView]) -> None:
        self.core = core
        self.single_type_managers = list(groups)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[Any]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """The free blocks a request would consume (vLLM's arguments): what the scheduler
        keeps free for a request whose KV a connector is still loading. It passes no hit."""
        refuse(
            any(new_computed_blocks),
            "coordinator.get_num_blocks_to_allocate with new_computed_blocks",
            "the scheduler passes none; allocate_slots adopts a hit",
        )
        del num_local_computed_tokens  # only a partial Mamba hit reads it (refused)
        return int(
            self.core.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                total_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                prefill_end=prefill_end,
                num_encoder_tokens=num_encoder_tokens,
            )
        )


class BlockPoolView:
    """The block pool as the scheduler and vLLM's tests read it (``core``: the core manager)."""

    def __init__(self, core: Any, num_gpu_blocks: int, metrics_collector: Any = None) -> None:
        self.core = core
        self.num_gpu_blocks = num_gpu_blocks
        # vLLM's ``KVCacheMetricsCollector`` (``--kv-cache-metrics``), told of ``evict_blocks``.
        self.metrics_collector = metrics_collector

    def __getattr__(self, name: str) -> Any:
        raise _internals("block_pool", name)

    def get_num_free_blocks(self) -> int:
        return int(self.core.num_free_blocks)

    def get_usage(self) -> float:
        return float(self.core.usage)

    @property
    def hash_block_size(self) -> int:
        return int(self.core.hash_block_size)

    @property
    def free_block_queue(self) -> FreeQueueView:
        return FreeQueueView(int(self.core.num_free_blocks))

    @property
    def blocks(self) -> list[BlockView]:
        """Every block, the null block (id 0) first, with its reference count."""
        return self._views(range(self.num_gpu_blocks), self.core.snapshot().ref_counts)

    def request_tables(self, group_id: int) -> dict[str, list[BlockView]]:
        """``single_type_managers[group_id].req_to_blocks``: each request's table, each block
        with its reference count now."""
        held = self.core.snapshot().ref_counts
        return {
            rid: self._views(self.core.get_block_ids(rid)[group_id], held)
            for rid in self.core.cached_block_counts()
        }

    @staticmethod
    def _views(block_ids: Iterable[int], ref_counts: dict[int, int]) -> list[BlockView]:
        return [BlockView(i, ref_counts.get(i, 0), i == 0) for i in block_ids]

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[CachedBlockView] | None:
        """The first block cached under ``block_hash`` in each group, or ``None`` if any group
        misses (the core's ``get_cached_block_ids``)."""
        ids = self.core.get_cached_block_ids(block_hash, kv_cache_group_ids)
        return None if ids is None else [CachedBlockView(i, block_hash) for i in ids]

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Forget the cached keys of these blocks, in the set's order (the core's); each id
        reported to the metrics collector as evicted, as vLLM's pool reports it."""
        self.core.evict_blocks(block_ids)
        report_evicted(self.metrics_collector, block_ids)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Drop one holder of each block, in eviction order: the scheduler's deferred free of
        what ``pop_blocks_for_free`` handed out (the core's ``free_blocks``)."""
        self.core.free_blocks([block.block_id for block in ordered_blocks])
