"""The prefix-cache statistics and usage calls of the vLLM integration's ``KVCacheManager``.

The core counts (``PrefixCacheStats`` of hybridkv, at admission, preempted requests apart);
vLLM's scheduler reads a live ``vllm.v1.metrics.stats.PrefixCacheStats`` object, which callers
may hold across steps: ``_publish_stats`` copies the core's counters into it.
"""

from __future__ import annotations

from typing import Any


class StatsCalls:
    """``usage`` and the prefix-cache statistics calls (mixed into ``KVCacheManager``)."""

    # The manager's own, which these read.
    core: Any
    log_stats: bool
    prefix_cache_stats: Any
    _stats_class: Any

    @property
    def usage(self) -> float:
        return float(self.core.usage)

    def make_prefix_cache_stats(self) -> Any:
        """vLLM's ``PrefixCacheStats`` since the last call, or ``None`` with ``log_stats`` off."""
        if not self.log_stats:
            return None
        self.core.make_prefix_cache_stats()
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._stats_class()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return bool(self.core.prefix_cache_lookup_enabled(request))

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Count one admitted lookup: the core counts (preempted requests apart), and vLLM's
        live ``prefix_cache_stats`` object shows its counters."""
        if self.log_stats:
            self.core.record_prefix_cache_stats(request, num_hits)
            self._publish_stats()

    def _publish_stats(self) -> None:
        """Copy the core's counters into vLLM's ``PrefixCacheStats`` object, which callers may
        hold across steps (vLLM's scheduler tests do)."""
        core_stats = self.core.prefix_cache_stats
        if core_stats is None or self.prefix_cache_stats is None:
            return
        for name in _STATS_FIELDS:
            setattr(self.prefix_cache_stats, name, getattr(core_stats, name))


_STATS_FIELDS = (
    "requests",
    "queries",
    "hits",
    "reset",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)
"""The counters of vLLM's ``PrefixCacheStats`` that the core's ``PrefixCacheStats`` holds."""
