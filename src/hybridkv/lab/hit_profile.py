"""Where a policy's hits are lost: per KV cache group, what first admissions found and what
eviction took.

A hybrid hit is the shortest of its groups' hits, so a policy that keeps one group's blocks
and evicts another's loses the hit all the same. ``ProfiledManager`` stands between a scheduler
loop and a manager (built with KV cache events on) and counts, per group, the prompt tokens
whose blocks each request's first admission found cached (a sliding window counts its
in-window blocks, a Mamba group its state block, as ``hybridkv replay`` does) and the cached
(hash, group) keys evicted (``BlockRemoved`` events). The policy table's ``--profile`` prints
them beside the hit rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.reference import KVCacheBlocks, Request
from hybridkv.reference.events import BlockRemoved, KVCacheEvent
from hybridkv.scheduling import Manager


class EventManager(Manager, Protocol):
    """A manager that emits KV cache events (both backends with ``enable_kv_cache_events``)."""

    def take_events(self) -> list[KVCacheEvent]: ...


@dataclass
class GroupProfile:
    """Per group: prompt tokens found cached at first admissions, and cached keys evicted."""

    hit_tokens: list[int] = field(default_factory=list)
    evicted_keys: list[int] = field(default_factory=list)


class ProfiledManager:
    """``manager``'s scheduler-facing calls, counting each group's first-admission hits and
    evictions into ``profile`` (the manager must emit KV cache events)."""

    def __init__(self, manager: EventManager, group_block_sizes: Sequence[int]) -> None:
        self.manager = manager
        self.group_block_sizes = tuple(group_block_sizes)
        groups = len(self.group_block_sizes)
        self.profile = GroupProfile([0] * groups, [0] * groups)
        self._found: dict[str, KVCacheBlocks] = {}
        self._admitted: set[str] = set()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        blocks, hits, boundary = self.manager.get_computed_blocks(request)
        self._found[request.request_id] = blocks
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
        self._count_evictions()  # an allocation is what evicts
        found = self._found.pop(request.request_id, None)
        if new is not None and found is not None and request.request_id not in self._admitted:
            self._admitted.add(request.request_id)
            self._count_hits(found)
        return new

    def free(self, request: Request) -> None:
        self.manager.free(request)

    @property
    def usage(self) -> float:
        return self.manager.usage

    def _count_hits(self, blocks: KVCacheBlocks) -> None:
        add_group_hit_tokens(self.profile.hit_tokens, blocks, self.group_block_sizes)

    def _count_evictions(self) -> None:
        for event in self.manager.take_events():
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
