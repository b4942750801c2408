"""Cache-hit lookup for the optimized backend: memoised, batched probes with verification.

The rules are the reference's (``hybridkv.reference.coordinator`` and the ``longest_hit`` hooks of
``hybridkv.reference.single_type_managers``, each a function of ``hybridkv.spec.rules``); this
module only changes how the per-position question "is block ``i`` of this request cached in
every group of this type?" is answered.

Data layout
-----------
One ``Lookup`` lives for one ``get_computed_blocks`` call. Per attention type it keeps one memo
(``TypeProbe``): an int32 buffer ``found[groups, positions]`` (block id, ``MISS`` or
``UNKNOWN``) and an int8 buffer of per-position flags (1 when every group of the type has the
block). Positions are filled in windows. A window of ``vector_min`` (position, group) pairs or
more is first read from *runs* (``source_run``): the block found at its first position names a
source (the request that cached it), whose ``blocks`` array gives, per position and group, the
block it cached there; all of them are checked at once against the table (still cached under that
position and group, from that source, never a duplicate entry) and the source is verified once
for the whole run, so a hit of thousands of blocks costs a few tensor calls (a short run is
checked on the array views). Where runs stop, the rest of the window goes through the tensor
hash table for all groups of the type at once (``probe_tensor``: one ``index_select`` per
chain step, lanes dropped as their chains end, the last ``TAIL_MAX`` chains walked on the
array views); a smaller window goes through the array views (the sizes are in
``hybridkv.optimized.thresholds``). The rule functions of ``hybridkv.spec.rules`` then read
the memo; the full-attention scan of a long prompt reads runs as far as they reach, then
window by window (``array.index``).

Verification (collision safety): token comparisons use the packed token arrays when both the
request and the source keep one (``Request.packed_token_ids``: one memory comparison), else
the token lists. A candidate block is accepted only if its source (see
``hybridkv.optimized.block_pool``) has the request's hash at that position, the request's cache
salt, and the request's tokens up to the end of that block (with lookahead hashes, also the
``num_hash_lookahead_tokens`` tokens after it, which its hash covers too). Positions are blocks
of the type's block size, keyed by the hash at the block's last hash boundary. Token agreement
is memoised per source as a prefix length, extended by galloping slice comparisons (after one
whole-list comparison, without slicing, when the two token lists are as long and so are the
hash lists, which are equal), so a lookup compares each token at most about three times
whatever the number of blocks. Hash lists are compared whole once per source in the same way
before window slices. A candidate that fails is skipped and the next block cached under the
same key (insertion order) is tried.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from hybridkv.optimized._buffers import IntBuffer, int32_from_bytes
from hybridkv.optimized.block_pool import GROUP_MIX, Source, TorchBlockPool, hash_key
from hybridkv.optimized.thresholds import (
    AGREE_MIN_STEP,
    FLAG_MAX_WINDOW,
    FLAG_MIN_WINDOW,
    RUN_MIN,
    RUN_SCALAR_MAX,
    SCAN_FIRST_WINDOW,
    TAIL_MAX,
    VECTOR_MIN,
)
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.lazy_flags import LazyFlags
from hybridkv.reference.request import RequestLike

UNKNOWN = -2
MISS = -1


def _view(hashes: Sequence[BlockHash], scale: int) -> Sequence[BlockHash]:
    """The hashes at ``scale`` hash blocks per block (``hashes_at_block_size``)."""
    return hashes if scale == 1 else hashes[scale - 1 :: scale]


def same_items(a: Sequence[object], b: Sequence[object]) -> bool:
    """Element-wise equality of two sequences of any types (list == tuple is False in Python)."""
    if type(a) is type(b):
        return a == b
    return list(a) == list(b)


class Lookup:
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
        self.pool = pool
        # Positions are blocks of ``block_size`` = ``scale`` hash blocks; a block's key is the
        # hash at its last hash boundary (``hashes_at_block_size``).
        self.scale = scale
        self.request_hashes: Sequence[BlockHash] = request.block_hashes
        self.hashes: Sequence[BlockHash] = _view(request.block_hashes, scale)
        self.tokens: Sequence[int] = request.all_token_ids
        self.packed: Sequence[int] | None = getattr(request, "packed_token_ids", None)
        self.salt: object = getattr(request, "cache_salt", None)
        self.block_size = block_size
        # Extra keys are probed one by one (with their insertion order).
        self.vector_min = vector_min if not pool.extras else 1 << 62
        self.lookahead = lookahead
        self._views: dict[int, Sequence[BlockHash]] = {}
        self._agree: dict[int, int] = {}
        self._limit: dict[int, int] = {}
        self._keys: torch.Tensor | None = None
        self._hashes_equal: dict[int, bool] = {}

    # --- Verification -----------------------------------------------------------------------

    def content_agrees(self, src: int, pos: int) -> bool:
        """Whether source ``src`` holds the request's salt and tokens up to block ``pos``."""
        agree = self._agree.get(src)
        source = self.pool.source(src)
        if agree is None:
            agree = 0
            if source.salt != self.salt:
                self._limit[src] = 0
            elif source.tokens is self.tokens:
                agree = len(self.tokens) // self.block_size
            self._agree[src] = agree
        if pos < agree:
            return True
        limit = self._limit.get(src)
        if limit is not None and pos >= limit:
            return False
        b = self.block_size
        ours, theirs = self._token_pair(source)
        cap = min(len(theirs), len(ours)) // b
        if (
            agree == 0
            and len(ours) == len(theirs)
            and self.all_hashes_equal(src)
            and same_items(ours, theirs)
        ):
            # Equal token lists (a repeated prompt, whose hash lists are equal too): one
            # comparison without slicing, which stops at the first difference otherwise (then
            # the search below finds it).
            self._agree[src] = cap
            return pos < cap
        target = min(max(pos + 1, 2 * agree, agree + AGREE_MIN_STEP), cap)
        lo, hi = agree * b, target * b
        whole = lo == 0 and hi == len(ours) == len(theirs)
        if same_items(ours, theirs) if whole else same_items(ours[lo:hi], theirs[lo:hi]):
            self._agree[src] = target
            return pos < target
        # Binary search for the first token that differs: [agree·b, lo) agree, [lo, hi) does not.
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if same_items(ours[lo:mid], theirs[lo:mid]):
                lo = mid
            else:
                hi = mid
        self._agree[src] = self._limit[src] = lo // b
        return pos < lo // b

    def _token_pair(self, source: Source) -> tuple[Sequence[int], Sequence[int]]:
        """The request's and the source's tokens, packed when both keep them packed (a slice
        comparison is then one memory comparison)."""
        if self.packed is not None and source.packed is not None:
            return self.packed, source.packed
        return self.tokens, source.tokens

    def their_hashes(self, src: int) -> Sequence[BlockHash]:
        """Source ``src``'s hashes at this lookup's block size."""
        hashes = self.pool.source(src).hashes
        if self.scale == 1:
            return hashes
        view = self._views.get(src)
        if view is None or len(view) != len(hashes) // self.scale:
            view = self._views[src] = _view(hashes, self.scale)
        return view

    def hashes_agree(self, src: int, lo: int, hi: int) -> bool:
        """Whether source ``src`` has the request's block hashes at positions ``lo … hi − 1``."""
        if self.all_hashes_equal(src):
            return True
        return same_items(self.their_hashes(src)[lo:hi], self.hashes[lo:hi])

    def all_hashes_equal(self, src: int) -> bool:
        """Whether source ``src`` has exactly the request's hashes at this lookup's block size
        (one comparison without slicing, remembered)."""
        equal = self._hashes_equal.get(src)
        if equal is None:
            theirs, ours = self.their_hashes(src), self.hashes
            equal = self._hashes_equal[src] = len(theirs) == len(ours) and same_items(theirs, ours)
        return equal

    def lookahead_agrees(self, src: int, pos: int) -> bool:
        """With lookahead hashes, whether source ``src`` has the request's tokens after block
        ``pos`` that its hash also covers (trivially true without lookahead)."""
        if not self.lookahead:
            return True
        lo = (pos + 1) * self.block_size
        hi = lo + self.lookahead
        ours, theirs = self._token_pair(self.pool.source(src))
        return len(theirs) >= hi and same_items(ours[lo:hi], theirs[lo:hi])

    def accepts(self, block: int, pos: int, src: int = -1) -> bool:
        """Whether cached ``block`` (its primary entry, or the extra one from source ``src``)
        really holds this request's block ``pos`` (and, with lookahead hashes, is keyed by the
        same following tokens)."""
        if src < 0:
            src = self.pool.src.a[block]
        if not self.content_agrees(src, pos) or not self.lookahead_agrees(src, pos):
            return False
        hidx = (pos + 1) * self.scale - 1
        return bool(self.pool.source(src).hashes[hidx] == self.hashes[pos])

    # --- Probes -----------------------------------------------------------------------------

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

    def keys(self) -> torch.Tensor:
        """The 4-byte keys of all the request's block hashes, as int64 (computed once)."""
        if self._keys is None:
            joined = b"".join(self.hashes)
            if len(joined) == 32 * len(self.hashes):
                keys = int32_from_bytes(joined)[::8]
            else:
                keys = torch.tensor([hash_key(h) for h in self.hashes], dtype=torch.int32)
            self._keys = keys.to(torch.int64)
        return self._keys

    def probe_window(self, lo: int, hi: int, group_ids: Sequence[int]) -> torch.Tensor:
        """``probe_tensor``'s result, read from sources' runs where it can: from ``lo``, the
        source of the block found at the first position gives the blocks of the positions
        after it (``source_run``), as long as it has them; the rest goes to ``probe_tensor``."""
        parts: list[torch.Tensor] = []
        start = lo
        if not self.pool.extras:
            while hi - start >= RUN_MIN:
                run = self.source_run(start, hi, group_ids)
                if run is None:
                    break
                parts.append(run)
                start += run.shape[1]
                if run.shape[1] < RUN_MIN:
                    break
        if start < hi:
            parts.append(self.probe_tensor(start, hi, group_ids))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([part.to(torch.int64) for part in parts], 1)

    def source_run(self, lo: int, hi: int, group_ids: Sequence[int]) -> torch.Tensor | None:
        """The blocks of positions ``lo … lo + k − 1`` in every group (``[groups, k]``, int32),
        all from the source of the block at ``lo`` in the first group; ``None`` if there is
        none there.

        A source's ``blocks`` give, per tag, the block last cached from it. Those still cached
        from that source (``src``) under that tag (the low half of ``hk``) hold the source's
        hash there; where the source's hashes, salt and tokens are the request's (one
        verification for the whole run), that is the request's key, and a block never cached
        while an entry of its key was (``dups``) is the first-inserted block of its key: exactly
        what ``probe`` finds."""
        pool = self.pool
        first = self.probe(lo, group_ids[0])
        if first < 0:
            return None
        pool.settle_duplicates()
        src = pool.src.a[first]
        source = pool.source(src)
        num_groups = pool.num_groups
        recorded = len(source.blocks)
        hi = min(hi, (recorded // num_groups + 1) // self.scale)
        if hi - lo < 1:
            return None
        width = hi - lo
        if width * len(group_ids) <= RUN_SCALAR_MAX:
            blocks, count = self._run_on_arrays(src, source.blocks, lo, width, group_ids)
        else:
            blocks, count = self._run_in_tensors(src, source.blocks, lo, width, group_ids)
        # One verification of the source for the run (tokens agree up to a prefix, found once).
        if count and not self.content_agrees(src, lo + count - 1):
            count = max(0, self._agree.get(src, 0) - lo)
        if count == 0 or not (
            self.lookahead_agrees(src, lo + count - 1) and self.hashes_agree(src, lo, lo + count)
        ):
            return None
        return blocks[:, :count]

    def _run_in_tensors(
        self, src: int, recorded: array[int], lo: int, width: int, group_ids: Sequence[int]
    ) -> tuple[torch.Tensor, int]:
        """``source_run``'s candidate blocks ``[groups, width]`` and how many leading
        positions pass the checks, in a few tensor calls."""
        pool = self.pool
        num_groups = pool.num_groups
        step = self.scale * num_groups
        first_tag = ((lo + 1) * self.scale - 1) * num_groups
        tags = torch.arange(first_tag, first_tag + width * step, step)
        if len(group_ids) > 1 or group_ids[0]:
            tags = tags + torch.tensor(group_ids, dtype=torch.int64)[:, None]
        tags = tags.view(-1)
        # A tag beyond the recorded ones reads the last recorded block, which is not cached
        # under it, so it fails the check below.
        at = tags.clamp(max=len(recorded) - 1)
        blocks = torch.frombuffer(recorded, dtype=torch.int32).index_select(0, at)
        good = (pool.hk.t.index_select(0, blocks) & 0xFFFFFFFF == tags) & (
            pool.src.t.index_select(0, blocks) == src
        )
        if pool.dups:
            good &= ~torch.isin(blocks, torch.tensor(sorted(pool.dups), dtype=torch.int32))
        good_2d = good.view(len(group_ids), width)
        count = width if bool(good.all()) else int(torch.nonzero(~good_2d.all(0))[0, 0])
        return blocks.view(len(group_ids), width), count

    def _run_on_arrays(
        self, src: int, recorded: array[int], lo: int, width: int, group_ids: Sequence[int]
    ) -> tuple[torch.Tensor, int]:
        """``_run_in_tensors`` for a short run, position by position on the array views (a
        tensor call costs more than a few dozen of these checks)."""
        pool = self.pool
        hk, srcs, dups, end = pool.hk.a, pool.src.a, pool.dups, pool.end
        num_groups, scale, size = pool.num_groups, self.scale, len(recorded)
        found: list[list[int]] = [[] for _ in group_ids]
        count = 0
        for pos in range(lo, lo + width):
            base = ((pos + 1) * scale - 1) * num_groups
            for column, group_id in zip(found, group_ids, strict=True):
                tag = base + group_id
                block = recorded[tag] if tag < size else end
                if hk[block] & 0xFFFFFFFF != tag or srcs[block] != src or block in dups:
                    break
                column.append(block)
            else:
                count += 1
                continue
            break
        blocks = torch.tensor([column[:count] for column in found], dtype=torch.int32)
        return blocks.view(len(group_ids), count), count

    def probe_tensor(self, lo: int, hi: int, group_ids: Sequence[int]) -> torch.Tensor:
        """``probe`` for positions ``lo … hi − 1`` of several groups: ``[groups, positions]``
        int64 block ids (``MISS`` where none), in a few tensor calls for all of them."""
        pool = self.pool
        groups = torch.tensor(group_ids, dtype=torch.int64)[:, None]
        keys = self.keys()[lo:hi]
        buckets = (keys + groups * GROUP_MIX) & pool.mask
        hidx = (torch.arange(lo, hi) + 1) * self.scale - 1
        targets = keys << 32 | (hidx * pool.num_groups + groups)
        current = pool.heads.t.index_select(0, buckets.view(-1))
        targets = targets.view(-1)
        best = torch.full(buckets.shape, MISS, dtype=torch.int64)
        found = best.view(-1)
        lanes: torch.Tensor | None = None  # which lanes ``current`` still walks (None: all)
        hk, hnext, end = pool.hk.t, pool.hnext.t, pool.end
        while True:
            hits = torch.nonzero(hk.index_select(0, current) == targets).view(-1)
            if hits.shape[0]:
                # Later matches overwrite earlier ones: the last match is the first inserted.
                at = hits if lanes is None else lanes.index_select(0, hits)
                found.index_copy_(0, at, current.index_select(0, hits).to(torch.int64))
            current = hnext.index_select(0, current)
            walking = torch.nonzero(current != end).view(-1)
            if walking.shape[0] == 0:
                break
            if walking.shape[0] < current.shape[0]:
                current = current.index_select(0, walking)
                targets = targets.index_select(0, walking)
                lanes = walking if lanes is None else lanes.index_select(0, walking)
            if current.shape[0] <= TAIL_MAX:
                # The few longest chains: walk them on the array views (a tensor call per step
                # would cost more than the walk).
                self._walk_tail(current, targets, lanes, found)
                break
        if bool((found >= 0).any()):
            self._verify_window(best, lo, group_ids)
        return best

    def _walk_tail(
        self,
        current: torch.Tensor,
        targets: torch.Tensor,
        lanes: torch.Tensor | None,
        found: torch.Tensor,
    ) -> None:
        """Finish ``probe_tensor``'s walk of a few chains: the last match of each is kept."""
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

    def _verify_window(self, best: torch.Tensor, lo: int, group_ids: Sequence[int]) -> None:
        """Verify a window's candidates source by source; re-probe exactly the ones that fail."""
        pool = self.pool
        flat = best.view(-1)
        width = best.shape[1]
        lanes = torch.nonzero(flat >= 0).view(-1)
        srcs = pool.src.t.index_select(0, flat.index_select(0, lanes))
        first = int(srcs[0])
        if bool((srcs == first).all()):
            by_source = [(first, lanes)]
        else:
            by_source = [(int(s), lanes[srcs == s]) for s in torch.unique(srcs).tolist()]
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


class TypeProbe:
    """The memo of one attention type (groups with equal specs) within one lookup.

    ``found[i]`` holds, per position, the block of group ``group_ids[i]`` (``MISS`` or
    ``UNKNOWN``), ``flags`` 1 where every group has one, 0 where one misses (``UNKNOWN`` not yet
    probed); both are buffers, written by tensor probes and read by the rule functions.
    """

    def __init__(self, lookup: Lookup, group_ids: Sequence[int], length: int) -> None:
        self.lookup = lookup
        self.group_ids = list(group_ids)
        self.length = length
        self.found = IntBuffer(len(self.group_ids) * length, UNKNOWN)
        self.found_2d = self.found.t.view(len(self.group_ids), length)
        self.flags = IntBuffer(length, UNKNOWN, typecode="b")

    def fill(self, lo: int, hi: int) -> None:
        """Probe positions ``lo … hi − 1`` (those not probed yet) in every group of the type."""
        flags = self.flags.a
        while lo < hi and flags[lo] != UNKNOWN:
            lo += 1
        while hi > lo and flags[hi - 1] != UNKNOWN:
            hi -= 1
        if lo >= hi:
            return
        lookup = self.lookup
        if (hi - lo) * len(self.group_ids) >= lookup.vector_min:
            best = lookup.probe_window(lo, hi, self.group_ids)
            self.found_2d[:, lo:hi] = best
            self.flags.t[lo:hi] = (best >= 0).all(0)
            return
        found, length = self.found.a, self.length
        for pos in range(lo, hi):
            if flags[pos] != UNKNOWN:
                continue
            flag = 1
            for index, group_id in enumerate(self.group_ids):
                block = lookup.probe(pos, group_id)
                found[index * length + pos] = block
                if block < 0:
                    flag = 0
                    break
            flags[pos] = flag

    def run_ahead(self, lo: int, hi: int) -> int:
        """Fill positions from ``lo`` (up to ``hi``) with sources' runs as far as they reach;
        the first position not filled (a long prompt's scan then needs no windows)."""
        lookup = self.lookup
        if (hi - lo) * len(self.group_ids) < lookup.vector_min or lookup.pool.extras:
            return lo
        while hi - lo >= RUN_MIN:
            run = lookup.source_run(lo, hi, self.group_ids)
            if run is None:
                break
            count = run.shape[1]
            self.found_2d[:, lo : lo + count] = run
            self.flags.t[lo : lo + count] = 1
            lo += count
            if count < RUN_MIN:
                break
        return lo

    def leading_hits(self, length: int) -> int:
        """Leading positions cached in every group (the full-attention scan), window by window."""
        flags = self.flags.a
        pos = self.run_ahead(0, length) if length and flags[0] == UNKNOWN else 0
        span = SCAN_FIRST_WINDOW
        while pos < length:
            end = min(length, pos + span)
            self.fill(pos, end)
            try:
                return flags.index(0, pos, end)
            except ValueError:
                pos = end
            span *= 4
        return length

    def blocks(self, first: int, num: int) -> tuple[tuple[int, ...], ...]:
        """Per group: null blocks before ``first``, then the cached blocks up to ``num`` (tuples,
        as ``KVCacheBlocks`` holds them: no copy on the way out)."""
        found, length = self.found.a, self.length
        nulls = (0,) * first
        return tuple(
            nulls + tuple(found[i * length + first : i * length + num])
            for i in range(len(self.group_ids))
        )


class WindowedFlags(LazyFlags):
    """``cached[i]`` for the rule functions, filled in windows in the scan's direction."""

    def __init__(self, memo: TypeProbe, length: int, leftwards: bool, span: int) -> None:
        super().__init__(length)
        self._memo = memo
        self._leftwards = leftwards
        self._span = max(span, FLAG_MIN_WINDOW)

    def flag(self, index: int) -> bool:
        flag = self._memo.flags.a[index]
        if flag == UNKNOWN:
            if self._leftwards:
                self._memo.fill(max(0, index + 1 - self._span), index + 1)
            else:
                self._memo.fill(index, min(self._length, index + self._span))
            self._span = min(self._span * 2, FLAG_MAX_WINDOW)
            flag = self._memo.flags.a[index]
        return flag == 1
