"""The small hybrid layout of the lookup tests (``test_optimized_lookup``,
``test_optimized_memo_hit``): one full-attention group and two sliding windows of 8 tokens,
blocks of 4 tokens, and the prompts they look up."""

from __future__ import annotations

import random

from hybridkv.spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

SIZES = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
FULL = KVCacheGroup(("full",), FullAttentionSpec(**SIZES))
WINDOWS = (
    KVCacheGroup(("sw.0",), SlidingWindowSpec(sliding_window=8, **SIZES)),
    KVCacheGroup(("sw.1",), SlidingWindowSpec(sliding_window=8, **SIZES)),
)


def prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids below 1,000, drawn from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]
