"""``hybrid``: useless blocks first, interior windows next, chains and branch tails last.

Pinned on the design document's 10 full + 20 sliding-window layers in miniature (one full
group, two sliding-window groups of window 8, block 4), and checked against a brute-force
oracle after every operation of random traffic.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_oracle import RecordingHybrid, check_against_oracle
from policy_workload import (
    KV,
    OPS,
    Op,
    admit,
    chunked_config,
    document_config,
    mamba_config,
    run_ops,
    useless_cache,
)

from hybridkv.policies import CachedBlock, HybridPolicy, LRUPolicy
from hybridkv.policies.hybrid import INTERIOR, KEEP, NO_KEY, OTHER, USELESS
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import (
    FullAttentionSpec,
    MambaSpec,
)

A = list(range(24))
B = A[:12] + list(range(500, 512))  # shares a's first three blocks, then branches


def _two_branches(policy: HybridPolicy | LRUPolicy) -> KVCacheManager:
    """a (six blocks) and b (a's first three, then three of its own), both freed."""
    manager = KVCacheManager(document_config(41), max_model_len=64, eviction_policy=policy)
    a = admit(manager, "a", [*A, 7])
    b = admit(manager, "b", [*B, 7])
    assert a is not None
    assert b is not None
    manager.free(a)
    manager.free(b)
    return manager


def test_interior_window_blocks_go_before_chains_and_branch_tails() -> None:
    """Free blocks without a key first (the partial last blocks and the unused ones), then the
    sliding-window blocks no tail end reads (block 0 of the shared stem, and a's and b's block
    3: the hits ending at the branch point, block 2, read blocks 1 and 2; those at the branch
    ends read blocks 4 and 5), then the full chains and the windows before the branch point
    and the branch ends, least recently released first within a tier."""
    policy = HybridPolicy()
    manager = _two_branches(policy)
    order = list(policy.choose(manager.block_pool.num_free_blocks))
    tiers = policy.tiers()
    assert [tiers[b] for b in order] == [NO_KEY] * 13 + [INTERIOR] * 6 + [KEEP] * 21
    assert order[13:19] == [11, 8, 18, 15, 26, 30]
    assert order[19:] == [6, 5, 4, 13, 12, 20, 19, 24, 23, 22, 3, 2, 1, 28, 27, 10, 9, 32, 31,
                          17, 16]  # fmt: skip
    manager.check_invariants()


def test_without_tails_last_the_useful_blocks_keep_vllms_order() -> None:
    """With ``tails_last=False`` and no useless block, the order is exactly LRU's."""
    policy = HybridPolicy(tails_last=False)
    lru = LRUPolicy()
    managers = [_two_branches(policy), _two_branches(lru)]
    n = managers[0].block_pool.num_free_blocks
    assert list(policy.choose(n)) == list(lru.choose(n))
    assert sorted(set(policy.tiers().values())) == [NO_KEY, OTHER]


def test_the_branch_released_last_keeps_its_whole_hit() -> None:
    """c needs 24 new blocks: the 13 without a key, the 6 interior window blocks and 5 of the
    chains and windows released first (a's); b's branch, released last, still hits all 24
    tokens, a's none."""
    manager = _two_branches(HybridPolicy())
    assert admit(manager, "c", [*range(900, 928), 1]) is not None
    hits = [
        manager.get_computed_blocks(Request(rid, [*tokens, 3], hash_block_size=4))[1]
        for rid, tokens in (("a2", A), ("b2", B))
    ]
    assert hits == [0, 24]
    manager.check_invariants()


def _block(block_id: int, name: bytes, group: int, spec: object, parent: bytes | None,
           tokens: int) -> CachedBlock:  # fmt: skip
    return CachedBlock(block_id, name, group, spec, parent, tokens)  # type: ignore[arg-type]


def test_blocks_that_can_serve_no_hit_are_useless() -> None:
    """A full block whose parent key is gone, a window block no cached end reads, a chunk's
    last block (a hit at the chunk boundary reads nothing of it), a Mamba state at a prefix
    the full group does not hold, and a second holder of a key are all reused first."""
    policy = HybridPolicy()
    blocks = useless_cache()
    for block in blocks:
        policy.cached(block)
    policy.released([], list(range(1, 11)))
    assert policy.tiers() == {
        1: OTHER, 2: OTHER,  # the chain h1-h2, beside a Mamba group: with the states
        3: INTERIOR, 4: KEEP, 5: KEEP,  # the end at 12 reads blocks 1 and 2
        6: INTERIOR, 7: USELESS,  # the end at 4 reads block 0; block 1 ends the chunk
        8: OTHER, 9: USELESS,  # the full group holds h2 but not h3
        10: USELESS,  # h1 is served by block 1
    }  # fmt: skip
    policy.taken([1])  # h1's first holder goes: block 10 serves it now
    assert policy.tiers()[10] == OTHER
    policy.taken([10, 4])  # full h1 gone: h2's chain is broken; window h2 gone: h3 ends
    tiers = policy.tiers()  # no hit, and h1 is a branch end now
    assert (tiers[2], tiers[3], tiers[5], tiers[8]) == (USELESS, KEEP, USELESS, OTHER)
    assert policy.choose(3) == [2, 5, 7]


def test_without_duplicates_first_a_second_holder_ages_with_the_first() -> None:
    """``duplicates_first=False``: the second holder of h1 (block 10) is not singled out; it
    waits in tier 3 beside the first holder, the other useless blocks still go first."""
    policy = HybridPolicy(duplicates_first=False)
    for block in useless_cache():
        policy.cached(block)
    policy.released([], list(range(1, 11)))
    tiers = policy.tiers()
    assert (tiers[7], tiers[9], tiers[10]) == (USELESS, USELESS, OTHER)
    assert list(policy.choose(3)) == [7, 9, 3]  # then tier 2: an interior window block


def test_beside_a_mamba_group_chains_age_with_the_states() -> None:
    """A hit on full attention + Mamba needs the state at its end, so the chain is not kept
    past its states: released in order chain h1, state h1, chain h2, the three leave in that
    order (LRU within tier 3). A chain cached before the first Mamba block moves from tier 4
    to tier 3 when that block arrives."""
    full = FullAttentionSpec(**KV)
    mamba = MambaSpec(block_size=4, state_bytes=64, mamba_cache_mode="align")
    policy = HybridPolicy()
    policy.cached(_block(1, b"h1", 0, full, None, 4))
    policy.released([], [1])
    assert policy.tiers() == {1: KEEP}
    policy.cached(_block(2, b"h1", 1, mamba, None, 4))
    policy.cached(_block(3, b"h2", 0, full, b"h1", 8))
    assert policy.tiers() == {1: OTHER}
    policy.released([], [2, 3])
    assert policy.tiers() == {1: OTHER, 2: OTHER, 3: OTHER}
    assert policy.choose(3) == [1, 2, 3]


def _oracle(policy: RecordingHybrid) -> object:
    def check(manager: KVCacheManager) -> None:
        free = [block.block_id for block in manager.block_pool.free_block_queue]
        check_against_oracle(policy, free)

    return check


@settings(max_examples=60, deadline=None)
@given(ops=OPS, layout=st.sampled_from(["document", "chunked", "mamba"]))
def test_incremental_counts_agree_with_the_brute_force_after_every_operation(
    ops: list[Op], layout: str
) -> None:
    policy = RecordingHybrid()
    config = {"document": document_config(17), "chunked": chunked_config(21)}.get(layout)
    run_ops(config or mamba_config(21), policy, ops, _oracle(policy))  # type: ignore[arg-type]
