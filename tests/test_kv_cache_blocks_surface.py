"""``KVCacheBlocks`` has vLLM's surface; both backends take vLLM's extra allocation settings
(reserved and watermark blocks, tokens in flight, a capped hit, lagging block hashes) and
estimate a request's cached tokens, with the same results and errors."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.invariants import estimate_by_scan
from hybridkv.reference import KVCacheBlocks, KVCacheManager, PrefixCacheStats, Request
from hybridkv.reference.block_hash import hash_full_blocks
from hybridkv.reference.table_invariants import cached_tokens_by_scan
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4)
SLIDING = SlidingWindowSpec(
    block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4, sliding_window=8
)
CONFIG = KVCacheConfig(12, (KVCacheGroup(("full",), FULL), KVCacheGroup(("sw",), SLIDING)))


def test_get_block_ids_selects_groups_and_allows_none() -> None:
    blocks = KVCacheBlocks(((1, 2), ()))
    assert blocks.get_block_ids() == ([1, 2], [])
    assert blocks.get_block_ids(group_ids=[1]) == ([],)
    assert blocks.get_block_ids(allow_none=True, group_ids=[1]) is None
    assert blocks.get_block_ids(allow_none=True) == ([1, 2], [])
    assert (blocks + KVCacheBlocks(((3,), (4,)))).block_ids == ((1, 2, 3), (4,))
    assert blocks.new_empty() == KVCacheBlocks.empty(2)


Manager = KVCacheManager | TorchKVCacheManager
BACKENDS = ["reference", "optimized"]


def make(backend: str) -> Manager:
    if backend == "reference":
        return KVCacheManager(CONFIG, 64)
    return TorchKVCacheManager(CONFIG, 64, max_num_reqs=4)


def error_of(call: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as info:  # noqa: PT011 (the message is compared below)
        call()
    return str(info.value)


def running(manager: Manager, request_id: str = "r") -> Request:
    """A request of 16 tokens, all computed, with a 17th token to schedule; 3 blocks free."""
    request = Request(request_id, list(range(16)), hash_block_size=4)
    assert manager.allocate_slots(request, 16) == KVCacheBlocks(((1, 2, 3, 4), (5, 6, 7, 8)))
    request.num_computed_tokens = 16
    request.append_output_token_ids(16)
    assert manager.num_free_blocks == 3
    return request


@pytest.mark.parametrize("backend", BACKENDS)
def test_reserved_and_watermark_blocks_gate_the_allocation(backend: str) -> None:
    manager = make(backend)
    request = Request("r", list(range(16)), hash_block_size=4)
    # 16 tokens: 4 full-attention blocks + 4 sliding-window blocks; 11 are free.
    assert manager.allocate_slots(request, 16, reserved_blocks=4) is None
    assert manager.allocate_slots(request, 16, watermark_blocks=4) is None
    assert (
        manager.allocate_slots(request, 16, reserved_blocks=4, full_sequence_must_fit=True) is None
    )
    assert manager.num_free_blocks == 11
    assert manager.get_block_ids("r") == ([], [])
    new = manager.allocate_slots(request, 16, reserved_blocks=2, watermark_blocks=1)
    assert new == KVCacheBlocks(((1, 2, 3, 4), (5, 6, 7, 8)))
    assert manager.num_free_blocks == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_sequence_check_keeps_the_watermark_only(backend: str) -> None:
    manager = make(backend)
    request = Request("r", list(range(16)), hash_block_size=4)
    assert (
        manager.allocate_slots(request, 16, watermark_blocks=4, full_sequence_must_fit=True) is None
    )
    # 8 blocks + watermark 3 fit the 11 free; the reserved blocks count in the second check.
    new = manager.allocate_slots(request, 16, watermark_blocks=3, full_sequence_must_fit=True)
    assert new == KVCacheBlocks(((1, 2, 3, 4), (5, 6, 7, 8)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_allocation_under_the_watermark_still_releases_the_window(backend: str) -> None:
    manager = make(backend)
    request = running(manager)
    # Two window blocks leave (5 free), two are needed: 2 + 3 > 5 − 1.
    assert manager.allocate_slots(request, 1, reserved_blocks=1, watermark_blocks=3) is None
    assert manager.num_free_blocks == 5
    assert manager.get_block_ids("r") == ([1, 2, 3, 4], [0, 0, 7, 8])
    new = manager.allocate_slots(request, 1, reserved_blocks=1, watermark_blocks=2)
    assert new == KVCacheBlocks(((9,), (10,)))
    assert manager.num_free_blocks == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reserved_blocks": -1}, "reserved_blocks must be a non-negative int, got -1"),
        ({"watermark_blocks": -2}, "watermark_blocks must be a non-negative int, got -2"),
        ({"reserved_blocks": True}, "reserved_blocks must be a non-negative int, got True"),
        ({"watermark_blocks": 1.5}, "watermark_blocks must be a non-negative int, got 1.5"),
    ],
)
def test_bad_reserved_or_watermark_blocks_change_nothing(
    backend: str, kwargs: dict[str, Any], message: str
) -> None:
    manager = make(backend)
    request = running(manager)
    before = manager.snapshot()
    assert error_of(partial(manager.allocate_slots, request, 1, **kwargs)) == message
    assert manager.snapshot() == before
    assert manager.get_block_ids("r") == ([1, 2, 3, 4], [5, 6, 7, 8])


@pytest.mark.parametrize("backend", BACKENDS)
def test_windows_release_on_the_processed_count(backend: str) -> None:
    manager = make(backend)
    request = running(manager)
    # Async scheduling: 8 of the 16 computed tokens are still in flight, so the window (8
    # tokens) still reads positions 0 and 1.
    vars(request)["num_in_flight_tokens"] = 8
    assert manager.allocate_slots(request, 1) == KVCacheBlocks(((9,), (10,)))
    assert manager.get_block_ids("r") == ([1, 2, 3, 4, 9], [5, 6, 7, 8, 10])
    assert manager.num_free_blocks == 1
    request.num_computed_tokens = 17
    request.append_output_token_ids(17)
    vars(request)["num_in_flight_tokens"] = 1  # 16 processed: tokens 0-8 have left the window
    assert manager.allocate_slots(request, 1) == KVCacheBlocks(((), ()))
    assert manager.get_block_ids("r") == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    assert manager.num_free_blocks == 3
    vars(request)["num_in_flight_tokens"] = 40  # more than computed: nothing is processed
    assert manager.allocate_slots(request, 1) == KVCacheBlocks(((), ()))
    assert manager.get_block_ids("r") == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_cache_hit_length_and_estimate_cached_tokens(backend: str) -> None:
    manager = make(backend)
    first = Request("a", list(range(16)), hash_block_size=4)
    manager.allocate_slots(first, 16)
    assert manager.estimate_cached_tokens("a") == 16
    manager.free(first)
    second = Request("b", list(range(16)), hash_block_size=4)
    blocks, hit, _ = manager.get_computed_blocks(second)
    assert (blocks, hit) == (KVCacheBlocks(((1, 2, 3), (0, 6, 7))), 12)
    blocks, capped, _ = manager.get_computed_blocks(second, max_cache_hit_length=8)
    assert (blocks, capped) == (KVCacheBlocks(((1, 2), (5, 6))), 8)
    assert manager.get_computed_blocks(second, max_cache_hit_length=100)[1] == 12
    assert manager.get_computed_blocks(second, max_cache_hit_length=0)[1] == 0
    before = manager.snapshot()
    message = "max_cache_hit_length must be a non-negative int, got -1"
    assert error_of(partial(manager.get_computed_blocks, second, -1)) == message
    assert manager.snapshot() == before
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()  # lookups alone count nothing
    assert manager.estimate_cached_tokens("unknown") == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_estimate_cached_tokens_is_the_shortest_group(backend: str) -> None:
    manager = make(backend)
    request = Request("r", list(range(14)), hash_block_size=4)
    manager.allocate_slots(request, 14, delay_cache_blocks=True)
    assert manager.estimate_cached_tokens("r") == 0
    manager.cache_blocks(request, 9)
    assert manager.estimate_cached_tokens("r") == 8
    request.num_computed_tokens = 14
    request.append_output_token_ids([14, 15])
    manager.allocate_slots(request, 2)
    assert manager.estimate_cached_tokens("r") == 16
    manager.free(request)
    assert manager.estimate_cached_tokens("r") == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_estimate_cached_tokens_reads_the_blocks_not_the_cached_count(backend: str) -> None:
    """A window that released every block it cached holds no cached prefix, though it still
    counts those positions as cached: vLLM's estimate (a scan of the blocks) is 0."""
    config = KVCacheConfig(32, CONFIG.groups)
    manager: Manager = (
        KVCacheManager(config, 64)
        if backend == "reference"
        else TorchKVCacheManager(config, 64, max_num_reqs=4)
    )
    request = Request("r", list(range(24)), hash_block_size=4)
    manager.allocate_slots(request, 24, delay_cache_blocks=True)
    request.num_computed_tokens = 24
    manager.cache_blocks(request, 8)  # positions 0 and 1 of both groups
    assert manager.estimate_cached_tokens("r") == 8
    request.append_output_token_ids(24)
    manager.allocate_slots(request, 1, delay_cache_blocks=True)  # the window drops 0 … 3
    assert manager.get_block_ids("r") == ([1, 2, 3, 4, 5, 6, 10], [0, 0, 0, 0, 11, 12, 9])
    assert manager.estimate_cached_tokens("r") == 0
    scan = (
        cached_tokens_by_scan(manager.coordinator.get_blocks("r"))
        if isinstance(manager, KVCacheManager)
        else estimate_by_scan(manager.state, "r")
    )
    assert scan == 0
    manager.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_with_fewer_block_hashes_use_their_hashed_blocks(backend: str) -> None:
    manager = make(backend)
    first = Request("a", list(range(16)), hash_block_size=4)
    manager.allocate_slots(first, 16)
    manager.free(first)
    lagging = Request("b", list(range(16)), hash_block_size=4, block_hasher=hash_full_blocks)
    del lagging._block_hashes[2:]  # two of its four full blocks are hashed
    blocks, hit, boundary = manager.get_computed_blocks(lagging)
    assert (blocks, hit, boundary) == (KVCacheBlocks(((1, 2), (5, 6))), 8, 0)
    new = manager.allocate_slots(lagging, 8, hit, blocks, delay_cache_blocks=True)
    assert new == KVCacheBlocks(((9, 10), (11, 4)))
    lagging.num_computed_tokens = 16
    manager.cache_blocks(lagging, 16)  # only the hashed blocks are cached
    assert manager.estimate_cached_tokens("b") == 8
    assert manager.snapshot().num_cached_keys == 7
    lagging.append_output_token_ids(16)  # the missing hashes arrive
    manager.cache_blocks(lagging, 16)
    assert manager.estimate_cached_tokens("b") == 16
    assert manager.snapshot().num_cached_keys == 8
    more = Request("c", list(range(8)), hash_block_size=2)
    message = "request 'c' has 4 block_hashes, expected 2 (hash_block_size must be 4)"
    for call in (
        partial(manager.get_computed_blocks, more),
        partial(manager.allocate_slots, more, 8),
        partial(manager.cache_blocks, more, 8),
    ):
        assert error_of(call) == message


def test_without_prefix_caching_the_coordinator_finds_no_hit() -> None:
    manager = KVCacheManager(CONFIG, 64, enable_caching=False)
    request = Request("r", list(range(16)), hash_block_size=4)
    assert manager.coordinator.find_longest_cache_hit(request.block_hashes, 16) == (([], []), 0, 0)
    assert manager.get_computed_blocks(request) == (KVCacheBlocks.empty(2), 0, 0)
