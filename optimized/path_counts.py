"""How often each vectorised or specialised path of the optimized backend ran.

A path the differential machine seldom reaches is a path whose bugs only unit tests can catch,
so the conformance report prints these counts per run (``hybridkv.conformance.run_stats``) and
``tests/test_conformance_fast_paths.py`` pins that the fast profile reaches each path.

A path is counted where it is chosen, in the phase that serves it, never on ``allocate_slots``'
quiet exit: that exit stays one comparison and a return. Every other way through
``allocate_slots`` counts one of ``ALLOCATE_PATHS``, so a caller that sees no count change
across a call knows the quiet exit answered it (the conformance lockstep counts it so).

Data layout: one ``Counter`` of path name → times, owned by the pool (``TorchBlockPool.paths``,
the object every phase reaches), read through ``TorchKVCacheManager.fast_paths``.
"""

from __future__ import annotations

from collections import Counter

RUNNING_STEP = "running step"
"""``allocate_slots`` of a running request past the quiet exit (``step.run``)."""
FUSED_STEP = "fused step (one block per group)"
"""``allocate_slots`` of a running request served by ``FusedStep`` (its common crossing call)."""
ALLOCATE = "allocate past the quiet exit"
"""``allocate_slots`` served by ``allocation.allocate`` (admissions, hits, odd counts)."""
ALLOCATE_PATHS = (RUNNING_STEP, FUSED_STEP, ALLOCATE)

STEP_RELEASE = "step: window or chunk release"
STEP_UNIFORM_TAKE = "step: uniform-columns take"
CACHE_UNIFORM = "caching: uniform columns"
CACHE_GENERAL = "caching: general"
TOUCH_VECTORISED = "touch: vectorised (one array)"
TOUCH_HEARD = "touch: group by group (a policy hears it)"
BATCH_QUIET = "batch: quiet requests skipped"
BATCH_ONE_BY_ONE = "batch: busy requests one by one"
BATCH_SMALL = "batch: below batch_min, quiet exits in its loop"
"""Requests of a batch too small for the vectorised step answered by the quiet exit's check in
the batch's own loop (``hybridkv.optimized.batch_small``)."""
BATCH_VECTORISED = "batch: vectorised step"
BATCH_RELEASES = "batch: vectorised step with window releases"
BATCH_REMEMBERED = "batch: the last batch's rows remembered"
"""A batch of the same request objects as the last, in order, no row changed hands since
(``RowTables.remembered``)."""
BATCH_COLUMNS = "batch: computed counts from step columns"
"""A remembered batch of column requests of one ``StepColumns``: their counts one gather."""
FREE_BATCH = "free_batch: vectorised"
LINKS_APART = "links: vectorised (a bucket each)"
"""``chain_entries`` of entries each alone in its bucket (linked to the old heads directly)."""
LINKS_SHARED = "links: vectorised (shared buckets)"
"""``chain_entries`` of a batch with two entries in one bucket (sorted by bucket first)."""
LOOKUP_WINDOW = "lookup: vectorised window probe"
LOOKUP_SOURCE_RUN = "lookup: source run"
LOOKUP_LEADING = "lookup: vectorised leading run"
LOOKUP_MEMO_RUN = "lookup: the memo's run"
"""A hit read from the record of the cached request whose hashes the prompt adopted
(``hybridkv.optimized.memo_hit``)."""
HYBRID_WITH_FULL = "lookup: 3-4 attention types with full attention"
ADMISSION_ONE_PASS = "admission: one pass (every group's table as one matrix)"
"""A plain admission (``hybridkv.optimized.one_pass_admission``)."""
TAKE_RUN = "take: a run of consecutive ids (no walk)"
"""``pop_array`` of blocks whose ids follow each other in the free queue (found by one
comparison of their links)."""
MEMO_MEMCMP = "memo: prompts' ids compared by memcmp"
"""A comparison of two prompts' packed ids, in the hash memo's walk, made by one ``memcmp`` of
their memory (``hybridkv.optimized.same_ids``: from ``memcmp_min`` ids)."""

PATHS = (
    RUNNING_STEP,
    FUSED_STEP,
    ALLOCATE,
    STEP_RELEASE,
    STEP_UNIFORM_TAKE,
    CACHE_UNIFORM,
    CACHE_GENERAL,
    TOUCH_VECTORISED,
    TOUCH_HEARD,
    BATCH_QUIET,
    BATCH_ONE_BY_ONE,
    BATCH_SMALL,
    BATCH_VECTORISED,
    BATCH_RELEASES,
    BATCH_REMEMBERED,
    BATCH_COLUMNS,
    FREE_BATCH,
    LINKS_APART,
    LINKS_SHARED,
    LOOKUP_WINDOW,
    LOOKUP_SOURCE_RUN,
    LOOKUP_LEADING,
    LOOKUP_MEMO_RUN,
    HYBRID_WITH_FULL,
    ADMISSION_ONE_PASS,
    TAKE_RUN,
    MEMO_MEMCMP,
)
"""Every path counted, in the report's order (the quiet exit, counted by callers, apart)."""


class PathCounts:
    """Times each path ran since the pool was built."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def ran(self, path: str, times: int = 1) -> None:
        self.counts[path] += times

    def listed(self) -> dict[str, int]:
        """Every path's count, in ``PATHS`` order (0 for one that has not run)."""
        return {path: self.counts[path] for path in PATHS}
