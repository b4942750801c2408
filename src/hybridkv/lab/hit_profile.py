"""Where a policy's hits are lost: per KV cache group, what first admissions found and what
eviction took.

A hybrid hit is the shortest of its groups' hits, so a policy that keeps one group's blocks
and evicts another's loses the hit all the same. ``ProfiledManager`` stands between a scheduler
loop and a manager (built with KV cache events on) and counts, per group, the prompt tokens
whose blocks each request's first admission found cached (a sliding window counts its
in-window blocks, a Mamba group its state block, as ``hybridkv replay`` does) and the cached
(hash, group) keys evicted (``BlockRemoved`` events). The policy table's ``--profile`` prints
them beside the hit rate.

Not every eviction costs a hit: a key no later prompt asks for again is free to lose.
``EvictionLedger`` splits the evicted keys: at each first admission it walks the prompt's
blocks from the start, past the keys still cached, counting the evicted ones the prompt
reaches (*reached again*), up to the first key that was never cached (no cache could hit past
it). Their tokens bound the hits the evictions cost; the other evicted keys cost none.
``hybridkv replay`` counts them too (``group_reached_again`` in its JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.reference import KVCacheBlocks, Request
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.scheduling import Manager
from hybridkv.spec import FullAttentionSpec, KVCacheSpec


class EventManager(Manager, Protocol):
    """A manager that emits KV cache events (both backends with ``enable_kv_cache_events``)."""

    def take_events(self) -> list[KVCacheEvent]: ...


@dataclass
class GroupProfile:
    """Per group: prompt tokens found cached at first admissions, cached keys evicted, and
    evicted keys a later first admission reached again (``EvictionLedger``)."""

    hit_tokens: list[int] = field(default_factory=list)
    evicted_keys: list[int] = field(default_factory=list)
    reached_again: list[int] = field(default_factory=list)


def walked_groups(specs: Sequence[KVCacheSpec], hash_block_size: int) -> list[bool]:
    """The groups ``EvictionLedger`` walks: full attention at the hash block size. A full
    attention hit is a prefix, so walking a prompt's blocks from the start is how a hit
    reads them; a window or chunk reads only the blocks before the hit's end, and a Mamba
    group one state, which a walk from the start does not measure."""
    return [
        isinstance(spec, FullAttentionSpec) and spec.block_size == hash_block_size for spec in specs
    ]


class EvictionLedger:
    """Per walked KV cache group (``walked_groups``: full attention), the keys cached now
    and the keys evicted since they were last cached, from a manager's events, and the
    evicted keys that later first admissions reached again (``reached_again``; 0 for the
    other groups).

    For a full-attention group those keys bound what eviction cost: a policy that had kept
    every one of them could have added at most their tokens to the hits (the other groups
    must hold their blocks at the same hit end too).
    """

    def __init__(self, walked: Sequence[bool]) -> None:
        self.walked = list(walked)
        self.cached: list[set[BlockHash]] = [set() for _ in walked]
        self.evicted: list[set[BlockHash]] = [set() for _ in walked]
        self.reached_again = [0] * len(walked)

    def observe(self, events: Sequence[object]) -> None:
        """Follow the walked groups' keys through a batch of events, in order (the other
        groups' keys are never read: they are not kept)."""
        walked = self.walked
        for event in events:
            if isinstance(event, BlockStored):
                g = event.group_idx
                if g is not None and walked[g]:
                    self.cached[g].update(event.block_hashes)
                    self.evicted[g].difference_update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                g = event.group_idx
                if g is not None and walked[g]:
                    self.cached[g].difference_update(event.block_hashes)
                    self.evicted[g].update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for keys in (*self.cached, *self.evicted):
                    keys.clear()

    def reached(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[list[BlockHash]]:
        """Per group, the evicted keys a prompt with these block hashes reaches (its first
        ``num_blocks`` blocks, walked from the start past cached and evicted keys up to the
        first key never cached). Changes nothing: ``count`` commits them."""
        found: list[list[BlockHash]] = []
        for g, walked in enumerate(self.walked):
            keys: list[BlockHash] = []
            if walked:
                cached, evicted = self.cached[g], self.evicted[g]
                for block_hash in hashes[:num_blocks]:
                    if block_hash in evicted:
                        keys.append(block_hash)
                    elif block_hash not in cached:
                        break
            found.append(keys)
        return found

    def count(self, reached: list[list[BlockHash]]) -> None:
        """Count a first admission's ``reached`` keys (each eviction is reached once)."""
        for g, keys in enumerate(reached):
            evicted = self.evicted[g]
            for key in keys:
                if key in evicted:
                    evicted.discard(key)
                    self.reached_again[g] += 1


class ProfiledManager:
    """``manager``'s scheduler-facing calls, counting each group's first-admission hits and
    evictions into ``profile`` (the manager must emit KV cache events)."""

    def __init__(
        self, manager: EventManager, specs: Sequence[KVCacheSpec], hash_block_size: int
    ) -> None:
        self.manager = manager
        self.group_block_sizes = tuple(spec.block_size for spec in specs)
        groups = len(self.group_block_sizes)
        self.ledger = EvictionLedger(walked_groups(specs, hash_block_size))
        # The profile's reached-again counts are the ledger's own list (no copy to keep up).
        self.profile = GroupProfile([0] * groups, [0] * groups, self.ledger.reached_again)
        self._found: dict[str, tuple[KVCacheBlocks, list[list[BlockHash]]]] = {}
        self._admitted: set[str] = set()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        self._count_evictions()  # the ledger sees the cache as the lookup does
        blocks, hits, boundary = self.manager.get_computed_blocks(request)
        if request.request_id not in self._admitted:
            full = request.num_prompt_tokens // request.hash_block_size
            reached = self.ledger.reached(request.block_hashes, full)
            self._found[request.request_id] = (blocks, reached)
        return blocks, hits, boundary

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        new = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
        )
        found = self._found.pop(request.request_id, None)
        if new is not None and found is not None and request.request_id not in self._admitted:
            self._admitted.add(request.request_id)
            self._count_hits(found[0])
            self.ledger.count(found[1])  # before this allocation's events cache them again
        self._count_evictions()  # an allocation is what evicts
        return new

    def free(self, request: Request) -> None:
        self.manager.free(request)

    @property
    def usage(self) -> float:
        return self.manager.usage

    def _count_hits(self, blocks: KVCacheBlocks) -> None:
        add_group_hit_tokens(self.profile.hit_tokens, blocks, self.group_block_sizes)

    def _count_evictions(self) -> None:
        events = self.manager.take_events()
        self.ledger.observe(events)
        for event in events:
            if isinstance(event, BlockRemoved) and event.group_idx is not None:
                self.profile.evicted_keys[event.group_idx] += len(event.block_hashes)


def add_group_hit_tokens(
    totals: list[int], blocks: KVCacheBlocks, group_block_sizes: Sequence[int]
) -> None:
    """Add to each group's total the prompt tokens whose blocks a hit found cached: its
    non-null block ids × the group's block size (a sliding window counts its in-window
    blocks, a Mamba group its one state block)."""
    for g, (ids, size) in enumerate(zip(blocks.block_ids, group_block_sizes, strict=False)):
        totals[g] += size * sum(1 for block_id in ids if block_id)
