"""KV cache events and prefix-cache statistics: what the manager reports to the outside.

Events let an external index (a KV-aware router, a CPU offload tier) mirror the prefix cache:
a block stored, a block removed, everything cleared. Statistics count lookups and their hits.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.reference.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Full blocks of one group entered the prefix cache, in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block of one group was evicted (its memory is about to be reused)."""

    block_hashes: tuple[BlockHash, ...]
    group_id: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` dropped every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class PrefixCacheStats:
    """Lookups since the last report: requests looked up, tokens queried, tokens hit.

    ``reset`` says the prefix cache was reset in that interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int) -> PrefixCacheStats:
        """These statistics plus one lookup of ``num_tokens`` tokens that hit ``num_hits``."""
        return PrefixCacheStats(
            self.requests + 1, self.queries + num_tokens, self.hits + num_hits, self.reset
        )

    def after_reset(self) -> PrefixCacheStats:
        """These statistics, marked as spanning a prefix-cache reset."""
        return PrefixCacheStats(self.requests, self.queries, self.hits, reset=True)
