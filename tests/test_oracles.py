"""Brute force against the clever algorithms: the longest hit and the planner.

The design document claims that the hybrid coordinator returns the longest hit every attention
type accepts. The oracles try every candidate length and check each group's rule directly,
over random cache states with three or more types, with and without full attention, first over
the rule functions, then inside the real reference manager.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.conformance import oracles
from hybridkv.conformance.adapters import (
    EngineOptions,
    Lookup,
    ProtocolAdapter,
    hash_block_size_of,
    reference_backend,
)
from hybridkv.conformance.harnesses import (
    block_pool_operations_keep_invariants,
    hybrid_hit_is_longest_accepted,
    hybrid_hit_without_full_attention,
)
from hybridkv.conformance.oracles import GroupCacheState, random_cache_state, run_adapter_hit_oracle
from hybridkv.conformance.strategies import document_models, random_models
from hybridkv.reference import (
    KVCacheManager,
    Request,
    plan_groups,
    plan_kv_cache,
    plan_report,
)
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)

SIZES = {"block_size": 2, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}

FAST = settings(max_examples=300, derandomize=True, deadline=None, database=None)
LONG = os.environ.get("HYBRIDKV_LONG") == "1"


@st.composite
def cache_states(
    draw: st.DrawFn, min_types: int = 3, full: bool | None = None, aligned: bool = True
) -> tuple[list[GroupCacheState], int, int]:
    """Groups of at least ``min_types`` attention types with random cached flags."""
    block_size = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, 40))
    num_blocks = num_tokens // block_size
    kinds = ["sliding_window", "chunked_local"] + ([] if full is False else ["full"])
    chosen = draw(st.lists(st.sampled_from(kinds), min_size=min_types, max_size=5))
    if full:
        chosen.append("full")
    groups = []
    for kind in chosen:
        if kind == "chunked_local":
            multiple = st.integers(1, 4).map(lambda k: k * block_size)
            param = draw(multiple if aligned else st.integers(1, 12))
        else:
            param = draw(st.integers(2, 14))
        cached = draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks))
        groups.append(GroupCacheState(kind, param, tuple(cached)))  # type: ignore[arg-type]
    return groups, num_tokens, block_size


@FAST
@given(cache_states(min_types=3, full=True))
def test_fixed_point_is_the_longest_accepted_hit_with_full_attention(
    case: tuple[list[GroupCacheState], int, int],
) -> None:
    groups, num_tokens, block_size = case
    best = oracles.brute_force_hit_blocks(groups, num_tokens, block_size)
    assert oracles.hybrid_hit_tokens(groups, num_tokens, block_size) == best * block_size


@FAST
@given(cache_states(min_types=3, full=False, aligned=False))
def test_fixed_point_is_the_longest_accepted_hit_without_full_attention(
    case: tuple[list[GroupCacheState], int, int],
) -> None:
    groups, num_tokens, block_size = case
    best = oracles.brute_force_hit_blocks(groups, num_tokens, block_size)
    assert oracles.hybrid_hit_tokens(groups, num_tokens, block_size) == best * block_size


def test_one_pass_is_not_enough_for_three_types() -> None:
    """Why the coordinator repeats: one pass over full + window + chunk can stop too long."""
    groups = [
        GroupCacheState("full", 0, (True, True, True)),
        GroupCacheState("sliding_window", 2, (False, True, True)),
        GroupCacheState("chunked_local", 3, (True, False, True)),
    ]
    # Full attention allows 2 tokens; the window (2) then allows 2; the chunk (3) lowers to 1;
    # but at 1 the window needs block 0, which it lacks: only a second pass finds 0.
    assert oracles.brute_force_hit_blocks(groups, 3, 1) == 0
    assert oracles.hybrid_hit_tokens(groups, 3, 1) == 0
    assert oracles.hybrid_hit_tokens(groups, 3, 1, iterate=False) == 1


@FAST
@given(cache_states(min_types=1))
def test_the_reference_manager_returns_the_longest_accepted_hit_and_its_blocks(
    case: tuple[list[GroupCacheState], int, int],
) -> None:
    """Built cache states inside a real ``KVCacheManager``: hit length and every group's blocks
    (a sliding window's are those of a lookup at the final length, not a truncated longer one)."""
    groups, num_tokens, block_size = case
    prompt = list(range(100, 100 + num_tokens))
    hit = oracles.reference_hit(groups, prompt, block_size)
    assert hit.hit_tokens == hit.brute_force_tokens
    assert hit.block_ids == hit.expected_block_ids


@FAST
@given(cache_states(min_types=3, full=False))
def test_the_reference_manager_without_full_attention(
    case: tuple[list[GroupCacheState], int, int],
) -> None:
    groups, num_tokens, block_size = case
    hit = oracles.reference_hit(groups, list(range(num_tokens)), block_size)
    assert (hit.hit_tokens, hit.block_ids) == (hit.brute_force_tokens, hit.expected_block_ids)


@FAST
@given(cache_states(min_types=1, aligned=False))
def test_chunks_not_a_multiple_of_the_block_size_never_lose_a_hit(
    case: tuple[list[GroupCacheState], int, int],
) -> None:
    """With a chunk size that is not a multiple of the block size, vLLM (and so the reference,
    pinned by the golden traces) stops after one lookup for one group or for full attention +
    one other type, and may return a hit longer than the chunk rule accepts. It never returns a
    shorter one, and every layout that iterates to the fixed point matches brute force."""
    groups, num_tokens, block_size = case
    hit = oracles.reference_hit(groups, list(range(num_tokens)), block_size)
    assert hit.hit_tokens >= hit.brute_force_tokens
    types = {g.type_key for g in groups}
    one_pass = len(groups) == 1 or (len(types) == 2 and any(g.kind == "full" for g in groups))
    if not one_pass:
        assert hit.hit_tokens == hit.brute_force_tokens


def test_a_known_chunk_case_where_one_pass_returns_a_longer_hit() -> None:
    """Full attention + a 5-token chunk over 2-token blocks: the reference returns 4 tokens with
    both chunk positions null, though token 4's chunk starts at token 0 (its KV is not cached)."""
    groups = [
        GroupCacheState("full", 0, (True, True, True, False, True)),
        GroupCacheState("chunked_local", 5, (True, False, False, False, False)),
    ]
    hit = oracles.reference_hit(groups, list(range(11)), 2)
    assert hit.hit_tokens == 4
    assert hit.block_ids[1] == (0, 0)
    assert hit.brute_force_tokens == 2


def test_admitting_the_one_pass_chunk_hit_holds_its_nulls_and_touches_its_blocks() -> None:
    """The same case through admission: the chunked group's table starts with the two null
    positions the lookup returned; the blocks after them (full attention's two) gain a holder
    and leave the free queue; freeing returns every one of them."""
    block_size, prompt = 2, list(range(11))
    config = KVCacheConfig(
        num_blocks=12,
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(**SIZES)),
            KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(attention_chunk_size=5, **SIZES)),
        ),
    )
    manager = KVCacheManager(config, 16)
    request = Request("r", prompt, hash_block_size=block_size)
    pool = manager.block_pool
    for group_id, cached in enumerate([(1, 1, 1, 0, 1), (1, 0, 0, 0, 0)]):
        table = [pool.get_new_blocks(1)[0] if flag else pool.null_block for flag in cached]
        pool.cache_full_blocks(
            request,
            table,
            num_cached_blocks=0,
            num_full_blocks=5,
            block_size=block_size,
            group_id=group_id,
        )
        pool.free_blocks(table[::-1])
    hit, num_hit_tokens, _ = manager.get_computed_blocks(request)
    assert (num_hit_tokens, hit.get_block_ids()) == (4, ([1, 2], [0, 0]))
    assert manager.allocate_slots(request, 7, num_hit_tokens, hit) is not None
    manager.check_invariants()
    full_table, chunk_table = manager.get_block_ids("r")
    assert full_table[:2] == [1, 2]
    assert chunk_table[:2] == [0, 0]
    assert manager.snapshot().ref_counts[1] == manager.snapshot().ref_counts[2] == 1
    manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 11


def test_the_harnesses_hold_exhaustively_on_a_small_domain() -> None:
    """What CrossHair searches symbolically, enumerated for block size 1 and 4 tokens."""
    for num_tokens in range(1, 5):
        flags = list(itertools.product([False, True], repeat=num_tokens))
        for a, b, c in itertools.product(flags, repeat=3):
            for window, chunk in itertools.product(range(2, 5), range(1, 5)):
                assert hybrid_hit_is_longest_accepted(
                    list(a), list(b), list(c), 1, window, chunk, num_tokens
                )
                assert hybrid_hit_without_full_attention(
                    list(a), list(b), list(c), 1, window, window + 1, chunk, num_tokens
                )


def test_the_block_pool_harness_holds_for_every_short_program() -> None:
    for length in range(4):
        for ops in itertools.product(range(0, 32, 3), repeat=length):
            assert block_pool_operations_keep_invariants(list(ops))


# --- The planner -----------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(4))
def test_the_document_models_obey_cases_1_to_5(index: int) -> None:
    layers, sharing = document_models()[index]
    config = plan_kv_cache(layers, 10**9, kv_sharing=sharing)
    assert oracles.check_grouping(layers, config.groups, sharing) == []
    assert oracles.check_memory_layout(config, 10**9, sharing) == []
    report = plan_report(
        layers, 10**9, max_model_len=4096, max_num_batched_tokens=512, kv_sharing=sharing
    )
    assert (
        oracles.check_plan_padding(
            layers,
            [g.num_padding_slots for g in report.groups],
            [g.num_own_layers for g in report.groups],
            report.num_padding_slots,
            report.layers_per_group,
            sharing,
        )
        == []
    )


def test_random_models_obey_cases_1_to_5() -> None:
    stats = oracles.run_planner_oracle(20_000 if LONG else 400)
    assert stats.failures == []
    assert stats.planner_models > 300


def test_gemma_3_has_seven_groups_and_eight_padding_slots() -> None:
    layers, _ = document_models()[1]
    groups = plan_groups(layers)
    assert len(groups) == 7
    assert sum(10 - len(g.layer_names) for g in groups) == 8


def test_the_grouping_oracle_rejects_broken_groupings() -> None:
    """The oracle itself has teeth: each broken grouping is reported."""
    sizes = {"block_size": 16, "num_kv_heads": 2, "head_size": 4, "dtype_bytes": 2}
    full = FullAttentionSpec(**sizes)
    sliding = SlidingWindowSpec(sliding_window=32, **sizes)
    layers: dict[str, KVCacheSpec] = {
        "f0": full,
        "f1": full,
        "s0": sliding,
        "s1": sliding,
        "s2": sliding,
        "s3": sliding,
    }
    good = (
        KVCacheGroup(("f0", "f1"), full),
        KVCacheGroup(("s0", "s1"), sliding),
        KVCacheGroup(("s2", "s3"), sliding),
    )
    assert oracles.check_grouping(layers, good) == []
    broken = [
        (KVCacheGroup(("f0", "f1"), full), KVCacheGroup(("s0", "s1", "s2", "s3"), sliding)),
        (KVCacheGroup(("s0", "s1"), sliding), KVCacheGroup(("s2", "s3"), sliding), good[0]),
        (KVCacheGroup(("f0", "f1"), full), KVCacheGroup(("s0", "s2"), sliding), good[2]),
        (KVCacheGroup(("f0", "s0"), full), KVCacheGroup(("f1", "s1"), sliding), good[2]),
        (good[0], good[1]),
        (good[0], good[1], good[2], KVCacheGroup(("s3",), sliding)),
    ]
    for groups in broken:
        assert oracles.check_grouping(layers, groups) != [], groups


def test_oracle_runs_for_the_report() -> None:
    stats = oracles.run_hit_oracle(200_000 if LONG else 1_500, seed=1)
    assert stats.failures == []
    assert stats.hit_states_three_types > 100
    assert stats.hit_states_without_full > 100


def test_random_cache_states_cover_every_shape() -> None:
    rng = random.Random(0)
    shapes = {len({g.type_key for g in random_cache_state(rng)[0]}) for _ in range(200)}
    assert {1, 2, 3} <= shapes
    assert random_models(random.Random(0), 5)


# --- Engine layouts: Mamba "align" and groups of different block sizes ----------------------


def _mamba(cached: tuple[bool, ...], size: int = 2) -> oracles.EngineGroupState:
    return oracles.EngineGroupState("mamba", 0, size, cached)


def test_brute_force_takes_a_mamba_hit_only_where_its_state_is_cached() -> None:
    full = oracles.EngineGroupState("full", 0, 2, (True, True, True, True))
    # The state after 4 tokens is cached, the one after 8 is not: the hit is 4, not 6 or 8.
    groups = [full, _mamba((False, True, False, False))]
    assert oracles.brute_force_engine_hit(groups, 9) == 4
    assert oracles.brute_force_engine_hit([_mamba((False, False, True, True))], 9) == 8
    assert oracles.brute_force_engine_hit([full, _mamba((False,) * 4)], 9) == 0


def test_brute_force_hits_land_on_the_lcm_of_the_block_sizes() -> None:
    small = oracles.EngineGroupState("full", 0, 2, (True,) * 6)
    large = oracles.EngineGroupState("full", 0, 4, (True,) * 3)
    assert oracles.brute_force_engine_hit([small, large], 11) == 8  # 10 is no multiple of 4
    window = oracles.EngineGroupState("sliding_window", 3, 4, (False, True, True))
    assert oracles.brute_force_engine_hit([small, window], 13) == 12


def test_the_reference_hit_equals_brute_force_on_engine_layouts() -> None:
    stats = oracles.run_engine_hit_oracle(1200 if LONG else 300)
    print("\n".join(stats.lines()))
    assert not stats.failures, stats.failures[:3]
    assert stats.with_mamba > 100
    assert stats.mixed_block_sizes > 100
    assert stats.hits > 50


def test_a_mamba_hit_one_block_off_is_caught_by_the_engine_oracle() -> None:
    """A lookup that takes the state after the previous block (a plausible off-by-one)."""
    from hybridkv.reference import single_type_managers

    original = single_type_managers.MambaManager.find_longest_cache_hit

    def off_by_one(self: Any, *args: Any, **kwargs: Any) -> Any:
        hits, length = original(self, *args, **kwargs)
        return hits, max(0, length - self.block_size) if length else 0

    single_type_managers.MambaManager.find_longest_cache_hit = off_by_one  # type: ignore[method-assign]
    try:
        stats = oracles.run_engine_hit_oracle(100)
    finally:
        single_type_managers.MambaManager.find_longest_cache_hit = original  # type: ignore[method-assign]
    assert stats.failures


def test_the_adapter_oracle_builds_states_through_the_adapter_and_finds_the_longest_hit() -> None:
    stats = run_adapter_hit_oracle("reference", reference_backend()[1], 60, seed=3)
    assert (stats.states, stats.probes, stats.failures) == (60, 180, [])
    assert stats.hits > 60
    assert stats.three_types > 10


class _DropsLastHitBlock(ProtocolAdapter):
    def lookup(self, request: Request) -> Lookup:
        found = super().lookup(request)
        ids = tuple(group[:-1] for group in found.block_ids)
        return Lookup(ids, found.num_hit_tokens, found.handle, found.shared_prefix_boundary)


class _MissesEveryHit(ProtocolAdapter):
    def lookup(self, request: Request) -> Lookup:
        found = super().lookup(request)
        return Lookup(tuple(() for _ in found.block_ids), 0, None, 0)


@pytest.mark.parametrize(
    ("cls", "words"),
    [(_DropsLastHitBlock, "blocks for a"), (_MissesEveryHit, "hit 0 tokens, brute force")],
)
def test_the_adapter_oracle_catches_a_wrong_hit(cls: type[ProtocolAdapter], words: str) -> None:
    def factory(
        config: KVCacheConfig,
        max_model_len: int,
        caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ProtocolAdapter:
        manager = KVCacheManager(config, max_model_len, enable_caching=caching)
        return cls("wrong", manager, hash_block_size_of(config, caching))

    stats = run_adapter_hit_oracle("wrong", factory, 30, seed=3)
    assert len(stats.failures) == stats.hits > 0
    assert all(f.startswith("wrong: longest hit of a ") and words in f for f in stats.failures)


def test_an_adapter_that_raises_is_a_failure_naming_the_state() -> None:
    def factory(
        config: KVCacheConfig,
        max_model_len: int,
        caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ProtocolAdapter:
        raise RuntimeError("no pool")

    stats = run_adapter_hit_oracle("broken", factory, 2, seed=5)
    assert stats.failures == [
        "broken: state 0 (seed 5) raised RuntimeError: no pool",
        "broken: state 1 (seed 5) raised RuntimeError: no pool",
    ]
