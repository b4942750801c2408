"""``KVCacheBlocks``: the opaque allocation result the scheduler gets back, one id list per group.

The scheduler never looks inside except through ``get_block_ids``; it hands a lookup's result
back to ``allocate_slots`` unchanged. Holding block *ids* (not block objects) lets every backend
return the same value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, overload


@dataclass(frozen=True)
class KVCacheBlocks:
    """Block ids per KV cache group; position ``i`` of a group covers tokens ``i × block_size …``.

    Positions that need no KV (before a sliding window or the current chunk) hold the null
    block 0.
    """

    block_ids: tuple[tuple[int, ...], ...]

    @overload
    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(
        self, allow_none: bool, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """The ids as fresh lists, one per group (the shape vLLM's scheduler expects).

        vLLM's surface: ``group_ids`` selects groups (all by default); with ``allow_none`` the
        result is ``None`` when every selected group is empty.
        """
        groups = (
            self.block_ids
            if group_ids is None
            else tuple(self.block_ids[group_id] for group_id in group_ids)
        )
        if allow_none and not any(groups):
            return None
        return tuple(list(ids) for ids in groups)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Group by group, these blocks followed by ``other``'s."""
        return KVCacheBlocks(
            tuple(a + b for a, b in zip(self.block_ids, other.block_ids, strict=True))
        )

    def new_empty(self) -> KVCacheBlocks:
        """No blocks, in as many groups."""
        return KVCacheBlocks.empty(self.num_groups)

    @property
    def num_groups(self) -> int:
        return len(self.block_ids)

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        """No blocks in any of ``num_groups`` groups."""
        return cls(tuple(() for _ in range(num_groups)))
