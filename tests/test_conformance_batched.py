"""The machine's batched rules, the adapter's optional batched calls, the traffic shares, and
the kill table of the planted mutants."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridkv.conformance.adapters import (
    SMALL_THRESHOLDS,
    Backend,
    BlockIds,
    EngineOptions,
    ManagerAdapter,
    ProtocolAdapter,
    batch_allocator,
    batch_freer,
    hash_block_size_of,
    optimized_backend,
    reference_backend,
    thresholds_of_pool,
)
from hybridkv.conformance.invariants import ConformanceError
from hybridkv.conformance.kill_table import KillRow, kill_table
from hybridkv.conformance.machine import RunStats, run_differential
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec


def _config(num_blocks: int) -> KVCacheConfig:
    sizes = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=(
            KVCacheGroup(("a",), FullAttentionSpec(block_size=2, **sizes)),
            KVCacheGroup(("b",), SlidingWindowSpec(block_size=2, sliding_window=3, **sizes)),
        ),
    )


def test_the_example_adapter_batches_exactly_as_the_single_calls_in_order() -> None:
    adapter = ProtocolAdapter("reference", KVCacheManager(_config(9), 16), 2)
    first = adapter.new_request("a", [1, 2, 3, 4, 5], None)
    second = adapter.new_request("b", [6, 7, 8, 9, 10, 11], None)
    assert batch_allocator(adapter) is adapter
    assert batch_freer(adapter) is adapter
    assert adapter.allocate_batch([first, second], [5, 6], 0, False) == [
        ((1, 2, 3), (4, 5, 6)),
        None,  # 7 blocks asked, 2 left: the pool cannot hold them
    ]
    assert adapter.num_free_blocks() == 2
    adapter.free_batch([second, first, first])
    assert adapter.num_free_blocks() == 8
    assert adapter.block_table("a") == ((), ())


class _NoBatches:
    """An adapter without the optional calls: the machine drives it one request at a time."""

    def __init__(self, inner: ProtocolAdapter) -> None:
        self.inner = inner
        self.name = "no-batches"

    def __getattr__(self, name: str) -> object:
        if name in ("allocate_batch", "free_batch"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _WrongBatch(ProtocolAdapter):
    """Serves a step in reverse order: later requests take the blocks first."""

    def allocate_batch(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> list[BlockIds | None]:
        pairs = list(zip(requests, num_new_tokens, strict=True))[::-1]
        out = [
            self.allocate(r, n, None, num_lookahead_tokens, delay_cache_blocks) for r, n in pairs
        ]
        return out[::-1]


def _backend(wrap: str) -> Backend:
    def factory(
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ManagerAdapter:
        manager = KVCacheManager(
            config,
            max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=events,
            **engine.kwargs(),
        )
        block = hash_block_size_of(config, enable_caching)
        if wrap == "wrong":
            return _WrongBatch("wrong", manager, block, engine.num_hash_lookahead_tokens)
        inner = ProtocolAdapter("x", manager, block, engine.num_hash_lookahead_tokens)
        return _NoBatches(inner)  # type: ignore[return-value]

    return wrap, factory


def test_an_adapter_without_batched_calls_is_driven_one_by_one() -> None:
    stats = run_differential([reference_backend(), _backend("plain")], max_examples=14, steps=30)
    assert stats.batch_steps > 0
    assert stats.batch_frees > 0
    assert stats.batched_calls["plain"] == 0
    assert stats.batched_calls["reference"] == stats.batch_steps + stats.batch_frees


def test_a_wrong_batched_step_is_caught() -> None:
    with pytest.raises(ConformanceError, match="wrong differs from reference"):
        run_differential(
            [reference_backend(), _backend("wrong")], max_examples=150, steps=30, shrink=False
        )


@pytest.mark.skipif(optimized_backend() is None, reason="hybridkv.optimized does not import")
def test_the_optimized_backend_takes_small_thresholds_on_odd_pools() -> None:
    backend = optimized_backend()
    assert backend is not None
    from hybridkv.optimized import thresholds

    adapters = [
        backend[1](_config(num_blocks), 16, True, False, EngineOptions())
        for num_blocks in (9, 17, 10)
    ]
    alone, vectorised, even = (a for a in adapters if isinstance(a, ProtocolAdapter))
    for attribute, value in SMALL_THRESHOLDS.items():
        assert getattr(alone.manager, attribute) == value
        # The production value, from the constants (which the small ones leave unchanged).
        assert getattr(even.manager, attribute) == getattr(thresholds, attribute.upper())
    # A lone busy request: served alone on a pool of 9 blocks (9 // 8 is odd), vectorised on
    # one of 17 (17 // 8 is even); every other threshold the same small one.
    assert getattr(alone.manager, "busy_batch_min") == 2  # noqa: B009 (a protocol's manager)
    assert getattr(vectorised.manager, "busy_batch_min") == 1  # noqa: B009
    assert thresholds_of_pool(17) == {**SMALL_THRESHOLDS, "busy_batch_min": 1}
    assert thresholds_of_pool(9) == SMALL_THRESHOLDS
    assert thresholds_of_pool(10) == {}
    assert SMALL_THRESHOLDS["batch_min"] == 1  # a batch of one request is vectorised too
    assert (thresholds.BATCH_MIN, thresholds.FREE_BATCH_MIN, thresholds.BUSY_BATCH_MIN) == (
        640,
        16,
        64,
    )


def test_the_shares_are_reported() -> None:
    stats = RunStats(lookups=10, cached_lookups=8, hits=2, allocations=20, failed_allocations=5)
    stats.steps = 40
    stats.rules.update({"prefill": 6, "decode": 3, "step_batch": 1, "lookup": 30})
    assert stats.shares() == {"hits": 25.0, "prefill_decode": 25.0, "failed_allocations": 25.0}
    assert (
        "  shares: 25% of lookups with caching on hit (8), 25% of steps prefill or decode, "
        "25% of allocations fail"
    ) in stats.lines()


def test_big_traffic_reaches_serving_sizes() -> None:
    stats = run_differential(
        [reference_backend()], max_examples=7, steps=12, big=True, families=("hybrid",)
    )
    assert stats.examples >= 1
    assert stats.allocations > 0


def test_the_kill_table_counts_each_check_alone() -> None:
    rows = [
        KillRow("a", "spec.rules", (True, True, False, None)),
        KillRow("b", "optimized.batch", (False, False, True, None)),
        KillRow("c", "reference.planner", (None, None, True, None)),
        KillRow("d", "conformance.planted_bugs", (None, None, None, True)),
    ]
    assert kill_table(rows).splitlines() == [
        "| planted bug | in | golden traces | differential machine | oracles | CrossHair |",
        "|---|---|---|---|---|---|",
        "| `a` | `spec.rules` | ✓ | ✓ | ✗ | – |",
        "| `b` | `optimized.batch` | ✗ | ✗ | ✓ | – |",
        "| `c` | `reference.planner` | – | – | ✓ | – |",
        "| `d` | `conformance.planted_bugs` | – | – | – | ✓ |",
        "",
        "Killed alone: golden traces 1/2, differential machine 1/2, oracles 2/3, CrossHair 1/1.",
        "The differential machine alone: 1 of 2 planted mutants (50%), 1 of 4 planted bugs "
        "with CrossHair's contract bugs (25%).",
        "Not caught by the machine alone: b.",
    ]
