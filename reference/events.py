"""KV cache events and prefix-cache statistics: what the manager reports to the outside.

Events let an external index (a KV-aware router, a CPU offload tier) mirror the prefix cache:
a block stored, a block removed, everything cleared. Statistics count lookups and their hits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import RequestLike


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
    """Prefix-cache lookups counted since the last report, in vLLM's shape.

    A lookup is counted when its request is admitted (``record``), not when it is made: a
    scheduler looks a waiting request up at every step until it fits, and only the lookup that
    admits it says what the cache saved. Requests admitted again after a preemption are counted
    apart (``preempted_*``): their hits are mostly their own blocks, kept since the preemption,
    and would inflate the hit rate of new traffic. ``queries`` and ``hits`` are tokens;
    ``reset`` says the prefix cache was reset in the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> PrefixCacheStats:
        """These statistics plus one admitted lookup of ``num_tokens`` tokens that hit
        ``num_hits`` (counted apart when the request was ``preempted`` before)."""
        if preempted:
            return replace(
                self,
                preempted_requests=self.preempted_requests + 1,
                preempted_queries=self.preempted_queries + num_tokens,
                preempted_hits=self.preempted_hits + num_hits,
            )
        return replace(
            self,
            requests=self.requests + 1,
            queries=self.queries + num_tokens,
            hits=self.hits + num_hits,
        )

    def after_reset(self) -> PrefixCacheStats:
        """These statistics, marked as spanning a prefix-cache reset."""
        return replace(self, reset=True)


def count_admission(
    stats: PrefixCacheStats, request: RequestLike, num_hits: int
) -> PrefixCacheStats:
    """``stats`` plus the lookup that admitted ``request`` with ``num_hits`` cached tokens.

    A request counts as preempted when it has ``num_preemptions > 0`` (the scheduler's
    counter; a request without the attribute was never preempted). ``num_hits`` must lie in
    ``[0, num_tokens)``: the last token is always recomputed.
    """
    if (
        not isinstance(num_hits, int)
        or isinstance(num_hits, bool)
        or not 0 <= num_hits < max(request.num_tokens, 1)
    ):
        raise ValueError(
            f"num_hits must be an int in [0, {request.num_tokens}) for request "
            f"{request.request_id!r}, got {num_hits!r}"
        )
    preempted = getattr(request, "num_preemptions", 0) > 0
    return stats.record(request.num_tokens, num_hits, preempted)
