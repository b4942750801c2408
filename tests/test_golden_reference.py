"""Every golden trace recorded from vLLM 0.33 replays identically on the reference.

Each trace is compared operation by operation (hit lengths, block ids per position, free-queue
order, cached blocks, reference counts), with the invariant checker run after every step.
"""

from __future__ import annotations

import pytest

from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.reference import KVCacheManager
from hybridkv.spec import KVCacheConfig


def reference_factory(
    config: KVCacheConfig, max_model_len: int, enable_caching: bool
) -> KVCacheManager:
    return KVCacheManager(config, max_model_len, enable_caching=enable_caching)


def test_all_189_traces_are_packaged() -> None:
    assert len(trace_names()) == 189


@pytest.mark.parametrize("name", trace_names())
def test_golden_trace_replays_identically(name: str) -> None:
    _, divergence = replay_trace(name, reference_factory, check_invariants=True)
    assert divergence is None, str(divergence)
