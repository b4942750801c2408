"""A lookup's runs over sources: long hits read from a source's record of its blocks at once.

A source (the request that cached a block) records, per tag (hash index × G + group), the block
it cached there, and evicting a block clears its entry (``hybridkv.optimized.block_pool``), so
the source's record read as an int32 array (``Source.blocks``) is the list of its blocks still
cached: a run of positions is its record's rows (a numpy view, position-major, groups as
columns), less the unrecorded and duplicate entries (``dups``), verified once for all of them
(``source_run``). ``probe_window`` reads a window from runs as far as they reach, the source of
the last run first (``hint``: a prompt cached by one request holds its blocks in every group),
and leaves the rest to ``probe_vector``.

``Lookup`` is the class a lookup builds: verification, probes and runs, one per
``get_computed_blocks`` call.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.hit_blocks import Ints
from hybridkv.optimized.probes import MISS, Probes
from hybridkv.optimized.sources import Source
from hybridkv.optimized.thresholds import RUN_MIN, RUN_SCALAR_MAX, VECTOR_MIN
from hybridkv.reference.request import RequestLike


class Lookup(Probes):
    """Probes and verification for one request's lookup."""

    def __init__(
        self,
        pool: TorchBlockPool,
        request: RequestLike,
        block_size: int,
        vector_min: int = VECTOR_MIN,
        lookahead: int = 0,
        scale: int = 1,
    ) -> None:
        super().__init__(pool, request, block_size, lookahead, scale)
        # Extra keys are probed one by one (with their insertion order).
        self.vector_min = vector_min if not pool.extras else 1 << 62
        self.hint = -1  # the source of the last run read

    def probe_window(self, lo: int, hi: int, group_ids: Sequence[int]) -> Ints:
        """``probe_vector``'s result, read from sources' runs where it can: from ``lo``, the
        source of the block found at the first position gives the blocks of the positions
        after it (``source_run``), as long as it has them; the rest goes to ``probe_vector``."""
        parts: list[Ints] = []
        start = lo
        if not self.pool.extras:
            while hi - start >= RUN_MIN:
                # The source of the last run first (a prompt cached by one request holds its
                # blocks in every group), else the one of the block a probe finds.
                first = self.hinted(start, group_ids[0])
                run = self.source_run(start, hi, group_ids, first) if first >= 0 else None
                if run is None:
                    first = self.probe(start, group_ids[0])
                    if first < 0:
                        break
                    run = self.source_run(start, hi, group_ids, first)
                    if run is None:
                        break
                parts.append(run)
                start += run.shape[1]
                if run.shape[1] < RUN_MIN:
                    break
        if start < hi:
            parts.append(self.probe_vector(start, hi, group_ids))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts, axis=1)

    def hinted(self, pos: int, group_id: int) -> int:
        """The block the last run's source (``hint``) holds at position ``pos`` of
        ``group_id``, if any and no duplicate entry (not verified: a run verifies its source),
        else ``MISS``."""
        src = self.hint
        pool = self.pool
        if src < 0 or pool.sources[src] is None:
            return MISS
        recorded = pool.source(src).blocks
        tag = ((pos + 1) * self.scale - 1) * pool.num_groups + group_id
        if tag >= len(recorded):
            return MISS
        block = recorded[tag]
        pool.settle_duplicates()
        return MISS if block == pool.end or block in pool.dups else block

    def source_run(
        self, lo: int, hi: int, group_ids: Sequence[int], first: int | None = None
    ) -> Ints | None:
        """The blocks of positions ``lo … lo + k − 1`` in every group (``[groups, k]``, int32),
        all from the source of ``first``, the block at ``lo`` in the first group (probed when
        not given); ``None`` if there is none there.

        A source's ``blocks`` give, per tag, the block cached from it there (evicting a block
        clears its entry), which holds the source's hash there; where the source's hashes,
        salt and tokens are the request's (one verification for the whole run), that is the
        request's key, and a block never cached while an entry of its key was (``dups``) is the
        first-inserted block of its key: exactly what ``probe`` finds."""
        pool = self.pool
        if first is None:
            first = self.probe(lo, group_ids[0])
        if first < 0:
            return None
        pool.settle_duplicates()
        src = pool.src.a[first]
        source = pool.source(src)
        hi = min(hi, self.recorded_positions(source, group_ids))
        if hi - lo < 1:
            return None
        width = hi - lo
        if width * len(group_ids) <= RUN_SCALAR_MAX:
            blocks, count = self._run_on_arrays(source.blocks, lo, width, group_ids)
        else:
            blocks, good = self.run_checks(source.blocks, lo, width, group_ids)
            every: Ints = good[:, 0] if len(group_ids) == 1 else np.logical_and.reduce(good, 1)
            at = int(every.argmin())
            count = width if every[at] else at
        count = self.verified_run(src, lo, count)
        if not count:
            return None
        self.hint = src
        return blocks[:count].T.copy()

    def recorded_positions(self, source: Source, group_ids: Sequence[int]) -> int:
        """The positions whose tags (hash index × G + group) the source has recorded for every
        group of ``group_ids``: its ``blocks`` array is shorter than some tags of the others."""
        rows = (len(source.blocks) - 1 - max(group_ids)) // self.pool.num_groups + 1
        return rows // self.scale

    def verified_run(self, src: int, lo: int, count: int) -> int:
        """How many of the ``count`` positions from ``lo`` source ``src`` is verified for:
        one verification for them all (tokens agree up to a prefix, found once), 0 if its
        hashes or lookahead tokens differ there."""
        if count and not self.content_agrees(src, lo + count - 1):
            count = max(0, self.agreed(src) - lo)
        if count == 0 or not (
            self.lookahead_agrees(src, lo + count - 1) and self.hashes_agree(src, lo, lo + count)
        ):
            return 0
        return count

    def run_checks(
        self, recorded: array[int], lo: int, width: int, group_ids: Sequence[int]
    ) -> tuple[Ints, Ints]:
        """A source's recorded blocks of positions ``lo … lo + width − 1`` in ``group_ids``
        (``[positions, groups]``, position-major as the source records them; often a view of
        ``recorded``, which the caller copies before it keeps them), and which of them are
        cached and no duplicate entry (bool, same shape), in a few numpy calls.

        A recorded block is cached from its source under its tag (evicting it clears it), so
        that is all there is to check besides ``dups``."""
        pool = self.pool
        row = self.scale * pool.num_groups
        start = ((lo + 1) * self.scale - 1) * pool.num_groups
        stop = start + width * row
        first, count = group_ids[0], len(group_ids)
        # Views for this call only: the array grows as its source caches.
        rec = np.frombuffer(recorded, np.int32)
        if count == 1:
            blocks = rec[start + first : stop : row][:, None]
        elif stop <= rec.shape[0] and list(group_ids) == list(range(first, first + count)):
            # Consecutive groups: their columns of the rows as they lie.
            blocks = rec[start:stop].reshape(width, row)[:, first : first + count]
        else:
            blocks = rec[np.arange(start, stop, row)[:, None] + np.array(group_ids)]
        good = blocks != pool.end
        if pool.dups:
            good &= ~np.isin(blocks, np.fromiter(pool.dups, np.int32, len(pool.dups)))
        return blocks, good

    def _run_on_arrays(
        self, recorded: array[int], lo: int, width: int, group_ids: Sequence[int]
    ) -> tuple[Ints, int]:
        """``run_checks`` for a short run, position by position on the array views (a numpy call
        costs more than a few of these checks): the blocks and how many leading positions
        pass."""
        pool = self.pool
        dups, end = pool.dups, pool.end
        num_groups, scale = pool.num_groups, self.scale
        found: list[int] = []
        count = 0
        for pos in range(lo, lo + width):
            base = ((pos + 1) * scale - 1) * num_groups
            for group_id in group_ids:
                block = recorded[base + group_id]
                if block == end or block in dups:
                    break
                found.append(block)
            else:
                count += 1
                continue
            break
        # Position-major as found: one row per position, then groups as columns.
        blocks = np.array(found[: count * len(group_ids)], dtype=np.int32)
        return blocks.reshape(count, len(group_ids)), count
