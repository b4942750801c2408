"""The policy lab's replay: first-admission hits beside the bound, preemption, time, skips."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridkv.block_trace import BlockTraceRequest, read_block_trace
from hybridkv.lab import CostModel, Replay, ReplayConfig, percentile
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake-synthetic.jsonl"


def _manager(num_blocks: int, block_size: int = 4) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(num_blocks, (KVCacheGroup(("layer",), spec),))
    return KVCacheManager(config, max_model_len=4096)


def _request(rid: str, tokens: Sequence[int]) -> Request:
    return Request(rid, tokens, hash_block_size=4)


def _trace(*lines: tuple[int, int, int, list[int]]) -> list[BlockTraceRequest]:
    return [
        BlockTraceRequest(index, t, length, out, tuple(ids), 8)
        for index, (t, length, out, ids) in enumerate(lines)
    ]


FLAT = ReplayConfig(max_num_batched_tokens=64, cost_model=CostModel(1.0, 0.0, 0.0, 0.0))
"""Every step lasts 1 ms, whatever it computes."""


def test_a_roomy_pool_hits_the_bound_exactly() -> None:
    """Request 1 arrives after request 0 has finished: it hits 0's first block (8 tokens) and
    the whole of its own repeated prompt minus the last block (the last token is computed)."""
    trace = _trace((0, 16, 2, [1, 2]), (50, 16, 2, [1, 3]), (100, 16, 2, [1, 2]))
    result = Replay(_manager(64), trace, _request, block_size=4, config=FLAT).run()
    assert (result.requests, result.finished, result.preemptions) == (3, 3, 0)
    assert (result.hit_tokens, result.bound_hit_tokens, result.prompt_tokens) == (20, 20, 48)
    assert result.hit_rate == result.bound_hit_rate == pytest.approx(20 / 48)


def test_requests_admitted_in_one_step_share_blocks_cached_at_allocation() -> None:
    """Both arrive at 0 ms and are admitted in one step: the first's full blocks are cached
    when they are allocated (as vLLM's ``allocate_slots`` caches them, before the step computes
    them), so the second hits them at once."""
    trace = _trace((0, 16, 2, [1, 2]), (0, 16, 2, [1, 2]))
    result = Replay(_manager(64), trace, _request, block_size=4, config=FLAT).run()
    assert (result.hit_tokens, result.bound_hit_tokens) == (12, 12)
    assert result.steps == 2  # one prefill step for both, one decode step


def test_time_is_the_cost_models_and_ttft_counts_from_arrival() -> None:
    """One request of 8 prompt tokens and 3 output tokens, steps of 2 ms + 0.5 ms per prefill
    token: the prefill step lasts 6 ms (first token at 6 ms), then two decode steps of 2 ms."""
    trace = _trace((10, 8, 3, [5]))
    config = ReplayConfig(max_num_batched_tokens=64, cost_model=CostModel(2.0, 0.5, 0.0, 0.0))
    result = Replay(_manager(64), trace, _request, block_size=4, config=config).run()
    assert result.ttft_ms == [6.0]
    assert result.e2e_ms == [10.0]
    assert result.queue_ms == [0.0]
    assert result.simulated_ms == 20.0
    assert result.output_tokens == 3


def test_readmissions_after_preemption_are_counted_apart() -> None:
    """Two long-decoding requests in a pool too small for both: the later one is preempted,
    re-admitted from its own cached prefix, and that hit is a re-admission's, not a first
    admission's."""
    trace = _trace((0, 8, 12, [1]), (0, 8, 12, [2]))
    result = Replay(_manager(8), trace, _request, block_size=4, config=FLAT).run()
    assert result.preemptions >= 1
    assert result.readmissions == result.preemptions
    assert result.hit_tokens == 0  # nothing was shared at first admission
    assert result.readmission_hit_tokens > 0
    assert result.finished == 2


def test_a_request_longer_than_the_model_is_skipped_and_counted() -> None:
    trace = _trace((0, 8, 2, [1]), (1, 16, 4090, [2, 3]), (2, 8, 2, [1]))
    config = ReplayConfig(max_num_batched_tokens=64, max_model_len=4096)
    result = Replay(_manager(64), trace, _request, block_size=4, config=config).run()
    assert (result.requests, result.skipped, result.finished) == (2, 1, 2)


def test_a_request_larger_than_the_pool_is_refused_and_counted() -> None:
    trace = _trace((0, 64, 2, [1, 2, 3, 4, 5, 6, 7, 8]), (1, 8, 2, [9]))
    result = Replay(_manager(5), trace, _request, block_size=4, config=FLAT).run()
    assert (result.refused, result.finished) == (1, 1)


def test_the_cost_model_from_a_gpu_preset() -> None:
    """5.1 B active parameters, 72 KiB of KV per token, on an H100 (989 TFLOP/s, 3.35 TB/s)."""
    model = CostModel.for_gpu(5.1e9, 72 * 1024, "H100")
    assert model.fixed_ms == pytest.approx(1.0 + 2 * 5.1e9 / 3.35e9)
    assert model.prefill_token_ms == pytest.approx(2 * 5.1e9 / (989e9 * 0.5))
    assert model.context_token_ms == pytest.approx(72 * 1024 / 3.35e9)
    assert model.step_ms(100, 2, 1000) == pytest.approx(
        model.fixed_ms + 100 * model.prefill_token_ms + 0.02 + 1000 * model.context_token_ms
    )
    with pytest.raises(ValueError, match="gpu must be one of"):
        CostModel.for_gpu(1e9, 1, "TPU")
    with pytest.raises(ValueError, match="cost model fixed_ms must be a number >= 0, got -1"):
        CostModel(fixed_ms=-1)


def test_a_window_reads_at_most_its_window() -> None:
    config = ReplayConfig(attention_mix=((0.25, None), (0.75, 128)))
    assert config.attended(1000) == pytest.approx(0.25 * 1000 + 0.75 * 128)
    assert config.attended(100) == pytest.approx(100)


def test_percentiles_interpolate_as_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([], 50) == 0.0
    assert percentile([0, 10], 90) == pytest.approx(9.0)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is not beside")
def test_the_shared_trace_slice_hits_its_bound_when_nothing_is_evicted(tmp_path: Path) -> None:
    """The first 40 requests, a pool that never evicts: every first-admission hit the bound
    counts is found (blocks are cached at allocation, so even a sharer admitted while the
    first is still prefilling finds what the first was given)."""
    lines = SHARED_TRACE.read_text("utf-8").splitlines()[:40]
    path = tmp_path / "slice.jsonl"
    path.write_text("\n".join(lines) + "\n", "utf-8")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype_bytes=2)
    manager = KVCacheManager(
        KVCacheConfig(60_000, (KVCacheGroup(("layer",), spec),)), max_model_len=200_000
    )
    replay = Replay(
        manager,
        read_block_trace(path),
        lambda rid, tokens: Request(rid, tokens, hash_block_size=16),
        block_size=16,
        config=ReplayConfig(max_model_len=200_000),
    )
    result = replay.run()
    assert result.requests == 40
    assert result.preemptions == 0
    assert result.hit_tokens == result.bound_hit_tokens
    assert json.dumps(result.summary())  # every figure is JSON


def test_evictions_count_the_cached_keys_new_tokens_took() -> None:
    """Four usable blocks of 4 tokens: request 0 caches 3 full blocks (12 tokens) and frees
    them; request 1 (other ids) needs 3 blocks: the never-cached free block first, then two
    of request 0's cached blocks, least recently used first (2 evictions). Request 2 repeats
    request 0: only its first block is still cached (a 4-token hit), and its two new blocks
    take two of request 1's (2 more). Of the four evicted keys, request 2 reached request 0's
    two again (past its cached first block): the hits eviction cost."""
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(5, (KVCacheGroup(("layer",), spec),))
    manager = KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True)
    trace = _trace((0, 12, 1, [1, 2]), (50, 12, 1, [3, 4]), (100, 12, 1, [1, 2]))
    replay = Replay(
        manager,
        trace,
        _request,
        block_size=4,
        config=FLAT,
        group_block_sizes=[4],
        events=manager.take_events,
        walked_groups=[True],
    )
    result = replay.run()
    assert (result.evictions, result.hit_tokens, result.group_hit_tokens) == (4, 4, [4])
    assert result.group_reached_again == [2]
    assert result.summary()["group_reached_again"] == [2]


def test_the_bound_counts_every_arrived_request_refused_ones_too() -> None:
    """Two usable 4-token blocks: request 0 (16 tokens) can never run and is refused, yet the
    bound (requests in file order) lets request 1 hit request 0's first block: 4 of the 22
    arrived prompt tokens. The hit rate counts admitted prompts only (6 tokens, none hit)."""
    trace = _trace((0, 16, 1, [1, 2]), (50, 6, 1, [1]))
    result = Replay(_manager(3), trace, _request, block_size=4, config=FLAT).run()
    assert (result.refused, result.prompt_tokens, result.arrived_prompt_tokens) == (1, 6, 22)
    assert (result.hit_tokens, result.bound_hit_tokens) == (0, 4)
    assert result.bound_hit_rate == pytest.approx(4 / 22)


def test_bound_tokens_still_in_flight_at_admission_are_counted_apart() -> None:
    """A Mamba-aligned prefill stops at the last Mamba boundary before the prompt's end (8 of
    16 tokens here), so the identical request admitted in the same step can reach only those
    8 tokens of the 12 the bound gives it: 4 bound tokens were in flight, and a pool that
    evicts nothing hits the bound less exactly those."""
    trace = _trace((0, 16, 2, [1, 2]), (0, 16, 2, [1, 2]))
    result = Replay(
        _manager(64), trace, _request, block_size=4, config=FLAT, mamba_block_size=8
    ).run()
    assert (result.bound_hit_tokens, result.in_flight_bound_tokens, result.hit_tokens) == (12, 4, 8)
    assert result.evictions == 0
    assert result.reachable_bound_hit_rate == pytest.approx(8 / 32)
