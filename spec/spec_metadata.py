"""What reports, messages and KV cache events call a layer spec."""

from __future__ import annotations

from hybridkv.spec.kv_cache_spec import KVCacheSpec, SlidingWindowSpec


def spec_kind(spec: KVCacheSpec) -> str:
    """A short stable name of the attention type, used in reports and error messages."""
    return spec.kind


def event_metadata(spec: KVCacheSpec) -> tuple[str, int | None]:
    """``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` of a group of ``spec`` in KV cache
    events: what vLLM 0.33's ``get_kv_cache_spec_kind`` (its ``KVCacheSpecKind`` value) and
    ``get_kv_cache_spec_sliding_window`` give for the same spec in vLLM's classes. Only a
    sliding window has a window (its ``sliding_window``: the extra retained tokens are not
    part of it)."""
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    return spec.event_kind, window
