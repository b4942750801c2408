"""``PoolSnapshot``: the whole observable state of a block pool as one comparable value.

Two backends that follow the same rules produce equal snapshots after the same calls; the golden
traces record exactly these fields.
"""

from __future__ import annotations

from dataclasses import dataclass


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
