"""Grouping policies: vLLM 0.33's planning tests with its exact expected groups, the policies
side by side on the issue's layouts, and the min-padding oracle (brute force over every group
size and both assignments, on random and catalogue models, with pipeline stages).

The expected values of the ``"vllm"`` cases are copied as literals from vLLM 0.33's
``tests/v1/core/test_kv_cache_planning.py`` and ``test_kv_cache_utils.py`` (specs from
``tests/v1/core/utils.py``: 2 KV heads × 64 × fp32, block 16, window 1); vLLM is not needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.catalogue import load_catalogue
from hybridkv.model_layers import model_layers
from hybridkv.reference import plan_report
from hybridkv.reference.grouping import GROUPING_POLICIES
from hybridkv.reference.planner import plan_groups, plan_kv_cache
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

VLLM_KV = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype_bytes": 4}
FULL = FullAttentionSpec(**VLLM_KV)
SW = SlidingWindowSpec(**VLLM_KV, sliding_window=1)
PAGE = FULL.page_size_bytes  # vLLM's mem_per_block_per_layer: 16 × 2 × 64 × 4 × 2 = 16,384


def vllm_layers(*specs: KVCacheSpec) -> dict[str, KVCacheSpec]:
    """``layer_1``, ``layer_2``, … as vLLM's tests name them."""
    return {f"layer_{i}": spec for i, spec in enumerate(specs, start=1)}


def group_names(layers: Mapping[str, KVCacheSpec], **kw: object) -> list[list[str]]:
    return [list(group.layer_names) for group in plan_groups(layers, policy="vllm", **kw)]  # type: ignore[arg-type]


# --- vLLM 0.33's test_get_kv_cache_config_one_worker ----------------------------------------


def test_vllm_one_full_one_sliding_two_groups_of_one() -> None:
    layers = vllm_layers(FULL, SW)
    assert group_names(layers) == [["layer_1"], ["layer_2"]]
    config = plan_kv_cache(layers, PAGE * 2 * 32, policy="vllm")
    assert config.num_blocks == 64
    assert [t.shared_by for t in config.tensors] == [("layer_1", "layer_2")]


def test_vllm_two_full_four_sliding_strided_pairs() -> None:
    layers = vllm_layers(FULL, FULL, SW, SW, SW, SW)
    expected = [["layer_1", "layer_2"], ["layer_3", "layer_5"], ["layer_4", "layer_6"]]
    assert group_names(layers) == expected
    assert plan_kv_cache(layers, PAGE * 2 * 32, policy="vllm").num_blocks == 32


def test_vllm_three_full_seven_sliding_pads_to_nine() -> None:
    layers = vllm_layers(FULL, FULL, FULL, *[SW] * 7)
    assert group_names(layers) == [
        ["layer_1", "layer_2", "layer_3"],
        ["layer_4", "layer_7", "layer_10"],
        ["layer_5", "layer_8"],
        ["layer_6", "layer_9"],
    ]
    config = plan_kv_cache(layers, PAGE * 3 * 32, policy="vllm")
    assert config.num_blocks == 32
    assert [t.shared_by for t in config.tensors] == [
        ("layer_1", "layer_4", "layer_5", "layer_6"),
        ("layer_2", "layer_7", "layer_8", "layer_9"),
        ("layer_3", "layer_10"),
    ]


def test_vllm_six_full_five_sliding_one_padding_slot() -> None:
    """gpt-oss + EAGLE's shape: 6 < 1.5 × 5, so groups of 6, not 5."""
    layers = vllm_layers(*[FULL] * 6, *[SW] * 5)
    assert group_names(layers) == [
        ["layer_1", "layer_2", "layer_3", "layer_4", "layer_5", "layer_6"],
        ["layer_7", "layer_8", "layer_9", "layer_10", "layer_11"],
    ]
    assert plan_kv_cache(layers, PAGE * 6 * 32, policy="vllm").num_blocks == 32


def test_vllm_all_full_or_all_sliding_is_one_group() -> None:
    for spec in (FULL, SW):
        assert group_names(vllm_layers(spec, spec)) == [["layer_1", "layer_2"]]
        assert plan_kv_cache(vllm_layers(spec, spec), PAGE * 2 * 32, policy="vllm").num_blocks == 32


# --- vLLM 0.33's test_get_kv_cache_configs_multiple_workers / _pp_sharding -------------------


def test_vllm_pipeline_stages_group_across_workers() -> None:
    """Worker 0: layer1 full, layer2–3 sliding; worker 1: layer4 full, layer5–6 sliding."""
    layers = vllm_layers(FULL, SW, SW, FULL, SW, SW)
    stages = {"layer_1": 0, "layer_2": 0, "layer_3": 0, "layer_4": 1, "layer_5": 1, "layer_6": 1}
    kw = {"pipeline_parallel_size": 2, "layer_stages": stages}
    expected = [["layer_1", "layer_4"], ["layer_2", "layer_5"], ["layer_3", "layer_6"]]
    assert group_names(layers, **kw) == expected
    config = plan_kv_cache(layers, PAGE * 10, policy="vllm", **kw)  # type: ignore[arg-type]
    assert config.num_blocks == 10
    # each worker: one tensor shared by its layer of every group
    assert [t.shared_by for t in config.tensors] == [
        ("layer_1", "layer_2", "layer_3"),
        ("layer_4", "layer_5", "layer_6"),
    ]


def test_vllm_pipeline_stages_of_different_types() -> None:
    """Worker 0 holds the two full layers, worker 1 the two sliding ones."""
    layers = vllm_layers(FULL, FULL, SW, SW)
    config = plan_kv_cache(layers, PAGE * 2 * 10, policy="vllm", pipeline_parallel_size=2)
    expected = [["layer_1", "layer_2"], ["layer_3", "layer_4"]]
    assert [list(g.layer_names) for g in config.groups] == expected
    assert config.num_blocks == 10


def test_vllm_pp_sharding_one_layer_per_worker() -> None:
    layers = vllm_layers(FULL, FULL)
    config = plan_kv_cache(layers, PAGE * 33, policy="vllm", pipeline_parallel_size=2)
    assert [list(g.layer_names) for g in config.groups] == [["layer_1", "layer_2"]]
    assert config.num_blocks == 512 // 16 + 1


# --- vLLM 0.33's max concurrency and auto-fit tests -----------------------------------------


QWEN_KV = {"block_size": 16, "num_kv_heads": 32, "head_size": 128, "dtype_bytes": 2}
QWEN_FULL = FullAttentionSpec(**QWEN_KV)
QWEN_SW = SlidingWindowSpec(**QWEN_KV, sliding_window=1024)


@pytest.mark.parametrize(
    ("specs", "num_blocks", "concurrency"),
    [
        ([QWEN_FULL] * 32, int(1024 * 1.5), 1.5),
        ([QWEN_SW] * 32, 129 * 3, 3.0),
        ([QWEN_FULL] * 32 + [QWEN_SW] * 32, (1024 + 129) * 3, 3.0),
    ],
    ids=["full", "sliding", "hybrid"],
)
def test_vllm_max_concurrency(
    specs: list[KVCacheSpec], num_blocks: int, concurrency: float
) -> None:
    """test_get_max_concurrency_for_kv_cache_config: 16,384 tokens, 1,024 per step, sync."""
    layers = {f"layer_{i}": spec for i, spec in enumerate(specs)}
    memory = num_blocks * 32 * QWEN_FULL.page_size_bytes
    report = plan_report(
        layers, memory, max_model_len=16384, max_num_batched_tokens=1024, policy="vllm"
    )
    assert report.num_blocks == num_blocks
    assert report.max_concurrency == concurrency


def test_vllm_auto_fit_reserves_the_null_block() -> None:
    """test_auto_fit_max_model_len_reserves_null_block: 64 blocks → 63 × 16 tokens."""
    report = plan_report(
        {"layer1": FULL}, PAGE * 64, max_model_len=1024, max_num_batched_tokens=8192
    )
    assert report.max_num_requests == 0
    assert report.max_fitting_model_len == 63 * 16


def test_vllm_auto_fit_keeps_a_length_that_fits() -> None:
    """test_auto_fit_max_model_len: with plenty of memory the length stays 1024."""
    layers = {"layer_1": FULL, "layer_2": FULL}
    report = plan_report(layers, PAGE * 2 * 1024, max_model_len=1024, max_num_batched_tokens=8192)
    assert report.max_fitting_model_len == 1024


# --- The rules vLLM's planning follows -------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "size"),
    [([10, 52], 10), ([13, 12], 13), ([6, 5], 6), ([3, 7], 3), ([2, 3], 2), ([4, 5], 5)],
)
def test_vllm_group_size_takes_the_largest_count_under_one_and_a_half_times(
    counts: list[int], size: int
) -> None:
    assert rules.vllm_group_size(counts) == size


def test_strided_indices_spread_a_type_over_its_groups() -> None:
    assert rules.strided_layer_indices(7, 3) == ((0, 3, 6), (1, 4), (2, 5))
    assert rules.strided_layer_indices(52, 10) == tuple(tuple(range(i, 52, 6)) for i in range(6))


@pytest.mark.parametrize(
    ("layers", "pp", "sizes"),
    [(62, 2, (31, 31)), (61, 4, (15, 15, 16, 15)), (26, 4, (6, 7, 7, 6)), (5, 3, (2, 2, 1))],
)
def test_pipeline_stage_sizes_are_vllms(layers: int, pp: int, sizes: tuple[int, ...]) -> None:
    assert rules.pipeline_stage_sizes(layers, pp) == sizes


def test_vllm_orders_groups_by_each_types_first_layer() -> None:
    """Gemma-3's first layer slides: vLLM's group 0 is sliding, the document's is full."""
    layers = {f"l{i}": FULL if (i + 1) % 6 == 0 else SW for i in range(12)}
    assert [type(g.spec) for g in plan_groups(layers, policy="vllm")][:2] == [
        SlidingWindowSpec,
        SlidingWindowSpec,
    ]
    assert type(plan_groups(layers)[0].spec) is FullAttentionSpec


def test_unknown_policy_names_the_value() -> None:
    message = "policy must be one of document, vllm, min-padding, got 'gcd'"
    with pytest.raises(ValueError, match=message):
        plan_groups({"a": FULL}, policy="gcd")  # type: ignore[arg-type]


def test_pipeline_size_larger_than_the_model_is_refused() -> None:
    message = r"pipeline_parallel_size must be at most the number of layers \(2\), got 3"
    with pytest.raises(ValueError, match=message):
        plan_groups({"a": FULL, "b": FULL}, pipeline_parallel_size=3)


def test_layer_stages_must_cover_every_layer_and_stage() -> None:
    with pytest.raises(ValueError, match=r"layer_stages\['b'\] must be an int stage, got None"):
        plan_groups({"a": FULL, "b": FULL}, pipeline_parallel_size=2, layer_stages={"a": 0})
    with pytest.raises(ValueError, match="stage 1 has none"):
        plan_groups({"a": FULL, "b": FULL}, pipeline_parallel_size=2, layer_stages={"a": 0, "b": 0})


# --- The three policies on the layouts ----------------------------------------------


def test_six_full_five_sliding_under_each_policy() -> None:
    """The document: 3 groups, 4 padding slots, 38 blocks; vLLM: 2 groups, 1 slot, 32 blocks
    of 6 pages; min-padding: 11 groups of one layer, no padding, 192 one-page blocks."""
    layers = vllm_layers(*[FULL] * 6, *[SW] * 5)
    found = {
        policy: plan_report(
            layers, PAGE * 6 * 32, max_model_len=16, max_num_batched_tokens=8192, policy=policy
        )
        for policy in GROUPING_POLICIES
    }
    summary = {p: (len(r.groups), r.num_padding_slots, r.num_blocks) for p, r in found.items()}
    assert summary == {"document": (3, 4, 38), "vllm": (2, 1, 32), "min-padding": (11, 0, 192)}
    assert [r.max_concurrency for r in found.values()] == [38 / 4, 32 / 3, 192 / 16]


def test_gemma_3_27b_under_two_pipeline_stages_strided_gets_twice_the_blocks() -> None:
    entry = next(e for e in load_catalogue() if e.model_id == "google/gemma-3-27b-it")
    layers = model_layers(entry.facts, block_size=16, kv_dtype_bytes=2).layers
    blocks = {
        policy: plan_kv_cache(layers, 40 << 30, policy=policy, pipeline_parallel_size=2).num_blocks
        for policy in GROUPING_POLICIES
    }
    assert blocks == {"document": 32768, "vllm": 65536, "min-padding": 327680}


# --- The min-padding oracle: brute force over every group size and assignment ----------------


def realized_slots(groups: Sequence[Sequence[str]], stages: Mapping[str, int]) -> tuple[int, int]:
    """(groups × the most layers of one group on one stage, groups), counted from the groups."""
    widest = max(
        sum(1 for name in group if stages[name] == stage)
        for group in groups
        for stage in set(stages.values())
    )
    return len(groups) * widest, len(groups)


def brute_force_groupings(
    types: Sequence[Sequence[str]],
) -> list[list[list[str]]]:
    """Every common group size g, each type cut strided and consecutively."""
    largest = max(len(names) for names in types)
    found = []
    for size in range(1, largest + 1):
        strided, consecutive = [], []
        for names in types:
            k = -(-len(names) // size)
            strided += [list(names[i::k]) for i in range(k)]
            consecutive += [list(names[i : i + size]) for i in range(0, len(names), size)]
        found += [strided, consecutive]
    return found


def check_min_padding_is_optimal(
    layers: Mapping[str, KVCacheSpec],
    pipeline_parallel_size: int,
    memory: int,
    kv_sharing: Mapping[str, str] | None = None,
) -> None:
    sharing = kv_sharing or {}
    config = plan_kv_cache(
        layers,
        memory,
        kv_sharing=sharing,
        policy="min-padding",
        pipeline_parallel_size=pipeline_parallel_size,
    )
    sizes = rules.pipeline_stage_sizes(len(layers), pipeline_parallel_size)
    stage_of = [stage for stage, size in enumerate(sizes) for _ in range(size)]
    stages = dict(zip(layers, stage_of, strict=True))
    own = [[n for n in g.layer_names if n not in sharing] for g in config.groups]
    chosen = realized_slots(own, stages)
    page = config.groups[0].spec.page_size_bytes
    assert config.num_blocks == memory // (chosen[0] // chosen[1] * page)
    types: dict[object, set[str]] = {}
    for group, names in zip(config.groups, own, strict=True):
        types.setdefault(group.spec, set()).update(names)
    in_model_order = [[n for n in layers if n in names] for names in types.values()]
    for grouping in brute_force_groupings(in_model_order):
        assert chosen <= realized_slots(grouping, stages), grouping


KINDS: list[KVCacheSpec] = [
    FullAttentionSpec(**VLLM_KV),
    SlidingWindowSpec(**VLLM_KV, sliding_window=64),
    ChunkedLocalAttentionSpec(**VLLM_KV, attention_chunk_size=128),
    MambaSpec(block_size=16, state_bytes=50_000),
]


@settings(max_examples=150, deadline=None)
@given(
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    pp=st.integers(1, 4),
)
def test_min_padding_is_optimal_on_random_models(pattern: list[int], pp: int) -> None:
    layers = {f"layers.{i}": KINDS[kind] for i, kind in enumerate(pattern)}
    if pp > len(layers):
        pp = len(layers)
    check_min_padding_is_optimal(layers, pp, 1 << 34)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_min_padding_is_optimal_on_every_catalogue_model(pp: int) -> None:
    for entry in load_catalogue():
        modelled = model_layers(entry.facts, block_size=16, kv_dtype_bytes=2)
        check_min_padding_is_optimal(modelled.layers, pp, 40 << 30, modelled.kv_sharing)


def test_min_padding_never_has_fewer_tokens_per_block_than_the_others() -> None:
    """Slots per block: min-padding ≤ vLLM's and the document's, on every catalogue model."""
    for entry in load_catalogue():
        modelled = model_layers(entry.facts, block_size=16, kv_dtype_bytes=2)
        for pp in (1, 2):
            reports = {
                policy: plan_report(
                    modelled.layers,
                    80 << 30,
                    max_model_len=8192,
                    max_num_batched_tokens=8192,
                    kv_sharing=modelled.kv_sharing,
                    policy=policy,
                    pipeline_parallel_size=pp,
                )
                for policy in GROUPING_POLICIES
            }
            slots = {p: len(r.groups) * r.layers_per_group for p, r in reports.items()}
            assert slots["min-padding"] <= min(slots.values()), (entry.model_id, pp, slots)
