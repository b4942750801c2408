"""vLLM's KV cache residency metrics (``--kv-cache-metrics``) over a hybridkv core.

vLLM's scheduler builds a ``KVCacheMetricsCollector`` (sampled per-block lifetime, idle time
and reuse gaps) and hands it to its manager; vLLM's ``BlockPool`` then calls it:

- ``on_block_evicted`` then ``on_block_allocated`` for each block ``get_new_blocks`` takes from
  the free queue, in order (``on_block_evicted`` only with prefix caching on, for every taken
  block, cached or not);
- ``on_block_accessed`` for each block a cache hit touches (``touch``; the null block apart);
- ``on_block_evicted`` for each block id of ``evict_blocks`` (a KV connector's failed load),
  cached or not;
- ``reset`` when ``reset_prefix_cache`` succeeds.

Both hybridkv pools tell an eviction policy exactly these moments (``hybridkv.policies``:
``taken``, ``touched``, ``reset``), so ``ObservedPolicy`` wraps the configured policy (vLLM's
own order, ``LRUPolicy``, by default), delegates every call and the choice to it, and reports to
the collector; ``BlockPoolView.evict_blocks`` reports a connector's evictions. The collector
reads only ``block.block_id``: it gets ``MetricsBlock`` values.

With a policy the optimized backend takes its immediate, per-call paths (the deferred and
batched ones would reorder the calls, ``hybridkv.optimized.policy_seam``): metrics cost it speed.

Not observable through the seam, so refused with a collector: Mamba ``"align"`` groups with
prefill checkpoint blocks (``num_prefill_checkpoint_blocks``, vLLM's ``MambaMixer2``). When a
step's checkpoint is transient (not the prompt's, not retained), vLLM's ``MambaManager`` calls
``_maybe_evict_cached_block`` on it and the collector hears the held block evicted, key or no
key (a decode step whose drafts span a block under the engine's retention interval 0), while a
pool tells a policy nothing for a keyless block and ``uncached`` for a block that lost keys,
the same call as for a partial key traded for a full one, which vLLM does not report.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.integrations.vllm.errors import refuse
from hybridkv.policies import CachedBlock, EvictionPolicy, LRUPolicy, resolve_policy
from hybridkv.spec import KVCacheConfig


@dataclass(frozen=True, slots=True)
class MetricsBlock:
    """A block as vLLM's ``KVCacheMetricsCollector`` reads a ``KVCacheBlock``: its id."""

    block_id: int


class ObservedPolicy:
    """``policy`` (every call and every choice its own) reporting to vLLM's ``collector``;
    ``enable_caching``: whether a taken block counts as evicted first (vLLM's rule)."""

    def __init__(self, policy: EvictionPolicy, collector: Any, *, enable_caching: bool) -> None:
        self.policy = policy
        self.collector = collector
        self.enable_caching = enable_caching
        self.name = str(getattr(policy, "name", type(policy).__name__))

    def cached(self, block: CachedBlock) -> None:
        self.policy.cached(block)

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        self.policy.released(without_hash, with_hash)

    def touched(self, block_ids: Sequence[int]) -> None:
        self.policy.touched(block_ids)
        for block_id in block_ids:
            self.collector.on_block_accessed(MetricsBlock(block_id))

    def choose(self, n: int) -> Sequence[int]:
        return self.policy.choose(n)

    def taken(self, block_ids: Sequence[int]) -> None:
        self.policy.taken(block_ids)
        collector = self.collector
        for block_id in block_ids:
            block = MetricsBlock(block_id)
            if self.enable_caching:
                collector.on_block_evicted(block)
            collector.on_block_allocated(block)

    def uncached(self, block_id: int) -> None:
        """Not reported: vLLM reports a connector's evictions (``report_evicted``), not a key
        traded in place."""
        self.policy.uncached(block_id)

    def reset(self) -> None:
        self.policy.reset()
        self.collector.reset()


def report_evicted(collector: Any, block_ids: Iterable[int]) -> None:
    """``BlockPool.evict_blocks``'s reports: each id, in the caller's order, cached or not."""
    if collector is not None:
        for block_id in block_ids:
            collector.on_block_evicted(MetricsBlock(block_id))


def observed_policy(
    choice: str | EvictionPolicy | None,
    collector: Any,
    config: KVCacheConfig,
    enable_caching: bool,
) -> ObservedPolicy:
    """The policy ``choice`` names (``None``: ``HYBRIDKV_EVICTION``'s, else ``lru``, vLLM's
    order as ``LRUPolicy``), reporting to ``collector``; refused by name with a Mamba
    ``"align"`` group with prefill checkpoint blocks (see the module docstring)."""
    refuse(
        any(
            getattr(group.spec, "mamba_cache_mode", None) == "align"
            and getattr(group.spec, "num_prefill_checkpoint_blocks", 0) > 0
            for group in config.groups
        ),
        "metrics_collector (--kv-cache-metrics) with Mamba 'align' prefill checkpoint blocks",
        "vLLM reports a transient checkpoint's block as evicted, which the eviction seam does "
        "not hear",
    )
    chosen = resolve_policy(choice or os.environ.get("HYBRIDKV_EVICTION", "lru"))
    return ObservedPolicy(chosen or LRUPolicy(), collector, enable_caching=enable_caching)
