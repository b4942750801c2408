"""Prefix-cache entries read by hash and dropped by block id, as vLLM's block pool offers them.

``BlockPool.get_cached_block`` (the first block cached under a hash in each group, or ``None``
if any group misses) is what vLLM's aux-output connector reads; ``BlockPool.evict_blocks``
(forget the keys of blocks named by id, wherever they are, announcing each removal) is what a
KV connector calls after a failed load. The manager offers both as ``get_cached_block_ids``
and ``evict_blocks``; the reference's block pool has them by vLLM's names.

Data layout: the table's chains (``hybridkv.optimized.cache_chains``) are keyed by a hash's
first 4 bytes and its group, and an entry also names the hash's position, which a lookup by
hash alone does not know: it walks the one bucket the key and group pick and compares each
candidate's whole hash (its source's, by position), so a 4-byte collision never answers for
another hash. A bucket lists its entries newest first; vLLM's answer is the first inserted.
Extra keys (``hybridkv.optimized.extra_keys``: rare, hash views and partial entries) are
scanned after, and one inserted before every primary holder still cached comes first, as
the reference's insertion-ordered entries give it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.optimized.sources import hash_key
from hybridkv.optimized.state import ManagerState
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.validation import check_block_ids, check_group_ids


def cached_block(s: ManagerState, block_hash: BlockHash, group_id: int) -> int:
    """The first block cached under ``block_hash`` in group ``group_id``, or -1."""
    pool = s.pool
    key, groups = hash_key(block_hash), pool.num_groups
    hnext, hk, end = pool.hnext.a, pool.hk.a, pool.end
    first = -1
    block = pool.heads.a[pool.bucket(key, group_id)]
    while block != end:
        value = hk[block]
        tag = value & 0xFFFFFFFF
        if value >> 32 == key and tag % groups == group_id and pool.block_hash(block) == block_hash:
            first = block  # the chain is newest first: the last match is the oldest
        block = hnext[block]
    extra = _first_extra(s, block_hash, key, group_id, first)
    return first if extra < 0 else extra


def _first_extra(
    s: ManagerState, block_hash: BlockHash, key: int, group_id: int, primary: int
) -> int:
    """The first-inserted extra holder of the hash inserted before ``primary`` (any, when
    ``primary`` is -1), or -1."""
    pool = s.pool
    best, best_order = -1, -1
    for (k, g, hidx), holders in pool.extra_index.items():
        if k != key or g != group_id:
            continue
        for block, (order, before) in holders.items():
            src = pool.extras[block][(k, g, hidx)]
            if pool.source(src).hashes[hidx] != block_hash:
                continue
            if primary >= 0 and primary in before:
                continue  # the primary holder came first
            if best < 0 or order < best_order:
                best, best_order = block, order
    return best


def get_cached_block_ids(
    s: ManagerState, block_hash: BlockHash, group_ids: Sequence[int]
) -> list[int] | None:
    """``BlockPool.get_cached_block``: the first block cached under ``block_hash`` in each of
    ``group_ids``, or ``None`` if any group has none."""
    groups = check_group_ids(group_ids, s.layout.num_groups)
    s.settle()
    found: list[int] = []
    for group_id in groups:
        block = cached_block(s, block_hash, group_id)
        if block < 0:
            return None
        found.append(block)
    return found


def evict_blocks(s: ManagerState, block_ids: Iterable[int]) -> None:
    """``BlockPool.evict_blocks``: forget every key of each named block (one not cached is left
    alone); a held block stays held, a free one keeps its place in the free queue."""
    ids = check_block_ids(block_ids, s.layout.config.num_blocks)  # all checked first
    s.settle()
    pool = s.pool
    for block in ids:
        pool.remove_keys(block)
    s.raise_policy_error()
