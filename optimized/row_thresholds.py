"""``RowThresholds``: when each row next needs work, derived from its counters by the group rules.

A running request's step can do three things: take blocks (its tokens outgrow its tables),
release blocks (a window or chunk moves past a block) and cache blocks (a block becomes full).
Each row keeps, in ``RowTables``, the token counts at which the next of each happens
(``capacity``, ``release_at``, ``cache_at``) and the least of them as ``quiet_below``: a step
below it does nothing, which decides most decode calls with one comparison. This class
recomputes them from the row's counters (table lengths, leading nulls, cached positions) after
a step changed them: those the step moved, in one call (the single-request paths, which know
what they changed), or all of them for many rows at once in numpy (the batched step).

The rules are those of the groups' attention types (``GroupRule``): a table of ``n`` positions
holds ``n × block_size`` tokens (less a Mamba group's speculative blocks); a sliding window of
``w`` tokens lets its next block go once ``(nulls + 1) × block_size + w − 1`` tokens are
processed (``sliding_window_skipped_tokens``), a chunk of ``c`` tokens at the start of the
chunk after that block; the next block is full at ``(cached + 1) × block_size`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridkv.optimized.group_columns import GroupColumns
from hybridkv.optimized.group_rules import CROSS, NEVER, GroupRule, one_window, release_columns
from hybridkv.optimized.rows import RowTables


class RowThresholds:
    """Recomputes the rows' thresholds in ``RowTables`` (see the module docstring)."""

    __slots__ = (
        "_block_size",
        "_caching",
        "_capacity_rules",
        "_columns",
        "_general",
        "_num_groups",
        "_one_window",
        "_release_columns",
        "_rows",
        "_rules",
        "_uniform",
    )

    def __init__(
        self,
        rows: RowTables,
        rules: Sequence[GroupRule],
        columns: GroupColumns,
        *,
        block_size: int,
        caching: bool,
        uniform: bool,
        general: bool,
    ) -> None:
        self._rows = rows
        self._rules = list(rules)
        # The groups whose tables hold decoder tokens (a cross-attention table holds the
        # encoder's, taken once: it never bounds a step).
        self._capacity_rules = [(g, rule) for g, rule in enumerate(rules) if rule.kind != CROSS]
        self._columns = columns
        self._num_groups = len(self._rules)
        self._block_size = block_size
        self._caching = caching
        self._uniform = uniform  # every table of a row as long, one block size
        self._general = general  # caching looks at every call (block sizes differ, Mamba align)
        self._one_window = one_window(self._rules)
        self._release_columns = release_columns(self._rules)

    def refresh(self, row: int) -> None:
        """Recompute all of the row's thresholds from its counters."""
        self.after_step(row, True, True, True)

    def after_step(self, row: int, released: bool, took: bool, cached: bool) -> None:
        """Recompute the thresholds a step moved, then ``quiet_below``, in one call: ``release_at``
        after it ``released`` blocks, ``capacity`` after it ``took`` blocks, ``cache_at`` after
        it ``cached`` blocks (the others stay as they are)."""
        rows = self._rows
        g_count = self._num_groups
        at = row * g_count
        if took:
            # The tokens its shortest table holds.
            length = rows.length
            if self._uniform:
                capacity = min(length[at : at + g_count]) * self._block_size
            else:
                capacity = NEVER
                for g, rule in self._capacity_rules:
                    capacity = min(capacity, (length[at + g] - rule.spec_blocks) * rule.block_size)
            rows.capacity[row] = capacity
        if released:
            # Where its first window or chunk next lets a block go.
            nulls = rows.nulls
            window = self._one_window
            if window is not None:
                # One sliding window for every releasing group, next to each other: their least
                # leading nulls decide.
                first, end, b, span = window
                release = (min(nulls[at + first : at + end]) + 1) * b + span - 1
            else:
                release = NEVER
                for g, b, span, chunked in self._release_columns:
                    if chunked:
                        start = -(-(nulls[at + g] + 1) * b // span) * span  # the next chunk
                        release = min(release, start)
                    else:
                        release = min(release, (nulls[at + g] + 1) * b + span - 1)
            rows.release_at[row] = release
        if cached:
            # The tokens at which its next block is full.
            if self._general:
                cache = 0  # scheduler-block rounding, prompt tails, Mamba: look every call
            elif self._uniform:
                cache = (min(rows.cached[at : at + g_count]) + 1) * self._block_size
            else:
                cache = NEVER
                for g, rule in enumerate(self._rules):
                    cache = min(cache, (rows.cached[at + g] + 1) * rule.block_size)
            rows.cache_at[row] = cache
        quiet = min(rows.capacity[row], rows.release_at[row]) + 1
        if self._caching:
            quiet = min(quiet, rows.cache_at[row])
        rows.quiet_below[row] = quiet

    def refresh_rows(
        self,
        rows: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        nulls: npt.NDArray[np.int64],
        cached: npt.NDArray[np.int64],
    ) -> None:
        """``refresh`` for many rows of a vectorisable layout (int64), in numpy calls, from
        their counters as they now stand (``[n, G]`` each: the batch that changed them has them
        at hand, so they are not gathered again)."""
        b = self._block_size
        nxt = self._rows.thresholds
        capacity = length.min(1) * b
        nxt[0, rows] = capacity
        columns = self._columns
        if columns.releases:
            release = (nulls + 1) * b + columns.window_less_one
            if columns.chunk is not None:
                starts = -((nulls + 1) * b // -columns.chunk_or_one) * columns.chunk_or_one
                release = np.where(columns.chunk > 0, starts, release)
            release_at = release.min(1)
            nxt[1, rows] = release_at
        else:
            release_at = nxt[1, rows]
        cache_at = (cached.min(1) + 1) * b
        nxt[2, rows] = cache_at
        quiet = np.minimum(capacity, release_at) + 1
        nxt[3, rows] = np.minimum(quiet, cache_at) if self._caching else quiet
