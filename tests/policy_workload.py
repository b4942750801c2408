"""Small managers and random traffic for the eviction-policy tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from hybridkv.policies import CachedBlock, EvictionPolicy
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

KV = {"block_size": 4, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}


def document_config(num_blocks: int = 17) -> KVCacheConfig:
    """The design document's 10 full + 20 sliding-window layers in miniature: one full group,
    two sliding-window groups of window 8 (a hit reads the 2 blocks before its end)."""
    full = FullAttentionSpec(**KV)
    sw = SlidingWindowSpec(**KV, sliding_window=8)
    groups = (
        KVCacheGroup(("full",), full),
        KVCacheGroup(("sw0",), sw),
        KVCacheGroup(("sw1",), sw),
    )
    return KVCacheConfig(num_blocks, groups)


def chunked_config(num_blocks: int = 25) -> KVCacheConfig:
    """Full attention beside a sliding window of 8 and chunked local attention of chunk 8."""
    groups = (
        KVCacheGroup(("full",), FullAttentionSpec(**KV)),
        KVCacheGroup(("sw",), SlidingWindowSpec(**KV, sliding_window=8)),
        KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(**KV, attention_chunk_size=8)),
    )
    return KVCacheConfig(num_blocks, groups)


def mamba_config(num_blocks: int = 25) -> KVCacheConfig:
    """Full attention beside a Mamba group in ``"align"`` mode (a state per cached block)."""
    groups = (
        KVCacheGroup(("full",), FullAttentionSpec(**KV)),
        KVCacheGroup(("mamba",), MambaSpec(block_size=4, state_bytes=64, mamba_cache_mode="align")),
    )
    return KVCacheConfig(num_blocks, groups)


def admit(manager: KVCacheManager, rid: str, tokens: Sequence[int]) -> Request | None:
    """Admit a request whole (its cache hit first); ``None`` when the pool cannot hold it."""
    request = Request(rid, list(tokens), hash_block_size=4)
    hit, num_hit, _ = manager.get_computed_blocks(request)
    if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit) is None:
        return None
    return request


Op = tuple[str, int, int]
"""``("admit", prefix, length)``, ``("free", index, 0)`` or ``("reset", 0, 0)``."""


def run_ops(
    config: KVCacheConfig,
    policy: EvictionPolicy,
    ops: Sequence[Op],
    after_each: Callable[[KVCacheManager], None],
) -> int:
    """Drive ``ops`` through a manager under ``policy``; ``after_each`` after every one.

    Prompts share one of four prefixes (so hits and branches occur). Returns the tokens hit.
    """
    manager = KVCacheManager(config, max_model_len=64, eviction_policy=policy)
    running: list[Request] = []
    hit_tokens = 0
    for number, (op, a, b) in enumerate(ops):
        if op == "admit":
            tokens = [1000 * (a % 4) + t for t in range(b)] + [number]
            request = Request(f"r{number}", tokens, hash_block_size=4)
            hit_tokens += manager.get_computed_blocks(request)[1]
            admitted = admit(manager, f"r{number}", tokens)
            if admitted is not None:
                running.append(admitted)
        elif op == "free" and running:
            manager.free(running.pop(a % len(running)))
        elif op == "reset":
            manager.reset_prefix_cache()
        manager.check_invariants()
        after_each(manager)
    return hit_tokens


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 7), st.integers(1, 40)),
        st.tuples(st.just("free"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("reset"), st.just(0), st.just(0)),
    ),
    max_size=40,
)
"""Random traffic for ``run_ops``: admissions over four prefixes, frees and resets."""


def useless_cache() -> list[CachedBlock]:
    """A hand-built cache of every kind (full h1-h2, a window of 8 to h3, a chunk of 8, Mamba
    states at h2 and h3, a second holder of full h1), blocks 1-10 in that order: the window
    block 3 is interior, the chunk's block 7, the Mamba state 9 (the full group lacks h3) and
    block 10 (h1 is served by block 1) can serve no hit."""
    full = FullAttentionSpec(**KV)
    window = SlidingWindowSpec(**KV, sliding_window=8)
    chunk = ChunkedLocalAttentionSpec(**KV, attention_chunk_size=8)
    mamba = MambaSpec(block_size=4, state_bytes=64, mamba_cache_mode="align")
    rows: list[tuple[int, bytes, int, KVCacheSpec, bytes | None, int]] = [
        (1, b"h1", 0, full, None, 4),
        (2, b"h2", 0, full, b"h1", 8),
        (3, b"h1", 1, window, None, 4),
        (4, b"h2", 1, window, b"h1", 8),
        (5, b"h3", 1, window, b"h2", 12),
        (6, b"h1", 2, chunk, None, 4),
        (7, b"h2", 2, chunk, b"h1", 8),
        (8, b"h2", 3, mamba, b"h1", 8),
        (9, b"h3", 3, mamba, b"h2", 12),
        (10, b"h1", 0, full, None, 4),
    ]
    return [CachedBlock(*row) for row in rows]
