"""Each attention type's longest cache hit over the optimized backend's lookup memo.

``find_longest_cache_hit`` of the reference's single-type managers, one function per attention
type (``TYPE_HITS``, by ``spec.kind``), each reading which of a prompt's blocks are cached through
a ``TypeProbe`` (``hybridkv.optimized.lookup``): a full-attention group's leading run (Prefix
caching, Case 1), a sliding window's rightmost run that covers the window (Case 2), a chunk's
cached blocks, a Mamba group's last cached state at an aligned boundary (Case 3). The manager's
coordinator (``TorchKVCacheManager._hybrid_hit``) intersects them as ``rules.hybrid_hit_length``
says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.lookup import GroupHit, TypeProbe, WindowedFlags
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

TypeHit = tuple[GroupHit, ...]
"""One attention type's hit, per group of the type (``TypeProbe.blocks``)."""


class HitProbe(NamedTuple):
    """One type's lookup: its memo, the token limit, the blocks within it, the alignment of
    the hit (the scheduler block), the EAGLE drop, and the length from which to vectorise."""

    memo: TypeProbe
    max_length: int
    length: int
    align: int
    drop: bool
    vector_min: int


def _full_attention_hit(spec: FullAttentionSpec, p: HitProbe) -> TypeHit:
    """The leading run of cached blocks, less the EAGLE drop, cut to the alignment."""
    b = spec.block_size
    if p.length >= p.vector_min:
        p.memo.lookup.pool.paths.ran(paths.LOOKUP_LEADING)
        num = p.memo.leading_hits(p.length)
    else:
        flags = WindowedFlags(p.memo, p.length, leftwards=False, span=p.length)
        num = rules.full_attention_hit_blocks(flags, p.length)
    hit_length = num * b
    if p.drop and hit_length > 0:
        hit_length -= min(p.align, b)
    hit_length -= hit_length % p.align
    return p.memo.blocks(0, rules.cdiv(hit_length, b))


def window_blocks_needed(spec: SlidingWindowSpec, drop: bool) -> int:
    """The cached blocks a sliding-window hit ends with (``drop``: the EAGLE drop's one more).
    A window of one token needs no block before the hit (``rules``' count is 0), yet the scan
    (vLLM's, the reference's, ``rules.sliding_window_hit_blocks``) still ends only at a cached
    block: as with one block needed, which the scans are given."""
    needed = rules.sliding_window_contiguous_blocks(spec.sliding_window, spec.block_size, drop)
    return max(1, needed)


def _sliding_window_hit(spec: SlidingWindowSpec, p: HitProbe) -> TypeHit:
    """The rightmost run of cached blocks that covers the window (Prefix caching, Case 2)."""
    b = spec.block_size
    needed = window_blocks_needed(spec, p.drop)
    if p.align == b:
        num, first = p.memo.window_hit(p.length, needed)
        if p.drop and num > 0:
            num -= 1
        return p.memo.blocks(first, num)
    flags = WindowedFlags(p.memo, p.length, leftwards=True, span=needed)
    num, first = aligned_window_hit(flags, p.length, needed, b, p.align, p.drop)
    return p.memo.blocks(first, num)


def _chunked_local_hit(spec: ChunkedLocalAttentionSpec, p: HitProbe) -> TypeHit:
    """The current chunk's cached blocks; the chunks before it are not needed."""
    b = spec.block_size
    chunk = spec.attention_chunk_size
    flags = WindowedFlags(p.memo, p.length, leftwards=False, span=chunk // b + 1)
    if p.length == p.max_length // b:
        num, first = rules.chunked_local_hit_blocks(flags, p.max_length, b, chunk)
        return p.memo.blocks(first, num)
    # Fewer block hashes than blocks: the chunk still starts where ``max_length`` puts it, and
    # the scan stops at the last hashed block (the reference's ``max_num_blocks``).
    first = rules.chunked_local_skipped_tokens(p.max_length, chunk) // b
    num = first
    while num < p.length and flags[num]:
        num += 1
    return p.memo.blocks(first, num)


def _mamba_hit(spec: MambaSpec, p: HitProbe) -> TypeHit:
    """The largest aligned block boundary whose state is cached (Case 3)."""
    b = spec.block_size
    flags = WindowedFlags(p.memo, p.length, leftwards=True, span=1)
    for index in range(p.length - 1, -1, -1):
        if not flags[index]:
            continue
        if b != p.align and (index + 1) * b % p.align:
            continue
        return p.memo.blocks(index, index + 1)
    return p.memo.blocks(0, 0)


TYPE_HITS: dict[str, Callable[[Any, HitProbe], TypeHit]] = {
    "full": _full_attention_hit,
    "sliding_window": _sliding_window_hit,
    "chunked_local": _chunked_local_hit,
    "mamba": _mamba_hit,
}
"""Each attention type's longest hit, by ``spec.kind`` (``find_longest_cache_hit``)."""


def aligned_window_hit(
    flags: Sequence[bool], length: int, needed: int, b: int, align: int, drop: bool
) -> tuple[int, int]:
    """``SlidingWindowManager.find_longest_cache_hit`` when the scheduler block is larger than
    the group's: ``(hit blocks, first real block)``, step for step."""
    step = align // b
    run = 0
    for index in range(length - 1, -1, -1):
        if not flags[index]:
            run = 0
            continue
        if run == 0:
            kept = index if drop else index + 1
            if kept % step:
                continue
        run += 1
        if run >= needed:
            num, first = index + run, index
            break
    else:
        num, first = run, 0
        num -= num % step
    if drop and num > 0:
        num -= 1
        num -= num % step
    return num, min(first, num)
