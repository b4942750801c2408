"""Whether two packed id arrays agree over a range: one ``memcmp`` of their memory.

The hash memo (``hybridkv.optimized.memo_tree``) adopts a cached request's block hashes for
the leading blocks whose ids equal the prompt's, so each adoption first compares the two
arrays of ids over a range: the whole shared system prompt in an admission, every id when a
long prompt comes back. Two unsigned 64-bit ids are equal exactly when their eight bytes are,
so the comparison is the C library's ``memcmp`` of the two ranges, called through ``ctypes``
on the arrays' own buffers (nothing copied: a copy of a long prompt's ids is a fresh
allocation whose pages fault in again). Short ranges, below ``MEMCMP_MIN`` ids
(``hybridkv.optimized.thresholds``; a manager's ``memcmp_min``), compare as memoryview slices
(one C loop over their items), which costs less than the foreign call.

Where ``ctypes`` finds no ``memcmp`` (``C_MEMCMP`` is ``None``), ``same_ids_portable``
answers instead: memoryview slices, or from ``NUMPY_COMPARE_MIN`` ids numpy views of the same
memory (one vector pass). Both give the same answer; ``tests/test_optimized_same_ids.py``
compares them with a comparison of Python lists.

Data layout
-----------
``ours`` and ``theirs`` are ``array('Q')``: id i at byte 8·i of the buffer whose address
``buffer_info()`` gives, so ids [start, stop) are bytes [8·start, 8·stop). The range is
checked against both arrays' lengths before ``memcmp`` reads it: a range past either end
raises ``ValueError`` instead of reading memory the arrays do not own. While ``memcmp`` runs
both arrays are exported (a memoryview of each) and the GIL stays held (``ctypes.PyDLL``), so
no array is resized under it.
"""

from __future__ import annotations

import ctypes
import os
from array import array
from collections.abc import Callable
from typing import Final

import numpy as np

from hybridkv.optimized.thresholds import MEMCMP_MIN, NUMPY_COMPARE_MIN

__all__ = [
    "C_MEMCMP",
    "MEMCMP_MIN",
    "NUMPY_COMPARE_MIN",
    "by_memcmp",
    "same_ids",
    "same_ids_portable",
]

ITEM_BYTES = 8  # an id packed as unsigned 64 bits ('Q')


def find_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp(a, b, n)`` as a ctypes function of two addresses and a byte
    count, or ``None`` where ctypes cannot load it."""
    try:
        # PyDLL: the call keeps the GIL, so no other thread runs (and resizes an array) during it.
        library = ctypes.PyDLL("msvcrt") if os.name == "nt" else ctypes.PyDLL(None)
        function = library.memcmp
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    compare: Callable[[int, int, int], int] = function
    return compare


C_MEMCMP: Final = find_memcmp()
"""The C library's ``memcmp``, loaded once (a function, not state), or ``None``."""


def by_memcmp(count: int, memcmp_min: int = MEMCMP_MIN) -> bool:
    """Whether ``same_ids`` compares a range of ``count`` ids with ``memcmp``."""
    return C_MEMCMP is not None and count >= memcmp_min


def same_ids(
    ours: array[int], theirs: array[int], start: int, stop: int, memcmp_min: int = MEMCMP_MIN
) -> bool:
    """Whether ids ``start … stop − 1`` of two ``array('Q')`` agree, by ``memcmp`` from
    ``memcmp_min`` ids (see the module docstring); ``ValueError`` for a range that is not
    within both arrays."""
    if not 0 <= start <= stop or stop > len(ours) or stop > len(theirs):
        raise ValueError(
            f"ids [{start}, {stop}) must lie within both arrays ({len(ours)} and {len(theirs)} ids)"
        )
    if not by_memcmp(stop - start, memcmp_min) or C_MEMCMP is None:  # (None: for mypy)
        return same_ids_portable(ours, theirs, start, stop)
    at, size = start * ITEM_BYTES, (stop - start) * ITEM_BYTES
    # Both buffers exported while their addresses are read and compared: neither array can be
    # resized (and its memory moved) meanwhile.
    with memoryview(ours), memoryview(theirs):
        return C_MEMCMP(ours.buffer_info()[0] + at, theirs.buffer_info()[0] + at, size) == 0


def same_ids_portable(ours: array[int], theirs: array[int], start: int, stop: int) -> bool:
    """``same_ids`` without ``memcmp``: the memoryview slices compared (one C loop over their
    items), or from ``NUMPY_COMPARE_MIN`` ids numpy views of the same memory (one vector pass);
    neither copies the ranges. The range must lie within both arrays."""
    if stop - start < NUMPY_COMPARE_MIN:
        return memoryview(ours)[start:stop] == memoryview(theirs)[start:stop]
    count = stop - start
    x = np.frombuffer(ours, np.uint64, count, start * ITEM_BYTES)
    y = np.frombuffer(theirs, np.uint64, count, start * ITEM_BYTES)
    return bool((x == y).all())  # array_equal's checks of shape and type cost a third more
