"""``PoolSnapshot``: the whole observable state of a block pool as one comparable value.

Two backends that follow the same rules produce equal snapshots after the same calls; the golden
traces record exactly these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.reference.block_pool import BlockPool


@dataclass(frozen=True)
class PoolSnapshot:
    """Free queue (head first), reference counts above 0, cached block ids per group (sorted),
    the number of distinct (block hash, group) keys in the prefix cache, and free blocks."""

    free_block_ids: tuple[int, ...]
    ref_counts: dict[int, int]
    cached_block_ids: tuple[tuple[int, ...], ...]
    num_cached_keys: int

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)


def pool_snapshot(pool: BlockPool, num_groups: int) -> PoolSnapshot:
    """The reference pool's ``PoolSnapshot`` (``num_groups``: the groups its keys name)."""
    cached: list[set[int]] = [set() for _ in range(num_groups)]
    for (_, group_id), blocks in pool.cached_block_hash_to_block.items():
        cached[group_id].update(blocks)
    return PoolSnapshot(
        free_block_ids=tuple(block.block_id for block in pool.free_block_queue),
        ref_counts={b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt > 0},
        cached_block_ids=tuple(tuple(sorted(ids)) for ids in cached),
        num_cached_keys=len(pool.cached_block_hash_to_block),
    )
