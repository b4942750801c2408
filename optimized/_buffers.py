"""Flat ``int32`` buffers seen three ways: as a Python ``array``, a numpy array and a torch tensor.

Data layout
-----------
Every piece of per-block and per-request state of the optimized backend is one flat, C-contiguous
``int32`` buffer. The memory is an ``array.array('i')``; ``numpy.frombuffer`` and
``torch.frombuffer`` wrap the same memory without copying. Single-element updates (one block
popped, one hash cached) go through the array, where an element costs one indexing operation;
host-side vector work on a few dozen to a few thousand elements (a scheduler step's crossing
requests, a prompt's hit) goes through the numpy view, whose calls cost a fraction of a
microsecond; the torch view serves the paths that hand tensors on (the block tables a GPU
reads). All views stay valid for the life of the buffer: it is never resized.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

assert array("i").itemsize == 4, "the optimized backend needs a 4-byte C int"
assert array("q").itemsize == 8

_NUMPY = {"q": np.int64, "i": np.int32, "b": np.int8}


class IntBuffer:
    """``n`` integers, each ``fill`` at first; ``.a`` is the array, ``.n`` the numpy array,
    ``.t`` the tensor.

    int32 (``typecode`` ``"i"``), int64 (``"q"``) or int8 (``"b"``).
    """

    __slots__ = ("a", "n", "t")

    def __init__(self, n: int, fill: int = 0, typecode: str = "i") -> None:
        # One spare element keeps torch.frombuffer valid for n == 0 (it rejects empty buffers).
        self.a = array(typecode, [fill]) * max(n, 1)
        dtype = {"q": torch.int64, "i": torch.int32, "b": torch.int8}[typecode]
        self.t = torch.frombuffer(self.a, dtype=dtype)[:n]
        self.n: npt.NDArray[Any] = np.frombuffer(self.a, dtype=_NUMPY[typecode])[:n]

    def __len__(self) -> int:
        return self.t.shape[0]

    @property
    def nbytes(self) -> int:
        return self.a.buffer_info()[1] * self.a.itemsize
