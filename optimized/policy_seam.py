"""The optimized pool's side of the eviction seam: the reference's calls, in the reference's order.

``TorchKVCacheManager(..., eviction_policy=...)`` takes what ``hybridkv.reference.
KVCacheManager`` takes (``hybridkv.policies.resolve_policy``). The default, ``"lru"``, is vLLM's
own free queue: the pool holds no policy (``policy is None``) and every path runs exactly as
before, testing that once where it branches (taking, releasing, touching, inserting).

With a policy, one policy must reuse the same blocks, find the same hits and emit the same
events on both backends, so the pool makes exactly ``BlockPool``'s calls in ``BlockPool``'s
order: every block free at the start; ``touched`` per group at an admission; ``choose`` and
``taken`` once per group that takes blocks (``TorchBlockPool.pop_groups``); ``released`` per
walk (``free_heard``); ``cached`` per entry made, with the parent hash one block (full block)
or one hash block (partial entry) back; ``uncached`` when a block trades its keys without being
reused (``remove_keys``); ``reset``. The optimized backend's deferred work would reorder those
calls (pending releases and inserts made at the next read, whole-step batches, one take for
every group), so a manager with a policy takes its general, immediate paths instead: its layout
does not defer and is not vectorisable (``GroupLayout.build(..., immediate=True)``), and
``allocate_slots_batch``/``free_batch`` make the single calls. Exactness matters more than
speed there: a custom order costs what the policy costs.

Errors (``PolicyError``, naming the policy, from ``hybridkv.policies.guard``): a wrong or
failing ``choose`` raises before anything changed in that take; a step that already released
blocks keeps them released with its thresholds recomputed, and blocks earlier groups of one
take got go back to the pool. A notification (``cached``, ``released``, ``touched``,
``taken``, ``uncached``, ``reset``) comes after the pool's own change, so its failure must not
cut a manager call in half: ``HeardPolicy`` keeps the first such error and the manager raises
it once the call is complete (``raise_failed``), the pool consistent and no block lost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.policies.guard import GuardedPolicy
from hybridkv.policies.protocol import EvictionPolicy, PolicyError
from hybridkv.spec import KVCacheSpec


class HeardPolicy:
    """``GuardedPolicy`` as the optimized pool calls it: notification errors wait for the end
    of the manager's call (see the module docstring)."""

    def __init__(self, policy: EvictionPolicy, specs: Sequence[KVCacheSpec]) -> None:
        self.guard = GuardedPolicy(policy, specs)
        self.name = self.guard.name
        self.failed: PolicyError | None = None

    def _heard(self, call: Callable[[], None]) -> None:
        try:
            call()
        except PolicyError as error:
            if self.failed is None:
                self.failed = error

    def raise_failed(self) -> None:
        """Raise the first notification error since the last call, if any."""
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    def cached(
        self,
        block_id: int,
        block_hash: bytes,
        group_id: int,
        parent_hash: bytes | None,
        prefix_tokens: int,
    ) -> None:
        guard = self.guard
        self._heard(
            lambda: guard.cached(block_id, block_hash, group_id, parent_hash, prefix_tokens)
        )

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        self._heard(lambda: self.guard.released(without_hash, with_hash))

    def touched(self, block_ids: Sequence[int]) -> None:
        self._heard(lambda: self.guard.touched(block_ids))

    def taken(self, block_ids: Sequence[int]) -> None:
        self._heard(lambda: self.guard.taken(block_ids))

    def uncached(self, block_id: int) -> None:
        self._heard(lambda: self.guard.uncached(block_id))

    def reset(self) -> None:
        self._heard(self.guard.reset)

    def choose(self, n: int, is_free: Callable[[int], bool]) -> list[int]:
        """The policy's ``n`` victims, checked (``GuardedPolicy.choose``); its error wins over
        a notification's kept before it."""
        try:
            return self.guard.choose(n, is_free)
        except PolicyError:
            self.failed = None
            raise
