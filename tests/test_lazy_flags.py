"""``LazyFlags``: the rules' ``cached[i]`` view reads as a sequence and asks only what it needs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.reference.lazy_flags import LazyFlags


class RecordingFlags(LazyFlags):
    """Flags read from a list, recording every index asked for."""

    def __init__(self, values: list[bool]) -> None:
        super().__init__(len(values))
        self.values = values
        self.asked: list[int] = []

    def flag(self, index: int) -> bool:
        self.asked.append(index)
        return self.values[index]


def test_lazy_flags_ask_only_for_the_items_read() -> None:
    """A full-attention scan stops at the first miss: blocks past it are never looked up."""
    flags = RecordingFlags([True, True, False, True, True])
    assert len(flags) == 5
    assert (flags[0], flags[1], flags[2]) == (True, True, False)
    assert flags[-1] is True
    assert flags.asked == [0, 1, 2, 4]


def test_lazy_flags_reject_an_index_out_of_range_by_naming_it() -> None:
    flags = RecordingFlags([True, False, True])
    for index in (3, -4, 10):
        with pytest.raises(IndexError) as raised:
            flags[index]
        assert raised.value.args == (index,)
    assert flags.asked == []
    assert (flags[2], flags[-3]) == (True, True)


@given(
    st.lists(st.booleans(), max_size=12),
    st.one_of(st.none(), st.integers(-14, 14)),
    st.one_of(st.none(), st.integers(-14, 14)),
    st.one_of(st.none(), st.integers(-4, 4).filter(bool)),
)
def test_lazy_flags_read_like_the_list_they_stand_for(
    values: list[bool], start: int | None, stop: int | None, step: int | None
) -> None:
    flags = RecordingFlags(values)
    assert flags[start:stop:step] == values[start:stop:step]
    assert list(flags) == values
    assert list(reversed(flags)) == values[::-1]
    assert (True in flags) == (True in values)
