"""A brute-force oracle for ``hybrid``: every class recomputed from the cached keys alone.

``RecordingHybrid`` writes down the keys the pool announces (its own copy, not the policy's
trees); ``check_against_oracle`` rebuilds every count from those records with
``rules.can_serve_hit`` and compares it with the policy's incremental counts and tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.policies import CachedBlock, HybridPolicy
from hybridkv.policies.hybrid import INTERIOR, KEEP, NO_KEY, OTHER, USELESS
from hybridkv.policies.key_tree import WINDOW_KINDS, window_of
from hybridkv.spec import rules

Key = tuple[bytes, int]


@dataclass(frozen=True)
class Entry:
    parent: Key | None
    kind: str
    window: int
    block_size: int
    prefix_tokens: int

    @property
    def index(self) -> int:
        return max(self.prefix_tokens - 1, 0) // self.block_size


class RecordingHybrid(HybridPolicy):
    """``hybrid``, keeping its own record of every held key in announcement order."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[Key, list[int]] = {}
        self.entries: dict[Key, Entry] = {}
        self.block_keys: dict[int, list[Key]] = {}

    def cached(self, block: CachedBlock) -> None:
        key = (block.block_hash, block.group_id)
        parent = None if block.parent_hash is None else (block.parent_hash, block.group_id)
        entry = Entry(parent, block.spec.kind, window_of(block), block.spec.block_size,
                      block.prefix_tokens)  # fmt: skip
        self.entries.setdefault(key, entry)
        self.holders.setdefault(key, []).append(block.block_id)
        self.block_keys.setdefault(block.block_id, []).append(key)
        super().cached(block)

    def _drop(self, block_id: int) -> None:
        for key in self.block_keys.pop(block_id, ()):
            self.holders[key].remove(block_id)
            if not self.holders[key]:
                del self.holders[key]

    def taken(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._drop(block_id)
        super().taken(block_ids)

    def uncached(self, block_id: int) -> None:
        self._drop(block_id)
        super().uncached(block_id)

    def reset(self) -> None:
        self.holders, self.block_keys = {}, {}
        super().reset()


def _path(policy: RecordingHybrid, key: Key) -> list[Key] | None:
    """The cached ancestors-or-self of ``key`` that a hit ending at ``key`` reads, if all are
    cached and reach back to the span's first block (or the root)."""
    end = policy.entries[key]
    lo, hi = rules.hit_block_span(end.kind, end.window, end.block_size, end.prefix_tokens)
    if lo == hi:
        return None
    path: list[Key] = []
    current: Key | None = key
    while current is not None:
        if current not in policy.holders:
            return None
        entry = policy.entries[current]
        path.append(current)
        before = entry.index - 1
        if before < 0 or not rules.can_serve_hit(
            end.kind, end.window, before, end.block_size, end.prefix_tokens
        ):
            return path
        current = entry.parent
    return path


def oracle_counts(policy: RecordingHybrid) -> dict[Key, tuple[int, int, int]]:
    """``key -> (cached children, serves, tails)`` for every held key, from scratch."""
    held = policy.holders
    children = dict.fromkeys(held, 0)
    for key in held:
        parent = policy.entries[key].parent
        if parent in children:
            children[parent] += 1
    serves = dict.fromkeys(held, 0)
    tails = dict.fromkeys(held, 0)
    for key in held:
        if policy.entries[key].kind not in WINDOW_KINDS:
            continue
        path = _path(policy, key)
        for reader in path or ():
            serves[reader] += 1
            tails[reader] += children[key] != 1
    return {key: (children[key], serves[key], tails[key]) for key in held}


def oracle_tiers(policy: RecordingHybrid, free: Sequence[int]) -> dict[int, int]:
    counts = oracle_counts(policy)
    full_hashes = {k[0] for k in policy.holders if policy.entries[k].kind == "full"}
    any_full = any(e.kind == "full" for e in policy.entries.values())
    chain = OTHER if any(e.kind == "mamba" for e in policy.entries.values()) else KEEP

    def key_tier(block_id: int, key: Key) -> int:
        entry = policy.entries[key]
        if policy.holders[key][0] != block_id:
            return USELESS
        if entry.kind == "full":
            return chain if entry.parent is None or entry.parent in policy.holders else USELESS
        if entry.kind in WINDOW_KINDS:
            _, serves, tails = counts[key]
            return USELESS if not serves else KEEP if tails else INTERIOR
        if entry.kind == "mamba" and any_full and key[0] not in full_hashes:
            return USELESS
        return OTHER

    def block_tier(block_id: int) -> int:
        keys = policy.block_keys.get(block_id, ())
        return max((key_tier(block_id, k) for k in keys), default=NO_KEY)

    return {block_id: block_tier(block_id) for block_id in free}


def check_against_oracle(policy: RecordingHybrid, free: Sequence[int]) -> None:
    """The policy's incremental counts and tiers equal the brute force's."""
    expected = oracle_counts(policy)
    tree = policy.tree
    actual = {
        key: (node.cached_children, node.serves, node.tails)
        for key, node in tree.nodes.items()
        if node.blocks
    }
    assert actual == expected
    for key, node in tree.nodes.items():
        if not node.blocks:
            assert (node.serves, node.tails) == (0, 0), key
    assert policy.tiers() == oracle_tiers(policy, free)
