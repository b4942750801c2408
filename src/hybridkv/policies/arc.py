"""``arc``: adaptive replacement over blocks, blind to the attention type.

Rule (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03, Fig. 4),
over the blocks of one pool: a cached block is in T1 (accessed once: cached, never hit since)
or T2 (hit at least once: ``touched`` while it held a key); a key evicted from T1 is
remembered in the ghost list B1, one from T2 in B2, the two bounded together by the pool's
block count ``c`` (the longer list's oldest ghost dropped first, a simplification of ARC's
case IV). Caching a key found in B1 means T1 was too small: the target ``p`` for T1 grows by
``max(1, |B2| // |B1|)`` (at most ``c``), and the block joins T2; a key found in B2 shrinks
``p`` by ``max(1, |B1| // |B2|)`` (at least 0). To reuse a block: free blocks without a key
first (nothing to lose, as in vLLM's queue), then the least recently released free block of T1
when T1 holds more than ``p`` blocks (held or free), else of T2, falling back to the other list
when the chosen one has no free block.

Only free blocks can be evicted, so T1 and T2 count every cached block but only their free
members are candidates. Each call costs O(1) per block (``OrderedDict``: linked lists);
``choose`` replays the replacement on local counters and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.policies.protocol import CachedBlock

GhostKey = tuple[bytes, int]


class ARCPolicy:
    """ARC's T1/T2, ghosts B1/B2 and target ``p`` over the pool's blocks."""

    name = "arc"

    def __init__(self) -> None:
        self._c = 0  # pool size: every block announced free at start
        self._p = 0
        self._keys: dict[int, list[GhostKey]] = {}
        self._frequent: dict[int, None] = {}  # T2 membership (held or free)
        self._t1_size = 0  # cached blocks in T1, held or free
        self._t2_size = 0
        # Free blocks, least recently released first. Ordered dicts are linked lists: O(1) to
        # prepend, to drop the oldest and to reach it (a plain dict reached through ``iter`` after
        # deletions from the front scans its dead slots: O(pool) per call).
        self._free_plain: OrderedDict[int, None] = OrderedDict()
        self._free_t1: OrderedDict[int, None] = OrderedDict()
        self._free_t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[GhostKey, None] = OrderedDict()
        self._b2: OrderedDict[GhostKey, None] = OrderedDict()
        self._free: set[int] = set()

    # --- what the pool tells ---------------------------------------------------------------

    def cached(self, block: CachedBlock) -> None:
        key = (block.block_hash, block.group_id)
        block_id = block.block_id
        first_key = block_id not in self._keys
        self._keys.setdefault(block_id, []).append(key)
        if key in self._b1:
            del self._b1[key]
            self._p = min(self._c, self._p + max(1, len(self._b2) // max(1, len(self._b1))))
            self._promote(block_id, first_key)
        elif key in self._b2:
            del self._b2[key]
            self._p = max(0, self._p - max(1, len(self._b1) // max(1, len(self._b2))))
            self._promote(block_id, first_key)
        elif first_key:
            self._t1_size += 1
            if block_id in self._free_plain:
                del self._free_plain[block_id]
                self._free_t1[block_id] = None

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        if not self._c:
            self._c = len(without_hash) + len(with_hash)
        for block_id in without_hash:
            if block_id in self._keys:
                self._drop_keys(block_id)
        for block_id in reversed(without_hash):
            self._free_plain[block_id] = None
            self._free_plain.move_to_end(block_id, last=False)
        for block_id in with_hash:
            if block_id not in self._keys:
                self._free_plain[block_id] = None
            elif block_id in self._frequent:
                self._free_t2[block_id] = None
            else:
                self._free_t1[block_id] = None
        self._free.update(without_hash)
        self._free.update(with_hash)

    def touched(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if block_id in self._free:
                self._leave_free(block_id)
            if block_id in self._keys and block_id not in self._frequent:
                self._promote(block_id, False)

    @property
    def num_free(self) -> int:
        """Free blocks, with a key or without."""
        return len(self._free_plain) + len(self._free_t1) + len(self._free_t2)

    def choose(self, n: int) -> Sequence[int]:
        chosen = list(_first(self._free_plain, n))
        t1 = iter(self._free_t1)
        t2 = iter(self._free_t2)
        t1_left, t2_left = len(self._free_t1), len(self._free_t2)
        t1_size = self._t1_size
        while len(chosen) < n:
            from_t1 = t1_left > 0 and (t1_size > self._p or t2_left == 0)
            if from_t1:
                chosen.append(next(t1))
                t1_left -= 1
                t1_size -= 1
            else:
                chosen.append(next(t2))
                t2_left -= 1
        return chosen

    def taken(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            ghosts = self._b2 if block_id in self._frequent else self._b1
            keys = self._keys.get(block_id, ())
            self._leave_free(block_id)
            self._drop_keys(block_id)
            for key in keys:
                ghosts[key] = None
            self._bound_ghosts()

    def uncached(self, block_id: int) -> None:
        free = block_id in self._free
        self._leave_free(block_id)
        self._drop_keys(block_id)
        if free:
            self._free.add(block_id)
            self._free_plain[block_id] = None

    def reset(self) -> None:
        for block_id in list(self._keys):
            self.uncached(block_id)
        self._b1.clear()
        self._b2.clear()
        self._p = 0

    # --- inside ----------------------------------------------------------------------------

    def _promote(self, block_id: int, first_key: bool) -> None:
        """``block_id`` joins T2 (from T1, or new when ``first_key``)."""
        if block_id in self._frequent:
            return
        if not first_key:
            self._t1_size -= 1
        self._frequent[block_id] = None
        self._t2_size += 1
        for queue in (self._free_t1, self._free_plain):
            if block_id in queue:
                del queue[block_id]
                self._free_t2[block_id] = None

    def _leave_free(self, block_id: int) -> None:
        self._free.discard(block_id)
        for queue in (self._free_plain, self._free_t1, self._free_t2):
            queue.pop(block_id, None)

    def _drop_keys(self, block_id: int) -> None:
        """The block holds no key any more: it leaves T1 or T2."""
        if self._keys.pop(block_id, None) is None:
            return
        if block_id in self._frequent:
            del self._frequent[block_id]
            self._t2_size -= 1
        else:
            self._t1_size -= 1

    def _bound_ghosts(self) -> None:
        """|B1| + |B2| <= c: drop the oldest ghost of the longer list."""
        while len(self._b1) + len(self._b2) > self._c:
            longer = self._b1 if len(self._b1) >= len(self._b2) else self._b2
            longer.popitem(last=False)

    # --- for tests -------------------------------------------------------------------------

    @property
    def target(self) -> int:
        """ARC's ``p``: the size T1 is steered to."""
        return self._p

    def lists(self) -> dict[str, int]:
        """Sizes of T1, T2, B1, B2 (T1/T2 counting held blocks too)."""
        return {
            "T1": self._t1_size,
            "T2": self._t2_size,
            "B1": len(self._b1),
            "B2": len(self._b2),
        }


def _first(queue: OrderedDict[int, None], n: int) -> list[int]:
    out: list[int] = []
    for block_id in queue:
        if len(out) == n:
            break
        out.append(block_id)
    return out
