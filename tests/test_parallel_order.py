"""The test command's order under pytest-xdist (``tests/parallel_order.py``): the slow tests
start first, spread over the workers' shares by Graham's LPT rule; the others keep their order."""

from __future__ import annotations

from typing import Any, cast

import pytest
from parallel_order import marked_seconds, share_sizes, spread


class _Item:
    """A collected test as ``spread`` reads it: a name and maybe a ``slow`` marker."""

    def __init__(self, name: str, seconds: Any = None) -> None:
        self.nodeid = name
        self.marker = None if seconds is None else pytest.mark.slow(seconds=seconds).mark

    def get_closest_marker(self, name: str) -> Any:
        return self.marker if name == "slow" else None


def _items(*specs: tuple[str, float | None]) -> list[pytest.Item]:
    return [cast(pytest.Item, _Item(name, seconds)) for name, seconds in specs]


def _names(items: list[pytest.Item]) -> list[str]:
    return [item.nodeid for item in items]


def test_the_shares_are_the_counts_worksteal_sends_first() -> None:
    assert share_sizes(7, 2) == [3, 4]
    assert share_sizes(9, 3) == [3, 3, 3]
    assert sum(share_sizes(2203, 16)) == 2203


def test_slow_tests_lead_each_share_longest_first_to_the_least_loaded() -> None:
    items = _items(
        ("a", None), ("b", None), ("own", 150), ("c", None), ("hair", 66),
        ("d", None), ("m1", 3), ("m2", 3), ("e", None), ("f", None),
    )  # fmt: skip
    ordered = spread(items, 2)
    # Share 0 (5 tests): own; share 1 (5 tests): hair, m1, m2 (66 + 3 + 3 < 150).
    assert _names(ordered) == ["own", "a", "b", "c", "d", "hair", "m1", "m2", "e", "f"]


def test_one_process_keeps_the_collection_order() -> None:
    items = _items(("a", None), ("slow", 10), ("b", None))
    assert _names(spread(items, 1)) == ["a", "slow", "b"]


def test_every_test_is_kept_exactly_once() -> None:
    items = _items(*[(f"t{i}", (i % 5) * 2.0 or None) for i in range(41)])
    ordered = spread(items, 4)
    assert sorted(_names(ordered)) == sorted(_names(items))


def test_a_slow_marker_without_seconds_is_a_usage_error() -> None:
    item = cast(pytest.Item, _Item("t", 0))
    with pytest.raises(pytest.UsageError, match="t: slow\\(seconds\\) needs seconds > 0, got 0"):
        marked_seconds(item)
