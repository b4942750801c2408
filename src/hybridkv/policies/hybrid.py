"""``hybrid``: evict what can no longer serve a hit first, branch tails and chains last.

Rule, by tier (lowest reused first, least recently released first within a tier, as vLLM's
queue orders ties):

0. free blocks without a key (nothing to lose, as in vLLM's queue);
1. blocks that can serve no hit: a sliding-window or chunked-local block outside the span of
   every cached prefix end (``rules.can_serve_hit``); a full-attention block whose parent key is
   gone (its chain to the root is broken); a Mamba state at a prefix the full-attention groups
   no longer cache; a second block holding a key another block already serves;
2. a branch's interior window blocks: read by some prefix end, but by none at a branch end or
   branch point (several cached children: the prefix the diverging requests share ends there);
3. the rest (Mamba states at cached prefixes, kinds without a rule);
4. full-attention chains and the last window before each branch end and branch point.

Beside a Mamba group the full-attention chains stay in tier 3, with the states: a hit there
needs the state at its end, so a chain kept past its states keeps blocks no hit can use (on
Jamba-v0.1 that order lost half of LRU's hits; ``docs/eviction.md``). The layout is learned
from the first Mamba block cached, when every free block is re-sorted once.

A block holding several keys takes its highest tier. ``HybridPolicy(tails_last=False)`` keeps
only tiers 0, 1 and 3: useless blocks first, then plain LRU. ``duplicates_first=False`` keeps a
second holder of a key in tier 3: it serves the key once the first holder is evicted, and the
first, older, goes first under LRU; on the real trace's Jamba at 512 GiB taking second holders
first lost 1.3 points against LRU, and keeping them gave LRU's hits exactly
(``docs/eviction.md``).

Sources: vllm#21017 and vllm#51909
(out-of-window and never-hit blocks flush the prefixes that could hit); SGLang's
``SWARadixCache`` trimming interior nodes to the trailing window first (sglang#26907) and
evicting the branch-tail window last (sglang#35515); Prefix caching, Cases 0-2 of the design
document for which blocks a hit reads. The classes are kept by ``KeyTree``'s incremental
counts; the free blocks by ``ScoredFreeSet`` (O(log n) per block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.policies.free_set import ReleaseClock, ScoredFreeSet
from hybridkv.policies.key_tree import WINDOW_KINDS, Key, KeyTree
from hybridkv.policies.protocol import CachedBlock

NO_KEY, USELESS, INTERIOR, OTHER, KEEP = range(5)
TIER_NAMES = ("no key", "useless", "interior window", "other", "chain or branch tail")


class HybridPolicy:
    """Tiered eviction over the groups' key trees, LRU within a tier."""

    name = "hybrid"

    def __init__(self, *, tails_last: bool = True, duplicates_first: bool = True) -> None:
        # False: only useless blocks are singled out, every other keyed block is LRU (tier 3).
        self.tails_last = tails_last
        # False: a second holder of a key ages with the first (tier 3) instead of going first.
        self.duplicates_first = duplicates_first
        self._tree = KeyTree()
        self._clock = ReleaseClock()
        self._free = ScoredFreeSet()
        self._stamp: dict[int, int] = {}  # free block -> release stamp
        self._keys: dict[int, dict[Key, None]] = {}
        self._beside_mamba = False  # a Mamba block was ever cached: chains age with states

    # --- what the pool tells ---------------------------------------------------------------

    def cached(self, block: CachedBlock) -> None:
        key = (block.block_hash, block.group_id)
        self._keys.setdefault(block.block_id, {})[key] = None
        self._reclassify(self._tree.add(block), (block.block_id,))
        if not self._beside_mamba and self._tree.mamba_groups:
            self._beside_mamba = True
            self._reclassify((), tuple(self._stamp))  # once: the chains' tier changes

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        for ids, stamps in (
            (without_hash, self._clock.at_head(without_hash)),
            (with_hash, self._clock.at_tail(with_hash)),
        ):
            for block_id, stamp in zip(ids, stamps, strict=True):
                self._stamp[block_id] = stamp
                self._free.put(block_id, self.sort_key(block_id, stamp))

    def touched(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._free.discard(block_id)
            self._stamp.pop(block_id, None)

    def choose(self, n: int) -> Sequence[int]:
        return self._free.smallest(n)

    def taken(self, block_ids: Sequence[int]) -> None:
        self.touched(block_ids)
        for block_id in block_ids:
            self._forget(block_id)

    def uncached(self, block_id: int) -> None:
        self._forget(block_id)
        self._reclassify((), (block_id,))

    def reset(self) -> None:
        self._tree = KeyTree()
        self._keys = {}
        for block_id, stamp in self._stamp.items():
            self._free.put(block_id, self.sort_key(block_id, stamp))

    # --- classes ---------------------------------------------------------------------------

    def sort_key(self, block_id: int, stamp: int) -> tuple[float, ...]:
        """Where a free block sorts (least reused first): its tier, then its release stamp."""
        return (self.tier(block_id), stamp)

    def keys_of(self, block_id: int) -> tuple[Key, ...]:
        """The keys the block holds."""
        return tuple(self._keys.get(block_id, ()))

    def tier(self, block_id: int) -> int:
        """The block's tier now (``NO_KEY`` … ``KEEP``)."""
        keys = self._keys.get(block_id)
        if not keys:
            return NO_KEY
        return max(self._key_tier(block_id, key) for key in keys)

    def _key_tier(self, block_id: int, key: Key) -> int:
        tree = self._tree
        node = tree.nodes[key]
        if next(iter(node.blocks)) != block_id:  # lookups return the first holder
            return USELESS if self.duplicates_first else OTHER
        if node.kind == "full":
            return (
                USELESS if tree.orphan(key) else self._kept(OTHER if self._beside_mamba else KEEP)
            )
        if node.kind in WINDOW_KINDS:
            if not node.serves:
                return USELESS
            return self._kept(KEEP if node.tails else INTERIOR)
        if node.kind == "mamba" and tree.full_groups and key[0] not in tree.full_holders:
            return USELESS
        return OTHER

    def _kept(self, tier: int) -> int:
        return tier if self.tails_last else OTHER

    def tiers(self) -> dict[int, int]:
        """Every free block's tier (for tests and profiles)."""
        return {block_id: int(self._free.key(block_id)[0]) for block_id in self._stamp}

    @property
    def tree(self) -> KeyTree:
        """The key trees (read-only use: tests compare their counts with a brute force)."""
        return self._tree

    def _forget(self, block_id: int) -> None:
        dirty: set[Key] = set()
        for key in self._keys.pop(block_id, ()):
            dirty |= self._tree.remove(block_id, key)
        self._reclassify(dirty, ())

    def _reclassify(self, keys: Iterable[Key], block_ids: Iterable[int]) -> None:
        """Move the free blocks of ``keys`` (and ``block_ids``) to their current tier."""
        todo = dict.fromkeys(block_ids)
        for key in keys:
            node = self._tree.nodes.get(key)
            if node is not None:
                todo.update(node.blocks)
        for block_id in todo:
            stamp = self._stamp.get(block_id)
            if stamp is not None:
                self._free.put(block_id, self.sort_key(block_id, stamp))
