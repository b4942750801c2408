"""A lookup's hit: per KV cache group a count of leading null blocks and an int32 array of ids.

``GroupHit`` is one group's hit as the lookup found it (copied out of its memo, so it outlives
the lookup): ``nulls`` null blocks, then ``ids``, a numpy int32 array it owns. ``HitBlocks``
is the ``KVCacheBlocks`` a lookup returns: it holds a ``GroupHit`` per group and builds the
tuples of Python ints that ``block_ids`` holds only on the first read, because a long hit's
ids as Python objects (thousands of ints and tuples) would cost every caller, while most (the
manager's own ``allocate_slots``) read the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.reference.kv_cache_blocks import KVCacheBlocks

Ints = npt.NDArray[Any]
"""A numpy integer array (int32 block ids, int64 keys and tags)."""


class GroupHit:
    """One group's hit: ``nulls`` null blocks, then the blocks ``ids`` (int32, owned); ``dense``
    when none of those is null (a lookup's hits are); ``size`` blocks in all (its ``len``, an
    attribute for the paths that read every group's)."""

    __slots__ = ("dense", "ids", "nulls", "size")

    def __init__(self, nulls: int, ids: Ints, dense: bool = True) -> None:
        self.nulls = nulls
        self.ids = ids
        self.dense = dense
        self.size: int = nulls + ids.shape[0]

    def __len__(self) -> int:
        return self.size

    def cut(self, length: int) -> GroupHit:
        """The first ``length`` blocks of the hit."""
        if length >= len(self):
            return self
        if length <= self.nulls:
            return GroupHit(length, NO_IDS)
        return GroupHit(self.nulls, self.ids[: length - self.nulls], self.dense)

    def as_tuple(self) -> tuple[int, ...]:
        """The hit as ``KVCacheBlocks`` holds a group's: a tuple of Python ints."""
        return (0,) * self.nulls + tuple(self.ids.tolist())

    @classmethod
    def of(cls, ids: Sequence[int]) -> GroupHit:
        """A group's hit given as ids: its leading nulls counted, the rest kept as given (a hit
        a scheduler built itself may hold a null anywhere)."""
        if not ids:
            return NO_HIT
        found: Ints = np.array(ids, dtype=np.int32)
        real = np.flatnonzero(found)
        nulls = int(real[0]) if real.shape[0] else found.shape[0]
        return cls(nulls, found[nulls:], real.shape[0] == found.shape[0] - nulls)


NO_IDS: Ints = np.empty(0, dtype=np.int32)
NO_IDS.flags.writeable = False
"""No block ids (read-only): the ids of a hit of nulls only."""
NO_HIT = GroupHit(0, NO_IDS)
"""A group's empty hit."""


def ids_past(hits: Sequence[GroupHit], skipped: Sequence[int]) -> list[Ints]:
    """Each group's hit ids from its first position past its ``skipped`` ones (the blocks an
    admission adopts, nulls among them where a hit is not ``dense``)."""
    return [hit.ids[max(skip - hit.nulls, 0) :] for hit, skip in zip(hits, skipped, strict=True)]


class HitBlocks(KVCacheBlocks):
    """A lookup's hit: equal to the ``KVCacheBlocks`` of the same ids (both ways, and hashing
    alike), immutable, and ``allocate_slots`` takes it back as the manager's own result.

    It holds each group's hit as a ``GroupHit`` (a count of nulls and an int32 array) and builds
    the tuples of Python ints that ``block_ids`` holds on its first read, then keeps them: a
    long hit's ids as Python objects (thousands of ints and tuples, made and later freed) cost
    only the caller that reads them."""

    _hits: tuple[GroupHit, ...]
    _ids: tuple[tuple[int, ...], ...] | None

    def __init__(self, hits: Sequence[GroupHit]) -> None:
        object.__setattr__(self, "_hits", tuple(hits))
        object.__setattr__(self, "_ids", None)

    @property
    def block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Block ids per KV cache group (built on the first read)."""
        ids = self._ids
        if ids is None:
            ids = tuple(hit.as_tuple() for hit in self._hits)
            object.__setattr__(self, "_ids", ids)
        return ids

    @property
    def num_groups(self) -> int:
        return len(self._hits)

    @property
    def group_hits(self) -> tuple[GroupHit, ...]:
        """Each group's hit as the lookup found it (no Python ints built)."""
        return self._hits

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KVCacheBlocks):
            return self.block_ids == other.block_ids
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.block_ids,))  # as the frozen dataclass hashes

    def __repr__(self) -> str:
        return f"KVCacheBlocks(block_ids={self.block_ids!r})"

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[type[KVCacheBlocks], tuple[tuple[tuple[int, ...], ...]]]:
        # Copies and pickles are plain ``KVCacheBlocks`` of the same ids.
        return (KVCacheBlocks, (self.block_ids,))
