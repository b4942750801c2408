"""The hash memo's tree: cached requests' hashes indexed by the token prefixes they continue.

A ``BranchTree`` holds the *memo sources*: the pool's sources
(``hybridkv.optimized.sources.Source``) of requests hashed by the memo, at its block size,
without lookahead. ``hybridkv.optimized.hash_memo`` says why a hash adopted from one is exact;
this module keeps the index the adoption walks, and the pool fills and empties it
(``remember``, ``forget``, ``clear``).

Data layout
-----------
``branches``, a dict (the index; see "Branches" below)::

    (parent hash or None, block j's token bytes, cache salt or None) -> Branch(source, j)

- the parent is the source's hash of block ``j − 1`` (``None`` for block 0);
- the token bytes are block ``j``'s ids packed as unsigned 64-bit ints (the source's
  ``packed``, a request's ``packed_token_ids``), so a block's bytes have one length;
- the salt is the source's cache salt for block 0 only (later blocks are salted through their
  parent, as in ``extra_keys_for_block``); an empty salt is none, as in the hash.

``registered``, a dict: the pool's source index -> (the source, its branch or ``None``).

Branches
--------
A branch says: "this source's blocks from ``j`` on continue the prefix that ends with the key's
parent hash". The branches form a tree over token prefixes (a radix tree whose edges are runs
of a source's blocks): a branch's *children* are the branches whose key's parent is a hash of
its source at or after ``j``. Looking up a request walks it from the root: probe the key of
block 0; compare the request's packed ids with the branch's source from ``j`` on (one C loop
up to the branch's ``fork``, where its last child leaves it and so where a request that
shares the run most likely does, one over the rest, then a bisection of a range that
differs), adopting the source's hashes up to the first block that differs (``m``); probe the
key of block ``m`` with the adopted parent hash; and so on until a probe misses. The blocks
from there on are hashed. A prompt that shares a long cached prefix adopts it with a couple of
probes and comparisons, whatever its length in blocks.

A source registers when the pool caches one of its blocks (``remember``): it walks the tree
the same way, and where its probe misses it adds its branch (at most one per source; none
if its whole hash list lies on the tree already). Most often the memo has just walked those
very ids to hash the request's prompt, in the same admission: ``walk_packed`` keeps where
that walk ended (``last_walk``) and ``remember`` takes it, while no branch has changed since
(``version``) and no source's length decided the end (a source only grows, so its ids and
hashes up to where the walk compared them stay). It leaves when the pool evicts its last
cached block or drops it (``forget``): a branch without children goes; one with children is
taken over by the child that branches off last (its source shares every block of the branch
up to there, so every other child still hangs off its run), whose own key goes. Growing
sources (a decoding request's hash list lengthens) extend their run in place.
``reset_prefix_cache`` empties the memo (``clear``).

So the memo holds no more branches than registered sources, and no more registered sources
than sources with a cached block in the pool: never more entries than cached blocks. It holds
the sources by reference (the pool holds them anyway, and drops them only after they leave).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias

from hybridkv.optimized import path_counts
from hybridkv.optimized.path_counts import PathCounts
from hybridkv.optimized.same_ids import by_memcmp, same_ids
from hybridkv.optimized.thresholds import MEMCMP_MIN
from hybridkv.reference.block_hash import BlockHash
from hybridkv.spec.errors import require

MemoKey = tuple[BlockHash | None, bytes, str | None]
WalkEnd = tuple[int, "Branch | None", "MemoKey | None"]
"""Where a walk ended: the blocks it adopted, the last branch followed and the key missed."""


class MemoSource(Protocol):
    """What the memo reads from a pool source: the request's hashes, packed ids and salt."""

    @property
    def hashes(self) -> Sequence[BlockHash]: ...

    @property
    def packed(self) -> array[int] | None: ...

    @property
    def salt(self) -> object: ...


class Branch:
    """Blocks ``start …`` of ``source`` (pool index ``src``), continuing the prefix of ``key``.

    ``fork`` is the start of the child added last (once a child leaves, the largest start
    left; -1 without children): where a request that shares the branch's run is likely to
    leave it, so a lookup compares up to there first."""

    __slots__ = ("children", "fork", "key", "parent", "source", "src", "start")

    def __init__(
        self, key: MemoKey, src: int, source: MemoSource, start: int, parent: Branch | None
    ) -> None:
        self.key = key
        self.src = src
        self.source = source
        self.start = start
        self.parent = parent
        self.children: set[Branch] = set()
        self.fork = -1


def salt_key(salt: object) -> tuple[bool, str | None]:
    """Whether the memo can key a salt, and its key (an empty salt is none, as in the hash)."""
    if salt is None:
        return True, None
    if isinstance(salt, str):
        return True, salt or None
    return False, None


SameIds: TypeAlias = "Callable[[array[int], array[int], int, int], bool]"
"""Whether two packed id arrays agree over ids ``[start, stop)`` (``same_ids``)."""


def agreeing_blocks(
    ours: array[int],
    theirs: array[int],
    block_size: int,
    lo: int,
    hi: int,
    hint: int = -1,
    same: SameIds = same_ids,
) -> int:
    """The first block in ``[lo, hi)`` where two packed id arrays differ (``hi`` if none):
    one comparison up to ``hint`` (a likely first difference) and one of the rest, then a
    bisection of the range that differs. Each comparison (``same``) is one ``memcmp`` of the
    arrays' memory, or one C loop over a short range (``same_ids``)."""
    good, bad = lo, hi
    if lo < hint < hi:
        if same(ours, theirs, lo * block_size, hint * block_size):
            good = hint
        else:
            bad = hint
    if bad == hi and same(ours, theirs, good * block_size, hi * block_size):
        return hi
    # Blocks [lo, good) agree; [good, bad) holds a difference.
    while bad - good > 1:
        mid = (good + bad) // 2
        if same(ours, theirs, good * block_size, mid * block_size):
            good = mid
        else:
            bad = mid
    return good


class BranchTree:
    """The memo's branches and registered sources (see the module docstring)."""

    def __init__(self, block_size: int, paths: PathCounts | None = None) -> None:
        self.block_size = block_size
        self.paths = paths
        """The pool's path counts, which count the comparisons ``memcmp`` makes (``None``: a
        memo of no manager's, uncounted)."""
        self.memcmp_min = MEMCMP_MIN
        """Ranges of at least this many ids compare by ``memcmp`` (a manager's ``memcmp_min``
        knob sets it)."""
        self.branches: dict[MemoKey, Branch] = {}
        self.registered: dict[int, tuple[MemoSource, Branch | None]] = {}
        self.first_agreement: tuple[MemoSource, int] | None = None
        """The last walk's first branch: its source and the leading blocks whose ids it
        compared equal to the walked ones (``walk``)."""
        self.version = 0
        """Bumped whenever a branch is added, dropped or handed to another source."""
        self.last_walk: tuple[array[int], int, str | None, int, WalkEnd] | None = None
        """The last ``walk_packed`` whose end no source's length decided: its ids, block
        count, salt, the tree's ``version`` then, and where it ended. A source only grows,
        so while the version holds, walking those ids again ends there again."""
        self._length_bound = False

    def __len__(self) -> int:
        """The number of branches (at most the number of registered sources)."""
        return len(self.branches)

    # --- The walk -----------------------------------------------------------------------------

    def walk(
        self, ours: array[int], count: int, salt: str | None
    ) -> tuple[list[BlockHash], Branch | None, MemoKey | None]:
        """Follow the tree along packed ids ``ours`` (``count`` full blocks, salt ``salt``).

        Returns the hashes adopted (of blocks ``0 … k − 1``), the last branch followed (the
        parent of a branch at ``k``) and the key probed at ``k`` that missed (``None`` if the
        walk covered all ``count`` blocks or stopped at a source it cannot read). The first
        branch's source and how many of its leading blocks hold ``ours``' ids, compared, are
        ``first_agreement`` afterwards (``None`` if no block was adopted).
        """
        self.first_agreement = None
        self._length_bound = False
        b = self.block_size
        hashes: list[BlockHash] = []
        key: MemoKey = (None, ours[:b].tobytes(), salt)
        last: Branch | None = None
        at = 0
        get = self.branches.get
        while True:
            branch = get(key)
            if branch is None:
                return hashes, last, key
            source = branch.source
            theirs, packed = source.hashes, source.packed
            if packed is None:
                return hashes, last, None
            end = min(count, len(theirs), len(packed) // b)
            bound = end < count  # a longer source could take the walk further
            # The branch's key names the request's parent hash (or salt) and block ``at``;
            # the source must still hold them (its salt, its hash of block at − 1).
            if at >= end or (theirs[at - 1] != key[0] if at else salt_key(source.salt)[1] != salt):
                self._length_bound |= bound
                return hashes, last, None
            reached = agreeing_blocks(ours, packed, b, at, end, branch.fork, self.same_ids)
            if reached == at:
                return hashes, last, None
            self._length_bound |= bound and reached == end
            if at == 0:
                self.first_agreement = (source, reached)
            if hashes or not isinstance(theirs, list):
                hashes += theirs[at:reached]
            else:
                hashes = theirs[at:reached]  # the first branch: its slice is the list (no copy)
            at = reached
            last = branch
            if at >= count:
                return hashes, last, None
            key = (theirs[at - 1], ours[at * b : (at + 1) * b].tobytes(), None)

    def same_ids(self, ours: array[int], theirs: array[int], start: int, stop: int) -> bool:
        """``same_ids`` from this memo's ``memcmp_min``, each ``memcmp`` counted."""
        if self.paths is not None and by_memcmp(stop - start, self.memcmp_min):
            self.paths.ran(path_counts.MEMO_MEMCMP)
        return same_ids(ours, theirs, start, stop, self.memcmp_min)

    def walk_packed(
        self, packed: array[int], count: int, salt: str | None
    ) -> tuple[list[BlockHash], Branch | None, MemoKey | None]:
        """``walk`` along a packed id array, remembered (``last_walk``) when no source's length
        decided where it ended, so that registering the request it hashed (``remember``, at
        its first cached block, most often in the same admission) need not walk again."""
        found = self.walk(packed, count, salt)
        self.last_walk = None
        if not self._length_bound:
            self.last_walk = (packed, count, salt, self.version, (len(found[0]), *found[1:]))
        return found

    def _walk_end(self, packed: array[int], count: int, salt: str | None) -> WalkEnd:
        """Where ``walk_packed`` of these ids ends: ``last_walk``'s end while it holds."""
        last = self.last_walk
        if (
            last is not None
            and last[0] is packed
            and last[1] == count
            and last[2] == salt
            and last[3] == self.version
        ):
            return last[4]
        adopted, parent, key = self.walk_packed(packed, count, salt)
        return len(adopted), parent, key

    # --- Filled and emptied by the pool ------------------------------------------------------

    def remember(self, src: int, source: MemoSource) -> None:
        """Pool source ``src`` (a memo source) has a cached block: register it (once)."""
        entry = self.registered.get(src)
        if entry is not None:
            if entry[0] is source:
                return
            self.forget(src)  # the index now names another source
        self.registered[src] = (source, None)
        keyable, salt = salt_key(source.salt)
        packed, hashes = source.packed, source.hashes
        b = self.block_size
        count = min(len(hashes), len(packed) // b) if packed is not None else 0
        if not keyable or packed is None or count == 0:
            return
        at, parent, key = self._walk_end(packed, count, salt)
        if key is None:
            return  # its blocks lie on the tree already (or past a source it cannot read)
        block = packed[at * b : (at + 1) * b].tobytes()
        # The key the walk missed, from the source's own hashes (equal, as they are exact).
        own: MemoKey = (hashes[at - 1] if at else None, block, None if at else salt)
        if own in self.branches:
            return
        branch = Branch(own, src, source, at, parent)
        self.branches[own] = branch
        self.version += 1
        if parent is not None:
            parent.children.add(branch)
            parent.fork = at
        self.registered[src] = (source, branch)

    def forget(self, src: int) -> None:
        """Pool source ``src`` has no cached block any more (or is dropped): unregister it."""
        entry = self.registered.pop(src, None)
        if entry is None or entry[1] is None:
            return
        branch = entry[1]
        self.version += 1
        if not branch.children:
            del self.branches[branch.key]
            parent = branch.parent
            if parent is not None:
                parent.children.discard(branch)
                if parent.fork == branch.start:
                    parent.fork = max((child.start for child in parent.children), default=-1)
            return
        # The child that branches off last shares every block of this branch up to its own
        # start, so all other children still hang off its run: it takes the branch over.
        heir = max(branch.children, key=lambda child: child.start)
        branch.children.discard(heir)
        del self.branches[heir.key]
        for child in heir.children:
            child.parent = branch
        branch.children |= heir.children
        branch.src, branch.source = heir.src, heir.source
        branch.fork = max((child.start for child in branch.children), default=-1)
        self.registered[heir.src] = (heir.source, branch)

    def clear(self) -> None:
        self.branches.clear()
        self.registered.clear()
        self.first_agreement = None
        self.last_walk = None
        self.version += 1

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the tree is inconsistent: every branch is registered
        under its key and its source, hangs off its parent after the parent's start, and names
        its source's block and parent hash; no more branches than registered sources."""
        b = self.block_size
        require(len(self.branches) <= len(self.registered), "more branches than sources")
        for src, (source, owned) in self.registered.items():
            if owned is not None:
                require(owned.src == src and owned.source is source, f"source {src}: wrong branch")
                require(self.branches.get(owned.key) is owned, f"source {src}: branch not indexed")
        for key, branch in self.branches.items():
            require(branch.key == key, "a branch under another key")
            require(
                self.registered.get(branch.src, (None, None))[1] is branch,
                f"branch of source {branch.src} is not registered",
            )
            parent, start = branch.parent, branch.start
            if parent is None:
                require(start == 0 and key[0] is None, "a root branch after block 0")
            else:
                require(self.branches.get(parent.key) is parent, "a branch off a dropped one")
                require(branch in parent.children, "a branch missing from its parent")
                require(parent.start < start, "a branch before its parent's start")
                require(key[2] is None, "a salt after block 0")
            for child in branch.children:
                require(child.parent is branch, "a child with another parent")
            require(branch.fork == -1 or bool(branch.children), "a fork without children")
            hashes, packed = branch.source.hashes, branch.source.packed
            if packed is not None and len(packed) >= (start + 1) * b:
                require(packed[start * b : (start + 1) * b].tobytes() == key[1], "key tokens")
            if start:
                require(len(hashes) >= start and hashes[start - 1] == key[0], "key parent")
