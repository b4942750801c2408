"""``hybrid-arc``: blocks that can serve no hit first (``hybrid``'s tiers 0 and 1), then ARC's
order (T1, cached once, before T2, hit since, while T1 exceeds its target)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_workload import (
    OPS,
    Op,
    chunked_config,
    document_config,
    mamba_config,
    run_ops,
    useless_cache,
)

from hybridkv.policies import HybridARCPolicy
from hybridkv.policies.hybrid import USELESS
from hybridkv.reference import KVCacheManager


def test_useless_blocks_go_first_then_arcs_lists() -> None:
    """The cache of ``hybrid``'s own useless-block test: a chunk's last block (7), a Mamba
    state at a prefix the full group does not hold (9) and a second holder of a key (10) go
    first, least recently released first; then T1 in release order, and block 2, hit since
    (T2), last."""
    policy = HybridARCPolicy()
    blocks = useless_cache()
    for block in blocks:
        policy.cached(block)
    policy.released([], list(range(1, 11)))
    assert list(policy.choose(10)) == [7, 9, 10, 1, 2, 3, 4, 5, 6, 8]
    assert list(policy.choose(2)) == [7, 9]
    policy.touched([2])
    policy.released([], [2])
    assert list(policy.choose(10)) == [7, 9, 10, 1, 3, 4, 5, 6, 8, 2]
    policy.taken([7, 9])
    assert list(policy.choose(3)) == [10, 1, 3]


def test_without_duplicates_first_a_second_holder_takes_its_place_in_arcs_lists() -> None:
    """``duplicates_first=False``: block 10 (h1's second holder) leaves with T1 in release
    order instead of first (on the real trace's Jamba at 512 GiB this kept LRU's hits)."""
    policy = HybridARCPolicy(duplicates_first=False)
    for block in useless_cache():
        policy.cached(block)
    policy.released([], list(range(1, 11)))
    assert list(policy.choose(10)) == [7, 9, 1, 2, 3, 4, 5, 6, 8, 10]


@settings(max_examples=40, deadline=None)
@given(ops=OPS, layout=st.sampled_from(["document", "chunked", "mamba"]))
def test_its_order_is_hybrids_useless_blocks_then_arcs_after_every_operation(
    ops: list[Op], layout: str
) -> None:
    """Beside a ``hybrid`` and an ``arc`` hearing the same calls (through the pool of a second
    manager), every answer is their composition: useless blocks in ``hybrid``'s order, then the
    others in ARC's."""
    configs = {"document": document_config(17), "chunked": chunked_config(21)}
    config = configs.get(layout) or mamba_config(21)
    policy = HybridARCPolicy()

    def compare(manager: KVCacheManager) -> None:
        free = manager.num_free_blocks
        order = list(policy.choose(free))
        hybrid, arc = policy.hybrid, policy.arc
        useless = [b for b in hybrid.choose(free) if hybrid.tier(b) <= USELESS]
        assert order == useless + [b for b in arc.choose(free) if b not in set(useless)]
        assert len(set(order)) == free
        manager.check_invariants()

    run_ops(config, policy, ops, compare)
