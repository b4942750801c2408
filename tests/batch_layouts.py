"""The hybrid layouts the whole-step batch tests run on (``test_optimized_batch``,
``test_optimized_step_columns``): one block size of 4 tokens, full attention beside sliding
windows of 9 tokens and, unless ``fused``, a chunked-local group of 12."""

from __future__ import annotations

from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)

SIZES = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
SPECS: tuple[KVCacheSpec, ...] = (
    FullAttentionSpec(**SIZES),
    SlidingWindowSpec(sliding_window=9, **SIZES),
    SlidingWindowSpec(sliding_window=9, **SIZES),
    ChunkedLocalAttentionSpec(attention_chunk_size=12, **SIZES),
)


def layout(num_blocks: int, fused: bool = False) -> KVCacheConfig:
    """The layout of ``num_blocks`` blocks; ``fused``: without the chunked-local group (one
    window: the layout whose steps defer their pool work and take the fused step)."""
    specs = SPECS[:3] if fused else SPECS
    return KVCacheConfig(
        num_blocks, tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    )
