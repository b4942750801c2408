"""The scheduler's prefix-cache statistics calls, one owner for both backends.

vLLM's scheduler asks its manager whether a request looks the cache up, counts the lookup that
admitted it, and takes the counts once per logging interval. Both managers answer alike, so the
counts live in one ``PrefixCacheCounter`` and the four calls in one mixin.
"""

from __future__ import annotations

from hybridkv.reference.events import PrefixCacheStats, count_admission
from hybridkv.reference.request import RequestLike


class PrefixCacheCounter:
    """The prefix-cache statistics a manager counts for its scheduler, one owner for both
    backends: admissions since the last ``take`` (nothing with ``log_stats`` off)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._stats = PrefixCacheStats()

    @property
    def current(self) -> PrefixCacheStats | None:
        """The counts since the last ``take`` (``None`` with ``log_stats`` off)."""
        return self._stats if self.enabled else None

    def record(self, request: RequestLike, num_hits: int) -> None:
        """Count the lookup that admitted ``request`` (``count_admission``)."""
        if self.enabled:
            self._stats = count_admission(self._stats, request, num_hits)

    def take(self) -> PrefixCacheStats | None:
        """The counts since the last call, starting afresh (``None`` with ``log_stats`` off)."""
        if not self.enabled:
            return None
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def after_reset(self) -> None:
        """The prefix cache was reset: the counts say so."""
        if self.enabled:
            self._stats = self._stats.after_reset()


class PrefixCacheStatsCalls:
    """The four statistics calls of a manager that sets ``enable_caching`` and ``_stats``."""

    enable_caching: bool
    _stats: PrefixCacheCounter

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics counted since the last ``make_prefix_cache_stats`` (``None`` with
        ``log_stats`` off)."""
        return self._stats.current

    def prefix_cache_lookup_enabled(self, request: RequestLike) -> bool:
        """Whether ``get_computed_blocks`` looks ``request`` up: caching is on and the request
        does not skip reading the cache."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: RequestLike, num_hits: int) -> None:
        """Count the lookup that admitted ``request``, with its ``num_hits`` cached tokens.

        The scheduler calls it when ``allocate_slots`` admitted the request, not after every
        lookup: a waiting request is looked up at every step until it fits, and only the
        admitting lookup says what the cache saved (vLLM's rule). Nothing is counted with
        ``log_stats`` off or for a request that did not look the cache up.
        """
        if self.prefix_cache_lookup_enabled(request):
            self._stats.record(request, num_hits)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Admitted lookups since the last call (the counters restart), or ``None`` with
        ``log_stats`` off."""
        return self._stats.take()
