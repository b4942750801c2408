"""The prefix cache's vectorised inserts link the chains as one insert after another.

``BulkInserts.chain_entries`` links many entries in numpy calls: when no two of them share a
bucket, each links to its bucket's old head; otherwise they are sorted by bucket first
(``_chain_sharing``). Both must leave the hash table exactly as ``chain_records``, the one-by-one
insert, does: the same heads, links, keys and sources, and the same duplicate marks.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized.block_pool import TorchBlockPool, hash_key
from hybridkv.optimized.pending import PendingInserts
from hybridkv.reference.block_hash import BlockHash

NUM_BLOCKS = 64
GROUPS = 3
HASHES = [BlockHash(bytes([i]) * 32) for i in range(6)]


def one_by_one(entries: list[tuple[int, int, int, int]]) -> PendingInserts:
    """Pending inserts of ``(block, group, position, hash index)`` entries, a record each."""
    inserts = PendingInserts()
    for b, g, pos, h in entries:
        inserts.add([b], [g], pos, HASHES[h], 7)
    return inserts


def table(pool: TorchBlockPool) -> tuple[list[int], ...]:
    return (
        pool.heads.n.tolist(),
        pool.hnext.n.tolist(),
        pool.hk.n.tolist(),
        pool.src.n.tolist(),
        sorted(pool.dups),
    )


entries = st.lists(
    st.tuples(st.integers(0, GROUPS - 1), st.integers(0, 5), st.integers(0, 5)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(
    before=entries,
    batch=entries,
    blocks=st.permutations(list(range(1, NUM_BLOCKS))),
    sparse=st.booleans(),
)
def test_vectorised_inserts_link_the_chains_as_one_insert_after_another(
    before: list[tuple[int, int, int]],
    batch: list[tuple[int, int, int]],
    blocks: list[int],
    sparse: bool,
) -> None:
    """Entries (group, position, hash) cached one by one, then a batch of them in one
    ``chain_entries`` call on one pool and one by one on the other: the tables agree. With
    ``sparse`` the batch has one entry only per bucket (the fast path), else any."""
    pools = [TorchBlockPool(NUM_BLOCKS, GROUPS, enable_caching=True) for _ in range(2)]
    ids = iter(blocks)
    first = [(next(ids), g, pos, h) for g, pos, h in before[:20]]
    second = [(next(ids), g, pos, h) for g, pos, h in batch[:20]]
    if sparse:
        seen: set[int] = set()
        kept = []
        for entry in second:
            bucket = pools[0].bucket(hash_key(HASHES[entry[3]]), entry[1])
            if bucket not in seen:
                seen.add(bucket)
                kept.append(entry)
        second = kept
    for pool in pools:
        pool.chain_records(one_by_one(first))
    columns = np.array([(b, g, pos, 7, hash_key(HASHES[h])) for b, g, pos, h in second])
    pools[0].chain_entries(*(columns[:, i].astype(np.int64) for i in range(5)))
    pools[1].chain_records(one_by_one(second))
    for pool in pools:
        pool.settle_duplicates()
    assert table(pools[0]) == table(pools[1])
