"""Cache-hit lookup for the optimized backend: memoised, batched probes with verification.

The rules are the reference's (``hybridkv.reference.coordinator`` and the ``longest_hit`` hooks of
``hybridkv.reference.single_type_managers``, each a function of ``hybridkv.spec.rules``); this
module only changes how the per-position question "is block ``i`` of this request cached in
every group of this type?" is answered.

Data layout
-----------
One ``Lookup`` lives for one ``get_computed_blocks`` call. Per attention type it keeps one memo
(``TypeProbe``): a numpy int32 array ``found[groups, positions]`` (the block of each group,
valid only where the position is a hit; allocated empty, so that the positions a lookup never
reaches cost nothing) and a ``bytearray`` of per-position flags (``HIT`` when every group of
the type has the block, ``MISSED`` when one does not, ``UNKNOWN`` not probed yet), read by the
scans with ``find``/``rfind`` and written a window at a time through a numpy view. All vector
work runs on the numpy views of the pool's buffers (``.n``): a numpy call on a few thousand
elements costs a fraction of a torch call.

Runs: a source (the request that cached a block) records, per position and group, the block it
cached there, and evicting a block clears its entry (``hybridkv.optimized.block_pool``), so
the source's record read as an array is the list of its blocks still cached: a run of
positions is its record's rows (a numpy view), less the unrecorded and duplicate entries
(``dups``), verified once for all of them (``source_run``). A lookup of several types first
reads one such run from position 0 for all their groups at once (``lead_run``: a prompt cached
by one request holds its blocks in every group), while it is at most ``LEAD_RUN_MAX`` (position,
group) pairs; longer prompts read a run per type, the later ones from the last run's source
first (``hint``) and from the source of the block a chain walk finds otherwise.

Positions are filled in windows. A window of ``vector_min`` (position, group) pairs or more is
first read from runs, as far as they reach; the rest of the window goes through the hash table
for all groups of the type at once (``probe_vector``: one gather per chain step, lanes dropped
as their chains end, the last ``TAIL_MAX`` chains walked on the array views); a smaller window
goes through the array views (the sizes are in ``hybridkv.optimized.thresholds``).

The scans: full attention reads runs from its known leading hits as far as they reach, then
probes the one position where they stop (most often the end of the cached prefix), then goes
on window by window; a sliding window runs ``rules.sliding_window_hit_blocks_skip`` (proved
equal to ``rules.sliding_window_hit_blocks``) with each candidate window filled at once and
searched with ``rfind``; the other rules read the memo through ``WindowedFlags``.

The hit: per group a ``GroupHit`` (a count of leading nulls and an int32 array of block ids,
copied out of the memo), returned as a ``HitBlocks``, a ``KVCacheBlocks`` that builds its
tuples of Python ints on the first read of ``block_ids``.

Verification (collision safety): token comparisons use the packed token arrays when both the
request and the source keep one (``Request.packed_token_ids``: one comparison of their memory,
and numpy views of it to find the first difference in one pass), else the token lists. A
candidate block is accepted only if its source (see ``hybridkv.optimized.block_pool``) has the
request's hash at that position, the request's cache salt, and the request's tokens up to the
end of that block (with lookahead hashes, also the ``num_hash_lookahead_tokens`` tokens after
it, which its hash covers too). Positions are blocks of the type's block size, keyed by the
hash at the block's last hash boundary. Token agreement is memoised per source as a prefix
length, extended by galloping comparisons (after one whole comparison when the two token lists
are as long and so are the hash lists, which are equal), so a lookup compares each token a few
times at most whatever the number of blocks. Hash lists are compared whole once per source in
the same way before window slices. A candidate that fails is skipped and the next block cached
under the same key (insertion order) is tried.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.optimized.block_pool import GROUP_MIX, Source, TorchBlockPool, hash_key
from hybridkv.optimized.thresholds import (
    AGREE_MIN_STEP,
    FLAG_MAX_WINDOW,
    FLAG_MIN_WINDOW,
    LEAD_RUN_MAX,
    RUN_MIN,
    RUN_SCALAR_MAX,
    SCAN_FIRST_WINDOW,
    TAIL_MAX,
    VECTOR_MIN,
)
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.lazy_flags import LazyFlags
from hybridkv.reference.request import RequestLike

MISS = -1
"""A probe's answer where no verified block is cached (in ``found`` and probe results)."""

MISSED, HIT, UNKNOWN = 0, 1, 2
"""The per-position flags of a ``TypeProbe`` (bytes of its ``flags``)."""
_HITS = bytes((HIT,))

Ints = npt.NDArray[Any]
"""A numpy integer array (int32 block ids, int64 keys and tags)."""


def _view(hashes: Sequence[BlockHash], scale: int) -> Sequence[BlockHash]:
    """The hashes at ``scale`` hash blocks per block (``hashes_at_block_size``)."""
    return hashes if scale == 1 else hashes[scale - 1 :: scale]


def same_items(a: Sequence[object], b: Sequence[object]) -> bool:
    """Element-wise equality of two sequences of any types (list == tuple is False in Python)."""
    if type(a) is type(b):
        return a == b
    return list(a) == list(b)


def _packed(tokens: Sequence[int]) -> bool:
    """Whether ``tokens`` is a packed token array (``Request.packed_token_ids``)."""
    return isinstance(tokens, array) and tokens.typecode == "Q"


def first_difference(ours: Sequence[int], theirs: Sequence[int], lo: int, hi: int) -> int:
    """The first index in ``lo … hi − 1`` where the token sequences differ, ``hi`` if none
    (both hold at least ``hi`` tokens).

    Packed arrays are compared as numpy views of their memory (no copy, one pass); lists by one
    slice comparison, then a binary search of slices for the first difference."""
    if hi <= lo:
        return hi
    if _packed(ours) and _packed(theirs):
        # Views for this call only: the arrays grow as tokens are appended.
        a = np.frombuffer(ours, np.uint64, hi - lo, lo * 8)  # type: ignore[call-overload]
        b = np.frombuffer(theirs, np.uint64, hi - lo, lo * 8)  # type: ignore[call-overload]
        differs = a != b
        at = int(differs.argmax())
        return lo + at if differs[at] else hi
    whole = lo == 0 and hi == len(ours) == len(theirs)
    if same_items(ours, theirs) if whole else same_items(ours[lo:hi], theirs[lo:hi]):
        return hi
    # [start, lo) agree, [lo, hi) does not.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same_items(ours[lo:mid], theirs[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class GroupHit:
    """One group's hit: ``nulls`` null blocks, then the blocks ``ids`` (int32, owned); ``dense``
    when none of those is null (a lookup's hits are)."""

    __slots__ = ("dense", "ids", "nulls")

    def __init__(self, nulls: int, ids: Ints, dense: bool = True) -> None:
        self.nulls = nulls
        self.ids = ids
        self.dense = dense

    def __len__(self) -> int:
        return self.nulls + int(self.ids.shape[0])

    def cut(self, length: int) -> GroupHit:
        """The first ``length`` blocks of the hit."""
        if length >= len(self):
            return self
        if length <= self.nulls:
            return GroupHit(length, _NO_IDS)
        return GroupHit(self.nulls, self.ids[: length - self.nulls], self.dense)

    def as_tuple(self) -> tuple[int, ...]:
        """The hit as ``KVCacheBlocks`` holds a group's: a tuple of Python ints."""
        return (0,) * self.nulls + tuple(self.ids.tolist())

    @classmethod
    def of(cls, ids: Sequence[int]) -> GroupHit:
        """A group's hit given as ids: its leading nulls counted, the rest kept as given (a hit
        a scheduler built itself may hold a null anywhere)."""
        if not ids:
            return NO_HIT
        found: Ints = np.array(ids, dtype=np.int32)
        real = np.flatnonzero(found)
        nulls = int(real[0]) if real.shape[0] else found.shape[0]
        return cls(nulls, found[nulls:], real.shape[0] == found.shape[0] - nulls)


_NO_IDS: Ints = np.empty(0, dtype=np.int32)
_NO_IDS.flags.writeable = False
NO_HIT = GroupHit(0, _NO_IDS)
"""A group's empty hit."""


class HitBlocks(KVCacheBlocks):
    """A lookup's hit: equal to the ``KVCacheBlocks`` of the same ids (both ways, and hashing
    alike), immutable, and ``allocate_slots`` takes it back as the manager's own result.

    It holds each group's hit as a ``GroupHit`` (a count of nulls and an int32 array) and builds
    the tuples of Python ints that ``block_ids`` holds on its first read, then keeps them: a
    long hit's ids as Python objects (thousands of ints and tuples, made and later freed) cost
    only the caller that reads them."""

    _hits: tuple[GroupHit, ...]
    _ids: tuple[tuple[int, ...], ...] | None

    def __init__(self, hits: Sequence[GroupHit]) -> None:
        object.__setattr__(self, "_hits", tuple(hits))
        object.__setattr__(self, "_ids", None)

    @property
    def block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Block ids per KV cache group (built on the first read)."""
        ids = self._ids
        if ids is None:
            ids = tuple(hit.as_tuple() for hit in self._hits)
            object.__setattr__(self, "_ids", ids)
        return ids

    @property
    def num_groups(self) -> int:
        return len(self._hits)

    @property
    def group_hits(self) -> tuple[GroupHit, ...]:
        """Each group's hit as the lookup found it (no Python ints built)."""
        return self._hits

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KVCacheBlocks):
            return self.block_ids == other.block_ids
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.block_ids,))  # as the frozen dataclass hashes

    def __repr__(self) -> str:
        return f"KVCacheBlocks(block_ids={self.block_ids!r})"

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[type[KVCacheBlocks], tuple[tuple[tuple[int, ...], ...]]]:
        # Copies and pickles are plain ``KVCacheBlocks`` of the same ids.
        return (KVCacheBlocks, (self.block_ids,))


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
        self._keys: Ints | None = None
        self._hashes_equal: dict[int, bool] = {}
        self.hint = -1  # the source of the last run read

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
            # comparison, which stops at the first difference otherwise (then the search below
            # finds it).
            self._agree[src] = cap
            return pos < cap
        target = min(max(pos + 1, 2 * agree, agree + AGREE_MIN_STEP), cap)
        hi = target * b
        first = first_difference(ours, theirs, agree * b, hi)
        if first == hi:
            self._agree[src] = target
            return pos < target
        self._agree[src] = self._limit[src] = first // b
        return pos < first // b

    def _token_pair(self, source: Source) -> tuple[Sequence[int], Sequence[int]]:
        """The request's and the source's tokens, packed when both keep them packed (a
        comparison is then one pass over memory)."""
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
            count = max(0, self._agree.get(src, 0) - lo)
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
        computes it, each candidate window filled at once and searched right to left."""
        if needed == 0:
            return length, length
        flags = self.flags
        end = length
        while end >= needed:
            self.fill(end - needed, end)
            miss = flags.rfind(MISSED, end - needed, end)
            if miss < 0:
                return end, end - needed
            end = miss
        return self.leading_hits(end), 0

    def blocks(self, first: int, num: int) -> tuple[GroupHit, ...]:
        """Per group: null blocks before ``first``, then the cached blocks up to ``num`` (a copy:
        the hit outlives the lookup)."""
        if num <= first:
            return tuple(GroupHit(first, _NO_IDS) for _ in self.group_ids)
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
