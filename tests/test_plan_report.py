"""The plan report: padding, per-request bounds, capacity, and the cost of a non-hybrid plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.reference.plan_report import GroupPlan, max_blocks_per_request, plan_report
from hybridkv.reference.planner import plan_groups, plan_kv_cache
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

GiB = 1 << 30
ATTENTION = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}
FULL = FullAttentionSpec(**ATTENTION)  # kv_hidden_size 4096, layer page 65536
SW = SlidingWindowSpec(**ATTENTION, sliding_window=32)


def model(
    pattern: Sequence[KVCacheSpec], prefixes: dict[KVCacheSpec, str]
) -> dict[str, KVCacheSpec]:
    """Layers in model order, named ``<type>.<index within its type>`` (full.0, sw.0, ...)."""
    layers: dict[str, KVCacheSpec] = {}
    for spec in pattern:
        prefix = prefixes[spec]
        layers[f"{prefix}.{sum(n.startswith(prefix + '.') for n in layers)}"] = spec
    return layers


def case2_model() -> dict[str, KVCacheSpec]:
    """Allocation, Case 2: 10 full + 20 sliding layers (block 16, window 32)."""
    return model([SW, SW, FULL] * 10, {FULL: "full", SW: "sw"})


GEMMA3_FULL = FullAttentionSpec(block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2)
GEMMA3_SW = SlidingWindowSpec(
    block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2, sliding_window=1024
)


def gemma3_27b() -> dict[str, KVCacheSpec]:
    """62 layers; layer i is full iff (i + 1) % 6 == 0: 52 sliding + 10 full."""
    pattern = [GEMMA3_FULL if (i + 1) % 6 == 0 else GEMMA3_SW for i in range(62)]
    return model(pattern, {GEMMA3_FULL: "full", GEMMA3_SW: "sw"})


# --- The document's Case 2 model ----------------------------------------------------------------


def test_case2_report_groups() -> None:
    report = plan_report(case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16)
    assert [(g.group_id, g.kind, g.num_own_layers, g.num_padding_slots) for g in report.groups] == [
        (0, "full", 10, 0),
        (1, "sliding_window", 10, 0),
        (2, "sliding_window", 10, 0),
    ]
    assert report.groups[2].layer_names == tuple(f"sw.{i}" for i in range(10, 20))
    assert report.groups[1].spec == SW
    assert report.config == plan_kv_cache(case2_model(), GiB)


def test_case2_report_sizes() -> None:
    report = plan_report(case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16)
    assert report.layers_per_group == 10
    assert report.block_size == 16
    assert report.layer_page_size_bytes == 65536
    assert report.page_size_bytes == 10 * 4096 * 16 == 655360
    assert report.num_blocks == 1638
    assert report.memory_bytes == 1638 * 655360 == 1_073_479_680
    assert report.num_padding_slots == 0
    assert report.padding_fraction == 0.0


def test_case2_report_request_bounds() -> None:
    report = plan_report(case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16)
    # Full: cdiv(112, 16) = 7. Sliding: the 31 tokens before a 16-token step and the step,
    # cdiv(min(31 + 16, 112), 16) = 3, plus one for a step that starts mid-block = 4.
    assert [g.max_blocks_per_request for g in report.groups] == [7, 4, 4]
    assert report.blocks_per_request == 15
    assert report.max_num_requests == (1638 - 1) // 15 == 109
    assert report.max_tokens == 109 * 112 == 12208
    assert report.bytes_per_request == 15 * 655360


def test_case2_report_against_full_attention() -> None:
    report = plan_report(case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16)
    assert (report.max_model_len, report.max_num_batched_tokens) == (112, 16)
    assert report.full_attention_bytes_per_token == 30 * 4096
    # Every one of the 30 layers keeps 7 blocks of 65536 bytes.
    assert report.full_attention_bytes_per_request == 30 * 7 * 65536 == 13_762_560
    assert report.full_attention_memory_bytes == 109 * 13_762_560
    assert report.memory_saved_bytes == 109 * (13_762_560 - 15 * 655360) == 428_605_440
    assert report.full_attention_max_num_requests == 1637 * 655360 // 13_762_560 == 77


# --- Gemma-3-27b (Case 3) -----------------------------------------------------------------------


def test_gemma3_27b_report_padding_wastes_8_of_70_slots() -> None:
    report = plan_report(gemma3_27b(), 40 * GiB, max_model_len=8192, max_num_batched_tokens=2048)
    assert len(report.groups) == 7
    assert report.groups[6].layer_names == ("sw.50", "sw.51")
    assert report.groups[6].num_padding_slots == 8
    assert [g.num_padding_slots for g in report.groups[:6]] == [0] * 6
    assert report.num_padding_slots == 8
    assert report.padding_fraction == 8 / 70


def test_gemma3_27b_report_capacity() -> None:
    report = plan_report(gemma3_27b(), 40 * GiB, max_model_len=8192, max_num_batched_tokens=2048)
    assert report.page_size_bytes == 10 * 16 * 8192 == 1_310_720
    assert report.num_blocks == 40 * GiB // 1_310_720 == 32768
    # Full: 8192 / 16 = 512. Sliding: cdiv(1023 + 2048, 16) + 1 = 193, in 6 groups.
    assert [g.max_blocks_per_request for g in report.groups] == [512] + [193] * 6
    assert report.blocks_per_request == 1670
    assert report.max_num_requests == 32767 // 1670 == 19
    assert report.max_tokens == 19 * 8192
    assert report.full_attention_bytes_per_token == 62 * 8192
    assert report.full_attention_bytes_per_request == 62 * 512 * 131072
    assert report.full_attention_max_num_requests == 32767 * 1_310_720 // (62 * 512 * 131072) == 10
    assert report.memory_saved_bytes == 19 * (62 * 512 * 131072 - 1670 * 1_310_720)


# --- Case 4 and Case 5 --------------------------------------------------------------------------


def test_jamba_like_report_raised_block_and_one_state_block_per_mamba_group() -> None:
    mamba = MambaSpec(block_size=16, state_bytes=1_000_000)
    layers = model([FULL if i % 8 == 4 else mamba for i in range(32)], {FULL: "attn", mamba: "m"})
    report = plan_report(layers, GiB, max_model_len=8192, max_num_batched_tokens=2048)
    assert report.block_size == 256
    assert report.layer_page_size_bytes == 256 * 4096 == 1_048_576
    assert [(g.kind, g.max_blocks_per_request) for g in report.groups] == [
        ("full", 8192 // 256)
    ] + [("mamba", 1)] * 7
    assert report.num_blocks == GiB // (4 * 1_048_576) == 256
    assert report.max_num_requests == 255 // 39 == 6
    # Mamba states do not grow with the request.
    assert report.full_attention_bytes_per_token == 4 * 4096
    # Nothing forgets tokens here, so a non-hybrid manager needs the same memory.
    assert report.memory_saved_bytes == 0


def test_gemma3n_like_report_counts_readers_apart() -> None:
    layers: dict[str, KVCacheSpec] = {f"layers.{i}": FULL if i % 5 == 4 else SW for i in range(30)}
    sharing = {f"layers.{i}": "layers.19" if i % 5 == 4 else "layers.18" for i in range(20, 30)}
    report = plan_report(
        layers, GiB, max_model_len=4096, max_num_batched_tokens=512, kv_sharing=sharing
    )
    assert [(g.num_own_layers, g.num_kv_sharing_layers) for g in report.groups] == [
        (4, 2),
        (4, 0),
        (4, 0),
        (4, 0),
        (4, 8),
    ]
    assert report.num_padding_slots == 0
    # Readers hold no KV: 20 own attention layers.
    assert report.full_attention_bytes_per_token == 20 * 4096


def test_full_attention_only_model_saves_nothing() -> None:
    layers: dict[str, KVCacheSpec] = {f"layers.{i}": FULL for i in range(32)}
    report = plan_report(layers, GiB, max_model_len=4096, max_num_batched_tokens=512)
    assert report.memory_saved_bytes == 0
    assert report.full_attention_max_num_requests == report.max_num_requests == 511 // 256 == 1


def test_no_request_of_max_model_len_fits() -> None:
    report = plan_report(case2_model(), 10 * 655360, max_model_len=112, max_num_batched_tokens=16)
    assert report.num_blocks == 10
    assert report.max_num_requests == 0
    assert report.max_tokens == 0
    assert report.memory_saved_bytes == 0


# --- Per-group bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (FULL, 7),  # cdiv(112, 16)
        (SW, 4),  # cdiv(min(31 + 16, 112), 16) + 1
        (replace(SW, sliding_window=1024), 8),  # cdiv(min(1039, 112), 16) + 1
        (ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=32), 3),  # cdiv(48, 16)
        (ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=8192), 7),  # cdiv(112, 16)
        (MambaSpec(block_size=16, state_bytes=100), 1),
    ],
)
def test_max_blocks_per_request_per_attention_type(spec: KVCacheSpec, expected: int) -> None:
    assert max_blocks_per_request(spec, 112, 16) == expected


# --- Bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_model_len", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, 2.5, None])
def test_non_positive_lengths_are_rejected(field: str, value: Any) -> None:
    lengths: dict[str, Any] = {"max_model_len": 112, "max_num_batched_tokens": 16, field: value}
    with pytest.raises(ValueError, match=rf"^{field} must be a positive int, got {value!r}$"):
        plan_report(case2_model(), GiB, **lengths)


def test_planner_errors_pass_through() -> None:
    with pytest.raises(ValueError, match=r"^available_memory_bytes is too small for one block"):
        plan_report(case2_model(), 100, max_model_len=112, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=r"^layers must name at least one layer"):
        plan_report({}, GiB, max_model_len=112, max_num_batched_tokens=16)


def test_reports_are_frozen() -> None:
    report = plan_report(case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16)
    with pytest.raises(AttributeError):
        report.num_blocks = 3  # type: ignore[misc]
    group: GroupPlan = report.groups[0]
    with pytest.raises(AttributeError):
        group.kind = "mamba"  # type: ignore[misc]


# --- Properties ---------------------------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn) -> dict[str, KVCacheSpec]:
    """Up to three attention types of one page, maybe Mamba, in random order."""
    base = {"block_size": draw(st.sampled_from([1, 16])), "num_kv_heads": 8, "head_size": 64}
    palette: list[KVCacheSpec] = [
        FullAttentionSpec(**base, dtype_bytes=2),
        SlidingWindowSpec(**base, dtype_bytes=2, sliding_window=draw(st.integers(1, 4096))),
        ChunkedLocalAttentionSpec(**base, dtype_bytes=2, attention_chunk_size=1024),
        MambaSpec(block_size=1, state_bytes=draw(st.integers(1, 1 << 20))),
    ]
    types = draw(st.lists(st.sampled_from(palette), min_size=1, max_size=4, unique=True))
    pattern = draw(st.permutations([s for s in types for _ in range(draw(st.integers(1, 16)))]))
    return {f"layers.{i}": spec for i, spec in enumerate(pattern)}


@settings(max_examples=100, deadline=None)
@given(models(), st.integers(1, 1 << 16), st.integers(1, 1 << 12), st.data())
def test_report_is_consistent_with_its_config(
    layers: dict[str, KVCacheSpec], max_model_len: int, batched: int, data: st.DataObject
) -> None:
    groups = plan_groups(layers)
    layers_per_group = max(len(g.layer_names) for g in groups)
    block_bytes = layers_per_group * groups[0].spec.page_size_bytes
    memory = data.draw(st.integers(2 * block_bytes, max(1 << 36, 2 * block_bytes)))
    report = plan_report(
        layers, memory, max_model_len=max_model_len, max_num_batched_tokens=batched
    )
    config = report.config
    assert report.memory_bytes == sum(t.size for t in config.tensors) <= memory
    assert report.layers_per_group == len(config.tensors)
    assert report.num_padding_slots == sum(g.num_padding_slots for g in report.groups)
    slots = len(report.groups) * report.layers_per_group
    assert report.padding_fraction == report.num_padding_slots / slots
    assert [g.layer_names for g in report.groups] == [g.layer_names for g in config.groups]
    assert all(
        g.num_own_layers + g.num_padding_slots == report.layers_per_group for g in report.groups
    )
    requests = report.max_num_requests
    assert requests * report.blocks_per_request <= report.num_blocks - 1
    assert (requests + 1) * report.blocks_per_request > report.num_blocks - 1
    assert report.max_tokens == requests * max_model_len
    assert (
        report.full_attention_max_num_requests * report.full_attention_bytes_per_request
        <= (report.num_blocks - 1) * report.page_size_bytes
    )


# --- Capacity edges -----------------------------------------------------------------------------


def test_case2_report_max_concurrency_is_blocks_over_blocks_per_request() -> None:
    report = plan_report(case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16)
    assert report.max_concurrency == 1638 / 15


def test_jamba_like_report_with_prefix_caching_holds_two_state_blocks() -> None:
    mamba = MambaSpec(block_size=16, state_bytes=1_000_000)
    layers = model([FULL if i % 8 == 4 else mamba for i in range(32)], {FULL: "attn", mamba: "m"})
    report = plan_report(
        layers, GiB, max_model_len=8192, max_num_batched_tokens=2048, enable_prefix_caching=True
    )
    assert [g.max_blocks_per_request for g in report.groups] == [32] + [2] * 7
    assert report.blocks_per_request == 32 + 14
    assert report.enable_prefix_caching is True


def test_two_pipeline_stages_count_the_slots_of_both() -> None:
    """Case 2's model over two stages (layers 0–14 and 15–29): the first sliding group lives
    on stage 0, the second on stage 1, full attention half on each; every stage's tensors
    hold 10 slots per group, so each group has 20 slots for its 10 own layers."""
    report = plan_report(
        case2_model(), GiB, max_model_len=112, max_num_batched_tokens=16, pipeline_parallel_size=2
    )
    assert [(g.num_own_layers, g.num_padding_slots) for g in report.groups] == [(10, 10)] * 3
    assert report.num_padding_slots == 30
    assert report.padding_fraction == 30 / 60
    assert report.pipeline_parallel_size == 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    memory_blocks=st.integers(1, 40),
    max_model_len=st.integers(1, 300),
    batched=st.sampled_from([1, 16, 48]),
    window=st.sampled_from([16, 32, 40]),
)
def test_max_fitting_model_len_is_the_longest_length_whose_request_fits(
    memory_blocks: int, max_model_len: int, batched: int, window: int
) -> None:
    """vLLM's auto-fit, by brute force: the longest length up to ``max_model_len`` whose one
    request fits in every block but the null block (0 when not even one token fits)."""
    sw = SlidingWindowSpec(**ATTENTION, sliding_window=window)
    layers = model([FULL, sw, sw], {FULL: "full", sw: "sw"})
    page = 65536  # one layer per group, one block of 16 tokens of 4096 bytes
    report = plan_report(
        layers,
        memory_blocks * 2 * page,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
    )
    usable = report.num_blocks - 1

    def blocks(length: int) -> int:
        return sum(max_blocks_per_request(g.spec, length, batched) for g in report.groups)

    fitting = [n for n in range(1, max_model_len + 1) if blocks(n) <= usable]
    assert report.max_fitting_model_len == (max(fitting) if fitting else 0)
