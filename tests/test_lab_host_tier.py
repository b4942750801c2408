"""The host tier: its two accountings of a key, LRU, what a hit needs, and a replay using it."""

from __future__ import annotations

import pytest

from hybridkv.block_trace import BlockTraceRequest
from hybridkv.lab import CostModel, Replay, ReplayConfig, ReplayResult
from hybridkv.lab.host_tier import FULL, STATE, GroupNeed, HostTier, key_bytes
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import BlockRemoved, BlockStored
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

FULL_AND_WINDOW = (GroupNeed(FULL, 100), GroupNeed(2, 300))
"""A full-attention group of 100-byte blocks and a 2-block window of 300-byte blocks."""


def _trace(index: int, length: int, ids: list[int]) -> BlockTraceRequest:
    return BlockTraceRequest(index, 0, length, 1, tuple(ids), 8)


def _replay(
    manager: KVCacheManager, trace: list[BlockTraceRequest], host: HostTier, num_groups: int
) -> ReplayResult:
    """``trace`` through ``manager`` over ``host``: 4-token blocks, one step per ms."""
    return Replay(
        manager,
        trace,
        lambda rid, tokens: Request(rid, tokens, hash_block_size=4),
        block_size=4,
        config=ReplayConfig(max_num_batched_tokens=64, cost_model=CostModel(1.0, 0, 0, 0)),
        group_block_sizes=[4] * num_groups,
        events=manager.take_events,
        host=host,
    ).run()


def test_vllms_accounting_charges_every_key_a_chunk_of_all_groups_pages() -> None:
    assert key_bytes("vllm", FULL_AND_WINDOW) == (400, 400)
    assert key_bytes("hybrid", FULL_AND_WINDOW) == (100, 300)
    with pytest.raises(ValueError, match="host accounting must be one of"):
        key_bytes("lmcache", FULL_AND_WINDOW)


@pytest.mark.parametrize(("accounting", "kept"), [("vllm", 3), ("hybrid", 12)])
def test_equal_host_bytes_hold_more_keys_hybrid_aware(accounting: str, kept: int) -> None:
    """1,200 bytes of full-group keys: vLLM's chunks of 400 hold 3, own pages of 100 hold 12;
    the LRU keeps the last ones stored."""
    host = HostTier(1200, FULL_AND_WINDOW, accounting=accounting, block_size=4)
    for token in range(100, 114):
        host.store((token, 0))
    assert list(host.keys) == [(token, 0) for token in range(114 - kept, 114)]
    assert host.used_bytes == 1200


def test_the_lru_head_leaves_first_and_a_hit_moves_its_keys_to_the_tail() -> None:
    """Blocks of 4 tokens of ids [1, 2] end at tokens 11, 15, 19: stored 19 first, then the
    hit touches 11, 15, 19 in order, so 11 is the head when 99 needs room."""
    host = HostTier(300, (GroupNeed(FULL, 100),), block_size=4)
    trace = _trace(0, 13, [1, 2])
    for token in (19, 11, 15):
        host.store((token, 0))
    assert host.hit_tokens(trace, 0) == 12  # blocks 0-2; block 3 holds the last token
    host.store((99, 0))
    assert list(host.keys) == [(15, 0), (19, 0), (99, 0)]


def test_a_full_attention_chain_stops_at_its_first_missing_block() -> None:
    host = HostTier(10_000, (GroupNeed(FULL, 100),), block_size=4)
    trace = _trace(0, 16, [1, 2])
    host.store((11, 0))
    host.store((19, 0))  # block 1 (ending at 15) missing
    assert host.hit_tokens(trace, 0) == 4
    assert host.hit_tokens(trace, 4) == 0


def test_a_window_needs_its_last_blocks_and_a_state_only_its_end() -> None:
    """Hit end after block 2 (12 tokens): the full group needs blocks 0-2, the 2-block window
    blocks 1-2, the Mamba group block 2 only."""
    needs = (GroupNeed(FULL, 1), GroupNeed(2, 1), GroupNeed(STATE, 1))
    host = HostTier(10_000, needs, block_size=4)
    trace = _trace(0, 16, [1, 2])
    for token in (11, 15, 19):
        host.store((token, 0))
    host.store((19, 2))
    host.store((15, 1))
    assert host.hit_tokens(trace, 0) == 0  # the window lacks block 2
    host.store((19, 1))
    assert host.hit_tokens(trace, 0) == 12


def test_a_replay_moves_evicted_blocks_to_the_host_and_hits_them() -> None:
    """Four usable 4-token blocks, 14-token requests (13 prompt, 1 output): request 1 takes
    all four, evicting request 0's three cached blocks to the host; request 2 repeats request
    0, misses on the GPU and finds those three blocks (12 tokens, the bound) on the host."""
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(5, (KVCacheGroup(("layer",), spec),))
    manager = KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True)
    host = HostTier(1 << 20, (GroupNeed(FULL, spec.page_size_bytes),), block_size=4)
    trace = [
        BlockTraceRequest(i, t, 13, 1, tuple(ids), 8)
        for i, (t, ids) in enumerate(((0, [1, 2]), (50, [3, 4]), (100, [1, 2])))
    ]
    result = _replay(manager, trace, host, num_groups=1)
    assert (result.hit_tokens, result.host_hit_tokens, result.bound_hit_tokens) == (0, 12, 12)
    assert result.host_hit_rate == pytest.approx(12 / 39)


@pytest.mark.parametrize(
    ("accounting", "stored", "at_end"),
    [
        ("hybrid", [(11, 1), (15, 1), (15, 2), (23, 1), (23, 2)], [(27, 1), (31, 1), (31, 2)]),
        ("vllm", [], []),
    ],
)
def test_the_hybrid_aware_tier_writes_each_trace_boundarys_window_as_it_is_computed(
    accounting: str, stored: list[tuple[int, int]], at_end: list[tuple[int, int]]
) -> None:
    """Trace blocks of 8 tokens, ids [1, 2, 3]: computing tokens 0-16 crosses the boundaries
    at 8 and 16, whose last manager blocks are 1 (ending at token 1×8+7 = 15) and 3 (ending at
    23). The 2-block window stores blocks 0-1 and 2-3 but block 2 (token 19), which the GPU
    holds cached; the Mamba group stores the states 15 and 23; the full-attention group nothing
    (the GPU evicts it to the host). vLLM's accounting stores only what the pool evicts."""
    needs = (GroupNeed(FULL, 1), GroupNeed(2, 1), GroupNeed(STATE, 1))
    host = HostTier(10_000, needs, accounting=accounting, block_size=4)
    host.observe(
        [BlockStored((BlockHash(b"h"),), None, tuple(range(16, 20)), 4, None, None, None, None, 1)]
    )
    trace = _trace(0, 24, [1, 2, 3])
    host.computed(trace, 0, 17)
    assert sorted(host.keys) == stored
    host.computed(trace, 17, 23)  # the boundary at 24 not yet computed
    assert sorted(host.keys) == stored
    host.computed(trace, 23, 24)  # the prompt's end: blocks 4-5 end at tokens 27 and 31
    assert sorted(host.keys) == sorted(stored + at_end)


def test_a_block_the_gpu_still_caches_counts_as_held_for_a_host_hit() -> None:
    """The GPU holds the full-attention chain (tokens 11, 15, 19) but not the window; the
    host's window blocks 1-2 complete a 12-token hit. Evicted, the chain's keys move to the
    host's keys and no longer to the GPU's."""
    host = HostTier(10_000, FULL_AND_WINDOW, block_size=4)
    hashes = (BlockHash(b"a"), BlockHash(b"b"), BlockHash(b"c"))
    stored = BlockStored(hashes, None, (0, 0, 0, 11, 0, 0, 0, 15, 0, 0, 0, 19), 4, None, None, None)
    host.observe([stored])
    assert host.gpu_keys == {(11, 0), (15, 0), (19, 0)}
    trace = _trace(0, 16, [1, 2])
    assert host.hit_tokens(trace, 0) == 0  # the window is on neither tier
    host.store((15, 1))
    host.store((19, 1))
    assert host.hit_tokens(trace, 0) == 12
    host.observe([BlockRemoved(hashes, None, None)])
    assert host.gpu_keys == set()
    assert list(host.keys)[-3:] == [(11, 0), (15, 0), (19, 0)]


@pytest.mark.parametrize(("accounting", "host_hit"), [("hybrid", 8), ("vllm", 0)])
def test_under_sparse_retention_only_the_hybrid_aware_tier_holds_a_mid_prompt_window(
    accounting: str, host_hit: int
) -> None:
    """Full + 4-token sliding window, 4-token blocks, sparse retention (the engine's default):
    request 0 ([1, 2]) leaves its full-attention chain and only its final window cached. Request
    1 ([1, 5]) shares the first trace block (8 tokens, the bound) but the GPU lacks the window
    ending there; the hybrid-aware tier wrote it while request 0 computed it."""
    sizes = {"num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
    full = FullAttentionSpec(block_size=4, **sizes)
    window = SlidingWindowSpec(block_size=4, sliding_window=4, **sizes)
    groups = (KVCacheGroup(("f",), full), KVCacheGroup(("w",), window))
    config = KVCacheConfig(40, groups, prefix_cache_retention_interval=0)
    manager = KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True)
    needs = (GroupNeed(FULL, full.page_size_bytes), GroupNeed(2, window.page_size_bytes))
    host = HostTier(1 << 20, needs, accounting=accounting, block_size=4)
    trace = [
        BlockTraceRequest(i, t, 16, 1, tuple(ids), 8)
        for i, (t, ids) in enumerate(((0, [1, 2]), (50, [1, 5])))
    ]
    result = _replay(manager, trace, host, num_groups=2)
    assert (result.hit_tokens, result.host_hit_tokens, result.bound_hit_tokens) == (0, host_hit, 8)
    assert host.unnamed == 0  # the sparse window runs named by the step's requests


def test_a_chunked_group_reads_only_its_own_chunks_blocks() -> None:
    """Chunks of 8 tokens, blocks of 4: a hit ending after block 2 (12 tokens) reads block 2,
    the start of its chunk; one ending after block 1 (8 tokens, a chunk's end) reads none."""
    chunked = GroupNeed(2, 1, chunk_tokens=8)
    assert [chunked.first_block(k, 4) for k in range(4)] == [0, 2, 2, 4]
    host = HostTier(10_000, (GroupNeed(FULL, 1), chunked), block_size=4)
    trace = _trace(0, 20, [1, 2, 3])
    for token in (11, 15, 19):  # the full-attention chain of blocks 0-2
        host.store((token, 0))
    assert host.hit_tokens(trace, 0) == 8  # ends after block 1: the chunk needs nothing
    host.store((19, 1))
    assert host.hit_tokens(trace, 0) == 12


def test_a_sliding_window_needs_the_blocks_of_its_hit_rule() -> None:
    """A 5-token window over 4-token blocks reads ``cdiv(4, 4) = 1`` block before a hit's end
    (``rules.sliding_window_hit_blocks_needed``), as the replay's tier is built."""
    window = GroupNeed(1, 1)
    assert [window.first_block(k, 4) for k in range(3)] == [0, 1, 2]
    assert GroupNeed(STATE, 1).first_block(5, 4) == 5
