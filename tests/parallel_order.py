"""The order of the collected tests when pytest-xdist runs them on several workers.

The test command runs ``pytest -n auto --dist worksteal``: each worker first gets one contiguous,
equal share of the collection (by count) and an idle worker then steals the tail of the busiest
worker's queue. A test of a minute or more that sits late in a share starts late and ends the
run alone. So the tests marked ``slow(seconds)`` (about that long on an idle 2-core machine) are
spread over the shares longest first, each to the share with the least marked time so far
(Graham's LPT rule), at the front of its share; the other tests keep their collection order and
fill the shares to their counts. Without xdist (one process) the collection order is kept.
"""

from __future__ import annotations

import os

import pytest

WORKER_COUNT = "PYTEST_XDIST_WORKER_COUNT"


def marked_seconds(item: pytest.Item) -> float:
    """The seconds a ``slow`` marker gives the test (0 for an unmarked test)."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return 0.0
    seconds = marker.kwargs.get("seconds", marker.args[0] if marker.args else None)
    if not isinstance(seconds, int | float) or seconds <= 0:
        raise pytest.UsageError(f"{item.nodeid}: slow(seconds) needs seconds > 0, got {seconds!r}")
    return float(seconds)


def share_sizes(total: int, workers: int) -> list[int]:
    """The counts worksteal sends each worker first: ``len(pending) // nodes_remaining``."""
    sizes = []
    for i in range(workers):
        size = total // (workers - i)
        sizes.append(size)
        total -= size
    return sizes


def spread(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` reordered so that each worker's first share starts with its slow tests."""
    if workers < 2 or len(items) < workers:
        return items
    sizes = share_sizes(len(items), workers)
    seconds = [marked_seconds(item) for item in items]
    slow = sorted((n for n, s in enumerate(seconds) if s > 0), key=lambda n: -seconds[n])
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for n in slow:
        open_shares = [w for w in range(workers) if len(shares[w]) < sizes[w]]
        target = min(open_shares, key=lambda w: (loads[w], w))
        shares[target].append(items[n])
        loads[target] += seconds[n]
    rest = iter(item for item, s in zip(items, seconds, strict=True) if s == 0)
    for w in range(workers):
        while len(shares[w]) < sizes[w]:
            shares[w].append(next(rest))
    return [item for share in shares for item in share]


def reorder_for_workers(items: list[pytest.Item]) -> None:
    """``pytest_collection_modifyitems``: spread the slow tests when xdist runs the session."""
    workers = int(os.environ.get(WORKER_COUNT, "1"))
    items[:] = spread(items, workers)
