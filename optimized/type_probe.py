"""The memo of one attention type within a lookup, and the scans' reads of it.

Data layout: per attention type (groups with equal specs) one ``TypeProbe``: a numpy int32
array ``found[groups, positions]`` (the block of each group, valid only where the position is
a hit; allocated empty, so that the positions a lookup never reaches cost nothing) and a
``bytearray`` of per-position flags (``HIT`` when every group of the type has the block,
``MISSED`` when one does not, ``UNKNOWN`` not probed yet), read by the scans with
``find``/``rfind`` and written a window at a time through a numpy view. Positions are filled in
windows: a window of ``vector_min`` (position, group) pairs or more through the lookup's
``probe_window``, a smaller one position by position.

The scans: full attention reads runs from its known leading hits as far as they reach, then
probes the one position where they stop (most often the end of the cached prefix), then goes
on window by window (``leading_hits``); a sliding window runs
``rules.sliding_window_hit_blocks_skip`` (proved equal to ``rules.sliding_window_hit_blocks``)
with each candidate window filled at once and searched with ``rfind`` (``window_hit``); the
other rules read the memo through ``WindowedFlags``. ``lead_run`` fills every type's leading
hits from one source's run at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.hit_blocks import NO_IDS, GroupHit, Ints
from hybridkv.optimized.source_runs import Lookup
from hybridkv.optimized.thresholds import (
    FLAG_MAX_WINDOW,
    FLAG_MIN_WINDOW,
    LEAD_RUN_MAX,
    RUN_MIN,
    SCAN_FIRST_WINDOW,
)
from hybridkv.reference.lazy_flags import LazyFlags

MISSED, HIT, UNKNOWN = 0, 1, 2
"""The per-position flags of a ``TypeProbe`` (bytes of its ``flags``)."""
_HITS = bytes((HIT,))


class TypeProbe:
    """The memo of one attention type (groups with equal specs) within one lookup.

    ``found[i]`` holds, per position, the block of group ``group_ids[i]`` where the position is
    a hit (uninitialised elsewhere); ``flags`` holds ``HIT`` where every group has one,
    ``MISSED`` where one misses and ``UNKNOWN`` where not probed yet; both are written by the
    probes and read by the scans.
    """

    def __init__(self, lookup: Lookup, group_ids: Sequence[int], length: int) -> None:
        self.lookup = lookup
        self.group_ids = list(group_ids)
        self.length = length
        self.found: Ints = np.empty((len(self.group_ids), length), dtype=np.int32)
        self.flags = bytearray((UNKNOWN,)) * length
        self.leading = 0  # positions 0 … leading − 1 are known hits (``lead_run``)

    def fill(self, lo: int, hi: int) -> None:
        """Probe positions ``lo … hi − 1`` (those not probed yet) in every group of the type."""
        flags = self.flags
        lo = flags.find(UNKNOWN, lo, hi)
        if lo < 0:
            return
        hi = flags.rfind(UNKNOWN, lo, hi) + 1
        lookup = self.lookup
        if (hi - lo) * len(self.group_ids) >= lookup.vector_min:
            lookup.pool.paths.ran(paths.LOOKUP_WINDOW)
            best = lookup.probe_window(lo, hi, self.group_ids)
            self.found[:, lo:hi] = best
            # A bool's byte is HIT (1) or MISSED (0).
            self.flags[lo:hi] = (best >= 0).all(0).tobytes()
            return
        found = self.found
        for pos in range(lo, hi):
            if flags[pos] != UNKNOWN:
                continue
            flag = HIT
            for index, group_id in enumerate(self.group_ids):
                block = lookup.probe(pos, group_id)
                found[index, pos] = block
                if block < 0:
                    flag = MISSED
                    break
            flags[pos] = flag

    def run_ahead(self, lo: int, hi: int) -> int:
        """Fill positions from ``lo`` (up to ``hi``) with sources' runs as far as they reach;
        the first position not filled (a long prompt's scan then needs no windows)."""
        lookup = self.lookup
        if (hi - lo) * len(self.group_ids) < lookup.vector_min or lookup.pool.extras:
            return lo
        first_group = self.group_ids[0]
        while hi - lo >= RUN_MIN:
            first = lookup.probe(lo, first_group)
            if first < 0:
                # A miss in the first group: the position is settled.
                self.flags[lo] = MISSED
                break
            run = lookup.source_run(lo, hi, self.group_ids, first)
            if run is None:
                break
            count = run.shape[1]
            lookup.pool.paths.ran(paths.LOOKUP_SOURCE_RUN)
            self.found[:, lo : lo + count] = run
            self.flags[lo : lo + count] = _HITS * count
            lo += count
            if count < RUN_MIN:
                break
        return lo

    def leading_hits(self, length: int) -> int:
        """Leading positions cached in every group (the full-attention scan): from the known
        leading hits, runs, then the position where they stop, then window by window."""
        flags = self.flags
        pos = min(self.leading, length)
        if pos < length and flags[pos] == UNKNOWN:
            pos = self.run_ahead(pos, length)
            if pos < length:
                # Most often the end of the cached prefix: settled by one probe per group.
                self.fill(pos, pos + 1)
                if flags[pos] != HIT:
                    return pos
                pos += 1
        span = SCAN_FIRST_WINDOW
        while pos < length:
            end = min(length, pos + span)
            self.fill(pos, end)
            miss = flags.find(MISSED, pos, end)
            if miss >= 0:
                return miss
            pos = end
            span *= 4
        return length

    def window_hit(self, length: int, needed: int) -> tuple[int, int]:
        """``rules.sliding_window_hit_blocks`` over the first ``length`` positions:
        ``(hit blocks, first real block)``, as its proved twin ``sliding_window_hit_blocks_skip``
        computes it, each candidate window filled at once and searched right to left (a
        one-token window, ``needed`` 0, as one block)."""
        span = max(needed, 1)
        flags = self.flags
        end = length
        while end >= span:
            self.fill(end - span, end)
            miss = flags.rfind(MISSED, end - span, end)
            if miss < 0:
                return end, end - span
            end = miss
        return self.leading_hits(end), 0

    def blocks(self, first: int, num: int) -> tuple[GroupHit, ...]:
        """Per group: null blocks before ``first``, then the cached blocks up to ``num`` (a copy:
        the hit outlives the lookup)."""
        if num <= first:
            return tuple(GroupHit(first, NO_IDS) for _ in self.group_ids)
        rows = self.found[:, first:num].copy()
        return tuple(GroupHit(first, row) for row in rows)


class WindowedFlags(LazyFlags):
    """``cached[i]`` for the rule functions, filled in windows in the scan's direction."""

    def __init__(self, memo: TypeProbe, length: int, leftwards: bool, span: int) -> None:
        super().__init__(length)
        self._memo = memo
        self._leftwards = leftwards
        self._span = max(span, FLAG_MIN_WINDOW)

    def flag(self, index: int) -> bool:
        flag = self._memo.flags[index]
        if flag == UNKNOWN:
            if self._leftwards:
                self._memo.fill(max(0, index + 1 - self._span), index + 1)
            else:
                self._memo.fill(index, min(self._length, index + self._span))
            self._span = min(self._span * 2, FLAG_MAX_WINDOW)
            flag = self._memo.flags[index]
        return flag == HIT


def _columns(group_ids: Sequence[int]) -> slice | list[int]:
    """The columns of ``group_ids`` in rows of every group: a slice when they are consecutive
    (a view, not a copy)."""
    first = group_ids[0]
    if list(group_ids) == list(range(first, first + len(group_ids))):
        return slice(first, first + len(group_ids))
    return list(group_ids)


def lead_run(memos: Sequence[TypeProbe]) -> list[int]:
    """Read the run of one source from position 0 for the groups of every type at once (the
    memos of one lookup, which together hold every group): a prompt cached by one request
    holds its blocks in every group, so one chain walk, one set of checks on the source's rows
    of blocks and one verification fill every type's leading hits, instead of a run per type.
    Only while the run is at most ``LEAD_RUN_MAX`` (position, group) pairs and at least
    ``vector_min``: a longer one reads positions a window type does not need, and the types'
    own scans read their runs. Returns the leading hits read per memo (all 0 when none)."""
    lookup = memos[0].lookup
    pool = lookup.pool
    num_groups = pool.num_groups
    counts = [0] * len(memos)
    width = max(memo.length for memo in memos)
    pairs = width * num_groups
    if pool.extras or not memos[0].length or not lookup.vector_min <= pairs <= LEAD_RUN_MAX:
        return counts
    first = lookup.first_candidate(0, memos[0].group_ids[0])
    if first < 0:
        memos[0].flags[0] = MISSED
        return counts
    pool.settle_duplicates()
    src = pool.src.a[first]
    source = pool.source(src)
    width = min(width, lookup.recorded_positions(source, range(num_groups)))
    if width < 1:
        return counts
    blocks, good = lookup.run_checks(source.blocks, 0, width, range(num_groups))
    columns = [_columns(memo.group_ids) for memo in memos]
    if good.all():
        # The source holds every position in every group (a prompt it cached whole).
        counts = [min(memo.length, width) for memo in memos]
    else:
        for index, (memo, cols) in enumerate(zip(memos, columns, strict=True)):
            span = min(memo.length, width)
            if span:
                every = np.logical_and.reduce(good[:span, cols], 1)
                at = int(every.argmin())
                counts[index] = span if every[at] else at
    verified = lookup.verified_run(src, 0, max(counts))
    for index, (memo, cols) in enumerate(zip(memos, columns, strict=True)):
        count = min(counts[index], verified)
        if count and count < verified and not lookup.lookahead_agrees(src, count - 1):
            count = 0
        counts[index] = count
        if count:
            memo.found[:, :count] = blocks[:count, cols].T
            memo.flags[:count] = _HITS * count
            memo.leading = count
    if verified:
        lookup.hint = src
    return counts
