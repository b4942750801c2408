"""``KVCacheBlocks``: the opaque allocation result the scheduler gets back, one id list per group.

The scheduler never looks inside except through ``get_block_ids``; it hands a lookup's result
back to ``allocate_slots`` unchanged. Holding block *ids* (not block objects) lets every backend
return the same value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheBlocks:
    """Block ids per KV cache group; position ``i`` of a group covers tokens ``i × block_size …``.

    Positions that need no KV (before a sliding window or the current chunk) hold the null
    block 0.
    """

    block_ids: tuple[tuple[int, ...], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The ids as fresh lists, one per group (the shape vLLM's scheduler expects)."""
        return tuple(list(ids) for ids in self.block_ids)

    @property
    def num_groups(self) -> int:
        return len(self.block_ids)

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        """No blocks in any of ``num_groups`` groups."""
        return cls(tuple(() for _ in range(num_groups)))
