"""Every golden trace recorded from vLLM 0.33 replays identically on the optimized backend (CPU).

The same replay as ``test_golden_reference``: every observation compared, the invariant checker
(pool, rows, row thresholds, device tables) run after every operation.
"""

from __future__ import annotations

import pytest

from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.spec import KVCacheConfig


def optimized_factory(
    config: KVCacheConfig, max_model_len: int, enable_caching: bool
) -> TorchKVCacheManager:
    return TorchKVCacheManager(config, max_model_len, enable_caching=enable_caching)


@pytest.mark.parametrize("name", trace_names())
def test_golden_trace_replays_identically_on_the_optimized_backend(name: str) -> None:
    _, divergence = replay_trace(name, optimized_factory, check_invariants=True)
    assert divergence is None, str(divergence)
