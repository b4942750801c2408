"""A lookup's probes of the prefix cache's hash table: one position, or a window in numpy.

The table is the pool's (``hybridkv.optimized.block_pool``): bucket heads, chain links and one
int64 per entry holding key, position and group, so a probe compares one int64 per chain entry.
``probe`` walks one chain on the array views and verifies its matches first-inserted first
(primary and extra entries of a key in insertion order); ``probe_vector`` walks the chains of a
window of positions for several groups at once (one gather per chain step, lanes dropped as
their chains end, the last ``TAIL_MAX`` chains walked on the array views), then verifies the
window source by source and re-probes exactly the lanes that fail. The request's 4-byte keys
are computed once per lookup (``keys``, an int64 array).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.hit_blocks import Ints
from hybridkv.optimized.sources import GROUP_MIX, hash_key
from hybridkv.optimized.thresholds import TAIL_MAX
from hybridkv.optimized.verification import Verification
from hybridkv.reference.request import RequestLike

MISS = -1
"""A probe's answer where no verified block is cached (in ``found`` and probe results)."""


class Probes(Verification):
    """Verification, and the probes that use it."""

    def __init__(
        self,
        pool: TorchBlockPool,
        request: RequestLike,
        block_size: int,
        lookahead: int = 0,
        scale: int = 1,
    ) -> None:
        super().__init__(pool, request, block_size, lookahead, scale)
        self._keys: Ints | None = None

    def probe(self, pos: int, group_id: int) -> int:
        """The first-inserted verified block cached for position ``pos`` in ``group_id``."""
        pool = self.pool
        key = hash_key(self.hashes[pos])
        hidx = (pos + 1) * self.scale - 1
        target = key << 32 | (hidx * pool.num_groups + group_id)
        hnext, hk, end = pool.hnext.a, pool.hk.a, pool.end
        block = pool.heads.a[(key + group_id * GROUP_MIX) & pool.mask]
        matches: list[int] = []
        while block != end:
            if hk[block] == target:
                matches.append(block)
            block = hnext[block]
        matches.reverse()
        extras = pool.extra_index.get((key, group_id, hidx)) if pool.extra_index else None
        if extras:
            # Primary and extra entries of the key, in insertion order: an extra right after
            # the primaries cached before it (a prefix of ``matches``).
            ordered = [(2 * i, 0, b, -1) for i, b in enumerate(matches)]
            for b, (count, before) in extras.items():
                prefix = sum(1 for m in matches if m in before)
                src = pool.extras[b][key, group_id, hidx]
                ordered.append((2 * prefix - 1, count, b, src))
            ordered.sort()
            for _, _, candidate, src in ordered:
                if self.accepts(candidate, pos, src):
                    return candidate
            return MISS
        for candidate in matches:
            if self.accepts(candidate, pos):
                return candidate
        return MISS

    def first_candidate(self, pos: int, group_id: int) -> int:
        """The first-inserted block cached under the key of position ``pos`` in ``group_id``
        (primary entries only, not verified), ``MISS`` if none: the seed of a run, which
        verifies its source for every position it returns."""
        pool = self.pool
        key = hash_key(self.hashes[pos])
        target = key << 32 | (((pos + 1) * self.scale - 1) * pool.num_groups + group_id)
        hnext, hk, end = pool.hnext.a, pool.hk.a, pool.end
        block = pool.heads.a[(key + group_id * GROUP_MIX) & pool.mask]
        last = MISS
        while block != end:
            if hk[block] == target:
                last = block
            block = hnext[block]
        return last

    def keys(self) -> Ints:
        """The 4-byte keys of all the request's block hashes, as int64 (computed once)."""
        if self._keys is None:
            joined = b"".join(self.hashes)
            if len(joined) == 32 * len(self.hashes):
                keys = np.frombuffer(joined, "<i4")[::8]
            else:
                keys = np.array([hash_key(h) for h in self.hashes], dtype=np.int32)
            self._keys = keys.astype(np.int64)
        return self._keys

    def probe_vector(self, lo: int, hi: int, group_ids: Sequence[int]) -> Ints:
        """``probe`` for positions ``lo … hi − 1`` of several groups: ``[groups, positions]``
        int32 block ids (``MISS`` where none), in a few numpy calls for all of them."""
        pool = self.pool
        groups = np.array(group_ids, dtype=np.int64)[:, None]
        keys = self.keys()[lo:hi]
        buckets = (keys + groups * GROUP_MIX) & pool.mask
        hidx = (np.arange(lo, hi, dtype=np.int64) + 1) * self.scale - 1
        targets = (keys << 32 | (hidx * pool.num_groups + groups)).reshape(-1)
        current = pool.heads.n[buckets.reshape(-1)]
        best = np.full(buckets.shape, MISS, dtype=np.int32)
        found = best.reshape(-1)
        lanes: Ints | None = None  # which lanes ``current`` still walks (None: all)
        hk, hnext, end = pool.hk.n, pool.hnext.n, pool.end
        while True:
            hits = np.flatnonzero(hk[current] == targets)
            if hits.shape[0]:
                # Later matches overwrite earlier ones: the last match is the first inserted.
                found[hits if lanes is None else lanes[hits]] = current[hits]
            current = hnext[current]
            walking = np.flatnonzero(current != end)
            if walking.shape[0] == 0:
                break
            if walking.shape[0] < current.shape[0]:
                current = current[walking]
                targets = targets[walking]
                lanes = walking if lanes is None else lanes[walking]
            if current.shape[0] <= TAIL_MAX:
                # The few longest chains: walk them on the array views (a numpy call per step
                # would cost more than the walk).
                self._walk_tail(current, targets, lanes, found)
                break
        if bool((found >= 0).any()):
            self._verify_window(best, lo, group_ids)
        return best

    def _walk_tail(self, current: Ints, targets: Ints, lanes: Ints | None, found: Ints) -> None:
        """Finish ``probe_vector``'s walk of a few chains: the last match of each is kept."""
        pool = self.pool
        hk, hnext, end = pool.hk.a, pool.hnext.a, pool.end
        lane_ids = range(current.shape[0]) if lanes is None else lanes.tolist()
        for lane, block, target in zip(lane_ids, current.tolist(), targets.tolist(), strict=True):
            last = -1
            while block != end:
                if hk[block] == target:
                    last = block
                block = hnext[block]
            if last >= 0:
                found[lane] = last

    def _verify_window(self, best: Ints, lo: int, group_ids: Sequence[int]) -> None:
        """Verify a window's candidates source by source; re-probe exactly the ones that fail."""
        pool = self.pool
        flat = best.reshape(-1)
        width = best.shape[1]
        lanes = np.flatnonzero(flat >= 0)
        srcs = pool.src.n[flat[lanes]]
        first = int(srcs[0])
        if bool((srcs == first).all()):
            by_source = [(first, lanes)]
        else:
            by_source = [(int(s), lanes[srcs == s]) for s in np.unique(srcs).tolist()]
        failed: list[int] = []
        for src, own in by_source:
            # With the source's tokens equal to the request's up to ``b``, its hashes there
            # are the request's too (unless they hash more than tokens and salt): compare the
            # whole span at once, and lane by lane only if that fails.
            at = own % width
            a, b = lo + int(at.min()), lo + int(at.max()) + 1
            if (
                self.content_agrees(src, b - 1)
                and self.lookahead_agrees(src, b - 1)
                and self.hashes_agree(src, a, b)
            ):
                continue
            failed.extend(
                lane
                for lane in own.tolist()
                if not self.accepts(int(flat[lane]), lo + lane % width)
            )
        for lane in failed:
            # Another block cached under the same key may be the right one.
            flat[lane] = self.probe(lo + lane % width, group_ids[lane // width])
