"""The scheduler API of this project's own managers, as ``ProtocolAdapter`` wraps it.

``hybridkv.reference.KVCacheManager`` and ``hybridkv.optimized.TorchKVCacheManager`` satisfy it
as they are. The conformance suite itself drives only ``ManagerAdapter``s
(``hybridkv.conformance.adapters``): ``ProtocolAdapter`` and ``manager_backend`` turn a manager
of this shape into one, and another engine's manager joins with an adapter of its own.
"""

from __future__ import annotations

from typing import Protocol

from hybridkv.reference.events import KVCacheEvent, PrefixCacheStats
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.reference.snapshot import PoolSnapshot


class KVCacheManagerLike(Protocol):
    """The methods the conformance suite calls."""

    def get_computed_blocks(self, request: RequestLike) -> tuple[KVCacheBlocks, int, int]: ...

    def new_step_starts(self) -> None: ...

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        *,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None: ...

    def free(self, request: RequestLike) -> None: ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    @property
    def usage(self) -> float: ...

    @property
    def num_free_blocks(self) -> int: ...

    def take_events(self) -> list[KVCacheEvent]: ...

    def prefix_cache_lookup_enabled(self, request: RequestLike) -> bool: ...

    def record_prefix_cache_stats(self, request: RequestLike, num_hits: int) -> None: ...

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    def snapshot(self) -> PoolSnapshot: ...

    def check_invariants(self) -> None: ...
