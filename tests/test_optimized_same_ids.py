"""The comparison of packed id ranges that the hash memo's walk makes (``same_ids``): one
``memcmp`` of the arrays' memory, or without it memoryview slices and numpy views, each equal
to comparing the ids as Python lists."""

from __future__ import annotations

import os
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import same_ids as same_ids_module
from hybridkv.optimized.same_ids import (
    C_MEMCMP,
    MEMCMP_MIN,
    NUMPY_COMPARE_MIN,
    same_ids,
    same_ids_portable,
)


@pytest.mark.skipif(os.name != "posix", reason="the C library of a POSIX system has memcmp")
def test_the_c_librarys_memcmp_is_found_on_posix() -> None:
    assert C_MEMCMP is not None


@st.composite
def two_arrays_and_a_range(draw: st.DrawFn) -> tuple[array[int], array[int], int, int]:
    """Two id arrays equal but for a few ids (anywhere, either array longer) and a range
    within both, sized on both sides of ``MEMCMP_MIN``."""
    length = draw(st.sampled_from([0, 1, 15, MEMCMP_MIN - 1, MEMCMP_MIN, 3 * MEMCMP_MIN + 5]))
    ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8))
    ours = array("Q", (ids[i % len(ids)] for i in range(length)))
    theirs = array("Q", ours)
    theirs.extend(range(draw(st.integers(0, 3))))
    for at in draw(st.lists(st.integers(0, max(length - 1, 0)), max_size=3)):
        if length:
            theirs[at] = draw(st.integers(0, 2**64 - 1))
    stop = draw(st.integers(0, length))
    start = draw(st.integers(0, stop))
    return ours, theirs, start, stop


@settings(max_examples=300, deadline=None)
@given(case=two_arrays_and_a_range(), memcmp_min=st.sampled_from([0, 1, MEMCMP_MIN]))
def test_either_comparison_equals_comparing_the_ids_as_lists(
    case: tuple[array[int], array[int], int, int], memcmp_min: int
) -> None:
    """From any ``memcmp_min`` (a manager's knob; the differential machine sets 1)."""
    ours, theirs, start, stop = case
    expected = ours.tolist()[start:stop] == theirs.tolist()[start:stop]
    assert same_ids(ours, theirs, start, stop, memcmp_min) is expected
    assert same_ids(theirs, ours, start, stop, memcmp_min) is expected
    assert same_ids_portable(ours, theirs, start, stop) is expected


@pytest.mark.parametrize("memcmp", [True, False], ids=["memcmp", "portable"])
@pytest.mark.parametrize("changed", [0, 1, NUMPY_COMPARE_MIN - 1, 3 * NUMPY_COMPARE_MIN - 1])
def test_a_difference_in_any_byte_of_one_id_is_found_in_a_long_range(
    changed: int, memcmp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the changed id's eight bytes in turn (the first, the highest), in a range long
    enough for numpy views without ``memcmp``."""
    if not memcmp:
        monkeypatch.setattr(same_ids_module, "C_MEMCMP", None)
    elif C_MEMCMP is None:
        pytest.skip("ctypes finds no memcmp in this C library")
    ours = array("Q", range(3 * NUMPY_COMPARE_MIN))
    for byte in range(8):
        theirs = array("Q", ours)
        theirs[changed] ^= 1 << (8 * byte)
        assert not same_ids(ours, theirs, 0, len(ours))
        assert same_ids(ours, theirs, changed + 1, len(ours))
        assert same_ids(ours, theirs, 0, changed)


@pytest.mark.parametrize(
    ("start", "stop"), [(-1, 4), (5, 4), (0, 2 * MEMCMP_MIN + 1), (0, 3 * MEMCMP_MIN)]
)
def test_a_range_outside_either_array_is_refused(start: int, stop: int) -> None:
    """Checked before ``memcmp`` reads memory: the message names the range and the lengths."""
    ours = array("Q", range(2 * MEMCMP_MIN))
    theirs = array("Q", range(3 * MEMCMP_MIN))
    with pytest.raises(ValueError, match=rf"ids \[{start}, {stop}\) must lie within both"):
        same_ids(ours, theirs, start, stop)
