"""A read-only ``Sequence[bool]`` computed item by item: the cache-hit rules' view of the pool.

The rules of ``hybridkv.spec.rules`` take ``cached[i]`` ("is block ``i`` of the request cached?")
as a plain sequence, so that they stay pure and small. A lookup must not ask the block pool about
every block of a long prompt up front, though: full attention scans left to right and stops at
the first miss; a sliding window scans right to left and stops at the first run long enough
(Prefix caching, Cases 0 and 1). This base class turns a per-block question into such a sequence;
each manager answers the question its own way.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import overload


class LazyFlags(Sequence[bool]):
    """``flags[i]`` for ``0 <= i < length``, computed by ``flag(i)`` only when asked for."""

    def __init__(self, length: int) -> None:
        self._length = length

    @abstractmethod
    def flag(self, index: int) -> bool:
        """The flag of block ``index`` (``0 <= index < len(self)``)."""

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> bool: ...

    @overload
    def __getitem__(self, index: slice) -> list[bool]: ...

    def __getitem__(self, index: int | slice) -> bool | list[bool]:
        if isinstance(index, slice):
            return [self.flag(i) for i in range(*index.indices(self._length))]
        if not -self._length <= index < self._length:
            raise IndexError(index)
        return self.flag(index % self._length)
