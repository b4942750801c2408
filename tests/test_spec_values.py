"""The spec vocabulary: derived sizes, and a ``ValueError`` naming field and value for bad input."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from hybridkv.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    spec_kind,
)

ATTENTION = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}
FULL = FullAttentionSpec(**ATTENTION)


# --- Derived sizes (document: "Definitions") ----------------------------------------------------


def test_kv_hidden_size_is_k_and_v_of_every_head() -> None:
    assert FULL.kv_hidden_size == 2 * 8 * 128 * 2 == 4096


def test_layer_page_size_is_block_size_times_kv_hidden_size() -> None:
    assert FULL.page_size_bytes == 16 * 4096 == 65536


def test_gemma3_27b_layer_page_size() -> None:
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2, sliding_window=1024
    )
    assert spec.kv_hidden_size == 8192
    assert spec.page_size_bytes == 131072


def test_every_attention_type_has_the_same_page_formula() -> None:
    sliding = SlidingWindowSpec(**ATTENTION, sliding_window=32)
    chunked = ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=8192)
    assert sliding.page_size_bytes == chunked.page_size_bytes == FULL.page_size_bytes


def test_mamba_page_is_its_state_until_padded() -> None:
    assert MambaSpec(block_size=16, state_bytes=1000).page_size_bytes == 1000
    padded = MambaSpec(block_size=16, state_bytes=1000, page_size_padded=4096)
    assert padded.page_size_bytes == 4096


def test_mamba_may_be_padded_to_exactly_its_state() -> None:
    assert MambaSpec(block_size=1, state_bytes=7, page_size_padded=7).page_size_bytes == 7


def test_equal_fields_make_equal_hashable_specs() -> None:
    assert FullAttentionSpec(**ATTENTION) == FULL
    assert hash(FullAttentionSpec(**ATTENTION)) == hash(FULL)


def test_specs_of_different_types_never_compare_equal() -> None:
    full_like: KVCacheSpec = ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=16)
    assert full_like != FULL
    assert SlidingWindowSpec(**ATTENTION, sliding_window=16) != full_like


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        (FULL, "full"),
        (SlidingWindowSpec(**ATTENTION, sliding_window=4), "sliding_window"),
        (ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=4), "chunked_local"),
        (MambaSpec(block_size=16, state_bytes=4), "mamba"),
    ],
)
def test_spec_kind_names_the_attention_type(spec: KVCacheSpec, kind: str) -> None:
    assert spec_kind(spec) == kind


def test_specs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        FULL.block_size = 32  # type: ignore[misc]


# --- Bad specs ----------------------------------------------------------------------------------

BAD_VALUES: list[Any] = [0, -1, True, 1.5, "16", None]


def _attention_kwargs(field: str, value: object) -> dict[str, Any]:
    return {**ATTENTION, field: value}


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_size", "dtype_bytes"])
@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (FullAttentionSpec, {}),
        (SlidingWindowSpec, {"sliding_window": 32}),
        (ChunkedLocalAttentionSpec, {"attention_chunk_size": 32}),
    ],
)
def test_attention_spec_rejects_a_non_positive_size(
    cls: type[AttentionSpec], extra: dict[str, int], field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be a positive int, got {value!r}$"):
        cls(**_attention_kwargs(field, value), **extra)


@pytest.mark.parametrize("value", BAD_VALUES)
def test_sliding_window_spec_rejects_a_non_positive_window(value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"^sliding_window must be a positive int, got {value!r}$"
    ):
        SlidingWindowSpec(**ATTENTION, sliding_window=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_VALUES)
def test_chunked_local_spec_rejects_a_non_positive_chunk(value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"^attention_chunk_size must be a positive int, got {value!r}$"
    ):
        ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_VALUES)
def test_mamba_spec_rejects_a_non_positive_block_size(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^block_size must be a positive int, got {value!r}$"):
        MambaSpec(block_size=value, state_bytes=100)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_VALUES)
def test_mamba_spec_rejects_a_non_positive_state(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^state_bytes must be a positive int, got {value!r}$"):
        MambaSpec(block_size=16, state_bytes=value)  # type: ignore[arg-type]


def test_mamba_spec_rejects_padding_below_its_state() -> None:
    with pytest.raises(
        ValueError, match=r"^page_size_padded must be at least state_bytes \(100\), got 99$"
    ):
        MambaSpec(block_size=16, state_bytes=100, page_size_padded=99)


def test_attention_spec_needs_every_field_by_keyword() -> None:
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 8, 128, 2)  # type: ignore[call-arg]


# --- Config values ------------------------------------------------------------------------------


def test_config_counts_the_null_block_so_two_is_the_least() -> None:
    group = KVCacheGroup(("full.0",), FULL)
    config = KVCacheConfig(num_blocks=2, groups=(group,))
    assert config.num_blocks == 2
    assert config.tensors == ()


@pytest.mark.parametrize("num_blocks", [1, 0, -3, True, 2.0, "8"])
def test_config_rejects_fewer_than_two_blocks(num_blocks: object) -> None:
    group = KVCacheGroup(("full.0",), FULL)
    with pytest.raises(
        ValueError,
        match=rf"^num_blocks must be an int of at least 2 \(the null block plus one\), "
        rf"got {num_blocks!r}$",
    ):
        KVCacheConfig(num_blocks=num_blocks, groups=(group,))  # type: ignore[arg-type]


def test_config_rejects_no_groups() -> None:
    with pytest.raises(
        ValueError, match=r"^groups must hold at least one KV cache group, got \(\)$"
    ):
        KVCacheConfig(num_blocks=8, groups=())


def test_group_rejects_no_layers() -> None:
    with pytest.raises(ValueError, match=r"^layer_names must name at least one layer, got \(\)$"):
        KVCacheGroup((), FULL)


@pytest.mark.parametrize("size", [-1, True, 1.0])
def test_tensor_rejects_a_negative_size(size: object) -> None:
    with pytest.raises(ValueError, match=rf"^size must be a non-negative int, got {size!r}$"):
        KVCacheTensor(size=size, shared_by=("full.0",))  # type: ignore[arg-type]


def test_tensor_rejects_no_layers() -> None:
    with pytest.raises(ValueError, match=r"^shared_by must name at least one layer, got \(\)$"):
        KVCacheTensor(size=0, shared_by=())


# --- Per-type dispatch --------------------------------------------------------------------------


def test_each_attention_type_answers_the_dispatch() -> None:
    """The one table of per-type behaviour, read from the spec classes: the reference, the
    optimized backend and the planner ask these instead of branching on the class."""
    attention = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype_bytes": 2}
    specs: dict[str, KVCacheSpec] = {
        "full": FullAttentionSpec(**attention),
        "sliding_window": SlidingWindowSpec(**attention, sliding_window=64),
        "chunked_local": ChunkedLocalAttentionSpec(**attention, attention_chunk_size=64),
        "mamba_none": MambaSpec(block_size=16, state_bytes=100),
        "mamba_align": MambaSpec(
            block_size=16, state_bytes=100, mamba_cache_mode="align", num_speculative_blocks=2
        ),
    }
    table = {
        name: (
            spec.kind,
            spec.title,
            spec.hit_is_prefix,
            spec.holds_state,
            spec.sparse_retention,
            spec.null_positions,
            spec.max_live_blocks,
            spec.lcm_hashing,
            spec.needs_shared_block_size,
            spec.supports_eagle_drop,
            spec.kv_bytes_per_token,
            spec.blocks_without_release(100),
        )
        for name, spec in specs.items()
    }
    assert table == {
        "full": (
            "full", "full-attention", True, False, False, "none", None, False, False, True, 64, 7,
        ),
        "sliding_window": (
            "sliding_window", "sliding-window", False, False, True, "leading", None, False,
            False, True, 64, 7,
        ),
        "chunked_local": (
            "chunked_local", "chunked local attention", False, False, False, "leading", None,
            False, True, False, 64, 7,
        ),
        "mamba_none": (
            "mamba", "Mamba", False, True, True, "leading", None, True, False, True, 0, 1,
        ),
        "mamba_align": (
            "mamba", "Mamba", False, True, True, "anywhere", 5, False, False, True, 0, 1,
        ),
    }  # fmt: skip


def test_prefix_caching_checks_of_a_mamba_spec_name_the_field() -> None:
    none = MambaSpec(block_size=16, state_bytes=100)
    with pytest.raises(ValueError, match=r"mamba_cache_mode must be 'align' .* got 'none'"):
        none.check_prefix_caching()
    align = replace(none, mamba_cache_mode="align")
    align.check_prefix_caching()
    align.check_hash_block_size(16)
    with pytest.raises(ValueError, match=r"block_size \(16\) must equal the hash block size \(8\)"):
        align.check_hash_block_size(8)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype_bytes=2)
    full.check_prefix_caching()
    full.check_hash_block_size(1)
