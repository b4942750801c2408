"""Flat integer buffers seen three ways: as a ``memoryview``, a numpy array and a torch tensor.

Data layout
-----------
Every piece of per-block and per-request state of the optimized backend is one flat, C-contiguous
integer buffer. The memory is a numpy array's (numpy asks the kernel for transparent huge pages
on large allocations, so a pool's scattered per-block reads miss the TLB less, and its bytes
count in ``tracemalloc``); a ``memoryview`` cast to the buffer's type and ``torch.from_numpy``
see the same memory without copying. Single-element updates (one block popped, one hash cached)
go through the memoryview, where an element costs one indexing operation; host-side vector work
on a few dozen to a few thousand elements (a scheduler step's crossing requests, a prompt's
hit) goes through the numpy array, whose calls cost a fraction of a microsecond; the tensor
serves the paths that hand tensors on (the block tables a GPU reads). All views stay valid for
the life of the buffer: it is never resized.

The block pool's per-block int32 fields are the exception to "one buffer each": they live
interleaved in one ``BlockRecords`` array, a 20-byte record per block::

    record[b] = (ref, prev, next, hnext, src)     int32 each

so that the fields one step reads and writes of a block (taking it: ``next``, ``prev``,
``ref``, ``src``; releasing it: ``ref``, ``prev``, ``next``; caching it: ``hnext``, ``src``)
share a cache line instead of spanning five: the pool's blocks are touched in no order, most
often cold. Each field is still an ``IntBuffer`` (``IntBuffer.field``): its memoryview, numpy
array and tensor are strided views of the records. ``hk`` (int64) stays a buffer of its own:
at a 20-byte stride it would sit misaligned, where torch cannot view it, and padding the
records to 24 bytes would cost 4 bytes a block.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

_NUMPY = {"q": np.int64, "i": np.int32, "b": np.int8}
TypeCode = Literal["i", "q", "b"]


class IntBuffer:
    """``n`` integers, each ``fill`` at first; ``.a`` is the memoryview, ``.n`` the numpy
    array, ``.t`` the tensor.

    int32 (``typecode`` ``"i"``), int64 (``"q"``) or int8 (``"b"``).
    """

    __slots__ = ("a", "n", "t")

    def __init__(self, n: int, fill: int = 0, typecode: TypeCode = "i") -> None:
        # One spare element keeps every view valid for n == 0.
        memory = np.full(max(n, 1), fill, dtype=_NUMPY[typecode])
        self.a = memory.data.cast("B").cast(typecode)
        self.n: npt.NDArray[Any] = memory[:n]
        self.t = torch.from_numpy(memory)[:n]

    @classmethod
    def field(cls, view: npt.NDArray[Any], n: int, fill: int) -> IntBuffer:
        """``n`` integers (at least one element) of a strided int32 ``view`` (a field of
        ``BlockRecords``), each ``fill`` at first."""
        view[:] = fill
        buffer = cls.__new__(cls)
        buffer.a = view[: max(n, 1)].data
        buffer.n = view[:n]
        buffer.t = torch.from_numpy(view)[:n]
        return buffer

    def __len__(self) -> int:
        return int(self.n.shape[0])

    @property
    def nbytes(self) -> int:
        return self.a.nbytes


class BlockRecords:
    """The block pool's per-block int32 fields, one record per block (see the module
    docstring): ``ref`` (``N`` entries), ``prev`` and ``next`` (``N + 2``: the free queue's
    sentinels), ``hnext`` and ``src`` (``N + 1``: the chain end), each an ``IntBuffer``."""

    __slots__ = ("hnext", "next", "prev", "records", "ref", "src")

    FIELDS = ("ref", "prev", "next", "hnext", "src")

    def __init__(self, num_blocks: int) -> None:
        n = num_blocks
        self.records = np.empty(n + 2, dtype=np.dtype([(f, np.int32) for f in self.FIELDS]))
        self.ref = IntBuffer.field(self.records["ref"], n, 0)
        self.prev = IntBuffer.field(self.records["prev"], n + 2, -1)
        self.next = IntBuffer.field(self.records["next"], n + 2, -1)
        self.hnext = IntBuffer.field(self.records["hnext"], n + 1, n)
        self.src = IntBuffer.field(self.records["src"], n + 1, -1)
