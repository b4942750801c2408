"""The planner (document: "Allocation" Cases 1–5 and "Memory Layout"): examples first, then errors,
then properties over random hybrid models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.reference.planner import own_layer_names, plan_groups, plan_kv_cache
from hybridkv.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

GiB = 1 << 30
ATTENTION = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}
FULL = FullAttentionSpec(**ATTENTION)  # kv_hidden_size 4096, layer page 65536
SW = SlidingWindowSpec(**ATTENTION, sliding_window=32)


def by_type(
    pattern: Sequence[KVCacheSpec], names: Mapping[KVCacheSpec, str]
) -> dict[str, KVCacheSpec]:
    """A model in layer order, each layer named ``<type>.<index within its type>`` as the document
    names them (full.0, sw.0, ...)."""
    counts: dict[str, int] = {}
    layers: dict[str, KVCacheSpec] = {}
    for spec in pattern:
        prefix = names[spec]
        layers[f"{prefix}.{counts.get(prefix, 0)}"] = spec
        counts[prefix] = counts.get(prefix, 0) + 1
    return layers


def names(prefix: str, start: int, stop: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(start, stop))


def case2_model() -> dict[str, KVCacheSpec]:
    """Allocation, Case 2: 20 sliding + 10 full layers, sw 2 : full 1 (block 16, window 32)."""
    return by_type([SW, SW, FULL] * 10, {FULL: "full", SW: "sw"})


GEMMA3_FULL = FullAttentionSpec(block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2)
GEMMA3_SW = SlidingWindowSpec(
    block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2, sliding_window=1024
)


def gemma3_27b() -> dict[str, KVCacheSpec]:
    """62 layers, 5 sliding then 1 full, repeating: layer i is full iff (i + 1) % 6 == 0."""
    pattern = [GEMMA3_FULL if (i + 1) % 6 == 0 else GEMMA3_SW for i in range(62)]
    return by_type(pattern, {GEMMA3_FULL: "full", GEMMA3_SW: "sw"})


# --- Allocation, Case 1: toy model --------------------------------------------------------------


def test_case1_toy_model_has_one_layer_per_group() -> None:
    layers = by_type([FULL, SW, SW, SW], {FULL: "full", SW: "sw"})
    groups = plan_groups(layers)
    assert groups == (
        KVCacheGroup(("full.0",), FULL),
        KVCacheGroup(("sw.0",), SW),
        KVCacheGroup(("sw.1",), SW),
        KVCacheGroup(("sw.2",), SW),
    )


def test_case1_toy_model_page_is_one_layer_block() -> None:
    layers = by_type([FULL, SW, SW, SW], {FULL: "full", SW: "sw"})
    config = plan_kv_cache(layers, 10 * 65536)
    # page size = kv_hidden_size × block_size = 4096 × 16; one tensor shared by all four layers.
    assert config.num_blocks == 10
    assert [t.shared_by for t in config.tensors] == [("full.0", "sw.0", "sw.1", "sw.2")]
    assert config.tensors[0].size == 10 * 4096 * 16


# --- Allocation, Case 2 and Memory Layout: 10 full + 20 sliding ---------------------------------


def test_case2_model_has_three_groups_of_ten() -> None:
    groups = plan_groups(case2_model())
    assert groups == (
        KVCacheGroup(names("full", 0, 10), FULL),
        KVCacheGroup(names("sw", 0, 10), SW),
        KVCacheGroup(names("sw", 10, 20), SW),
    )


def test_case2_page_size_is_ten_layers_of_one_block() -> None:
    config = plan_kv_cache(case2_model(), GiB)
    layers_per_group = len(config.tensors)
    for group in config.groups:
        assert layers_per_group * group.spec.page_size_bytes == 10 * 4096 * 16 == 655360


def test_memory_layout_ten_tensors_each_shared_by_three_layers() -> None:
    config = plan_kv_cache(case2_model(), GiB)
    assert len(config.tensors) == 10
    assert config.tensors[0].shared_by == ("full.0", "sw.0", "sw.10")
    assert [t.shared_by for t in config.tensors] == [
        (f"full.{i}", f"sw.{i}", f"sw.{i + 10}") for i in range(10)
    ]


def test_memory_layout_num_blocks_and_tensor_sizes() -> None:
    config = plan_kv_cache(case2_model(), GiB)
    # A block is one 65536-byte slice of each of 10 tensors: 2**30 // 655360 = 1638 blocks.
    assert config.num_blocks == 1638
    assert {t.size for t in config.tensors} == {1638 * 65536}
    assert sum(t.size for t in config.tensors) == 1_073_479_680 <= GiB


def test_memory_layout_leftover_memory_stays_unused() -> None:
    exact = plan_kv_cache(case2_model(), 1638 * 655360)
    short = plan_kv_cache(case2_model(), 1638 * 655360 - 1)
    assert exact.num_blocks == 1638
    assert short.num_blocks == 1637


# --- Allocation, Case 3: Gemma-3-27b ------------------------------------------------------------


def test_gemma3_27b_has_seven_groups_and_eight_padding_slots() -> None:
    groups = plan_groups(gemma3_27b())
    assert [g.layer_names for g in groups] == [
        names("full", 0, 10),
        *(names("sw", i, i + 10) for i in range(0, 50, 10)),
        ("sw.50", "sw.51"),
    ]
    assert [g.spec for g in groups] == [GEMMA3_FULL] + [GEMMA3_SW] * 6
    # Group 6 has 2 layers in slots for 10: 8 padding slots out of 7 × 10.
    assert sum(10 - len(g.layer_names) for g in groups) == 8


def test_gemma3_27b_last_group_leaves_eight_tensors_without_its_layer() -> None:
    config = plan_kv_cache(gemma3_27b(), 4 * GiB)
    assert len(config.tensors) == 10
    assert config.tensors[0].shared_by == (
        "full.0",
        "sw.0",
        "sw.10",
        "sw.20",
        "sw.30",
        "sw.40",
        "sw.50",
    )
    assert config.tensors[2].shared_by == ("full.2", "sw.2", "sw.12", "sw.22", "sw.32", "sw.42")
    assert [len(t.shared_by) for t in config.tensors] == [7, 7, 6, 6, 6, 6, 6, 6, 6, 6]
    # Layer page 16 × 8192 = 131072; a block costs 10 of them.
    assert config.num_blocks == 4 * GiB // 1_310_720 == 3276


def test_full_attention_comes_first_though_the_model_starts_sliding() -> None:
    assert next(iter(gemma3_27b().values())) == GEMMA3_SW
    assert plan_groups(gemma3_27b())[0].spec == GEMMA3_FULL


def test_eagle_adds_a_full_layer_so_case2_becomes_case3() -> None:
    """Case 3: a Case 2 model plus an eagle draft's full layer: groups of 11, 2 padding slots."""
    layers = {**case2_model(), "full.10": FULL}
    groups = plan_groups(layers)
    assert [g.layer_names for g in groups] == [
        names("full", 0, 11),
        names("sw", 0, 11),
        names("sw", 11, 20),
    ]


def test_case3_heuristic_groups_20_full_and_30_sliding_by_20() -> None:
    """The document's known weak spot (20 full + 30 sliding): g = 20, not the better 10."""
    pattern: list[KVCacheSpec] = [FULL if i < 40 and i % 2 == 0 else SW for i in range(50)]
    layers = by_type(pattern, {FULL: "full", SW: "sw"})
    groups = plan_groups(layers)
    assert [g.layer_names for g in groups] == [
        names("full", 0, 20),
        names("sw", 0, 20),
        names("sw", 20, 30),
    ]


def test_llama4_local_3_full_1() -> None:
    """Llama 4: 3 chunked local layers per full layer; 48 layers → 12 per group, 4 groups."""
    local = ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=8192)
    layers = by_type([local, local, local, FULL] * 12, {FULL: "full", local: "local"})
    groups = plan_groups(layers)
    assert [g.layer_names for g in groups] == [
        names("full", 0, 12),
        names("local", 0, 12),
        names("local", 12, 24),
        names("local", 24, 36),
    ]
    assert [g.spec for g in groups] == [FULL, local, local, local]


def test_types_other_than_full_keep_their_order_of_first_appearance() -> None:
    local = ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=64)
    layers: dict[str, KVCacheSpec] = {
        "local.0": local,
        "sw.0": SW,
        "full.0": FULL,
        "local.1": local,
        "sw.1": SW,
    }
    groups = plan_groups(layers)
    assert [g.layer_names for g in groups] == [
        ("full.0",),
        ("local.0",),
        ("local.1",),
        ("sw.0",),
        ("sw.1",),
    ]


def test_full_attention_only_model_is_one_group() -> None:
    layers = {f"layers.{i}": FULL for i in range(32)}
    groups = plan_groups(layers)
    assert groups == (KVCacheGroup(tuple(layers), FULL),)
    config = plan_kv_cache(layers, GiB)
    assert len(config.tensors) == 32
    assert config.num_blocks == GiB // (32 * 65536) == 512


def test_equal_page_different_heads_are_two_types() -> None:
    """8 heads × 128 and 16 heads × 64 share kv_hidden_size 4096, but not a spec."""
    other = FullAttentionSpec(block_size=16, num_kv_heads=16, head_size=64, dtype_bytes=2)
    groups = plan_groups({"a.0": FULL, "b.0": other, "a.1": FULL, "b.1": other})
    assert groups == (KVCacheGroup(("a.0", "a.1"), FULL), KVCacheGroup(("b.0", "b.1"), other))


# --- Allocation, Case 4: Mamba ------------------------------------------------------------------


def jamba_like(state_bytes: int) -> dict[str, KVCacheSpec]:
    """32 layers, one attention layer in every 8 (layer i is attention iff i % 8 == 4)."""
    mamba = MambaSpec(block_size=16, state_bytes=state_bytes)
    pattern = [FULL if i % 8 == 4 else mamba for i in range(32)]
    return by_type(pattern, {FULL: "attn", mamba: "mamba"})


def test_case4_raises_the_attention_block_size_until_a_page_holds_the_state() -> None:
    # A page of 16 tokens × 4096 bytes = 65536 < 1_000_000; 256 tokens hold 1_048_576.
    groups = plan_groups(jamba_like(1_000_000))
    raised_full = replace(FULL, block_size=256)
    padded = MambaSpec(block_size=256, state_bytes=1_000_000, page_size_padded=256 * 4096)
    assert groups == (
        KVCacheGroup(names("attn", 0, 4), raised_full),
        *(KVCacheGroup(names("mamba", i, i + 4), padded) for i in range(0, 28, 4)),
    )
    assert {g.spec.page_size_bytes for g in groups} == {1_048_576}


def test_case4_pads_a_small_state_without_raising() -> None:
    groups = plan_groups(jamba_like(1000))
    assert groups[0].spec == FULL
    assert groups[1].spec == MambaSpec(block_size=16, state_bytes=1000, page_size_padded=65536)


def test_case4_tensors_are_shared_by_attention_and_mamba_layers() -> None:
    config = plan_kv_cache(jamba_like(1_000_000), GiB)
    assert len(config.tensors) == 4
    assert config.tensors[0].shared_by == ("attn.0", *(f"mamba.{i}" for i in range(0, 28, 4)))
    # A block costs 4 × 1_048_576 bytes.
    assert config.num_blocks == GiB // (4 * 1_048_576) == 256
    assert {t.size for t in config.tensors} == {256 * 1_048_576}


def test_case4_replanning_a_plan_changes_nothing() -> None:
    planned = {
        name: group.spec
        for group in plan_groups(jamba_like(1_000_000))
        for name in group.layer_names
    }
    again = plan_groups(planned)
    assert again == plan_groups(jamba_like(1_000_000))


def test_case4_mamba_layers_of_one_state_form_one_type_whatever_their_block_size() -> None:
    layers: dict[str, KVCacheSpec] = {
        "attn.0": FULL,
        "mamba.0": MambaSpec(block_size=16, state_bytes=1000),
        "mamba.1": MambaSpec(block_size=64, state_bytes=1000, page_size_padded=5000),
    }
    groups = plan_groups(layers)
    padded = MambaSpec(block_size=16, state_bytes=1000, page_size_padded=65536)
    assert groups == (
        KVCacheGroup(("attn.0",), FULL),
        KVCacheGroup(("mamba.0",), padded),
        KVCacheGroup(("mamba.1",), padded),
    )


def test_mamba_only_model_keeps_its_state_as_the_page() -> None:
    mamba = MambaSpec(block_size=16, state_bytes=1_000_000)
    layers = {f"mamba.{i}": mamba for i in range(4)}
    config = plan_kv_cache(layers, 10_000_000, enable_caching=False)
    assert config.groups == (KVCacheGroup(tuple(layers), mamba),)
    assert config.num_blocks == 10_000_000 // 4_000_000 == 2
    assert {t.size for t in config.tensors} == {2_000_000}


# --- Allocation, Case 5: KV sharing -------------------------------------------------------------


def gemma3n_like() -> tuple[dict[str, KVCacheSpec], dict[str, str]]:
    """30 layers, 4 sliding then 1 full; layers 20–29 read layer 18 (sliding) or 19 (full)."""
    layers: dict[str, KVCacheSpec] = {f"layers.{i}": FULL if i % 5 == 4 else SW for i in range(30)}
    sharing = {f"layers.{i}": "layers.19" if i % 5 == 4 else "layers.18" for i in range(20, 30)}
    return layers, sharing


def test_case5_readers_follow_their_target_groups_own_layers() -> None:
    layers, sharing = gemma3n_like()
    groups = plan_groups(layers, kv_sharing=sharing)

    def at(*indices: int) -> tuple[str, ...]:
        return tuple(f"layers.{i}" for i in indices)

    assert groups == (
        KVCacheGroup(at(4, 9, 14, 19, 24, 29), FULL),
        KVCacheGroup(at(0, 1, 2, 3), SW),
        KVCacheGroup(at(5, 6, 7, 8), SW),
        KVCacheGroup(at(10, 11, 12, 13), SW),
        KVCacheGroup(at(15, 16, 17, 18, 20, 21, 22, 23, 25, 26, 27, 28), SW),
    )


def test_case5_readers_get_no_tensor() -> None:
    layers, sharing = gemma3n_like()
    config = plan_kv_cache(layers, GiB, kv_sharing=sharing)
    # 4 full + 16 sliding own layers: groups of 4, so 4 tensors of five layers each.
    assert [t.shared_by for t in config.tensors] == [
        (f"layers.{4 + 5 * j}", *(f"layers.{i + j}" for i in (0, 5, 10, 15))) for j in range(4)
    ]
    assert config.tensors[0].shared_by == (
        "layers.4",
        "layers.0",
        "layers.5",
        "layers.10",
        "layers.15",
    )
    shared = {name for t in config.tensors for name in t.shared_by}
    assert shared.isdisjoint(sharing)
    assert config.num_blocks == GiB // (4 * 65536) == 4096


def test_case5_readers_are_not_counted_in_the_group_size() -> None:
    """Without sharing the full type has 6 layers (g = 6); its 2 readers leave 4 (g = 4)."""
    layers, sharing = gemma3n_like()
    assert len(plan_groups(layers)[0].layer_names) == 6
    groups = plan_groups(layers, kv_sharing=sharing)
    assert [len(own_layer_names(g, sharing)) for g in groups] == [4, 4, 4, 4, 4]


def test_case5_readers_keep_model_order_not_name_order() -> None:
    layers: dict[str, KVCacheSpec] = {"full.0": FULL, "z": FULL, "full.1": FULL, "a": FULL}
    groups = plan_groups(layers, kv_sharing={"a": "full.0", "z": "full.0"})
    assert groups == (KVCacheGroup(("full.0", "full.1", "z", "a"), FULL),)


def test_own_layer_names_leave_out_the_readers() -> None:
    layers, sharing = gemma3n_like()
    group = plan_groups(layers, kv_sharing=sharing)[0]
    assert own_layer_names(group, sharing) == ("layers.4", "layers.9", "layers.14", "layers.19")
    assert own_layer_names(group, {}) == group.layer_names


def test_case5_reader_of_a_mamba_layer_joins_the_padded_group() -> None:
    layers = {**jamba_like(1_000_000), "mamba.28": MambaSpec(block_size=16, state_bytes=1_000_000)}
    groups = plan_groups(layers, kv_sharing={"mamba.28": "mamba.3"})
    assert groups[1].layer_names == ("mamba.0", "mamba.1", "mamba.2", "mamba.3", "mamba.28")


# --- Bad input ----------------------------------------------------------------------------------


def test_empty_model_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^layers must name at least one layer, got \{\}$"):
        plan_groups({})


def test_empty_model_is_rejected_by_plan_kv_cache() -> None:
    with pytest.raises(ValueError, match=r"^layers must name at least one layer"):
        plan_kv_cache({}, GiB)


@pytest.mark.parametrize("spec", [AttentionSpec(**ATTENTION), "full", None, 16])
def test_a_value_that_is_no_layer_spec_is_rejected(spec: Any) -> None:
    with pytest.raises(
        ValueError,
        match=r"^layers\['x'\] must be one of FullAttentionSpec, SlidingWindowSpec, "
        r"ChunkedLocalAttentionSpec, MambaSpec, got ",
    ):
        plan_groups({"full.0": FULL, "x": spec})


@pytest.mark.parametrize("name", ["", 3, None])
def test_a_layer_name_that_is_no_string_is_rejected(name: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"^layers keys must be non-empty layer names, got {name!r}$"
    ):
        plan_groups({name: FULL})


def test_kv_sharing_target_missing_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"^kv_sharing\['full.1'\] must be a layer of the model, got 'full.9'$"
    ):
        plan_groups({"full.0": FULL, "full.1": FULL}, kv_sharing={"full.1": "full.9"})


def test_kv_sharing_reader_missing_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^kv_sharing keys must be layers of the model, got 'x'$"):
        plan_groups({"full.0": FULL}, kv_sharing={"x": "full.0"})


def test_kv_sharing_target_that_itself_shares_is_rejected() -> None:
    layers = {"full.0": FULL, "full.1": FULL, "full.2": FULL}
    with pytest.raises(
        ValueError,
        match=r"^kv_sharing\['full.2'\] must be a layer with its own KV cache, got 'full.1', "
        r"which itself shares 'full.0'$",
    ):
        plan_groups(layers, kv_sharing={"full.1": "full.0", "full.2": "full.1"})


def test_kv_sharing_with_itself_is_rejected() -> None:
    with pytest.raises(
        ValueError,
        match=r"^kv_sharing\['full.1'\] must be a layer with its own KV cache, got 'full.1'",
    ):
        plan_groups({"full.0": FULL, "full.1": FULL}, kv_sharing={"full.1": "full.1"})


def test_kv_sharing_with_a_different_spec_is_rejected() -> None:
    with pytest.raises(
        ValueError,
        match=r"^kv_sharing\['sw.0'\] = 'full.0' needs equal specs, but layer 'sw.0' has "
        r"SlidingWindowSpec\(.*\) and layer 'full.0' has FullAttentionSpec\(.*\)$",
    ):
        plan_groups({"full.0": FULL, "sw.0": SW}, kv_sharing={"sw.0": "full.0"})


def test_different_kv_hidden_size_is_rejected() -> None:
    wide = SlidingWindowSpec(**{**ATTENTION, "num_kv_heads": 16}, sliding_window=32)
    with pytest.raises(
        ValueError,
        match=r"^kv_hidden_size must be the same for every attention layer .*, "
        r"got 4096 for layer 'full.0' and 8192 for layer 'sw.0'$",
    ):
        plan_groups({"full.0": FULL, "sw.0": wide})


def test_different_block_size_is_rejected() -> None:
    coarse = replace(SW, block_size=32)
    with pytest.raises(
        ValueError,
        match=r"^block_size must be the same for every attention layer .*, "
        r"got 16 for layer 'full.0' and 32 for layer 'sw.0'$",
    ):
        plan_groups({"full.0": FULL, "sw.0": coarse})


def test_different_kv_hidden_size_next_to_mamba_is_rejected() -> None:
    wide = replace(FULL, dtype_bytes=4)
    layers: dict[str, KVCacheSpec] = {
        "attn.0": FULL,
        "mamba.0": MambaSpec(block_size=16, state_bytes=10),
        "attn.1": wide,
    }
    with pytest.raises(
        ValueError,
        match=r"^kv_hidden_size must be the same for every attention layer .*, "
        r"got 4096 for layer 'attn.0' and 8192 for layer 'attn.1'$",
    ):
        plan_groups(layers)


def test_different_mamba_states_are_rejected() -> None:
    layers: dict[str, KVCacheSpec] = {
        "attn.0": FULL,
        "mamba.0": MambaSpec(block_size=16, state_bytes=10),
        "mamba.1": MambaSpec(block_size=16, state_bytes=20),
    }
    with pytest.raises(
        ValueError,
        match=r"^state_bytes must be the same for every Mamba layer .*, "
        r"got 10 for layer 'mamba.0' and 20 for layer 'mamba.1'$",
    ):
        plan_groups(layers)


def test_mamba_only_model_with_different_block_sizes_is_rejected() -> None:
    layers = {
        "mamba.0": MambaSpec(block_size=16, state_bytes=10),
        "mamba.1": MambaSpec(block_size=32, state_bytes=10),
    }
    with pytest.raises(
        ValueError,
        match=r"^block_size must be the same for every Mamba layer .*, "
        r"got 16 for layer 'mamba.0' and 32 for layer 'mamba.1'$",
    ):
        plan_groups(layers)


def test_mamba_only_model_with_different_padding_is_rejected() -> None:
    layers = {
        "mamba.0": MambaSpec(block_size=16, state_bytes=10),
        "mamba.1": MambaSpec(block_size=16, state_bytes=10, page_size_padded=12),
    }
    with pytest.raises(
        ValueError,
        match=r"^page_size_bytes must be the same for every Mamba layer .*, "
        r"got 10 for layer 'mamba.0' and 12 for layer 'mamba.1'$",
    ):
        plan_groups(layers)


def test_memory_too_small_for_one_block_is_rejected() -> None:
    # Two blocks (the null block and one) of 10 × 65536 bytes need 1310720 bytes.
    with pytest.raises(
        ValueError,
        match=r"^available_memory_bytes is too small for one block: it must hold 2 blocks "
        r"\(the null block plus one\) of 10 × 65536 = 655360 bytes, i.e. 1310720 bytes, "
        r"got 1310719$",
    ):
        plan_kv_cache(case2_model(), 1_310_719)
    assert plan_kv_cache(case2_model(), 1_310_720).num_blocks == 2


@pytest.mark.parametrize("memory", [-1, 1.5e9, True, "1GiB", None])
def test_memory_that_is_no_non_negative_int_is_rejected(memory: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"^available_memory_bytes must be a non-negative int, got {memory!r}$"
    ):
        plan_kv_cache(case2_model(), memory)


def test_zero_memory_is_too_small() -> None:
    with pytest.raises(ValueError, match=r"^available_memory_bytes is too small .* got 0$"):
        plan_kv_cache(case2_model(), 0)


# --- Properties over random hybrid models -------------------------------------------------------


# Attention types that share kv_hidden_size 4096 (so they may share a page), per block size.
def attention_palette(block_size: int) -> list[KVCacheSpec]:
    base = {"block_size": block_size, "dtype_bytes": 2}
    return [
        FullAttentionSpec(**base, num_kv_heads=8, head_size=128),
        FullAttentionSpec(**base, num_kv_heads=16, head_size=64),
        SlidingWindowSpec(**base, num_kv_heads=8, head_size=128, sliding_window=512),
        SlidingWindowSpec(**base, num_kv_heads=8, head_size=128, sliding_window=4096),
        ChunkedLocalAttentionSpec(**base, num_kv_heads=8, head_size=128, attention_chunk_size=8192),
    ]


@st.composite
def hybrid_models(draw: st.DrawFn) -> tuple[dict[str, KVCacheSpec], dict[str, str]]:
    """A model of 1–4 attention types (and maybe Mamba) in random order, with maybe readers."""
    block_size = draw(st.sampled_from([1, 16, 64]))
    types = draw(st.lists(st.sampled_from(attention_palette(block_size)), max_size=4, unique=True))
    if draw(st.booleans()) or not types:
        types.append(MambaSpec(block_size=block_size, state_bytes=draw(st.integers(1, 1 << 22))))
    pattern = [spec for spec in types for _ in range(draw(st.integers(1, 24)))]
    pattern = draw(st.permutations(pattern))
    layers = {f"layers.{i}": spec for i, spec in enumerate(pattern)}
    sharing: dict[str, str] = {}
    for i in range(draw(st.integers(0, 6))):
        target = draw(st.sampled_from(sorted(layers.keys() - sharing.keys())))
        reader = f"reader.{9 - i}"  # names that do not sort in model order
        layers[reader] = layers[target]
        sharing[reader] = target
    order = draw(st.permutations(list(layers)))
    return {name: layers[name] for name in order}, sharing


def own_types(layers: Mapping[str, KVCacheSpec], sharing: Mapping[str, str]) -> list[list[str]]:
    """Own layers per type (equal input spec, all Mamba layers being one type), in model order."""
    types: dict[object, list[str]] = {}
    for name, spec in layers.items():
        if name not in sharing:
            types.setdefault("mamba" if isinstance(spec, MambaSpec) else spec, []).append(name)
    return list(types.values())


MODEL_SETTINGS = settings(max_examples=150, deadline=None)


@MODEL_SETTINGS
@given(hybrid_models())
def test_every_own_layer_is_placed_exactly_once(
    model: tuple[dict[str, KVCacheSpec], dict[str, str]],
) -> None:
    layers, sharing = model
    groups = plan_groups(layers, kv_sharing=sharing)
    placed = [name for g in groups for name in own_layer_names(g, sharing)]
    assert sorted(placed) == sorted(layers.keys() - sharing.keys())
    readers = [name for g in groups for name in g.layer_names if name in sharing]
    assert sorted(readers) == sorted(sharing)


@MODEL_SETTINGS
@given(hybrid_models())
def test_readers_follow_the_own_layers_of_their_targets_group(
    model: tuple[dict[str, KVCacheSpec], dict[str, str]],
) -> None:
    layers, sharing = model
    for group in plan_groups(layers, kv_sharing=sharing):
        own = own_layer_names(group, sharing)
        assert group.layer_names[: len(own)] == own
        readers = group.layer_names[len(own) :]
        assert all(sharing[reader] in own for reader in readers)
        assert list(readers) == [name for name in layers if name in readers]  # model order


@MODEL_SETTINGS
@given(hybrid_models())
def test_each_type_is_cut_into_consecutive_groups_of_g_with_only_the_last_short(
    model: tuple[dict[str, KVCacheSpec], dict[str, str]],
) -> None:
    layers, sharing = model
    groups = plan_groups(layers, kv_sharing=sharing)
    types = own_types(layers, sharing)
    g = min(len(names) for names in types)
    own = [own_layer_names(group, sharing) for group in groups]
    for names in types:
        of_type = [o for o in own if o[0] in names]
        assert [name for o in of_type for name in o] == names  # model order, consecutive
        assert all(len(o) == g for o in of_type[:-1])
        assert 0 < len(of_type[-1]) <= g
        assert len({groups[own.index(o)].spec for o in of_type}) == 1
    padding = sum(g - len(o) for o in own)
    assert padding == sum(rules.num_padding_slots(len(names), g) for names in types)


@MODEL_SETTINGS
@given(hybrid_models())
def test_every_group_has_one_page_size_and_block_size(
    model: tuple[dict[str, KVCacheSpec], dict[str, str]],
) -> None:
    layers, sharing = model
    groups = plan_groups(layers, kv_sharing=sharing)
    assert len({g.spec.page_size_bytes for g in groups}) == 1
    assert len({g.spec.block_size for g in groups}) == 1
    for g in groups:
        if isinstance(g.spec, MambaSpec):
            assert g.spec.page_size_bytes >= g.spec.state_bytes


@MODEL_SETTINGS
@given(hybrid_models())
def test_full_attention_groups_come_first(
    model: tuple[dict[str, KVCacheSpec], dict[str, str]],
) -> None:
    layers, sharing = model
    kinds = [isinstance(g.spec, FullAttentionSpec) for g in plan_groups(layers, kv_sharing=sharing)]
    assert kinds == sorted(kinds, reverse=True)


@MODEL_SETTINGS
@given(hybrid_models(), st.integers(0, 1 << 34))
def test_tensor_i_holds_the_ith_own_layer_of_every_group(
    model: tuple[dict[str, KVCacheSpec], dict[str, str]], memory: int
) -> None:
    layers, sharing = model
    groups = plan_groups(layers, kv_sharing=sharing)
    g = min(len(names) for names in own_types(layers, sharing))
    page = groups[0].spec.page_size_bytes
    if memory < 2 * g * page:
        with pytest.raises(ValueError, match=r"^available_memory_bytes is too small"):
            plan_kv_cache(layers, memory, kv_sharing=sharing)
        return
    config = plan_kv_cache(layers, memory, kv_sharing=sharing, enable_caching=False)
    assert config.groups == groups
    assert len(config.tensors) == g
    own = [own_layer_names(group, sharing) for group in groups]
    for i, tensor in enumerate(config.tensors):
        assert tensor.shared_by == tuple(o[i] for o in own if i < len(o))
        assert tensor.size == config.num_blocks * page
    in_tensors = [name for t in config.tensors for name in t.shared_by]
    assert sorted(in_tensors) == sorted(layers.keys() - sharing.keys())
    assert config.num_blocks == memory // (g * page)


def test_with_mamba_cache_mode_is_align_with_caching_and_none_without() -> None:
    """An engine runs a plan's Mamba groups in ``"align"`` mode with prefix caching
    (Prefix caching, Case 3) and in ``"none"`` without; attention groups are untouched."""
    from hybridkv.reference.planner import with_mamba_cache_mode
    from hybridkv.spec import KVCacheConfig, KVCacheGroup, MambaSpec

    mamba = MambaSpec(block_size=16, state_bytes=64)
    config = KVCacheConfig(
        8, (KVCacheGroup(("attn",), FULL), KVCacheGroup(("m",), mamba)), tensors=()
    )
    cached = with_mamba_cache_mode(config, True)
    assert cached.groups[0] == config.groups[0]
    assert cached.groups[1] == KVCacheGroup(("m",), replace(mamba, mamba_cache_mode="align"))
    assert cached.num_blocks == 8
    uncached = with_mamba_cache_mode(cached, False)
    assert uncached.groups[1].spec == mamba
    assert uncached.groups[0] == config.groups[0]
