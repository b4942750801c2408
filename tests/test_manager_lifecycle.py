"""The manager's life cycle: events, statistics, Mamba groups, and a stateful model that runs
the invariant checker after every step; each on both backends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hybridkv.reference import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    PrefixCacheStats,
    Request,
    hash_block_tokens,
)
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from conftest import BackendManager, ManagerFactory

SIZES = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}


def single_group(spec: KVCacheSpec, num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (KVCacheGroup(("layer",), spec),))


def stored(
    block_hashes: tuple[BlockHash, ...],
    parent: BlockHash | None,
    token_ids: tuple[int, ...],
    block_size: int,
    group_idx: int,
) -> BlockStored:
    """A full-attention group's ``BlockStored`` of an unsalted request, as vLLM 0.33 builds it."""
    return BlockStored(
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=(None,) * len(block_hashes) or None,
        group_idx=group_idx,
        kv_cache_spec_kind="full_attention",
    )


def test_events_report_stored_removed_and_cleared_blocks(make_manager: ManagerFactory) -> None:
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 4), max_model_len=16, enable_kv_cache_events=True)
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(a, 5) is not None
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    assert m.take_events() == [stored((h0, h1), None, (1, 2, 3, 4), 2, 0)]
    assert m.take_events() == []
    m.free(a)
    b = Request("b", [9, 9, 9], hash_block_size=2)
    assert m.allocate_slots(b, 3) is not None  # takes 3 (unhashed) then 2, evicting h1
    assert m.take_events() == [
        BlockRemoved((h1,), "GPU", 0),
        stored((hash_block_tokens(None, [9, 9]),), None, (9, 9), 2, 0),
    ]
    m.free(b)
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]


def test_events_are_off_unless_asked_for(make_manager: ManagerFactory) -> None:
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 4), max_model_len=16)
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(a, 5) is not None
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.take_events() == []


def test_a_request_id_used_again_after_free_caches_its_new_blocks(
    make_manager: ManagerFactory,
) -> None:
    """Freeing forgets everything about the request, how many blocks it had cached included:
    a new request with the same id (a readmission) caches its blocks from the first."""
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 8), max_model_len=16)
    first = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(first, 5) is not None
    m.free(first)
    assert m.reset_prefix_cache()
    again = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(again, 5) is not None
    assert m.snapshot().num_cached_keys == 2
    assert m.get_computed_blocks(Request("b", [1, 2, 3, 4, 6], hash_block_size=2))[1] == 4


def test_a_step_within_the_held_blocks_needs_no_free_block(make_manager: ManagerFactory) -> None:
    """With every block held, tokens that fit in the last block's free slots are admitted."""
    spec = FullAttentionSpec(block_size=4, **SIZES)
    m = make_manager(single_group(spec, 3), max_model_len=16)
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=4)
    assert m.allocate_slots(a, 5) is not None
    assert m.num_free_blocks == 0
    a.num_computed_tokens = 5
    a.append_output_token_ids([6, 7])
    assert m.allocate_slots(a, 2) is not None
    assert m.get_block_ids("a") == ([1, 2],)
    a.num_computed_tokens = 7
    a.append_output_token_ids([8, 9])
    assert m.allocate_slots(a, 2) is None
    m.check_invariants()


def test_prefix_cache_stats_count_admissions_since_the_last_report(
    make_manager: ManagerFactory,
) -> None:
    """A lookup alone counts nothing: the scheduler records the lookup that admitted a
    request (vLLM looks a waiting request up at every step until it fits)."""
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 8), max_model_len=16)
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.get_computed_blocks(a)[1] == 0
    assert m.allocate_slots(a, 5) is not None
    m.record_prefix_cache_stats(a, 0)
    b = Request("b", [1, 2, 3, 4, 7], hash_block_size=2)
    assert m.get_computed_blocks(b)[1] == 4
    assert m.get_computed_blocks(b)[1] == 4
    assert m.prefix_cache_stats == PrefixCacheStats(requests=1, queries=5, hits=0)
    m.record_prefix_cache_stats(b, 4)
    assert m.make_prefix_cache_stats() == PrefixCacheStats(requests=2, queries=10, hits=4)
    assert m.make_prefix_cache_stats() == PrefixCacheStats()


def test_prefix_cache_stats_count_a_preempted_request_apart(
    make_manager: ManagerFactory,
) -> None:
    """A request readmitted after a preemption (``num_preemptions > 0``) counts in the
    ``preempted_*`` fields, as vLLM reports it, not as new traffic."""
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 8), max_model_len=16)
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(a, 5) is not None
    m.record_prefix_cache_stats(a, 0)
    m.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    blocks, hits, _ = m.get_computed_blocks(a)
    assert hits == 4
    assert m.allocate_slots(a, 1, hits, blocks) is not None
    m.record_prefix_cache_stats(a, hits)
    assert m.make_prefix_cache_stats() == PrefixCacheStats(
        requests=1,
        queries=5,
        hits=0,
        preempted_requests=1,
        preempted_queries=5,
        preempted_hits=4,
    )


def test_prefix_cache_stats_are_off_with_log_stats_off_and_skip_uncached_lookups(
    make_manager: ManagerFactory,
) -> None:
    """``log_stats=False`` reports ``None``; a request that skips reading the cache is not
    counted (it made no lookup)."""
    spec = FullAttentionSpec(block_size=2, **SIZES)
    quiet = make_manager(single_group(spec, 8), max_model_len=16, log_stats=False)
    a = Request("a", [1, 2, 3], hash_block_size=2)
    quiet.record_prefix_cache_stats(a, 0)
    assert quiet.prefix_cache_stats is None
    assert quiet.make_prefix_cache_stats() is None
    m = make_manager(single_group(spec, 8), max_model_len=16)
    skipping = Request("s", [1, 2, 3], hash_block_size=2, skip_reading_prefix_cache=True)
    assert not m.prefix_cache_lookup_enabled(skipping)
    m.record_prefix_cache_stats(skipping, 0)
    assert m.make_prefix_cache_stats() == PrefixCacheStats()


def test_recording_an_impossible_hit_count_is_refused_by_name(
    make_manager: ManagerFactory,
) -> None:
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 8), max_model_len=16)
    a = Request("a", [1, 2, 3], hash_block_size=2)
    with pytest.raises(
        ValueError, match=r"num_hits must be an int in \[0, 3\) for request 'a', got 3"
    ):
        m.record_prefix_cache_stats(a, 3)
    assert m.make_prefix_cache_stats() == PrefixCacheStats()
    with pytest.raises(ValueError, match="log_stats must be a bool, got 'yes'"):
        make_manager(single_group(spec, 8), max_model_len=16, log_stats="yes")  # type: ignore[arg-type]


def test_prefix_cache_stats_mark_a_reset_and_keep_counting_across_it(
    make_manager: ManagerFactory,
) -> None:
    """A reset is reported with the counts of the interval it falls in, admissions before and
    after it alike; the next interval starts unmarked."""
    spec = FullAttentionSpec(block_size=2, **SIZES)
    m = make_manager(single_group(spec, 8), max_model_len=16)
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(a, 5) is not None
    b = Request("b", [1, 2, 3, 4, 7], hash_block_size=2)
    assert m.get_computed_blocks(b)[1] == 4
    m.record_prefix_cache_stats(b, 4)
    m.free(a)
    assert m.reset_prefix_cache()
    c = Request("c", [1, 2, 3], hash_block_size=2)
    assert m.get_computed_blocks(c)[1] == 0
    m.record_prefix_cache_stats(c, 0)
    assert m.make_prefix_cache_stats() == PrefixCacheStats(
        requests=2, queries=8, hits=4, reset=True
    )
    assert m.make_prefix_cache_stats() == PrefixCacheStats()


def test_a_mamba_block_spanning_max_model_len_is_one_state_block_per_request(
    make_manager: ManagerFactory,
) -> None:
    """Allocation, Case 4: without prefix caching an engine gives the Mamba block
    ``max_model_len`` tokens, so the group keeps one block whatever the length."""
    attention = FullAttentionSpec(block_size=4, **SIZES)
    mamba = MambaSpec(block_size=64, state_bytes=16)
    config = KVCacheConfig(
        12, (KVCacheGroup(("attn",), attention), KVCacheGroup(("mamba",), mamba))
    )
    m = make_manager(config, max_model_len=64, enable_caching=False)
    r = Request("r", list(range(9)), hash_block_size=64)
    assert m.allocate_slots(r, 9) is not None
    r.num_computed_tokens = 9
    assert m.get_block_ids("r") == ([1, 2, 3], [4])
    for token in range(9, 14):
        r.append_output_token_ids(token)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert m.get_block_ids("r") == ([1, 2, 3, 5], [4])
    m.free(r)
    assert m.num_free_blocks == 11


def test_a_small_mamba_block_keeps_only_the_state_of_the_last_computed_token(
    make_manager: ManagerFactory,
) -> None:
    """With a Mamba block smaller than the request, ``"none"`` mode behaves like a window of
    one token: each allocation releases the states before the block of the last computed
    token (position 2 holds tokens 8–11, so after 9 tokens positions 0 and 1 go)."""
    attention = FullAttentionSpec(block_size=4, **SIZES)
    mamba = MambaSpec(block_size=4, state_bytes=16)
    config = KVCacheConfig(
        12, (KVCacheGroup(("attn",), attention), KVCacheGroup(("mamba",), mamba))
    )
    m = make_manager(config, max_model_len=64, enable_caching=False)
    r = Request("r", list(range(9)), hash_block_size=4)
    assert m.allocate_slots(r, 9) is not None
    assert m.get_block_ids("r") == ([1, 2, 3], [4, 5, 6])
    r.num_computed_tokens = 9
    r.append_output_token_ids(9)
    assert m.allocate_slots(r, 1) is not None
    assert m.get_block_ids("r") == ([1, 2, 3], [0, 0, 6])
    assert m.num_free_blocks == 11 - 4
    m.check_invariants()


def all_kinds_of_groups() -> st.SearchStrategy[tuple[KVCacheSpec, ...]]:
    block_size = st.sampled_from([1, 2, 4])

    def specs(b: int) -> st.SearchStrategy[tuple[KVCacheSpec, ...]]:
        one = st.one_of(
            st.just(FullAttentionSpec(block_size=b, **SIZES)),
            st.integers(2, 12).map(
                lambda w: SlidingWindowSpec(block_size=b, sliding_window=w, **SIZES)
            ),
            st.integers(1, 12).map(
                lambda c: ChunkedLocalAttentionSpec(block_size=b, attention_chunk_size=c, **SIZES)
            ),
        )
        return st.lists(one, min_size=1, max_size=3).map(tuple)

    return block_size.flatmap(specs)


class ManagerLifecycle(RuleBasedStateMachine):
    """A scheduler's calls in any order; the invariants hold after each, and a failed
    allocation leaves the pool as it was apart from window releases."""

    def __init__(self, make_manager: ManagerFactory) -> None:
        super().__init__()
        self.make_manager = make_manager
        self.m: BackendManager

    @initialize(
        specs=all_kinds_of_groups(),
        num_blocks=st.integers(2, 24),
        enable_caching=st.booleans(),
    )
    def setup(self, specs: tuple[KVCacheSpec, ...], num_blocks: int, enable_caching: bool) -> None:
        groups = tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(specs))
        self.block_size = specs[0].block_size
        self.m = self.make_manager(
            KVCacheConfig(num_blocks, groups), max_model_len=40, enable_caching=enable_caching
        )
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.next_id = 0

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    )
    def add(self, prefix: list[int], tail: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = Request(rid, prefix + tail, hash_block_size=self.block_size)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), use_hit=st.booleans())
    def admit(self, data: st.DataObject, use_hit: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        request = self.waiting[rid]
        hit, num_hit, _ = self.m.get_computed_blocks(request)
        if not use_hit:
            hit, num_hit = None, 0  # type: ignore[assignment]
        n = request.num_tokens - num_hit
        before = self.m.snapshot()
        if self.m.allocate_slots(request, n, num_hit, hit) is None:
            assert self.m.snapshot() == before
            return
        request.num_computed_tokens = request.num_tokens
        self.running[rid] = self.waiting.pop(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[rid]
        if request.num_tokens >= 39:
            return
        request.append_output_token_ids(token)
        if self.m.allocate_slots(request, 1) is not None:
            request.num_computed_tokens += 1

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data: st.DataObject, preempt: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        self.m.free(request)
        if preempt:
            request.num_computed_tokens = 0
            self.waiting[rid] = request

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.m.reset_prefix_cache() == (
            self.m.num_free_blocks == self.m.config.num_blocks - 1
        )

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "m"):
            self.m.check_invariants()
            assert 0.0 <= self.m.usage <= 1.0

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for request in self.running.values():
            self.m.free(request)
        assert self.m.num_free_blocks == self.m.config.num_blocks - 1
        assert self.m.reset_prefix_cache()


LIFECYCLE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_manager_lifecycle(make_manager: ManagerFactory) -> None:
    """``ManagerLifecycle`` on the backend under test (the same settings for both)."""
    # Hypothesis types this helper only in recent releases: call it through Any.
    run: Any = run_state_machine_as_test
    run(lambda: ManagerLifecycle(make_manager), settings=LIFECYCLE_SETTINGS)
