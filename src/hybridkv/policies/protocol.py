"""The eviction seam: what a block pool tells a policy, and the one question it asks.

vLLM 0.33 has one answer to "which free blocks do new tokens reuse?": the head of its LRU free
queue. A policy replaces only that answer. The pool keeps every block's reference count, cache
keys and the set of free blocks; the policy hears each change that matters to an order and,
when ``n`` new blocks are needed, names ``n`` free blocks. The pool checks the answer before it
changes anything (``PolicyError`` names the policy; nothing is lost), so a policy cannot break
the pool, only choose worse or better victims.

The calls, in the order a block meets them:

* ``cached``: the block now holds a prefix-cache key (its hash, its group, the group's spec, the
  parent block's hash and the prefix length the key names);
* ``released``: blocks whose last holder let go, in the pool's walk order (evicted last first),
  split into those keeping a cached key and those without one;
* ``touched``: a cache hit adopts these blocks (free ones leave the free set);
* ``choose``: the question, which must not change the policy's state;
* ``taken``: the pool reuses these free blocks for new tokens (their keys are forgotten: the
  eviction itself);
* ``uncached``: a block lost its keys without being reused (a Mamba checkpoint replaced, a
  partial entry traded for a full one);
* ``reset``: the prefix cache was cleared (every block free, no key kept).

Block ids are ints, so one policy serves both backends. A policy must be deterministic: no wall
clock, no Python ``hash()`` of strings or bytes (randomised per process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hybridkv.spec import KVCacheSpec


class PolicyError(RuntimeError):
    """An eviction policy raised, or answered ``choose`` with blocks the pool cannot reuse."""


@dataclass(frozen=True)
class CachedBlock:
    """A block entering the prefix cache, as a policy sees it.

    ``prefix_tokens`` is the length of the prefix the key names (the block's right edge for a
    full block, a hash boundary inside it for a partial entry); ``parent_hash`` the hash of the
    prefix one hash block shorter (``None`` at the start of the prompt).
    """

    block_id: int
    block_hash: bytes
    group_id: int
    spec: KVCacheSpec
    parent_hash: bytes | None
    prefix_tokens: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which free blocks new tokens reuse; hears every change to the free set."""

    name: str

    def cached(self, block: CachedBlock) -> None:
        """``block.block_id`` now holds the key ``(block_hash, group_id)``."""

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        """These blocks just became free, each list in the pool's walk order."""

    def touched(self, block_ids: Sequence[int]) -> None:
        """A cache hit adopts these blocks (free or already held)."""

    def choose(self, n: int) -> Sequence[int]:
        """``n`` distinct free blocks to reuse, without changing the policy's state."""
        ...

    def taken(self, block_ids: Sequence[int]) -> None:
        """The pool reuses these blocks (the ones ``choose`` named): they are held again and
        their keys are gone."""

    def uncached(self, block_id: int) -> None:
        """The block lost its keys while staying where it is."""

    def reset(self) -> None:
        """Every key is gone (every block was free and stays free)."""
