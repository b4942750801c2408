"""The small hybrid layout of the lookup tests (``test_optimized_lookup``,
``test_optimized_memo_hit``, ``test_optimized_one_pass_admission``): one full-attention group
and two sliding windows of 8 tokens, blocks of 4 tokens, and the prompts they look up."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.state import Tuning
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

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


ADMISSIONS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 5), st.booleans()),
    min_size=1,
    max_size=14,
)
"""A run of admissions: per admission, which of four shared prefixes, where it is cut, how
many tokens of its own (three a unit, plus one) and whether a live request is freed after."""


def admission_prompts(
    admissions: list[tuple[int, int, int, bool]],
) -> Iterator[tuple[int, list[int], bool]]:
    """Each admission's index, prompt and whether a live request is freed after it."""
    prefixes = [prompt(seed, 48) for seed in range(4)]
    for i, (which, cut, own, free_one) in enumerate(admissions):
        yield i, [*prefixes[which][:cut], *prompt(100 + i, own * 3 + 1)], free_one


def managers_beside(
    num_blocks: int, off: Tuning, groups: tuple[KVCacheGroup, ...] = (FULL, *WINDOWS)
) -> tuple[TorchKVCacheManager, TorchKVCacheManager, KVCacheManager]:
    """The optimized manager, the same with a fast path switched ``off``, and the reference,
    on ``num_blocks`` blocks of ``groups`` (4,096 tokens long)."""
    config = KVCacheConfig(num_blocks, groups)
    return (
        TorchKVCacheManager(config, 4096),
        TorchKVCacheManager(config, 4096, tuning=off),
        KVCacheManager(config, 4096),
    )


def free_oldest(
    managers: Sequence[TorchKVCacheManager | KVCacheManager], live: list[list[Request]]
) -> None:
    """Free the oldest live request (one ``Request`` per manager) in every manager."""
    for manager, request in zip(managers, live.pop(0), strict=True):
        manager.free(request)
