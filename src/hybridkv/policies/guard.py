"""A block pool's side of the seam: every call to a policy, checked and named on failure.

Both backends' pools talk to a policy only through ``GuardedPolicy``: it builds the
``CachedBlock`` values from what the pool knows (block id, key, the group's spec), turns any
exception a policy raises into a ``PolicyError`` that names the policy and the call, and checks
``choose``'s answer before the pool acts on it (``n`` distinct ints, each a free block), so a
failing policy leaves the pool exactly as it was.

The pool asks once per KV cache group: when a policy fails on a later group of one
allocation, the blocks the earlier groups already took stay with the request (and return to
the pool when it is freed), so no block is lost and every invariant holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from hybridkv.policies.protocol import CachedBlock, EvictionPolicy, PolicyError
from hybridkv.spec import KVCacheSpec

_T = TypeVar("_T")


class GuardedPolicy:
    """``policy`` as one pool calls it; ``specs[g]`` is group ``g``'s spec."""

    def __init__(self, policy: EvictionPolicy, specs: Sequence[KVCacheSpec]) -> None:
        self.policy = policy
        self.specs = tuple(specs)
        self.name = str(getattr(policy, "name", type(policy).__name__))

    def _call(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except PolicyError:
            raise
        except Exception as error:
            raise PolicyError(
                f"eviction policy {self.name!r} raised in {what}: {type(error).__name__}: {error}"
            ) from error

    def cached(
        self,
        block_id: int,
        block_hash: bytes,
        group_id: int,
        parent_hash: bytes | None,
        prefix_tokens: int,
    ) -> None:
        block = CachedBlock(
            block_id, block_hash, group_id, self.specs[group_id], parent_hash, prefix_tokens
        )
        self._call("cached", lambda: self.policy.cached(block))

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        if without_hash or with_hash:
            self._call("released", lambda: self.policy.released(without_hash, with_hash))

    def touched(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            self._call("touched", lambda: self.policy.touched(block_ids))

    def taken(self, block_ids: Sequence[int]) -> None:
        self._call("taken", lambda: self.policy.taken(block_ids))

    def uncached(self, block_id: int) -> None:
        self._call("uncached", lambda: self.policy.uncached(block_id))

    def reset(self) -> None:
        self._call("reset", self.policy.reset)

    def choose(self, n: int, is_free: Callable[[int], bool]) -> list[int]:
        """The policy's ``n`` victims, checked: distinct ints, each free now."""
        answer = self._call("choose", lambda: list(self.policy.choose(n)))
        if len(answer) != n:
            raise PolicyError(
                f"eviction policy {self.name!r} chose {len(answer)} blocks for {n} new blocks"
            )
        seen: set[int] = set()
        for block_id in answer:
            if not isinstance(block_id, int) or isinstance(block_id, bool):
                raise PolicyError(
                    f"eviction policy {self.name!r} chose {block_id!r}, not a block id"
                )
            if block_id in seen:
                raise PolicyError(f"eviction policy {self.name!r} chose block {block_id} twice")
            if not is_free(block_id):
                raise PolicyError(
                    f"eviction policy {self.name!r} chose block {block_id}, which is not free"
                )
            seen.add(block_id)
        return answer
