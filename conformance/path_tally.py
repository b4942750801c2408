"""The fast paths a lockstep run drove, per implementation that counts its own.

An implementation whose adapter offers ``fast_paths()`` (``PathCounting``) says how often each
of its paths ran; ``PathTally`` reads the counts around each scheduler call of the lockstep and
adds what ran to the run's counts (``RunStats.fast_paths``). A single ``allocate`` across which
no count changed was the implementation's quiet exit (hybridkv's optimized backend counts
every other way through ``allocate_slots``: ``hybridkv.optimized.path_counts``), counted here as
``QUIET_EXIT``. A path listed at 0 is one the run never drove.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hybridkv.conformance.adapters import ManagerAdapter, path_counter

QUIET_EXIT = "quiet exit"

Reading = list[Counter[str] | None]


class PathTally:
    """Adds each call's paths into ``totals`` (implementation name → path → times)."""

    def __init__(self, impls: Sequence[ManagerAdapter], totals: dict[str, Counter[str]]) -> None:
        self.impls = list(impls)
        self.totals = totals

    def read(self) -> Reading:
        """Each implementation's path counts now (``None``: it keeps none)."""
        found: Reading = []
        for impl in self.impls:
            counter = path_counter(impl)
            counts = None if counter is None else counter.fast_paths()
            found.append(None if counts is None else Counter(counts))
        return found

    def add(self, before: Reading, single_allocate: bool = False) -> None:
        """Add the paths each implementation ran since ``before``; a single ``allocate`` that
        ran none was its quiet exit."""
        for impl, old, new in zip(self.impls, before, self.read(), strict=True):
            if old is None or new is None:
                continue
            ran = new - old
            if single_allocate and not ran:
                ran[QUIET_EXIT] = 1
            total = self.totals.setdefault(impl.name, Counter({QUIET_EXIT: 0}))
            for name in new:
                total[name] += 0  # a path that has not run yet is listed at 0
            total.update(ran)
