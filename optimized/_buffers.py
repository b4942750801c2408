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

    def __len__(self) -> int:
        return int(self.n.shape[0])

    @property
    def nbytes(self) -> int:
        return self.a.nbytes
