"""``arc``: T1 (cached once) before T2 (hit since) while T1 exceeds its target ``p``; a key
cached again after its eviction from T1 (a B1 ghost) raises ``p``."""

from __future__ import annotations

from policy_workload import KV, admit, document_config

from hybridkv.policies import ARCPolicy, CachedBlock
from hybridkv.reference import KVCacheManager
from hybridkv.spec import FullAttentionSpec

A = list(range(24))
B = A[:12] + list(range(500, 512))


def _two_branches(policy: ARCPolicy) -> KVCacheManager:
    manager = KVCacheManager(document_config(41), max_model_len=64, eviction_policy=policy)
    a = admit(manager, "a", [*A, 7])
    b = admit(manager, "b", [*B, 7])
    assert a is not None
    assert b is not None
    manager.free(a)
    manager.free(b)
    return manager


def test_blocks_cached_once_go_before_blocks_hit_since() -> None:
    """b's hit adopted a's first three full blocks and two window blocks per sliding-window
    group (the hit reads blocks 1 and 2): those 7 are in T2 and are reused last; the 13 free
    blocks without a key go first, then T1 least recently released first."""
    policy = ARCPolicy()
    manager = _two_branches(policy)
    assert policy.lists() == {"T1": 20, "T2": 7, "B1": 0, "B2": 0}
    order = list(policy.choose(manager.block_pool.num_free_blocks))
    assert order[:13] == [33, 29, 25, 21, 14, 7, 34, 35, 36, 37, 38, 39, 40]
    assert order[13:33] == [6, 5, 4, 13, 12, 11, 8, 20, 19, 18, 15, 24, 23, 22, 28, 27, 26,
                            32, 31, 30]  # fmt: skip
    assert order[33:] == [3, 2, 1, 10, 9, 17, 16]
    manager.check_invariants()


def test_a_key_cached_again_after_eviction_from_t1_raises_the_target() -> None:
    """c evicts 11 T1 blocks (11 ghosts in B1); a again re-caches 9 of those keys, each ghost
    hit raising p by one and joining T2."""
    policy = ARCPolicy()
    manager = _two_branches(policy)
    c = admit(manager, "c", [*range(900, 928), 1])
    assert c is not None
    manager.free(c)
    assert (policy.lists()["B1"], policy.target) == (11, 0)
    assert admit(manager, "a2", [*A, 8]) is not None
    assert policy.target == 9
    assert policy.lists() == {"T1": 21, "T2": 16, "B1": 11, "B2": 0}
    manager.check_invariants()


def test_t2_goes_first_once_t1_is_within_its_target() -> None:
    spec = FullAttentionSpec(**KV)
    policy = ARCPolicy()
    policy.released([1, 2, 3, 4], [])
    policy.cached(CachedBlock(1, b"k1", 0, spec, None, 4))
    policy.cached(CachedBlock(2, b"k2", 0, spec, None, 4))
    policy.touched([2])  # a hit: block 2 joins T2
    policy.released([], [2])
    assert list(policy.choose(4)) == [3, 4, 1, 2]  # no key, then T1 (|T1| = 1 > p = 0)
    policy.taken([3, 4, 1])  # k1 becomes a B1 ghost
    policy.cached(CachedBlock(3, b"k1", 0, spec, None, 4))  # ghost hit: p = 1, block 3 in T2
    policy.cached(CachedBlock(4, b"k9", 0, spec, None, 4))
    policy.released([], [3, 4])
    assert policy.target == 1
    assert policy.lists() == {"T1": 1, "T2": 2, "B1": 0, "B2": 0}
    assert list(policy.choose(3)) == [2, 3, 4]  # |T1| = 1 is not above p: T2 first
